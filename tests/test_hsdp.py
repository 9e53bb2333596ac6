"""Step 7's HSDP (``--replicate R``, step7_zero3/hsdp.py) at 4 ranks, R = 2: its groups are
``init_device_mesh``'s; a toy in spawned processes trains bitwise like FSDP2's ``fully_shard`` on
the (replicate, shard) mesh and like one process averaging in float64; the trainer is bitwise
compare/fsdp2_reference.py --replicate 2 (float32 and bf16 parameters) and, in the exact mode, step
1 (DDP) at 4 ranks; bytes per rank and per collective are the closed form with N / R = 2 in place of
N; a checkpoint resumes bitwise at R = 2 and at R = 1.

Runs are shared between the tests (module fixtures);
the exact-mode step 1 run is conftest's ``exact_run``.
"""

import math
import sys

import pytest
import torch
import torch.distributed as dist

import exact_sums  # common/, on the path through conftest
from conftest import (
    EXACT,
    REPO,
    TIMEOUT,
    TINY,
    assert_bitwise_same_run,
    init_gloo,
    metrics,
    parity,
    run_forked,
    run_ranks,
    spawn,
    train,
    weights,
)
from test_zero3 import (
    ACCUM,
    CONFIG,
    STEPS,
    Toy,
    batch,
    full_state_dict,
    init_fn,
    loss_of,
    memory_tool,
    units_of,
)

STEP7 = REPO / "step7_zero3"
R, N = 2, 4
S = N // R  # ranks per shard group (a row)
HSDP = ("--replicate", str(R))


# ---- The idea file the way an outsider uses it: a toy, our groups and FSDP2's --------------------


