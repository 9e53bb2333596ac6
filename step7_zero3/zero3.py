"""FullyShardedDP: ZeRO stage 3, every rank keeps 1/N of the parameters and gathers them only for use.

Step 6 still kept every parameter on every rank; here:

1. **Units.** The model is cut into units: the submodules given (GPT-2's blocks) and one root unit for
   every parameter no unit holds (embeddings, the tied output layer, the last LayerNorm). A parameter
   belongs to the innermost unit that contains it; a unit left with no parameter is no unit at all. A unit's parameters are laid end to end in one flat
   range of L elements, padded to Lp, a multiple of N; rank r keeps [r*Lp/N, (r+1)*Lp/N) (step 5's
   slices), and one layout serves parameters, gradients and optimiser state alike.
2. **Pieces under the original names.** Every registered parameter is replaced by this rank's piece of
   it: a 1-D ``nn.Parameter`` that views the unit's shard (0 elements where the rank owns none of it).
   ``named_parameters()`` still says ``transformer.h.0.attn.c_q.weight``, so a plain torch optimiser
   steps the pieces in place and weight decay, decided by name, lands where it always did.
3. **Gather before use, free after.** A forward pre-hook all-gathers the unit's shards into one buffer
   of Lp elements and points the module's parameters at views of it; the post-hook points them back at
   the pieces and frees the buffer (its storage is resized to 0: the memory goes back to the allocator).
   Backward needs the weights again: a hook on the gradient of the unit's output gathers them once more
   just before the unit's backward runs. The root unit is gathered first and kept until the end of
   backward: the tied embedding is used at both ends of the model. A frozen parameter (``requires_grad``
   False) is gathered and freed like the others, but no gradient is computed or reduced for it.
4. **One flat gradient per unit.** The views are cut (``torch.split``) from one flat leaf tensor, so
   autograd sums every use of every parameter of the unit into ``flat.grad`` and runs the leaf's
   post-accumulate hook once, when the unit's backward is over. That hook frees the gathered weights and
   launches the unit's reduce-scatter: rank r receives the sum of every rank's slice r, divided by N and
   rounded to float32 once (reduced in float64: the exact mode of steps 3-6).
5. **Prefetch.** When a unit starts, the next one's all-gather is launched (forward: the next unit in
   forward order; backward: the one before it), so the transfer overlaps this unit's compute. Every
   read waits on its handle first. At most one reduce-scatter is in flight: the next unit's hook waits
   for it, so backward holds about two units' full gradients (plus what the collective copies), not all.
6. **Built from nothing.** The model may be built on the meta device (no memory at all); ``init_fn(name,
   shape)`` gives each parameter's values, one full parameter at a time, and the rank keeps its slice.
   No broadcast: the values are a pure function of the name, so every rank agrees without talking.
7. **Mixed precision, as FSDP2's ``MixedPrecisionPolicy``.** With ``param_dtype`` (bf16 or fp16) the fp32
   shards stay the master copy the optimiser steps; each gather sends the shard cast to 16 bits (half the
   bytes) and forward and backward compute in 16 bits, floating inputs of every unit cast too. Gradients
   are reduced in ``reduce_dtype`` (float32: never rounded to 16 bits on the way to the master weights);
   under ``no_sync()`` each micro-batch's 16-bit gradient is added to a ``reduce_dtype`` sum, as FSDP2 does.
8. **no_sync() and one sync point**, as in steps 4-6. Inside ``no_sync()`` full gradients accumulate in
   ``flat.grad`` (as DDP's do in ``param.grad``: bitwise parity needs the same sums); the next synchronised
   backward reduce-scatters them. ``finish_gradient_synchronization()`` waits for the last reduce-scatter
   and points each piece's ``.grad`` at its slice of the unit's gradient shard.

Collectives are matched by the order they are issued in. Every rank runs the same graph, so the hooks
fire, and launch their collectives, in the same order everywhere.
"""
import contextlib
import functools
import math

import torch
import torch.distributed as dist

from comm_accounting import all_gather_single, reduce_scatter_single, count_collective

