"""Step 11's ring attention beside PyTorch's own context parallelism (``context_parallel``), on the
same queries, keys and values: each against attention on the whole sequence in float32, forward and
backward, and the time and CUDA memory of one forward and backward per rank.

    # 2 ranks: one GPU each, or sharing one
    python compare/cp_reference.py
    # the ring alone (tests/test_gpu_check.py)
    python compare/cp_reference.py --device cpu --seq-len 256 --heads 2

PyTorch's ``context_parallel`` splits the buffers it is given with the same head-tail layout as step
11's zig-zag (rank r keeps chunks r and 2C-1-r) and, inside its context, runs
scaled_dot_product_attention as a ring of flash or memory-efficient kernels, passing K/V shards by
all-gather (its default). Those kernels are CUDA's, so on the CPU only the ring runs. The comparison
is with attention computed whole, not bitwise: the two rings merge their partial softmaxes in
different orders and kernels (step 11's bitwise proof is against its blockwise reference in
``tests/test_context_parallel.py``). With one GPU the ranks share it over gloo; with more, nccl, one
GPU a rank.
"""

import argparse
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "step11_context_parallel"))
from config import OneLineParser, UserError, exit_on_user_error  # noqa: E402
from launch import spawn_ranks  # noqa: E402

NAMES = ("output", "dq", "dk", "dv")


def relative_errors(got: list, exact: list) -> dict:
    """max |got - exact| / max |exact| of each tensor:
    a bf16 result is about 2^-8 off, float32's about 2^-23."""
    return {
        name: ((g.float() - e.float()).abs().max() / e.float().abs().max()).item()
        for name, g, e in zip(NAMES, got, exact)
    }


def forward_backward(attention, q, k, v, dout) -> list:
    """[output, dq, dk, dv] of ``attention(q, k,
    v)`` with ``dout`` as the output's gradient, on fresh leaves."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = attention(*leaves)
    out.backward(dout)
    return [out.detach(), *(t.grad for t in leaves)]


def causal_sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def timed(fn, repeats: int, device: torch.device) -> tuple[float, int]:
    """(median ms of ``fn``, the CUDA peak it reached above
    what was allocated before, bytes; 0 on the CPU)."""
    cuda = device.type == "cuda"
    times = []
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    peak = torch.cuda.max_memory_allocated(device) - before if cuda else 0
    return statistics.median(times), peak


def compare(rank: int, world_size: int, port: int, config: dict) -> dict:
    torch.set_num_threads(1)
    device = (
        torch.device(config["device"], rank % max(torch.cuda.device_count(), 1))
        if config["device"] == "cuda"
        else torch.device("cpu")
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = (
        "nccl" if device.type == "cuda" and torch.cuda.device_count() >= world_size else "gloo"
    )
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(
        backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=120)
    )
    from context_parallel import shard_positions
    from ring_attention import RingAttention

    b, h, s, d = config["batch"], config["heads"], config["seq_len"], config["head_dim"]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator().manual_seed(0)  # every rank: the same whole tensors
    q, k, v, dout = (torch.randn(b, h, s, d, generator=g).to(device, dtype) for _ in range(4))

    positions = shard_positions(s, rank, world_size, "zigzag").to(device)
    # the whole sequence, float32
    whole = forward_backward(causal_sdpa, *(t.float() for t in (q, k, v, dout)))
    exact = [t.index_select(2, positions) for t in whole]
    del whole
    # this rank's positions, as step 11 keeps them
    local = [t.index_select(2, positions) for t in (q, k, v, dout)]

    def ours():
        return forward_backward(lambda *qkv: RingAttention.apply(*qkv, None, "zigzag"), *local)

    result = {"backend": backend, "ours": relative_errors(ours(), exact)}
    result["ours_ms"], result["ours_peak"] = timed(ours, config["repeats"], device)

    if device.type != "cuda":
        result["theirs"] = (
            "not run: PyTorch's context_parallel needs flash or efficient SDPA, CUDA's kernels"
        )
    else:
        try:
            result.update(theirs(q, k, v, dout, exact, world_size, config["repeats"], device))
        except Exception as error:  # noqa: BLE001 (the report says why it could not run)
            result["theirs"] = (
                f"could not run: {type(error).__name__}: {str(error).splitlines()[0][:200]}"
            )
    dist.barrier()
    dist.destroy_process_group()
    return result


def theirs(q, k, v, dout, exact, world_size: int, repeats: int, device) -> dict:
    """PyTorch's context_parallel on the same tensors:
    SDPA inside the context on the buffers it shards."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = DeviceMesh(device.type, list(range(world_size)))
    buffers = [t.clone() for t in (q, k, v, dout)]
    with context_parallel(
        mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2, 2], no_restore_buffers=set(buffers)
    ):
        cq, ck, cv, cdout = buffers  # now this rank's chunks, laid out as step 11's zig-zag

        def run():
            return forward_backward(causal_sdpa, cq, ck, cv, cdout)  # SDPA here is PyTorch's ring

        errors = relative_errors(run(), exact)
        ms, peak = timed(run, repeats, device)
    return {"theirs": errors, "theirs_ms": ms, "theirs_peak": peak}


