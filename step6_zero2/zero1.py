"""ShardedOptimizer: ZeRO stage 1, every rank keeps and steps 1/N of the optimiser state.

Step 4 made the gradient all-reduce cheap, but every rank still held the whole AdamW state (8 bytes
per parameter, twice the weights) and ran the same full update as every other rank. Here:

1. **Element-balanced shards.** The parameters are laid end to end in one flat range (or a few
   chunks), padded to a multiple of N; rank r owns the r-th of N equal slices, so a parameter may be
   cut between two ranks (owning whole parameters would leave the rank with the embedding most of
   the state).
2. **Views, not copies.** The local optimiser steps *views* into the parameters' storage
   (``param.detach().view(-1)[start:end]``): the update lands in the parameter itself, and the
   optimiser creates state for this rank's slices only.
3. **Gradients by slice.** ``step()`` points each view's ``.grad`` at its slice of the averaged
   ``param.grad`` (no copy). In ZeRO-2 (step 6) the views' ``.grad`` point, for good, into shards a
   reduce-scatter fills.
4. **All-gather after the step.** Every rank sends its updated slices and receives everyone else's,
   chunk by chunk, in the same order on every rank (collectives are matched by order).
5. **A drop-in, as ``ZeroRedundancyOptimizer`` is.** ``param_groups`` hold the full parameters, so a
   ``GradScaler``, ``clip_grad_norm_`` and an LR scheduler read the whole averaged gradient every
   rank holds: the ranks agree without a word. Where the optimiser reads slices only (ZeRO-2,
   ``masters.py``), that verdict is combined across ranks (``sharded_gradients.py``). Saving and
   loading: ``zero1_state.py``.

Adam, AdamW and SGD update each element from its own values, so a slice steps to the bits the whole
tensor would; an optimiser that looks across a tensor (LAMB, Adafactor) would not survive
being sliced.
"""

import math
from typing import NamedTuple

import torch
import torch.distributed as dist

from comm_accounting import all_gather_single, count_collective
from zero1_state import ShardedOptimizerState, hyperparameters


class Piece(NamedTuple):
    """The part of one parameter inside one rank's slice of one chunk."""

    param: torch.Tensor
    start: int  # first element, within param.view(-1)
    end: int  # one past the last
    chunk: int
    offset: int  # where the piece begins inside the rank's shard of the chunk


def shard_numel(chunk: list, world_size: int | None = None) -> int:
    """Lp / N: the chunk's L elements, padded up to a multiple of the world size, split N ways."""
    return math.ceil(sum(p.numel() for p in chunk) / (world_size or dist.get_world_size()))


def cut_into_pieces(chunks: list[list], world_size: int) -> list[list[Piece]]:
    """``pieces[r]``: rank r's pieces, chunk by chunk. Rank r owns flat range
    [r * Lp/N, (r + 1) * Lp/N) of every chunk; the padding past L belongs to nobody."""
    pieces = [[] for _ in range(world_size)]
    for c, chunk in enumerate(chunks):
        shard = math.ceil(sum(p.numel() for p in chunk) / world_size)
        begin = 0  # where this parameter begins in the chunk's flat range
        for p in chunk:
            for r in range(world_size):
                lo, hi = max(begin, r * shard), min(begin + p.numel(), (r + 1) * shard)
                if lo < hi:
                    pieces[r].append(Piece(p, lo - begin, hi - begin, c, lo - r * shard))
            begin += p.numel()
    return pieces


def flat_view(piece: Piece, tensor: torch.Tensor) -> torch.Tensor:
    """The piece's elements of ``tensor`` (a parameter or its gradient), as a view: no copy."""
    return tensor.detach().view(-1)[piece.start : piece.end]


