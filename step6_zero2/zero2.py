"""ShardedGradientDDP: ZeRO stage 2, every rank keeps only its own slice of the averaged gradient.

Step 4 all-reduced every bucket, so every rank ended with the whole averaged gradient; here:

1. **Reduce-scatter instead of all-reduce.** Each bucket's flat buffer is padded with zeros to a
   multiple of the world size N and cut into N equal slices; rank r receives only slice r of the sum.
   The sharded optimiser (step 5) updates only the slice of the parameters that its rank owns, so the
   other N-1 slices of an all-reduced gradient were memory that nobody read.
2. **A fixed layout.** Buckets are built exactly as in step 4 (gradient-ready order, same caps). Bucket
   c, flattened in that order into L elements and padded to Lp = ceil(L/N)*N, gives rank r the flat
   range [r*Lp/N, (r+1)*Lp/N). ``bucket_params`` and ``gradient_shards`` hand that layout to the optimiser.
3. **Full gradients live briefly.** When a parameter's gradient is ready it is copied into its bucket
   and ``param.grad`` is set to None at once. A bucket's buffer is allocated by the first gradient that
   goes into it and dropped as soon as its reduce-scatter is launched: from then on the collective's
   handle keeps alive what it still reads (gloo copies the input at launch; NCCL keeps it from reuse
   until done), so holding on to it until the result is known would only keep a second copy alive.
   After the sync point only ``gradient_shards`` (1/N of the gradient, float32) hold gradient memory.
4. **One sync point.** ``finish_gradient_synchronization()``, called once before the optimiser step,
   waits for every bucket, divides by the world size and rounds into ``gradient_shards[c]`` once.
5. **no_sync().** By default, backward inside it only accumulates full gradients in ``param.grad``, as
   in step 4 and PyTorch DDP (so the result is the same to the bit), and the next synchronised backward
   reduces the sum. With ``reduce_every_micro_batch=True`` every backward reduce-scatters and the slices
   are summed, so full gradients never pile up across micro-batches: less memory, but one reduce-scatter
   per micro-batch, and a different rounding (the sum over micro-batches comes after the sum over ranks).
   On gloo, whose reduce-scatter keeps a full copy of each bucket until it is waited on, the process's
   peak hardly moves; the saving shows where a reduce-scatter needs no copy of its input (NCCL).

Every rank launches the buckets in the same order (bucket 0, 1, 2, ...), whatever order they become
ready in: collectives are matched by order, so this is what makes them pair up correctly.
Parameters that got no gradient in a step are handled in the last section of this file.
"""
import contextlib
import time

import torch
import torch.distributed as dist

from comm_accounting import count_collective


