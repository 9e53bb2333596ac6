"""Sharded data loading, written from scratch: which samples does each rank see?

In data parallelism every rank trains the same model on a different slice (shard) of the data.
Three rules make that work, and each has a reason:

1. **Deterministic sharding.** No rank asks another which samples it has: each computes its own
   shard from (dataset length, world size, rank, seed, epoch) alone, with no communication. All
   ranks must therefore compute the *same* shuffle, or two ranks could train on one sample while
   another sample is never seen. A seeded generator makes the shuffle a pure function of its seed.
2. **The same number of samples on every rank.** Every optimiser step ends in collectives (the
   gradient all-reduce) that every rank must join. A rank with one step fewer would stop issuing
   them and leave the others blocked in an all-reduce that never completes: a hang, until the
   process-group timeout. So the sampler pads the shuffled list by repeating its start (or, with
   ``drop_last``, drops the tail) until its length divides evenly by the world size.
3. **Per-epoch seed control.** ``set_epoch(e)`` reseeds the shuffle with ``seed + e``: a new order
   each epoch, identical on every rank, and reproducible after a resume.

``ShardedSampler`` yields exactly the indices ``torch.utils.data.DistributedSampler`` yields for
the same arguments (the tests compare them over a broad grid), so step 2 trains bit for bit like
step 1. An empty dataset gives every rank an empty shard, as ``DistributedSampler`` does.
``check_no_overlap`` proves, at run time and across real processes, that the shards are right.
"""

import math

import torch
import torch.distributed as dist


def samples_per_rank(dataset_len: int, num_replicas: int, drop_last: bool) -> int:
    """The same on every rank, so every rank runs the same number of steps. (DistributedSampler
    writes the drop_last case as ceil((n - N) / N); it is the same number.)"""
    if drop_last:  # drop the tail that does not divide evenly
        return dataset_len // num_replicas
    return math.ceil(dataset_len / num_replicas)  # pad up to the next multiple of num_replicas


