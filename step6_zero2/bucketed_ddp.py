"""BucketedDDP: data parallelism that talks while backward is still computing.

Step 3 waited for backward to finish, then issued one all-reduce per parameter. Two costs: many
small messages (each pays a fixed latency), and a network that idles while backward computes. Here:

1. **Hooks.** Each parameter gets a hook that fires once its gradient has been *accumulated* into
   ``param.grad`` (``register_post_accumulate_grad_hook``). A hook on the gradient itself would fire
   before accumulation and see only this backward's contribution: with gradient accumulation it
   would reduce the wrong thing.
2. **Buckets.** Parameters are grouped, in the order their gradients become ready (the reverse of
   registration order: backward runs from the last layer to the first), into buckets of about
   ``bucket_cap_mb`` MiB, each one flat buffer. The first bucket is small (``first_bucket_cap_mb``),
   as in PyTorch DDP, so the first message leaves as early as possible.
3. **Overlap.** When the last gradient of a bucket is ready, the bucket's all-reduce is launched
   asynchronously and backward carries on with the earlier layers while it runs.
4. **One sync point.** ``finish_gradient_synchronization()``, called once before the optimiser
   step, waits for every bucket, divides by the world size and writes the averaged gradients back.
5. **no_sync().** Inside it, backward only accumulates into ``param.grad``; the next synchronised
   backward reduces the accumulated sum.

Every rank launches the buckets in the same order (bucket 0, 1, 2, ...), whatever order they become
ready in: collectives are matched by order, so this is what makes them pair up correctly.
Parameters that got no gradient in a step are handled in the last section of this file.
"""

import contextlib
import time
import weakref

import torch
import torch.distributed as dist

from comm_accounting import count_collective


class Bucket:
    """A flat buffer of ``numel`` elements holding the gradients
    of a few parameters, reduced with one collective."""

    def __init__(self, index: int, params: list, dtype: torch.dtype, numel: int):
        self.index, self.params, self.dtype, self.numel = index, params, dtype, numel
        self.buffer = self.slots = None  # made by allocate()
        self.work = None  # the collective in flight
        self.timeline = None  # a list to record launch/finish times in, when overlap_trace.py asks
        self.reset()

    def allocate(self):
        self.buffer = torch.zeros(self.numel, dtype=self.dtype, device=self.params[0].device)
        # slots[i]: the part of the buffer that holds
        # params[i]'s gradient, shaped like the parameter
        self.slots, offset = [], 0
        for p in self.params:
            self.slots.append(self.buffer[offset : offset + p.numel()].view_as(p))
            offset += p.numel()

    def reset(self):
        """No gradient in yet: ready for the next backward."""
        self.ready = [False] * len(self.params)
        self.pending = len(self.params)


def assign_buckets(
    params: list, bucket_cap_bytes: float, first_bucket_cap_bytes: float
) -> list[list]:
    """Split ``params`` (in gradient-ready order) into consecutive groups of about the cap in bytes.
    A group closes once it reaches its cap;
    a parameter larger than the cap gets a group of its own."""
    groups, current, size = [], [], 0
    for p in params:
        current.append(p)
        size += p.numel() * p.element_size()
        if size >= (first_bucket_cap_bytes if not groups else bucket_cap_bytes):
            groups.append(current)
            current, size = [], 0
    return groups + ([current] if current else [])


