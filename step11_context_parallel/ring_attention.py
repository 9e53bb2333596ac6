"""Ring attention: softmax(q k^T / sqrt(d), causal) v for this rank's queries against every rank's
keys and values, the key/value blocks passed round the ring of C ranks (Liu et al. 2023; the merge
and the recomputing backward are flash attention's). context_parallel.py puts it in the model; this
page is the arithmetic:

1. **Chunks.** The sequence is cut into 2C chunks and rank r holds two of them (``chunks_of``: r and
   2C-1-r, ``zigzag``, or 2r and 2r+1, ``contiguous``); a block going round the ring is its rank's
   two chunks.
2. **The ring.** Attention needs every earlier key. A rank computes its queries against the
   key/value block it holds, then passes the block to rank r+1 and receives rank r-1's: after C-1
   passes it has met every block, never holding more than two. The next block's send and receive
   start before the current block is computed, so the compute hides the transfer.
3. **Log-sum-exp merge.** Each (query chunk, key chunk) pair gives a softmax normalised over its own
   keys, and its log-sum-exp ``lse``. Two such partial results merge exactly, in float32:
   ``lse = logaddexp(lse_a, lse_b)``, ``out = out_a exp(lse_a - lse) + out_b exp(lse_b - lse)``.
   Only the merged output and lse are kept for backward: no rank ever holds a score matrix beyond
   one chunk by one chunk, and none is saved. The output is laid out (B, S, H, D), as flash
   attention lays it out, so the projection after it reads the same storage instead of a copy.
4. **Causal.** A key chunk after a query chunk is skipped, the diagonal pair is masked
   (context_parallel.py's rule 3: why zig-zag balances the work).
5. **Backward around the ring again.** The probabilities are recomputed from the saved lse (flash
   attention's backward); the key/value blocks travel the same way, each with a float32 buffer for
   its dK and dV that every rank adds its queries' part to; one more pass brings each buffer home. A
   buffer travels while the next block is computed: a rank computes its part first and adds it once
   the buffer has come (in the same order, so the sums are those of adding at once).
6. **Dropout on the attention weights**, drawn pair by pair in the ring; backward draws the same
   masks again from a generator set to the state forward started from, so no mask is kept. A rank
   that holds some of the heads only (step 10, tensor-parallel too) draws every head's mask and
   keeps its own, so tp ranks do not all drop alike and the masks are this ring's whole-model ones.
"""

import math

import torch
import torch.distributed as dist

from comm_accounting import count_collective

LAYOUTS = ("zigzag", "contiguous")
KV_TAG, GRAD_TAG = 11, 12  # the blocks and their gradients travel as separate messages


def chunks_of(rank: int, cp: int, layout: str = "zigzag") -> tuple[int, int]:
    """The two chunks (of 2 * cp) that ``rank`` holds, in the order its tokens are laid out."""
    return (rank, 2 * cp - 1 - rank) if layout == "zigzag" else (2 * rank, 2 * rank + 1)


class _Ring:
    """Point-to-point with the next and previous rank of ``group``; gloo moves CPU tensors only, so
    where the ranks share a GPU over gloo the messages go through host memory."""

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
        """Send ``tensor`` to the next rank and receive the previous rank's into a new buffer;
        returns a function that waits for both (within the group's timeout) and gives the
        received tensor."""
        staged = tensor.device.type != "cpu" and dist.get_backend(self.group) == "gloo"
        out = tensor.detach().cpu() if staged else tensor.detach().contiguous()
        into = torch.empty_like(out)
        count_collective("send", out)
        # One batch: nccl posts both at once (a send and a receive issued one after the other on its
        # stream would wait for each other round the ring); gloo issues them in turn.
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
    """Float32 scores of one chunk of queries against one chunk of keys;
    the diagonal pair is causal."""
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
    """What ``F.dropout`` multiplies by on the CPU: kept with probability 1 - p, scaled by 1 / (1 -
    p). ``heads``: (i, n) where ``like`` holds block i of n of the heads (step 10's tensor
    parallelism): the mask of all heads is drawn, as one rank of the ring draws it, and block i kept
    (rule 6)."""
    index, blocks = heads
    whole = torch.empty(
        (like.shape[0], like.shape[1] * blocks, *like.shape[2:]),
        dtype=like.dtype,
        device=like.device,
    )
    return whole.bernoulli_(1 - p, generator=generator).div_(1 - p).chunk(blocks, dim=1)[index]


class RingAttention(torch.autograd.Function):
    """softmax(q k^T / sqrt(d), causal) v for this rank's queries against every rank's keys and
    values; with ``dropout`` on the attention weights (rule 6)."""

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
        # laid out (B, S, H, D) as flash attention lays it out:
        # c_proj's input is then the same storage, kept once
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
