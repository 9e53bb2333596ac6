"""GPT-2 with mixture-of-experts MLPs, for Hugging Face ``transformers``:
the model of an exported MoE run.

``transformers`` has no GPT-2 with experts (its MoE models, Mixtral, Qwen-MoE, OLMoE, ..., use
rotary positions, RMSNorm and gated experts), so compare/export_hf.py copies this file into the
folder it writes and names it in ``config.json``'s ``auto_map``; ``from_pretrained(folder,
trust_remote_code=True)`` runs it. It imports only ``torch`` and ``transformers``, and repeats
common/moe.py's rules instead of importing them: the folder stands alone, and
tests/test_export_hf.py checks the two implementations against each other.

Everything is ``GPT2LMHeadModel`` but the MLP of blocks 0, N, 2N, ... (``moe_every`` N), which is a
router and ``moe_experts`` E of their own ``GPT2MLP``:

1. Router: ``nn.Linear(h, E, bias=False)``; ``softmax``
   of its logits in float32; the ``moe_top_k`` k largest.
2. Weights: for k > 1 the k probabilities renormalised to
   sum to 1 (Mixtral); for k = 1 the probability (Switch).
3. Capacity (``moe_capacity_factor`` c > 0): of one forward's N tokens, each expert takes at most
   ``ceil(k * N * c / E)`` slots, served token by token and, within a token, choice by choice; a
   dropped choice adds nothing. So with c > 0 a token's output depends on the tokens beside it in
   the forward, as in training: generating with the KV cache forwards one new token at a time, and
   one token is never dropped.
4. Output: each token's sum over its kept choices of weight * expert output.

The load-balancing loss is not added to this model's loss: fine-tuning it here trains without it.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.models.gpt2.modeling_gpt2 import GPT2MLP


class GPT2MoEConfig(GPT2Config):
    model_type = "gpt2_moe"
    moe_experts: int = 4
    moe_top_k: int = 2
    moe_every: int = 1
    moe_capacity_factor: float | int = 0.0


class GPT2MoESparseBlock(nn.Module):
    """Rules 1-4, in place of a block's ``GPT2MLP``: ``(B, T, h) -> (B, T, h)``."""

    def __init__(self, config: GPT2MoEConfig):
        super().__init__()
        h = config.n_embd
        inner = config.n_inner if config.n_inner is not None else 4 * h
        self.router = nn.Linear(h, config.moe_experts, bias=False)
        self.experts = nn.ModuleList(GPT2MLP(inner, config) for _ in range(config.moe_experts))
        self.top_k, self.capacity_factor = config.moe_top_k, config.moe_capacity_factor

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        n_tokens, n_experts, k = x.shape[0], len(self.experts), self.top_k
        probs = F.softmax(self.router(x).float(), dim=-1)
        weights, chosen = probs.topk(k, dim=-1)  # (N, k) each
        if k > 1:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        kept = torch.ones_like(chosen, dtype=torch.bool)
        if self.capacity_factor > 0:
            limit = math.ceil(k * n_tokens * self.capacity_factor / n_experts)
            for e in range(n_experts):
                # expert e's slots, token by token, choice by choice: the first `limit` are served
                slots = (chosen.flatten() == e).nonzero().flatten()
                kept.view(-1)[slots[limit:]] = False
        outputs = x.new_zeros(n_tokens, k, x.shape[-1])
        for e, expert in enumerate(self.experts):
            token, choice = ((chosen == e) & kept).nonzero(as_tuple=True)
            if token.numel():
                outputs[token, choice] = expert(x[token])
        mixed = (weights.unsqueeze(-1) * outputs).sum(dim=1)
        return mixed.to(hidden_states.dtype).view_as(hidden_states)


class GPT2MoELMHeadModel(GPT2LMHeadModel):
    config_class = GPT2MoEConfig

    def __init__(self, config: GPT2MoEConfig):
        super().__init__(config)
        for i in range(0, config.n_layer, config.moe_every):
            self.transformer.h[i].mlp = GPT2MoESparseBlock(config)
        self.post_init()
