"""Memory per rank, measured vs the ZeRO paper's formulas, for any run; and a bar chart of several.

    python compare/memory.py step1 step5 step6            # one table per run, every rank
    python compare/memory.py runs/a runs/b --png mem.png   # and a bar chart of them
    python compare/memory.py step6 --check                 # exit 1 if a rank is off by more than 2%
    # bytes per rank against N: formulas, runs as points
    python compare/memory.py runs/scaling/* --scaling-png docs/images/memory_scaling.png

With Ψ parameters, fp32 AdamW (two moments) and N ranks, the bytes each rank holds outside backward:

    strategy            parameters  gradients  optimizer state
    DDP (steps 0-4)     4Ψ          4Ψ         8Ψ
    ZeRO-1 (step 5)     4Ψ          4Ψ         8Ψ/N
    ZeRO-2 (step 6)     4Ψ          4Ψ/N       8Ψ/N
    ZeRO-3 (step 7)     4Ψ/N        4Ψ/N       8Ψ/N
    ZeRO-3 offloaded    4Ψ/N        4Ψ/N       8Ψ/N,
                                               on the host with 4Ψ/N of float32 copies (``host``)

With ``--param-dtype bf16|fp16`` (steps 0, 5, 6, 7: 16-bit parameters, float32 masters of the owned
elements, gradients reduced and kept in float32; docs/mixed_precision.md):

    strategy            parameters  gradients        float32 masters  optimizer state
    one process (0)     2Ψ          4Ψ               4Ψ               8Ψ
    ZeRO-1 (step 5)     2Ψ          4Ψ (main_grad)   4Ψ/N             8Ψ/N     = 2Ψ + 4Ψ + 12Ψ/N
    ZeRO-2 (step 6)     2Ψ          4Ψ/N (shards)    4Ψ/N             8Ψ/N     = 2Ψ + 16Ψ/N
    ZeRO-3 (step 7)     4Ψ/N (its float32 shards are the masters)  4Ψ/N  8Ψ/N   = 16Ψ/N

HSDP (step 7's ``--replicate R``): N above is the N/R ranks each unit is sharded over.

Measured: each record's ``memory`` entry of every rank (taken after the optimiser step, before the
gradients are freed), last step. Ψ is counted from the final weights (a tied tensor once).
"""

import argparse
import math
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# config.py, as every step has it
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "common"))
import parity  # noqa: E402
from config import OneLineParser, UserError, exit_on_user_error  # noqa: E402
from plot import check_figure_path  # noqa: E402

TOLERANCE = 0.02
KINDS = ("params", "grads", "master_params", "optimizer_state")
# Bytes per parameter of each kind, and whether it is
# divided by N: (params, grads, masters, optimizer state).
FORMULAS = {
    "DDP": ((4, False), (4, False), (0, False), (8, False)),
    "ZeRO-1": ((4, False), (4, False), (0, False), (8, True)),
    "ZeRO-2": ((4, False), (4, True), (0, False), (8, True)),
    "ZeRO-3": ((4, True), (4, True), (0, False), (8, True)),
    # --param-dtype bf16|fp16: 16-bit parameters; gradients reduced into float32 (whole in step 5's
    # main_grad, shards in step 6); float32 masters of the owned elements. Step 7's float32 shards
    # are its masters, so its formula is ZeRO-3's.
    "DDP 16-bit": ((2, False), (4, False), (4, False), (8, False)),
    "ZeRO-1 16-bit": ((2, False), (4, False), (4, True), (8, True)),
    "ZeRO-2 16-bit": ((2, False), (4, True), (4, True), (8, True)),
}


def strategy(step: str) -> str:
    number = int(step[4]) if step.startswith("step") and step[4:5].isdigit() else -1
    if number in (5, 6, 7):
        return {5: "ZeRO-1", 6: "ZeRO-2", 7: "ZeRO-3"}[number]
    if 0 <= number <= 4:
        return "DDP"
    raise UserError(f"no memory formula for {step!r}: steps 0-7 have one")


