"""Step 10's --zero 0|1|2|3 (zero_stages.py, zero3_on_mesh.py): the ZeRO stage over the dp x cp
plane. At dp only, --zero 0 is step 1 (PyTorch DDP) and --zero 2 is step 6 bitwise at 2 ranks, and
--zero 2 is step 6 at 4 ranks in the exact mode; with tp or pp, every stage is --zero 1's run
bitwise (the same sums), --zero 3 too (tp, pp, and cp at a plane of 4 in the exact mode); every
rank's params, grads, AdamW state (and ZeRO-3's gathered units) are the planner's for its stage
(compare/plan.py's measured rows); a checkpoint resumes at another stage bitwise, --zero 3's at
another plane too.

The runs are shared (module fixture ``zero_runs``; step 1's and the --zero 1 mesh runs are
conftest.py's ``mesh_runs``, step 6's exact-mode run its ``exact_run``): TINY, global batch 8
samples (16 in the exact mode).
"""

import json
import math

import pytest

import estimate  # compare/, on the path through conftest
import plan
from conftest import EXACT, MESH_RUNS, assert_bitwise_same_run, metrics, train

ACCUM = ("--grad-accum", "2")
# name: (step, ranks, flags)
RUNS = {
    "z0": ("step10", 2, ["--dp", "2", "--zero", "0", *ACCUM, "--save-every", "2"]),
    "z2": ("step10", 2, ["--dp", "2", "--zero", "2", *ACCUM, "--save-every", "2"]),
    "step6": ("step6", 2, [*ACCUM]),
    "z2tp": ("step10", 4, ["--dp", "2", "--tp", "2", "--zero", "2", *ACCUM]),
    "z0pp": ("step10", 4, ["--dp", "2", "--pp", "2", "--zero", "0", *ACCUM]),
    "z2exact": ("step10", 4, ["--dp", "4", "--zero", "2", *EXACT]),
    # --zero 3 (zero3_on_mesh.py), each with what a layout of the planner's adds: recomputation
    # (bitwise to none), gpipe (its last stage's root freed by the first backward, gathered again
    # for the second), cp in float64
    "z3tp": (
        "step10",
        4,
        ["--dp", "2", "--tp", "2", "--zero", "3", *ACCUM, "--save-every", "2"]
        + ["--activation-checkpointing", "selective"],
    ),
    "z3pp": (
        "step10",
        4,
        ["--dp", "2", "--pp", "2", "--zero", "3", *ACCUM, "--save-every", "2"]
        + ["--schedule", "gpipe", "--activation-checkpointing", "full"],
    ),
    "z3cp": ("step10", 4, ["--dp", "2", "--cp", "2", "--zero", "3", *EXACT]),
    # z3tp with AdamW on host copies of the pieces (step
    # 7's offload.py): on a CPU the same arithmetic
    "z3tpOff": (
        "step10",
        4,
        ["--dp", "2", "--tp", "2", "--zero", "3", *ACCUM, "--save-every", "2"]
        + ["--activation-checkpointing", "selective", "--offload-optimizer"],
    ),
    "z1cp": ("step10", 4, ["--dp", "2", "--cp", "2", *EXACT]),
    "z3exact2": ("step10", 2, ["--dp", "2", "--zero", "3", *EXACT]),
    # HSDP over a plane of each tp rank (rows of 1: two planes' rows and columns made), and over the
    # dp x cp plane (rows of 2, each ring's halves; the rows replicas)
    "z3tpR2": ("step10", 4, ["--dp", "2", "--tp", "2", "--zero", "3", "--replicate", "2", *ACCUM]),
    "z3cpR2": ("step10", 4, ["--dp", "2", "--cp", "2", "--zero", "3", "--replicate", "2", *EXACT]),
}


@pytest.fixture(scope="module")
def zero_runs(tmp_path_factory, small_corpus):
    done, top = {}, tmp_path_factory.mktemp("zero_stages")

    def run(name):
        if name not in done:
            step, nproc, flags = RUNS[name]
            done[name] = train(step, top / name, small_corpus, *flags, nproc=nproc)
        return done[name]

    def resume(saved, name: str, flags: list, nproc: int):
        """Step 10 with ``flags`` on ``nproc`` ranks from
        the step-2 checkpoint of run folder ``saved``."""
        step_2 = str(saved / "checkpoints" / "step_2")
        return train("step10", top / name, small_corpus, *flags, "--resume", step_2, nproc=nproc)

    run.top, run.resume = top, resume
    return run


