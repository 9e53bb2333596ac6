"""The pipeline bubble, measured: step 9 at P = 2 and 4 stages with M = 1, 2, 4, 8 micro-batches,
each stage's idle fraction of its last step against the ideal schedule's (P - 1) / (M + P - 1),
(P - 1) / (V M + P - 1) interleaved over V = 2 chunks per stage (M a multiple of P),
(P - 1) / (3 M + P - 1) zero bubble, and the micro-batches whose activations each stage held at
once (GPipe: M; 1F1B: at most P - s on stage s; interleaved: (V - 1) P + 2 (P - s - 1) + 1 chunks'
worth; zero bubble: min(P, M), each until its W), and the activation bytes each stage sent,
M B S h x 4 per hop: V hops out and V back, one fewer at either end.

    python compare/bubble.py                        # every schedule, a table, runs/plots/bubble.png
    python compare/bubble.py --stages 2 --micro-batches 1 4 --schedules 1f1b
    # the compute simulated: the schedules alone
    python compare/bubble.py --simulate-ms 20 --micro-batches 4 8

Each run is step 9's trainer with --trace (its bubble.json and pipeline.png land in
runs/bubble/<run>/). A model of 8 blocks, width 128, micro-batches of 4 x 64 tokens: big enough that
compute, not launching, fills a stage. On a machine with fewer cores than stages the stages also
wait for a core; the table says so.

``--simulate-ms F``: step 9's ``Pipeline`` as it is (schedules, messages, waits) around stages whose
work is a sleep, so each stage has a "device" of its own however few the cores: one layer whose
forward sleeps F, the gradient of its output (B) F and of its weight (W) F (a whole backward B + W;
the interleaved schedule's chunks F / 2 each). The idle fractions of the second step then measure
the schedule against its formula.
"""

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

# config.py, as every step has it
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "common"))
from config import OneLineParser, UserError, exit_on_user_error  # noqa: E402
from launch import run_trainer, spawn_ranks  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
STEP = "step9_pipeline_parallel"
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")
VIRTUAL = 2  # the interleaved schedule's chunks per stage
WIDTH = 8  # --simulate-ms: the layer's width, its real compute negligible beside the sleeps


def sleepy_stage(seconds: float):
    """One layer whose forward, output gradient (B) and weight gradient (W) each take ``seconds``: a
    Linear whose forward sleeps and whose weight's gradient hook sleeps (W), then an identity whose
    backward sleeps (B: it lies on the path to the stage's input and to the layer's output, not on
    the path to the weight)."""
    import torch

    class SleepOnBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            time.sleep(seconds)
            return grad

    class SleepyLinear(torch.nn.Linear):
        def __init__(self):
            super().__init__(WIDTH, WIDTH, bias=False)
            self.weight.register_hook(lambda grad: time.sleep(seconds) or grad)

        def forward(self, x):
            time.sleep(seconds)
            return super().forward(x)

    class Backward(torch.nn.Module):
        def forward(self, x):
            return SleepOnBackward.apply(x)

    return torch.nn.Sequential(SleepyLinear(), Backward())


