"""A tensor-parallel model's state, apart from its layers (tensor_parallel.py): each rank's shards written as
checkpoint blocks and read back at any degree, the whole model gathered, the shards counted once in a global norm,
and the replicated parameters checked bit-identical across the group.

1. **A shard is its own checkpoint block.** Every sharded parameter carries ``tp_blocks``: ``[(dim, start, end)]``,
   rank r's block r of T in the model's own layout (``nn.Linear``'s ``(out, in)``), so a rank writes its shards
   as they are, with ``(name, dim, start, end)`` beside each; resharding.py joins blocks back whatever the degree
   that wrote them, and cuts them for whatever degree reads them.
2. **Counted once.** A global norm over the group sums every rank's shards and the replicated parameters once
   (on the group's first rank): ``counted_once`` says which tensors a rank adds.
"""

import hashlib

import torch
import torch.distributed as dist
import torch.nn as nn

from comm_accounting import count_collective
from config import UserError
from training import params_in_order


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
    """Rank r's block r of T of ``full`` along ``dim``, as a new Parameter that records where it sits (rule 1):
    ``tp_blocks``, ``[(dim, start, end)]`` (a list: the checkpoint format of resharding.py allows several)."""
    length = block_length(full.shape[dim], group, what)
    start = dist.get_rank(group) * length
    shard = nn.Parameter(
        full.detach().narrow(dim, start, length).clone(memory_format=torch.contiguous_format),
        requires_grad=full.requires_grad,
    )
    shard.tp_blocks = [(dim, start, start + length)]
    return shard


def is_sharded(param: torch.Tensor) -> bool:
    return getattr(param, "tp_blocks", None) is not None


def shard_of(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``full`` (a full parameter, or its optimiser state), shaped as ``param``; ``full``
    itself for a replicated parameter."""
    if not is_sharded(param):
        return full
    [(dim, start, end)] = param.tp_blocks
    return full.narrow(dim, start, end - start)


def checkpoint_blocks(name: str, param) -> list:
    """Where this rank's ``param`` sits in the whole one: ``(name, dim, start, end)`` blocks (resharding.py);
    a replicated parameter is one block, all of it."""
    return (
        [(name, *block) for block in param.tp_blocks]
        if is_sharded(param)
        else [(name, 0, 0, param.shape[0])]
    )


def checkpoint_shards(named: list, params: list, optimizer_state: dict) -> dict:
    """This rank's shards of the parameters ``named`` (``(name, param)`` pairs) and of their optimiser state
    (``optimizer_state``: a state dict whose i-th parameter is ``params[i]``), and which block of which parameter
    each is: resharding.py joins them back at any degree. A shard is its own block, as it is laid out."""
    name_of = {p: n for n, p in named}
    return {
        "model_blocks": [b for n, p in named for b in checkpoint_blocks(n, p)],
        "model": [p.detach() for _, p in named],
        "optimizer": optimizer_state,
        "optimizer_slices": [checkpoint_blocks(name_of[p], p) for p in params],
    }


def load_checkpoint_shards(named: list, params: list, checkpoint) -> dict:
    """The reverse of ``checkpoint_shards``: copy this rank's shard of every parameter ``named`` out of
    ``checkpoint`` (any step's, any degree's: resharding.py joins its blocks), and return the optimiser
    state of the shards (the i-th entry ``params[i]``'s)."""
    with torch.no_grad():
        for name, param in named:
            param.copy_(shard_of(param, checkpoint.parameter(name)))
    name_of = {p: n for n, p in named}
    return checkpoint.optimizer_state_dict(
        [checkpoint_blocks(name_of[p], p) for p in params], params
    )


class TensorParallelShards:
    """checkpoint.py's part for a tensor-parallel model and its plain optimiser: each rank saves its shards as they
    are (``checkpoint_shards``) and loads back its shards of any step's checkpoint (``load_checkpoint_shards``)."""

    per_rank = True

    def __init__(self, model, optimizer):
        self.named, self.optimizer = list(model.named_parameters()), optimizer

    def checkpoint_state(self) -> dict:
        return checkpoint_shards(
            self.named, params_in_order(self.optimizer), self.optimizer.state_dict()
        )

    def load_checkpoint(self, checkpoint) -> None:
        params = params_in_order(self.optimizer)
        self.optimizer.load_state_dict(load_checkpoint_shards(self.named, params, checkpoint))


def gather_full_parameters(model, group=None) -> dict:
    """Every parameter whole, by name, on every rank: what the plain model's ``named_parameters()`` would hold.
    One all-gather per sharded parameter."""
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
    """The full tensor from every rank's shard (``parts[r]``, rank r's), given one rank's ``tp_blocks``: rank r
    holds block r of T along the same dim, so the full tensor is the shards side by side in rank order."""
    return torch.cat(parts, dim=blocks[0][0])


def counted_once(params, group=None) -> list:
    """This rank's share of the whole model for a global norm (``training.clip_grad_norm`` and ``param_norm``
    over ``group``): its shards, and the replicated parameters on the group's first rank only."""
    first = dist.get_rank(group) == 0
    return [p for p in params if is_sharded(p) or first]


def replicated_in_sync(model, group=None) -> bool:
    """True on every rank when every replicated parameter is bit-identical on every rank (a check, not a fix)."""
    digest = hashlib.sha256()
    for param in model.parameters():
        if not is_sharded(param):
            digest.update(param.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    mine = torch.tensor([int.from_bytes(digest.digest()[:7], "little")], dtype=torch.int64)
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    return all(torch.equal(everyone[0], d) for d in everyone)
