"""One process's dropout mask, on a rank's block of a tensor split over a group: how tensor and
sequence parallelism drop exactly what one process drops (tensor_parallel.py's rule 7).

Every rank's random stream is the same (one seed). A rank that drew a mask for its own block alone
would draw the same mask as every other rank: heads h and h + H/T (or tokens s and s + S/T) dropped
alike, and the stream would move on by 1/T of one process's draw. ``ShardDropout`` draws the whole
tensor's mask and keeps this rank's block; the cost is a mask T times the block's, freed as soon as
the block is cut.
"""

import torch
import torch.distributed as dist
import torch.nn as nn


class ShardDropout(nn.Module):
    """``nn.Dropout(p)`` on this rank's block (dim 1) of a tensor split over ``group``: the heads of
    attention's (B, heads, S, S) weights (rule 7), the sequence of (B, S, h) activations under
    sequence parallelism. It draws the whole tensor's mask, as ``F.dropout`` does on a CPU (a
    Bernoulli draw in the input's dtype, divided by 1 - p), and keeps this rank's block, so the
    masks are one process's and the random stream moves on as one process's does."""

    def __init__(self, p: float, group=None):
        super().__init__()
        self.p, self.group = p, group

    def forward(self, x):
        if not self.training or self.p == 0:
            return x
        world_size = dist.get_world_size(self.group)
        whole = (x.shape[0], x.shape[1] * world_size, *x.shape[2:])
        noise = torch.empty(whole, dtype=x.dtype, device=x.device).bernoulli_(1 - self.p)
        noise = noise.div_(1 - self.p)
        # A copy of this rank's block: a view would keep the whole mask alive until backward.
        return x * noise.chunk(world_size, dim=1)[dist.get_rank(self.group)].clone(
            memory_format=torch.contiguous_format
        )
