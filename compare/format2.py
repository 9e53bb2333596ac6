"""Reading a checkpoint of format 2 (this repository's own files, before
torch.distributed.checkpoint): what compare/consolidate.py converts into today's format. Kept here,
not in the step folders: the trainers refuse format 2 in one line that says to convert it.

``<checkpoint>/`` holds ``meta.json``, ``state.pt`` (rank 0's: the run state; steps 1-4 also the
whole model) and ``rank<r>.pt`` (each rank's RNG and its pieces). Whoever held a tensor said which
elements of which parameter it is: whole (``model``: ``{name: tensor}``), flat slices of the
flattened parameters (``model`` with ``model_slices``:
``{name: (start, end)}``, ZeRO), or N-D blocks (``model``, a list, with ``model_blocks``: ``(name,
dim, start, end)`` each, tensor parallelism). The optimiser's state dict comes with
``optimizer_slices``: ``(name, start, end)`` or a list of blocks per parameter. ``Checkpoint`` joins
the pieces back (``parameter(name)``) and cuts the ones asked for
(``optimizer_state_dict(slices)``).
"""

import json
from pathlib import Path

import torch

from checkpoint_files import complete_checkpoints
from config import UserError

FORMAT_VERSION = 2

# Optimiser options that say how the update runs, not what
# it computes: the resuming run's own, not the saved ones.
UPDATE_IMPLEMENTATION = ("foreach", "fused", "capturable", "differentiable")


