"""Step 12's sums at W ranks, written again in one process:
the reference step 12 at 4 ranks is bitwise against.

A plain loop over the MoE model step 0 trains (common/model.py + common/moe.py, its data, AdamW and
schedule), naming nothing of step 12. Each optimiser step runs its W micro-batches one at a time
(micro-batch i is what rank i holds with one sample a micro-batch), keeps each one's gradients g_i
apart, then adds them in an order:

- ``step0``: one after the other in float32, as step 0's ``.grad`` accumulates them: ((g_0 + g_1) +
  g_2) + g_3. The loss likewise. (This order must give step 0's bits: it checks the rest of
  the loop.)
- ``ep`` (``--ep D``), step 12 with ``--reduce-dtype float64``, micro-batch i on rank i:
  1. a dense gradient: the W terms added in float64, divided by W, rounded to float32 once. Exact
     for a few float32 terms, so whatever order gloo's all-reduce adds in, it gets these bits;
  2. expert e's gradient: the ranks of an expert-parallel group (D consecutive ranks) send their
     slots to e's rank, which computes one product per source. Autograd's engine runs the ready node
     created last first, so the last source's product reaches e's gradient first, and it adds them
     in float32: ((g_{D-1} + g_{D-2}) + ...) + g_0 for group 0. The W/D groups' sums (e's copies)
     are then added in float64, divided by W, rounded once;
  3. the loss: the W losses added in float64, divided by W, rounded to float32;
  4. the clipping norm as step 0 takes it (squares added in float64, the root in float32): a rank's
     share added first moves the float64 sum by ~1e-16 relative, below float32's rounding.

Writes OUT/<order>/metrics.json and model.safetensors, as a run does, and
OUT/<order>/first_step.json: how many elements of the first step's summed gradients (dense, experts)
and whether its loss differ from the ``step0`` order's on the same g_i.

    # RUN: a run whose config to train (W = its world size)
    python tests/ep_same_order.py RUN OUT ORDER...
"""

import json
import math
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "common"))
from safetensors.torch import save_file  # noqa: E402
from torch.utils.data import DistributedSampler  # noqa: E402

from data import MicroBatches, load_corpus  # noqa: E402
from model import build_model, language_model_loss  # noqa: E402
from moe_setup import moe_model, take_moe_record, with_aux_loss  # noqa: E402
from seeding import seed_everything  # noqa: E402
from training import make_optimizer, make_scheduler  # noqa: E402


def expert_of(name: str) -> int | None:
    return int(name.split(".experts.")[1].split(".")[0]) if ".experts." in name else None


def in_order_of_step0(terms: list) -> torch.Tensor:
    total = terms[0].clone()
    for t in terms[1:]:
        total += t
    return total


def exactly(terms: list, world: int) -> torch.Tensor:
    """Added in float64, divided by ``world``, rounded to float32 once."""
    total = terms[0].double()
    for t in terms[1:]:
        total += t.double()
    return (total / world).float()


def as_step12(name: str, terms: list, ep: int) -> torch.Tensor:
    world = len(terms)
    if expert_of(name) is None:
        return exactly(terms, world)
    groups = [terms[g : g + ep] for g in range(0, world, ep)]
    per_group = [in_order_of_step0(group[::-1]) for group in groups]  # the last source first
    return exactly(per_group, world)


def summed(order: str, grads: list, ep: int) -> dict:
    world = len(grads)
    if order == "step0":
        return {n: in_order_of_step0([g[n] for g in grads]) / world for n in grads[0]}
    return {n: as_step12(n, [g[n] for g in grads], ep) for n in grads[0]}


def loss_of(order: str, losses: list) -> float:
    if order == "step0":
        return (in_order_of_step0(losses) / len(losses)).item()
    return torch.tensor(sum(loss.double() for loss in losses).item() / len(losses)).float().item()


def exact_norm(tensors) -> float:
    """sqrt of the exact sum of squares, rounded once:
    each float32 square is exact in float64, fsum rounds once."""
    return math.sqrt(math.fsum(x for t in tensors for x in t.double().pow(2).flatten().tolist()))


def differences(order: str, grads: list, ep: int) -> dict:
    """The first step: which summed gradient elements this order changes from step 0's."""
    ours, step0 = summed(order, grads, ep), summed("step0", grads, ep)
    count = {"dense": [0, 0], "experts": [0, 0]}
    for n in ours:
        kind = count["dense" if expert_of(n) is None else "experts"]
        kind[0] += int((ours[n] != step0[n]).sum())
        kind[1] += ours[n].numel()
    return count


def train(config: dict, world: int, order: str, out: Path) -> None:
    assert config["grad_accum"] == 1 and config["micro_batch_size"] == 1, (
        "one micro-batch of one a rank"
    )
    ep = config.get("ep") or world
    seed_everything(config["seed"])
    corpus = load_corpus(config["data"], config["tokenizer"], config["seq_len"])
    sampler = DistributedSampler(
        range(len(corpus.blocks)), num_replicas=1, rank=0, shuffle=True, seed=config["seed"]
    )
    batches = MicroBatches(corpus.blocks, sampler, 1)
    model = moe_model(build_model(config, corpus.vocab_size, config["seed"]), config)
    params = dict(model.named_parameters())
    optimizer = make_optimizer(model.named_parameters(), config)
    scheduler = make_scheduler(optimizer, config)
    records, first = [], None
    for step in range(config["steps"]):
        lr = scheduler.get_last_lr()[0]
        grads, losses = [], []
        for _ in range(world):
            inputs, targets = batches.next()
            loss = language_model_loss(model, inputs, targets)
            with_aux_loss(model, loss, config).backward()
            grads.append({n: p.grad for n, p in params.items()})
            losses.append(loss.detach())
            for p in params.values():
                p.grad = None
        if first is None:
            first = {
                **differences(order, grads, ep),
                "loss": loss_of(order, losses) != loss_of("step0", losses),
            }
        for n, g in summed(order, grads, ep).items():
            params[n].grad = g
        squares = torch.zeros((), dtype=torch.float64)
        for p in params.values():  # tensor by tensor, in float64, as step 0 adds them
            squares = squares + p.grad.double().pow(2).sum()
        grad_norm = squares.sqrt().float()
        if config["grad_clip"] > 0:
            coefficient = torch.clamp(config["grad_clip"] / (grad_norm + 1e-6), max=1.0)
            for p in params.values():
                p.grad.mul_(coefficient)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        records.append(
            {
                "step": step + 1,
                "loss": loss_of(order, losses),
                "grad_norm": grad_norm.item(),
                "param_norm": exact_norm(params.values()),
                "lr": lr,
                **take_moe_record(model),
            }
        )
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.json").write_text(
        json.dumps({"config": {**config, "order": order}, "records": records})
    )
    (out / "first_step.json").write_text(json.dumps(first))
    save_file(
        {n: p.detach().contiguous() for n, p in params.items()}, str(out / "model.safetensors")
    )


def main() -> None:
    run, out, orders = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
    metrics = json.loads((run / "metrics.json").read_text())
    world = metrics["env"]["world_size"]
    for order in orders:
        train(metrics["config"], world, order, out / order)


if __name__ == "__main__":
    main()
