"""Steps 8, 9, 11 and 12 composed on step 10's mesh (mesh.py): what no step had to decide alone.

1. **The flags and their checks**: the mesh's own (mesh.py), step 8's for the tp degree, step 11's
   for the cp degree, step 9's for the pp degree, every one before anything connects.
2. **A stage of a tensor-parallel model**: step 9 cuts the model step 8 made tensor-parallel; the
   last stage keeps the tensor-parallel output layer, with its copy of the tie
   (``parallelize_on_mesh``: the whole wrapping order).
3. **Counted once across the mesh**: a norm adds TP shards on every tp rank, replicated tensors on
   tp rank 0, and the tie on the first stage only.
4. **One checkpoint whatever the mesh**: each rank gives DCP its TP/PP shard as step 8 does and its
   ZeRO-1 slices of that shard's AdamW state as step 5 does, boxes of the whole tensors, so the
   checkpoint never depends on the mesh; loading copies this rank's part out of any step's
   checkpoint at any mesh.
5. **Context parallelism inside the stages** (step 11, ``--cp``): the model made tensor-parallel is
   then made context-parallel over the cp group (its attention the ring, on this rank's heads; its
   embeddings, dropouts and targets this rank's positions), so the stages send each other S/C tokens
   of every micro-batch. Gradients and ZeRO-1 go over dp x cp (mesh.py's rule 5). Not with
   --sequence-parallel (both split the sequence; not composed here) nor selective recomputation (the
   ring keeps no s x s tensor to recompute). With dropout, each tp rank's ring draws every head's
   mask and keeps its heads' (ring_attention.py's rule 6), as step 8 does (its rule 7).
6. **Experts on the mesh** (step 12, ``--moe-experts E --ep D``): experts_on_mesh.py, after its
   rules 1-3 on the whole model; the gradients, the optimiser, the norms and the checkpoints then as
   its rules 4-7 say.
"""

import functools

import torch
import torch.distributed as dist

from config import UserError
from context_parallel import LAYOUTS, check_context_parallel, context_parallel_gpt2, sequence_shard
from dcp_checkpoint import load_model, load_optimizer, model_state, optimizer_state
from expert_parallel import is_expert
from experts_on_mesh import add_ep_flag, check_experts_on_mesh, experts_on_mesh, gather_experts
from mesh import check_mesh
from pipeline_setup import add_pipeline_flags, check_pipeline, pipeline_gpt2, virtual_stages
from pipeline_stages import GPT2Stage
from recomputation import add_recomputation_flag, recompute
from sequence_parallel import check_sequence_parallel, sequence_parallel_gpt2
from sequence_parallel import finish_gradient_synchronization as finish_sequence_parallel
from tensor_parallel import check_tensor_parallel, parallelize_gpt2
from tensor_parallel_state import gather_full_parameters, is_sharded, place_of
from vocab_parallel import vocab_parallel_cross_entropy


def add_mesh_flags(parser) -> None:
    flags = parser.add_argument_group("3D parallelism (their product is the number of ranks)")
    flags.add_argument(
        "--dp",
        type=int,
        default=None,
        help="data-parallel degree (default: what --tp and --pp leave)",
    )
    flags.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel degree: must divide --n-head and the vocabulary",
    )
    flags.add_argument("--pp", type=int, default=1, help="pipeline stages: at most --n-layer")
    flags.add_argument(
        "--cp",
        type=int,
        default=1,
        help="context-parallel degree: ranks that split each sequence (step 11's ring attention)",
    )
    flags.add_argument(
        "--cp-layout",
        choices=LAYOUTS,
        default="zigzag",
        help="which chunks of the sequence each cp rank keeps (step 11's context_parallel.py)",
    )
    flags.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="split the activations between the layers along the sequence over tp "
        "(step 8's sequence_parallel.py)",
    )
    add_recomputation_flag(flags)  # step 7's --activation-checkpointing: full or selective
    add_ep_flag(flags)  # experts_on_mesh.py: --ep, with common/moe.py's --moe-experts
    add_pipeline_flags(parser)  # step 9's --schedule, --virtual-stages and --micro-batches


