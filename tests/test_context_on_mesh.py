"""Step 10 with --cp:
context parallelism as a fourth axis of the mesh (composition.py's rule 5, mesh.py's rule 5).

Where the other degrees leave every sum alone the run is bitwise step 11's: cp alone, cp x pp (a
pipeline changes no sum) under zero bubble, dp x cp (two rings' gradients, an order-free sum) with
full recomputation, the interleaved schedule; with bf16, dropout 0.1 and the float64 reduction on.
cp x tp sums each layer as step 8 does: step 11's in another summation order, bounded by step 0's
drift from step 1 on this machine, dropout 0.1 on (each tp rank's ring draws every head's mask and
keeps its own heads': step 11's masks). All four at 8 ranks is cp x tp's run, bitwise. A checkpoint
resumes across steps 10 and 11 at another mesh, bitwise.
"""

import sys

import pytest
import torch

from conftest import (
    EXACT,
    REPO,
    TINY,
    assert_bitwise_same_run,
    launch,
    metrics,
    other_order_drift,
    run_forked,
    spawn,
    train,
)

STEP10 = REPO / "step10_3d_parallel"
L4 = ("--n-layer", "4")  # the interleaved schedule: two chunks a stage


@pytest.fixture(scope="module")
def cp_runs(tmp_path_factory, small_corpus):
    """``cp_runs(name)``:
    each run trained once on TINY (4 steps, global batch 4 samples), checkpoints every 2."""
    runs, done = (
        {
            "step11": ("step11", 2, ["--cp", "2", *EXACT]),
            "cp2": ("step10", 2, ["--cp", "2", *EXACT]),
            "cp2pp2": (
                "step10",
                4,
                ["--cp", "2", "--pp", "2", "--schedule", "zero-bubble", *EXACT],
            ),
            "step11dp2": ("step11", 4, ["--cp", "2", *EXACT]),
            "dp2cp2": (
                "step10",
                4,
                ["--dp", "2", "--cp", "2", "--activation-checkpointing", "full", *EXACT],
            ),
            "step11l4": ("step11", 2, ["--cp", "2", *L4, *EXACT]),
            "cp2pp2interleaved": (
                "step10",
                4,
                [
                    "--cp",
                    "2",
                    "--pp",
                    "2",
                    "--schedule",
                    "interleaved-1f1b",
                    "--virtual-stages",
                    "2",
                    *L4,
                    *EXACT,
                ],
            ),
            "step11dropout": ("step11", 2, ["--cp", "2", "--dropout", "0.1"]),
            "cp2tp2": ("step10", 4, ["--cp", "2", "--tp", "2", "--steps", "2"]),
            "cp2tp2pp2": ("step10", 8, ["--cp", "2", "--tp", "2", "--pp", "2", "--steps", "2"]),
            "cp2tp2dropout": ("step10", 4, ["--cp", "2", "--tp", "2", "--dropout", "0.1"]),
        },
        {},
    )

    def run(name):
        if name not in done:
            step, nproc, flags = runs[name]
            done[name] = train(
                step, tmp_path_factory.mktemp(name) / "run", small_corpus, *flags, nproc=nproc
            )
        return done[name]

    return run


@pytest.mark.parametrize(
    "ours, theirs",
    [
        ("cp2", "step11"),
        ("cp2pp2", "step11"),
        ("dp2cp2", "step11dp2"),
        ("cp2pp2interleaved", "step11l4"),
    ],
)
def test_cp_with_dp_or_pp_is_step11_bitwise(cp_runs, ours, theirs):
    run = cp_runs(ours)
    assert metrics(run)["env"]["context_parallel_size"] == 2
    assert_bitwise_same_run(cp_runs(theirs), run)


