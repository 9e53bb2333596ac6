"""The tour: run every step that exists with its default config, check parity, plot, summarise.

    python compare/tour.py                 # CPU, world size 2, a few minutes on 2 cores
    python compare/tour.py --nproc 3       # another world size
    python compare/tour.py --steps 10      # extra flags after the known ones go to every trainer

Step 0 runs as one process accumulating ``grad_accum x nproc`` micro-batches, so its global
batches are the distributed steps' global batches. Every distributed step runs under torchrun
with ``--nproc`` ranks. Then each step is compared with step 1, the PyTorch DDP reference: the
parity contract must hold for steps 2 and up (bitwise at world size 2 with default flags); the
tour fails otherwise. Step 0 is compared too, and its difference printed: its micro-batches hold
other samples than the ranks' do, so its sums round differently (the README measures it).
Each trainer's output goes to runs/tour/<step>.log.
"""
import subprocess
import sys
import time
from pathlib import Path

import parity
from config import OneLineParser, UserError, exit_on_user_error
from plot import plot_runs

REPO_ROOT = parity.REPO_ROOT
DEFAULT_GRAD_ACCUM = 2


def launch_command(step: str, nproc: int, extra: list[str]) -> list[str]:
    script = str(REPO_ROOT / step / "train.py")
    if step.startswith("step0"):
        return [sys.executable, script, "--grad-accum", str(DEFAULT_GRAD_ACCUM * nproc), "--quiet", *extra]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            script, "--grad-accum", str(DEFAULT_GRAD_ACCUM), "--quiet", *extra]


def run_step(step: str, nproc: int, extra: list[str], log_dir: Path) -> float:
    """Run one trainer to the end; its output goes to a log file. Returns the wall time."""
    log = log_dir / f"{step}.log"
    started = time.perf_counter()
    with open(log, "w") as f:
        code = subprocess.call(launch_command(step, nproc, extra), stdout=f, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
    if code != 0:
        errors = [line for line in log.read_text().splitlines() if line.startswith("error:")]
        raise UserError(f"{step} failed (exit {code}): {errors[0] if errors else f'see {log}'}")
    return time.perf_counter() - started


def median(values):
    values = sorted(values)
    return values[len(values) // 2] if values else float("nan")


def main() -> int:
    parser = OneLineParser(description=__doc__, formatter_class=__import__("argparse").RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2, help="ranks for the distributed steps")
    args, extra = parser.parse_known_args()
    steps = parity.step_folders()
    log_dir = REPO_ROOT / "runs" / "tour"
    log_dir.mkdir(parents=True, exist_ok=True)

    times = {}
    for step in steps:
        print(f"running {step} ...", end=" ", flush=True)
        times[step] = run_step(step, args.nproc, extra, log_dir)
        print(f"{times[step]:.0f} s")

    reference = next(s for s in steps if s.startswith("step1"))
    results = {}
    for step in steps:
        if step != reference:
            run_a, run_b, results[step] = parity.check(reference, step)
            print(parity.report(run_a, run_b, results[step], brief=True))
    # The reference first: the difference panel then shows every step against PyTorch DDP.
    plot = plot_runs([reference] + [s for s in steps if s != reference], REPO_ROOT / "runs" / "plots" / "tour.png")

    print(f"\n{'step':<22} {'ranks':>5} {'time':>6} {'final loss':>10} {'tok/s':>8}  parity vs {reference}")
    all_passed = True
    for step in steps:
        _, metrics = parity.load_run(step)
        records = metrics["records"]
        if step == reference:
            verdict = "(reference)"
        elif step.startswith("step0"):
            # Not a parity check: one process sums its micro-batches in another order (see README).
            verdict = (f"same global batches, other summation order: max abs diff {results[step].max_abs:.1e}, "
                       f"param norm diff {results[step].max_param_norm_diff:.1e}")
        else:
            verdict = parity.verdict(results[step])
            must_be_bitwise = args.nproc == 2 and not extra
            if not results[step].passed or (must_be_bitwise and not results[step].bitwise):
                all_passed = False
                verdict += "  <-- expected bitwise identical" if results[step].passed else ""
        print(f"{step:<22} {metrics['env']['world_size']:>5} {times[step]:>5.0f}s {records[-1]['loss']:>10.4f} "
              f"{median([r['tokens_per_s'] for r in records]):>8,.0f}  {verdict}")
    print(f"\nplot: {plot}\nlogs: {log_dir}")
    print("tour: all parity checks passed" if all_passed else "tour: PARITY FAILED (see above)")
    return 0 if all_passed else 1


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main))
