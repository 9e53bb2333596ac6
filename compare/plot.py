"""Loss, grad norm and param norm of any number of runs,
overlaid, and each run's difference to the first.

    python compare/plot.py step0 step1 step3   # -> runs/plots/step0_vs_step1_vs_step3.png
    python compare/plot.py step1 runs/matrix/float32_ws3/step3_naive_dp --out diff.png

Left column: the curves. Right column: run minus the first run (the reference), step by step, on a
symmetric log scale that shows both 0 (bitwise identical) and 1e-7 (a rounding difference). One
legend below the panels names every run with its verdict (identical, or its largest difference).
Runs are named like in parity.py: short step names, step folders or run folders.

    # an MoE run: each expert's share
    python compare/plot.py --expert-load runs/moe/step12_expert_parallel
"""

import argparse
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display needed
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

# config.py, as every step has it
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "common"))
import parity  # noqa: E402
from config import OneLineParser, UserError, check_writable_file, exit_on_user_error  # noqa: E402

SERIES = (
    ("loss", "loss"),
    ("grad_norm", "grad norm (before clipping)"),
    ("param_norm", "param norm"),
)


def check_figure_path(path: Path, flag: str) -> None:
    """Refuse, before any run is read, a figure file matplotlib cannot write: an unknown format (it
    goes by the file's extension), or a folder that cannot hold it."""
    formats = plt.figure().canvas.get_supported_filetypes()
    plt.close("all")
    if path.suffix.lstrip(".").lower() not in formats:
        raise UserError(
            f"{flag} {path}: the format is taken from the extension, and "
            f"{repr(path.suffix) if path.suffix else 'no extension'} is not one matplotlib writes; "
            "end the name with .png (or .pdf, .svg)"
        )
    check_writable_file(path, f"{flag} {path}")