SHARDED, GATHERING, GATHERED = "sharded", "gathering", "gathered"


class Unit:
    """Parameters gathered, freed and reduce-scattered together: one flat range of Lp elements.

    ``entries``: (first name, parameter, [(module, attribute)] where it is registered: two for a tied weight).
    Fills this rank's shard from ``value(name, param)``, one full parameter at a time, and cuts the pieces.
    """

    def __init__(self, name: str, module, entries: list, value, world_size: int, rank: int, device):
        self.name, self.module = name, module
        self.names, self.registrations = [e[0] for e in entries], [e[2] for e in entries]
        self.shapes = [param.shape for _, param, _ in entries]
        self.trainable = [param.requires_grad for _, param, _ in entries]  # frozen ones get no gradient
        self.numels = [math.prod(shape) for shape in self.shapes]
        self.padded = -(-sum(self.numels) // world_size) * world_size  # Lp
        size = self.padded // world_size
        self.shard = torch.zeros(size, device=device)  # this rank's elements; the padding stays 0
        self.grad_shard = None  # this rank's averaged gradient: allocated by the first reduce-scatter
        self.slices, self.pieces, self.ranges, begin = [], [], [], 0
        for (name, param, _), numel in zip(entries, self.numels):
            lo = max(begin, rank * size)  # this rank's elements of the parameter, in the unit: [lo, hi)
            hi = max(lo, min(begin + numel, (rank + 1) * size))  # hi == lo: the rank owns none of it
            self.slices.append(slice(lo - rank * size, hi - rank * size))
            self.ranges.append((lo - begin, hi - begin))  # the same elements, within the parameter
            with torch.no_grad():  # the full value lives only until its slice is copied
                self.shard[self.slices[-1]] = value(name, param).reshape(-1)[lo - begin : hi - begin]
            self.pieces.append(torch.nn.Parameter(self.shard[self.slices[-1]], requires_grad=param.requires_grad))
            begin += numel
        self.flat = None  # the full-size leaf: created by the first gather, its storage freed between uses
        self.accumulated = None  # param_dtype under no_sync: the micro-batches' gradients summed in reduce_dtype
        self.state, self.handle, self.views = SHARDED, None, None
        self.sending = None  # param_dtype: the shard cast to 16 bits, in flight in the all-gather
        self.work = self.output = None  # the reduce-scatter in flight and the buffer it writes
        self.input = None  # the full gradient it reads

    def full_views(self, flat: torch.Tensor) -> list:  # shaped like the parameters; the padding left out
        sizes = self.numels + [self.padded - sum(self.numels)]
        chunks, detached = torch.split(flat, sizes), torch.split(flat.detach(), sizes)  # frozen: no gradient path
        return [(chunk if trainable else frozen).view(shape)
                for chunk, frozen, trainable, shape in zip(chunks, detached, self.trainable, self.shapes)]

    def install(self, tensors: list) -> None:
        """Make ``tensors`` (pieces, or full views) the modules' parameters (``setattr`` would refuse a view)."""
        for tensor, where in zip(tensors, self.registrations):
            for module, attribute in where:
                module._parameters[attribute] = tensor


class FullyShardedDP(torch.nn.Module):
    """Wrap ``module`` for fully sharded data parallelism over the default process group.

    ``units``: submodules, each sharded and gathered as one unit; a root unit holds every other parameter.
    ``init_fn(name, shape)``: the values of a parameter (or buffer) that is on the meta device.
    ``param_dtype``: the dtype parameters are gathered and computed in (None: their own, float32).
    Contract as in steps 4-6: the same forwards and backwards on every rank; after the last backward of an
    optimiser step (the one outside ``no_sync()``) call ``finish_gradient_synchronization()`` once.
    """

    def __init__(self, module: torch.nn.Module, units, init_fn=None, reshard_after_forward: bool = True,
                 reduce_dtype: torch.dtype = torch.float32, prefetch: bool = True, device=None,
                 param_dtype: torch.dtype | None = None):
        super().__init__()
        self.module = module
        self.param_dtype = param_dtype
        self.world_size, self.rank = dist.get_world_size(), dist.get_rank()
        self.reshard_after_forward, self.reduce_dtype, self.prefetch = reshard_after_forward, reduce_dtype, prefetch
        self.device = torch.device(device or "cpu")
        self.require_sync = True
        self.units = self._build_units(module, list(units), init_fn)
        self.root = self.units[0] if self.units[0].module is module else None  # None: no parameter of its own
        module.register_forward_pre_hook(self._root_pre_forward)
        module.register_forward_hook(self._root_post_forward)
        for unit in self.units[1:] if self.root else self.units:
            unit.module.register_forward_pre_hook(functools.partial(self._pre_forward, unit))
            unit.module.register_forward_hook(functools.partial(self._post_forward, unit))
        if param_dtype is not None:  # as FSDP2's cast_forward_inputs: every unit computes in param_dtype
            for m in {module, *(unit.module for unit in self.units)}:
                m.register_forward_pre_hook(self._cast_inputs, with_kwargs=True)
        # Units as their forwards begin, a unit called twice listed twice: recorded in the first forward (every
        # forward runs the same graph), it says what to prefetch at each call. forward_calls: calls so far.
        self.forward_order, self.forward_calls, self.recorded = [], 0, False
        self.post_forward_order = []  # units as their forwards ended, this forward; reversed: backward's order
        self.reducing = None  # the unit whose reduce-scatter is in flight
        self.reduced = set()  # units reduce-scattered in this optimiser step (cleared by the sync point)
        self.gathered_bytes = self.peak_gathered_bytes = 0

    def _build_units(self, model, unit_modules: list, init_fn) -> list:
        names = {m: n for n, m in model.named_modules()}
        unit_names = [names[m] for m in unit_modules]  # KeyError: not a submodule of the model
        full_name = lambda module, attribute: f"{names[module]}.{attribute}".lstrip(".")  # noqa: E731
        where = {}  # parameter -> where it is registered, first (named_parameters()' name) first
        for module in names:
            for attribute, param in module._parameters.items():
                if param is not None:
                    where.setdefault(param, []).append((module, attribute))

        def owner(module) -> int:  # the innermost unit holding the module (0: the root)
            inside = [i + 1 for i, u in enumerate(unit_names) if f"{names[module]}.".startswith(f"{u}.")]
            return max(inside, key=lambda i: len(unit_names[i - 1]), default=0)

        entries = [[] for _ in range(len(unit_modules) + 1)]
        for param, registered in where.items():
            owners = {owner(module) for module, _ in registered}
            if len(owners) > 1:  # it would be gathered, and its gradient reduced, in two places
                raise ValueError(f"{full_name(*registered[0])} is tied across units ("
                                 f"{', '.join(sorted(['root', *unit_names][o] for o in owners))}): wrap one module "
                                 "that holds every use of it, or leave them all to the root")
            entries[owners.pop()].append((full_name(*registered[0]), param, registered))

        def value(name, tensor):
            if tensor.is_meta and init_fn is None:
                raise ValueError(f"{name} is on the meta device: pass init_fn to give it values")
            return (init_fn(name, tensor.shape) if tensor.is_meta else tensor.detach()).to(self.device, tensor.dtype)

        units = [Unit(name, m, e, value, self.world_size, self.rank, self.device)
                 for name, m, e in zip(["root"] + unit_names, [model] + unit_modules, entries) if e]
        for unit in units:
            unit.install(unit.pieces)
        for module in names:  # buffers are small: every rank keeps them whole
            for attribute, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[attribute] = value(full_name(module, attribute), buffer)
        return units

    def forward(self, *args, **kwargs):
        if self.reduced:  # a synchronised backward ran, and nobody finished it
            raise RuntimeError("FullyShardedDP: call finish_gradient_synchronization() after the last backward of "
                               "every optimiser step, before optimizer.step(): without it the pieces' .grad are "
                               "not this step's averaged gradients (the last step used stale or no gradients)")
        return self.module(*args, **kwargs)

    def named_parameters(self, *args, **kwargs):  # the original names, as FSDP2 keeps them (no "module.")
        return self.module.named_parameters(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward inside this block accumulates full gradients locally: no reduce-scatter."""
        previous, self.require_sync = self.require_sync, False
        try:
            yield
        finally:
            self.require_sync = previous

    # ---- Gather and free ---------------------------------------------------------------------------
    def _launch_gather(self, unit: Unit) -> None:
        if unit.state != SHARDED:
            return
        if unit.flat is None:
            unit.flat = torch.empty(unit.padded, dtype=self.param_dtype or unit.shard.dtype, device=self.device,
                                    requires_grad=any(unit.trainable))
            if any(unit.trainable):  # a unit of frozen parameters has no backward of its own to end
                unit.flat.register_post_accumulate_grad_hook(functools.partial(self._post_backward, unit))
        else:
            unit.flat.untyped_storage().resize_(unit.padded * unit.flat.element_size())
        self.gathered_bytes += unit.padded * unit.flat.element_size()
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)
        count_collective("all_gather", unit.flat)
        # Into .data: a write autograd does not count, so what backward saved from the last gather stays valid.
        # With param_dtype the shard goes out cast to 16 bits, a copy freed after the wait (see _gathered).
        unit.sending = unit.shard.to(unit.flat.dtype)
        unit.handle = all_gather_single(unit.flat.data, unit.sending, async_op=True)
        unit.state = GATHERING

    def _gathered(self, unit: Unit) -> None:  # launching the gather if nobody did
        self._launch_gather(unit)
        if unit.state == GATHERING:
            unit.handle.wait()
            if unit.sending is not unit.shard:  # the 16-bit copy: freed now, here (gloo's thread may hold it last)
                unit.sending.untyped_storage().resize_(0)
            unit.state, unit.handle, unit.sending = GATHERED, None, None

    def _free(self, unit: Unit) -> None:
        if unit.state == SHARDED:
            return
        self._gathered(unit)  # a prefetched gather still writes into the buffer: let it finish first
        unit.flat.untyped_storage().resize_(0)  # the memory goes back to the allocator now
        self.gathered_bytes -= unit.padded * unit.flat.element_size()
        unit.state = SHARDED

    def _prefetch(self, order: list, position: int) -> None:
        """Start gathering ``order[position]``, the unit that runs next, if there is one."""
        if self.prefetch and 0 <= position < len(order):
            self._launch_gather(order[position])

    # ---- The hooks -----------------------------------------------------------------------------------
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
        self.root.install(self.root.pieces)  # the graph keeps the views; the weights stay gathered for backward
        if not torch.is_grad_enabled():
            self._free(self.root)  # no backward will come

    def _cast_inputs(self, module, args, kwargs):
        cast = lambda t: t.to(self.param_dtype) if torch.is_tensor(t) and t.is_floating_point() else t  # noqa: E731
        return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}

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
            if tensors:  # runs when the gradient of the unit's output is known: the unit's backward comes next
                hook = functools.partial(self._pre_backward, unit, position)
                torch.autograd.graph.register_multi_grad_hook(tensors, hook, mode="any")
        if self.reshard_after_forward or not torch.is_grad_enabled():
            self._free(unit)

    def _pre_backward(self, unit: Unit, position: int, grad) -> None:
        """``position``: where this call of the unit ended in forward; the call that ended before it runs next."""
        self._launch_gather(unit)
        self._prefetch(self.post_forward_order, position - 1)
        self._gathered(unit)
        unit.install(unit.views)  # for activation checkpointing: the forward recomputed in backward reads them

    def _post_backward(self, unit: Unit, flat: torch.Tensor) -> None:
        """Runs once per backward, after every gradient of the unit has been summed into ``flat.grad``."""
        unit.install(unit.pieces)
        self._free(unit)
        if self.require_sync:
            self._reduce_scatter(unit)
        elif self.param_dtype is not None:  # no_sync: add this micro-batch's 16-bit gradient to a reduce_dtype sum
            unit.accumulated = self._upcast_and_add(unit)

    def _upcast_and_add(self, unit: Unit):
        grad, unit.flat.grad = unit.flat.grad, None
        if unit.accumulated is None:
            return None if grad is None else grad.to(self.reduce_dtype)
        return unit.accumulated if grad is None else unit.accumulated.add_(grad)

    # ---- Gradients -----------------------------------------------------------------------------------
    def _reduce_scatter(self, unit: Unit) -> None:
        if self.reducing is not None:
            self._finish_reduce_scatter(self.reducing)  # at most one in flight: bounds full-gradient memory
        full = getattr(unit.flat, "grad", None)  # None: no gradient reached the unit: zeros, so no peer waits
        if unit.accumulated is not None:  # param_dtype with no_sync: the earlier micro-batches' sum
            full, unit.accumulated = self._upcast_and_add(unit), None
        full = (torch.zeros(unit.padded, device=self.device) if full is None else full).to(self.reduce_dtype)
        if unit.flat is not None:
            unit.flat.grad = None  # the collective's handle keeps what it still reads
        if unit.grad_shard is None:
            unit.grad_shard = torch.zeros(len(unit.shard), device=self.device)
        unit.output = unit.grad_shard if self.reduce_dtype == torch.float32 else full.new_empty(len(unit.shard))
        count_collective("reduce_scatter", full)
        unit.input = full  # its storage is freed after the wait, in this thread, as an all-gather's copy is
        unit.work = reduce_scatter_single(unit.output, full, async_op=True)
        self.reducing = unit
        self.reduced.add(unit)

    def _finish_reduce_scatter(self, unit: Unit) -> None:
        unit.work.wait()  # gloo writes the output only here (and its handle has no future to call back)
        unit.input.untyped_storage().resize_(0)
        unit.grad_shard.copy_(unit.output.div_(self.world_size))  # float64 -> float32 rounds here, once
        unit.work = unit.output = unit.input = self.reducing = None

    def finish_gradient_synchronization(self) -> None:
        """Wait for the last reduce-scatter; then each piece's ``.grad`` is its slice of the averaged gradient."""
        for unit in self.units:  # the optimiser is about to change the shards: no gathered copy may outlive them
            self._free(unit)  # (a unit of frozen parameters, gathered for backward, has no hook that frees it)
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
            raise RuntimeError(f"unit(s) {', '.join(u.name for u in missing)} received no gradient in this step; "
                               "make every parameter take part in the loss")

    # ---- Full parameters, unit by unit (export, tests), and what the trainer measures ------------------
    @torch.no_grad()
    def gathered_parameters(self):
        """Collective: yields ``(name, full tensor)`` for every parameter, one unit gathered at a time, into
        a buffer of its own (not ``flat``, whose storage must stay resizable: ``.numpy()`` would pin it)."""
        for unit in self.units:
            full = torch.empty(unit.padded, device=self.device)
            count_collective("all_gather", full)
            all_gather_single(full, unit.shard)
            yield from zip(unit.names, unit.full_views(full))
            del full  # gone once the caller lets go of this unit's tensors

    def piece_ranges(self) -> dict:
        """``{name: (start, end)}``: the elements of each (flattened) parameter this rank's piece holds."""
        return {name: r for unit in self.units for name, r in zip(unit.names, unit.ranges)}

    # ---- Checkpoints (the interface of checkpoint.py: what this rank saves, and loading it back) ----
    def checkpoint_state(self, optimizer=None) -> dict:
        """What this rank saves: its pieces as flat slices (``model``; ``model_slices``, which elements of each
        flattened parameter they are) and, given the ``optimizer`` that steps the pieces, its state dict and the
        slice each of its parameters is (``optimizer``, ``optimizer_slices``). Nothing full-size, no collective."""
        state = {"model": self.module.state_dict(), "model_slices": self.piece_ranges()}
        if optimizer is not None:
            state.update(optimizer=optimizer.state_dict(), optimizer_slices=self._optimizer_slices(optimizer))
        return state

    def load_checkpoint(self, checkpoint, optimizer=None) -> None:
        """Copy this rank's pieces out of ``checkpoint`` (a ``resharding.Checkpoint``, written at any world
        size by any step: only these elements are read) and, given the ``optimizer``, its state for them."""
        ranges = self.piece_ranges()
        with torch.no_grad():
            for name, piece in self.module.named_parameters():
                piece.copy_(checkpoint.parameter(name, *ranges[name]))
        if optimizer is not None:
            params = [p for group in optimizer.param_groups for p in group["params"]]
            optimizer.load_state_dict(checkpoint.optimizer_state_dict(self._optimizer_slices(optimizer), params))

    def _optimizer_slices(self, optimizer) -> list:
        """``(name, start, end)`` of each of ``optimizer``'s parameters (pieces), numbered as its state dict is."""
        ranges, name_of = self.piece_ranges(), {piece: name for name, piece in self.module.named_parameters()}
        return [(name_of[p], *ranges[name_of[p]]) for group in optimizer.param_groups for p in group["params"]]

    @property
    def parameter_shards(self) -> list:
        return [unit.shard for unit in self.units]

    @property
    def gradient_shards(self) -> list:
        return [unit.grad_shard for unit in self.units if unit.grad_shard is not None]

    def take_peak_gathered_bytes(self) -> int:
        """The most bytes of gathered parameters held at once since the last call (tracked, not sampled)."""
        peak, self.peak_gathered_bytes = self.peak_gathered_bytes, self.gathered_bytes
        return peak


def _tensors_in(output) -> list:
    """The tensors in a module's output: a tensor, or tuples, lists and dicts of them (ModelOutput is a dict)."""
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (tuple, list)):
        return [t for item in output for t in _tensors_in(item)]
    return [output] if torch.is_tensor(output) else []


# ---- GPT-2, fully sharded: what step 7's train.py builds ------------------------------------------------------

def add_zero3_flags(parser) -> None:
    flags = parser.add_argument_group("ZeRO-3")
    flags.add_argument("--no-prefetch", action="store_true", help="gather each unit only when it is needed")
    flags.add_argument("--activation-checkpointing", action="store_true",
                       help="recompute each block's activations in backward instead of keeping them")
    flags.add_argument("--offload-optimizer", action="store_true",
                       help="AdamW's state and step in host memory (ZeRO-Offload, offload.py): the device keeps "
                            "parameters and gradients")
    flags.add_argument("--trace", action="store_true", help="write trace.json and timeline.png of the last step")


def checkpoint_activations(blocks) -> None:
    """Keep only each block's input in forward and recompute the rest in backward (preserve_rng_state:
    dropout draws the same masks twice). The block's hooks (rule 3) run around it, once: the recomputation
    calls the inner forward, with the weights the pre-backward hook gathered."""
    for block in blocks:
        block.forward = functools.partial(torch.utils.checkpoint.checkpoint, block.forward, use_reentrant=False,
                                          preserve_rng_state=True)


def shard_gpt2(config: dict, vocab_size: int, device, param_dtype=None) -> tuple:
    """This project's GPT-2 (model.py), fully sharded with its blocks as units: built on the meta device (only
    shapes: no rank ever holds all of it), each rank filling its own slices from ``initial_value``, a pure function
    of (seed, name), so no broadcast is needed (rule 6); --activation-checkpointing, --no-prefetch, --reduce-dtype
    and ``param_dtype`` (--param-dtype's 16-bit dtype, rule 7) as ``config`` says. Returns ``(wrapper, shapes)``:
    the full parameters' shapes by name, which no rank holds any more."""
    from model import GPT2, gpt2_config, initial_value  # here: FullyShardedDP itself needs no particular model
    with torch.device("meta"):
        model = GPT2(gpt2_config(config, vocab_size))
    shapes = {name: p.shape for name, p in model.named_parameters()}
    if config["activation_checkpointing"]:
        checkpoint_activations(model.transformer.h)
    wrapper = FullyShardedDP(model, model.transformer.h, device=device, prefetch=not config["no_prefetch"],
                             init_fn=lambda name, shape: initial_value(name, shape, config["seed"], config["n_layer"]),
                             reduce_dtype=getattr(torch, config["reduce_dtype"]), param_dtype=param_dtype)
    return wrapper, shapes

