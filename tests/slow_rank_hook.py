"""Run a trainer with one rank slowed down on purpose: a straggler made from tests/, so that the
trainers carry no test switch of their own (compare/stragglers.py is tested on real runs;
docs/fault_tolerance.md, "Stragglers").

    torchrun --standalone --nproc_per_node=2 tests/slow_rank_hook.py 1:0.05 \\
        step1_torch_ddp/train.py ...

``RANK:SECONDS``: rank RANK spins for SECONDS of its thread's CPU time each time it fetches a
micro-batch. CPU work, not a sleep: it stands in for a slower device or a heavier input pipeline,
i.e. more computation. The patch goes on the step's own ``data`` module (the trainer's folder first
on sys.path, as when it runs by itself), then train.py runs as ``__main__``. A malformed
RANK:SECONDS is one line and exit code 2, before any import.
"""

import os
import runpy
import sys
import time
from pathlib import Path

HOOK = Path(__file__).resolve()


def parse(spec: str) -> tuple[int, float]:
    """``"R:SECONDS"`` -> (R, SECONDS); a ``ValueError`` unless R >= 0 and 0 <= SECONDS < 60."""
    slow_rank, seconds = spec.split(":")
    slow_rank, seconds = int(slow_rank), float(seconds)
    if slow_rank < 0 or not 0 <= seconds < 60:
        raise ValueError(spec)
    return slow_rank, seconds


def extra_work(seconds: float) -> None:
    """Busy the CPU for ``seconds`` of this thread's CPU time
    (a sleep would cost wall time but no work)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def main() -> None:
    spec, script, *args = sys.argv[1:]
    try:
        slow_rank, seconds = parse(spec)
    except ValueError:
        print(
            f"error: slow_rank_hook.py {spec!r}: expected RANK:SECONDS, e.g. 1:0.05 "
            "(rank >= 0, 0 <= seconds < 60)",
            file=sys.stderr,
            flush=True,
        )
        sys.exit(2)
    sys.path.insert(0, str(Path(script).resolve().parent))
    sys.argv = [script, *args]
    import data  # the step's copy, the module train.py imports

    if int(os.environ.get("RANK", 0)) == slow_rank:  # torchrun sets RANK; a plain process is rank 0
        next_batch = data.MicroBatches.next

        def slowed_next(self):
            extra_work(seconds)
            return next_batch(self)

        data.MicroBatches.next = slowed_next
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
