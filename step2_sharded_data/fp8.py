"""FP8 training from scratch: the blocks' linears multiply in 8-bit floats, with dynamic scaling.

A linear layer does three matmuls per step, and FP8 runs each on 8-bit operands
(``torch._scaled_mm`` multiplies them and accumulates in float32 on the GPU's tensor cores: twice
bf16's rate on a Hopper):

    forward       out    = x  @ W^T      x (tokens x in)  e4m3,   W^T (in x out)     e4m3
    backward      grad_x = gy @ W        gy (tokens x out) e5m2*, W (out x in)       e4m3
    backward      grad_W = gy^T @ x      gy^T (out x tokens) e5m2*, x (tokens x in)  e4m3

Rules, each one what torchao 0.18's ``convert_to_float8_training`` does
(the parity the tests prove, bit for bit):

1. Two formats. ``float8_e4m3fn`` (4 exponent bits, 3 mantissa bits, largest 448) for what the
   forward reads: activations and weights need precision more than range. ``float8_e5m2``
   (largest 57344) for the output gradient in the tensorwise recipe: gradients span more decades
   than one scale can cover in e4m3.
   (*) The rowwise recipe keeps the gradient in e4m3 too: a scale per row already follows each
   row's range.
2. A scale maps a tensor's largest magnitude (its amax, measured now: *dynamic* scaling) onto the
   format's largest value: ``scale = fmax / max(amax, 1e-12)``, in float64 then rounded to float32
   (torch.compile and eager agree on that division; the epsilon keeps an all-zero tensor finite).
   The cast is ``clamp(x * scale, -fmax, fmax)`` rounded to 8 bits; the matmul multiplies by
   ``1/scale`` again.
3. Tensorwise: one scale per tensor. Rowwise: one scale per row *of the matmul's operand along its
   reduced dimension*, so every scale factors out of the sum: x per token and W per output feature
   in the forward; gy per token and W per input feature for grad_x; gy per output feature and x per
   input feature (both over the tokens) for grad_W. Each operand is cast again for each matmul it
   enters, on the axis that one needs. Rowwise scales are rounded down to a power of two
   (``round_scales_to_power_of_2``): multiplying by a power of two is exact, so the scaling itself
   adds no rounding.
4. ``_scaled_mm`` wants its first operand row-major and its second column-major (what the tensor
   cores read); both layouts are made here where torchao makes them, so every kernel, the CPU's too,
   gets the same call.
5. The forward gemm uses fast accumulation, the two gradient gemms do not (torchao's defaults).
   Rowwise without fast accumulation multiplies with unit scales and applies the two scale vectors
   afterwards (torchao's choice: the rowwise kernel is slow without it), and rowwise output in
   float32 or fp16 is produced in bf16 then converted (``_scaled_mm`` has no rowwise
   float32 output).
6. The output comes out in the compute dtype: the input's, or bf16 under ``--amp bf16`` autocast.
   The backward saves the high-precision input and weight, not their FP8 copies, and casts again (so
   FP8 saves matmul time, not activation memory); the bias is added after the matmul in the output's
   dtype. Autocast is off around the matmuls: inside it, the CPU's ``_scaled_mm`` returns other
   bits, and torchao's runs below it.
7. Which layers: every ``nn.Linear`` inside the transformer blocks. The embeddings are lookups, not
   matmuls, and the output layer (tied to the token embedding here) stays in high precision, as
   torchao's users and torchtitan leave it: the logits feed a softmax over the whole vocabulary,
   where FP8's three mantissa bits cost the most. FP8 gemms need both dimensions of every weight to
   be multiples of 16, and so the tokens of a micro-batch (the inner dimension of grad_W); anything
   else is refused in one line.
"""

import torch
from torch import nn

from failures import UserError

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
EPS = 1e-12  # rule 2: an all-zero tensor gets a large but finite scale
# rule 1 and 3: (granularity, dtype of the output gradient, scales rounded to powers of two)
RECIPES = {
    "tensorwise": ("tensor", E5M2, False),
    "rowwise": ("row", E4M3, True),
}


def scale_of(t: torch.Tensor, dtype: torch.dtype, dim: int | None, pow2: bool) -> torch.Tensor:
    """Rule 2-3: ``fmax / amax`` of ``t`` (dim None:
    the whole tensor; else one per slice along ``dim``)."""
    amax = t.abs().max() if dim is None else t.abs().amax(dim=dim, keepdim=True)
    scale = (torch.finfo(dtype).max / torch.clamp(amax.to(torch.float64), min=EPS)).to(
        torch.float32
    )
    return torch.exp2(torch.floor(torch.log2(scale))) if pow2 else scale


