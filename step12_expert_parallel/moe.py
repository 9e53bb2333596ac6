"""A mixture of experts in place of a block's MLP: a router sends each token to k of E GPT-2 MLPs.

    tokens (N, h) -> router logits (N, E) -> softmax -> top-k experts and weights per token
                  -> permute: the kept (token, choice) slots sorted by expert -> each expert's MLP
                  on its slots -> unpermute -> each token's output = sum over its k choices of
                  weight * expert output

1. **Router**: one ``nn.Linear(h, E, bias=False)``; probabilities ``softmax(logits)`` in float32
   (also under autocast), the k largest per token chosen (``torch.topk``).
2. **Weights**: k > 1: the k chosen probabilities renormalised to sum to 1 (Mixtral; HF's
   ``MixtralTopKRouter``). k = 1: the probability itself, not renormalised (Switch Transformer, eq.
   2): renormalised it would be 1 and the router would get no gradient from the language-model loss.
3. **Capacity** (``--moe-capacity-factor c``): 0 is dropless; else each expert takes at most
   ``C = ceil(k * T * c / E)`` of a micro-batch's T tokens' k*T slots: the Switch Transformer's
   expert capacity (Fedus et al. 2021, arXiv:2101.03961, eq. 3: tokens per batch / experts *
   capacity factor) counted in slots for k > 1, per micro-batch as GShard's per-group capacity
   (Lepikhin et al. 2020, arXiv:2006.16668, sec. 2.2: 2N/E for top-2 over a group's N tokens; c = 1,
   k = 2 gives it). Slots are served in order of position, token by token and, within a token,
   choice by choice (Megatron-LM's ``--moe-token-drop-policy position``); an expert's slots past C
   are dropped: that choice adds nothing, and a token all of whose choices were dropped passes
   through the block on the residual alone.
4. **Load-balancing loss** (``--moe-aux-loss-coef a``),
   per MoE layer and per micro-batch, added to the loss:
   ``a * E * sum_i f_i * P_i``, f_i the fraction of the k*T routed slots that chose expert i (before
   dropping), P_i the mean router probability of expert i over the T tokens: Switch Transformer
   (Fedus et al. 2021) eq. 4 (the loss, a * N * sum_i f_i * P_i), eq. 5 (f_i) and eq. 6 (P_i), for
   k = 1; DeepSeek-V2's expert-level balance loss for k > 1 (1 at perfect balance for every k). HF's
   ``load_balancing_loss_func`` divides the counts by T, not k*T: its value is k times this one
   (tested). A sequence split over ranks (step 10's ``--cp``): ``whole_sequence(counts, T)`` adds
   the other ranks' counts and tokens, so f_i is the whole micro-batch's; P_i stays the mean over
   this rank's tokens, so the ranks' losses average to one process's, as their language-model
   losses do.
5. **Experts** are the GPT-2 MLP (model.py's ``MLP``). Each computes its slots of one micro-batch as
   one product; ``dispatch`` is where step 12 sends the slots to the rank that owns the expert
   and back.

Parameter names, for an MoE block ``i`` (``--moe-every N``: blocks 0, N, 2N, ... as Megatron-LM's
``--moe-layer-freq``): ``transformer.h.i.mlp.router.weight`` (E, h),
``transformer.h.i.mlp.experts.e.c_fc.{weight, bias}`` and ``.c_proj.{weight,bias}`` for e in 0..E-1;
every one set by model.py's ``initial_value`` from (seed, name): the router and c_fc N(0, 0.02),
c_proj N(0, 0.02 / sqrt(2 n_layer)), biases 0. ``experts`` is an ``nn.ModuleDict`` keyed by the
expert's number, so a rank that holds some experts keeps their names. The flags, GPT-2 wired in and
the loop's two hooks (the loss, the record): moe_setup.py.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from model import MLP


@dataclass
class Routing:
    """Where one micro-batch's N tokens go: ``probs`` (N, E) float32, ``weights`` (N, k) and
    ``experts`` (N, k) for each token's choices, ``kept`` (N, k) bool (False: dropped by capacity),
    ``aux_loss`` (unscaled)."""

    probs: torch.Tensor
    weights: torch.Tensor
    experts: torch.Tensor
    kept: torch.Tensor
    aux_loss: torch.Tensor


def capacity(n_tokens: int, n_experts: int, top_k: int, capacity_factor: float) -> int | None:
    """Slots an expert takes from one micro-batch:
    ceil(k * T * c / E), None when dropless (c = 0)."""
    return (
        math.ceil(top_k * n_tokens * capacity_factor / n_experts) if capacity_factor > 0 else None
    )


def route(
    logits: torch.Tensor, top_k: int, capacity_factor: float = 0.0, whole_sequence=None
) -> Routing:
    """Rules 1-4 on the router's ``logits`` (N, E); ``whole_sequence``: rule 4's, or None."""
    n_tokens, n_experts = logits.shape
    probs = F.softmax(logits.float(), dim=-1)
    weights, experts = probs.topk(top_k, dim=-1)
    if top_k > 1:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    with torch.no_grad():
        chosen = F.one_hot(experts.flatten(), n_experts)  # (N*k, E), slots in order of position
        limit = capacity(n_tokens, n_experts, top_k, capacity_factor)
        if limit is None:
            kept = torch.ones_like(experts, dtype=torch.bool)
        # a slot's place in its expert's queue: how many slots before it chose the same expert
        else:
            place = ((chosen.cumsum(0) - 1) * chosen).sum(-1)
            kept = (place < limit).view_as(experts)
        counts, total = chosen.sum(0), n_tokens
        if whole_sequence is not None:  # the other ranks' tokens of the same sequences
            counts, total = whole_sequence(counts, n_tokens)
        fraction = counts.float() / (total * top_k)  # f_i, before dropping
    aux_loss = n_experts * (fraction * probs.mean(0)).sum()
    return Routing(probs, weights, experts, kept, aux_loss)


def permute(routing: Routing, n_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept slots (indices into the N*k flattened choices) sorted by expert, in order of
    position within an expert, and each expert's count (E,): expert e's slots are the e-th chunk."""
    # dropped: past the last
    experts = routing.experts.flatten().masked_fill(~routing.kept.flatten(), n_experts)
    order = torch.sort(experts, stable=True).indices
    counts = torch.bincount(experts, minlength=n_experts + 1)[:n_experts]
    return order[: int(counts.sum())], counts


