"""The memory budget (``--max-memory-mb``) and the one line that says a run ran out of memory.

Operations code, not the lesson: skip it on a first read. ``limit_memory`` asks the OS to refuse
this process more data memory than the budget, as a GPU's memory would; running out (under a budget
or not) ends the run with one line that says who ran out, within which budget, why this step needs
that much, and what to do instead (``failures.exit_on_user_error`` prints it, exit code 2).
"""

import ctypes
import os
import platform
import re
import resource

from failures import UserError, failure_explainers

# The memory budget this process runs under (--max-memory-mb), for the out-of-memory line below.
budget = {"mb": None, "step": None, "start_mb": None, "gpu": None}

# How an allocation that failed reads: Python's MemoryError; torch's CPU allocator
# ("DefaultCPUAllocator: can't allocate memory: you tried to allocate N bytes. Error code 12 (Cannot
# allocate memory)"); a C++ std::bad_alloc that torch passed on; CUDA's "CUDA out of memory".
OUT_OF_MEMORY = re.compile(
    r"can't allocate memory|Cannot allocate memory|std::bad_alloc|out of memory", re.I
)


def is_out_of_memory(error: BaseException) -> bool:
    if isinstance(error, MemoryError):
        return True
    if not isinstance(error, RuntimeError):
        return False
    # Under a budget a thread's stack (8 MiB, private and writable) counts as data memory, so a
    # budget too small for the libraries' threads (datasets reads the corpus with a pool) fails to
    # start one: Python says "can't start new thread". Without a budget it may be a limit on
    # processes instead: not claimed as memory.
    return bool(OUT_OF_MEMORY.search(str(error))) or (
        budget["mb"] is not None and "can't start new thread" in str(error)
    )


def out_of_memory_message(error: BaseException) -> str:
    """One line: who ran out, within which budget,
    why this step needs that much, what to do instead."""
    asked = re.search(r"tried to allocate (\d+) bytes", str(error))
    what = (
        f"could not allocate {int(asked.group(1)) / 2**20:,.1f} MiB more"
        if asked
        else "could not get more memory"
    )
    rank = os.environ.get("RANK")
    who = f"rank {rank} of {os.environ.get('WORLD_SIZE')}" if rank is not None else "this process"
    if budget["gpu"] is not None:
        within = f"within --max-memory-mb {budget['mb']:g} of {budget['gpu']}'s memory"
        fix = ", or raise --max-memory-mb"
    elif budget["mb"] is not None:
        within = (
            f"within --max-memory-mb {budget['mb']:g} (RLIMIT_DATA: {budget['start_mb']:,.0f} MiB "
            f"held at start-up + {budget['mb']:g} MiB)"
        )
        fix = ", or raise --max-memory-mb"
    else:
        within = "(the machine's memory, or a limit set outside this program)"
        fix = ", or train a smaller model"
    step = budget["step"] or "this program"
    number = int(step[4]) if step.startswith("step") and step[4:5].isdigit() else None
    if number == 7:
        why = f"{step} already shards everything: use more ranks or a smaller micro-batch"
    else:
        replicated = {5: "the weights and the gradients", 6: "the weights"}.get(
            number, "the whole training state (weights, gradients, AdamW's moments)"
        )
        why = (
            f"{step} keeps {replicated} on every rank, however many ranks: train with "
            "step7_zero3 on more ranks"
        )
    return (
        f"out of memory: {who} {what} {within}; {why}{fix} (compare/estimate.py predicts "
        "the bytes per rank)"
    )


def explain_out_of_memory(error: BaseException) -> tuple[str, int] | None:
    """(one line, exit code 2) for running out of memory, else None."""
    return (out_of_memory_message(error), 2) if is_out_of_memory(error) else None


# Consulted first, before the explanations other modules add (failures.explain_failure).
failure_explainers.insert(0, explain_out_of_memory)


def limit_memory(max_memory_mb: float | None, step: str, device=None) -> None:
    """Let this process allocate at most ``max_memory_mb`` MiB more data memory than it holds now;
    on a CUDA ``device``, at most ``max_memory_mb`` MiB of that GPU's memory
    (``torch.cuda.set_per_process_memory_fraction``: the caching allocator refuses more, as a
    smaller GPU would; ranks sharing one GPU each get their own budget).

    Called once the corpus is tokenized, before the model or the process group: the budget is what
    training adds, as a GPU's memory would be, and it does not depend on how much the libraries and
    the data take on this machine. (Set before tokenizing, a small budget made the Rust tokenizer
    abort the process, or hang, instead of failing an allocation we can report: docs/design.md.) The
    OS enforces it: ``RLIMIT_DATA`` caps the data segment and every private writable mapping, which
    is where torch's CPU tensors live (``brk`` and ``mmap`` both honour it since Linux 4.7). An
    allocation beyond it fails like any out-of-memory: torch raises, and ``exit_on_user_error``
    (failures.py) turns that into one line. Why this limit and not ``RLIMIT_AS`` or an external
    ``prlimit``: docs/design.md."""
    if max_memory_mb is not None and max_memory_mb <= 0:
        raise UserError(f"--max-memory-mb must be positive, got {max_memory_mb:g}")
    # the budget is named once it is in force
    budget.update(mb=None, step=step, start_mb=None, gpu=None)
    if max_memory_mb is None:
        return
    if device is not None and device.type == "cuda":
        import torch

        total = torch.cuda.get_device_properties(device).total_memory
        if max_memory_mb * 2**20 > total:
            raise UserError(
                f"--max-memory-mb {max_memory_mb:g} is more than {device}'s "
                f"{total / 2**20:,.0f} MiB; "
                "lower it"
            )
        torch.cuda.set_per_process_memory_fraction(max_memory_mb * 2**20 / total, device)
        budget.update(mb=max_memory_mb, gpu=str(device))
        return
    held = data_memory_bytes()
    if held is None:
        raise UserError(
            "--max-memory-mb needs Linux (/proc/self/status and RLIMIT_DATA); run without it"
        )
    limit = held + int(max_memory_mb * 2**20)
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    if hard != resource.RLIM_INFINITY and limit > hard:
        raise UserError(
            f"--max-memory-mb {max_memory_mb:g} goes past this process's hard data limit "
            f"({hard / 2**20:,.0f} MiB, {held / 2**20:,.0f} MiB of it already held); lower it"
        )
    release_freed_blocks()
    resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))
    budget.update(mb=max_memory_mb, start_mb=held / 2**20)


def release_freed_blocks(threshold: int = 2**20) -> None:
    """Make glibc give every freed block of ``threshold`` bytes or more straight back to the OS.

    By default glibc serves a block from its heaps (and keeps it there when freed) unless it is
    larger than its mmap threshold, which rises, as large blocks are freed, up to 32 MiB. A data
    limit then counts the allocator's cache as if it were tensors (step 7's peak per rank about
    doubled: docs/design.md, "glibc's mmap threshold"). ``mallopt(M_MMAP_THRESHOLD)`` fixes the
    threshold, so a freed tensor's memory leaves the process at once. Other C libraries: no-op."""
    if platform.libc_ver()[0] != "glibc":
        return
    m_mmap_threshold = -3  # from <malloc.h>
    ctypes.CDLL(None).mallopt(m_mmap_threshold, threshold)


def data_memory_bytes() -> int | None:
    """What ``RLIMIT_DATA`` counts for this process now
    (``VmData``), or None where /proc is missing."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmData:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