def report(results: dict, config: dict) -> tuple[str, bool]:
    """A markdown table, and whether the ring is as close to whole attention as the bound allows on
    every rank, and, where PyTorch's ring ran, within twice its error (or bf16's 2^-8 where
    PyTorch's is smaller still)."""
    first = results[0]
    # bf16 inputs on a GPU; float32 on the CPU
    bound = 2**-5 if config["device"] == "cuda" else 1e-5
    lines = [
        f"C = {len(results)} ranks ({first['backend']}), batch {config['batch']}, "
        f"{config['heads']} heads of "
        f"{config['head_dim']}, {config['seq_len']:,} tokens, causal, "
        f"{'bf16' if config['device'] == 'cuda' else 'float32'}; max |error| / max "
        "|whole attention's| over "
        "the ranks, forward and backward; ms and CUDA peak per rank, medians of "
        f"{config['repeats']} forward + backward",
        "",
        "| | output | dq | dk | dv | ms | peak MB |",
        "|---|---|---|---|---|---|---|",
    ]
    ok = True
    for who, label in (("ours", "step 11's ring"), ("theirs", "PyTorch's context_parallel")):
        if isinstance(first[who], str):
            lines.append(f"| {label} | {first[who]} | | | | | |")
            continue
        worst = {name: max(r[who][name] for r in results.values()) for name in NAMES}
        ms = max(r[f"{who}_ms"] for r in results.values())
        peak = max(r[f"{who}_peak"] for r in results.values()) / 2**20
        lines.append(
            f"| {label} | "
            + " | ".join(f"{worst[n]:.2e}" for n in NAMES)
            + f" | {ms:.2f} | {peak:,.1f} |"
        )
        if who == "ours":
            ok &= all(e < bound for e in worst.values())
        elif not isinstance(first["theirs"], str):
            ok &= all(
                results[r]["ours"][n] <= max(2 * results[r]["theirs"][n], 2**-8)
                for r in results
                for n in NAMES
            )
    lines.append("")
    lines.append(
        f"Ours within {bound:.0e} of whole attention on every rank"
        + (
            ", and within twice PyTorch's ring's error"
            if not isinstance(first["theirs"], str)
            else ""
        )
        + f": {'yes' if ok else 'NO'}"
    )
    return "\n".join(lines), ok


def main() -> int:
    parser = OneLineParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--cp", type=int, default=2, help="ranks of the ring")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=5)
    config = vars(parser.parse_args())
    if config["device"] == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda asked for, but torch sees no CUDA GPU; use --device cpu")
    from context_parallel import check_context_parallel

    # step 11's own check: 2 x cp chunks of the sequence
    check_context_parallel(config, config["cp"])
    text, ok = report(spawn_ranks(compare, config["cp"], config, timeout=600), config)
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main))