def plot_runs(names: list[str], out: Path) -> Path:
    check_figure_path(out, "--out")
    runs = [parity.load_run(name) for name in names]
    labels = [f"{path.name} (ws {m['env']['world_size']})" for path, m in runs]
    # A run keeps its colour in both columns; past the default
    # cycle's 10 colours, tab20's 20 (no two runs alike).
    colors = (
        [f"C{i}" for i in range(len(runs))]
        if len(runs) <= 10
        else [plt.cm.tab20(i % 20) for i in range(len(runs))]
    )
    base = {r["step"]: r for r in runs[0][1]["records"]}
    # One legend for the whole figure, below it, each run with its verdict: per-panel legends would
    # sit on the curves, and the runs are the same in every panel.
    worst = [{key: 0.0 for key, _ in SERIES} for _ in runs]
    fig, axes = plt.subplots(len(SERIES), 2, figsize=(12, 8.5), dpi=110, sharex=True)
    for row, (key, title) in enumerate(SERIES):
        curves, diffs = axes[row]
        for (_, metrics), color in zip(runs, colors):
            steps = [r["step"] for r in metrics["records"]]
            curves.plot(steps, [r[key] for r in metrics["records"]], color=color, linewidth=1.2)
        curves.set_ylabel(title)
        for i, ((_, metrics), color) in enumerate(list(zip(runs, colors))[1:], start=1):
            common = [r for r in metrics["records"] if r["step"] in base]
            delta = [r[key] - base[r["step"]][key] for r in common]
            worst[i][key] = max(map(abs, delta), default=0.0)
            diffs.plot([r["step"] for r in common], delta, color=color, linewidth=1.2)
        diffs.axhline(0, color="gray", linewidth=0.8)
        diffs.set_yscale("symlog", linthresh=1e-9)
        identical = all(worst[i][key] == 0 for i in range(1, len(runs)))
        if len(runs) == 1:
            diffs.set_title("(one run: nothing to compare)", fontsize=9)
            diffs.yaxis.set_visible(False)
        else:
            # all zeros: autoscale would spread ticks over +-1e-2; a rounding-sized range says more
            if identical:
                diffs.set_ylim(-1e-6, 1e-6)
            diffs.set_title(
                f"{title}: each run minus the reference"
                + ("  (all identical)" if identical else ""),
                fontsize=9,
            )
    for ax in axes[-1]:
        ax.set_xlabel("optimiser step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    handles = [Line2D([], [], color=color, linewidth=2) for color in colors]
    verdicts = [f"{labels[0]} (the reference)"] + [
        f"{label}: "
        + (
            "identical"
            if not any(w.values())
            else "max |diff| "
            + ", ".join(
                f"{name} {w[key]:.1e}" if w[key] else f"{name} 0"
                for key, name in (
                    ("loss", "loss"),
                    ("grad_norm", "grad norm"),
                    ("param_norm", "param norm"),
                )
            )
        )
        for label, w in zip(labels[1:], worst[1:])
    ]
    # Two columns while every verdict fits half the width at this font size; one column otherwise (a
    # long verdict in two columns runs off both edges). The figure grows by the legend's lines, so
    # no line sits on a panel.
    columns = 2 if len(runs) > 1 and max(map(len, verdicts)) <= 80 else 1
    legend_inches = 0.25 + 0.2 * -(-len(verdicts) // columns)
    fig.set_size_inches(12, 8.5 + legend_inches)
    fig.legend(handles, verdicts, loc="lower center", ncol=columns, fontsize=9, frameon=False)
    fig.suptitle(
        f"{len(runs)} runs: the curves (left), and each run minus the reference, "
        f"{labels[0]} (right)"
        if len(runs) > 1
        else labels[0],
        fontsize=11,
    )
    fig.tight_layout(rect=(0, legend_inches / fig.get_figheight(), 1, 1))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out


def expert_load(metrics: dict) -> dict:
    """An MoE run's load, per step: for each MoE layer, each expert's share of the token slots the
    experts computed (the record's ``tokens_per_expert``, common/moe.py: the step's micro-batches;
    1/E each when the router balances), and the fraction of slots dropped by capacity."""
    records = [r for r in metrics["records"] if r.get("moe")]
    if not records:
        raise UserError(
            '--expert-load: this run trained no mixture of experts (no "moe" in its records); '
            "give a run of --moe-experts E"
        )
    layers = len(records[0]["moe"]["tokens_per_expert"])
    return {
        "steps": [r["step"] for r in records],
        "share": [
            [
                [
                    n / sum(r["moe"]["tokens_per_expert"][layer])
                    for n in r["moe"]["tokens_per_expert"][layer]
                ]
                for r in records
            ]
            for layer in range(layers)
        ],
        "dropped": [
            [r["moe"]["dropped_fraction"][layer] for r in records] for layer in range(layers)
        ],
    }


def plot_expert_load(name: str, out: Path) -> Path:
    """``expert_load`` drawn: a panel per MoE layer (the first 4), a line per expert, the balanced
    1/E dashed, and the dropped fraction below them."""
    check_figure_path(out, "--out")
    path, metrics = parity.load_run(name)
    load = expert_load(metrics)
    shown = load["share"][:4]
    experts = len(shown[0][0])
    fig, axes = plt.subplots(
        2, len(shown), figsize=(4 * len(shown) + 2, 6), dpi=110, sharex=True, squeeze=False
    )
    for layer, (share, ax, low) in enumerate(zip(shown, axes[0], axes[1])):
        for expert in range(experts):
            ax.plot(
                load["steps"],
                [step[expert] for step in share],
                linewidth=1.2,
                marker="o",
                markersize=3,
                label=f"expert {expert}",
            )
        ax.axhline(1 / experts, color="gray", linestyle="--", linewidth=0.8)
        ax.set_title(f"MoE layer {layer}: each expert's share of the slots computed", fontsize=9)
        low.plot(
            load["steps"],
            load["dropped"][layer],
            color="black",
            linewidth=1.2,
            marker="o",
            markersize=3,
        )
        low.set_ylim(bottom=0)
        low.set_title("dropped by capacity", fontsize=9)
        low.set_xlabel("optimiser step")
        low.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0][0].legend(fontsize=8, ncol=2 if experts > 4 else 1)
    fig.suptitle(
        f"{path.name}: expert load ({experts} experts, dashed: balanced, 1/{experts})", fontsize=11
    )
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out


def main() -> int:
    parser = OneLineParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("runs", nargs="+", help="step names, step folders or run folders")
    parser.add_argument("--out", type=Path, help="PNG path (default: runs/plots/<a>_vs_<b>.png)")
    parser.add_argument(
        "--expert-load",
        action="store_true",
        help="one MoE run's expert load instead (default: runs/plots/<run>_expert_load.png)",
    )
    args = parser.parse_args()
    if args.expert_load:
        if len(args.runs) != 1:
            raise UserError(f"--expert-load draws one run, got {len(args.runs)}: give one run")
        default = parity.REPO_ROOT / "runs" / "plots" / f"{Path(args.runs[0]).name}_expert_load.png"
        print(f"wrote {plot_expert_load(args.runs[0], args.out or default)}")
        return 0
    default = (
        parity.REPO_ROOT
        / "runs"
        / "plots"
        / ("_vs_".join(Path(r).name for r in args.runs) + ".png")
    )
    print(f"wrote {plot_runs(args.runs, args.out or default)}")
    return 0


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main))
