"""The pieces of one optimiser step that every step shares:
optimiser, LR schedule, AMP, clipping, norms.

They live here, not in each train.py, so that the numbers they produce are computed the same way
in every step; parity between steps depends on it. Why the norms are summed so that no grouping
changes them, and how the exact one works: exact_sums.py.
"""

import contextlib
import math
import os

import torch

from exact_sums import norm_from_parts, pieces, square_sum_parts
from failures import UserError


def check_one_process(step: str) -> None:
    """Step 0 is one process:
    under torchrun each copy would train the whole model alone into the same --out."""
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        raise UserError(
            f"{step} is one process, but torchrun started {os.environ['WORLD_SIZE']}: "
            "each would train "
            "the whole model alone and write the same --out; run it with python, or run "
            "step1_torch_ddp under torchrun"
        )


def pick_device(choice: str, local_rank: int = 0) -> torch.device:
    """``auto``: the local rank's GPU when there is one
    (ranks share GPUs round-robin), else the CPU."""
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise UserError("--device cuda asked for, but torch sees no CUDA GPU; use --device cpu")
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def check_amp(amp: str, device: torch.device) -> None:
    """Refuse an autocast mode this device cannot run, before any work is done."""
    if amp == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise UserError(
            f"--amp bf16 needs a GPU with bfloat16 support; {torch.cuda.get_device_name(device)} "
            "has none: use --amp fp16 or --amp none"
        )
    if amp == "fp16":
        try:  # the CPU path exists in recent PyTorch builds, not in all: ask it, do not guess
            with torch.autocast(device.type, dtype=torch.float16):
                torch.ones(2, 2, device=device) @ torch.ones(2, 2, device=device)
            torch.amp.GradScaler(device.type)
        except (RuntimeError, ValueError) as error:
            raise UserError(
                f"--amp fp16 cannot run on {device.type} with this torch build "
                f"({str(error).splitlines()[0]}); use --amp bf16 or --amp none"
            ) from None


def autocast(amp: str, device: torch.device):
    """The forward-pass context of ``--amp``: parameters and gradients stay float32."""
    if amp == "none":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16 if amp == "bf16" else torch.float16)


PARAM_DTYPES = {"float32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def add_param_dtype_flag(parser) -> None:
    """``--param-dtype``:
    the steps that keep float32 master weights beside 16-bit parameters (0, 5, 6, 7)."""
    parser.add_argument(
        "--param-dtype",
        choices=list(PARAM_DTYPES),
        default="float32",
        help="dtype of the parameters forward and backward compute in (and of the all-gathers); "
        "16 bits keeps a float32 master copy of the owned elements beside AdamW's moments",
    )


def param_dtype(config: dict) -> torch.dtype | None:
    """The 16-bit parameter dtype of ``--param-dtype``, or None for float32 (no master copy)."""
    dtype = PARAM_DTYPES[config.get("param_dtype", "float32")]
    return None if dtype == torch.float32 else dtype


def float32_masters(model, dtype) -> list | None:
    """``--param-dtype`` (``dtype``, 16-bit): float32 ``(name, master)`` copies of the parameters,
    for AdamW to step, and the model cast to ``dtype`` (the copy it computes in, rounded from the
    masters after every step). None, and the model as it is, for float32."""
    if dtype is None:
        return None
    masters = [
        (name, p.detach().clone().requires_grad_(p.requires_grad))
        for name, p in model.named_parameters()
    ]
    model.to(dtype)
    return masters


def check_param_dtype(config: dict, device: torch.device) -> None:
    """Refuse a ``--param-dtype`` that means nothing clear
    with the other flags, before any work is done."""
    dtype = param_dtype(config)
    if dtype is None:
        return
    if config["amp"] != "none":
        raise UserError(
            f"--param-dtype {config['param_dtype']} already computes in 16 bits; --amp "
            f"{config['amp']} "
            "would autocast on top of it: drop --amp (it is autocast over float32 weights)"
        )
    if dtype == torch.bfloat16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise UserError(
            "--param-dtype bf16 needs a GPU with bfloat16 support; "
            f"{torch.cuda.get_device_name(device)} "
            "has none: use --param-dtype fp16"
        )


def needs_loss_scaling(config: dict) -> bool:
    """fp16 gradients underflow without loss scaling,
    whether autocast (``--amp``) or the parameters made them."""
    return config["amp"] == "fp16" or config.get("param_dtype") == "fp16"


def make_grad_scaler(
    config: dict, device: torch.device, scaler_cls=torch.amp.GradScaler
) -> torch.amp.GradScaler:
    """fp16 gradients underflow without loss scaling; bf16 has float32's range and needs none.
    Disabled, the scaler is a no-op with the same calls, so the loop has one shape for every mode.
    The sharded steps pass their own ``scaler_cls``, which agrees on overflow across ranks."""
    return scaler_cls(
        device.type, init_scale=config["loss_scale_init"], enabled=needs_loss_scaling(config)
    )


def decays(name: str) -> bool:
    """Weight decay for the matrices and embeddings, none for biases and LayerNorm weights (GPT-2
    practice). Decided by name, not by ``param.dim()``:
    a ZeRO-3 rank holds 1-D slices of everything."""
    return not (name.endswith(".bias") or ".ln_" in name)


def adamw_param_groups(named_params, config: dict) -> list[dict]:
    named_params = [(n, p) for n, p in named_params if p.requires_grad]
    return [
        {
            "params": [p for n, p in named_params if decays(n)],
            "weight_decay": config["weight_decay"],
        },
        {"params": [p for n, p in named_params if not decays(n)], "weight_decay": 0.0},
    ]


def adamw_options(config: dict) -> dict:
    """AdamW's hyperparameters, and one implementation of its update for every step and reference of
    a run: the two implementations group their arithmetic differently, and parity is bitwise.
    torch's default on each device, pinned: the single-tensor update on the CPU, the multi-tensor
    (``foreach``) kernels on a GPU, where the single-tensor update launches a dozen small kernels
    per parameter. A config without a device (a script of one's own) gets ``foreach=None``: torch's
    default for the parameters' device, the same."""
    from config import on_cuda

    foreach = on_cuda(config) if "device" in config else None
    return {"lr": config["lr"], "betas": (config["beta1"], config["beta2"]), "foreach": foreach}


def make_optimizer(named_params, config: dict) -> torch.optim.AdamW:
    return torch.optim.AdamW(adamw_param_groups(named_params, config), **adamw_options(config))


def lr_at(step: int, config: dict) -> float:
    """Linear warm-up to ``lr`` over ``warmup_steps``,
    then cosine decay to ``min_lr`` at the last step.
    ``step`` counts optimiser steps from 0. A pure function of the step: resume needs no
    scheduler state."""
    lr, min_lr, warmup, total = (
        config["lr"],
        config["min_lr"],
        config["warmup_steps"],
        config["steps"],
    )
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - 1 - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))) * (lr - min_lr)


