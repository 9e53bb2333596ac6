"""Every user mistake in docs/bad_input.md, tried for real:
one `error:` line, exit 2, nothing saved touched.

The table in docs/bad_input.md is the list. Each row names its case here (last column), and the
message it shows is the pattern the case's one stderr line must match: paths as the doc shows them,
``...`` for what depends on the machine. A case with no row, or a row with no case, fails the test.

Each case is a process of its own running the real command: a trainer as ``python stepK/train.py``
(a distributed step as rank 0 of 2 through torchrun's environment variables, which reaches every
check, since all of them run before the process group is joined), a tool as ``python compare/x.py``.
The processes are forked from one that has imported torch and tokenizers (``conftest.run_forked``:
the script runs as ``__main__`` with its argv and environment; a new interpreter would spend ~6 CPU
seconds importing them, in 80 cases), a few at a time. Each works in a folder of its own laid out
like the repository (``runs/``, ``data/``), holding what its command reads: a copy of the tour's
step-1 run, damaged on purpose where that is the mistake. Afterwards every file in those folders
must have the bytes it had before, and none may have been added.
"""

import json
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

import distributed  # common/, on the path through conftest
from config import UserError, build_parser, check_config
from conftest import REPO, STEPS, TINY, free_port, run_forked, trainer_command

TABLE = REPO / "docs" / "bad_input.md"
# processes at a time: each mostly imports torch, and more would only queue for 2 cores
PARALLEL = 4


# ---- how a case runs its command -----------------------------------------------------------------


@dataclass
class Case:
    command: list[str]
    env: dict = field(default_factory=dict)

    @property
    def script(self) -> str:
        """``step1_torch_ddp/train.py`` or ``compare/parity.py``:
        what the doc's example command must run."""
        return (
            next(Path(part) for part in self.command if part.endswith(".py"))
            .relative_to(REPO)
            .as_posix()
        )


def trainer(step: str, *args, ranks: int | None = None, env: dict | None = None) -> Case:
    """``python stepK/train.py ARGS``; with ``ranks``, as rank 0 of that many, as torchrun would
    start it. Were a check missing, the rank would go on to wait for its peers: a port of its own
    and a short timeout end that."""
    if ranks:
        env = {
            "WORLD_SIZE": str(ranks),
            "RANK": "0",
            "LOCAL_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()),
            **(env or {}),
        }
        args = (*args, "--timeout-s", "20")
    return Case(trainer_command(STEPS[step], 0, list(map(str, args))), env or {})


# A stand-in for a torch build this one is not, set up in the trainer's process before it runs as
# `python train.py ARGS` would: the refusal it leads to cannot happen with this CPU build of torch.
SIMULATED = {
    "a build without fp16 on the CPU": (
        "import torch\n"
        "def refuse(*args, **kwargs): raise RuntimeError('GradScaler is not supported "
        "on this device')\n"
        "torch.amp.GradScaler = refuse\n"
    ),
    "a device without FP8 matmuls": (
        "import torch\n"
        "def refuse(*args, **kwargs): raise RuntimeError('torch._scaled_mm is only "
        "supported on CUDA SM 8.9 or later')\n"
        "torch._scaled_mm = refuse\n"
    ),
    "an FP8 matmul with one scale per tensor only (torch 2.11's CPU)": (
        "import torch\n"
        "mm = torch._scaled_mm\n"
        "def per_tensor(a, b, scale_a, scale_b, **kwargs):\n"
        "    if scale_a.numel() != 1: raise RuntimeError('_scaled_mm only supports "
        "per-tensor scaling for CPU')\n"
        "    return mm(a, b, scale_a=scale_a, scale_b=scale_b, **kwargs)\n"
        "torch._scaled_mm = per_tensor\n"
    ),
}


def simulated(what: str, step: str, *args) -> Case:
    script = REPO / STEPS[step] / "train.py"
    code = (
        SIMULATED[what] + "import runpy, sys\n"
        f"sys.path.insert(0, {str(script.parent)!r})\n"
        "sys.argv = sys.argv[1:]  # python -c CODE SCRIPT ARGS: as if SCRIPT ran with ARGS\n"
        f"runpy.run_path({str(script)!r}, run_name='__main__')\n"
    )
    return Case([sys.executable, "-c", code, str(script), *args])


def tool(name: str, *args) -> Case:
    return Case([sys.executable, str(REPO / "compare" / name), *map(str, args)])


def slurm(*args, **env) -> Case:
    """``python launch/slurm_command.py ARGS`` with these Slurm variables ("" = not set)."""
    return Case([sys.executable, str(REPO / "launch" / "slurm_command.py"), *args], env)


# ---- what a case's command reads: a folder laid out like the repository --------------------------


class Scratch:
    """A case's own folder, ``<root>/runs``, ``<root>/data``:
    what its command reads, and nothing else."""

    def __init__(self, root: Path, step1_run: Path, small_corpus: Path):
        self.root, self.step1_run = root, step1_run
        # the corpus the run trained on: a resume names that file
        self.tiny = [*TINY, "--data", str(small_corpus)]
        root.mkdir(parents=True)

    def run(
        self, name: str = "step1_torch_ddp", damage=None, checkpoint_damage=None, metrics_edit=None
    ) -> Path:
        """runs/<name>: a copy of the tour's step-1 run (2 ranks, checkpoints step_2 and step_4),
        with ``damage(run folder)``, ``checkpoint_damage(step_4 folder)`` and ``metrics_edit(metrics
        dict)`` done to it."""
        run = Path(shutil.copytree(self.step1_run, self.root / "runs" / name))
        if damage:
            damage(run)
        if checkpoint_damage:
            checkpoint_damage(run / "checkpoints" / "step_4")
        if metrics_edit:
            edit_json(run / "metrics.json", metrics_edit)
        return run

    def notes(self) -> Path:
        """runs/notes/notes.txt: a file, in a folder that is not a run."""
        path = self.root / "runs" / "notes" / "notes.txt"
        path.parent.mkdir(parents=True)
        path.write_text("my notes\n")
        return path

    def data(self, name: str, content: bytes) -> Path:
        path = self.root / "data" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
        return path


def edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def write(name: str, content: bytes):
    """A damage: the file ``name`` in the folder now holds ``content``."""
    return lambda folder: (folder / name).write_bytes(content)


def cut_short(name: str, size: int):
    """A damage: the file ``name`` in the folder keeps
    only its first ``size`` bytes (a copy cut short)."""
    return lambda folder: (folder / name).write_bytes((folder / name).read_bytes()[:size])


def set_data_position(index: int):
    """Where an epoch ended inside an optimiser step,
    the position saved is not a whole number of steps."""

    def damage(
        checkpoint: Path,
    ) -> None:  # the run state is one of DCP's objects: the checkpoint written anew
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        from dcp_checkpoint import read, save

        saved = FileSystemReader(checkpoint).read_metadata().state_dict_metadata
        state = read(
            {
                key: torch.empty(md.size, dtype=md.properties.dtype)
                if isinstance(md, TensorStorageMetadata)
                else None
                for key, md in saved.items()
            },
            checkpoint,
        )
        state["run"]["data"]["index"] = index
        for file in [*checkpoint.glob("*.distcp"), checkpoint / ".metadata"]:
            file.unlink()
        save(state, checkpoint)

    return damage


def changed_tokenizer(s: Scratch) -> Path:
    """A run whose config names data/tokenizer.json,
    which changed (by a byte) after the run was trained."""
    tokenizer = s.data("tokenizer.json", (REPO / "data" / "tokenizer.json").read_bytes())
    run = s.run(metrics_edit=lambda m: m["config"].update(tokenizer=str(tokenizer)))
    tokenizer.write_text(tokenizer.read_text() + "\n")
    return run


def step4(run: Path) -> Path:
    return run / "checkpoints" / "step_4"


NO_GPU = {"CUDA_VISIBLE_DEVICES": ""}
# what conftest's small_corpus holds
CORPUS = (REPO / "data" / "tinyshakespeare.txt").read_bytes()[:150_000]

