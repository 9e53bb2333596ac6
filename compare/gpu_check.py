"""One command that runs every GPU path on the GPUs present and writes a markdown report.

    # on the GPU(s): 6-8 minutes on one H100 before the FP8 section
    python compare/gpu_check.py
    # the same checks, tiny, on the CPU (the tests run it)
    python compare/gpu_check.py --device cpu

What it checks, each section a verdict:

1. **The tour on the GPU, ranks sharing it** (2 ranks over gloo on one device, the way a learner
   with one GPU runs the steps): every step with its parity verdict against step 1 on the same
   device (compare/tour.py).
2. **One GPU per rank over nccl**, when there are 2 or more GPUs: the same tour.
3. **Resume and repeat**: step 0 stopped at a checkpoint and resumed equals the uninterrupted run
   bit for bit, and so does a second run (deterministic kernels, flash attention's
   backward included).
4. **Memory**: the bytes of parameters, gradients and AdamW state per rank of steps 1 and 5-7 (from
   the tour's runs) against compare/memory.py's formulas, with what CUDA allocated.
5. **Speed**: step 0 at GPT-2 small's shape (12 layers, 768 wide, sequence 1024, micro-batch 16,
   bf16) beside compare/plain_loop.py on the same model, with SDPA and with SDPA + torch.compile:
   step 0 as it ships (deterministic kernels) against the plain loop with torch's defaults, and each
   with the other choice (``--nondeterministic``, deterministic); tokens/s and MFU, interleaved
   rounds, medians.
6. **A model that does not fit one rank**: a per-rank budget (--max-memory-mb: a fraction of the
   GPU) that 16 bytes per parameter exceeds; step 1 (DDP) must end with one out-of-memory line, step
   7 (ZeRO-3, 2 ranks sharing the GPU) must train.
7. **ZeRO-Offload**: step 7 with and without ``--offload-optimizer``: the parity verdict, and the
   device bytes AdamW's state no longer takes.
8. **Context parallelism**: step 11's ring attention beside PyTorch's ``context_parallel`` (CUDA
   only) on the same tensors, each against attention on the whole sequence, with ms and CUDA peak
   per rank (compare/cp_reference.py).
9. **Expert parallelism**: step 12 at ``--ep 2`` on 2 ranks (sharing the GPU over gloo, or over nccl
   with a GPU each) against step 0 accumulating 2 micro-batches of the same MoE model: bitwise, and
   every rank's all-to-all bytes the closed form, per MoE layer and micro-batch.
10. **FP8**: step 0 at the speed section's shape under bf16 autocast, then with ``--fp8 tensorwise``
    and ``--fp8 rowwise`` (common/fp8.py); tokens/s, MFU against the bf16 peak and the final loss,
    interleaved rounds, medians. A recipe the device's ``_scaled_mm`` cannot run is skipped in
    one line.

Exit 0 when every section passes, 1 otherwise; the report goes to --report (and stdout).
"""

import argparse
import datetime
import json
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "common"))
import estimate  # noqa: E402
import memory  # noqa: E402
import parity  # noqa: E402
from config import OneLineParser, UserError, exit_on_user_error  # noqa: E402
from fp8 import fp8_cannot_run  # noqa: E402
from launch import trainer_command  # noqa: E402

REPO_ROOT = parity.REPO_ROOT
TOKENIZER = str(REPO_ROOT / "data" / "tokenizer.json")
# Dense bf16 peak FLOP/s of the GPUs we know, for MFU (the vendor's datasheets, without sparsity).
PEAK_BF16 = {
    "H100": 989e12,
    "H200": 989e12,
    "A100": 312e12,
    "L4": 121e12,
    "A10G": 70e12,
    "RTX 4090": 165e12,
}


