"""Peak tensor memory of a ZeRO-3 (step 7) training step, per rank: measured, and predicted.

    python compare/peak_memory.py   # the default model at N = 1, 2 and 4
    # activations dominate: with and without
    python compare/peak_memory.py --world-sizes 1,2 --n-layer 8 --seq-len 256 \\
        --micro-batch-size 4 --compare-checkpointing --timed-steps 10
    # FullyShardedDP(param_dtype=torch.bfloat16)
    python compare/peak_memory.py --param-dtype bf16 --world-sizes 1,2,3,4 --timed-steps 0

For each world size N, N processes (gloo on loopback, one CPU thread each, started by
torch.multiprocessing) build step 7's model as its train.py does (``shard_gpt2``): GPT-2 on the meta
device (with --activation-checkpointing, each block recomputed in backward), ``FullyShardedDP`` over
the blocks, a plain AdamW over the pieces. Each step is train.py's own ``train_step`` (--grad-accum
micro-batches of --micro-batch-size x --seq-len, the last one synchronised, then
``finish_gradient_synchronization``, clipping, AdamW), which names its phases for the profiler, on
random tokens: memory depends on shapes, not on the text, and no corpus has to be loaded.

Measured, with torch.profiler's memory records (``profile_memory=True``): every allocation and free
that torch's CPU allocator reports on the rank's main thread, replayed in time order from before the
model is built, through one warm-up step (it allocates AdamW's moments and the gradient shards) and
--profiled-steps steps:

    state    bytes live through a whole step: parameter shards, gradient shards, AdamW's state
    peak     the most bytes live at once during a step; where (forward, backward, optimizer); and
             what is live then besides the state, by the op or autograd node that allocated it

Predicted, with ``compare/estimate.py``'s layouts (padding and AdamW's step counts included):

    state        4Ψ/N + 4Ψ/N + 8Ψ/N (with --param-dtype bf16 too: the fp32 shards are the master
                 weights, the gradients are reduced and kept in float32, as FSDP2's; 16-bit copies
                 exist only while gathered)
    gathered     the units in flight (2 bytes an element with --param-dtype): the root (kept from
                 forward to the end of backward) and two blocks
                 (one computing, the next prefetched; one with --no-prefetch)
    activations  what autograd saves in one micro-batch; with --activation-checkpointing, the root's
                 saved tensors, every block's inputs and one block's own
                 (recomputed in its backward)

The breakdown names what the prediction leaves out. On GPT-2 here the peak comes as the last
micro-batch's backward starts: the state, the root (no block is gathered then), the activations, the
full gradients the earlier micro-batches accumulated (4Ψ, not 4Ψ/N: under ``no_sync`` they stay
whole) and the loss's gradients with respect to the log-probabilities and the logits (2 x B x T x
vocabulary float32). The records miss what gloo's worker threads allocate and free (the profiler
records the thread it runs on): a tensor one of them frees is taken off when its address is
allocated again, and a collective's own copy (gloo's reduce-scatter clones its input) is never
counted as state.

Step time: the median, over --timed-steps steps run after the profiled ones without the profiler,
of the slowest rank's time (the ranks start each timed step together); cpu time: the same with the
rank's CPU time (``time.process_time``, gloo's threads included), which other work on the machine
disturbs far less than the wall clock.
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STEP7 = REPO / "step7_zero3"
# Step 7's folder first: its own copies of config.py,
# model.py, training.py... are what gets measured.
sys.path[:0] = [str(STEP7), str(REPO / "compare")]
import torch  # noqa: E402

import distributed  # noqa: E402
import estimate  # noqa: E402
from config import UserError, build_parser, check_writable_file, exit_on_user_error, parse_config  # noqa: E402
from launch import spawn_ranks  # noqa: E402

# The flags that change what is measured; the trainer's others are accepted (a train.py command line
# can be pasted) and hidden.
USED_FLAGS = estimate.USED_FLAGS | {
    "grad_accum",
    "amp",
    "seed",
    "grad_clip",
    "reduce_dtype",
    "timeout_s",
}
PHASES = ("forward", "backward", "optimizer")
NODE = "autograd::engine::evaluate_function: "


# ---- Prediction ----------------------------------------------------------------------------------


def predict(config: dict, vocab_size: int, world_size: int, checkpointing: bool) -> list[dict]:
    """Per rank: ``state`` (16Ψ/N as laid out),
    ``gathered`` and ``activations``, in bytes; and Ψ."""
    # 16 bits: gathered and computed in it
    dtype = estimate.PARAM_DTYPES[config.get("param_dtype") or "float32"]
    model = estimate.Model(config, vocab_size, dtype)
    activations = model.activation_bytes(config["micro_batch_size"], checkpointing)
    ranks = estimate.predict(
        model, estimate.STEPS[3], world_size, prefetch=not config["no_prefetch"]
    )
    # the fp32 shards stay the state either way
    gathered_bytes = 2 if dtype is not None else estimate.BYTES
    return [
        {
            "state": r["params"] + r["grads"] + r["optimizer_state"],
            "gathered": r["gathered"] // estimate.BYTES * gathered_bytes,
            "activations": activations,
            "psi": model.psi,
        }
        for r in ranks
    ]


# ---- Replaying the profiler's memory records -----------------------------------------------------


def label(ranges: tuple) -> str:
    """What made an allocation, from the ranges around it (innermost first): the autograd node in
    backward, the outermost op otherwise; none at all is a storage resized from Python: a unit
    being gathered."""
    node = next((r[len(NODE) :] for r in ranges if r.startswith(NODE)), None)
    ops = [r for r in ranges if r.startswith(("aten::", "c10d::"))]
    if not ops:
        return "gathered unit (storage resize)"
    return node or ops[-1]


def collective_copy(ranges: tuple) -> bool:
    """Whether an allocation is a collective's own copy:
    gloo's reduce-scatter clones its input (measured:
    ``aten::clone`` inside ``c10d::_reduce_scatter_base_``, the input's size). The copy goes when
    the collective's work object does, freed by whichever thread lets go of it last: the rank's,
    after its ``wait()``, or now and then gloo's worker thread, whose frees the records miss. Such a
    copy still "live" from a step's start to its end is one of those: it is not state, and the
    replay says how many bytes of them it set apart (``collective_copies``)."""
    return any(r.startswith("c10d::") for r in ranges)


def phase_of(ranges: tuple) -> str:
    """The phase of the training step (``PHASES``) an allocation was made in; "-" outside them."""
    return next((r for r in ranges if r in PHASES), "-")


def allocations(prof) -> list[tuple]:
    """Every allocation and free recorded, in time order: (ns, address, bytes (negative: a free),
    ranges around it, innermost first: ops, autograd nodes, ``record_function`` labels)."""
    from torch._C._profiler import _EventType

    found = []

    def walk(node, ranges):
        if node.tag == _EventType.Allocation:
            fields = node.extra_fields
            found.append((node.start_time_ns, fields.ptr, fields.alloc_size, ranges))
            return
        for child in node.children:
            walk(child, (node.name, *ranges))

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root, ())
    return sorted(found, key=lambda a: a[0])


def replay(events: list[tuple]):
    """Yield, after each event: (its index, bytes live, the live blocks {address: (bytes, index of
    the allocation)}, whether a block was freed unseen).

    A block freed by another thread leaves no record; an allocation at its address shows that it is
    gone by then, and it is taken off there."""
    live, total = {}, 0
    for i, (_, address, nbytes, _) in enumerate(events):
        unseen = False
        if nbytes > 0:
            if address in live:
                total -= live.pop(address)[0]
                unseen = True
            live[address] = (nbytes, i)
            total += nbytes
        elif address in live:  # else: a block from before the profiler started
            total -= live.pop(address)[0]
        yield i, total, live, unseen


def step_peaks(events: list[tuple], steps: int) -> tuple[list[dict], int]:
    """From ``allocations``' events, per profiled step (ranges "step 0", "step 1", ...):

    ``state``: bytes of the blocks live from its start to its end, collectives' copies apart
    (``state_parts``: by what allocated them);
    ``peak``: the most bytes live during it,
    the ``phase`` it falls in and what made the allocation that reached it (``made_by``);
    ``beyond_state``: what is live at the peak besides the state, by phase and ``label`` ("before
    the step": a block from an earlier step, freed unseen or freed later). Also: how many blocks
    were freed unseen, in all."""
    step_of = lambda ranges: next((int(r[5:]) for r in ranges if r.startswith("step ")), None)  # noqa: E731
    results = [{"peak": -1} for _ in range(steps)]
    unseen = 0
    for i, total, _, freed_unseen in replay(events):
        unseen += freed_unseen
        if (step := step_of(events[i][3])) is not None:
            r = results[step]
            r.setdefault("first", i)
            r["last"] = i
            if total > r["peak"]:
                r["peak"], r["at"] = total, i
    # Again, to see the live blocks at each step's start
    # (after the event before its first), peak and end.
    before_start = {r["first"] - 1: r for r in results}
    at_peak, at_end = {r["at"]: r for r in results}, {r["last"]: r for r in results}
    for i, _, live, _ in replay(events):
        if i in before_start:
            before_start[i]["live at start"] = dict(live)
        if i in at_peak:
            r = at_peak[i]
            r["phase"], r["made_by"], r["live at peak"] = (
                phase_of(events[i][3]),
                label(events[i][3]),
                dict(live),
            )
        if i in at_end:
            r = at_end[i]
            start = r.pop("live at start", {})
            state = {
                address: block for address, block in start.items() if live.get(address) == block
            }
            copies = {address for address, (_, j) in state.items() if collective_copy(events[j][3])}
            # see collective_copy
            r["collective_copies"] = sum(state[address][0] for address in copies)
            state = {address: block for address, block in state.items() if address not in copies}
            r["state"] = sum(nbytes for nbytes, _ in state.values())
            r["state_parts"] = parts_by_label(state.values(), events)
            beyond = [
                (nbytes, j)
                for address, (nbytes, j) in r.pop("live at peak").items()
                if address not in state
            ]
            r["beyond_state"] = parts_by_label(beyond, events, before=r["first"])
            del r["first"], r["last"], r["at"]
    return results, unseen


def parts_by_label(blocks, events: list[tuple], before: int = 0) -> dict:
    """Bytes of ``blocks`` ((bytes, index of the allocation) pairs) by the phase and op that
    allocated them, largest first; a block allocated before event ``before`` counts as "before
    the step"."""
    parts = {}
    for nbytes, j in blocks:
        key = (
            f"{phase_of(events[j][3])}: {label(events[j][3])}" if j >= before else "before the step"
        )
        parts[key] = parts.get(key, 0) + nbytes
    return dict(sorted(parts.items(), key=lambda kv: -kv[1]))


# ---- Each rank's process -------------------------------------------------------------------------


def checkpointing_modes(config: dict) -> list[bool]:
    return (
        [False, True] if config["compare_checkpointing"] else [config["activation_checkpointing"]]
    )


def measure_rank(rank: int, world_size: int, port: int, config: dict, vocab_size: int) -> dict:
    """This rank's measurements, per checkpointing mode: {mode: {"steps", "unseen", "gathered_peak",
    "step_times"}}. Each mode is profiled in a profiler session of its own (blocks allocated before
    a session are not in its records: the other mode's model does not count), then the timed steps
    of the modes alternate, so that a change in the machine's load hits them alike."""
    from seeding import seed_everything
    from sharded_gradients import ShardedGradScaler
    from train import train_step  # step 7's train.py: importing it runs nothing
    from training import make_grad_scaler, make_optimizer, param_dtype
    from zero3_setup import shard_gpt2

    # one CPU thread per process, as in every trainer
    seed_everything(config["seed"], config["deterministic"])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    distributed.join(
        distributed.World(rank, world_size, rank, torch.device("cpu"), "gloo"), config["timeout_s"]
    )
    generator = torch.Generator().manual_seed(config["seed"] + rank)
    shape = (config["grad_accum"], config["micro_batch_size"], config["seq_len"])
    inputs, targets = (torch.randint(0, vocab_size, shape, generator=generator) for _ in range(2))
    micro_batches = list(zip(inputs, targets))  # views: nothing allocated during the steps
    device = torch.device("cpu")

    trainers, results = {}, {}
    for checkpointing in checkpointing_modes(config):
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
        ) as prof:
            # as step 7's train.py builds them
            ddp_model, _ = shard_gpt2(
                {**config, "activation_checkpointing": checkpointing},
                vocab_size,
                device,
                param_dtype(config),
            )
            trainer = (
                ddp_model,
                make_optimizer(ddp_model.named_parameters(), config),
                make_grad_scaler(config, device, ShardedGradScaler),
            )
            # warm-up: AdamW's state, the gradient shards
            train_step(*trainer, micro_batches, config, device)
            gathered_peak = 0
            for i in range(config["profiled_steps"]):
                with torch.profiler.record_function(f"step {i}"):
                    # the tensors freed at once
                    memory = train_step(*trainer, micro_batches, config, device)[2]
                gathered_peak = max(gathered_peak, memory["gathered_peak"])
        steps, unseen = step_peaks(allocations(prof), config["profiled_steps"])
        del prof
        trainers[checkpointing] = trainer
        results[checkpointing] = {
            "steps": steps,
            "unseen": unseen,
            "gathered_peak": gathered_peak,
            "step_times": [],
            "step_cpu_times": [],
        }
    for _ in range(config["timed_steps"]):
        for checkpointing, trainer in trainers.items():
            torch.distributed.barrier()  # together: the slowest rank's time is the step's
            started, cpu_started = time.perf_counter(), time.process_time()
            train_step(*trainer, micro_batches, config, device)
            results[checkpointing]["step_times"].append(time.perf_counter() - started)
            results[checkpointing]["step_cpu_times"].append(time.process_time() - cpu_started)
    distributed.shutdown()
    return results


