"""How many bytes this rank hands to each kind of collective: what every record's ``comm`` holds.

A module of its own, with nothing but a counter in it, so that an idea file (``naive_dp.py``,
``bucketed_ddp.py``, ``zero1.py``, ...) can count its collectives without importing the
process-group set-up in ``distributed.py``, whatever training script it is dropped into. The idea
files add to the counter; a trainer reads and clears it once per optimiser step.

It also names the two one-tensor collectives ZeRO uses for every torch this project runs on: torch
2.13 calls them ``all_gather_single`` and ``reduce_scatter_single`` (and warns on the old names);
torch 2.11, what GPU images ship, has only the old ones, ``all_gather_into_tensor`` and
``reduce_scatter_tensor``.
"""

import collections

import torch
import torch.distributed as dist

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# Bytes this rank handed to each kind of collective since the last ``take_comm_bytes()``.
comm_bytes = collections.Counter()


def count_collective(kind: str, tensor: torch.Tensor) -> None:
    comm_bytes[kind] += tensor.numel() * tensor.element_size()


def take_comm_bytes() -> dict:
    counts = dict(sorted(comm_bytes.items()))
    comm_bytes.clear()
    return counts
