"""The pipeline bubble, measured: step 9 at P = 2 and 4 stages with M = 1, 2, 4, 8 micro-batches, each stage's
idle fraction of its last step against the ideal schedule's (P - 1) / (M + P - 1), or (P - 1) / (V M + P - 1)
interleaved over V = 2 chunks per stage (M a multiple of P), and the micro-batches whose activations each stage
held at once (GPipe: M; 1F1B: at most P - s on stage s; interleaved: (V - 1) P + 2 (P - s - 1) + 1 chunks' worth).

    python compare/bubble.py                        # both schedules, a table, runs/plots/bubble.png
    python compare/bubble.py --stages 2 --micro-batches 1 4 --schedules 1f1b

Each run is step 9's trainer with --trace (its bubble.json and pipeline.png land in runs/bubble/<run>/). A
model of 8 blocks, width 128, micro-batches of 4 x 64 tokens: big enough that compute, not launching, fills
a stage. On a machine with fewer cores than stages the stages also wait for a core; the table says so.
"""
import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "common"))  # config.py, as every step has it
from config import OneLineParser, UserError, exit_on_user_error  # noqa: E402
from launch import run_trainer  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
STEP = "step9_pipeline_parallel"
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")
VIRTUAL = 2  # the interleaved schedule's chunks per stage
MODEL = ["--n-layer", "8", "--n-embd", "128", "--n-head", "4", "--seq-len", "64", "--micro-batch-size", "4",
         "--steps", "3", "--save-every", "0", "--quiet", "--trace"]


def main() -> int:
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--schedules", nargs="+", choices=SCHEDULES, default=list(SCHEDULES))
    parser.add_argument("--runs-dir", type=Path, default=REPO_ROOT / "runs" / "bubble")
    parser.add_argument("--png", type=Path, default=REPO_ROOT / "runs" / "plots" / "bubble.png")
    args, extra = parser.parse_known_args()
    if any(not 1 <= p <= 4 for p in args.stages) or any(m < 1 for m in args.micro_batches):
        raise UserError("--stages must be 1 to 4 (the runs share this machine's cores) and --micro-batches at "
                        "least 1")
    if args.png.suffix != ".png":
        raise UserError(f"--png {args.png}: name a .png file")
    results = []
    for schedule in args.schedules:
        for stages in args.stages:
            for m in args.micro_batches:
                interleaved = schedule == "interleaved-1f1b"
                if interleaved and (m % stages or stages < 2):
                    print(f"skipping {schedule} P={stages} M={m}: it runs whole rounds of P >= 2 micro-batches")
                    continue
                out = args.runs_dir / f"{schedule}_p{stages}_m{m}"
                print(f"running {schedule} P={stages} M={m} ...", flush=True)
                chunks = ["--virtual-stages", str(VIRTUAL)] if interleaved else []
                run_trainer(STEP, stages, [*MODEL, "--grad-accum", str(m), "--schedule", schedule, *chunks,
                                           "--out", str(out), *extra], out / "train.log")
                bubble = json.loads((out / "bubble.json").read_text())
                last = json.loads((out / "metrics.json").read_text())["records"][-1]
                held = [memory["micro_batches_in_flight"] for memory in last["memory"]]
                results.append({"schedule": schedule, **bubble, "held": held})

    cores = os.cpu_count()
    print(f"\nidle fraction of the last step per stage vs (P - 1) / (V M + P - 1); micro-batches (interleaved: "
          f"chunk micro-batches) held at once ({cores} CPU cores)")
    print(f"{'schedule':<16} {'P':>2} {'M':>2} {'ideal':>6}  {'idle per stage':<28} {'held per stage':<14} formula")
    for r in results:
        p, m = r["stages"], r["micro_batches"]
        formula = {"gpipe": [m] * p, "1f1b": [min(p - s, m) for s in range(p)],
                   "interleaved-1f1b": [min((VIRTUAL - 1) * p + 2 * (p - s - 1) + 1, m * VIRTUAL) for s in range(p)]}
        formula = formula[r["schedule"]]
        idle = " ".join(f"{f:.2f}" for f in r["idle"])
        print(f"{r['schedule']:<16} {p:>2} {m:>2} {r['ideal']:>6.2f}  {idle:<28} {str(r['held']):<14} {formula}"
              f"{'' if r['held'] == formula else '  <-- differs'}")

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(args.stages), figsize=(5 * len(args.stages), 3.6), dpi=110, squeeze=False)
    for ax, p in zip(axes[0], args.stages):
        ms = sorted(args.micro_batches)
        ax.plot(ms, [(p - 1) / (m + p - 1) for m in ms], "k--", label="(P-1)/(M+P-1)")
        ax.plot(ms, [(p - 1) / (VIRTUAL * m + p - 1) for m in ms], "k:", label=f"(P-1)/({VIRTUAL}M+P-1)")
        for schedule, marker in (("gpipe", "o"), ("1f1b", "s"), ("interleaved-1f1b", "^")):
            rows = sorted((r for r in results if r["schedule"] == schedule and r["stages"] == p),
                          key=lambda r: r["micro_batches"])
            if rows:
                mean = [sum(r["idle"]) / p for r in rows]
                ax.plot([r["micro_batches"] for r in rows], mean, marker=marker, label=f"{schedule}: mean over stages")
        ax.set_xscale("log", base=2)
        ax.set_xticks(ms, [str(m) for m in ms])
        ax.set_xlabel("micro-batches M")
        ax.set_ylabel("idle fraction of the step")
        ax.set_title(f"P = {p} stages ({cores} CPU cores)")
        ax.set_ylim(0, 1)
        ax.legend(fontsize=8)
    fig.tight_layout()
    args.png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.png)
    print(f"plot: {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main))
