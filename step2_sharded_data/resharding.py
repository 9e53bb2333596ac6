"""Opening a checkpoint to resume it: what wrote it (``meta.json``), whether this run may resume it,
and what it holds, read through torch.distributed.checkpoint (``dcp_checkpoint.py``) at whatever
layout the reader has.

1. **Read what the checkpoint says about itself**, never which step wrote it: ``meta.json``
   (``checkpoint_meta``: format, step, world size, config, the parameters' shapes) and DCP's
   ``.metadata`` (every tensor's chunks, and in which file they are). Each rank then reads only its
   own boxes of each tensor (``read``).
2. **Whole or refused before anything connects** (``Checkpoint``): an unreadable ``meta.json`` or
   ``.metadata``, a data file missing or cut short, is one line naming the checkpoint to resume
   instead. A checkpoint of the earlier format (2: this repository's own files) is refused in one
   line saying how to convert it (compare/consolidate.py).
3. **The same run, or refused** (``check_resumable``): the config must be the checkpoint's, except
   the flags that say where and how to run (``RESUMABLE_KEYS``) and how the global batch is split:
   micro-batch x accumulation x ranks may change if their product does not. The data stream
   continues at the same sample.
4. **Opened before anything is connected or written** (``open_checkpoint``, once
   ``checkpoint_files.py`` has found it). Step 0's checkpoints are its own (one process, one file):
   refused here in one line.
5. **Each rank's own part** (``PerRank``): an idea file's sharded state, saved by every rank for
   itself beside checkpoint.py's shared parts, read back here at any world size.
"""

import json
import sys
import time
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from checkpoint_files import complete_checkpoints
from config import UserError
from dcp_checkpoint import Place, optimizer_state_dict, read

FORMAT_VERSION = 3  # 2: this repository's own files (state.pt, rank<r>.pt), before DCP
STEP0_FORMAT = "single-process"  # step0_single_gpu/checkpoint.py's meta.json
CONVERT = (
    "python compare/consolidate.py {path} OUT"  # what turns a format-2 checkpoint into this one
)

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


def checkpoint_meta(
    step: int, world_size: int, config: dict, shapes: dict, data_parallel_size=None
) -> str:
    """meta.json. ``data_parallel_size``:
    the ranks that drew their own samples, when not all did (TP, PP)."""
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


