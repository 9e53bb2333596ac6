"""ZeRO-3 in mixed precision, as FSDP2's ``MixedPrecisionPolicy``: what
``FullyShardedDP(param_dtype=...)`` adds to zero3.py. A second idea (16-bit compute over float32
masters), so a file of its own; zero3.py calls it in a line where float32 has nothing to do.

1. **The float32 shards stay the masters.** The optimiser steps them as in float32 training; only
   what is gathered is 16-bit: each all-gather sends the shard cast to ``param_dtype`` (bf16 or
   fp16: half the bytes), a copy freed once the gather is waited on (zero3.py's
   ``_launch_gather`` and ``_gathered``).
2. **Compute in 16 bits.** Forward and backward run on the gathered 16-bit weights, and the
   floating inputs of every unit are cast to ``param_dtype`` first, as FSDP2's
   ``cast_forward_inputs`` does, so no operation mixes the dtypes (``cast_forward_inputs``).
3. **Gradients never rounded to 16 bits on the way to the masters.** A unit's 16-bit gradient is
   reduced in ``reduce_dtype`` (float32); under ``no_sync()`` each micro-batch's 16-bit gradient
   is added to a ``reduce_dtype`` sum, as FSDP2 does, not summed in 16 bits (``accumulate``).
"""

import torch


def cast_forward_inputs(modules, param_dtype: torch.dtype) -> None:
    """Rule 2: before each module's forward, its floating tensor arguments are cast to
    ``param_dtype``."""

    def cast_inputs(module, args, kwargs):
        def cast(t):
            return t.to(param_dtype) if torch.is_tensor(t) and t.is_floating_point() else t

        return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}

    for module in modules:
        module.register_forward_pre_hook(cast_inputs, with_kwargs=True)


def accumulate(unit, reduce_dtype: torch.dtype):
    """Rule 3: take ``unit.flat.grad`` (this backward's 16-bit gradient; None if none reached the
    unit) and add it to ``unit.accumulated``, the micro-batches' ``reduce_dtype`` sum so far;
    returns the new sum."""
    grad, unit.flat.grad = unit.flat.grad, None
    if unit.accumulated is None:
        return None if grad is None else grad.to(reduce_dtype)
    return unit.accumulated if grad is None else unit.accumulated.add_(grad)