# ---- Report --------------------------------------------------------------------------------------


def run(config: dict, world_sizes: list[int]) -> dict:
    """Measure and predict at each world size (and checkpointing mode); one row per rank, in bytes
    (step times in seconds)."""
    vocab_size = estimate.vocabulary_size(config["tokenizer"])
    rows = []
    for world_size in world_sizes:
        measured = spawn_ranks(measure_rank, world_size, config, vocab_size)
        for checkpointing in checkpointing_modes(config):
            times, cpu_times = (
                [
                    max(measured[r][checkpointing][kind][i] for r in measured)
                    for i in range(config["timed_steps"])
                ]
                for kind in ("step_times", "step_cpu_times")
            )
            for rank, predicted in enumerate(
                predict(config, vocab_size, world_size, checkpointing)
            ):
                m = measured[rank][checkpointing]
                top = max(m["steps"], key=lambda s: s["peak"])
                rows.append(
                    {
                        "world_size": world_size,
                        "activation_checkpointing": checkpointing,
                        "rank": rank,
                        **predicted,
                        "predicted": predicted["state"]
                        + predicted["gathered"]
                        + predicted["activations"],
                        "state_measured": [s["state"] for s in m["steps"]],
                        "state_parts": max(m["steps"], key=lambda s: s["state"])["state_parts"],
                        "collective_copies": [s["collective_copies"] for s in m["steps"]],
                        "peaks": [s["peak"] for s in m["steps"]],
                        "peak": top["peak"],
                        "peak_phase": top["phase"],
                        "peak_made_by": top["made_by"],
                        "beyond_state": top["beyond_state"],
                        "unseen_frees": m["unseen"],
                        "gathered_peak": m["gathered_peak"],
                        "step_time_s": statistics.median(times) if times else None,
                        "step_times_s": times,
                        "step_cpu_s": statistics.median(cpu_times) if cpu_times else None,
                    }
                )
    return {"config": config, "vocab_size": vocab_size, "rows": rows}


