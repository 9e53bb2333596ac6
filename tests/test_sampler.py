"""ShardedSampler against torch's DistributedSampler over a broad grid, and the shard check in real
gloo processes, including a planted overlap it must catch."""
import itertools
import sys

import pytest
import torch.distributed as dist
from torch.utils.data import DistributedSampler

from conftest import REPO, init_gloo, spawn

sys.path.insert(0, str(REPO / "step2_sharded_data"))
from sampler import ShardedSampler, check_no_overlap  # noqa: E402

LENGTHS = list(range(0, 41)) + [97, 1000]  # empty, shorter than the world, not divisible, large


@pytest.mark.parametrize("world_size", range(1, 9))
def test_yields_exactly_what_distributed_sampler_yields(world_size):
    for n, shuffle, drop_last, seed, epoch in itertools.product(LENGTHS, (True, False), (False, True),
                                                                (0, 1, 1234), (0, 1, 5)):
        for rank in range(world_size):
            ours = ShardedSampler(n, world_size, rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
            theirs = DistributedSampler(range(n), world_size, rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            case = f"n={n} ws={world_size} rank={rank} shuffle={shuffle} drop_last={drop_last} seed={seed} epoch={epoch}"
            assert list(ours) == list(theirs), case
            assert len(ours) == len(theirs), case


def test_every_rank_gets_the_same_number_of_samples():
    for n, world_size in itertools.product(range(1, 30), range(1, 8)):
        assert len({len(list(ShardedSampler(n, world_size, r))) for r in range(world_size)}) == 1


def test_a_new_shuffle_each_epoch_and_the_same_shuffle_on_replay():
    sampler = ShardedSampler(100, 2, 0, seed=7)
    first = list(sampler)
    sampler.set_epoch(1)
    assert list(sampler) != first
    sampler.set_epoch(0)
    assert list(sampler) == first


@pytest.mark.parametrize("rank, world_size", [(2, 2), (-1, 2), (0, 0)])
def test_bad_rank_or_world_size_is_refused(rank, world_size):
    with pytest.raises(ValueError):
        ShardedSampler(10, world_size, rank)


def test_check_catches_overlap_and_gaps_in_a_world_of_one():
    assert check_no_overlap(list(range(5)), 5, 1)["ok"]
    with pytest.raises(RuntimeError, match="sample 3"):
        check_no_overlap([0, 1, 2, 3, 3], 5, 1)
    with pytest.raises(RuntimeError, match="distinct"):
        check_no_overlap([0, 1, 2], 5, 1)


def shard_worker(rank, world_size, port, queue, dataset_len, plant_overlap):
    init_gloo(rank, world_size, port)
    shard = list(ShardedSampler(dataset_len, world_size, rank, seed=3))
    if plant_overlap and rank == 1:
        shard = list(ShardedSampler(dataset_len, world_size, 0, seed=3))  # rank 1 takes rank 0's samples
    try:
        queue.put((rank, check_no_overlap(shard, dataset_len, world_size)))
    except RuntimeError as error:
        queue.put((rank, str(error)))
    dist.barrier()
    dist.destroy_process_group()


def run_shard_check(world_size, dataset_len, plant_overlap):
    return spawn(shard_worker, world_size, dataset_len, plant_overlap)


@pytest.mark.parametrize("world_size, dataset_len", [(2, 10), (3, 10)])
def test_shard_check_passes_on_real_shards(world_size, dataset_len):
    results = run_shard_check(world_size, dataset_len, plant_overlap=False)
    padding = -dataset_len % world_size
    for rank in range(world_size):
        assert results[rank] == {"ranks": world_size, "per_rank": (dataset_len + padding) // world_size,
                                 "distinct": dataset_len, "padding": padding, "ok": True}


def test_shard_check_catches_a_planted_overlap_on_every_rank():
    results = run_shard_check(3, 10, plant_overlap=True)
    for rank in range(3):
        assert isinstance(results[rank], str) and "is on ranks 0 and 1" in results[rank], results[rank]
