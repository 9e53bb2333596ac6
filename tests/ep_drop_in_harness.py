"""step12's expert_parallel.py dropped into someone else's script:
their own MoE layer, their own mp.spawn loop.

The outsider writes a top-1 MoE layer of their own (a router, argmax, their own sort by expert,
experts that are ``nn.Sequential``s in an ``nn.ModuleDict``), and uses two things of the idea file:
``ExpertParallel`` in place of running their experts, and ``reduce_gradients`` after backward. Each
of 2 ranks trains on its own batch with SGD for a few steps; the reference is the same layer with
every expert, in one process, running both ranks' batches one after the other and averaging the
gradients. After every step each rank's parameters must be ``torch.equal`` to the reference's (at 2
ranks every sum has two terms: the same bits). Prints JSON.

    python tests/ep_drop_in_harness.py OUT.json
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

REPO = Path(__file__).resolve().parent.parent
WORLD, EXPERTS, WIDTH, TOKENS, STEPS = 2, 4, 8, 12, 3


class MyMoE(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.router = nn.Linear(WIDTH, EXPERTS, bias=False)
        self.experts = nn.ModuleDict(
            {
                str(e): nn.Sequential(nn.Linear(WIDTH, 16), nn.ReLU(), nn.Linear(16, WIDTH))
                for e in range(EXPERTS)
            }
        )
        self.run_experts = self.whole

    def whole(self, tokens, counts, experts):
        return torch.cat(
            [experts[str(e)](chunk) for e, chunk in enumerate(tokens.split(counts.tolist()))]
        )

    def forward(self, x):
        probs = self.router(x).softmax(-1)
        gate, expert = probs.max(-1)
        order = torch.argsort(expert, stable=True)
        counts = torch.bincount(expert, minlength=EXPERTS)
        out = torch.empty_like(x).index_copy(
            0, order, self.run_experts(x[order], counts, self.experts)
        )
        return gate[:, None] * out


def batch(rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(TOKENS, WIDTH, generator=g), torch.randn(TOKENS, WIDTH, generator=g)


def worker(rank, port, queue):
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    sys.path.insert(0, str(REPO / "step12_expert_parallel"))
    from expert_parallel import ExpertParallel, Groups, reduce_gradients, shard_experts  # noqa: F401

    groups = Groups(ep=WORLD)
    mine = MyMoE()
    for e in [e for e in mine.experts if int(e) not in range(rank * 2, rank * 2 + 2)]:
        del mine.experts[e]  # this rank keeps experts 2r, 2r + 1
    mine.run_experts = ExpertParallel(groups, EXPERTS, "mine")
    reference = MyMoE()  # every expert, in this one process
    opt, ref_opt = (
        torch.optim.SGD(mine.parameters(), lr=0.5),
        torch.optim.SGD(reference.parameters(), lr=0.5),
    )
    equal = []
    for step in range(STEPS):
        x, target = batch(rank, step)
        ((mine(x) - target) ** 2).sum().backward()
        reduce_gradients(mine, groups)
        # the reference: both ranks' batches in turn, gradients averaged
        for source in range(WORLD):
            xs, ts = batch(source, step)
            (((reference(xs) - ts) ** 2).sum() / WORLD).backward()
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
        ref = dict(reference.named_parameters())
        equal.append(all(torch.equal(p, ref[n]) for n, p in mine.named_parameters()))
    routed = int(sum(n["received"] for n in mine.run_experts.traffic))
    queue.put(
        (rank, {"equal_every_step": equal, "experts": sorted(mine.experts), "received": routed})
    )
    dist.barrier()
    dist.destroy_process_group()


def main(rank, port, queue):
    worker(rank, port, queue)


if __name__ == "__main__":
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    mp.spawn(main, args=(port, queue), nprocs=WORLD, join=True)
    results = dict(queue.get() for _ in range(WORLD))
    Path(sys.argv[1]).write_text(json.dumps({str(r): v for r, v in results.items()}))