def to_fp8(t: torch.Tensor, dtype: torch.dtype, dim: int | None, pow2: bool) -> tuple:
    """Rule 2: ``t`` scaled into ``dtype``'s range and rounded,
    saturating; returns (bits, scale)."""
    scale = scale_of(t, dtype, dim, pow2)
    fmax = torch.finfo(dtype).max
    return (t.to(torch.float32) * scale).clamp(min=-fmax, max=fmax).to(dtype), scale


def scaled_mm(a, a_scale, b, b_scale, out_dtype: torch.dtype, fast_accum: bool) -> torch.Tensor:
    """``(a / a_scale) @ (b / b_scale)`` in ``out_dtype``;
    rules 4 and 5 (a row-major, b column-major)."""
    a = a if a.stride(1) == 1 and a.stride(0) > 1 else a.contiguous()
    b = b.t().contiguous().t() if b.stride(1) == 1 and b.stride(0) > 1 else b
    a_inv, b_inv = a_scale.reciprocal(), b_scale.reciprocal()
    rowwise = a_scale.dim() == 2
    after = None
    # rule 5: unit scales in the kernel, the scale vectors applied after
    if rowwise and not fast_accum:
        after, a_inv, b_inv = a_inv * b_inv, a_inv.new_ones(()), a_inv.new_ones(())
    mm_dtype = torch.bfloat16 if rowwise and out_dtype != torch.bfloat16 else out_dtype
    out = torch._scaled_mm(
        a, b, scale_a=a_inv, scale_b=b_inv, out_dtype=mm_dtype, use_fast_accum=fast_accum
    )
    if after is not None:
        out *= after  # in place: computed in float32, kept in the kernel's dtype (as torchao does)
    return out.to(out_dtype)


class _FP8Matmul(torch.autograd.Function):
    """``x @ W^T`` with all three matmuls in FP8 (the table above); x is 2-D (tokens x in)."""

    @staticmethod
    def forward(ctx, x, weight, recipe: str, out_dtype: torch.dtype):
        granularity, grad_dtype, pow2 = RECIPES[recipe]
        row = granularity == "row"
        ctx.save_for_backward(x, weight)  # rule 6: high precision, cast again in backward
        ctx.recipe = recipe
        x8, sx = to_fp8(x, E4M3, -1 if row else None, pow2)  # one scale per token
        wt8, swt = to_fp8(weight.t(), E4M3, 0 if row else None, pow2)  # one per output feature
        return scaled_mm(x8, sx, wt8, swt, out_dtype, fast_accum=True)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        granularity, grad_dtype, pow2 = RECIPES[ctx.recipe]
        row = granularity == "row"
        # grad_x = gy @ W: the sum runs over the output features; gy per token, W per input feature.
        g8, sg = to_fp8(grad_out, grad_dtype, -1 if row else None, pow2)
        wt8, swt = to_fp8(weight.t(), E4M3, -1 if row else None, pow2)
        grad_x = scaled_mm(g8, sg, wt8.t(), swt.t(), grad_out.dtype, fast_accum=False)
        # grad_W = gy^T @ x: the sum runs over the tokens;
        # gy per output feature, x per input feature.
        g8, sg = to_fp8(grad_out, grad_dtype, 0 if row else None, pow2)
        x8, sx = to_fp8(x, E4M3, 0 if row else None, pow2)
        grad_w = scaled_mm(g8.t(), sg.t(), x8, sx, grad_out.dtype, fast_accum=False)
        return grad_x, grad_w, None, None


class Float8Linear(nn.Linear):
    """An ``nn.Linear`` whose matmuls run in FP8 (``recipe``: tensorwise or rowwise); the same
    parameters, names and state dict as the layer it replaces, so optimisers, checkpoints and the
    sharding steps see no change."""

    recipe = "tensorwise"

    def forward(self, x):
        # CUDA autocast: torchao rounds the input to its dtype first
        if torch.is_autocast_enabled("cuda"):
            x = x.to(torch.get_autocast_dtype("cuda"))
        dtype = (
            torch.get_autocast_dtype(x.device.type)
            if torch.is_autocast_enabled(x.device.type)
            else x.dtype
        )
        # autocast would recast _scaled_mm's operands
        with torch.autocast(x.device.type, enabled=False):
            out = _FP8Matmul.apply(x.reshape(-1, x.shape[-1]), self.weight, self.recipe, dtype)
        out = out.reshape(*x.shape[:-1], out.shape[-1])
        return out if self.bias is None else out + self.bias.to(out.dtype)  # rule 6

    def extra_repr(self):
        return f"{super().extra_repr()}, fp8={self.recipe}"


