"""Step 10, 3D parallelism: the mesh's groups are PyTorch's ``init_device_mesh``'s; with two degrees
at 1 the run is bitwise the step that has the remaining axis (tp: step 8, pp: step 9, dp: step 1,
which step 5 equals bitwise at 2 ranks); two axes at once are bitwise where no sum changes order (pp
with tp: step 8; pp with dp: step 1) and compared with step 1 as step 8 is where tp meets dp; all
three at once, 2 x 2 x 2, for 2 steps.

The runs are shared (conftest.py's session fixture ``mesh_runs``): every trainer runs once on TINY,
global batch 8 samples per step; the step-10 runs with checkpoints are resumed at other meshes and
by step 1.
"""

import re
import sys

import pytest
import torch
import torch.distributed as dist

from conftest import (
    MESH_RUNS,
    REPO,
    TIMEOUT,
    TINY,
    assert_bitwise_same_run,
    launch,
    metrics,
    other_order_drift,
    spawn,
    train,
)
from launch import run_nodes_here

STEP10 = REPO / "step10_3d_parallel"
ACCUM = TINY.index("--grad-accum") + 1
# name: (step, ranks, flags); trained once per session (conftest.py), compare/plan.py's test too
RUNS = MESH_RUNS


@pytest.fixture(scope="module")
def runs(mesh_runs):
    return mesh_runs


# ---- the mesh ------------------------------------------------------------------------------------


def _mesh_worker(rank, world_size, port, queue, shapes):
    from conftest import init_gloo, shutdown

    init_gloo(rank, world_size, port)
    sys.path.insert(0, str(STEP10))
    # ours, imported after the process group exists, as an outsider would
    from torch.distributed.device_mesh import init_device_mesh

    from mesh import build_mesh

    result = []
    for pp, dp, tp in shapes:
        ours = build_mesh(dp, tp, pp)
        theirs = init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
        for axis in ("pp", "dp", "tp"):
            their_ranks = dist.get_process_group_ranks(theirs.get_group(axis))
            our_ranks = dist.get_process_group_ranks(getattr(ours, f"{axis}_group"))
            result.append(
                (
                    axis,
                    (pp, dp, tp),
                    our_ranks,
                    getattr(ours, f"{axis}_ranks"),
                    their_ranks,
                    getattr(ours, f"{axis}_rank"),
                    theirs.get_local_rank(axis),
                )
            )
    queue.put((rank, result))
    shutdown()


def test_the_mesh_has_init_device_mesh_groups():
    """8 ranks, as 2 x 2 x 2 and as 1 x 2 x 4 and 2 x 4 x 1 (pp, dp, tp): on every rank, each axis's
    group holds the same ranks, in the same order, as PyTorch's ``init_device_mesh``, and the rank's
    coordinate is theirs."""
    shapes = [(2, 2, 2), (1, 2, 4), (2, 4, 1)]
    results = spawn(_mesh_worker, 8, shapes, timeout=240)
    for rank, result in results.items():
        assert len(result) == 3 * len(shapes)
        for (
            axis,
            shape,
            our_group,
            our_list,
            their_group,
            our_coordinate,
            their_coordinate,
        ) in result:
            assert our_group == their_group == our_list, (rank, axis, shape, our_group, their_group)
            assert our_coordinate == their_coordinate, (rank, axis, shape)
    # TP innermost: in 2 x 2 x 2, rank 0's tp peer is
    # rank 1, its dp peer rank 2, its pp peer rank 4.
    first = {axis: group for axis, shape, group, *_ in results[0] if shape == (2, 2, 2)}
    assert first == {"tp": [0, 1], "dp": [0, 2], "pp": [0, 4]}


def test_axis_groups_are_the_lines_of_the_rank_array():
    """Without processes: ``axis_groups`` is how ``DeviceMesh`` cuts ``arange(world).reshape(pp, dp,
    tp)`` (cp 1: tests/test_context_on_mesh.py has the fourth axis)."""
    sys.path.insert(0, str(STEP10))
    from mesh import AXES, axis_groups, coordinates

    for pp, dp, tp in [(1, 1, 1), (2, 2, 2), (3, 2, 4), (1, 4, 2), (4, 1, 3)]:
        array = torch.arange(pp * dp * tp).reshape(pp, dp, 1, tp)  # AXES: pp, dp, cp, tp
        for d, axis in enumerate(AXES):
            lines = array.movedim(d, -1).reshape(-1, array.shape[d]).tolist()
            assert axis_groups(axis, dp, tp, pp) == lines, (axis, pp, dp, tp)
        for rank in range(pp * dp * tp):
            at = coordinates(rank, dp, tp, pp)
            assert at["cp"] == 0 and array[at["pp"], at["dp"], 0, at["tp"]] == rank


