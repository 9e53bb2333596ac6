"""Activation bytes by formula: Korthikanti et al. 2022's accounting ("Reducing Activation
Recomputation in Large Transformer Models", section 4), written out term by term and generalised to
the shapes real jobs train, so that the planner can size models it cannot count: flash attention
saves no s x s tensor on a GPU, but the meta device (where ``estimate.Model`` counts) runs the math
path in its place.

Per transformer layer and micro-batch of b sequences of s tokens (T = s b), hidden h, a heads of d,
kv key/value heads, MLP width f, t-way tensor parallelism; e bytes an activation (2 in 16 bits), m
bytes a dropout mask element (1 on a GPU: a bool), what autograd keeps for backward:

    whole on every tensor-parallel rank (1/t of each with sequence parallelism)
        the two LayerNorms' inputs          2 T h e      and their float32 statistics per token
        attention's and the MLP's inputs    2 T h e      (the LayerNorms' outputs)
        two dropout masks, with dropout     2 T h m      (after attention and after the MLP)
    split 1/t (whole heads, columns of the MLP)
        q; k and v                          T h e;  2 T kv d e
        c_proj's input (attention's output) T h e
        the MLP, GELU                       2 T f e      (c_fc's output, GELU's output)
                 SwiGLU                     3 T f e      (gate, up, their product; silu
                                                         recomputed, as fused)
        math attention                      a T s e      softmax's output; with dropout its
                                                         mask a T s m and output a T s e
                                                         (5 a s² b at e = 2, m = 1)
        flash attention (sdpa)              a T 4        the log-sum-exp (the output is
                                                         c_proj's input)

With e = 2, m = 1, f = 4h, kv = a and dropout on, that is the paper's equation (1) and Table 2, in
units of sbh: 34 + 5as/h per layer; with tensor parallelism 10 + 24/t + 5as/(ht); with sequence
parallelism (34 + 5as/h)/t; selective recomputation (the s² terms recomputed) 10 + 24/t or 34/t;
full recomputation keeps the layer's input, 2 (1/t of it with sequence parallelism, as Megatron-LM
keeps it). The LayerNorms' statistics (16 bytes a token) and the log-sum-exp are what the paper
leaves out: below 0.1% of a layer at its shapes (tests/test_plan.py).

Outside the layers (its section 4.3): the first stage keeps the embedding dropout's mask, T h m; the
last stage the final norm's input and output, 2 T h e, and the logits in float32 for the loss, 4 T V
/ t.

A mixture of experts' layer (common/moe.py; step 12 with ``expert_parallel.py``) in place of the MLP
and its dropout mask, E experts, top-k, on a rank holding T tokens that sends S kept slots (k T when
dropless) and whose experts compute R (in one process R = S; under expert parallelism k T on
average, when the router balances):

    router           4 T E + 4 E      the float32 probabilities; f_i, the aux loss's
    choices          8 T k + 4 T k    the k experts (int64) and the weights (float32); k > 1:
                                      the weights before renormalising, and their sums,
                                      4 T k + 4 T
    dispatch         8 S + 8 T k      the gathered slots' token indices; the sort's order
    experts' inputs  R h e            the slots that reach this rank's experts
    experts          2 R f e          GELU's (3 R f e SwiGLU), and the dropout mask R h m
    combine          S h e + T k h e  the outputs back home, then placed in the k T slots

Context parallelism over C ranks (step 11's ring) gives each rank T/C of the tokens and every term
above falls to 1/C: attention by the ring keeps what flash attention keeps (the log-sum-exp, the
output as c_proj's input), never a score matrix, whatever --attention says.
"""

# Korthikanti et al.'s Table 2, per layer in units of s
# b h (e = 2, dropout on, multi-head attention, f = 4h)
TABLE2 = {
    ("none", False): lambda a, s, h, t: 10 + 24 / t + 5 * a * s / (h * t),
    ("none", True): lambda a, s, h, t: (34 + 5 * a * s / h) / t,
    ("selective", False): lambda a, s, h, t: 10 + 24 / t,
    ("selective", True): lambda a, s, h, t: 34 / t,
    ("full", False): lambda a, s, h, t: 2,
}


