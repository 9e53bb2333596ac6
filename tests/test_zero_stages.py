"""Step 10's --zero 0|1|2 (zero_stages.py): the ZeRO stage over the dp x cp plane. At dp only, --zero 0 is step 1
(PyTorch DDP) and --zero 2 is step 6 bitwise at 2 ranks, and --zero 2 is step 6 at 4 ranks in the exact mode; with
tp or pp, both are --zero 1's run bitwise (the same sums); every rank's params, grads and AdamW state are the
planner's for its stage (compare/plan.py's measured rows); a checkpoint resumes at another stage bitwise.

The runs are shared (module fixture ``zero_runs``; step 1's and the --zero 1 mesh runs are conftest.py's
``mesh_runs``, step 6's exact-mode run its ``exact_run``): TINY, global batch 8 samples (16 in the exact mode).
"""

import pytest

import estimate  # compare/, on the path through conftest
import plan
from conftest import EXACT, assert_bitwise_same_run, metrics, train

ACCUM = ("--grad-accum", "2")
# name: (step, ranks, flags)
RUNS = {
    "z0": ("step10", 2, ["--dp", "2", "--zero", "0", *ACCUM, "--save-every", "2"]),
    "z2": ("step10", 2, ["--dp", "2", "--zero", "2", *ACCUM, "--save-every", "2"]),
    "step6": ("step6", 2, [*ACCUM]),
    "z2tp": ("step10", 4, ["--dp", "2", "--tp", "2", "--zero", "2", *ACCUM]),
    "z0pp": ("step10", 4, ["--dp", "2", "--pp", "2", "--zero", "0", *ACCUM]),
    "z2exact": ("step10", 4, ["--dp", "4", "--zero", "2", *EXACT]),
}


@pytest.fixture(scope="module")
def zero_runs(tmp_path_factory, small_corpus):
    done, top = {}, tmp_path_factory.mktemp("zero_stages")

    def run(name):
        if name not in done:
            step, nproc, flags = RUNS[name]
            done[name] = train(step, top / name, small_corpus, *flags, nproc=nproc)
        return done[name]

    run.top, run.corpus = top, small_corpus
    return run


def test_dp_only_zero0_is_step1_and_zero2_is_step6(zero_runs, mesh_runs):
    """2 ranks: --zero 0 (step 3's all-reduce, AdamW whole) is step 1, --zero 2 (reduce-scatter into ZeRO-1's
    slices) step 6, bitwise; at 2 ranks every sum is order-free, so both are step 1's (step 6 is too)."""
    assert_bitwise_same_run(zero_runs("z0"), mesh_runs("step1"))
    assert_bitwise_same_run(zero_runs("z2"), zero_runs("step6"))
    assert_bitwise_same_run(zero_runs("z2"), mesh_runs("step1"))
    assert any(
        r["grad_norm"] > 0.3 for r in metrics(zero_runs("z2"))["records"]
    )  # clipping triggers


def test_zero2_at_4_ranks_is_step6_in_the_exact_mode(zero_runs, exact_run):
    """--dp 4 --zero 2 with the float64 reduction (bf16, dropout 0.1, clipping): step 6 at 4 ranks, bitwise. In
    float32 a 4-rank reduce-scatter and an all-reduce may add in other orders (step 6's tests: the same contract)."""
    assert_bitwise_same_run(zero_runs("z2exact"), exact_run("step6", 4))


@pytest.mark.parametrize(
    "ours, theirs", [("z2tp", "dp2tp2"), ("z0pp", "dp2pp2")], ids=["zero2-tp", "zero0-pp"]
)
def test_with_tp_or_pp_every_stage_is_zero1s_run(zero_runs, mesh_runs, ours, theirs):
    """dp 2 x tp 2 at --zero 2 and dp 2 x pp 2 at --zero 0: the --zero 1 run (test_3d_parallel.py's) bitwise. The
    gradients add the same two numbers, the norm's float64 squares round to the same float32, AdamW steps every
    element as it would whole; only where the gradient lives and who steps it change."""
    assert_bitwise_same_run(zero_runs(ours), mesh_runs(theirs))


def _stage_of(run) -> int:
    return metrics(run)["config"]["zero"]


@pytest.mark.parametrize("name", ["z0", "z2", "z2tp", "z0pp", "z2exact"])
def test_every_ranks_memory_and_traffic_is_the_planners(zero_runs, name):
    """Every rank's parameters and gradients are the planner's bytes for its stage (``plan.measured_rows``, ZeRO 0
    or 2 read from the run), to the byte: at --zero 2 the gradient is this rank's ceil(Ψ/N) slice, and the whole
    gradient the micro-batches accumulated before the reduce-scatter freed it is 4Ψ (the planner's ``accumulated``).
    AdamW's state is the planner's up to its per-tensor step counts and the last slice's padding. The data axis
    sends what the planner counts: stage 0 an all-reduce, stage 2 a reduce-scatter of the padded flat gradient
    and an all-gather."""
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
    """The checkpoint is by name, whatever the stage (composition.py's rule 4): --zero 2's step-2 checkpoint
    resumed at --zero 0 continues as the uninterrupted --zero 0 run, bit for bit, and --zero 0's at --zero 2."""
    _, nproc, flags = RUNS[resumed]
    out = train(
        "step10",
        zero_runs.top / f"{saved}_at_{resumed}",
        zero_runs.corpus,
        *flags,
        "--resume",
        str(zero_runs(saved) / "checkpoints" / "step_2"),
        nproc=nproc,
    )
    assert_bitwise_same_run(out, zero_runs(resumed))
    assert metrics(out)["config"]["zero"] == _stage_of(zero_runs(resumed))
    assert (
        metrics(out)["records"][:2] == metrics(zero_runs(saved))["records"][:2]
    )  # the checkpoint's own
