"""Command-line flags shared by every step, and the one way a user mistake ends a run.

Every step builds its parser here, so a shared flag means the same thing in every step folder.
A flag that belongs to one step's idea (``--bucket-cap-mb``, ``--trace``, ...) is added by that
step's own files, so the diff that introduces the idea introduces its flag. `--help` lists them all
with their defaults. The parsed flags become a plain ``dict``: it is written into metrics.json and
into every checkpoint, and `compare/parity.py` reads it back to decide whether two runs are
comparable.
"""
import argparse
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent  # common/.. or stepK_x/..: both are the repo root


class UserError(Exception):
    """A mistake the user can fix. It ends the run with one line on stderr and exit code 2."""


def exit_on_user_error(main):
    """Run ``main()``; turn a ``UserError`` into one line and exit code 2, with no traceback."""
    try:
        return main()
    except UserError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        sys.exit(2)


class OneLineParser(argparse.ArgumentParser):
    """argparse prints the whole usage block on a bad flag; one line says enough."""

    def error(self, message):
        raise UserError(f"{message} (see --help)")


def _path_under_repo(value: str) -> str:
    path = Path(value)
    return str(path if path.is_absolute() else (Path.cwd() / path).resolve())


def build_parser(step: str) -> argparse.ArgumentParser:
    """The flags every step has. Defaults are the reference workload (about a minute on 2 CPU cores)."""
    p = OneLineParser(
        prog=f"{step}/train.py",
        description=f"{step}: train a small GPT-2 on tiny shakespeare.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    run = p.add_argument_group("run")
    run.add_argument("--steps", type=int, default=40, help="optimiser steps")
    run.add_argument("--micro-batch-size", type=int, default=8, help="sequences per forward pass, per rank")
    run.add_argument("--grad-accum", type=int, default=2, help="micro-batches accumulated per optimiser step")
    run.add_argument("--seed", type=int, default=1337)
    run.add_argument("--amp", choices=["none", "bf16", "fp16"], default="none", help="autocast dtype; fp16 adds a gradient scaler")
    run.add_argument("--loss-scale-init", type=float, default=2.0**16,
                     help="fp16: the gradient scaler's first loss scale (halved on every overflow, which skips the step)")
    run.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: cuda when available")
    run.add_argument("--out", type=_path_under_repo, default=str(REPO_ROOT / "runs" / step), help="run folder")
    run.add_argument("--save-every", type=int, default=20, help="checkpoint period in optimiser steps (0 = never)")
    run.add_argument("--resume", nargs="?", const="latest", default=None, metavar="PATH",
                     help="continue from the latest checkpoint in --out, or from PATH")
    run.add_argument("--quiet", action="store_true", help="no per-step console lines")

    model = p.add_argument_group("model and data")
    model.add_argument("--n-layer", type=int, default=2)
    model.add_argument("--n-head", type=int, default=4)
    model.add_argument("--n-embd", type=int, default=128)
    model.add_argument("--seq-len", type=int, default=64, help="tokens per sample (the model's max sequence length)")
    model.add_argument("--dropout", type=float, default=0.0)
    model.add_argument("--data", type=_path_under_repo, default=str(REPO_ROOT / "data" / "tinyshakespeare.txt"))
    model.add_argument("--tokenizer", type=_path_under_repo, default=str(REPO_ROOT / "data" / "tokenizer.json"))

    optim = p.add_argument_group("optimiser and schedule")
    optim.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    optim.add_argument("--min-lr", type=float, default=2e-4, help="learning rate at the end of the cosine")
    optim.add_argument("--warmup-steps", type=int, default=5)
    optim.add_argument("--weight-decay", type=float, default=0.1)
    optim.add_argument("--beta1", type=float, default=0.9)
    optim.add_argument("--beta2", type=float, default=0.95)
    optim.add_argument("--grad-clip", type=float, default=1.0, help="max global grad norm (0 = no clipping)")
    p.set_defaults(step=step)  # recorded with the flags: a checkpoint of one step is not resumed by another
    return p


def parse_config(parser: argparse.ArgumentParser, argv=None) -> dict:
    """Parse and sanity-check the shared flags; every problem is a ``UserError``. A step checks its own."""
    config = vars(parser.parse_args(argv))
    positive = ["steps", "micro_batch_size", "grad_accum", "n_layer", "n_head", "n_embd", "seq_len"]
    for key in positive:
        if config[key] < 1:
            raise UserError(f"--{key.replace('_', '-')} must be at least 1, got {config[key]}")
    if config["n_embd"] % config["n_head"]:
        raise UserError(f"--n-embd {config['n_embd']} must be divisible by --n-head {config['n_head']}")
    if config["loss_scale_init"] <= 0:
        raise UserError(f"--loss-scale-init must be positive, got {config['loss_scale_init']}")
    if config["save_every"] < 0 or config["warmup_steps"] < 0 or config["grad_clip"] < 0:
        raise UserError("--save-every, --warmup-steps and --grad-clip cannot be negative")
    if not 0.0 <= config["dropout"] < 1.0:
        raise UserError(f"--dropout must be in [0, 1), got {config['dropout']}")
    for key in ("data", "tokenizer"):
        if not Path(config[key]).is_file():
            raise UserError(f"--{key} {config[key]} does not exist; pass a readable file")
    return config

