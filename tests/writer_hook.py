"""Run a trainer with its checkpoint writer slowed down or failing: a test hook injected from tests/, so that
the trainers carry no test switch of their own.

    python tests/writer_hook.py slow:2 step7_zero3/train.py --async-save ...   # every write starts 2 s late
    python tests/writer_hook.py fail:4 step7_zero3/train.py --async-save ...   # writing step_4 raises OSError
    torchrun ... tests/writer_hook.py pause:4:1 step1_torch_ddp/train.py ...    # rank 1 stops inside step_4's write

Under torchrun, give this file as the script and the trainer's train.py as its second argument. The patch goes
on the step's own ``checkpoint`` module (the trainer's folder first on sys.path, as when it runs by itself),
then train.py runs as ``__main__``. A slow write prints ``writer hook: step_<k> written`` once it is whole on
disk, so a test can see whether the trainer waited for it. A paused rank prints its pid, to be killed there.
"""
import os
import runpy
import sys
import time
from pathlib import Path

mode, script, *args = sys.argv[1:]
kind, value = mode.split(":", 1)
sys.path.insert(0, str(Path(script).resolve().parent))
sys.argv = [script, *args]
import checkpoint  # noqa: E402  (the step's copy, the module train.py imports)

write = checkpoint.CheckpointWriter._write


def slow_or_failing_write(self, step, *state):
    if kind == "fail" and step == int(value):
        raise OSError(28, f"No space left on device (writer_hook.py, rank {self.rank}, step_{step})")
    if kind == "slow":
        time.sleep(float(value))
    write(self, step, *state)
    if kind == "slow":
        print(f"writer hook: step_{step} written (rank {self.rank})", flush=True)


barrier = checkpoint.CheckpointWriter._barrier


def pausing_barrier(self):
    """``pause:STEP:RANK``: rank RANK stops in the middle of writing checkpoint STEP, once its own file is in
    .tmp_step_<STEP> (the barrier before the rename), on the first attempt only, so that a run torchrun
    restarts goes through. See tests/test_fault_tolerance.py."""
    step, rank = map(int, value.split(":"))
    tmp = checkpoint.checkpoint_dir(self.config["out"], step).with_name(f".tmp_step_{step}")
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if self.rank == rank and first_attempt and (tmp / f"rank{rank}.pt").is_file():
        print(f"paused in the save of step {step}: rank {self.rank}, pid {os.getpid()}", flush=True)
        time.sleep(3600)
    barrier(self)


if kind == "pause":
    checkpoint.CheckpointWriter._barrier = pausing_barrier
else:
    checkpoint.CheckpointWriter._write = slow_or_failing_write
runpy.run_path(script, run_name="__main__")
