"""Where checkpoints live, how a run finds one, and how a save makes one whole or leaves none.

1. **One folder a checkpoint**: ``<out>/checkpoints/step_<k>/``,
   with a ``meta.json`` that says what wrote it.
2. **Whole or absent**: a save writes into ``.tmp_step_<k>`` (``start_writing``) and renames it
   ``step_<k>`` once every file is in it (``publish``); a save that was killed leaves only a
   ``.tmp_`` folder, never taken for a checkpoint, and removed by the next save.
3. **Found by ``--resume``** (``find_checkpoint``: ``auto`` and ``latest`` take the newest *whole*
   one); a fresh run clears the checkpoints an earlier run left in its ``--out``
   (``clear_checkpoints``).
"""

import os
import re
import shutil
from pathlib import Path

from config import UserError

# what a save writes, all a fresh run removes
OWN_CHECKPOINT_FOLDER = re.compile(r"(\.tmp_|\.old_)?step_\d+")


def checkpoint_dir(out_dir, step: int) -> Path:
    return Path(out_dir) / "checkpoints" / f"step_{step}"


def complete_checkpoints(out_dir) -> list[Path]:
    """The whole checkpoints in ``out_dir``, oldest first (by step number, not by name)."""
    folders = [
        p
        for p in (Path(out_dir) / "checkpoints").glob("step_*")
        if p.name[5:].isdigit() and (p / "meta.json").is_file()
    ]
    return sorted(folders, key=lambda p: int(p.name[5:]))


def find_checkpoint(resume: str | None, out_dir) -> Path | None:
    """``--resume``: ``auto``, the newest whole checkpoint in ``out_dir`` or None (a fresh start)
    when there is none; ``latest``, the same but none is an error; otherwise the given folder; None:
    a fresh start."""
    if resume is None:
        return None
    if resume in ("auto", "latest"):
        found = complete_checkpoints(out_dir)
        if not found and resume == "latest":
            raise UserError(
                f"--resume: no checkpoint in {out_dir}/checkpoints; train with "
                "--save-every N first, "
                "pass --resume PATH, or --resume auto to start afresh when there is none"
            )
        return found[-1] if found else None
    if not (Path(resume) / "meta.json").is_file():
        raise not_a_checkpoint(resume, "--resume ")
    return Path(resume)


def clear_checkpoints(out_dir) -> None:
    """A fresh run replaces the run in ``out_dir``: its checkpoints would otherwise be taken for
    this run's. Only the folders a save writes go; anything else in <out>/checkpoints was put there
    by someone else."""
    folder = Path(out_dir) / "checkpoints"
    if folder.is_dir():
        for entry in folder.iterdir():
            if entry.is_dir() and OWN_CHECKPOINT_FOLDER.fullmatch(entry.name):
                shutil.rmtree(entry, ignore_errors=True)
        if not any(folder.iterdir()):
            folder.rmdir()


def not_a_checkpoint(path, flag: str = "") -> UserError:
    """The error for ``path``, not a checkpoint, naming the one probably meant: the checkpoint a
    file of it is in, or the newest whole checkpoint of a run folder (or of its
    checkpoints/ folder)."""
    path = Path(path)
    if path.is_file() and (path.parent / "meta.json").is_file():
        meant = path.parent
    else:
        found = complete_checkpoints(path.parent if path.name == "checkpoints" else path)
        meant = found[-1] if found else None
    return UserError(
        f"{flag}{path} is not a checkpoint (a checkpoints/step_<k> folder with meta.json)"
        + (f"; did you mean {flag}{meant}?" if meant else "")
    )


def start_writing(out_dir, step: int) -> Path:
    """Rule 2, first half: an empty ``.tmp_step_<step>`` to write into,
    after removing what a killed save left."""
    tmp = checkpoint_dir(out_dir, step).with_name(f".tmp_step_{step}")
    for leftover in [*tmp.parent.glob(".tmp_step_*"), *tmp.parent.glob(".old_step_*")]:
        shutil.rmtree(leftover, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def publish(tmp: Path) -> None:
    """Rule 2, second half: ``tmp`` becomes ``step_<k>``,
    replacing one an earlier run from this folder wrote."""
    final = tmp.with_name(tmp.name[len(".tmp_") :])
    old = tmp.with_name(".old_" + final.name)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
