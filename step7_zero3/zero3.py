"""FullyShardedDP: ZeRO stage 3, every rank keeps 1/N of the parameters, gathered only for use.

Step 6 still kept every parameter on every rank; here:

1. **Units.** The model is cut into units (the submodules given, GPT-2's blocks, and a root unit
   for every other parameter). A unit's parameters are one flat range, padded to Lp, a multiple of
   N; rank r keeps [r*Lp/N, (r+1)*Lp/N), its shard (zero3_units.py's rule 1).
2. **Pieces under the original names.** Every parameter is replaced by this rank's piece of it, a
   view of the unit's shard under the parameter's own name, so a plain torch optimiser steps the
   pieces in place (zero3_units.py's rule 2).
3. **Gather before use, free after.** A forward pre-hook all-gathers the unit's shards into one
   buffer of Lp elements and points the module's parameters at views of it; the post-hook points
   them back at the pieces and frees the buffer (its storage is resized to 0: the memory goes back
   to the allocator). Backward needs the weights again: a hook on the gradient of the unit's output
   gathers them once more just before the unit's backward runs. The root unit is gathered first and
   kept until the end of backward: the tied embedding is used at both ends of the model (a hook on
   the model's output gathers it again if an earlier backward freed it: a pipeline runs several
   forwards before their backwards, step 10). A frozen parameter (``requires_grad`` False) is
   gathered and freed like the others, but no gradient is computed or reduced for it.
4. **One flat gradient per unit.** The views are cut (``torch.split``) from one flat leaf tensor, so
   autograd sums every use of every parameter of the unit into ``flat.grad`` and runs the leaf's
   post-accumulate hook once, when the unit's backward is over. That hook frees the gathered weights
   and launches the unit's reduce-scatter: rank r receives the sum of every rank's slice r, divided
   by N and rounded to float32 once (reduced in float64: the exact mode of steps 3-6).
5. **Prefetch.** When a unit starts, the next one's all-gather is launched (forward: the next unit
   in forward order; backward: the one before it), so the transfer overlaps this unit's compute.
   Every read waits on its handle first. At most one reduce-scatter is in flight: the next unit's
   hook waits for it, so backward holds about two units' full gradients (plus what the collective
   copies), not all.
6. **Built from nothing.** The model may be built on the meta device; ``init_fn(name, shape)`` gives
   each parameter's values, and each rank keeps its slice, no broadcast (zero3_units.py's rule 3).
7. **Mixed precision** (``param_dtype``, as FSDP2's ``MixedPrecisionPolicy``): the float32 shards
   stay the masters, gathers and compute are 16-bit, gradients are reduced in float32
   (zero3_mixed_precision.py).
8. **no_sync() and one sync point**, as in steps 4-6. Inside ``no_sync()`` full gradients accumulate
   in ``flat.grad`` (as DDP's do in ``param.grad``: bitwise parity needs the same sums); the next
   synchronised backward reduce-scatters them. ``finish_gradient_synchronization()`` waits for the
   last reduce-scatter and points each piece's ``.grad`` at its slice of the unit's gradient shard.

Collectives are matched by the order they are issued in. Every rank runs the same graph, so the
hooks fire, and launch their collectives, in the same order everywhere. The layout (rules 1, 2, 6):
zero3_units.py, read before this file. Saving, loading, the full parameters by name and what the
trainer measures: zero3_state.py. GPT-2 from step 7's flags: zero3_setup.py. HSDP (``mesh``: N read
as the N/R ranks of a row, the gradient all-reduced across the rows): hsdp.py.
"""

import contextlib
import functools
import weakref

import torch
import torch.distributed as dist

from comm_accounting import all_gather_single, count_collective, reduce_scatter_single
from hsdp import average, hybrid_mesh
from zero3_mixed_precision import accumulate, cast_forward_inputs
from zero3_state import FullyShardedState
from zero3_units import GATHERED, GATHERING, SHARDED, Unit, build_units