def simulated(rank: int, world_size: int, port: int, args) -> list:
    """Every schedule and M of ``args`` on ``world_size`` sleeping stages: each stage's idle
    fraction of the second step, the formula's, and the micro-batches held at once."""
    sys.path.insert(0, str(REPO_ROOT / STEP))
    import torch
    import torch.distributed as dist

    from pipeline import Pipeline
    from pipeline_schedules import ideal_bubble
    from pipeline_trace import idle_fractions

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    P, rows = world_size, []
    for schedule in args.schedules:
        for m in args.micro_batches:
            if (
                schedule == "interleaved-1f1b"
                and (m % P or P < 2)
                or schedule == "zero-bubble"
                and P < 2
            ):
                continue
            chunks = 2 if schedule == "interleaved-1f1b" else 1
            stages = [sleepy_stage(args.simulate_ms / 1e3 / chunks) for _ in range(chunks)]
            pipe = Pipeline(
                stages if chunks > 1 else stages[0],
                rank,
                P,
                (1, WIDTH),
                loss_fn=torch.nn.functional.mse_loss,
                schedule=schedule,
            )
            data = [torch.randn(1, WIDTH) for _ in range(m)]
            for step in range(2):
                pipe.timeline = [] if step == 1 else None
                dist.barrier()
                pipe.run(
                    m, inputs=data if rank == 0 else None, targets=data if rank == P - 1 else None
                )
                pipe.finish_gradient_synchronization()
            everyone = [None] * P
            dist.all_gather_object(
                everyone, (pipe.timeline, pipe.take_peak_in_flight(), pipe.peak_deferred)
            )
            rows.append(
                {
                    "schedule": schedule,
                    "stages": P,
                    "micro_batches": m,
                    "held": [e[1] for e in everyone],
                    "waiting": [e[2] for e in everyone],
                    "idle": idle_fractions([e[0] for e in everyone]),
                    "ideal": ideal_bubble(schedule, P, m, chunks),
                }
            )
    dist.destroy_process_group()
    return rows


# MODEL's micro-batch x sequence x width, float32: one message's bytes
ACTIVATION = 4 * 64 * 128 * 4
MODEL = [
    "--n-layer",
    "8",
    "--n-embd",
    "128",
    "--n-head",
    "4",
    "--seq-len",
    "64",
    "--micro-batch-size",
    "4",
    "--steps",
    "3",
    "--save-every",
    "0",
    "--quiet",
    "--trace",
]


