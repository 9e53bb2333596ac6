"""Before launching: the bytes each rank will hold, per step and world size, from the trainer flags.

    python compare/estimate.py   # the default config, world sizes 1-4
    python compare/estimate.py --n-layer 16 --n-embd 1024 --n-head 16 --micro-batch-size 1 \\
        --world-sizes 1,2,4 --budget-mb 2048   # step 7's "does not fit on one rank" demo
    python compare/estimate.py --param-dtype bf16   # and the closed forms, 16-bit, N = 1 ... 1024
    python compare/estimate.py --zero-paper         # the ZeRO paper's Figure 1, its 4x and 8x

Nothing is allocated: GPT-2 is built on the meta device from the flags the trainers take (--n-layer,
--n-embd, --n-head, --seq-len, the vocabulary of --tokenizer), so Ψ and every tensor's shape are
exact. Then, with float32 parameters and AdamW (two moments and a 4-byte step count per tensor it
steps), per rank:

    step               parameters  gradients  optimizer state
    DDP (steps 0-4)    4Ψ          4Ψ         8Ψ
    ZeRO-1 (step 5)    4Ψ          4Ψ         8Ψ/N   one flat range, cut N ways
    ZeRO-2 (step 6)    4Ψ          4Ψ/N       8Ψ/N   the gradient buckets, each cut N ways
    ZeRO-3 (step 7)    4Ψ/N        4Ψ/N       8Ψ/N   units (root, each block), each cut N ways

each computed element by element with the layouts the steps use (padding to a multiple of N, on the
last rank; one step count per piece a rank steps): these are the numbers each record's ``memory``
holds in metrics.json (``tests/test_estimate.py`` checks them against real runs). For step 7 also
the parameters gathered at once: the root (kept from forward to backward) and two blocks (one
computing, the next prefetched; one with --no-prefetch). ``activations``: what autograd saves for
backward in one micro-batch of --micro-batch-size x --seq-len (a forward on the meta device,
counted by ``saved_tensors_hooks``; the same in every step, and released by each backward).
``Model.checkpointed_activation_bytes`` counts what step 7 keeps with --activation-checkpointing
(``compare/peak_memory.py`` predicts with it).

With 16-bit parameters (``--param-dtype bf16``; ``state_bytes``, ``formula``) the closed forms
follow the ZeRO paper: DDP 2Ψ + 2Ψ + 12Ψ (K = 12: fp32 master weights and two moments), ZeRO-1 2Ψ +
2Ψ + 12Ψ/N, ZeRO-2 2Ψ + (2 + 12)Ψ/N, ZeRO-3 16Ψ/N; and as FSDP2's ``reduce_dtype=float32`` (step 7's
``param_dtype``) holds them, gradients in float32: ZeRO-2 2Ψ + (4 + 12)Ψ/N, ZeRO-3 4Ψ/N + 4Ψ/N +
8Ψ/N (docs/planner.md).

``total`` adds them up for the rank that holds most. With ``--budget-mb`` (the trainers'
``--max-memory-mb``: what a rank may allocate beyond its start-up) each row says whether that total
fits and what is left. Not counted, and the reason to leave headroom: communication buffers (DDP's
and steps 4-5's buckets, 4Ψ; step 6's buckets until launched), the copies gloo makes of a gathered
or reduce-scattered unit, the gradient of the unit in backward (step 7), the corpus, the process
group's threads, and the allocator's own slack (docs/zero3.md measures them on step 7's demo).
"""

import argparse
import contextlib
import functools
import json
import sys
from pathlib import Path

import torch

# config.py, model.py, as every step has them
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "common"))
from config import UserError, build_parser, check_writable_file, exit_on_user_error, parse_config  # noqa: E402
from model import GPT2, gpt2_config  # noqa: E402
from training import adamw_param_groups  # noqa: E402

STEPS = ("DDP (steps 0-4)", "ZeRO-1 (step 5)", "ZeRO-2 (step 6)", "ZeRO-3 (step 7)")
KINDS = ("params", "grads", "optimizer_state")
BYTES = 4  # float32 parameters, gradients and moments
STEP_COUNT_BYTES = 4  # AdamW's per-tensor step, a float32 scalar tensor
# The trainer flags an estimate reads; the others are accepted
# (so a trainer's command line can be pasted) and hidden.
USED_FLAGS = {
    "n_layer",
    "n_embd",
    "n_head",
    "seq_len",
    "tokenizer",
    "micro_batch_size",
    "dropout",
    "param_dtype",
}