class Check:
    """The sizes and flags of one mode: the GPU's, or the CPU's tiny ones."""

    def __init__(self, device: str, out: Path, report: Path, header: str):
        self.device, self.out, self.gpu = device, out, device == "cuda"
        self.report, self.header, self.started = report, header, time.perf_counter()
        self.sections, self.verdicts = {}, {}  # {place in the report: text}, {place: ok}
        self.common = ["--device", device]
        self.tour_flags = [] if self.gpu else ["--steps", "3", "--save-every", "0"]
        self.small = (
            [
                "--n-layer",
                "12",
                "--n-head",
                "12",
                "--n-embd",
                "768",
                "--seq-len",
                "1024",
                "--micro-batch-size",
                "16",
                "--grad-accum",
                "2",
                "--amp",
                "bf16",
            ]
            if self.gpu
            else [
                "--n-layer",
                "2",
                "--n-head",
                "4",
                "--n-embd",
                "64",
                "--seq-len",
                "32",
                "--micro-batch-size",
                "4",
                "--grad-accum",
                "2",
            ]
        )
        self.speed_steps, self.speed_warmup, self.rounds = (14, 4, 2) if self.gpu else (4, 1, 1)
        # A model whose 16 bytes per parameter do not fit
        # the budget; ZeRO-3 over 2 ranks needs about half.
        self.fit_model = (
            ["--n-layer", "8", "--n-embd", "1024", "--n-head", "16"]
            if self.gpu
            else ["--n-layer", "12", "--n-embd", "512", "--n-head", "8"]
        )

    def section(self, place: int, title: str, ok: bool | None, body: str) -> None:
        """Add a section (``ok`` None: not run) and rewrite the report,
        so a check cut short keeps what it found."""
        self.verdicts[place] = ok  # a section rewritten as it goes (speed) keeps its last verdict
        verdict = {True: "PASS", False: "FAIL", None: "not run"}[ok]
        self.sections[place] = f"## {title}: {verdict}\n\n{body.rstrip()}\n"
        print(self.sections[place], flush=True)
        self.write()

    @property
    def passed(self) -> bool:
        return all(ok is not False for ok in self.verdicts.values())

    def write(self, verdict: str = "(still running)") -> None:
        self.report.parent.mkdir(parents=True, exist_ok=True)
        body = "\n".join(text for _, text in sorted(self.sections.items()))
        self.report.write_text(
            f"{self.header}\n{body}\n{verdict} ({time.perf_counter() - self.started:.0f} s)\n"
        )


def run(command: list[str], log: Path, timeout: float = 900) -> tuple[int, str]:
    """Run ``command`` from the repository root; all output to ``log``; (exit code, output)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(
            command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout
        )
        code, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as expired:
        code, output = (
            124,
            f"timed out after {timeout:.0f} s\n{expired.stdout or ''}{expired.stderr or ''}",
        )
    log.write_text(output)
    return code, output


def error_line(output: str) -> str:
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    return errors[0] if errors else (output.strip().splitlines() or ["(no output)"])[-1]


def environment(device: str) -> str:
    lines = [
        f"- date: {datetime.date.today().isoformat()}",
        f"- torch {torch.__version__}, Python {platform.python_version()}, {platform.machine()}",
    ]
    if device == "cuda":
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        lines.append(
            f"- {len(names)} GPU(s): {', '.join(sorted(set(names)))}; CUDA {torch.version.cuda}"
        )
        try:
            driver = (
                subprocess.run(
                    [
                        "nvidia-smi",
                        "--query-gpu=driver_version,memory.total",
                        "--format=csv,noheader",
                    ],
                    capture_output=True,
                    text=True,
                    timeout=30,
                )
                .stdout.strip()
                .splitlines()[0]
            )
            lines.append(f"- driver, memory: {driver}")
        except (OSError, IndexError, subprocess.TimeoutExpired):
            lines.append("- driver: nvidia-smi not available")
    else:
        lines.append("- device: CPU (the tiny mode: the same checks, small sizes)")
    return "\n".join(lines)


def check_tour(check: Check, place: int, nproc: int, title: str, backend: str) -> Path:
    runs = check.out / f"tour_{backend}"
    command = [
        sys.executable,
        str(REPO_ROOT / "compare" / "tour.py"),
        "--keep-going",
        "--nproc",
        str(nproc),
        # --backend auto: gloo or nccl
        "--runs-dir",
        str(runs),
        *check.common,
        *check.tour_flags,
    ]
    code, output = run(command, check.out / f"tour_{backend}.log", timeout=1500)
    lines = output.splitlines()
    start = next(
        (i for i, line in enumerate(lines) if line.startswith("step ") and "parity vs" in line),
        None,
    )
    table = lines[start:] if start is not None else lines[-20:]
    body = (
        "```\n"
        + "\n".join(line for line in table if not line.startswith(("plot:", "logs:")))
        + "\n```\n"
    )
    check.section(
        place, title, code == 0, f"`{' '.join(['compare/tour.py', *command[2:]])}`\n\n{body}"
    )
    return runs


def check_resume(check: Check, place: int) -> None:
    out = check.out / "resume"
    flags = [*check.common, "--steps", "6", "--save-every", "3", "--quiet", *check.small]
    for name, extra in (
        ("whole", []),
        ("again", []),
        ("resumed", ["--resume", str(out / "whole" / "checkpoints" / "step_3")]),
    ):
        code, output = run(
            trainer_command("step0_single_gpu", 0, [*flags, "--out", str(out / name), *extra]),
            out / f"{name}.log",
        )
        if code:
            check.section(
                place,
                "Resume and repeat (step 0)",
                False,
                f"{name}: exit {code}: `{error_line(output)}`",
            )
            return
    lines = []
    ok = True
    for other in ("again", "resumed"):
        _, _, result = parity.check(str(out / "whole"), str(out / other))
        a, b = (
            json.loads((out / n / "metrics.json").read_text())["records"] for n in ("whole", other)
        )
        same_records = all(
            x[k] == y[k] for x, y in zip(a[3:], b[3:]) for k in ("loss", "grad_norm", "param_norm")
        )
        ok &= result.bitwise and same_records
        lines.append(
            f"- {other} vs whole: {parity.verdict(result)}; steps 4-6 loss, grad norm, param norm "
            f"{'equal' if same_records else 'DIFFER'}"
        )
    attention = json.loads((out / "whole" / "metrics.json").read_text())["config"]["attention"]
    check.section(
        place,
        "Resume and repeat (step 0)",
        ok,
        f"step 0, {attention} attention, 6 steps, checkpoint at 3: `{' '.join(flags)}`\n\n"
        + "\n".join(lines),
    )


def check_memory(check: Check, place: int, runs: Path) -> None:
    lines, ok = [], True
    for step in ("step1_torch_ddp", "step5_zero1", "step6_zero2", "step7_zero3"):
        if not (runs / step / "metrics.json").exists():
            lines.append(f"{step}: no run (see the tour)")
            ok = False
            continue
        text, within = memory.report(str(runs / step))
        records = json.loads((runs / step / "metrics.json").read_text())["records"]
        cuda = [m.get("cuda_allocated") for m in records[-1]["memory"]]
        if cuda[0] is not None:
            text += "\n  CUDA allocated after the step, per rank: " + ", ".join(
                f"{c:,} B" for c in cuda
            )
        lines.append(text)
        ok &= within
    check.section(
        place, "Memory per rank against the formulas", ok, "```\n" + "\n\n".join(lines) + "\n```"
    )


def flops_per_token(config: dict) -> float:
    """nanoGPT's estimate:
    6 per parameter (the position embedding left out), and attention's 12 L h T."""
    model = estimate.Model(config, estimate.vocabulary_size(TOKENIZER))
    params = model.psi - config["seq_len"] * config["n_embd"]
    return 6 * params + 12 * config["n_layer"] * config["n_embd"] * config["seq_len"]


