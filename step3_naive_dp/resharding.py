"""Reading a checkpoint back at any world size: whatever pieces of each tensor the writing ranks held, joined
by parameter name and element range, so a checkpoint written by any step at N ranks resumes in any step at N'.

1. **Three forms.** Whoever holds a tensor says which elements of which parameter it is: whole (``model``:
   ``{name: tensor}``), flat slices of the flattened parameters (``model`` with ``model_slices``:
   ``{name: (start, end)}``, ZeRO), or N-D blocks of rows or columns (``model``, a list, with ``model_blocks``:
   ``(name, dim, start, end)`` each, tensor parallelism, as torch.distributed.checkpoint describes N-D chunks).
   The optimiser's state dict comes with ``optimizer_slices``: ``(name, start, end)`` or a list of blocks per
   parameter.
2. **Read what each file says about itself**, never which step wrote it: ``Checkpoint`` joins the pieces back
   (``parameter(name)``) or cuts the ones a loader asks for (``optimizer_state_dict(slices)``); each rank reads
   only what it will own (the files are memory-mapped), as DeepSpeed's universal checkpoints and
   torch.distributed.checkpoint do.
3. **The same run, or refused** (``check_resumable``): the config must be the checkpoint's, except the flags
   that say where and how to run (``RESUMABLE_KEYS``) and how the global batch is split: micro-batch x
   accumulation x ranks may change if their product does not. The data stream continues at the same sample.
4. **Opened before anything is connected or written** (``open_checkpoint``, once ``checkpoint_files.py`` has
   found it); ``meta.json`` (``checkpoint_meta``) says what wrote the rest. Step 0's checkpoints are its own
   (one process, one file): refused here in one line.
5. **Each rank's own part** (``PerRank``): an idea file's sharded state, saved by every rank for itself beside
   checkpoint.py's shared parts, read back here at any world size.
"""

import json
import sys
from pathlib import Path

import torch

from checkpoint_files import complete_checkpoints
from config import UserError
from training import params_in_order

FORMAT_VERSION = 2
STEP0_FORMAT = "single-process"  # step0_single_gpu/checkpoint.py's meta.json

# Flags that may change when resuming: they say where to write, what to print, where to run and how
# long to wait, not what to compute. Every other flag must be the checkpoint's.
RESUMABLE_KEYS = (
    "out",
    "save_every",
    "preempt_grace_s",
    "resume",
    "quiet",
    "timeout_s",
    "trace",
    "max_memory_mb",
    "async_save",
    "offload_optimizer",
    "backend",
    "device",
    "schedule",
    "micro_batches",
    "virtual_stages",
    "dp",
    "tp",
    "pp",
    "replicate",
    "fp8",
    "ep",
    "activation_checkpointing",
    "zero",
)
# may change with the world size, the product kept
BATCH_SPLIT_KEYS = ("micro_batch_size", "grad_accum")

# Optimiser options that say how the update runs, not what it computes: the resuming run's own, not the saved ones.
UPDATE_IMPLEMENTATION = ("foreach", "fused", "capturable", "differentiable")


def checkpoint_meta(
    step: int, world_size: int, config: dict, shapes: dict, data_parallel_size=None
) -> str:
    """meta.json. ``data_parallel_size``: the ranks that drew their own samples, when not all did (TP, PP)."""
    meta = {
        "format": FORMAT_VERSION,
        "step": step,
        "world_size": world_size,
        "config": config,
        "shapes": {name: list(shape) for name, shape in shapes.items()},
    }
    if data_parallel_size is not None and data_parallel_size != world_size:
        meta["data_parallel_size"] = data_parallel_size
    return json.dumps(meta, indent=1) + "\n"


def optimizer_slices(optimizer, named_params) -> list:
    """``optimizer_slices`` (rule 1) of a plain optimiser over whole parameters: ``(name, 0, numel)`` of each of its
    parameters, numbered as its state dict numbers them."""
    name_of = {param: name for name, param in named_params}
    return [(name_of[p], 0, p.numel()) for p in params_in_order(optimizer)]


