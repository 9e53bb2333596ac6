"""Context parallelism: the sequence of every micro-batch split over C ranks, attention by a ring.

Data parallelism split the batch, tensor parallelism the weights; neither helps when one sequence is
too long: attention's activations grow with its square. Here every rank holds the whole model, reads
the same micro-batch, and keeps 1/C of its positions. Everything except attention works token by
token, so it runs on a rank's tokens unchanged. Here:

1. **Chunks, zig-zag.** The sequence is cut into 2C chunks; rank r keeps chunks r and 2C-1-r
   (``zigzag``) or 2r and 2r+1 (``contiguous``). ``sequence_shard`` takes a rank's positions of any
   (B, S, ...) tensor: the token ids (a hook on the token embedding), the position ids (a hook on
   the position embedding: positions stay global) and the targets.
2. **Attention by a ring** (ring_attention.py, the arithmetic on its own page). A rank computes its
   queries against the key/value block it holds while passing the block on round the ring; partial
   softmaxes merge exactly by their log-sum-exp, and backward sends dK and dV round the ring again.
   ``RingSelfAttention`` puts it in GPT-2's attention, the projections (and their names) kept.
3. **Causal, balanced.** A key chunk after a query chunk is skipped, the diagonal pair is masked.
   With the contiguous split rank r computes 4r + 3 pairs, so the last rank does (4C - 1)/3 times
   the first's work and everyone waits for it; zig-zag gives every rank 2C + 1
   (``attention_pairs``).
4. **The loss and the gradients.** Each rank's loss is the mean over its S/C tokens of every
   sequence; every rank has as many, so the mean of the ranks' gradients (step 3's all-reduce) is
   the gradient of the mean over all tokens: context parallelism is data parallelism over positions.
   Beside data parallelism (``--cp`` below the world size) the ranks are laid out
   ``arange(world).view(dp, cp)``, one ring per row, and the same all-reduce over every rank
   averages both.
5. **Dropout.** Between the layers (``SequenceShardDropout``) a rank draws the mask one process
   draws for the whole sequence and keeps its positions: drawing only its own would give every rank
   the same mask, as they share the random stream. Attention's dropout is drawn in the ring
   (ring_attention.py's rule 6).
"""

import functools

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from config import UserError
from ring_attention import LAYOUTS, RingAttention, chunks_of


def shard_positions(seq_len: int, rank: int, cp: int, layout: str = "zigzag") -> torch.Tensor:
    """The global positions rank ``rank`` keeps, in its local order."""
    size = seq_len // (2 * cp)
    return torch.cat([torch.arange(c * size, (c + 1) * size) for c in chunks_of(rank, cp, layout)])


def sequence_shard(
    x: torch.Tensor, group=None, layout: str = "zigzag", dim: int = 1
) -> torch.Tensor:
    """This rank's positions of ``x`` along ``dim`` (the sequence)."""
    positions = shard_positions(
        x.shape[dim], dist.get_rank(group), dist.get_world_size(group), layout
    )
    return x.index_select(dim, positions.to(x.device))


def attention_pairs(rank: int, cp: int, layout: str = "zigzag") -> int:
    """(query chunk, key chunk) pairs rank ``rank`` computes: its work (rule 3)."""
    return sum(
        key <= query
        for query in chunks_of(rank, cp, layout)
        for chunk_rank in range(cp)
        for key in chunks_of(chunk_rank, cp, layout)
    )


def add_context_parallel_flags(parser) -> None:
    flags = parser.add_argument_group("context parallelism")
    flags.add_argument(
        "--cp",
        type=int,
        help="ranks that split each sequence (default: all of them); the "
        "world size / cp rings split the batch, as data parallelism does",
    )
    flags.add_argument(
        "--cp-layout",
        choices=LAYOUTS,
        default="zigzag",
        help="which chunks of the sequence each rank keeps (rule 3: contiguous is unbalanced)",
    )