def step0_tokens_per_s(run_dir: Path, warmup: int) -> tuple[float, float, int | None]:
    """(tokens/s of the whole loop, logging included; tokens/s of ``train_step`` alone
    (``step_time``); CUDA peak) over the records after ``warmup``. Their gap is what the loop does
    around the step (the exact norms)."""
    metrics = json.loads((run_dir / "metrics.json").read_text())
    records, config = metrics["records"], metrics["config"]
    per_step = config["micro_batch_size"] * config["grad_accum"] * config["seq_len"]
    seconds = records[-1]["since_start_s"] - records[warmup - 1]["since_start_s"]
    step_only = sum(r["step_time"][0]["wall_s"] for r in records[warmup:])
    return (
        per_step * (len(records) - warmup) / seconds,
        per_step * (len(records) - warmup) / step_only,
        records[-1]["memory"][0].get("cuda_peak"),
    )


def check_speed(check: Check, place: int, compiled: bool) -> None:
    out = check.out / "speed"
    flags = [
        *check.common,
        *check.small,
        "--steps",
        str(check.speed_steps),
        "--save-every",
        "0",
        "--quiet",
        "--attention",
        "sdpa",
    ]
    # (name, plain loop or step 0, extra flags): the plain loop with torch's defaults and step 0 as
    # it ships (deterministic kernels, so that two runs, resume and parity are bitwise), then each
    # with the other choice.
    fast = ["--nondeterministic"]
    variants = [
        ("plain loop, SDPA", "plain", fast),
        ("step 0, SDPA", "step0", []),
        ("plain loop, SDPA, deterministic", "plain", []),
        ("step 0, SDPA, --nondeterministic", "step0", fast),
    ]
    schedule = [(round_, *variant) for round_ in range(check.rounds) for variant in variants]
    if check.gpu and compiled:  # compiling costs a minute or more: one round of it, last
        schedule += [
            (0, "plain loop, SDPA + compile", "plain", ["--compile", *fast]),
            (0, "step 0, SDPA + compile", "step0", ["--compile"]),
        ]
    config = {
        "n_layer": int(check.small[1]),
        "n_head": int(check.small[3]),
        "n_embd": int(check.small[5]),
        "seq_len": int(check.small[7]),
        "dropout": 0.0,
        "weight_decay": 0.1,
    }
    per_token = flops_per_token(config)
    peak = next(
        (v for k, v in PEAK_BF16.items() if check.gpu and k in torch.cuda.get_device_name(0)), None
    )
    measured, peaks, failures = {}, {}, []
    # interleaved: a slow spell of the machine hits every variant
    for round_, name, kind, extra in schedule:
        tag = f"{kind}{''.join(extra).replace('-', '_')}_{round_}"
        if kind == "plain":
            command = [
                sys.executable,
                str(REPO_ROOT / "compare" / "plain_loop.py"),
                *flags,
                "--warmup",
                str(check.speed_warmup),
                *extra,
            ]
            code, output = run(command, out / f"{tag}.log")
            if code == 0:
                result = json.loads(output.strip().splitlines()[-1])
                measured.setdefault(name, []).append(result["tokens_per_s"])
                peaks[name] = result["cuda_peak"]
        else:
            code, output = run(
                trainer_command("step0_single_gpu", 0, [*flags, *extra, "--out", str(out / tag)]),
                out / f"{tag}.log",
            )
            if code == 0:
                tokens_per_s, step_only, peaks[name] = step0_tokens_per_s(
                    out / tag, check.speed_warmup
                )
                measured.setdefault(name, []).append(tokens_per_s)
                measured.setdefault(f"{name}: train_step alone (records' step_time)", []).append(
                    step_only
                )
        if code:
            failures.append(f"{name}: exit {code}: `{error_line(output)}`")
        # after every run: a check cut short keeps what it measured
        speed_section(check, place, flags, measured, peaks, failures, per_token, peak)


