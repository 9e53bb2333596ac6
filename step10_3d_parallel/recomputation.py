"""Activation recomputation: keep less for backward and compute it again there.
``--activation-checkpointing`` full recomputes each block from its input; selective (Korthikanti et
al. 2022, "Reducing Activation Recomputation in Large Transformer Models", section 5) only
attention's core, softmax(q kᵀ / √d, causal) v, the part whose saved tensors grow with s² and whose
FLOPs are few. Steps 7 and 10 (tensor and pipeline parallel) take the flag.

Rules:
1. Selective recomputes ``CausalSelfAttention.core(q, k, v)`` (model.py): no weights, so ZeRO-3's
   gathers and hooks (zero3.py) never see it, and no collective, so a tensor-parallel rank
   recomputes its own heads alone. Full recomputes ``block.forward``: under tensor parallelism the
   block's all-reduces (or sequence parallelism's all-gathers) run again in backward, on every rank
   of the tp group in the same order.
2. ``torch.utils.checkpoint(use_reentrant=False, preserve_rng_state=True)``, both modes: the forward
   runs the same ops in the same order as without recomputation (the same dropout draws from the
   same generator); the recomputation in backward restores the RNG state the forward found, so
   dropout draws the same masks twice, and forks it, so nothing after it sees a draw more. Losses,
   gradients and weights are bitwise those of no recomputation (tests/test_selective_recompute.py),
   in step 10 under its schedules too. Not full under zero bubble: its W runs a backward call per
   layer, and checkpoint recomputes the block for each call (refused there).
3. Kept per block instead of the s x s tensors: q, k and v, which the math path keeps anyway (the
   two matmuls' inputs). Bytes a block leaves for backward, float32, micro-batch b x s, width h, a
   heads, CPU (a dropout mask is a float32 tensor here), counted with saved_tensors_hooks on real
   tensors (the test):
       none       64 sbh + 16 sb + 4 a b s² + s²  (dropout: 72 sbh + 16 sb + 12 a b s² + s²)
       selective  64 sbh + 16 sb                 (dropout: 72 sbh + 16 sb)
       full        4 sbh                         (the block's input; the rest alive again while
                                                 it recomputes)
   16 sb: the two LayerNorms' float32 mean and 1/std; s²: the bool causal mask; 4 a b s²: softmax's
   output, with dropout also its float32 mask and output. Korthikanti et al.'s sbh (34 + 5as/h) and
   34 sbh are the same terms with 2-byte activations and 1-byte masks, less the statistics and the
   causal mask. A tp rank holds a/t heads, so its a b s² terms are 1/t of these (the causal mask
   stays whole); with sequence parallelism its LayerNorms' and dropouts' terms are too
   (docs/zero3.md has a tp rank's closed forms).
4. Recomputed FLOPs per block and micro-batch: the two matmuls, 4 b s² h (2 b s² h each; softmax,
   mask and dropout are O(a b s²) element-wise), against full recomputation's whole block forward,
   24 b s h² + 4 b s² h.
5. One mode a run (none, full, selective): full recomputes the core already, within its block. With
   sdpa the core is one fused kernel that keeps no s x s tensor, so selective saves little there
   (its log-sum-exp). The mode may change when a run resumes (resharding.py's RESUMABLE_KEYS): it
   changes what is kept, never what is computed.
"""

import functools

import torch.utils.checkpoint

MODES = ("none", "full", "selective")


def mode_of(value) -> str:
    """The mode from a config: the flag's string, or a bool (True:
    full) from configs written before it had one."""
    return {True: "full", False: "none"}.get(value, value) if isinstance(value, bool) else value


def add_recomputation_flag(flags) -> None:
    flags.add_argument(
        "--activation-checkpointing",
        nargs="?",
        const="full",
        default="none",
        choices=MODES,
        help="recompute activations in backward instead of keeping them: full (the bare flag), "
        "each block's; selective (recomputation.py), only attention's s x s core",
    )


def recompute(blocks, mode) -> None:
    """``blocks`` recomputed in backward as ``mode`` says (rules 1-2):
    their forwards, or their attention cores."""
    checkpointed = functools.partial(
        torch.utils.checkpoint.checkpoint, use_reentrant=False, preserve_rng_state=True
    )
    mode = mode_of(mode)
    for block in blocks:
        # a module's hooks run around it once; the recomputation calls the inner forward
        if mode == "full":
            block.forward = functools.partial(checkpointed, block.forward)
        elif mode == "selective":
            block.attn.core = functools.partial(checkpointed, block.attn.core)


def recomputed_flops(
    mode: str, micro_batch_size: int, seq_len: int, n_embd: int, n_layer: int
) -> int:
    """FLOPs one micro-batch's backward spends recomputing forward (rule 4):
    the matmuls' 2 flops a multiply-add."""
    b, s, h = micro_batch_size, seq_len, n_embd
    attention = 4 * b * s * s * h
    return (
        n_layer * {"none": 0, "selective": attention, "full": 24 * b * s * h * h + attention}[mode]
    )