def expected(name: str, psi: int, world_size: int) -> dict:
    return {
        kind: per_param * psi / (world_size if sharded else 1)
        for kind, (per_param, sharded) in zip(KINDS, FORMULAS[name])
    }


def measure(run_name: str) -> tuple[Path, str, int, int, list[dict]]:
    run, metrics = parity.load_run(run_name)
    psi = sum(math.prod(f["shape"]) for f in metrics["final"]["fingerprints"].values())
    memory = metrics["records"][-1]["memory"]
    if not isinstance(memory, list):
        raise UserError(f"{run}: memory of one rank only (an older run); run the step again")
    name = strategy(metrics["config"]["step"])
    if (
        metrics["config"].get("param_dtype", "float32") != "float32"
        and f"{name} 16-bit" in FORMULAS
    ):
        name = f"{name} 16-bit"
    # HSDP (step 7's --replicate R): the shards are over
    # the N/R ranks of a row, so the formula's N is N/R
    shards = metrics["env"]["world_size"] // metrics["config"].get("replicate", 1)
    # per rank: each kind's bytes, and ``host`` (the bytes
    # --offload-optimizer keeps on the host; None without it)
    return (
        run,
        name,
        psi,
        shards,
        [{**{kind: m.get(kind, 0) for kind in KINDS}, "host": m.get("host")} for m in memory],
    )


def report(run_name: str) -> tuple[str, bool]:
    run, name, psi, world_size, memory = measure(run_name)
    formula = expected(name, psi, world_size)
    replicate = parity.load_run(run_name)[1]["config"].get("replicate", 1)
    hsdp = f" (HSDP: {world_size * replicate} ranks, {replicate} replicas of {world_size})"
    lines = [
        f"{run}: {name}, N = {world_size}{hsdp if replicate > 1 else ''}, Ψ = {psi:,} parameters"
    ]
    lines.append(
        f"  {'rank':>4}  " + "  ".join(f"{kind + ' (measured / formula)':>40}" for kind in KINDS)
    )
    ok = True
    for rank, m in enumerate(memory):
        cells = []
        for kind in KINDS:
            if formula[kind] == 0:  # no masters in float32 training
                ok &= m[kind] == 0
                cells.append(f"{m[kind]:>13,} / {0:>13,}" + " " * 10)
                continue
            off = m[kind] / formula[kind] - 1
            ok &= abs(off) <= TOLERANCE
            cells.append(f"{m[kind]:>13,} / {formula[kind]:>13,.0f} ({off:+.2%})")
        lines.append(f"  {rank:>4}  " + "  ".join(f"{c:>40}" for c in cells))
    hosts = [m["host"] for m in memory]
    # --offload-optimizer: AdamW's state and a float32 copy of the shard, on the host
    if hosts[0] is not None:
        host = 12 * psi / world_size
        ok &= all(abs(h / host - 1) <= TOLERANCE for h in hosts)
        lines.append(
            "  host (--offload-optimizer), measured / 12Ψ/N: "
            + ", ".join(f"{h:,} / {host:,.0f} ({h / host - 1:+.2%})" for h in hosts)
        )
    lines.append(f"  every rank within {TOLERANCE:.0%} of the formula: {'yes' if ok else 'NO'}")
    return "\n".join(lines), ok


def bar_chart(run_names: list[str], out: Path) -> Path:
    runs = [measure(name) for name in run_names]
    fig, ax = plt.subplots(figsize=(1.6 + 1.3 * len(runs), 4.5), dpi=110)
    for x, (*_, memory) in enumerate(runs):
        bottom = 0.0
        worst = max(memory, key=lambda m: sum(m[k] for k in KINDS))  # the rank that holds the most
        for kind, color in zip(KINDS, ("tab:blue", "tab:orange", "tab:purple", "tab:green")):
            ax.bar(
                x, worst[kind] / 2**20, bottom=bottom, color=color, label=kind if x == 0 else None
            )
            bottom += worst[kind] / 2**20
    ax.set_xticks(range(len(runs)), [f"{name}\nN = {ws}" for _, name, _, ws, _ in runs])
    ax.set_ylabel("MiB per rank (the rank holding most)")
    ax.set_title("parameters + gradients + optimizer state per rank")
    ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out


