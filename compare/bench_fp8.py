"""One linear layer's forward and backward at GPT-2 small's shapes: nn.Linear (float32, bf16
autocast), common/fp8.py's Float8Linear and torchao's, each recipe; interleaved rounds, the median.

    # the linears of a GPT-2 small block, 1024 tokens
    python compare/bench_fp8.py
    python compare/bench_fp8.py --tokens 8192 --device cuda   # where FP8 is the point: a Hopper GPU

On a CPU, ``torch._scaled_mm`` is an emulation (the 8-bit operands widened, then a float32 GEMM), so
FP8 is slower there, not faster: the CPU's ratio says what the casts and the emulation cost, nothing
about a GPU. Prints a table and one JSON line (milliseconds per forward + backward).
"""

import copy
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "common"))
from config import OneLineParser, UserError, exit_on_user_error  # noqa: E402
from fp8 import RECIPES, convert_to_fp8  # noqa: E402

# a block's linears: attention projections, MLP up, MLP down
GPT2_SMALL = "768x768,768x3072,3072x768"


def layers(in_f: int, out_f: int, device) -> dict:
    """Every contender for one (in, out) shape, the same weights:
    name -> (module, autocast dtype or None)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    base = torch.nn.Linear(in_f, out_f, device=device)
    rows = {"nn.Linear float32": (base, None), "nn.Linear bf16 autocast": (base, torch.bfloat16)}
    for recipe in RECIPES:
        rows[f"ours {recipe}"] = (
            convert_to_fp8(torch.nn.Sequential(copy.deepcopy(base)), recipe),
            torch.bfloat16,
        )
        rows[f"torchao {recipe}"] = (
            convert_to_float8_training(
                torch.nn.Sequential(copy.deepcopy(base)),
                config=Float8LinearConfig.from_recipe_name(recipe),
            ),
            torch.bfloat16,
        )
    return rows


def time_once(module, dtype, x, device) -> float:
    x = x.detach().requires_grad_()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
        y = module(x)
    y.float().sum().backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def main():
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=GPT2_SMALL, help="in x out of each layer, comma-separated")
    p.add_argument(
        "--tokens", type=int, default=1024, help="rows of the input (micro-batch x sequence)"
    )
    p.add_argument(
        "--rounds", type=int, default=5, help="interleaved rounds; the median is reported"
    )
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = p.parse_args()
    try:
        shapes = [tuple(int(n) for n in s.split("x")) for s in args.shapes.split(",")]
        assert all(len(s) == 2 for s in shapes)
    except (ValueError, AssertionError):
        raise UserError(
            f"--shapes {args.shapes}: give IN x OUT pairs like 768x3072,3072x768"
        ) from None
    if args.tokens % 16 or any(n % 16 for s in shapes for n in s) or args.rounds < 1:
        raise UserError(
            "--tokens and every size in --shapes must be multiples of 16 (FP8 GEMMs), "
            "--rounds at least 1"
        )
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda asked for, but torch sees no CUDA GPU; use --device cpu")
    device = torch.device(args.device)
    torch.manual_seed(0)
    results = {}
    for in_f, out_f in shapes:
        rows = layers(in_f, out_f, device)
        x = torch.randn(args.tokens, in_f, device=device)
        times = {name: [] for name in rows}
        for module, dtype in rows.values():
            time_once(module, dtype, x, device)  # warm-up: allocations, kernel selection
        for _ in range(args.rounds):
            for name, (module, dtype) in rows.items():
                times[name].append(time_once(module, dtype, x, device))
        results[f"{in_f}x{out_f}"] = {name: statistics.median(t) for name, t in times.items()}
    kind = "emulated on the CPU" if device.type == "cpu" else torch.cuda.get_device_name(device)
    print(
        f"forward + backward of one linear, {args.tokens} tokens, ms (median of "
        f"{args.rounds}; FP8 {kind})"
    )
    names = list(next(iter(results.values())))
    print("| shape | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for shape, row in results.items():
        base = row["nn.Linear bf16 autocast"]
        print(
            f"| {shape} | "
            + " | ".join(f"{row[n]:.1f} ({row[n] / base:.2f}x)" for n in names)
            + " |"
        )
    print(json.dumps({"device": kind, "tokens": args.tokens, "ms": results}))


if __name__ == "__main__":
    exit_on_user_error(main)