# Every case, by the name docs/bad_input.md gives it: a function of the case's Scratch folder that
# puts there what the command reads and returns the command.
CASES = {
    # ---- flags
    "unknown-choice": lambda s: trainer("step0", "--amp", "fp8"),
    "count-below-one": lambda s: trainer("step0", "--steps", "0"),
    "negative": lambda s: trainer("step0", "--save-every", "-1"),
    "memory-budget-zero": lambda s: trainer("step0", "--max-memory-mb", "0"),
    "preempt-grace-too-long": lambda s: trainer(
        "step1",
        "--preempt-grace-s",
        "30",
        ranks=2,
        # as torchrun starts it
        env={"TORCHELASTIC_RESTART_COUNT": "0"},
    ),
    # ---- files
    "data-missing": lambda s: trainer("step0", "--data", s.root / "data" / "shakespeare.txt"),
    "data-not-text": lambda s: trainer(
        "step0", "--data", s.data("corpus.bin", bytes(range(128, 256)))
    ),
    "data-empty": lambda s: trainer("step0", "--data", s.data("empty.txt", b"")),
    "data-too-short": lambda s: trainer(
        "step0", "--data", s.data("small.txt", CORPUS), "--seq-len", "100000"
    ),
    "tokenizer-not-one": lambda s: trainer("step0", "--tokenizer", s.notes()),
    "out-is-a-file": lambda s: trainer("step1", *s.tiny, "--out", s.notes(), ranks=2),
    # ---- checkpoints
    "nothing-to-resume": lambda s: trainer(
        "step0", *s.tiny, "--out", s.root / "runs" / "fresh", "--resume"
    ),
    "resume-a-run-folder": lambda s: trainer(
        "step1", *s.tiny, "--out", s.root / "runs" / "fresh", "--resume", s.run(), ranks=2
    ),
    "corrupted-file": lambda s: trainer(
        "step1",
        *s.tiny,
        "--out",
        s.run(checkpoint_damage=write(".metadata", bytes(100))),
        "--resume",
        ranks=2,
    ),
    "missing-rank-file": lambda s: trainer(
        "step1",
        *s.tiny,
        "--out",
        s.run(checkpoint_damage=lambda c: (c / "__1_0.distcp").unlink()),
        "--resume",
        ranks=2,
    ),
    "meta-not-json": lambda s: trainer(
        "step1",
        *s.tiny,
        "--out",
        s.run(checkpoint_damage=cut_short("meta.json", 20)),
        "--resume",
        ranks=2,
    ),
    "another-format": lambda s: trainer(
        "step1",
        *s.tiny,
        "--out",
        s.run(
            checkpoint_damage=lambda c: edit_json(
                c / "meta.json", lambda meta: meta.update(format=1)
            )
        ),
        "--resume",
        ranks=2,
    ),
    "format-2": lambda s: trainer(
        "step1",
        *s.tiny,
        "--out",
        s.run(
            checkpoint_damage=lambda c: edit_json(
                c / "meta.json", lambda meta: meta.update(format=2)
            )
        ),
        "--resume",
        ranks=2,
    ),
    "another-config": lambda s: trainer(
        "step1",
        *s.tiny,
        "--lr",
        "0.1",
        "--out",
        s.root / "runs" / "fresh",
        "--resume",
        step4(s.run()),
        ranks=2,
    ),
    "global-batch-not-kept": lambda s: trainer(
        "step1", *s.tiny, "--out", s.root / "runs" / "fresh", "--resume", step4(s.run()), ranks=1
    ),
    "stream-cannot-continue": lambda s: trainer(
        "step1",
        *s.tiny,
        "--micro-batch-size",
        "8",
        "--grad-accum",
        "1",
        "--out",
        s.root / "runs" / "fresh",
        "--resume",
        step4(s.run(checkpoint_damage=set_data_position(3))),
        ranks=1,
    ),
    "step0-resumes-another-step": lambda s: trainer(
        "step0", *s.tiny, "--out", s.root / "runs" / "fresh", "--resume", step4(s.run())
    ),
    "another-step-resumes-step0": lambda s: trainer(
        "step1",
        *s.tiny,
        "--out",
        s.root / "runs" / "fresh",
        "--resume",
        step4(
            s.run(
                "step0_single_gpu",
                checkpoint_damage=lambda c: edit_json(
                    c / "meta.json", lambda meta: meta.update(format="single-process")
                ),
            )
        ),
        ranks=2,
    ),
    # ---- the machine and the world
    "nccl-without-gpus": lambda s: trainer("step1", "--backend", "nccl", ranks=2, env=NO_GPU),
    "cuda-without-gpu": lambda s: trainer("step0", "--device", "cuda", env=NO_GPU),
    "fp16-cannot-run": lambda s: simulated(
        "a build without fp16 on the CPU", "step0", "--amp", "fp16"
    ),
    "pipeline-more-stages-than-blocks": lambda s: trainer("step9", "--n-layer", "2", ranks=4),
    "pipeline-micro-batches": lambda s: trainer(
        "step9", "--grad-accum", "4", "--micro-batches", "3", ranks=2
    ),
    "pipeline-interleaved-rounds": lambda s: trainer(
        "step9", "--schedule", "interleaved-1f1b", "--n-layer", "4", "--grad-accum", "3", ranks=2
    ),
    "pipeline-virtual-stages": lambda s: trainer("step9", "--virtual-stages", "2", ranks=2),
    "pipeline-schedule": lambda s: trainer("step9", "--schedule", "zb", ranks=2),
    "pipeline-fp16": lambda s: trainer("step9", "--amp", "fp16", ranks=2),
    "compile-not-here": lambda s: trainer("step7", "--compile", ranks=2),
    "replicate-not-dividing": lambda s: trainer("step7", "--replicate", "3", ranks=4),
    "param-dtype-with-amp": lambda s: trainer("step0", "--param-dtype", "bf16", "--amp", "bf16"),
    "param-dtype-not-here": lambda s: trainer("step1", "--param-dtype", "bf16", ranks=2),
    "fp8-with-fp16": lambda s: trainer("step0", "--fp8", "tensorwise", "--amp", "fp16"),
    "fp8-sizes": lambda s: trainer(
        "step5", "--fp8", "rowwise", "--n-embd", "24", "--n-head", "2", ranks=2
    ),
    "fp8-cannot-run": lambda s: simulated(
        "a device without FP8 matmuls", "step0", "--fp8", "rowwise"
    ),
    "fp8-rowwise-cannot-run": lambda s: simulated(
        "an FP8 matmul with one scale per tensor only (torch 2.11's CPU)",
        "step0",
        "--fp8",
        "rowwise",
    ),
    "fsdp2-reference-flags": lambda s: tool("fsdp2_reference.py", "--param-dtype", "fp16"),
    "accelerate-reference-flags": lambda s: tool("accelerate_reference.py", "--amp", "bf16"),
    "world-larger-than-data": lambda s: trainer("step1", *s.tiny[-2:], ranks=5000),
    "ranks-without-a-step": lambda s: trainer(
        "step1", *s.tiny[-2:], "--micro-batch-size", "64", ranks=64
    ),
    "step0-under-torchrun": lambda s: trainer(
        "step0",
        *s.tiny,
        "--out",
        s.root / "runs" / "fresh",
        env={"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"},
    ),
    "tp-heads": lambda s: trainer("step8", "--data", s.data("small.txt", CORPUS), ranks=3),
    "tp-vocabulary": lambda s: trainer(
        "step8", "--data", s.data("small.txt", CORPUS), "--n-head", "3", "--n-embd", "96", ranks=3
    ),
    "tp-sequence": lambda s: trainer(
        "step8",
        "--data",
        s.data("small.txt", CORPUS),
        "--sequence-parallel",
        "--seq-len",
        "30",
        ranks=4,
    ),
    "cp-sequence": lambda s: trainer(
        "step11", "--data", s.data("small.txt", CORPUS), "--seq-len", "30", ranks=4
    ),
    "moe-flags-dense": lambda s: trainer("step0", "--moe-top-k", "2"),
    "moe-top-k": lambda s: trainer("step0", "--moe-experts", "4", "--moe-top-k", "5"),
    "moe-capacity-negative": lambda s: trainer(
        "step0", "--moe-experts", "4", "--moe-capacity-factor", "-1"
    ),
    "ep-dense": lambda s: trainer("step12", ranks=2),
    "ep-experts": lambda s: trainer("step12", "--moe-experts", "3", ranks=2),
    "ep-world": lambda s: trainer("step12", "--moe-experts", "4", "--ep", "3", ranks=2),
    "mesh-product": lambda s: trainer(
        "step10",
        "--data",
        s.data("small.txt", CORPUS),
        "--dp",
        "2",
        "--tp",
        "2",
        "--pp",
        "2",
        ranks=4,
    ),
    "mesh-tp-heads": lambda s: trainer(
        "step10",
        "--data",
        s.data("small.txt", CORPUS),
        "--dp",
        "2",
        "--tp",
        "2",
        "--n-head",
        "3",
        "--n-embd",
        "96",
        ranks=4,
    ),
    "mesh-cp-sequence-parallel": lambda s: trainer(
        "step10",
        "--data",
        s.data("small.txt", CORPUS),
        "--cp",
        "2",
        "--tp",
        "2",
        "--sequence-parallel",
        ranks=4,
    ),
    "mesh-ep-plane": lambda s: trainer(
        "step10", "--data", s.data("small.txt", CORPUS), "--moe-experts", "4", "--ep", "4", ranks=2
    ),
    "mesh-moe-not-composed": lambda s: trainer(
        "step10",
        "--data",
        s.data("small.txt", CORPUS),
        "--cp",
        "2",
        "--moe-experts",
        "4",
        "--moe-capacity-factor",
        "1",
        ranks=2,
    ),
    "mesh-full-recompute-zero-bubble": lambda s: trainer(
        "step10",
        "--data",
        s.data("small.txt", CORPUS),
        "--pp",
        "2",
        "--schedule",
        "zero-bubble",
        "--activation-checkpointing",
        "full",
        ranks=2,
    ),
    "mesh-zero-3-not-composed": lambda s: trainer(
        "step10",
        "--data",
        s.data("small.txt", CORPUS),
        "--tp",
        "2",
        "--zero",
        "3",
        "--sequence-parallel",
        ranks=2,
    ),
    "mesh-replicate": lambda s: trainer(
        "step10",
        *("--data", s.data("small.txt", CORPUS), "--dp", "2", "--cp", "2"),
        *("--zero", "3", "--replicate", "3"),
        ranks=4,
    ),
    "memory-budget-too-small": lambda s: trainer(
        "step0", *s.tiny, "--out", s.root / "runs" / "fresh", "--max-memory-mb", "1"
    ),
    "checkpoint-not-written": lambda s: Case(
        [
            sys.executable,
            str(REPO / "tests" / "writer_hook.py"),
            "fail:2",
            str(REPO / STEPS["step0"] / "train.py"),
            *s.tiny,
            "--steps",
            "2",
            "--warmup-steps",
            "1",
            "--save-every",
            "2",
            "--out",
            str(s.root / "runs" / "fresh"),
        ]
    ),
    # ---- runs given to the compare/ tools
    "unknown-step": lambda s: tool("parity.py", s.run(), "step99"),
    "not-a-run": lambda s: tool("parity.py", s.run(), s.notes().parent),
    "metrics-cut-short": lambda s: tool(
        "parity.py", s.run(), s.run("other", damage=cut_short("metrics.json", 500))
    ),
    "metrics-not-metrics": lambda s: tool(
        "parity.py", s.run(), s.run("other", damage=write("metrics.json", b"[1, 2]"))
    ),
    "older-schema": lambda s: tool(
        "parity.py", s.run(), s.run("other", metrics_edit=lambda m: m.update(schema_version=1))
    ),
    "run-not-finished": lambda s: tool(
        "parity.py", s.run(), s.run("other", metrics_edit=lambda m: m.update(final=None))
    ),
    "weights-unreadable": lambda s: tool(
        "parity.py", s.run(), s.run("other", damage=write("model.safetensors", b"garbage"))
    ),
    "not-comparable": lambda s: tool(
        "parity.py", s.run(), s.run("other", metrics_edit=lambda m: m["config"].update(seed=7))
    ),
    "other-global-batch": lambda s: tool(
        "parity.py",
        s.run(),
        s.run("other", metrics_edit=lambda m: m["config"].update(micro_batch_size=4)),
    ),
    "no-step-times": lambda s: tool(
        "stragglers.py",
        s.run(metrics_edit=lambda m: [record.pop("step_time") for record in m["records"]]),
    ),
    "stragglers-threshold": lambda s: tool("stragglers.py", s.run(), "--ratio", "0.5"),
    "no-cost": lambda s: tool("cost.py", s.run(metrics_edit=lambda m: m.pop("cost"))),
    "tokenizer-changed": lambda s: tool("sample.py", changed_tokenizer(s)),
    "sample-no-tokens": lambda s: tool("sample.py", s.run(), "--tokens", "0"),
    "scaling-two-models": lambda s: tool(
        "memory.py",
        s.run(),
        s.run(
            "other", metrics_edit=lambda m: m["final"]["fingerprints"].update(extra={"shape": [10]})
        ),
        "--scaling-png",
        s.root / "runs" / "scaling.png",
    ),
    "figure-format": lambda s: tool("plot.py", s.run(), "--out", s.root / "runs" / "plot.txt"),
    "expert-load-of-a-dense-run": lambda s: tool(
        "plot.py", "--expert-load", s.run(), "--out", s.root / "runs" / "load.png"
    ),
    "consolidate-a-run-folder": lambda s: tool(
        "consolidate.py", s.run(), s.root / "runs" / "plain"
    ),
    "consolidate-corrupted": lambda s: tool(
        "consolidate.py",
        step4(s.run(checkpoint_damage=write(".metadata", bytes(100)))),
        s.root / "runs" / "plain",
    ),
    "consolidate-into-itself": lambda s: tool(
        "consolidate.py", step4(s.run()), s.root / "runs" / "step1_torch_ddp"
    ),
    "consolidate-into-a-file": lambda s: tool("consolidate.py", step4(s.run()), s.notes()),
    "export-not-a-run": lambda s: tool("export_hf.py", s.notes().parent),
    "export-no-weights": lambda s: tool(
        "export_hf.py", s.run(damage=lambda run: (run / "model.safetensors").unlink())
    ),
    "export-weights-do-not-fit": lambda s: tool(
        "export_hf.py",
        s.run(
            metrics_edit=lambda m: m["config"].update(
                moe_experts=8, moe_top_k=2, moe_every=1, moe_capacity_factor=0.0
            )
        ),
    ),
    "export-out-not-empty": lambda s: tool("export_hf.py", s.run(), s.notes().parent),
    # ---- launch/slurm_command.py (slurm.sbatch's line), outside a job or in one it cannot launch
    "slurm-not-in-a-job": lambda s: slurm("step3", SLURM_JOB_ID="", SLURM_NNODES=""),
    "slurm-tasks-per-node": lambda s: slurm(
        "step3", SLURM_JOB_ID="7", SLURM_NNODES="2", SLURM_NTASKS_PER_NODE="4"
    ),
    "slurm-no-ranks": lambda s: slurm(
        "step3",
        SLURM_JOB_ID="7",
        SLURM_NNODES="2",
        SLURM_NTASKS_PER_NODE="1",
        SLURM_GPUS_ON_NODE="",
        NPROC_PER_NODE="",
    ),
    # ---- the other compare/ tools' own flags
    "tour-out": lambda s: tool("tour.py", "--out", s.root / "runs" / "x"),
    "tour-nproc-data": lambda s: tool(
        "tour.py", "--nproc", "5000", "--data", s.data("small.txt", CORPUS)
    ),
    "tour-runs-dir-file": lambda s: tool("tour.py", "--runs-dir", s.notes()),
    "tour-flag-not-shared": lambda s: tool("tour.py", "--backend", "gloo"),
    "matrix-world-sizes": lambda s: tool("exact_matrix.py", "--world-sizes", "two"),
    "matrix-modes": lambda s: tool("exact_matrix.py", "--modes", "float16"),
    "estimate-world-sizes": lambda s: tool("estimate.py", "--world-sizes", "two"),
    "plan-devices": lambda s: tool("plan.py", "--devices", "0"),
    "plan-preset-and-params": lambda s: tool("plan.py", "--preset", "gpt2", "--params", "1e9"),
    "plan-kv-heads": lambda s: tool("plan.py", "--n-kv-head", "3"),
    "plan-moe-top-k": lambda s: tool("plan.py", "--moe-experts", "4", "--moe-top-k", "5"),
    "peak-profiled-steps": lambda s: tool("peak_memory.py", "--profiled-steps", "0"),
    "bench-strategies": lambda s: tool("bench.py", "--strategies", "zero4"),
    "fp8-outliers-sizes": lambda s: tool("fp8_outliers.py", "--tokens", "100"),
    "bubble-stages": lambda s: tool("bubble.py", "--stages", "0"),
    "pipeline-reference-stages": lambda s: tool("pipeline_reference.py", "--stages", "0"),
    "pipeline-memory-stages": lambda s: tool("pipeline_memory.py", "--stages", "0"),
    "bench-checkpoint-step": lambda s: tool("bench_checkpoint.py", "--step", "step99"),
    "collectives-without-torchrun": lambda s: tool("bench_collectives.py"),
    "step-diffs-markers": lambda s: tool("step_diffs.py", "--readme", s.notes()),
}


