"""Steps 2-7 against the step-1 reference (PyTorch DDP): bitwise parity, the exact-mode matrix,
fp16 with skipped steps, the shard check, the broadcast, the overlap trace, memory per rank against
the ZeRO formulas and the communication accounting."""

import json
import math
import os
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from conftest import (
    EXACT,
    REPO,
    STEPS,
    TIMEOUT,
    TINY,
    assert_bitwise_same_run,
    init_gloo,
    metrics,
    parity,
    run_ranks,
    shutdown,
    spawn,
    train,
)
from launch import run_nodes_here


@pytest.fixture(scope="module")
def default_runs(tour, tmp_path_factory, small_corpus):
    """Steps 2 to 7 on 2 ranks in the default float32 mode, as the tour ran them, and step 4 again
    with its overlap trace and 0.1 MiB buckets
    (the tiny model's 0.37 MB would fit in one bucket)."""
    runs = {
        step: tour[0] / STEPS[step]
        for step in ("step2", "step3", "step4", "step5", "step6", "step7")
    }
    runs["step4 traced"] = train(
        "step4",
        tmp_path_factory.mktemp("traced"),
        small_corpus,
        "--trace",
        "--bucket-cap-mb",
        "0.1",
    )
    return runs


@pytest.mark.parametrize(
    "step", ["step2", "step3", "step4", "step4 traced", "step5", "step6", "step7"]
)
def test_bitwise_identical_to_ddp_at_world_size_2(step, default_runs, step1_ws2):
    result = parity(step1_ws2, default_runs[step])
    assert result.returncode == 0, result.stdout
    assert "verdict: PASS (bitwise identical)" in result.stdout, result.stdout


def test_fp16_with_skipped_steps_is_bitwise_identical_at_world_size_2(tmp_path, small_corpus):
    """A first loss scale of 1e6 overflows fp16: the scaler skips the first steps (the unscaled
    gradient's norm is inf or NaN) and halves the scale until a step trains. The sharded steps see
    an overflow only in their own slices, so they must agree on it across ranks, or one rank would
    step while the other skips (and wait in the all-gather until the timeout)."""
    fp16 = ("--amp", "fp16", "--loss-scale-init", "1e6")
    runs = {
        step: train(step, tmp_path / step, small_corpus, *fp16)
        for step in ("step1", "step5", "step6", "step7")
    }
    norms = [r["grad_norm"] for r in metrics(runs["step1"])["records"]]
    assert not math.isfinite(norms[0]) and math.isfinite(norms[-1]), (
        f"no skipped step, then no trained one: {norms}"
    )
    for step in ("step5", "step6", "step7"):
        result = parity(runs["step1"], runs[step])
        assert "verdict: PASS (bitwise identical)" in result.stdout, f"{step}:\n{result.stdout}"


# Bytes per parameter of (parameters, gradients, optimizer state) and whether each is divided by N:
# the ZeRO paper's formulas for fp32 AdamW.
REPLICATED = ((4, 1), (4, 1), (8, 1))
FORMULAS = {
    "step1": REPLICATED,
    "step3": REPLICATED,
    "step4": REPLICATED,
    "step5": ((4, 1), (4, 1), (8, "N")),
    "step6": ((4, 1), (4, "N"), (8, "N")),
    "step7": ((4, "N"), (4, "N"), (8, "N")),
}


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_exact_mode_is_bitwise_identical_at_any_world_size(world_size, exact_run):
    """Exact mode, accumulation, clipping that triggers, bf16 and dropout at once; and, from the
    same runs, every rank's memory against the ZeRO formulas and the bytes each step hands to
    each collective."""
    runs = {step: exact_run(step, world_size) for step in FORMULAS}
    for step in ("step3", "step4", "step5", "step6", "step7"):
        result = parity(runs["step1"], runs[step])
        assert "verdict: PASS (bitwise identical)" in result.stdout, (
            f"{step} at world size {world_size}:\n{result.stdout}"
        )
    assert any(r["grad_norm"] > 0.3 for r in metrics(runs["step1"])["records"]), (
        "clipping never triggered"
    )

    psi = sum(
        math.prod(f["shape"]) for f in metrics(runs["step1"])["final"]["fingerprints"].values()
    )
    for step, formula in FORMULAS.items():
        memory = metrics(runs[step])["records"][-1]["memory"]
        assert len(memory) == world_size
        for rank, measured in enumerate(memory):
            for kind, (per_param, divisor) in zip(("params", "grads", "optimizer_state"), formula):
                expected = per_param * psi / (world_size if divisor == "N" else 1)
                assert abs(measured[kind] / expected - 1) < 0.02, (
                    f"{step} rank {rank} {kind}: {measured[kind]} vs {expected}"
                )
    # Each ZeRO stage moves the gradients once (in float64 here: 8 bytes each) and the parameters
    # once (float32), padding included: at most N - 1 elements per bucket.
    for step, gradient_collective in (("step5", "all_reduce"), ("step6", "reduce_scatter")):
        for r in metrics(runs[step])["records"]:
            gathered = r["comm"]["all_gather"] / 4
            assert psi <= gathered < psi + 64 * world_size, (
                f"{step}: all-gathered {gathered} of {psi} parameters"
            )
            assert psi <= r["comm"][gradient_collective] / 8 < psi + 64 * world_size, (
                f"{step}: {r['comm']}"
            )


