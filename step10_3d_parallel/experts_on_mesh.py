"""Step 12's experts on step 10's mesh (``--moe-experts E --ep D``): what expert parallelism must
decide when the ranks that exchange tokens are also tensor-parallel, pipelined and context-parallel.

1. **The groups** (mesh.py's rule 6): D consecutive ranks of a dp x cp plane, at the same stage and
   tp rank, split each MoE layer's experts (step 12's ``Groups``, the plane for its world). A tp
   rank holds its E/D experts whole: the tensor-parallel plan skips an MoE block's MLP
   (tensor_parallel.py), every tp rank routes the same tokens and computes the same experts, so
   their gradients agree with no collective (Megatron can also cut an expert over tp, its expert
   tensor parallelism; not here). ``--ep 1``: every expert on every rank, no all-to-all.
2. **The load-balancing loss reaches every stage.** One process differentiates ``(loss + a * sum of
   aux) / accum``; in a pipeline the loss is on the last stage, the other stages' routers out of its
   reach. So each MoE layer's output carries its aux loss through ``AuxLossToRouters``
   (Megatron-LM's ``MoEAuxLossAutoScaler``): forward, the output itself; backward, the output's
   gradient passed on, and the aux loss given the gradient one process gives it, ``(1 / accum) * a``
   with the same two float32 roundings. It meets the language-model loss's gradient at the router's
   probabilities in a sum of two terms (a + b = b + a): one process's bits, at any pp, at pp =
   1 too.
3. **A sequence split over cp.** A cp rank routes its S/C positions. The aux loss's fractions f_i
   must be the whole micro-batch's: moe.py's ``whole_sequence`` (its rule 4) adds the ring's counts,
   E integers all-reduced (exact), and tokens; its mean probabilities P_i stay the rank's, so the
   ring's aux losses average to one process's, as their language-model losses do (rule 4 divides
   both by W). Capacity is refused with cp: it drops by position among a micro-batch's T tokens, and
   a rank holds S/C of them.
4. **Gradients** (step 12's rule 7, on a plane of W = dp x cp ranks): the dense ones summed over the
   plane, an expert's over its W/D copies (at the same stage and tp rank), both divided by W
   (``reduce_gradients``).
5. **ZeRO-1 per kind of parameter.** ZeRO-1 over dp x cp assumes the plane's ranks hold the same
   parameters; an ep group's do not. The dense parameters' AdamW state is sharded over the plane, an
   expert's over its copies:
   ``DenseAndExperts``, two ``ShardedOptimizer``s stepped as one (the LR schedule sets the dense
   groups; the experts' follow them).
6. **Counted once** (composition.py's rule 3, and an axis more): a norm adds the dense tensors on
   the ep group's first rank, the experts on every ep rank (tp rank 0's), all-reduced over tp, pp,
   then ep.
7. **Checkpoints**: an expert is written whole and by name, as step 12 writes it, its AdamW state as
   the slices its copies step (rule 5): boxes of the whole tensors, each written once
   (composition.py's rule 4). Step 12 at any ep, and this step at any mesh, ep or --zero, read
   them back.
8. **What does not compose**, refused in one line each (``check_experts_on_mesh``): see there.
"""

import torch
import torch.distributed as dist

import distributed
from comm_accounting import count_collective
from config import UserError
from expert_parallel import ExpertParallel, is_expert, shard_experts
from moe import MoE
from moe_setup import moe_layers, take_moe_record
from zero1 import ShardedOptimizer
from zero1_state import hyperparameters


def add_ep_flag(flags) -> None:
    flags.add_argument(
        "--ep",
        type=int,
        default=1,
        metavar="D",
        help="expert-parallel degree: each MoE layer's experts split over D ranks of the dp x cp "
        "plane (step 12's expert_parallel.py); needs --moe-experts",
    )


