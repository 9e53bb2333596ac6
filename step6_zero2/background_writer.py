"""``--async-save``: a checkpoint copied to memory in the training loop and written to disk by
torch.distributed.checkpoint's ``async_save`` in a thread,
while training goes on; made whole there too.

1. **A copy training cannot change**: ``async_save`` stages the state through the writer's
   ``stage``, here ``snapshot`` (tensors and ``dcp_checkpoint.Boxes`` copied to the CPU: the pause
   training sees), then DCP's thread writes the copy. DCP's default staging does not know
   a ``Boxes``.
2. **Whole or absent, as in the foreground** (checkpoint.py, rule 1): when DCP's write is done on
   this rank, its thread goes on to ``_publish`` (the barrier after every rank's data,
   ``meta.json``, the rename): ``async_save``'s future alone says this rank's part is written, not
   that the checkpoint is.
3. **Collectives on a process group of their own**: collectives on one group are matched by the
   order they are issued in, and DCP's and the barriers, issued from another thread, would
   interleave with training's.
4. **One save at a time**: the next ``save`` first waits for the last; ``wait`` (before the run says
   it is done, and before a preempted run exits) raises what the write failed with, as the
   foreground writer would have.
The cost is one copy of what is saved, in memory (docs/benchmarks.md measures the pause either way).
"""

import copy
import threading
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from checkpoint import CheckpointWriter
from config import not_written
from dcp_checkpoint import SavePlanner


def add_async_save_flag(parser) -> None:
    parser.add_argument(
        "--async-save",
        action="store_true",
        help="copy the state to memory at each checkpoint and write it in the background",
    )


def snapshot(state):
    """A copy of ``state`` that training can no longer change: tensors copied to the CPU, the rest
    deep-copied (a ``Boxes``: its tensor, dcp_checkpoint.py)."""
    if torch.is_tensor(state):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {key: snapshot(value) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(snapshot(value) for value in state)
    return copy.deepcopy(state)


class _SnapshotWriter(dcp.FileSystemWriter):
    """DCP's file writer, staging with ``snapshot`` (rule 1)."""

    def stage(self, state_dict: dict) -> dict:
        return snapshot(state_dict)


class BackgroundWriter(CheckpointWriter):
    """A ``CheckpointWriter`` whose ``save`` returns once the state is copied to memory;
    DCP's thread writes it."""

    def __init__(
        self,
        config: dict,
        rank: int,
        world_size: int,
        shapes: dict,
        parts: list,
        data_parallel_size=None,
    ):
        super().__init__(config, rank, world_size, shapes, parts, data_parallel_size)
        self.done, self.error = None, None
        if dist.is_available() and dist.is_initialized():
            # rule 3: every rank creates it, in the same order
            self.group = dist.new_group(backend="gloo")

    def save(self, step: int) -> None:
        started = time.perf_counter()
        self.wait()  # rule 4: the previous write is finished before this one starts
        try:
            (state,) = self._states(step)
            tmp = self._prepare(step)
            written = dcp.async_save(
                state,
                storage_writer=_SnapshotWriter(tmp),
                planner=SavePlanner(),
                process_group=self.group,
            )
        except Exception as error:  # staging failed: one line, exit 2, as in the foreground
            raise not_written(error, self.rank, step, self.config["out"]) from error
        self.done = threading.Event()
        written.add_done_callback(lambda future: self._finish(future, step, tmp))
        self._report(step, started, "copied to memory, written in the background")

    def _finish(self, written, step: int, tmp) -> None:
        """Rule 2, in DCP's thread (or here, if the write was already done)."""
        try:
            written.result()
            self._publish(step, tmp)
        except BaseException as error:  # noqa: BLE001 (raised by wait(), in the training thread)
            self.error = step, error
        finally:
            self.done.set()

    def wait(self) -> None:
        """Block until the write in progress (if any) is whole; raise what it failed with."""
        if self.done is not None:
            self.done.wait()
            self.done = None
        if self.error is not None:
            (step, error), self.error = self.error, None
            raise not_written(error, self.rank, step, self.config["out"])
