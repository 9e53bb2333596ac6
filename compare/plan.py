"""Before launching: which (dp, cp, tp, pp, ZeRO stage, activation checkpointing, sequence
parallelism) fit, what each rank holds, what each axis moves, and which to try first.

    # a 7.5B model on 8 nodes of 8 GPUs
    python compare/plan.py --devices 64 --memory-gb 80 --params 7.5e9 --seq-len 2048 \\
        --micro-batch-size 1 --global-batch 512 --param-dtype bf16
    python compare/plan.py --devices 4 --memory-gb 0.03   # the trainers' default model, 4 ranks
    # estimate beside what runs measured
    python compare/plan.py --measured runs/step1_torch_ddp runs/step8_tensor_parallel ...

The model is the trainers' GPT-2 (their flags: --n-layer, --n-embd, --n-head, --seq-len, the
vocabulary of --tokenizer or --vocab-size), or, with --params, a GPT shaped like GPT-3's family
(hidden h a multiple of 128, h/128 layers and heads), or a published one (--preset: GPT-2, GPT-3,
Korthikanti et al.'s, Llama 3, with grouped-query attention, SwiGLU, RMSNorm, untied embeddings:
``Shape``). GPT-2's Ψ per block is 12h² + 13h; the embeddings Vh + sh, the final norm 2h.

A rank of the mesh dp x tp x pp holds, of its pipeline stage's blocks (step 9's even split; the
first stage adds the embeddings, the last the final norm and, when pp > 1, a copy of the tied
embedding), 1/tp of every matrix and of the column-parallel biases and the vocabulary (step 8's
layout), the rest whole. Over the data axis its state is what ``estimate.state_bytes`` gives for the
ZeRO stage (0: DDP), float32 or 16-bit parameters (the ZeRO paper's 2 + 2 + 12; with --reduce-dtype
float32, FSDP2's gradients).

Activations per micro-batch are counted on the meta device (``estimate.Model``: what autograd saves,
exact for the trainers' model with math attention), or, with --preset, --params, --attention sdpa or
--selective-recompute, by Korthikanti et al.'s formula (``activation_formula.py``: as on a GPU);
tensor parallelism splits the ones inside its split layers (q, k, v, the attention scores, the MLP's
4h, the logits) and leaves the (b, s, h) ones whole. Checkpointing keeps each block's input
and recomputes one block at a time. Sequence parallelism (step 8's sequence_parallel.py, at tp > 1)
splits the LayerNorms'
activations too; context parallelism (step 11: cp ranks share each sequence, each a replica of the
model state, ZeRO over dp x cp) gives each rank 1/cp of every activation, by the formula with the
ring's attention. Both are kept only where the same layout with less of them does not fit (CP too
where the global batch is too small for dp x cp replicas); --sequence-parallel asks for SP at every
tp > 1. Micro-batches held at once: 1 without a pipeline (each backward frees its own), M with GPipe
on every stage, at most P - s on stage s with 1F1B (the first stage holds P).

Communication per optimiser step and rank, in bytes handed to collectives and point-to-point sends
(the report also gives what a rank sends on the wire with ring algorithms, ``on_the_wire``):
    DP   ZeRO-0 all-reduce G·ψ; ZeRO-1 all-reduce G·ψ + all-gather P·ψ; ZeRO-2 reduce-scatter G·ψ +
         all-gather P·ψ (M reduce-scatters with --reduce-every-micro-batch; else no_sync() holds a
         whole gradient until the step's one); ZeRO-3 reduce-scatter G·ψ + all-gathers
         M·(2ψ_blocks + ψ_rest)·P (each block forward and backward, the rest once per micro-batch):
         ψ the rank's TP/PP share, P and G the bytes of a parameter as computed (ZeRO-3 gathers
         16-bit units from a float32 shard) and of a gradient HSDP (--hsdp, step 7's --replicate R):
         ZeRO-3's, inside rows of S = dp·cp/R ranks, and an all-reduce of G·ψ/S across the R rows
    TP   per micro-batch 6 all-reduces of b·s·h per block (2 forward; 4 backward: q, k, v and the
         MLP's input), one for the embedding, one for the output layer's input: (6 L_stage + 2)
         b·s·h activations
    PP   per micro-batch b·s·h activations forward and b·s·h gradients back (one message each way),
         and the tied embedding's gradient (Vh/tp) from the last stage to the first
    CP   per micro-batch and block, to the next rank of the ring: cp - 1 K/V blocks forward (again
         with checkpointing) and backward, and cp float32 dK/dV buffers (step 11's records)
Mixture of experts (``--moe-experts E`` or ``--moe-preset``): step 12's layouts instead, one per ep
dividing E and the devices: a rank holds the dense part whole and E/ep experts of each MoE layer
(ZeRO-0) and one micro-batch's activations (activation_formula.py's MoE terms), and hands 8E +
4·k·T·h·bytes to all-to-alls per MoE layer and micro-batch of T tokens; each row's step time is
estimated (moe_step_time), not ranked (docs/planner.md). Each row again on step 10's mesh (``--dp N
--ep D``): the same, with ZeRO-1's AdamW state, the dense part's sharded over the N ranks and each
expert's over its N/D copies (experts_on_mesh.py).
Ranking: by an estimated step time (compute 6Ψ + 12 L s h per token, 8Ψ + 16 L s h for the blocks
with checkpointing, over --tflops,
stretched by the bubble (M + P - 1)/M; each axis's bytes over the link it crosses: --intra-gbs
inside a node, --inter-gbs across, ranks laid out tp innermost, then cp, then dp, then pp; with
--offload-optimizer, ZeRO-3 may keep AdamW's state on the host, its gradient shard out and float32
shard back over --host-gbs; nothing overlapped, so it errs slow), then by simplicity. The first row
is the one to try; each row says why it is there.
"""

import argparse
import dataclasses
import functools
import importlib
import itertools
import json
import math
import sys
from pathlib import Path

import torch

# config.py, as every step has it
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "common"))
import estimate  # noqa: E402
from activation_formula import FormulaActivations  # noqa: E402
from config import UserError, build_parser, exit_on_user_error, parse_config  # noqa: E402

GIB = 2**30
USED_FLAGS = {
    "n_layer",
    "n_embd",
    "n_head",
    "seq_len",
    "tokenizer",
    "micro_batch_size",
    "grad_accum",
    "param_dtype",
    "attention",
    "dropout",
}
SCHEDULES = ("1f1b", "gpipe", "interleaved-1f1b", "zero-bubble")
VIRTUAL_STAGES = 2  # the interleaved schedule's chunks per stage, as step 9's default
# GPT-3's table, and one more
HIDDEN_SIZES = (768, 1024, 1536, 2048, 2560, 4096, 5120, 6144, 8192, 12288, 16384)


