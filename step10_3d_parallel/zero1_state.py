"""ZeRO-1's optimiser (zero1.py) as PyTorch's tools and checkpoints see it, apart from its
mechanism: the methods ``ShardedOptimizer`` takes from ``ShardedOptimizerState``.

0. **The full groups.** A ``GradScaler``, clipping and an LR scheduler read ``param_groups``: the
   full parameters with the local groups' hyperparameters, pushed to the local optimiser before
   every step and state dict, pulled back whenever a state dict is loaded into it (ZeRO-2: the local
   groups of slices).
1. **Each rank its own slices.** A rank's state dict is its local optimiser's, with the
   ``(parameter, start, end)`` slices it covers; its checkpoint holds those slices of the weights
   and of the state, as boxes of the whole tensors named by parameter (``checkpoint_state``,
   dcp_checkpoint.py), so DCP copies any layout's boxes into this rank's slices at any world size
   (``load_checkpoint``, which all-gathers the weights after). No gather, no full copy when saving.
   dcp_checkpoint is imported by these methods, not with the file: importing DCP imports
   torch.distributed.nn, which binds the default group, and importing an idea file must leave a
   script's group alone.
2. **A plain optimiser's state dict on request** (``consolidated_state_dict``): every rank's slices
   gathered and joined, as ``ZeroRedundancyOptimizer.consolidate_state_dict`` does; for export and
   inspection, never per step.
"""

import torch
import torch.distributed as dist


def hyperparameters(group: dict) -> dict:
    """A param group without its parameters: lr, weight decay, betas, ..."""
    return {k: v for k, v in group.items() if k != "params"}


