"""Activation memory in flight per pipeline stage, in bytes:
GPipe holds M micro-batches' activations, 1F1B at most P.

    python compare/pipeline_memory.py   # P = 2 and 4, M = 1, 2, 4, 8, both schedules
    python compare/pipeline_memory.py --stages 2 --micro-batches 1 8 --n-embd 256

Autograd keeps tensors from a micro-batch's forward until its backward: the activations. A pipeline
stage holds those of every micro-batch it has run forward and not yet backward, so its peak is
(micro-batches held at once) x (bytes one micro-batch saves on that stage): GPipe holds all M before
the first backward; 1F1B's stage s at most P - s (min(P - s, M)). This measures the bytes, not the
count: ``SavedBytesInFlight`` follows every tensor autograd saves while ``Pipeline.run`` runs
(``torch.autograd.graph.saved_tensors_hooks``), from the save until autograd lets go of it, each
storage once, the parameters left out; it keeps the most bytes held at once. No allocator is asked,
so the numbers are exact and the same on every machine (float32).

Each P runs in P spawned gloo processes, step 9's own modules: every rank builds the whole model and
keeps ``GPT2Stage(model, rank, P)``, as train.py does, and runs one optimiser step's forwards and
backwards per (schedule, M) on random tokens (memory depends on shapes, not on the text). The
default model is compare/bubble.py's: 4 blocks of width 128, micro-batches of 4 x 64 tokens.
"""

import argparse
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parent.parent
STEP9 = REPO / "step9_pipeline_parallel"
sys.path.insert(0, str(REPO / "common"))  # config.py, as every step has it
from config import OneLineParser, UserError, build_parser, exit_on_user_error, parse_config  # noqa: E402
from launch import spawn_ranks  # noqa: E402

MODEL = [
    "--n-layer",
    "4",
    "--n-embd",
    "128",
    "--n-head",
    "4",
    "--seq-len",
    "64",
    "--micro-batch-size",
    "4",
]
VOCAB = 2048  # data/tokenizer.json's


class SavedBytesInFlight:
    """The bytes autograd holds for backward,
    followed live while active as ``saved_tensors_hooks(*counter.hooks)``.

    A storage counts from the first time a tensor on it is saved until autograd has let go of the
    last one (autograd drops a saved tensor once the backward that needs it has run). Parameters
    (``params``) are not activations and are left out. ``peak``: the most bytes held at once;
    ``saved``: bytes counted in, in all.
    """

    def __init__(self, params=()):
        self.skip = {p.untyped_storage().data_ptr() for p in params}
        self.holders = {}  # storage address: [saved tensors on it still held, its bytes]
        self.live = self.peak = self.saved = 0
        self.hooks = (self._pack, self._unpack)

    def _pack(self, tensor):
        address = tensor.untyped_storage().data_ptr()
        if address in self.skip:
            return tensor
        if address in self.holders:
            self.holders[address][0] += 1
        else:
            nbytes = tensor.untyped_storage().nbytes()
            self.holders[address] = [1, nbytes]
            self.live += nbytes
            self.saved += nbytes
            self.peak = max(self.peak, self.live)
        return _Held(tensor, self, address)

    @staticmethod
    def _unpack(packed):
        return packed.tensor if isinstance(packed, _Held) else packed

    def _release(self, address: int) -> None:
        holder = self.holders[address]
        holder[0] -= 1
        if holder[0] == 0:
            self.live -= holder[1]
            del self.holders[address]

    def reset_peak(self) -> None:
        self.peak, self.saved = self.live, 0


class _Held:
    """What autograd keeps in place of a saved tensor:
    the tensor, and a note to the counter when dropped."""

    __slots__ = ("tensor", "counter", "address")

    def __init__(self, tensor, counter, address):
        self.tensor, self.counter, self.address = tensor, counter, address

    def __del__(self):
        self.counter._release(self.address)


def held_formula(schedule: str, stage: int, num_stages: int, micro_batches: int) -> int:
    """Micro-batches whose activations stage ``stage`` holds at once:
    M for GPipe, min(P - s, M) for 1F1B."""
    return micro_batches if schedule == "gpipe" else min(num_stages - stage, micro_batches)