def check_experts_on_mesh(config: dict, dp: int, cp: int, pp: int) -> None:
    """Rule 8: the flags of experts on the mesh, one line each, before anything connects."""
    ep, experts = config.get("ep", 1), config.get("moe_experts", 0)
    if ep < 1:
        raise UserError(f"--ep {ep}: the expert-parallel degree must be at least 1")
    if not experts:
        if ep > 1:
            raise UserError(
                f"--ep {ep} splits the experts of a mixture of experts: give --moe-experts E "
                f"(a multiple of {ep}), or drop --ep"
            )
        return
    if (dp * cp) % ep:
        raise UserError(
            f"--ep {ep} must divide --dp x --cp = {dp * cp}: the experts are split "
            "over ranks of the "
            "data and context axes (mesh.py's rule 6); change --ep, --dp or --cp"
        )
    if experts % ep:
        raise UserError(
            f"--moe-experts {experts} is not divisible by --ep {ep}: each rank holds E/D experts; "
            f"choose E a multiple of {ep}"
        )
    if cp > 1 and config["moe_capacity_factor"] > 0:
        raise UserError(
            "--moe-capacity-factor with --cp: capacity drops slots by position among a "
            "micro-batch's "
            "tokens, and a cp rank holds S/C of them; use --moe-capacity-factor 0 "
            "(dropless) with --cp"
        )
    if config["dropout"] > 0 and max(ep, cp, pp) > 1:
        raise UserError(
            "--dropout with --moe-experts and --ep, --cp or --pp above 1: an expert "
            "draws its mask over the "
            "slots it receives, known once routed, on the rank that owns it, so no "
            "rank can draw one "
            "process's masks; use --dropout 0"
        )
    if config["sequence_parallel"]:
        raise UserError(
            "--sequence-parallel with --moe-experts: each tp rank would route its S/T "
            "tokens and the "
            "experts' gradients would need adding over tp; use one of the two"
        )
    if config["activation_checkpointing"] == "full":
        raise UserError(
            "--activation-checkpointing full with --moe-experts: recomputing a block would run its "
            "experts' all-to-alls and count its tokens again; use selective, or none"
        )


class AuxLossToRouters(torch.autograd.Function):
    """Rule 2: ``output`` unchanged; in backward,
    ``gradient`` for ``aux_loss`` beside ``output``'s own."""

    @staticmethod
    def forward(ctx, output, aux_loss, gradient):
        ctx.save_for_backward(gradient)
        return output

    @staticmethod
    def backward(ctx, grad):
        (gradient,) = ctx.saved_tensors
        return grad, gradient, None


def experts_on_mesh(model, mesh, config: dict) -> None:
    """Rules 1-3 on ``model`` (whole, before tensor parallelism cuts it): keep this rank's experts
    and dispatch to the ep group's; under cp count the routing over the ring; carry every layer's
    aux-loss gradient."""
    layers = moe_layers(model)
    if mesh.ep > 1:
        shard_experts(model, layers, mesh.experts)
    if mesh.cp > 1:
        for layer in layers:
            layer.whole_sequence = lambda counts, tokens: _over_ring(counts, tokens, mesh)
    if config["moe_aux_loss_coef"]:
        # (1 / accum) * a, as one process's backward of (loss + a * aux) / accum computes it
        gradient = torch.ones(()) / config["grad_accum"] * config["moe_aux_loss_coef"]
        for layer in layers:
            layer.register_forward_hook(
                lambda module, args, out: AuxLossToRouters.apply(
                    out, module.aux_loss, gradient.to(out.device)
                )
            )


def _over_ring(counts: torch.Tensor, tokens: int, mesh) -> tuple[torch.Tensor, int]:
    """Rule 3: the slots each expert got from the whole micro-batch,
    and its tokens (cp x this rank's)."""
    counts = counts.clone()
    count_collective("routing counts", counts)
    dist.all_reduce(counts, group=mesh.cp_group)
    return counts, tokens * mesh.cp


