"""Shared helpers: launch real trainers (one process for step 0, a process per rank over gloo
otherwise, each forked from a server that has imported torch: ``run_ranks``) on a tiny workload, and
read what they wrote. Every trainer sets one CPU thread per process itself
(seeding.seed_everything); the process-group timeout is short so a broken collective fails fast."""

import getpass
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parent.parent
# torch.compile's on-disk cache does not key its CPU kernels by ATEN_CPU_CAPABILITY: kernels
# compiled in a suite run under avx2 were loaded by a later run under avx512 and corrupted the heap
# (step 1 --compile, both ranks aborted in malloc; with an empty cache it passes). One cache per
# kernel path, for the tests and their ranks.
os.environ.setdefault(
    "TORCHINDUCTOR_CACHE_DIR",
    str(
        Path(tempfile.gettempdir())
        / (f"torchinductor_{getpass.getuser()}_{os.environ.get('ATEN_CPU_CAPABILITY', 'native')}")
    ),
)
# launch.py imports config from common/
sys.path[:0] = [str(REPO / "compare"), str(REPO / "common")]
import distributed  # noqa: E402  (common/distributed.py: workers join and leave the way the trainers do)
import other_order  # noqa: E402  (compare/other_order.py: another summation order, bounded on this machine)
from fp8 import fp8_cannot_run  # noqa: E402  (common/fp8.py)
from launch import trainer_command  # noqa: E402,F401  (the tests import it from here)

# torch 2.11's CPU _scaled_mm takes one scale per tensor: there, --fp8 rowwise is refused in one
# line (check_fp8, tests/test_bad_input.py) and the tests that run it skip, saying so
ROWWISE_RUNS_HERE = pytest.mark.skipif(
    fp8_cannot_run("rowwise", torch.device("cpu")) is not None,
    reason="this torch build's CPU _scaled_mm takes one scale per tensor only: no rowwise FP8 here",
)
FP8_RECIPES = ["tensorwise", pytest.param("rowwise", marks=ROWWISE_RUNS_HERE)]

STEPS = {
    p.name.split("_")[0]: p.name
    for p in REPO.glob("step*_*")
    if re.fullmatch(r"step\d+_\w+", p.name) and (p / "train.py").is_file()
}

# Small enough that a world-size-2 run takes a few seconds, big enough that clipping, accumulation
# and several buckets all happen. --grad-clip 0.3 sits below the early gradient norms (~1-3).
TINY = [
    "--steps",
    "4",
    "--micro-batch-size",
    "2",
    "--grad-accum",
    "2",
    "--seq-len",
    "32",
    "--n-layer",
    "2",
    "--n-embd",
    "32",
    "--n-head",
    "2",
    "--grad-clip",
    "0.3",
    "--warmup-steps",
    "2",
    "--save-every",
    "0",
    "--quiet",
]
TIMEOUT = ["--timeout-s", "60"]
# The contract's strictest setting at once: exact mode (float64 reduction), accumulation (no_sync),
# clipping that triggers, bf16 autocast, dropout (each rank's RNG must be where it should),
# checkpoints every 2 steps. bf16 here covers bf16 at world size 2 too: there the float64 and
# float32 reductions give the same bits.
EXACT = ("--reduce-dtype", "float64", "--amp", "bf16", "--dropout", "0.1", "--save-every", "2")
# The tests' mixture of experts (common/moe.py): 4 experts, top-2, capacity factor 1 (so choices are
# dropped on TINY's micro-batches), the Switch load-balancing loss at its usual weight.
MOE = (
    "--moe-experts",
    "4",
    "--moe-top-k",
    "2",
    "--moe-capacity-factor",
    "1.0",
    "--moe-aux-loss-coef",
    "0.01",
)


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory) -> Path:
    """The first 150 kB of the corpus:
    tokenizing it takes a tenth of the time, the text is the same kind."""
    path = tmp_path_factory.mktemp("data") / "small.txt"
    path.write_bytes((REPO / "data" / "tinyshakespeare.txt").read_bytes()[:150_000])
    return path


