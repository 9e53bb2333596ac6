"""Outliers against FP8's scales: a small model trained in bf16, ``tensorwise`` and ``rowwise`` FP8,
with outlier tokens (rows of a linear's input) or an outlier channel (a column), and each matmul's
error measured.

    python compare/fp8_outliers.py                                   # the table and one JSON line
    python compare/fp8_outliers.py --plot docs/images/fp8_outliers.png

1. The model: a two-layer MLP (``Linear(width, hidden)``, GELU, ``Linear(hidden, width)``), every
   linear in FP8 (common/fp8.py) or in bf16, always under bf16 autocast. It learns a teacher of the
   same shape from a start near it (the teacher's weights, each times 1 + 0.3 N(0, 1)), so the loss
   falls to the floor that each recipe's rounding allows. The loss: squared error relative to the
   target's, on the ordinary tokens.
2. The outliers carry no information, so what they cost is only what they do to the scales.
   ``tokens``: one token in 64 at ``--factor`` times the others (the "massive activations" of large
   models), left out of the loss, as an attention sink's output is unused; its rows reach the second
   linear too. ``channel``: input channel 0 at ``--factor`` times the others in every token; it is
   channel 0 in every case and the teacher's and the student's weights on it are zero (they stay
   zero: its gradient is dropped). ``none``: the control.
3. Each matmul's error, after training, on a fresh batch: the first linear's forward (``x W^T``) and
   weight gradient (``gy^T x``, gy the float32 model's own gradient of the loss), the recipe's
   result against float32 with the same weights and gy, as a relative Frobenius error over the
   ordinary part (the outlier tokens' rows and channel 0's column left out). A scale helps only
   along the axis its matmul keeps: rowwise scales x per token in the forward, per input channel
   (over the tokens) in the weight gradient (fp8.py, rule 3).
4. Every run starts from the same weights and draws the same
   batches (seeded); the runs differ in the recipe only.
Prints a table and one JSON line.
"""

import copy
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "common"))
from config import OneLineParser, UserError, exit_on_user_error  # noqa: E402
from fp8 import convert_to_fp8, fp8_cannot_run  # noqa: E402

KINDS = ["none", "tokens", "channel"]
# bf16 last: on an AVX-512 CPU (AMX, torch 2.13) a bf16 matmul sends the CPU's _scaled_mm to
# oneDNN's reference FP8 kernel for the rest of the process, 1000x slower (docs/fp8.md, Speed)
RECIPES = ["tensorwise", "rowwise", "bf16"]
EVERY = 64  # rule 2: one token in 64 is an outlier


def batch(kind: str, tokens: int, width: int, factor: float, gen) -> tuple:
    """Rule 2: inputs (tokens x width) and which tokens count in the loss."""
    x = torch.randn(tokens, width, generator=gen)
    keep = torch.ones(tokens, dtype=torch.bool)
    if kind == "tokens":
        x[::EVERY] *= factor
        keep[::EVERY] = False
    elif kind == "channel":
        x[:, 0] = (
            factor  # the same in every token, as the outlier features of large models nearly are
        )
    return x, keep


def mlp(width: int, hidden: int) -> torch.nn.Sequential:
    return torch.nn.Sequential(
        torch.nn.Linear(width, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, width)
    )


def relative_loss(out, target, keep) -> torch.Tensor:
    return ((out.float() - target)[keep] ** 2).sum() / (target[keep] ** 2).sum()


