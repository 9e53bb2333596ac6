"""Step 9's interleaved 1F1B (``--schedule interleaved-1f1b --virtual-stages V``): bitwise equal to step 0
accumulating the same micro-batches at P = 2 and 4 (dropout, bf16 and clipping on: each chunk's backwards add in
micro-batch order, each chunk draws its masks where one process does); its action lists run to the end with
blocking receives and sends that never block (a simulation of every rank at once), with the bubble of its formula;
and its mistakes stop in one line."""
import json
import subprocess
import sys

import pytest

from conftest import PIPELINE, REPO, TINY, assert_bitwise_same_run, launch, metrics, train

STEP9 = REPO / "step9_pipeline_parallel"


def simulate(schedule: str, stages: int, micro_batches: int, chunks: int = 1, backward_cost: int = 2) -> dict:
    """Every rank runs its ``schedule_actions`` in order, one time unit a forward, ``backward_cost`` a backward, an
    action starting when its inputs have arrived (the previous stage's forward, the next stage's backward: a
    receive blocks; a send does not). Returns each rank's busy and idle units and the step's length; raises
    AssertionError if the ranks deadlock (some rank waits for what no rank will ever send)."""
    import sys
    sys.path.insert(0, str(STEP9))
    from pipeline import schedule_actions

    P, V, M = stages, chunks, micro_batches
    K = P * V
    actions = [[(kind, i, *(c or [0])) for kind, i, *c in schedule_actions(schedule, r, P, M, V)] for r in range(P)]
    for r in range(P):  # every micro-batch through every chunk, forward and backward, once
        assert sorted(actions[r]) == sorted((kind, i, v) for kind in "FB" for i in range(M) for v in range(V))
    done, clock, position = {}, [0] * P, [0] * P
    while any(position[r] < len(actions[r]) for r in range(P)):
        progressed = False
        for r in range(P):
            if position[r] == len(actions[r]):
                continue
            kind, i, v = actions[r][position[r]]
            k = v * P + r
            needs = ("F", k - 1, i) if kind == "F" else ("B", k + 1, i) if k < K - 1 else ("F", k, i)
            if kind == "F" and k == 0:
                needs = None
            if needs is not None and needs not in done:
                continue  # this rank's receive waits
            start = max(clock[r], done[needs] if needs else 0)
            clock[r] = start + (1 if kind == "F" else backward_cost)
            done[kind, k, i] = clock[r]
            position[r] += 1
            progressed = True
        assert progressed, f"deadlock: ranks stopped at {position} of {[len(a) for a in actions]}"
    length = max(clock)
    busy = M * V * (1 + backward_cost)
    held = []  # per rank, the most (micro-batch, chunk) activations held at once
    for rank_actions in actions:
        now = peak = 0
        for kind, *_ in rank_actions:
            now += 1 if kind == "F" else -1
            peak = max(peak, now)
        held.append(peak)
    return {"length": length, "idle": [(length - busy) / length for _ in range(P)], "held": held}


@pytest.mark.quick
@pytest.mark.parametrize("P,V,M", [(2, 2, 2), (2, 2, 4), (2, 3, 6), (4, 2, 4), (4, 2, 8), (4, 4, 8), (3, 2, 9)])
def test_interleaved_actions_run_without_deadlock_and_with_the_formulas_bubble(P, V, M):
    """With unit forwards and backwards twice as long, the step of the interleaved schedule is the work plus the
    formula's bubble: idle fraction (P - 1) / (V M + P - 1) on every rank; 1F1B's the same at V = 1. Held at once
    on rank r: Megatron-LM's warm-up plus one, (V - 1) P + 2 (P - r - 1) + 1 chunk micro-batches (at most M V), each
    1/V of a stage's activations; 1F1B's min(P - r, M). A warm-up one forward short deadlocks, one too long holds
    one more (both checked by hand)."""
    bubble = simulate("interleaved-1f1b", P, M, V)
    assert bubble["idle"][0] == pytest.approx((P - 1) / (V * M + P - 1)), bubble
    assert bubble["held"] == [min((V - 1) * P + 2 * (P - r - 1) + 1, M * V) for r in range(P)], bubble
    plain = simulate("1f1b", P, M)
    assert plain["idle"][0] == pytest.approx((P - 1) / (M + P - 1)), plain
    assert plain["held"] == [min(P - r, M) for r in range(P)], plain


@pytest.mark.quick
def test_interleaved_rounds_and_warmup_are_megatrons():
    """Rank 0 of 2, 2 chunks, 4 micro-batches: micro-batches 0, 1 through chunk 0, then through chunk 1, warm-up
    (V - 1) P + 2 (P - 1) = 4 forwards; then one forward, one backward, the backwards through the last chunk first."""
    import sys
    sys.path.insert(0, str(STEP9))
    from pipeline import schedule_actions
    assert schedule_actions("interleaved-1f1b", 0, 2, 4, 2) == [
        ("F", 0, 0), ("F", 1, 0), ("F", 0, 1), ("F", 1, 1),
        ("F", 2, 0), ("B", 0, 1), ("F", 3, 0), ("B", 1, 1), ("F", 2, 1), ("B", 0, 0), ("F", 3, 1), ("B", 1, 0),
        ("B", 2, 1), ("B", 3, 1), ("B", 2, 0), ("B", 3, 0)]