class Model:
    """GPT-2 of a config on the meta device: names, shapes and units, no memory.

    ``dtype``: what forward computes in (a 16-bit ``param_dtype``: activations of 2 bytes where the
    model's own ops keep that dtype)."""

    def __init__(self, config: dict, vocab_size: int, dtype: torch.dtype | None = None):
        self.config, self.vocab_size = config, vocab_size
        with torch.device("meta"):
            self.module = GPT2(gpt2_config(config, vocab_size))
        if dtype is not None:
            self.module.to(dtype)
        # a tied tensor once
        self.named = [(name, p.numel()) for name, p in self.module.named_parameters()]
        self.psi = sum(n for _, n in self.named)
        blocks = [f"transformer.h.{i}." for i in range(config["n_layer"])]
        # step 7's units: the root (every parameter outside a block), then each block, in order
        self.units = [[n for name, n in self.named if not any(name.startswith(b) for b in blocks)]]
        self.units += [[n for name, n in self.named if name.startswith(b)] for b in blocks]

    def optimizer_order(self) -> list[int]:
        """The sizes in the order the steps' AdamW groups list them (decayed first):
        step 5's one flat range."""
        index = {p: i for i, (p) in enumerate(self.module.parameters())}
        sizes = [n for _, n in self.named]
        groups = adamw_param_groups(self.module.named_parameters(), self.config)
        return [sizes[index[p]] for group in groups for p in group["params"]]

    def gradient_buckets(
        self, bucket_cap_mb: float, first_bucket_cap_mb: float = 1.0
    ) -> list[list[int]]:
        """Step 6's buckets:
        the parameters in gradient-ready order (reversed), closed once a cap is reached."""
        buckets, current, size = [], [], 0
        for n in [n for _, n in self.named][::-1]:
            current.append(n)
            size += n * BYTES
            if (
                size
                >= (min(first_bucket_cap_mb, bucket_cap_mb) if not buckets else bucket_cap_mb)
                * 2**20
            ):
                buckets.append(current)
                current, size = [], 0
        return buckets + ([current] if current else [])

    def activation_bytes(self, micro_batch_size: int, checkpointing: bool = False) -> int:
        """Bytes autograd keeps for backward in one micro-batch,
        at most at once (the weights left out).

        ``checkpointing``: as step 7's --activation-checkpointing:
        ``checkpointed_activation_bytes``, both parts."""
        if checkpointing:
            return sum(self.checkpointed_activation_bytes(micro_batch_size))
        saved, _ = self.saved_tensors(micro_batch_size)
        # a tensor saved twice: once
        return sum({k: n for part in saved.values() for k, n in part.items()}.values())

    def checkpointed_activation_bytes(self, micro_batch_size: int) -> tuple[int, int]:
        """With every block checkpointed: (what is kept from forward to backward, the most a block's
        recomputation adds while its backward runs). Kept: what the root saves and each block's
        tensor arguments (a checkpointed block keeps its input and nothing it computes); added: the
        block's own saved tensors, alive again while it recomputes them."""
        saved, arguments = self.saved_tensors(micro_batch_size)
        kept = {**saved.get(None, {}), **arguments}
        added = [
            sum(n for k, n in saved.get(i, {}).items() if k not in kept)
            for i in range(self.config["n_layer"])
        ]
        return sum(kept.values()), max(added, default=0)

    def saved_tensors(self, micro_batch_size: int, shapes: dict | None = None) -> tuple[dict, dict]:
        """One forward (and the loss) of a micro-batch, counting storages: ({block index, or None
        for the root: {storage: bytes} of the tensors autograd saves there}, {storage: bytes} of the
        blocks' tensor arguments).
        ``shapes``: filled with
        {storage: the shape it was first saved with}."""
        weights = {p.untyped_storage()._cdata for p in self.module.parameters()}
        running, saved, arguments = [], {}, {}  # the blocks whose forward runs

        def pack(tensor):
            storage = tensor.untyped_storage()
            if storage._cdata not in weights:
                saved.setdefault(running[-1] if running else None, {})[storage._cdata] = (
                    storage.nbytes()
                )
                if shapes is not None:
                    shapes.setdefault(storage._cdata, tuple(tensor.shape))
            return tensor

        def enter(index, block, args, kwargs):
            running.append(index)
            for t in (*args, *kwargs.values()):
                if torch.is_tensor(t):
                    arguments[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()

        def leave(block, args, output):  # returns None: the block's output stays its own
            running.pop()

        blocks = list(self.module.transformer.h)
        # meta: no memory (a real model gives the same count)
        device = next(self.module.parameters()).device
        tokens = torch.zeros(
            micro_batch_size, self.config["seq_len"], dtype=torch.long, device=device
        )
        with contextlib.ExitStack() as stack:
            for i, block in enumerate(blocks):
                stack.callback(
                    block.register_forward_pre_hook(
                        functools.partial(enter, i), with_kwargs=True
                    ).remove
                )
                stack.callback(block.register_forward_hook(leave).remove)
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                logits = self.module(tokens)
                torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens.flatten())
        return saved, arguments


