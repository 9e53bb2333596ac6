"""The tour: run every step that exists with its default config, check parity, plot, summarise.

    python compare/tour.py                 # CPU, world size 2, a few minutes on 2 cores
    python compare/tour.py --nproc 3       # another world size
    python compare/tour.py --steps 10      # extra flags after the known ones go to every trainer

Step 0 runs as one process accumulating ``grad_accum x nproc`` micro-batches, so its global
batches are the distributed steps' global batches. Every distributed step runs under torchrun
with ``--nproc`` ranks. Then each step is compared with step 1, the PyTorch DDP reference: the
parity contract must hold for steps 2 and up (bitwise at world size 2 with default flags); the
tour fails otherwise. Step 0 is compared too, and its difference printed: its micro-batches hold
other samples than the ranks' do, so its sums round differently (docs/parity.md measures it). Steps
8 and up split the model, not the batch: their ``--nproc`` ranks share one stream of micro-batches,
accumulating ``grad_accum x nproc`` of them as step 0 does. Step 9 (pipeline parallelism) changes no
sum, so it must be bitwise equal to step 0; so must its zero-bubble schedule (runs/zero_bubble) and
its interleaved one (2 chunks per rank), run once more beside step 0 on a model of 2 x nproc blocks
(or the --n-layer given, if more), in runs/interleaved. Step 8 (tensor parallelism) sums inside each
layer in another order than step 1; its difference is printed the same way (the first step's loss
and gradient norm relative to step 1's, and the drift), and, without --amp, judged against step 0's
own drift from step 1 on this machine (compare/other_order.py: within 10 times it, the first loss to
1e-6), so the verdict does not change with the CPU; it is skipped when ``--nproc`` does not divide
its heads. Step 12 (expert parallelism) trains a mixture of experts, not the tour's model: it runs
beside step 0 training the same one (runs/moe; one sample a micro-batch, 2 x nproc experts), bitwise
equal to it at 2 ranks. Step 10 runs its ``--nproc`` ranks as a dp x tp mesh, tp = 2 and dp = nproc
/ 2, each replica accumulating as many micro-batches as make step 1's global batch (at 2 ranks: one
replica of tp 2, step 8's run); its difference to step 1 is step 8's kind, printed the same way
(skipped for an odd ``--nproc``). Step 11 splits every sequence over the ``--nproc`` ranks (skipped
when 2 x nproc chunks do not cut ``--seq-len``); printed as step 8 is. It also says whether a run
had a rank consistently slower than the others (compare/stragglers.py): that is information, not a
failure. Each step writes runs/<step folder>; its output goes to runs/tour/<step folder>.log
(see --runs-dir).
"""

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

# config.py, as every step has it
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "common"))
import other_order  # noqa: E402
import parity  # noqa: E402
import stragglers  # noqa: E402
from config import (  # noqa: E402
    OneLineParser,
    UserError,
    build_parser,
    check_config,
    check_writable_folder,
    exit_on_user_error,
)
from data import check_enough_data, load_corpus  # noqa: E402
from launch import run_trainer  # noqa: E402
from plot import plot_expert_load, plot_runs  # noqa: E402

REPO_ROOT = parity.REPO_ROOT
DEFAULT_GRAD_ACCUM = 2


def number(step: str) -> int:
    """7 for step7_zero3: prefixes would take step10 for step1."""
    return int(step[4:].split("_")[0])


def shown(path: Path) -> Path:
    """``path`` relative to the current folder when it lies inside it:
    shorter to read and to paste."""
    path = Path(path).resolve()
    return path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path


def check_the_data_feeds(nproc: int, extra: list[str]) -> tuple[dict, int]:
    """Refuse, before any trainer starts, flags a trainer would refuse,
    and an --nproc the corpus cannot feed.

    The trainers would refuse them too, but step 0 first and in its own terms: it runs as one
    process accumulating 2 x nproc micro-batches, so too many ranks would read as a --grad-accum it
    cannot feed."""
    try:
        config = vars(
            build_parser("tour").parse_args(["--grad-accum", str(DEFAULT_GRAD_ACCUM), *extra])
        )
    except UserError as error:  # the trainer's --help lists the flags, the tour's does not
        raise UserError(
            "the tour passes the flags it does not know to every step, step 0 "
            f"included: {str(error).removesuffix(' (see --help)')}; "
            "python step0_single_gpu/train.py --help lists them"
        ) from None
    check_config(config)
    corpus = load_corpus(config["data"], config["tokenizer"], config["seq_len"])
    check_enough_data(len(corpus.blocks), nproc, config["micro_batch_size"], config["grad_accum"])
    return config, corpus.vocab_size


