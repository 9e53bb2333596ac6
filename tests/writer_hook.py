"""Run a trainer with its checkpoint writer slowed down or failing, or with a SIGTERM sent at a
chosen point: a test hook injected from tests/, so that the trainers carry no test switch of
their own.

    # every save made whole 2 s late
    python tests/writer_hook.py slow:2 step7_zero3/train.py --async-save ...
    # making step_4 whole raises OSError
    python tests/writer_hook.py fail:4 step7_zero3/train.py --async-save ...
    # rank 1 stops inside step_4's write
    torchrun ... tests/writer_hook.py pause:4:1 step1_torch_ddp/train.py ...
    torchrun ... tests/writer_hook.py sigterm:2:launcher step1_torch_ddp/train.py \\
        --preempt-grace-s 20 ...
    torchrun ... tests/writer_hook.py sigterm-in-save:2:1 step7_zero3/train.py \\
        --preempt-grace-s 20 ...

``sigterm:K:TO``: after step K, before the ranks agree whether to stop, rank 0 sends SIGTERM to
``launcher`` (torchrun, which passes it on to every rank), to ``self`` (itself alone: its peers must
follow), or ``self-twice`` (two, the second once the first is noticed); on the first attempt only,
and it waits until the trainer has noticed its own signal, so the step the run stops after is K.
``sigterm-in-save:K:R``: rank R sends SIGTERM to torchrun in the middle of writing checkpoint K.
Modes combine with commas (``sigterm:2:self,slow:5``).

Under torchrun, give this file as the script and the trainer's train.py as its second argument. The
patch goes on the step's own ``checkpoint`` module (the trainer's folder first on sys.path, as when
it runs by itself), then train.py runs as ``__main__``. A slow write prints ``writer hook: step_<k>
written`` once it is whole on disk, so a test can see whether the trainer waited for it. A paused
rank prints its pid, to be killed there.
"""

import os
import runpy
import signal
import sys
import time
from functools import partialmethod
from pathlib import Path

modes, script, *args = sys.argv[1:]
sys.path.insert(0, str(Path(script).resolve().parent))
sys.argv = [script, *args]
import checkpoint  # noqa: E402  (the step's copy, the module train.py imports)
import failures  # noqa: E402

first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"

# the step where a save becomes the checkpoint (step 0's one process: the whole write)
FINISH = "_publish" if hasattr(checkpoint.CheckpointWriter, "_publish") else "_write"
write = getattr(checkpoint.CheckpointWriter, FINISH)


def slow_or_failing_write(self, step, *state, kind, value):
    if kind == "fail" and step == int(value):
        raise OSError(
            28, f"No space left on device (writer_hook.py, rank {self.rank}, step_{step})"
        )
    if kind == "slow":
        time.sleep(float(value))
    write(self, step, *state)
    if kind == "slow":
        print(f"writer hook: step_{step} written (rank {self.rank})", flush=True)


# step 0's one process has no barrier to pause in
barrier = getattr(checkpoint.CheckpointWriter, "_barrier", None)
paused = False


def pausing_barrier(self, kind, value):
    """``pause:STEP:RANK``: rank RANK stops in the middle of writing checkpoint STEP, once every
    rank's data is in .tmp_step_<STEP> (DCP's .metadata written: the barrier before the rename), on
    the first attempt only, so that a run torchrun restarts goes through. See
    tests/test_fault_tolerance.py."""
    global paused
    step, rank = map(int, value.split(":"))
    tmp = checkpoint.checkpoint_dir(self.config["out"], step).with_name(f".tmp_step_{step}")
    # Once: the barrier after the rename can come before
    # rank 0 has renamed, the file still in .tmp_step_<STEP>.
    if self.rank == rank and first_attempt and not paused and (tmp / ".metadata").is_file():
        paused = True
        if kind == "pause":
            print(
                f"paused in the save of step {step}: rank {self.rank}, pid {os.getpid()}",
                flush=True,
            )
            time.sleep(3600)
        # sigterm-in-save: torchrun passes it on while the save goes on
        os.kill(os.getppid(), signal.SIGTERM)
        print(
            f"SIGTERM sent to torchrun in the save of step {step} by rank {self.rank}", flush=True
        )
    barrier(self)


signalled = failures.Preemption.signalled
asked = 0


def signalled_at_step(self, value):
    """``sigterm:K:TO``: when the loop asks for the K-th time (after step K), rank 0 is signalled
    first, then the ranks agree (distributed.preempted_anywhere)."""
    global asked
    asked += 1
    step, to = value.split(":")
    if self.rank == 0 and asked == int(step) and first_attempt:
        os.kill(os.getppid() if to == "launcher" else os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 10
        # noticed by the trainer's own watcher
        while self.signalled_at is None and time.monotonic() < deadline:
            time.sleep(0.01)
        if to == "self-twice":
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(2)  # the watcher ends the process here
    return signalled(self)


for mode in modes.split(","):
    kind, value = mode.split(":", 1)
    if kind in ("pause", "sigterm-in-save"):
        checkpoint.CheckpointWriter._barrier = partialmethod(
            pausing_barrier, kind=kind, value=value
        )
    elif kind == "sigterm":
        failures.Preemption.signalled = partialmethod(signalled_at_step, value=value)
    else:
        setattr(
            checkpoint.CheckpointWriter,
            FINISH,
            partialmethod(slow_or_failing_write, kind=kind, value=value),
        )
runpy.run_path(script, run_name="__main__")