@dataclasses.dataclass(frozen=True)
class Shape:
    """A decoder-only transformer by its shape: the trainers' GPT-2 by default (multi-head
    attention, a GELU MLP of 4h, LayerNorms, biases, learned positions, the output layer tied to the
    token embedding); Llama's kind with ``n_kv_head`` < ``n_head`` (grouped-query attention),
    ``mlp="swiglu"``, ``ffn``, ``norm="rmsnorm"``, ``bias=False``, ``positions=False`` (rotary: no
    table) and ``tied=False``."""

    n_layer: int
    n_embd: int
    n_head: int
    vocab: int
    seq_len: int
    n_kv_head: int = 0  # 0: n_head
    ffn: int = 0  # the MLP's width; 0: 4h
    mlp: str = "gelu"
    norm: str = "layernorm"
    bias: bool = True
    positions: bool = True
    tied: bool = True

    @classmethod
    def from_params(cls, psi: float, vocab: int, seq_len: int) -> "Shape":
        """A shape of GPT-3's table for about Ψ parameters: the hidden size nearest (32Ψ/3)^(1/3)
        (where h = 128 L), heads of 128, then as many layers as Ψ takes."""
        h = min(HIDDEN_SIZES, key=lambda h: abs(math.log(h / (32 * psi / 3) ** (1 / 3))))
        layers = max(1, round((psi - (vocab + seq_len + 2) * h) / (12 * h * h + 13 * h)))
        return cls(layers, h, max(1, h // 128), vocab, seq_len)

    @property
    def is_trainers(self) -> bool:
        """The trainers' GPT-2, which ``Activations`` can count on the meta device."""
        return (
            self.kv_dim,
            self.ffn_width,
            self.mlp,
            self.norm,
            self.bias,
            self.positions,
            self.tied,
        ) == (self.n_embd, 4 * self.n_embd, "gelu", "layernorm", True, True, True)

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def kv_dim(self) -> int:  # the width of k and of v
        return self.kv_heads * (self.n_embd // self.n_head)

    @property
    def ffn_width(self) -> int:
        return self.ffn or 4 * self.n_embd

    @property
    def block_split(self) -> int:
        """A block's elements tensor parallelism splits: c_q, c_k, c_v, attn.c_proj's weight, the
        MLP's matrices, and the column-parallel layers' biases."""
        h, f = self.n_embd, self.ffn_width
        matrices = 2 * h * h + 2 * h * self.kv_dim + (3 if self.mlp == "swiglu" else 2) * h * f
        return matrices + (
            h + 2 * self.kv_dim + (2 if self.mlp == "swiglu" else 1) * f if self.bias else 0
        )

    @property
    def norm_params(self) -> int:
        return (2 if self.norm == "layernorm" else 1) * self.n_embd

    @property
    # GPT-2: 12h² + 7h split, 6h whole (the LayerNorms, the row-parallel biases)
    def block(self) -> int:
        return self.block_split + 2 * self.norm_params + (2 * self.n_embd if self.bias else 0)

    @property
    def psi(self) -> int:
        embeddings = (
            1 if self.tied else 2
        ) * self.vocab * self.n_embd + self.positions * self.seq_len * self.n_embd
        return embeddings + self.n_layer * self.block + self.norm_params


# Published shapes: GPT-2 (Radford et al. 2019, Hugging Face's counts), GPT-3 (Brown et al. 2020,
# Table 2.1; 13B's h as released, 5120), Korthikanti et al. 2022's Table 3 (vocabulary 51,200),
# Llama 3 (Dubey et al. 2024, Table 3)
PRESETS = {
    "gpt2": Shape(12, 768, 12, 50257, 1024),
    "gpt2-medium": Shape(24, 1024, 16, 50257, 1024),
    "gpt2-large": Shape(36, 1280, 20, 50257, 1024),
    "gpt2-xl": Shape(48, 1600, 25, 50257, 1024),
    "gpt3-125m": Shape(12, 768, 12, 50257, 2048),
    "gpt3-350m": Shape(24, 1024, 16, 50257, 2048),
    "gpt3-760m": Shape(24, 1536, 16, 50257, 2048),
    "gpt3-1.3b": Shape(24, 2048, 24, 50257, 2048),
    "gpt3-2.7b": Shape(32, 2560, 32, 50257, 2048),
    "gpt3-6.7b": Shape(32, 4096, 32, 50257, 2048),
    "gpt3-13b": Shape(40, 5120, 40, 50257, 2048),
    "gpt3-175b": Shape(96, 12288, 96, 50257, 2048),
    "megatron-22b": Shape(48, 6144, 64, 51200, 2048),
    "megatron-175b": Shape(96, 12288, 96, 51200, 2048),
    "megatron-530b": Shape(105, 20480, 128, 51200, 2048),
    "megatron-1t": Shape(128, 25600, 160, 51200, 2048),
    **{
        f"llama3-{name}": Shape(
            layers,
            h,
            heads,
            128256,
            8192,
            n_kv_head=8,
            ffn=ffn,
            mlp="swiglu",
            norm="rmsnorm",
            bias=False,
            positions=False,
            tied=False,
        )
        for name, layers, h, heads, ffn in (
            ("8b", 32, 4096, 32, 14336),
            ("70b", 80, 8192, 64, 28672),
            ("405b", 126, 16384, 128, 53248),
        )
    },
}


# Mixture of experts (common/moe.py, step 12's expert parallelism): every ``every``-th block (0, N,
# 2N, ...) has E copies of its MLP behind a router (E x h, no bias); each token's k slots go to
# their experts' ranks.
@dataclasses.dataclass(frozen=True)
class MoE:
    experts: int
    top_k: int = 1
    every: int = 1


# Mixtral 8x7B (Jiang et al. 2024): 46.7B parameters, 12.9B active per token (top-2 of 8)
MOE_PRESETS = {
    "mixtral-8x7b": (
        Shape(
            32,
            4096,
            32,
            32000,
            32768,
            n_kv_head=8,
            ffn=14336,
            mlp="swiglu",
            norm="rmsnorm",
            bias=False,
            positions=False,
            tied=False,
        ),
        MoE(8, 2, 1),
    )
}


def moe_psi(shape: Shape, moe: MoE) -> dict:
    """Ψ of an MoE model: ``dense`` (everything but the experts, the routers included), ``experts``
    (all E of every MoE layer), ``active`` (what one token computes with: dense and k experts
    a layer)."""
    h, f = shape.n_embd, shape.ffn_width
    expert = (3 if shape.mlp == "swiglu" else 2) * h * f + (
        (2 if shape.mlp == "swiglu" else 1) * f + h if shape.bias else 0
    )
    layers = -(-shape.n_layer // moe.every)
    dense = shape.psi - layers * expert + layers * moe.experts * h
    return {
        "dense": dense,
        "experts": layers * moe.experts * expert,
        "active": dense + layers * moe.top_k * expert,
        "moe_layers": layers,
    }


def moe_rank_params(shape: Shape, moe: MoE, ep: int) -> int:
    """Elements a rank of step 12 holds: the dense part whole (data-parallel over every rank), E/ep
    experts of each MoE layer. Its gradients and AdamW state follow its parameters
    (``estimate.state_bytes`` at ZeRO-0)."""
    psi = moe_psi(shape, moe)
    return psi["dense"] + psi["experts"] // ep


def all_to_all_bytes(
    moe: MoE, tokens: int, h: int, ep: int, activation_bytes: int = 4, kept: float = 1.0
) -> dict:
    """Bytes per MoE layer and micro-batch of ``tokens`` a rank hands to all-to-alls in step 12
    (expert_parallel.py), on average over the ranks: the E counts (int64), then the kept slots' rows
    sent and as many received (over a group, what is sent is what arrives), forward (dispatch,
    combine) and backward (their gradients): 8E + 4 x k·T·kept x h x bytes. ``on_the_wire``: the
    token rows that leave the rank, (ep - 1)/ep of them when the router balances."""
    rows = moe.top_k * tokens * kept * h * activation_bytes
    return {
        "handed": 8 * moe.experts + 4 * rows,
        "on_the_wire": (8 * moe.experts + 4 * rows) * (ep - 1) / ep,
    }


def stage_blocks(n_layer: int, pp: int, stage: int) -> int:
    """Blocks on ``stage`` of ``pp``: step 9's split,
    as even as can be, the first stages taking one more."""
    base, extra = divmod(n_layer, pp)
    return base + (stage < extra)


def chunk_blocks(n_layer: int, pp: int, stage: int, chunks: int = 1) -> list[int]:
    """Blocks of each chunk a rank of pipeline ``stage`` holds: one chunk, step 9's split;
    interleaved, the chunks stage, stage + pp, ... of the model cut into pp x chunks."""
    return [stage_blocks(n_layer, pp * chunks, v * pp + stage) for v in range(chunks)]


def rank_params(shape: Shape, tp: int, pp: int, stage: int, chunks: int = 1) -> dict:
    """Elements a rank of pipeline ``stage`` holds: ``blocks`` (its blocks' share) and ``rest``
    (embeddings, final norm, the tied copy). Of a block ``Shape.block_split`` is split over tp
    (GPT-2: 12h² + 7h, c_q, c_k, c_v, attn.c_proj's weight, c_fc, mlp.c_proj's weight), the rest
    kept whole (GPT-2: 6h, the LayerNorms, the row-parallel biases); the vocabulary is split.
    ``chunks``: the interleaved schedule's per stage."""
    h = shape.n_embd
    blocks = sum(chunk_blocks(shape.n_layer, pp, stage, chunks)) * (
        -(-shape.block_split // tp) + shape.block - shape.block_split
    )
    vocab = -(-(shape.vocab * h) // tp)
    # token (split), positions (whole)
    first = vocab + shape.positions * shape.seq_len * h if stage == 0 else 0
    # the final norm; the output layer: its own matrix, or the tied copy on a last stage of its own
    last = shape.norm_params + (vocab if pp > 1 or not shape.tied else 0) if stage == pp - 1 else 0
    rest = first + last
    return {"blocks": blocks, "rest": rest}


def block_indices(n_layer: int, pp: int, stage: int, chunks: int = 1) -> list[int]:
    """The blocks, by number, a rank of pipeline ``stage`` holds (``chunk_blocks``'s): the model cut
    into pp x chunks stages by step 9's split, this rank's the stages stage, stage + pp, ..."""
    starts = list(
        itertools.accumulate(
            (stage_blocks(n_layer, pp * chunks, k) for k in range(pp * chunks)), initial=0
        )
    )
    return [
        b for v in range(chunks) for b in range(starts[v * pp + stage], starts[v * pp + stage + 1])
    ]


def moe_rank_params_on_mesh(
    shape: Shape, moe: MoE, tp: int, pp: int, stage: int, chunks: int, ep: int
) -> dict:
    """Elements a rank of step 10 with experts holds (experts_on_mesh.py; the trainers' GPT-2):
    ``dense``, ``rank_params``'s with each MoE block's tp share of the MLP (c_fc, c_proj's weight;
    its bias whole) replaced by the router (E x h, whole), and ``experts``, E/ep whole experts of
    each MoE block it holds."""
    held = rank_params(shape, tp, pp, stage, chunks)
    h, f = shape.n_embd, shape.ffn_width
    mlp_split = 2 * h * f + f
    moe_blocks = sum(b % moe.every == 0 for b in block_indices(shape.n_layer, pp, stage, chunks))
    mlp_share = -(-shape.block_split // tp) - -(-(shape.block_split - mlp_split) // tp) + h
    expert = 2 * h * f + f + h
    return {
        "dense": held["blocks"] + held["rest"] - moe_blocks * (mlp_share - moe.experts * h),
        "experts": moe_blocks * moe.experts // ep * expert,
    }


class Activations:
    """What autograd saves per micro-batch of b sequences, counted once on the meta device: per
    block and for the rest of the model, the part tensor parallelism splits and the part it keeps
    whole; with checkpointing, what a block keeps (its input)."""

    def __init__(self, shape: Shape, micro_batch_size: int, dtype=None, dropout: float = 0.0):
        config = {
            "n_layer": 1,
            "n_embd": shape.n_embd,
            "n_head": shape.n_head,
            "seq_len": shape.seq_len,
            "dropout": dropout,
            "weight_decay": 0.1,
        }
        model = estimate.Model(config, shape.vocab, dtype)
        shapes = {}
        saved, arguments = model.saved_tensors(micro_batch_size, shapes=shapes)
        h = shape.n_embd

        hidden = micro_batch_size * shape.seq_len * h
        # the activations' (the LayerNorms' statistics stay float32)
        element = (dtype or torch.float32).itemsize

        # (b, s, h) wide, a LayerNorm's per-token statistics, or the (s, s) causal mask
        def whole(dims) -> bool:
            return len(dims) > 0 and (
                (dims[-1] == h and math.prod(dims) == hidden)
                or dims[-1] == 1
                or tuple(dims) == (shape.seq_len, shape.seq_len)
            )

        def parts(storages: dict, in_block: bool) -> tuple[int, int, int]:
            kept = sum(n for k, n in storages.items() if whole(shapes[k]))
            # A block saves five (b, s, h) tensors: the LayerNorms' inputs and outputs, whole on
            # every rank, and the attention's output, the row-parallel c_proj's input, which holds
            # only the rank's heads.
            if in_block:
                kept -= hidden * element
            # Sequence parallelism (step 8's sequence_parallel.py) splits the LayerNorms' inputs
            # (two per block, the final one in
            # the rest) and their per-token statistics; their outputs, gathered whole for the
            # column-parallel layers and kept for their weights' gradients, stay whole (as in
            # PyTorch's plan).
            statistics = sum(
                n for k, n in storages.items() if len(shapes[k]) > 0 and shapes[k][-1] == 1
            )
            kept_sp = kept - statistics - (2 if in_block else 1) * hidden * element
            return kept, sum(storages.values()) - kept, kept_sp

        self.block, self.rest = parts(saved.get(0, {}), True), parts(saved.get(None, {}), False)
        # the hidden states (b, s, h); the mask is shared by every block
        block_input = max(arguments.values())
        self.kept_per_block = block_input

    def per_micro_batch(
        self,
        blocks: int,
        tp: int,
        first: bool,
        last: bool,
        checkpointing: bool,
        sequence_parallel: bool = False,
    ) -> int:
        """Bytes one micro-batch leaves for backward on a rank of a stage with ``blocks`` blocks
        (with checkpointing, the blocks' inputs: the block recomputed in backward is ``recomputed``;
        with ``sequence_parallel``, 1/tp of them, and of what sequence parallelism splits)."""
        # the rest (embedding lookup, final norm, logits,
        # loss): on the last stage, where nearly all of it is
        rest = self.split(self.rest, tp, sequence_parallel) if last else 0
        kept = -(-self.kept_per_block // tp) if sequence_parallel else self.kept_per_block
        return blocks * (kept if checkpointing else self.block_bytes(tp, sequence_parallel)) + rest

    @staticmethod
    def split(part: tuple, tp: int, sequence_parallel: bool) -> int:
        kept = part[2] if sequence_parallel and tp > 1 else part[0]
        return kept + -(-(part[0] + part[1] - kept) // tp)

    def block_bytes(self, tp: int, sequence_parallel: bool = False) -> int:
        return self.split(self.block, tp, sequence_parallel)

    def recomputed(
        self, blocks: int, tp: int, checkpointing: bool, sequence_parallel: bool = False
    ) -> int:
        """With checkpointing, what one block's recomputation holds while its backward runs: once
        per stage, whatever the micro-batches in flight (one backward, so one recomputation, runs at
        a time)."""
        return self.block_bytes(tp, sequence_parallel) if checkpointing and blocks else 0


def in_flight(
    schedule: str, pp: int, stage: int, micro_batches: int, chunks: int = VIRTUAL_STAGES
) -> int:
    """Micro-batches whose activations a stage holds at once: GPipe M, 1F1B at most P - s;
    interleaved, chunk micro-batches, its warm-up plus one, (V - 1) P + 2 (P - s - 1) + 1, at most M
    V; zero bubble min(P, M) (each held until its deferred W); no pipeline: 1."""
    if pp == 1:
        return 1
    if schedule == "zero-bubble":
        return min(pp, micro_batches)
    if schedule == "interleaved-1f1b":
        return min((chunks - 1) * pp + 2 * (pp - stage - 1) + 1, micro_batches * chunks)
    return micro_batches if schedule == "gpipe" else min(pp - stage, micro_batches)


def step9_pipeline(module: str = "pipeline_schedules"):
    """Step 9's pipeline_schedules.py: the schedules the planner counts with (their action lists,
    their bubble); or another of step 9's modules, ``module`` (pipeline_setup.py: its
    flags' rules)."""
    step9 = str(Path(__file__).resolve().parent.parent / "step9_pipeline_parallel")
    if step9 not in sys.path:
        sys.path.append(step9)  # after common/: the copies step 9 shares are common's own
    return importlib.import_module(module)


def interleaved_activations(
    activations,
    shape: Shape,
    tp: int,
    pp: int,
    stage: int,
    micro_batches: int,
    checkpointing: bool,
    sequence_parallel: bool,
    chunks: int = VIRTUAL_STAGES,
) -> int:
    """The most bytes a rank of the interleaved schedule holds for backward: its chunks' activations
    per micro-batch (the last chunk with the logits) added and taken away along step 9's own action
    list, at their peak."""
    schedule_actions = step9_pipeline().schedule_actions
    blocks = chunk_blocks(shape.n_layer, pp, stage, chunks)
    last = [v * pp + stage == pp * chunks - 1 for v in range(chunks)]
    per = [
        activations.per_micro_batch(b, tp, False, is_last, checkpointing, sequence_parallel)
        for b, is_last in zip(blocks, last)
    ]
    held = peak = 0
    for kind, _, v in schedule_actions("interleaved-1f1b", stage, pp, micro_batches, chunks):
        held += per[v] if kind == "F" else -per[v]
        peak = max(peak, held)
    return peak


@dataclasses.dataclass
class Hardware:
    devices: int
    memory: float  # bytes per device
    gpus_per_node: int = 8
    tflops: float = 300.0  # achieved, per device
    intra_gbs: float = 450.0  # GB/s a rank moves inside a node (NVLink)
    inter_gbs: float = 50.0  # across nodes (400 Gb/s InfiniBand per GPU)
    # between a device and its host (PCIe 4 x16), each way: ZeRO-Offload's moves
    host_gbs: float = 25.0


def moe_layouts(
    shape: Shape,
    moe: MoE,
    hardware: Hardware,
    micro_batch_size: int,
    micro_batches: int,
    param_dtype: str = "float32",
    activations: FormulaActivations | None = None,
) -> list[dict]:
    """Step 12's layouts on ``hardware.devices`` ranks: every ep that divides both E and the ranks.
    The dense part is data-parallel over every rank, each expert over the devices/ep ranks that hold
    it; ZeRO-0 (step 12 is built on naive DP). Per rank: parameters, model state, one micro-batch's
    activations (step 12 runs each micro-batch's backward before the next forward; ``activations``:
    by formula, math attention by default) and the all-to-all bytes of an optimiser step, dropless
    (``kept`` = 1: a capacity factor only sends less) and balanced (each rank's experts compute k x
    T slots, whatever ep). An ep group is ep consecutive ranks (expert_parallel.py): inside a node
    when ep divides the GPUs per node."""
    psi = moe_psi(shape, moe)
    rows, layers = [], psi["moe_layers"]
    per_step = layers * micro_batches
    activations = activations or FormulaActivations(
        shape, micro_batch_size, activation_bytes(param_dtype)
    )
    held_activations = (
        (shape.n_layer - layers) * activations.block_bytes(1)
        + layers * activations.moe_block_bytes(moe.experts, moe.top_k)
        + activations.rest(1, first=True, last=True, sequence_parallel=False)
    )
    for ep in divisors(math.gcd(moe.experts, hardware.devices)):
        held = moe_rank_params(shape, moe, ep)
        state = estimate.state_bytes(0, held, 1, param_dtype)
        total = sum(state.values()) + held_activations
        mesh = mesh_moe_state(psi["dense"], held - psi["dense"], hardware.devices, ep, param_dtype)
        layer = all_to_all_bytes(
            moe, micro_batch_size * shape.seq_len, shape.n_embd, ep, activation_bytes(param_dtype)
        )
        rows.append(
            {
                "ep": ep,
                "expert_replicas": hardware.devices // ep,
                "params": held,
                "state": state,
                "activations": held_activations,
                "total": total,
                "fits": total <= hardware.memory,
                "all_to_all_handed": layer["handed"] * per_step,
                "all_to_all_on_the_wire": layer["on_the_wire"] * per_step,
                "inside_a_node": hardware.gpus_per_node % ep == 0,
                "micro_batches": micro_batches,
                "mesh_state": mesh,
                "mesh_fits": sum(mesh.values()) + held_activations <= hardware.memory,
                # step 10 at --ep 1 runs every expert where its tokens are: no all-to-all
                "mesh_all_to_all_handed": layer["handed"] * per_step if ep > 1 else 0,
            }
        )
        rows[-1]["time"] = moe_step_time(
            shape, psi, hardware, micro_batch_size, rows[-1], state["grads"] / held
        )
    return rows


def mesh_moe_state(
    dense: int, experts: int, devices: int, ep: int, param_dtype: str, zero: int = 1
) -> dict:
    """Bytes per rank, by kind, of step 10's ``--dp N --ep D`` (experts_on_mesh.py's rule 5): ZeRO-1
    (or ``zero``, its --zero) over the N ranks for the ``dense`` elements, over an expert's N/D
    copies for the rank's ``experts``;
    ``zero`` 0: step 12's whole state."""
    parts = (
        estimate.state_bytes(zero, dense, devices, param_dtype),
        estimate.state_bytes(zero, experts, devices // ep, param_dtype),
    )
    return {kind: sum(part[kind] for part in parts) for kind in parts[0]}


def moe_step_time(
    shape: Shape, psi: dict, hardware: Hardware, micro_batch_size: int, row: dict, grad_bytes: float
) -> dict:
    """Seconds per optimiser step of a step-12 row, ``step_time``'s rough model: compute (6 x the
    active Ψ + 12 L s h a token) on this rank's tokens; the all-to-alls' bytes on the wire over the
    ep group's link; the dense gradients' all-reduce over every rank and each expert's over its
    copies (rings: 2(n - 1)/n), none overlapped. A group spans nodes when it has more ranks than a
    node (the copies of an expert are strided, ep apart, so they span nodes whenever the devices
    do). ``psi``: ``moe_psi``'s."""
    tokens = row["micro_batches"] * micro_batch_size * shape.seq_len
    flops = flops_per_token(shape, False, active=psi["active"]) * tokens
    compute = flops / (hardware.tflops * 1e12)
    spans = hardware.devices > hardware.gpus_per_node  # the world, and an expert's copies
    gbs = lambda inside: (hardware.intra_gbs if inside else hardware.inter_gbs) * 1e9  # noqa: E731
    dense = psi["dense"] * grad_bytes
    experts = (row["params"] - psi["dense"]) * grad_bytes
    comm = {
        "all_to_all": row["all_to_all_on_the_wire"] / gbs(row["inside_a_node"]),
        "dense all-reduce": on_the_wire({"all_reduce": dense}, hardware.devices) / gbs(not spans),
        "experts' all-reduce": on_the_wire({"all_reduce": experts}, row["expert_replicas"])
        / gbs(not spans),
    }
    return {"compute_s": compute, "comm_s": comm, "step_s": compute + sum(comm.values())}


def moe_report(
    shape: Shape,
    moe: MoE,
    hardware: Hardware,
    rows: list[dict],
    micro_batch_size: int,
    global_batch: int,
    param_dtype: str,
    accounting: str = "by formula (compare/activation_formula.py: math attention, dropout 0)",
) -> str:
    """The EP table: one line per ep degree,
    and each row's step 12 command (or why there is none)."""
    unit = (GIB, "GiB") if max(row["total"] for row in rows) >= 2 * GIB else (2**20, "MiB")
    psi = moe_psi(shape, moe)
    lines = [
        f"mixture of experts: E {moe.experts}, top-{moe.top_k}, every {moe.every} block(s) "
        f"({psi['moe_layers']} MoE layers); Ψ = {psi['dense'] + psi['experts']:,} "
        f"({psi['dense']:,} dense, "
        f"{psi['experts']:,} experts), {psi['active']:,} active per token; {param_dtype}, AdamW",
        f"{hardware.devices} devices of {hardware.memory / unit[0]:g} {unit[1]} "
        f"({hardware.gpus_per_node} per "
        f"node); micro-batch {micro_batch_size}, global batch {global_batch} sequences, "
        f"{rows[0]['micro_batches']} micro-batches a rank",
        "step 12: dp over every rank, ep splitting the experts; ZeRO-0; model state "
        "and one micro-batch's "
        f"activations {accounting}; all-to-all per rank and optimiser step; dropless, balanced",
        "step 10 (--dp N --ep D): the same layout on its mesh, AdamW's state sharded "
        "(ZeRO-1) over the N ranks "
        "for the dense part and over an expert's N/D copies for the experts",
        f"{'ep':>4}{'copies of an expert':>21}{'params a rank':>16}{f'state ({unit[1]})':>14}"
        f"{f'activations ({unit[1]})':>20}{'fits':>6}"
        f"{f'all-to-all handed ({unit[1]})':>25}{f'on the wire ({unit[1]})':>19}{'ep group':>16}"
        f"{'step (est.)':>13}{f'step 10: state ({unit[1]})':>25}{'fits':>6}",
    ]
    for row in rows:
        lines.append(
            f"{row['ep']:>4}{row['expert_replicas']:>21}{row['params']:>16,}"
            f"{sum(row['state'].values()) / unit[0]:>14,.1f}{row['activations'] / unit[0]:>20,.1f}"
            f"{'yes' if row['fits'] else 'no':>6}"
            f"{row['all_to_all_handed'] / unit[0]:>25,.1f}"
            f"{row['all_to_all_on_the_wire'] / unit[0]:>19,.1f}"
            f"{'inside a node' if row['inside_a_node'] else 'across nodes':>16}"
            f"{step_ms(row['time']['step_s'] * 1e3):>13}"
            f"{sum(row['mesh_state'].values()) / unit[0]:>25,.1f}"
            f"{'yes' if row['mesh_fits'] else 'no':>6}"
        )
    if rows[0]["no_command"]:
        lines.append(f"no command: {rows[0]['no_command']}")
    else:
        lines += [f"  ep {row['ep']}: {row['command']}" for row in rows if row["fits"]]
        lines += [
            f"  ep {row['ep']}, step 10: "
            f"{row['mesh_command'] or 'no command: ' + row['no_mesh_command']}"
            for row in rows
            if row["mesh_fits"]
        ]
    if not any(row["fits"] or row["mesh_fits"] for row in rows):
        lines.append(
            "no ep fits, in step 12 (ZeRO-0) nor on step 10's mesh (ZeRO-1 for the "
            "dense part and the "
            "experts); step 10's --zero 2 also shards their gradients (not in this "
            "table), ZeRO-3 with ep "
            "is not built"
        )
    return "\n".join(lines)


def activation_bytes(param_dtype: str) -> int:
    """Bytes of an activation element: float32's, or the 16-bit parameters' (2)."""
    return (estimate.PARAM_DTYPES[param_dtype] or torch.float32).itemsize


def configuration(
    shape: Shape,
    dp: int,
    tp: int,
    pp: int,
    zero: int,
    checkpointing: bool,
    micro_batch_size: int,
    micro_batches: int,
    activations: Activations,
    param_dtype: str = "float32",
    reduce_dtype: str | None = None,
    schedule: str = "1f1b",
    offload: bool = False,
    reduce_every_micro_batch: bool = False,
    sequence_parallel: bool = False,
    cp: int = 1,
    replicate: int = 1,
) -> dict:
    """Every rank's bytes and every axis's traffic for one configuration (``micro_batches``: per
    rank and step, the pipeline's M). Stages differ; the rank holding most decides whether it fits.
    ZeRO-2 and -3 over M > 1 micro-batches: as the trainers' ``no_sync()`` does, whole gradients
    accumulate until the step's one reduce-scatter (``accumulated``, beside the shard);
    ``reduce_every_micro_batch`` (step 6's flag): M reduce-scatters into the shard instead.
    ``offload`` (ZeRO-3 only, step 7's --offload-optimizer): the optimiser state leaves the device
    for the host (``host``), with a float32 copy of the shard where the shard is the master; the
    gradient shard goes out and the float32 shard comes back every step (``offloaded``, bytes each
    way). ``sequence_parallel`` (at tp > 1, step 8's sequence_parallel.py): what the
    LayerNorms save split 1/tp too; each activation all-reduce a reduce-scatter and an all-gather.
    ``cp`` (step 11): each sequence split over cp ranks, each a replica of the state, so ZeRO shards
    over dp x cp; ``activations`` must then be the ring's (``FormulaActivations(..., cp=cp)``); the
    ring passes K/V blocks to its neighbour.
    ``replicate`` (ZeRO-3 only, step 7's --replicate: HSDP): the dp x cp replicas are R rows of S =
    dp cp / R, the state sharded over a row's S, the gathers and the reduce-scatter in the row, the
    1/S gradient shard all-reduced across the R rows (``comm["replicate"]``)."""
    sequence_parallel = sequence_parallel and tp > 1
    chunks = VIRTUAL_STAGES if schedule == "interleaved-1f1b" and pp > 1 else 1
    (p_bytes, g_bytes, _), _ = estimate.bytes_per_parameter(zero, param_dtype, reduce_dtype)
    # also what ZeRO-3 gathers: 16-bit units from a float32 shard
    act_bytes = activation_bytes(param_dtype)
    # a rank's tokens of a micro-batch, b s h wide
    bsh = micro_batch_size * shape.seq_len * shape.n_embd // cp
    replicas = dp * cp  # ranks holding the same model state: ZeRO's group
    # HSDP: the ranks each unit is cut over (a row); without it, all the replicas
    shard = replicas // replicate
    stages = []
    for stage in range(pp):
        held = rank_params(shape, tp, pp, stage, chunks)
        psi = held["blocks"] + held["rest"]
        state = estimate.state_bytes(zero, psi, shard, param_dtype, reduce_dtype)
        blocks = sum(chunk_blocks(shape.n_layer, pp, stage, chunks))
        # step 7's units in flight, whole: the rest (kept through backward) and two blocks
        if zero == 3:
            state["gathered"] = act_bytes * (
                held["rest"] + held["blocks"] // max(blocks, 1) * min(blocks, 2)
            )
        reduce_scatters = 1
        if zero >= 2 and micro_batches > 1:
            if reduce_every_micro_batch:
                reduce_scatters = micro_batches
            else:
                state["accumulated"] = g_bytes * psi
        host = offloaded = 0
        if offload:
            host = state["optimizer_state"] + (state["params"] if p_bytes == 4 else 0)
            offloaded = state["grads"] + 4 * -(-psi // shard)
            state["optimizer_state"] = 0
        flight = in_flight(schedule, pp, stage, micro_batches, chunks)
        if chunks > 1:
            act = interleaved_activations(
                activations,
                shape,
                tp,
                pp,
                stage,
                micro_batches,
                checkpointing,
                sequence_parallel,
                chunks,
            )
        else:
            act = flight * activations.per_micro_batch(
                blocks, tp, stage == 0, stage == pp - 1, checkpointing, sequence_parallel
            )
        act += activations.recomputed(blocks, tp, checkpointing, sequence_parallel)
        comm = {}
        if replicas > 1:
            if zero == 3:
                gathers = micro_batches * (2 * held["blocks"] + held["rest"]) * act_bytes
                comm["dp"] = {
                    "all_gather": gathers,
                    "reduce_scatter": reduce_scatters * g_bytes * psi,
                }
                if replicate > 1:  # HSDP: this rank's gradient shard, across the rows
                    comm["replicate"] = {"all_reduce": reduce_scatters * g_bytes * -(-psi // shard)}
            else:
                comm["dp"] = {
                    "all_reduce" if zero < 2 else "reduce_scatter": reduce_scatters * g_bytes * psi,
                    **({"all_gather": p_bytes * psi} if zero else {}),
                }
        if tp > 1:
            reduced = micro_batches * (6 * blocks + 2) * bsh * act_bytes
            comm["tp"] = (
                {"all_gather": reduced, "reduce_scatter": reduced}
                if sequence_parallel
                else {"all_reduce": reduced}
            )
        if pp > 1:
            tied = -(-(shape.vocab * shape.n_embd) // tp) * 4 if shape.tied else 0
            # activations out, gradients back, per chunk
            hops = 2 * chunks - (stage == pp - 1) - (stage == 0)
            comm["pp"] = {
                "send": micro_batches * bsh * act_bytes * hops
                + (micro_batches * tied if stage == pp - 1 else tied if stage == 0 else 0)
            }
        # per block: C - 1 K/V blocks forward (again with
        # checkpointing) and backward, C float32 dK/dV
        if cp > 1:
            kv = 2 * micro_batch_size * shape.seq_len // cp * -(-shape.kv_dim // tp)
            passes = (cp - 1) * (3 if checkpointing else 2) * act_bytes + cp * 4
            comm["cp"] = {"send": micro_batches * blocks * kv * passes}
        stages.append(
            {
                "stage": stage,
                "psi": psi,
                **state,
                "activations": act,
                "in_flight": flight,
                "total": sum(state.values()) + act,
                "comm": comm,
                "host": host,
                "offloaded": offloaded,
            }
        )
    worst = max(stages, key=lambda s: s["total"])
    return {
        "dp": dp,
        "cp": cp,
        "tp": tp,
        "pp": pp,
        "zero": zero,
        "replicate": replicate,
        "checkpointing": checkpointing,
        "schedule": schedule,
        "selective": getattr(activations, "selective", False) and not checkpointing,
        "offload": offload,
        "sequence_parallel": sequence_parallel,
        "micro_batches": micro_batches,
        "stages": stages,
        "total": worst["total"],
        "worst_stage": worst["stage"],
        "bubble": step9_pipeline().ideal_bubble(schedule, pp, micro_batches, chunks),
    }


def flops_per_token(
    shape: Shape, checkpointing: bool, selective: bool = False, active: int | None = None
) -> float:
    """Forward and backward, 3 passes of 2 flops per weight and 4 s h a layer for attention's QKᵀ
    and AV: 6Ψ + 12 L s h, Narayanan et al. 2021's 72 L h² (1 + s / 6h + V / 12 L h). Checkpointing
    runs the blocks' forward once more (their 96 L h² (1 + s / 6h + V / 16 L h)): 2Ψ_blocks + 4 L s
    h; selective recomputation only attention's QKᵀ and AV: 4 L s h. ``active``: the Ψ a token
    computes with, if not the model's (an MoE's)."""
    blocks, attention = (
        shape.n_layer * shape.block,
        4 * shape.n_layer * shape.seq_len * shape.n_embd,
    )
    return (
        6 * (shape.psi if active is None else active)
        + 3 * attention
        + (2 * blocks + attention if checkpointing else attention if selective else 0)
    )


def step_time(config: dict, shape: Shape, hardware: Hardware, micro_batch_size: int) -> dict:
    """Seconds per optimiser step, a rough model: compute over the devices, stretched by the bubble,
    plus each axis's bytes over the link it crosses (a ring moves 2(n-1)/n of an all-reduce's
    bytes), none overlapped."""
    dp, cp, tp, pp, m = (
        config["dp"],
        config["cp"],
        config["tp"],
        config["pp"],
        config["micro_batches"],
    )
    tokens = dp * m * micro_batch_size * shape.seq_len  # a ring's cp ranks share each sequence
    flops = (
        flops_per_token(shape, config["checkpointing"], config.get("selective", False))
        * tokens
        / (dp * cp * tp * pp)
    )
    compute = flops / (hardware.tflops * 1e12) / (1 - config["bubble"])  # (V M + P - 1) / V M
    inside = lambda span: span <= hardware.gpus_per_node  # noqa: E731 (ranks a group spans, tp innermost, then cp)
    # HSDP: ZeRO's group is a row of S consecutive replicas
    shard = dp * cp // config.get("replicate", 1)
    links = {
        "tp": inside(tp),
        "cp": inside(tp * cp),
        "dp": inside(tp * shard),
        "pp": inside(tp * cp * dp * pp),
        "replicate": inside(tp * cp * dp),
    }
    sizes = group_sizes(config)
    comm = {}
    worst = max(config["stages"], key=lambda s: s["total"])
    # ZeRO-Offload: the gradient shard out, the float32 shard back, over the host link
    if worst["offloaded"]:
        comm["host"] = worst["offloaded"] / (hardware.host_gbs * 1e9)
    for axis, kinds in worst["comm"].items():
        link_gbs = hardware.intra_gbs if links[axis] else hardware.inter_gbs
        comm[axis] = on_the_wire(kinds, sizes[axis]) / (link_gbs * 1e9)
    return {
        "compute_s": compute,
        "comm_s": comm,
        "step_s": compute + sum(comm.values()),
        "links": links,
    }


def group_sizes(config: dict) -> dict:
    """The ranks of each axis's group (ZeRO's and the gradients' over dp x cp: a ring's ranks are
    replicas); a pipeline's and a ring's sends go to one neighbour at a time. HSDP (``replicate``):
    its rows and columns."""
    # HSDP: ZeRO's group is a row of dp cp / R, the gradient shard's a column
    replicate = config.get("replicate", 1)
    return {
        "dp": config["dp"] * config["cp"] // replicate,
        "tp": config["tp"],
        "pp": 2,
        "cp": 2,
        "replicate": replicate,
    }


def on_the_wire(kinds: dict, n: int) -> float:
    """Bytes a rank sends for ``kinds`` (bytes handed to each kind of collective, as the records
    count them) on a group of ``n`` ranks with ring algorithms: an all-reduce 2(n - 1)/n of its
    buffer (a reduce-scatter, then an all-gather), a reduce-scatter or an all-gather (n - 1)/n of
    the whole buffer, a point-to-point send all of it. So ZeRO-2's reduce-scatter + all-gather hands
    collectives twice DDP's all-reduce bytes, and sends the same."""
    return sum(
        b * (2 * (n - 1) / n if kind == "all_reduce" else 1 if kind == "send" else (n - 1) / n)
        for kind, b in kinds.items()
    )


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def plan(
    shape: Shape,
    hardware: Hardware,
    micro_batch_size: int,
    global_batch: int,
    param_dtype: str = "float32",
    reduce_dtype: str | None = None,
    schedule: str = "1f1b",
    offload: bool = False,
    reduce_every_micro_batch: bool = False,
    sequence_parallel: bool = False,
    activations=None,
    ring_activations=None,
    hsdp: bool = False,
) -> tuple[list[dict], list[dict]]:
    """(the configurations that fit, ranked; those that do not). Every dp x cp x tp x pp = --devices
    with tp dividing the heads (and the key/value heads), pp at most the layers, 2 cp dividing the
    sequence and global batch = dp x micro-batch x M. The interleaved schedule where it can run (M a
    multiple of pp, 2 chunks of a block or more per stage), 1F1B where it cannot. Sequence
    parallelism (``sequence_parallel``: always) and context parallelism are kept where they are
    needed: a layout with them fits only if the same layout without them (cp folded into dp) does
    not, or cannot run (the global batch too small for dp x cp replicas).
    ``activations``: by default counted on the meta device (the trainers' model);
    ``ring_activations(cp)``: by default the formula's, with the ring's attention. ``hsdp``: ZeRO-3
    also as HSDP, every R that leaves rows of 2 or more (step 7's --replicate R)."""
    activations = activations or Activations(
        shape, micro_batch_size, estimate.PARAM_DTYPES[param_dtype]
    )
    ring_activations = ring_activations or (
        lambda cp: FormulaActivations(shape, micro_batch_size, activation_bytes(param_dtype), cp=cp)
    )
    configs = []
    for tp in divisors(hardware.devices):
        if shape.n_head % tp or shape.kv_heads % tp:
            continue
        for pp in divisors(hardware.devices // tp):
            for cp in divisors(hardware.devices // (tp * pp)):
                dp = hardware.devices // (tp * pp * cp)
                if (
                    pp > shape.n_layer
                    or global_batch % (dp * micro_batch_size)
                    or shape.seq_len % (2 * cp)
                ):
                    continue
                m = global_batch // (dp * micro_batch_size)
                runs = schedule != "interleaved-1f1b" or (
                    m % pp == 0 and pp * VIRTUAL_STAGES <= shape.n_layer
                )
                held = activations if cp == 1 else ring_activations(cp)
                # HSDP: rows of 2 or more
                rows = [r for r in divisors(dp * cp) if r < dp * cp] if hsdp else [1]
                for zero, offloaded, checkpointing, sp, replicate in itertools.product(
                    range(4) if dp * cp > 1 else (0,),
                    (False, True) if offload else (False,),
                    (False, True),
                    (True,) if sequence_parallel else (False, True) if tp > 1 else (False,),
                    rows,
                ):
                    if (offloaded or replicate > 1) and zero != 3:
                        continue
                    c = configuration(
                        shape,
                        dp,
                        tp,
                        pp,
                        zero,
                        checkpointing,
                        micro_batch_size,
                        m,
                        held,
                        param_dtype,
                        reduce_dtype,
                        schedule if runs else "1f1b",
                        offloaded,
                        reduce_every_micro_batch,
                        sp,
                        cp,
                        replicate,
                    )
                    c["time"] = step_time(c, shape, hardware, micro_batch_size)
                    c["fits"] = c["total"] <= hardware.memory
                    configs.append(c)
    fitting = {layout_key(c) for c in configs if c["fits"]}
    fit = [c for c in configs if c["fits"] and not plainer(c, sequence_parallel) & fitting]
    rejected = [c for c in configs if not c["fits"]]
    simplicity = lambda c: (
        c["tp"] * c["pp"],
        c["pp"],
        c["cp"],
        c["sequence_parallel"],
        c["zero"],  # noqa: E731
        c["replicate"],
        c["offload"],
        c["checkpointing"],
    )
    # ties (3 digits): the simpler
    fit.sort(key=lambda c: (float(f"{c['time']['step_s']:.3g}"), simplicity(c)))
    rejected.sort(key=simplicity)
    return fit, rejected


def layout_key(c: dict) -> tuple:
    return (
        c["dp"],
        c["cp"],
        c["tp"],
        c["pp"],
        c["zero"],
        c["offload"],
        c["checkpointing"],
        c["sequence_parallel"],
        c.get("replicate", 1),
    )


def plainer(c: dict, sequence_parallel: bool = False) -> set:
    """The keys of the same layout with less of what only activations call for: context parallelism
    folded into dp, or sequence parallelism left out (unless ``sequence_parallel`` asks for it
    everywhere), or both."""
    sp = sequence_parallel and c["tp"] > 1
    folds = [{"dp": c["dp"] * c["cp"], "cp": 1}] if c["cp"] > 1 else []
    unsplits = [{"sequence_parallel": sp}] if c["sequence_parallel"] != sp else []
    changes = folds + unsplits + ([{**folds[0], **unsplits[0]}] if folds and unsplits else [])
    return {layout_key({**c, **change}) for change in changes}


def name(c: dict) -> str:
    cp = f"cp {c['cp']} x " if c["cp"] > 1 else ""
    hsdp = (
        f" (HSDP {c['replicate']} x {c['dp'] * c['cp'] // c['replicate']})"
        if c.get("replicate", 1) > 1
        else ""
    )
    return (
        f"dp {c['dp']} x {cp}tp {c['tp']} x pp {c['pp']}, {estimate.STAGES[c['zero']]}{hsdp}"
        f"{', offload' if c['offload'] else ''}{', checkpointing' if c['checkpointing'] else ''}"
        f"{', selective' if c.get('selective') else ''}"
        f"{', sequence-parallel' if c.get('sequence_parallel') else ''}"
    )


# ---- The command that trains a layout ------------------------------------------------------------

# pure dp, by ZeRO stage
ZERO_STEPS = ("step1_torch_ddp", "step5_zero1", "step6_zero2", "step7_zero3")
PARAM_DTYPE_STEPS = ("step5_zero1", "step6_zero2", "step7_zero3")  # the trainers with --param-dtype


def trainer(
    c: dict, param_dtype: str = "float32", reduce_every_micro_batch: bool = False
) -> tuple[str, list] | str:
    """(the step folder that trains layout ``c``, its
    layout flags), or one line saying why no trainer does.
    cp: step 11 (dp rings of cp ranks, each a replica, DDP over the rings), or step 10 (DDP, ZeRO-1,
    -2 or -3 over dp x cp, --zero 0|1|2|3, with tp and pp too; not with SP or selective
    recomputation); tp or pp: step 8 (tp alone), step 9 (pp alone), step 10 (dp x tp x pp, --zero
    over dp; tp or pp alone too where recomputation is asked: steps 8 and 9 have none); pure dp:
    step 1, 5, 6, 7 for ZeRO-0 to 3, step 7 with --replicate (HSDP), --offload-optimizer and
    --activation-checkpointing full|selective, which step 10 also takes at ZeRO 0-2 (step 10 at tp =
    pp = 1). ZeRO-3 with tp, pp or cp: step 10's --zero 3 (HSDP: its --replicate R; its
    --offload-optimizer), not with SP or zero bubble (step 10 refuses them). 16-bit parameters:
    steps 5-7 only."""
    dp, cp, tp, pp, zero, m = c["dp"], c["cp"], c["tp"], c["pp"], c["zero"], c["micro_batches"]
    recompute = "full" if c["checkpointing"] else "selective" if c.get("selective") else None
    axes = " x ".join(a for a in ("dp", "cp", "tp", "pp") if c[a] > 1)
    # step 10's --zero, said where it is not the default (ZeRO-1) and there is more than one replica
    zero_flag = ["--zero", zero] if zero != 1 and dp * cp > 1 else []
    if cp > 1 and zero == 0 and tp == pp == 1 and not recompute:
        step, flags = "step11_context_parallel", ["--cp", cp]
    elif zero == 3 and (tp > 1 or pp > 1 or cp > 1) and (why := mesh_zero3_problem(c)):
        return why
    elif cp > 1 and (c["sequence_parallel"] or c.get("selective")):
        return (
            "no trainer runs cp with "
            f"{'sequence parallelism' if c['sequence_parallel'] else 'selective recomputation'}"
            ": step 10 refuses it (composition.py's rule 5)"
        )
    elif tp > 1 or pp > 1 or cp > 1:
        pipeline = (
            [
                "--schedule",
                c["schedule"],
                *(
                    ["--virtual-stages", VIRTUAL_STAGES]
                    if c["schedule"] == "interleaved-1f1b"
                    else []
                ),
                "--micro-batches",
                m,
            ]
            if pp > 1
            else []
        )
        sp = ["--sequence-parallel"] if c["sequence_parallel"] else []
        if dp > 1 or cp > 1 or (tp > 1 and pp > 1) or recompute:
            step, flags = (
                "step10_3d_parallel",
                [
                    "--dp",
                    dp,
                    *(["--cp", cp] if cp > 1 else []),
                    "--tp",
                    tp,
                    "--pp",
                    pp,
                    *zero_flag,
                    *(["--replicate", c["replicate"]] if c.get("replicate", 1) > 1 else []),
                    *(["--offload-optimizer"] if c["offload"] else []),
                    *sp,
                    *pipeline,
                    *(["--activation-checkpointing", recompute] if recompute else []),
                ],
            )
        else:
            step, flags = (
                ("step8_tensor_parallel", sp) if tp > 1 else ("step9_pipeline_parallel", pipeline)
            )
    # step 10 at tp = pp = 1: ZeRO 0-2 over dp, with recomputation (steps 1, 5 and 6 have none)
    elif recompute and zero < 3:
        step, flags = (
            "step10_3d_parallel",
            [
                "--dp",
                dp,
                "--tp",
                1,
                "--pp",
                1,
                *zero_flag,
                "--activation-checkpointing",
                recompute,
            ],
        )
    else:
        step, flags = ZERO_STEPS[zero], []
        if zero == 2 and reduce_every_micro_batch:
            flags.append("--reduce-every-micro-batch")
        if zero == 3:
            if reduce_every_micro_batch and m > 1:
                return (
                    "no trainer runs ZeRO-3 reducing every micro-batch: step 7 has no "
                    "--reduce-every-micro-batch"
                )
            flags += [
                *(["--replicate", c["replicate"]] if c.get("replicate", 1) > 1 else []),
                *(["--offload-optimizer"] if c["offload"] else []),
                *(["--activation-checkpointing", recompute] if recompute else []),
            ]
    layout = estimate.STAGES[zero] if step in ZERO_STEPS else axes
    if step == "step10_3d_parallel" and zero >= 2 and reduce_every_micro_batch and m > 1:
        return (
            f"no trainer runs ZeRO-{zero} reducing every micro-batch with "
            f"{axes if tp > 1 or pp > 1 or cp > 1 else 'recomputation'}: step 10's --zero {zero} "
            "reduce-scatters once a step; step 6 alone has --reduce-every-micro-batch"
        )
    if recompute == "full" and pp > 1 and c["schedule"] == "zero-bubble":
        return (
            "no trainer runs checkpointing with zero bubble: step 10 refuses it (W would "
            "recompute every block again)"
        )
    if recompute and step not in ("step7_zero3", "step10_3d_parallel"):
        return (
            "no trainer runs "
            f"{'checkpointing' if c['checkpointing'] else 'selective recomputation'} "
            f"with {layout}: steps 7 (ZeRO-3) and 10 (ZeRO 0-3) alone have "
            "--activation-checkpointing"
        )
    if param_dtype != "float32" and step not in PARAM_DTYPE_STEPS:
        return (
            f"no trainer runs {param_dtype} parameters with {layout}: steps 5-7 alone have "
            "--param-dtype"
        )
    return step, flags


def mesh_zero3_problem(c: dict) -> str | None:
    """Why step 10's --zero 3 cannot train ZeRO-3 layout ``c`` with tp, pp or cp, or None."""
    if c["sequence_parallel"] or (c["pp"] > 1 and c["schedule"] == "zero-bubble"):
        return (
            "no trainer runs ZeRO-3 with "
            f"{'sequence parallelism' if c['sequence_parallel'] else 'zero bubble'}: "
            "step 10 refuses it (zero3_on_mesh.py's rule 6)"
        )
    return None


def command(
    c: dict,
    devices: int,
    model_flags: list,
    param_dtype: str = "float32",
    reduce_every_micro_batch: bool = False,
) -> tuple[str | None, str | None]:
    """(``torchrun --nproc-per-node N stepX/train.py
    FLAGS``, None) for layout ``c``, or (None, why not):
    ``trainer``'s step and layout flags after ``model_flags`` (the model's, the micro-batch's), the
    plan's M as --grad-accum (the global batch), --param-dtype where the step has it."""
    found = trainer(c, param_dtype, reduce_every_micro_batch)
    if isinstance(found, str):
        return None, found
    step, flags = found
    dtype = ["--param-dtype", param_dtype] if step in PARAM_DTYPE_STEPS else []
    words = [*model_flags, "--grad-accum", c["micro_batches"], *dtype, *flags]
    return f"torchrun --nproc-per-node {devices} {step}/train.py {' '.join(map(str, words))}", None


def justify(c: dict, fit: list[dict], rejected: list[dict], unit: tuple) -> str:
    """Why this configuration, in the rules' terms: DDP first; ZeRO-2 before ZeRO-3; TP inside a
    node; PP across nodes, paying the bubble; checkpointing only when activations do not fit."""
    reasons = []
    same = lambda r: all(r[k] == c[k] for k in ("dp", "cp", "tp", "pp", "sequence_parallel"))  # noqa: E731
    simpler = [
        r for r in rejected if same(r) and r["checkpointing"] is False and r["zero"] < c["zero"]
    ]
    if c["zero"] == 0:
        reasons.append("DDP: the whole state fits, the fewest bytes moved")
    elif simpler:
        worst = max(simpler, key=lambda r: r["zero"])
        reasons.append(
            f"{estimate.STAGES[c['zero']]}: {estimate.STAGES[worst['zero']]} needs "
            f"{worst['total'] / unit[0]:,.1f} {unit[1]}"
        )
    else:
        ddp = next(
            (
                f
                for f in fit
                if same(f) and (f["zero"], f["checkpointing"]) == (0, c["checkpointing"])
            ),
            None,
        )
        less = f"{(ddp['total'] - c['total']) / unit[0]:,.1f} {unit[1]}" if ddp else ""
        saved = f"{less} less than DDP, which fits too" if ddp else "fits"
        reasons.append(f"{estimate.STAGES[c['zero']]}: {saved}")
    if c.get("replicate", 1) > 1:
        links, across = (
            c["time"]["links"],
            c["stages"][c["worst_stage"]]["comm"]["replicate"]["all_reduce"],
        )
        reasons.append(
            f"HSDP: gathers {'inside a node' if links['dp'] else 'ACROSS nodes'}, "
            f"{across / 1e6:,.1f} MB of gradient shard "
            f"{'inside a node' if links['replicate'] else 'across'}"
        )
    if c["tp"] > 1:
        reasons.append(
            f"TP {c['tp']} {'inside a node' if c['time']['links']['tp'] else 'ACROSS nodes (slow)'}"
        )
    if c["pp"] > 1:
        reasons.append(
            f"PP {c['pp']}: bubble {c['bubble']:.0%} at M = {c['micro_batches']}"
            f"{', stages across nodes' if not c['time']['links']['pp'] else ''}"
        )
    if c["sequence_parallel"] or c["cp"] > 1:
        reasons.append(activations_reason(c, rejected, unit))
    if c["offload"]:
        s = c["stages"][c["worst_stage"]]
        reasons.append(
            f"offload: {s['host'] / unit[0]:,.1f} {unit[1]} on the host, "
            f"+{step_ms(c['time']['comm_s']['host'] * 1e3)} ms over its link"
        )
    if c["checkpointing"]:
        reasons.append("checkpointing: +1 forward")
    return "; ".join(reasons)


def activations_reason(c: dict, rejected: list[dict], unit: tuple) -> str:
    """Why context or sequence parallelism:
    the same layout with less of them does not fit, or cannot run."""
    # less CP or SP, with SP or without: the least it needs
    keys = plainer(c) | plainer(c, sequence_parallel=True)
    without = [r for r in rejected if layout_key(r) in keys]
    needed_sp = c["sequence_parallel"] and layout_key({**c, "sequence_parallel": False}) in map(
        layout_key, without
    )
    what = " and ".join(
        ([f"CP {c['cp']}: each sequence split {c['cp']} ways"] if c["cp"] > 1 else [])
        + (["SP: the LayerNorms' activations split"] if needed_sp else [])
    )
    if without:
        return f"{what} (without: {in_unit(min(r['total'] for r in without), unit)} {unit[1]})"
    return f"{what} (without: the global batch is too small for dp {c['dp'] * c['cp']})"


def step_ms(ms: float) -> str:
    return f"{ms:,.0f}" if ms >= 100 else f"{ms:.3g}"


def in_unit(n: float, unit: tuple) -> str:
    return f"{n / unit[0]:,.3f}" if n < 10 * unit[0] else f"{n / unit[0]:,.1f}"


def report(
    shape: Shape,
    hardware: Hardware,
    fit: list[dict],
    rejected: list[dict],
    micro_batch_size: int,
    global_batch: int,
    param_dtype: str,
    top: int,
    accounting: str = "counted on the meta device",
    no_commands: str | None = None,
) -> str:
    unit = (GIB, "GiB") if hardware.memory >= 2 * GIB else (2**20, "MiB")
    gib = lambda n: in_unit(n, unit)  # noqa: E731
    kind = "GPT-2" if shape.is_trainers else f"{shape.mlp}, {shape.norm}, {shape.kv_heads} kv heads"
    lines = [
        f"{kind} n_layer {shape.n_layer}, n_embd {shape.n_embd}, n_head {shape.n_head}, vocabulary "
        f"{shape.vocab:,}, seq_len {shape.seq_len}: Ψ = {shape.psi:,}; {param_dtype} "
        "parameters, AdamW; "
        f"activations {accounting}",
        f"{hardware.devices} devices of {hardware.memory / unit[0]:g} {unit[1]} "
        f"({hardware.gpus_per_node} per node); "
        f"micro-batch {micro_batch_size}, global batch {global_batch} sequences",
        f"{len(fit)} configurations fit, {len(rejected)} do not. {unit[1]} per rank "
        "(the stage holding most); "
        "grads: with ZeRO-2/3, the shard and the whole gradient no_sync() accumulates (M > 1); "
        "gather: ZeRO-3's units in flight; held: micro-batches of activations held "
        "(interleaved: chunks'); "
        "MB: bytes per step and rank each axis hands to collectives / sends on the "
        "wire (ring algorithms); "
        + (
            f"no commands: {no_commands}"
            if no_commands
            else "under each, the command that trains it, or why none"
        ),
        f"{'#':>3} "
        f"{'configuration':<62}{'params':>9}{'grads':>9}{'optim':>9}{'gather':>9}"
        f"{'activ.':>9}{'held':>5}"
        f"{'total':>9}{'DP MB':>20}{'TP MB':>20}{'PP MB':>20}{'CP MB':>20}{'step ms':>9}  why",
    ]
    for i, c in enumerate(fit[:top]):
        s = c["stages"][c["worst_stage"]]
        sizes = group_sizes(c)
        also = {"dp": ("replicate",)}  # HSDP: the all-reduce across the rows in the DP column
        handed = {a: sum(s["comm"].get(a, {}).values()) for a in sizes}
        wire = {a: on_the_wire(s["comm"].get(a, {}), sizes[a]) for a in sizes}
        comm = {
            axis: f"{sum(handed[a] for a in (axis, *also.get(axis, ()))) / 1e6:,.1f}/"
            f"{sum(wire[a] for a in (axis, *also.get(axis, ()))) / 1e6:,.1f}"
            for axis in ("dp", "tp", "pp", "cp")
        }
        lines.append(
            f"{i + 1:>3} "
            f"{name(c):<62}{gib(s['params']):>9}{gib(s['grads'] + s.get('accumulated', 0)):>9}"
            f"{gib(s['optimizer_state']):>9}"
            f"{gib(s['gathered']) if 'gathered' in s else '-':>9}{gib(s['activations']):>9}"
            f"{s['in_flight']:>5}{gib(c['total']):>9}"
            + "".join(f"{comm[axis]:>20}" for axis in ("dp", "tp", "pp", "cp"))
            + f"{step_ms(c['time']['step_s'] * 1e3):>9}  {justify(c, fit, rejected, unit)}"
        )
        if "command" in c and not no_commands:  # the command that trains it, or why none does
            lines.append(f"{'':>4}{c['command'] or 'no command: ' + c['no_command']}")
    if not fit:
        best = min(rejected, key=lambda c: c["total"])
        lines.append(
            f"nothing fits: the smallest is {name(best)} with {gib(best['total'])} "
            f"{unit[1]} per rank; add "
            "devices or memory, or shorten the micro-batch"
        )
    return "\n".join(lines)


# ---- Measured beside estimated -------------------------------------------------------------------

# step 10: its --zero over the data axis, ZeRO-1 by default (and in runs from before the flag)
ZERO_OF_STEP = {5: 1, 6: 2, 7: 3, 10: 1}
MEASURED_TOLERANCE = 0.05  # a rank's recorded model state against the estimate (docs/planner.md)


def layout_of(metrics: dict) -> dict:
    """The mesh of a run from its metrics.json: dp, tp, pp, ZeRO stage, and each rank's (dp, tp, pp)
    coordinates. Reads ``env``'s ``data_parallel_size``, ``tensor_parallel_size``,
    ``pipeline_stages`` (steps 8 and 9 write them; a step 10 run writes all three, and
    ``mesh_coords`` [[dp, tp, pp] per rank] where its layout is not tp innermost, then dp, then pp);
    step 11's ``context_parallel_size``: a ring's ranks are replicas of the model state, counted in
    dp; step 7's ``--replicate R`` (HSDP): sharded over dp / R."""
    env, step = metrics["env"], metrics["config"]["step"]
    number = int(step[4:].split("_")[0])
    world = env["world_size"]
    tp, pp = (
        env.get("tensor_parallel_size", 1),
        env.get("pipeline_stages", env.get("pipeline_parallel_size", 1)),
    )
    dp = (
        env.get("data_parallel_size", world)
        if (tp, pp) == (1, 1)
        else env.get("data_parallel_size", 1)
    )
    # step 11: every rank of a ring holds the whole state, a replica
    dp *= env.get("context_parallel_size", 1)
    if dp * tp * pp != world:
        raise UserError(
            f"{step}: a mesh of dp {dp} x tp {tp} x pp {pp} is not the world size {world}"
        )
    coords = env.get("mesh_coords") or [
        [(r // tp) % dp, r % tp, r // (tp * dp)] for r in range(world)
    ]
    replicate = metrics["config"].get("replicate", 1)  # step 7's HSDP: ZeRO-3 over rows of dp / R
    return {
        "dp": dp,
        "tp": tp,
        "pp": pp,
        "zero": metrics["config"].get("zero", ZERO_OF_STEP.get(number, 0)),
        "coords": coords,
        "replicate": replicate,
    }


def measured_rows(metrics: dict, vocab: int) -> list[dict]:
    """Per rank of a run: the model state it recorded (params + grads + optimizer state, the last
    record) and the planner's for its stage; a step 10 run is read the same way (``layout_of``)."""
    config, mesh = metrics["config"], layout_of(metrics)
    shape = Shape(config["n_layer"], config["n_embd"], config["n_head"], vocab, config["seq_len"])
    param_dtype = config.get("param_dtype") or "float32"
    reduce_dtype = "float32" if param_dtype != "float32" else None
    rows = []
    for rank, memory in enumerate(metrics["records"][-1]["memory"]):
        stage = mesh["coords"][rank][2]
        # step 9's rule
        chunks = step9_pipeline("pipeline_setup").virtual_stages({"schedule": "1f1b", **config})
        chunks = chunks if mesh["pp"] > 1 else 1
        held = rank_params(shape, mesh["tp"], mesh["pp"], stage, chunks)
        estimated = estimate.state_bytes(
            mesh["zero"],
            held["blocks"] + held["rest"],
            mesh["dp"] // mesh["replicate"],
            param_dtype,
            reduce_dtype,
        )
        if config.get(
            "moe_experts"
        ):  # step 12 (ZeRO-0), step 10 (its --zero per kind: mesh_moe_state)
            moe = MoE(config["moe_experts"], config["moe_top_k"], config["moe_every"])
            ep = metrics["env"].get("expert_parallel_size", config.get("ep") or 1)
            held = moe_rank_params_on_mesh(shape, moe, mesh["tp"], mesh["pp"], stage, chunks, ep)
            estimated = mesh_moe_state(
                held["dense"], held["experts"], mesh["dp"], ep, param_dtype, mesh["zero"]
            )
        rows.append(
            {
                "step": config["step"],
                "rank": rank,
                "stage": stage,
                **{k: mesh[k] for k in ("dp", "tp", "pp", "zero", "replicate")},
                "measured": {k: memory[k] for k in estimate.KINDS},
                "estimated": estimated,
                "in_flight": memory.get("micro_batches_in_flight"),
                "in_flight_estimated": in_flight(
                    config.get("schedule", "1f1b"),
                    mesh["pp"],
                    stage,
                    config.get("micro_batches") or config["grad_accum"],
                    chunks,
                ),
            }
        )
    return rows


def measured_report(runs: list[Path]) -> tuple[str, bool]:
    import parity

    lines = [
        f"{'run':<26}{'rank':>5}{'mesh dp x tp x pp, ZeRO':>40}{'measured state':>16}"
        f"{'estimated':>12}"
        f"{'ratio':>8}{'in flight (measured / est.)':>29}"
    ]
    ok = True
    for run in runs:
        folder, metrics = parity.load_run(str(run))
        vocab = estimate.vocabulary_size(metrics["config"]["tokenizer"])
        for row in measured_rows(metrics, vocab):
            m, e = sum(row["measured"].values()), sum(row["estimated"].values())
            ok &= abs(m / e - 1) <= MEASURED_TOLERANCE
            mesh = (
                f"{row['dp']} x {row['tp']} x {row['pp']}, "
                f"{estimate.STAGES[row['zero']] if row['dp'] > 1 else '-'}"
            )
            mesh += (
                f" (HSDP {row['replicate']} x {row['dp'] // row['replicate']})"
                if row["replicate"] > 1
                else ""
            )
            held = (
                f"{row['in_flight']} / {row['in_flight_estimated']}"
                if row["in_flight"] is not None
                else "-"
            )
            lines.append(
                f"{Path(folder).name:<26}{row['rank']:>5}{mesh:>40}{m:>16,}{e:>12,}"
                f"{m / e:>8.3f}{held:>29}"
            )
    lines.append(
        f"every rank's model state within {MEASURED_TOLERANCE:.0%} of the estimate: "
        f"{'yes' if ok else 'NO'}"
    )
    return "\n".join(lines), ok


def trainers_model(config: dict, parser, shape: Shape, vocab: int) -> str | None:
    """None where the step trainers build the planned model; else why no layout gets a command."""
    if config["preset"] or config["params"] or not shape.is_trainers:
        return (
            "not the trainers' GPT-2 (--preset, --params or a shape flag): no step trainer "
            "builds it"
        )
    if vocab != estimate.vocabulary_size(config["tokenizer"]):
        return f"the trainers take the vocabulary of --tokenizer, not --vocab-size {vocab}"
    return None


def model_flags(config: dict, parser) -> list:
    """The trainer flags that give the planned model and micro-batch: the shape's always, the rest
    where the plan did not take the trainers' default."""
    words = [
        f"--{flag.replace('_', '-')} {config[flag]}"
        for flag in ("n_layer", "n_embd", "n_head", "seq_len", "micro_batch_size")
    ]
    words += [
        f"--{flag} {config[flag]}"
        for flag in ("tokenizer", "dropout")
        if config[flag] != parser.get_default(flag)
    ]
    return words + (["--attention sdpa"] if config["attention"] == "sdpa" else [])


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The docstring as written, the flags with their defaults."""


def moe_plan(
    config: dict, parser, shape: Shape, vocab: int, hardware: Hardware, global_batch: int
) -> str:
    """``main`` for an MoE: step 12's layouts (``moe_layouts``) and their commands."""
    if config["moe_preset"]:
        shape, moe = MOE_PRESETS[config["moe_preset"]]
        given = {"vocab": config["vocab_size"]} if config["vocab_size"] else {}
        if config["seq_len"] != parser.get_default("seq_len"):
            # the preset's own unless --seq-len says otherwise, as --preset
            given["seq_len"] = config["seq_len"]
        shape = dataclasses.replace(shape, **given)
    else:
        moe = MoE(config["moe_experts"], config["moe_top_k"], config["moe_every"])
    b = config["micro_batch_size"]
    if global_batch % (hardware.devices * b):
        raise UserError(
            f"--global-batch {global_batch} is not a multiple of --devices x --micro-batch-size "
            f"({hardware.devices * b})"
        )
    formula = FormulaActivations(
        shape, b, activation_bytes(config["param_dtype"]), config["attention"], config["dropout"]
    )
    accounting = (
        f"by formula (compare/activation_formula.py: {config['attention']} attention, dropout "
        f"{config['dropout']:g})"
    )
    rows = moe_layouts(
        shape,
        moe,
        hardware,
        b,
        global_batch // (hardware.devices * b),
        config["param_dtype"],
        formula,
    )
    why_not = (
        "a published model's shape: no step trainer builds it"
        if config["moe_preset"]
        else trainers_model(config, parser, shape, vocab)
    )
    if not why_not and config["param_dtype"] != "float32":
        why_not = "step 12 trains float32 parameters (it has no --param-dtype)"
    for row in rows:
        row["command"], row["no_command"] = None, why_not
        row["mesh_command"], row["no_mesh_command"] = None, why_not
        flags = (
            f"{' '.join(model_flags(config, parser))} --grad-accum {row['micro_batches']} "
            f"--moe-experts {moe.experts} --moe-top-k {moe.top_k} --moe-every {moe.every} "
            f"--moe-capacity-factor 0 --ep {row['ep']}"
        )
        if not why_not:
            row["command"] = (
                f"torchrun --nproc-per-node {hardware.devices} "
                f"step12_expert_parallel/train.py {flags}"
            )
            if config["dropout"] > 0 and row["ep"] > 1:  # experts_on_mesh.py's rule 8
                row["no_mesh_command"] = "step 10 refuses --dropout with --ep above 1"
            else:
                row["mesh_command"] = (
                    f"torchrun --nproc-per-node {hardware.devices} step10_3d_parallel/train.py "
                    f"--dp {hardware.devices} {flags}"
                )
    if config["json"]:
        config["json"].write_text(
            json.dumps(
                {
                    "shape": dataclasses.asdict(shape),
                    "moe": dataclasses.asdict(moe),
                    "layouts": rows,
                },
                indent=1,
            )
            + "\n"
        )
    return moe_report(
        shape, moe, hardware, rows, b, global_batch, config["param_dtype"], accounting
    )


def main() -> int:
    parser = build_parser("plan")
    parser.prog, parser.description, parser.formatter_class = (
        "compare/plan.py",
        __doc__,
        HelpFormatter,
    )
    for action in parser._actions:
        if action.dest not in USED_FLAGS and action.option_strings and action.dest != "help":
            # a trainer flag with no bearing on the plan: accepted, not advertised
            action.help = argparse.SUPPRESS
    flags = parser.add_argument_group("plan")
    flags.add_argument("--devices", type=int, default=4, help="devices (ranks) in all")
    flags.add_argument("--memory-gb", type=float, default=80.0, help="memory per device, GiB")
    flags.add_argument("--gpus-per-node", type=int, default=8)
    flags.add_argument(
        "--params", type=float, default=None, help="a parameter count instead of --n-layer/--n-embd"
    )
    flags.add_argument(
        "--preset",
        choices=tuple(PRESETS),
        default=None,
        help="a published model's shape (GPT-2, GPT-3, Korthikanti et al.'s, Llama 3) instead",
    )
    shape_flags = parser.add_argument_group(
        "the model's shape beyond GPT-2's (on the flags' model or a preset)"
    )
    shape_flags.add_argument(
        "--n-kv-head", type=int, default=None, help="key/value heads (grouped-query attention)"
    )
    shape_flags.add_argument("--ffn", type=int, default=None, help="the MLP's width (default 4h)")
    shape_flags.add_argument("--mlp", choices=("gelu", "swiglu"), default=None)
    shape_flags.add_argument("--norm", choices=("layernorm", "rmsnorm"), default=None)
    shape_flags.add_argument("--untied", action="store_true", help="an output layer of its own")
    shape_flags.add_argument("--no-bias", action="store_true", help="linear layers without biases")
    shape_flags.add_argument(
        "--rotary", action="store_true", help="no position table (rotary embeddings)"
    )
    flags.add_argument(
        "--selective-recompute",
        action="store_true",
        help="recompute attention's s x s part in backward (Korthikanti et al.) where not "
        "checkpointing",
    )
    flags.add_argument(
        "--vocab-size", type=int, default=None, help="default: the vocabulary of --tokenizer"
    )
    flags.add_argument(
        "--global-batch",
        type=int,
        default=None,
        help="sequences per optimiser step (default: --devices x --micro-batch-size x "
        "--grad-accum)",
    )
    if not any(action.dest == "param_dtype" for action in parser._actions):
        flags.add_argument("--param-dtype", choices=tuple(estimate.PARAM_DTYPES), default="float32")
    flags.add_argument(
        "--reduce-dtype-fp32",
        action="store_true",
        help="16-bit parameters with gradients kept in float32, as FSDP2 (default: the "
        "paper's 16-bit)",
    )
    flags.add_argument(
        "--schedule",
        choices=SCHEDULES,
        default="1f1b",
        help="the pipeline's (interleaved: 2 chunks a stage where M and the blocks allow, "
        "else 1f1b; "
        "zero-bubble: B = W = F assumed in its bubble)",
    )
    flags.add_argument(
        "--tflops", type=float, default=300.0, help="achieved TFLOP/s per device (ranking only)"
    )
    flags.add_argument(
        "--intra-gbs", type=float, default=450.0, help="GB/s per rank inside a node (ranking only)"
    )
    flags.add_argument(
        "--inter-gbs", type=float, default=50.0, help="GB/s per rank across nodes (ranking only)"
    )
    flags.add_argument(
        "--offload-optimizer",
        action="store_true",
        help="also try ZeRO-3 with AdamW's state on the host (step 7's --offload-optimizer)",
    )
    flags.add_argument(
        "--host-gbs", type=float, default=25.0, help="GB/s between a device and its host (offload)"
    )
    flags.add_argument(
        "--hsdp",
        action="store_true",
        help="also try ZeRO-3 as HSDP: sharded over rows of dp/R, replicated over R (step 7's "
        "--replicate R)",
    )
    flags.add_argument(
        "--reduce-every-micro-batch",
        action="store_true",
        help="ZeRO-2/3 reduce-scatter every micro-batch into the shard (step 6's flag), not one "
        "whole gradient accumulated under no_sync() per step (the trainers' default)",
    )
    flags.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="step 8's --sequence-parallel at every tp > 1 (default: where activations need it)",
    )
    flags.add_argument("--top", type=int, default=12, help="configurations printed")
    moe_flags = parser.add_argument_group(
        "mixture of experts: step 12's ep axis instead of the dense search"
    )
    moe_flags.add_argument(
        "--moe-preset", choices=tuple(MOE_PRESETS), default=None, help="a published MoE's shape"
    )
    moe_flags.add_argument(
        "--moe-experts", type=int, default=0, metavar="E", help="experts per MoE layer (0: dense)"
    )
    moe_flags.add_argument(
        "--moe-top-k", type=int, default=2, metavar="K", help="experts per token"
    )
    moe_flags.add_argument(
        "--moe-every", type=int, default=1, metavar="N", help="blocks 0, N, 2N, ... are MoE"
    )
    flags.add_argument(
        "--measured",
        type=Path,
        nargs="+",
        default=None,
        help="run folders (or step names): print their measured model state beside the estimate",
    )
    flags.add_argument("--json", type=Path, help="also write every configuration here")
    config = parse_config(parser)
    if config["measured"]:
        text, ok = measured_report(config["measured"])
        print(text)
        return 0 if ok else 1
    for flag in (
        "devices",
        "memory_gb",
        "micro_batch_size",
        "gpus_per_node",
        "top",
        "params",
        "host_gbs",
        "n_kv_head",
        "ffn",
        "moe_every",
    ):
        if config[flag] is not None and config[flag] <= 0:
            raise UserError(f"--{flag.replace('_', '-')} must be positive, got {config[flag]:g}")
    vocab = config["vocab_size"] or estimate.vocabulary_size(config["tokenizer"])
    if config["preset"] and config["params"]:
        raise UserError("--preset and --params both describe the model: give one")
    if config["moe_preset"] and (config["preset"] or config["params"] or config["moe_experts"]):
        raise UserError(
            "--moe-preset describes the whole model: drop --preset, --params and --moe-experts"
        )
    if config["moe_experts"] < 0 or (
        config["moe_experts"] and not 1 <= config["moe_top_k"] <= config["moe_experts"]
    ):
        raise UserError(
            f"--moe-top-k must be between 1 and the {config['moe_experts']} experts (--moe-experts "
            f"at least 1), got {config['moe_top_k']}"
        )
    if config["preset"]:
        given = {"vocab": vocab} if config["vocab_size"] else {}
        if config["seq_len"] != parser.get_default("seq_len"):
            given["seq_len"] = config["seq_len"]  # the preset's own unless --seq-len says otherwise
        shape = dataclasses.replace(PRESETS[config["preset"]], **given)
    elif config["params"]:
        shape = Shape.from_params(config["params"], vocab, config["seq_len"])
    else:
        shape = Shape(
            config["n_layer"], config["n_embd"], config["n_head"], vocab, config["seq_len"]
        )
    shape = dataclasses.replace(
        shape,
        **{
            field: value
            for field, value in (
                ("n_kv_head", config["n_kv_head"]),
                ("ffn", config["ffn"]),
                ("mlp", config["mlp"]),
                ("norm", config["norm"]),
                ("tied", False if config["untied"] else None),
                ("bias", False if config["no_bias"] else None),
                ("positions", False if config["rotary"] else None),
            )
            if value is not None
        },
    )
    if shape.n_head % shape.kv_heads:
        raise UserError(f"--n-kv-head must divide the {shape.n_head} heads, got {shape.n_kv_head}")
    b = config["micro_batch_size"]
    global_batch = config["global_batch"] or config["devices"] * b * config["grad_accum"]
    hardware = Hardware(
        config["devices"],
        config["memory_gb"] * GIB,
        config["gpus_per_node"],
        config["tflops"],
        config["intra_gbs"],
        config["inter_gbs"],
        config["host_gbs"],
    )
    if config["moe_preset"] or config["moe_experts"]:
        print(moe_plan(config, parser, shape, vocab, hardware, global_batch))
        return 0
    reduce_dtype = (
        "float32" if config["reduce_dtype_fp32"] and config["param_dtype"] != "float32" else None
    )
    formula = functools.partial(
        FormulaActivations,
        shape,
        b,
        activation_bytes(config["param_dtype"]),
        config["attention"],
        config["dropout"],
        config["selective_recompute"],
    )
    if (
        config["preset"]
        or config["params"]
        or not shape.is_trainers
        or config["attention"] == "sdpa"
        or config["selective_recompute"]
    ):
        activations = formula()
        accounting = (
            f"by formula (compare/activation_formula.py: {config['attention']} attention, dropout "
            f"{config['dropout']:g}"
            f"{', selective recomputation' if config['selective_recompute'] else ''})"
        )
    else:
        activations = Activations(
            shape, b, estimate.PARAM_DTYPES[config["param_dtype"]], config["dropout"]
        )
        accounting = (
            f"counted on the meta device (the trainers' model, dropout {config['dropout']:g})"
        )
    accounting += "; with cp > 1 by formula, attention by the ring"
    fit, rejected = plan(
        shape,
        hardware,
        b,
        global_batch,
        config["param_dtype"],
        reduce_dtype,
        config["schedule"],
        config["offload_optimizer"],
        config["reduce_every_micro_batch"],
        config["sequence_parallel"],
        # step 11's ring: 1/cp terms
        activations,
        lambda cp: formula(cp=cp),
        config["hsdp"],
    )
    no_commands = trainers_model(config, parser, shape, vocab)
    for c in fit:
        c["command"], c["no_command"] = (
            (None, no_commands)
            if no_commands
            else command(
                c,
                hardware.devices,
                model_flags(config, parser),
                config["param_dtype"],
                config["reduce_every_micro_batch"],
            )
        )
    print(
        report(
            shape,
            hardware,
            fit,
            rejected,
            b,
            global_batch,
            config["param_dtype"],
            config["top"],
            accounting,
            no_commands,
        )
    )
    if config["json"]:
        config["json"].write_text(
            json.dumps(
                {"shape": dataclasses.asdict(shape), "fit": fit, "rejected": rejected},
                indent=1,
                default=str,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main))
