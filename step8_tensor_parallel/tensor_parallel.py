"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019): T ranks run one model on the same samples,
each holding 1/T of every weight matrix.

Steps 1-7 split the batch: every rank ran the whole model on its own samples (ZeRO only changed
where the state waits between uses). Here the ranks of a group see the same micro-batches and split
the work *inside* each layer. Here:

1. **Column-parallel, then row-parallel.** A linear layer ``y = x A^T`` can be split by the rows of
   ``A`` (its output features: rank r computes ``y_r``, a slice of ``y``, from the whole ``x``) or
   by its columns (its input features: rank r computes a partial ``x_r A_r^T`` of the whole ``y``,
   and the ranks sum). An MLP is a column-parallel layer, an element-wise activation, a row-parallel
   layer: the activation needs no communication in between, so a pair costs one all-reduce forward
   (after the row-parallel layer) and one backward per column-parallel layer (attention: c_q, c_k
   and c_v, then c_proj; MLP: c_fc, then c_proj). The plan (``BLOCK_PLAN``) names each layer and its
   kind, as torchtitan's does. (Megatron fuses q, k and v into one matrix, one backward all-reduce
   instead of three; PyTorch's ``ColwiseParallel`` on each, which we equal bit for bit, does not.)
2. **Two conjugate functions carry all the communication** (tensor_parallel_mappings.py, apart from
   the layers, as Megatron-LM's ``mappings.py``). ``copy_to_tensor_parallel_region`` (Megatron's
   *f*): identity forward, all-reduce of the gradient backward, in front of a column-parallel layer,
   because each rank's ``x`` feeds only its slice of ``y``. And
   ``reduce_from_tensor_parallel_region`` (*g*): all-reduce forward, identity backward, after a
   row-parallel layer. Nothing else in the model knows it is distributed.
3. **Whole heads.** q, k and v are three ``nn.Linear`` whose rows are the heads side by side, so
   rank r's contiguous block of rows of each is heads ``r H/T .. (r+1) H/T - 1``: attention runs on
   its local heads with no communication, and reads their number off the width (no attribute to
   patch). Hence T must divide the number of heads: a block that cut a head in two would be
   silently wrong.
