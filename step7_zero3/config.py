"""Command-line flags shared by every step.

Every step builds its parser here, so a shared flag means the same thing in every step folder.
A flag that belongs to one step's idea (``--bucket-cap-mb``, ``--trace``, ...) is added by that
step's own files, so the diff that introduces the idea introduces its flag. `--help` lists them all
with their defaults. The parsed flags become a plain ``dict``: it is written into metrics.json and
into every checkpoint, and `compare/parity.py` reads it back to decide whether two runs are
comparable. A mistake in them is a ``UserError``: one line and exit code 2 (failures.py).
"""

import argparse
import os
from pathlib import Path

# How a run ends on a mistake, and the memory budget: operations code, in modules of their own (skip
# them on a first read). Named here too because every train.py imports them from config.
from failures import (  # noqa: F401
    Preemption,
    UserError,
    exit_on_user_error,
    explain_failure,
    failure_explainers,
    not_written,
)
from memory_budget import limit_memory  # noqa: F401

# common/.. or stepK_x/..: both are the repo root
REPO_ROOT = Path(__file__).resolve().parent.parent


class OneLineParser(argparse.ArgumentParser):
    """argparse prints the whole usage block on a bad flag; one line says enough."""

    def error(self, message):
        raise UserError(f"{message} (see --help)")


def check_writable_folder(path, what: str) -> None:
    """Refuse, before anything is written, a folder that cannot be created or written: ``path``
    itself or one of its parents is a file, or the nearest existing one is not writable. ``what``
    names it for the user (``--out runs/x``). A missing folder is fine: it is created when the first
    file is written."""
    path = Path(path)
    for folder in [path, *path.parents]:
        if not folder.exists():
            continue
        if not folder.is_dir():
            raise UserError(
                f"{what}: {folder} is a file, where a folder is needed; choose another path"
            )
        if not os.access(folder, os.W_OK | os.X_OK):
            raise UserError(
                f"{what}: cannot write in {folder} (permission denied); choose a folder of your own"
            )
        return


def check_writable_file(path, what: str) -> None:
    """Refuse, before any work, a file that cannot be written at the end of it: ``path`` is a
    folder, or its folder cannot be made or written (``check_writable_folder``)."""
    if Path(path).is_dir():
        raise UserError(f"{what} is a folder; name a file")
    check_writable_folder(Path(path).parent, what)


