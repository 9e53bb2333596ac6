"""When a collective fails: one line that says which rank died, froze or disagreed, and exit code 3.

Operations code, not the lesson: skip it on a first read. A rank that dies, freezes or issues other
collectives than its peers leaves them waiting. gloo then raises, in the survivors, a RuntimeError
whose text says what it saw (torch 2.13; docs/fault_tolerance.md has each case as measured). The
trainers turn it into one line and this exit code, and leave with os._exit: a normal exit would tear
down the broken group, which can itself wait for the lost peer. distributed.py imports this module,
which registers ``explain_collective_failure`` with ``failures.exit_on_user_error``.
"""

import os
import re
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from failures import failure_explainers

COLLECTIVE_FAILED = 3
SEE = "see docs/fault_tolerance.md"
# How long a survivor waits, after its own failure, for the other survivors to report
# (``roll_call``). They entered the collective together, so they fail within the compute between
# two collectives.
ROLL_CALL_S = 2.0

# a peer never sent (or never took) its part
GLOO_TIMEOUT = re.compile(r"Timed out waiting (\d+)ms")
# When one operation times out, gloo closes every pair of the group with this text: another
# operation under way at the same time (step 7's prefetched gather beside a reduce-scatter) raises
# it instead of the timeout, and may be the one this rank waits on first. It is the same failure:
# this rank waited a timeout.
PAIR_CLOSED = "Application timeout caused pair closure"
# A peer's socket closed: its process ended, or its
# gloo gave up on the collective (its own timeout).
PEER_GONE = re.compile(r"Connection (?:reset|closed) by peer|Broken pipe")
# What TORCH_DISTRIBUTED_DEBUG=DETAIL checks before every collective: that every rank arrives, and
# that they all issue the same collective (op, shapes, dtypes). Its errors name the
# ranks themselves.
DETAIL_ABSENT = re.compile(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier in (\d+) ms")
DETAIL_MISMATCH = re.compile(
    r"Rank (\d+) is running collective: CollectiveFingerPrint\(SequenceNumber=(\d+), "
    r"OpType=(\w+), TensorShape=\[([^\]]*)\], TensorDtypes=(\w+).*?"
    r"but Rank (\d+) is running collective: CollectiveFingerPrint\(SequenceNumber=(\d+), "
    r"OpType=(\w+), TensorShape=\[([^\]]*)\], TensorDtypes=(\w+)",
    re.S,
)


def roll_call(grace_s: float = ROLL_CALL_S, missing: list | None = None) -> list[int] | None:
    """After a collective failed here:
    the ranks that did not report through the store within ``grace_s``.

    Every rank whose collective fails calls this, so a rank missing here is one that is not failing
    with the others: dead, frozen, or busy for longer than the timeout. An empty list means every
    rank reached it: they are all alive and gave up on each other, which is what ranks that issued
    different collectives do. None: the store did not answer (its host may be the rank that froze).
    The store is torchrun's, or rank 0's without torchrun; every operation on it is bounded
    by ``grace_s``.
    ``missing``, if given, holds the ranks not yet seen while the roll call runs.
    """
    missing = [] if missing is None else missing
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set_timeout(timedelta(seconds=grace_s))
        # torchrun may restart the workers, and its store outlives them: one key space per attempt.
        prefix = f"collective_failed/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
        store.set(f"{prefix}{dist.get_rank()}", "here")
        deadline = time.monotonic() + grace_s
        missing[:] = range(dist.get_world_size())
        while True:
            missing[:] = [rank for rank in missing if not store.check([f"{prefix}{rank}"])]
            if not missing or time.monotonic() >= deadline:
                return list(missing)
            time.sleep(0.05)
    except Exception:  # noqa: BLE001  (a failure here only means: we cannot tell who is missing)
        return None


def who_is_missing(what: str) -> str:
    """``what`` happened to this rank; finish the sentence with what a roll call finds.

    torchrun stops every rank (SIGTERM) as soon as one exits, which for a rank that was killed is a
    tenth of a second after its death, before the roll call can end: then the line says what the
    roll call had seen so far, and leaves at once."""
    missing, started = [], time.monotonic()

    def stopped_by_launcher(signum, frame):
        ranks = (
            f"rank(s) {', '.join(map(str, missing))} had not answered a roll call"
            if missing
            else "a roll call had not ended"
        )
        os.write(
            2,
            (
                f"error: {what}; {ranks} when the launcher stopped this rank "
                f"{time.monotonic() - started:.1f} s "
                f"later (another rank failed first: torchrun's report says how); {SEE}\n"
            ).encode(),
        )
        os._exit(COLLECTIVE_FAILED)

    try:
        previous = signal.signal(signal.SIGTERM, stopped_by_launcher)
    except ValueError:  # not the main thread: no handler, the roll call still runs
        previous = None
    try:
        found = roll_call(ROLL_CALL_S, missing)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    if found:
        return (
            f"{what}; rank(s) {', '.join(map(str, found))} did not answer a roll call "
            f"within {ROLL_CALL_S:g} s "
            f"either: dead, frozen, or slower than --timeout-s; {SEE}"
        )
    if found == []:
        return (
            f"{what}, yet every rank answered a roll call: all alive, they issued "
            "different collectives, or "
            f"the same ones in a different order (TORCH_DISTRIBUTED_DEBUG=DETAIL names them); {SEE}"
        )
    return (
        f"{what}: a rank died, froze, is slower than --timeout-s, or the ranks issued "
        "different collectives "
        f"(the store did not answer a roll call); {SEE}"
    )


def group_timeout_s() -> float:
    """The default process group's timeout in seconds (gloo's; what --timeout-s set)."""
    backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    return backend.options._timeout.total_seconds()


def explain_collective_failure(error: BaseException) -> tuple[str, int] | None:
    """One line for a collective that failed on this rank,
    and exit code 3; None for any other error."""
    if not isinstance(error, RuntimeError) or not dist.is_initialized():
        return None
    text, me = str(error), f"rank {dist.get_rank()}"
    if match := DETAIL_MISMATCH.search(text):
        a, seq_a, op_a, shape_a, dtype_a, b, seq_b, op_b, shape_b, dtype_b = match.groups()
        return (
            f"{me}: the ranks issued different collectives: rank {a} runs collective "
            f"#{seq_a} {op_a} "
            f"[{shape_a}] {dtype_a}, rank {b} runs #{seq_b} {op_b} [{shape_b}] {dtype_b} "
            f"(found by TORCH_DISTRIBUTED_DEBUG=DETAIL); {SEE}"
        ), COLLECTIVE_FAILED
    if match := DETAIL_ABSENT.search(text):
        ranks, waited_ms = match.groups()
        return (
            f"{me} waited {int(waited_ms) / 1000:g} s in a collective that rank(s) "
            f"{ranks.strip()} never joined "
            "(TORCH_DISTRIBUTED_DEBUG=DETAIL's barrier): died, froze, or slower than "
            f"--timeout-s; {SEE}"
        ), COLLECTIVE_FAILED
    if match := GLOO_TIMEOUT.search(text):
        return who_is_missing(
            f"{me} waited {int(match.group(1)) / 1000:g} s in a collective"
        ), COLLECTIVE_FAILED
    if PAIR_CLOSED in text:
        return who_is_missing(
            f"{me} waited {group_timeout_s():g} s in a collective"
        ), COLLECTIVE_FAILED
    if match := PEER_GONE.search(text):
        return who_is_missing(
            f"{me} lost its connection to a peer in a collective (gloo: {match.group(0)})"
        ), COLLECTIVE_FAILED
    return None


# exit_on_user_error (failures.py) consults it
failure_explainers.append(explain_collective_failure)