class ShardedSampler:
    """The indices of one rank's shard of ``range(dataset_len)``, reshuffled every epoch."""

    def __init__(
        self,
        dataset_len: int,
        num_replicas: int,
        rank: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ):
        if dataset_len < 0:
            raise ValueError(f"dataset_len must be >= 0, got {dataset_len}")
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        if not 0 <= rank < num_replicas:
            raise ValueError(
                f"rank {rank} is not in [0, {num_replicas - 1}] for num_replicas={num_replicas}"
            )
        self.dataset_len, self.num_replicas, self.rank = dataset_len, num_replicas, rank
        self.shuffle, self.seed, self.drop_last, self.epoch = shuffle, seed, drop_last, 0
        self.num_samples = samples_per_rank(dataset_len, num_replicas, drop_last)
        self.total_size = self.num_samples * num_replicas

    def set_epoch(self, epoch: int) -> None:
        """Call at the start of every epoch, with the same epoch on every rank."""
        self.epoch = epoch

    def __iter__(self):
        if self.shuffle:
            # A private generator: the order depends on (seed, epoch) only, never on the global RNG
            # that model init or dropout have advanced differently. Same on every rank, new
            # each epoch.
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            indices = torch.randperm(self.dataset_len, generator=generator).tolist()
        else:
            indices = list(range(self.dataset_len))
        if self.drop_last:
            indices = indices[: self.total_size]
        else:
            # Repeat from the start, cycling more than once
            # when the dataset is shorter than the padding.
            padding = self.total_size - len(indices)
            indices += [indices[i % len(indices)] for i in range(padding)]
        # Interleaved, not contiguous: rank r takes positions r, r + N, r + 2N, ...
        return iter(indices[self.rank : self.total_size : self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples


def _where(ranks: list[int]) -> str:
    """'is on ranks 0 and 1', or 'is on rank 0 2 times' for a repeat within one rank."""
    if len(set(ranks)) == 1:
        return f"is on rank {ranks[0]} {len(ranks)} times"
    return "is on ranks " + ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}"


def check_no_overlap(
    indices: list[int], dataset_len: int, world_size: int, drop_last: bool = False, group=None
) -> dict:
    """Collective: every rank of ``group`` must call it. All-gathers every rank's index list and
    checks, on every rank, that

    - every rank holds the same number of samples (so every rank takes the same number of steps);
    - no sample is on two ranks, except the ``total_size - dataset_len`` padding repeats
      (none with ``drop_last``);
    - together the ranks cover the whole dataset
      (``total_size`` distinct samples with ``drop_last``).

    Without an initialised process group it checks ``indices`` as a world of one. Returns a summary
    to log; raises ``RuntimeError`` naming the first problem it finds (ranks are ``group`` ranks).
    """
    if dist.is_available() and dist.is_initialized():
        gathered = [None] * dist.get_world_size(group)
        # Pickled Python lists: handles shards of different
        # lengths (a bug we want to catch) for free.
        dist.all_gather_object(gathered, [int(i) for i in indices], group=group)
    else:
        gathered = [[int(i) for i in indices]]
    # From here on every rank looks at the same data, so all reach the same verdict and raise the
    # same error: no rank is left waiting in a later collective for a peer that stopped.
    if len(gathered) != world_size:
        raise RuntimeError(
            f"gathered shards from {len(gathered)} ranks, but world_size is {world_size}"
        )
    lengths = [len(shard) for shard in gathered]
    if len(set(lengths)) != 1:
        raise RuntimeError(
            "ranks hold different numbers of samples (a rank with fewer steps would "
            "leave the others "
            "hanging in all-reduce): " + ", ".join(f"rank {r}: {n}" for r, n in enumerate(lengths))
        )
    per_rank = samples_per_rank(dataset_len, world_size, drop_last)
    if lengths[0] != per_rank:
        raise RuntimeError(
            f"every rank holds {lengths[0]} samples, expected {per_rank} for {dataset_len} samples "
            f"on {world_size} ranks (drop_last={drop_last})"
        )
    total_size = per_rank * world_size
    padding = 0 if drop_last else total_size - dataset_len

    holders: dict[int, list[int]] = {}  # sample index -> the ranks that hold it, in rank order
    repeats, culprit = 0, None
    for rank, shard in enumerate(gathered):
        for index in shard:
            if not 0 <= index < dataset_len:
                raise RuntimeError(
                    f"sample {index} on rank {rank} is outside the dataset [0, {dataset_len - 1}]"
                )
            if index in holders:
                repeats += 1
                # the first repeat beyond what padding explains
                if repeats > padding and culprit is None:
                    culprit = index
            holders.setdefault(index, []).append(rank)
    if culprit is not None:
        # Padding never puts one sample on one rank twice,
        # so such a sample is the surest one to name.
        culprit = next((i for i, ranks in holders.items() if len(set(ranks)) < len(ranks)), culprit)
        raise RuntimeError(
            f"sample {culprit} {_where(holders[culprit])}: {repeats} repeated samples, "
            f"but padding explains only {padding}"
        )
    # Property (a). Implied by the checks above (the right total, no more repeats than padding, all
    # in range), but stated on its own: it is the property training needs.
    expected = total_size if drop_last else dataset_len
    if len(holders) != expected:
        missing = sorted(set(range(dataset_len)) - holders.keys())[:5]
        raise RuntimeError(
            f"the shards cover {len(holders)} distinct samples, expected {expected}; "
            f"missing e.g. {missing}"
        )
    return {
        "ranks": world_size,
        "per_rank": per_rank,
        "distinct": len(holders),
        "padding": padding,
        "ok": True,
    }


def checked_micro_batches(batches, accum: int, verbose: bool = False) -> tuple[list, dict | None]:
    """The step's next ``accum`` micro-batches from ``batches`` (data.MicroBatches over a
    ShardedSampler), and ``check_no_overlap``'s summary when one of them started an epoch (else
    None): a collective, which every rank reaches at the same micro-step, as every rank starts every
    epoch at the same one. ``verbose``: print it."""
    micro_batches, shard_check = [], None
    for _ in range(accum):
        micro_batches.append(batches.next())
        if batches.epoch_started is not None:
            sampler = batches.sampler
            shard_check = check_no_overlap(
                list(sampler), sampler.dataset_len, sampler.num_replicas, sampler.drop_last
            )
            if verbose:
                print(f"epoch {batches.epoch_started}: shards checked: {shard_check}")
    return micro_batches, shard_check


if __name__ == "__main__":  # a tiny example for the README: 10 samples at world size 2 and 3
    for world_size in (2, 3):
        for epoch in (0, 1):
            shards = []
            for rank in range(world_size):
                sampler = ShardedSampler(10, world_size, rank, shuffle=True, seed=0)
                sampler.set_epoch(epoch)
                shards.append(list(sampler))
            print(
                f"world size {world_size}, epoch {epoch}: "
                + "  ".join(f"rank {r}: {s}" for r, s in enumerate(shards))
            )
