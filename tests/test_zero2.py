"""ShardedGradientDDP (step 6, ZeRO-2) against PyTorch DDP, in real gloo processes.

Each case runs two optimiser steps of ACCUM micro-batches (no_sync on all but the last) through
PyTorch DDP and through ShardedGradientDDP, from the same weights and data, and requires each rank's
``gradient_shards[c]`` after the second step to be torch.equal to its slice of DDP's averaged
gradient, flattened in bucket order and zero-padded to a multiple of the world size. Float32 at
world size 2 (order-free there) and the exact float64 mode at world size 3 (DDP with a float64
communication hook, as in step 1).
"""

import contextlib
import gc
import sys
import time
import traceback

import pytest
import torch
import torch.distributed as dist

from conftest import REPO, init_gloo, spawn

ACCUM = 3  # micro-batches per optimiser step
STEPS = 2  # optimiser steps per case: the second must not see anything of the first
WORLDS = {2: torch.float32, 3: torch.float64}  # world size -> reduce dtype


class Toy(torch.nn.Module):
    """A tied weight (input embedding = output layer, as in GPT-2), a frozen bias, parameter sizes
    that neither 2 nor 3 divide, and ``extra``, which takes part only when asked."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(37, 7)
        self.hidden = torch.nn.Linear(7, 13)
        self.hidden.bias.requires_grad_(False)
        self.extra = torch.nn.Linear(13, 13)
        self.down = torch.nn.Linear(13, 7)
        self.scale = torch.nn.Parameter(torch.ones(1))
        self.out = torch.nn.Linear(7, 37, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, x, use_extra=True):
        h = torch.tanh(self.hidden(self.embed(x)))
        if use_extra:
            h = h + torch.tanh(self.extra(h))
        return self.out(torch.tanh(self.down(h)) * self.scale).mean(dim=1)


def fresh() -> Toy:
    torch.manual_seed(0)
    return Toy()


def float64_allreduce_hook(process_group, bucket):
    """PyTorch DDP's side of the exact mode (as step1_torch_ddp/train.py):
    float64 sum, divide, round once."""
    buffer = bucket.buffer()
    future = dist.all_reduce(
        buffer.to(torch.float64), group=process_group, async_op=True
    ).get_future()
    return future.then(
        lambda fut: buffer.copy_(fut.value()[0].div_(dist.get_world_size(process_group)))
    )


def accumulate(wrapped, rank, step, extra_in, after_backward=lambda micro: None) -> None:
    for micro in range(ACCUM):
        with wrapped.no_sync() if micro < ACCUM - 1 else contextlib.nullcontext():
            seed = 1000 * step + 100 * rank + micro
            x = torch.randint(0, 37, (4, 5), generator=torch.Generator().manual_seed(seed))
            wrapped(x, use_extra=micro in extra_in).pow(2).mean().div(2).backward()
        after_backward(micro)


def padded(numel: int, world_size: int) -> int:
    return -(-numel // world_size) * world_size


def expected_shards(ours, reference_grads, rank, world_size) -> list:
    """DDP's averaged gradient, flattened in bucket order,
    zero-padded, and this rank's slice of it."""
    shards = []
    for params in ours.bucket_params:
        flat = torch.cat(
            [reference_grads.get(ours.names[p], torch.zeros_like(p)).flatten() for p in params]
        )
        flat = torch.cat([flat, flat.new_zeros(padded(flat.numel(), world_size) - flat.numel())])
        shards.append(flat.chunk(world_size)[rank])
    return shards