def mib(n: float) -> str:
    return f"{n / 2**20:,.2f}"


def report(result: dict, top: int = 6) -> str:
    config, rows = result["config"], result["rows"]
    lines = [
        f"step 7, GPT-2 n_layer {config['n_layer']}, n_embd {config['n_embd']}, vocabulary "
        f"{result['vocab_size']:,}: Ψ = {rows[0]['psi']:,}; micro-batch "
        f"{config['micro_batch_size']} x "
        f"{config['seq_len']} tokens, accumulation {config['grad_accum']}; "
        f"prefetch {'off' if config['no_prefetch'] else 'on'}",
        "MiB per rank. predicted = state (16Ψ/N) + gathered units + activations. "
        "Measured from the profiler's "
        "memory records: state (live through a whole step), peak (the most live during a step)",
        f"{'N':>2}{'ckpt':>5}{'rank':>5}{'state':>9}{'measured':>10}{'gathered':>10}"
        f"{'activ.':>9}{'predicted':>11}"
        f"{'peak':>9}{'peak/pred':>11}  {'peak in':<10}{'step time':>11}{'cpu time':>11}",
    ]
    for r in rows:
        ms = lambda seconds: f"{seconds * 1e3:,.0f} ms" if seconds is not None else "-"  # noqa: E731
        lines.append(
            f"{r['world_size']:>2}{'on' if r['activation_checkpointing'] else 'off':>5}"
            f"{r['rank']:>5}"
            f"{mib(r['state']):>9}{mib(max(r['state_measured'])):>10}{mib(r['gathered']):>10}"
            f"{mib(r['activations']):>9}{mib(r['predicted']):>11}{mib(r['peak']):>9}"
            f"{r['peak'] / r['predicted']:>11.3f}  {r['peak_phase']:<10}{ms(r['step_time_s']):>11}"
            f"{ms(r['step_cpu_s']):>11}"
        )
    for r in (r for r in rows if r["rank"] == 0):
        parts = list(r["beyond_state"].items())
        shown = ", ".join(f"{name} {mib(n)}" for name, n in parts[:top])
        rest = sum(n for _, n in parts[top:])
        lines.append(
            f"N = {r['world_size']}, checkpointing "
            f"{'on' if r['activation_checkpointing'] else 'off'}, "
            f"rank 0, at its peak ({r['peak_phase']}, {r['peak_made_by']}), live "
            f"besides the state: {shown}"
            f"{f', the rest {mib(rest)}' if rest else ''}"
        )
    return "\n".join(lines)


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The docstring as written, the flags with their defaults."""


def main() -> int:
    parser = build_parser("step7_zero3")
    distributed.add_flags(parser)
    parser.prog, parser.description, parser.formatter_class = (
        "compare/peak_memory.py",
        __doc__,
        HelpFormatter,
    )
    parser.set_defaults(timeout_s=120.0)
    for action in parser._actions:
        if action.dest not in USED_FLAGS and action.option_strings and action.dest != "help":
            # a trainer flag with no bearing here: accepted, not advertised
            action.help = argparse.SUPPRESS
    flags = parser.add_argument_group("peak memory")
    flags.add_argument("--world-sizes", default="1,2,4", help="comma-separated world sizes")
    flags.add_argument("--activation-checkpointing", action="store_true", help="as step 7's flag")
    flags.add_argument("--no-prefetch", action="store_true", help="as step 7's flag")
    # the trainers' flag, where they lack it
    if not any(action.dest == "param_dtype" for action in parser._actions):
        flags.add_argument(
            "--param-dtype",
            choices=tuple(estimate.PARAM_DTYPES),
            default="float32",
            help="FullyShardedDP's param_dtype: gather and compute in 16 bits, fp32 master shards",
        )
    flags.add_argument(
        "--compare-checkpointing",
        action="store_true",
        help="measure with and without activation checkpointing, in the same processes, "
        "timed steps "
        "alternating",
    )
    flags.add_argument(
        "--profiled-steps", type=int, default=2, help="steps replayed from the profiler's records"
    )
    flags.add_argument(
        "--timed-steps", type=int, default=5, help="steps timed after those, without the profiler"
    )
    flags.add_argument("--json", type=Path, help="also write every rank's numbers here")
    config = parse_config(parser)
    world_sizes = estimate.parse_world_sizes(config["world_sizes"])
    if config["profiled_steps"] < 1 or config["timed_steps"] < 0:
        raise UserError(
            f"--profiled-steps must be at least 1 and --timed-steps at least 0, got "
            f"{config['profiled_steps']} and {config['timed_steps']}"
        )
    if config["timeout_s"] <= 0:
        raise UserError(f"--timeout-s must be positive, got {config['timeout_s']:g}")
    # written at the end, after minutes of measuring: refused now if it cannot be
    if config["json"]:
        check_writable_file(config["json"], f"--json {config['json']}")
    result = run(config, world_sizes)
    print(report(result))
    if config["json"]:
        config["json"].write_text(json.dumps(result, indent=1, default=str) + "\n")
        print(f"numbers: {config['json']}")
    return 0


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main))
