"""The torchrun line that launch/slurm.sbatch runs on
every node of a Slurm job, rendered from Slurm's variables.

    python launch/slurm_command.py step7 --steps 2000      # inside a job: one argument per line
    python launch/slurm_command.py step7 --steps 2000 --show   # the same, as one shell line to read

What it reads, and why (docs/multi_node.md walks through it):

1. ``SLURM_JOB_NODELIST``, expanded by ``scontrol show hostnames``: the first node serves torchrun's
   c10d rendezvous (``--rdzv-endpoint=HEAD:PORT``); every node runs the same line and torchrun
   numbers the nodes itself (c10d ignores ``--node-rank``, so ``SLURM_NODEID`` is not passed: the
   sbatch script uses it to name each node's pid file).
2. ``SLURM_NNODES``: ``--nnodes``. ``SLURM_JOB_ID``: ``--rdzv-id`` (the same after a requeue: a new
   store then, on the new torchruns), and the port, ``29400 + id % 1000`` (``RDZV_PORT`` overrides),
   so two jobs sharing a node do not meet by mistake.
3. ``--nproc_per_node``: ``NPROC_PER_NODE`` if set, else ``SLURM_GPUS_ON_NODE`` (one rank per GPU);
   a CPU allocation has to say how many. One torchrun per node: the job must run one task per node
   (``--ntasks-per-node=1``); torchrun starts the ranks.
4. The trainer's own flags, plus ``--resume auto`` (a requeued job goes on from its last checkpoint;
   a new one starts) and ``--preempt-grace-s`` (20 s, under torchrun's 30, unless given): the
   SIGTERM the script forwards before the time limit ends the step in progress with a checkpoint.
"""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "common"))  # config.py: UserError, one line and exit 2
from config import UserError, exit_on_user_error  # noqa: E402

# under torchrun's 30 s (config.check_grace): the step in progress and its save fit in it
GRACE_S = "20"


def step_folder(name: str) -> str:
    """``step3`` or ``step3_naive_dp`` -> ``step3_naive_dp``,
    or a ``UserError`` listing the steps."""
    folders = sorted(
        (
            p.name
            for p in REPO_ROOT.glob("step*_*")
            if re.fullmatch(r"step\d+_\w+", p.name) and (p / "train.py").is_file()
        ),
        key=lambda f: int(re.match(r"step(\d+)", f).group(1)),
    )
    matches = [f for f in folders if name.rstrip("/") in (f, f.split("_")[0])]
    if not matches:
        raise UserError(f"no step named {name!r}; steps: {', '.join(folders)}")
    return matches[0]


def variable(env: dict, name: str) -> str:
    if not env.get(name):
        raise UserError(
            f"{name} is not set: run this inside a Slurm job (sbatch "
            "launch/slurm.sbatch STEP ...), "
            "or set the SLURM_* variables it reads by hand"
        )
    return env[name]


def ranks_per_node(env: dict) -> int:
    """Rule 3: ``NPROC_PER_NODE``, else the GPUs Slurm gave this node."""
    tasks = env.get("SLURM_NTASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE", "1").split("(")[0]
    if tasks != "1":
        raise UserError(
            f"the job runs {tasks} tasks per node; launch/slurm.sbatch runs one torchrun per node, "
            "which starts the ranks: submit with --ntasks-per-node=1 and set NPROC_PER_NODE or "
            "--gpus-per-node"
        )
    given = env.get("NPROC_PER_NODE") or env.get("SLURM_GPUS_ON_NODE") or "0"
    if not given.isdigit() or int(given) < 1:
        raise UserError(
            "the job has no GPUs per node (SLURM_GPUS_ON_NODE) and NPROC_PER_NODE is "
            "not set: submit "
            "with --gpus-per-node=N, or set NPROC_PER_NODE=N for N ranks per node on CPUs"
        )
    return int(given)


def check_job(step: str, env: dict) -> None:
    """What needs no ``scontrol``: the step, the job's variables, the ranks per node."""
    step_folder(step)
    variable(env, "SLURM_JOB_ID"), variable(env, "SLURM_NNODES")
    ranks_per_node(env)


def torchrun_command(step: str, args: list[str], env: dict, hostnames: list[str]) -> list[str]:
    """The line every node runs (rules 1-4),
    from Slurm's variables ``env`` and the job's ``hostnames``."""
    check_job(step, env)
    nnodes, job = int(env["SLURM_NNODES"]), env["SLURM_JOB_ID"]
    if len(hostnames) != nnodes:
        raise UserError(
            f"SLURM_JOB_NODELIST names {len(hostnames)} nodes, SLURM_NNODES says {nnodes}"
        )
    port = env.get("RDZV_PORT") or str(29400 + int(re.sub(r"\D", "", job) or 0) % 1000)
    flags = [a.split("=")[0] for a in args]
    extra = ([] if "--resume" in flags else ["--resume", "auto"]) + (
        [] if "--preempt-grace-s" in flags else ["--preempt-grace-s", GRACE_S]
    )
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nnodes}",
        f"--nproc_per_node={ranks_per_node(env)}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={hostnames[0]}:{port}",
        f"--rdzv-id={job}",
        str(REPO_ROOT / step_folder(step) / "train.py"),
        *args,
        *extra,
    ]


def job_hostnames(env: dict) -> list[str]:
    """``scontrol show hostnames $SLURM_JOB_NODELIST``: ``gpu[07-08]`` -> ``gpu07``, ``gpu08``."""
    nodelist = variable(env, "SLURM_JOB_NODELIST")
    try:
        result = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True
        )
    except FileNotFoundError:
        raise UserError("scontrol is not on PATH: run this on a node of the Slurm job") from None
    if result.returncode != 0 or not result.stdout.split():
        raise UserError(
            f"scontrol show hostnames {nodelist} failed: {(result.stderr or result.stdout).strip()}"
        )
    return result.stdout.split()


def main() -> int:
    argv = sys.argv[1:]
    show = "--show" in argv
    argv = [a for a in argv if a != "--show"]
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    check_job(argv[0], os.environ)  # before scontrol: a mistake is named as itself, on any machine
    command = torchrun_command(argv[0], argv[1:], dict(os.environ), job_hostnames(os.environ))
    print(shlex.join(command) if show else "\n".join(command))
    return 0


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main))
