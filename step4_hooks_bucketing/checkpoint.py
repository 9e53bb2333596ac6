"""Checkpoints that are whole or absent, found again by ``--resume``, and refused to another run.

``<out>/checkpoints/step_<k>/``: ``meta.json`` (format, step, world size, config, parameter shapes), ``state.pt``
(written by rank 0: what every rank holds alike) and ``rank<r>.pt`` (the rank's RNG and, from step 5 on, its slices).

1. **Whole or absent**: written into ``.tmp_step_<k>``, renamed ``step_<k>`` once every rank's file is in it.
2. **Read by parameter name** (``resharding.py``): any step resumes any other's checkpoint at any world size.
3. **One interface**, as torchtitan's ``Stateful``: what holds state says what this rank saves and loads its part
   back. The writer adds the step, each rank's RNG and the ``RunState``; the loop hands it the model and optimiser.
"""
import json
import os
import re
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist

from config import UserError, not_written
from seeding import rng_state

FORMAT_VERSION = 2
OWN_CHECKPOINT_FOLDER = re.compile(r"(\.tmp_|\.old_)?step_\d+")  # what a save writes, all a fresh run removes


def checkpoint_dir(out_dir, step: int) -> Path:
    return Path(out_dir) / "checkpoints" / f"step_{step}"


def checkpoint_meta(step: int, world_size: int, config: dict, shapes: dict, data_parallel_size=None) -> str:
    """meta.json. ``data_parallel_size``: the ranks that drew their own samples, when not all did (TP, PP)."""
    meta = {"format": FORMAT_VERSION, "step": step, "world_size": world_size, "config": config,
            "shapes": {name: list(shape) for name, shape in shapes.items()}}
    if data_parallel_size is not None and data_parallel_size != world_size:
        meta["data_parallel_size"] = data_parallel_size
    return json.dumps(meta, indent=1) + "\n"


def complete_checkpoints(out_dir) -> list[Path]:
    """The whole checkpoints in ``out_dir``, oldest first (by step number, not by name)."""
    folders = [p for p in (Path(out_dir) / "checkpoints").glob("step_*")
               if p.name[5:].isdigit() and (p / "meta.json").is_file()]
    return sorted(folders, key=lambda p: int(p.name[5:]))


def find_checkpoint(resume: str | None, out_dir) -> Path | None:
    """``--resume``: ``auto``, the newest whole checkpoint in ``out_dir`` or None (a fresh start) when there
    is none; ``latest``, the same but none is an error; otherwise the given folder; None: a fresh start."""
    if resume is None:
        return None
    if resume in ("auto", "latest"):
        found = complete_checkpoints(out_dir)
        if not found and resume == "latest":
            raise UserError(f"--resume: no checkpoint in {out_dir}/checkpoints; train with --save-every N first, "
                            "pass --resume PATH, or --resume auto to start afresh when there is none")
        return found[-1] if found else None
    if not (Path(resume) / "meta.json").is_file():
        from resharding import not_a_checkpoint  # the advice: which checkpoint was probably meant
        raise not_a_checkpoint(resume, "--resume ")
    return Path(resume)


def clear_checkpoints(out_dir) -> None:
    """A fresh run replaces the run in ``out_dir``: its checkpoints would otherwise be taken for this run's.
    Only the folders a save writes go; anything else in <out>/checkpoints was put there by someone else."""
    folder = Path(out_dir) / "checkpoints"
    if folder.is_dir():
        for entry in folder.iterdir():
            if entry.is_dir() and OWN_CHECKPOINT_FOLDER.fullmatch(entry.name):
                shutil.rmtree(entry, ignore_errors=True)
        if not any(folder.iterdir()):
            folder.rmdir()


class RunState:
    """What every rank holds alike besides model and optimiser; ``Checkpoint.restore`` loads it back."""

    def __init__(self, scheduler, scaler, batches, log):
        self.scheduler, self.scaler, self.batches, self.log = scheduler, scaler, batches, log

    def checkpoint_state(self) -> dict:
        return {"scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
                "data": self.batches.state_dict(), "records": self.log.records}


