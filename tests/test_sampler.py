"""ShardedSampler against torch's DistributedSampler over a broad grid, check_no_overlap on every
correct sharding and on planted bugs, and the check in real gloo processes, where a planted
overlap or a short shard must be caught on every rank."""

import itertools
import sys

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

from conftest import REPO, init_gloo, shutdown, spawn

sys.path.insert(0, str(REPO / "step2_sharded_data"))
import sampler as sampler_module  # noqa: E402
from sampler import ShardedSampler, check_no_overlap, checked_micro_batches  # noqa: E402

LENGTHS = list(range(0, 41)) + [97, 1000]  # empty, shorter than the world, not divisible, large
WORLD_SIZES = range(1, 9)


def shards(n, world_size, **kwargs):
    return [list(ShardedSampler(n, world_size, rank, **kwargs)) for rank in range(world_size)]


# ---- the sampler: exactly DistributedSampler ---------------------------------------------------


@pytest.mark.quick
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_yields_exactly_what_distributed_sampler_yields(world_size):
    for n, shuffle, drop_last, seed, epoch in itertools.product(
        LENGTHS, (True, False), (False, True), (0, 1, 1234), (0, 1, 5)
    ):
        for rank in range(world_size):
            ours = ShardedSampler(
                n, world_size, rank, shuffle=shuffle, seed=seed, drop_last=drop_last
            )
            theirs = DistributedSampler(
                range(n), world_size, rank, shuffle=shuffle, seed=seed, drop_last=drop_last
            )
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            case = (
                f"n={n} ws={world_size} rank={rank} shuffle={shuffle} "
                f"drop_last={drop_last} seed={seed} epoch={epoch}"
            )
            assert list(ours) == list(theirs), case
            assert len(ours) == len(theirs) == len(list(ours)), case


@pytest.mark.quick
def test_an_empty_dataset_gives_every_rank_an_empty_shard_like_torch():
    for world_size, drop_last in itertools.product(WORLD_SIZES, (False, True)):
        assert shards(0, world_size, drop_last=drop_last) == [[]] * world_size
        assert len(ShardedSampler(0, world_size, 0, drop_last=drop_last)) == 0


@pytest.mark.quick
def test_every_rank_gets_the_same_number_of_samples():
    for n, world_size, drop_last in itertools.product(range(0, 30), WORLD_SIZES, (False, True)):
        assert len({len(shard) for shard in shards(n, world_size, drop_last=drop_last)}) == 1


@pytest.mark.quick
def test_a_new_shuffle_each_epoch_the_same_on_every_rank_and_on_replay():
    sampler = ShardedSampler(100, 2, 0, seed=7)
    first = list(sampler)
    sampler.set_epoch(1)
    assert list(sampler) != first
    sampler.set_epoch(0)
    assert list(sampler) == first
    # Two independently built samplers for the same rank agree: no hidden state, no global RNG.
    torch.manual_seed(123)
    other = ShardedSampler(100, 2, 0, seed=7)
    assert list(other) == first


@pytest.mark.quick
@pytest.mark.parametrize("rank, world_size", [(2, 2), (5, 2), (-1, 2), (0, 0), (0, -1)])
def test_bad_rank_or_world_size_is_refused_like_torch(rank, world_size):
    with pytest.raises(ValueError, match="rank|num_replicas"):
        ShardedSampler(10, world_size, rank)
    with pytest.raises(ValueError):
        DistributedSampler(range(10), world_size, rank)


@pytest.mark.quick
def test_negative_dataset_length_is_refused():
    with pytest.raises(ValueError, match="dataset_len"):
        ShardedSampler(-1, 2, 0)


# ---- the check, in one process ---------------------------------------------------------------


