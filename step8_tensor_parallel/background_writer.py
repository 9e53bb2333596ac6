"""``--async-save``: a checkpoint copied to memory in the training loop and written to disk by a thread, while
training goes on, as torch.distributed.checkpoint's ``async_save`` does.

1. **A copy training cannot change**: ``save`` snapshots the state to CPU memory (the pause training sees),
   then a thread writes the copy with ``CheckpointWriter``'s atomic write (checkpoint.py, rule 1).
2. **Barriers on a process group of their own**: collectives on one group are matched by the order they are
   issued in, and the writer's barriers, issued from another thread, would interleave with training's.
3. **One save at a time**: the next ``save`` first waits for the last; ``wait`` (before the run says it is
   done) raises what the write failed with, as the foreground writer would have.
The cost is one copy of what is saved, in memory (docs/benchmarks.md measures the pause either way).
"""

import copy
import threading
import time

import torch
import torch.distributed as dist

from checkpoint import CheckpointWriter
from config import not_written


def add_async_save_flag(parser) -> None:
    parser.add_argument(
        "--async-save",
        action="store_true",
        help="copy the state to memory at each checkpoint and write it in the background",
    )


def snapshot(state):
    """A copy of ``state`` that training can no longer change: tensors copied to the CPU, the rest deep-copied."""
    if torch.is_tensor(state):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {key: snapshot(value) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(snapshot(value) for value in state)
    return copy.deepcopy(state)


class BackgroundWriter(CheckpointWriter):
    """A ``CheckpointWriter`` whose ``save`` returns once the state is copied to memory; a thread writes it."""

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
        self.thread, self.error = None, None
        if dist.is_available() and dist.is_initialized():
            # rule 2: every rank creates it, in the same order
            self.group = dist.new_group(backend="gloo")

    def save(self, step: int) -> None:
        started = time.perf_counter()
        self.wait()  # rule 3: the previous write is finished before this one starts
        states = snapshot(self._states(step))
        self.thread = threading.Thread(
            target=self._write_catching, args=(step, *states), name="checkpoint-writer"
        )
        self.thread.start()
        self._report(step, started, "copied to memory, written in the background")

    def wait(self) -> None:
        """Block until the write in progress (if any) is done; raise what it failed with."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            (step, error), self.error = self.error, None
            raise not_written(error, self.rank, step, self.config["out"])

    def _write_catching(self, step: int, *state) -> None:
        try:
            self._write(step, *state)
        except BaseException as error:  # noqa: BLE001 (raised by wait(), in the training thread)
            self.error = step, error
