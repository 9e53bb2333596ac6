"""Start a step's trainer the way a learner would, and turn its failure into one line."""
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "common"))  # config.py, as every step has it
from config import UserError  # noqa: E402


def trainer_command(step: str, nproc: int, args: list[str]) -> list[str]:
    """``python stepK/train.py`` for nproc=0 (one process, no torchrun), else torchrun with nproc ranks."""
    script = str(REPO_ROOT / step / "train.py")
    if nproc == 0:
        return [sys.executable, script, *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", script, *args]


def run_trainer(step: str, nproc: int, args: list[str], log: Path) -> None:
    """Run to the end with all output in ``log``; on failure raise the trainer's own ``error:`` line
    (torchrun's report of the failed workers stays in the log)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        code = subprocess.call(trainer_command(step, nproc, args), stdout=f, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
    if code != 0:
        errors = [line for line in log.read_text().splitlines() if line.startswith("error:")]
        raise UserError(f"{step} failed (exit {code}): {errors[0] if errors else f'see {log}'}")