def speed_section(
    check: Check,
    place: int,
    flags: list,
    measured: dict,
    peaks: dict,
    failures: list,
    per_token: float,
    peak: float | None,
) -> None:
    """The speed section as measured so far:
    ``per_token`` FLOPs per token, ``peak`` the GPU's bf16 FLOP/s."""
    rows = [
        "| run | tokens/s (median of rounds) | rounds | MFU | CUDA peak |",
        "|---|---|---|---|---|",
    ]
    for name, values in measured.items():
        median = statistics.median(values)
        mfu = f"{median * per_token / peak:.1%}" if peak else "n/a"
        cuda = f"{peaks[name] / 2**30:.1f} GiB" if peaks.get(name) else "n/a"
        rows.append(
            f"| {name} | {median:,.0f} ({min(values):,.0f}-{max(values):,.0f}) | "
            f"{len(values)} | {mfu} | {cuda} |"
        )
    ratios = []
    alone = ": train_step alone (records' step_time)"
    for plain, ours in (
        ("plain loop, SDPA", "step 0, SDPA"),
        ("plain loop, SDPA", "step 0, SDPA" + alone),
        ("plain loop, SDPA", "step 0, SDPA, --nondeterministic"),
        ("plain loop, SDPA", "plain loop, SDPA, deterministic"),
        ("plain loop, SDPA + compile", "step 0, SDPA + compile"),
    ):
        if measured.get(plain) and measured.get(ours):
            ratios.append(
                (
                    ours,
                    statistics.median(measured[ours]) / statistics.median(measured[plain]),
                    plain,
                )
            )
    text = (
        "\n".join(rows)
        + "\n\n"
        + "\n".join(f"- {ours}: {ratio:.2f}x of the {plain}" for ours, ratio, plain in ratios)
    )
    ok = not failures and bool(ratios) and (not check.gpu or ratios[0][1] >= 0.9)
    target = (
        "target: step 0 with SDPA, as it ships (deterministic), at 0.9x or better of "
        "the plain SDPA loop with "
        "torch's defaults"
        if check.gpu
        else "CPU: the tiny sizes check that every variant runs; the ratio is not a target here"
    )
    check.section(
        place,
        "Speed: step 0 beside a plain PyTorch loop",
        ok,
        f"`{' '.join(flags)}`, {check.speed_steps} steps, clock from step "
        f"{check.speed_warmup + 1}; "
        f"{per_token / 1e9:.2f} GFLOP per token\n\n{text}\n\n{target}\n"
        + "".join(f"\n- FAILED {f}" for f in failures),
    )


# (name, step 0's extra flags, the FP8 recipe or None):
# every run under bf16 autocast, FP8 on the blocks' linears
FP8_VARIANTS = [
    ("bf16 autocast", [], None),
    ("bf16 autocast + --fp8 tensorwise", ["--fp8", "tensorwise"], "tensorwise"),
    ("bf16 autocast + --fp8 rowwise", ["--fp8", "rowwise"], "rowwise"),
]


