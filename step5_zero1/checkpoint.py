"""Checkpoints that are whole or absent, that any step reads at any world size, and that refuse another run.

Layout: ``<out>/checkpoints/step_<k>/`` holds ``meta.json`` (format, step, world size, config, the full
shape of every parameter), ``state.pt`` (what every rank holds the same: scheduler, scaler, data
position, the metrics records so far, and the whole model and optimiser state where every rank holds them
whole; written by rank 0) and ``rank<r>.pt`` per rank (its RNG states, and what only it holds: its
slices of the optimiser state, of the parameters or of their float32 masters).

1. **Whole or absent.** Everything is written into ``.tmp_step_<k>`` and renamed to ``step_<k>`` only
   once every rank's file is in it: a rank killed mid-write leaves a ``.tmp`` folder, which is never
   read and is removed by the next save. ``--resume auto`` takes the newest ``step_<k>``.
2. **Read by name and element range.** Whoever holds a tensor says which elements of which parameter it
   is, in one of three forms: whole (``model``: ``{name: tensor}``), flat slices of the flattened parameters
   (``model`` with ``model_slices``: ``{name: (start, end)}``), or N-D blocks of rows or columns (``model``,
   a list, with ``model_blocks``: ``(name, dim, start, end)`` each, as torch.distributed.checkpoint describes
   N-D chunks). The optimiser's state dict comes with ``optimizer_slices``: ``(name, start, end)`` or a list
   of blocks per parameter. ``Checkpoint`` reads what each file says about itself, never which step wrote it,
   and joins the pieces back (``parameter(name)``) or cuts the ones a loader asks for
   (``optimizer_state_dict(slices)``). So a checkpoint written at N ranks resumes in any step at N' ranks:
   each rank reads only the slices it will own (files are memory-mapped), as DeepSpeed's universal
   checkpoints and torch.distributed.checkpoint do.
3. **The same run, or refused.** The config must be the checkpoint's, except the flags that say where
   and how to run (``RESUMABLE_KEYS``) and how the global batch is split: micro-batch x accumulation x
   ranks may change if their product does not. The data stream then continues at the same sample.
4. **In the background** (``--async-save``): the state is copied to memory, and a thread writes it while
   training goes on; its barriers use a process group of their own, so they never interleave with
   training's collectives. One save at a time: the next one first waits for the last.
5. **One interface**, as torchtitan's ``Stateful``: each component that holds state says what this rank saves
   for it (entries of the forms above) and loads its part back from a ``Checkpoint`` at any world size:
   ``checkpoint_state(...)`` and ``load_checkpoint(checkpoint, ...)`` of ``ShardedOptimizer`` and
   ``FullyShardedDP``; ``optimizer_state`` and ``load_optimizer`` (below) for a plain optimiser.
"""
import copy
import json
import os
import re
import shutil
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from config import UserError, explain_failure, failure_explainers
from seeding import set_rng_state

FORMAT_VERSION = 2

# Flags that may change when resuming: they say where to write, what to print, where to run and how
# long to wait, not what to compute. Every other flag must be the checkpoint's.
RESUMABLE_KEYS = ("out", "save_every", "resume", "quiet", "timeout_s", "trace", "max_memory_mb", "async_save",
                  "backend", "device", "schedule", "micro_batches", "dp", "tp", "pp")
BATCH_SPLIT_KEYS = ("micro_batch_size", "grad_accum")  # may change with the world size, the product kept


def checkpoint_dir(out_dir, step: int) -> Path:
    return Path(out_dir) / "checkpoints" / f"step_{step}"


def checkpoint_meta(step: int, world_size: int, config: dict, shapes: dict, data_parallel_size=None) -> str:
    """meta.json: written last into a checkpoint's folder, by the trainers and by compare/consolidate.py.
    ``data_parallel_size``: how many ranks drew their own samples, when not all of them (tensor parallelism)."""
    meta = {"format": FORMAT_VERSION, "step": step, "world_size": world_size, "config": config,
            "shapes": {name: list(shape) for name, shape in shapes.items()}}
    if data_parallel_size is not None and data_parallel_size != world_size:
        meta["data_parallel_size"] = data_parallel_size
    return json.dumps(meta, indent=1) + "\n"