def local_experts(
    tokens: torch.Tensor, counts: torch.Tensor, experts: nn.ModuleDict
) -> torch.Tensor:
    """Rule 5 in one process:
    expert e's MLP on the e-th chunk of ``tokens`` (sorted by expert), one product each."""
    chunks = tokens.split(counts.tolist())
    return torch.cat([experts[str(e)](chunk) for e, chunk in enumerate(chunks)])


def combine(
    outputs: torch.Tensor, order: torch.Tensor, routing: Routing, dtype: torch.dtype
) -> torch.Tensor:
    """Unpermute the experts' ``outputs`` into the N*k slots (0 where dropped), then each token's
    sum over its choices, in choice order, of weight * output."""
    n_tokens, top_k = routing.experts.shape
    slots = outputs.new_zeros(n_tokens * top_k, outputs.shape[-1]).index_copy(0, order, outputs)
    slots = slots.view(n_tokens, top_k, -1)
    mixed = routing.weights[:, 0, None] * slots[:, 0]
    for j in range(1, top_k):
        mixed = mixed + routing.weights[:, j, None] * slots[:, j]
    return mixed.to(dtype)


class MoE(nn.Module):
    """E GPT-2 MLPs behind a router, with model.py's ``MLP`` interface: ``(B, T, h) -> (B, T, h)``.

    After each forward: ``aux_loss`` (this micro-batch's, unscaled; in the graph) and ``totals``
    (the counts since ``take_moe_record``). ``dispatch(tokens, counts, experts)`` computes the
    sorted slots' outputs:
    ``local_experts`` here; step 12 puts its all-to-all dispatcher in its place. ``whole_sequence``:
    rule 4's (step 10 sets it under ``--cp``)."""

    def __init__(self, cfg, n_experts: int, top_k: int, capacity_factor: float = 0.0):
        super().__init__()
        self.router = nn.Linear(cfg.n_embd, n_experts, bias=False)
        self.experts = nn.ModuleDict({str(e): MLP(cfg) for e in range(n_experts)})
        self.n_experts, self.top_k, self.capacity_factor = n_experts, top_k, capacity_factor
        self.dispatch, self.whole_sequence = local_experts, None
        self.aux_loss = None
        self.totals = {
            "tokens_per_expert": torch.zeros(n_experts, dtype=torch.long, device="cpu"),
            "dropped": 0,
            "slots": 0,
            "aux_loss": 0.0,
            "micro_batches": 0,
        }

    def forward(self, x):
        tokens = x.reshape(-1, x.shape[-1])
        routing = route(self.router(tokens), self.top_k, self.capacity_factor, self.whole_sequence)
        order, counts = permute(routing, self.n_experts)
        outputs = self.dispatch(tokens[order // self.top_k], counts, self.experts)
        self.aux_loss = routing.aux_loss
        self._count(routing, counts)
        return combine(outputs, order, routing, x.dtype).view_as(x)

    def _count(self, routing: Routing, counts: torch.Tensor) -> None:
        totals = self.totals
        totals["tokens_per_expert"] += counts.cpu()
        totals["dropped"] += int((~routing.kept).sum())
        totals["slots"] += routing.kept.numel()
        totals["aux_loss"] += float(routing.aux_loss.detach())
        totals["micro_batches"] += 1