class ShardedOptimizer(ShardedOptimizerState, torch.optim.Optimizer):
    """Wrap ``optimizer_cls`` so that this rank keeps and steps only its slices of the parameters;
    use it as ``ZeroRedundancyOptimizer``: ``zero_grad()``, ``backward()``, the gradient sync
    (anything that leaves every rank the averaged ``param.grad``), ``step()``, with a
    ``GradScaler``, clipping and an LR scheduler.

    ``params``: tensors or param-group dicts (frozen parameters are dropped). ``chunks``: lists of
    parameters, each laid out flat and sharded on its own (default: one). ``gradient_shards``:
    ZeRO-2, one flat buffer of Lp/N elements per chunk, filled elsewhere. ``process_group``: the
    ranks sharing the state (default: all).
    ``defaults`` go to ``optimizer_cls``. 16-bit parameters with float32 masters: ``masters.py``.

    ``param_groups`` are the full parameters' groups (with
    ``gradient_shards``, the local groups of slices);
    ``state`` is the local optimiser's. ``Optimizer.__init__`` is not called: it would create
    full-size state.
    """

    def __init__(
        self,
        params,
        optimizer_cls,
        chunks=None,
        gradient_shards=None,
        process_group=None,
        **defaults,
    ):
        groups = list(params)
        if not groups:
            raise ValueError("ShardedOptimizer got an empty parameter list")
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        groups = [
            {
                **g,
                "params": [
                    p
                    for p in ([g["params"]] if torch.is_tensor(g["params"]) else g["params"])
                    if p.requires_grad
                ],
            }
            for g in groups
        ]
        # numbered as a plain optimiser numbers them
        self.params = [p for g in groups for p in g["params"]]
        self.group_sizes = [len(g["params"]) for g in groups]
        self.index = {p: i for i, p in enumerate(self.params)}
        self.chunks = [list(c) for c in chunks] if chunks is not None else [list(self.params)]
        listed = [p for c in self.chunks for p in c]
        if (
            len(self.index) != len(self.params)
            or len(listed) != len(self.params)
            or set(listed) != set(self.params)
        ):
            raise ValueError(
                "every trainable parameter must appear exactly once in the groups and in the chunks"
            )
        if any(len({(p.dtype, p.device) for p in c}) != 1 for c in self.chunks):
            raise ValueError(
                "a chunk is one flat buffer: its parameters need one dtype and one device"
            )
        self.group = process_group
        self.world_size, self.rank = (
            dist.get_world_size(process_group),
            dist.get_rank(process_group),
        )
        self.device = self.params[0].device if self.params else torch.device("cpu")

        # Every rank computes every rank's pieces: it must
        # know where to put what the all-gather brings.
        self.pieces_of_rank = cut_into_pieces(self.chunks, self.world_size)
        group_of = {p: gi for gi, g in enumerate(groups) for p in g["params"]}
        mine = self.pieces_of_rank[self.rank]
        # The local optimiser's parameter order: group by group, chunk order inside a group.
        self.pieces = [
            piece for gi in range(len(groups)) for piece in mine if group_of[piece.param] == gi
        ]
        self.views = self._to_step([flat_view(piece, piece.param) for piece in self.pieces])
        local_groups = [
            {
                **g,
                "params": [
                    v for piece, v in zip(self.pieces, self.views) if group_of[piece.param] == gi
                ],
            }
            for gi, g in enumerate(groups)
        ]
        self.local_optimizer = optimizer_cls(local_groups, **defaults)
        # What GradScaler, clipping and LR schedulers see: the full parameters, with the local
        # groups' hyperparameters. Hyperparameters flow to the local groups before every step and
        # state_dict, and back from them whenever a state dict is loaded into the local optimiser
        # (by anyone).
        self.full_groups = [
            {**hyperparameters(local), "params": g["params"]}
            for g, local in zip(groups, self.local_optimizer.param_groups)
        ]
        self.local_optimizer.register_state_dict_pre_hook(lambda _: self._push_hyperparameters())
        self.local_optimizer.register_load_state_dict_post_hook(
            lambda _: self._pull_hyperparameters()
        )

        self.gradient_shards = gradient_shards
        # ZeRO-2: each view's gradient is a fixed slice of its chunk's shard
        if gradient_shards is not None:
            if [s.numel() for s in gradient_shards] != [
                shard_numel(c, self.world_size) for c in self.chunks
            ]:
                raise ValueError(
                    "gradient_shards needs one flat buffer of ceil(L / world size) "
                    "elements per chunk"
                )
            for piece, view in zip(self.pieces, self.views):
                view.grad = gradient_shards[piece.chunk][
                    piece.offset : piece.offset + piece.end - piece.start
                ]

    def _to_step(self, views: list) -> list:
        """What the local optimiser steps:
        the views themselves (rule 2). ``masters.py``: float32 copies."""
        return views

    # ---- One optimiser step ----------------------------------------------------------------------
    def _take_gradient_slices(self) -> None:
        """ZeRO-1: point every view's ``.grad`` at its
        slice of the averaged ``param.grad`` (no copy)."""
        if self.gradient_shards is not None:
            return  # ZeRO-2: the views already read the gradient shards
        for piece, view in zip(self.pieces, self.views):
            view.grad = None if piece.param.grad is None else flat_view(piece, piece.param.grad)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()
        if self.gradient_shards is None and set_to_none:
            for view in self.views:
                view.grad = None  # in ZeRO-2 the views keep their shard slices for good

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:  # it recomputes the gradients
            with torch.enable_grad():
                loss = closure()
        # whatever scaling or clipping did to param.grad, the views see it
        self._take_gradient_slices()
        self._push_hyperparameters()  # an LR scheduler set them on the full groups
        self.local_optimizer.step()
        self.all_gather_parameters()
        return loss

    def all_gather_parameters(self) -> None:
        """Every rank sends its updated slice of each chunk and receives everyone else's."""
        mine = [flat_view(piece, piece.param) for piece in self.pieces]
        for rank, piece, values in self._all_gather_chunks(mine):
            if rank != self.rank:
                flat_view(piece, piece.param).copy_(values)

    def _all_gather_chunks(self, mine: list, dtype=None):
        """Collective, chunk by chunk (rule 4): this rank sends ``mine``, the values of its pieces
        (in ``pieces`` order), and every rank's come back. Yields ``(rank, piece, its values)`` for
        every rank's pieces; each rank must consume it whole (one all-gather per chunk). ``dtype``:
        what is sent (default: the chunk's own)."""
        for c, chunk in enumerate(self.chunks):
            shard = shard_numel(chunk, self.world_size)
            # Two temporary buffers, the chunk's size (several
            # chunks keep this peak small); the tail is padding.
            send = torch.zeros(shard, dtype=dtype or chunk[0].dtype, device=chunk[0].device)
            for piece, values in zip(self.pieces, mine):
                if piece.chunk == c:
                    send[piece.offset : piece.offset + piece.end - piece.start] = values
            received = torch.empty(shard * self.world_size, dtype=send.dtype, device=send.device)
            count_collective("all_gather", received)
            # comm_accounting: the name this torch has
            all_gather_single(received, send, group=self.group)
            for rank, pieces in enumerate(self.pieces_of_rank):
                for piece in pieces:
                    if piece.chunk == c:
                        begin = rank * shard + piece.offset
                        yield rank, piece, received[begin : begin + piece.end - piece.start]
