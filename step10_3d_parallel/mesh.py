"""A device mesh, from scratch: the ranks laid out as pp x dp x cp x tp, one process group per axis.

Step 8 split every layer over all the ranks (tensor parallelism, TP), step 9 split the layers into
stages over all the ranks (pipeline parallelism, PP), steps 1-7 split the batch (data parallelism,
DP) and step 11 every sequence (context parallelism, CP). Each used the whole world as its one
group. To use them at once, every rank needs a group per axis: the ranks that share its layers'
shards, the ranks that hold the other stages of its replica, the ranks that hold the other positions
of its sequences, and the ranks that hold the same shard of the same stage in the other
replicas. Here:

1. **One coordinate per axis.** A world of ``dp * cp * tp * pp`` ranks is the array
   ``arange(world).reshape(pp, dp, cp, tp)``: rank ``r`` sits at ``(pp_rank, dp_rank, cp_rank,
   tp_rank)`` with ``r = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank``. A group along
   an axis is a line through that array: the ranks that differ only in that coordinate.
2. **TP innermost: adjacent ranks.** Tensor parallelism all-reduces activations inside every layer,
   forward and backward, where nothing overlaps them: the most bytes and the least patience of the
   axes. Adjacent ranks are the ones a launcher puts on one machine (``--nproc_per_node``
   consecutive ranks), so TP gets the fastest links (NVLink inside a node). CP next: its ring passes
   key/value blocks in every attention, overlapped with the blocks' compute. Data parallelism next:
   one gradient all-reduce per step, overlappable with backward. Pipeline parallelism outermost: it
   sends one activation per micro-batch to one neighbour, the least traffic, and tolerates the
   slowest links (between nodes). Megatron-LM orders them the same way (``tp-cp-ep-dp-pp``: TP
   fastest-varying).
3. **Every rank creates every group, in the same order.** ``dist.new_group`` is a collective over
   the whole world even for ranks not in the new group (each process must know every group's id), so
   every rank walks the same loops and keeps the groups it belongs to.
4. **Point-to-point over the world.** The pipeline's peers are the ranks of the same ``(dp_rank,
   cp_rank, tp_rank)`` in the neighbouring stages: ``pp_ranks`` lists them by stage; sends and
   receives go to those global ranks, and TP rank t of stage s only ever talks to TP rank t of stage
   s +- 1 (every TP rank holds the whole residual-stream activation of its positions, so no gather
   is needed between stages).
5. **The gradients' group is dp x cp.** The ranks of a ring read the same samples, each its
   positions: to the weights they are replicas (step 11's context_parallel.py, rule 4). Averaging
   gradients and sharding AdamW's state (ZeRO-1) run over the plane of ranks that differ in dp or cp
   (``dp_cp_group``, Megatron-LM's "data parallel group with context parallel"), the sampler over dp
   alone. At cp = 1 that plane is the dp group, and no other group is created.
6. **Experts inside the dp x cp plane** (``--ep D``, step 12's expert_parallel.py). An MoE layer's
   experts are split over D ranks that hold the same stage and tp shard, drawn from the dp x cp
   plane as Megatron-LM folds expert parallelism into "data parallel x context parallel" and
   torchtitan takes its ep from the data and context axes: the ranks of a plane already hold
   different tokens of the same dense weights, so sending tokens between them to their experts costs
   no other layout. The plane, ``W = dp * cp`` ranks in dp x cp order (cp varying fastest), is cut
   into W/D blocks of D consecutive ranks, step 12's ``Groups`` with the plane for the world:
   ``arange(world).view(pp, W // D, D, tp)``, the ep group a line along the third dimension, an
   expert's copies (its gradient's group) along the second. The ep group sits next to tp in rank
   order, the nearest ranks tp leaves: its all-to-alls run twice a layer, forward and backward, with
   nothing to overlap them (at cp = D it is the ring itself). At D = W = world, step 12's
   groups exactly.

``torch.distributed.device_mesh.init_device_mesh("cpu", (pp, dp, cp, tp), mesh_dim_names=("pp",
"dp", "cp", "tp"))`` builds the same groups, and ``mesh["dp", "cp"]._flatten()`` the dp x cp plane;
``(pp, W // D, D, tp)`` the experts' (the tests check them rank by rank); it is what to use in your
own code. This file shows what it does.
"""

import itertools
from datetime import timedelta
from typing import NamedTuple

import torch.distributed as dist

from config import UserError
from expert_parallel import Groups

AXES = ("pp", "dp", "cp", "tp")  # outermost first: the order of the array's dimensions


def check_mesh(dp: int, tp: int, pp: int, world_size: int, cp: int = 1) -> None:
    """Refuse, with one line, degrees that are not positive or do not multiply to the world size."""
    named = {"dp": dp, **({"cp": cp} if cp != 1 else {}), "tp": tp, "pp": pp}
    if min(named.values()) < 1:
        raise UserError(
            f"{' '.join(f'--{a} {n}' for a, n in named.items())}: every degree must be at least 1"
        )
    product = dp * cp * tp * pp
    if product != world_size:
        raise UserError(
            f"{' x '.join(f'--{a} {n}' for a, n in named.items())} = {product} ranks, "
            "but the job has "
            f"{world_size}: launch {product} processes (torchrun --nproc_per_node), or "
            "choose degrees "
            f"whose product is {world_size}"
        )


def _sizes(dp: int, tp: int, pp: int, cp: int) -> dict:
    return {"pp": pp, "dp": dp, "cp": cp, "tp": tp}


