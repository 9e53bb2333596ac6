"""ZeRO-3 on the mesh (zero3_on_mesh.py) as checkpoints and the final weights see it: a second idea
(what is saved and read back, not how a step trains), so a file of its own, as step 7's
zero3_state.py is to its zero3.py.

1. **Each rank its own pieces.** A piece is a flat slice of a tp shard, and a tp shard a block of
   the whole tensor: a slice of a block, a few boxes of the whole tensor (dcp_checkpoint.py's rule
   2). Every rank gives DCP its pieces and AdamW's state for them under the model's names, as they
   are: no gather. The tie's copy on the last stage holds the same elements as the first stage's
   (zero3_on_mesh.py's rule 2) and is not saved, as composition.py's ``MeshShards`` leaves it out.
2. **Loading copies this rank's pieces out** of any step's checkpoint at any mesh and --zero stage
   (the tie's copy too): DCP copies the saved boxes' overlaps into them.
3. **The final weights**: each unit gathered over the plane (step 7's ``gathered_parameters``), the
   tp shards over tp (step 8), the stages over pp (step 9), as composition.py's
   ``gather_full_model`` does.
"""

import torch
import torch.distributed as dist

from comm_accounting import count_collective
from dcp_checkpoint import load_model, load_optimizer, model_state, optimizer_state, params_in_order
from tensor_parallel_state import assemble
from zero3_on_mesh import TIE


class FullyShardedShards:
    """checkpoint.py's part for --zero 3 (rules 1, 2): ``stages`` (a ``FullyShardedStages``) and the
    AdamW that steps its pieces."""

    per_rank = True

    def __init__(self, stages, optimizer):
        self.stages, self.optimizer = stages, optimizer
        # each piece's place: its range in the flattened tp
        # shard, at that shard's place in the whole tensor
        self.places = {
            names[n]: stages.shards[names[n]][0]._replace(start=place.start)
            for wrapper, names in zip(stages.wrappers, stages.local_names)
            for n, place in wrapper.checkpoint_places().items()
        }
        self.saved = [(n, p) for n, p in stages.named if n != TIE or stages.mesh.pp_rank == 0]

    def _pieces(self, named: list) -> list:
        return [(n, p, self.places[n]) for n, p in named]

    def _optimizer_places(self, named: list) -> list:
        """``(name, place)`` of each of the optimiser's pieces
        (``params_in_order``), None for one not in ``named``."""
        name_of = {p: n for n, p in named}
        return [
            (name_of[p], self.places[name_of[p]]) if p in name_of else None
            for p in params_in_order(self.optimizer)
        ]

    def checkpoint_state(self) -> dict:
        """Rule 1: this rank's pieces and their AdamW state,
        boxes of the whole tensors. No collective."""
        return {
            **model_state(self._pieces(self.saved)),
            **optimizer_state(self.optimizer, self._optimizer_places(self.saved)),
        }

    def load_checkpoint(self, checkpoint) -> None:
        """Rule 2: this rank's pieces, and AdamW's state for them,
        out of any step's checkpoint at any mesh."""
        load_model(checkpoint, self._pieces(self.stages.named))
        load_optimizer(checkpoint, self.optimizer, self._optimizer_places(self.stages.named))


def gather_full_model(stages, mesh) -> dict:
    """Rule 3: every parameter whole, by name,
    on every rank. Collective over the plane, tp and pp."""
    mine = {}
    for wrapper, names in zip(stages.wrappers, stages.local_names):
        for n, t in wrapper.gathered_parameters():  # one unit at a time, over the plane
            mine[names[n]] = t.clone()
    # the same names in the same order on every tp rank of the stage
    for name, tensor in mine.items():
        blocks = stages.shards[name][1]
        if blocks:
            parts = [torch.empty_like(tensor) for _ in range(mesh.tp)]
            count_collective("all_gather", tensor)
            dist.all_gather(parts, tensor, group=mesh.tp_group)
            mine[name] = assemble(blocks, parts)
    if mesh.pp_rank > 0:
        mine.pop(TIE, None)  # the last stage's copy: the first stage's is the model's
    held = [None] * mesh.pp
    dist.all_gather_object(held, mine, group=mesh.pp_group)
    return {n: t for part in held for n, t in part.items()}