SPLITS_HEADS = {8}  # tensor parallelism: --nproc must divide the heads and the vocabulary
MESH = 10  # step 10: a dp x tp mesh, tp = 2
CONTEXT = 11  # step 11: the sequence cut into 2 x nproc chunks
EXPERTS = 12  # step 12: an MoE model (--moe-experts), compared with step 0 training the same one


def mesh_flags(nproc: int) -> list[str]:
    """Step 10's mesh in the tour: tp = 2 inside, dp = nproc / 2 replicas, each accumulating 2 x
    nproc / dp micro-batches: step 1's global batch."""
    dp = nproc // 2
    return ["--tp", "2", "--dp", str(dp), "--grad-accum", str(DEFAULT_GRAD_ACCUM * nproc // dp)]


def run_schedule(
    folder: str,
    flags: list[str],
    single: str,
    pipeline: str,
    args,
    extra: list[str],
    timeout: list[str],
    layers: list[str] = (),
) -> tuple:
    """Step 9 with ``flags`` (another schedule) in runs/<folder>; its parity with the tour's step 0,
    or, given ``layers`` (a deeper model), with step 0 run beside it on that model. Returns
    (parity, seconds)."""
    runs = {step: args.runs_dir / folder / step for step in (single, pipeline)}
    if not layers:
        runs[single] = args.runs_dir / single
    print(
        f"running step 9 {' '.join(flags)}{' and step 0' if layers else ''} ...",
        end=" ",
        flush=True,
    )
    started = time.perf_counter()
    if layers:
        run_step(
            single,
            args,
            [*extra, *layers],
            timeout,
            str(runs[single]),
            args.runs_dir / "tour" / f"{folder}0.log",
        )
    run_step(
        pipeline,
        args,
        [*extra, *layers, *flags],
        timeout,
        str(runs[pipeline]),
        args.runs_dir / "tour" / f"{folder}.log",
    )
    print(f"{time.perf_counter() - started:.0f} s")
    run_a, run_b, result = parity.check(str(runs[single]), str(runs[pipeline]))
    print(parity.report(run_a, run_b, result, brief=True))
    return result, time.perf_counter() - started


def run_experts(single: str, experts: str, args, extra: list[str], timeout: list[str]) -> tuple:
    """Step 12 with 2 x nproc experts split over the nproc ranks, beside step 0 training the same
    MoE model, in runs/moe: one sample a micro-batch, each rank one, step 0 accumulating nproc, so
    both hold the same micro-batches in the same order. Returns (parity, seconds)."""
    runs = {step: args.runs_dir / "moe" / step for step in (single, experts)}
    moe = [
        "--moe-experts",
        str(2 * args.nproc),
        "--moe-capacity-factor",
        "1.25",
        "--micro-batch-size",
        "1",
    ]
    print(f"running {experts} and {single} on an MoE model ...", end=" ", flush=True)
    started = time.perf_counter()
    run_trainer(
        single,
        0,
        ["--quiet", "--out", str(runs[single]), *extra, *moe, "--grad-accum", str(args.nproc)],
        args.runs_dir / "tour" / "moe_step0.log",
    )
    run_trainer(
        experts,
        args.nproc,
        [
            "--quiet",
            "--out",
            str(runs[experts]),
            *timeout,
            *extra,
            *moe,
            "--grad-accum",
            "1",
            "--ep",
            str(args.nproc),
        ],
        args.runs_dir / "tour" / "moe.log",
    )
    print(f"{time.perf_counter() - started:.0f} s")
    run_a, run_b, result = parity.check(str(runs[single]), str(runs[experts]))
    print(parity.report(run_a, run_b, result, brief=True))
    plot_expert_load(str(runs[experts]), args.runs_dir / "plots" / "expert_load.png")
    return result, time.perf_counter() - started


def splits_the_model(step: str) -> bool:
    """Steps 8 and up:
    their ranks share one stream of micro-batches (they split the model or the sequence)."""
    return number(step) >= parity.MODEL_PARALLEL_FROM


def other_order_row(result, run_a: dict, run_b: dict) -> str:
    """How far a run that sums in another order is from step 1: the first step's loss and gradient
    norm (relative), and the drift of the weights and the param norm by the end."""
    first_a, first_b = run_a["records"][0], run_b["records"][0]
    rel = {k: abs(first_b[k] - first_a[k]) / abs(first_a[k]) for k in ("loss", "grad_norm")}
    return (
        f"other summation order: step 1 loss rel diff {rel['loss']:.1e}, grad norm "
        f"{rel['grad_norm']:.1e}; "
        f"max abs diff {result.max_abs:.1e}, param norm diff {result.max_param_norm_diff:.1e}"
    )


def drift_from(reference: str, run: str) -> tuple[other_order.Drift, dict, dict]:
    """The drift of run folder ``run`` from ``reference``, with ``run``'s metrics and weights."""
    (ref_path, a), (path, b) = parity.load_run(reference), parity.load_run(run)
    weights = parity.load_weights(path, b)
    return other_order.drift(b, weights, a, parity.load_weights(ref_path, a)), b, weights


def machine() -> str:
    """The CPU and the kernels ATen chose for it: what the tour's losses, drifts and speeds depend
    on (and its 16-bit matmul units, which decide how fast bf16 runs on a CPU)."""
    import torch

    model, units = platform.processor() or platform.machine(), []
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        model = next(
            line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")
        )
        flags = next(line.split(":", 1)[1].split() for line in lines if line.startswith("flags"))
        units = [unit for unit in ("avx512_bf16", "amx_bf16") if unit in flags]
    except (OSError, StopIteration):
        pass
    return (
        f"{model}{' (' + ', '.join(units) + ')' if units else ''}, ATen kernels "
        f"{torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}"
    )


def run_step(step: str, args, extra: list[str], timeout: list[str], out: str, log: Path) -> None:
    """Run one step with the tour's flags for it (see the module's docstring)."""
    if number(step) == 0:  # one process accumulating what nproc ranks accumulate together
        run_trainer(
            step,
            0,
            ["--grad-accum", str(DEFAULT_GRAD_ACCUM * args.nproc), "--quiet", "--out", out, *extra],
            log,
        )
    elif number(step) == MESH:  # dp replicas of a tp = 2 model, step 1's global batch
        run_trainer(
            step,
            args.nproc,
            [*mesh_flags(args.nproc), "--quiet", "--out", out, *timeout, *extra],
            log,
        )
    # nproc ranks share one stream of micro-batches, as step 0's process
    elif splits_the_model(step):
        run_trainer(
            step,
            args.nproc,
            [
                "--grad-accum",
                str(DEFAULT_GRAD_ACCUM * args.nproc),
                "--quiet",
                "--out",
                out,
                *timeout,
                *extra,
            ],
            log,
        )
    else:
        run_trainer(
            step,
            args.nproc,
            ["--grad-accum", str(DEFAULT_GRAD_ACCUM), "--quiet", "--out", out, *timeout, *extra],
            log,
        )


def main() -> int:
    parser = OneLineParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nproc", type=int, default=2, help="ranks for the distributed steps")
    parser.add_argument(
        "--runs-dir",
        type=Path,
        default=REPO_ROOT / "runs",
        help="each step writes <runs-dir>/<step folder>; logs and plot go beside them",
    )
    parser.add_argument(
        "--keep-going",
        action="store_true",
        help="a step that fails is reported in the table and the others still run "
        "(compare/gpu_check.py)",
    )
    parser.add_argument(
        "--timeout-s",
        type=float,
        help="process-group timeout for the distributed steps (their default if unset)",
    )
    args, extra = parser.parse_known_args()
    timeout = ["--timeout-s", f"{args.timeout_s:g}"] if args.timeout_s is not None else []
    if any(flag == "--out" or flag.startswith("--out=") for flag in extra):
        raise UserError(
            "the tour gives every step its own run folder; use --runs-dir instead of --out"
        )
    if args.nproc < 1:
        raise UserError(f"--nproc must be at least 1, got {args.nproc}")
    # step 0 would run before step 1 refused it
    if args.timeout_s is not None and not args.timeout_s > 0:
        raise UserError(f"--timeout-s must be positive, got {args.timeout_s:g}")
    check_writable_folder(args.runs_dir, f"--runs-dir {args.runs_dir}")
    config, vocab_size = check_the_data_feeds(args.nproc, extra)
    steps, skipped, experts = [], [], None
    for step in parity.step_folders():
        if number(step) in SPLITS_HEADS and (
            config["n_head"] % args.nproc or vocab_size % args.nproc
        ):
            skipped.append(
                f"{step} (splits {config['n_head']} heads and {vocab_size} tokens: "
                "--nproc must divide both)"
            )
        elif number(step) == MESH and (args.nproc % 2 or config["n_head"] % 2 or vocab_size % 2):
            skipped.append(
                f"{step} (a dp x tp mesh with tp = 2: --nproc and the heads must be even)"
            )
        elif number(step) == EXPERTS:
            # not the tour's dense model: run beside step 0 training the same MoE (run_experts)
            experts = step
        elif number(step) == CONTEXT and config["seq_len"] % (2 * args.nproc):
            skipped.append(
                f"{step} (cuts --seq-len {config['seq_len']} into 2 x {args.nproc} chunks: "
                f"use a multiple of {2 * args.nproc})"
            )
        else:
            steps.append(step)
    runs = {step: str(args.runs_dir / step) for step in steps}
    log_dir = args.runs_dir / "tour"

    times, failed = {}, {}
    for step in steps:
        print(f"running {step} ...", end=" ", flush=True)
        started = time.perf_counter()
        try:
            run_step(step, args, extra, timeout, runs[step], log_dir / f"{step}.log")
        except UserError as error:
            if not args.keep_going:
                raise
            failed[step] = str(error)
            print(f"FAILED: {error}")
            continue
        times[step] = time.perf_counter() - started
        print(f"{times[step]:.0f} s")
    steps = [step for step in steps if step not in failed]
    if not any(number(s) == 1 for s in steps):
        raise UserError(f"step 1, the reference, failed: {'; '.join(failed.values())}")

    reference = next(s for s in steps if number(s) == 1)
    single = next((s for s in steps if number(s) == 0), None)
    results, against_step0 = {}, {}
    for step in steps:
        if step != reference:
            run_a, run_b, results[step] = parity.check(runs[reference], runs[step])
            print(parity.report(run_a, run_b, results[step], brief=True))
        # the pipeline's contract: step 0's sums, in step 0's order
        if number(step) == 9 and single:
            run_a, run_b, against_step0[step] = parity.check(runs[single], runs[step])
            print(parity.report(run_a, run_b, against_step0[step], brief=True))
    pipeline = next((s for s in steps if number(s) == 9), None)
    schedules = {}
    if single and pipeline and args.nproc >= 2:  # both schedules need 2 or more stages
        schedules["  zero bubble"] = run_schedule(
            "zero_bubble", ["--schedule", "zero-bubble"], single, pipeline, args, extra, timeout
        )
        schedules["  interleaved, V = 2"] = run_schedule(  # a model of 2 chunks per rank at least
            "interleaved",
            ["--schedule", "interleaved-1f1b", "--virtual-stages", "2"],
            single,
            pipeline,
            args,
            extra,
            timeout,
            ["--n-layer", str(max(config["n_layer"], 2 * args.nproc))],
        )
    moe = None
    if single and experts:
        try:
            moe = run_experts(single, experts, args, extra, timeout)
        except UserError as error:
            if not args.keep_going:
                raise
            failed[experts] = str(error)
            print(f"FAILED: {error}")
    # The reference first: the difference panel then shows every step against PyTorch DDP.
    plot = plot_runs(
        [runs[reference]] + [runs[s] for s in steps if s != reference],
        args.runs_dir / "plots" / "tour.png",
    )

    # Two correct implementations in other orders, on this machine: what a model-splitting step may
    # drift. In 32 bits: under 16-bit autocast a split matmul rounds its partial sums in 16 bits,
    # and the first loss is no longer float32's to round (step 8 at bf16: 2.2e-6 relative), so such
    # a tour prints the drift alone.
    order_reference = (
        drift_from(runs[reference], runs[single])[0] if single and config["amp"] == "none" else None
    )
    print(
        f"\nmachine: {machine()} (final losses, differences and tok/s are this "
        "machine's; the verdicts hold "
        "on any)"
    )
    print(
        f"{'step':<24} {'ranks':>5} {'time':>6} {'final loss':>10} {'tok/s':>8}  "
        f"parity vs {reference}"
    )
    all_passed = True
    for step in steps:
        _, metrics = parity.load_run(runs[step])
        records = metrics["records"]
        if step == reference:
            verdict = "(reference)"
        elif number(step) in (0, 9):
            # Not a parity check: one process sums its
            # micro-batches in another order (see docs/parity.md).
            verdict = (
                "same global batches, other summation order: max abs diff "
                f"{results[step].max_abs:.1e}, "
                f"param norm diff {results[step].max_param_norm_diff:.1e}"
            )
            if step in against_step0:  # one pipeline sums as one process: bitwise equal to step 0
                bitwise = against_step0[step].passed and against_step0[step].bitwise
                all_passed &= bitwise  # at any --nproc, with any flags: no sum changes order
                verdict = (
                    f"vs {single}: {parity.verdict(against_step0[step])}"
                    f"{'' if bitwise else '  <-- expected bitwise identical'}; {verdict}"
                )
        elif splits_the_model(step):
            # Not a parity check against step 1 either: the layers sum their products in another
            # order (the step's README; its bitwise check is against PyTorch's own implementation).
            verdict = other_order_row(results[step], parity.load_run(runs[reference])[1], metrics)
            # judged by step 0's own drift from step 1, measured here
            if order_reference is not None:
                drift, run_metrics, run_weights = drift_from(runs[reference], runs[step])
                beyond = other_order.beyond(
                    drift, other_order.bound(order_reference, run_metrics, run_weights)
                )
                all_passed &= not beyond
                verdict += (
                    "; "
                    f"{drift.weights / max(order_reference.weights, other_order.EPS):.1f}x "
                    "step 0's "
                    f"drift: {'FAIL (' + '; '.join(beyond) + ')' if beyond else 'PASS'}"
                )
        else:
            verdict = parity.verdict(results[step])
            must_be_bitwise = args.nproc == 2 and not extra
            if not results[step].passed or (must_be_bitwise and not results[step].bitwise):
                all_passed = False
                verdict += "  <-- expected bitwise identical" if results[step].passed else ""
        print(
            f"{step:<24} {metrics['env']['world_size']:>5} {times[step]:>5.0f}s "
            f"{records[-1]['loss']:>10.4f} "
            f"{statistics.median(r['tokens_per_s'] for r in records):>8,.0f}  {verdict}"
        )
    # one pipeline, other schedules: still one process's sums
    for name, (result, seconds) in schedules.items():
        bitwise = result.passed and result.bitwise
        all_passed &= bitwise
        print(
            f"{name:<24} {args.nproc:>5} {seconds:>5.0f}s {'':>10} {'':>8}  vs {single}"
            f"{' on the same model' if 'interleaved' in name else ''}: {parity.verdict(result)}"
            f"{'' if bitwise else '  <-- expected bitwise identical'}"
        )
    # step 12 beside step 0 on the same MoE model: bitwise at 2 ranks (its README), close otherwise
    if moe:
        (result, seconds), (_, moe_metrics) = moe, parity.load_run(args.runs_dir / "moe" / experts)
        expected = result.passed and (result.bitwise or args.nproc != 2)
        all_passed &= expected
        print(
            f"{experts:<24} {args.nproc:>5} {seconds:>5.0f}s "
            f"{moe_metrics['records'][-1]['loss']:>10.4f} "
            f"{statistics.median(r['tokens_per_s'] for r in moe_metrics['records']):>8,.0f}"
            f"  vs {single} on the "
            "same MoE model: "
            f"{parity.verdict(result)}{'' if expected else '  <-- expected bitwise identical'}"
        )
    # Informational, never a failure: the per-rank CPU time of every step (compare/stragglers.py).
    flagged, too_short = [], 0
    for step in steps:
        _, _, result = stragglers.check(runs[step])
        if result.straggler is not None:
            flagged.append(f"{step}: {stragglers.verdict(result)}")
        too_short = max(
            too_short, len(result.ranks) > 1 and len(result.steps) < stragglers.MIN_STEPS
        )
    nobody = (
        f"too few steps to call (a verdict needs {stragglers.MIN_STEPS} after the first)"
        if too_short
        else "no rank consistently slower in any step"
    )
    print(
        f"\nstragglers: {'; '.join(flagged) or nobody} (per-rank table: python "
        "compare/stragglers.py <step>)"
    )
    if skipped:
        print(f"skipped: {'; '.join(skipped)}")
    for step, error in failed.items():
        print(f"{step:<24} FAILED: {error}")
        all_passed = False
    load = f", expert load: {shown(args.runs_dir / 'plots' / 'expert_load.png')}" if moe else ""
    print(f"plot: {shown(plot)}{load}\nlogs: {shown(log_dir)}")
    print("tour: all parity checks passed" if all_passed else "tour: PARITY FAILED (see above)")
    return 0 if all_passed else 1


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main))
