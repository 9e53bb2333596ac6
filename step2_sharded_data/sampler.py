"""Sharded data loading, written from scratch: which samples does each rank see?

Three rules, and why:

1. **Deterministic sharding.** No rank asks another which samples it has: each computes its own
   shard from (dataset length, world size, rank, seed, epoch) alone. All ranks must therefore
   compute the *same* shuffle, or two ranks could train on one sample while another sample is
   never seen. A seeded generator makes the shuffle a pure function of its seed.
2. **The same number of samples on every rank.** Every optimiser step ends in collectives (the
   gradient all-reduce) that every rank must join. A rank with one step fewer would leave the
   others waiting in an all-reduce that never completes: a hang, until the process-group timeout.
   So the sampler pads the index list by repeating its start (or, with ``drop_last``, drops the
   tail) until it divides evenly.
3. **Per-epoch seed control.** ``set_epoch(e)`` reseeds the shuffle with ``seed + e``: a new order
   each epoch, identical on every rank, and reproducible after a resume.

``ShardedSampler`` yields exactly the indices ``torch.utils.data.DistributedSampler`` yields for
the same arguments (the tests compare them over a broad grid), so step 2 trains bit for bit like
step 1. ``check_no_overlap`` proves the shards are right at run time.
"""
import math

import torch
import torch.distributed as dist


class ShardedSampler:
    """The indices of one rank's shard of ``range(dataset_len)``, reshuffled every epoch."""

    def __init__(self, dataset_len: int, num_replicas: int, rank: int, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False):
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is not in [0, {num_replicas - 1}] for num_replicas={num_replicas}")
        self.dataset_len, self.num_replicas, self.rank = dataset_len, num_replicas, rank
        self.shuffle, self.seed, self.drop_last, self.epoch = shuffle, seed, drop_last, 0
        if drop_last:  # drop the tail that does not divide evenly
            self.num_samples = dataset_len // num_replicas
        else:  # pad up to the next multiple of num_replicas
            self.num_samples = math.ceil(dataset_len / num_replicas)
        self.total_size = self.num_samples * num_replicas

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)  # the same order on every rank, new each epoch
            indices = torch.randperm(self.dataset_len, generator=generator).tolist()
        else:
            indices = list(range(self.dataset_len))
        if self.drop_last:
            indices = indices[: self.total_size]
        elif self.total_size > len(indices):  # repeat from the start, as often as needed
            padding = self.total_size - len(indices)
            indices += (indices * math.ceil(padding / max(1, len(indices))))[:padding]
        # Interleaved, not contiguous: rank r takes positions r, r + N, r + 2N, ...
        return iter(indices[self.rank : self.total_size : self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples


def check_no_overlap(indices: list[int], dataset_len: int, world_size: int, drop_last: bool = False) -> dict:
    """Collective: all ranks all-gather their index lists and each checks, on the same data, that

    - every rank holds the same number of samples;
    - no sample is on two ranks, except the padding (``total_size - dataset_len`` repeats);
    - together the ranks cover the whole dataset (or all but the dropped tail, with ``drop_last``).

    Returns a summary to log; raises ``RuntimeError`` naming the first overlap or gap it finds.
    """
    if dist.is_available() and dist.is_initialized():
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, list(indices))
    else:
        gathered = [list(indices)]
    lengths = [len(shard) for shard in gathered]
    if len(set(lengths)) != 1:
        raise RuntimeError(f"ranks hold different numbers of samples: {lengths}")
    total = sum(lengths)
    padding = 0 if drop_last else total - dataset_len
    owner, repeats = {}, 0
    for rank, shard in enumerate(gathered):
        for index in shard:
            if index in owner:
                repeats += 1
                if repeats > padding:
                    raise RuntimeError(f"sample {index} is on ranks {owner[index]} and {rank} "
                                       f"(more repeats than the {padding} padding samples)")
            else:
                owner[index] = rank
    expected = total if drop_last else dataset_len
    if len(owner) != expected or any(not 0 <= i < dataset_len for i in owner):
        missing = sorted(set(range(dataset_len)) - set(owner))[:5]
        raise RuntimeError(f"the shards cover {len(owner)} distinct samples, expected {expected}; missing e.g. {missing}")
    return {"ranks": len(gathered), "per_rank": lengths[0], "distinct": len(owner), "padding": padding, "ok": True}


if __name__ == "__main__":  # a tiny example for the README: 10 samples at world size 2 and 3
    for world_size in (2, 3):
        for epoch in (0, 1):
            shards = []
            for rank in range(world_size):
                sampler = ShardedSampler(10, world_size, rank, shuffle=True, seed=0)
                sampler.set_epoch(epoch)
                shards.append(list(sampler))
            print(f"world size {world_size}, epoch {epoch}: " + "  ".join(f"rank {r}: {s}" for r, s in enumerate(shards)))
