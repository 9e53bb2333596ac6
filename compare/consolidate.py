"""Rewrite a checkpoint whole, in one process: every tensor one chunk of its full shape, in today's
format (DCP); and convert a checkpoint of the earlier format (2: this repository's own files), which
the trainers refuse.

    python compare/consolidate.py runs/step7_zero3/checkpoints/step_20 runs/consolidated
    torchrun --standalone --nproc_per_node=2 step1_torch_ddp/train.py \\
        --resume runs/consolidated/checkpoints/step_20

Every trainer already resumes any step's checkpoint at any world size (DCP copies the saved boxes
into the new layout's); this writes the joined tensors once (DeepSpeed calls it a universal
checkpoint): for a tool that reads one chunk per tensor, or a checkpoint of format 2 to resume
today. Bad input is one line and exit code 2.
"""

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

# checkpoint.py, config.py
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "common"))
import format2  # noqa: E402
from checkpoint_files import checkpoint_dir, not_a_checkpoint  # noqa: E402
from config import OneLineParser, UserError, check_writable_folder, exit_on_user_error  # noqa: E402
from dcp_checkpoint import save  # noqa: E402
from resharding import Checkpoint, checkpoint_meta  # noqa: E402


def open_any(path) -> Checkpoint | format2.Checkpoint:
    """The checkpoint in ``path``, read by today's reader or, for format 2, by format2.py."""
    try:
        found = json.loads((Path(path) / "meta.json").read_text()).get("format")
    except (OSError, ValueError, AttributeError):
        found = None  # today's reader says what is wrong
    return (format2.Checkpoint if found == 2 else Checkpoint)(path, reader="consolidate")


def whole_entries(checkpoint) -> dict:
    """Every tensor whole and every object, by DCP name (dcp_checkpoint.py's rule 1)."""
    if isinstance(checkpoint, Checkpoint):
        wanted = {
            key: torch.empty(saved.size, dtype=saved.properties.dtype)
            if isinstance(saved, TensorStorageMetadata)
            else None
            for key, saved in checkpoint.metadata.items()
        }
        return checkpoint.read(wanted)
    names = list(checkpoint.shapes)  # named_parameters() order; the optimiser's is group by group
    order = [name for _, group in checkpoint.groups for name in names if name in group]
    slices = [(name, 0, checkpoint.shapes[name].numel()) for name in order]
    params = [torch.empty(checkpoint.shapes[name], device="meta") for name in order]
    optimizer = checkpoint.optimizer_state_dict(slices, params)
    entries = {f"model.{name}": checkpoint.parameter(name) for name in names}
    for g, group in enumerate(optimizer["param_groups"]):
        hyper = {k: v for k, v in group.items() if k != "params"}
        for i in group["params"]:
            entries[f"optim.param_groups.{order[i]}"] = {"group": g, **hyper}
            for key, value in optimizer["state"].get(i, {}).items():
                shaped = torch.is_tensor(value) and value.dim() > 0
                value = value.view(checkpoint.shapes[order[i]]) if shaped else value
                entries[f"optim.state.{order[i]}.{key}"] = value
    pieces = ("model", "model_slices", "model_blocks", "optimizer", "optimizer_slices")
    entries["run"] = {k: v for k, v in checkpoint.shared.items() if k not in pieces}
    for rank, held in enumerate(checkpoint.ranks):
        entries[f"rank{rank}"] = {"rng": held["rng"]}
    return entries


def consolidate(source, out_dir: Path) -> Path:
    """Rewrite checkpoint ``source`` (a ``Checkpoint``, or its folder: any step, any world size,
    format 2 or today's) in ``out_dir``/checkpoints as one process: every tensor one chunk. Returns
    it. Refuses (before writing anything) an ``out_dir`` that cannot be written or already holds
    that checkpoint."""
    checkpoint = source if not isinstance(source, (str, Path)) else open_any(source)
    final = checkpoint_dir(out_dir, checkpoint.step)
    check_writable_folder(final, f"consolidating into {out_dir}")
    if final.exists():
        raise UserError(f"{final} exists already; consolidate into another folder")
    entries = whole_entries(checkpoint)
    tmp = final.with_name(f".tmp_{final.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save(entries, tmp)
    (tmp / "meta.json").write_text(
        checkpoint_meta(
            checkpoint.step,
            checkpoint.world_size,
            checkpoint.config,
            checkpoint.shapes,
            checkpoint.data_parallel_size,
        )
    )
    os.replace(tmp, final)
    return final


def main(argv=None):
    parser = OneLineParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("checkpoint", type=Path, help="a checkpoints/step_<k> folder")
    parser.add_argument(
        "out", type=Path, help="run folder to write <out>/checkpoints/step_<k> into"
    )
    args = parser.parse_args(argv)
    # a run folder named instead of one of its checkpoints?
    if not (args.checkpoint / "meta.json").is_file():
        raise not_a_checkpoint(args.checkpoint)
    source = open_any(args.checkpoint)
    written = consolidate(source, args.out)
    print(
        f"{written}: {len(source.shapes)} parameters of {source.config['step']} (world "
        f"size {source.world_size}) "
        f"at step {source.step}, each tensor whole"
    )


if __name__ == "__main__":
    exit_on_user_error(main)
