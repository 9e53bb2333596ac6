"""Activations per rank under tensor parallelism: what step 8 shrinks, and what it does not; and
under context parallelism (step 11), which splits them all.

    python compare/activations.py   # TP = 1, 2, 4 on the default model, one micro-batch
    python compare/activations.py --tp 1 2 --n-layer 4 --seq-len 128
    # and step 8's --sequence-parallel beside each
    python compare/activations.py --sequence-parallel
    # step 11's ring instead
    python compare/activations.py --cp 1 2 4 --seq-len 1024 --micro-batch-size 1

Autograd keeps tensors from forward for backward: the activations. This counts them exactly, as the
forward of one micro-batch saves them (``torch.autograd.graph.saved_tensors_hooks``; each storage
once, the parameters left out), on every rank of step 8's model at each TP degree, in spawned gloo
processes (TP = 1 is the whole model: one data-parallel rank's activations). Printed: the bytes each
rank saves, the part every rank holds identically (the residual stream, the LayerNorms' inputs and
outputs, the token ids: replicated, found by comparing the ranks' tensors), and the rest (q, k, v,
the attention scores, the MLP's 4h, the logits), which tensor parallelism splits 1/T. With
``--sequence-parallel`` each degree is measured again with step 8's sequence_parallel.py: the
replicated part is what it splits. With ``--cp`` the model is step 11's at each degree C (its ring
at C = 1 too), beside model.py's own attention, which keeps an S x S matrix per head.
"""

import argparse
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "step8_tensor_parallel"), str(REPO / "step11_context_parallel")]
from config import OneLineParser, UserError, build_parser, exit_on_user_error, parse_config  # noqa: E402
from launch import spawn_ranks  # noqa: E402


class SavedActivations:
    """The tensors autograd saves for backward while it is active,
    each storage once: (bytes, fingerprint)."""

    def __init__(self, params):
        self.skip = {p.untyped_storage().data_ptr() for p in params}
        self.seen, self.saved = set(), []

    def pack(self, tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self.skip | self.seen:
            self.seen.add(storage.data_ptr())
            fingerprint = (tuple(tensor.shape), tensor.detach().double().sum().item())
            self.saved.append((storage.nbytes(), fingerprint))
        return tensor


def measure(
    rank: int, world_size: int, port: int, config: dict, sequence_parallel: bool = False
) -> tuple:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(
        "gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=120)
    )
    from model import build_model
    from sequence_parallel import sequence_parallel_gpt2
    from tensor_parallel import parallelize_gpt2
    from vocab_parallel import vocab_parallel_cross_entropy

    vocab = 2048
    model = parallelize_gpt2(build_model(config, vocab, config["seed"]))
    if sequence_parallel:
        model = sequence_parallel_gpt2(model)
    b, s = config["micro_batch_size"], config["seq_len"]
    inputs = torch.randint(0, vocab, (b, s + 1), generator=torch.Generator().manual_seed(0))
    counter = SavedActivations(model.parameters())
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda tensor: tensor):
        logits = model(inputs[:, :-1])
        loss = vocab_parallel_cross_entropy(logits.float().flatten(0, 1), inputs[:, 1:].flatten())
    loss.backward()
    everyone = [None] * world_size
    # every rank runs the same graph: the same order
    dist.all_gather_object(everyone, counter.saved)
    same = [len({theirs[i][1] for theirs in everyone}) == 1 for i in range(len(counter.saved))]
    replicated = sum(nbytes for (nbytes, _), alike in zip(counter.saved, same) if alike)
    dist.barrier()
    dist.destroy_process_group()
    return rank, sum(nbytes for nbytes, _ in counter.saved), replicated


def run(world_size: int, config: dict, sequence_parallel: bool = False) -> list[tuple]:
    return sorted(spawn_ranks(measure, world_size, config, sequence_parallel, timeout=600).values())