def convert_to_fp8(
    module: nn.Module, recipe: str = "tensorwise", module_filter_fn=None
) -> nn.Module:
    """Every ``nn.Linear`` in ``module`` (those ``module_filter_fn(layer, name)`` accepts) turned
    into a ``Float8Linear`` in place, keeping its parameters; torchao's
    ``convert_to_float8_training`` called alike.
    Our GPT-2: ``convert_to_fp8(model.transformer.h, recipe)``, the blocks only (rule 7)."""
    if recipe not in RECIPES:
        raise UserError(f"fp8 recipe {recipe!r} is not one of {', '.join(RECIPES)}")
    for name, layer in list(module.named_modules()):
        if type(layer) is nn.Linear and (module_filter_fn is None or module_filter_fn(layer, name)):
            if layer.in_features % 16 or layer.out_features % 16:
                raise UserError(
                    "--fp8 needs linear layers whose sizes are multiples of 16; "
                    f"{name or 'the layer'} "
                    f"is {layer.in_features} x {layer.out_features}: change --n-embd"
                )
            layer.__class__ = Float8Linear  # the same object and parameters, another forward
            layer.recipe = recipe
    return module


def add_fp8_flag(parser) -> None:
    """``--fp8``: the steps that offer FP8 (0-7)."""
    parser.add_argument(
        "--fp8",
        choices=list(RECIPES),
        default=None,
        help="the blocks' linear layers in FP8 with dynamic scaling, one scale per tensor "
        "or per row "
        "(torchao's recipe names; fp8.py)",
    )


def check_fp8(config: dict, device: torch.device) -> None:
    """Refuse what FP8 cannot run, before any work is done (rule 7, autocast, the device)."""
    if not config.get("fp8"):
        return
    if config["amp"] == "fp16":
        raise UserError(
            "--fp8 with --amp fp16 is not a recipe (fp16's range needs a loss scaler "
            "that FP8's own "
            "scales replace); use --amp bf16 or --amp none"
        )
    if config.get("compile"):
        raise UserError("--fp8 with --compile is not tried yet; drop one of them")
    if config.get("moe_experts"):  # an expert's token count varies per step: not a multiple of 16
        raise UserError(
            "--fp8 with --moe-experts is not built yet (an expert's tokens are not a "
            "multiple of 16); "
            "drop one of them"
        )
    tokens = config["micro_batch_size"] * config["seq_len"]
    if config["n_embd"] % 16 or tokens % 16:
        raise UserError(
            f"--fp8 needs --n-embd ({config['n_embd']}) and the tokens of a micro-batch "
            f"(--micro-batch-size x --seq-len = {tokens}) to be multiples of 16"
        )
    recipe, why = config["fp8"], fp8_cannot_run(config["fp8"], device)
    if why and recipe != "tensorwise" and not fp8_cannot_run("tensorwise", device):
        raise UserError(
            f"--fp8 {recipe} cannot run on {device.type} with this torch build (its "
            "_scaled_mm takes one "
            "scale per tensor only); use --fp8 tensorwise or drop --fp8"
        )
    if why:
        raise UserError(
            f"--fp8 cannot run on {device.type} with this torch build ({why}); drop --fp8"
        )


def fp8_cannot_run(recipe: str, device: torch.device) -> str | None:
    """Why ``recipe``'s matmuls cannot run on ``device`` with this torch build (the first line of
    ``_scaled_mm``'s error), or None. Ask the device, do not guess: a GPU needs compute capability
    8.9+, and torch 2.11's CPU ``_scaled_mm`` takes one scale per tensor only (rowwise needs one
    per row)."""
    row = RECIPES[recipe][0] == "row"
    try:
        a = torch.zeros(16, 16, device=device, dtype=E4M3)
        scale = torch.ones((16, 1) if row else (), device=device)
        out = torch.bfloat16 if row else torch.float32  # rule 5: rowwise gives bf16
        torch._scaled_mm(
            a, a.t(), scale_a=scale, scale_b=scale.t(), out_dtype=out, use_fast_accum=row
        )
    except (RuntimeError, AttributeError) as error:
        return str(error).splitlines()[0]
    return None
