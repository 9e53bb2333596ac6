"""Step 9's schedules beyond 1F1B: interleaved 1F1B (``--schedule interleaved-1f1b --virtual-stages
V``) and zero bubble (``--schedule zero-bubble``, ZB-H1). Each bitwise equal to step 0 accumulating
the same micro-batches at P = 2 and 4 (dropout, bf16 and clipping on: each chunk's backwards, or
W's, add in micro-batch order; each chunk draws its masks where one process does) and to PyTorch's
``ScheduleInterleaved1F1B`` / ``ScheduleInterleavedZeroBubble``; their action lists run to the end
with blocking receives and sends that never block (a simulation of every rank at once), with the
bubble of their formulas; step 10's pp axis takes them; their mistakes stop in one line."""

import json
import re
import sys

import pytest

from conftest import (
    PIPELINE,
    REPO,
    TINY,
    assert_bitwise_same_run,
    launch,
    metrics,
    run_forked,
    train,
)

STEP9 = REPO / "step9_pipeline_parallel"


def simulate(
    schedule: str, stages: int, micro_batches: int, chunks: int = 1, backward_cost: int = 2
) -> dict:
    """Every rank runs its ``schedule_actions`` in order, one time unit a forward, ``backward_cost``
    a backward (half of it B, half W, where split), an action starting when its inputs have arrived
    (the previous stage's forward, the next stage's B; W after its own B; the first stage's tie
    after the last stage's: a receive blocks, a send does not). Returns each rank's idle fraction,
    the step's length, the most micro-batches (or chunk micro-batches) held at once and the most W's
    waiting; raises AssertionError if the ranks deadlock (some rank waits for what no rank will
    ever send)."""
    import sys

    sys.path.insert(0, str(STEP9))
    from pipeline_schedules import schedule_actions

    P, V, M = stages, chunks, micro_batches
    K = P * V
    actions = [
        [(kind, i, *(c or [0])) for kind, i, *c in schedule_actions(schedule, r, P, M, V)]
        for r in range(P)
    ]
    split = schedule == "zero-bubble"
    cost = {"F": 1, "B": backward_cost / 2 if split else backward_cost, "W": backward_cost / 2}
    # every micro-batch through every chunk, forward and backward (B and W), once
    for r in range(P):
        kinds = "FBW" if split else "FB"
        assert sorted(actions[r]) == sorted(
            (kind, i, v) for kind in kinds for i in range(M) for v in range(V)
        )
    done, clock, position = {}, [0] * P, [0] * P
    while any(position[r] < len(actions[r]) for r in range(P)):
        progressed = False
        for r in range(P):
            if position[r] == len(actions[r]):
                continue
            kind, i, v = actions[r][position[r]]
            k = v * P + r
            needs = (
                [("F", k - 1, i)]
                if kind == "F" and k > 0
                else [("B", k + 1, i) if k < K - 1 else ("F", k, i)]
            )
            needs = [] if kind == "F" and k == 0 else [("B", k, i)] if kind == "W" else needs
            if k == 0 and P > 1 and kind == "B":
                # the tie: the last stage's half of this micro-batch's gradient
                needs.append((kind, K - 1, i))
            # (zero-bubble: the first stage adds the tie's halves
            # after its last W, when the last stage's are in)
            if any(need not in done for need in needs):
                continue  # this rank's receive waits
            start = max([clock[r]] + [done[need] for need in needs])
            clock[r] = start + cost[kind]
            done[kind, k, i] = clock[r]
            position[r] += 1
            progressed = True
        assert progressed, f"deadlock: ranks stopped at {position} of {[len(a) for a in actions]}"
    length = max(clock)
    busy = M * V * (1 + backward_cost)
    # per rank, the most (micro-batch, chunk) activations held at once, W's not yet run
    held, waiting = [], []
    for rank_actions in actions:
        now = peak = pending = most = 0
        for kind, *_ in rank_actions:
            now += 1 if kind == "F" else -1 if kind == ("W" if split else "B") else 0
            pending += 1 if kind == "B" and split else -1 if kind == "W" else 0
            peak, most = max(peak, now), max(most, pending)
        held.append(peak)
        waiting.append(most)
    return {
        "length": length,
        "idle": [(length - busy) / length for _ in range(P)],
        "held": held,
        "W": waiting,
    }


