"""MainGradDDP: step 4's BucketedDDP for 16-bit parameters,
whose gradients are never summed in 16 bits.

With ``--param-dtype bf16|fp16`` (``masters.py``) the model computes in 16 bits and AdamW steps
float32 masters. Backward leaves a 16-bit ``param.grad``; summing micro-batches there would round
every partial sum to 8 (bf16) or 11 (fp16) bits of mantissa. So, as Megatron-LM's ``main_grad`` and
FSDP2's ``MixedPrecisionPolicy(reduce_dtype=torch.float32)`` do:

1. **Accumulate in the reduce dtype.** Each micro-batch's 16-bit gradient is added to
   ``param.main_grad`` (float32, or float64 with ``--reduce-dtype float64``) and ``param.grad`` is
   freed, inside ``no_sync()`` and out of it alike.
2. **Reduce the sum.** What a bucket reduces for a
   16-bit parameter is that sum, not a 16-bit gradient.
3. **Leave the average in float32.** The averaged gradient goes to ``param.main_grad`` (float32;
   float64 rounded once) and ``param.grad`` stays None: ``masters.py`` reads it from there, so
   nothing on the way to the master weights is rounded to 16 bits.

A float32 parameter goes through step 4's path unchanged,
so a float32 model trains bit for bit as in step 4.
"""

import torch

from bucketed_ddp import BucketedDDP


def is_16_bit(param: torch.Tensor) -> bool:
    return param.dtype in (torch.bfloat16, torch.float16)


def accumulate(param: torch.Tensor, dtype: torch.dtype) -> None:
    """Rule 1: this backward's 16-bit gradient added to
    ``param.main_grad`` (in ``dtype``), and freed."""
    grad, param.grad = param.grad, None
    param.main_grad = (
        grad.to(dtype) if getattr(param, "main_grad", None) is None else param.main_grad.add_(grad)
    )


def gradients(params) -> list:
    """Where each parameter's gradient is after the sync (rule 3): ``main_grad`` beside a 16-bit
    parameter, ``grad`` beside a float32 one (what a step's memory record counts)."""
    return [p.grad if getattr(p, "main_grad", None) is None else p.main_grad for p in params]


class MainGradDDP(BucketedDDP):
    """``BucketedDDP`` whose 16-bit parameters' gradients are summed, reduced and left in float32 in
    ``param.main_grad`` (rules 1-3); same arguments and contract as ``BucketedDDP``."""

    def _on_gradient_ready(self, param: torch.Tensor) -> None:
        if not self.require_sync and is_16_bit(param):
            accumulate(param, self.reduce_dtype)  # rule 1, inside no_sync()
            return
        super()._on_gradient_ready(param)

    def _local_gradient(self, param: torch.Tensor):
        """Rule 2: for a 16-bit parameter, the sum of the step's micro-batches, taken (and freed)
        from ``main_grad`` and ``.grad``."""
        if not is_16_bit(param):
            return param.grad
        if param.grad is not None:
            accumulate(param, self.reduce_dtype)
        grad, param.main_grad = getattr(param, "main_grad", None), None
        return grad

    def _write_back(self, p: torch.Tensor, slot: torch.Tensor, receiving: set) -> None:
        if is_16_bit(p):  # rule 3: float32 (a view of the bucket, or float64 rounded once)
            p.main_grad = slot.to(torch.float32) if p in receiving else None
        else:
            super()._write_back(p, slot, receiving)