def check_degrees(config: dict, world_size: int, vocab_size: int) -> tuple[int, int]:
    """Every mistake in the mesh flags, with one line, before anything connects; returns (dp, M):
    the mesh's own (mesh.py), step 8's for the tp degree, step 11's for the cp degree and step 9's
    for the pp degree."""
    tp, pp, cp = config["tp"], config["pp"], config["cp"]
    dp = config["dp"] if config["dp"] is not None else max(1, world_size // max(1, tp * pp * cp))
    check_mesh(dp, tp, pp, world_size, cp)
    if config["sequence_parallel"] and tp == 1:
        raise UserError(
            "--sequence-parallel splits the sequence over the tp group: use it with --tp 2 or more"
        )
    check_tensor_parallel(config, vocab_size, tp, flag="--tp")
    check_sequence_parallel(config, tp, flag="--tp")
    if (
        config["activation_checkpointing"] == "full"
        and pp > 1
        and config["schedule"] == "zero-bubble"
    ):
        raise UserError(
            "--activation-checkpointing full with --schedule zero-bubble: W's backward "
            "of each layer "
            "would recompute its block again (torch.utils.checkpoint recomputes once "
            "per backward call); "
            "use selective, or another --schedule"
        )
    if cp > 1:
        check_context_on_mesh(config, cp)
    check_experts_on_mesh(config, dp, cp, pp)
    return dp, check_pipeline(config, pp, flag="--pp")


def check_context_on_mesh(config: dict, cp: int) -> None:
    """Rule 5's refusals, one line each:
    step 11's check of the sequence, then what step 10 does not compose."""
    check_context_parallel(config, cp)  # --seq-len cut into 2 x cp chunks
    if config["sequence_parallel"]:
        raise UserError(
            "--sequence-parallel with --cp: both split the sequence, and step 10 does not compose "
            "them; use one of the two"
        )
    if config["activation_checkpointing"] == "selective":
        raise UserError(
            "--activation-checkpointing selective with --cp: the ring keeps no s x s tensor to "
            "recompute; use full, or none"
        )


def tensor_parallel_stage(model, stage_index: int, num_stages: int) -> GPT2Stage:
    """Step 9's stage of a model step 8 made tensor-parallel. The output layer must stay the
    tensor-parallel one (its input's gradient is all-reduced over the tp group, Megatron's f):
    GPT2Stage gives the last stage a plain Linear, so it gets the model's ColumnParallelLinear back,
    with the stage's copy of the tie."""
    stage = GPT2Stage(model, stage_index, num_stages)
    if stage.is_last and is_sharded(model.transformer.wte.weight):
        copy, embedding = stage.lm_head.weight, model.transformer.wte.weight
        copy.tp_blocks, copy.tp_shape = embedding.tp_blocks, embedding.tp_shape  # the same shard
        model.lm_head.weight = copy
        stage.lm_head = model.lm_head
    return stage


def parallelize_on_mesh(model, mesh, config: dict, device) -> tuple:
    """``(stage, named, pipe, shapes)`` of this rank (step 9's ``pipeline_gpt2``, and the whole
    model's parameter shapes: what checkpoints and the final weights describe): ``model``, whole on
    every rank, made tensor-parallel over the tp group (step 8; at tp = 1 it stays plain GPT-2, as
    in steps 5 and 9), cut into stages (rule 2), this rank's run by a Pipeline over the pp group,
    the last stage's loss step 8's over the vocabulary slices (or step 9's at tp = 1); with --cp,
    context-parallel over the cp group (rule 5); its blocks recomputed in backward as
    --activation-checkpointing says. Pass ``model`` and keep no reference to it: the rank keeps its
    stage only."""
    shapes = {name: p.shape for name, p in model.named_parameters()}
    if mesh.experts:  # rule 6: this rank's experts, dispatched over the ep group
        experts_on_mesh(model, mesh, config)
    if mesh.tp > 1:
        reduce_dtype = torch.float64 if config["reduce_dtype"] == "float64" else None
        model = parallelize_gpt2(model, group=mesh.tp_group, reduce_dtype=reduce_dtype)
        if config["sequence_parallel"]:
            model = sequence_parallel_gpt2(model, group=mesh.tp_group, reduce_dtype=reduce_dtype)
    loss_fn = (
        functools.partial(vocab_parallel_cross_entropy, group=mesh.tp_group)
        if mesh.tp > 1
        else torch.nn.functional.cross_entropy
    )
    # rule 5: the ring over each tp rank's heads, this rank's positions of every tensor
    if mesh.cp > 1:
        model = context_parallel_gpt2(
            model, mesh.cp_group, config["cp_layout"], heads=(mesh.tp_rank, mesh.tp)
        )
        loss_fn = functools.partial(
            _loss_on_positions,
            loss_fn,
            mesh.cp_group,
            config["cp_layout"],
            config["micro_batch_size"],
        )
    # each rank's own heads (recomputation.py)
    recompute(model.transformer.h, config["activation_checkpointing"])
    model = model.to(device)
    # the model's stages: V per pp rank with --schedule interleaved-1f1b
    chunks = mesh.pp * virtual_stages(config)
    stages = [tensor_parallel_stage(model, s, chunks) for s in range(chunks)]
    split = mesh.tp if config["sequence_parallel"] else mesh.cp  # S/T or S/C tokens a message
    stage, named, pipe = pipeline_gpt2(
        stages, mesh.pp_rank, config, device, loss_fn, ranks=mesh.pp_ranks, sequence_split=split
    )
    return stage, named, pipe, shapes


def _loss_on_positions(loss_fn, group, layout: str, micro_batch_size: int, logits, targets):
    """``loss_fn`` on this cp rank's positions: the logits are theirs already, the (flattened)
    targets are the whole micro-batch's (rule 5)."""
    return loss_fn(
        logits, sequence_shard(targets.view(micro_batch_size, -1), group, layout).flatten()
    )


def finish_gradient_synchronization(pipe) -> None:
    """The single sync point of a tensor-parallel stage, before the optimiser step: step 9's (the
    tie's gradient from the first stage, every send waited), then step 8's (--sequence-parallel: the
    LayerNorms' partial gradients, added over tp)."""
    pipe.finish_gradient_synchronization()
    finish_sequence_parallel(pipe.module)


def counted_once(named: list, mesh, plane: bool = False) -> list:
    """The tensors whose squares add up to the whole model's (or gradient's) across the mesh: TP
    shards on every tp rank, replicated ones on tp rank 0 only, the tie's copy on the last stage not
    at all; with experts, the dense tensors on the ep group's first rank only (experts_on_mesh.py's
    rule 6), unless ``plane``: each rank's slices of them, added over the dp x cp plane too (ZeRO-2:
    zero_stages.py's rule 4)."""
    first_of_ep = plane or mesh.experts is None or mesh.experts.ep_rank == 0
    return [
        p
        for n, p in named
        if (is_sharded(p) or mesh.tp_rank == 0)
        and not (n == "transformer.wte.weight" and mesh.pp_rank > 0)
        and (first_of_ep or is_expert(n))
    ]


def gather_full_model(stage, named: list, mesh) -> dict:
    """Every parameter whole, by name, on every rank: the tp shards all-gathered (step 8), the other
    experts over the ep group (step 12), the stages' parts then gathered over the pp group
    (step 9)."""
    full = gather_full_parameters(stage, group=mesh.tp_group)  # by the stage module's names
    name_of = {n: name for (n, _), (name, _) in zip(stage.named_parameters(), named)}
    mine = {
        name_of[n]: t
        for n, t in full.items()
        if not (name_of[n] == "transformer.wte.weight" and mesh.pp_rank > 0)
    }
    stages = [None] * mesh.pp
    dist.all_gather_object(stages, gather_experts(mine, mesh), group=mesh.pp_group)
    return {n: t for part in stages for n, t in part.items()}


class MeshShards:
    """checkpoint.py's part for a rank of the mesh (rule 4): its TP/PP shard of the parameters, as
    step 8 gives it (one box of each whole tensor), and the slices each of its ZeRO optimisers steps
    of that shard's AdamW state (step 5's flat ranges, a few boxes each; --zero 0: all of it; with
    experts, the dense optimiser's and the experts', experts_on_mesh.py's rule 5): no gather. Every
    copy of a tensor writes the same boxes (dp x cp replicas, an expert's copies, tp ranks'
    replicated tensors), which DCP writes once; the tie's copy on the last stage is not saved (its
    slices are cut with that stage's other parameters: other boxes). Any step reads it at any mesh,
    ep and --zero stage."""

    per_rank = True

    def __init__(self, named: list, optimizer, mesh):
        self.named, self.mesh = named, mesh
        # the ZeRO optimisers: itself, or DenseAndExperts's two (experts_on_mesh.py)
        self.optimizers = getattr(optimizer, "parts", [optimizer])
        self.saved = [
            (n, p) for n, p in named if n != "transformer.wte.weight" or mesh.pp_rank == 0
        ]

    @staticmethod
    def places(optimizer, named: list) -> list:
        """``optimizer``'s local parameters,
        flat slices of the TP shards ``named`` holds (None: another's)."""
        name_of = {p: n for n, p in named}
        return [
            (name_of[piece.param], place_of(piece.param)._replace(start=piece.start))
            if piece.param in name_of
            else None
            for piece in optimizer.pieces
        ]

    def checkpoint_state(self) -> dict:
        state = model_state([(n, p, place_of(p)) for n, p in self.saved])
        for optimizer in self.optimizers:
            state.update(
                optimizer_state(optimizer.local_optimizer, self.places(optimizer, self.saved))
            )
        return state

    def load_checkpoint(self, checkpoint) -> None:
        """This rank's TP shard of every parameter (the tie's copy too, its experts by their names),
        then each optimiser's slices of that shard's AdamW state, out of any step's checkpoint at
        any mesh."""
        load_model(checkpoint, [(n, p, place_of(p)) for n, p in self.named])
        for optimizer in self.optimizers:
            load_optimizer(
                checkpoint, optimizer.local_optimizer, self.places(optimizer, self.named)
            )
