"""How long a checkpoint holds training up, written in the foreground or with --async-save, and how
long a resume takes to read one back.

    python compare/bench_checkpoint.py   # step 1, 2 ranks, a 25 M-parameter model
    python compare/bench_checkpoint.py --step step7 --rounds 5

Runs the trainer with and without --async-save, alternating (so a slow spell of the machine hits
both), and reads the pause each save reports ("checkpoint step_k ...: training paused N ms"). The
first save of each run is left out (its folder and file creation are slower). Then resumes the
foreground run's checkpoint of step 6 and reads what the trainer reports ("resumed from ...: read in
N ms": opening it and every rank's part loaded). Prints medians with the spread, and the resident
memory the in-memory copy costs (the trainer's own rss column).
"""

import re
import statistics
import subprocess
import sys
from pathlib import Path

# compare/ and common/ (config.py, as every step has it), as gpu_check.py puts them
sys.path[:0] = [
    str(Path(__file__).resolve().parent),
    str(Path(__file__).resolve().parent.parent / "common"),
]
from config import OneLineParser, UserError, exit_on_user_error  # noqa: E402
from launch import trainer_command  # noqa: E402
from parity import step_folders  # noqa: E402

MODEL = [
    "--n-layer",
    "8",
    "--n-embd",
    "512",
    "--n-head",
    "8",
    "--micro-batch-size",
    "2",
    "--grad-accum",
    "1",
    "--seq-len",
    "64",
    "--steps",
    "8",
    "--save-every",
    "2",
    "--timeout-s",
    "120",
]


def one_run(
    step: str, nproc: int, out: Path, async_save: bool, resume=None
) -> tuple[list[float], float]:
    """The pauses of a run's saves (the first left out) and its peak rss;
    resuming ``resume``: the read's."""
    args = [*MODEL, "--out", str(out), *(["--async-save"] if async_save else [])]
    args += ["--resume", str(resume)] if resume else []
    result = subprocess.run(
        trainer_command(step, nproc, args), capture_output=True, text=True, timeout=1800
    )
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    if errors:  # the trainer refused its flags: its own line says why
        raise UserError(f"{step} failed (exit {result.returncode}): {errors[0]}")
    if result.returncode != 0:  # a crash, not bad input: all of its output
        sys.exit(f"{step} failed (exit {result.returncode}):\n{result.stderr[-2000:]}")
    pauses = [float(m) for m in re.findall(r"training paused (\d+) ms", result.stdout)]
    rss = [float(m) for m in re.findall(r"rss (\d+) MiB", result.stdout)]
    if resume:
        return [float(m) for m in re.findall(r"read in (\d+) ms", result.stdout)], max(rss)
    return pauses[1:], max(rss)


def main():
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--step", default="step1")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("runs/bench_checkpoint"))
    args = parser.parse_args()
    steps = {folder.split("_")[0]: folder for folder in step_folders()}
    if args.step not in steps:
        raise UserError(f"--step {args.step}: no such step; choose one of {', '.join(steps)}")
    if args.nproc < 1 or args.rounds < 1:
        raise UserError("--nproc and --rounds must be at least 1")
    step = steps[args.step]
    pauses, peaks, reads = {False: [], True: []}, {False: [], True: []}, []
    for _ in range(args.rounds):
        for async_save in (False, True):
            p, rss = one_run(
                step, args.nproc, args.out / ("async" if async_save else "sync"), async_save
            )
            pauses[async_save] += p
            peaks[async_save].append(rss)
        saved = args.out / "sync" / "checkpoints" / "step_6"
        reads += one_run(step, args.nproc, args.out / "resumed", False, saved)[0]
    for async_save, name in ((False, "written in the foreground"), (True, "--async-save")):
        p = sorted(pauses[async_save])
        print(
            f"{name:26s} pause median {statistics.median(p):7.0f} ms (min {p[0]:.0f}, "
            f"max {p[-1]:.0f}, "
            f"{len(p)} saves), peak rss {statistics.median(peaks[async_save]):.0f} MiB"
        )
    reads.sort()
    print(
        f"{'read back (resume)':26s} read median  {statistics.median(reads):7.0f} ms "
        f"(min {reads[0]:.0f}, "
        f"max {reads[-1]:.0f}, {len(reads)} resumes)"
    )


if __name__ == "__main__":
    exit_on_user_error(main)