class Checkpoint:
    """A whole checkpoint on disk: its run state (``shared``), each rank's RNG (``ranks``), and
    every tensor by name (``read``), whatever step, world size or layout wrote it.

    Opening it checks that it is readable; ``check_resumable`` that it belongs to this run.
    ``reader`` says who reads it (a trainer's "resume", or "consolidate"), so that a corrupted one
    is reported in that one's terms.
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
        self.path, self.reader, started = Path(path), reader, time.perf_counter()
        try:
            meta = json.loads((self.path / "meta.json").read_text())
        except (OSError, ValueError) as error:
            self._corrupted(f"meta.json unreadable: {type(error).__name__}")
        found = meta.get("format") if isinstance(meta, dict) else None
        if found == STEP0_FORMAT:
            raise UserError(
                f"checkpoint {self.path} was written by step 0, whose checkpoint is "
                "one process's whole "
                "state in one file, not pieces to reshard: resume it with "
                "step0_single_gpu/train.py, or "
                "start afresh without --resume"
            )
        if found == 2 and reader == "resume":
            raise UserError(
                f"checkpoint {self.path} has format 2 (this repository's own files, "
                "before DCP); convert it "
                f"with {CONVERT.format(path=self.path)}, then resume OUT's checkpoint"
            )
        if found != FORMAT_VERSION:
            raise UserError(
                f"checkpoint {self.path} has format {found}, this code reads "
                f"{FORMAT_VERSION} (it was "
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
        try:
            stored = FileSystemReader(self.path).read_metadata()
        except FileNotFoundError:
            self._corrupted(".metadata is missing")
        except Exception as error:  # noqa: BLE001 (a pickle cut short or overwritten: all "corrupted")
            self._corrupted(f".metadata unreadable: {type(error).__name__}")
        self.metadata = stored.state_dict_metadata  # every entry: a tensor's chunks, or an object
        self._check_files(stored.storage_data)
        missing = [n for n in ("run", *self._rank_keys()) if n not in self.metadata]
        missing += [n for n in self.shapes if f"model.{n}" not in self.metadata]
        if missing:
            self._corrupted(f"it holds no {missing[0]}")
        objects = self.read({key: None for key in ("run", *self._rank_keys())})
        self.shared, self.ranks = objects["run"], [objects[k] for k in self._rank_keys()]
        if self.shared.get("step") != self.step:
            self._corrupted(
                f"its run state is for step {self.shared.get('step')}, meta.json says {self.step}"
            )
        self.open_s = time.perf_counter() - started  # the trainer reports it with its loading

    def _rank_keys(self) -> list[str]:
        return [f"rank{r}" for r in range(self.world_size)]

    def _check_files(self, storage: dict) -> None:
        """Every data file ``.metadata`` names is there and long enough:
        found before anything connects."""
        needed = {}
        for info in storage.values():
            needed[info.relative_path] = max(
                needed.get(info.relative_path, 0), info.offset + info.length
            )
        for name, size in sorted(needed.items()):
            file = self.path / name
            if not file.is_file():
                self._corrupted(f"{name} is missing")
            if file.stat().st_size < size:
                self._corrupted(f"{name} is cut short")

    def read(self, state: dict) -> dict:
        """Fill ``state`` (DCP entries: tensors, ``dcp_checkpoint.Boxes``,
        None for objects) from this checkpoint."""
        for key, value in state.items():
            saved = self.metadata.get(key)
            size = getattr(value, "size", None)
            if saved is None or (
                isinstance(saved, TensorStorageMetadata) and size and saved.size != size()
            ):
                there = "nothing" if saved is None else f"shape {tuple(saved.size)}"
                raise UserError(
                    f"checkpoint {self.path} holds {there} under {key}, this run needs shape "
                    f"{tuple(size()) if size else 'an object'}: it is another model's; "
                    "resume it with the "
                    "flags that wrote it, or start afresh without --resume"
                )
        try:
            return read(state, self.path)
        except UserError:
            raise
        except Exception as error:  # noqa: BLE001 (bytes overwritten in a data file)
            self._corrupted(f"a data file unreadable: {type(error).__name__}")

    def entries(self, prefix: str) -> dict:
        """``{rest: storage metadata}`` of the entries whose names begin with ``prefix``."""
        return {k[len(prefix) :]: v for k, v in self.metadata.items() if k.startswith(prefix)}

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

    # ---- Whole tensors, for tools and tests (a trainer reads only its own boxes) -----------------
    def parameter(self, name: str, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Elements [start, end) of the flattened parameter
        (all of it, shaped, by default): a new tensor."""
        saved = self.metadata[f"model.{name}"]
        whole = self.read({f"model.{name}": torch.empty(saved.size, dtype=saved.properties.dtype)})
        whole = whole[f"model.{name}"]
        return whole if end is None and start == 0 else whole.reshape(-1)[start:end].clone()

    def optimizer_state_dict(self, slices: list, params: list) -> dict:
        """The state dict of an optimiser whose i-th parameter ``params[i]`` holds elements [start,
        end) of ``slices[i] = (name, start, end)``, in one group per group the checkpoint saved its
        parameters in."""
        groups = {}
        for (name, _, _), param in zip(slices, params):
            hyper = self.read({f"optim.param_groups.{name}": None})[f"optim.param_groups.{name}"]
            groups.setdefault(hyper["group"], {**hyper, "params": []})["params"].append(param)
        places = [(name, Place(self.shapes[name], start=start)) for name, start, _ in slices]
        groups = [{k: v for k, v in g.items() if k != "group"} for _, g in sorted(groups.items())]
        return optimizer_state_dict(self, places, params, groups)

    def rank_state(self, rank: int) -> dict:
        """What rank ``rank`` saved (its RNG); at another world size, rank ``rank mod N``'s: a
        stream, not the one an uninterrupted run at the new size would have drawn."""
        return self.ranks[rank % self.world_size]

    def data_state(self, micro_batch_size: int, world_size: int) -> dict:
        """The data position for ``world_size`` ranks drawing ``micro_batch_size`` samples each: the
        same number of samples into the same epoch's shuffle (every rank's shard interleaves that
        one order)."""
        state = self.shared["data"]
        saved_per_draw = self.config["micro_batch_size"] * self.data_parallel_size
        per_draw = micro_batch_size * world_size
        consumed = state["index"] * saved_per_draw
        if consumed % per_draw:
            raise UserError(
                f"cannot continue the data stream of {self.path} with {world_size} ranks x "
                f"{micro_batch_size}: it stopped {consumed} samples into epoch "
                f"{state['epoch']}, not a "
                f"multiple of {per_draw}; resume with {self.data_parallel_size} ranks x "
                f"{self.config['micro_batch_size']}"
            )
        return {"epoch": state["epoch"], "index": consumed // per_draw}

    def check_resumable(
        self, config: dict, world_size: int, say_changes: bool = False
    ) -> list[str]:
        """Refuse (``UserError``) a checkpoint of another run, or one whose data stream cannot
        continue at this world size; return what changes (step, world size, batch split), and with
        ``say_changes`` print it."""
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
                f"{config['micro_batch_size']} x accumulation {config['grad_accum']}: "
                "the global batch "
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
                "the micro-batches group the samples differently, so the steps from "
                "here are close to, not "
                "bitwise, those of an uninterrupted run"
                if split_changed
                else "the steps from here are bitwise "
                "those of an uninterrupted run wherever the two steps train alike"
            )
            print(
                f"resuming {self.path} with {', '.join(changes)}: the data stream "
                "continues at the same sample; "
                f"{outcome} (docs/fault_tolerance.md)",
                file=sys.stderr,
            )
        return changes


def open_checkpoint(path: Path, config: dict, world_size: int, is_main: bool):
    """Open ``path`` for this run, checked before anything is
    connected or written (``is_main`` says what changes)."""
    checkpoint = Checkpoint(path)
    checkpoint.check_resumable(config, world_size, say_changes=is_main)
    return checkpoint


class PerRank:
    """A part each rank saves for itself: ``holder.checkpoint_state(*args)``,
    ``holder.load_checkpoint(c, *args)`` (an idea file's sharded state: ZeRO's slices,
    ``zero3.py``'s pieces)."""

    per_rank = True

    def __init__(self, holder, *args):
        self.holder, self.args = holder, args

    def checkpoint_state(self) -> dict:
        return self.holder.checkpoint_state(*self.args)

    def load_checkpoint(self, checkpoint) -> None:
        self.holder.load_checkpoint(checkpoint, *self.args)
