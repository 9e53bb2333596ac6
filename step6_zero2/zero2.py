"""ShardedGradientDDP: ZeRO stage 2, every rank keeps only its own slice of the averaged gradient.

Step 4 all-reduced every bucket, so every rank ended with the whole averaged gradient. Here, a
subclass of step 4's ``BucketedDDP`` (its hooks, buckets, ``no_sync()`` and unused parameters,
unchanged; ``bucketed_ddp.py`` is step 4's, copied, through step 5's ``MainGradDDP`` for 16-bit
parameters) that changes what happens to a bucket once it is full:

1. **Reduce-scatter instead of all-reduce.** Each bucket's flat buffer is padded with zeros to a
   multiple of the world size N and cut into N equal slices; rank r receives only slice r of the
   sum. The sharded optimiser (step 5) updates only the slice of the parameters that its rank owns,
   so the other N-1 slices of an all-reduced gradient were memory that nobody read.
2. **A fixed layout.** Buckets are built exactly as in step 4 (gradient-ready order, same caps).
   Bucket c, flattened in that order into L elements and padded to Lp = ceil(L/N)*N, gives rank r
   the flat range [r*Lp/N, (r+1)*Lp/N). ``bucket_params`` and ``gradient_shards`` hand that layout
   to the optimiser.
3. **Full gradients live briefly.** When a parameter's gradient is ready it is copied into its
   bucket and ``param.grad`` is set to None at once. A bucket's buffer is allocated by the first
   gradient that goes into it and dropped as soon as its reduce-scatter is launched: from then on
   the collective's handle keeps alive what it still reads (gloo copies the input at launch; NCCL
   keeps it from reuse until done), so holding on to it until the result is known would only keep a
   second copy alive. After the sync point only ``gradient_shards`` (1/N of the gradient, float32)
   hold gradient memory.
4. **One sync point.** ``finish_gradient_synchronization()``, called once before the optimiser step,
   waits for every bucket, divides by the world size and rounds into ``gradient_shards[c]`` once.
5. **no_sync().** By default, backward inside it only accumulates full gradients in ``param.grad``,
   as in step 4 and PyTorch DDP (so the result is the same to the bit), and the next synchronised
   backward reduces the sum. With ``reduce_every_micro_batch=True`` every backward reduce-scatters
   and the slices are summed, so full gradients never pile up across micro-batches: less memory, but
   one reduce-scatter per micro-batch, and a different rounding (the sum over micro-batches comes
   after the sum over ranks). On gloo, whose reduce-scatter keeps a full copy of each bucket until
   it is waited on, the process's peak hardly moves; the saving shows where a reduce-scatter needs
   no copy of its input (NCCL).

Every rank launches the buckets in the same order (step 4's rule), and a parameter no rank used gets
zeros in its slices (with ``find_unused_parameters=True``, ``unused_parameters`` names it).
"""

import contextlib
import time

import torch

from bucketed_ddp import Bucket
from comm_accounting import count_collective, reduce_scatter_single
from main_grad import MainGradDDP