@pytest.mark.quick
@pytest.mark.parametrize(
    "P,V,M", [(2, 2, 2), (2, 2, 4), (2, 3, 6), (4, 2, 4), (4, 2, 8), (4, 4, 8), (3, 2, 9)]
)
def test_interleaved_actions_run_without_deadlock_and_with_the_formulas_bubble(P, V, M):
    """With unit forwards and backwards twice as long, the step of the interleaved schedule is the
    work plus the formula's bubble: idle fraction (P - 1) / (V M + P - 1) on every rank; 1F1B's the
    same at V = 1. Held at once on rank r: Megatron-LM's warm-up plus one, (V - 1) P + 2 (P - r - 1)
    + 1 chunk micro-batches (at most M V), each 1/V of a stage's activations; 1F1B's min(P - r, M).
    A warm-up one forward short deadlocks, one too long holds one more (both checked by hand)."""
    bubble = simulate("interleaved-1f1b", P, M, V)
    assert bubble["idle"][0] == pytest.approx((P - 1) / (V * M + P - 1)), bubble
    assert bubble["held"] == [min((V - 1) * P + 2 * (P - r - 1) + 1, M * V) for r in range(P)], (
        bubble
    )
    plain = simulate("1f1b", P, M)
    assert plain["idle"][0] == pytest.approx((P - 1) / (M + P - 1)), plain
    assert plain["held"] == [min(P - r, M) for r in range(P)], plain


@pytest.mark.quick
@pytest.mark.parametrize("P,M", [(2, 1), (2, 4), (3, 6), (4, 2), (4, 4), (4, 8)])
def test_zero_bubble_runs_without_deadlock_and_with_the_formulas_bubble(P, M):
    """ZB-H1 with forward, B and W a unit each: the step is the work plus (P - 1) units, idle
    (P - 1) / (3 M + P - 1) (1F1B's with the same costs: 3 (P - 1) units), once M >= P (fewer, and
    the warm-up is the whole batch); each stage holds min(P, M) micro-batches' activations (1F1B's
    P - s, plus the s W's it defers) and at most min(s + 1, M) W's. The tie's dependency (the first
    stage's W after the last stage's) deadlocks nothing."""
    bubble = simulate("zero-bubble", P, M)
    assert bubble["held"] == [min(P, M)] * P and bubble["W"] == [min(s + 1, M) for s in range(P)], (
        bubble
    )
    if M >= P:
        assert bubble["idle"][0] == pytest.approx((P - 1) / (3 * M + P - 1)), bubble
    assert bubble["length"] <= simulate("1f1b", P, M)["length"] - 2 * (P - 1) * (M >= P)


@pytest.mark.quick
def test_interleaved_rounds_and_warmup_are_megatrons():
    """Rank 0 of 2, 2 chunks, 4 micro-batches: micro-batches 0, 1 through chunk 0, then through
    chunk 1, warm-up (V - 1) P + 2 (P - 1) = 4 forwards; then one forward, one backward, the
    backwards through the last chunk first."""
    import sys

    sys.path.insert(0, str(STEP9))
    from pipeline_schedules import schedule_actions

    assert schedule_actions("interleaved-1f1b", 0, 2, 4, 2) == [
        ("F", 0, 0),
        ("F", 1, 0),
        ("F", 0, 1),
        ("F", 1, 1),
        ("F", 2, 0),
        ("B", 0, 1),
        ("F", 3, 0),
        ("B", 1, 1),
        ("F", 2, 1),
        ("B", 0, 0),
        ("F", 3, 1),
        ("B", 1, 0),
        ("B", 2, 1),
        ("B", 3, 1),
        ("B", 2, 0),
        ("B", 3, 0),
    ]


def test_two_stages_two_chunks_train_bitwise_like_step0(pipeline_runs):
    """P = 2, V = 2 (4 chunks of one block), 4 micro-batches, dropout, bf16, clipping: every weight
    and every logged number the same bits as step 0 accumulating the same micro-batches. --trace:
    the last step's timeline names each chunk, the bubble's formula is (P - 1) / (V M + P - 1) =
    1/9, and each rank held the chunk micro-batches of its warm-up plus one (5 and 3)."""
    run = pipeline_runs(
        "step9", 2, "--schedule", "interleaved-1f1b", "--virtual-stages", "2", "--trace"
    )
    assert_bitwise_same_run(pipeline_runs("step0"), run)
    bubble = json.loads((run / "bubble.json").read_text())
    assert (bubble["stages"], bubble["chunks"], bubble["micro_batches"]) == (2, 2, 4)
    assert bubble["ideal"] == pytest.approx(1 / 9) and all(0 <= f < 1 for f in bubble["idle"])
    names = {event["name"] for event in json.loads((run / "trace.json").read_text())["traceEvents"]}
    assert {
        f"{what} {i} chunk {v}"
        for what in ("forward", "backward")
        for i in range(4)
        for v in range(2)
    } <= names
    assert (run / "pipeline.png").stat().st_size > 10_000
    assert [m["micro_batches_in_flight"] for m in metrics(run)["records"][-1]["memory"]] == [5, 3]