def check_fp8_speed(check: Check, place: int) -> None:
    """Step 0 under bf16 autocast, with and without ``--fp8 tensorwise|rowwise`` (common/fp8.py), at
    the speed section's shape (GPT-2 small's on a GPU), interleaved rounds, medians. A recipe this
    device's ``_scaled_mm`` cannot run (``fp8_cannot_run``: a GPU before compute capability 8.9,
    torch 2.11's CPU build for rowwise) is skipped in one line, not failed."""
    out = check.out / "fp8"
    # On a CPU, smaller still: on an AVX-512 CPU the CPU's _scaled_mm can run oneDNN's reference FP8
    # kernel, about 1 s for a 256^3 matmul (docs/fp8.md, Speed); the tiny mode checks that every
    # recipe runs.
    cpu = "--n-layer 2 --n-head 2 --n-embd 32 --seq-len 16 --micro-batch-size 1 --grad-accum 2"
    shape = check.small if check.gpu else cpu.split()
    flags = [
        *check.common,
        *shape,
        "--amp",
        "bf16",
        "--steps",
        str(check.speed_steps),
        "--save-every",
        "0",
        "--quiet",
        "--attention",
        "sdpa",
    ]
    skipped, variants = [], []
    for name, extra, recipe in FP8_VARIANTS:
        why = recipe and fp8_cannot_run(recipe, torch.device(check.device))
        if why:
            skipped.append(f"- {name}: skipped, this device's `_scaled_mm` cannot run it (`{why}`)")
        else:
            variants.append((name, extra))
    title = "FP8: step 0 in bf16 beside --fp8 tensorwise and rowwise"
    if len(variants) == 1:  # bf16 alone: nothing to compare
        check.section(place, title, None, "\n".join(skipped))
        return

    def last(flag: str) -> int:  # the value argparse keeps: the flag's last
        return int(flags[len(flags) - flags[::-1].index(flag)])

    config = {
        "n_layer": last("--n-layer"),
        "n_head": last("--n-head"),
        "n_embd": last("--n-embd"),
        "seq_len": last("--seq-len"),
        "dropout": 0.0,
        "weight_decay": 0.1,
    }
    per_token = flops_per_token(config)
    peak = next(
        (v for k, v in PEAK_BF16.items() if check.gpu and k in torch.cuda.get_device_name(0)), None
    )
    measured, peaks, losses, failures = {}, {}, {}, []
    # interleaved: a slow spell of the machine hits every variant
    for round_ in range(check.rounds):
        for name, extra in variants:
            tag = f"{name.split()[-1]}_{round_}"
            code, output = run(
                trainer_command("step0_single_gpu", 0, [*flags, *extra, "--out", str(out / tag)]),
                out / f"{tag}.log",
            )
            if code:
                failures.append(f"{name}: exit {code}: `{error_line(output)}`")
                continue
            tokens_per_s, _, peaks[name] = step0_tokens_per_s(out / tag, check.speed_warmup)
            measured.setdefault(name, []).append(tokens_per_s)
            records = json.loads((out / tag / "metrics.json").read_text())["records"]
            losses[name] = records[-1]["loss"]
    rows = [
        "| run | tokens/s (median of rounds) | rounds | x bf16 | MFU (bf16 peak) | "
        "final loss | CUDA peak |",
        "|---|---|---|---|---|---|---|",
    ]
    base = statistics.median(measured["bf16 autocast"]) if "bf16 autocast" in measured else None
    for name, values in measured.items():
        median = statistics.median(values)
        rows.append(
            f"| {name} | {median:,.0f} ({min(values):,.0f}-{max(values):,.0f}) | {len(values)} | "
            + (f"{median / base:.2f}x" if base else "n/a")
            + f" | {f'{median * per_token / peak:.1%}' if peak else 'n/a'} | {losses[name]:.4f} | "
            + (f"{peaks[name] / 2**30:.1f} GiB" if peaks.get(name) else "n/a")
            + " |"
        )
    ok = not failures and len(measured) == len(variants)
    note = (
        "MFU counts the model's FLOPs against the GPU's dense bf16 peak (its FP8 peak "
        "is twice that), so an "
        "FP8 run's MFU says how much of bf16's peak it reached; no target: eager FP8 "
        "casts in separate kernels"
        if check.gpu
        else "CPU: `_scaled_mm` is an emulation or oneDNN's reference kernel here; the tiny "
        "sizes check that every "
        "recipe runs, not its speed"
    )
    check.section(
        place,
        title,
        ok,
        f"`{' '.join(flags)}`, {check.speed_steps} steps, clock from step "
        f"{check.speed_warmup + 1}; "
        f"{per_token / 1e9:.2f} GFLOP per token\n\n"
        + "\n".join(rows)
        + "\n\n"
        + "".join(f"{line}\n" for line in skipped)
        + f"\n{note}\n"
        + "".join(f"\n- FAILED {f}" for f in failures),
    )


