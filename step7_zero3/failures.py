"""How a run ends when something goes wrong: one line on stderr and an exit code, no traceback.

Operations code, not the lesson: skip it on a first read. ``train.py`` runs ``main()`` through
``exit_on_user_error``; a mistake the user can fix (``UserError``) ends the run with exit code 2, and so do
the failures another module knows how to explain: running out of memory (``memory_budget.py``), a
checkpoint that could not be written (below), and, with exit code 3, a collective that failed
because a peer died, froze or disagreed (``collective_failures.py``).
"""
import os
import sys


class UserError(Exception):
    """A mistake the user can fix. It ends the run with one line on stderr and exit code 2."""


# Failures that come in the middle of a run and that a module other than this one can explain: each
# function returns (message, exit code) for an exception it recognises, else None. memory_budget.py adds
# running out of memory, collective_failures.py the failed collective (a rank died, froze, or the ranks
# disagreed); this module, which every step has, step 0 included, knows nothing about either.
failure_explainers = []


def explain_failure(error: BaseException) -> tuple[str, int] | None:
    """(one line, exit code) for a failure that ends a run without a traceback, or None."""
    for explain in failure_explainers:
        explained = explain(error)
        if explained is not None:
            return explained
    return None


class CheckpointNotWritten(RuntimeError):
    """A save that failed: one line and exit code 2, like running out of memory, at whatever point of training;
    the checkpoints saved before it stay whole."""


failure_explainers.append(lambda error: (str(error), 2) if isinstance(error, CheckpointNotWritten) else None)


def not_written(error: BaseException, rank: int, step: int, out_dir) -> BaseException:
    """What a failed checkpoint write raises: out of memory or a failed collective as they are (they have their
    own one-line explanations), anything else (a full disk, a folder removed under the run) as
    ``CheckpointNotWritten``."""
    if explain_failure(error) is not None:
        return error
    failure = CheckpointNotWritten(
        f"rank {rank} could not write checkpoint step_{step} in {out_dir}/checkpoints ({type(error).__name__}: "
        f"{error}); the checkpoints before it are whole: make room, then resume with --resume")
    failure.__cause__ = error
    return failure


def exit_on_user_error(main):
    """Run ``main()``; turn a ``UserError`` into one line and exit code 2, with no traceback.

    Running out of memory is reported the same way (a model too big for the budget is a choice the
    user can change), and so is a collective that failed (exit 3, ``collective_failures.py``), but the process
    ends with ``os._exit``: the failure may have come in the middle of training, with a process group
    and a DDP reducer alive, and a normal interpreter exit would tear them down while peers still wait
    in a collective, or wait itself for a peer that will never answer (torchrun stops the peers)."""
    try:
        return main()
    except UserError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        sys.exit(2)
    except (MemoryError, RuntimeError) as error:
        explained = explain_failure(error)
        if explained is None:
            raise
        error.__traceback__ = None  # let go of the frames (and the tensors they hold) before formatting
        message, code = explained
        sys.stdout.flush()
        os.write(2, f"error: {message}\n".encode())
        os._exit(code)
