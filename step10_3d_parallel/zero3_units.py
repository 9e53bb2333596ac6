"""ZeRO-3's layout: which parameters are gathered together, which of their elements each rank
keeps, and how the model keeps its names while holding only pieces. ``FullyShardedDP`` (zero3.py)
builds its units here, once; its hooks then only gather, free and reduce-scatter them. What is held
where, not when it moves: a second idea, so a file of its own, read before zero3.py (its rules 1,
2 and 6 are this file's 1, 2 and 3).

1. **Units.** The model is cut into units: the submodules given (GPT-2's blocks) and one root unit
   for every parameter no unit holds (embeddings, the tied output layer, the last LayerNorm). A
   parameter belongs to the innermost unit that contains it; a unit left with no parameter is no
   unit at all. A unit's parameters are laid end to end in one flat range of L elements, padded to
   Lp, a multiple of N; rank r keeps [r*Lp/N, (r+1)*Lp/N) (step 5's slices), and one layout serves
   parameters, gradients and optimiser state alike. A parameter tied across two units is refused: it
   would be gathered, and its gradient reduced, in two places.
2. **Pieces under the original names.** Every registered parameter is replaced by this rank's piece
   of it: a 1-D ``nn.Parameter`` that views the unit's shard (0 elements where the rank owns none
   of it).
   ``named_parameters()`` still says ``transformer.h.0.attn.c_q.weight``, so a plain torch optimiser
   steps the pieces in place and weight decay, decided by name, lands where it always did. While a
   unit computes, its modules hold full views of the gathered range instead (``full_views``,
   ``install``), under the same names.
3. **Built from nothing.** The model may be built on the meta device (no memory at all);
   ``init_fn(name, shape)`` gives each parameter's values, one full parameter at a time, and the
   rank keeps its slice.
   No broadcast: the values are a pure function of the name, so every rank agrees without talking.
   Buffers are small: every rank keeps them whole.
"""

import math

import torch

# Where a unit's full parameters are: its hooks (zero3.py) move it from one to the next and back.
SHARDED, GATHERING, GATHERED = "sharded", "gathering", "gathered"