def free_port() -> int:
    """A loopback port no one listens on now: where a job's rank 0 serves its store."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(
    step: str, args: list[str], nproc: int = 1, env: dict | None = None, timeout: float = 240
):
    """Run a step's trainer: step 0 (or nproc=0) as one process, the others as ``nproc`` ranks with
    the short process-group timeout (``run_ranks``)."""
    nproc = 0 if step == "step0" else nproc
    return run_ranks(
        REPO / STEPS[step] / "train.py", [*args, *TIMEOUT] if nproc else args, nproc, env, timeout
    )


def run_ranks(
    script: Path, args: list[str], nproc: int, env: dict | None = None, timeout: float = 240
):
    """``python SCRIPT ARGS`` as one process (nproc=0), or as ``nproc`` ranks. Each rank is a
    process of its own with the variables torchrun gives it (RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT...), forked from ``WORKERS``' server (``run_forked``): torchrun and its ranks would
    spend ~6 CPU seconds each importing torch and tokenizers, most of what a tiny run costs. The
    ranks then meet in rank 0's store, as they do started by hand; what torchrun itself does (its
    agent's store, restarts, stopping the other ranks) is tested with real torchrun, and the tour
    runs every step under it. Returns the ranks' outputs, rank by rank, and torchrun's exit code: 0,
    or 1 if a rank failed (their own codes end stderr then)."""
    if not nproc:
        return run_forked([sys.executable, str(script), *args], env=env, timeout=timeout)
    port = free_port()
    ranks = [
        {
            **(env or {}),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(nproc),
            "LOCAL_WORLD_SIZE": str(nproc),
            "GROUP_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        for rank in range(nproc)
    ]
    results = run_forked_together([[sys.executable, str(script), *args]] * nproc, ranks, timeout)
    codes = [result.returncode for result in results]
    stderr = "".join(result.stderr for result in results)
    if any(codes):
        stderr += f"ranks' exit codes: {codes}\n"
    return subprocess.CompletedProcess(
        results[0].args, int(any(codes)), "".join(r.stdout for r in results), stderr
    )


def train(step: str, out: Path, corpus: Path, *extra: str, nproc: int = 2) -> Path:
    """Train on the tiny workload into ``out``;
    fail the test with the trainer's output if it fails."""
    result = launch(step, [*TINY, "--data", str(corpus), "--out", str(out), *extra], nproc=nproc)
    assert result.returncode == 0, (
        f"{step} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    )
    return out


def metrics(out: Path) -> dict:
    return json.loads((out / "metrics.json").read_text())


def weights(out: Path) -> dict:
    return load_file(str(out / "model.safetensors"))


DETERMINISTIC = ("step", "loss", "grad_norm", "param_norm", "lr", "effective_batch_size", "epoch")


def assert_bitwise_same_run(a: Path, b: Path) -> None:
    """Final weights torch.equal, tensor by tensor, and identical deterministic record fields."""
    wa, wb = weights(a), weights(b)
    assert sorted(wa) == sorted(wb)
    different = [name for name in wa if not torch.equal(wa[name], wb[name])]
    assert not different, f"tensors differ: {different}"
    ra = [{k: r[k] for k in DETERMINISTIC} for r in metrics(a)["records"]]
    rb = [{k: r[k] for k in DETERMINISTIC} for r in metrics(b)["records"]]
    assert ra == rb


def assert_all_to_all_closed_form(run: Path) -> int:
    """Step 12's all-to-all bytes on every rank of ``run`` (float32 activations), per MoE layer and
    micro-batch: the E counts (int64), then the token rows sent and received, forward and backward
    (float32 rows of h): 8 E + 4 h * 2 * (sent + received), what a rank receives being what the
    ranks of its expert-parallel group sent to its experts (step 10's ep groups at pp = tp = cp = 1
    are step 12's). Rank 0's notes add up to its recorded all-to-all bytes. Returns how many notes
    were checked."""
    config = metrics(run)["config"]
    experts, h, ep = config["moe_experts"], config["n_embd"], config["ep"]
    checked = 0
    for record in metrics(run)["records"]:
        notes = record["all_to_all"]  # [rank][layer x micro-batch]
        for rank, mine in enumerate(notes):
            group = range(rank // ep * ep, rank // ep * ep + ep)
            local = range(rank % ep * experts // ep, (rank % ep + 1) * experts // ep)
            for i, note in enumerate(mine):
                received = sum(notes[s][i]["sent_per_expert"][e] for s in group for e in local)
                assert note["received"] == received, (run, rank, i)
                sent = sum(note["sent_per_expert"])
                assert note["bytes"] == 8 * experts + 4 * h * 2 * (sent + received), (run, rank, i)
                checked += 1
        # step 12 records rank 0's bytes by kind; step 10 every rank's, by axis
        comm = record["comm"]
        recorded = (
            comm["all_to_all"]
            if isinstance(comm, dict)
            else comm[0].get("ep", {}).get("all_to_all", 0)
        )
        assert sum(n["bytes"] for n in notes[0]) == recorded
    return checked


def parity(a, b) -> subprocess.CompletedProcess:
    return run_forked(
        [sys.executable, str(REPO / "compare" / "parity.py"), str(a), str(b)], timeout=60
    )


def other_order_drift(reference, a: Path, b: Path) -> tuple[other_order.Drift, list[str]]:
    """Run ``b`` against ``a`` where ``b`` sums in another order (compare/other_order.py): its
    drift, and what of it exceeds ``reference`` (a Drift measured on this machine) times the stated
    factor. Empty: within."""
    mb, wb = metrics(b), weights(b)
    drift = other_order.drift(mb, wb, metrics(a), weights(a))
    return drift, other_order.beyond(drift, other_order.bound(reference, mb, wb))


def regrouped_drift(
    run: Path, corpus: Path, out: Path, *flags: str, groupings=((8, 1), (2, 4))
) -> other_order.Drift:
    """How far step 0 drifts from ``run`` (step 0 on TINY with ``flags``) when it regroups the same
    samples a step into other micro-batches, (accumulation, micro-batch size) each: another order of
    the same sums, in one process. Each quantity's largest over the groupings."""
    runs = [
        train(
            "step0",
            out / f"step0_{k}x{b}",
            corpus,
            *flags,
            "--grad-accum",
            str(k),
            "--micro-batch-size",
            str(b),
        )
        for k, b in groupings
    ]
    return other_order.largest(
        *(other_order.drift(metrics(r), weights(r), metrics(run), weights(run)) for r in runs)
    )


@pytest.fixture(scope="session")
def order_reference(tour) -> other_order.Drift:
    """How far two correct implementations drift apart on this machine: the tour's step 0 (one
    process, 4 micro-batches) from its step 1 (DDP, 2 ranks x 2), the same global batches summed in
    another order. Every test of a run in another summation order takes its bound from it
    (compare/other_order.py)."""
    single, ddp = tour[0] / STEPS["step0"], tour[0] / STEPS["step1"]
    return other_order.drift(metrics(single), weights(single), metrics(ddp), weights(ddp))


@pytest.fixture(scope="session")
def tour(tmp_path_factory, small_corpus) -> tuple[Path, str]:
    """The README's main job on the tiny workload: every step at world size 2 (step 0 as one process
    accumulating 2 x 2 micro-batches),
    checkpoints every 2 steps. Returns (runs folder, its output)."""
    runs = tmp_path_factory.mktemp("tour")
    at = TINY.index("--grad-accum")
    tiny = TINY[:at] + TINY[at + 2 :]  # the tour sets the accumulation itself
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "compare" / "tour.py"),
            "--runs-dir",
            str(runs),
            *tiny,
            "--save-every",
            "2",
            "--data",
            str(small_corpus),
            "--timeout-s",
            "60",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return runs, result.stdout


@pytest.fixture(scope="session")
def step1_ws2(tour) -> Path:
    """The golden reference on the tiny workload:
    PyTorch DDP, 2 ranks, float32, with checkpoints."""
    return tour[0] / STEPS["step1"]


@pytest.fixture(scope="session")
def exact_run(tmp_path_factory, small_corpus):
    """``exact_run(step, world_size)``: that step trained on TINY with the EXACT flags at that world
    size, once per session, and its run folder. The exact-mode matrix, the two-node test, the resume
    tests and step 7's tests share them."""
    runs = {}

    def run(step: str, world_size: int) -> Path:
        if (step, world_size) not in runs:
            out = tmp_path_factory.mktemp(f"exact_{step}_ws{world_size}")
            runs[step, world_size] = train(step, out, small_corpus, *EXACT, nproc=world_size)
        return runs[step, world_size]

    return run


# Step 9 (pipeline parallelism) on top of TINY: 4 blocks (up to 4 stages), 4 micro-batches per step,
# and what must flow through the stages right: dropout (one random stream), bf16 autocast, clipping
# (TINY's), checkpoints at steps 2 and 4.
PIPELINE = (
    "--n-layer",
    "4",
    "--grad-accum",
    "4",
    "--dropout",
    "0.1",
    "--amp",
    "bf16",
    "--save-every",
    "2",
)


@pytest.fixture(scope="session")
def pipeline_runs(tmp_path_factory, small_corpus):
    """``pipeline_runs(step, nproc, *extra)``: that trainer on TINY + PIPELINE (+ extra), once per
    session; its run folder. Step 9's tests (tests/test_pipeline_parallel.py) and step 9's resume
    test share them."""
    runs = {}

    def run(step: str, nproc: int = 1, *extra: str) -> Path:
        key = (step, nproc, extra)
        if key not in runs:
            out = tmp_path_factory.mktemp(f"{step}_p{nproc}")
            runs[key] = train(step, out, small_corpus, *PIPELINE, *extra, nproc=nproc)
        return runs[key]

    return run


# Step 10's meshes on TINY, each run 8 samples per optimiser step (micro-batches of 2), as step 1 on
# 2 ranks accumulating 2; name: (step, ranks, flags), the accumulation each run's own. The runs with
# checkpoints are resumed at other meshes and by step 1 (tests/test_3d_parallel.py).
MESH_RUNS = {
    "step1": ("step1", 2, ["--grad-accum", "2"]),
    "step8": ("step8", 2, ["--grad-accum", "4"]),
    "step9": ("step9", 2, ["--grad-accum", "4"]),
    "tp2": ("step10", 2, ["--tp", "2", "--grad-accum", "4", "--save-every", "2"]),
    "pp2": ("step10", 2, ["--pp", "2", "--grad-accum", "4"]),
    "dp2": ("step10", 2, ["--dp", "2", "--grad-accum", "2", "--save-every", "2"]),
    "tp2pp2": ("step10", 4, ["--tp", "2", "--pp", "2", "--grad-accum", "4", "--save-every", "2"]),
    "dp2pp2": ("step10", 4, ["--dp", "2", "--pp", "2", "--grad-accum", "2", "--save-every", "2"]),
    "dp2tp2": ("step10", 4, ["--dp", "2", "--tp", "2", "--grad-accum", "2", "--save-every", "2"]),
    # sequence parallelism through a pipeline: the stages send S/T tokens; dropout and bf16 on
    "step8sp": (
        "step8",
        2,
        ["--grad-accum", "4", "--sequence-parallel", "--dropout", "0.1", "--amp", "bf16"],
    ),
    # the same without sequence parallelism: the same masks,
    # the same first loss (tests/test_tensor_parallel.py)
    "step8dropbf16": ("step8", 2, ["--grad-accum", "4", "--dropout", "0.1", "--amp", "bf16"]),
    "tp2pp2sp": (
        "step10",
        4,
        [
            "--tp",
            "2",
            "--pp",
            "2",
            "--grad-accum",
            "4",
            "--sequence-parallel",
            "--dropout",
            "0.1",
            "--amp",
            "bf16",
        ],
    ),
}


@pytest.fixture(scope="session")
def mesh_runs(tmp_path_factory, small_corpus):
    """``mesh_runs(name)``: the run folder of ``MESH_RUNS[name]``, trained once per session. Step
    10's tests (tests/test_3d_parallel.py) and the planner's measured rows (tests/test_plan.py)
    share them."""
    done = {}
    at = TINY.index("--grad-accum")
    tiny = TINY[:at] + TINY[at + 2 :]  # each run sets its own accumulation

    def run(name: str) -> Path:
        if name not in done:
            step, nproc, flags = MESH_RUNS[name]
            out = tmp_path_factory.mktemp(name)
            result = launch(
                step, [*tiny, *flags, "--data", str(small_corpus), "--out", str(out)], nproc=nproc
            )
            assert result.returncode == 0, (
                f"{name} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
            )
            done[name] = out
        return done[name]

    return run


def init_gloo(rank: int, world_size: int, port: int) -> None:
    """In a spawned worker: one CPU thread, and the trainers' own join: a gloo group on loopback,
    with a short timeout. Leave with ``shutdown()``, as the trainers do."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    distributed.join(
        distributed.World(rank, world_size, rank, torch.device("cpu"), "gloo"), timeout_s=30
    )


shutdown = distributed.shutdown


# The workers' start method. Each is a new process, forked from a server process that has imported
# torch and this file and done nothing else (no group, no tensor work), so a worker starts where a
# spawned one would be once it has unpickled its target, without importing torch again: about 3 CPU
# seconds less per worker, most of what a toy test costs. (Outsiders' harnesses,
# tests/drop_in_harness.py, still use mp.spawn.)
WORKERS = mp.get_context("forkserver")
# And what every trainer imports beyond torch, ~1,000 modules that cost a rank 2-4 CPU seconds, more
# than the rest of a tiny run: tokenizers (the corpus), safetensors (the weights),
# torch._inductor.config (which torch.use_deterministic_algorithms imports, and with it
# torch._dynamo and sympy), matplotlib (--trace), and torch.distributed's FSDP, DTensor, pipelining
# and checkpoint (the references and the resharding). A name that does not import is skipped by
# the server.
WORKERS.set_forkserver_preload(
    [
        "torch",
        "torch.distributed",
        "tokenizers",
        "safetensors.torch",
        "torch._inductor.config",
        "matplotlib.pyplot",
        "torch.distributed.fsdp",
        "torch.distributed.tensor",
        "torch.distributed.pipelining",
        "torch.distributed.checkpoint",
        "conftest",
    ]
)


def spawn(target, world_size: int, *args, timeout: float = 120) -> dict:
    """Run ``target(rank, world_size, port, queue, *args)`` in ``world_size`` fresh processes
    (``WORKERS``). Each worker puts ``(rank, result)`` on the queue; returns ``{rank: result}``."""
    ctx = WORKERS
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=target, args=(rank, world_size, port, queue, *args))
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    try:
        results = dict(queue.get(timeout=timeout) for _ in procs)
        for p in procs:
            p.join(timeout=30)
        # A worker that answered but never exited hangs in
        # its shutdown: that is a bug, not a slow machine.
        assert [p.exitcode for p in procs] == [0] * world_size, (
            f"worker exit codes: {[p.exitcode for p in procs]}"
        )
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    return results


def run_forked(
    command: list[str], env: dict | None = None, timeout: float = 300
) -> subprocess.CompletedProcess:
    """``subprocess.run(command, cwd=REPO, capture_output=True, text=True)`` for ``python SCRIPT
    ARGS`` or ``python -c CODE ARGS``, in a process forked from ``WORKERS``' server instead of a new
    interpreter: the same script runs as ``__main__`` with the same argv, environment and working
    folder, and only the imports of torch and tokenizers are already done (the repository's own
    modules are forgotten first, so the script imports its folder's copies as it would). A new
    interpreter costs ~6 CPU seconds of imports, a fork a tenth of one: most of what a short command
    (tests/test_bad_input.py's) or a tiny training run costs."""
    return run_forked_together([command], [env or {}], timeout)[0]


def run_forked_together(
    commands: list[list[str]], envs: list[dict], timeout: float = 300, grace_s: float = 30
) -> list[subprocess.CompletedProcess]:
    """``run_forked`` for several commands at once (the ranks of one job); once one has failed, the
    others have ``grace_s`` to end before they are killed, as torchrun stops a job's other ranks."""
    import tempfile
    import time

    assert all(command[0] == sys.executable for command in commands), commands
    with tempfile.TemporaryDirectory() as folder:
        files = [(Path(folder, f"{i}.out"), Path(folder, f"{i}.err")) for i in range(len(commands))]
        processes = []
        for command, env, (out, err) in zip(commands, envs, files):
            # read afterwards even if the process ended before it wrote a byte
            out.touch(), err.touch()
            processes.append(
                WORKERS.Process(
                    target=_run_as_main, args=(command[1:], {**os.environ, **env}, out, err)
                )
            )
            processes[-1].start()
        # As torchrun does: once one process has failed,
        # the others get grace_s to end, then are stopped.
        deadline, timed_out = time.monotonic() + timeout, False
        while any(p.is_alive() for p in processes):
            if any(p.exitcode for p in processes):
                deadline = min(deadline, time.monotonic() + grace_s)
            if time.monotonic() > deadline:
                timed_out = not any(p.exitcode for p in processes)
                for p in processes:
                    p.kill()
                break
            time.sleep(0.05)
        for p in processes:
            p.join()
        results = [
            subprocess.CompletedProcess(command, p.exitcode, out.read_text(), err.read_text())
            for command, p, (out, err) in zip(commands, processes, files)
        ]
        if timed_out:
            raise subprocess.TimeoutExpired(
                commands[0],
                timeout,
                "".join(r.stdout for r in results),
                "".join(r.stderr for r in results),
            )
        return results


def _run_as_main(argv: list[str], env: dict, out: Path, err: Path) -> None:
    """In the forked process: become ``python *argv`` (see ``run_forked``);
    the exit code is the script's."""
    import runpy

    for fd, path in ((1, out), (2, err)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_TRUNC), fd)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(REPO)

    # the repository or one of its folders; not a virtual environment inside it
    def ours(path: str) -> bool:
        return path.startswith(str(REPO)) and REPO in (
            Path(path).resolve(),
            Path(path).resolve().parent,
        )

    # conftest, common/'s and compare/'s modules: not the script's
    for name, module in list(sys.modules.items()):
        if ours(os.path.dirname(getattr(module, "__file__", None) or "")):
            del sys.modules[name]
    sys.path[:] = [entry for entry in sys.path if not ours(entry)]
    if argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        sys.path.insert(0, "")
        exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
    else:
        sys.argv = list(argv)
        sys.path.insert(0, str(Path(argv[0]).resolve().parent))
        runpy.run_path(argv[0], run_name="__main__")