class ShardedOptimizerState:
    """Mixed into ``zero1.ShardedOptimizer``: reads its ``pieces``, ``views``, ``local_optimizer``,
    ``params``, ``index``, ``group_sizes``, ``full_groups``, ``gradient_shards``, ``world_size``,
    ``rank`` and ``group``."""

    # ---- What PyTorch's tools read (rule 0) ------------------------------------------------------
    @property
    def groups_are_local(self) -> bool:
        """ZeRO-2: only the local slices have the gradients a tool reads."""
        return self.gradient_shards is not None

    @property
    def param_groups(self):  # a property: load_state_dict replaces the local optimiser's list
        return self.local_optimizer.param_groups if self.groups_are_local else self.full_groups

    def _push_hyperparameters(self) -> None:
        if not self.groups_are_local:
            for full, local in zip(self.full_groups, self.local_optimizer.param_groups):
                local.update(hyperparameters(full))

    def _pull_hyperparameters(self) -> None:
        for full, local in zip(self.full_groups, self.local_optimizer.param_groups):
            full.update(hyperparameters(local))

    @property
    def state(self):
        return self.local_optimizer.state

    @property
    def defaults(self):
        return self.local_optimizer.defaults

    def add_param_group(self, param_group):
        raise NotImplementedError(
            "ShardedOptimizer fixes its layout at construction; build a new one"
        )

    @property
    def norm_groups(self) -> list:
        """What a global norm of the stepped tensors (``param_groups``) sums over
        (``sharded_norms.clip_grad_norm``'s ``groups``): nothing while every rank holds the whole
        averaged gradient, the ranks' group once the groups are this rank's slices
        (ZeRO-2, masters)."""
        return [self.group or dist.group.WORLD] if self.groups_are_local else []

    @property
    def masters(self) -> list:
        """The float32 master copies this optimiser steps in place of the parameters:
        none (``masters.py``: some)."""
        return []

    def slices(self, named_params=None) -> list:
        """``(name, start, end)`` of each local parameter: the elements of which parameter its state
        is for. Without ``named_params``, the parameter's number (its place in the groups) stands
        for its name."""
        name_of = (
            {param: name for name, param in named_params}
            if named_params is not None
            else self.index
        )
        return [(name_of[piece.param], piece.start, piece.end) for piece in self.pieces]

    def master_weights(self, named_params) -> dict:
        """``{name: full weight}``: the parameters themselves, which every rank holds whole and up
        to date after ``step()`` (``masters.py``: the float32 masters, gathered)."""
        return {name: param for name, param in named_params}

    # ---- Checkpoints (rule 1: the interface of checkpoint.py) ------------------------------------
    def checkpoint_places(self, named_params) -> list:
        """``(name, place)`` of each local parameter:
        a flat slice of parameter ``name`` (dcp_checkpoint.py)."""
        from dcp_checkpoint import Place  # here, not at the top: rule 1

        name_of = {param: name for name, param in named_params}
        return [
            (name_of[piece.param], Place(tuple(piece.param.shape), start=piece.start))
            for piece in self.pieces
        ]

    def checkpoint_state(self, named_params) -> dict:
        """What this rank saves: the weights of its slices and its slices of the optimiser state,
        each a few boxes of the whole tensor named by ``named_params`` (dcp_checkpoint.py). No
        gather, no full copy: each rank writes what it steps (with masters: float32)."""
        from dcp_checkpoint import model_state, optimizer_state

        places = self.checkpoint_places(named_params)
        pieces = [(name, view, place) for (name, place), view in zip(places, self.views)]
        return {**model_state(pieces), **optimizer_state(self.local_optimizer, places)}

    def load_checkpoint(self, checkpoint, named_params) -> None:
        """This rank's slices of the weights and of the optimiser state, copied out of
        ``checkpoint`` (a ``resharding.Checkpoint``, whatever world size or step wrote it), then the
        parameters all-gathered as after a step (a collective): every rank holds the whole
        model again."""
        from dcp_checkpoint import load_model, load_optimizer

        places = self.checkpoint_places(named_params)
        load_model(
            checkpoint, [(name, view, place) for (name, place), view in zip(places, self.views)]
        )
        load_optimizer(checkpoint, self.local_optimizer, places)
        self.all_gather_parameters()

    def state_dict(self) -> dict:
        """This rank's shard: the local optimiser's state dict and the slices it covers."""
        return {
            **self.local_optimizer.state_dict(),
            "slices": self.slices(),
            "world_size": self.world_size,
        }

    def load_state_dict(self, state_dict: dict) -> None:
        if [tuple(s) for s in state_dict.get("slices", ())] != self.slices():
            raise ValueError(
                f"this optimiser shard covers other slices (saved at world size "
                f"{state_dict.get('world_size')}; here world size {self.world_size}, "
                f"rank {self.rank}, "
                "or other chunks): cut this rank's slices from every rank's shards, as "
                "resharding.py does, or load a consolidated state dict into a plain optimiser"
            )
        self.local_optimizer.load_state_dict(
            {k: v for k, v in state_dict.items() if k not in ("slices", "world_size")}
        )

    def consolidated_state_dict(self) -> dict:
        """Collective: the state dict a plain ``optimizer_cls``
        over the full parameters would have, on every rank.

        For checkpoints and inspection only: gathering the state every step would put the whole
        state back on every rank, the memory ZeRO-1 exists to save, and send it over the network.
        """
        mine = self.local_optimizer.state_dict()
        mine["state"] = {
            i: {k: v.cpu() if torch.is_tensor(v) else v for k, v in s.items()}
            for i, s in mine["state"].items()
        }
        everyone = [None] * self.world_size
        dist.all_gather_object(everyone, (self.slices(), mine["state"]), group=self.group)
        state = {}
        for slices, shard_state in everyone:
            for local_index, (index, start, end) in enumerate(slices):
                param = self.params[index]
                # no state yet: no entry
                for key, value in shard_state.get(local_index, {}).items():
                    full = state.setdefault(index, {})
                    # one value per element
                    if torch.is_tensor(value) and value.shape == (end - start,):
                        if key not in full:
                            full[key] = torch.empty(
                                param.shape, dtype=value.dtype, device=param.device
                            )
                        full[key].view(-1)[start:end] = value
                    else:  # one value per parameter (AdamW's step): every piece holds it
                        full.setdefault(key, value)
        groups, first = [], 0
        for group, size in zip(mine["param_groups"], self.group_sizes):
            groups.append({**group, "params": list(range(first, first + size))})
            first += size
        return {"state": dict(sorted(state.items())), "param_groups": groups}