def params_in_order(optimizer) -> list:
    """The optimiser's parameters, numbered as its state dict numbers them."""
    return [param for group in optimizer.param_groups for param in group["params"]]


def complete_checkpoints(out_dir) -> list[Path]:
    """The whole checkpoints in ``out_dir``, oldest first (by step number, not by name)."""
    folders = [p for p in (Path(out_dir) / "checkpoints").glob("step_*")
               if p.name[5:].isdigit() and (p / "meta.json").is_file()]
    return sorted(folders, key=lambda p: int(p.name[5:]))


def find_checkpoint(resume: str | None, out_dir) -> Path | None:
    """``--resume``: ``auto``, the newest whole checkpoint in ``out_dir`` or None (a fresh start) when there
    is none; ``latest``, the same but none is an error; otherwise the given folder; None: a fresh start."""
    if resume is None:
        return None
    if resume in ("auto", "latest"):
        found = complete_checkpoints(out_dir)
        if not found and resume == "latest":
            raise UserError(f"--resume: no checkpoint in {out_dir}/checkpoints; train with --save-every N first, "
                            "pass --resume PATH, or --resume auto to start afresh when there is none")
        return found[-1] if found else None
    path = Path(resume)
    if not (path / "meta.json").is_file():
        meant = checkpoint_meant_by(path)
        raise UserError(f"--resume {resume} is not a checkpoint (a checkpoints/step_<k> folder with meta.json)"
                        + (f"; did you mean --resume {meant}?" if meant else ""))
    return path


def checkpoint_meant_by(path: Path) -> Path | None:
    """The checkpoint someone who named ``path`` instead probably meant: the one a file of it is in, or the
    newest whole checkpoint of a run folder (or of its checkpoints/ folder). None when there is none near."""
    path = Path(path)
    if path.is_file() and (path.parent / "meta.json").is_file():
        return path.parent
    found = complete_checkpoints(path.parent if path.name == "checkpoints" else path)
    return found[-1] if found else None


# What a fresh run removes from <out>/checkpoints: the folders a save writes, and nothing else.
OWN_CHECKPOINT_FOLDER = re.compile(r"(\.tmp_|\.old_)?step_\d+")


def clear_checkpoints(out_dir) -> None:
    """A fresh run replaces the run in ``out_dir``: its checkpoints would otherwise be taken for this run's.
    Only the folders a save writes go; anything else in <out>/checkpoints was put there by someone else."""
    folder = Path(out_dir) / "checkpoints"
    if not folder.is_dir():
        return
    for entry in folder.iterdir():
        if entry.is_dir() and OWN_CHECKPOINT_FOLDER.fullmatch(entry.name):
            shutil.rmtree(entry, ignore_errors=True)
    if not any(folder.iterdir()):
        folder.rmdir()


# ---- Writing ------------------------------------------------------------------------------------------