# ---- one axis: bitwise the step that has it ------------------------------------------------------


def test_tp_only_is_step8_and_pp_only_is_step9(runs):
    """--tp 2: bitwise step 8 (the same sharding, the same all-reduces, the same loss); --pp 2:
    bitwise step 9 (the same stages and schedule, plain GPT-2 and F.cross_entropy at tp = 1). ZeRO-1
    over a dp group of one is a plain AdamW on flat views: the same bits."""
    assert_bitwise_same_run(runs("tp2"), runs("step8"))
    assert_bitwise_same_run(runs("pp2"), runs("step9"))
    assert all(r["grad_norm"] > 0.3 for r in metrics(runs("tp2"))["records"]), (
        "clipping must trigger"
    )


def test_flushes_smaller_than_the_accumulation_are_step9(runs, tmp_path, small_corpus):
    """--micro-batches 2 with --grad-accum 4: two pipeline flushes a step, each micro-batch's loss
    still divided by the 4 of the whole step (dividing by the flush's 2 would double every
    gradient), bitwise step 9's one flush of 4."""
    # after TINY's
    flushes = train(
        "step10",
        tmp_path / "flushes",
        small_corpus,
        "--pp",
        "2",
        "--grad-accum",
        "4",
        "--micro-batches",
        "2",
        nproc=2,
    )
    assert_bitwise_same_run(flushes, runs("step9"))


def test_dp_only_is_step1(runs):
    """--dp 2: step 5's training (ZeRO-1 over the dp group) on the pipeline of one stage; at 2 ranks
    every sum of two is order-free, so it is bitwise step 1 (PyTorch DDP), as step 5 is."""
    assert_bitwise_same_run(runs("dp2"), runs("step1"))


# ---- two axes ------------------------------------------------------------------------------------


def test_pp_with_tp_is_step8_and_pp_with_dp_is_step1(runs):
    """A pipeline changes no sum: tp 2 x pp 2 is bitwise step 8 at tp 2 (4 micro-batches each), dp 2
    x pp 2 is bitwise step 1 on 2 ranks."""
    assert_bitwise_same_run(runs("tp2pp2"), runs("step8"))
    assert_bitwise_same_run(runs("dp2pp2"), runs("step1"))


def test_sequence_parallelism_on_the_tp_axis_through_a_pipeline_is_step8s(runs):
    """--sequence-parallel at tp 2 x pp 2 (the stages send each other S/T tokens of every
    micro-batch; dropout replays its whole masks across stages) is bitwise step 8's
    --sequence-parallel at tp 2, dropout and bf16 on."""
    assert_bitwise_same_run(runs("tp2pp2sp"), runs("step8sp"))
    assert [
        m["micro_batches_in_flight"] for m in metrics(runs("tp2pp2sp"))["records"][-1]["memory"]
    ] == [2, 2, 1, 1]


def first_grad_norm(a, b) -> float:
    """The first step's gradient norms, relative:
    like the first loss, one step's sums in another order."""
    ga, gb = metrics(a)["records"][0]["grad_norm"], metrics(b)["records"][0]["grad_norm"]
    return abs(ga - gb) / gb


def test_dp_with_tp_is_step1_in_another_summation_order(runs, order_reference):
    """dp 2 x tp 2 against step 1 on the same global batches, as step 8 is: the first step's loss
    and gradient norm to float32's rounding (< 1e-6 relative), the losses, the param norm and the
    weights within compare/other_order.py's factor of step 0's drift from step 1 on this machine
    (measured 0.6-1.1x on three kernel paths). The cause is step 8's alone: the same run is bitwise
    step 8's sums within each replica (tp2pp2 above), and dp 2 adds two replicas' gradients, an
    order-free sum."""
    drift, beyond = other_order_drift(order_reference, runs("step1"), runs("dp2tp2"))
    assert first_grad_norm(runs("dp2tp2"), runs("step1")) < 1e-6
    assert not beyond, f"{beyond}; {drift}; step 0 from step 1: {order_reference}"
    assert drift.weights > 0  # 0 would mean no tensor parallelism happened


