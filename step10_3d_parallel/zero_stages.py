"""The ZeRO stage over step 10's data axis (``--zero 0|1|2|3``): where the averaged gradient lives
and who steps AdamW, over the dp x cp plane (mesh.py's rule 5; with experts each kind over its own
group, experts_on_mesh.py's rule 5). Stage 3, where the parameters are sharded too, is step 7's
FullyShardedDP on each stage: zero3_on_mesh.py.

1. **One layout, three stages.** Every stage cuts this rank's TP/PP shard as step 5's
   ``ShardedOptimizer`` does (zero1.py's rule 1: laid flat, element-balanced), over a group of
   N ranks:
   - 0, DDP's (step 3): the gradients all-reduced; N = 1, a group of this rank alone, whose one
     slice is the whole shard (ZeRO-1 on flat views steps AdamW's bits) and whose all-gather is
     nothing. AdamW's whole state.
   - 1, ZeRO-1 (step 5): the gradients all-reduced; N = dp x cp; 1/N stepped, then all-gathered.
   - 2, ZeRO-2 (step 6): the gradients reduce-scattered into the slices ZeRO-1 owns (its
     ``gradient_shards``, zero1.py's rule 3); then ZeRO-1's step and all-gather. Step 6 cuts by its
     buckets; here ZeRO-1's one chunk.
2. **The whole gradient accumulates, then leaves** (ZeRO-2). A pipeline's backward has no moment at
   which a parameter's gradient is final (the tie's and sequence parallelism's are finished after
   the flushes), so the micro-batches add into ``param.grad`` as step 6's ``no_sync()`` has them do;
   then each chunk is laid flat in ZeRO-1's order, each ``param.grad`` freed as it is copied,
   reduce-scattered, divided, rounded once into the shard: 4 Ψ/N bytes of gradient held (and 4 Ψ
   while accumulating: the planner's ZeRO-2 row).
3. **The same sums.** An all-reduce and a reduce-scatter add the same N numbers for each element,
   divided by the same W (dp x cp; an expert's over its W/D copies, divided by W too: step 12's rule
   7), in ``--reduce-dtype``: the stages agree bitwise wherever the collective's order cannot change
   a sum (2 ranks, or float64).
4. **A norm over slices** (ZeRO-2). A rank holds 1/N of its shard's gradient, so the squares of its
   slices are added over the plane too (sharded_gradients.py's rule 2, step 5's), then over tp and
   pp (composition.py's rule 3): the plane holds every dense and every expert element once, so no ep
   rank is left out (experts_on_mesh.py's rule 6).
5. **Checkpoints by name**, whatever the stage: composition.py's rule 4 gives DCP each optimiser's
   slices (stage 0: whole) as boxes of the whole tensors, so a run saved at one stage resumes
   at another.
"""

import torch
import torch.distributed as dist

from comm_accounting import count_collective, reduce_scatter_single
from config import UserError
from expert_parallel import reduce_gradients
from naive_dp import allreduce_gradients
from offload import OffloadedOptimizer
from training import adamw_options, adamw_param_groups, make_optimizer
from zero1 import ShardedOptimizer, shard_numel
from zero3_on_mesh import check_fully_sharded, check_plane_flags

STAGES = (0, 1, 2, 3)


def add_zero_flag(flags) -> None:
    flags.add_argument(
        "--zero",
        type=int,
        default=1,
        help="ZeRO stage over the dp x cp ranks (zero_stages.py): 0 all-reduces the "
        "gradients and keeps AdamW "
        "whole, 1 shards AdamW's state, 2 its gradients too, 3 the parameters too "
        "(zero3_on_mesh.py)",
    )
    flags.add_argument(
        "--replicate",
        type=int,
        default=1,
        metavar="R",
        help="with --zero 3, HSDP (zero3_on_mesh.py, step 7's hsdp.py): shard over dp x cp "
        "/ R consecutive "
        "ranks of the plane, replicate over R such rows; 1: shard over the whole plane",
    )
    flags.add_argument(
        "--offload-optimizer",
        action="store_true",
        help="with --zero 3, AdamW's state and step in host memory (ZeRO-Offload, step 7's "
        "offload.py)",
    )


def check_zero(config: dict, dp: int) -> None:
    """One line for a stage step 10 does not have, or (ZeRO-3) a flag it does not compose with, or
    replicas (HSDP) that do not cut the dp x cp plane."""
    if config["zero"] not in STAGES:
        raise UserError(
            f"--zero {config['zero']}: step 10 runs ZeRO 0, 1, 2 or 3 over dp x cp; use one of them"
        )
    if config["zero"] == 3:
        check_fully_sharded(config)
    check_plane_flags(config, dp)


