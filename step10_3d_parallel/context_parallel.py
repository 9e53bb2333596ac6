"""Context parallelism: the sequence of every micro-batch split over C ranks, attention by a ring.

Data parallelism split the batch, tensor parallelism the weights; neither helps when one sequence is too
long: attention's activations grow with its square. Here every rank holds the whole model, reads the same
micro-batch, and keeps 1/C of its positions. Everything except attention works token by token, so it runs
on a rank's tokens unchanged. Here:

1. **Chunks, zig-zag.** The sequence is cut into 2C chunks; rank r keeps chunks r and 2C-1-r (``zigzag``)
   or 2r and 2r+1 (``contiguous``). ``sequence_shard`` takes a rank's positions of any (B, S, ...) tensor:
   the token ids (a hook on the token embedding), the position ids (a hook on the position embedding:
   positions stay global) and the targets.
2. **The ring.** Attention needs every earlier key. A rank computes its queries against the key/value
   block it holds, then passes the block to rank r+1 and receives rank r-1's: after C-1 passes it has met
   every block, never holding more than two. The next block's send and receive start before the current
   block is computed, so the compute hides the transfer.
3. **Log-sum-exp merge.** Each (query chunk, key chunk) pair gives a softmax normalised over its own keys,
   and its log-sum-exp ``lse``. Two such partial results merge exactly, in float32:
   ``lse = logaddexp(lse_a, lse_b)``, ``out = out_a exp(lse_a - lse) + out_b exp(lse_b - lse)``.
   Only the merged output and lse are kept for backward: no rank ever holds a score matrix beyond one
   chunk by one chunk, and none is saved. The output is laid out (B, S, H, D), as flash attention lays it
   out, so the projection after it reads the same storage instead of a copy.
4. **Causal, balanced.** A key chunk after a query chunk is skipped, the diagonal pair is masked. With the
   contiguous split rank r computes 4r + 3 pairs, so the last rank does (4C - 1)/3 times the first's work
   and everyone waits for it; zig-zag gives every rank 2C + 1 (``attention_pairs``).
5. **Backward around the ring again.** The probabilities are recomputed from the saved lse (flash
   attention's backward); the key/value blocks travel the same way, each with a float32 buffer for its
   dK and dV that every rank adds its queries' part to; one more pass brings each buffer home. A buffer
   travels while the next block is computed: a rank computes its part first and adds it once the buffer
   has come (in the same order, so the sums are those of adding at once).
6. **The loss and the gradients.** Each rank's loss is the mean over its S/C tokens of every sequence;
   every rank has as many, so the mean of the ranks' gradients (step 3's all-reduce) is the gradient of the
   mean over all tokens: context parallelism is data parallelism over positions. Beside data parallelism
   (``--cp`` below the world size) the ranks are laid out ``arange(world).view(dp, cp)``, one ring per row,
   and the same all-reduce over every rank averages both.
7. **Dropout.** Between the layers (``SequenceShardDropout``) a rank draws the mask one process draws for
   the whole sequence and keeps its positions: drawing only its own would give every rank the same mask, as
   they share the random stream. Attention's dropout is drawn pair by pair in the ring; backward draws the
   same masks again from a generator set to the state forward started from, so no mask is kept. A rank that
   holds some of the heads only (step 10, tensor-parallel too) draws every head's mask and keeps its own,
   so tp ranks do not all drop alike and the masks are this ring's whole-model ones.
"""

import functools
import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from comm_accounting import count_collective
from config import UserError

LAYOUTS = ("zigzag", "contiguous")
KV_TAG, GRAD_TAG = 11, 12  # the blocks and their gradients travel as separate messages


def chunks_of(rank: int, cp: int, layout: str = "zigzag") -> tuple[int, int]:
    """The two chunks (of 2 * cp) that ``rank`` holds, in the order its tokens are laid out."""
    return (rank, 2 * cp - 1 - rank) if layout == "zigzag" else (2 * rank, 2 * rank + 1)


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
    """(query chunk, key chunk) pairs rank ``rank`` computes: its work (rule 4)."""
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
        help="which chunks of the sequence each rank keeps (rule 4: contiguous is unbalanced)",
    )


def check_context_parallel(config: dict, world_size: int) -> tuple[int, int]:
    """Refuse what the ring cannot split, before anything starts (one line each, docs/bad_input.md); returns
    ``(cp, dp)``: the ranks of a ring (``--cp``, default all) and the rings, each a data-parallel replica."""
    cp = config["cp"] or world_size
    if cp < 1 or world_size % cp:
        raise UserError(
            f"--cp {cp} does not divide the {world_size} ranks into rings: launch a multiple of {cp} "
            "processes, or change --cp"
        )
    if config["seq_len"] % (2 * cp):
        raise UserError(
            f"--seq-len {config['seq_len']} is cut into 2 x {cp} chunks for {cp} ranks: "
            f"use a multiple of {2 * cp}"
        )
    return cp, world_size // cp