def test_dp_only_zero0_is_step1_and_zero2_is_step6(zero_runs, mesh_runs):
    """2 ranks: --zero 0 (step 3's all-reduce, AdamW whole) is step 1, --zero 2 (reduce-scatter into
    ZeRO-1's slices) step 6, bitwise; at 2 ranks every sum is order-free, so both are step 1's (step
    6 is too)."""
    assert_bitwise_same_run(zero_runs("z0"), mesh_runs("step1"))
    assert_bitwise_same_run(zero_runs("z2"), zero_runs("step6"))
    assert_bitwise_same_run(zero_runs("z2"), mesh_runs("step1"))
    assert any(
        r["grad_norm"] > 0.3 for r in metrics(zero_runs("z2"))["records"]
    )  # clipping triggers


def test_zero2_at_4_ranks_is_step6_in_the_exact_mode(zero_runs, exact_run):
    """--dp 4 --zero 2 with the float64 reduction (bf16, dropout 0.1, clipping): step 6 at 4 ranks,
    bitwise. In float32 a 4-rank reduce-scatter and an all-reduce may add in other orders (step 6's
    tests: the same contract)."""
    assert_bitwise_same_run(zero_runs("z2exact"), exact_run("step6", 4))


@pytest.mark.parametrize(
    "ours, theirs", [("z2tp", "dp2tp2"), ("z0pp", "dp2pp2")], ids=["zero2-tp", "zero0-pp"]
)
def test_with_tp_or_pp_every_stage_is_zero1s_run(zero_runs, mesh_runs, ours, theirs):
    """dp 2 x tp 2 at --zero 2 and dp 2 x pp 2 at --zero 0: the --zero 1 run (test_3d_parallel.py's)
    bitwise. The gradients add the same two numbers, the norm's float64 squares round to the same
    float32, AdamW steps every element as it would whole; only where the gradient lives and who
    steps it change."""
    assert_bitwise_same_run(zero_runs(ours), mesh_runs(theirs))


def _stage_of(run) -> int:
    return metrics(run)["config"]["zero"]


