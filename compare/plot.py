"""Loss, grad norm and param norm of any number of runs, overlaid, and each run's difference to the first.

    python compare/plot.py step0 step1 step3                  # -> runs/plots/step0_vs_step1_vs_step3.png
    python compare/plot.py step1 runs/matrix/float32_ws3/step3_naive_dp --out diff.png

Left column: the curves. Right column: run minus the first run, step by step, on a symmetric log
scale that shows both 0 (bitwise identical) and 1e-7 (a rounding difference). Runs are named like
in parity.py: short step names, step folders or run folders.
"""
import argparse
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display needed
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "common"))  # config.py, as every step has it
import parity  # noqa: E402
from config import OneLineParser, UserError, check_writable_file, exit_on_user_error  # noqa: E402

SERIES = (("loss", "loss"), ("grad_norm", "grad norm (before clipping)"), ("param_norm", "param norm"))


def check_figure_path(path: Path, flag: str) -> None:
    """Refuse, before any run is read, a figure file matplotlib cannot write: an unknown format (it goes by
    the file's extension), or a folder that cannot hold it."""
    formats = plt.figure().canvas.get_supported_filetypes()
    plt.close("all")
    if path.suffix.lstrip(".").lower() not in formats:
        raise UserError(f"{flag} {path}: the format is taken from the extension, and "
                        f"{repr(path.suffix) if path.suffix else 'no extension'} is not one matplotlib writes; "
                        "end the name with .png (or .pdf, .svg)")
    check_writable_file(path, f"{flag} {path}")


def plot_runs(names: list[str], out: Path) -> Path:
    check_figure_path(out, "--out")
    runs = [parity.load_run(name) for name in names]
    labels = [f"{path.name} (ws {m['env']['world_size']})" for path, m in runs]
    colors = [f"C{i % 10}" for i in range(len(runs))]  # a run keeps its colour in both columns
    fig, axes = plt.subplots(len(SERIES), 2, figsize=(12, 9), dpi=110, sharex=True)
    base = {r["step"]: r for r in runs[0][1]["records"]}
    for row, (key, title) in enumerate(SERIES):
        curves, diffs = axes[row]
        for (path, metrics), label, color in zip(runs, labels, colors):
            steps = [r["step"] for r in metrics["records"]]
            curves.plot(steps, [r[key] for r in metrics["records"]], label=label, color=color, linewidth=1.2)
        curves.set_ylabel(title)
        identical = True
        for (path, metrics), label, color in list(zip(runs, labels, colors))[1:]:
            common = [r for r in metrics["records"] if r["step"] in base]
            delta = [r[key] - base[r["step"]][key] for r in common]
            zero = all(d == 0 for d in delta)
            identical &= zero
            diffs.plot([r["step"] for r in common], delta, color=color, linewidth=1.2,
                       label=f"{label}: " + ("identical" if zero else f"max |diff| {max(map(abs, delta)):.1e}"))
        diffs.axhline(0, color="gray", linewidth=0.8)
        diffs.set_yscale("symlog", linthresh=1e-9)
        if len(runs) == 1:
            diffs.set_title("(one run: nothing to compare)", fontsize=9)
            diffs.yaxis.set_visible(False)
        else:
            if identical:  # all zeros: autoscale would spread ticks over +-1e-2; a rounding-sized range says more
                diffs.set_ylim(-1e-6, 1e-6)
            diffs.set_title(f"{title}: run - {labels[0]}" + ("  (all identical)" if identical else ""), fontsize=9)
            diffs.legend(fontsize=7, loc="upper left")
    axes[0][0].legend(fontsize=8)
    axes[-1][0].set_xlabel("optimiser step")
    axes[-1][1].set_xlabel("optimiser step")
    fig.suptitle(" vs ".join(labels), fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out


def main() -> int:
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="step names, step folders or run folders")
    parser.add_argument("--out", type=Path, help="PNG path (default: runs/plots/<a>_vs_<b>.png)")
    args = parser.parse_args()
    default = parity.REPO_ROOT / "runs" / "plots" / ("_vs_".join(Path(r).name for r in args.runs) + ".png")
    print(f"wrote {plot_runs(args.runs, args.out or default)}")
    return 0


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main))