def check_fits(check: Check, place: int) -> None:
    out = check.out / "fits"
    config = {
        "n_layer": int(check.fit_model[1]),
        "n_embd": int(check.fit_model[3]),
        "n_head": int(check.fit_model[5]),
        "seq_len": 64,
        "dropout": 0.0,
        "weight_decay": 0.1,
    }
    psi = estimate.Model(config, estimate.vocabulary_size(TOKENIZER)).psi
    # 16Ψ of state cannot fit; ZeRO-3's 8Ψ at N = 2 does, with its working memory (a gathered block,
    # AdamW's multi-tensor temporaries on a GPU, the exact norm's pieces): about 14Ψ at this shape
    # on a GPU (2026-11-26). On a CPU, under RLIMIT_DATA, ZeRO-3 ran out at 11.5Ψ and once at 12Ψ
    # (12 MiB short: the libraries' threads take a varying share), not at 12.5Ψ or 13Ψ (2026-11-27):
    # 14Ψ leaves it 1.7Ψ, and DDP 2Ψ short of its state.
    budget = round((15 if check.gpu else 14) * psi / 2**20)
    flags = [
        *check.common,
        *check.fit_model,
        "--seq-len",
        "64",
        "--micro-batch-size",
        "1",
        "--grad-accum",
        "1",
        "--steps",
        "2",
        "--save-every",
        "0",
        "--quiet",
        "--max-memory-mb",
        str(budget),
        "--timeout-s",
        "120",
    ]
    ddp_code, ddp_output = run(
        trainer_command("step1_torch_ddp", 2, [*flags, "--out", str(out / "ddp")]), out / "ddp.log"
    )
    zero3_code, zero3_output = run(
        trainer_command("step7_zero3", 2, [*flags, "--out", str(out / "zero3")]), out / "zero3.log"
    )
    ddp_line = next(
        (line for line in ddp_output.splitlines() if line.startswith("error: out of memory")),
        # the rank that ran out says so; its peer may only see it leave
        error_line(ddp_output),
    )
    ok = ddp_code != 0 and ddp_line.startswith("error: out of memory") and zero3_code == 0
    lines = [
        f"Ψ = {psi:,} parameters: 16Ψ = {16 * psi / 2**20:,.0f} MiB of training state; budget "
        f"{budget:,} MiB per rank (`--max-memory-mb`), 2 ranks sharing the device",
        f"- step 1 (DDP): exit {ddp_code}: `{ddp_line}`",
    ]
    if zero3_code == 0:
        records = json.loads((out / "zero3" / "metrics.json").read_text())["records"]
        state = [m["params"] + m["grads"] + m["optimizer_state"] for m in records[-1]["memory"]]
        peak = [m.get("cuda_peak") for m in records[-1]["memory"]]
        lines.append(
            f"- step 7 (ZeRO-3): trained {len(records)} steps; state per rank "
            + ", ".join(f"{s / 2**20:,.0f} MiB" for s in state)
            + f" (8Ψ = {8 * psi / 2**20:,.0f} MiB)"
            + ("; CUDA peak " + ", ".join(f"{p / 2**20:,.0f} MiB" for p in peak) if peak[0] else "")
        )
    else:
        lines.append(f"- step 7 (ZeRO-3): exit {zero3_code}: `{error_line(zero3_output)}`")
    check.section(place, "A model that does not fit one rank's budget", ok, "\n".join(lines))


def check_offload(check: Check, place: int) -> None:
    """Step 7 with and without --offload-optimizer, 2 ranks sharing the device: bitwise on a CPU,
    where AdamW runs on the same kernels either way; on a GPU the same first step and param norms
    within the parity contract, and the device bytes after the step lower by AdamW's state (the
    moments move to the host, beside float32 copies)."""
    out = check.out / "offload"
    flags = [
        *check.common,
        *check.small,
        "--steps",
        "4",
        "--save-every",
        "0",
        "--quiet",
        "--timeout-s",
        "120",
    ]
    runs = {}
    for name, extra in (("on the device", []), ("offloaded", ["--offload-optimizer"])):
        code, output = run(
            trainer_command("step7_zero3", 2, [*flags, *extra, "--out", str(out / name)]),
            out / f"{name}.log",
        )
        if code:
            check.section(
                place,
                "ZeRO-Offload (step 7)",
                False,
                f"{name}: exit {code}: `{error_line(output)}`",
            )
            return
        runs[name] = json.loads((out / name / "metrics.json").read_text())["records"][-1]["memory"]
    _, _, result = parity.check(str(out / "on the device"), str(out / "offloaded"))
    ok = result.bitwise  # on a CPU both update with the same kernels
    lines = [f"`{' '.join(flags)}`, offloaded vs not: {parity.verdict(result)}"]
    # the host's single-tensor AdamW against the device's multi-tensor one rounds otherwise (4 steps
    if check.gpu:
        # on an H200: some weights past allclose, param norms 5e-7 apart), as another summation
        # order does: the same first step, then the parity contract's param-norm bound
        ok = result.first_loss_diff_step != 1 and result.first_param_norm_violation_step is None
        lines.append(
            f"- another AdamW implementation (host vs device): first loss difference at step "
            f"{result.first_loss_diff_step}, param norm within 1e-6 at every step: "
            f"{'yes' if result.first_param_norm_violation_step is None else 'NO'} "
            f"(max {result.max_param_norm_diff:.1e})"
        )
    for name, ranks in runs.items():
        cuda = [m.get("cuda_allocated") for m in ranks]
        lines.append(
            f"- {name}: per rank AdamW state {ranks[0]['optimizer_state']:,} B, host "
            f"{ranks[0].get('host', 0):,} B"
            + (
                ", CUDA allocated after the step " + ", ".join(f"{c:,} B" for c in cuda)
                if cuda[0]
                else ""
            )
        )
    if check.gpu:
        device = {name: ranks[0]["cuda_allocated"] for name, ranks in runs.items()}
        saved = device["on the device"] - device["offloaded"]
        ok &= saved >= runs["offloaded"][0]["optimizer_state"] * 0.9  # the moments left the device
        lines.append(f"- device bytes saved per rank: {saved:,} B")
    check.section(place, "ZeRO-Offload (step 7)", ok, "\n".join(lines))


