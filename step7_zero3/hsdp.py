"""HSDP (hybrid sharding): ZeRO-3 inside groups of N/R ranks,
plain data parallelism across R of them.

ZeRO-3 over all N ranks (zero3.py) all-gathers every unit twice a step and reduce-scatters it once,
each time over all N ranks: across nodes, every one of those goes over the slow links. ``--replicate
R`` keeps the sharding inside a group small enough to sit on one node and copies that group R times,
as FSDP2's 2-D mesh (``fully_shard(mesh=init_device_mesh(..., (R, N // R),
mesh_dim_names=("replicate", "shard")))``) and ZeRO++'s hierarchical partitioning do:

1. **Two groups from one array.** The ranks are ``arange(N).view(R, S)``, S = N / R: a row is a
   *shard group* (ranks ``r*S .. r*S + S-1``), a column a *replicate group* (ranks ``s, s+S, s+2S,
   ...``). A launcher puts ``--nproc_per_node`` consecutive ranks on one node, so with S = ranks per
   node a row is a node: every all-gather and reduce-scatter (the parameters, 3x per step) stays on
   the node's links, and only the all-reduce of the 1/S gradient shard crosses nodes. Every rank
   creates every group, in the same order (``dist.new_group`` is a collective over the world).
2. **ZeRO-3 inside the row.** Each unit is padded to a multiple of S and cut into S shards, rank
   ``s`` of a row keeping shard ``s``: the rows hold the same shards, so the memory per rank is Psi
   / S for the parameters, gradients and AdamW's state each (the formula with N / R in place of N).
3. **The gradient: reduce-scatter in the row, then all-reduce across the column** (``average``). In
   float32 (and bf16), as FSDP2's ``foreach_reduce`` with ``ReduceOp.AVG`` in both: the row's sum
   divided by S, then the column's sum of those divided by R. In float64 (the exact mode), both sums
   first, divided by N once and rounded to float32 once, as DDP's exact mode (FSDP2 divides by about
   sqrt(N) before and the rest after: at N = 4, 2 and 2, powers of two, so the same bits). Every
   replica then holds the same gradient shard, bit for bit, and steps it the same way.
4. **Whoever reads shards reads the row.** The full parameters (export) are gathered in the shard
   group; the norms (clipping, the parameter norm) sum squares over the shard group only: the other
   rows hold the same elements, counted R times over the world. Checkpoints: every rank writes its
   own pieces, as without replicas (it writes its own RNG anyway); the reader keeps one copy of each
   range, so a checkpoint resumes at any R and N the data stream allows.
"""

from datetime import timedelta
from typing import NamedTuple

import torch
import torch.distributed as dist

from comm_accounting import count_collective


class HybridMesh(NamedTuple):
    """This rank's place in the (replicate, shard) array and its two groups (rule 1)."""

    replicate: int  # R: copies of the sharded model
    shard_size: int  # S = N / R: ranks each unit is cut over
    replicate_rank: int  # the row
    shard_rank: int  # the place in the row: which shard this rank holds
    shard_group: object  # the row (the world when R = 1)
    replicate_group: object  # the column (None when R = 1)


def replicate_problem(replicate: int, world_size: int) -> str | None:
    """What is wrong with R for N ranks, in one sentence that says what to do; None: nothing."""
    if replicate < 1:
        return f"--replicate {replicate}: the number of replicas must be at least 1"
    if world_size % replicate:
        return (
            f"--replicate {replicate} does not divide the {world_size} ranks: choose R "
            "with N / R whole "
            f"(the ranks of one node, typically), or launch a multiple of {replicate} ranks"
        )
    return None


def hybrid_mesh(replicate: int = 1, timeout_s: float | None = None) -> HybridMesh:
    """The groups of rule 1 for this rank (every rank calls it, with the same R). R = 1: the world
    is the one shard group and no group is created (ZeRO-3 as zero3.py does it alone)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if problem := replicate_problem(replicate, world):
        raise ValueError(problem)
    shard = world // replicate
    if replicate == 1:
        return HybridMesh(1, world, 0, rank, dist.group.WORLD, None)
    ranks = torch.arange(world).view(replicate, shard)
    # else a dead peer is waited on for 30 minutes
    timeout = timedelta(seconds=timeout_s) if timeout_s else None
    mine = {}
    # rows, then columns: the same order everywhere
    for kind, lines in (("shard", ranks), ("replicate", ranks.T)):
        for line in lines.tolist():
            group = dist.new_group(line, timeout=timeout)
            if rank in line:
                mine[kind] = group
    return HybridMesh(
        replicate, shard, rank // shard, rank % shard, mine["shard"], mine["replicate"]
    )


def average(output: torch.Tensor, mesh: HybridMesh, reduce_dtype: torch.dtype) -> torch.Tensor:
    """Rule 3: ``output``, this rank's shard of the row's summed gradient (the reduce-scatter's,
    waited on), made the mean over all N ranks, in place. R = 1: divided by N, as zero3.py
    always did."""
    if mesh.replicate == 1:
        return output.div_(mesh.shard_size)
    # FSDP2: AVG in the row, then AVG across the rows
    if reduce_dtype in (torch.float32, torch.bfloat16):
        output.div_(mesh.shard_size)
        count_collective("all_reduce", output)
        dist.all_reduce(output, group=mesh.replicate_group)
        return output.div_(mesh.replicate)
    # float64: exact sums, one division, one rounding (by the caller)
    count_collective("all_reduce", output)
    dist.all_reduce(output, group=mesh.replicate_group)
    return output.div_(mesh.replicate * mesh.shard_size)
