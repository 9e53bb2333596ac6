"""How many bytes this rank hands to each kind of collective: what every record's ``comm`` holds.

A module of its own, with nothing but a counter in it, so that an idea file (``naive_dp.py``,
``bucketed_ddp.py``, ``zero1.py``, ...) can count its collectives without importing the process-group
set-up in ``distributed.py``, whatever training script it is dropped into. The idea files add to the
counter; a trainer reads and clears it once per optimiser step.
"""
import collections

import torch

# Bytes this rank handed to each kind of collective since the last ``take_comm_bytes()``.
comm_bytes = collections.Counter()


def count_collective(kind: str, tensor: torch.Tensor) -> None:
    comm_bytes[kind] += tensor.numel() * tensor.element_size()


def take_comm_bytes() -> dict:
    counts = dict(sorted(comm_bytes.items()))
    comm_bytes.clear()
    return counts
