"""Command-line flags shared by every step, and the one way a user mistake ends a run.

Every step builds its parser here, so a shared flag means the same thing in every step folder.
A flag that belongs to one step's idea (``--bucket-cap-mb``, ``--trace``, ...) is added by that
step's own files, so the diff that introduces the idea introduces its flag. `--help` lists them all
with their defaults. The parsed flags become a plain ``dict``: it is written into metrics.json and
into every checkpoint, and `compare/parity.py` reads it back to decide whether two runs are
comparable.
"""
import argparse
import ctypes
import os
import platform
import re
import resource
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent  # common/.. or stepK_x/..: both are the repo root


class UserError(Exception):
    """A mistake the user can fix. It ends the run with one line on stderr and exit code 2."""


# The memory budget this process runs under (--max-memory-mb), for the out-of-memory line below.
memory_budget = {"mb": None, "step": None, "start_mb": None}

# How an allocation that failed reads: Python's MemoryError; torch's CPU allocator ("DefaultCPUAllocator:
# can't allocate memory: you tried to allocate N bytes. Error code 12 (Cannot allocate memory)"); a
# C++ std::bad_alloc that torch passed on; CUDA's "CUDA out of memory".
OUT_OF_MEMORY = re.compile(r"can't allocate memory|Cannot allocate memory|std::bad_alloc|out of memory", re.I)


def is_out_of_memory(error: BaseException) -> bool:
    if isinstance(error, MemoryError):
        return True
    if not isinstance(error, RuntimeError):
        return False
    # Under a budget a thread's stack (8 MiB, private and writable) counts as data memory, so a budget too
    # small for the libraries' threads (datasets reads the corpus with a pool) fails to start one: Python says
    # "can't start new thread". Without a budget it may be a limit on processes instead: not claimed as memory.
    return bool(OUT_OF_MEMORY.search(str(error))) or (
        memory_budget["mb"] is not None and "can't start new thread" in str(error))


def out_of_memory_message(error: BaseException) -> str:
    """One line: who ran out, within which budget, why this step needs that much, what to do instead."""
    asked = re.search(r"tried to allocate (\d+) bytes", str(error))
    what = f"could not allocate {int(asked.group(1)) / 2**20:,.1f} MiB more" if asked else "could not get more memory"
    rank = os.environ.get("RANK")
    who = f"rank {rank} of {os.environ.get('WORLD_SIZE')}" if rank is not None else "this process"
    if memory_budget["mb"] is not None:
        within = (f"within --max-memory-mb {memory_budget['mb']:g} (RLIMIT_DATA: {memory_budget['start_mb']:,.0f} MiB "
                  f"held at start-up + {memory_budget['mb']:g} MiB)")
        fix = ", or raise --max-memory-mb"
    else:
        within = "(the machine's memory, or a limit set outside this program)"
        fix = ", or train a smaller model"
    step = memory_budget["step"] or "this program"
    number = int(step[4]) if step.startswith("step") and step[4:5].isdigit() else None
    if number == 7:
        why = f"{step} already shards everything: use more ranks or a smaller micro-batch"
    else:
        replicated = {5: "the weights and the gradients", 6: "the weights"}.get(
            number, "the whole training state (weights, gradients, AdamW's moments)")
        why = f"{step} keeps {replicated} on every rank, however many ranks: train with step7_zero3 on more ranks"
    return f"out of memory: {who} {what} {within}; {why}{fix} (compare/estimate.py predicts the bytes per rank)"


# Failures that come in the middle of a run and that a module other than this one can explain: each
# function returns (message, exit code) for an exception it recognises, else None. distributed.py adds
# the failed collective (a rank died, froze, or the ranks disagreed); this module, which every step has,
# step 0 included, knows nothing about process groups.
failure_explainers = []


def explain_failure(error: BaseException) -> tuple[str, int] | None:
    """(one line, exit code) for a failure that ends a run without a traceback, or None."""
    if is_out_of_memory(error):
        return out_of_memory_message(error), 2
    for explain in failure_explainers:
        explained = explain(error)
        if explained is not None:
            return explained
    return None