class DenseAndExperts(torch.optim.Optimizer):
    """Rule 5: ZeRO-1 over dp x cp for the dense parameters, over an expert's copies for the
    experts, as one optimiser for the loop, the LR schedule (``param_groups``: the dense ones) and
    the memory record (``state``).
    ``parts``: the two, each checkpointed as its slices (rule 7; composition.py's ``MeshShards``).
    ``zero1(named, group)``: what builds each part (default:
    ZeRO-1 over ``group``; zero_stages.py: --zero's)."""

    def __init__(self, named: list, config: dict, mesh, zero1=None):
        from training import adamw_options, adamw_param_groups

        def sharded(named, group):
            return ShardedOptimizer(
                adamw_param_groups(named, config),
                torch.optim.AdamW,
                process_group=group,
                **adamw_options(config),
            )

        zero1 = zero1 or sharded  # zero_stages.py's, for the stage --zero asks
        experts = [(n, p) for n, p in named if is_expert(n)]
        self.dense = zero1([(n, p) for n, p in named if not is_expert(n)], mesh.dp_cp_group)
        self.experts = zero1(experts, mesh.experts.replicas) if experts else None
        self.parts = [self.dense] + ([self.experts] if self.experts else [])

    @property
    def param_groups(self):
        return self.dense.param_groups

    @property
    def state(self):
        return {**self.dense.state, **(self.experts.state if self.experts else {})}

    @property
    def defaults(self):
        return self.dense.defaults

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.parts:
            optimizer.zero_grad(set_to_none)

    def step(self, closure=None):
        self.dense.step()
        if self.experts:  # the same AdamW groups (decay, no decay): the schedule's lr, and the rest
            for dense, experts in zip(self.dense.param_groups, self.experts.param_groups):
                experts.update(hyperparameters(dense))
            self.experts.step()


def norm_groups(mesh) -> list:
    """Rule 6: the groups a norm's sums of squares are all-reduced over, in turn."""
    return [mesh.tp_group, mesh.pp_group] + ([mesh.experts.ep] if mesh.ep > 1 else [])


def gather_experts(mine: dict, mesh) -> dict:
    """``mine`` (every parameter of this rank's stage,
    by name) with the other experts of its ep group. Collective."""
    if mesh.ep > 1:
        held = [None] * mesh.ep
        experts = {n: t for n, t in mine.items() if is_expert(n)}
        dist.all_gather_object(held, experts, group=mesh.experts.ep)
        for part in held:
            mine.update(part)
    return mine


def moe_record_on_mesh(stage, mesh) -> dict:
    """Step 12's MoE record over the mesh, on every rank (collective): per MoE layer, in model
    order, the slots each expert computed summed over the dp x cp ranks that hold it, the dropped
    fraction averaged over them; the layers' load-balancing loss averaged over them and summed over
    layers; each rank's all-to-all notes (step 12's ``traffic``). Counted on tp rank 0: the tp ranks
    route alike."""
    layers = [(n, m) for n, m in stage.named_modules() if isinstance(m, MoE)]
    traffic = []
    for _, m in layers:
        if isinstance(m.dispatch, ExpertParallel):
            traffic += m.dispatch.traffic
            m.dispatch.traffic = []
    blocks = [
        int(n.split("transformer.h.")[1].split(".")[0]) for n, _ in layers
    ]  # a stage's, or chunks'
    mine = (mesh.tp_rank, blocks, take_moe_record(stage).get("moe"))
    everyone = distributed.gather_per_rank(moe=mine, all_to_all=traffic)
    by_block, aux = {}, 0.0
    for tp, blocks, record in everyone["moe"]:
        if tp == 0 and record:
            aux += record["aux_loss"] / (mesh.dp * mesh.cp)  # each layer on dp x cp of these ranks
            for i, block in enumerate(blocks):
                tokens, dropped = record["tokens_per_expert"][i], record["dropped_fraction"][i]
                by_block.setdefault(block, []).append((tokens, dropped))
    held = [by_block[block] for block in sorted(by_block)]
    return {
        "moe": {
            "aux_loss": aux,
            "tokens_per_expert": [[sum(c) for c in zip(*(t for t, _ in h))] for h in held],
            "dropped_fraction": [sum(d for _, d in h) / len(h) for h in held],
        },
        "all_to_all": everyone["all_to_all"],
    }