def test_the_rings_bytes_are_on_the_cp_axis_and_step11s(cp_runs):
    """Rank 0's record at cp 2: the ring's sends under ``cp``, as many bytes as step 11's rank 0
    sends (the same ring, the same blocks); at cp 2 x pp 2 each stage rings its own block, half of
    them; nothing on ``tp``."""
    step11 = metrics(cp_runs("step11"))["records"][-1]["comm"]["send"]
    alone, piped = (metrics(cp_runs(name))["records"][-1]["comm"] for name in ("cp2", "cp2pp2"))
    assert alone[0]["cp"] == {"send": step11} and not alone[0]["tp"], alone[0]
    assert [c["cp"] for c in piped] == [{"send": step11 // 2}] * 4 and not any(
        c["tp"] for c in piped
    ), piped


def test_cp_with_tp_is_step11_in_another_summation_order(cp_runs, order_reference):
    """cp 2 x tp 2 against step 11's cp 2, dropout 0.1: the first step's loss and gradient norm to
    float32's rounding (a tp rank drawing its own heads' masks alone would be 1e-4 away), losses,
    norms and weights within compare/other_order.py's factor of step 0's drift from step 1."""
    ours, theirs = cp_runs("cp2tp2dropout"), cp_runs("step11dropout")
    drift, beyond = other_order_drift(order_reference, theirs, ours)
    first = [metrics(r)["records"][0] for r in (ours, theirs)]
    assert abs(first[0]["grad_norm"] / first[1]["grad_norm"] - 1) < 1e-6, first
    assert abs(first[0]["loss"] / first[1]["loss"] - 1) < 1e-6, first
    assert not beyond, f"{beyond}; {drift}; step 0 from step 1: {order_reference}"
    assert drift.weights > 0  # 0 would mean no tensor parallelism happened
    print(f"cp 2 x tp 2 from step 11: {drift}; step 0 from step 1: {order_reference}")


def test_all_four_axes_at_8_ranks_are_cp_x_tps_run(cp_runs):
    """cp 2 x tp 2 x pp 2 x dp 1, 8 ranks, 2 steps:
    the pipeline adds no sum to cp x tp's (4 ranks)."""
    run = cp_runs("cp2tp2pp2")
    assert metrics(run)["env"]["mesh"] == {
        "pp": 2,
        "dp": 1,
        "cp": 2,
        "tp": 2,
        "order": "pp, dp, cp, tp (tp innermost)",
    }
    assert_bitwise_same_run(cp_runs("cp2tp2"), run)


def test_the_planner_holds_every_ranks_model_state_at_four_axes(cp_runs):
    """``compare/plan.py --measured`` on the 8-rank cp x tp x pp run: every rank's parameters,
    gradients and AdamW state (ZeRO-1 over the cp pair) within the planner's tolerance of its
    estimate, a ring's ranks counted as replicas (dp x cp)."""
    result = run_forked(
        [
            sys.executable,
            str(REPO / "compare" / "plan.py"),
            "--measured",
            str(cp_runs("cp2tp2pp2")),
        ],
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.rstrip().endswith("within 5% of the estimate: yes"), result.stdout
    assert result.stdout.count(" 2 x 2 x 2, ZeRO-1 ") == 8, result.stdout


def test_checkpoints_resume_between_steps_10_and_11_at_another_mesh_bitwise(
    cp_runs, tmp_path, small_corpus
):
    """cp 2 x pp 2 (4 ranks, step 10) resumed by step 11 at cp 2 (2 ranks), and step 11's checkpoint
    by step 10 at cp 2 x pp 2: the same sums, so steps 3 and 4 are the uninterrupted runs', bit
    for bit."""
    into11 = train(
        "step11",
        tmp_path / "into11",
        small_corpus,
        "--cp",
        "2",
        *EXACT,
        "--resume",
        str(cp_runs("cp2pp2") / "checkpoints" / "step_2"),
        nproc=2,
    )
    assert_bitwise_same_run(cp_runs("step11"), into11)
    into10 = train(
        "step10",
        tmp_path / "into10",
        small_corpus,
        "--cp",
        "2",
        "--pp",
        "2",
        *EXACT,
        "--resume",
        str(cp_runs("step11") / "checkpoints" / "step_2"),
        nproc=4,
    )
    assert_bitwise_same_run(cp_runs("cp2pp2"), into10)


def _mesh_worker(rank, world_size, port, queue, shapes):
    from conftest import init_gloo, shutdown

    init_gloo(rank, world_size, port)
    sys.path.insert(0, str(STEP10))
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from mesh import build_mesh

    result = []
    for pp, dp, cp, tp in shapes:
        ours = build_mesh(dp, tp, pp, cp=cp)
        theirs = init_device_mesh("cpu", (pp, dp, cp, tp), mesh_dim_names=("pp", "dp", "cp", "tp"))
        their_groups = {axis: theirs.get_group(axis) for axis in ("pp", "dp", "cp", "tp")}
        their_groups["dp_cp"] = theirs["dp", "cp"]._flatten().get_group()
        for axis, group in their_groups.items():
            result.append(
                (
                    axis,
                    (pp, dp, cp, tp),
                    dist.get_process_group_ranks(getattr(ours, f"{axis}_group")),
                    dist.get_process_group_ranks(group),
                )
            )
        result.append(
            (
                "rank",
                (pp, dp, cp, tp),
                [ours.cp_rank, ours.dp_cp_rank],
                [
                    theirs.get_local_rank("cp"),
                    theirs.get_local_rank("dp") * cp + theirs.get_local_rank("cp"),
                ],
            )
        )
    queue.put((rank, result))
    shutdown()


def test_the_four_axes_are_init_device_mesh_groups():
    """8 ranks as (pp, dp, cp, tp) = 1 x 2 x 2 x 2 and 2 x 1 x 2 x 2: every axis's group, and the dp
    x cp plane the gradients go over, hold the ranks of PyTorch's ``init_device_mesh`` (the plane:
    its flattened dp, cp)."""
    results = spawn(_mesh_worker, 8, [(1, 2, 2, 2), (2, 1, 2, 2)], timeout=240)
    for rank, result in results.items():
        assert len(result) == 2 * 6
        for axis, shape, ours, theirs in result:
            assert ours == theirs, (rank, axis, shape, ours, theirs)


def test_axis_groups_along_cp_are_the_lines_of_the_rank_array():
    sys.path.insert(0, str(STEP10))
    from mesh import AXES, axis_groups, coordinates

    for pp, dp, cp, tp in [(1, 2, 2, 2), (2, 1, 3, 2), (1, 1, 4, 1), (2, 2, 2, 1)]:
        array = torch.arange(pp * dp * cp * tp).reshape(pp, dp, cp, tp)
        for d, axis in enumerate(AXES):
            lines = array.movedim(d, -1).reshape(-1, array.shape[d]).tolist()
            assert axis_groups(axis, dp, tp, pp, cp) == lines, (axis, pp, dp, cp, tp)
        plane = array.movedim((1, 2), (-2, -1)).reshape(-1, dp * cp).tolist()
        assert axis_groups(("dp", "cp"), dp, tp, pp, cp) == plane
        for rank in range(pp * dp * cp * tp):
            at = coordinates(rank, dp, tp, pp, cp)
            assert array[at["pp"], at["dp"], at["cp"], at["tp"]] == rank


@pytest.mark.quick
# the other refusals: docs/bad_input.md (tests/test_bad_input.py)
@pytest.mark.parametrize(
    "flags, nproc, line",
    [
        (
            ["--cp", "2", "--seq-len", "30"],
            2,
            "error: --seq-len 30 is cut into 2 x 2 chunks for 2 ranks: use a multiple of 4",
        ),
        (
            ["--cp", "3"],
            2,
            "error: --dp 1 x --cp 3 x --tp 1 x --pp 1 = 3 ranks, but the job has 2: "
            "launch 3 processes "
            "(torchrun --nproc_per_node), or choose degrees whose product is 2",
        ),
    ],
    ids=["seq-len", "degrees"],
)
def test_what_cp_on_the_mesh_cannot_do_is_one_line_exit_2(
    flags, nproc, line, tmp_path, small_corpus
):
    result = launch(
        "step10", [*TINY, *flags, "--data", str(small_corpus), "--out", str(tmp_path)], nproc=nproc
    )
    assert f"ranks' exit codes: {[2] * nproc}" in result.stderr, result.stderr
    assert line in result.stderr.splitlines(), result.stderr
