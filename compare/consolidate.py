"""Turn a sharded checkpoint (steps 5-7, any world size) into a plain one: the whole model and AdamW's
whole state in one state.pt, as steps 0-4 write theirs (DeepSpeed calls this a universal checkpoint).

    python compare/consolidate.py runs/step7_zero3/checkpoints/step_20 runs/consolidated
    torchrun --standalone --nproc_per_node=2 step1_torch_ddp/train.py --resume runs/consolidated/checkpoints/step_20

Every trainer already resumes any step's checkpoint at any world size (resharding.py reads it by parameter
name and element range); this writes the joined tensors once, for a tool that does not know the slices, or
to keep one file per run instead of one per rank. Bad input is one line and exit code 2.
"""

import argparse
import os
import shutil
import sys
from pathlib import Path

import torch

# checkpoint.py, config.py
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "common"))
from checkpoint_files import checkpoint_dir, not_a_checkpoint  # noqa: E402
from config import OneLineParser, UserError, check_writable_folder, exit_on_user_error  # noqa: E402
from resharding import Checkpoint, checkpoint_meta  # noqa: E402


def consolidate(source, out_dir: Path) -> Path:
    """Rewrite checkpoint ``source`` (a ``Checkpoint``, or its folder: any step, any world size) in
    ``out_dir``/checkpoints as steps 0-4 write theirs: the whole model and AdamW's whole state in state.pt,
    each rank's file only its RNG. Returns it. Refuses (before writing anything) an ``out_dir`` that cannot
    be written or already holds that checkpoint."""
    checkpoint = (
        source if isinstance(source, Checkpoint) else Checkpoint(source, reader="consolidate")
    )
    final = checkpoint_dir(out_dir, checkpoint.step)
    check_writable_folder(final, f"consolidating into {out_dir}")
    if final.exists():
        raise UserError(f"{final} exists already; consolidate into another folder")
    names = list(checkpoint.shapes)  # named_parameters() order; the optimiser's is group by group
    order = [name for _, group in checkpoint.groups for name in names if name in group]
    slices = [(name, 0, checkpoint.shapes[name].numel()) for name in order]
    params = [torch.empty(checkpoint.shapes[name], device="meta") for name in order]
    shared = {
        key: value
        for key, value in checkpoint.shared.items()
        if key not in ("model", "optimizer_slices")
    }
    shared.update(
        model={name: checkpoint.parameter(name) for name in names},
        optimizer_slices=slices,
        optimizer=checkpoint.optimizer_state_dict(slices, params),
    )
    tmp = final.with_name(f".tmp_{final.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for rank in range(checkpoint.world_size):
        torch.save({"rng": checkpoint.ranks[rank]["rng"]}, tmp / f"rank{rank}.pt")
    torch.save(shared, tmp / "state.pt")
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
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("checkpoint", type=Path, help="a checkpoints/step_<k> folder")
    parser.add_argument(
        "out", type=Path, help="run folder to write <out>/checkpoints/step_<k> into"
    )
    args = parser.parse_args(argv)
    # a run folder named instead of one of its checkpoints?
    if not (args.checkpoint / "meta.json").is_file():
        raise not_a_checkpoint(args.checkpoint)
    source = Checkpoint(args.checkpoint, reader="consolidate")
    written = consolidate(source, args.out)
    print(
        f"{written}: {len(source.shapes)} parameters of {source.config['step']} (world size {source.world_size}) "
        f"at step {source.step}, whole, in state.pt"
    )


if __name__ == "__main__":
    exit_on_user_error(main)