class CheckpointWriter:
    """Every rank calls ``save`` at the same steps, and ``wait`` before exit. ``shapes``: every parameter's full
    shape, by name (what a loader needs to join slices back). ``--async-save``: ``background_writer.py``."""

    def __init__(self, config: dict, rank: int, world_size: int, shapes: dict, data_parallel_size=None, run=None):
        self.config, self.rank, self.world_size = config, rank, world_size
        self.shapes, self.data_parallel_size, self.run = shapes, data_parallel_size, run
        self.group = None  # the barriers' process group: the default one

    def save(self, step: int, shared_state: dict, rank_state: dict | None = None) -> None:
        """Write checkpoint ``step``: ``shared_state`` (by rank 0) and this rank's ``rank_state``."""
        started = time.perf_counter()
        try:
            self._write(step, *self._states(step, shared_state, rank_state))
        except Exception as error:  # a full disk, a folder removed under the run: one line, exit 2
            raise not_written(error, self.rank, step, self.config["out"])
        self._report(step, started, "written")

    def _states(self, step: int, shared_state: dict, rank_state: dict | None) -> tuple[dict, dict]:
        run = self.run.checkpoint_state() if self.run is not None else {}
        return {"step": step, **run, **shared_state}, {"rng": rng_state(), **(rank_state or {})}

    def wait(self) -> None:
        """Nothing to wait for: ``save`` returns once the checkpoint is whole (``BackgroundWriter`` waits)."""

    def _report(self, step: int, started: float, how: str) -> None:
        if self.rank == 0 and not self.config["quiet"]:
            print(f"checkpoint step_{step} {how}: training paused {(time.perf_counter() - started) * 1e3:.0f} ms",
                  flush=True)

    def _barrier(self) -> None:
        if dist.is_available() and dist.is_initialized():
            dist.barrier(group=self.group)

    def _write(self, step: int, shared_state: dict, rank_state: dict) -> None:
        final = checkpoint_dir(self.config["out"], step)
        out, tmp = final.parent, final.with_name(f".tmp_step_{step}")
        if self.rank == 0:
            for leftover in [*out.glob(".tmp_step_*"), *out.glob(".old_step_*")]:  # from a save that was killed
                shutil.rmtree(leftover, ignore_errors=True)
            tmp.mkdir(parents=True)
        self._barrier()
        torch.save(rank_state, tmp / f"rank{self.rank}.pt")
        if self.rank == 0:
            torch.save(shared_state, tmp / "state.pt")
            (tmp / "meta.json").write_text(checkpoint_meta(step, self.world_size, self.config, self.shapes,
                                                           self.data_parallel_size))
        self._barrier()  # every rank's file is in tmp before it becomes the checkpoint
        if self.rank == 0:
            if final.exists():  # written by an earlier run from this folder: move it aside, then replace it
                os.replace(final, out / f".old_step_{step}")
            os.replace(tmp, final)
            shutil.rmtree(out / f".old_step_{step}", ignore_errors=True)
        self._barrier()


def params_in_order(optimizer) -> list:
    """The optimiser's parameters, numbered as its state dict numbers them."""
    return [param for group in optimizer.param_groups for param in group["params"]]


def optimizer_slices(optimizer, named_params) -> list:
    """``(name, 0, numel)`` of each of ``optimizer``'s parameters, in its order: whole parameters."""
    name_of = {param: name for name, param in named_params}
    return [(name_of[p], 0, p.numel()) for p in params_in_order(optimizer)]


def optimizer_state(optimizer, named_params) -> dict:
    """What is saved for a plain optimiser over whole parameters: its state dict, and their names."""
    return {"optimizer": optimizer.state_dict(), "optimizer_slices": optimizer_slices(optimizer, named_params)}


def load_optimizer(optimizer, checkpoint, named_params) -> None:
    """The reverse of ``optimizer_state``: give ``optimizer`` its state from ``checkpoint``, whatever wrote it."""
    slices = optimizer_slices(optimizer, named_params)
    optimizer.load_state_dict(checkpoint.optimizer_state_dict(slices, params_in_order(optimizer)))


def load_parameters(named_params, checkpoint) -> None:
    """Copy every full parameter from ``checkpoint`` into ``named_params``: a model every rank holds whole."""
    with torch.no_grad():
        for name, param in named_params:
            param.copy_(checkpoint.parameter(name))


def open_checkpoint(path: Path, config: dict, world_size: int, is_main: bool):
    """Open ``path`` for this run, checked before anything is connected or written (``is_main`` says what changes)."""
    from resharding import Checkpoint  # here, not at the top: resharding.py builds on this file
    checkpoint = Checkpoint(path)
    checkpoint.check_resumable(config, world_size, say_changes=is_main)
    return checkpoint