def optimizer_factory(config: dict, timeout=None):
    """``sharded(named, group)``: rule 1's ``ShardedOptimizer`` for ``named``, whose gradients are
    averaged over ``group``: sliced over ``group`` (stages 1 and 2; 2 with its gradient shards), or
    over this rank alone (stage 0).
    Stage 3: a plain AdamW, ``named`` being this rank's pieces already (zero3_on_mesh.py, as step
    7), or with --offload-optimizer step 7's ``OffloadedOptimizer`` (the same AdamW on host copies:
    bitwise on a CPU).
    ``timeout``: stage 0's group's, as the mesh's groups have it."""
    alone = []  # stage 0's group of one, made once: only this rank takes part in creating it

    def sharded(named: list, group) -> ShardedOptimizer | torch.optim.AdamW:
        if (
            config["zero"] == 3
        ):  # with --offload-optimizer, stepping host copies of the pieces (step 7's)
            make = lambda named: make_optimizer(named, config)  # noqa: E731
            return OffloadedOptimizer(named, make) if config["offload_optimizer"] else make(named)
        groups, shards = adamw_param_groups(named, config), None
        if config["zero"] == 0:
            if not alone:
                alone.append(
                    dist.new_group(
                        [dist.get_rank()], timeout=timeout, use_local_synchronization=True
                    )
                )
            return Whole(groups, torch.optim.AdamW, process_group=alone[0], **adamw_options(config))
        if config["zero"] == 2:  # the optimiser's one chunk: its parameters in group order
            chunk = [p for g in groups for p in g["params"] if p.requires_grad]
            n = dist.get_world_size(group)
            shards = [
                torch.zeros(shard_numel(chunk, n), dtype=torch.float32, device=chunk[0].device)
            ]
        return ShardedOptimizer(
            groups,
            torch.optim.AdamW,
            process_group=group,
            gradient_shards=shards,
            **adamw_options(config),
        )

    return sharded


class Whole(ShardedOptimizer):
    """Stage 0 (rule 1): ZeRO-1 over this rank alone.
    Its slice is every element: nothing to gather."""

    def all_gather_parameters(self) -> None:
        pass


def _parts(optimizer) -> list:
    """The ``ShardedOptimizer``s inside ``optimizer``:
    itself, or (with experts) ``DenseAndExperts``'s two."""
    return getattr(optimizer, "parts", [optimizer])


def average_gradients(module, optimizer, mesh, reduce_dtype: torch.dtype) -> int | None:
    """Rule 1's gradient sync, after the flushes: stages 0 and 1 all-reduce (step 3's; with experts
    step 12's, each kind over its group), stage 2 reduce-scatters into each optimiser's shards
    (rule 2) and returns the bytes of the whole gradient it freed (what the micro-batches
    accumulated)."""
    if _parts(optimizer)[0].gradient_shards is not None:
        return sum(
            reduce_scatter_gradients(part, mesh.dp * mesh.cp, reduce_dtype)
            for part in _parts(optimizer)
        )
    if mesh.experts:  # dense ones over dp x cp, each expert's over its copies (experts_on_mesh.py)
        reduce_gradients(module, mesh.experts, reduce_dtype)
    elif mesh.dp * mesh.cp > 1:
        allreduce_gradients(module, reduce_dtype=reduce_dtype, group=mesh.dp_cp_group)


def reduce_scatter_gradients(
    optimizer: ShardedOptimizer, divisor: int, reduce_dtype: torch.dtype
) -> int:
    """Rule 2: each chunk's ``param.grad`` laid flat in the optimiser's order (padded to N slices),
    freed as it is copied, summed over the optimiser's group with this rank receiving its slice
    only, divided by ``divisor``, rounded once into the chunk's gradient shard. A parameter with no
    gradient adds zeros. Returns the bytes of the gradients freed."""
    n, freed = optimizer.world_size, 0
    for chunk, shard in zip(optimizer.chunks, optimizer.gradient_shards):
        flat = torch.zeros(shard.numel() * n, dtype=reduce_dtype, device=shard.device)
        begin = 0
        for p in chunk:
            if p.grad is not None:
                flat[begin : begin + p.numel()].copy_(p.grad.view(-1))
                freed += p.grad.numel() * p.grad.element_size()
            p.grad = (
                None  # the whole gradient lives in ``flat`` only, and soon as this rank's slice
            )
            begin += p.numel()
        mine = flat
        if n > 1:  # (an expert on one rank of the plane: nothing to add)
            mine = flat.new_empty(shard.numel())
            count_collective("reduce_scatter", flat)
            reduce_scatter_single(mine, flat, group=optimizer.group)
        del flat
        shard.copy_(mine.div_(divisor))  # float64 -> float32 rounds here, once
    return freed


def norm_terms(named: list, optimizer, mesh) -> tuple[list, list, list]:
    """``sharded_norms.clip_grad_norm``'s (params, counted, groups) at this stage. Stages 0 and 1:
    every rank holds the whole averaged gradient of its shard: composition.py's ``counted_once``,
    over tp, pp (and ep). Stage 2 (rule 4): this rank's slices, of them those of the tensors counted
    once over tp and pp, over the plane first."""
    from composition import counted_once
    from experts_on_mesh import norm_groups

    parts = _parts(optimizer)
    if parts[0].gradient_shards is None:
        return [p for _, p in named], counted_once(named, mesh), norm_groups(mesh)
    keep = {id(p) for p in counted_once(named, mesh, plane=True)}
    views = [(piece, view) for part in parts for piece, view in zip(part.pieces, part.views)]
    return (
        [view for _, view in views],
        [view for piece, view in views if id(piece.param) in keep],
        [mesh.dp_cp_group, mesh.tp_group, mesh.pp_group],
    )


def gradient_shards(optimizer) -> list | None:
    """What holds this rank's gradient after the sync (``metrics.memory_stats``'s ``grads``): stage
    2's shards, or None (every ``param.grad``)."""
    if _parts(optimizer)[0].gradient_shards is None:
        return None
    return [shard for part in _parts(optimizer) for shard in part.gradient_shards]