def _rank_at(at: dict, sizes: dict) -> int:
    """The global rank at coordinates ``at``:
    ``((pp * dp + d) * cp + c) * tp + t``, tp varying fastest."""
    rank = 0
    for axis in AXES:
        rank = rank * sizes[axis] + at[axis]
    return rank


def coordinates(rank: int, dp: int, tp: int, pp: int, cp: int = 1) -> dict:
    """``{"pp": s, "dp": d, "cp": c, "tp": t}`` of ``rank``:
    ``rank = ((s * dp + d) * cp + c) * tp + t``."""
    sizes, at = _sizes(dp, tp, pp, cp), {}
    for axis in reversed(AXES):  # tp first: it varies fastest
        rank, at[axis] = divmod(rank, sizes[axis])
    return {axis: at[axis] for axis in AXES}


def axis_groups(axis, dp: int, tp: int, pp: int, cp: int = 1) -> list[list[int]]:
    """Every group along ``axis`` (or along several axes at once, a tuple such as ``("dp", "cp")``):
    lists of global ranks that differ only in those coordinates, in the order every rank creates
    them (the other coordinates outer to inner); within a group the coordinates of ``axis`` outer
    to inner."""
    sizes, along = _sizes(dp, tp, pp, cp), (axis,) if isinstance(axis, str) else tuple(axis)
    others = [a for a in AXES if a not in along]
    return [
        [
            _rank_at({**dict(zip(others, fixed)), **dict(zip(along, moving))}, sizes)
            for moving in itertools.product(*(range(sizes[a]) for a in along))
        ]
        for fixed in itertools.product(*(range(sizes[a]) for a in others))
    ]


class DeviceMesh(NamedTuple):
    """This rank's place in the mesh: its coordinates, the ranks of each of its groups, and the
    groups. ``dp_cp``: the dp x cp ranks that hold the same shard of the same stage (rule 5), or the
    dp group where cp is 1."""

    dp: int
    tp: int
    pp: int
    dp_rank: int
    tp_rank: int
    pp_rank: int
    dp_ranks: list  # global ranks of this rank's data-parallel group, by dp rank
    tp_ranks: list
    pp_ranks: list  # by stage: the pipeline's peers
    dp_group: object
    tp_group: object
    pp_group: object
    cp: int = 1
    cp_rank: int = 0
    cp_ranks: list = None  # the ring
    cp_group: object = None
    dp_cp_rank: int = 0
    dp_cp_group: object = None
    experts: Groups = (
        None  # an MoE model's: the ep group and the experts' copies (rule 6); None for a dense one
    )

    @property
    def ep(self) -> int:
        return self.experts.ep_size if self.experts else 1

    def record(self) -> dict:
        """The degrees, as a run's record keeps them
        (compare/parity.py reads the global batch from them)."""
        experts = (
            {"ep": self.ep, "experts": "D consecutive ranks of dp x cp"} if self.experts else {}
        )
        return {
            "data_parallel_size": self.dp,
            "context_parallel_size": self.cp,
            "tensor_parallel_size": self.tp,
            "pipeline_stages": self.pp,
            **({"expert_parallel_size": self.ep} if self.experts else {}),
            "mesh": {
                "pp": self.pp,
                "dp": self.dp,
                "cp": self.cp,
                "tp": self.tp,
                "order": "pp, dp, cp, tp (tp innermost)",
                **experts,
            },
        }


def build_mesh(
    dp: int, tp: int, pp: int, timeout_s: float | None = None, cp: int = 1, ep: int | None = None
) -> DeviceMesh:
    """Create the axes' process groups (every rank calls this, with the same degrees) and return
    this rank's place in them. The default process group must exist; ``dp * cp * tp * pp`` must be
    its size. ``timeout_s``: how long a collective on these groups waits for a peer; pass the
    default group's, or a new group waits torch's default 30 minutes for a rank that died. cp = 1
    creates no cp or dp x cp group (rule 5). ``ep``: an MoE model's expert-parallel degree, dividing
    dp * cp (rule 6; 1: every expert on every rank); None: a dense model."""
    check_mesh(dp, tp, pp, dist.get_world_size(), cp)
    rank = dist.get_rank()
    timeout = timedelta(seconds=timeout_s) if timeout_s else None
    axes = ("tp", "dp", "pp") + (("cp", ("dp", "cp")) if cp > 1 else ())
    mine = {}
    for axis in axes:  # the same order on every rank: new_group is a collective
        for ranks in axis_groups(axis, dp, tp, pp, cp):
            group = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                mine[axis] = ranks, group
    at = coordinates(rank, dp, tp, pp, cp)
    ring = mine.get("cp", ([rank], None))
    dp_cp = mine.get(("dp", "cp"), mine["dp"])
    planes = axis_groups(("dp", "cp"), dp, tp, pp, cp)  # rule 6: each cut into blocks of ep
    experts = None if ep is None else Groups(ep, planes, data=dp_cp[1], timeout=timeout)
    return DeviceMesh(
        dp,
        tp,
        pp,
        at["dp"],
        at["tp"],
        at["pp"],
        mine["dp"][0],
        mine["tp"][0],
        mine["pp"][0],
        mine["dp"][1],
        mine["tp"][1],
        mine["pp"][1],
        cp=cp,
        cp_rank=at["cp"],
        cp_ranks=ring[0],
        cp_group=ring[1],
        dp_cp_rank=at["dp"] * cp + at["cp"],
        dp_cp_group=dp_cp[1],
        experts=experts,
    )