def main() -> int:
    parser = OneLineParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--schedules", nargs="+", choices=SCHEDULES, default=list(SCHEDULES))
    parser.add_argument("--runs-dir", type=Path, default=REPO_ROOT / "runs" / "bubble")
    parser.add_argument("--png", type=Path, default=REPO_ROOT / "runs" / "plots" / "bubble.png")
    parser.add_argument(
        "--simulate-ms",
        type=float,
        default=None,
        metavar="F",
        help="stages that sleep F ms a forward, B and W (the schedules alone; see above)",
    )
    args, extra = parser.parse_known_args()
    if (
        any(not 1 <= p <= 4 for p in args.stages)
        or any(m < 1 for m in args.micro_batches)
        or args.simulate_ms is not None
        and not args.simulate_ms > 0
    ):
        raise UserError(
            "--stages must be 1 to 4 (the runs share this machine's cores), "
            "--micro-batches at least 1 "
            "and --simulate-ms positive"
        )
    if args.png.suffix != ".png":
        raise UserError(f"--png {args.png}: name a .png file")
    results = []
    if args.simulate_ms is not None:
        for stages in args.stages:
            results += spawn_ranks(simulated, stages, args, timeout=600)[0]
    for schedule in args.schedules if args.simulate_ms is None else ():
        for stages in args.stages:
            for m in args.micro_batches:
                interleaved = schedule == "interleaved-1f1b"
                if interleaved and (m % stages or stages < 2):
                    print(
                        f"skipping {schedule} P={stages} M={m}: it runs whole rounds "
                        "of P >= 2 micro-batches"
                    )
                    continue
                out = args.runs_dir / f"{schedule}_p{stages}_m{m}"
                print(f"running {schedule} P={stages} M={m} ...", flush=True)
                chunks = ["--virtual-stages", str(VIRTUAL)] if interleaved else []
                run_trainer(
                    STEP,
                    stages,
                    [
                        *MODEL,
                        "--grad-accum",
                        str(m),
                        "--schedule",
                        schedule,
                        *chunks,
                        "--out",
                        str(out),
                        *extra,
                    ],
                    out / "train.log",
                )
                bubble = json.loads((out / "bubble.json").read_text())
                last = json.loads((out / "metrics.json").read_text())["records"][-1]
                held = [memory["micro_batches_in_flight"] for memory in last["memory"]]
                sent = [
                    c.get("p2p activations", 0) + c.get("p2p activation gradients", 0)
                    for c in last["comm"]
                ]
                results.append({"schedule": schedule, **bubble, "held": held, "sent": sent})

    cores = os.cpu_count()
    compute = (
        f"compute simulated, {args.simulate_ms:g} ms" if args.simulate_ms else f"{cores} CPU cores"
    )
    print(
        "\nidle fraction of the last step per stage vs its schedule's (ideal); "
        "micro-batches (interleaved: "
        f"chunk micro-batches) held at once ({compute})"
    )
    print(
        f"{'schedule':<16} {'P':>2} {'M':>2} {'ideal':>6}  {'idle per stage':<28} "
        f"{'held per stage':<14} formula"
    )
    for r in results:
        p, m = r["stages"], r["micro_batches"]
        formula = {
            "gpipe": [m] * p,
            "1f1b": [min(p - s, m) for s in range(p)],
            "interleaved-1f1b": [
                min((VIRTUAL - 1) * p + 2 * (p - s - 1) + 1, m * VIRTUAL) for s in range(p)
            ],
            "zero-bubble": [min(p, m)] * p,
        }
        formula = formula[r["schedule"]]
        idle = " ".join(f"{f:.2f}" for f in r["idle"])
        waiting = ""
        # activations out and gradients back, B S h x 4 bytes each, V times interleaved
        if "sent" in r:
            chunks = VIRTUAL if r["schedule"] == "interleaved-1f1b" else 1
            sent = [m * ACTIVATION * (2 * chunks - (s == p - 1) - (s == 0)) for s in range(p)]
            waiting = (
                "; p2p bytes = formula"
                if r["sent"] == sent
                else f"; p2p bytes {r['sent']} differ from {sent}"
            )
        # W's deferred at once: min(s + 1, M) on stage s
        if r["schedule"] == "zero-bubble" and "waiting" in r:
            waiting = [min(s + 1, m) for s in range(p)]
            waiting = (
                f"; W's waiting {r['waiting']}, formula "
                f"{waiting}{'' if r['waiting'] == waiting else ' differs'}"
            )
        print(
            f"{r['schedule']:<16} {p:>2} {m:>2} {r['ideal']:>6.2f}  {idle:<28} "
            f"{str(r['held']):<14} {formula}"
            f"{'' if r['held'] == formula else '  <-- differs'}{waiting}"
        )

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        1, len(args.stages), figsize=(5 * len(args.stages), 3.6), dpi=110, squeeze=False
    )
    for ax, p in zip(axes[0], args.stages):
        ms = sorted(args.micro_batches)
        ax.plot(ms, [(p - 1) / (m + p - 1) for m in ms], "k--", label="(P-1)/(M+P-1)")
        ax.plot(
            ms, [(p - 1) / (VIRTUAL * m + p - 1) for m in ms], "k:", label=f"(P-1)/({VIRTUAL}M+P-1)"
        )
        ax.plot(ms, [(p - 1) / (3 * m + p - 1) for m in ms], "k-.", label="(P-1)/(3M+P-1)")
        for schedule, marker in (
            ("gpipe", "o"),
            ("1f1b", "s"),
            ("interleaved-1f1b", "^"),
            ("zero-bubble", "D"),
        ):
            rows = sorted(
                (r for r in results if r["schedule"] == schedule and r["stages"] == p),
                key=lambda r: r["micro_batches"],
            )
            if rows:
                mean = [sum(r["idle"]) / p for r in rows]
                ax.plot(
                    [r["micro_batches"] for r in rows],
                    mean,
                    marker=marker,
                    label=f"{schedule}: mean over stages",
                )
        ax.set_xscale("log", base=2)
        ax.set_xticks(ms, [str(m) for m in ms])
        ax.set_xlabel("micro-batches M")
        ax.set_ylabel("idle fraction of the step")
        ax.set_title(f"P = {p} stages ({compute})")
        ax.set_ylim(0, 1)
        ax.legend(fontsize=8)
    fig.tight_layout()
    args.png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.png)
    print(f"plot: {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main))
