"""A model that does not fit on one rank (docs/zero3.md), smaller: at one per-rank budget
enforced by the OS (--max-memory-mb, RLIMIT_DATA), step 1 (DDP) ends with one error line and exit 2,
and step 7 (ZeRO-3) trains at 4 ranks."""

import os
import socket
import subprocess
import sys

import pytest

import estimate  # compare/, on the path through conftest
from conftest import REPO, STEPS, metrics, trainer_command

# The README's demo is 16 x 1024 (Ψ = 204M) in 2048 MiB; this is 12 x 512 (Ψ = 39M) in 512 MiB.
SMALL = [
    "--n-layer",
    "12",
    "--n-embd",
    "512",
    "--n-head",
    "8",
    "--seq-len",
    "64",
    "--micro-batch-size",
    "1",
    "--grad-accum",
    "1",
    "--steps",
    "2",
    "--save-every",
    "0",
    "--quiet",
]
BUDGET_MB = 512


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def test_a_model_that_does_not_fit_on_one_rank_trains_sharded(tmp_path, small_corpus):
    config = {
        "n_layer": 12,
        "n_embd": 512,
        "n_head": 8,
        "seq_len": 64,
        "dropout": 0.0,
        "weight_decay": 0.1,
    }
    psi = estimate.Model(
        config, estimate.vocabulary_size(str(REPO / "data" / "tokenizer.json"))
    ).psi
    assert 16 * psi > BUDGET_MB * 2**20, "the full training state must exceed the budget"

    args = [*SMALL, "--data", str(small_corpus), "--max-memory-mb", str(BUDGET_MB)]
    # Started together. DDP's memory does not depend on the number of ranks: one process shows it.
    ddp = subprocess.Popen(
        trainer_command(STEPS["step1"], 0, [*args, "--out", str(tmp_path / "ddp")]),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "MASTER_PORT": free_port()},
    )
    zero3 = subprocess.Popen(
        trainer_command(
            STEPS["step7"], 4, [*args, "--out", str(tmp_path / "zero3"), "--timeout-s", "60"]
        ),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    ddp_out, ddp_err = ddp.communicate(timeout=240)
    zero3_out, zero3_err = zero3.communicate(timeout=240)

    assert ddp.returncode == 2, f"exit {ddp.returncode}\n{ddp_out}\n{ddp_err}"
    lines = ddp_err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: out of memory: "), ddp_err
    for words in (
        f"--max-memory-mb {BUDGET_MB}",
        "RLIMIT_DATA",
        STEPS["step1"],
        "step7_zero3",
        "more ranks",
    ):
        assert words in lines[0], f"{words!r} not in {lines[0]!r}"
    assert not (tmp_path / "ddp" / "metrics.json").exists()

    assert zero3.returncode == 0, zero3_out[-3000:] + zero3_err[-3000:]
    run = metrics(tmp_path / "zero3")
    assert run["config"]["max_memory_mb"] == BUDGET_MB and run["env"]["world_size"] == 4
    assert len(run["records"]) == 2
    # each rank holds a quarter of the 16Ψ that did not fit
    for memory in run["records"][-1]["memory"]:
        state = memory["params"] + memory["grads"] + memory["optimizer_state"]
        assert abs(state / (16 * psi / 4) - 1) < 0.02, state


def run_python(code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO / "common",
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


def test_out_of_memory_is_one_line_and_exit_2_and_other_errors_keep_their_traceback():
    oom = run_python(
        "import config, memory_budget\n"
        "def main():\n"
        '    raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] '
        "DefaultCPUAllocator: can't allocate "
        'memory: you tried to allocate 16777216 bytes. Error code 12 (Cannot allocate memory)")\n'
        "memory_budget.budget.update(mb=64, step='step6_zero2', start_mb=400)\n"
        "config.exit_on_user_error(main)",
        env={"RANK": "1", "WORLD_SIZE": "4"},
    )
    assert oom.returncode == 2 and oom.stderr.count("\n") == 1, oom.stderr
    assert oom.stderr.startswith(
        "error: out of memory: rank 1 of 4 could not allocate 16.0 MiB more within "
        "--max-memory-mb 64 (RLIMIT_DATA: 400 MiB held at start-up + 64 MiB); "
        "step6_zero2 keeps the weights on every rank"
    ), oom.stderr
    python_oom = run_python(
        "import config\ndef main():\n    return [0] * (2**62)\nconfig.exit_on_user_error(main)"
    )
    assert python_oom.returncode == 2 and python_oom.stderr.startswith(
        "error: out of memory: this process could not get more memory"
    ), python_oom.stderr
    other = run_python(
        "import config\n"
        "def main():\n"
        "    raise RuntimeError('a bug')\n"
        "config.exit_on_user_error(main)"
    )
    assert other.returncode == 1 and "Traceback" in other.stderr and "a bug" in other.stderr


def test_a_budget_that_cannot_be_one_is_a_user_error():
    """Checked while the flags are parsed, before any limit is set (so, safely, in this process)."""
    import config

    for value in (0, -5):
        with pytest.raises(
            config.UserError, match=f"--max-memory-mb must be positive, got {value}"
        ):
            config.parse_config(
                config.build_parser("step0_single_gpu"), ["--max-memory-mb", str(value)]
            )
