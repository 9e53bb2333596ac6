"""What did each run cost, and what did it buy?
Device-hours and tokens per device-hour, side by side.

    # short step names (runs/<step>) or run folders
    python compare/cost.py step0 step1 step7 runs/x

A device is what the job held: a GPU, or a rank on the CPU. Every record of a run says what its step
cost (``device_s``: the job's devices x the wall time since the previous record, the logging
included; common/metrics.py), and ``metrics.json``'s ``cost`` sums them over every launch of the
run, a resumed run's earlier launches included. The table gives, per run: devices, steps, tokens,
device-seconds, device-hours, tokens per device-hour (the efficiency to compare layouts by: the same
model and tokens at a lower cost), tokens per second per device, and the final loss. On the CPU
these are lessons, not prices: ranks share the machine's cores, so more ranks do not buy more
compute. Each node's samples and tokens per second (median over the steps) are in
``cost["per_node"]`` and the run's last line. Exit 0, or 2 on bad input.
"""

import argparse
import sys
from pathlib import Path

# config.py, as every step has it
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "common"))
import parity  # noqa: E402
from config import OneLineParser, UserError, exit_on_user_error  # noqa: E402


def run_cost(name: str) -> dict:
    """One row: the run's ``cost`` with its name, steps and final loss;
    ``UserError`` for a run without one."""
    run, metrics = parity.load_run(name)
    cost = metrics.get("cost")
    if not isinstance(cost, dict) or not cost.get("steps_timed"):
        raise UserError(
            f"{run}/metrics.json has no cost (written before runs recorded it); run the step again"
        )
    return {
        "run": str(run),
        "steps": len(metrics["records"]),
        "loss": metrics["records"][-1]["loss"],
        **cost,
    }


def report(rows: list[dict]) -> str:
    lines = [
        f"{'run':<28}{'devices':>8}{'steps':>7}{'tokens':>12}{'device-s':>11}{'device-h':>10}"
        f"{'tokens/device-h':>17}{'tokens/s/device':>17}{'loss':>8}"
    ]
    for r in rows:
        per_second = r["tokens"] / r["device_s"] if r["device_s"] > 0 else 0.0
        lines.append(
            f"{Path(r['run']).name:<28}{r['devices']:>8}{r['steps']:>7}{r['tokens']:>12,}"
            f"{r['device_s']:>11,.1f}{r['device_hours']:>10.3g}"
            f"{r['tokens_per_device_hour'] or 0:>17,.0f}"
            f"{per_second:>17,.0f}{r['loss']:>8.4f}"
        )
    devices = sorted({r["device"] for r in rows})
    lines.append(f"devices: {', '.join(devices)}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = OneLineParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    parser.add_argument("runs", nargs="+", help="steps (step1: runs/<step folder>) or run folders")
    print(report([run_cost(name) for name in parser.parse_args(argv).runs]))
    return 0


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main))
