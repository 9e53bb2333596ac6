"""This rank's pieces of the parameters and of the optimiser's state as a
torch.distributed.checkpoint (DCP) state dict, and back: saved under the model's own names, read
back at any layout, opened by any DCP reader.

1. **Names, not ranks.** ``model.<name>`` is parameter ``name``, ``optim.state.<name>.<key>`` its
   optimiser state (AdamW's ``exp_avg``, ``exp_avg_sq``, ``step``), ``optim.param_groups.<name>``
   its group's hyperparameters, as torch's flattened optimiser state dict names them:
   ``dcp_to_torch_save`` gives whole tensors of the model's shapes.
2. **A piece is a few boxes.** A rank's tensor holds elements [start, start + numel) of the
   flattened block of sizes ``block`` at ``offsets`` in the whole tensor (a ``Place``): all of it
   (DDP), a flat slice (ZeRO), a block (tensor parallelism), a slice of a block (both). Any such
   range is at most 2·ndim − 1 N-D boxes (a partial row, full rows, a partial row: ``boxes``), each
   a contiguous view of the piece: DCP's chunks. Replicas write the same boxes, which DCP
   writes once.
3. **Loading copies into the views.** This rank's boxes in the new layout ask DCP for the saved
   chunks that overlap them, and DCP copies the overlaps into the views: no arithmetic, no dtype
   change, so resuming is bitwise.
4. **The default planners, told where a box lives** (``Boxes`` answers DCP's
   ``__create_write_items__``, ``__create_chunk_list__`` and ``__get_tensor_shard__`` as DTensor
   does; the planners look its views up).
5. **The optimiser's hyperparameters come from the checkpoint, its groups and its update
   implementation from the resuming run** (``UPDATE_IMPLEMENTATION``: foreach on a GPU,
   single-tensor on the CPU).
"""

import copy
import math
import warnings
from typing import NamedTuple

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

# One process saving or every rank reading alone is what is meant here: DCP need not say so.
warnings.filterwarnings(
    "ignore", message=".*assuming the intent is to (save|load) in a single process"
)


def params_in_order(optimizer) -> list:
    """The optimiser's parameters, numbered as its state dict numbers them."""
    return [param for group in optimizer.param_groups for param in group["params"]]


# Optimiser options that say how the update runs, not
# what it computes: the resuming run's own (rule 5).
UPDATE_IMPLEMENTATION = ("foreach", "fused", "capturable", "differentiable")


class Place(NamedTuple):
    """Where a rank's tensor sits in the whole one of ``shape`` (rule 2);
    the defaults: all of it."""

    shape: tuple
    offsets: tuple | None = None  # of the block; None: at the origin
    block: tuple | None = None  # its sizes; None: the whole shape
    start: int = 0  # the tensor's first element, within the flattened block


def boxes(start: int, end: int, shape: tuple) -> list[tuple[tuple, tuple, int]]:
    """Elements [start, end) of a row-major tensor of ``shape`` as ``(offsets, sizes, first
    element)`` boxes, each contiguous in memory: a partial first row, the full rows, a partial last
    row (rows cut the same way inside)."""
    if start >= end:
        return []
    if len(shape) <= 1:
        return [((start,) * len(shape), (end - start,) * len(shape), start)]
    inner = math.prod(shape[1:])

    def in_row(row: int, lo: int, hi: int) -> list:
        return [
            ((row, *o), (1, *s), row * inner + f)
            for o, s, f in boxes(lo - row * inner, hi - row * inner, shape[1:])
        ]

    first, last = -(-start // inner), end // inner  # the full rows: [first, last)
    if first > last:  # inside one row
        return in_row(last, start, end)
    out = in_row(first - 1, start, first * inner) if start < first * inner else []
    if first < last:
        out.append(((first,) + (0,) * (len(shape) - 1), (last - first, *shape[1:]), first * inner))
    return out + (in_row(last, last * inner, end) if last * inner < end else [])


class Boxes:
    """A tensor at its ``Place`` as DCP sees a piece of a whole tensor (rules 2 and 4):
    its boxes, views of it."""

    def __init__(self, tensor: torch.Tensor, place: Place):
        self.tensor, self.place = tensor, place
        flat = tensor.detach().view(-1)  # a view, or an error: loads must land in the tensor itself
        offsets = place.offsets or (0,) * len(place.shape)
        self.views = {}
        for o, sizes, first in boxes(
            place.start, place.start + flat.numel(), place.block or place.shape
        ):
            at = torch.Size(a + b for a, b in zip(offsets, o))
            self.views[at] = flat[first - place.start :][: math.prod(sizes)].view(sizes)

    def size(self) -> torch.Size:  # what DCP checks against the saved tensor's
        return torch.Size(self.place.shape)

    def __create_chunk_list__(self) -> list:
        return [ChunkStorageMetadata(offsets=o, sizes=v.shape) for o, v in self.views.items()]

    def __create_write_items__(self, fqn: str, _) -> list:
        return [
            WriteItem(
                index=MetadataIndex(fqn, o),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=o, sizes=v.shape),
                    properties=TensorProperties.create_from_tensor(v),
                    size=self.size(),
                ),
            )
            for o, v in self.views.items()
        ]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        return self.views[torch.Size(index.offset)]

    def __deepcopy__(self, memo) -> "Boxes":  # the piece copied, not the storage it is a view of
        return Boxes(self.tensor.detach().to("cpu", copy=True), self.place)


