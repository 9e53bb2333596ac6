"""What gloo does underneath: time all-reduce, reduce-scatter and all-gather of the same buffer.

    torchrun --standalone --nproc_per_node=2 compare/bench_collectives.py
    torchrun --standalone --nproc_per_node=4 compare/bench_collectives.py --mib 4 --repeats 30

A bandwidth-optimal reduce-scatter (the first half of a ring all-reduce) moves (N-1)/N of the
buffer per rank and should take about half an all-reduce's time; an all-gather the other half.
The medians say how close gloo's implementations come to that on this machine.
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

# config.py, as every step has it
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "common"))
from config import OneLineParser, UserError, exit_on_user_error  # noqa: E402


def timed(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats + 1):
        dist.barrier()
        started = time.perf_counter()
        fn()
        dist.barrier()
        times.append(time.perf_counter() - started)
    return times[1:]  # the first call sets up connections and buffers


def main():
    parser = OneLineParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--mib", type=float, default=8.0, help="buffer size per rank (MiB, float32)"
    )
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    if not args.mib > 0 or args.repeats < 1:
        raise UserError("--mib must be positive and --repeats at least 1")
    # torchrun tells each rank its place; without it there is no group to join
    if "RANK" not in os.environ:
        raise UserError(
            "start it under torchrun: torchrun --standalone --nproc_per_node=2 "
            "compare/bench_collectives.py"
        )
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    n = dist.get_world_size()
    numel = int(args.mib * 2**20 / 4) // n * n
    full, shard = torch.ones(numel), torch.ones(numel // n)
    # torch 2.13's names; 2.11 has only all_gather_into_tensor
    # / reduce_scatter_tensor (common/comm_accounting.py)
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    results = {
        "all_reduce": timed(lambda: dist.all_reduce(full), args.repeats),
        "reduce_scatter_single": timed(lambda: reduce_scatter(shard, full), args.repeats),
        "all_gather_single": timed(lambda: all_gather(full, shard), args.repeats),
    }
    if dist.get_rank() == 0:
        ar = statistics.median(results["all_reduce"])
        print(
            f"gloo, {n} ranks, {numel * 4 / 2**20:.1f} MiB float32 per rank, {args.repeats} repeats"
        )
        print(f"{'collective':<24} {'median':>9} {'min':>9} {'max':>9} {'/ all_reduce':>13}")
        for name, t in results.items():
            m = statistics.median(t)
            print(
                f"{name:<24} {m * 1e3:>7.2f}ms {min(t) * 1e3:>7.2f}ms "
                f"{max(t) * 1e3:>7.2f}ms {m / ar:>13.2f}"
            )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    exit_on_user_error(main)