class Unit:
    """Parameters gathered, freed and reduce-scattered together: one flat range of Lp elements.

    ``entries``: (first name, parameter, [(module, attribute)] where it is registered: two for a
    tied weight). Fills this rank's shard from ``value(name, param)``, one full parameter at a time,
    and cuts the pieces.
    """

    def __init__(self, name: str, module, entries: list, value, world_size: int, rank: int, device):
        # world_size, rank: of the shard group (the whole world, but for HSDP: hsdp.py's rule 2)
        self.name, self.module = name, module
        self.names, self.registrations = [e[0] for e in entries], [e[2] for e in entries]
        self.shapes = [param.shape for _, param, _ in entries]
        # frozen ones get no gradient
        self.trainable = [param.requires_grad for _, param, _ in entries]
        self.numels = [math.prod(shape) for shape in self.shapes]
        self.padded = -(-sum(self.numels) // world_size) * world_size  # Lp
        size = self.padded // world_size
        self.shard = torch.zeros(size, device=device)  # this rank's elements; the padding stays 0
        # this rank's averaged gradient: allocated by the first reduce-scatter
        self.grad_shard = None
        self.slices, self.pieces, self.ranges, begin = [], [], [], 0
        for (name, param, _), numel in zip(entries, self.numels):
            # this rank's elements of the parameter, in the unit: [lo, hi)
            lo = max(begin, rank * size)
            # hi == lo: the rank owns none of it
            hi = max(lo, min(begin + numel, (rank + 1) * size))
            self.slices.append(slice(lo - rank * size, hi - rank * size))
            self.ranges.append((lo - begin, hi - begin))  # the same elements, within the parameter
            with torch.no_grad():  # the full value lives only until its slice is copied
                self.shard[self.slices[-1]] = value(name, param).reshape(-1)[
                    lo - begin : hi - begin
                ]
            self.pieces.append(
                torch.nn.Parameter(self.shard[self.slices[-1]], requires_grad=param.requires_grad)
            )
            begin += numel
        # What the hooks (zero3.py) set and clear as the unit moves. The full-size leaf: created by
        # the first gather, its storage freed between uses.
        self.flat = None
        # param_dtype under no_sync: the micro-batches' gradients summed in reduce_dtype
        self.accumulated = None
        self.state, self.handle, self.views = SHARDED, None, None
        self.sending = None  # param_dtype: the shard cast to 16 bits, in flight in the all-gather
        self.work = self.output = None  # the reduce-scatter in flight and the buffer it writes
        self.input = None  # the full gradient it reads

    # shaped like the parameters; the padding left out
    def full_views(self, flat: torch.Tensor) -> list:
        sizes = self.numels + [self.padded - sum(self.numels)]
        # frozen: no gradient path
        chunks, detached = torch.split(flat, sizes), torch.split(flat.detach(), sizes)
        return [
            (chunk if trainable else frozen).view(shape)
            for chunk, frozen, trainable, shape in zip(
                chunks, detached, self.trainable, self.shapes
            )
        ]

    def install(self, tensors: list) -> None:
        """Make ``tensors`` (pieces, or full views) the modules' parameters
        (``setattr`` would refuse a view)."""
        for tensor, where in zip(tensors, self.registrations):
            for module, attribute in where:
                module._parameters[attribute] = tensor


def build_units(
    model, unit_modules: list, init_fn, world_size: int, rank: int, device
) -> list[Unit]:
    """``model``'s units (rule 1; the root first, if it holds any parameter), each parameter
    replaced by this rank's piece (rule 2), the values from ``init_fn`` where they are on the meta
    device (rule 3). ``world_size``, ``rank``: of the shard group."""
    names = {m: n for n, m in model.named_modules()}
    unit_names = [names[m] for m in unit_modules]  # KeyError: not a submodule of the model
    full_name = lambda module, attribute: f"{names[module]}.{attribute}".lstrip(".")  # noqa: E731
    where = {}  # parameter -> where it is registered, first (named_parameters()' name) first
    for module in names:
        for attribute, param in module._parameters.items():
            if param is not None:
                where.setdefault(param, []).append((module, attribute))

    def owner(module) -> int:  # the innermost unit holding the module (0: the root)
        inside = [
            i + 1 for i, u in enumerate(unit_names) if f"{names[module]}.".startswith(f"{u}.")
        ]
        return max(inside, key=lambda i: len(unit_names[i - 1]), default=0)

    entries = [[] for _ in range(len(unit_modules) + 1)]
    for param, registered in where.items():
        owners = {owner(module) for module, _ in registered}
        if len(owners) > 1:  # it would be gathered, and its gradient reduced, in two places
            raise ValueError(
                f"{full_name(*registered[0])} is tied across units ("
                f"{', '.join(sorted(['root', *unit_names][o] for o in owners))}): wrap one module "
                "that holds every use of it, or leave them all to the root"
            )
        entries[owners.pop()].append((full_name(*registered[0]), param, registered))

    def value(name, tensor):
        if tensor.is_meta and init_fn is None:
            raise ValueError(f"{name} is on the meta device: pass init_fn to give it values")
        return (init_fn(name, tensor.shape) if tensor.is_meta else tensor.detach()).to(
            device, tensor.dtype
        )

    units = [
        Unit(name, m, e, value, world_size, rank, device)
        for name, m, e in zip(["root"] + unit_names, [model] + unit_modules, entries)
        if e
    ]
    for unit in units:
        unit.install(unit.pieces)
    for module in names:  # buffers are small: every rank keeps them whole
        for attribute, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[attribute] = value(full_name(module, attribute), buffer)
    return units
