"""The schedules, each a pure function: what a stage does, in order, from (schedule, stage,
stages, micro-batches). Nothing here sends or computes: ``Pipeline.run`` (pipeline.py) follows the
list, and a schedule can be read, printed and simulated on its own (tests/test_pipeline_schedules.py
runs every rank's list). GPipe and 1F1B, the schedules a learner meets first, are here; the two
beyond them, interleaved 1F1B and zero bubble, in interleaved_and_zero_bubble.py, read after
pipeline.py.

1. **GPipe**: every micro-batch forward, then every backward (M micro-batches of activations held
   at once).
2. **1F1B**: stage s runs P - s - 1 forwards (warm-up), then alternates one forward and one
   backward, then the remaining backwards (at most P - s micro-batches held). Idle time per stage,
   the bubble, is (P - 1) / (M + P - 1) of the step in both (``ideal_bubble``); 1F1B saves memory.
3. **Backwards in micro-batch order.** Both run the backwards in micro-batch order 0, 1, ...,
   M - 1, which is the order one process accumulating M micro-batches adds their gradients in: so
   every ``.grad`` holds the same bits.
"""

from interleaved_and_zero_bubble import interleaved_actions, zero_bubble_actions

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")


def schedule_actions(
    schedule: str, stage: int, num_stages: int, micro_batches: int, chunks: int = 1
) -> list[tuple]:
    """What stage ``stage`` does, in order: ``("F", i)`` forward of micro-batch i, ``("B", i)`` its
    backward; interleaved ``("F", i, v)`` and ``("B", i, v)``, through this rank's chunk v of
    ``chunks``; zero bubble also ``("W", i)`` (interleaved_and_zero_bubble.py)."""
    if schedule == "interleaved-1f1b":
        return interleaved_actions(stage, num_stages, micro_batches, chunks)
    if schedule == "zero-bubble":
        return zero_bubble_actions(stage, num_stages, micro_batches)
    forwards = [("F", i) for i in range(micro_batches)]
    backwards = [("B", i) for i in range(micro_batches)]
    if schedule == "gpipe":
        return forwards + backwards
    if schedule != "1f1b":
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    warmup = min(num_stages - stage - 1, micro_batches)  # in flight before the first backward comes
    steady = [action for pair in zip(forwards[warmup:], backwards) for action in pair]
    return forwards[:warmup] + steady + backwards[micro_batches - warmup :]


def ideal_bubble(schedule: str, num_stages: int, micro_batches: int, chunks: int = 1) -> float:
    """The idle fraction of a stage in the ideal schedule, a backward twice a forward: (P - 1) /
    (M + P - 1) for GPipe and 1F1B, (P - 1) / (V M + P - 1) interleaved, (P - 1) / (3 M + P - 1)
    zero bubble (B = W = F; M >= P)."""
    work = {"interleaved-1f1b": chunks, "zero-bubble": 3}.get(schedule, 1) * micro_batches
    return (num_stages - 1) / (work + num_stages - 1)
