"""Start a step's trainer the way a learner would, and turn its failure into one line; or spawn the
ranks of a measuring tool (``spawn_ranks``)."""

import queue as queues
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "common"))  # config.py, as every step has it
import torch.multiprocessing as mp  # noqa: E402

from config import UserError  # noqa: E402


def trainer_command(step: str, nproc: int, args: list[str]) -> list[str]:
    """``python stepK/train.py`` for nproc=0 (one process,
    no torchrun), else torchrun with nproc ranks."""
    script = str(REPO_ROOT / step / "train.py")
    if nproc == 0:
        return [sys.executable, script, *args]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        script,
        *args,
    ]


def node_command(
    step: str, nnodes: int, nproc_per_node: int, endpoint: str, run_id: str, args: list[str]
) -> list[str]:
    """torchrun for one node of a job on ``nnodes`` nodes, each running ``nproc_per_node`` ranks:
    the same command on every node.

    torchrun's c10d rendezvous, served at ``endpoint`` (HOST:PORT, an address of one of the nodes
    that every node can reach), waits for ``nnodes`` launches with the same ``run_id``, then numbers
    the nodes itself (no ``--node-rank``: torchrun ignores it with c10d); global rank = node rank x
    nproc_per_node + local rank. The endpoint's node serves the store, on whichever of its launches
    binds the port first."""
    script = str(REPO_ROOT / step / "train.py")
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nnodes}",
        f"--nproc_per_node={nproc_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={run_id}",
        script,
        *args,
    ]


def run_nodes_here(
    step: str, nnodes: int, nproc_per_node: int, args: list[str], timeout: float = 600
) -> list[tuple[int, str]]:
    """Run a multi-node job as ``nnodes`` launches on this machine, rendezvousing on a free loopback
    port; (exit code, output) per launch. If one launch fails, or the time runs out, the others are
    stopped (SIGTERM: torchrun passes it on to its ranks), so no launch waits for a peer that will
    never come."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = node_command(
        step, nnodes, nproc_per_node, f"127.0.0.1:{port}", uuid.uuid4().hex[:8], args
    )
    # files, not pipes: nobody reads until the end
    logs = [tempfile.TemporaryFile("w+") for _ in range(nnodes)]
    launches = [
        subprocess.Popen(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
        for log in logs
    ]
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in launches):
            if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in launches):
                break
            time.sleep(0.2)
    finally:
        for p in launches:
            if p.poll() is None:
                p.terminate()
        for p in launches:
            p.wait(timeout=60)
    results = []
    for p, log in zip(launches, logs):
        log.seek(0)
        results.append((p.returncode, log.read()))
        log.close()
    return results


def run_trainer(step: str, nproc: int, args: list[str], log: Path) -> None:
    """Run to the end with all output in ``log``; on failure raise the trainer's own ``error:`` line
    (torchrun's report of the failed workers stays in the log)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        code = subprocess.call(
            trainer_command(step, nproc, args), stdout=f, stderr=subprocess.STDOUT, cwd=REPO_ROOT
        )
    if code != 0:
        errors = [line for line in log.read_text().splitlines() if line.startswith("error:")]
        raise UserError(f"{step} failed (exit {code}): {errors[0] if errors else f'see {log}'}")


def spawn_ranks(target, world_size: int, *args, timeout: float = 900) -> dict:
    """Run ``target(rank, world_size, port, *args)`` in ``world_size`` processes that meet at a free
    loopback port (each joins its own process group there); ``{rank: what target returned}``. A rank
    that fails ends them all, with its traceback; one that dies without a word (killed: out of
    memory?) with its exit code; no answer within ``timeout`` seconds, likewise. The ranks are
    forked from a server process that has imported the tool (and so torch) and done nothing else: a
    spawned rank would import torch again, seconds each, and a rank forked from the tool itself
    would inherit its state (CUDA's, once it has touched the GPU)."""
    ctx = mp.get_context("forkserver")
    # torch._dynamo too: building a model under a device context imports it, ~3 CPU seconds a rank
    # no effect once it runs
    ctx.set_forkserver_preload(["__main__", "torch", "torch.distributed", "torch._dynamo"])
    results = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [
        ctx.Process(target=_rank_main, args=(target, rank, world_size, port, args, results))
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    answers, deadline = {}, time.monotonic() + timeout
    try:
        while len(answers) < world_size:
            try:
                rank, failed, answer = results.get(timeout=1)
            except queues.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(
                        f"a rank of {world_size} ended with exit code {dead[0]} and no result"
                    ) from None
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"{world_size - len(answers)} of {world_size} ranks gave no result "
                        f"in {timeout:g} s"
                    ) from None
                continue
            if failed:
                raise RuntimeError(f"rank {rank} of {world_size} failed:\n{answer}")
            answers[rank] = answer
        for p in procs:
            p.join(timeout=60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    return answers


def _rank_main(target, rank: int, world_size: int, port: int, args: tuple, results) -> None:
    try:
        results.put((rank, False, target(rank, world_size, port, *args)))
    # the parent reports it: a rank that died silently would only be a timeout
    except BaseException:
        results.put((rank, True, traceback.format_exc()))
        raise