class _Ring:
    """Point-to-point with the next and previous rank of ``group``; gloo moves CPU tensors only, so where
    the ranks share a GPU over gloo the messages go through host memory."""

    def __init__(self, group):
        self.group = group
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        self.next, self.prev = (
            ((rank + 1) % size, (rank - 1) % size)
            if group is None
            else (
                dist.get_global_rank(group, (rank + 1) % size),
                dist.get_global_rank(group, (rank - 1) % size),
            )
        )

    def start(self, tensor: torch.Tensor, tag: int):
        """Send ``tensor`` to the next rank and receive the previous rank's into a new buffer; returns a
        function that waits for both (within the group's timeout) and gives the received tensor."""
        staged = tensor.device.type != "cpu" and dist.get_backend(self.group) == "gloo"
        out = tensor.detach().cpu() if staged else tensor.detach().contiguous()
        into = torch.empty_like(out)
        count_collective("send", out)
        # One batch: nccl posts both at once (a send and a receive issued one after the other on its stream would
        # wait for each other round the ring); gloo issues them in turn.
        works = dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, out, self.next, self.group, tag),
                dist.P2POp(dist.irecv, into, self.prev, self.group, tag),
            ]
        )

        def wait() -> torch.Tensor:
            for work in works:
                work.wait()
            return into.to(tensor.device) if staged else into

        return wait


def _scores(q, k, causal: bool, scale: float) -> torch.Tensor:
    """Float32 scores of one chunk of queries against one chunk of keys; the diagonal pair is causal."""
    s = (q @ k.transpose(-2, -1)).float() * scale
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(
            ~torch.ones(n, n, dtype=torch.bool, device=s.device).tril(), float("-inf")
        )
    return s