def test_per_axis_communication_and_memory_of_every_rank(runs):
    """Every record holds every rank's memory and bytes per axis: tp all-reduces on the tp axis only
    where tp > 1, point-to-point only where pp > 1, the gradient all-reduce on the dp axis only
    where dp > 1; AdamW's state per rank is half its shard's at dp 2 (up to ZeRO-1's step counters:
    4 bytes per piece a tensor is cut into)."""
    for name, (tp, pp, dp) in {
        "dp2tp2": (2, 1, 2),
        "tp2pp2": (2, 2, 1),
        "dp2pp2": (1, 2, 2),
    }.items():
        record = metrics(runs(name))["records"][-1]
        assert len(record["comm"]) == len(record["memory"]) == 4
        for comm in record["comm"]:
            assert bool(comm["tp"]) == (tp > 1), (name, comm)
            assert bool(comm["pp"]) == (pp > 1), (name, comm)
            # the gradients, averaged
            assert bool(comm["dp"].get("all_reduce")) == (dp > 1), (name, comm)
    # dp 2 x tp 2 against tp 2 alone (step 8's run):
    # parameters the same per rank, AdamW's state halved.
    sharded, whole = (
        metrics(runs("dp2tp2"))["records"][-1]["memory"],
        metrics(runs("tp2"))["records"][-1]["memory"],
    )
    for rank, memory in enumerate(sharded):
        assert memory["params"] == whole[rank % 2]["params"]
        assert abs(memory["optimizer_state"] - whole[rank % 2]["optimizer_state"] / 2) < 4 * 64, (
            rank,
            memory,
        )


def test_resume_on_the_same_mesh_is_bitwise(runs, tmp_path, small_corpus):
    """dp 2 x tp 2 resumed from its step-2 checkpoint:
    steps 3 and 4 are the uninterrupted run's, bit for bit."""
    full = runs("dp2tp2")
    _, nproc, flags = RUNS["dp2tp2"]
    resumed = train(
        "step10",
        tmp_path / "resumed",
        small_corpus,
        *flags,
        "--resume",
        str(full / "checkpoints" / "step_2"),
        nproc=nproc,
    )
    assert_bitwise_same_run(full, resumed)


# ---- checkpoints read at another mesh shape, and by step 1 ---------------------------------------


def resumed_from(runs, name: str, tmp_path, corpus, step: str, nproc: int, *flags: str):
    """``step`` on ``nproc`` ranks with ``flags``,
    resumed from the step-2 checkpoint of run ``name`` (4 steps)."""
    return train(
        step,
        tmp_path / f"{name}_in_{step}_{nproc}",
        corpus,
        *flags,
        "--resume",
        str(runs(name) / "checkpoints" / "step_2"),
        nproc=nproc,
    )


def test_a_checkpoint_resumes_at_another_mesh_bitwise_where_the_sums_agree(
    runs, tmp_path, small_corpus
):
    """pp 2 x tp 2 (4 ranks) resumed at tp 2 alone (2 ranks): the last stage's blocks and the
    first's are joined into whole tensors, AdamW's state with them, and cut into tp 2 shards again.
    A pipeline changes no sum, so steps 3 and 4 are bitwise the uninterrupted tp 2 run's (which is
    bitwise pp 2 x tp 2's, above)."""
    resumed = resumed_from(
        runs, "tp2pp2", tmp_path, small_corpus, "step10", 2, "--tp", "2", "--grad-accum", "4"
    )
    assert_bitwise_same_run(resumed, runs("tp2"))