def _path_under_repo(value: str) -> str:
    path = Path(value)
    return str(path if path.is_absolute() else (Path.cwd() / path).resolve())


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's help ends with its default, but a switch's: "--nondeterministic ... (default:
    True)" read as nondeterministic by default (its value is the deterministic setting it turns
    off). A switch is off until given."""

    def _get_help_string(self, action):
        return action.help if action.nargs == 0 else super()._get_help_string(action)


def build_parser(step: str) -> argparse.ArgumentParser:
    """The flags every step has. Defaults are the reference workload
    (about a minute on 2 CPU cores)."""
    p = OneLineParser(
        prog=f"{step}/train.py",
        description=f"{step}: train a small GPT-2 on tiny shakespeare.",
        formatter_class=DefaultsHelpFormatter,
    )
    run = p.add_argument_group("run")
    run.add_argument("--steps", type=int, default=40, help="optimiser steps")
    run.add_argument(
        "--micro-batch-size", type=int, default=8, help="sequences per forward pass, per rank"
    )
    run.add_argument(
        "--grad-accum", type=int, default=2, help="micro-batches accumulated per optimiser step"
    )
    run.add_argument("--seed", type=int, default=1337)
    run.add_argument(
        "--amp",
        choices=["none", "bf16", "fp16"],
        default="none",
        help="autocast dtype; fp16 adds a gradient scaler",
    )
    run.add_argument(
        "--loss-scale-init",
        type=float,
        default=2.0**16,
        help="fp16: the gradient scaler's first loss scale (halved on every overflow, which "
        "skips the step)",
    )
    run.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="auto: cuda when available",
    )
    run.add_argument(
        "--out", type=_path_under_repo, default=str(REPO_ROOT / "runs" / step), help="run folder"
    )
    run.add_argument(
        "--save-every",
        type=int,
        default=20,
        help="checkpoint period in optimiser steps (0 = never)",
    )
    run.add_argument(
        "--resume",
        nargs="?",
        const="latest",
        default=None,
        metavar="PATH",
        help="continue from the newest checkpoint in --out (an error if there is none), "
        "from PATH, or, "
        "with 'auto', from the newest one or afresh when there is none (for torchrun "
        "--max-restarts)",
    )
    run.add_argument(
        "--preempt-grace-s",
        type=float,
        default=0.0,
        metavar="S",
        help="on SIGTERM (a spot machine's notice, torchrun stopping), finish the step, "
        "save it and exit "
        "with code 4 within S seconds; 0: SIGTERM ends the run at once",
    )
    run.add_argument("--quiet", action="store_true", help="no per-step console lines")
    run.add_argument(
        "--nondeterministic",
        dest="deterministic",
        action="store_false",
        help="torch's default kernels instead of deterministic ones (on a GPU some backward "
        "passes add "
        "atomically): two runs, a resumed run and the steps' parity no longer agree bit for bit. "
        "Without it, every kernel is deterministic",
    )
    run.add_argument(
        "--max-memory-mb",
        type=float,
        default=None,
        metavar="MB",
        help="memory budget per rank: the OS refuses this process more than MB MiB of data memory "
        "(tensors, heap) beyond what it holds at start-up (Python, torch, libraries), via "
        "RLIMIT_DATA; going over it ends the run with one line",
    )

    model = p.add_argument_group("model and data")
    model.add_argument("--n-layer", type=int, default=2)
    model.add_argument("--n-head", type=int, default=4)
    model.add_argument("--n-embd", type=int, default=128)
    model.add_argument(
        "--seq-len",
        type=int,
        default=64,
        help="tokens per sample (the model's max sequence length)",
    )
    model.add_argument("--dropout", type=float, default=0.0)
    model.add_argument(
        "--attention",
        choices=["auto", "math", "sdpa"],
        default="auto",
        help="math: scores, mask and softmax written out (the same kernels on every device); sdpa: "
        "scaled_dot_product_attention (flash attention on a GPU); auto: sdpa on cuda, else math",
    )
    model.add_argument(
        "--data", type=_path_under_repo, default=str(REPO_ROOT / "data" / "tinyshakespeare.txt")
    )
    model.add_argument(
        "--tokenizer", type=_path_under_repo, default=str(REPO_ROOT / "data" / "tokenizer.json")
    )

    optim = p.add_argument_group("optimiser and schedule")
    optim.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    optim.add_argument(
        "--min-lr", type=float, default=2e-4, help="learning rate at the end of the cosine"
    )
    optim.add_argument("--warmup-steps", type=int, default=5)
    optim.add_argument("--weight-decay", type=float, default=0.1)
    optim.add_argument("--beta1", type=float, default=0.9)
    optim.add_argument("--beta2", type=float, default=0.95)
    optim.add_argument(
        "--grad-clip", type=float, default=1.0, help="max global grad norm (0 = no clipping)"
    )
    model.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile each block, as torchtitan does: fused kernels, other rounding "
        "than eager",
    )
    p.set_defaults(step=step)  # recorded with the flags: which step wrote a run or a checkpoint
    return p


def parse_config(parser: argparse.ArgumentParser, argv=None) -> dict:
    """Parse and sanity-check the shared flags, then put the memory budget in force; every problem
    is a ``UserError``. A step checks its own."""
    config = vars(parser.parse_args(argv))
    check_config(config)
    config["attention"] = resolved_attention(config)
    if config["max_memory_mb"] is not None and config["max_memory_mb"] <= 0:
        raise UserError(f"--max-memory-mb must be positive, got {config['max_memory_mb']:g}")
    return config


def resolved_attention(config: dict) -> str:
    """``--attention auto`` made concrete,
    so that metrics.json and checkpoints say which attention ran."""
    if config.get("attention", "auto") != "auto":
        return config["attention"]
    return "sdpa" if on_cuda(config) else "math"


def on_cuda(config: dict) -> bool:
    """Whether ``--device`` (``auto`` included) puts this run on a GPU."""
    import torch  # here, not at the top: --help and flag errors need no torch

    return config["device"] == "cuda" or (config["device"] == "auto" and torch.cuda.is_available())


def check_grace(grace_s: float) -> None:
    """Under torchrun, --preempt-grace-s must end before torchrun kills what it told to stop: it
    waits --shutdown_timeout (its environment's TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 30 s) after
    its SIGTERM."""
    if "TORCHELASTIC_RESTART_COUNT" not in os.environ or not grace_s:
        return
    launcher_s = float(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", 30))
    if grace_s >= launcher_s:
        raise UserError(
            f"--preempt-grace-s {grace_s:g} is not shorter than the {launcher_s:g} s "
            "torchrun waits after "
            "a SIGTERM before it kills its ranks: give less (the save must fit in it), or raise "
            "torchrun's TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
        )


def check_config(config: dict) -> None:
    """The checks of the shared flags (what ``parse_config`` does, less the budget): for a tool that
    starts trainers and wants to refuse their flags before it starts any (compare/tour.py)."""
    positive = ["steps", "micro_batch_size", "grad_accum", "n_layer", "n_head", "n_embd", "seq_len"]
    for key in positive:
        if config[key] < 1:
            raise UserError(f"--{key.replace('_', '-')} must be at least 1, got {config[key]}")
    if config["n_embd"] % config["n_head"]:
        raise UserError(
            f"--n-embd {config['n_embd']} must be divisible by --n-head {config['n_head']}"
        )
    # AdamW refuses a negative --lr, --weight-decay or a beta outside [0, 1) itself, but with a
    # traceback from inside torch once the corpus is tokenized; a zero --lr would divide by zero in
    # the schedule. Written as "not >=" and the like so that nan is refused too.
    # the last where defined: steps 4-6, bench, estimate
    for key in ("lr", "loss_scale_init", "bucket_cap_mb"):
        if key in config and not config[key] > 0:
            raise UserError(f"--{key.replace('_', '-')} must be positive, got {config[key]:g}")
    for key in (
        "save_every",
        "preempt_grace_s",
        "warmup_steps",
        "grad_clip",
        "min_lr",
        "weight_decay",
    ):
        if not config[key] >= 0:
            raise UserError(f"--{key.replace('_', '-')} cannot be negative, got {config[key]:g}")
    check_grace(config["preempt_grace_s"])
    for key in ("dropout", "beta1", "beta2"):
        if not 0.0 <= config[key] < 1.0:
            raise UserError(f"--{key} must be in [0, 1), got {config[key]:g}")
    for key in ("data", "tokenizer"):
        if Path(config[key]).is_dir():
            raise UserError(f"--{key} {config[key]} is a folder, not a file; pass the file itself")
        if not Path(config[key]).is_file():
            raise UserError(f"--{key} {config[key]} does not exist; pass a readable file")
    check_writable_folder(config["out"], f"--out {config['out']}")