def exit_on_user_error(main):
    """Run ``main()``; turn a ``UserError`` into one line and exit code 2, with no traceback.

    Running out of memory is reported the same way (a model too big for the budget is a choice the
    user can change), and so is a collective that failed (exit 3, ``distributed.py``), but the process
    ends with ``os._exit``: the failure may have come in the middle of training, with a process group
    and a DDP reducer alive, and a normal interpreter exit would tear them down while peers still wait
    in a collective, or wait itself for a peer that will never answer (torchrun stops the peers)."""
    try:
        return main()
    except UserError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        sys.exit(2)
    except (MemoryError, RuntimeError) as error:
        explained = explain_failure(error)
        if explained is None:
            raise
        error.__traceback__ = None  # let go of the frames (and the tensors they hold) before formatting
        message, code = explained
        sys.stdout.flush()
        os.write(2, f"error: {message}\n".encode())
        os._exit(code)


def limit_memory(max_memory_mb: float | None, step: str) -> None:
    """Let this process allocate at most ``max_memory_mb`` MiB more data memory than it holds now.

    Called once the corpus is tokenized, before the model or the process group: the budget is what
    training adds, as a GPU's memory would be, and it does not depend on how much the libraries and the
    data take on this machine. (Set before tokenizing, a small budget made the Rust tokenizer abort the
    process, or hang, instead of failing an allocation we can report: measured at 1, 16 and 32 MiB.) The OS
    enforces it: ``RLIMIT_DATA`` caps the data segment and every private writable mapping, which is
    where torch's CPU tensors live (``brk`` and ``mmap`` both honour it since Linux 4.7). An allocation
    beyond it fails like any out-of-memory: torch raises, and ``exit_on_user_error`` turns that into
    one line. Why this limit and not ``RLIMIT_AS`` or an external ``prlimit``: docs/design.md."""
    if max_memory_mb is not None and max_memory_mb <= 0:
        raise UserError(f"--max-memory-mb must be positive, got {max_memory_mb:g}")
    memory_budget.update(mb=None, step=step, start_mb=None)  # the budget is named once it is in force
    if max_memory_mb is None:
        return
    held = data_memory_bytes()
    if held is None:
        raise UserError("--max-memory-mb needs Linux (/proc/self/status and RLIMIT_DATA); run without it")
    limit = held + int(max_memory_mb * 2**20)
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    if hard != resource.RLIM_INFINITY and limit > hard:
        raise UserError(f"--max-memory-mb {max_memory_mb:g} goes past this process's hard data limit "
                        f"({hard / 2**20:,.0f} MiB, {held / 2**20:,.0f} MiB of it already held); lower it")
    release_freed_blocks()
    resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))
    memory_budget.update(mb=max_memory_mb, start_mb=held / 2**20)


def release_freed_blocks(threshold: int = 2**20) -> None:
    """Make glibc give every freed block of ``threshold`` bytes or more straight back to the OS.

    By default glibc serves a block from its heaps (and keeps it there when freed) unless it is larger
    than its mmap threshold, which rises, as large blocks are freed, up to 32 MiB. A data limit then
    counts the allocator's cache as if it were tensors: measured on step 7 (24 blocks of 27 MiB, 4 ranks),
    a peak of 3.2-4.0 GiB of data memory per rank instead of 1.7 GiB. ``mallopt(M_MMAP_THRESHOLD)`` fixes
    the threshold, so a freed tensor's memory leaves the process at once. Other C libraries: no-op."""
    if platform.libc_ver()[0] != "glibc":
        return
    m_mmap_threshold = -3  # from <malloc.h>
    ctypes.CDLL(None).mallopt(m_mmap_threshold, threshold)