def entry(tensor: torch.Tensor, place: Place):
    """What DCP is given for ``tensor`` at ``place``:
    the tensor itself (shaped as the whole) when it is all of it."""
    if place.offsets is None and place.block is None and tensor.numel() == math.prod(place.shape):
        return tensor.view(place.shape)
    return Boxes(tensor, place)


class SavePlanner(DefaultSavePlanner):
    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def lookup_object(self, index: MetadataIndex):
        found = self.state_dict[index.fqn]
        return (
            found.__get_tensor_shard__(index)
            if isinstance(found, Boxes)
            else super().lookup_object(index)
        )


class LoadPlanner(DefaultLoadPlanner):
    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        # the default's first step would replace what it does not know (a Boxes) by None
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        found = self.state_dict[index.fqn]
        return (
            found.__get_tensor_shard__(index)
            if isinstance(found, Boxes)
            else super().lookup_tensor(index)
        )


def save(state: dict, folder, process_group=None, storage_writer=None) -> None:
    """Collective over ``process_group`` (one process: none): ``state`` written into ``folder``."""
    dcp.save(
        state,
        storage_writer=storage_writer or dcp.FileSystemWriter(folder),
        planner=SavePlanner(),
        process_group=process_group,
    )


def read(state: dict, folder) -> dict:
    """Every tensor and box of ``state`` filled from ``folder``,
    every other value replaced by the saved object.
    No collective: each rank reads what it asks for."""
    dcp.load(
        state, storage_reader=dcp.FileSystemReader(folder), planner=LoadPlanner(), no_dist=True
    )
    return state


# ---- The model and the optimiser -----------------------------------------------------------------
def model_state(pieces) -> dict:
    """``model.<name>`` for each ``(name, tensor, place)`` of ``pieces``."""
    return {f"model.{name}": entry(tensor, place) for name, tensor, place in pieces}


def optimizer_state(optimizer, places: list) -> dict:
    """``optim.*`` (rule 1) of ``optimizer``,
    whose i-th parameter (``params_in_order``) is ``places[i]``:
    ``(name, place)``, or None for a copy another rank saves."""
    saved, out = optimizer.state_dict(), {}
    for g, group in enumerate(saved["param_groups"]):
        hyper = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        for i in group["params"]:
            if places[i] is None:
                continue
            name, place = places[i]
            out[f"optim.param_groups.{name}"] = {"group": g, **copy.deepcopy(hyper)}
            for key, value in saved["state"].get(i, {}).items():
                per_element = torch.is_tensor(value) and value.dim() > 0
                out[f"optim.state.{name}.{key}"] = entry(value, place) if per_element else value
    return out


def load_model(checkpoint, pieces) -> None:
    """Copy this rank's ``(name, tensor,
    place)`` pieces out of ``checkpoint`` (any layout's), in place."""
    checkpoint.read(model_state(pieces))


def optimizer_state_dict(checkpoint, places: list, params: list, groups: list) -> dict:
    """The state dict of an optimiser whose i-th parameter ``params[i]`` is at ``places[i] = (name,
    place)``, read from ``checkpoint``; ``groups``: its own param groups (membership and update
    implementation, rule 5)."""
    # what DCP fills; the state dict (DCP fills its
    # tensors through views); its objects, filled after
    wanted, state, objects = {}, {}, []
    for i, ((name, place), param) in enumerate(zip(places, params)):
        for key, saved in checkpoint.entries(f"optim.state.{name}.").items():
            fqn = f"optim.state.{name}.{key}"
            if not isinstance(saved, TensorStorageMetadata):
                wanted[fqn] = None  # an object: replaced by the saved one
                objects.append((i, key, fqn))
                continue
            per_element = saved.size == torch.Size(place.shape) and len(saved.size) > 0
            shape = param.shape if per_element else saved.size
            value = state.setdefault(i, {})[key] = torch.empty(shape, dtype=saved.properties.dtype)
            wanted[fqn] = entry(value, place) if per_element else value
        if f"optim.param_groups.{name}" in checkpoint.metadata:
            wanted[f"optim.param_groups.{name}"] = None
    checkpoint.read(wanted)
    for i, key, fqn in objects:
        state.setdefault(i, {})[key] = wanted[fqn]
    index = {id(p): i for i, p in enumerate(params)}
    saved_groups = []
    for group in groups:
        members = [index[id(p)] for p in group["params"]]
        found = [wanted.get(f"optim.param_groups.{places[i][0]}") for i in members]
        saved = next((h for h in found if h is not None), {})
        hyper = {k: v for k, v in saved.items() if k not in ("group", *UPDATE_IMPLEMENTATION)}
        own = {k: v for k, v in group.items() if k != "params"}
        saved_groups.append({**own, **hyper, "params": members})
    return {"state": state, "param_groups": saved_groups}


def load_optimizer(checkpoint, optimizer, places: list) -> None:
    """Give ``optimizer`` (its i-th parameter at ``places[i]``)
    its state from ``checkpoint``, whatever wrote it."""
    params = params_in_order(optimizer)
    optimizer.load_state_dict(
        optimizer_state_dict(checkpoint, places, params, optimizer.param_groups)
    )
