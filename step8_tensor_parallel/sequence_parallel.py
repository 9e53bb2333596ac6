"""Sequence parallelism (Korthikanti et al. 2022), on top of tensor_parallel.py: between the
blocks each rank holds S/T of the tokens, not all of them.

Why: tensor parallelism's replicated work (its rule 6: LayerNorms, dropout, residuals) is done T
times on the same tokens, and its activations are kept T times. Split along the sequence instead.
*f* and *g* become an all-gather of the sequence before the column-parallel layers (once per
module: q, k and v share it; backward, the reduce-scatter of their summed gradients) and a
reduce-scatter after the row-parallel ones (backward, an all-gather): the same bytes as the
all-reduces they replace. The position embedding gives each rank its positions; dropout draws the
whole mask one process draws and keeps this rank's block (the masks one process uses, no two ranks
alike). A LayerNorm now sees only its rank's tokens: its gradient is a partial sum, added over the
group once per step, after the micro-batches, as PyTorch's ``SequenceParallel`` and Megatron do
(``finish_gradient_synchronization``).
"""

import torch
import torch.distributed as dist

from comm_accounting import count_collective, reduce_scatter_single
from config import UserError
from shard_dropout import ShardDropout
from tensor_parallel import degree_and_fix
from tensor_parallel_mappings import all_gather_along, all_reduce, scatter_along

# ---- the communication: f and g along the sequence ---------------------------------------


def _reduce_scatter_along(x: torch.Tensor, dim: int, group, reduce_dtype=None) -> torch.Tensor:
    """This rank's block along ``dim`` of the sum of every rank's ``x``: the blocks stacked along
    dim 0 as PyTorch's functional ``reduce_scatter_tensor(scatter_dim=dim)`` stacks them, so the
    sums are its sums."""
    world_size = dist.get_world_size(group)
    stacked = torch.cat(x.chunk(world_size, dim=dim), dim=0).contiguous()
    wide = stacked if reduce_dtype in (None, x.dtype) else stacked.to(reduce_dtype)
    out = torch.empty(
        (wide.shape[0] // world_size, *wide.shape[1:]), dtype=wide.dtype, device=wide.device
    )
    count_collective("reduce_scatter", wide)
    reduce_scatter_single(out, wide, group=group)
    return out.to(x.dtype)


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    """*f*: the whole sequence (dim 1) gathered forward; backward, its gradient reduce-scattered."""

    @staticmethod
    def forward(ctx, x, group, reduce_dtype):
        ctx.group, ctx.reduce_dtype = group, reduce_dtype
        return all_gather_along(x, 1, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_along(grad, 1, ctx.group, ctx.reduce_dtype), None, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """*g*: the partial sums added and this rank's block of the sequence kept; backward, the
    gradients all-gathered."""

    @staticmethod
    def forward(ctx, x, group, reduce_dtype):
        ctx.group = group
        return _reduce_scatter_along(x, 1, group, reduce_dtype)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_along(grad, 1, ctx.group), None, None


def gather_from_sequence_parallel_region(x, group=None, reduce_dtype=None):
    return _GatherFromSequenceParallelRegion.apply(x, group, reduce_dtype)


def reduce_scatter_to_sequence_parallel_region(x, group=None, reduce_dtype=None):
    return _ReduceScatterToSequenceParallelRegion.apply(x, group, reduce_dtype)


def _gathered_already(x, group=None, reduce_dtype=None):
    """A column-parallel layer's *f* here: nothing. Its module's gather made ``x`` whole, and its
    backward reduce-scatters the gradient."""
    return x


# ---- the switch: GPT-2, made sequence-parallel ---------------------------------------------


def add_sequence_parallel_flags(parser) -> None:
    parser.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="split the activations between the layers along the sequence too "
        "(sequence_parallel.py)",
    )


def check_sequence_parallel(config: dict, world_size: int, flag: str | None = None) -> None:
    """With --sequence-parallel, refuse in one line a degree that does not divide --seq-len.
    ``flag``: the option that sets the degree (step 10's ``--tp``); none: the number of ranks."""
    seq_len = config["seq_len"]
    if config["sequence_parallel"] and seq_len % world_size:
        degree, fix = degree_and_fix(world_size, flag)
        raise UserError(
            f"{degree} with --sequence-parallel needs --seq-len divisible by "
            f"{world_size}, got {seq_len}: {fix} {seq_len}, or change --seq-len"
        )


def sequence_parallel_gpt2(model, group=None, reduce_dtype=None):
    """Sequence parallelism on a model ``parallelize_gpt2`` made tensor-parallel, in place; returns
    it. The embedding and both c_proj reduce-scatter along the sequence; ``attn``, ``mlp`` and
    ``lm_head`` gather it first (one all-gather each); the position embedding gives this rank's
    positions; dropout between the blocks keeps this rank's block of one process's mask; the
    LayerNorms' parameters are marked ``sequence_parallel`` (their gradients are partial sums:
    ``finish_gradient_synchronization`` adds them over the group)."""

    def gather(module, args):
        return (gather_from_sequence_parallel_region(args[0], group, reduce_dtype),)

    model.transformer.wte.reduce_output = reduce_scatter_to_sequence_parallel_region
    model.transformer.wpe.register_forward_hook(
        lambda module, args, out: scatter_along(out, 0, group)
    )
    model.transformer.drop = ShardDropout(model.config.dropout, group)
    norms = [model.transformer.ln_f]
    for block in model.transformer.h:
        for module in (block.attn, block.mlp):
            module.register_forward_pre_hook(gather)
        for layer in (block.attn.c_q, block.attn.c_k, block.attn.c_v, block.mlp.c_fc):
            layer.copy_input = _gathered_already
        for layer in (block.attn.c_proj, block.mlp.c_proj):
            layer.reduce_output = reduce_scatter_to_sequence_parallel_region
        block.attn.resid_dropout = ShardDropout(model.config.dropout, group)
        block.mlp.dropout = ShardDropout(model.config.dropout, group)
        norms += [block.ln_1, block.ln_2]
    model.lm_head.register_forward_pre_hook(gather)
    model.lm_head.copy_input = _gathered_already
    for p in (p for norm in norms for p in norm.parameters()):
        p.sequence_parallel = {"group": group, "reduce_dtype": reduce_dtype}  # where it is added
    return model


def finish_gradient_synchronization(model) -> None:
    """The single sync point before the optimiser step: the gradients of ``model``'s parameters
    marked ``sequence_parallel``, each rank's sum over its own tokens and every micro-batch, added
    over their group. Nothing to do without sequence parallelism: every replicated parameter then
    saw every token (tensor_parallel.py's rule 6)."""
    for p in model.parameters():
        marked = getattr(p, "sequence_parallel", None)
        if marked and p.grad is not None:
            all_reduce(p.grad, marked["group"], reduce_dtype=marked["reduce_dtype"])
