"""Checkpoints that are either whole or absent, and that refuse to resume a different run.

Layout: ``<out>/checkpoints/step_<k>/`` holds ``meta.json`` (format, step, world size, config),
``state.pt`` (what every rank holds the same: model, optimiser, scheduler, scaler, data position,
the metrics records so far; written by rank 0) and ``rank<r>.pt`` per rank (what differs between
ranks: RNG states, and in sharded steps the rank's shard). Everything is written into a temporary
folder and renamed into place at the end, so a crash mid-write never leaves a folder that looks
like a checkpoint.
"""
import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from config import UserError

FORMAT_VERSION = 1

# Flags that may change when resuming: they say where to write, what to print and how long to wait,
# not what to compute. Every other flag must be the checkpoint's.
RESUMABLE_KEYS = ("out", "save_every", "resume", "quiet", "timeout_s", "trace", "max_memory_mb")


def _barrier():
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def checkpoint_dir(out_dir, step: int) -> Path:
    return Path(out_dir) / "checkpoints" / f"step_{step}"


def save_checkpoint(out_dir, step: int, shared_state: dict, rank_state: dict, rank: int, world_size: int,
                    config: dict) -> Path:
    """Every rank calls this at the same step. Returns the checkpoint folder."""
    final = checkpoint_dir(out_dir, step)
    tmp = final.with_name(f".tmp_step_{step}")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    torch.save(rank_state, tmp / f"rank{rank}.pt")
    if rank == 0:
        torch.save(shared_state, tmp / "state.pt")
        meta = {"format": FORMAT_VERSION, "step": step, "world_size": world_size, "config": config}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    _barrier()  # every rank's file is in tmp before it becomes the checkpoint
    if rank == 0:
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    _barrier()
    return final


def find_checkpoint(resume: str, out_dir) -> Path:
    """``latest``: the highest-numbered complete checkpoint in ``out_dir``; otherwise the given folder."""
    if resume != "latest":
        path = Path(resume)
        if not (path / "meta.json").is_file():
            raise UserError(f"--resume {resume}: no checkpoint there (a checkpoints/step_<k> folder with meta.json)")
        return path
    found = sorted((p for p in (Path(out_dir) / "checkpoints").glob("step_*") if (p / "meta.json").is_file()),
                   key=lambda p: int(p.name.split("_")[1]) if p.name.split("_")[1].isdigit() else -1)
    if not found:
        raise UserError(f"--resume: no checkpoint in {out_dir}/checkpoints; train with --save-every N first "
                        "or pass --resume PATH")
    return found[-1]


def config_differences(saved: dict, current: dict) -> list[str]:
    keys = (set(saved) | set(current)) - set(RESUMABLE_KEYS)
    return sorted(k for k in keys if saved.get(k) != current.get(k))


def load_checkpoint(path: Path, rank: int, world_size: int, config: dict, device) -> tuple[dict, dict]:
    """Check that ``path`` is a whole checkpoint of this very run, then load it.

    Resuming with another config (or world size) would silently train something else, so the
    differing keys are named and the run refuses. A file that cannot be read is reported as
    corrupted, in one line.
    """
    try:
        meta = json.loads((path / "meta.json").read_text())
        step, saved_world, saved_config = meta["step"], meta["world_size"], meta["config"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise UserError(f"checkpoint {path} is corrupted: meta.json unreadable ({error})") from None
    if meta.get("format") != FORMAT_VERSION:
        raise UserError(f"checkpoint {path} has format {meta.get('format')}, this code reads {FORMAT_VERSION}")
    if saved_config.get("step") != config["step"]:
        raise UserError(f"cannot resume {path}: it was written by {saved_config.get('step')}, this is {config['step']}; "
                        "each step resumes only its own checkpoints (their optimiser state is laid out differently)")
    differing = config_differences(saved_config, config)
    if differing:
        details = ", ".join(f"{k}: {saved_config.get(k)!r} -> {config.get(k)!r}" for k in differing)
        raise UserError(f"cannot resume {path}: the config differs from the checkpoint's ({details}); "
                        "resume with the original flags")
    if saved_world != world_size:
        raise UserError(f"cannot resume {path}: saved at world size {saved_world}, now {world_size}; "
                        f"launch {saved_world} ranks")
    states = []
    for name in ("state.pt", f"rank{rank}.pt"):
        try:
            states.append(torch.load(path / name, map_location=device, weights_only=True))
        except Exception as error:  # a truncated zip, a missing file, garbage bytes: all mean "corrupted"
            reason = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise UserError(f"checkpoint {path} is corrupted: {name} unreadable ({reason})") from None
    if states[0].get("step") != step:
        raise UserError(f"checkpoint {path} is corrupted: state.pt is for step {states[0].get('step')}, meta says {step}")
    return states[0], states[1]


def clear_checkpoints(out_dir) -> None:
    """A fresh run replaces the run in ``out_dir``: its checkpoints would otherwise be taken for this run's."""
    shutil.rmtree(Path(out_dir) / "checkpoints", ignore_errors=True)