def run_case(
    rank,
    world_size,
    dtype,
    cap_mb,
    extra_in=range(ACCUM),
    find_unused=False,
    reduce_every=False,
    extra_on_ranks=None,
):
    """STEPS optimiser steps through DDP and through ShardedGradientDDP;
    what the tests check, of the last."""
    import comm_accounting
    from zero2 import ShardedGradientDDP

    extra_in = extra_in if extra_on_ranks is None or rank in extra_on_ranks else ()
    reference = torch.nn.parallel.DistributedDataParallel(fresh(), find_unused_parameters=True)
    if dtype == torch.float64:
        reference.register_comm_hook(None, float64_allreduce_hook)
    for step in range(STEPS):
        reference.zero_grad(set_to_none=True)
        accumulate(reference, rank, step, extra_in)
    grads = {
        n: p.grad.clone() for n, p in reference.module.named_parameters() if p.grad is not None
    }
    del reference

    model, seen = fresh(), {"gradient ready": [], "grad None after our hook": [], "full grads": []}
    # a hook registered before ours runs before ours: when the gradient is ready
    for p in model.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(
                lambda p: seen["gradient ready"].append(time.perf_counter())
            )
    ours = ShardedGradientDDP(
        model,
        bucket_cap_mb=cap_mb,
        first_bucket_cap_mb=cap_mb,
        reduce_dtype=dtype,
        find_unused_parameters=find_unused,
        reduce_every_micro_batch=reduce_every,
    )
    for p in model.parameters():  # ... and one registered after ours runs right after ours
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(
                lambda p: seen["grad None after our hook"].append(p.grad is None)
            )
    # the same weights in every step (no optimiser): only the data changes
    for step in range(STEPS):
        # keep the last step's: forget the construction's broadcast, earlier steps
        comm_accounting.take_comm_bytes()
        for bucket in ours.buckets:
            bucket.timeline = []
        for observations in seen.values():
            observations.clear()
        accumulate(
            ours,
            rank,
            step,
            extra_in,
            lambda micro: seen["full grads"].append(
                sum(p.grad is not None for p in model.parameters())
            ),
        )
        try:
            error = None
            ours.finish_gradient_synchronization()
        except RuntimeError as e:
            error = str(e)
    want = expected_shards(ours, grads, rank, world_size)
    lp = [padded(sum(p.numel() for p in params), world_size) for params in ours.bucket_params]
    return {
        "error": error,
        "buckets": len(ours.buckets),
        "bucketed": sorted(ours.names[p] for params in ours.bucket_params for p in params),
        "bitwise mismatches": [
            c
            for c, (a, b) in enumerate(zip(ours.gradient_shards, want))
            if a.dtype != torch.float32 or a.shape != b.shape or not torch.equal(a, b)
        ],
        "max abs diff": max((a - b).abs().max().item() for a, b in zip(ours.gradient_shards, want)),
        "grads alive": [n for n, p in ours.module.named_parameters() if p.grad is not None],
        "buffers alive": [
            b.index
            for b in ours.buckets
            if any(x is not None for x in (b.buffer, b.work, b.output))
        ],
        "shard bytes": sum(s.numel() * s.element_size() for s in ours.gradient_shards),
        "expected shard bytes": 4 * sum(lp) // world_size,
        "padded bytes": sum(lp) * dtype.itemsize,
        "comm": comm_accounting.take_comm_bytes(),
        "full grads after each backward": seen["full grads"],
        "grad None after our hook": seen["grad None after our hook"],
        "first launch before backward ends": min(
            e["launched"] for b in ours.buckets for e in b.timeline
        )
        < max(seen["gradient ready"]),
        "timeline complete": all(b.timeline for b in ours.buckets)
        and all(e["finished"] >= e["launched"] for b in ours.buckets for e in b.timeline),
        "unused names": sorted(ours.unused_parameters),
    }


def half_cap(world_size) -> float:
    """A cap (MiB) that splits the toy's gradients into exactly two buckets."""
    # step 4's, copied: the buckets ShardedGradientDDP fills
    from bucketed_ddp import assign_buckets

    params = [p for p in fresh().parameters() if p.requires_grad][::-1]
    for k in range(1, len(params)):
        cap = sum(p.numel() * 4 for p in params[:k])
        if len(assign_buckets(params, cap, cap)) == 2:
            return cap / 2**20
    raise AssertionError("no cap splits the toy into two buckets")


def worker(rank, world_size, port, queue):
    sys.path.insert(0, str(REPO / "step6_zero2"))
    init_gloo(rank, world_size, port)
    dtype, results = WORLDS[world_size], {}
    try:
        caps = {
            "one parameter per bucket": 1e-9,
            "two buckets": half_cap(world_size),
            "one bucket": 100.0,
        }
        for name, cap in caps.items():
            results[name] = run_case(rank, world_size, dtype, cap)
        # extra takes part in the first micro-batch only:
        # its accumulated gradient must still be reduced
        results["used earlier only"] = run_case(
            rank, world_size, dtype, caps["two buckets"], extra_in=[0]
        )
        results["reduce every micro-batch"] = run_case(
            rank, world_size, dtype, caps["two buckets"], reduce_every=True
        )
        results["every micro-batch, used earlier only"] = run_case(
            rank, world_size, dtype, caps["two buckets"], extra_in=[0], reduce_every=True
        )
        results["never used"] = run_case(rank, world_size, dtype, caps["two buckets"], extra_in=())
        results["never used, find_unused"] = run_case(
            rank, world_size, dtype, caps["two buckets"], extra_in=(), find_unused=True
        )
        results["used on rank 0 only"] = run_case(
            rank, world_size, dtype, caps["two buckets"], extra_on_ranks=[0]
        )
        # after the errors above: every rank still issued every collective, nobody hangs
        dist.barrier()
        queue.put((rank, (results, None)))
    except Exception:
        queue.put((rank, (results, traceback.format_exc())))
    finally:
        gc.collect()  # no DDP reducer may outlive the process group (see distributed.shutdown)
        dist.destroy_process_group()


@pytest.fixture(
    scope="module", params=[pytest.param(2, marks=pytest.mark.quick), 3], ids=lambda n: f"world{n}"
)
def world(request):
    got = spawn(worker, request.param)
    for rank, (_, error) in got.items():
        assert error is None, f"rank {rank} failed:\n{error}"
    return request.param, {rank: r for rank, (r, _) in got.items()}


