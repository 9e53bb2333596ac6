"""ShardedOptimizerWithMasters: ZeRO-1 (zero1.py) with 16-bit parameters and float32 master weights,
as ZeRO and FSDP2 train in mixed precision.

1. **16-bit parameters, float32 masters.** With ``param_dtype`` (bf16 or fp16) the model's
   parameters become 16-bit: forward and backward compute in 16 bits and the all-gather moves 2
   bytes per element. What the local optimiser steps is a float32 *copy* of this rank's slices, the
   master weights, beside their moments: 12 bytes per owned element, 2Ψ + 2Ψ + 12Ψ/N in all.
2. **The gradient never rounded on its way to the master.** It is read in float32: from
   ``param.main_grad`` where the gradient sync left one (``main_grad.py``'s ``MainGradDDP`` does for
   16-bit parameters, as Megatron-LM's does), else ``param.grad`` upcast, or from the ZeRO-2 shards.
3. **Rounded once, then all-gathered.** After the step each master is rounded to 16 bits into this
   rank's slice of its parameter, and the slices are all-gathered as in ZeRO-1.
4. **The masters' groups are what tools read.** ``param_groups`` are the local optimiser's groups:
   in ZeRO-1 their ``.grad`` are views of this rank's slices of ``main_grad``, taken fresh whenever
   they are read, so a scaler unscales (and clipping scales) ``main_grad`` in place; it sees only
   this rank's slices, so its verdict must be combined across ranks (``sharded_gradients.py``).
5. **Checkpoints hold the masters**, each rank its float32 slices beside its optimiser state
   (``zero1_state.py``: what ZeRO-1 saves are the tensors it steps), never the 16-bit copies: a
   resumed run steps on from them.
"""

import torch

from zero1 import ShardedOptimizer, flat_view


class ShardedOptimizerWithMasters(ShardedOptimizer):
    """``ShardedOptimizer`` whose parameters are ``param_dtype`` (torch.bfloat16 or torch.float16)
    and whose local optimiser steps float32 masters of this rank's slices. Every other argument is
    ``ShardedOptimizer``'s."""

    def __init__(self, params, optimizer_cls, param_dtype, **kwargs):
        self.param_dtype = param_dtype
        super().__init__(params, optimizer_cls, **kwargs)

    def _to_step(self, views: list) -> list:
        """Rule 1: float32 copies of this rank's slices; the parameters themselves become 16-bit."""
        if (
            self.param_dtype not in (torch.bfloat16, torch.float16)
            or self.params[0].dtype != torch.float32
        ):
            raise ValueError(
                f"param_dtype {self.param_dtype}: 16-bit parameters over float32 ones only"
            )
        masters = [view.clone() for view in views]
        for p in self.params:
            p.data = p.data.to(self.param_dtype)
        return masters

    @property
    def groups_are_local(self) -> bool:
        return True  # rule 4

    @property
    def param_groups(self):
        # rule 4: fresh views of main_grad, for a scaler to unscale in place
        self._take_gradient_slices()
        return super().param_groups

    def _take_gradient_slices(self) -> None:
        """Rule 2: each master's ``.grad`` a float32 view of its slice of ``main_grad`` (ZeRO-2:
        of the shards)."""
        if self.gradient_shards is not None:
            return
        for piece, master in zip(self.pieces, self.views):
            grad = getattr(piece.param, "main_grad", None)
            grad = piece.param.grad if grad is None else grad
            master.grad = None if grad is None else flat_view(piece, grad).to(master.dtype)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if set_to_none:
            for p in self.params:
                if getattr(p, "main_grad", None) is not None:
                    p.main_grad = None
        super().zero_grad(set_to_none)

    @torch.no_grad()
    def all_gather_parameters(self) -> None:
        """Rule 3: the masters rounded once into this rank's
        slices of the 16-bit parameters, then all-gathered."""
        for piece, master in zip(self.pieces, self.views):
            flat_view(piece, piece.param).copy_(master)
        super().all_gather_parameters()

    @torch.no_grad()
    def gathered_masters(self) -> dict:
        """Collective: ``{parameter: its full float32 master}`` (``param_dtype``), every rank's
        slices gathered chunk by chunk. The whole model in float32: for the final weights and tests,
        not for every step."""
        full = {}
        for _, piece, values in self._all_gather_chunks(self.views, torch.float32):
            target = full.setdefault(
                piece.param, torch.empty(piece.param.shape, device=self.device)
            )
            target.view(-1)[piece.start : piece.end] = values
        return full

    def master_weights(self, named_params) -> dict:
        """``{name: full float32 weight}``:
        the masters gathered (a collective, every rank takes part)."""
        masters = self.gathered_masters()
        return {name: masters.get(param, param) for name, param in named_params}

    @property
    def masters(self) -> list:
        return self.views  # rule 1


def sharded_optimizer(params, optimizer_cls, param_dtype=None, **kwargs) -> ShardedOptimizer:
    """ZeRO-1's ``ShardedOptimizer``, or, given a 16-bit ``param_dtype`` (``--param-dtype``), its
    float32-master subclass: the trainers' one constructor for both."""
    if param_dtype is None:
        return ShardedOptimizer(params, optimizer_cls, **kwargs)
    return ShardedOptimizerWithMasters(params, optimizer_cls, param_dtype, **kwargs)