def test_two_stages_two_chunks_train_bitwise_like_step0(pipeline_runs):
    """P = 2, V = 2 (4 chunks of one block), 4 micro-batches, dropout, bf16, clipping: every weight and every
    logged number the same bits as step 0 accumulating the same micro-batches. --trace: the last step's timeline
    names each chunk, the bubble's formula is (P - 1) / (V M + P - 1) = 1/9, and each rank held the chunk
    micro-batches of its warm-up plus one (5 and 3)."""
    run = pipeline_runs("step9", 2, "--schedule", "interleaved-1f1b", "--virtual-stages", "2", "--trace")
    assert_bitwise_same_run(pipeline_runs("step0"), run)
    bubble = json.loads((run / "bubble.json").read_text())
    assert (bubble["stages"], bubble["chunks"], bubble["micro_batches"]) == (2, 2, 4)
    assert bubble["ideal"] == pytest.approx(1 / 9) and all(0 <= f < 1 for f in bubble["idle"])
    names = {event["name"] for event in json.loads((run / "trace.json").read_text())["traceEvents"]}
    assert {f"{what} {i} chunk {v}" for what in ("forward", "backward") for i in range(4) for v in range(2)} <= names
    assert (run / "pipeline.png").stat().st_size > 10_000
    assert [m["micro_batches_in_flight"] for m in metrics(run)["records"][-1]["memory"]] == [5, 3]


def test_four_stages_two_chunks_train_bitwise_like_step0(tmp_path, small_corpus):
    """P = 4, V = 2: 8 chunks of one block, each micro-batch through rank 3 to rank 0 and on; 8 micro-batches in
    2 flushes of 4 (the smallest M the schedule takes), dropout on."""
    flags = (*TINY, "--n-layer", "8", "--grad-accum", "8", "--dropout", "0.1", "--steps", "2")
    step0 = train("step0", tmp_path / "step0", small_corpus, *flags)
    four = train("step9", tmp_path / "four", small_corpus, *flags, "--schedule", "interleaved-1f1b",
                 "--micro-batches", "4", nproc=4)
    assert_bitwise_same_run(step0, four)


@pytest.mark.parametrize("flags,nproc,says", [
    (["--schedule", "interleaved-1f1b", "--grad-accum", "3"], 2,
     "--schedule interleaved-1f1b sends micro-batches through the 2 stages in rounds of 2: make --micro-batches "
     "(or --grad-accum) a multiple of 2, not 3"),
    (["--virtual-stages", "2"], 2,
     "--virtual-stages 2 gives each rank chunks of layers for the interleaved schedule: add --schedule "
     "interleaved-1f1b, or leave --virtual-stages out"),
    (["--schedule", "interleaved-1f1b", "--virtual-stages", "3"], 2,
     "2 stages (one per rank) x 3 virtual stages but the model has 4 blocks: every stage needs at least one; use "
     "fewer stages or virtual stages or a larger --n-layer"),
])
def test_interleaved_mistakes_stop_in_one_line(tmp_path, small_corpus, flags, nproc, says):
    result = launch("step9", [*TINY, *PIPELINE, "--data", str(small_corpus), "--out", str(tmp_path / "run"), *flags],
                    nproc=nproc)
    assert result.returncode != 0 and says in result.stderr, result.stderr[-2000:]


@pytest.mark.parametrize("stages,layers", [(2, 4), (4, 8)])
def test_equal_to_torch_interleaved_1f1b_on_the_same_chunks(stages, layers):
    """compare/pipeline_reference.py: PyTorch's ScheduleInterleaved1F1B on the same P x 2 chunks (PipelineStage
    each, scale_grads=False, loss / M) against ours, M = 4: every gradient and weight torch.equal."""
    result = subprocess.run([sys.executable, str(REPO / "compare" / "pipeline_reference.py"), "--steps", "1",
                             "--schedules", "interleaved-1f1b", "--stages", str(stages), "--n-layer", str(layers),
                             "--micro-batches", "4"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "interleaved-1f1b gradients and weights" in result.stdout and "bitwise identical" in result.stdout
    assert result.stdout.rstrip().endswith("PASS"), result.stdout


def test_step10_pp_axis_interleaved_is_bitwise(pipeline_runs):
    """Step 10's pp axis takes the same flags: --pp 2 with 2 chunks per rank is step 0's bits, and with --tp 2 it
    is tp 2 x pp 2 under 1F1B's bits (tensor parallelism sums in its own order; the schedule changes none)."""
    interleaved = ("--schedule", "interleaved-1f1b", "--virtual-stages", "2")
    assert_bitwise_same_run(pipeline_runs("step0"), pipeline_runs("step10", 2, "--pp", "2", *interleaved))
    assert_bitwise_same_run(pipeline_runs("step10", 4, "--pp", "2", "--tp", "2"),
                            pipeline_runs("step10", 4, "--pp", "2", "--tp", "2", *interleaved))


def test_a_1f1b_checkpoint_resumed_interleaved_is_bitwise(pipeline_runs, tmp_path, small_corpus):
    """The 2-stage 1F1B run's step-2 checkpoint resumed with 2 chunks per rank (the blocks now cut in 4, the state
    found by name, the random stream where one process left it): finishes bitwise like step 0."""
    checkpoint = pipeline_runs("step9", 2, "--schedule", "1f1b") / "checkpoints" / "step_2"
    resumed = train("step9", tmp_path / "interleaved", small_corpus, *PIPELINE, "--schedule",
                    "interleaved-1f1b", "--resume", str(checkpoint))
    assert_bitwise_same_run(pipeline_runs("step0"), resumed)