def each_rank(world, case):
    world_size, results = world
    return [(rank, results[rank][case]) for rank in range(world_size)]


TRAINABLE = [
    "down.bias",
    "down.weight",
    "embed.weight",
    "extra.bias",
    "extra.weight",
    "hidden.weight",
    "scale",
]
BITWISE_CASES = [
    "one parameter per bucket",
    "two buckets",
    "one bucket",
    "used earlier only",
    "used on rank 0 only",
]


@pytest.mark.parametrize("case", BITWISE_CASES)
def test_gradient_shards_are_bitwise_slices_of_ddp_gradients(world, case):
    expected_buckets = {"one parameter per bucket": len(TRAINABLE), "one bucket": 1}.get(case, 2)
    for rank, r in each_rank(world, case):
        assert r["buckets"] == expected_buckets
        assert r["bucketed"] == TRAINABLE  # tied weight once, frozen bias nowhere
        assert r["bitwise mismatches"] == [], (
            f"rank {rank}: buckets {r['bitwise mismatches']} differ from DDP"
        )


@pytest.mark.parametrize("case", BITWISE_CASES + ["reduce every micro-batch"])
def test_after_the_sync_point_only_the_shards_hold_gradient_memory(world, case):
    world_size, _ = world
    for _, r in each_rank(world, case):
        assert r["grads alive"] == [] and r["buffers alive"] == []
        # 4 * sum(Lp) / N: float32, a 1/N share
        assert r["shard bytes"] == r["expected shard bytes"]


def test_each_full_gradient_is_freed_as_soon_as_it_is_in_its_bucket(world):
    for _, r in each_rank(world, "two buckets"):
        # default no_sync: full gradients accumulate
        # locally until the synchronised backward frees them
        assert r["full grads after each backward"] == [len(TRAINABLE)] * (ACCUM - 1) + [0]
        assert r["grad None after our hook"] == [False] * len(TRAINABLE) * (ACCUM - 1) + [
            True
        ] * len(TRAINABLE)
    for _, r in each_rank(world, "reduce every micro-batch"):
        # never a full gradient between micro-batches
        assert r["full grads after each backward"] == [0] * ACCUM
        assert all(r["grad None after our hook"])


def test_each_gradient_byte_is_reduce_scattered_once_per_optimiser_step(world):
    """4 * sum(Lp) bytes in float32 (8 * sum(Lp) in the float64 mode), whatever the accumulation."""
    world_size, _ = world
    for _, r in each_rank(world, "two buckets"):
        assert r["comm"] == {"reduce_scatter": r["padded bytes"]}
        assert (
            r["padded bytes"]
            == r["expected shard bytes"] * world_size * WORLDS[world_size].itemsize // 4
        )


def test_reducing_every_micro_batch_moves_the_gradient_accum_times_and_agrees_within_1e6(world):
    """Not bitwise: DDP (and the default mode) sums the micro-batches in float32 on each rank, then
    sums over ranks; here each micro-batch is summed over ranks first and the results are added, so
    the same numbers are added in another order, and float32 addition is not associative. In the
    float64 mode each micro-batch's average is rounded to float32 and added in float32, where DDP
    rounds each rank's float32 micro-batch sum: other roundings again."""
    for case in ("reduce every micro-batch", "every micro-batch, used earlier only"):
        for rank, r in each_rank(world, case):
            assert r["error"] is None
            assert r["comm"] == {"reduce_scatter": ACCUM * r["padded bytes"]}
            assert r["max abs diff"] <= 1e-6, f"{case}, rank {rank}: {r['max abs diff']}"
    for _, r in each_rank(world, "two buckets"):
        assert r["max abs diff"] == 0  # the tolerance above is not hiding a broken default mode


def test_the_first_bucket_is_launched_before_backward_ends(world):
    for _, r in each_rank(world, "one parameter per bucket"):
        assert r["first launch before backward ends"] and r["timeline complete"]


def test_a_parameter_no_rank_used_is_a_clear_error_without_a_hang(world):
    for _, r in each_rank(world, "never used"):
        assert (
            "extra.weight" in r["error"]
            and "extra.bias" in r["error"]
            and "find_unused_parameters" in r["error"]
        )
    for _, r in each_rank(world, "never used, find_unused"):
        assert r["error"] is None and r["unused names"] == ["extra.bias", "extra.weight"]
        # their slices are zero, everything else is DDP's average
        assert r["bitwise mismatches"] == []


def test_a_rank_that_never_gets_a_gradient_errors_while_its_peers_carry_on(world):
    for rank, r in each_rank(world, "used on rank 0 only"):
        if rank == 0:
            assert r["error"] is None
        else:
            assert "extra.weight" in r["error"] and "extra.bias" in r["error"]