def measure(rank: int, world_size: int, port: int, config: dict, cases: list) -> list:
    """One stage: for each (schedule, M),
    a fresh stage of the same model runs one step; its counts to rank 0."""
    torch.set_num_threads(1)
    # the step's own modules (its copies of common's, verbatim, and pipeline.py)
    sys.path.insert(0, str(STEP9))
    from model import build_model
    from pipeline import Pipeline
    from pipeline_stages import GPT2Stage

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(
        "gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=300)
    )
    b, s = config["micro_batch_size"], config["seq_len"]
    results = []
    for schedule, m in cases:
        stage = GPT2Stage(build_model(config, VOCAB, config["seed"]), rank, world_size)
        pipe = Pipeline(
            stage,
            rank,
            world_size,
            (b, s, config["n_embd"]),
            schedule=schedule,
            loss_fn=lambda logits, y: torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), y.flatten()
            ),
            tied_parameter=stage.tied_parameter,
        )
        tokens = torch.randint(0, VOCAB, (m, b, s + 1), generator=torch.Generator().manual_seed(0))
        counter = SavedBytesInFlight(stage.parameters())
        with torch.autograd.graph.saved_tensors_hooks(*counter.hooks):
            # Each micro-batch's ids in a storage of its own, as a data loader hands them out: views
            # of one tensor would be counted as one storage, held until the last
            # micro-batch's backward.
            pipe.run(
                m,
                inputs=[t[:, :-1].clone() for t in tokens],
                targets=[t[:, 1:].clone() for t in tokens],
                loss_scale=m,
            )
        pipe.finish_gradient_synchronization()
        results.append(
            {
                "schedule": schedule,
                "M": m,
                "peak": counter.peak,
                "per_micro_batch": counter.saved // m,
                "held": pipe.take_peak_in_flight(),
                "left": counter.live,
            }
        )
    everyone = [None] * world_size
    dist.all_gather_object(everyone, results)
    dist.barrier()
    dist.destroy_process_group()
    return everyone


def run(world_size: int, config: dict, cases: list) -> list[list[dict]]:
    """``[stage][case]`` results of ``measure``, from ``world_size`` spawned processes."""
    return spawn_ranks(measure, world_size, config, cases)[0]


def main() -> int:
    parser = OneLineParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument(
        "--schedules", nargs="+", choices=["gpipe", "1f1b"], default=["gpipe", "1f1b"]
    )
    args, extra = parser.parse_known_args()
    config = parse_config(build_parser("pipeline_memory"), [*MODEL, *extra])
    if any(not 2 <= p <= config["n_layer"] for p in args.stages) or any(
        m < 1 for m in args.micro_batches
    ):
        raise UserError(
            f"--stages must be 2 to {config['n_layer']} (the model's blocks) and "
            "--micro-batches at "
            "least 1"
        )
    cases = [(schedule, m) for schedule in args.schedules for m in args.micro_batches]
    print(
        f"activations held for backward per stage, bytes (float32; {config['n_layer']} "
        "blocks, n_embd "
        f"{config['n_embd']}, micro-batches of {config['micro_batch_size']} x "
        f"{config['seq_len']} tokens, "
        f"vocabulary {VOCAB})"
    )
    print(
        f"{'schedule':<8} {'P':>2} {'M':>2} {'stage':>5} {'one micro-batch':>16} "
        f"{'held':>4} {'peak measured':>14} "
        f"{'held x one':>14}"
    )
    differ = 0
    for p in args.stages:
        per_stage = run(p, config, cases)
        for i, (schedule, m) in enumerate(cases):
            for s in range(p):
                r = per_stage[s][i]
                expected = held_formula(schedule, s, p, m) * r["per_micro_batch"]
                ok = (
                    r["peak"] == expected
                    and r["held"] == held_formula(schedule, s, p, m)
                    and r["left"] == 0
                )
                differ += not ok
                print(
                    f"{schedule:<8} {p:>2} {m:>2} {s:>5} {r['per_micro_batch']:>16,} "
                    f"{r['held']:>4} "
                    f"{r['peak']:>14,} {expected:>14,}{'' if ok else '  <-- differs'}"
                )
    print(
        "every peak = (micro-batches held) x (one micro-batch's bytes)"
        if not differ
        else f"{differ} rows differ"
    )
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main))