def _toy_worker(rank, world_size, port, queue):
    sys.path.insert(0, str(STEP7))
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hsdp import hybrid_mesh
    from training import adamw_options, adamw_param_groups
    from zero3 import FullyShardedDP

    init_gloo(rank, world_size, port)
    results = {}
    mesh = hybrid_mesh(R)
    theirs = init_device_mesh("cpu", (R, S), mesh_dim_names=("replicate", "shard"))
    results["groups"] = [
        (
            dist.get_process_group_ranks(mesh.shard_group),
            dist.get_process_group_ranks(theirs.get_group("shard")),
        ),
        (
            dist.get_process_group_ranks(mesh.replicate_group),
            dist.get_process_group_ranks(theirs.get_group("replicate")),
        ),
    ]
    results["coordinates"] = (
        (mesh.replicate_rank, mesh.shard_rank),
        (theirs.get_local_rank("replicate"), theirs.get_local_rank("shard")),
    )

    def trained(reduce_dtype) -> dict:
        with torch.device("meta"):
            model = Toy()
        ours = FullyShardedDP(
            model, units_of(model), init_fn=init_fn, reduce_dtype=reduce_dtype, mesh=mesh
        )
        optimizer = torch.optim.AdamW(
            adamw_param_groups(model.named_parameters(), CONFIG), **adamw_options(CONFIG)
        )
        for step in range(STEPS):
            for micro in range(ACCUM):
                with ours.no_sync() if micro < ACCUM - 1 else torch.enable_grad():
                    loss_of(ours, batch(step, micro, rank)).backward()
            ours.finish_gradient_synchronization()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        results.setdefault("shard sizes", []).append([len(u.shard) for u in ours.units])
        results.setdefault("padded", []).append([u.padded for u in ours.units])
        return full_state_dict(ours)

    # FSDP2 on the 2-D mesh, float32 gradients (ReduceOp.AVG in both groups), the same units
    fsdp2 = Toy()
    with torch.no_grad():
        for name, p in fsdp2.named_parameters():
            p.copy_(init_fn(name, p.shape))
        fsdp2.temperature.fill_(2.0)
    # inner before its block: FSDP2 wants the nested one first
    for unit in reversed(units_of(fsdp2)):
        fully_shard(unit, mesh=theirs)
    fully_shard(fsdp2, mesh=theirs)
    optimizer = torch.optim.AdamW(
        adamw_param_groups(fsdp2.named_parameters(), CONFIG), **adamw_options(CONFIG)
    )
    for step in range(STEPS):
        for micro in range(ACCUM):
            fsdp2.set_requires_gradient_sync(micro == ACCUM - 1)
            loss_of(fsdp2, batch(step, micro, rank)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    theirs_full = {name: p.full_tensor() for name, p in fsdp2.named_parameters()}
    ours_full = trained(torch.float32)
    results["unlike fsdp2"] = [
        n for n in theirs_full if not torch.equal(theirs_full[n], ours_full[n])
    ]

    # One process, every rank's gradient averaged in float64 and rounded once: the exact mode
    ref = Toy()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(init_fn(name, p.shape))
        ref.temperature.fill_(2.0)
    ref_optimizer = torch.optim.AdamW(
        adamw_param_groups(ref.named_parameters(), CONFIG), **adamw_options(CONFIG)
    )
    for step in range(STEPS):
        grads = []
        for r in range(world_size):
            ref.zero_grad()
            for micro in range(ACCUM):
                loss_of(ref, batch(step, micro, r)).backward()
            grads.append([p.grad.clone() for p in ref.parameters()])
        for i, p in enumerate(ref.parameters()):
            p.grad = (sum(g[i].double() for g in grads) / world_size).float()
        ref_optimizer.step()
    exact = trained(torch.float64)
    results["unlike one process"] = [
        n for n, p in ref.named_parameters() if not torch.equal(exact[n], p)
    ]
    queue.put((rank, results))
    del fsdp2, optimizer, theirs_full
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def toy():
    return spawn(_toy_worker, N, timeout=240)


def test_toy_groups_are_init_device_mesh_rows_and_columns(toy):
    """Rank r: shard group = its row of arange(4).view(2,
    2), replicate group = its column, as FSDP2's mesh."""
    for rank, result in toy.items():
        (ours_shard, theirs_shard), (ours_rep, theirs_rep) = result["groups"]
        assert ours_shard == theirs_shard == [rank // S * S + i for i in range(S)]
        assert ours_rep == theirs_rep == [rank % S + S * i for i in range(R)]
        assert result["coordinates"][0] == result["coordinates"][1] == (rank // S, rank % S)


def test_toy_trains_bitwise_like_fsdp2_on_a_2d_mesh_and_like_one_process(toy):
    for rank, result in toy.items():
        assert result["unlike fsdp2"] == [], (rank, result["unlike fsdp2"])
        assert result["unlike one process"] == [], (rank, result["unlike one process"])
        # each unit cut in S shards (padded to a multiple of S), not N
        for sizes, padded in zip(result["shard sizes"], result["padded"]):
            assert [p % S for p in padded] == [0] * len(padded) and sizes == [
                p // S for p in padded
            ]
            assert any(p % N for p in padded), (
                "the toy's sizes should show the padding is to S, not N"
            )


# ---- The trainer ---------------------------------------------------------------------------------


def fsdp2_reference(out, corpus, *extra):
    result = run_ranks(
        REPO / "compare" / "fsdp2_reference.py",
        [*TINY, "--data", str(corpus), "--out", str(out), *extra, *TIMEOUT],
        nproc=N,
        timeout=300,
    )
    assert result.returncode == 0, (
        f"fsdp2_reference failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    )
    return out


@pytest.fixture(scope="module", params=[(), ("--param-dtype", "bf16")], ids=["float32", "bf16"])
def fsdp2_pair(request, tmp_path_factory, small_corpus):
    top = tmp_path_factory.mktemp("hsdp_fsdp2")
    return (
        train("step7", top / "step7", small_corpus, *HSDP, *request.param, nproc=N),
        fsdp2_reference(top / "fsdp2", small_corpus, *HSDP, *request.param),
    )


@pytest.fixture(scope="module")
def exact_pair(exact_run, tmp_path_factory, small_corpus):
    """Exact mode (float64 sums, bf16 autocast, dropout,
    clipping, checkpoints every 2 steps) at 4 ranks."""
    return exact_run("step1", N), train(
        "step7",
        tmp_path_factory.mktemp("hsdp_exact") / "step7",
        small_corpus,
        *EXACT,
        *HSDP,
        nproc=N,
    )


def test_trainer_is_bitwise_fsdp2_on_the_replicate_shard_mesh(fsdp2_pair):
    step7, fsdp2 = fsdp2_pair
    result = parity(fsdp2, step7)
    assert "verdict: PASS (bitwise identical)" in result.stdout, result.stdout
    assert metrics(step7)["config"]["replicate"] == metrics(fsdp2)["config"]["replicate"] == R


def test_trainer_with_offload_is_bitwise_fsdp2_cpu_offload_on_the_mesh(tmp_path, small_corpus):
    """--offload-optimizer with --replicate:
    AdamW on host copies of the row's shards, as FSDP2's CPUOffloadPolicy."""
    flags = (*HSDP, "--offload-optimizer", "--steps", "3")
    step7 = train("step7", tmp_path / "step7", small_corpus, *flags, nproc=N)
    result = parity(fsdp2_reference(tmp_path / "fsdp2", small_corpus, *flags), step7)
    assert "verdict: PASS (bitwise identical)" in result.stdout, result.stdout


def test_trainer_exact_mode_is_bitwise_ddp_at_4_ranks(exact_pair):
    step1, step7 = exact_pair
    result = parity(step1, step7)
    assert "verdict: PASS (bitwise identical)" in result.stdout, result.stdout
    assert metrics(step7)["final"]["sha256"] == metrics(step1)["final"]["sha256"]


def unit_sizes(run) -> list[int]:
    """Elements per unit: the root (every parameter outside the blocks; the tied output layer is the
    embedding), then each block."""
    final = weights(run)
    blocks = metrics(run)["config"]["n_layer"]
    root = sum(t.numel() for n, t in final.items() if not n.startswith("transformer.h."))
    return [root] + [
        sum(t.numel() for n, t in final.items() if n.startswith(f"transformer.h.{i}."))
        for i in range(blocks)
    ]


def padded(numel: int) -> int:
    return -(-numel // S) * S  # a unit is cut in S shards: padded to a multiple of S


def test_trainer_bytes_per_rank_are_the_formula_with_n_over_r(fsdp2_pair, exact_pair):
    """Parameters and gradients: 4 bytes x (the padded units / S) on every rank, exactly; AdamW's
    state 8 per element held (within 2%: its step counters). A rank holds what ZeRO-3 over S ranks
    holds: Psi / (N / R)."""
    for run in (fsdp2_pair[0], exact_pair[1]):
        held = sum(padded(n) for n in unit_sizes(run)) // S
        psi = sum(unit_sizes(run))
        for rank, measured in enumerate(metrics(run)["records"][-1]["memory"]):
            assert measured["params"] == 4 * held, (rank, measured["params"], 4 * held)
            assert measured["grads"] == 4 * held, (rank, measured["grads"], 4 * held)
            assert abs(measured["optimizer_state"] / (8 * psi / S) - 1) < 0.02, (
                rank,
                measured["optimizer_state"],
            )


def test_memory_tool_checks_an_hsdp_run_against_n_over_r(exact_pair):
    """compare/memory.py --check reads --replicate:
    the formula's N is the row's 2 ranks, not the job's 4."""
    result = memory_tool(exact_pair[1], "--check")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ZeRO-3, N = 2 (HSDP: 4 ranks, 2 replicas of 2)" in result.stdout, result.stdout
    assert "every rank within 2% of the formula: yes" in result.stdout


def test_planner_reads_an_hsdp_run_as_zero3_over_a_row(exact_pair):
    """compare/plan.py --measured:
    the run's model state against ZeRO-3 over dp / R, every rank within 5%."""
    result = run_forked(
        [sys.executable, str(REPO / "compare" / "plan.py"), "--measured", str(exact_pair[1])],
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("4 x 1 x 1, ZeRO-3 (HSDP 2 x 2)") == N, result.stdout
    assert result.stdout.rstrip().endswith("within 5% of the estimate: yes"), result.stdout


def test_trainer_communication_is_the_closed_form(fsdp2_pair, exact_pair):
    """Per optimiser step, per rank: all-gathers in the shard group, every unit in each forward and
    every block in each backward (4 bytes, 2 with bf16 parameters); the reduce-scatter in the shard
    group, every unit padded to S, once (gradient bytes: 4, 8 in the exact mode); the all-reduce
    across the replicas, its 1/S shard, plus the norms' small all-reduces (the exact parameter
    norm's parts, one float64 for clipping)."""
    small = exact_sums.square_sum_parts([torch.zeros(1)]).numel() * 8 + 8
    for run in (fsdp2_pair[0], exact_pair[1]):
        config = metrics(run)["config"]
        units = [padded(n) for n in unit_sizes(run)]
        param_bytes = 2 if config["param_dtype"] == "bf16" else 4
        grad_bytes = 8 if config["reduce_dtype"] == "float64" else 4
        for r in metrics(run)["records"]:
            assert r["comm"] == {
                "all_gather": param_bytes * config["grad_accum"] * (2 * sum(units) - units[0]),
                "reduce_scatter": grad_bytes * sum(units),
                "all_reduce": grad_bytes * sum(units) // S + small,
            }, r["comm"]


@pytest.mark.parametrize("replicate", [R, 1, N], ids=["same layout", "R=1", "R=4"])
def test_trainer_resumes_bitwise_at_the_same_and_another_layout(
    exact_pair, replicate, tmp_path, small_corpus
):
    """Every rank gives DCP its pieces (replicas the same boxes, which DCP writes once: different
    ones would overlap, and DCP refuses a plan whose boxes overlap); resumed at R = 2, at R = 1
    (sharded over all 4: each rank reads its elements out of the saved boxes) or at R = 4 (rows of
    one rank: every rank whole, as DDP), the exact mode gives the same bits."""
    from torch.distributed.checkpoint import FileSystemReader

    _, step7 = exact_pair
    checkpoint = step7 / "checkpoints" / "step_2"
    stored = FileSystemReader(checkpoint).read_metadata()
    written = {}  # each rank's file: the model's boxes it holds
    for index, info in stored.storage_data.items():
        if index.fqn.startswith("model."):
            written.setdefault(info.relative_path, set()).add((index.fqn, tuple(index.offset)))
    for fqn, saved in stored.state_dict_metadata.items():
        if fqn.startswith(
            "model."
        ):  # the boxes tile the tensor once: one copy of each replica's piece
            assert sum(math.prod(c.sizes) for c in saved.chunks) == math.prod(saved.size), fqn
    assert len(written) > 1 and written["__0_0.distcp"] != written["__1_0.distcp"]
    resumed = train(
        "step7",
        tmp_path / "resumed",
        small_corpus,
        *EXACT,
        "--replicate",
        str(replicate),
        "--resume",
        str(checkpoint),
        nproc=N,
    )
    assert_bitwise_same_run(step7, resumed)