# ---- the table -----------------------------------------------------------------------------------


@dataclass
class Row:
    mistake: str
    example: str
    message: str
    exit_code: str
    case: str | None  # None: a row no case tries (the doc says why)


def table_rows() -> list[Row]:
    """The rows of docs/bad_input.md's table:
    | mistake | example command | message | exit code | case |."""
    rows = []
    for line in TABLE.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split(" | ")]
        if not line.startswith("| ") or len(cells) != 5 or cells[0] == "mistake":
            continue
        mistake, example, message, exit_code, case = cells
        named = re.fullmatch(r"`([a-z0-9-]+)`", case)
        rows.append(
            Row(
                mistake, example.strip("`"), message.strip("`"), exit_code, named and named.group(1)
            )
        )
    return rows


ROWS = table_rows()
TRIED = [row for row in ROWS if row.case]


def matches(message: str, pattern: str) -> bool:
    """``message`` is ``pattern``, where each ``...`` of the pattern stands for any text."""
    return re.fullmatch(".*?".join(map(re.escape, pattern.split("..."))), message) is not None


def files_under(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def shorten(text: str, root: Path) -> str:
    """Paths as the doc shows them:
    relative to the case's folder (laid out like the repository) or the repo."""
    return text.replace(f"{root}/", "").replace(f"{REPO}/", "")


def run_case(case: Case) -> subprocess.CompletedProcess:
    return run_forked(case.command, env=case.env, timeout=300)


@pytest.fixture(scope="module")
def tried(step1_ws2, small_corpus, tmp_path_factory):
    """Every case run, a few at a time: ``(folder of the case folders, its files before, after,
    {case: (case folder, result)})``."""
    top = tmp_path_factory.mktemp("bad_input")
    folders = {name: Scratch(top / name, step1_ws2, small_corpus) for name in CASES}
    cases = {name: build(folders[name]) for name, build in CASES.items()}
    before = files_under(top)
    with ThreadPoolExecutor(PARALLEL) as pool:
        results = dict(zip(cases, pool.map(run_case, cases.values())))
    return (
        cases,
        {name: (folders[name].root, result) for name, result in results.items()},
        before,
        files_under(top),
    )


def test_the_table_lists_every_case_once_and_only_those():
    named = [row.case for row in TRIED]
    assert len(named) == len(set(named)), "a case named in two rows"
    assert set(named) == set(CASES), (
        f"cases without a row: {sorted(set(CASES) - set(named))}; "
        f"rows naming no case: {sorted(set(named) - set(CASES))}"
    )
    untried = [row.mistake for row in ROWS if not row.case]
    assert all("dead or frozen rank" in mistake for mistake in untried), (
        f"rows no case tries: {untried}"
    )


@pytest.mark.parametrize("row", TRIED, ids=[row.case for row in TRIED])
def test_bad_input_is_one_line_and_exit_2(row, tried):
    cases, results, _, _ = tried
    if row.case not in results:
        pytest.fail(f"docs/bad_input.md names the case {row.case!r}, which this file does not have")
    assert cases[row.case].script in row.example, (
        f"the example command does not run {cases[row.case].script}"
    )
    folder, result = results[row.case]
    assert str(result.returncode) == row.exit_code == "2", (
        f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    )
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.stderr and "weights_only" not in result.stderr
    shown = shorten(lines[0], folder)
    assert matches(shown, row.message), f"printed:\n{shown}\ndocs/bad_input.md says:\n{row.message}"


def test_bad_input_changes_and_adds_no_file(tried):
    _, _, before, after = tried
    assert sorted(after) == sorted(before), (
        f"added {sorted(set(after) - set(before))}, removed {sorted(set(before) - set(after))}"
    )
    assert [name for name in before if after[name] != before[name]] == [], "files changed"


# ---- the checks a row lists as "likewise": the same check, or its twin, on another flag ----------
# A process for each would double this file's time (each mostly imports torch), so these run in this
# one, through the very functions the trainers and tools call; the rows' own cases show the line and
# exit code.


def flags(*argv):
    """What the trainers' shared flags check (config.check_config), for ``argv``."""
    return lambda: check_config(vars(build_parser("step0_single_gpu").parse_args(list(argv))))


def fp8_check(config: dict):
    """What fp8.check_fp8 refuses (the trainers of steps 0-7 call it after check_amp)."""

    def run(monkeypatch):
        monkeypatch.syspath_prepend(str(REPO / "common"))
        from fp8 import check_fp8

        check_fp8(config, torch.device("cpu"))

    return run


def tool_main(module: str, *argv):
    def run(monkeypatch):
        import importlib

        monkeypatch.setattr(sys, "argv", [f"{module}.py", *argv])
        importlib.import_module(module).main()

    return run


def no_gpu(run):
    """``run`` where torch sees no GPU, whatever this machine has."""

    def without(monkeypatch):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        run(monkeypatch)

    return without


def gpu_without_bfloat16(monkeypatch):
    import training

    monkeypatch.setattr(training.torch.cuda, "is_bf16_supported", lambda *args, **kwargs: False)
    monkeypatch.setattr(training.torch.cuda, "get_device_name", lambda *args, **kwargs: "Tesla T4")
    training.check_amp("bf16", torch.device("cuda", 0))


def gpu_without_bfloat16_parameters(monkeypatch):
    import training

    monkeypatch.setattr(training.torch.cuda, "is_bf16_supported", lambda *args, **kwargs: False)
    monkeypatch.setattr(training.torch.cuda, "get_device_name", lambda *args, **kwargs: "Tesla T4")
    training.check_param_dtype({"param_dtype": "bf16", "amp": "none"}, torch.device("cuda", 0))


def gpu_budget_over_its_memory(monkeypatch):
    """What --max-memory-mb checks on a GPU (an H100's 81,559 MiB), before any work."""
    import types

    import memory_budget

    total = types.SimpleNamespace(total_memory=81559 * 2**20)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *args, **kwargs: total)
    memory_budget.limit_memory(100000, "step0_single_gpu", torch.device("cuda", 0))


