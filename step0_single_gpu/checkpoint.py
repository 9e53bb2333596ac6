"""Step 0's checkpoint: one process's whole state in one file,
written whole or not at all, resumed in one call.

``<out>/checkpoints/step_<k>/`` holds ``state.pt`` (``torch.save`` of one dict: the weights, AdamW's
moments, the schedule, the loss scale, the data position, the log and every random generator) and
``meta.json`` (the step and the flags). ``checkpoint_files.py`` makes it whole or absent and finds
it for ``--resume``.

1. **One call each way**, as torchtitan's ``Stateful``: the writer is given the run's *parts* once,
   each with ``checkpoint_state()`` and ``load_checkpoint(state)``; the loop calls
   ``start(checkpoint)`` and ``save(step)``.
2. **The same run, or refused** (``open_checkpoint``): every flag must be the checkpoint's, except
   those that say where to write, what to print and where to run (``RESUMABLE_KEYS``).
3. **Bitwise**: the random generators are put back last (nothing may draw after them), so the
   resumed run takes the very steps the uninterrupted one took.
"""

import json
import time
from pathlib import Path

import torch

from checkpoint_files import clear_checkpoints, publish, start_writing
from config import UserError, not_written
from seeding import rng_state, set_rng_state

FORMAT = "single-process"  # meta.json's "format": what the later steps' reader refuses in one line

# Flags that may change when resuming: they say where to write, what to print and where to run, not
# what to compute (--fp8 keeps no state of its own: a bf16 run may go on in FP8). Every other flag
# must be the checkpoint's.
RESUMABLE_KEYS = (
    "out",
    "save_every",
    "preempt_grace_s",
    "resume",
    "quiet",
    "max_memory_mb",
    "device",
    "fp8",
)


class RunState:
    """A part (rule 1): the schedule, the loss scale, the data position and the log."""

    def __init__(self, scheduler, scaler, batches, log):
        self.scheduler, self.scaler, self.batches, self.log = scheduler, scaler, batches, log

    def checkpoint_state(self) -> dict:
        return {
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "data": self.batches.state_dict(),
            "records": self.log.records,
        }

    def load_checkpoint(self, state: dict) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        self.batches.load_state_dict(state["data"])
        self.log.records = list(state["records"])


class WholeModel:
    """A part: the model and AdamW, or, given ``masters`` (--param-dtype), AdamW over the float32
    masters, which are saved in place of the 16-bit copies (the copies are rounded from them
    on load)."""

    def __init__(self, model, optimizer, masters=None):
        self.model, self.optimizer, self.masters = model, optimizer, masters or []

    def checkpoint_state(self) -> dict:
        master_of = {p.data_ptr(): m for (_, m), p in zip(self.masters, self.model.parameters())}
        return {
            "model": {
                name: master_of.get(t.data_ptr(), t) for name, t in self.model.state_dict().items()
            },
            "optimizer": self.optimizer.state_dict(),
        }

    def load_checkpoint(self, state: dict) -> None:
        with torch.no_grad():
            for name, param in [*self.model.named_parameters(), *self.masters]:
                param.copy_(state["model"][name])
        self.optimizer.load_state_dict(state["optimizer"])


def open_checkpoint(path: Path, config: dict) -> dict:
    """Rule 2: the state saved in ``path``,
    read before anything is written, or a one-line refusal."""
    try:
        meta = json.loads((path / "meta.json").read_text())
        saved, step = dict(meta["config"]), int(meta["step"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise corrupted(path, f"meta.json unreadable: {type(error).__name__}") from error
    if meta.get("format") != FORMAT:
        who = saved.get("step", "another step")
        raise UserError(
            f"checkpoint {path} was written by {who} (format {meta.get('format')}), "
            "not by this step 0: "
            "step 0 resumes only its own; resume it with the step that wrote it (at "
            "any world size, "
            "1 included), or start afresh without --resume"
        )
    differing = sorted(
        k for k in set(saved) & set(config) - set(RESUMABLE_KEYS) if saved[k] != config[k]
    )
    if differing:
        details = ", ".join(f"{k}: {saved[k]!r} -> {config[k]!r}" for k in differing)
        raise UserError(
            f"cannot resume {path}: the config differs from the checkpoint's ({details}); "
            "resume with the original flags"
        )
    try:
        state = torch.load(path / "state.pt", map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 (missing, cut short, garbage: all "corrupted")
        raise corrupted(path, "state.pt unreadable or missing") from error
    if state.get("step") != step:
        raise corrupted(path, f"state.pt is for step {state.get('step')}, meta.json says {step}")
    return {**state, "path": path}  # where it came from, for the line that says so


def corrupted(path: Path, what: str) -> UserError:
    return UserError(
        f"checkpoint {path} is corrupted ({what}); resume from an earlier one with --resume PATH, "
        "or start afresh without --resume"
    )


class CheckpointWriter:
    """``start`` once, ``save`` at every checkpoint step; ``parts``: rule 1."""

    rank = 0  # the one process, as the distributed steps' writers name theirs in a failure's line

    def __init__(self, config: dict, parts: list):
        self.config, self.parts = config, parts

    def start(self, state: dict | None) -> int:
        """Resume from ``state`` (``open_checkpoint``'s): every part, then the RNG (rule 3); given
        None, clear the checkpoints an earlier run left in --out. Returns the step to go on from."""
        if state is None:
            clear_checkpoints(self.config["out"])
            return 0
        for part in self.parts:
            part.load_checkpoint(state)
        set_rng_state(state["rng"])
        print(f"resumed from {state['path']} at step {state['step']}")
        return state["step"]

    def save(self, step: int) -> None:
        started = time.perf_counter()
        state = {"step": step, "rng": rng_state()}
        for part in self.parts:
            state.update(part.checkpoint_state())
        try:
            self._write(step, state)
        except Exception as error:  # a full disk, a folder removed under the run: one line, exit 2
            raise not_written(error, self.rank, step, self.config["out"]) from error
        if not self.config["quiet"]:
            print(
                f"checkpoint step_{step} written: training paused "
                f"{(time.perf_counter() - started) * 1e3:.0f} ms",
                flush=True,
            )

    def wait(self) -> None:
        """Nothing to wait for:
        ``save`` returns once the checkpoint is whole (``Preemption`` calls it)."""

    def _write(self, step: int, state: dict) -> None:
        tmp = start_writing(self.config["out"], step)
        torch.save(state, tmp / "state.pt")
        meta = {"format": FORMAT, "step": step, "config": self.config}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
        publish(tmp)