def formula_text(name: str) -> list[str]:
    """The formula's terms, as written in the docstring: ["4Ψ", "4Ψ", "8Ψ/N"]."""
    return [
        f"{per_param}Ψ{'/N' if sharded else ''}"
        for per_param, sharded in FORMULAS[name]
        if per_param
    ]


def one_model(runs: list) -> int:
    """Ψ of runs (as ``measure`` returns them) that must all be of one model."""
    psis = sorted({psi for _, _, psi, _, _ in runs})
    if len(psis) > 1:
        raise UserError(
            "--scaling-png needs runs of one model; these have Ψ = "
            f"{', '.join(f'{p:,}' for p in psis)}"
        )
    return psis[0]


def scaling_chart(run_names: list[str], out: Path) -> Path:
    """Bytes per rank (parameters + gradients + optimizer state, the rank holding most) against the
    world size: each strategy's formula as a line over N = 1 to max(4, the largest N run), each run
    as a point on it. The runs must be of one model (one Ψ): the lines are drawn for that Ψ."""
    runs = [measure(name) for name in run_names]
    psi, sizes = one_model(runs), range(1, max(4, *(ws for _, _, _, ws, _ in runs)) + 1)
    fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=110)
    drawn = [name for name in FORMULAS if "16-bit" not in name or any(r[1] == name for r in runs)]
    for name, color in zip(
        drawn,
        ("tab:gray", "tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:olive", "tab:cyan"),
    ):
        ax.plot(
            sizes,
            [sum(expected(name, psi, n).values()) / 2**20 for n in sizes],
            color=color,
            linewidth=1.5,
            label=f"{name}: {'+'.join(formula_text(name))}",
        )
        points = [
            (ws, max(sum(m[k] for k in KINDS) for m in memory) / 2**20)
            for _, strategy_name, _, ws, memory in runs
            if strategy_name == name
        ]
        if points:
            ax.scatter(*zip(*points), color=color, edgecolor="black", s=45, zorder=3)
    ax.scatter(
        [], [], color="white", edgecolor="black", s=45, label="measured (a run's rank holding most)"
    )
    ax.set_xticks(list(sizes))
    ax.set_xlabel("world size N (ranks)")
    ax.set_ylabel("MiB per rank")
    ax.set_ylim(bottom=0)
    ax.set_title(f"parameters + gradients (+ float32 masters) + AdamW state per rank, Ψ = {psi:,}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out


def main() -> int:
    parser = OneLineParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("runs", nargs="+", help="step names (step5), step folders or run folders")
    parser.add_argument("--png", type=Path, help="also draw a bar chart of the runs here")
    parser.add_argument(
        "--scaling-png",
        type=Path,
        help="also draw bytes per rank against N here: the formulas as "
        "lines, the runs (of one model) as points",
    )
    parser.add_argument(
        "--check", action="store_true", help="exit 1 unless every rank is within 2%% of its formula"
    )
    args = parser.parse_args()
    for flag in ("png", "scaling_png"):  # a figure it cannot write fails now, not after the tables
        if getattr(args, flag):
            check_figure_path(getattr(args, flag), f"--{flag.replace('_', '-')}")
    if args.scaling_png:
        one_model([measure(name) for name in args.runs])  # before any output: a mistake is one line
    all_ok = True
    for name in args.runs:
        text, ok = report(name)
        all_ok &= ok
        print(text)
    if args.png:
        print(f"bar chart: {bar_chart(args.runs, args.png)}")
    if args.scaling_png:
        print(f"scaling chart: {scaling_chart(args.runs, args.scaling_png)}")
    return 1 if args.check and not all_ok else 0


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main))