class Checkpoint:
    """A whole checkpoint on disk, read as full tensors by parameter name, whatever step and world size wrote it.

    Opening it checks that it is readable; ``check_resumable`` that it belongs to this run. ``reader`` says who
    reads it (a trainer's "resume", or "consolidate"), so that a corrupted one is reported in that one's terms.
    """

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
        if isinstance(meta, dict) and meta.get("format") == STEP0_FORMAT:
            raise UserError(
                f"checkpoint {self.path} was written by step 0, whose checkpoint is one process's whole "
                "state in one file, not pieces to reshard: resume it with step0_single_gpu/train.py, or "
                "start afresh without --resume"
            )
        if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
            found = meta.get("format") if isinstance(meta, dict) else None
            raise UserError(
                f"checkpoint {self.path} has format {found}, this code reads {FORMAT_VERSION} (it was "
                "written by another version of this repository); start afresh without --resume"
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
        # Where each parameter's elements, and each parameter's optimiser state, are: (start, end, tensor or state).
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
        """Note where the file ``holder`` says its tensors belong, in whichever form it wrote them (rule 2)."""
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
            # Our words, not torch's: its message about weights_only would advise loading untrusted pickles.
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
            # Which implementation runs the update (foreach on a GPU, single-tensor on the CPU) is the resuming
            # run's choice, not the saved run's: a checkpoint written on one device resumes on the other.
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
        """The N-D blocks of a parameter (and of its state) joined into the whole, read as one piece."""
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

    # ---- What a loader asks for ----------------------------------------------------------------------
    def parameter(self, name: str, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Elements [start, end) of the flattened parameter (all of them, shaped, by default): a new tensor."""
        whole = end is None and start == 0
        end = self.shapes[name].numel() if end is None else end
        values = _cut(self.parameter_pieces[name], start, end, self, name)
        return values.view(self.shapes[name]) if whole else values

    def optimizer_state_dict(self, slices: list, params: list) -> dict:
        """The state dict of an optimiser whose i-th parameter ``params[i]`` holds elements [start, end) of
        ``slices[i] = (name, start, end)``, in the checkpoint's parameter groups (which are chosen by name)."""
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
        """Parameter ``name``'s whole optimiser state (flat tensors), joined from whatever pieces hold it."""
        pieces = [p for p in self.state_pieces[name] if p[2]]
        numel = self.shapes[name].numel()
        return {
            key: _cut([(s, e, st[key]) for s, e, st in pieces], 0, numel, self, name)
            if torch.is_tensor(value) and value.dim() > 0
            else (value.clone() if torch.is_tensor(value) else value)
            for key, value in pieces[0][2].items()
        }

    def block(self, name: str, blocks: list, whole: torch.Tensor | None = None) -> torch.Tensor:
        """The ``(name, dim, start, end)`` blocks of parameter ``name`` (or of ``whole``, shaped like it),
        concatenated along their dim, in the checkpoint's layout: a tensor-parallel rank's shard."""
        whole = self.parameter(name) if whole is None else whole
        return torch.cat(
            [whole.narrow(dim, start, end - start) for _, dim, start, end in blocks],
            dim=blocks[0][1],
        )

    def rank_state(self, rank: int) -> dict:
        """What rank ``rank`` saved (its RNG); at another world size, rank ``rank mod N``'s: a stream, not the one
        an uninterrupted run at the new size would have drawn."""
        return self.ranks[rank % self.world_size]

    def data_state(self, micro_batch_size: int, world_size: int) -> dict:
        """The data position for ``world_size`` ranks drawing ``micro_batch_size`` samples each: the same number
        of samples into the same epoch's shuffle (every rank's shard interleaves that one order)."""
        state = self.shared["data"]
        saved_per_draw = self.config["micro_batch_size"] * self.data_parallel_size
        per_draw = micro_batch_size * world_size
        consumed = state["index"] * saved_per_draw
        if consumed % per_draw:
            raise UserError(
                f"cannot continue the data stream of {self.path} with {world_size} ranks x "
                f"{micro_batch_size}: it stopped {consumed} samples into epoch {state['epoch']}, not a "
                f"multiple of {per_draw}; resume with {self.data_parallel_size} ranks x "
                f"{self.config['micro_batch_size']}"
            )
        return {"epoch": state["epoch"], "index": consumed // per_draw}

    def check_resumable(
        self, config: dict, world_size: int, say_changes: bool = False
    ) -> list[str]:
        """Refuse (``UserError``) a checkpoint of another run, or one whose data stream cannot continue at this world
        size; return what changes (step, world size, batch split), and with ``say_changes`` print it."""
        saved = self.config
        ignored = set(RESUMABLE_KEYS) | set(BATCH_SPLIT_KEYS) | {"step"}
        differing = sorted(k for k in set(saved) & set(config) - ignored if saved[k] != config[k])
        if differing:
            details = ", ".join(f"{k}: {saved[k]!r} -> {config[k]!r}" for k in differing)
            raise UserError(
                f"cannot resume {self.path}: the config differs from the checkpoint's ({details}); "
                "resume with the original flags"
            )
        saved_batch = saved["micro_batch_size"] * saved["grad_accum"] * self.data_parallel_size
        batch = config["micro_batch_size"] * config["grad_accum"] * world_size
        if batch != saved_batch:
            raise UserError(
                f"cannot resume {self.path} at world size {world_size} with micro-batch "
                f"{config['micro_batch_size']} x accumulation {config['grad_accum']}: the global batch "
                f"would be {batch}, it was {saved_batch} (saved at world size "
                f"{self.data_parallel_size}); keep "
                "micro-batch x accumulation x ranks the same"
            )
        changes = [
            f"{what} {a} -> {b}"
            for what, a, b in (
                ("step", saved["step"], config["step"]),
                ("world size", self.data_parallel_size, world_size),
                ("micro-batch", saved["micro_batch_size"], config["micro_batch_size"]),
                ("accumulation", saved["grad_accum"], config["grad_accum"]),
            )
            if a != b
        ]
        # can the data stream continue here?
        self.data_state(config["micro_batch_size"], world_size)
        if changes and say_changes:
            split_changed = any(not change.startswith("step ") for change in changes)
            outcome = (
                "the micro-batches group the samples differently, so the steps from here are close to, not "
                "bitwise, those of an uninterrupted run"
                if split_changed
                else "the steps from here are bitwise "
                "those of an uninterrupted run wherever the two steps train alike"
            )
            print(
                f"resuming {self.path} with {', '.join(changes)}: the data stream continues at the same sample; "
                f"{outcome} (docs/fault_tolerance.md)",
                file=sys.stderr,
            )
        return changes


def _is_blocks(piece) -> bool:
    """N-D blocks, ``[(name, dim, start, end), ...]``, rather than a flat slice ``(name, start, end)``."""
    return isinstance(piece[0], (list, tuple))


def _name(piece) -> str:
    return piece[0][0] if _is_blocks(piece) else piece[0]


def _cut(pieces: list, start: int, end: int, checkpoint: Checkpoint, name: str) -> torch.Tensor:
    """Elements [start, end) from ``pieces`` = [(piece start, piece end, tensor)] that tile the parameter."""
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


def open_checkpoint(path: Path, config: dict, world_size: int, is_main: bool):
    """Open ``path`` for this run, checked before anything is connected or written (``is_main`` says what changes)."""
    checkpoint = Checkpoint(path)
    checkpoint.check_resumable(config, world_size, say_changes=is_main)
    return checkpoint


class PerRank:
    """A part each rank saves for itself: ``holder.checkpoint_state(*args)``, ``holder.load_checkpoint(c, *args)``
    (an idea file's sharded state: ZeRO's slices, ``zero3.py``'s pieces)."""

    per_rank = True

    def __init__(self, holder, *args):
        self.holder, self.args = holder, args

    def checkpoint_state(self) -> dict:
        return self.holder.checkpoint_state(*self.args)

    def load_checkpoint(self, checkpoint) -> None:
        self.holder.load_checkpoint(checkpoint, *self.args)
