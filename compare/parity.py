"""Do two runs train the same model? The parity contract (docs/parity.md: "Why exact parity needs an
order-free reduction"), checked by numbers.

    python compare/parity.py step1 step3                 # short step names: runs/<step folder>
    python compare/parity.py step1_torch_ddp runs/x      # or full names, or run folders

It refuses runs that are not comparable (naming the differing keys), then asserts

- final weights: torch.allclose(rtol=1e-5, atol=1e-6), tensor by tensor;
- param norm: |difference| < 1e-6 at every logged step;

and prints a per-tensor table (max abs / max rel difference), the first step at which loss or
param norm differ at all, and the verdict. Exit 0 pass, 1 fail, 2 bad input.
"""

import argparse
import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "common"))
from config import OneLineParser, UserError, exit_on_user_error  # noqa: E402
from metrics import SCHEMA_VERSION  # noqa: E402

RTOL, ATOL, PARAM_NORM_TOL = 1e-5, 1e-6, 1e-6

# Flags that change the numbers a run computes. Two runs are comparable when these agree and they
# process the same global batch per optimiser step; the rest (world size, accumulation split,
# reduce dtype, bucket cap, where to write, ...) may differ.
TRAINING_KEYS = (
    "steps",
    "seed",
    "amp",
    "loss_scale_init",
    "n_layer",
    "n_head",
    "n_embd",
    "seq_len",
    "dropout",
    "lr",
    "min_lr",
    "warmup_steps",
    "weight_decay",
    "beta1",
    "beta2",
    "grad_clip",
    "param_dtype",
    "fp8",
    "moe_experts",
    "moe_top_k",
    "moe_every",
    "moe_capacity_factor",
    "moe_aux_loss_coef",
)
# what a run of a step without the flag trained with
KEY_DEFAULTS = {"param_dtype": "float32", "fp8": None, "moe_experts": 0}


STEP_FOLDER = re.compile(r"step(\d+)_\w+")  # step0_single_gpu ... step10_3d_parallel
# steps 8 and up split the model or the sequence, not the batch: their sums are not step 1's
MODEL_PARALLEL_FROM = 8


def step_number(folder: str) -> int:
    return int(STEP_FOLDER.fullmatch(Path(folder).name).group(1))


def step_folders() -> list[str]:
    """Every step folder with a train.py, in step order (step10 after step9)."""
    return sorted(
        (
            p.name
            for p in REPO_ROOT.glob("step*_*")
            if STEP_FOLDER.fullmatch(p.name) and (p / "train.py").is_file()
        ),
        key=step_number,
    )


def resolve_run(name: str) -> Path:
    """A short step name (``step3``), a step folder name, or a run folder holding metrics.json."""
    path = Path(name)
    if (path / "metrics.json").is_file():
        return path
    folders = step_folders()
    matches = [f for f in folders if f == name.rstrip("/") or f.split("_")[0] == name]
    if matches:
        return REPO_ROOT / "runs" / matches[0]
    if path.is_dir():
        return path
    raise UserError(f"no step or run folder named {name!r}; steps: {', '.join(folders)}")


def load_run(name: str) -> tuple[Path, dict]:
    run = resolve_run(name)
    path = run / "metrics.json"
    if not path.is_file() and run == Path(name):  # a folder named (not a step), but not a run's
        raise UserError(
            f"{run} is not a run folder (no metrics.json in it); name the --out folder "
            "of a finished "
            "run, or a step (step1)"
        )
    if not path.is_file():
        raise UserError(f"{path} not found: run the step first (see README), or name a run folder")
    try:
        metrics = json.loads(path.read_text())
        missing = [k for k in ("config", "env", "records", "final") if k not in metrics]
    except (ValueError, UnicodeDecodeError) as error:
        raise UserError(f"{path} is corrupted (not JSON: {error}); run the step again") from None
    if missing or not isinstance(metrics["records"], list):
        raise UserError(
            f"{path} is corrupted or not a metrics file (missing "
            f"{', '.join(missing) or 'records'}); "
            "run the step again"
        )
    if metrics.get("schema_version") != SCHEMA_VERSION:
        raise UserError(
            f"{path} has schema {metrics.get('schema_version')}, this tool reads "
            f"{SCHEMA_VERSION} (it was "
            "written by another version of the trainers); run the step again"
        )
    if not metrics["final"]:
        raise UserError(
            f"{path} is from a run that did not finish; run it to the end (or --resume it)"
        )
    return run, metrics


