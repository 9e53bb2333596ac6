"""What ranks whose optimiser reads only slices of the gradient must agree on: whether to step, and by how much.

Step 4's ranks all held the whole averaged gradient, so a GradScaler's overflow check and the
clipping norm came out the same on every rank without a word. Here rank r's optimiser reads only
slice r of the gradient: in step 5 with 16-bit parameters (``ShardedOptimizer(param_dtype=...)``:
its float32 masters' gradients are slices of ``param.main_grad``), in ZeRO-2's reduce-scatter shards
(step 6) and in ZeRO-3's pieces (step 7). Then:

1. **One overflow verdict.** Each rank checks only its slices for inf/NaN. If rank 1 found an inf
   and rank 0 did not, rank 0 would step and rank 1 would skip: the replicas would part for good.
   ``ShardedGradScaler`` combines the flags with one all-reduce (MAX), as FSDP's does.
2. **One clipping norm.** Each rank sums the squares of its own slices, one all-reduce adds the
   sums, and every rank scales its slices by the same coefficient (``clip_gradient_shards``).
3. **One parameter norm for the log**, from slices too (the float32 masters, ZeRO-3's pieces): the exact
   parts of the sums of squares add up across ranks to the whole's (``sharded_param_norm``).
"""
import torch
import torch.distributed as dist

from comm_accounting import count_collective
from training import clip_to_norm, norm_from_parts, square_sum_parts, sum_of_squares


class ShardedGradScaler(torch.amp.GradScaler):
    """A GradScaler whose found-inf flag is the same on every rank.

    Each rank checks only its own gradient slices for inf/NaN. If rank 1 found an inf and rank 0 did
    not, rank 0 would step and rank 1 would skip: the replicas would part for good. So the flags are
    combined with one all-reduce (MAX) and every rank skips, or steps, together.
    """

    def unscale_(self, optimizer) -> None:
        if not self.is_enabled():
            return  # a disabled scaler is a no-op, here too: no collective
        super().unscale_(optimizer)
        state = self._per_optimizer_states[id(optimizer)]
        found_inf = torch.zeros((), dtype=torch.float32, device=self._scale.device)
        for flag in state["found_inf_per_device"].values():  # empty on a rank with no gradients
            found_inf += flag.to(found_inf.device)
        count_collective("all_reduce", found_inf)
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)
        state["found_inf_per_device"] = {found_inf.device: found_inf}


def clip_gradient_shards(optimizer, max_norm: float) -> torch.Tensor:
    """``training.clip_gradients`` for sharded gradients: same rule, same return (the norm before clipping).

    ``optimizer``: a ``ShardedOptimizer`` over ``gradient_shards`` (ZeRO-2) or with ``param_dtype`` (its
    masters' gradients are slices of ``param.main_grad``), or any optimiser whose groups hold this rank's
    slices (ZeRO-3 steps a plain AdamW over them). Each rank sums the squares of its own slices (in float64:
    see ``sum_of_squares``), one all-reduce adds the ranks' sums, and every rank scales its slices by the
    same coefficient. The slices cover every gradient element exactly once and never the padding. A ZeRO-1
    ``ShardedOptimizer`` over float32 parameters holds whole gradients: clip those as step 1 does.
    """
    if not getattr(optimizer, "groups_are_local", True):  # step 5's ShardedOptimizer over float32 parameters
        raise ValueError("this ShardedOptimizer's gradients are whole on every rank (ZeRO-1): clip them with "
                         "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm), as for a plain optimiser")
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grads = [p.grad for p in params if p.grad is not None]
    # nccl reduces GPU tensors only: the device of the parameters, even on a rank whose slices are empty
    device = getattr(optimizer, "device", params[0].device if params else torch.device("cpu"))
    total = sum_of_squares(grads).to(device)
    count_collective("all_reduce", total)
    dist.all_reduce(total)
    norm = total.cpu().sqrt().float()
    clip_to_norm(grads, norm, max_norm)
    return norm


def sharded_param_norm(slices, device) -> float:
    """``training.param_norm`` of the full parameters from this rank's ``slices`` of them (collective): the exact
    integer parts of the sums of squares add up across ranks to the parts of the whole, so every rank gets the
    bits one process holding everything gets."""
    parts = square_sum_parts(slices).to(device)  # nccl reduces GPU tensors only
    count_collective("all_reduce", parts)
    dist.all_reduce(parts)
    return norm_from_parts(parts.cpu())