def _rng_state(device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _dropout_mask(like: torch.Tensor, p: float, generator=None, heads=(0, 1)) -> torch.Tensor:
    """What ``F.dropout`` multiplies by on the CPU: kept with probability 1 - p, scaled by 1 / (1 - p). ``heads``:
    (i, n) where ``like`` holds block i of n of the heads (step 10's tensor parallelism): the mask of all heads is
    drawn, as one rank of the ring draws it, and block i kept (rule 7)."""
    index, blocks = heads
    whole = torch.empty(
        (like.shape[0], like.shape[1] * blocks, *like.shape[2:]),
        dtype=like.dtype,
        device=like.device,
    )
    return whole.bernoulli_(1 - p, generator=generator).div_(1 - p).chunk(blocks, dim=1)[index]


class RingAttention(torch.autograd.Function):
    """softmax(q k^T / sqrt(d), causal) v for this rank's queries against every rank's keys and values; with
    ``dropout`` on the attention weights (rule 7)."""

    @staticmethod
    def forward(ctx, q, k, v, group, layout, dropout=0.0, heads=(0, 1)):
        ring, cp, rank = _Ring(group), dist.get_world_size(group), dist.get_rank(group)
        # where backward redraws the masks from
        ctx.rng_state = _rng_state(q.device) if dropout else None
        scale, mine = 1.0 / math.sqrt(q.shape[-1]), chunks_of(rank, cp, layout)
        qs = q.chunk(2, dim=2)
        out, lse = [None, None], [None, None]
        kv = torch.stack([k, v])
        for step in range(cp):
            source = (rank - step) % cp  # whose block this is
            # rule 2: the next block on its way
            pending = ring.start(kv, KV_TAG) if step < cp - 1 else None
            for i, query in enumerate(mine):
                for key, k_c, v_c in zip(
                    chunks_of(source, cp, layout), kv[0].chunk(2, dim=2), kv[1].chunk(2, dim=2)
                ):
                    if key > query:
                        continue  # rule 4: every key after every query
                    s = _scores(qs[i], k_c, key == query, scale)
                    block_lse = torch.logsumexp(s, dim=-1, keepdim=True)
                    weights = torch.exp(s - block_lse)
                    if dropout:
                        weights = weights * _dropout_mask(weights, dropout, heads=heads)
                    block_out = (weights.to(v_c.dtype) @ v_c).float()
                    if out[i] is None:
                        out[i], lse[i] = block_out, block_lse
                    else:  # rule 3
                        merged = torch.logaddexp(lse[i], block_lse)
                        out[i] = out[i] * torch.exp(lse[i] - merged) + block_out * torch.exp(
                            block_lse - merged
                        )
                        lse[i] = merged
            if pending:
                kv = pending()
        # laid out (B, S, H, D) as flash attention lays it out: c_proj's input is then the same storage, kept once
        out = torch.cat(out, dim=2).to(q.dtype).transpose(1, 2).contiguous().transpose(1, 2)
        lse = torch.cat(lse, dim=2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.layout, ctx.dropout, ctx.heads = group, layout, dropout, heads
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, layout, dropout = ctx.group, ctx.layout, ctx.dropout
        if dropout:  # forward's masks, drawn again in the same order
            generator = torch.Generator(device=q.device)
            generator.set_state(ctx.rng_state)
        ring, cp, rank = _Ring(group), dist.get_world_size(group), dist.get_rank(group)
        scale, mine = 1.0 / math.sqrt(q.shape[-1]), chunks_of(rank, cp, layout)
        qs, dos, lses = q.chunk(2, dim=2), dout.chunk(2, dim=2), lse.chunk(2, dim=2)
        # rowsum(dO * O)
        deltas = (dout.float() * out.float()).sum(-1, keepdim=True).chunk(2, dim=2)
        dq = [torch.zeros_like(c, dtype=torch.float32) for c in qs]
        kv = torch.stack([k, v])
        # the travelling buffer of the block held
        dkv, arriving = torch.zeros_like(kv, dtype=torch.float32), None
        for step in range(cp):
            source = (rank - step) % cp
            pending = ring.start(kv, KV_TAG) if step < cp - 1 else None
            # this rank's share of the held block's dK, dV, added once the block's buffer is here
            parts = []
            for i, query in enumerate(mine):
                for j, key in enumerate(chunks_of(source, cp, layout)):
                    if key > query:
                        continue
                    k_c, v_c = kv[0].chunk(2, dim=2)[j], kv[1].chunk(2, dim=2)[j]
                    # the final probabilities
                    p = torch.exp(_scores(qs[i], k_c, key == query, scale) - lses[i])
                    mask = _dropout_mask(p, dropout, generator, ctx.heads) if dropout else None
                    kept = p * mask if dropout else p
                    dp = (dos[i] @ v_c.transpose(-2, -1)).float()
                    ds = (p * ((dp * mask if dropout else dp) - deltas[i]) * scale).to(q.dtype)
                    dq[i].add_((ds @ k_c).float())
                    dv = (kept.to(v_c.dtype).transpose(-2, -1) @ dos[i]).float()
                    parts.append((j, (ds.transpose(-2, -1) @ qs[i]).float(), dv))
            if arriving:  # rule 5: the buffer the previous rank sent while this block was computed
                dkv = arriving()
            for j, dk_part, dv_part in parts:  # added in the order computed, as if added at once
                dkv[0].chunk(2, dim=2)[j].add_(dk_part)
                dkv[1].chunk(2, dim=2)[j].add_(dv_part)
            # on to the next rank; after the last step, home
            arriving = ring.start(dkv, GRAD_TAG) if cp > 1 else None
            if pending:
                kv = pending()
        if arriving:
            dkv = arriving()
        return (
            torch.cat(dq, dim=2).to(q.dtype),
            dkv[0].to(k.dtype),
            dkv[1].to(v.dtype),
            None,
            None,
            None,
            None,
        )


class SequenceShardDropout(nn.Module):
    """``nn.Dropout`` on this rank's positions: the whole sequence's mask, as one process draws it, then this
    rank's positions of it (rule 7)."""

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
    """GPT-2's attention (model.py) with the ring in place of scores, mask and softmax. It keeps the original's
    projections, so the parameters keep their names."""

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
    """(this rank's ring, its data-parallel index): the ranks laid out ``arange(world).view(dp, cp)``, one ring
    per row (rule 6). Every rank creates every group, in the same order; one ring of every rank is the world."""
    world_size, rank = dist.get_world_size(), dist.get_rank()
    if cp == world_size:
        return None, 0
    rings = [dist.new_group(row) for row in torch.arange(world_size).view(-1, cp).tolist()]
    return rings[rank // cp], rank // cp


def context_parallel_gpt2(
    model: nn.Module, group=None, layout: str = "zigzag", heads=(0, 1)
) -> nn.Module:
    """Our GPT-2 (model.py), in place, for its rank of ``group``: it takes the whole micro-batch and returns
    the logits of this rank's positions (rule 1); ``model.sequence_shard(targets)`` gives the targets of those.
    ``heads``: (i, n) where the model is tensor-parallel and this rank holds block i of n of the heads (step 10)."""
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