def data_memory_bytes() -> int | None:
    """What ``RLIMIT_DATA`` counts for this process now (``VmData``), or None where /proc is missing."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmData:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class OneLineParser(argparse.ArgumentParser):
    """argparse prints the whole usage block on a bad flag; one line says enough."""

    def error(self, message):
        raise UserError(f"{message} (see --help)")


def check_writable_folder(path, what: str) -> None:
    """Refuse, before anything is written, a folder that cannot be created or written: ``path`` itself or one
    of its parents is a file, or the nearest existing one is not writable. ``what`` names it for the user
    (``--out runs/x``). A missing folder is fine: it is created when the first file is written."""
    path = Path(path)
    for folder in [path, *path.parents]:
        if not folder.exists():
            continue
        if not folder.is_dir():
            raise UserError(f"{what}: {folder} is a file, where a folder is needed; choose another path")
        if not os.access(folder, os.W_OK | os.X_OK):
            raise UserError(f"{what}: cannot write in {folder} (permission denied); choose a folder of your own")
        return


def check_writable_file(path, what: str) -> None:
    """Refuse, before any work, a file that cannot be written at the end of it: ``path`` is a folder, or its
    folder cannot be made or written (``check_writable_folder``)."""
    if Path(path).is_dir():
        raise UserError(f"{what} is a folder; name a file")
    check_writable_folder(Path(path).parent, what)


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
                     help="continue from the newest checkpoint in --out (an error if there is none), from PATH, or, "
                          "with 'auto', from the newest one or afresh when there is none (for torchrun --max-restarts)")
    run.add_argument("--async-save", action="store_true",
                     help="copy the state to memory at each checkpoint and write it in the background")
    run.add_argument("--quiet", action="store_true", help="no per-step console lines")
    run.add_argument("--max-memory-mb", type=float, default=None, metavar="MB",
                     help="memory budget per rank: the OS refuses this process more than MB MiB of data memory "
                          "(tensors, heap) beyond what it holds at start-up (Python, torch, libraries), via "
                          "RLIMIT_DATA; going over it ends the run with one line")

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
    p.set_defaults(step=step)  # recorded with the flags: which step wrote a run or a checkpoint
    return p


def parse_config(parser: argparse.ArgumentParser, argv=None) -> dict:
    """Parse and sanity-check the shared flags, then put the memory budget in force; every problem is a
    ``UserError``. A step checks its own."""
    config = vars(parser.parse_args(argv))
    check_config(config)
    if config["max_memory_mb"] is not None and config["max_memory_mb"] <= 0:
        raise UserError(f"--max-memory-mb must be positive, got {config['max_memory_mb']:g}")
    return config


def check_config(config: dict) -> None:
    """The checks of the shared flags (what ``parse_config`` does, less the budget): for a tool that starts
    trainers and wants to refuse their flags before it starts any (compare/tour.py)."""
    positive = ["steps", "micro_batch_size", "grad_accum", "n_layer", "n_head", "n_embd", "seq_len"]
    for key in positive:
        if config[key] < 1:
            raise UserError(f"--{key.replace('_', '-')} must be at least 1, got {config[key]}")
    if config["n_embd"] % config["n_head"]:
        raise UserError(f"--n-embd {config['n_embd']} must be divisible by --n-head {config['n_head']}")
    # AdamW refuses a negative --lr, --weight-decay or a beta outside [0, 1) itself, but with a traceback from
    # inside torch once the corpus is tokenized; a zero --lr would divide by zero in the schedule. Written as
    # "not >=" and the like so that nan is refused too.
    for key in ("lr", "loss_scale_init"):
        if not config[key] > 0:
            raise UserError(f"--{key.replace('_', '-')} must be positive, got {config[key]:g}")
    for key in ("save_every", "warmup_steps", "grad_clip", "min_lr", "weight_decay"):
        if not config[key] >= 0:
            raise UserError(f"--{key.replace('_', '-')} cannot be negative, got {config[key]:g}")
    for key in ("dropout", "beta1", "beta2"):
        if not 0.0 <= config[key] < 1.0:
            raise UserError(f"--{key} must be in [0, 1), got {config[key]:g}")
    for key in ("data", "tokenizer"):
        if Path(config[key]).is_dir():
            raise UserError(f"--{key} {config[key]} is a folder, not a file; pass the file itself")
        if not Path(config[key]).is_file():
            raise UserError(f"--{key} {config[key]} does not exist; pass a readable file")
    check_writable_folder(config["out"], f"--out {config['out']}")

