"""Selective activation recomputation (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", section 5): ``--activation-checkpointing selective`` recomputes in backward only attention's
core, softmax(q kᵀ / √d, causal) v, the part whose saved tensors grow with s² and whose FLOPs are few.

Rules:
1. The unit recomputed is ``CausalSelfAttention.core(q, k, v)`` (model.py): no weights, so ZeRO-3's gathers and
   hooks (zero3.py) never see it, and it needs nothing from the FSDP unit but q, k and v, which it keeps.
2. ``torch.utils.checkpoint(use_reentrant=False, preserve_rng_state=True)``: the forward runs the same ops in the
   same order as without recomputation (the same dropout draws from the same generator); the recomputation in
   backward restores the RNG state the forward found, so attention dropout draws the same mask twice, and
   forks it, so nothing after it sees a draw more. Losses, gradients and weights are bitwise those of no
   recomputation (tests/test_selective_recompute.py).
3. Kept per block instead of the s x s tensors: q, k and v, which the math path keeps anyway (the two matmuls'
   inputs). Bytes a block leaves for backward, float32, micro-batch b x s, width h, a heads, CPU (a dropout mask
   is a float32 tensor here), counted with saved_tensors_hooks on real tensors (the test):
       none       64 sbh + 16 sb + 4 a b s² + s²      (dropout: 72 sbh + 16 sb + 12 a b s² + s²)
       selective  64 sbh + 16 sb                     (dropout: 72 sbh + 16 sb)
       full        4 sbh                             (the block's input; the rest alive again while it recomputes)
   16 sb: the two LayerNorms' float32 mean and 1/std; s²: the bool causal mask; 4 a b s²: softmax's output, with
   dropout also its float32 mask and output. Korthikanti et al.'s sbh (34 + 5as/h) and 34 sbh are the same terms
   with 2-byte activations and 1-byte masks, less the statistics and the causal mask.
4. Recomputed FLOPs per block and micro-batch: the two matmuls, 4 b s² h (2 b s² h each; softmax, mask and
   dropout are O(a b s²) element-wise), against full recomputation's whole block forward, 24 b s h² + 4 b s² h.
5. One mode a run (none, full, selective): full recomputes the core already, within its block. With sdpa the core
   is one fused kernel that keeps no s x s tensor, so selective saves little there (its log-sum-exp).
"""
import functools

import torch.utils.checkpoint

MODES = ("none", "full", "selective")


def mode_of(value) -> str:
    """The mode from a config: the flag's string, or a bool (True: full) from configs written before it had one."""
    return {True: "full", False: "none"}.get(value, value) if isinstance(value, bool) else value


def recompute_attention_core(blocks) -> None:
    """Each block's attention core checkpointed (rules 1-2): what it computes is recomputed in backward."""
    for block in blocks:
        attention = block.attn
        attention.core = functools.partial(torch.utils.checkpoint.checkpoint, attention.core,
                                           use_reentrant=False, preserve_rng_state=True)


def recomputed_flops(mode: str, micro_batch_size: int, seq_len: int, n_embd: int, n_layer: int) -> int:
    """FLOPs one micro-batch's backward spends recomputing forward (rule 4): the matmuls' 2 flops a multiply-add."""
    b, s, h = micro_batch_size, seq_len, n_embd
    attention = 4 * b * s * s * h
    return n_layer * {"none": 0, "selective": attention, "full": 24 * b * s * h * h + attention}[mode]
