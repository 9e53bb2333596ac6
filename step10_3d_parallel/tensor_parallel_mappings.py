"""Tensor parallelism's communication, apart from the layers (Megatron-LM's ``mappings.py``): each
one a small autograd Function whose backward is its forward's conjugate. The layers
(tensor_parallel.py) and sequence parallelism (sequence_parallel.py) call these and nothing else of
torch.distributed.

1. **f and g.** ``copy_to_tensor_parallel_region`` (Megatron's *f*): identity forward, the gradient
   all-reduced backward, in front of a column-parallel layer, because each rank's ``x`` feeds only
   its slice of ``y``.
   ``reduce_from_tensor_parallel_region`` (*g*): the ranks' partial sums all-reduced forward,
   identity backward, after a row-parallel layer.
2. **Gather and scatter along a dimension.** ``gather_along``: the ranks' blocks concatenated
   forward, this rank's block of the gradient backward; ``scatter_along`` the other way round.
   Concatenating adds nothing, so both are exact.
3. **The float64 reduction.** ``all_reduce(..., reduce_dtype=torch.float64)`` sums in float64 and
   rounds once, so the result does not depend on the order the ranks are added in (the exact
   mode's reductions).
4. **Counted.** Every collective's bytes go to
   comm_accounting, whole buffers, as the records report them.
"""

import torch
import torch.distributed as dist

from comm_accounting import all_gather_single, count_collective


def all_reduce(
    tensor: torch.Tensor, group, op=dist.ReduceOp.SUM, reduce_dtype=None
) -> torch.Tensor:
    """Sum (or max) ``tensor`` over ``group`` in place and return it (rule 3: ``reduce_dtype``)."""
    wide = tensor if reduce_dtype in (None, tensor.dtype) else tensor.to(reduce_dtype)
    count_collective("all_reduce", wide)
    dist.all_reduce(wide, op=op, group=group)
    return tensor.copy_(wide) if wide is not tensor else tensor


class _CopyToTensorParallelRegion(torch.autograd.Function):
    """f: identity forward; backward,
    the gradients of every rank's slice of the output are summed."""

    @staticmethod
    def forward(ctx, x, group, reduce_dtype):
        ctx.group, ctx.reduce_dtype = group, reduce_dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return (
            all_reduce(grad.contiguous().clone(), ctx.group, reduce_dtype=ctx.reduce_dtype),
            None,
            None,
        )


class _ReduceFromTensorParallelRegion(torch.autograd.Function):
    """g: the ranks' partial sums added up forward;
    backward, every rank gets the whole gradient as is."""

    @staticmethod
    def forward(ctx, x, group, reduce_dtype):
        return all_reduce(x.contiguous().clone(), group, reduce_dtype=reduce_dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def all_gather_along(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """The ranks' blocks of ``x`` along ``dim``,
    concatenated in rank order (exact: nothing is added)."""
    world_size = dist.get_world_size(group)
    x = x.contiguous()
    stacked = torch.empty((world_size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    count_collective("all_gather", stacked)  # the whole buffer, as every all-gather here is counted
    all_gather_single(stacked, x, group=group)
    return torch.cat(stacked.chunk(world_size, dim=0), dim=dim)


def _my_block(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    return x.chunk(dist.get_world_size(group), dim=dim)[dist.get_rank(group)].contiguous()


class _GatherAlong(torch.autograd.Function):
    """Forward: the ranks' blocks of ``dim``, concatenated;
    backward: this rank's block of the gradient."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return all_gather_along(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _my_block(grad, ctx.dim, ctx.group), None, None


class _ScatterAlong(torch.autograd.Function):
    """Forward: this rank's block of ``dim``, no communication;
    backward: the blocks' gradients all-gathered."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _my_block(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_along(grad, ctx.dim, ctx.group), None, None


def copy_to_tensor_parallel_region(x, group=None, reduce_dtype=None):
    return _CopyToTensorParallelRegion.apply(x, group, reduce_dtype)


def reduce_from_tensor_parallel_region(x, group=None, reduce_dtype=None):
    return _ReduceFromTensorParallelRegion.apply(x, group, reduce_dtype)


def gather_along(x, dim: int, group=None):
    return _GatherAlong.apply(x, dim, group)


def scatter_along(x, dim: int, group=None):
    return _ScatterAlong.apply(x, dim, group)