def make_scheduler(optimizer, config: dict) -> torch.optim.lr_scheduler.LambdaLR:
    """``lr_at`` as a PyTorch scheduler (its state_dict is checkpointed like every other state)."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_at(step, config) / config["lr"]
    )


def sum_of_squares(tensors) -> torch.Tensor:
    """Sum of the squares of all elements of all tensors, accumulated and returned in float64 on
    their device (on a GPU nothing waits for it: the clipping that follows scales on the
    device too).

    Each float32 square is exact in float64, and the float64 sum carries ~29 more bits than a
    float32 result keeps: adding the same squares in another grouping moves it by ~1e-16 relative,
    far below float32's rounding (exact_sums.py says why that matters). On a GPU the elements are
    taken in pieces of 4M across tensors (``exact_sums.pieces``): a GPT-2 small's 148 gradients in
    21 pieces, three kernels each, not three per tensor. On the CPU, tensor by tensor: each one's
    float64 squares stay in cache.
    """
    tensors = list(tensors)
    pieces_ = pieces(tensors) if tensors and tensors[0].is_cuda else (t.detach() for t in tensors)
    # summed on the first tensor's device, in order: float64 additions in the same order give the
    total = None
    for x in pieces_:  # same bits on either device
        square = x.double().pow(2).sum()
        total = square if total is None else total + square.to(total.device)
    return torch.zeros((), dtype=torch.float64) if total is None else total


def clip_grad_norm(params, max_norm: float) -> torch.Tensor:
    """Scale the gradients of ``params`` in place so that their norm is at most ``max_norm``; return
    that norm before clipping, in float32. The rule of ``torch.nn.utils.clip_grad_norm_``
    (coefficient max_norm / (norm + 1e-6), capped at 1, in float32), with the squares added in
    float64 (``sum_of_squares``) rather than as per-tensor float32 norms: the same float32 norm
    however the sum is grouped (unless it sits within ~1e-16 of a float32 rounding boundary). Not
    exact, unlike ``param_norm``: exactness would cost many times the float64 sum's time
    (docs/design.md, "Norms")."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = sum_of_squares(grads).sqrt().float()
    scale_gradients(grads, norm, max_norm)
    return norm


def scale_gradients(grads, norm: torch.Tensor, max_norm: float) -> None:
    """``torch.nn.utils.clip_grad_norm_``'s rule, given the float32 ``norm``: ``grads`` times
    max_norm / (norm + 1e-6), capped at 1; ``max_norm`` 0 leaves them alone (no clipping)."""
    if max_norm > 0:
        coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        by_device = {}
        for g in grads:
            by_device.setdefault(g.device, []).append(g)
        # one multi-tensor multiply per device, as torch's does
        for device, same_device in by_device.items():
            torch._foreach_mul_(same_device, coefficient.to(device))


def param_norm(tensors) -> float:
    """The parameter norm of ``tensors``, in float64. In float64: a float32 norm of ~30 would round
    to steps of 4e-6, coarser than the 1e-6 parity limit. Exact rather than summed in float64
    (``exact_sums``): records are compared bitwise, and a float64 sum of the same numbers grouped
    differently can differ in the last bit; integers do not."""
    return norm_from_parts(square_sum_parts(list(tensors)))
