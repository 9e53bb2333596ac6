"""ZeRO-3 on the mesh (zero3_on_mesh.py) as checkpoints and the final weights see it: a second idea (what is saved
and read back, not how a step trains), so a file of its own, as step 7's zero3_state.py is to its zero3.py.

1. **The checkpoint every stage writes.** A piece is a flat slice of a tp shard, and a tp shard an N-D block of
   the whole tensor; resharding.py describes slices of whole tensors and blocks of them, not slices of blocks. So
   the pieces, and AdamW's state for them, are gathered over the dp x cp plane into the tp shards, unit by unit,
   and dp x cp rank 0 writes them as step 8's blocks (composition.py's rule 4): --zero 1's checkpoint, bitwise.
   A run saved at any --zero resumes at any other, and at any mesh.
2. **Loading cuts the pieces out.** Each rank reads its tp shard of every parameter (and of its AdamW state) from
   any step's checkpoint, then keeps its piece's elements: the range step 7's layout gives it in the flattened
   shard.
3. **The final weights**: each unit gathered over the plane (step 7's ``gathered_parameters``), the tp shards
   over tp (step 8), the stages over pp (step 9), as composition.py's ``gather_full_model`` does.
"""

import torch
import torch.distributed as dist

from comm_accounting import all_gather_single, count_collective
from tensor_parallel_state import assemble, checkpoint_shards
from training import params_in_order
from zero3_on_mesh import TIE

MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's state with one value per element


def tp_blocks(stages, name: str) -> list:
    """Where this rank's tp shard of ``name`` sits in the whole tensor: step 8's ``(name, dim, start, end)``
    blocks; a replicated tensor is one block, all of it."""
    shape, blocks = stages.shards[name]
    return [(name, *b) for b in blocks] if blocks else [(name, 0, 0, shape[0])]


class FullyShardedShards:
    """checkpoint.py's part for --zero 3 (rules 1, 2): ``stages`` (a ``FullyShardedStages``) and the AdamW that
    steps its pieces."""

    per_rank = True

    def __init__(self, stages, optimizer):
        self.stages, self.optimizer = stages, optimizer

    def _gathered(self, unit, values) -> list:
        """``values`` (this rank's shard of ``unit``'s flat range) gathered over the plane: one tensor per
        parameter of the unit, shaped as its tp shard. A collective over the plane, not counted: not a step's."""
        mesh = self.stages.wrappers[0].mesh
        full = values.new_empty(unit.padded)
        all_gather_single(full, values.detach().contiguous(), group=mesh.shard_group)
        return [t.clone() for t in full.split(unit.numels + [unit.padded - sum(unit.numels)])][:-1]

    def checkpoint_state(self) -> dict:
        """Rule 1: every rank of the plane gathers; dp x cp rank 0 returns the tp shards and their state."""
        state = self.optimizer.state
        named, moments = [], {}
        for wrapper, names in zip(self.stages.wrappers, self.stages.local_names):
            for unit in wrapper.units:
                whole = self._gathered(unit, unit.shard)
                stepped = [piece for piece in unit.pieces if piece in state]
                by_key = {}
                for key in MOMENTS if stepped else ():
                    flat = torch.zeros_like(unit.shard)
                    for piece, part in zip(unit.pieces, unit.slices):
                        if piece in state:
                            flat[part] = state[piece][key]
                    by_key[key] = self._gathered(unit, flat)
                for i, (name, shape) in enumerate(zip(unit.names, unit.shapes)):
                    tensor = whole[i].view(shape)
                    tensor.tp_blocks = self.stages.shards[names[name]][
                        1
                    ]  # tensor_parallel_state's form
                    named.append((names[name], tensor))
                    if stepped:  # every piece of a parameter steps alike: any one's step count
                        moments[names[name]] = {
                            "step": state[unit.pieces[i]]["step"].clone(),
                            **{k: by_key[k][i].view(shape) for k in MOMENTS},
                        }
        if self.stages.mesh.dp_cp_rank != 0:
            return {}
        tensors, order = dict(named), self._names_in_order()
        saved = {
            "state": {i: moments[n] for i, n in enumerate(order) if n in moments},
            "param_groups": self.optimizer.state_dict()["param_groups"],
        }
        return checkpoint_shards(named, [tensors[n] for n in order], saved)

    def _names_in_order(self) -> list:
        """The model's name of each parameter (piece) of the optimiser, numbered as its state dict is."""
        name_of = {id(p): n for n, p in self.stages.named}
        return [name_of[id(p)] for p in params_in_order(self.optimizer)]

    def load_checkpoint(self, checkpoint) -> None:
        """Rule 2: this rank's pieces, and AdamW's state for them, out of any step's checkpoint at any mesh."""
        ranges = {
            names[n]: r
            for wrapper, names in zip(self.stages.wrappers, self.stages.local_names)
            for n, r in wrapper.piece_ranges().items()
        }
        with torch.no_grad():
            for name, piece in self.stages.named:
                shard = checkpoint.block(name, tp_blocks(self.stages, name))
                piece.copy_(shard.reshape(-1)[slice(*ranges[name])])
        order = self._names_in_order()
        blocks = [tp_blocks(self.stages, n) for n in order]
        full = checkpoint.optimizer_state_dict(blocks, params_in_order(self.optimizer))
        state = {
            i: {
                k: v.reshape(-1)[slice(*ranges[order[i]])].clone()
                if torch.is_tensor(v) and v.dim()
                else v
                for k, v in entry.items()
            }
            for i, entry in full["state"].items()
        }
        self.optimizer.load_state_dict({"state": state, "param_groups": full["param_groups"]})


def gather_full_model(stages, mesh) -> dict:
    """Rule 3: every parameter whole, by name, on every rank. Collective over the plane, tp and pp."""
    mine = {}
    for wrapper, names in zip(stages.wrappers, stages.local_names):
        for n, t in wrapper.gathered_parameters():  # one unit at a time, over the plane
            mine[names[n]] = t.clone()
    for (
        name,
        tensor,
    ) in mine.items():  # the same names in the same order on every tp rank of the stage
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