def degrees_check(config: dict, world_size: int = 2):
    """What step 10 checks before joining (composition.check_degrees),
    on 2 ranks and a 2048-token vocabulary."""

    def run(monkeypatch):
        monkeypatch.syspath_prepend(str(REPO / STEPS["step10"]))
        import composition

        composition.check_degrees(config, world_size, 2048)

    return run


def experts_check(**flags):
    """Step 10's checks of experts on the mesh
    (experts_on_mesh.py), at --ep 2 and 4 experts on 2 ranks."""
    return degrees_check(
        {
            "dp": None,
            "tp": 1,
            "pp": 1,
            "cp": 1,
            "sequence_parallel": False,
            "n_head": 2,
            "seq_len": 32,
            "micro_batches": None,
            "grad_accum": 2,
            "n_layer": 2,
            "activation_checkpointing": "none",
            "dropout": 0.0,
            "ep": 2,
            "moe_experts": 4,
            "moe_capacity_factor": 0.0,
            **flags,
        }
    )


def zero_check(**flags):
    """Step 10's check of --zero (zero_stages.py),
    and of what ZeRO-3 on the mesh does not compose with."""

    def run(monkeypatch):
        monkeypatch.syspath_prepend(str(REPO / STEPS["step10"]))
        import zero_stages

        config = {"zero": 3, "sequence_parallel": False, "schedule": "1f1b", "moe_experts": 0}
        plane = {"cp": 1, "replicate": 1, "offload_optimizer": False}
        zero_stages.check_zero(plane | config | flags, dp=4)

    return run