def test_two_nodes_train_bitwise_like_one(exact_run, tmp_path, small_corpus):
    """Two torchrun launches of 2 ranks each, meeting through torchrun's c10d rendezvous as two
    machines would (compare/launch.py's node_command, the same command on every node), train every
    hand-written sharding bitwise like one launch of 4 ranks: a rank's work depends on its global
    rank only, not on which node runs it. Exact mode, so the comparison is the strict one of the
    exact-mode matrix."""
    for step in ("step4", "step5", "step6", "step7"):
        out = tmp_path / step
        nodes = run_nodes_here(
            STEPS[step],
            2,
            2,
            [*TINY, "--data", str(small_corpus), "--out", str(out), *EXACT, *TIMEOUT],
            timeout=300,
        )
        assert [code for code, _ in nodes] == [0, 0], f"{step}:\n" + "\n".join(
            log[-3000:] for _, log in nodes
        )
        # one world of 4: rank 0 (on whichever launch the
        # rendezvous made node 0) reports for all of them
        assert sum("done: 4 steps on 4 ranks" in log for _, log in nodes) == 1, [
            log[-1000:] for _, log in nodes
        ]
        assert metrics(out)["env"]["world_size"] == 4 and metrics(out)["env"]["ranks_per_node"] == 2
        # each node: its 2 ranks' 8 of the 16 samples, per its slowest rank
        for r in metrics(out)["records"]:
            walls = [t["wall_s"] for t in r["step_time"]]
            assert [(n["node"], n["ranks"]) for n in r["per_node"]] == [(0, 2), (1, 2)]
            assert [n["samples_per_s"] for n in r["per_node"]] == [
                pytest.approx(8 / max(walls[:2])),
                pytest.approx(8 / max(walls[2:])),
            ]
        assert_bitwise_same_run(exact_run(step, 4), out)


def test_step2_checks_its_shards_at_every_epoch_start(default_runs):
    first = metrics(default_runs["step2"])["records"][0]["shard_check"]
    assert first["ok"] and first["ranks"] == 2


def test_step3_replicas_end_identical(default_runs):
    assert metrics(default_runs["step3"])["final"]["replicas_identical"] is True


def test_step4_first_bucket_is_launched_before_backward_ends(default_runs):
    events = json.loads((default_runs["step4 traced"] / "trace.json").read_text())["traceEvents"]
    backward = next(e for e in events if e["name"] == "backward")
    buckets = sorted((e for e in events if e["cat"] == "comm"), key=lambda e: e["ts"])
    assert len(buckets) >= 2, (
        "the tiny model should need a small first bucket and at least one more"
    )
    assert buckets[0]["ts"] < backward["ts"] + backward["dur"], (
        "no overlap: first all-reduce after backward"
    )
    assert (default_runs["step4 traced"] / "timeline.png").read_bytes().startswith(b"\x89PNG")


def test_step4_all_reduces_each_gradient_byte_once_per_optimiser_step(default_runs):
    records = metrics(default_runs["step4"])["records"]
    for r in records:  # 2 micro-batches per step: no_sync keeps the first one silent
        assert r["comm"]["all_reduce"] == r["memory"][0]["grads"]
    # rank 0's weights, once
    assert records[0]["comm"]["broadcast"] == records[0]["memory"][0]["params"]
    assert all("broadcast" not in r["comm"] for r in records[1:])


# ---- why the broadcast matters (step 3) ----------------------------------------------------------


