"""The exact mode of steps 1 and 2 (``--reduce-dtype float64``): PyTorch's DDP reducing in float64.

Summing float32 gradients of 3+ ranks gives a result that depends on the order of the additions;
summing them in float64 is exact for the few ranks we run, so every implementation that does the
same gets the same bits, whatever order its all-reduce adds in (docs/parity.md). Steps 3 and up
reduce in float64 themselves; DDP's C++ reducer does not, so steps 1 and 2 give it this
communication hook.
"""

import torch
import torch.distributed as dist

from comm_accounting import count_collective


def float64_allreduce_hook(process_group, bucket):
    """DDP communication hook: reduce the bucket in float64, divide, round to float32 once."""
    buffer = bucket.buffer()
    wide = buffer.to(torch.float64)
    count_collective("all_reduce", wide)
    world_size = dist.get_world_size(process_group)
    future = dist.all_reduce(wide, group=process_group, async_op=True).get_future()
    return future.then(lambda fut: buffer.copy_(fut.value()[0].div_(world_size)))