def check_context(check: Check, place: int) -> None:
    sizes = (
        []
        if check.gpu
        else ["--seq-len", "256", "--heads", "2", "--head-dim", "16", "--repeats", "2"]
    )
    command = [
        sys.executable,
        str(REPO_ROOT / "compare" / "cp_reference.py"),
        *check.common,
        *sizes,
    ]
    code, output = run(command, check.out / "context.log", timeout=600)
    body = (
        output[output.index("C = ") :]
        if "C = " in output
        else f"exit {code}: `{error_line(output)}`"
    )
    check.section(
        place,
        "Context parallelism: step 11's ring beside PyTorch's context_parallel",
        code == 0,
        f"`{' '.join(['compare/cp_reference.py', *command[2:]])}`\n\n{body}",
    )


def all_to_all_off_formula(run: Path) -> tuple[int, list[str]]:
    """Step 12's all-to-all notes in ``run``, on every rank, per MoE layer and micro-batch, against
    the closed form (float32 rows of h): 8 E + 4 h * 2 * (sent + received) bytes, what a rank
    receives being what the ranks of its expert-parallel group sent to its experts. Returns (notes
    checked, those off the formula)."""
    metrics = json.loads((run / "metrics.json").read_text())
    config = metrics["config"]
    experts, h, ep = config["moe_experts"], config["n_embd"], config["ep"]
    checked, off = 0, []
    for record in metrics["records"]:
        notes = record["all_to_all"]  # [rank][layer x micro-batch]
        for rank, mine in enumerate(notes):
            group = range(rank // ep * ep, rank // ep * ep + ep)
            local = range(rank % ep * experts // ep, (rank % ep + 1) * experts // ep)
            for i, note in enumerate(mine):
                received = sum(notes[s][i]["sent_per_expert"][e] for s in group for e in local)
                formula = 8 * experts + 4 * h * 2 * (sum(note["sent_per_expert"]) + received)
                checked += 1
                if (note["received"], note["bytes"]) != (received, formula):
                    off.append(
                        f"step {record['step']} rank {rank} note {i}: {note['bytes']:,} B received "
                        f"{note['received']} (formula {formula:,} B, {received})"
                    )
    return checked, off


def check_experts(check: Check, place: int) -> None:
    """Step 12 at --ep 2 against step 0 on the same MoE model and micro-batches (one sample each:
    step 0's two micro-batches are the two ranks'), float32, capacity factor 1 (slots dropped):
    every sum step 12 changes has two terms, so the runs are bitwise (docs/parity.md); and the
    all-to-all bytes the formula on every rank."""
    out, title = check.out / "experts", "Expert parallelism: step 12 at --ep 2 against step 0"
    model = (
        ["--n-layer", "4", "--n-embd", "256", "--n-head", "4", "--seq-len", "256", "--steps", "6"]
        if check.gpu
        else [
            "--n-layer",
            "2",
            "--n-embd",
            "32",
            "--n-head",
            "2",
            "--seq-len",
            "32",
            "--steps",
            "3",
        ]
    )
    flags = [
        *check.common,
        *model,
        "--moe-experts",
        "4",
        "--moe-top-k",
        "2",
        "--moe-capacity-factor",
        "1.0",
        "--micro-batch-size",
        "1",
        "--save-every",
        "0",
        "--quiet",
    ]
    for name, step, nproc, extra in (
        ("step0", "step0_single_gpu", 0, ["--grad-accum", "2"]),
        (
            "step12",
            "step12_expert_parallel",
            2,
            ["--grad-accum", "1", "--ep", "2", "--timeout-s", "120"],
        ),
    ):
        code, output = run(
            trainer_command(step, nproc, [*flags, *extra, "--out", str(out / name)]),
            out / f"{name}.log",
        )
        if code:
            check.section(place, title, False, f"{name}: exit {code}: `{error_line(output)}`")
            return
    _, _, result = parity.check(str(out / "step0"), str(out / "step12"))
    checked, off = all_to_all_off_formula(out / "step12")
    metrics = json.loads((out / "step12" / "metrics.json").read_text())
    first = metrics["records"][0]
    dropped = ", ".join(f"{d:.1%}" for d in first["moe"]["dropped_fraction"])
    ok = result.bitwise and checked > 0 and not off
    lines = [
        f"`{' '.join(flags)}`; step 0 `--grad-accum 2`, step 12 `--ep 2` on 2 ranks "
        f"({metrics['env']['backend']}, {metrics['env']['device']})",
        f"- step 12 vs step 0: {parity.verdict(result)}",
        f"- all-to-all bytes, {checked} notes (ranks x MoE layers x micro-batches x steps): "
        + ("every one the formula" if checked and not off else f"{len(off)} OFF: {off[:3]}"),
        f"- step 1: rank 0 sent {first['comm']['all_to_all']:,} B of all-to-alls; "
        "tokens per expert "
        f"{first['moe']['tokens_per_expert']}; dropped (per layer) {dropped}",
    ]
    check.section(place, title, ok, "\n".join(lines))


def main() -> int:
    parser = OneLineParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument(
        "--out", type=Path, default=REPO_ROOT / "runs" / "gpu_check", help="runs and logs"
    )
    parser.add_argument(
        "--report", type=Path, help="where the markdown report goes (default: OUT/report.md)"
    )
    parser.add_argument(
        "--only",
        nargs="+",
        choices=[
            "tour",
            "nccl",
            "resume",
            "memory",
            "speed",
            "compile",
            "fits",
            "offload",
            "context",
            "experts",
            "fp8",
        ],
        help="run only these sections (memory needs tour; compile: speed's compiled pair)",
    )
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda asked for, but torch sees no CUDA GPU; use --device cpu")
    sections = set(
        args.only
        or [
            "tour",
            "nccl",
            "resume",
            "memory",
            "speed",
            "compile",
            "fits",
            "offload",
            "context",
            "experts",
            "fp8",
        ]
    )
    header = f"# GPU check ({args.device})\n\n{environment(args.device)}\n"
    print(header, flush=True)
    check = Check(
        args.device, args.out.resolve(), (args.report or args.out / "report.md").resolve(), header
    )
    check.write()

    def tour_and_memory():
        try:
            runs = check_tour(check, 1, 2, "The tour, 2 ranks sharing one device (gloo)", "gloo")
            if "memory" in sections:
                check_memory(check, 2, runs)
        except Exception as error:  # noqa: BLE001 (a thread's exception would only be printed)
            check.section(2, "The tour and memory", False, f"`{error!r}`")

    # On a GPU the tour (2 ranks, small model) runs beside the resume and budget checks, which need
    # little of the device; the speed check runs alone, last. On the CPU (2 cores here) everything
    # runs in turn.
    tour = threading.Thread(target=tour_and_memory) if sections & {"tour", "memory"} else None
    if tour:
        tour.start()
        if not check.gpu:
            tour.join()
    if "resume" in sections:
        check_resume(check, 4)
    if "fits" in sections:
        check_fits(check, 5)
    if "offload" in sections:
        check_offload(check, 7)
    if "context" in sections:
        check_context(check, 8)
    if "experts" in sections:
        check_experts(check, 9)
    if tour:
        tour.join()
    if "nccl" in sections and check.gpu:
        count = torch.cuda.device_count()
        if count >= 2:
            check_tour(
                check,
                3,
                min(count, 4),
                f"The tour, one GPU per rank ({min(count, 4)} ranks, nccl)",
                "nccl",
            )
        else:
            check.section(
                3, "One GPU per rank (nccl)", None, "One GPU here: nccl needs a GPU per rank."
            )
    if sections & {"speed", "compile"}:
        check_speed(check, 6, "compile" in sections)
    if "fp8" in sections:  # timed too: alone, after the tour
        check_fp8_speed(check, 10)
    verdict = "every section passed" if check.passed else "SOME SECTIONS FAILED"
    check.write(verdict)
    print(
        f"gpu_check: {verdict} ({time.perf_counter() - check.started:.0f} s); report: "
        f"{check.report}"
    )
    return 0 if check.passed else 1


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main))