class BucketedDDP(torch.nn.Module):
    """Wrap ``module`` for data parallelism over the default process group.

    Contract: call ``forward`` and ``backward`` on every rank the same number of times; after the
    last backward of an optimiser step (the one outside ``no_sync()``) call
    ``finish_gradient_synchronization()`` once; then every rank holds the same averaged gradients.
    ``reduce_dtype=torch.float64`` reduces in float64 (exact, order-free) and rounds back once.

    What a bucket's collective is lives in four methods, ``_make_bucket``, ``_fill``, ``_launch``
    and ``_finish``: step 6 (ZeRO-2) overrides them to reduce-scatter each bucket instead. What a
    parameter puts in and takes out lives in two, ``_local_gradient`` and ``_write_back``.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        bucket_cap_mb: float = 25.0,
        first_bucket_cap_mb: float = 1.0,
        reduce_dtype: torch.dtype = torch.float32,
        find_unused_parameters: bool = False,
    ):
        super().__init__()
        self.module = module
        self.world_size = dist.get_world_size()
        self.find_unused_parameters = find_unused_parameters
        self.reduce_dtype = reduce_dtype
        self.require_sync = True

        # Every replica starts from rank 0's state.
        for tensor in list(module.parameters()) + list(module.buffers()):
            count_collective("broadcast", tensor)
            dist.broadcast(tensor.data, src=0)

        # parameters() lists a tied parameter once; frozen ones need no reduction.
        ready_order = [p for p in module.parameters() if p.requires_grad][::-1]
        self.names = {p: n for n, p in module.named_parameters()}
        groups = assign_buckets(
            ready_order, bucket_cap_mb * 2**20, min(first_bucket_cap_mb, bucket_cap_mb) * 2**20
        )
        self.buckets = [self._make_bucket(i, group) for i, group in enumerate(groups)]
        self.location = {
            p: (bucket, i) for bucket in self.buckets for i, p in enumerate(bucket.params)
        }
        self.next_to_launch = 0
        self._register_hooks(ready_order)

    def _make_bucket(self, index: int, params: list) -> Bucket:
        bucket = Bucket(index, params, self.reduce_dtype, numel=sum(p.numel() for p in params))
        bucket.allocate()  # once: every backward reuses it, as PyTorch DDP's buckets
        return bucket

    def _register_hooks(self, params: list) -> None:
        # Weakly: a parameter's hooks live in autograd's C++ graph, where Python's garbage collector
        # does not look, so a hook holding this wrapper (which holds the parameter) would keep both
        # alive for good, and the process group with them (tests/test_data_parallel.py). A parameter
        # that outlives the wrapper trains alone.
        me = weakref.ref(self)
        for p in params:  # fires after backward has added this pass's gradient into p.grad
            p.register_post_accumulate_grad_hook(
                lambda param: me() and me()._on_gradient_ready(param)
            )

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward inside this block only accumulates gradients locally: no communication."""
        previous, self.require_sync = self.require_sync, False
        try:
            yield
        finally:
            self.require_sync = previous

    def _on_gradient_ready(self, param: torch.Tensor) -> None:
        """Runs inside backward, right after ``param.grad``
        received this backward's contribution."""
        if not self.require_sync:
            return
        bucket, i = self.location[param]
        if bucket.ready[i]:
            raise RuntimeError(
                f"gradient of {self.names[param]} became ready twice in one backward; "
                "call finish_gradient_synchronization() after each synchronised backward"
            )
        self._fill(bucket, i, self._local_gradient(param))
        self._launch_ready_buckets()

    def _local_gradient(self, param: torch.Tensor):
        """What this rank reduces for ``param``:
        the gradient backward accumulated in ``param.grad``."""
        return param.grad

    def _fill(self, bucket: Bucket, i: int, grad) -> None:
        """Put this rank's gradient of ``bucket.params[i]`` into its slot (zeros for None)."""
        if grad is not None:
            bucket.slots[i].copy_(grad)
        else:
            bucket.slots[i].zero_()
        bucket.ready[i], bucket.pending = True, bucket.pending - 1

    def _launch_ready_buckets(self) -> None:
        # Launch in bucket order only: bucket k waits until buckets 0..k-1 have been launched.
        while (
            self.next_to_launch < len(self.buckets)
            and self.buckets[self.next_to_launch].pending == 0
        ):
            self._launch(self.buckets[self.next_to_launch])
            self.next_to_launch += 1

    def _launch(self, bucket: Bucket) -> None:
        """Start the bucket's all-reduce; backward carries on while it runs."""
        count_collective("all_reduce", bucket.buffer)
        launched = time.perf_counter()
        bucket.work = dist.all_reduce(bucket.buffer, async_op=True)
        if bucket.timeline is not None:  # overlap_trace.py wants to see when it ran
            event = {"launched": launched, "finished": None}
            bucket.timeline.append(event)
            bucket.work.get_future().then(
                lambda _, event=event: event.update(finished=time.perf_counter())
            )

    def finish_gradient_synchronization(self) -> None:
        """Wait for every bucket, average,
        and write the result into ``param.grad``. Once per optimiser step."""
        unused = self._complete_the_buckets_backward_left_open()
        used_anywhere = self._used_by_any_rank(unused) if self.find_unused_parameters else None
        unused_ids = {id(p) for p in unused}
        # A gradient for what this rank used, and
        # (find_unused_parameters=True) for what any rank used.
        receiving = {
            p
            for p in self.location
            if id(p) not in unused_ids or (used_anywhere and used_anywhere[p])
        }
        for bucket in self.buckets:  # every bucket's collective is in flight here
            self._finish(bucket, receiving)
        if unused and not self.find_unused_parameters:
            names = ", ".join(self.names[p] for p in unused)
            raise RuntimeError(
                f"parameter(s) {names} received no gradient in this step; make every trainable "
                "parameter take part in the loss, or pass find_unused_parameters=True"
            )

    def _finish(self, bucket: Bucket, receiving: set) -> None:
        """Wait for the bucket's all-reduce, average,
        and write the gradients of ``receiving`` back."""
        bucket.work.wait()
        bucket.work = None
        bucket.buffer.div_(self.world_size)
        for p, slot in zip(bucket.params, bucket.slots):
            self._write_back(p, slot, receiving)

    def _write_back(self, p: torch.Tensor, slot: torch.Tensor, receiving: set) -> None:
        """The averaged gradient ``slot`` into ``p.grad``."""
        if p.grad is not None:
            p.grad.copy_(slot)  # float64 -> float32 rounds here, once
        elif p in receiving:  # used by another rank only
            p.grad = slot.to(p.dtype, copy=True)

    # ---- Parameters without a gradient in this backward ------------------------------------------
    # Their hooks never fired, so their buckets are still open when backward ends. A parameter that
    # got a gradient in an earlier micro-batch (inside no_sync) still has it in ``param.grad``: that
    # accumulated gradient is what gets reduced. A parameter with no gradient at all is reduced as
    # zeros, so no peer is left waiting; then, with ``find_unused_parameters=False`` (the default,
    # as in DDP) it is an error naming it. With ``True``, one extra small all-reduce tells every
    # rank which parameters nobody used, and those keep ``grad=None`` (as PyTorch DDP does), so the
    # optimiser skips them.

    def _complete_the_buckets_backward_left_open(self) -> list:
        """Fill and launch every bucket backward did not complete, and get the buckets ready for the
        next backward; return the parameters with no gradient."""
        unused = []
        for bucket in self.buckets[self.next_to_launch :]:
            for i, p in enumerate(bucket.params):
                if bucket.ready[i]:
                    continue
                grad = self._local_gradient(p)  # not None: a gradient from an earlier micro-batch
                if grad is None:
                    unused.append(p)
                self._fill(bucket, i, grad)
        self._launch_ready_buckets()
        # their collectives are in flight; the next backward fills them anew
        for bucket in self.buckets:
            bucket.reset()
        self.next_to_launch = 0
        return unused

    def _used_by_any_rank(self, locally_unused: list) -> dict:
        """One small all-reduce: for each parameter, did any rank produce a gradient for it?"""
        params, unused_ids = list(self.location), {id(p) for p in locally_unused}
        used = torch.tensor(
            [id(p) not in unused_ids for p in params], dtype=torch.int32, device=params[0].device
        )
        count_collective("all_reduce", used)
        dist.all_reduce(used)
        return {p: bool(u) for p, u in zip(params, used.tolist())}