class ShardedBucket(Bucket):
    """Step 4's bucket, padded to a multiple of the world size and reduce-scattered. Its buffer
    exists only between its first gradient and its launch."""

    def __init__(self, index: int, params: list, dtype: torch.dtype, world_size: int):
        numel = sum(p.numel() for p in params)
        # Lp: every rank's slice has Lp / N elements. No buffer yet: _fill allocates it.
        super().__init__(index, params, dtype, numel=-(-numel // world_size) * world_size)
        self.output = None  # the slice the reduce-scatter in flight writes (at wait())
        # whether a reduce-scatter of this optimiser step has reached the shard yet
        self.in_shard = False
        # its parameters that got a gradient in this optimiser step, on this rank
        self.had_gradient = set()


class ShardedGradientDDP(MainGradDDP):
    """Wrap ``module`` for data parallelism with sharded gradients over the default process group.

    Contract: call ``forward`` and ``backward`` on every rank the same number of times; after the
    last backward of an optimiser step (the one outside ``no_sync()``) call
    ``finish_gradient_synchronization()`` once; then every ``param.grad`` is None and
    ``gradient_shards[c]`` holds this rank's slice of the averaged gradient of ``bucket_params[c]``.
    ``reduce_dtype=torch.float64`` reduces in float64 (exact, order-free) and rounds back once.
    16-bit parameters (``ShardedOptimizerWithMasters`` makes them): micro-batches inside
    ``no_sync()`` are summed in ``reduce_dtype`` (``param.main_grad``) and reduced from there; the
    shards are float32 whatever the parameters' dtype, so the masters' update never sees a gradient
    rounded to 16 bits.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        bucket_cap_mb: float = 25.0,
        first_bucket_cap_mb: float = 1.0,
        reduce_dtype: torch.dtype = torch.float32,
        find_unused_parameters: bool = False,
        reduce_every_micro_batch: bool = False,
    ):
        super().__init__(
            module, bucket_cap_mb, first_bucket_cap_mb, reduce_dtype, find_unused_parameters
        )
        self.reduce_every_micro_batch = reduce_every_micro_batch
        # The layout the sharded optimiser reads: bucket c's
        # parameters, and this rank's slice of their gradient.
        self.bucket_params = [bucket.params for bucket in self.buckets]
        self.gradient_shards = [
            torch.zeros(
                bucket.numel // self.world_size, dtype=torch.float32, device=bucket.params[0].device
            )
            for bucket in self.buckets
        ]
        # names nobody used in the last step (find_unused_parameters=True)
        self.unused_parameters = []
        self.micro_batch_open = False

    def _make_bucket(self, index: int, params: list) -> ShardedBucket:
        return ShardedBucket(index, params, self.reduce_dtype, self.world_size)

    def forward(self, *args, **kwargs):
        if self.reduce_every_micro_batch and torch.is_grad_enabled():
            # the previous micro-batch's backward is over: reduce what it left open
            if self.micro_batch_open:
                self._complete_the_buckets_backward_left_open()
            self.micro_batch_open = True
        return super().forward(*args, **kwargs)

    def no_sync(self):
        """Backward inside this block only accumulates gradients locally
        (unless reduce_every_micro_batch)."""
        return contextlib.nullcontext() if self.reduce_every_micro_batch else super().no_sync()

    def _fill(self, bucket: ShardedBucket, i: int, grad) -> None:
        if bucket.buffer is None:  # the first gradient of this backward for this bucket
            bucket.allocate()
        super()._fill(bucket, i, grad)
        # the full gradient now lives only in the bucket, and soon only as this rank's slice
        if grad is not None:
            bucket.params[i].grad = None
            bucket.had_gradient.add(bucket.params[i])

    def _launch(self, bucket: ShardedBucket) -> None:
        """Start the bucket's reduce-scatter: this rank receives the sum of its slice only."""
        # reduce_every_micro_batch: the previous micro-batch's, long done by now
        if bucket.work is not None:
            self._retire(bucket)
        count_collective("reduce_scatter", bucket.buffer)
        # this rank's slice
        bucket.output = bucket.buffer.new_empty(bucket.numel // self.world_size)
        launched = time.perf_counter()
        # PyTorch 2.13's name for reduce_scatter_tensor
        # (which still works, with a deprecation warning)
        bucket.work = reduce_scatter_single(bucket.output, bucket.buffer, async_op=True)
        # the handle keeps what the collective still needs (rule 3)
        bucket.buffer = bucket.slots = None
        if bucket.timeline is not None:  # a tracer wants to see when it ran
            bucket.timeline.append({"launched": launched, "finished": None})

    def _retire(self, bucket: ShardedBucket) -> None:
        """Wait for the bucket's reduce-scatter, average this rank's slice, and round it into the
        bucket's gradient shard (added to it, for a later micro-batch with
        reduce_every_micro_batch)."""
        bucket.work.wait()  # gloo writes the output only here: never read it before
        # when this rank saw it finish (gloo's reduce-scatter handle has no callback)
        if bucket.timeline:
            bucket.timeline[-1]["finished"] = time.perf_counter()
        average, shard = bucket.output.div_(self.world_size), self.gradient_shards[bucket.index]
        # reduce_every_micro_batch: a later micro-batch adds to the earlier ones
        if bucket.in_shard:
            shard.add_(average)
        else:
            shard.copy_(average)  # float64 -> float32 rounds here, once
        bucket.in_shard = True
        # dropping the handle frees what it kept (gloo: its copy of the input)
        bucket.output = bucket.work = None

    def _finish(self, bucket: ShardedBucket, receiving: set) -> None:
        """At the sync point: the bucket's last reduce-scatter of this optimiser step, into its
        shard. A parameter nobody used keeps zeros in its slice, so ``receiving`` changes
        nothing here."""
        self._retire(bucket)
        # the next optimiser step starts from nothing
        bucket.in_shard, bucket.had_gradient = False, set()

    def finish_gradient_synchronization(self) -> None:
        """Wait for every bucket, average, round this rank's slices into ``gradient_shards``. Once
        per optimiser step."""
        self.micro_batch_open = False
        super().finish_gradient_synchronization()

    # With reduce_every_micro_batch, the buckets a backward left open are completed after every
    # micro-batch (at the next forward), and "no gradient" means none in any micro-batch of the
    # optimiser step.

    def _complete_the_buckets_backward_left_open(self) -> list:
        unused = super()._complete_the_buckets_backward_left_open()
        return [p for p in unused if p not in self.location[p][0].had_gradient]

    def _used_by_any_rank(self, locally_unused: list) -> dict:
        used = super()._used_by_any_rank(locally_unused)
        self.unused_parameters = [self.names[p] for p, u in used.items() if not u]
        return used


def add_zero2_flags(parser) -> None:
    flags = parser.add_argument_group("ZeRO-2")
    flags.add_argument(
        "--bucket-cap-mb",
        type=float,
        default=25.0,
        help="gradient bucket size cap in MiB (step 4's)",
    )
    flags.add_argument(
        "--reduce-every-micro-batch",
        action="store_true",
        help="reduce-scatter every micro-batch into the shard: less memory, more traffic, "
        "not bitwise",
    )