def load_weights(run: Path, metrics: dict) -> dict:
    path = run / metrics["final"]["weights"]
    try:
        return load_file(str(path))
    except Exception as error:  # missing file, truncated header, garbage: all unusable the same way
        raise UserError(
            f"{path} cannot be read ({str(error).splitlines()[0]}); run the step again"
        ) from None


def global_batch(metrics: dict) -> int:
    """Samples per optimiser step: micro-batch x accumulation x the ranks that draw their own
    samples (all of them in data parallelism; one group of tensor-parallel ranks shares
    its samples)."""
    c, env = metrics["config"], metrics["env"]
    return (
        c["micro_batch_size"] * c["grad_accum"] * env.get("data_parallel_size", env["world_size"])
    )


def comparability_problems(a: dict, b: dict) -> list[str]:
    """Keys that make two runs compute different things. World size, the accumulation split, the
    reduce dtype and the bucket cap may differ: they change how, not what."""
    value = lambda run, k: run["config"].get(k, KEY_DEFAULTS.get(k))  # noqa: E731
    problems = [
        f"{k} ({value(a, k)!r} vs {value(b, k)!r})"
        for k in TRAINING_KEYS
        if value(a, k) != value(b, k)
    ]
    for key in ("data_sha256", "tokenizer_sha256"):
        if a["env"].get(key) != b["env"].get(key):
            problems.append(f"{key.replace('_sha256', '')} file (different contents)")
    if global_batch(a) != global_batch(b):
        problems.append(
            f"global batch (micro-batch x accumulation x data-parallel ranks: {global_batch(a)} vs "
            f"{global_batch(b)})"
        )
    if len(a["records"]) != len(b["records"]):
        problems.append(f"logged steps ({len(a['records'])} vs {len(b['records'])})")
    return problems


@dataclass
class TensorDiff:
    name: str
    max_abs: float
    max_rel: float
    allclose: bool
    bitwise: bool


@dataclass
class Parity:
    tensors: list[TensorDiff] = field(default_factory=list)
    max_param_norm_diff: float = 0.0
    first_loss_diff_step: int | None = None
    first_param_norm_diff_step: int | None = None
    first_param_norm_violation_step: int | None = None
    records_bitwise: bool = True

    @property
    def passed(self) -> bool:
        return (
            all(t.allclose for t in self.tensors) and self.first_param_norm_violation_step is None
        )

    @property
    def bitwise(self) -> bool:
        return all(t.bitwise for t in self.tensors) and self.records_bitwise

    @property
    def max_abs(self) -> float:
        return max((t.max_abs for t in self.tensors), default=0.0)


def same_number(x: float, y: float) -> bool:
    """Equal, or both NaN:
    an fp16 step the scaler skipped logs a NaN or inf gradient norm in both runs."""
    return x == y or (math.isnan(x) and math.isnan(y))