class FullyShardedDP(FullyShardedState, torch.nn.Module):
    """Wrap ``module`` for fully sharded data parallelism over the default process group.

    ``units``: submodules, each sharded and gathered as one unit;
    a root unit holds every other parameter.
    ``init_fn(name, shape)``: the values of a parameter (or buffer) that is on the meta device.
    ``param_dtype``: the dtype parameters are gathered and computed in (None: their own, float32).
    ``mesh``: an ``hsdp.HybridMesh``, to shard over its rows and replicate over its columns (None:
    the world). Contract as in steps 4-6: the same forwards and backwards on every rank; after the
    last backward of an optimiser step (the one outside ``no_sync()``) call
    ``finish_gradient_synchronization()`` once.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        units,
        init_fn=None,
        reshard_after_forward: bool = True,
        reduce_dtype: torch.dtype = torch.float32,
        prefetch: bool = True,
        device=None,
        param_dtype: torch.dtype | None = None,
        mesh=None,
    ):
        super().__init__()
        self.module, self.param_dtype = module, param_dtype
        self.world_size, self.rank = dist.get_world_size(), dist.get_rank()
        # the shard group (all ranks, or a row: HSDP) the units are cut over
        self.mesh = mesh or hybrid_mesh()
        self.reshard_after_forward = reshard_after_forward
        self.reduce_dtype, self.prefetch = reduce_dtype, prefetch
        self.device = torch.device(device or "cpu")
        self.require_sync = True
        # the layout, built once (zero3_units.py)
        self.units = build_units(
            module, list(units), init_fn, self.mesh.shard_size, self.mesh.shard_rank, self.device
        )
        # None: no parameter of its own
        self.root = self.units[0] if self.units[0].module is module else None
        module.register_forward_pre_hook(self._root_pre_forward)
        module.register_forward_hook(self._root_post_forward)
        for unit in self.units[1:] if self.root else self.units:
            unit.module.register_forward_pre_hook(functools.partial(self._pre_forward, unit))
            unit.module.register_forward_hook(functools.partial(self._post_forward, unit))
        # as FSDP2's cast_forward_inputs: every unit computes in param_dtype
        if param_dtype is not None:
            cast_forward_inputs({module, *(unit.module for unit in self.units)}, param_dtype)
        # Units as their forwards begin, a unit called twice listed twice: recorded in the first
        # forward (every forward runs the same graph), it says what to prefetch at each call.
        # forward_calls: calls so far.
        self.forward_order, self.forward_calls, self.recorded = [], 0, False
        # units as their forwards ended, this forward; reversed: backward's order
        self.post_forward_order = []
        self.reducing = None  # the unit whose reduce-scatter is in flight
        # units reduce-scattered in this optimiser step (cleared by the sync point)
        self.reduced = set()
        self.gathered_bytes = self.peak_gathered_bytes = 0

    def forward(self, *args, **kwargs):
        if self.reduced:  # a synchronised backward ran, and nobody finished it
            raise RuntimeError(
                "FullyShardedDP: call finish_gradient_synchronization() after the last backward of "
                "every optimiser step, before optimizer.step(): without it the pieces' .grad are "
                "not this step's averaged gradients (the last step used stale or no gradients)"
            )
        return self.module(*args, **kwargs)

    # the original names, as FSDP2 keeps them (no "module.")
    def named_parameters(self, *args, **kwargs):
        return self.module.named_parameters(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward inside this block accumulates full gradients locally: no reduce-scatter."""
        previous, self.require_sync = self.require_sync, False
        try:
            yield
        finally:
            self.require_sync = previous

    # ---- Gather and free -------------------------------------------------------------------------
    def _launch_gather(self, unit: Unit) -> None:
        if unit.state != SHARDED:
            return
        if unit.flat is None:
            unit.flat = torch.empty(
                unit.padded,
                dtype=self.param_dtype or unit.shard.dtype,
                device=self.device,
                requires_grad=any(unit.trainable),
            )
            if any(unit.trainable):  # a unit of frozen parameters has no backward of its own to end
                # Weakly, as step 4's hooks: a tensor's hooks live where Python's garbage collector
                # does not look, and a hook holding the unit (which holds this tensor) would keep
                # it, and the wrapper, for good.
                me, unit_ref = weakref.ref(self), weakref.ref(unit)
                unit.flat.register_post_accumulate_grad_hook(
                    lambda flat: me() and me()._post_backward(unit_ref(), flat)
                )
        else:
            unit.flat.untyped_storage().resize_(unit.padded * unit.flat.element_size())
        self.gathered_bytes += unit.padded * unit.flat.element_size()
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)
        count_collective("all_gather", unit.flat)
        # Into .data: a write autograd does not count, so what backward saved from the last gather
        # stays valid. With param_dtype the shard goes out cast to 16 bits, a copy freed after the
        # wait (see _gathered).
        unit.sending = unit.shard.to(unit.flat.dtype)
        unit.handle = all_gather_single(
            unit.flat.data, unit.sending, group=self.mesh.shard_group, async_op=True
        )
        unit.state = GATHERING

    def _gathered(self, unit: Unit) -> None:  # launching the gather if nobody did
        self._launch_gather(unit)
        if unit.state == GATHERING:
            unit.handle.wait()
            # the 16-bit copy: freed now, here (gloo's thread may hold it last)
            if unit.sending is not unit.shard:
                unit.sending.untyped_storage().resize_(0)
            unit.state, unit.handle, unit.sending = GATHERED, None, None

    def _free(self, unit: Unit) -> None:
        if unit.state == SHARDED:
            return
        # a prefetched gather still writes into the buffer: let it finish first
        self._gathered(unit)
        unit.flat.untyped_storage().resize_(0)  # the memory goes back to the allocator now
        self.gathered_bytes -= unit.padded * unit.flat.element_size()
        unit.state = SHARDED

    def _prefetch(self, order: list, position: int) -> None:
        """Start gathering ``order[position]``, the unit that runs next, if there is one."""
        if self.prefetch and 0 <= position < len(order):
            self._launch_gather(order[position])

    # ---- The hooks -------------------------------------------------------------------------------
    def _root_pre_forward(self, module, args) -> None:
        self.post_forward_order, self.forward_calls = [], 0
        if self.root is None:  # no parameter of its own: only start the first unit's gather
            self._prefetch(self.forward_order, 0)
            return
        self._launch_gather(self.root)
        self._prefetch(self.forward_order, 0)
        self._gathered(self.root)
        self.root.views = self.root.full_views(self.root.flat)
        self.root.install(self.root.views)

    def _root_post_forward(self, module, args, output) -> None:
        self.recorded = True
        if self.root is None:
            return
        # the graph keeps the views; the weights stay gathered for backward
        self.root.install(self.root.pieces)
        if not torch.is_grad_enabled():
            self._free(self.root)  # no backward will come
        elif tensors := [t for t in _tensors_in(output) if t.requires_grad]:
            # gathered again if another forward's backward
            # freed it since (nothing if it is still gathered)
            hook = functools.partial(self._root_pre_backward, self.root)
            torch.autograd.graph.register_multi_grad_hook(tensors, hook, mode="any")

    def _pre_forward(self, unit: Unit, module, args) -> None:
        position, self.forward_calls = self.forward_calls, self.forward_calls + 1
        if not self.recorded:
            self.forward_order.append(unit)
        self._launch_gather(unit)
        self._prefetch(self.forward_order, position + 1)
        self._gathered(unit)
        unit.views = unit.full_views(unit.flat)
        unit.install(unit.views)

    def _post_forward(self, unit: Unit, module, args, output) -> None:
        unit.install(unit.pieces)
        position = len(self.post_forward_order)
        self.post_forward_order.append(unit)
        if torch.is_grad_enabled():
            tensors = [t for t in _tensors_in(output) if t.requires_grad]
            # runs when the gradient of the unit's output is known: the unit's backward comes next
            if tensors:
                hook = functools.partial(self._pre_backward, unit, position)
                torch.autograd.graph.register_multi_grad_hook(tensors, hook, mode="any")
        if self.reshard_after_forward or not torch.is_grad_enabled():
            self._free(unit)

    def _pre_backward(self, unit: Unit, position: int, grad) -> None:
        """``position``: where this call of the unit ended in forward;
        the call that ended before it runs next."""
        self._launch_gather(unit)
        self._prefetch(self.post_forward_order, position - 1)
        self._gathered(unit)
        # for activation checkpointing: the forward recomputed in backward reads them
        unit.install(unit.views)

    def _root_pre_backward(self, root: Unit, grad) -> None:
        self._gathered(root)  # the views backward saved read the buffer the gather fills again

    def _post_backward(self, unit: Unit, flat: torch.Tensor) -> None:
        """Runs once per backward, after every gradient
        of the unit has been summed into ``flat.grad``."""
        unit.install(unit.pieces)
        self._free(unit)
        if self.require_sync:
            self._reduce_scatter(unit)
        elif self.param_dtype is not None:  # no_sync: this 16-bit gradient into a reduce_dtype sum
            unit.accumulated = accumulate(unit, self.reduce_dtype)

    # ---- Gradients -------------------------------------------------------------------------------
    def _reduce_scatter(self, unit: Unit) -> None:
        if self.reducing is not None:
            # at most one in flight: bounds full-gradient memory
            self._finish_reduce_scatter(self.reducing)
        # None: no gradient reached the unit: zeros, so no peer waits
        full = getattr(unit.flat, "grad", None)
        if unit.accumulated is not None:  # param_dtype with no_sync: the earlier micro-batches' sum
            full, unit.accumulated = accumulate(unit, self.reduce_dtype), None
        full = (torch.zeros(unit.padded, device=self.device) if full is None else full).to(
            self.reduce_dtype
        )
        if unit.flat is not None:
            unit.flat.grad = None  # the collective's handle keeps what it still reads
        if unit.grad_shard is None:
            unit.grad_shard = torch.zeros(len(unit.shard), device=self.device)
        unit.output = (
            unit.grad_shard
            if self.reduce_dtype == torch.float32
            else full.new_empty(len(unit.shard))
        )
        count_collective("reduce_scatter", full)
        # its storage is freed after the wait, in this thread, as an all-gather's copy is
        unit.input = full
        unit.work = reduce_scatter_single(
            unit.output, full, group=self.mesh.shard_group, async_op=True
        )
        self.reducing = unit
        self.reduced.add(unit)

    def _finish_reduce_scatter(self, unit: Unit) -> None:
        # gloo writes the output only here (and its handle has no future to call back)
        unit.work.wait()
        unit.input.untyped_storage().resize_(0)
        # Divided by N (HSDP: all-reduced across the replicas
        # too, hsdp.py); float64 -> float32 rounds here, once
        unit.grad_shard.copy_(average(unit.output, self.mesh, self.reduce_dtype))
        unit.work = unit.output = unit.input = self.reducing = None

    def finish_gradient_synchronization(self) -> None:
        """Wait for the last reduce-scatter;
        then each piece's ``.grad`` is its slice of the averaged gradient."""
        # the optimiser is about to change the shards: no gathered copy may outlive them
        for unit in self.units:
            # (a unit of frozen parameters, gathered for backward, has no hook that frees it)
            self._free(unit)
        missing = [unit for unit in self.units if any(unit.trainable) and unit not in self.reduced]
        for unit in missing:  # in unit order on every rank
            self._free(unit)
            self._reduce_scatter(unit)
        if self.reducing is not None:
            self._finish_reduce_scatter(self.reducing)
        for unit in self.units:
            for piece, part, trainable in zip(unit.pieces, unit.slices, unit.trainable):
                if trainable:
                    piece.grad = unit.grad_shard[part]
        self.reduced = set()
        if missing:
            raise RuntimeError(
                f"unit(s) {', '.join(u.name for u in missing)} received no gradient in this step; "
                "make every parameter take part in the loss"
            )


def _tensors_in(output) -> list:
    """The tensors in a module's output: a tensor, or tuples,
    lists and dicts of them (ModelOutput is a dict)."""
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (tuple, list)):
        return [t for item in output for t in _tensors_in(item)]
    return [output] if torch.is_tensor(output) else []
