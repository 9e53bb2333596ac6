"""The parity matrix: every data-parallel step against PyTorch DDP at world sizes 2, 3 and 4,
in the exact mode (float64 reduction) and in the default float32 mode.

    python compare/exact_matrix.py                          # default workload, ~10 min on 2 cores
    python compare/exact_matrix.py --steps 10 --amp bf16     # extra flags go to every trainer

The exact mode must show zero difference everywhere. The float32 mode is bitwise at world size 2
(a + b == b + a, and halving is exact) and drifts at 3 and 4, where PyTorch DDP computes
g0/3 + g1/3 + g2/3 and the from-scratch steps (g0 + g1 + g2)/3: the same value, rounded differently.
Runs go to runs/matrix/<mode>_ws<N>/<step>.
"""

import argparse
import sys
from pathlib import Path

# config.py, as every step has it
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "common"))
import parity  # noqa: E402
from config import OneLineParser, UserError, exit_on_user_error  # noqa: E402
from launch import run_trainer  # noqa: E402

REPO_ROOT = parity.REPO_ROOT
MODES = ("float64", "float32")  # the trainers' --reduce-dtype


def run(step: str, world_size: int, mode: str, extra: list[str]):
    out = REPO_ROOT / "runs" / "matrix" / f"{mode}_ws{world_size}" / step
    run_trainer(
        step,
        world_size,
        ["--reduce-dtype", mode, "--quiet", "--save-every", "0", "--out", str(out), *extra],
        out.with_suffix(".log"),
    )
    return out


def world_sizes_and_modes(world_sizes: str, modes: str) -> tuple[list[int], list[str]]:
    """The comma-separated flags as lists, or a ``UserError`` before any run starts."""
    try:
        sizes = [int(w) for w in world_sizes.split(",")]
    except ValueError:
        raise UserError(
            f"--world-sizes takes integers separated by commas, e.g. 2,3,4; got {world_sizes!r}"
        ) from None
    if min(sizes) < 1:
        raise UserError(f"--world-sizes: every world size must be at least 1, got {world_sizes!r}")
    unknown = [m for m in modes.split(",") if m not in MODES]
    if unknown:
        raise UserError(
            f"--modes: {', '.join(map(repr, unknown))} is not a reduce dtype; choose "
            f"from {','.join(MODES)}"
        )
    return sizes, modes.split(",")


def main() -> int:
    parser = OneLineParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world-sizes", default="2,3,4")
    parser.add_argument("--modes", default=",".join(MODES))
    args, extra = parser.parse_known_args()
    world_sizes, modes = world_sizes_and_modes(args.world_sizes, args.modes)
    # Steps 3-7: data parallelism. Steps 8 and up sum inside the
    # layers in another order (no exact mode reaches step 1).
    steps = [
        s for s in parity.step_folders() if 3 <= parity.step_number(s) < parity.MODEL_PARALLEL_FROM
    ]
    reference = next(s for s in parity.step_folders() if s.startswith("step1"))
    print(
        f"{'mode':<8} {'ranks':>5}  {'step':<22} {'max abs diff':>12} "
        f"{'max |param norm diff|':>21}  verdict"
    )
    exact_ok = True
    for mode in modes:
        for world_size in world_sizes:
            ref = run(reference, world_size, mode, extra)
            for step in steps:
                _, _, result = parity.check(str(ref), str(run(step, world_size, mode, extra)))
                if mode == "float64":
                    exact_ok &= result.bitwise
                print(
                    f"{mode:<8} {world_size:>5}  {step:<22} {result.max_abs:>12.3e} "
                    f"{result.max_param_norm_diff:>21.3e}  {parity.verdict(result)}",
                    flush=True,
                )
    print("exact mode: zero difference everywhere" if exact_ok else "exact mode: DIFFERENCES FOUND")
    return 0 if exact_ok else 1


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main))