def diverge_worker(rank, world_size, port, queue, broadcast):
    sys.path.insert(0, str(REPO / "step3_naive_dp"))
    from naive_dp import allreduce_gradients, broadcast_parameters, replicas_in_sync

    init_gloo(rank, world_size, port)
    torch.manual_seed(rank)  # different initial weights on purpose, as step 3 builds them
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    if broadcast:
        broadcast_parameters(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        torch.manual_seed(100 + 10 * step + rank)
        model(torch.randn(5, 4)).pow(2).mean().backward()
        allreduce_gradients(model)  # identical gradients on both ranks...
        optimizer.step()
        optimizer.zero_grad()
    # ...but identical weights only if they started identical
    queue.put((rank, replicas_in_sync(model)))
    shutdown()


@pytest.mark.parametrize("broadcast", [True, False])
def test_without_the_broadcast_replicas_diverge(broadcast):
    assert spawn(diverge_worker, 2, broadcast) == {0: broadcast, 1: broadcast}


# ---- leaving the group ---------------------------------------------------------------------------


def gloo_threads() -> list[str]:
    names = [
        (Path("/proc/self/task") / t / "comm").read_text().strip()
        for t in os.listdir("/proc/self/task")
    ]
    return [n for n in names if "gloo" in n or "tcpstore" in n]


def leave_worker(rank, world_size, port, queue):
    init_gloo(rank, world_size, port)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()  # the first step imports torch._dynamo, and with it torch.distributed.nn
    gathered = [torch.zeros(1) for _ in range(world_size)]
    dist.all_gather(gathered, torch.ones(1))
    started = gloo_threads()  # the workers start with the first collective
    shutdown()
    at_once = gloo_threads()
    deadline = time.monotonic() + 10
    while gloo_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    queue.put((rank, (started, at_once, gloo_threads())))


@pytest.mark.skipif(
    not Path("/proc/self/task").is_dir(), reason="thread names are read from /proc (Linux)"
)
def test_shutdown_leaves_no_gloo_thread_behind():
    """After shutdown() the group is really gone, its threads with it. A thread of a group that
    outlives shutdown() may still be letting go of the last collective's tensors when the
    interpreter exits; it then needs the GIL and aborts the process (the cause of a flaky SIGABRT of
    the test above).

    Those are the group's workers (``pt_gloo_runloop``): gone when shutdown() returns. The
    transport's socket loop (``gloo_tcp_loop``) holds no Python object; when its last user lets go
    from inside the loop it cannot join itself, and it ends on its own a moment later (1 run in 10
    here on 2 cores: still running when shutdown() returned, gone 0.2 s after). It must end, not
    outlive the process."""
    for rank, (started, at_once, later) in spawn(leave_worker, 2).items():
        assert "pt_gloo_runloop" in started, (
            f"rank {rank}: no gloo worker to watch, thread names changed: {started}"
        )
        workers = [name for name in at_once if name != "gloo_tcp_loop"]
        assert workers == [], (
            f"rank {rank}: threads of the destroyed group still running: {workers}"
        )
        assert later == [], (
            f"rank {rank}: threads of the destroyed group still running after 10 s: {later}"
        )


# Every step that holds groups in objects of its own, as
# a learner runs it; step 7 twice: R = 1 holds the world.
EXIT_RUNS = {
    "step4": [],
    "step5": [],
    "step6": [],
    "step7": [],
    "step7-hsdp": ["--replicate", "2"],
    "step8": [],
    "step9": [],
    "step10": ["--tp", "2"],
    "step11": ["--cp", "2"],
    "step12": ["--moe-experts", "2", "--ep", "2"],
}


@pytest.mark.skipif(
    not Path("/proc/self/task").is_dir(), reason="thread names are read from /proc (Linux)"
)
@pytest.mark.parametrize("run", EXIT_RUNS)
def test_a_trainer_leaves_no_gloo_thread_behind(run, tmp_path, small_corpus):
    """The test above with a whole trainer (tests/exit_threads_hook.py): after main() no thread of
    any group is left, on any rank. Found this way: step 7 kept every rank's world group alive (its
    model held ``dist.group.WORLD`` and outlived main), the cause of a rare "terminate called
    without an active exception" at the exit of a test that trained it."""
    step = run.split("-")[0]
    args = [
        str(REPO / STEPS[step] / "train.py"),
        *TINY,
        "--steps",
        "1",
        *TIMEOUT,
        "--data",
        str(small_corpus),
        "--out",
        str(tmp_path / "run"),
        *EXIT_RUNS[run],
    ]
    result = run_ranks(REPO / "tests" / "exit_threads_hook.py", args, 2)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("threads after main: ")]
    assert len(lines) == 2, result.stdout[-3000:]
    for line in lines:
        left = [
            name for name in line.split(": ")[1].split(",") if "gloo" in name or "tcpstore" in name
        ]
        assert left == [], f"{run}: a group outlived main(): {line}"