def test_a_tp_checkpoint_resumes_at_dp_in_step1s_summation_order(
    runs, order_reference, tmp_path, small_corpus
):
    """tp 2 resumed at dp 2 (ZeRO-1 slices of whole tensors where tp 2 held blocks of rows and
    columns): steps 3 and 4 sum each layer as one process does (step 1's order), so they are the
    uninterrupted tp 2 run's within the bound of another summation order, as dp 2 x tp 2 against
    step 1 above. A lost optimiser state would be far outside them: AdamW's first step from zero
    moments moves every weight by about the learning rate."""
    resumed = resumed_from(
        runs, "tp2", tmp_path, small_corpus, "step10", 2, "--dp", "2", "--grad-accum", "2"
    )
    # the checkpoint's own records
    assert metrics(resumed)["records"][:2] == metrics(runs("tp2"))["records"][:2]
    drift, beyond = other_order_drift(order_reference, runs("tp2"), resumed)
    assert not beyond and drift.weights > 0, (
        f"{beyond}; {drift}; step 0 from step 1: {order_reference}"
    )


def test_step1_resumes_a_step10_checkpoint(runs, order_reference, tmp_path, small_corpus):
    """Step 1 (PyTorch DDP, 2 ranks) reads a step-10 checkpoint like any other step's: from dp 2 x
    pp 2 it is bitwise the uninterrupted step 1 run (a pipeline changes no sum, two replicas add in
    either order alike); from dp 2 x tp 2 (blocks of rows and columns, AdamW's state in ZeRO-1
    slices of them) it continues the dp 2 x tp 2 run in step 1's summation order, within the bound
    of another summation order (as above)."""
    assert_bitwise_same_run(
        resumed_from(runs, "dp2pp2", tmp_path, small_corpus, "step1", 2, "--grad-accum", "2"),
        runs("step1"),
    )
    from_tp = resumed_from(runs, "dp2tp2", tmp_path, small_corpus, "step1", 2, "--grad-accum", "2")
    drift, beyond = other_order_drift(order_reference, runs("dp2tp2"), from_tp)
    assert not beyond and drift.weights > 0, (
        f"{beyond}; {drift}; step 0 from step 1: {order_reference}"
    )


# ---- two launches, one mesh ----------------------------------------------------------------------


def test_two_launches_train_bitwise_like_one(runs, tmp_path, small_corpus):
    """dp 2 x tp 2 as two torchrun launches of 2 ranks (``--nnodes=2``, torchrun's c10d rendezvous,
    as two machines would: compare/launch.py's node_command) trains bitwise like one launch of 4. A
    rank's place in the mesh depends on its global rank only; with TP innermost each launch holds
    one tp group ({0, 1}, {2, 3}: TP inside a node) and the dp groups ({0, 2}, {1, 3}) cross between
    the launches."""
    _, nproc, flags = RUNS["dp2tp2"]
    out = tmp_path / "two_launches"
    tiny = TINY[: ACCUM - 1] + TINY[ACCUM + 1 :]
    nodes = run_nodes_here(
        STEP10.name,
        2,
        nproc // 2,
        [*tiny, *flags, "--data", str(small_corpus), "--out", str(out), *TIMEOUT],
        timeout=300,
    )
    assert [code for code, _ in nodes] == [0, 0], "\n".join(log[-3000:] for _, log in nodes)
    # one world of 4: rank 0 (on whichever launch the
    # rendezvous made node 0) reports for all of them
    assert (
        sum("done: 4 steps on a 1 x 2 x 2 (pp x dp x tp) mesh" in log for _, log in nodes) == 1
    ), nodes
    assert metrics(out)["env"]["world_size"] == 4
    assert_bitwise_same_run(runs("dp2tp2"), out)


# ---- three axes ----------------------------------------------------------------------------------


