"""Turn a sharded checkpoint (steps 5-7, any world size) into a plain one: the whole model and AdamW's
whole state in one state.pt, as steps 0-4 write theirs (DeepSpeed calls this a universal checkpoint).

    python compare/consolidate.py runs/step7_zero3/checkpoints/step_20 runs/consolidated
    torchrun --standalone --nproc_per_node=2 step1_torch_ddp/train.py --resume runs/consolidated/checkpoints/step_20

Every trainer already resumes any step's checkpoint at any world size (checkpoint.py reads it by parameter
name and element range); this writes the joined tensors once, for a tool that does not know the slices, or
to keep one file per run instead of one per rank. Bad input is one line and exit code 2.
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "common"))  # checkpoint.py, config.py
from checkpoint import Checkpoint, checkpoint_meant_by, consolidate  # noqa: E402
from config import OneLineParser, UserError, exit_on_user_error  # noqa: E402


def main(argv=None):
    parser = OneLineParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="a checkpoints/step_<k> folder")
    parser.add_argument("out", type=Path, help="run folder to write <out>/checkpoints/step_<k> into")
    args = parser.parse_args(argv)
    if not (args.checkpoint / "meta.json").is_file():
        meant = checkpoint_meant_by(args.checkpoint)  # a run folder named instead of one of its checkpoints?
        raise UserError(f"{args.checkpoint} is not a checkpoint (a checkpoints/step_<k> folder with meta.json)"
                        + (f"; did you mean {meant}?" if meant else ""))
    source = Checkpoint(args.checkpoint, reader="consolidate")
    written = consolidate(source, args.out)
    print(f"{written}: {len(source.shapes)} parameters of {source.config['step']} (world size {source.world_size}) "
          f"at step {source.step}, whole, in state.pt")


if __name__ == "__main__":
    exit_on_user_error(main)
