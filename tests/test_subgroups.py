"""Step 10 runs step 3's ``allreduce_gradients(group=)`` and step 5's
``ShardedOptimizer(process_group=)`` over its data-parallel groups. The way an outsider would use
them: their own ``mp.spawn`` of 4 ranks, the world split into two groups of 2 ({0, 1} and {2, 3}, as
dp groups inside a tp 2 mesh), our files imported after the groups exist, a plain loop naming none
of our helpers; against PyTorch's DDP(process_group=) with a plain AdamW and with
ZeroRedundancyOptimizer(process_group=), torch.equal after every step. The two groups train on
different data, so a collective that leaked out of its group would show."""

import contextlib
import json
import os
import socket
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

# PyTorch's references, imported at the top as a script does: torch.distributed.optim imported once
# a group exists imports torch.distributed.nn.functional, which then holds the default group, so
# destroy_process_group cannot free it and gloo's threads run into interpreter exit ("terminate
# called without an active exception", SIGABRT; seen once in a full suite on the loaded 2-core
# machine). Our files are imported after the groups exist.
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

REPO = Path(__file__).resolve().parent.parent
STEPS, MICRO_BATCHES, WORLD_SIZE = 3, 2, 4


def toy(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(50, 8), nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 50))


def loss_of(model, step: int, micro_step: int, rank: int) -> torch.Tensor:
    x = torch.randint(
        0, 50, (4, 6), generator=torch.Generator().manual_seed(100 * step + 10 * micro_step + rank)
    )
    return (
        nn.functional.cross_entropy(model(x).flatten(0, 1), x.roll(1, 1).flatten()) / MICRO_BATCHES
    )


def params(model) -> list:
    return [p.detach().clone() for p in model.parameters()]


def worker(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE, timeout=timedelta(seconds=60))
    # every rank creates every group, in one order
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = groups[rank // 2]
    sys.path.insert(0, str(REPO / "step3_naive_dp"))
    from naive_dp import allreduce_gradients

    sys.path[0] = str(REPO / "step5_zero1")
    from zero1 import ShardedOptimizer

    seed = 7 + rank // 2  # the two groups start apart too: each group is a replica set of its own
    ours = toy(seed)
    references = [DDP(toy(seed), process_group=mine) for _ in range(2)]
    optimizers = [
        ShardedOptimizer(ours.parameters(), torch.optim.AdamW, process_group=mine, lr=0.05),
        torch.optim.AdamW(references[0].parameters(), lr=0.05),
        ZeroRedundancyOptimizer(
            references[1].parameters(), torch.optim.AdamW, process_group=mine, lr=0.05
        ),
    ]
    problems = []
    for step in range(STEPS):
        for micro_step in range(MICRO_BATCHES):
            loss_of(ours, step, micro_step, rank).backward()
            for ddp in references:
                with ddp.no_sync() if micro_step < MICRO_BATCHES - 1 else contextlib.nullcontext():
                    loss_of(ddp, step, micro_step, rank).backward()
        allreduce_gradients(ours, group=mine)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        for label, ddp in zip(("DDP + AdamW", "DDP + ZeroRedundancyOptimizer"), references):
            if not all(torch.equal(a, b) for a, b in zip(params(ours), params(ddp.module))):
                problems.append(f"rank {rank} step {step}: ours differs from {label}")
    theirs = [None] * WORLD_SIZE
    dist.all_gather_object(theirs, params(ours)[0].sum().item())
    del references, optimizers
    dist.destroy_process_group()
    Path(f"{out}.rank{rank}").write_text(
        json.dumps({"problems": problems, "first_weight_sums": theirs})
    )


def test_an_outsider_shards_adamw_over_a_subgroup(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "report")
    mp.spawn(worker, args=(port, out), nprocs=WORLD_SIZE, join=True)
    reports = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(WORLD_SIZE)]
    assert [p for r in reports for p in r["problems"]] == []
    sums = reports[0]["first_weight_sums"]
    assert sums[0] == sums[1] and sums[2] == sums[3], "the ranks of a group hold one replica"
    assert sums[0] != sums[2], "the two groups trained apart: nothing crossed between them"