def test_all_three_axes_on_8_ranks(tmp_path, small_corpus, runs):
    """2 x 2 x 2, two steps (8 processes on 2 cores: about two minutes): the same tolerance against
    step 1 as dp x tp (the pipeline adds no sum of its own)."""
    tiny = TINY[: ACCUM - 1] + TINY[ACCUM + 1 :]
    steps = tiny.index("--steps") + 1
    out = tmp_path / "mesh8"
    result = launch(
        "step10",
        [
            *tiny[:steps],
            "2",
            *tiny[steps + 1 :],
            "--dp",
            "2",
            "--tp",
            "2",
            "--pp",
            "2",
            "--grad-accum",
            "2",
            "--data",
            str(small_corpus),
            "--out",
            str(out),
        ],
        nproc=8,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ours, reference = metrics(out)["records"], metrics(runs("dp2tp2"))["records"][:2]
    assert len(ours) == 2 and len(metrics(out)["records"][0]["memory"]) == 8
    for a, b in zip(ours, reference):  # the pipeline changes no sum: dp 2 x tp 2's bits
        assert {k: a[k] for k in ("loss", "grad_norm", "param_norm")} == {
            k: b[k] for k in ("loss", "grad_norm", "param_norm")
        }


@pytest.mark.parametrize(
    "mesh, nproc, frozen, waiting",
    [
        (("--tp", "2"), 2, 1, "0"),
        (("--dp", "2", "--pp", "2"), 4, 3, "[012]"),
        (("--cp", "2", "--pp", "2"), 4, 3, "[012]"),
    ],
    ids=["tp", "dp-x-pp", "cp-x-pp"],
)
def test_a_frozen_rank_ends_the_job_within_the_timeout(
    mesh, nproc, frozen, waiting, tmp_path, small_corpus
):
    """SIGSTOP one rank after two steps: its peers wait --timeout-s (groups build_mesh made, with
    the run's timeout, not torch's default 30 minutes), one prints one line and the job exits 3,
    within the bound tests/test_dead_rank.py allows step 1 and step 7. tp: rank 1 of a tp pair, rank
    0 waits in a tensor-parallel all-reduce. dp x pp: rank 3 (stage 1 of replica 1); rank 2 waits in
    its data-parallel all-reduce, rank 1 in a point-to-point receive from it, any rank in the
    mesh-wide norm: whichever waits first speaks (rank 0 did in 1 of 8 runs where the line was
    recorded; once, in a full suite, rank 0's line came first and said it lost its connection: the
    rank it waited on had timed out first). cp x pp: rank 3 (stage 1, ring position 1); rank 2 waits
    in the ring's point-to-point exchange, rank 1 for the pipeline's."""
    import os
    import signal
    import subprocess
    import time

    from collective_failures import COLLECTIVE_FAILED, ROLL_CALL_S
    from conftest import trainer_command
    from test_dead_rank import (
        FREEZE_TIMEOUT_S,
        SLACK_S,
        Lines,
        continue_once_sigterm_is_pending,
        workers_by_rank,
    )

    args = [
        *TINY,
        "--steps",
        "10000",
        *mesh,
        "--data",
        str(small_corpus),
        "--out",
        str(tmp_path / "run"),
        "--timeout-s",
        str(FREEZE_TIMEOUT_S),
    ]
    args.remove("--quiet")  # rank 0's per-step lines say when training is under way
    proc = subprocess.Popen(
        trainer_command(STEP10.name, nproc, args),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    output, ranks = Lines(proc), {}
    try:
        output.wait_for(r"^step\s+2/", timeout=180)
        ranks = workers_by_rank(proc.pid)
        os.kill(ranks[frozen], signal.SIGSTOP)
        frozen_at = time.monotonic()
        error_at, error = output.wait_for(r"^error:", timeout=FREEZE_TIMEOUT_S + ROLL_CALL_S + 30)
        output.wait_for(rf"Sending process {ranks[frozen]} closing signal SIGTERM", timeout=10)
        continue_once_sigterm_is_pending(ranks[frozen])
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            for pid in workers_by_rank(proc.pid).values():
                for sig in (signal.SIGCONT, signal.SIGKILL):
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        pass
            proc.kill()
            proc.wait()
    # a survivor that waits on another survivor may see that one's timeout first, as a lost
    # connection (its pair closed): its line says so, and its roll call still names the frozen rank
    # (tests/test_pipeline_faults.py too)
    waited = rf"waited {FREEZE_TIMEOUT_S} s in a collective"
    lost = (
        r"lost its connection to a peer in a collective \(gloo: Connection "
        r"(?:closed|reset) by peer\)"
    )
    expected = rf"error: rank {waiting} (?:{waited}|{lost}); rank\(s\) {frozen} did not answer"
    assert re.match(expected, error), error
    assert FREEZE_TIMEOUT_S <= error_at - frozen_at <= FREEZE_TIMEOUT_S + ROLL_CALL_S + SLACK_S
    assert f"exitcode  : {COLLECTIVE_FAILED}" in "\n".join(output.rest())