4. **The row-parallel bias as PyTorch adds it.** Each rank adds ``bias / T`` to its partial sum
   before the all-reduce (DTensor's Replicate -> Partial, ``_partition_value``), so the result is
   bitwise PyTorch's ``RowwiseParallel``. The bias gradient is the true one (``_BiasShare``):
   every rank already holds the whole output gradient.
5. **The vocabulary split, the tie kept** (vocab_parallel.py): the token embedding and the tied
   output layer hold rows ``[r V/T, (r+1) V/T)`` of one Parameter, and the loss is taken on logits
   split by vocabulary.
6. **Replicated parameters stay identical without a gradient sync.** LayerNorms, the position
   embedding and row-parallel biases see the same inputs on every rank and, thanks to *f*'s
   all-reduce, the same output gradients: their gradients come out bit-identical everywhere.
   (That replicated work, done T times on the same tokens, is what sequence parallelism splits:
   sequence_parallel.py, which swaps the layers' communication, below, for its own.)
7. **One process's dropout masks.** Every rank's random stream is the same (one seed), so a rank
   that drew attention dropout's mask for its own heads would draw every other rank's mask too:
   heads h and h + H/T dropped alike. ``ShardDropout`` draws the mask of all heads, as one process
   draws it, and keeps this rank's block (shard_dropout.py): the masks are one process's (tests:
   within float32's rounding of step 0), and the stream moves on as one process's. The fused sdpa
   kernel draws inside itself, so with dropout it is refused (``check_tensor_parallel``).

What changes the numbers: a row-parallel layer sums ``h/T`` products per rank and then the ranks'
partial sums; one process sums ``h`` products in one go. Floating-point addition is not associative,
so tensor parallelism is bitwise equal to PyTorch's own tensor parallelism (which groups the same
way), not to steps 0-7 (README: "what is and is not bitwise").
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from config import UserError
from shard_dropout import ShardDropout
from tensor_parallel_mappings import (
    copy_to_tensor_parallel_region,
    gather_along,
    reduce_from_tensor_parallel_region,
    scatter_along,
)
from tensor_parallel_state import block_length, block_of
from vocab_parallel import VocabParallelEmbedding

# ---- a rank's share of a row-parallel bias -------------------------------------------------------


class _BiasShare(torch.autograd.Function):
    """``bias / T`` forward (rule 4); backward,
    the gradient of the whole bias: the T shares add up to it."""

    @staticmethod
    def forward(ctx, bias, world_size):
        return bias / world_size

    @staticmethod
    def backward(ctx, grad):
        return grad, None


# ---- the layers ----------------------------------------------------------------------------------


class ColumnParallelLinear(nn.Module):
    """``nn.Linear(in_features, out_features)`` with its output features split over ``group``.

    ``.weight`` is this rank's block of rows of the full ``(out_features, in_features)`` weight,
    rows ``[r out/T, (r+1) out/T)``; ``.bias`` the same rows of the bias. The input is the whole
    ``x``, the same on every rank; the output is this rank's slice of the last dimension, or, with
    ``gather_output=True``, the whole output (one all-gather). ``out_features`` must be divisible
    by T.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        gather_output: bool = False,
        group=None,
        reduce_dtype=None,
    ):
        super().__init__()
        self.group, self.gather_output, self.reduce_dtype = group, gather_output, reduce_dtype
        self.copy_input = copy_to_tensor_parallel_region  # f (sequence_parallel.py: its own)
        self.in_features, self.out_features = in_features, out_features
        local = block_length(out_features, group, "out_features")
        self.weight = nn.Parameter(torch.empty(local, in_features))
        self.bias = nn.Parameter(torch.zeros(local)) if bias else None
        nn.init.normal_(self.weight, std=0.02)

    @classmethod
    def from_full(cls, linear: nn.Linear, group=None, reduce_dtype=None) -> "ColumnParallelLinear":
        """This rank's part of ``linear`` (the same full layer on every rank):
        its block of rows, of the bias too."""
        # no storage, no random draw: dropout's masks must not depend on this
        with torch.device("meta"):
            layer = cls(
                linear.in_features,
                linear.out_features,
                bias=linear.bias is not None,
                group=group,
                reduce_dtype=reduce_dtype,
            )
        layer.weight = block_of(linear.weight, 0, group, "out_features")
        if linear.bias is not None:
            layer.bias = block_of(linear.bias, 0, group, "out_features")
        return layer

    def forward(self, x):
        y = F.linear(self.copy_input(x, self.group, self.reduce_dtype), self.weight, self.bias)
        return gather_along(y, -1, self.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """``nn.Linear(in_features, out_features)`` with its input features split over ``group``.

    ``.weight`` is this rank's block of columns of the full ``(out_features, in_features)`` weight,
    columns ``[r in/T, (r+1) in/T)``; ``.bias`` is whole (replicated). The input is this rank's
    slice of the last dimension (what a column-parallel layer returns), or, with
    ``input_is_parallel=False``, the whole input, sliced here. The output is whole and the same on
    every rank: the partial sums, each with ``bias / T`` added (as PyTorch's ``RowwiseParallel``
    does), all-reduced.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        input_is_parallel: bool = True,
        group=None,
        reduce_dtype=None,
    ):
        super().__init__()
        self.group, self.input_is_parallel, self.reduce_dtype = (
            group,
            input_is_parallel,
            reduce_dtype,
        )
        self.reduce_output = reduce_from_tensor_parallel_region  # g (sequence_parallel.py: its own)
        self.in_features, self.out_features = in_features, out_features
        local = block_length(in_features, group, "in_features")
        self.weight = nn.Parameter(torch.empty(out_features, local))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        nn.init.normal_(self.weight, std=0.02)

    @classmethod
    def from_full(cls, linear: nn.Linear, group=None, reduce_dtype=None) -> "RowParallelLinear":
        """This rank's part of ``linear`` (the same full layer on every rank):
        its block of columns, the bias whole."""
        with torch.device("meta"):
            layer = cls(
                linear.in_features,
                linear.out_features,
                bias=linear.bias is not None,
                group=group,
                reduce_dtype=reduce_dtype,
            )
        layer.weight = block_of(linear.weight, 1, group, "in_features")
        if linear.bias is not None:
            layer.bias = nn.Parameter(linear.bias.detach().clone())  # replicated
        return layer

    def forward(self, x):
        if not self.input_is_parallel:
            x = scatter_along(x, -1, self.group)
        share = (
            None
            if self.bias is None
            else _BiasShare.apply(self.bias, dist.get_world_size(self.group))
        )
        return self.reduce_output(F.linear(x, self.weight, share), self.group, self.reduce_dtype)


# ---- GPT-2, made tensor-parallel -----------------------------------------------------------------
# Every sharded parameter is one contiguous block of the full one (``from_full``: rank r's block r
# of T along dim 0 for column-parallel weights and biases and for the vocabulary, dim 1 for
# row-parallel weights), in the model's own layout (nn.Linear's ``(out, in)``), so a shard is its
# own checkpoint block, nothing transposed. The plan (torchtitan's style, our layers): each layer by
# its name, and the layer that replaces it. A column-parallel layer's output stays split (by heads,
# or the MLP's hidden features) into the row-parallel one.
# whole heads: a block of rows
BLOCK_PLAN = {
    "attn.c_q": ColumnParallelLinear,
    "attn.c_k": ColumnParallelLinear,
    "attn.c_v": ColumnParallelLinear,
    "attn.c_proj": RowParallelLinear,
    "mlp.c_fc": ColumnParallelLinear,
    "mlp.c_proj": RowParallelLinear,
}
# over the vocabulary; tied to wte again after
MODEL_PLAN = {
    "transformer.wte": VocabParallelEmbedding,
    "lm_head": ColumnParallelLinear,
}


def tensor_parallel_plan(n_layer: int) -> dict:
    """Every layer of GPT-2 that tensor parallelism splits, by its full name, and how."""
    return {
        **MODEL_PLAN,
        **{
            f"transformer.h.{i}.{name}": style
            for i in range(n_layer)
            for name, style in BLOCK_PLAN.items()
        },
    }


def check_tensor_parallel(
    config: dict, vocab_size: int, world_size: int, flag: str | None = None
) -> None:
    """``check_divisible`` for a run's flags: --n-head and the vocabulary; and no fused attention
    with dropout (rule 7)."""
    check_divisible(config["n_head"], vocab_size, world_size, flag)
    if world_size > 1 and config.get("dropout", 0) > 0 and config.get("attention") == "sdpa":
        raise UserError(
            "--attention sdpa (a GPU's default) with --dropout under tensor "
            "parallelism: the fused kernel "
            "would draw attention's masks for this rank's heads alone, the same on every rank; use "
            "--attention math"
        )


def degree_and_fix(world_size: int, flag: str | None) -> tuple[str, str]:
    """How a refusal names the degree and its fix: ``flag`` (step 10's ``--tp``), or the ranks."""
    degree = f"{flag} {world_size}" if flag else f"tensor parallelism over {world_size} ranks"
    return degree, f"use a {flag} that divides" if flag else "run on a number of ranks that divides"


def check_divisible(n_head: int, vocab_size: int, world_size: int, flag: str | None = None) -> None:
    """Refuse, with one line, a tensor-parallel degree that cannot split the heads or the
    vocabulary. ``flag``: the option that sets the degree, named in the line; none: the ranks."""
    degree, fix = degree_and_fix(world_size, flag)
    if n_head % world_size:
        why = "more ranks than heads" if world_size > n_head else "each rank holds whole heads"
        raise UserError(
            f"{degree} needs --n-head divisible by {world_size}, got {n_head} ({why}): "
            f"{fix} {n_head}, "
            "or change --n-head (and --n-embd)"
        )
    if vocab_size % world_size:
        raise UserError(
            f"{degree} needs a vocabulary divisible by {world_size}, the tokenizer has "
            f"{vocab_size} "
            f"tokens: {fix} {vocab_size}, or pad the vocabulary (Megatron does)"
        )


def parallelize_gpt2(model, group=None, reduce_dtype=None):
    """Turn our GPT-2 (common/model.py; every rank holding the same full weights) into its
    tensor-parallel form over ``group``, in place, and return it.

    ``tensor_parallel_plan``: each block's ``attn.c_q``, ``attn.c_k``, ``attn.c_v`` and ``mlp.c_fc``
    become ``ColumnParallelLinear`` (rank r: heads ``r H/T .. (r+1) H/T - 1`` of q, k and v),
    ``attn.c_proj`` and ``mlp.c_proj`` ``RowParallelLinear``; ``transformer.wte`` a
    ``VocabParallelEmbedding`` and ``lm_head`` a ``ColumnParallelLinear`` over the vocabulary whose
    weight is that embedding's Parameter (the tie kept). The attention reads its number of heads off
    the width, so it runs on the local heads unchanged. Parameter names do not change. The model's
    forward then returns this rank's vocabulary slice of the logits: take the loss with
    ``vocab_parallel_cross_entropy``. Every sharded parameter carries ``tp_blocks``: where it sits
    in the whole one (tensor_parallel_state.py). Attention dropout keeps this rank's heads of one
    process's mask (rule 7). Sequence parallelism: sequence_parallel.py."""
    cfg = model.config
    check_divisible(cfg.n_head, cfg.vocab_size, dist.get_world_size(group))
    for name, style in tensor_parallel_plan(len(model.transformer.h)).items():
        parent, _, leaf = name.rpartition(".")
        module = model.get_submodule(parent)
        if hasattr(
            module, leaf
        ):  # a mixture of experts has no mlp.c_fc: its experts stay whole (step 10)
            setattr(module, leaf, style.from_full(getattr(module, leaf), group, reduce_dtype))
    for block in model.transformer.h:  # rule 7: this rank's heads of one process's mask
        block.attn.attn_dropout = ShardDropout(cfg.dropout, group)
    # one Parameter: its gradient sums both uses, as in GPT-2
    model.lm_head.weight = model.transformer.wte.weight
    return model