def train(teacher, start, kind: str, recipe: str, args) -> tuple[list, torch.nn.Module]:
    """Rule 1: AdamW, a cosine learning rate from ``--lr`` to 0;
    the losses and the trained model."""
    model = copy.deepcopy(start)
    if recipe != "bf16":
        convert_to_fp8(model, recipe)
    # rule 2: channel 0's weights stay zero
    model[0].weight.register_hook(lambda g: g.index_fill(1, torch.tensor([0]), 0.0))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(2)  # rule 4: the same batches in every run
    losses = []
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = args.lr * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        x, keep = batch(kind, args.tokens, args.width, args.factor, gen)
        with torch.no_grad():
            target = teacher(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = relative_loss(model(x), target, keep)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, model


def matmul_errors(teacher, model, kind: str, args) -> dict:
    """Rule 3: the first linear's forward and weight-gradient error over the ordinary part."""
    x, keep = batch(kind, args.tokens, args.width, args.factor, torch.Generator().manual_seed(3))
    with torch.no_grad():
        target = teacher(x)
    exact = copy.deepcopy(model).float()  # the same weights, every linear a float32 nn.Linear
    for layer in exact:
        if isinstance(layer, torch.nn.Linear):
            layer.__class__ = torch.nn.Linear
    out32 = exact[0](x)
    out32.retain_grad()
    relative_loss(exact[2](exact[1](out32)), target, keep).backward()
    gy = out32.grad
    layer = copy.deepcopy(model[0])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
    out.backward(gy.to(out.dtype))
    ordinary = torch.ones(args.width, dtype=torch.bool)
    ordinary[0] = False  # channel 0: the outlier in the channel case, zero weights in every case

    def error(a, b):
        return ((a.float() - b).norm() / b.norm()).item()

    return {
        "forward": error(out.detach()[keep], out32.detach()[keep]),
        "grad_weight": error(layer.weight.grad[:, ordinary], exact[0].weight.grad[:, ordinary]),
    }


def run(args) -> dict:
    """Every (kind, recipe) this CPU can run:
    losses, the mean of the last 10, each matmul's error."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    teacher = mlp(args.width, args.hidden)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        teacher[0].weight[:, 0] = 0  # rule 2
        start = copy.deepcopy(teacher)
        for p in start.parameters():
            p.mul_(1 + 0.3 * torch.randn(p.shape, generator=gen))
    results = {kind: {} for kind in KINDS}
    skipped = {}
    for recipe in RECIPES:
        why = recipe != "bf16" and fp8_cannot_run(recipe, torch.device("cpu"))
        if why:
            skipped[recipe] = why
            continue
        for kind in KINDS:
            losses, model = train(teacher, start, kind, recipe, args)
            results[kind][recipe] = {
                "losses": losses,
                "final": sum(losses[-10:]) / len(losses[-10:]),
                **matmul_errors(teacher, model, kind, args),
            }
    return {"results": results, "skipped": skipped, "config": vars(args) | {"plot": None}}


def table(report: dict) -> str:
    rows = [
        "| outliers | recipe | final loss (mean of last 10) | x bf16 | forward error | "
        "weight-gradient error |",
        "|---|---|---|---|---|---|",
    ]
    for kind, recipes in report["results"].items():
        base = recipes.get("bf16", {}).get("final")
        for recipe in ["bf16", "tensorwise", "rowwise"]:
            if recipe in recipes:
                r = recipes[recipe]
                ratio = f"{r['final'] / base:.1f}x" if base else "n/a"
                rows.append(
                    f"| {kind} | {recipe} | {r['final']:.2e} | {ratio} | {r['forward']:.1%} | "
                    f"{r['grad_weight']:.1%} |"
                )
    rows += [f"\n{recipe}: skipped, `{why}`" for recipe, why in report["skipped"].items()]
    return "\n".join(rows)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = report["results"]
    fig, axes = plt.subplots(1, len(kinds), figsize=(4.2 * len(kinds), 3.4), sharey=True)
    colours = {"bf16": "black", "tensorwise": "tab:red", "rowwise": "tab:blue"}
    for ax, (kind, recipes) in zip(axes, kinds.items()):
        for recipe in ["bf16", "tensorwise", "rowwise"]:
            if recipe in recipes:
                ax.plot(recipes[recipe]["losses"], label=recipe, color=colours[recipe], lw=1.2)
        ax.set_yscale("log")
        ax.set_title(f"outliers: {kind}")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("relative squared error (ordinary tokens)")
    axes[0].legend()
    c = report["config"]
    fig.suptitle(
        f"MLP {c['width']}-{c['hidden']}-{c['width']}, {c['tokens']} tokens a step, "
        f"outlier x{c['factor']:g}"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--factor", type=float, default=1e5, help="the outliers' magnitude")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=256, help="tokens a step (a multiple of 64)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--plot", type=Path, help="the loss curves, one panel per kind of outlier")
    args = parser.parse_args()
    if args.tokens % EVERY or args.width % 16 or args.hidden % 16 or args.steps < 10:
        raise UserError(
            f"--tokens must be a multiple of {EVERY}, --width and --hidden of 16, "
            "--steps at least 10"
        )
    report = run(args)
    print(table(report))
    if args.plot:
        plot(report, args.plot)
        print(f"plot: {args.plot}")
    # the numbers without the curves
    brief = {
        kind: {
            recipe: {k: v for k, v in r.items() if k != "losses"} for recipe, r in recipes.items()
        }
        for kind, recipes in report["results"].items()
    }
    print(json.dumps({**report, "results": brief}))


if __name__ == "__main__":
    exit_on_user_error(main)