def dropped_wrapper_worker(rank, world_size, port, queue, folder, wrap):
    """An outsider's loop: wrap a model, train a step,
    drop the wrapper; is it gone once garbage is collected?"""
    import gc
    import weakref

    torch.set_num_threads(1)
    init_gloo(rank, world_size, port)
    sys.path.insert(0, str(REPO / folder))
    wrapped = WRAPS[wrap](torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)))
    wrapped(torch.randn(3, 4)).sum().backward()
    wrapped.finish_gradient_synchronization()
    gone = weakref.ref(wrapped), weakref.ref(wrapped.module)
    del wrapped
    gc.collect()
    queue.put((rank, [ref() is None for ref in gone]))
    shutdown()


def wrap_bucketed(model):
    from bucketed_ddp import BucketedDDP

    return BucketedDDP(model, bucket_cap_mb=1e-4)  # a bucket a parameter


def wrap_fully_sharded(model, replicate=1):
    from hsdp import hybrid_mesh
    from zero3 import FullyShardedDP

    return FullyShardedDP(model, [model[0]], mesh=hybrid_mesh(replicate))


WRAPS = {
    "bucketed": wrap_bucketed,
    "fully-sharded": wrap_fully_sharded,
    "hsdp": lambda model: wrap_fully_sharded(model, replicate=2),
}


@pytest.mark.parametrize(
    "folder, wrap",
    [
        ("step4_hooks_bucketing", "bucketed"),
        ("step7_zero3", "fully-sharded"),
        ("step7_zero3", "hsdp"),
    ],
)
def test_a_dropped_wrapper_is_freed(folder, wrap):
    """A parameter's hooks live in autograd's C++ graph, where Python's garbage collector does not
    look: a hook that held the wrapper kept it, its model and its groups (HSDP's, or the world)
    alive for good. So an outsider who wrapped a second model leaked the first, and step 7 kept
    gloo's threads into interpreter exit. Both wrappers now hook weakly; the planted bug (a bound
    method as the hook) keeps both alive."""
    assert spawn(dropped_wrapper_worker, 2, folder, wrap) == {0: [True, True], 1: [True, True]}


# ---- exact_reduction.py as an outsider uses it: PyTorch's DDP, their own harness -----------------


def exact_hook_worker(rank, world_size, port, out):
    from datetime import timedelta

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # group first
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    sys.path.insert(0, str(REPO / STEPS["step1"]))
    from exact_reduction import float64_allreduce_hook

    # several buckets
    ddp = torch.nn.parallel.DistributedDataParallel(exact_hook_model(), bucket_cap_mb=0.001)
    ddp.register_comm_hook(None, float64_allreduce_hook)
    ddp(exact_hook_batch(rank)).square().mean().backward()
    if rank == 0:
        torch.save([p.grad for p in ddp.module.parameters()], out)
    # DDP's C++ reducer holds the group: dropped as the last holder, the group's destructor would
    # wait, holding the GIL, for a gloo thread that needs the GIL to release the hook's callback
    # (seen: a hang at exit). So: first.
    del ddp
    dist.barrier()
    dist.destroy_process_group()


def exact_hook_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))


def exact_hook_batch(rank):
    # unlike magnitudes
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(rank)) * 10.0**rank


def test_exact_reduction_hook_gives_ddp_the_float64_average(tmp_path):
    """DDP with float64_allreduce_hook at 3 ranks, in a harness that names none of our helpers,
    against the closed form computed here: each rank's float32 gradient, summed in float64, divided
    by 3, rounded once."""
    import torch.multiprocessing as mp

    from conftest import free_port

    out = tmp_path / "grads.pt"
    ranks = mp.spawn(exact_hook_worker, args=(3, free_port(), str(out)), nprocs=3, join=False)
    deadline = time.monotonic() + 120
    while not ranks.join(timeout=1):  # raises if a rank failed
        if time.monotonic() > deadline:
            for process in ranks.processes:
                process.kill()
            pytest.fail("the 3 ranks did not finish within 120 s")
    torch.set_num_threads(1)
    grads = []
    for rank in range(3):
        model = exact_hook_model()
        model(exact_hook_batch(rank)).square().mean().backward()
        grads.append([p.grad for p in model.parameters()])
    expected = [(sum(g[i].double() for g in grads) / 3).float() for i in range(len(grads[0]))]
    got = torch.load(out)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    float32_sum = [(grads[0][i] + grads[1][i] + grads[2][i]) / 3 for i in range(len(grads[0]))]
    # the order would have mattered
    assert not all(torch.equal(a, b) for a, b in zip(float32_sum, expected))
