"""Speed of gradient synchronisation: PyTorch DDP vs BucketedDDP (step 4) vs naive per-parameter
all-reduce (step 3), in one torchrun job on the default workload, interleaved.

    torchrun --standalone --nproc_per_node=2 compare/bench_ddp.py              # ~2 min on 2 CPU cores
    torchrun --standalone --nproc_per_node=2 compare/bench_ddp.py --rounds 9 --steps-per-round 10

Each round runs every variant for a few optimiser steps, in a rotating order (so no variant always
runs first or after the same neighbour); the first round is a warm-up and is not counted. Reported:
median optimiser-step time over rounds with min and max, tokens/s, the ratio of DDP's median
time to the variant's (above 1.0 = faster than DDP), and the median of that ratio taken round by
round (each round's DDP time over the same round's variant time), which cancels slow phases of
the machine that hit both.
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

REPO_ROOT = Path(__file__).resolve().parent.parent
for folder in ("step4_hooks_bucketing", "step3_naive_dp"):  # their modules, and the common ones they carry
    sys.path.insert(0, str(REPO_ROOT / folder))
from bucketed_ddp import BucketedDDP  # noqa: E402
from config import build_parser  # noqa: E402
from distributed import shutdown  # noqa: E402
from model import build_model, language_model_loss  # noqa: E402
from naive_dp import allreduce_gradients, broadcast_parameters  # noqa: E402
from seeding import seed_everything  # noqa: E402
from training import make_optimizer  # noqa: E402


class Variant:
    """A model, its data-parallel wrapper and optimiser, and how one synchronised step runs."""

    def __init__(self, name, config, vocab_size):
        self.name = name
        model = build_model(config, vocab_size, config["seed"])
        if name == "pytorch DDP":
            self.wrapped = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=config["bucket_cap_mb"])
        elif name == "BucketedDDP":
            self.wrapped = BucketedDDP(model, bucket_cap_mb=config["bucket_cap_mb"])
        else:
            broadcast_parameters(model)
            self.wrapped = model
        self.model, self.optimizer = model, make_optimizer(model.named_parameters(), config)

    def step(self, batches, accum):
        for micro, (inputs, targets) in enumerate(batches):
            syncing = micro == accum - 1
            no_sync = getattr(self.wrapped, "no_sync", None)
            context = no_sync() if (no_sync and not syncing) else torch.enable_grad()
            with context:
                (language_model_loss(self.wrapped, inputs, targets) / accum).backward()
        if self.name == "BucketedDDP":
            self.wrapped.finish_gradient_synchronization()
        elif self.name == "naive (step 3)":
            allreduce_gradients(self.model)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def time_rounds(config, rounds, steps_per_round, rank) -> dict:
    """Seconds per optimiser step of each variant, one list entry per round. The variants (DDP's C++
    reducer among them) are freed when this returns, before the process group goes: see shutdown()."""
    vocab_size, accum, micro = 2048, config["grad_accum"], config["micro_batch_size"]
    generator = torch.Generator().manual_seed(rank)
    tokens_in = [torch.randint(0, vocab_size, (micro, config["seq_len"] + 1), generator=generator) for _ in range(accum)]
    batches = [(block[:, :-1], block[:, 1:]) for block in tokens_in]
    variants = [Variant(name, config, vocab_size) for name in ("pytorch DDP", "BucketedDDP", "naive (step 3)")]
    times = {v.name: [] for v in variants}
    for round_ in range(rounds + 1):
        order = variants[round_ % 3:] + variants[: round_ % 3]
        for variant in order:
            dist.barrier()
            started = time.perf_counter()
            for _ in range(steps_per_round):
                variant.step(batches, accum)
            dist.barrier()
            if round_ > 0:
                times[variant.name].append((time.perf_counter() - started) / steps_per_round)
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=21, help="timed rounds (plus one warm-up)")
    parser.add_argument("--steps-per-round", type=int, default=5)
    args, rest = parser.parse_known_args()
    parser = build_parser("bench")
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0)
    config = vars(parser.parse_args(rest))
    seed_everything(config["seed"])
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    times = time_rounds(config, args.rounds, args.steps_per_round, rank)
    if rank == 0:
        tokens = config["micro_batch_size"] * config["grad_accum"] * config["seq_len"] * world_size
        ddp = statistics.median(times["pytorch DDP"])
        print(f"{world_size} ranks, gloo, {torch.get_num_threads()} thread(s) each; {args.rounds} rounds x "
              f"{args.steps_per_round} steps; global batch {tokens:,} tokens")
        print(f"{'variant':<16} {'median step':>12} {'min':>8} {'max':>8} {'tokens/s':>9} {'DDP time / time':>16} "
              f"{'per-round ratio: median [min, max]':>36}")
        for name, t in times.items():
            m = statistics.median(t)
            # Paired by round: DDP and the variant ran back to back, so slow phases of the machine cancel.
            paired = [d / v for d, v in zip(times["pytorch DDP"], t)]
            print(f"{name:<16} {m * 1e3:>10.1f}ms {min(t) * 1e3:>6.1f}ms {max(t) * 1e3:>6.1f}ms "
                  f"{tokens / m:>9,.0f} {ddp / m:>16.3f} {statistics.median(paired):>20.3f} "
                  f"[{min(paired):.3f}, {max(paired):.3f}]")
    shutdown()


if __name__ == "__main__":
    main()
