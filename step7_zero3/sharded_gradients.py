"""What ranks whose optimiser reads only slices of the gradient must agree on:
whether to step, and by how much.

Step 4's ranks all held the whole averaged gradient, so a GradScaler's overflow check and the
clipping norm came out the same on every rank without a word. Here rank r's optimiser reads only
slice r of the gradient: in step 5 with 16-bit parameters (``ShardedOptimizerWithMasters``:
its float32 masters' gradients are slices of ``param.main_grad``), in ZeRO-2's reduce-scatter shards
(step 6) and in ZeRO-3's pieces (step 7). Then:

1. **One overflow verdict.** Each rank checks only its slices for inf/NaN. If rank 1 found an inf
   and rank 0 did not, rank 0 would step and rank 1 would skip: the replicas would part for good.
   ``ShardedGradScaler`` combines the flags with one all-reduce (MAX), as FSDP's does.
2. **One clipping norm.** Each rank sums the squares of its own slices, one all-reduce adds the
   sums, and every rank scales its slices by the same coefficient: ``sharded_norms.clip_grad_norm``
   with the ranks' group, ``clip_grad_norm(params_of_this_rank, max_norm, [dist.group.WORLD])``.
3. **One parameter norm for the log**, from slices too (the float32 masters, ZeRO-3's pieces): the
   exact parts of the sums of squares add up across ranks to the whole's
   (``sharded_norms.param_norm``).
"""

import torch
import torch.distributed as dist

from comm_accounting import count_collective


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
