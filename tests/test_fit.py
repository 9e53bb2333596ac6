"""A model that does not fit on one rank (step7_zero3/README.md), smaller: at one per-rank budget
enforced by the OS (--max-memory-mb, RLIMIT_DATA), step 1 (DDP) ends with one error line and exit 2,
and step 7 (ZeRO-3) trains at 4 ranks."""
import os
import socket
import subprocess

import estimate  # compare/, on the path through conftest
from conftest import REPO, STEPS, metrics, trainer_command

# The README's demo is 16 x 1024 (Ψ = 204M) in 2048 MiB; this is 12 x 512 (Ψ = 39M) in 512 MiB.
SMALL = ["--n-layer", "12", "--n-embd", "512", "--n-head", "8", "--seq-len", "64", "--micro-batch-size", "1",
         "--grad-accum", "1", "--steps", "2", "--save-every", "0", "--quiet"]
BUDGET_MB = 512


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def test_a_model_that_does_not_fit_on_one_rank_trains_sharded(tmp_path, small_corpus):
    config = {"n_layer": 12, "n_embd": 512, "n_head": 8, "seq_len": 64, "dropout": 0.0, "weight_decay": 0.1}
    psi = estimate.Model(config, estimate.vocabulary_size(str(REPO / "data" / "tokenizer.json"))).psi
    assert 16 * psi > BUDGET_MB * 2**20, "the full training state must exceed the budget"

    args = [*SMALL, "--data", str(small_corpus), "--max-memory-mb", str(BUDGET_MB)]
    # Started together. DDP's memory does not depend on the number of ranks: one process shows it.
    ddp = subprocess.Popen(trainer_command(STEPS["step1"], 0, [*args, "--out", str(tmp_path / "ddp")]), cwd=REPO,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env={**os.environ, "MASTER_PORT": free_port()})
    zero3 = subprocess.Popen(trainer_command(STEPS["step7"], 4, [*args, "--out", str(tmp_path / "zero3"),
                                                                 "--timeout-s", "60"]),
                             cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ddp_out, ddp_err = ddp.communicate(timeout=240)
    zero3_out, zero3_err = zero3.communicate(timeout=240)

    assert ddp.returncode == 2, f"exit {ddp.returncode}\n{ddp_out}\n{ddp_err}"
    lines = ddp_err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: out of memory: "), ddp_err
    for words in (f"--max-memory-mb {BUDGET_MB}", "RLIMIT_DATA", STEPS["step1"], "step7_zero3", "more ranks"):
        assert words in lines[0], f"{words!r} not in {lines[0]!r}"
    assert not (tmp_path / "ddp" / "metrics.json").exists()

    assert zero3.returncode == 0, zero3_out[-3000:] + zero3_err[-3000:]
    run = metrics(tmp_path / "zero3")
    assert run["config"]["max_memory_mb"] == BUDGET_MB and run["env"]["world_size"] == 4
    assert len(run["records"]) == 2
    for memory in run["records"][-1]["memory"]:  # each rank holds a quarter of the 16Ψ that did not fit
        state = memory["params"] + memory["grads"] + memory["optimizer_state"]
        assert abs(state / (16 * psi / 4) - 1) < 0.02, state