@pytest.mark.parametrize("name", ["z0", "z2", "z2tp", "z0pp", "z2exact"])
def test_every_ranks_memory_and_traffic_is_the_planners(zero_runs, name):
    """Every rank's parameters and gradients are the planner's bytes for its stage
    (``plan.measured_rows``, ZeRO 0 or 2 read from the run), to the byte: at --zero 2 the gradient
    is this rank's ceil(Ψ/N) slice, and the whole gradient the micro-batches accumulated before the
    reduce-scatter freed it is 4Ψ (the planner's ``accumulated``). AdamW's state is the planner's up
    to its per-tensor step counts and the last slice's padding. The data axis sends what the planner
    counts: stage 0 an all-reduce, stage 2 a reduce-scatter of the padded flat gradient and
    an all-gather."""
    run = metrics(zero_runs(name))
    zero, reduce_bytes = _stage_of(zero_runs(name)), 8 if "z2exact" == name else 4
    rows = plan.measured_rows(run, estimate.vocabulary_size(run["config"]["tokenizer"]))
    record = run["records"][-1]
    assert len(rows) == len(record["memory"]) == len(record["comm"])
    for row, memory, comm in zip(rows, record["memory"], record["comm"]):
        replicas = row["dp"]
        assert row["zero"] == zero and replicas > 1, row
        measured, estimated = row["measured"], row["estimated"]
        assert measured["params"] == estimated["params"], (name, row)
        assert measured["grads"] == estimated["grads"], (name, row)
        # step counts (4 bytes a piece), and the last slice short of ceil(Ψ/N) by the padding
        slack = measured["optimizer_state"] - estimated["optimizer_state"]
        assert -8 * (replicas - 1) <= slack <= 4 * 64, (name, row)
        psi = estimated["params"] // 4
        if zero == 2:
            assert memory["accumulated_grads"] == 4 * psi, (name, memory)
            shard = -(-psi // replicas)
            assert comm["dp"] == {
                "reduce_scatter": reduce_bytes * shard * replicas,
                "all_gather": 4 * shard * replicas,
            }, (name, comm)
        else:
            assert "accumulated_grads" not in memory
            assert comm["dp"] == {"all_reduce": 4 * psi}, (name, comm)


@pytest.mark.parametrize("saved, resumed", [("z2", "z0"), ("z0", "z2")])
def test_a_checkpoint_resumes_at_another_stage_bitwise(zero_runs, saved, resumed):
    """The checkpoint is by name, whatever the stage (composition.py's rule 4): --zero 2's step-2
    checkpoint resumed at --zero 0 continues as the uninterrupted --zero 0 run, bit for bit, and
    --zero 0's at --zero 2."""
    _, nproc, flags = RUNS[resumed]
    out = zero_runs.resume(zero_runs(saved), f"{saved}_at_{resumed}", flags, nproc)
    assert_bitwise_same_run(out, zero_runs(resumed))
    assert metrics(out)["config"]["zero"] == _stage_of(zero_runs(resumed))
    assert (
        metrics(out)["records"][:2] == metrics(zero_runs(saved))["records"][:2]
    )  # the checkpoint's own


# ---- --zero 3: step 7's FullyShardedDP on each rank's tp/pp stage, over dp x cp (zero3_on_mesh.py)


@pytest.mark.parametrize(
    "ours, theirs",
    [("z3tp", "dp2tp2"), ("z3pp", "dp2pp2"), ("z3tpR2", "dp2tp2")],
    ids=["zero3-tp", "zero3-pp", "hsdp-tp"],
)
def test_zero3_with_tp_or_pp_is_zero1s_run(zero_runs, mesh_runs, ours, theirs):
    """dp 2 x tp 2 and dp 2 x pp 2 at --zero 3: the --zero 1 run bitwise (losses, gradient norms,
    parameter norms, final weights). A reduce-scatter adds each element's two numbers as the
    all-reduce does; the norm adds every element once, from pieces over dp, shards over tp, the
    replicated LayerNorms on tp rank 0 and the tie on the first stage, and clipping triggers; the
    tie crosses the pipeline as averaged slices. With selective and full recomputation and gpipe,
    which change nothing computed. HSDP at dp 2 x tp 2 with --replicate 2 (rows of one rank, every
    tp rank's plane its own rows and columns): each piece's two numbers added across the
    rows instead."""
    assert_bitwise_same_run(zero_runs(ours), mesh_runs(theirs))
    assert any(r["grad_norm"] > 0.3 for r in metrics(zero_runs(ours))["records"])


def test_zero3_over_a_plane_of_4_is_zero1s_run_in_the_exact_mode(zero_runs):
    """dp 2 x cp 2 (ZeRO-3 over 4 ranks, each ring's two halves replicas) with the float64
    reduction, bf16, dropout and clipping: the --zero 1 run bitwise. In float32 a 4-rank
    reduce-scatter and an all-reduce may add in other orders (the contract of steps 6 and 7). With
    --replicate 2 (HSDP: sharded over rows of 2, the rows reduced across), the same run too: float64
    sums, one division (hsdp.py's rule 3)."""
    assert_bitwise_same_run(zero_runs("z3cp"), zero_runs("z1cp"))
    assert_bitwise_same_run(zero_runs("z3cpR2"), zero_runs("z1cp"))
    assert metrics(zero_runs("z3cpR2"))["config"]["replicate"] == 2


def _planned(run: dict, offload: bool = False) -> dict:
    """compare/plan.py's configuration of ``run``'s layout at ZeRO-3: its stages' bytes per rank."""
    config, mesh = run["config"], plan.layout_of(run)
    shape = plan.Shape(
        config["n_layer"],
        config["n_embd"],
        config["n_head"],
        estimate.vocabulary_size(config["tokenizer"]),
        config["seq_len"],
    )
    b, m = config["micro_batch_size"], config["micro_batches"] or config["grad_accum"]
    return plan.configuration(
        shape,
        mesh["dp"],
        mesh["tp"],
        mesh["pp"],
        3,
        False,
        b,
        m,
        plan.Activations(shape, b),
        schedule=config["schedule"],
        replicate=config["replicate"],
        offload=offload,
    )


@pytest.mark.parametrize("name", ["z3tp", "z3pp", "z3cp", "z3cpR2"])
def test_zero3_memory_per_rank_is_the_planners(zero_runs, name):
    """Every rank's parameters and gradients are the planner's ZeRO-3 bytes for its stage (4
    ceil(Ψ/N) each, Ψ its tp/pp share, N = dp x cp, or a row's dp x cp / R with --replicate R) to
    the byte, AdamW's state 8 ceil(Ψ/N) and a 4-byte step count a piece, the units gathered at once
    (the root and two blocks, or the blocks a stage has) and the whole gradient the micro-batches
    accumulated before the last one's backward reduce-scattered it: the plan's ``gathered`` and
    ``accumulated``, to the byte. The reduce-scatter sends Ψ once a step in the reduction's dtype
    (the plan's float32, twice in float64); the all-gathers at least the plan's M (2 Ψ_blocks +
    Ψ_rest) (a pipeline's end stages gather their small units, the positions or the final norm, in
    backward too)."""
    run = metrics(zero_runs(name))
    # AdamW's step counts: one a piece, a piece of every
    # tensor a stage holds (GPT-2's 16 a block, 5 more at most)
    planned, pieces = _planned(run), 16 * run["config"]["n_layer"] + 5
    rows = plan.measured_rows(run, estimate.vocabulary_size(run["config"]["tokenizer"]))
    record = run["records"][-1]
    for row, memory, comm in zip(rows, record["memory"], record["comm"]):
        stage = planned["stages"][row["stage"]]
        assert row["zero"] == 3 and row["dp"] == 2 * (1 + (name in ("z3cp", "z3cpR2"))), row
        measured, estimated = row["measured"], row["estimated"]
        assert (measured["params"], measured["grads"]) == (stage["params"], stage["grads"]), row
        assert (estimated["params"], estimated["grads"]) == (stage["params"], stage["grads"]), row
        assert 0 < measured["optimizer_state"] - stage["optimizer_state"] <= 4 * pieces, row
        assert memory["gathered_peak"] == stage["gathered"], (name, memory, stage)
        assert memory["accumulated_grads"] == stage["accumulated"], (name, memory, stage)
        wide = 2 if run["config"]["reduce_dtype"] == "float64" else 1  # the plan's float32 gradient
        assert comm["dp"]["reduce_scatter"] == wide * stage["comm"]["dp"]["reduce_scatter"], comm
        assert comm["dp"]["all_gather"] >= stage["comm"]["dp"]["all_gather"], (name, comm)
        if run["config"]["pp"] == 1:  # the root once a micro-batch, every block twice: the plan's
            assert comm["dp"]["all_gather"] == stage["comm"]["dp"]["all_gather"], (name, comm)


@pytest.mark.parametrize("name", ["z3tp", "z3pp"], ids=["zero3-tp", "zero3-pp"])
def test_a_zero3_checkpoint_is_every_ranks_own_pieces(zero_runs, name):
    """zero3_on_mesh_state.py's rule 1: every rank of dp 2 x tp 2 (and of dp 2 x pp 2) writes its
    own pieces of the parameters and of AdamW's moments, no gather to dp rank 0; their boxes tile
    every tensor exactly once (the tie's copy on the last stage not written: the first stage's
    pieces are the tensor)."""
    from torch.distributed.checkpoint import FileSystemReader

    checkpoint = zero_runs(name) / "checkpoints" / "step_2"
    stored = FileSystemReader(checkpoint).read_metadata()
    written = {}  # each rank's file: the boxes of the model and of its moments it holds
    for index, info in stored.storage_data.items():
        if index.fqn.startswith("model.") or index.fqn.endswith(".exp_avg"):
            written.setdefault(info.relative_path, set()).add((index.fqn, tuple(index.offset)))
    assert sorted(written) == [f"__{r}_0.distcp" for r in range(4)], sorted(written)
    assert all(written[a] != written[b] for a in written for b in written if a != b)
    names = json.loads((checkpoint / "meta.json").read_text())["shapes"]
    tiled = [
        f for f in stored.state_dict_metadata if f.startswith("model.") or f.endswith(".exp_avg")
    ]
    assert sorted(tiled) == sorted(
        [f"model.{n}" for n in names] + [f"optim.state.{n}.exp_avg" for n in names]
    )
    for fqn in tiled:
        saved = stored.state_dict_metadata[fqn]
        assert sum(math.prod(c.sizes) for c in saved.chunks) == math.prod(saved.size), fqn


@pytest.mark.parametrize(
    "saved, resumed",
    [
        ("z3tp", "dp2tp2"),
        ("dp2pp2", "z3pp"),
        ("z3pp", "dp2pp2"),
        ("z3cpR2", "z1cp"),
        ("z3tpOff", "dp2tp2"),
        ("dp2tp2", "z3tpOff"),
    ],
    ids=[
        "zero3-to-zero1",
        "zero1-to-zero3",
        "zero3-pp-to-zero1",
        "hsdp-to-zero1",
        "offloaded-to-zero1",
        "zero1-to-offloaded",
    ],
)
def test_a_zero3_checkpoint_resumes_at_zero1_and_back_bitwise(zero_runs, mesh_runs, saved, resumed):
    """--zero 3's checkpoint is by name, each rank's pieces boxes of the whole tensors
    (zero3_on_mesh_state.py): dp 2 x tp 2's at step 2 resumed at --zero 1 continues as the
    uninterrupted --zero 1 run, bit for bit, and so does dp 2 x pp 2's (the tie read from the first
    stage's pieces); dp 2 x pp 2's --zero 1 checkpoint resumed at --zero 3 (each rank reading its
    pieces out of the saved slices) as the --zero 3 run; dp 2 x cp 2's HSDP checkpoint (each row's
    ranks their pieces, the rows the same ones, written once) at --zero 1 as the --zero 1 run; and
    dp 2 x tp 2's with AdamW offloaded as the --zero 1 run, and back (the host copies refreshed from
    the pieces read)."""

    def run(name):
        return zero_runs(name) if name in RUNS else mesh_runs(name)

    _, nproc, flags = RUNS[resumed] if resumed in RUNS else MESH_RUNS[resumed]
    out = zero_runs.resume(run(saved), f"{saved}_at_{resumed}", flags, nproc)
    stage = metrics(out)["config"]["zero"]
    assert stage == metrics(run(resumed))["config"]["zero"] != metrics(run(saved))["config"]["zero"]
    assert_bitwise_same_run(out, run(resumed))


def test_a_zero3_checkpoint_resumes_at_another_plane_bitwise(zero_runs):
    """Pieces cut for a plane of 2 read back into pieces for a plane of 4: dp 2's --zero 3
    checkpoint at step 2, resumed at --dp 4 --zero 3 (each rank copying its new pieces out of the
    saved ones), continues bit for bit as the same checkpoint resumed at --dp 4 --zero 2 (ZeRO-1's
    slices: another reader), in the exact mode (float64 reduction: the same sums at either stage).
    No uninterrupted run compares: another dp takes other samples."""
    resumed = {
        stage: zero_runs.resume(
            zero_runs("z3exact2"),
            f"z3exact2_at_dp4_zero{stage}",
            ["--dp", "4", "--zero", stage, *EXACT, "--grad-accum", "1"],  # the saved global batch
            4,
        )
        for stage in ("3", "2")
    }
    for stage, out in resumed.items():
        config = metrics(out)["config"]
        assert (config["zero"], config["dp"]) == (int(stage), 4)
        assert config["resume"].endswith("step_2")
    assert_bitwise_same_run(resumed["3"], resumed["2"])
    saved = [r["loss"] for r in metrics(zero_runs("z3exact2"))["records"]]
    after = [r["loss"] for r in metrics(resumed["3"])["records"]]
    assert (
        after[:2] == saved[:2] and after[2:] != saved[2:]
    )  # the saved steps, then dp 4's own samples


def test_zero3_offloaded_on_the_mesh_is_the_same_run_with_its_state_on_the_host(zero_runs):
    """--offload-optimizer at dp 2 x tp 2 (step 7's OffloadedOptimizer over the pieces): on a CPU
    AdamW does the same arithmetic on the host copies, so the run is --zero 3's without it bitwise;
    every rank's host holds the float32 copies and the moments, the planner's offloaded row (12Ψ/N
    on the host, within its padding and step counters), and the device the pieces and their
    gradients, the row's to the byte."""
    assert_bitwise_same_run(zero_runs("z3tpOff"), zero_runs("z3tp"))
    run = metrics(zero_runs("z3tpOff"))
    planned = _planned(run, offload=True)
    rows = plan.measured_rows(run, estimate.vocabulary_size(run["config"]["tokenizer"]))
    for row, memory in zip(rows, run["records"][-1]["memory"]):
        stage = planned["stages"][row["stage"]]
        assert stage["optimizer_state"] == 0 < stage["host"], stage
        assert (memory["params"], memory["grads"]) == (stage["params"], stage["grads"]), row
        assert memory["host"] == memory["params"] + memory["optimizer_state"]  # copies + moments
        assert memory["host"] == pytest.approx(stage["host"], rel=1e-3), (memory, stage)