def fake_world(monkeypatch, gathered):
    """Make check_no_overlap see an initialised group whose all-gather returns ``gathered``."""
    monkeypatch.setattr(sampler_module.dist, "is_available", lambda: True)
    monkeypatch.setattr(sampler_module.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(sampler_module.dist, "get_world_size", lambda group=None: len(gathered))
    monkeypatch.setattr(
        sampler_module.dist,
        "all_gather_object",
        lambda out, obj, group=None: out.__setitem__(slice(None), [list(s) for s in gathered]),
    )


@pytest.mark.quick
def test_check_passes_on_every_correct_sharding(monkeypatch):
    for n, world_size, drop_last in itertools.product(
        list(range(0, 41)) + [97], WORLD_SIZES, (False, True)
    ):
        gathered = shards(n, world_size, seed=5, drop_last=drop_last)
        fake_world(monkeypatch, gathered)
        summary = check_no_overlap(gathered[0], n, world_size, drop_last)
        per_rank = n // world_size if drop_last else -(-n // world_size)
        assert summary == {
            "ranks": world_size,
            "per_rank": per_rank,
            "padding": 0 if drop_last else per_rank * world_size - n,
            "distinct": per_rank * world_size if drop_last else n,
            "ok": True,
        }, (n, world_size, drop_last)


@pytest.mark.quick
def test_check_in_a_world_of_one_without_a_process_group():
    assert not dist.is_initialized()
    assert check_no_overlap([3, 1, 0, 4, 2], 5, 1) == {
        "ranks": 1,
        "per_rank": 5,
        "distinct": 5,
        "padding": 0,
        "ok": True,
    }
    with pytest.raises(RuntimeError, match="sample 3 is on rank 0 2 times"):
        check_no_overlap([0, 1, 2, 3, 3], 5, 1)
    with pytest.raises(RuntimeError, match="holds 3 samples, expected 5"):
        check_no_overlap([0, 1, 2], 5, 1)
    with pytest.raises(RuntimeError, match="sample 7 on rank 0 is outside"):
        check_no_overlap([0, 1, 2, 3, 7], 5, 1)
    with pytest.raises(RuntimeError, match="from 1 ranks, but world_size is 2"):
        check_no_overlap([0, 1, 2, 3, 4], 5, 2)


@pytest.mark.parametrize(
    "plant, message",
    [
        ("copy", "sample 6 is on ranks 0 and 1: 4 repeated samples, but padding explains only 2"),
        ("twice", "sample 8 is on rank 2 2 times: 3 repeated samples, but padding explains only 2"),
        ("short", "different numbers of samples .*rank 0: 4, rank 1: 4, rank 2: 3"),
        ("long", "every rank holds 5 samples, expected 4"),
    ],
)
@pytest.mark.quick
def test_check_names_the_planted_bug(monkeypatch, plant, message):
    # 10 samples on 3 ranks: 0 and 1 are the padding
    gathered = [[0, 3, 6, 9], [1, 4, 7, 0], [2, 5, 8, 1]]
    assert gathered == shards(10, 3, shuffle=False)
    if plant == "copy":
        gathered[1] = list(gathered[0])  # rank 1 computed rank 0's shard
    elif plant == "twice":
        gathered[2] = [2, 8, 8, 1]
    elif plant == "short":
        gathered[2] = gathered[2][:-1]
    elif plant == "long":
        gathered = [shard + [shard[0]] for shard in gathered]
    fake_world(monkeypatch, gathered)
    with pytest.raises(RuntimeError, match=message):
        check_no_overlap(gathered[0], 10, 3)


@pytest.mark.quick
def test_check_with_drop_last_allows_no_repeats(monkeypatch):
    gathered = shards(10, 3, seed=1, drop_last=True)  # 9 of the 10 samples, each once
    fake_world(monkeypatch, gathered)
    assert check_no_overlap(gathered[0], 10, 3, drop_last=True) == {
        "ranks": 3,
        "per_rank": 3,
        "distinct": 9,
        "padding": 0,
        "ok": True,
    }
    gathered[2][0] = gathered[0][0]
    fake_world(monkeypatch, gathered)
    with pytest.raises(RuntimeError, match=f"sample {gathered[0][0]} is on ranks 0 and 2"):
        check_no_overlap(gathered[0], 10, 3, drop_last=True)


# ---- the check across real processes over gloo ---------------------------------------------


def shard_worker(rank, world_size, port, queue, dataset_len, drop_last, plant):
    """One rank: build the shard, maybe plant a bug,
    run the collective check, report what happened."""
    init_gloo(rank, world_size, port)
    shard = list(ShardedSampler(dataset_len, world_size, rank, seed=3, drop_last=drop_last))
    if plant == "overlap" and rank == 1:  # rank 1 computes rank 0's shard
        shard = list(ShardedSampler(dataset_len, world_size, 0, seed=3, drop_last=drop_last))
    elif plant == "short" and rank == world_size - 1:  # the last rank would run a step fewer
        shard = shard[:-1]
    try:
        result = {"summary": check_no_overlap(shard, dataset_len, world_size, drop_last)}
    except RuntimeError as error:
        result = {"error": str(error)}
    shutdown()  # its barrier: every rank got here, verdict or not; the group is still in step
    queue.put((rank, result))


def run_world(world_size, dataset_len=10, drop_last=False, plant=None) -> list[dict]:
    results = spawn(shard_worker, world_size, dataset_len, drop_last, plant)
    return [results[rank] for rank in range(world_size)]


@pytest.mark.parametrize("world_size, drop_last", [(2, False), (3, False), (3, True)])
def test_real_processes_pass_the_check_on_real_shards(world_size, drop_last):
    per_rank = 10 // world_size if drop_last else -(-10 // world_size)
    padding = 0 if drop_last else per_rank * world_size - 10
    distinct = per_rank * world_size if drop_last else 10
    expected = {
        "ranks": world_size,
        "per_rank": per_rank,
        "distinct": distinct,
        "padding": padding,
        "ok": True,
    }
    assert run_world(world_size, drop_last=drop_last) == [{"summary": expected}] * world_size


@pytest.mark.parametrize("world_size", [2, 3])
def test_real_processes_all_catch_a_planted_overlap(world_size):
    results = run_world(world_size, plant="overlap")
    assert all("is on ranks 0 and 1" in r.get("error", "") for r in results), results
    assert len({r["error"] for r in results}) == 1  # the same verdict on every rank


def test_real_processes_all_catch_a_short_shard():
    results = run_world(3, plant="short")
    assert all("different numbers of samples" in r.get("error", "") for r in results), results


def loop_worker(rank, world_size, port, queue):
    """One rank of the trainers' bookkeeping: three steps of two micro-batches from
    checked_micro_batches (an epoch is 5 micro-batches per rank, so steps 1 and 3 start one), and
    the loss mean of distributed.py."""
    import distributed
    from data import MicroBatches

    init_gloo(rank, world_size, port)
    blocks = torch.arange(40).view(10, 4)
    batches = MicroBatches(blocks, ShardedSampler(10, world_size, rank, seed=3), 1)
    twin = MicroBatches(blocks, ShardedSampler(10, world_size, rank, seed=3), 1)  # drawn one by one
    steps = []
    for _ in range(3):
        micro_batches, shard_check = checked_micro_batches(batches, 2)
        expected = [twin.next() for _ in range(2)]
        steps.append(
            (
                all(
                    torch.equal(a, b)
                    for got, want in zip(micro_batches, expected)
                    for a, b in zip(got, want)
                ),
                shard_check,
            )
        )
    # rank r summed 3 losses to r + 1: the mean over every rank's losses is (1 + 2) / 6, exactly
    mean = distributed.mean_over_ranks(torch.tensor(float(rank + 1)), 3)
    shutdown()
    queue.put((rank, {"steps": steps, "mean": mean}))


def test_the_micro_batches_are_checked_at_each_epoch_start_and_the_loss_averaged_over_ranks():
    results = spawn(loop_worker, 2)
    summary = {"ranks": 2, "per_rank": 5, "distinct": 10, "padding": 0, "ok": True}
    for rank in (0, 1):
        assert results[rank] == {
            "steps": [(True, summary), (True, None), (True, summary)],
            "mean": 0.5,
        }
