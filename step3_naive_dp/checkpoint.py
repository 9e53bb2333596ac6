"""Checkpoints that are whole or absent, and resumed in one call. ``<out>/checkpoints/step_<k>/`` is
a torch.distributed.checkpoint (DCP) folder: ``.metadata`` and the ranks' ``.distcp`` files, holding
every part's entries (``dcp_checkpoint.py``: the parameters and AdamW's state by name), ``run``
(rank 0's: what every rank holds alike) and ``rank<r>`` (each rank's RNG); and ``meta.json``
(format, step, world size, config, parameter shapes).

1. **Whole or absent**: written into ``.tmp_step_<k>``; once every rank's data and DCP's
   ``.metadata`` are in it, rank 0 adds ``meta.json`` and renames it ``step_<k>``.
2. **One call each way**, as torchtitan's ``Stateful``: the writer is given the run's *parts* once,
   each with ``checkpoint_state()`` and ``load_checkpoint(checkpoint)``; the loop calls
   ``start(checkpoint)`` and ``save(step)``.
3. **Read back by parameter name** (``resharding.py``): by any step from 1 on, at any world size and
   layout; found and made whole or absent by ``checkpoint_files.py``.
"""

import time

import torch.distributed as dist

import dcp_checkpoint
from checkpoint_files import checkpoint_dir, clear_checkpoints, publish, start_writing
from config import not_written
from dcp_checkpoint import Place, load_model, model_state, optimizer_state, params_in_order
from resharding import checkpoint_meta
from seeding import rng_state, set_rng_state


def whole_places(optimizer, named_params) -> list:
    """``(name, place)`` of each of ``optimizer``'s parameters
    (``params_in_order``), whole ones of ``named_params``."""
    name_of = {param: name for name, param in named_params}
    return [(name_of[p], Place(tuple(p.shape))) for p in params_in_order(optimizer)]


def load_optimizer(optimizer, checkpoint, named_params) -> None:
    """Give a plain ``optimizer`` over the whole ``named_params``
    its state from ``checkpoint``, whatever wrote it."""
    dcp_checkpoint.load_optimizer(checkpoint, optimizer, whole_places(optimizer, named_params))


def load_parameters(named_params, checkpoint) -> None:
    """Copy every full parameter from ``checkpoint`` into ``named_params``:
    a model every rank holds whole."""
    load_model(checkpoint, [(name, p, Place(tuple(p.shape))) for name, p in named_params])


class RunState:
    """A part (rule 2) every rank holds alike:
    the schedule, the loss scale, the data position and the log."""

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
    """A part: a model every rank holds whole and a plain ``optimizer`` (if any) over its
    parameters. Every rank gives DCP its copy, which DCP writes once (a replica's boxes are
    the same)."""

    per_rank = True

    def __init__(self, model, optimizer=None):
        self.model, self.optimizer = model, optimizer
        self.named = list(model.named_parameters())  # the tie once

    def checkpoint_state(self) -> dict:
        state = model_state([(name, p, Place(tuple(p.shape))) for name, p in self.named])
        if self.optimizer:
            state.update(optimizer_state(self.optimizer, whole_places(self.optimizer, self.named)))
        return state

    def load_checkpoint(self, checkpoint) -> None:
        load_parameters(self.named, checkpoint)
        if self.optimizer:
            load_optimizer(self.optimizer, checkpoint, self.named)


class CheckpointWriter:
    """Every rank calls ``start`` once, ``save`` at the same steps, ``wait`` before exit.
    ``shapes``: every full parameter's, by name (what joins slices back); ``parts``: rule 2;
    ``--async-save``: ``background_writer.py``."""

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
        """Resume from ``checkpoint``: every part, then this rank's RNG (nothing may draw after it);
        given None, clear the checkpoints an earlier run left in --out. Returns the step to go
        on from."""
        if checkpoint is None:
            if self.rank == 0:
                clear_checkpoints(self.config["out"])
            return 0
        started = time.perf_counter()
        for part in self.parts:
            part.load_checkpoint(checkpoint)
        # 1: one stream
        set_rng_state(checkpoint.rank_state(self.rank if self.world_size > 1 else 0)["rng"])
        if self.rank == 0:
            took = (time.perf_counter() - started + checkpoint.open_s) * 1e3
            print(
                f"resumed from {checkpoint.path} at step {checkpoint.step}: read in {took:.0f} ms"
            )
        return checkpoint.step

    def save(self, step: int) -> None:
        """Write checkpoint ``step``: every part,
        asked on every rank (a part may gather: a collective)."""
        started = time.perf_counter()
        try:
            self._write(step, *self._states(step))
        except Exception as error:  # a full disk, a folder removed under the run: one line, exit 2
            raise not_written(error, self.rank, step, self.config["out"]) from error
        self._report(step, started, "written")

    def _states(self, step: int) -> tuple[dict]:
        """DCP's state dict:
        every part's entries (a shared part's in ``run``, once), and this rank's RNG."""
        shared, state = {"step": step}, {}
        if self.rank < self.world_size:  # step 9's stages: one process's RNG, rank 0's
            state[f"rank{self.rank}"] = {"rng": rng_state()}
        for part in self.parts:
            (state if part.per_rank else shared).update(part.checkpoint_state())
        if self.rank == 0:
            state["run"] = shared
        return (state,)

    def wait(self) -> None:  # nothing to wait for: save returns once the checkpoint is whole
        pass

    def _report(self, step: int, started: float, how: str) -> None:
        if self.rank == 0 and not self.config["quiet"]:
            print(
                f"checkpoint step_{step} {how}: training paused "
                f"{(time.perf_counter() - started) * 1e3:.0f} ms",
                flush=True,
            )

    def _barrier(self) -> None:
        if dist.is_available() and dist.is_initialized():
            dist.barrier(group=self.group)

    def _write(self, step: int, state: dict) -> None:
        tmp = self._prepare(step)
        dcp_checkpoint.save(state, tmp, self.group)  # every rank's boxes, .metadata last (rank 0)
        self._publish(step, tmp)

    def _prepare(self, step: int):
        """An empty ``.tmp_step_<step>`` (what a killed save left,
        removed), on every rank before anyone writes."""
        tmp = checkpoint_dir(self.config["out"], step).with_name(f".tmp_step_{step}")
        if self.rank == 0:
            start_writing(self.config["out"], step)
        self._barrier()
        return tmp

    def _publish(self, step: int, tmp) -> None:
        """Rule 1, once DCP has written every rank's data and its ``.metadata``:
        ``meta.json``, then the rename."""
        self._barrier()  # (a test pauses a rank here: written, not yet the checkpoint)
        if self.rank == 0:
            (tmp / "meta.json").write_text(
                checkpoint_meta(
                    step, self.world_size, self.config, self.shapes, self.data_parallel_size
                )
            )
            publish(tmp)  # .tmp_step_<k> becomes step_<k>
        self._barrier()
