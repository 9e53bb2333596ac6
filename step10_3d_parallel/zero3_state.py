"""FullyShardedDP (zero3.py) as checkpoints, export and the trainer see it, apart from its
mechanism: the methods ``FullyShardedDP`` takes from ``FullyShardedState``. A second idea (what is
saved and read back, not how a step trains), so a file of its own, as ZeRO-1's zero1_state.py.

1. **Each rank its own pieces.** A rank saves its pieces as they are, flat slices under the
   original names, each a few boxes of the whole parameter (dcp_checkpoint.py), and AdamW's state
   for them (``checkpoint_state``): nothing full-size, no collective. ``load_checkpoint`` reads back
   only this rank's elements, from a checkpoint written at any world size by any step (DCP copies
   the saved boxes' overlaps into the pieces). dcp_checkpoint is imported by these methods, not
   with the file: importing DCP imports torch.distributed.nn, which binds the default group, and
   importing an idea file must leave a script's group alone.
2. **The full parameters on request** (``gathered_parameters``): one unit all-gathered at a time,
   for the export and the tests, never per step.
3. **What the trainer measures**: the shards it counts (``parameter_shards``,
   ``gradient_shards``) and the most gathered bytes held at once (``take_peak_gathered_bytes``).
"""

import torch

from comm_accounting import all_gather_single, count_collective


class FullyShardedState:
    """Mixed into ``zero3.FullyShardedDP``: reads its ``units``, ``module``, ``device`` and the
    bytes its gathers and frees track (``gathered_bytes``, ``peak_gathered_bytes``)."""

    # ---- Checkpoints (rule 1; checkpoint.py's interface: what this rank saves, and loading it) ---
    def checkpoint_places(self) -> dict:
        """``{name: place}``: the flat slice of each whole parameter this rank's piece of it is."""
        from dcp_checkpoint import Place  # here, not at the top: rule 1

        ranges = self.piece_ranges()
        return {
            name: Place(tuple(shape), start=ranges[name][0])
            for unit in self.units
            for name, shape in zip(unit.names, unit.shapes)
        }

    def checkpoint_state(self, optimizer=None) -> dict:
        """What this rank saves: its pieces, each a few boxes of the whole parameter
        (dcp_checkpoint.py), and, given the ``optimizer`` that steps the pieces, its state for them.
        Nothing full-size, no collective."""
        from dcp_checkpoint import model_state, optimizer_state

        places = self.checkpoint_places()
        state = model_state(
            [(name, piece, places[name]) for name, piece in self.module.named_parameters()]
        )
        if optimizer is not None:
            state.update(optimizer_state(optimizer, self._optimizer_places(optimizer)))
        return state

    def load_checkpoint(self, checkpoint, optimizer=None) -> None:
        """Copy this rank's pieces out of ``checkpoint`` (a ``resharding.Checkpoint``, written at
        any world size by any step: only these elements are read) and, given the ``optimizer``, its
        state for them."""
        from dcp_checkpoint import load_model, load_optimizer

        places = self.checkpoint_places()
        load_model(
            checkpoint,
            [(name, piece, places[name]) for name, piece in self.module.named_parameters()],
        )
        if optimizer is not None:
            load_optimizer(checkpoint, optimizer, self._optimizer_places(optimizer))

    def piece_ranges(self) -> dict:
        """``{name: (start, end)}``: the elements of each (flattened) parameter this rank's piece
        holds."""
        return {name: r for unit in self.units for name, r in zip(unit.names, unit.ranges)}

    def _optimizer_places(self, optimizer) -> list:
        """``(name, place)`` of each of ``optimizer``'s parameters (pieces), numbered as its state
        dict is."""
        places = self.checkpoint_places()
        name_of = {piece: name for name, piece in self.module.named_parameters()}
        # dcp_checkpoint.params_in_order, written out: this idea file imports no checkpoint code
        pieces = [p for group in optimizer.param_groups for p in group["params"]]
        return [(name_of[p], places[name_of[p]]) for p in pieces]

    # ---- Full parameters, unit by unit (rule 2) --------------------------------------------------
    @torch.no_grad()
    def gathered_parameters(self):
        """Collective: yields ``(name, full tensor)`` for every parameter, one unit gathered at a
        time, into a buffer of its own (not ``flat``, whose storage must stay resizable:
        ``.numpy()`` would pin it)."""
        for unit in self.units:
            full = torch.empty(unit.padded, device=self.device)
            count_collective("all_gather", full)
            all_gather_single(full, unit.shard, group=self.mesh.shard_group)  # HSDP: within the row
            yield from zip(unit.names, unit.full_views(full))
            del full  # gone once the caller lets go of this unit's tensors

    # ---- What the trainer measures (rule 3) ------------------------------------------------------
    @property
    def parameter_shards(self) -> list:
        return [unit.shard for unit in self.units]

    @property
    def gradient_shards(self) -> list:
        return [unit.grad_shard for unit in self.units if unit.grad_shard is not None]

    def take_peak_gathered_bytes(self) -> int:
        """The most bytes of gathered parameters held at once since the last call (tracked, not
        sampled)."""
        peak, self.peak_gathered_bytes = self.peak_gathered_bytes, self.gathered_bytes
        return peak
