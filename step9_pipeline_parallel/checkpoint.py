"""Checkpoints that are whole or absent, and resumed in one call. ``<out>/checkpoints/step_<k>/`` holds ``meta.json``
(format, step, world size, config, parameter shapes), ``state.pt`` (written by rank 0: what every rank holds alike)
and ``rank<r>.pt`` (the rank's RNG and, from step 5 on, its slices).

1. **Whole or absent**: written into ``.tmp_step_<k>``, renamed ``step_<k>`` once every rank's file is in it.
2. **One call each way**, as torchtitan's ``Stateful``: the writer is given the run's *parts* once, each with
   ``checkpoint_state()`` and ``load_checkpoint(checkpoint)``; the loop calls ``start(checkpoint)`` and ``save(step)``.
3. **Read back by parameter name** (``resharding.py``): by any step from 1 on, at any world size; found and made
   whole or absent by ``checkpoint_files.py``.
"""

import time

import torch
import torch.distributed as dist

from checkpoint_files import checkpoint_dir, clear_checkpoints, publish, start_writing
from config import not_written
from resharding import checkpoint_meta, optimizer_slices
from seeding import rng_state, set_rng_state
from training import params_in_order


def optimizer_state(optimizer, named_params) -> dict:
    """What is saved for a plain optimiser over whole parameters: its state dict, and whose state each entry is."""
    return {
        "optimizer": optimizer.state_dict(),
        "optimizer_slices": optimizer_slices(optimizer, named_params),
    }


def load_optimizer(optimizer, checkpoint, named_params) -> None:
    """The reverse of ``optimizer_state``: give ``optimizer`` its state from ``checkpoint``, whatever wrote it."""
    slices = optimizer_slices(optimizer, named_params)
    optimizer.load_state_dict(checkpoint.optimizer_state_dict(slices, params_in_order(optimizer)))


def load_parameters(named_params, checkpoint) -> None:
    """Copy every full parameter from ``checkpoint`` into ``named_params``: a model every rank holds whole."""
    with torch.no_grad():
        for name, param in named_params:
            param.copy_(checkpoint.parameter(name))


class RunState:
    """A part (rule 2) every rank holds alike: the schedule, the loss scale, the data position and the log."""

    per_rank = False  # rank 0 saves it for everyone

    def __init__(self, scheduler, scaler, batches, log):
        self.scheduler, self.scaler, self.batches, self.log = scheduler, scaler, batches, log

    def checkpoint_state(self) -> dict:
        return {
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "data": self.batches.state_dict(),
            "records": self.log.records,
        }

    def load_checkpoint(self, checkpoint) -> None:
        self.scheduler.load_state_dict(checkpoint.shared["scheduler"])
        self.scaler.load_state_dict(checkpoint.shared["scaler"])
        # the ranks drawing samples now: the same position, maybe cut anew
        ranks = self.batches.sampler.num_replicas
        self.batches.load_state_dict(checkpoint.data_state(self.batches.micro_batch_size, ranks))
        self.log.records = list(checkpoint.shared["records"])


class WholeModel:
    """A part: a model every rank holds whole and a plain ``optimizer`` (if any) over its parameters, or, given
    ``masters`` (step 0's --param-dtype), over their float32 masters, saved and loaded in place of 16-bit copies."""

    per_rank = False

    def __init__(self, model, optimizer=None, masters=None):
        self.model, self.optimizer, self.masters = model, optimizer, masters or []
        # what the optimiser steps, by name
        self.trained = self.masters or list(model.named_parameters())

    def checkpoint_state(self) -> dict:
        master_of = {p.data_ptr(): m for (_, m), p in zip(self.masters, self.model.parameters())}
        state = {
            "model": {
                name: master_of.get(t.data_ptr(), t) for name, t in self.model.state_dict().items()
            }
        }
        return (
            {**state, **optimizer_state(self.optimizer, self.trained)} if self.optimizer else state
        )

    def load_checkpoint(self, checkpoint) -> None:
        # 16-bit copies rounded
        load_parameters([*self.model.named_parameters(), *self.masters], checkpoint)
        if self.optimizer:
            load_optimizer(self.optimizer, checkpoint, self.trained)


class CheckpointWriter:
    """Every rank calls ``start`` once, ``save`` at the same steps, ``wait`` before exit. ``shapes``: every full
    parameter's, by name (what joins slices back); ``parts``: rule 2; ``--async-save``: ``background_writer.py``."""

    def __init__(
        self,
        config: dict,
        rank: int,
        world_size: int,
        shapes: dict,
        parts: list,
        data_parallel_size=None,
    ):
        self.config, self.rank, self.world_size, self.shapes = config, rank, world_size, shapes
        # the barriers' group: default
        self.parts, self.data_parallel_size, self.group = parts, data_parallel_size, None

    def start(self, checkpoint) -> int:
        """Resume from ``checkpoint``: every part, then this rank's RNG (nothing may draw after it); given None,
        clear the checkpoints an earlier run left in --out. Returns the step to go on from."""
        if checkpoint is None:
            if self.rank == 0:
                clear_checkpoints(self.config["out"])
            return 0
        for part in self.parts:
            part.load_checkpoint(checkpoint)
        # 1: one stream
        set_rng_state(checkpoint.rank_state(self.rank if self.world_size > 1 else 0)["rng"])
        if self.rank == 0:
            print(f"resumed from {checkpoint.path} at step {checkpoint.step}")
        return checkpoint.step

    def save(self, step: int) -> None:
        """Write checkpoint ``step``: every part, asked on every rank (a part may gather: a collective)."""
        started = time.perf_counter()
        try:
            self._write(step, *self._states(step))
        except Exception as error:  # a full disk, a folder removed under the run: one line, exit 2
            raise not_written(error, self.rank, step, self.config["out"]) from error
        self._report(step, started, "written")

    def _states(self, step: int) -> tuple[dict, dict]:
        shared, own = {"step": step}, {"rng": rng_state()}
        for part in self.parts:
            (own if part.per_rank else shared).update(part.checkpoint_state())
        return shared, own

    def wait(self) -> None:  # nothing to wait for: save returns once the checkpoint is whole
        pass

    def _report(self, step: int, started: float, how: str) -> None:
        if self.rank == 0 and not self.config["quiet"]:
            print(
                f"checkpoint step_{step} {how}: training paused {(time.perf_counter() - started) * 1e3:.0f} ms",
                flush=True,
            )

    def _barrier(self) -> None:
        if dist.is_available() and dist.is_initialized():
            dist.barrier(group=self.group)

    def _write(self, step: int, shared_state: dict, rank_state: dict) -> None:
        tmp = checkpoint_dir(self.config["out"], step).with_name(f".tmp_step_{step}")
        if self.rank == 0:
            start_writing(self.config["out"], step)  # what a killed save left, removed
        self._barrier()
        torch.save(rank_state, tmp / f"rank{self.rank}.pt")
        if self.rank == 0:
            torch.save(shared_state, tmp / "state.pt")
            (tmp / "meta.json").write_text(
                checkpoint_meta(
                    step, self.world_size, self.config, self.shapes, self.data_parallel_size
                )
            )
        self._barrier()  # every rank's file is in tmp before it becomes the checkpoint
        if self.rank == 0:
            publish(tmp)  # .tmp_step_<k> becomes step_<k>
        self._barrier()