def measure_cp(rank: int, world_size: int, port: int, config: dict, ring: bool) -> tuple:
    """The bytes one rank of step 11's model saves for one micro-batch (``ring=False``:
    model.py's attention)."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(
        "gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=120)
    )
    import torch.nn.functional as F

    from context_parallel import context_parallel_gpt2, sequence_shard
    from model import build_model

    vocab = 2048
    model = build_model(config, vocab, config["seed"])
    model = context_parallel_gpt2(model) if ring else model
    b, s = config["micro_batch_size"], config["seq_len"]
    inputs = torch.randint(0, vocab, (b, s + 1), generator=torch.Generator().manual_seed(0))
    counter = SavedActivations(model.parameters())
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda tensor: tensor):
        logits = model(inputs[:, :-1])
        targets = sequence_shard(inputs[:, 1:]) if ring else inputs[:, 1:]
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    loss.backward()
    dist.barrier()
    dist.destroy_process_group()
    return rank, sum(nbytes for nbytes, _ in counter.saved)


def run_cp(degrees: list[int], config: dict) -> list[tuple]:
    """(label, C, bytes saved per rank) for model.py's attention and for step 11 at each degree."""
    rows = []
    for label, c, ring in [("model.py", 1, False)] + [("ring", c, True) for c in degrees]:
        per_rank = {
            saved for _, saved in spawn_ranks(measure_cp, c, config, ring, timeout=600).values()
        }
        if len(per_rank) != 1:
            raise RuntimeError(f"the ranks saved different amounts at CP = {c}: {sorted(per_rank)}")
        rows.append((label, c, per_rank.pop()))
    return rows


def main() -> int:
    parser = OneLineParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--tp", type=int, nargs="+", default=[1, 2, 4], help="tensor-parallel degrees to measure"
    )
    parser.add_argument(
        "--sequence-parallel", action="store_true", help="each degree with sequence parallelism too"
    )
    parser.add_argument(
        "--cp", type=int, nargs="+", help="context-parallel degrees to measure instead (step 11)"
    )
    args, extra = parser.parse_known_args()
    config = parse_config(build_parser("activations"), extra)
    if args.cp:
        for c in args.cp:
            if c < 1 or config["seq_len"] % (2 * c):
                raise UserError(
                    f"--cp {c}: step 11 cuts --seq-len {config['seq_len']} into 2 x {c} chunks; "
                    "use degrees whose 2 x C divides it"
                )
        print(
            f"saved for backward, one micro-batch of {config['micro_batch_size']} x "
            f"{config['seq_len']} tokens "
            f"(n_layer {config['n_layer']}, n_embd {config['n_embd']}, n_head "
            f"{config['n_head']}), per rank:"
        )
        print(f"{'attention':>10} {'CP':>3} {'saved per rank':>15} {'x CP':>15}")
        for label, c, saved in run_cp(args.cp, config):
            print(f"{label:>10} {c:>3} {saved:>15,} {saved * c:>15,}")
        return 0
    for t in args.tp:
        if t < 1 or config["n_head"] % t:
            raise UserError(f"--tp {t}: each degree must divide the {config['n_head']} heads")
    print(
        f"saved for backward, one micro-batch of {config['micro_batch_size']} x "
        f"{config['seq_len']} tokens "
        f"(n_layer {config['n_layer']}, n_embd {config['n_embd']}, n_head "
        f"{config['n_head']}), per rank:"
    )
    print(
        f"{'TP':>3} {'SP':>3} {'saved per rank':>15} {'replicated':>12} {'split':>12} "
        f"{'split x TP':>12}"
    )
    for t in args.tp:
        for sequence_parallel in [False, True] if args.sequence_parallel and t > 1 else [False]:
            if sequence_parallel and config["seq_len"] % t:
                raise UserError(
                    f"--tp {t} with --sequence-parallel: each degree must divide --seq-len "
                    f"{config['seq_len']}"
                )
            results = run(t, config, sequence_parallel)
            if len({r[1:] for r in results}) != 1:
                raise RuntimeError(f"the ranks saved different amounts at TP = {t}: {results}")
            total, replicated = results[0][1:]
            print(
                f"{t:>3} {'yes' if sequence_parallel else 'no':>3} {total:>15,} {replicated:>12,} "
                f"{total - replicated:>12,} {(total - replicated) * t:>12,}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main))