def compare(a: dict, wa: dict, b: dict, wb: dict) -> Parity:
    result = Parity()
    if sorted(wa) != sorted(wb):
        raise UserError(f"the runs hold different tensors: {sorted(set(wa) ^ set(wb))}")
    for name in sorted(wa):
        x, y = wa[name].double(), wb[name].double()
        if x.shape != y.shape:
            raise UserError(
                f"tensor {name} has shape {tuple(x.shape)} in one run and "
                f"{tuple(y.shape)} in the other"
            )
        diff = (x - y).abs()
        rel = diff / y.abs().clamp_min(torch.finfo(torch.float32).tiny)
        result.tensors.append(
            TensorDiff(
                name,
                diff.max().item(),
                rel.max().item(),
                torch.allclose(wa[name], wb[name], rtol=RTOL, atol=ATOL),
                torch.equal(wa[name], wb[name]),
            )
        )
    for ra, rb in zip(a["records"], b["records"]):
        step = ra["step"]
        norm_diff = abs(ra["param_norm"] - rb["param_norm"])
        result.max_param_norm_diff = max(result.max_param_norm_diff, norm_diff)
        if ra["loss"] != rb["loss"] and result.first_loss_diff_step is None:
            result.first_loss_diff_step = step
        if norm_diff != 0 and result.first_param_norm_diff_step is None:
            result.first_param_norm_diff_step = step
        if not norm_diff < PARAM_NORM_TOL and result.first_param_norm_violation_step is None:
            result.first_param_norm_violation_step = step
        if not all(same_number(ra[k], rb[k]) for k in ("loss", "grad_norm", "param_norm", "lr")):
            result.records_bitwise = False
    return result


def check(name_a: str, name_b: str) -> tuple[Path, Path, Parity]:
    """Load and compare two runs; raise ``UserError`` when they cannot or must not be compared."""
    run_a, a = load_run(name_a)
    run_b, b = load_run(name_b)
    problems = comparability_problems(a, b)
    if problems:
        raise UserError(
            f"{run_a} and {run_b} are not comparable: they differ in {'; '.join(problems)}"
        )
    return run_a, run_b, compare(a, load_weights(run_a, a), b, load_weights(run_b, b))


def verdict(parity: Parity) -> str:
    if not parity.passed:
        return "FAIL"
    return (
        "PASS (bitwise identical)"
        if parity.bitwise
        else f"PASS (max abs diff {parity.max_abs:.2e})"
    )


def report(run_a: Path, run_b: Path, parity: Parity, brief: bool = False) -> str:
    lines = [f"parity: {run_a} vs {run_b}"]
    if not brief:
        lines.append(
            f"  {'tensor':<40} {'max abs diff':>13} {'max rel diff':>13}  allclose  bitwise"
        )
        for t in parity.tensors:
            lines.append(
                f"  {t.name:<40} {t.max_abs:>13.3e} {t.max_rel:>13.3e}  "
                f"{'yes' if t.allclose else 'NO':<8}  {'yes' if t.bitwise else 'no'}"
            )
    fmt = lambda step: "never" if step is None else f"step {step}"  # noqa: E731
    lines.append(
        f"  weights: {sum(t.allclose for t in parity.tensors)}/{len(parity.tensors)} "
        "tensors allclose "
        f"(rtol={RTOL}, atol={ATOL}), {sum(t.bitwise for t in parity.tensors)} bitwise equal, "
        f"max abs diff {parity.max_abs:.3e}"
    )
    lines.append(
        f"  param norm: max |diff| {parity.max_param_norm_diff:.3e} (limit {PARAM_NORM_TOL}); "
        f"first differs at {fmt(parity.first_param_norm_diff_step)}, "
        f"first over the limit at {fmt(parity.first_param_norm_violation_step)}"
    )
    lines.append(f"  loss first differs at {fmt(parity.first_loss_diff_step)}")
    lines.append(f"verdict: {verdict(parity)}")
    return "\n".join(lines)


def main() -> int:
    parser = OneLineParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run_a", help="step name (step1), step folder or run folder")
    parser.add_argument("run_b")
    parser.add_argument("--brief", action="store_true", help="no per-tensor table")
    args = parser.parse_args()
    run_a, run_b, parity = check(args.run_a, args.run_b)
    print(report(run_a, run_b, parity, args.brief))
    return 0 if parity.passed else 1


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main))
