"""How a run ends when something goes wrong: one line on stderr and an exit code, no traceback.

Operations code, not the lesson: skip it on a first read. ``train.py`` runs ``main()`` through
``exit_on_user_error``; a mistake the user can fix (``UserError``) ends the run with exit code 2,
and so do the failures another module knows how to explain: running out of memory
(``memory_budget.py``), a checkpoint that could not be written (below), and, with exit code 3, a
collective that failed because a peer died, froze or disagreed (``collective_failures.py``).
``Preemption`` (at the end) turns a SIGTERM into a checkpoint and exit code 4.
"""

import os
import signal
import sys
import threading
import time


class UserError(Exception):
    """A mistake the user can fix. It ends the run with one line on stderr and exit code 2."""


# Failures that come in the middle of a run and that a module other than this one can explain: each
# function returns (message, exit code) for an exception it recognises, else None. memory_budget.py
# adds running out of memory, collective_failures.py the failed collective (a rank died, froze, or
# the ranks disagreed); this module, which every step has, step 0 included, knows nothing
# about either.
failure_explainers = []


def explain_failure(error: BaseException) -> tuple[str, int] | None:
    """(one line, exit code) for a failure that ends a run without a traceback, or None."""
    for explain in failure_explainers:
        explained = explain(error)
        if explained is not None:
            return explained
    return None


class CheckpointNotWritten(RuntimeError):
    """A save that failed: one line and exit code 2, like running out of memory, at whatever point
    of training; the checkpoints saved before it stay whole."""


failure_explainers.append(
    lambda error: (str(error), 2) if isinstance(error, CheckpointNotWritten) else None
)


def not_written(error: BaseException, rank: int, step: int, out_dir) -> BaseException:
    """What a failed checkpoint write raises: out of memory or a failed collective as they are (they
    have their own one-line explanations), anything else (a full disk, a folder removed under the
    run) as ``CheckpointNotWritten``."""
    if explain_failure(error) is not None:
        return error
    failure = CheckpointNotWritten(
        f"rank {rank} could not write checkpoint step_{step} in {out_dir}/checkpoints "
        f"({type(error).__name__}: "
        f"{error}); the checkpoints before it are whole: make room, then resume with --resume"
    )
    failure.__cause__ = error
    return failure


def exit_on_user_error(main):
    """Run ``main()``; turn a ``UserError`` into one line and exit code 2, with no traceback.

    Running out of memory is reported the same way (a model too big for the budget is a choice the
    user can change), and so is a collective that failed (exit 3, ``collective_failures.py``), but
    the process ends with ``os._exit``: the failure may have come in the middle of training, with a
    process group and a DDP reducer alive, and a normal interpreter exit would tear them down while
    peers still wait in a collective, or wait itself for a peer that will never answer (torchrun
    stops the peers)."""
    try:
        return main()
    except UserError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        sys.exit(2)
    except (MemoryError, RuntimeError) as error:
        explained = explain_failure(error)
        if explained is None:
            raise
        # let go of the frames (and the tensors they hold) before formatting
        error.__traceback__ = None
        message, code = explained
        sys.stdout.flush()
        os.write(2, f"error: {message}\n".encode())
        os._exit(code)


# ---- preemption: a SIGTERM ends the run at a step boundary, with a checkpoint --------------------

PREEMPTED, PREEMPTED_UNSAVED = 4, 5  # the exit codes (docs/fault_tolerance.md)


class Preemption:
    """``--preempt-grace-s S``: a SIGTERM (a spot machine's notice; torchrun passing on its own)
    ends the run at the end of the optimiser step in progress, with a checkpoint, within S seconds.
    0 (the default): SIGTERM ends the rank at once, which is what a rank should do when torchrun
    stops it because a peer died.

    1. **Noticed at once**: Python runs a signal handler only between bytecodes, never while the
       main thread waits in a collective; the signal's number also goes down a pipe
       (``signal.set_wakeup_fd``) that a thread reads, so the deadline starts when the signal comes.
    2. **At a step's end**: the loop asks ``signalled()``
       after each optimiser step and, if so, saves that step;
       ``leave`` then waits for the write, says where it is and exits ``PREEMPTED``: ``--resume
       auto`` (under ``torchrun --max-restarts`` too) goes on from there, bit for bit.
    3. **Never a hang**: a second SIGTERM, or S seconds without leaving, ends the rank with
       ``PREEMPTED_UNSAVED``; the checkpoints already written are whole (checkpoint.py, rule 1).
    """

    def __init__(self, grace_s: float, rank: int = 0):
        self.grace_s, self.rank, self.signalled_at = grace_s, rank, None
        if grace_s:
            read, write = os.pipe()
            os.set_blocking(write, False)
            # the work is the watcher's (rule 1)
            signal.signal(signal.SIGTERM, lambda signum, frame: None)
            signal.set_wakeup_fd(write)
            threading.Thread(
                target=self._watch, args=(read,), name="preemption-watcher", daemon=True
            ).start()

    def _watch(self, read: int) -> None:
        while True:
            # the numbers of the signals that came (SIGINT too)
            if signal.SIGTERM not in os.read(read, 64):
                continue
            if self.signalled_at is not None:
                self._give_up("a second SIGTERM came")
            self.signalled_at = time.monotonic()
            timer = threading.Timer(
                self.grace_s, self._give_up, [f"--preempt-grace-s {self.grace_s:g} s passed"]
            )
            timer.daemon = True
            timer.start()

    def _give_up(self, why: str) -> None:
        os.write(
            2,
            f"error: rank {self.rank} was told to stop (SIGTERM) and {why} before it "
            "could save: it ends "
            "without a checkpoint; the ones already saved are whole (resume with "
            "--resume auto)\n".encode(),
        )
        os._exit(PREEMPTED_UNSAVED)

    def signalled(self) -> bool:
        """Whether a SIGTERM came: asked once per step, after the optimiser step (rule 2)."""
        return self.signalled_at is not None

    def leave(self, writer, step: int, out_dir) -> None:
        """After the save of ``step``: wait for the write,
        say where it is, exit ``PREEMPTED`` (rule 2)."""
        writer.wait()
        if self.rank == 0:
            print(
                f"preempted: SIGTERM; stopped after step {step}, saved in "
                f"{out_dir}/checkpoints/step_{step}; "
                f"go on with --resume auto (exit code {PREEMPTED})",
                flush=True,
            )
        sys.stdout.flush()
        os._exit(PREEMPTED)
