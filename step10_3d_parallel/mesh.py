"""A device mesh, from scratch: the ranks laid out as pp x dp x tp, one process group per axis.

Step 8 split every layer over all the ranks (tensor parallelism, TP), step 9 split the layers into
stages over all the ranks (pipeline parallelism, PP), and steps 1-7 split the batch (data parallelism,
DP). Each used the whole world as its one group. To use all three at once, every rank needs three
groups: the ranks that share its layers' shards, the ranks that hold the other stages of its replica,
and the ranks that hold the same shard of the same stage in the other replicas. Here:

1. **One coordinate per axis.** A world of ``dp * tp * pp`` ranks is the array
   ``arange(world).reshape(pp, dp, tp)``: rank ``r`` sits at ``(pp_rank, dp_rank, tp_rank)`` with
   ``r = (pp_rank * dp + dp_rank) * tp + tp_rank``. A group along an axis is a line through that
   array: the ranks that differ only in that coordinate.
2. **TP innermost: adjacent ranks.** Tensor parallelism all-reduces activations inside every layer,
   forward and backward, where nothing overlaps them: the most bytes and the least patience of the
   three. Adjacent ranks are the ones a launcher puts on one machine (``--nproc_per_node`` consecutive
   ranks), so TP gets the fastest links (NVLink inside a node). Data parallelism next: one gradient
   all-reduce per step, overlappable with backward. Pipeline parallelism outermost: it sends one
   activation per micro-batch to one neighbour, the least traffic, and tolerates the slowest links
   (between nodes). Megatron-LM orders them the same way (``tp-cp-ep-dp-pp``: TP fastest-varying).
3. **Every rank creates every group, in the same order.** ``dist.new_group`` is a collective over the
   whole world even for ranks not in the new group (each process must know every group's id), so
   every rank walks the same loops and keeps the groups it belongs to.
4. **Point-to-point over the world.** The pipeline's peers are the ranks of the same ``(dp_rank,
   tp_rank)`` in the neighbouring stages: ``pp_ranks`` lists them by stage; sends and receives go to
   those global ranks, and TP rank t of stage s only ever talks to TP rank t of stage s +- 1 (every TP
   rank holds the whole residual-stream activation, so no gather is needed between stages).

``torch.distributed.device_mesh.init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))``
builds the same groups (``tests/test_3d_parallel.py`` checks it rank by rank); it is what to use in
your own code. This file shows what it does.
"""
from datetime import timedelta
from typing import NamedTuple

import torch.distributed as dist

from config import UserError

AXES = ("pp", "dp", "tp")  # outermost first: the order of the array's dimensions


def check_mesh(dp: int, tp: int, pp: int, world_size: int) -> None:
    """Refuse, with one line, degrees that are not positive or do not multiply to the world size."""
    if min(dp, tp, pp) < 1:
        raise UserError(f"--dp {dp} --tp {tp} --pp {pp}: every degree must be at least 1")
    if dp * tp * pp != world_size:
        raise UserError(f"--dp {dp} x --tp {tp} x --pp {pp} = {dp * tp * pp} ranks, but the job has {world_size}: "
                        f"launch {dp * tp * pp} processes (torchrun --nproc_per_node), or choose degrees whose "
                        f"product is {world_size}")


def coordinates(rank: int, dp: int, tp: int, pp: int) -> dict:
    """``{"pp": s, "dp": d, "tp": t}`` of ``rank``: ``rank = (s * dp + d) * tp + t``."""
    return {"pp": rank // (dp * tp), "dp": rank // tp % dp, "tp": rank % tp}


def axis_groups(axis: str, dp: int, tp: int, pp: int) -> list[list[int]]:
    """Every group along ``axis``: lists of global ranks that differ only in that coordinate, in the order every
    rank creates them (the other coordinates outer to inner)."""
    sizes = {"pp": pp, "dp": dp, "tp": tp}
    others = [a for a in AXES if a != axis]
    groups = []
    for first in range(sizes[others[0]]):
        for second in range(sizes[others[1]]):
            fixed = {others[0]: first, others[1]: second}
            groups.append([(at["pp"] * dp + at["dp"]) * tp + at["tp"]
                           for at in ({**fixed, axis: i} for i in range(sizes[axis]))])
    return groups


class DeviceMesh(NamedTuple):
    """This rank's place in the mesh: its coordinates, the ranks of each of its groups, and the groups."""
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

    def record(self) -> dict:
        """The degrees, as a run's record keeps them (compare/parity.py reads the global batch from them)."""
        return {"data_parallel_size": self.dp, "tensor_parallel_size": self.tp, "pipeline_stages": self.pp,
                "mesh": {"pp": self.pp, "dp": self.dp, "tp": self.tp, "order": "pp, dp, tp (tp innermost)"}}


def build_mesh(dp: int, tp: int, pp: int, timeout_s: float | None = None) -> DeviceMesh:
    """Create the three axes' process groups (every rank calls this, with the same degrees) and return this rank's
    place in them. The default process group must exist; ``dp * tp * pp`` must be its size. ``timeout_s``: how
    long a collective on these groups waits for a peer; pass the default group's, or a new group waits torch's
    default 30 minutes for a rank that died."""
    check_mesh(dp, tp, pp, dist.get_world_size())
    rank = dist.get_rank()
    mine = {}
    for axis in ("tp", "dp", "pp"):  # the same order on every rank: new_group is a collective
        for ranks in axis_groups(axis, dp, tp, pp):
            group = dist.new_group(ranks, timeout=timedelta(seconds=timeout_s) if timeout_s else None)
            if rank in ranks:
                mine[axis] = ranks, group
    at = coordinates(rank, dp, tp, pp)
    return DeviceMesh(dp, tp, pp, at["dp"], at["tp"], at["pp"], mine["dp"][0], mine["tp"][0], mine["pp"][0],
                      mine["dp"][1], mine["tp"][1], mine["pp"][1])
