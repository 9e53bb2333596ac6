"""The whole model's norms when its pieces live on several ranks:
one clipping norm, one logged parameter norm.

Up to step 4 every rank holds the whole gradient, and ``training.clip_grad_norm`` gives each the
same norm alone. From step 5 on a rank holds part of the model: ZeRO's slices (steps 5-7),
tensor-parallel shards (step 8), a pipeline's stages (step 9), experts (step 12), all of them on
step 10's mesh. After torchtitan's ``clip_grad_norm_(..., pp_mesh=)``, one function for
every layout:

1. **Every element once.** A rank adds the squares of ``counted`` (default: the tensors it scales);
   across the ranks of ``groups`` every element of the model is counted exactly once: a slice or a
   shard on its own rank, a replica on one rank only (step 8's LayerNorms on tp rank 0; the tied
   embedding on the first stage).
2. **Summed over the groups in turn** (ZeRO's ranks; the pipeline's stages; tp, then pp, in step
   10): one all-reduce of one number per group, counted in the records' communication bytes.
3. **One process's bits.** The squares are added in float64 (the clipping norm) or exactly (the
   parameter norm, ``exact_sums``), so any grouping of the pieces gives the float32 clipping norm
   and the exact parameter norm that one process holding everything gets; every rank then scales its
   own pieces by the same coefficient.
"""

import torch
import torch.distributed as dist

from comm_accounting import count_collective
from exact_sums import norm_from_parts, square_sum_parts
from training import scale_gradients, sum_of_squares


def clip_grad_norm(params, max_norm: float, groups=(), counted=None, device=None) -> torch.Tensor:
    """``training.clip_grad_norm`` over pieces: scale the gradients of ``params`` (every tensor
    whose ``.grad`` this rank scales) so that the whole model's gradient has norm at most
    ``max_norm``; return that norm before clipping, in float32. ``counted``: rule 1; ``groups``:
    rule 2; ``device``: where nccl reduces (default: the parameters')."""
    params = list(params)
    grads = [p.grad for p in params if p.grad is not None]
    squares = sum_of_squares(
        grads if counted is None else [p.grad for p in counted if p.grad is not None]
    )
    device = device or (params[0].device if params else torch.device("cpu"))
    norm = summed_over(squares, groups, device).sqrt().float()
    scale_gradients(grads, norm, max_norm)
    return norm


def param_norm(tensors, groups=(), device=None) -> float:
    """``training.param_norm`` over pieces: the whole model's parameter norm, exact, in float64,
    from this rank's ``tensors`` (every element counted once across the ranks of ``groups``:
    rule 1)."""
    tensors = list(tensors)
    parts = square_sum_parts(tensors)
    device = device or (tensors[0].device if tensors else None)
    return norm_from_parts(summed_over(parts, groups, device))


def summed_over(tensor: torch.Tensor, groups, device) -> torch.Tensor:
    """Rule 2: ``tensor`` all-reduced over each of ``groups`` in turn, on ``device`` (nccl reduces
    device tensors only), back on the CPU; as it is when there are no groups."""
    if not groups:
        return tensor
    tensor = tensor.to(device or "cpu")
    for group in groups:
        count_collective("all_reduce", tensor)
        dist.all_reduce(tensor, group=group)
    return tensor.cpu()