def split(n: int, ways: int) -> int:
    """A rank's share of n bytes cut ``ways`` ways (rounded up)."""
    return -(-n // ways)


class FormulaActivations:
    """The planner's activations by formula, with the interface of ``plan.Activations`` (bytes one
    micro-batch leaves for backward on a rank; what one block's recomputation adds). ``selective``:
    attention's s x s part recomputed in backward (nothing to recompute with flash attention, which
    keeps none). ``cp``: a rank's share of every sequence under context parallelism, attention by
    the ring."""

    def __init__(
        self,
        shape,
        micro_batch_size: int,
        element: int = 2,
        attention: str = "math",
        dropout: float = 0.0,
        selective: bool = False,
        mask: int = 1,
        cp: int = 1,
    ):
        self.shape, self.b, self.e, self.m = shape, micro_batch_size, element, mask
        # the ring keeps what flash attention keeps
        self.attention = attention if cp == 1 else "ring"
        self.dropout, self.selective = dropout > 0, selective
        self.tokens = shape.seq_len * micro_batch_size // cp  # T on this rank
        # per norm: mean, 1/std; or 1/rms
        self.statistics = (8 if shape.norm == "layernorm" else 4) * self.tokens

    def terms(self, tp: int = 1, sequence_parallel: bool = False) -> dict:
        """One layer's saved bytes on a rank, by name."""
        shape, e, m, tokens = self.shape, self.e, self.m, self.tokens
        h, a, s = shape.n_embd, shape.n_head, shape.seq_len
        # what sequence parallelism splits over the group, else kept whole
        whole = tp if sequence_parallel else 1
        terms = {
            "norm inputs": split(2 * tokens * h * e, whole),
            "norm statistics": split(2 * self.statistics, whole),
            "attention and MLP inputs": split(2 * tokens * h * e, whole),
            "dropout masks": split(2 * tokens * h * m, whole) if self.dropout else 0,
            "q, k, v": split(tokens * (h + 2 * shape.kv_dim) * e, tp),
            "attention output": split(tokens * h * e, tp),
            "MLP": split((3 if shape.mlp == "swiglu" else 2) * tokens * shape.ffn_width * e, tp),
        }
        if self.attention == "math":  # softmax's output; with dropout, its mask and output too
            scores = a * tokens * s * (e + (m + e if self.dropout else 0))
            terms["scores"] = 0 if self.selective else split(scores, tp)
        else:
            terms["log-sum-exp"] = split(a * tokens * 4, tp)
        return terms

    def block_bytes(self, tp: int, sequence_parallel: bool = False) -> int:
        return sum(self.terms(tp, sequence_parallel).values())

    def moe_terms(self, experts: int, top_k: int, sent=None, received=None) -> dict:
        """One MoE block's saved bytes on a rank (no tensor parallelism), by name: the dense terms
        with the MLP's replaced by the MoE layer's. ``sent``: the kept slots of this rank's tokens;
        ``received``: the slots its experts compute; both k T by default (dropless, balanced)."""
        shape, e, m, tokens = self.shape, self.e, self.m, self.tokens
        h, f = shape.n_embd, shape.ffn_width
        slots = top_k * tokens
        sent = slots if sent is None else sent
        received = sent if received is None else received
        terms = self.terms()
        del terms["MLP"]
        if self.dropout:  # attention's mask stays; the MLP's is the experts' now
            terms["dropout masks"] = tokens * h * m + received * h * m
        renormalised = 4 * slots + 4 * tokens if top_k > 1 else 0
        terms |= {
            "router": 4 * tokens * experts + 4 * experts,
            "choices": 8 * slots + 4 * slots + renormalised,
            "dispatch": 8 * sent + 8 * slots,
            "experts' inputs": received * h * e,
            "experts": (3 if shape.mlp == "swiglu" else 2) * received * f * e,
            "combine": sent * h * e + slots * h * e,
        }
        return terms

    def moe_block_bytes(self, experts: int, top_k: int, sent=None, received=None) -> int:
        return sum(self.moe_terms(experts, top_k, sent, received).values())

    def kept_per_block(self, tp: int, sequence_parallel: bool) -> int:
        """A checkpointed layer keeps its input, the hidden states."""
        return split(self.tokens * self.shape.n_embd * self.e, tp if sequence_parallel else 1)

    def rest(self, tp: int, first: bool, last: bool, sequence_parallel: bool) -> int:
        """Outside the layers: the embedding dropout's mask on the first stage; on the last, the
        final norm's input, output and statistics, and the float32 logits (split by vocabulary)."""
        hidden, whole = self.tokens * self.shape.n_embd, tp if sequence_parallel else 1
        total = split(hidden * self.m, whole) if first and self.dropout else 0
        if last:
            total += split(2 * hidden * self.e + self.statistics, whole) + split(
                4 * self.tokens * self.shape.vocab, tp
            )
        return total

    def per_micro_batch(
        self,
        blocks: int,
        tp: int,
        first: bool,
        last: bool,
        checkpointing: bool,
        sequence_parallel: bool = False,
    ) -> int:
        sequence_parallel = sequence_parallel and tp > 1
        per_block = (
            self.kept_per_block(tp, sequence_parallel)
            if checkpointing
            else self.block_bytes(tp, sequence_parallel)
        )
        return blocks * per_block + self.rest(tp, first, last, sequence_parallel)

    def recomputed(
        self, blocks: int, tp: int, checkpointing: bool, sequence_parallel: bool = False
    ) -> int:
        """With full recomputation, one layer's activations
        while its backward runs (once per stage)."""
        return self.block_bytes(tp, sequence_parallel and tp > 1) if checkpointing and blocks else 0