def snapshot(state):
    """A copy of ``state`` that training can no longer change: tensors copied to the CPU, the rest deep-copied."""
    if torch.is_tensor(state):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {key: snapshot(value) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(snapshot(value) for value in state)
    return copy.deepcopy(state)


class CheckpointNotWritten(RuntimeError):
    """A save that failed: one line and exit code 2 (``config.exit_on_user_error``), like running out of
    memory, at whatever point of training; the checkpoints saved before it stay whole."""


failure_explainers.append(lambda error: (str(error), 2) if isinstance(error, CheckpointNotWritten) else None)


class CheckpointWriter:
    """Saves checkpoints for one rank. Every rank calls ``save`` at the same steps, and ``wait`` before exit.

    ``shapes``: every parameter's full shape, by name (what any loader needs to join slices back).
    With ``config["async_save"]``, ``save`` returns once the state is copied to memory; a thread writes it.
    """

    def __init__(self, config: dict, rank: int, world_size: int, shapes: dict, data_parallel_size=None):
        self.config, self.rank, self.world_size, self.async_save = config, rank, world_size, config["async_save"]
        self.shapes, self.data_parallel_size = shapes, data_parallel_size
        self.thread = None
        self.error = None
        # Barriers from a background thread need a group no training collective uses: collectives on
        # one group are matched by the order they are issued in, and two threads would interleave them.
        distributed_run = dist.is_available() and dist.is_initialized()
        self.group = dist.new_group(backend="gloo") if distributed_run and self.async_save else None
        self.distributed_run = distributed_run

    def save(self, step: int, shared_state: dict, rank_state: dict) -> float:
        """Write checkpoint ``step``; returns the seconds training was held up (the whole write, or the copy)."""
        started = time.perf_counter()
        self.wait()  # the previous background write, if any, is finished before this one starts
        if self.async_save:
            states = snapshot((shared_state, rank_state))
            self.thread = threading.Thread(target=self._write_catching, args=(step, *states), name="checkpoint-writer")
            self.thread.start()
        else:
            self._write_catching(step, shared_state, rank_state)
            self.wait()
        paused = time.perf_counter() - started
        if self.rank == 0 and not self.config["quiet"]:
            how = "copied to memory, written in the background" if self.async_save else "written"
            print(f"checkpoint step_{step} {how}: training paused {paused * 1e3:.0f} ms", flush=True)
        return paused

    def wait(self) -> None:
        """Block until the background write (if any) is done; raise what it failed with: out of memory or a
        failed collective as they are (they have their own one-line explanations), anything else (a full disk,
        a folder removed under the run) as ``CheckpointNotWritten``."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            (step, error), self.error = self.error, None
            if explain_failure(error) is not None:
                raise error
            raise CheckpointNotWritten(
                f"rank {self.rank} could not write checkpoint step_{step} in {self.config['out']}/checkpoints "
                f"({type(error).__name__}: {error}); the checkpoints before it are whole: make room, then resume "
                "with --resume") from error

    def _write_catching(self, step: int, *state) -> None:
        try:
            self._write(step, *state)
        except BaseException as error:  # noqa: BLE001 (handed to the main thread by wait())
            self.error = step, error

    def _barrier(self) -> None:
        if self.distributed_run:
            dist.barrier(group=self.group)

    def _write(self, step: int, shared_state: dict, rank_state: dict) -> None:
        final = checkpoint_dir(self.config["out"], step)
        out, tmp = final.parent, final.with_name(f".tmp_step_{step}")
        if self.rank == 0:
            for leftover in [*out.glob(".tmp_step_*"), *out.glob(".old_step_*")]:  # from a save that was killed
                shutil.rmtree(leftover, ignore_errors=True)
            tmp.mkdir(parents=True)
        self._barrier()
        torch.save(rank_state, tmp / f"rank{self.rank}.pt")
        if self.rank == 0:
            torch.save(shared_state, tmp / "state.pt")
            (tmp / "meta.json").write_text(checkpoint_meta(step, self.world_size, self.config, self.shapes,
                                                                   self.data_parallel_size))
        self._barrier()  # every rank's file is in tmp before it becomes the checkpoint
        if self.rank == 0:
            if final.exists():  # written by an earlier run from this folder: move it aside, then replace it
                os.replace(final, out / f".old_step_{step}")
            os.replace(tmp, final)
            shutil.rmtree(out / f".old_step_{step}", ignore_errors=True)
        self._barrier()


def optimizer_slices(optimizer, named_params) -> list:
    """``(name, 0, numel)`` of each parameter of ``optimizer``, in its order: every one is a whole parameter."""
    name_of = {param: name for name, param in named_params}
    return [(name_of[p], 0, p.numel()) for p in params_in_order(optimizer)]


def optimizer_state(optimizer, named_params) -> dict:
    """What is saved for a plain torch optimiser over whole parameters, named by ``named_params``: its state dict
    (``optimizer``) and which parameter each of its parameters is (``optimizer_slices``)."""
    return {"optimizer": optimizer.state_dict(), "optimizer_slices": optimizer_slices(optimizer, named_params)}


def load_optimizer(optimizer, checkpoint, named_params) -> None:
    """The reverse of ``optimizer_state``: give ``optimizer`` its state from ``checkpoint``, whatever wrote it."""
    slices = optimizer_slices(optimizer, named_params)
    optimizer.load_state_dict(checkpoint.optimizer_state_dict(slices, params_in_order(optimizer)))


# ---- Reading ------------------------------------------------------------------------------------------

# Optimiser options that say how the update runs, not what it computes: the resuming run's own, not the saved ones.
UPDATE_IMPLEMENTATION = ("foreach", "fused", "capturable", "differentiable")


class Checkpoint:
    """A whole checkpoint on disk, read as full tensors by parameter name, whatever step and world size wrote it.

    Opening it checks that it is readable; ``check_resumable`` that it belongs to this run. ``reader`` says who
    reads it (a trainer's "resume", or "consolidate"), so that a corrupted one is reported in that one's terms.
    """

    # What to do instead of reading a corrupted checkpoint: with the one before it, or without any.
    INSTEAD = {
        "resume": ("resume from the one before it: --resume {earlier}",
                   "there is no earlier checkpoint to resume from: start afresh without --resume"),
        "consolidate": ("consolidate the one before it: python compare/consolidate.py {earlier} OUT",
                        "there is no earlier checkpoint to consolidate instead"),
    }

    def __init__(self, path: Path, reader: str = "resume"):
        self.path, self.reader = Path(path), reader
        try:
            meta = json.loads((self.path / "meta.json").read_text())
        except (OSError, ValueError) as error:
            self._corrupted(f"meta.json unreadable: {type(error).__name__}")
        if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
            found = meta.get("format") if isinstance(meta, dict) else None
            raise UserError(f"checkpoint {self.path} has format {found}, this code reads {FORMAT_VERSION} (it was "
                            "written by another version of this repository); start afresh without --resume")
        try:
            self.step, self.world_size, self.config = int(meta["step"]), int(meta["world_size"]), dict(meta["config"])
            self.shapes = {name: torch.Size(shape) for name, shape in meta["shapes"].items()}
            self.data_parallel_size = int(meta.get("data_parallel_size", self.world_size))
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            self._corrupted(f"meta.json lacks or garbles {error}")
        self.shared = self._load("state.pt")
        self.ranks = [self._load(f"rank{r}.pt") for r in range(self.world_size)]
        if self.shared.get("step") != self.step:
            self._corrupted(f"state.pt is for step {self.shared.get('step')}, meta.json says {self.step}")
        # Where each parameter's elements, and each parameter's optimiser state, are: (start, end, tensor or state).
        self.parameter_pieces, self.state_pieces, self.groups = {}, {}, []
        self.parameter_blocks, self.state_blocks = {}, {}  # N-D blocks, joined below
        for file, holder in [("state.pt", self.shared), *((f"rank{r}.pt", h) for r, h in enumerate(self.ranks))]:
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
        if "model_blocks" in holder:  # N-D blocks of rows or columns, a list of tensors beside their places
            for (name, dim, start, end), tensor in zip(holder["model_blocks"], holder["model"]):
                self.parameter_blocks.setdefault(name, []).append((dim, start, end, tensor))
        elif "model" in holder:  # flat slices of the flattened parameters; without model_slices, whole ones
            whole = {name: (0, shape.numel()) for name, shape in self.shapes.items()}
            ranges = holder["model_slices"] if "model_slices" in holder else whole
            for name, (start, end) in ranges.items():
                self.parameter_pieces.setdefault(name, []).append((start, end, holder["model"][name]))
        if "optimizer" in holder:
            self._index_optimizer(holder["optimizer"], holder["optimizer_slices"])

    def _load(self, name: str) -> dict:
        try:
            return torch.load(self.path / name, map_location="cpu", weights_only=True, mmap=True)
        except Exception as error:  # noqa: BLE001 (a truncated zip, a missing file, garbage bytes: all "corrupted")
            # Our words, not torch's: its message about weights_only would advise loading untrusted pickles.
            if isinstance(error, FileNotFoundError):
                self._corrupted(f"{name} is missing")
            reason = "not a file torch.save wrote, or cut short" if "zip" in str(error).lower() or isinstance(
                error, (EOFError, OSError)) else "it holds something other than tensors and plain values"
            self._corrupted(f"{name} unreadable: {reason}")

    def _corrupted(self, what: str):
        number = int(self.path.name[5:]) if self.path.name[5:].isdigit() else None  # step_<k>
        earlier = [p for p in complete_checkpoints(self.path.parent.parent) if number and int(p.name[5:]) < number]
        with_earlier, without = self.INSTEAD[self.reader]
        advice = with_earlier.format(earlier=earlier[-1]) if earlier else without
        raise UserError(f"checkpoint {self.path} is corrupted ({what}); {advice}")

    def _index_optimizer(self, state_dict: dict, slices: list) -> None:
        for i, piece in enumerate(slices):
            state = state_dict["state"].get(i, {})
            if _is_blocks(piece):  # split the state into its blocks, to be joined with the other ranks'
                offset = 0
                for name, dim, start, end in piece:
                    cut = {k: v.narrow(dim, offset, end - start) if torch.is_tensor(v) and v.dim() > 0 else v
                           for k, v in state.items()}
                    self.state_blocks.setdefault(name, []).append((dim, start, end, cut))
                    offset += end - start
            else:
                name, start, end = piece
                self.state_pieces.setdefault(name, []).append((start, end, state))
        if not self.groups:  # the same hyperparameters in every rank's groups
            # Which implementation runs the update (foreach on a GPU, single-tensor on the CPU) is the resuming
            # run's choice, not the saved run's: a checkpoint written on one device resumes on the other.
            self.groups = [({k: v for k, v in g.items() if k not in ("params", *UPDATE_IMPLEMENTATION)},
                            {_name(slices[i]) for i in g["params"]}) for g in state_dict["param_groups"]]
        else:
            for (_, names), group in zip(self.groups, state_dict["param_groups"]):
                names.update(_name(slices[i]) for i in group["params"])

    def _join_blocks(self) -> None:
        """The N-D blocks of a parameter (and of its state) joined into the whole, read as one piece."""
        for name, blocks in self.parameter_blocks.items():
            whole = self._join(name, [(dim, start, end, tensor) for dim, start, end, tensor in blocks])
            self.parameter_pieces.setdefault(name, []).append((0, whole.numel(), whole))
        for name, blocks in self.state_blocks.items():
            first = blocks[0][3]
            if not first:
                continue  # never stepped
            state = {key: self._join(name, [(d, s, e, st[key]) for d, s, e, st in blocks])
                     if torch.is_tensor(value) and value.dim() > 0 else value for key, value in first.items()}
            self.state_pieces.setdefault(name, []).append((0, self.shapes[name].numel(), state))

    def _join(self, name: str, blocks: list) -> torch.Tensor:
        dim, covered, parts = blocks[0][0], 0, []
        for _, start, end, tensor in sorted({b[1]: b for b in blocks}.values(), key=lambda b: b[1]):  # replicas once
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
            if _is_blocks(piece):  # N-D blocks (a tensor-parallel shard), in the checkpoint's layout
                name, whole = piece[0][0], [p for p in self.state_pieces.get(piece[0][0], []) if p[2]]
                if whole:
                    state[i] = {key: self.block(name, piece, value.view(self.shapes[name]))
                                if torch.is_tensor(value) and value.dim() > 0 else value
                                for key, value in self._whole_state(name).items()}
                continue
            name, start, end = piece
            pieces = [p for p in self.state_pieces.get(name, []) if p[2]]
            if not pieces:
                continue  # never stepped: no state, as in a fresh optimiser
            entry = {}
            for key, value in pieces[0][2].items():
                if torch.is_tensor(value) and value.dim() > 0:  # one value per element: exp_avg, exp_avg_sq
                    part = [(s, e, st[key]) for s, e, st in pieces]
                    entry[key] = _cut(part, start, end, self, name).view(param.shape)
                else:  # one value per parameter (AdamW's step): every slice holds it
                    entry[key] = value.clone() if torch.is_tensor(value) else value
            state[i] = entry
        groups = [{**hyper, "params": [i for i, piece in enumerate(slices) if _name(piece) in names]}
                  for hyper, names in self.groups]
        return {"state": state, "param_groups": groups}

    def _whole_state(self, name: str) -> dict:
        """Parameter ``name``'s whole optimiser state (flat tensors), joined from whatever pieces hold it."""
        pieces = [p for p in self.state_pieces[name] if p[2]]
        numel = self.shapes[name].numel()
        return {key: _cut([(s, e, st[key]) for s, e, st in pieces], 0, numel, self, name)
                if torch.is_tensor(value) and value.dim() > 0 else (value.clone() if torch.is_tensor(value) else value)
                for key, value in pieces[0][2].items()}

    def block(self, name: str, blocks: list, whole: torch.Tensor | None = None) -> torch.Tensor:
        """The ``(name, dim, start, end)`` blocks of parameter ``name`` (or of ``whole``, shaped like it),
        concatenated along their dim, in the checkpoint's layout: a tensor-parallel rank's shard."""
        whole = self.parameter(name) if whole is None else whole
        return torch.cat([whole.narrow(dim, start, end - start) for _, dim, start, end in blocks], dim=blocks[0][1])

    def restore(self, scheduler, scaler, batches, rank: int, world_size: int) -> tuple[int, list]:
        """Load what is not the model or the optimiser: the schedule, the loss scale, the data position, and,
        last (loading must not consume randomness after it), this rank's RNG. Returns (step, records)."""
        scheduler.load_state_dict(self.shared["scheduler"])
        scaler.load_state_dict(self.shared["scaler"])
        batches.load_state_dict(self.data_state(batches.micro_batch_size, world_size))
        set_rng_state(self.rank_state(rank)["rng"])
        return self.step, list(self.shared["records"])

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
            raise UserError(f"cannot continue the data stream of {self.path} with {world_size} ranks x "
                            f"{micro_batch_size}: it stopped {consumed} samples into epoch {state['epoch']}, not a "
                            f"multiple of {per_draw}; resume with {self.data_parallel_size} ranks x "
                            f"{self.config['micro_batch_size']}")
        return {"epoch": state["epoch"], "index": consumed // per_draw}

    def check_resumable(self, config: dict, world_size: int) -> list[str]:
        """Refuse (``UserError``) a checkpoint of another run; return what changes (step, world size, batch split)."""
        saved = self.config
        ignored = set(RESUMABLE_KEYS) | set(BATCH_SPLIT_KEYS) | {"step"}
        differing = sorted(k for k in set(saved) & set(config) - ignored if saved[k] != config[k])
        if differing:
            details = ", ".join(f"{k}: {saved[k]!r} -> {config[k]!r}" for k in differing)
            raise UserError(f"cannot resume {self.path}: the config differs from the checkpoint's ({details}); "
                            "resume with the original flags")
        saved_batch = saved["micro_batch_size"] * saved["grad_accum"] * self.data_parallel_size
        batch = config["micro_batch_size"] * config["grad_accum"] * world_size
        if batch != saved_batch:
            raise UserError(f"cannot resume {self.path} at world size {world_size} with micro-batch "
                            f"{config['micro_batch_size']} x accumulation {config['grad_accum']}: the global batch "
                            f"would be {batch}, it was {saved_batch} (saved at world size "
                            f"{self.data_parallel_size}); keep "
                            "micro-batch x accumulation x ranks the same")
        changes = [f"{what} {a} -> {b}" for what, a, b in (
            ("step", saved["step"], config["step"]), ("world size", self.data_parallel_size, world_size),
            ("micro-batch", saved["micro_batch_size"], config["micro_batch_size"]),
            ("accumulation", saved["grad_accum"], config["grad_accum"])) if a != b]
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


def open_checkpoint(path: Path, config: dict, world_size: int, is_main: bool) -> Checkpoint:
    """Open ``path`` for this run (every check before anything is connected or written) and say what changes."""
    checkpoint = Checkpoint(path)
    changes = checkpoint.check_resumable(config, world_size)
    checkpoint.data_state(config["micro_batch_size"], world_size)  # can the data stream continue here?
    if changes and is_main:
        split_changed = any(not change.startswith("step ") for change in changes)
        outcome = ("the micro-batches group the samples differently, so the steps from here are close to, not bitwise, "
                   "those of an uninterrupted run" if split_changed else
                   "the steps from here are bitwise those of an uninterrupted run wherever the two steps train alike")
        print(f"resuming {path} with {', '.join(changes)}: the data stream continues at the same sample; {outcome} "
              "(docs/fault_tolerance.md)", file=sys.stderr)
    return checkpoint


def load_parameters(named_params, checkpoint: Checkpoint) -> None:
    """Copy every full parameter from ``checkpoint`` into ``named_params``: a model every rank holds whole."""
    with torch.no_grad():
        for name, param in named_params:
            param.copy_(checkpoint.parameter(name))