def context_parallel_check(config: dict, ranks: int):
    """What step 11 checks before joining: rings of --cp ranks, 2 x cp chunks of the sequence."""

    def run(monkeypatch):
        monkeypatch.syspath_prepend(str(REPO / STEPS["step11"]))
        import context_parallel

        context_parallel.check_context_parallel(config, ranks)

    return run


def tensor_parallel_check(n_head: int, vocab_size: int, ranks: int):
    """What step 8 checks before joining: whole heads and whole vocabulary slices per rank."""

    def run(monkeypatch):
        monkeypatch.syspath_prepend(str(REPO / STEPS["step8"]))
        import tensor_parallel

        tensor_parallel.check_divisible(n_head, vocab_size, ranks)

    return run


def mesh_check(dp: int, tp: int, pp: int, world_size: int):
    """What step 10 checks before joining: degrees of at least 1 whose product is the world size."""

    def run(monkeypatch):
        monkeypatch.syspath_prepend(str(REPO / STEPS["step10"]))
        import mesh

        mesh.check_mesh(dp, tp, pp, world_size)

    return run


def slurm_without_scontrol(monkeypatch):
    """launch/slurm_command.py on a machine that is not a Slurm node:
    no scontrol to expand the node list."""
    monkeypatch.syspath_prepend(str(REPO / "launch"))
    monkeypatch.setenv("PATH", str(REPO / "no such folder"))
    import slurm_command

    slurm_command.job_hostnames({"SLURM_JOB_NODELIST": "gpu[07-08]"})


