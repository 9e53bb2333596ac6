"""A tensor-parallel model's state, apart from its layers (tensor_parallel.py): each rank's shards
written as checkpoint boxes and read back at any degree, the whole model gathered, the shards
counted once in a global norm, and the replicated parameters checked bit-identical across the group.

1. **A shard is its own checkpoint box.** Every sharded parameter carries ``tp_blocks``: ``[(dim,
   start, end)]``, rank r's block r of T in the model's own layout (``nn.Linear``'s ``(out, in)``),
   and ``tp_shape``, the whole parameter's; a rank gives DCP its shards as they are, each one box of
   the whole tensor (``place_of``, dcp_checkpoint.py), and DCP copies any degree's boxes into
   whatever degree reads them.
2. **Counted once.** A global norm over the group sums every rank's shards and the replicated
   parameters once (on the group's first rank): ``counted_once`` says which tensors a rank adds.
"""

import hashlib

import torch
import torch.distributed as dist
import torch.nn as nn

from comm_accounting import count_collective
from config import UserError
from dcp_checkpoint import (
    Place,
    load_model,
    load_optimizer,
    model_state,
    optimizer_state,
    params_in_order,
)


def block_length(size: int, group, what: str) -> int:
    """``size / T``, or a UserError naming ``what`` when T does not divide it."""
    world_size = dist.get_world_size(group)
    if size % world_size:
        raise UserError(
            f"{what} ({size}) is not divisible by the tensor-parallel degree {world_size}; "
            f"use a degree that divides it"
        )
    return size // world_size


def block_of(full: torch.Tensor, dim: int, group, what: str) -> nn.Parameter:
    """Rank r's block r of T of ``full`` along ``dim``, as
    a new Parameter that records where it sits (rule 1):
    ``tp_blocks``, ``[(dim, start, end)]`` (a list: the checkpoint format of resharding.py
    allows several)."""
    length = block_length(full.shape[dim], group, what)
    start = dist.get_rank(group) * length
    shard = nn.Parameter(
        full.detach().narrow(dim, start, length).clone(memory_format=torch.contiguous_format),
        requires_grad=full.requires_grad,
    )
    shard.tp_blocks, shard.tp_shape = [(dim, start, start + length)], tuple(full.shape)
    return shard


def is_sharded(param: torch.Tensor) -> bool:
    return getattr(param, "tp_blocks", None) is not None


def place_of(param: torch.Tensor) -> Place:
    """Where this rank's ``param`` sits in the whole one (rule 1):
    its block, or all of a replicated parameter."""
    if not is_sharded(param):
        return Place(tuple(param.shape))
    [(dim, start, _)] = param.tp_blocks
    offsets = tuple(start if d == dim else 0 for d in range(param.dim()))
    return Place(param.tp_shape, offsets, tuple(param.shape))


class TensorParallelShards:
    """checkpoint.py's part for a tensor-parallel model and its plain optimiser: each rank gives DCP
    its shards as they are, and loads back its shards of any step's checkpoint, at any degree
    (rule 1)."""

    per_rank = True

    def __init__(self, model, optimizer):
        self.named, self.optimizer = list(model.named_parameters()), optimizer
        name_of = {p: n for n, p in self.named}
        self.places = [(name_of[p], place_of(p)) for p in params_in_order(optimizer)]

    def checkpoint_state(self) -> dict:
        return {
            **model_state([(n, p, place_of(p)) for n, p in self.named]),
            **optimizer_state(self.optimizer, self.places),
        }

    def load_checkpoint(self, checkpoint) -> None:
        load_model(checkpoint, [(n, p, place_of(p)) for n, p in self.named])
        load_optimizer(checkpoint, self.optimizer, self.places)


def gather_full_parameters(model, group=None) -> dict:
    """Every parameter whole, by name, on every rank: what the plain model's ``named_parameters()``
    would hold. One all-gather per sharded parameter."""
    size = dist.get_world_size(group)
    full = {}
    for name, param in model.named_parameters():
        local = param.detach().contiguous()
        if not is_sharded(param):
            full[name] = local.clone()
            continue
        parts = [torch.empty_like(local) for _ in range(size)]
        count_collective("all_gather", local)
        dist.all_gather(parts, local, group=group)
        full[name] = assemble(param.tp_blocks, parts)
    return full


def assemble(blocks: list, parts: list) -> torch.Tensor:
    """The full tensor from every rank's shard (``parts[r]``, rank r's), given one rank's
    ``tp_blocks``: rank r holds block r of T along the same dim, so the full tensor is the shards
    side by side in rank order."""
    return torch.cat(parts, dim=blocks[0][0])


def counted_once(params, group=None) -> list:
    """This rank's share of the whole model for a global norm (``sharded_norms.clip_grad_norm`` and
    ``param_norm`` over ``group``): its shards, and the replicated parameters on the group's first
    rank only."""
    first = dist.get_rank(group) == 0
    return [p for p in params if is_sharded(p) or first]


def replicated_in_sync(model, group=None) -> bool:
    """True on every rank when every replicated parameter
    is bit-identical on every rank (a check, not a fix)."""
    digest = hashlib.sha256()
    for param in model.parameters():
        if not is_sharded(param):
            digest.update(param.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    mine = torch.tensor([int.from_bytes(digest.digest()[:7], "little")], dtype=torch.int64)
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    return all(torch.equal(everyone[0], d) for d in everyone)