def test_four_stages_two_chunks_train_bitwise_like_step0(tmp_path, small_corpus):
    """P = 4, V = 2: 8 chunks of one block, each micro-batch through rank 3 to rank 0 and on; 8
    micro-batches in 2 flushes of 4 (the smallest M the schedule takes), dropout on."""
    flags = (*TINY, "--n-layer", "8", "--grad-accum", "8", "--dropout", "0.1", "--steps", "2")
    step0 = train("step0", tmp_path / "step0", small_corpus, *flags)
    four = train(
        "step9",
        tmp_path / "four",
        small_corpus,
        *flags,
        "--schedule",
        "interleaved-1f1b",
        "--micro-batches",
        "4",
        nproc=4,
    )
    assert_bitwise_same_run(step0, four)


@pytest.mark.parametrize(
    "flags,nproc,says",
    [
        (
            ["--schedule", "interleaved-1f1b", "--grad-accum", "3"],
            2,
            "--schedule interleaved-1f1b sends micro-batches through the 2 stages in "
            "rounds of 2: make --micro-batches "
            "(or --grad-accum) a multiple of 2, not 3",
        ),
        (
            ["--virtual-stages", "2"],
            2,
            "--virtual-stages 2 gives each rank chunks of layers for the interleaved "
            "schedule: add --schedule "
            "interleaved-1f1b, or leave --virtual-stages out",
        ),
        (
            ["--schedule", "zero-bubble"],
            1,
            "--schedule zero-bubble defers each stage's weight gradients past the next "
            "stage's work: it needs 2 or more "
            "stages (one process: any other schedule)",
        ),
        (
            ["--schedule", "interleaved-1f1b", "--virtual-stages", "3"],
            2,
            "2 stages (one per rank) x 3 virtual stages but the model has 4 blocks: "
            "every stage needs at least one; use "
            "fewer stages or virtual stages or a larger --n-layer",
        ),
    ],
)
def test_interleaved_mistakes_stop_in_one_line(tmp_path, small_corpus, flags, nproc, says):
    result = launch(
        "step9",
        [*TINY, *PIPELINE, "--data", str(small_corpus), "--out", str(tmp_path / "run"), *flags],
        nproc=nproc,
    )
    assert result.returncode != 0 and says in result.stderr, result.stderr[-2000:]