def replicate_check(replicate: int, world_size: int):
    """What step 7 checks before joining:
    --replicate R dividing the ranks into equal shard groups."""

    def run(monkeypatch):
        monkeypatch.syspath_prepend(str(REPO / STEPS["step7"]))
        import zero3_setup

        zero3_setup.check_replicate(replicate, world_size)

    return run


# message: what raises it (a function of pytest's monkeypatch, or of nothing; or several such)
LIKEWISE = {
    "--n-embd 100 must be divisible by --n-head 3": flags("--n-embd", "100", "--n-head", "3"),
    "--beta1 must be in [0, 1), got 1": flags("--beta1", "1"),
    "--beta2 must be in [0, 1), got -0.1": flags("--beta2", "-0.1"),
    "--dropout must be in [0, 1), got 1": flags("--dropout", "1"),
    "--lr must be positive, got 0": flags("--lr", "0"),
    "--lr must be positive, got nan": flags("--lr", "nan"),
    "--loss-scale-init must be positive, got 0": flags("--loss-scale-init", "0"),
    "--min-lr cannot be negative, got -1": flags("--min-lr", "-1"),
    "--weight-decay cannot be negative, got -0.1": flags("--weight-decay", "-0.1"),
    "--warmup-steps cannot be negative, got -1": flags("--warmup-steps", "-1"),
    "--grad-clip cannot be negative, got -1": flags("--grad-clip", "-1"),
    "--preempt-grace-s cannot be negative, got -1": flags("--preempt-grace-s", "-1"),
    "--data data is a folder, not a file; pass the file itself": flags(
        "--data", str(REPO / "data")
    ),
    "--timeout-s must be positive, got 0: it is how long a rank waits for its peers "
    "(default 300)": lambda: distributed.plan_world({"timeout_s": 0.0}),
    "--amp bf16 needs a GPU with bfloat16 support; Tesla T4 has none: use --amp fp16 "
    "or --amp none": gpu_without_bfloat16,
    "--param-dtype bf16 needs a GPU with bfloat16 support; Tesla T4 has none: use "
    "--param-dtype fp16": gpu_without_bfloat16_parameters,
    "--max-memory-mb 100000 is more than cuda:0's 81,559 MiB; lower it": gpu_budget_over_its_memory,
    "--nproc must be at least 1, got 0": tool_main("tour", "--nproc", "0"),
    "--timeout-s must be positive, got 0": tool_main("tour", "--timeout-s", "0"),
    "--budget-mb must be positive, got -1": tool_main("estimate", "--budget-mb", "-1"),
    "--memory-gb must be positive, got 0": tool_main("plan", "--memory-gb", "0"),
    "--params must be positive, got -1": tool_main("plan", "--params", "-1"),
    "--host-gbs must be positive, got 0": tool_main("plan", "--host-gbs", "0"),
    "--moe-every must be positive, got 0": tool_main(
        "plan", "--moe-experts", "4", "--moe-every", "0"
    ),
    "--expert-load draws one run, got 2: give one run": tool_main(
        "plot", "--expert-load", "step0", "step1"
    ),
    "--moe-preset describes the whole model: drop --preset, --params and --moe-experts": tool_main(
        "plan", "--moe-preset", "mixtral-8x7b", "--preset", "gpt2"
    ),
    "--global-batch 7 is not a multiple of --devices x --micro-batch-size (4)": tool_main(
        "plan",
        "--moe-experts",
        "4",
        "--devices",
        "4",
        "--micro-batch-size",
        "1",
        "--global-batch",
        "7",
    ),
    "tensor parallelism over 8 ranks needs --n-head divisible by 8, got 4 (more ranks "
    "than heads): run on a number of "
    "ranks that divides 4, or change --n-head (and --n-embd)": tensor_parallel_check(4, 2048, 8),
    "--sequence-parallel splits the sequence over the tp group: use it with --tp 2 or "
    "more": degrees_check(
        {
            "dp": None,
            "tp": 1,
            "pp": 1,
            "cp": 1,
            "sequence_parallel": True,
            "n_head": 2,
            "seq_len": 32,
            "micro_batches": None,
            "grad_accum": 2,
            "n_layer": 2,
        }
    ),
    "--activation-checkpointing selective with --cp: the ring keeps no s x s tensor to "
    "recompute; use full, or none": degrees_check(
        {
            "dp": None,
            "tp": 1,
            "pp": 1,
            "cp": 2,
            "sequence_parallel": False,
            "n_head": 2,
            "seq_len": 32,
            "micro_batches": None,
            "grad_accum": 2,
            "n_layer": 2,
            "activation_checkpointing": "selective",
        }
    ),
    "--attention sdpa (a GPU's default) with --dropout under tensor parallelism: the "
    "fused kernel would draw "
    "attention's masks for this rank's heads alone, the same on every rank; use "
    "--attention math": degrees_check(
        {
            "dp": None,
            "tp": 2,
            "pp": 1,
            "cp": 1,
            "sequence_parallel": False,
            "n_head": 2,
            "seq_len": 32,
            "micro_batches": None,
            "grad_accum": 2,
            "n_layer": 2,
            "activation_checkpointing": "none",
            "dropout": 0.1,
            "attention": "sdpa",
        }
    ),
    "--dp 1 x --cp 3 x --tp 1 x --pp 1 = 3 ranks, but the job has 2: launch 3 "
    "processes (torchrun --nproc_per_node), "
    "or choose degrees whose product is 2": degrees_check(
        {
            "dp": None,
            "tp": 1,
            "pp": 1,
            "cp": 3,
            "sequence_parallel": False,
            "n_head": 2,
            "seq_len": 36,
            "micro_batches": None,
            "grad_accum": 2,
            "n_layer": 2,
            "activation_checkpointing": "none",
        }
    ),
    "--cp 3: step 11 cuts --seq-len 64 into 2 x 3 chunks; use degrees whose 2 x C "
    "divides it": tool_main("activations", "--cp", "1", "3"),
    "--cp 3 does not divide the 4 ranks into rings: launch a multiple of 3 processes, "
    "or change --cp": context_parallel_check({"seq_len": 36, "dropout": 0.0, "cp": 3}, 4),
    "--seq-len 36 is cut into 2 x 4 chunks for 4 ranks: use a multiple of 8": tool_main(
        "cp_reference", "--device", "cpu", "--cp", "4", "--seq-len", "36"
    ),
    "scontrol is not on PATH: run this on a node of the Slurm job": slurm_without_scontrol,
    "--replicate 3 does not divide the 1 ranks: choose R with N / R whole (the ranks "
    "of one node, typically), or "
    "launch a multiple of 3 ranks": tool_main("fsdp2_reference", "--replicate", "3"),
    "--fp8 with --moe-experts is not built yet (an expert's tokens are not a multiple "
    "of 16); drop one of them": fp8_check({"fp8": "rowwise", "amp": "none", "moe_experts": 4}),
    "--fp8 with --compile is not tried yet; drop one of them": fp8_check(
        {"fp8": "rowwise", "amp": "none", "compile": True}
    ),
    "--device cuda asked for, but torch sees no CUDA GPU; use --device cpu": (
        no_gpu(tool_main("cp_reference")),
        no_gpu(tool_main("gpu_check")),
    ),
    "--moe-every must be at least 1, got 0": lambda: moe_check(moe_experts=4, moe_every=0),
    "--ep 2 splits the experts of a mixture of experts: give --moe-experts E (a "
    "multiple of 2), or drop "
    "--ep": experts_check(ep=2, moe_experts=0),
    "--ep 0: the expert-parallel degree must be at least 1": experts_check(ep=0),
    "--moe-experts 3 is not divisible by --ep 2: each rank holds E/D experts; choose E "
    "a multiple of 2": (experts_check(moe_experts=3)),
    "--dropout with --moe-experts and --ep, --cp or --pp above 1: an expert draws its "
    "mask over the slots it "
    "receives, known once routed, on the rank that owns it, so no rank can draw one "
    "process's masks; use "
    "--dropout 0": experts_check(dropout=0.1),
    "--sequence-parallel with --moe-experts: each tp rank would route its S/T tokens "
    "and the experts' "
    "gradients would need adding over tp; use one of the two": experts_check(
        tp=2, ep=1, sequence_parallel=True
    ),
    "--activation-checkpointing full with --moe-experts: recomputing a block would run "
    "its experts' "
    "all-to-alls and count its tokens again; use selective, or none": experts_check(
        activation_checkpointing="full"
    ),
    "--moe-experts cannot be negative, got -2": lambda: moe_check(moe_experts=-2),
    "--zero 4: step 10 runs ZeRO 0, 1, 2 or 3 over dp x cp; use one of them": zero_check(zero=4),
    "--replicate 2 replicates ZeRO-3's shard groups (HSDP): use it with --zero 3, or "
    "leave it out": zero_check(zero=1, replicate=2),
    "--replicate 0: the number of replicas must be at least 1": (
        replicate_check(0, 4),
        zero_check(replicate=0),
    ),
    "--offload-optimizer steps ZeRO-3's pieces on the host: use it with --zero 3, or "
    "leave it out": zero_check(zero=2, offload_optimizer=True),
    "--zero 3 with --schedule zero-bubble: its W computes the weight gradients after "
    "the backward whose end "
    "reduce-scatters them; use 1f1b, gpipe or interleaved-1f1b, or --zero 2": zero_check(
        schedule="zero-bubble"
    ),
    "--zero 3 with --moe-experts: the experts' gradients have groups of their own, not "
    "the dp x cp plane ZeRO-3 "
    "shards over; use --zero 0, 1 or 2": zero_check(moe_experts=4),
}