class Bucket:
    """The gradients of a few parameters in one flat buffer, padded to a multiple of the world size and
    reduce-scattered with one call. The buffer exists only between its first gradient and its launch."""

    def __init__(self, index: int, params: list, dtype: torch.dtype, world_size: int):
        self.index, self.params, self.dtype = index, params, dtype
        numel = sum(p.numel() for p in params)
        self.padded = -(-numel // world_size) * world_size  # Lp: every rank's slice has Lp / N elements
        self.buffer = self.slots = None  # allocated by the first gradient a backward puts in this bucket
        self.work = self.output = None  # the reduce-scatter in flight, and the slice it writes (at wait())
        self.in_shard = False  # whether a reduce-scatter of this optimiser step has reached the shard yet
        self.timeline = None  # a list to record launch/finish times in, when overlap_trace.py asks
        self.reset()

    def allocate(self):
        self.buffer = torch.zeros(self.padded, dtype=self.dtype, device=self.params[0].device)
        # slots[i]: the part of the buffer that holds params[i]'s gradient, shaped like the parameter
        self.slots, offset = [], 0
        for p in self.params:
            self.slots.append(self.buffer[offset : offset + p.numel()].view_as(p))
            offset += p.numel()

    def reset(self):
        self.ready = [False] * len(self.params)
        self.pending = len(self.params)


def assign_buckets(params: list, bucket_cap_bytes: float, first_bucket_cap_bytes: float) -> list[list]:
    """Split ``params`` (in gradient-ready order) into consecutive groups of about the cap in bytes.
    A group closes once it reaches its cap; a parameter larger than the cap gets a group of its own."""
    groups, current, size = [], [], 0
    for p in params:
        current.append(p)
        size += p.numel() * p.element_size()
        if size >= (first_bucket_cap_bytes if not groups else bucket_cap_bytes):
            groups.append(current)
            current, size = [], 0
    return groups + ([current] if current else [])


def is_16_bit(param: torch.Tensor) -> bool:
    return param.dtype in (torch.bfloat16, torch.float16)


def accumulate(param: torch.Tensor, dtype: torch.dtype) -> None:
    """A 16-bit parameter's gradient, added to a sum in ``dtype`` (the reduce dtype) kept in ``param.main_grad``,
    and freed: micro-batches are summed in the reduce dtype, never in 16 bits (as FSDP2 sums them under
    ``set_requires_gradient_sync(False)``)."""
    grad, param.grad = param.grad, None
    param.main_grad = grad.to(dtype) if getattr(param, "main_grad", None) is None else param.main_grad.add_(grad)


def local_gradient(param: torch.Tensor, dtype: torch.dtype):
    """What this rank reduces for ``param``: its ``.grad``; for a 16-bit parameter the sum, in ``dtype``, of
    the step's micro-batches (taken, and freed, from ``main_grad`` and ``.grad``): nothing rounded to 16 bits."""
    if not is_16_bit(param):
        return param.grad
    if param.grad is not None:
        accumulate(param, dtype)
    grad, param.main_grad = getattr(param, "main_grad", None), None
    return grad

class ShardedGradientDDP(torch.nn.Module):
    """Wrap ``module`` for data parallelism with sharded gradients over the default process group.

    Contract: call ``forward`` and ``backward`` on every rank the same number of times; after the
    last backward of an optimiser step (the one outside ``no_sync()``) call
    ``finish_gradient_synchronization()`` once; then every ``param.grad`` is None and
    ``gradient_shards[c]`` holds this rank's slice of the averaged gradient of ``bucket_params[c]``.
    ``reduce_dtype=torch.float64`` reduces in float64 (exact, order-free) and rounds back once.
    16-bit parameters (``ShardedOptimizer(param_dtype=...)`` makes them): micro-batches inside ``no_sync()``
    are summed in ``reduce_dtype`` (``param.main_grad``) and reduced from there; the shards are float32 whatever the
    parameters' dtype, so the masters' update never sees a gradient rounded to 16 bits.
    """

    def __init__(self, module: torch.nn.Module, bucket_cap_mb: float = 25.0, first_bucket_cap_mb: float = 1.0,
                 reduce_dtype: torch.dtype = torch.float32, find_unused_parameters: bool = False,
                 reduce_every_micro_batch: bool = False):
        super().__init__()
        self.module = module
        self.world_size = dist.get_world_size()
        self.find_unused_parameters = find_unused_parameters
        self.reduce_dtype = reduce_dtype
        self.reduce_every_micro_batch = reduce_every_micro_batch
        self.require_sync = True

        # Every replica starts from rank 0's state.
        for tensor in list(module.parameters()) + list(module.buffers()):
            count_collective("broadcast", tensor)
            dist.broadcast(tensor.data, src=0)

        # parameters() lists a tied parameter once; frozen ones need no reduction.
        ready_order = [p for p in module.parameters() if p.requires_grad][::-1]
        self.names = {p: n for n, p in module.named_parameters()}
        groups = assign_buckets(ready_order, bucket_cap_mb * 2**20, min(first_bucket_cap_mb, bucket_cap_mb) * 2**20)
        self.buckets = [Bucket(i, group, reduce_dtype, self.world_size) for i, group in enumerate(groups)]
        self.location = {p: (bucket, i) for bucket in self.buckets for i, p in enumerate(bucket.params)}
        self.next_to_launch = 0
        # The layout the sharded optimiser reads: bucket c's parameters, and this rank's slice of their gradient.
        self.bucket_params = [bucket.params for bucket in self.buckets]
        self.gradient_shards = [torch.zeros(bucket.padded // self.world_size, dtype=torch.float32,
                                            device=bucket.params[0].device) for bucket in self.buckets]
        self.had_gradient = set()  # parameters that got a gradient in this optimiser step, on this rank
        self.unused_parameters = []  # names nobody used in the last step (find_unused_parameters=True)
        self.micro_batch_open = False
        self._register_hooks(ready_order)

    def _register_hooks(self, params: list) -> None:
        for p in params:  # fires after backward has added this pass's gradient into p.grad
            p.register_post_accumulate_grad_hook(self._on_gradient_ready)

    def forward(self, *args, **kwargs):
        if self.reduce_every_micro_batch and torch.is_grad_enabled():
            if self.micro_batch_open:  # the previous micro-batch's backward is over: reduce what it left open
                self._complete_the_buckets_backward_left_open()
            self.micro_batch_open = True
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward inside this block only accumulates gradients locally (unless reduce_every_micro_batch)."""
        previous, self.require_sync = self.require_sync, False
        try:
            yield
        finally:
            self.require_sync = previous

    def _on_gradient_ready(self, param: torch.Tensor) -> None:
        """Runs inside backward, right after ``param.grad`` received this backward's contribution."""
        if not (self.require_sync or self.reduce_every_micro_batch):
            if is_16_bit(param):
                accumulate(param, self.reduce_dtype)
            return
        bucket, i = self.location[param]
        if bucket.ready[i]:
            raise RuntimeError(f"gradient of {self.names[param]} became ready twice in one backward; "
                               "call finish_gradient_synchronization() after each synchronised backward")
        if bucket.buffer is None:  # the first gradient of this backward for this bucket
            bucket.allocate()
        bucket.slots[i].copy_(local_gradient(param, self.reduce_dtype))
        param.grad = None  # the full gradient now lives only in the bucket, and soon only as this rank's slice
        self.had_gradient.add(param)
        bucket.ready[i], bucket.pending = True, bucket.pending - 1
        self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        # Launch in bucket order only: bucket k waits until buckets 0..k-1 have been launched.
        while self.next_to_launch < len(self.buckets) and self.buckets[self.next_to_launch].pending == 0:
            bucket = self.buckets[self.next_to_launch]
            if bucket.work is not None:  # reduce_every_micro_batch: the previous micro-batch's, long done by now
                self._retire(bucket)
            count_collective("reduce_scatter", bucket.buffer)
            bucket.output = bucket.buffer.new_empty(bucket.padded // self.world_size)  # this rank's slice
            launched = time.perf_counter()
            # PyTorch 2.13's name for reduce_scatter_tensor (which still works, with a deprecation warning)
            bucket.work = dist.reduce_scatter_single(bucket.output, bucket.buffer, async_op=True)
            bucket.buffer = bucket.slots = None  # the handle keeps what the collective still needs (rule 3)
            if bucket.timeline is not None:  # overlap_trace.py wants to see when it ran
                bucket.timeline.append({"launched": launched, "finished": None})
            self.next_to_launch += 1

    def _retire(self, bucket: Bucket) -> None:
        """Wait for the bucket's reduce-scatter, average this rank's slice, and round it into the bucket's
        gradient shard (added to it, for a later micro-batch with reduce_every_micro_batch)."""
        bucket.work.wait()  # gloo writes the output only here: never read it before
        if bucket.timeline:  # when this rank saw it finish (gloo's reduce-scatter handle has no callback)
            bucket.timeline[-1]["finished"] = time.perf_counter()
        average, shard = bucket.output.div_(self.world_size), self.gradient_shards[bucket.index]
        if bucket.in_shard:  # reduce_every_micro_batch: a later micro-batch adds to the earlier ones
            shard.add_(average)
        else:
            shard.copy_(average)  # float64 -> float32 rounds here, once
        bucket.in_shard = True
        bucket.output = bucket.work = None  # dropping the handle frees what it kept (gloo: its copy of the input)

    def finish_gradient_synchronization(self) -> None:
        """Wait for every bucket, average, round this rank's slices into ``gradient_shards``. Once per optimiser step."""
        unused = self._complete_the_buckets_backward_left_open()
        used_anywhere = self._used_by_any_rank(unused) if self.find_unused_parameters else None
        for bucket in self.buckets:  # every bucket has a reduce-scatter in flight here
            self._retire(bucket)
            bucket.in_shard = False
        self.had_gradient, self.micro_batch_open = set(), False
        self.unused_parameters = [self.names[p] for p, used in (used_anywhere or {}).items() if not used]
        if unused and not self.find_unused_parameters:
            names = ", ".join(self.names[p] for p in unused)
            raise RuntimeError(f"parameter(s) {names} received no gradient in this step; make every trainable "
                               "parameter take part in the loss, or pass find_unused_parameters=True")

    # ---- Parameters without a gradient in this backward ------------------------------------------
    # Their hooks never fired, so their buckets are still open when backward ends. A parameter that
    # got a gradient in an earlier micro-batch (inside no_sync) still has it in ``param.grad``: that
    # accumulated gradient is what gets reduced, and then freed. A parameter with no gradient at all is
    # reduced as zeros, so no peer is left waiting; then, with ``find_unused_parameters=False`` (the
    # default, as in DDP) it is an error naming it. With ``True``, one extra small all-reduce tells every
    # rank which parameters nobody used: their slices stay zero and ``unused_parameters`` names them, so
    # an optimiser can skip them as PyTorch DDP's does (there they keep ``grad=None``).
    # With ``reduce_every_micro_batch``, this runs after every micro-batch (at the next forward), and
    # "no gradient" means none in any micro-batch of the optimiser step.

    def _complete_the_buckets_backward_left_open(self) -> list:
        """Fill and launch every bucket backward did not complete, and get ready for the next backward;
        return the parameters with no gradient in this optimiser step."""
        unused = []
        for bucket in self.buckets[self.next_to_launch :]:
            if bucket.buffer is None:
                bucket.allocate()
            for i, p in enumerate(bucket.params):
                if bucket.ready[i]:
                    continue
                grad = local_gradient(p, self.reduce_dtype)
                if grad is not None:  # no gradient this backward, but one from an earlier micro-batch
                    bucket.slots[i].copy_(grad)
                    p.grad = None
                    self.had_gradient.add(p)
                elif p not in self.had_gradient:  # its slot stays zero
                    unused.append(p)
                bucket.ready[i], bucket.pending = True, bucket.pending - 1
        self._launch_ready_buckets()
        for bucket in self.buckets:
            bucket.reset()
        self.next_to_launch = 0
        return unused

    def _used_by_any_rank(self, locally_unused: list) -> dict:
        """One small all-reduce: for each parameter, did any rank produce a gradient for it?"""
        params, unused_ids = list(self.location), {id(p) for p in locally_unused}
        used = torch.tensor([id(p) not in unused_ids for p in params], dtype=torch.int32, device=params[0].device)
        count_collective("all_reduce", used)
        dist.all_reduce(used)
        return {p: bool(u) for p, u in zip(params, used.tolist())}