@pytest.mark.parametrize("stages,layers", [(2, 4), (4, 8)])
def test_equal_to_torchs_interleaved_and_zero_bubble_schedules(stages, layers):
    """compare/pipeline_reference.py: PyTorch's ScheduleInterleaved1F1B on the same P x 2 chunks,
    and its ScheduleInterleavedZeroBubble on one stage per process (its B and W:
    ``stage_backward_input`` / ``_weight``), PipelineStage each, scale_grads=False, loss / M,
    against ours, M = 4: every gradient and weight torch.equal."""
    result = run_forked(
        [
            sys.executable,
            str(REPO / "compare" / "pipeline_reference.py"),
            "--steps",
            "1",
            "--schedules",
            "interleaved-1f1b",
            "zero-bubble",
            "--stages",
            str(stages),
            "--n-layer",
            str(layers),
            "--micro-batches",
            "4",
        ]
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for schedule in ("interleaved-1f1b", "zero-bubble"):
        assert re.search(
            rf"{schedule} gradients and weights of \d+ tensors after every step: bitwise identical",
            result.stdout,
        ), result.stdout
    assert result.stdout.rstrip().endswith("PASS"), result.stdout


@pytest.mark.parametrize(
    "schedule",
    [("--schedule", "interleaved-1f1b", "--virtual-stages", "2"), ("--schedule", "zero-bubble")],
    ids=["interleaved", "zero-bubble"],
)
def test_step10_pp_axis_takes_the_schedules_bitwise(pipeline_runs, schedule):
    """Step 10's pp axis takes the same flags: --pp 2 is step 0's bits, and with --tp 2 it is tp 2 x
    pp 2 under 1F1B's bits (tensor parallelism sums in its own order; the schedule changes none;
    zero bubble's W's leave the tp all-reduces in B)."""
    assert_bitwise_same_run(
        pipeline_runs("step0"), pipeline_runs("step10", 2, "--pp", "2", *schedule)
    )
    assert_bitwise_same_run(
        pipeline_runs("step10", 4, "--pp", "2", "--tp", "2"),
        pipeline_runs("step10", 4, "--pp", "2", "--tp", "2", *schedule),
    )


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "zero-bubble"])
def test_a_1f1b_checkpoint_resumed_by_another_schedule_is_bitwise(
    pipeline_runs, tmp_path, small_corpus, schedule
):
    """The 2-stage 1F1B run's step-2 checkpoint resumed interleaved (2 chunks per rank: the blocks
    now cut in 4, the state found by name, the random stream where one process left it) or with zero
    bubble: bitwise like step 0."""
    checkpoint = pipeline_runs("step9", 2, "--schedule", "1f1b") / "checkpoints" / "step_2"
    resumed = train(
        "step9",
        tmp_path / schedule,
        small_corpus,
        *PIPELINE,
        "--schedule",
        schedule,
        "--resume",
        str(checkpoint),
    )
    assert_bitwise_same_run(pipeline_runs("step0"), resumed)


def test_zero_bubble_two_stages_train_bitwise_like_step0(pipeline_runs):
    """ZB-H1 at P = 2, 4 micro-batches, dropout, bf16, clipping, the tie: every weight and logged
    number step 0's bits; each stage held min(P, M) = 2 micro-batches (until their W); --trace
    records the W's."""
    run = pipeline_runs("step9", 2, "--schedule", "zero-bubble", "--trace")
    assert_bitwise_same_run(pipeline_runs("step0"), run)
    assert [m["micro_batches_in_flight"] for m in metrics(run)["records"][-1]["memory"]] == [2, 2]
    names = {event["name"] for event in json.loads((run / "trace.json").read_text())["traceEvents"]}
    assert {f"{what} {i}" for what in ("forward", "backward", "weights") for i in range(4)} <= names


@pytest.mark.parametrize("accum", ["4", "2"])
def test_zero_bubble_four_stages_train_bitwise_like_step0(tmp_path, small_corpus, accum):
    """P = 4 with 4 micro-batches, and with 2 (M < P: the warm-up is the whole batch, the W's all at
    the end), dropout on."""
    flags = (*TINY, "--n-layer", "4", "--grad-accum", accum, "--dropout", "0.1", "--steps", "2")
    step0 = train("step0", tmp_path / "step0", small_corpus, *flags)
    four = train(
        "step9", tmp_path / "four", small_corpus, *flags, "--schedule", "zero-bubble", nproc=4
    )
    assert_bitwise_same_run(step0, four)


def test_bubble_with_simulated_compute_runs_every_schedule(tmp_path):
    """compare/bubble.py --simulate-ms: step 9's Pipeline around sleeping stages, every schedule at
    P = 2, M = 4; the micro-batches each stage held and zero bubble's W's waiting at once, counted
    by the Pipeline, are each schedule's closed form (the idle fractions are timings: the step
    README has them, from a quiet machine)."""
    png = tmp_path / "bubble.png"
    result = run_forked(
        [
            sys.executable,
            str(REPO / "compare" / "bubble.py"),
            "--simulate-ms",
            "5",
            "--stages",
            "2",
            "--micro-batches",
            "4",
            "--png",
            str(png),
        ]
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [
        line.split()
        for line in result.stdout.splitlines()
        if line.split()[:1]
        and line.split()[0] in ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")
    ]
    assert [row[0] for row in rows] == ["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble"], (
        result.stdout
    )
    assert "differs" not in result.stdout and png.read_bytes().startswith(b"\x89PNG")
    ideal = {row[0]: float(row[3]) for row in rows}
    assert ideal == {"gpipe": 0.2, "1f1b": 0.2, "interleaved-1f1b": 0.11, "zero-bubble": 0.08}
    # zero bubble's deferred W's, counted by Pipeline
    assert "W's waiting [1, 2], formula [1, 2]" in result.stdout