def check_context_parallel(config: dict, world_size: int) -> tuple[int, int]:
    """Refuse what the ring cannot split, before anything starts (one line each, docs/bad_input.md);
    returns ``(cp, dp)``: the ranks of a ring (``--cp``, default all) and the rings, each a
    data-parallel replica."""
    cp = config["cp"] or world_size
    if cp < 1 or world_size % cp:
        raise UserError(
            f"--cp {cp} does not divide the {world_size} ranks into rings: launch a "
            f"multiple of {cp} "
            "processes, or change --cp"
        )
    if config["seq_len"] % (2 * cp):
        raise UserError(
            f"--seq-len {config['seq_len']} is cut into 2 x {cp} chunks for {cp} ranks: "
            f"use a multiple of {2 * cp}"
        )
    return cp, world_size // cp


class SequenceShardDropout(nn.Module):
    """``nn.Dropout`` on this rank's positions: the whole sequence's mask, as one process draws it,
    then this rank's positions of it (rule 5)."""

    def __init__(self, p: float, group=None, layout: str = "zigzag"):
        super().__init__()
        self.p, self.group, self.layout = p, group, layout

    def forward(self, x):
        if not self.training or not self.p:
            return x
        whole = (x.shape[0], x.shape[1] * dist.get_world_size(self.group), *x.shape[2:])
        mask = F.dropout(torch.ones(whole, dtype=x.dtype, device=x.device), self.p)
        return x * sequence_shard(mask, self.group, self.layout)


class RingSelfAttention(nn.Module):
    """GPT-2's attention (model.py) with the ring in place of scores, mask and softmax. It keeps the
    original's projections, so the parameters keep their names."""

    def __init__(self, attn: nn.Module, group=None, layout: str = "zigzag", heads=(0, 1)):
        super().__init__()
        self.c_q, self.c_k, self.c_v, self.c_proj = attn.c_q, attn.c_k, attn.c_v, attn.c_proj
        self.head_dim, self.group, self.layout, self.dropout = (
            attn.head_dim,
            group,
            layout,
            attn.dropout,
        )
        # (i, n): this module computes block i of n of the heads (step 10's tp rank)
        self.heads = heads
        self.resid_dropout = SequenceShardDropout(attn.dropout, group, layout)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (
            proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
            for proj in (self.c_q, self.c_k, self.c_v)
        )
        y = RingAttention.apply(
            q, k, v, self.group, self.layout, self.dropout if self.training else 0.0, self.heads
        )
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(B, T, -1)))


def context_parallel_groups(cp: int):
    """(this rank's ring, its data-parallel index): the ranks laid out ``arange(world).view(dp,
    cp)``, one ring per row (rule 4). Every rank creates every group, in the same order; one ring of
    every rank is the world."""
    world_size, rank = dist.get_world_size(), dist.get_rank()
    if cp == world_size:
        return None, 0
    rings = [dist.new_group(row) for row in torch.arange(world_size).view(-1, cp).tolist()]
    return rings[rank // cp], rank // cp


def context_parallel_gpt2(
    model: nn.Module, group=None, layout: str = "zigzag", heads=(0, 1)
) -> nn.Module:
    """Our GPT-2 (model.py), in place, for its rank of ``group``: it takes the whole micro-batch and
    returns the logits of this rank's positions (rule 1); ``model.sequence_shard(targets)`` gives
    the targets of those.
    ``heads``: (i, n) where the model is tensor-parallel and this rank holds block i of n of the
    heads (step 10)."""
    model.sequence_shard = functools.partial(sequence_shard, group=group, layout=layout)
    model.transformer.wte.register_forward_pre_hook(
        lambda module, args: (sequence_shard(args[0], group, layout),)
    )
    model.transformer.wpe.register_forward_pre_hook(  # the global positions of this rank's tokens
        lambda module, args: (sequence_shard(args[0], group, layout, dim=0),)
    )
    model.transformer.drop = SequenceShardDropout(model.config.dropout, group, layout)
    for block in model.transformer.h:
        block.attn = RingSelfAttention(block.attn, group, layout, heads)
        block.mlp.dropout = SequenceShardDropout(model.config.dropout, group, layout)
    return model