class Checkpoint:
    """A whole checkpoint of format 2 on disk, read as full tensors by parameter name, whatever step
    and world size wrote it. ``reader`` says who reads it, so that a corrupted one is reported in
    that one's terms."""

    # What to do instead of reading a corrupted checkpoint: with the one before it, or without any.
    INSTEAD = {
        "resume": (
            "resume from the one before it: --resume {earlier}",
            "there is no earlier checkpoint to resume from: start afresh without --resume",
        ),
        "consolidate": (
            "consolidate the one before it: python compare/consolidate.py {earlier} OUT",
            "there is no earlier checkpoint to consolidate instead",
        ),
    }

    def __init__(self, path: Path, reader: str = "resume"):
        self.path, self.reader = Path(path), reader
        try:
            meta = json.loads((self.path / "meta.json").read_text())
        except (OSError, ValueError) as error:
            self._corrupted(f"meta.json unreadable: {type(error).__name__}")
        if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
            self._corrupted(
                f"meta.json says format {meta.get('format') if isinstance(meta, dict) else None}"
            )
        try:
            self.step, self.world_size, self.config = (
                int(meta["step"]),
                int(meta["world_size"]),
                dict(meta["config"]),
            )
            self.shapes = {name: torch.Size(shape) for name, shape in meta["shapes"].items()}
            self.data_parallel_size = int(meta.get("data_parallel_size", self.world_size))
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            self._corrupted(f"meta.json lacks or garbles {error}")
        self.shared = self._load("state.pt")
        self.ranks = [self._load(f"rank{r}.pt") for r in range(self.world_size)]
        if self.shared.get("step") != self.step:
            self._corrupted(
                f"state.pt is for step {self.shared.get('step')}, meta.json says {self.step}"
            )
        # Where each parameter's elements, and each parameter's
        # optimiser state, are: (start, end, tensor or state).
        self.parameter_pieces, self.state_pieces, self.groups = {}, {}, []
        self.parameter_blocks, self.state_blocks = {}, {}  # N-D blocks, joined below
        for file, holder in [
            ("state.pt", self.shared),
            *((f"rank{r}.pt", h) for r, h in enumerate(self.ranks)),
        ]:
            try:
                self._index(holder)
            except (KeyError, TypeError, ValueError, IndexError) as error:
                self._corrupted(f"{file} lacks or garbles {error}")
        self._join_blocks()
        missing = [name for name in self.shapes if name not in self.parameter_pieces]
        if missing:
            self._corrupted(f"no rank holds {missing[0]}")

    def _index(self, holder: dict) -> None:
        """Note where the file ``holder`` says its tensors belong,
        in whichever form it wrote them (rule 2)."""
        # N-D blocks of rows or columns, a list of tensors beside their places
        if "model_blocks" in holder:
            for (name, dim, start, end), tensor in zip(holder["model_blocks"], holder["model"]):
                self.parameter_blocks.setdefault(name, []).append((dim, start, end, tensor))
        # flat slices of the flattened parameters; without model_slices, whole ones
        elif "model" in holder:
            whole = {name: (0, shape.numel()) for name, shape in self.shapes.items()}
            ranges = holder["model_slices"] if "model_slices" in holder else whole
            for name, (start, end) in ranges.items():
                self.parameter_pieces.setdefault(name, []).append(
                    (start, end, holder["model"][name])
                )
        if "optimizer" in holder:
            self._index_optimizer(holder["optimizer"], holder["optimizer_slices"])

    def _load(self, name: str) -> dict:
        try:
            return torch.load(self.path / name, map_location="cpu", weights_only=True, mmap=True)
        except Exception as error:  # noqa: BLE001 (a truncated zip, a missing file, garbage bytes: all "corrupted")
            # Our words, not torch's: its message about
            # weights_only would advise loading untrusted pickles.
            if isinstance(error, FileNotFoundError):
                self._corrupted(f"{name} is missing")
            reason = (
                "not a file torch.save wrote, or cut short"
                if "zip" in str(error).lower() or isinstance(error, (EOFError, OSError))
                else "it holds something other than tensors and plain values"
            )
            self._corrupted(f"{name} unreadable: {reason}")

    def _corrupted(self, what: str):
        number = int(self.path.name[5:]) if self.path.name[5:].isdigit() else None  # step_<k>
        earlier = [
            p
            for p in complete_checkpoints(self.path.parent.parent)
            if number and int(p.name[5:]) < number
        ]
        with_earlier, without = self.INSTEAD[self.reader]
        advice = with_earlier.format(earlier=earlier[-1]) if earlier else without
        raise UserError(f"checkpoint {self.path} is corrupted ({what}); {advice}")

    def _index_optimizer(self, state_dict: dict, slices: list) -> None:
        for i, piece in enumerate(slices):
            state = state_dict["state"].get(i, {})
            # split the state into its blocks, to be joined with the other ranks'
            if _is_blocks(piece):
                offset = 0
                for name, dim, start, end in piece:
                    cut = {
                        k: v.narrow(dim, offset, end - start)
                        if torch.is_tensor(v) and v.dim() > 0
                        else v
                        for k, v in state.items()
                    }
                    self.state_blocks.setdefault(name, []).append((dim, start, end, cut))
                    offset += end - start
            else:
                name, start, end = piece
                self.state_pieces.setdefault(name, []).append((start, end, state))
        if not self.groups:  # the same hyperparameters in every rank's groups
            # Which implementation runs the update (foreach on a GPU, single-tensor on the CPU) is
            # the resuming run's choice, not the saved run's: a checkpoint written on one device
            # resumes on the other.
            self.groups = [
                (
                    {k: v for k, v in g.items() if k not in ("params", *UPDATE_IMPLEMENTATION)},
                    {_name(slices[i]) for i in g["params"]},
                )
                for g in state_dict["param_groups"]
            ]
        else:
            for (_, names), group in zip(self.groups, state_dict["param_groups"]):
                names.update(_name(slices[i]) for i in group["params"])

    def _join_blocks(self) -> None:
        """The N-D blocks of a parameter
        (and of its state) joined into the whole, read as one piece."""
        for name, blocks in self.parameter_blocks.items():
            whole = self._join(
                name, [(dim, start, end, tensor) for dim, start, end, tensor in blocks]
            )
            self.parameter_pieces.setdefault(name, []).append((0, whole.numel(), whole))
        for name, blocks in self.state_blocks.items():
            first = blocks[0][3]
            if not first:
                continue  # never stepped
            state = {
                key: self._join(name, [(d, s, e, st[key]) for d, s, e, st in blocks])
                if torch.is_tensor(value) and value.dim() > 0
                else value
                for key, value in first.items()
            }
            self.state_pieces.setdefault(name, []).append((0, self.shapes[name].numel(), state))

    def _join(self, name: str, blocks: list) -> torch.Tensor:
        dim, covered, parts = blocks[0][0], 0, []
        # replicas once
        for _, start, end, tensor in sorted({b[1]: b for b in blocks}.values(), key=lambda b: b[1]):
            if start != covered:
                break
            parts.append(tensor)
            covered = end
        if covered != self.shapes[name][dim]:
            self._corrupted(f"no rank holds rows or columns {covered}- of {name} (dim {dim})")
        return torch.cat(parts, dim=dim).reshape(-1)

    # ---- What a loader asks for ------------------------------------------------------------------
    def parameter(self, name: str, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Elements [start, end) of the flattened parameter
        (all of them, shaped, by default): a new tensor."""
        whole = end is None and start == 0
        end = self.shapes[name].numel() if end is None else end
        values = _cut(self.parameter_pieces[name], start, end, self, name)
        return values.view(self.shapes[name]) if whole else values

    def optimizer_state_dict(self, slices: list, params: list) -> dict:
        """The state dict of an optimiser whose i-th parameter ``params[i]`` holds elements [start,
        end) of ``slices[i] = (name, start, end)``, in the checkpoint's parameter groups (which are
        chosen by name)."""
        state = {}
        for i, (piece, param) in enumerate(zip(slices, params)):
            # N-D blocks (a tensor-parallel shard), in the checkpoint's layout
            if _is_blocks(piece):
                name, whole = (
                    piece[0][0],
                    [p for p in self.state_pieces.get(piece[0][0], []) if p[2]],
                )
                if whole:
                    state[i] = {
                        key: self.block(name, piece, value.view(self.shapes[name]))
                        if torch.is_tensor(value) and value.dim() > 0
                        else value
                        for key, value in self._whole_state(name).items()
                    }
                continue
            name, start, end = piece
            pieces = [p for p in self.state_pieces.get(name, []) if p[2]]
            if not pieces:
                continue  # never stepped: no state, as in a fresh optimiser
            entry = {}
            for key, value in pieces[0][2].items():
                # one value per element: exp_avg, exp_avg_sq
                if torch.is_tensor(value) and value.dim() > 0:
                    part = [(s, e, st[key]) for s, e, st in pieces]
                    entry[key] = _cut(part, start, end, self, name).view(param.shape)
                else:  # one value per parameter (AdamW's step): every slice holds it
                    entry[key] = value.clone() if torch.is_tensor(value) else value
            state[i] = entry
        groups = [
            {**hyper, "params": [i for i, piece in enumerate(slices) if _name(piece) in names]}
            for hyper, names in self.groups
        ]
        return {"state": state, "param_groups": groups}

    def _whole_state(self, name: str) -> dict:
        """Parameter ``name``'s whole optimiser state
        (flat tensors), joined from whatever pieces hold it."""
        pieces = [p for p in self.state_pieces[name] if p[2]]
        numel = self.shapes[name].numel()
        return {
            key: _cut([(s, e, st[key]) for s, e, st in pieces], 0, numel, self, name)
            if torch.is_tensor(value) and value.dim() > 0
            else (value.clone() if torch.is_tensor(value) else value)
            for key, value in pieces[0][2].items()
        }

    def block(self, name: str, blocks: list, whole: torch.Tensor | None = None) -> torch.Tensor:
        """The ``(name, dim, start, end)`` blocks of parameter ``name`` (or of ``whole``, shaped
        like it), concatenated along their dim, in the checkpoint's layout: a tensor-parallel
        rank's shard."""
        whole = self.parameter(name) if whole is None else whole
        return torch.cat(
            [whole.narrow(dim, start, end - start) for _, dim, start, end in blocks],
            dim=blocks[0][1],
        )


def _is_blocks(piece) -> bool:
    """N-D blocks, ``[(name, dim, start, end), ...]``,
    rather than a flat slice ``(name, start, end)``."""
    return isinstance(piece[0], (list, tuple))


def _name(piece) -> str:
    return piece[0][0] if _is_blocks(piece) else piece[0]


def _cut(pieces: list, start: int, end: int, checkpoint: Checkpoint, name: str) -> torch.Tensor:
    """Elements [start, end) from ``pieces`` = [(piece start,
    piece end, tensor)] that tile the parameter."""
    parts, covered = [], start
    for piece_start, piece_end, tensor in sorted(pieces, key=lambda p: p[0]):
        lo, hi = max(covered, piece_start), min(end, piece_end)
        if lo < hi:
            if lo != covered:
                break
            parts.append(tensor.reshape(-1)[lo - piece_start : hi - piece_start])
            covered = hi
    if covered != end:
        checkpoint._corrupted(f"no rank holds elements {covered}-{end} of {name}")
    return torch.cat(parts) if parts else pieces[0][2].reshape(-1)[:0].clone()