def cut(ranges: list[list[int]], world_size: int) -> list[tuple[int, int, int]]:
    """Each flat range of tensors padded to a multiple of N and cut N ways (zero1.cut_into_pieces,
    zero3_units.Unit): per rank, (elements held including padding, elements owned, pieces owned)."""
    held, owned, pieces = [0] * world_size, [0] * world_size, [0] * world_size
    for sizes in ranges:
        shard = -(-sum(sizes) // world_size)
        begin = 0
        for n in sizes:
            for r in range(world_size):
                lo, hi = max(begin, r * shard), min(begin + n, (r + 1) * shard)
                owned[r] += max(0, hi - lo)
                pieces[r] += hi > lo
            begin += n
        for r in range(world_size):
            held[r] += shard
    return list(zip(held, owned, pieces))


def predict(
    model: Model, step: str, world_size: int, bucket_cap_mb: float = 25.0, prefetch: bool = True
) -> list[dict]:
    """Bytes per rank of ``step`` at ``world_size``,
    as the trainers record them (after the optimiser step)."""
    whole, tensors = model.psi * BYTES, len(model.named)
    adam = lambda owned, pieces: 2 * BYTES * owned + STEP_COUNT_BYTES * pieces  # noqa: E731
    if step == STEPS[0]:
        return [
            {"params": whole, "grads": whole, "optimizer_state": adam(model.psi, tensors)}
        ] * world_size
    if step == STEPS[1]:
        return [
            {"params": whole, "grads": whole, "optimizer_state": adam(owned, pieces)}
            for _, owned, pieces in cut([model.optimizer_order()], world_size)
        ]
    if step == STEPS[2]:
        return [
            {"params": whole, "grads": BYTES * held, "optimizer_state": adam(owned, pieces)}
            for held, owned, pieces in cut(model.gradient_buckets(bucket_cap_mb), world_size)
        ]
    if step == STEPS[3]:
        # Lp of each unit
        padded = [-(-sum(unit) // world_size) * world_size for unit in model.units]
        in_flight = padded[0] + sum(sorted(padded[1:], reverse=True)[: 2 if prefetch else 1])
        # every rank keeps a piece of every tensor, empty or not, and AdamW counts steps for each
        return [
            {
                "params": BYTES * held,
                "grads": BYTES * held,
                "optimizer_state": adam(owned, tensors),
                "gathered": BYTES * in_flight,
            }
            for held, owned, _ in cut(model.units, world_size)
        ]
    raise ValueError(f"no estimate for {step!r}; steps: {', '.join(STEPS)}")


# ---- The closed forms, with 16-bit parameters (the ZeRO paper's accounting) ----------------------

# None: FullyShardedDP's default
PARAM_DTYPES = {"float32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
STAGES = ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3")  # stage 0 (DDP-equivalent: nothing sharded) to 3
# the ZeRO paper's Figure 1: 7.5B parameters, 64 devices, K = 12
PAPER_PSI, PAPER_N = 7_500_000_000, 64
PAPER_GB = (120.0, 31.4, 16.6, 1.9)  # its printed numbers (GB = 10^9 bytes), stages 0-3


def bytes_per_parameter(
    stage: int, param_dtype: str = "float32", reduce_dtype: str | None = None
) -> tuple:
    """(parameters, gradients, optimiser state) in bytes per parameter,
    and which of them are divided by N.

    float32 (steps 0-7 today): 4 + 4 + 8 (two AdamW moments; the parameters are the weights
    stepped). 16-bit ``param_dtype``: 2-byte parameters for compute and communication, K = 12 bytes
    of fp32 state (the master weights + two moments). The gradients the optimiser reads are kept in
    ``reduce_dtype``: 16 bits when None (the paper's 2 + 2 + 12), or 4 bytes with ``"float32"``, as
    FSDP2's ``MixedPrecisionPolicy(reduce_dtype=float32)`` and step 7's ``param_dtype`` keep them
    (the reduced fp32 gradient applied to the fp32 master, never rounded to 16 bits). ZeRO-3 held
    that way keeps no 16-bit shard at all: its parameter shard *is* the fp32 master (4), cast to 16
    bits only while gathered, so its K is the two moments (8): 4 + 4 + 8, the same 16Ψ/N as the
    paper's 2 + 2 + 12."""
    if param_dtype not in PARAM_DTYPES:
        raise ValueError(f"param_dtype {param_dtype!r}: one of {', '.join(PARAM_DTYPES)}")
    sharded = (stage >= 3, stage >= 2, stage >= 1)
    if param_dtype == "float32":
        return (4, 4, 8), sharded
    grad = (
        2
        if reduce_dtype is None
        else torch.empty(0, dtype=getattr(torch, reduce_dtype)).element_size()
    )
    if stage == 3 and reduce_dtype is not None:  # FSDP2 / step 7: the fp32 shard is the master
        return (4, grad, 8), sharded
    return (2, grad, 12), sharded


def state_bytes(
    stage: int,
    psi: int,
    world_size: int,
    param_dtype: str = "float32",
    reduce_dtype: str | None = None,
) -> dict:
    """Bytes per rank of ZeRO ``stage`` (0: DDP) for Ψ parameters on N ranks, the closed form with
    the padding included: a sharded kind holds ceil(Ψ/N) elements (the steps pad each flat range to
    a multiple of N; over several ranges, ``predict`` counts the layouts exactly). AdamW's step
    counts left out."""
    per_param, sharded = bytes_per_parameter(stage, param_dtype, reduce_dtype)
    return {
        kind: b * (-(-psi // world_size) if cut else psi)
        for kind, b, cut in zip(KINDS, per_param, sharded)
    }


def formula(stage: int, param_dtype: str = "float32", reduce_dtype: str | None = None) -> str:
    """The closed form as written: "2Ψ + 2Ψ + 12Ψ/N"."""
    per_param, sharded = bytes_per_parameter(stage, param_dtype, reduce_dtype)
    return " + ".join(f"{b}Ψ{'/N' if cut else ''}" for b, cut in zip(per_param, sharded))


def reduction_limit(
    stage: int, param_dtype: str = "bf16", reduce_dtype: str | None = None
) -> float:
    """How many times less than DDP a rank holds as N grows without bound:
    16Ψ / (the unsharded terms)."""
    per_param, sharded = bytes_per_parameter(stage, param_dtype, reduce_dtype)
    kept = sum(b for b, cut in zip(per_param, sharded) if not cut)
    return (
        float("inf")
        if kept == 0
        else sum(bytes_per_parameter(0, param_dtype, reduce_dtype)[0]) / kept
    )


def zero_paper_report(world_sizes=tuple(2**k for k in range(11))) -> str:
    """The ZeRO paper's Figure 1 from the closed forms,
    the "4x" and "8x" as limits, and N = 1 ... 1024."""
    psi, n = PAPER_PSI, PAPER_N
    lines = [
        f"The ZeRO paper's Figure 1: Ψ = 7.5B parameters, N = {n} devices, mixed "
        "precision (16-bit parameters "
        "and gradients, K = 12 bytes of fp32 master weights and Adam moments per "
        "parameter), GB = 10^9 bytes",
        f"{'stage':<8}{'per rank':<26}{'computed':>12}{'the paper':>11}",
    ]
    for stage in range(4):
        gb = sum(state_bytes(stage, psi, n, "bf16").values()) / 1e9
        lines.append(
            f"{STAGES[stage]:<8}{formula(stage, 'bf16'):<26}{gb:>9.2f} GB{PAPER_GB[stage]:>8.1f} GB"
        )
    lines += [
        "",
        'Where "4x" and "8x" come from: what DDP holds over what a ZeRO rank holds, as N grows',
        "  ZeRO-1: 16Ψ / (2Ψ + 2Ψ + 12Ψ/N) -> 16/4 = 4 (the 16-bit weights and "
        "gradients stay whole)",
        "  ZeRO-2: 16Ψ / (2Ψ + 14Ψ/N)      -> 16/2 = 8 (the 16-bit weights stay whole)",
        "  ZeRO-3: 16Ψ / (16Ψ/N)            =  N (nothing stays whole)",
        f"{'N':>6}"
        + "".join(f"{name + ' GB':>12}" for name in STAGES)
        + f"{'DDP/ZeRO-1':>12}{'DDP/ZeRO-2':>12}",
    ]
    for world_size in world_sizes:
        totals = [sum(state_bytes(stage, psi, world_size, "bf16").values()) for stage in range(4)]
        lines.append(
            f"{world_size:>6}"
            + "".join(f"{t / 1e9:>12.2f}" for t in totals)
            + f"{totals[0] / totals[1]:>12.2f}{totals[0] / totals[2]:>12.2f}"
        )
    lines.append(f"{'limit':>6}{'':>48}{reduction_limit(1):>12.2f}{reduction_limit(2):>12.2f}")
    return "\n".join(lines)


def closed_forms_report(psi: int, param_dtype: str, world_sizes) -> str:
    """Ψ of the configured model through each stage's closed form, as the paper counts it and as
    FSDP2's ``MixedPrecisionPolicy(reduce_dtype=float32)`` (step 7's ``param_dtype``) holds it."""
    ways = [
        (None, "the paper (16-bit gradients)"),
        ("float32", "gradients reduced and kept in float32, as FSDP2"),
    ]
    if param_dtype == "float32":
        ways = [(None, "float32 (steps 0-7 today)")]
    lines = [
        f"Closed forms, Ψ = {psi:,}, param_dtype {param_dtype}: MiB per rank "
        "(parameters + gradients + "
        "optimizer state, padding included)"
    ]
    for reduce_dtype, title in ways:
        lines.append(
            f"  {title}: "
            + "; ".join(
                f"{STAGES[stage]} {formula(stage, param_dtype, reduce_dtype)}" for stage in range(4)
            )
        )
        lines.append(f"  {'N':>6}" + "".join(f"{name:>11}" for name in STAGES))
        for world_size in world_sizes:
            stages = [state_bytes(s, psi, world_size, param_dtype, reduce_dtype) for s in range(4)]
            lines.append(
                f"  {world_size:>6}" + "".join(f"{mib(sum(b.values()), 3):>11}" for b in stages)
            )
    return "\n".join(lines)


def vocabulary_size(tokenizer: str) -> int:
    from data import load_tokenizer  # the trainers' own loader (only when estimating)

    return load_tokenizer(tokenizer).get_vocab_size()  # what data.load_corpus gives the trainers


def estimate(
    config: dict, world_sizes: list[int], bucket_cap_mb: float = 25.0, prefetch: bool = True
) -> dict:
    model = Model(config, vocabulary_size(config["tokenizer"]))
    activations = model.activation_bytes(config["micro_batch_size"])
    rows = []
    for step in STEPS:
        for world_size in world_sizes:
            ranks = predict(model, step, world_size, bucket_cap_mb, prefetch)
            totals = [sum(r.values()) + activations for r in ranks]
            rows.append(
                {
                    "step": step,
                    "world_size": world_size,
                    "ranks": ranks,
                    "activations": activations,
                    "total": max(totals),
                    "rank": totals.index(max(totals)),
                }
            )
    return {
        "psi": model.psi,
        "tensors": len(model.named),
        "vocab_size": model.vocab_size,
        "units": [sum(unit) for unit in model.units],
        "rows": rows,
    }


def mib(n: int, digits: int = 1) -> str:
    return f"{n / 2**20:,.{digits}f}"


def report(config: dict, result: dict, budget_mb: float | None, prefetch: bool) -> str:
    psi, units = result["psi"], result["units"]
    lines = [
        f"GPT-2 n_layer {config['n_layer']}, n_embd {config['n_embd']}, n_head "
        f"{config['n_head']}, seq_len "
        f"{config['seq_len']}, vocabulary {result['vocab_size']:,} "
        f"({Path(config['tokenizer']).name}): "
        f"Ψ = {psi:,} parameters in {result['tensors']} tensors",
        f"(root {units[0]:,}, each block {units[1] if len(units) > 1 else 0:,}); "
        "float32, AdamW; full training "
        f"state 16Ψ = {mib(16 * psi)} MiB; micro-batch {config['micro_batch_size']} x "
        f"{config['seq_len']} tokens",
        "",
        "MiB per rank, the rank holding most (ZeRO ranks differ by padding; --json "
        "has every rank). "
        f"gathered: step 7's units in flight (root + {'two blocks' if prefetch else 'one block'})",
    ]
    header = (
        f"{'step':<17}{'ranks':>5}{'params':>10}{'grads':>10}{'optimizer':>11}{'gathered':>10}"
        f"{'activations':>13}{'total':>10}"
    )
    if budget_mb is not None:
        header += f"   within --budget-mb {budget_mb:g}"
    lines.append(header)
    for row in result["rows"]:
        rank = row["ranks"][row["rank"]]
        line = (
            f"{row['step']:<17}{row['world_size']:>5}{mib(rank['params']):>10}"
            f"{mib(rank['grads']):>10}"
            f"{mib(rank['optimizer_state']):>11}"
            f"{mib(rank['gathered']) if 'gathered' in rank else '-':>10}"
            f"{mib(row['activations']):>13}{mib(row['total']):>10}"
        )
        if budget_mb is not None:
            left = budget_mb - row["total"] / 2**20
            line += (
                f"   {'fits' if left >= 0 else 'DOES NOT FIT'}: {abs(left):,.0f} MiB "
                f"{'left' if left >= 0 else 'over'}"
            )
        lines.append(line)
    if budget_mb is not None:
        lines.append(
            "Not counted, so leave headroom: communication buffers (DDP's buckets: "
            "4Ψ), gloo's copies of "
            "a unit in flight, the unit's full gradient in step 7's backward, the "
            "corpus, the allocator's "
            "slack (see --help)."
        )
    return "\n".join(lines)


def parse_world_sizes(text: str) -> list[int]:
    """``--world-sizes``: "1,2,4" -> [1, 2, 4]; anything else is a UserError (one line, exit 2)."""
    try:
        world_sizes = [int(w) for w in text.split(",") if w.strip()]
    except ValueError:
        raise UserError(f"--world-sizes takes integers separated by commas, got {text!r}") from None
    if not world_sizes or min(world_sizes) < 1:
        raise UserError(f"--world-sizes needs world sizes of at least 1, got {text!r}")
    return world_sizes


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The docstring as written, the flags with their defaults."""


def main() -> int:
    parser = build_parser("estimate")
    parser.prog = "compare/estimate.py"
    parser.description = __doc__
    parser.formatter_class = HelpFormatter
    for action in parser._actions:
        if action.dest not in USED_FLAGS and action.option_strings and action.dest != "help":
            # a trainer flag with no bearing on memory: accepted, not advertised
            action.help = argparse.SUPPRESS
    flags = parser.add_argument_group("estimate")
    flags.add_argument("--world-sizes", default="1,2,3,4", help="comma-separated world sizes")
    flags.add_argument(
        "--budget-mb",
        type=float,
        default=None,
        help="per-rank budget in MiB (the trainers' --max-memory-mb): mark what fits",
    )
    flags.add_argument(
        "--bucket-cap-mb", type=float, default=25.0, help="step 6's gradient bucket cap"
    )
    flags.add_argument("--no-prefetch", action="store_true", help="step 7 run with --no-prefetch")
    flags.add_argument("--json", type=Path, help="also write every rank's numbers here")
    # the trainers' flag, where they lack it
    if not any(action.dest == "param_dtype" for action in parser._actions):
        flags.add_argument(
            "--param-dtype",
            choices=tuple(PARAM_DTYPES),
            default="float32",
            help="16-bit parameters: also print the closed forms for N = 1 ... 1024, as the ZeRO "
            "paper counts them and as FSDP2 (reduce_dtype float32) holds them",
        )
    flags.add_argument(
        "--zero-paper",
        action="store_true",
        help="print the ZeRO paper's Figure 1 (7.5B parameters, N = 64) from the closed forms, and "
        "where its 4x and 8x come from; nothing else",
    )
    config = parse_config(parser)
    if config["zero_paper"]:
        print(zero_paper_report())
        return 0
    world_sizes = parse_world_sizes(config["world_sizes"])
    if config["budget_mb"] is not None and config["budget_mb"] <= 0:
        raise UserError(f"--budget-mb must be positive, got {config['budget_mb']:g}")
    if config["json"]:
        check_writable_file(config["json"], f"--json {config['json']}")
    result = estimate(config, world_sizes, config["bucket_cap_mb"], not config["no_prefetch"])
    print(report(config, result, config["budget_mb"], not config["no_prefetch"]))
    if (config.get("param_dtype") or "float32") != "float32":
        print()
        print(closed_forms_report(result["psi"], config["param_dtype"], [2**k for k in range(11)]))
    if config["json"]:
        config["json"].write_text(
            json.dumps({"config": config, **result}, indent=1, default=str) + "\n"
        )
        print(f"numbers: {config['json']}")
    return 0


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main))