def moe_check(**flags):
    import moe_setup  # common/moe_setup.py: the MoE flags' checks (steps 0, 10 and 12)

    moe_setup.check_moe({key: None for key in moe_setup.MOE_DEFAULTS} | flags)


# The ones the doc quotes word for word (the others it
# gives by their form: "must be positive, got ...").
QUOTED = (
    "--moe-every must",
    "--moe-experts cannot",
    "--n-embd 100 must",
    "--beta1 must",
    "--data data is",
    "--amp bf16",
    "--nproc must",
    "--dp 0 --tp 2",
    "--sequence-parallel splits",
    "--cp 3",
    "--activation-checkpointing selective with --cp",
    "--attention sdpa (a GPU",
    "--param-dtype bf16",
    "--max-memory-mb 100000",
    "scontrol is not",
    "--fp8 with --compile",
    "--fp8 with --moe",
    "--ep 2 splits",
    "--ep 0:",
    "--dropout with --moe",
    "--sequence-parallel with --moe",
    "--activation-checkpointing full with --moe",
    "--zero 4",
    "--zero 3 with --schedule",
    "--zero 3 with --moe",
    "--replicate 2 replicates",
    "--offload-optimizer steps",
)


@pytest.mark.parametrize("message", LIKEWISE)
def test_a_likewise_check_refuses_in_its_own_words(message, monkeypatch):
    for raises in (
        LIKEWISE[message] if isinstance(LIKEWISE[message], tuple) else (LIKEWISE[message],)
    ):
        with pytest.raises(UserError) as refused:
            raises(monkeypatch) if raises.__code__.co_argcount else raises()
        assert shorten(str(refused.value), REPO) == message
    if message.startswith(QUOTED):
        assert message.replace("Tesla T4", "<GPU>") in TABLE.read_text(), (
            f"docs/bad_input.md does not quote {message!r}"
        )
