"""Step 0, step 1, the metrics file, the parity tool, bad input, and the copies of common/."""

import json
import re
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from conftest import (
    EXACT,
    PIPELINE,
    REPO,
    STEPS,
    TINY,
    assert_bitwise_same_run,
    launch,
    metrics,
    other_order_drift,
    parity,
    regrouped_drift,
    train,
    weights,
)


def test_step0_two_identical_runs_are_bitwise_identical(tmp_path, small_corpus):
    """With dropout on, so the RNG state matters."""
    runs = [
        train("step0", tmp_path / f"run{i}", small_corpus, "--dropout", "0.1", "--steps", "6")
        for i in range(2)
    ]
    assert_bitwise_same_run(*runs)


@pytest.mark.parametrize("step", sorted(STEPS))
def test_resume_from_a_checkpoint_is_bitwise_with_dropout(
    step, exact_run, pipeline_runs, tmp_path, small_corpus
):
    """Every step: resumed from step_2 of a 4-step run, steps 3 and 4 come out bit for bit, with
    dropout on. A step that forgot to restore the data position would train on other batches; one
    that forgot the RNG state would draw other dropout masks. The 2-rank exact-mode runs (dropout,
    bf16, checkpoints) are the originals where they exist; step 9's is its tests' 2-stage 1F1B run
    (dropout, bf16, checkpoints); step 0 (one process), step 2 and step 12 (with two experts) train
    their own."""
    if step in ("step0", "step2"):
        extra = ["--dropout", "0.1", "--save-every", "2"]
        original = train(step, tmp_path / "original", small_corpus, *extra)
    elif step == "step9":
        extra, original = (
            [*PIPELINE, "--schedule", "1f1b"],
            pipeline_runs(step, 2, "--schedule", "1f1b"),
        )
    elif step == "step12":  # step 12 trains only a mixture of experts: 2 experts, one on each rank
        extra = [*EXACT, "--moe-experts", "2", "--ep", "2"]
        original = train(step, tmp_path / "original", small_corpus, *extra)
    else:
        extra, original = list(EXACT), exact_run(step, 2)
    copy = tmp_path / "copy"
    shutil.copytree(original, copy)
    # what is compared must come from the resumed run
    for name in ("metrics.json", "model.safetensors"):
        (copy / name).unlink()
    result = launch(
        step,
        [
            *TINY,
            "--data",
            str(small_corpus),
            "--out",
            str(copy),
            *extra,
            "--resume",
            str(original / "checkpoints" / "step_2"),
        ],
        nproc=2,
    )
    assert result.returncode == 0, (
        f"{step} resume failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    )
    assert "resumed from" in result.stdout and "at step 2" in result.stdout, result.stdout
    assert_bitwise_same_run(original, copy)


def test_step0_fp16_with_its_gradient_scaler_resumes_bitwise(tmp_path, small_corpus):
    """fp16 autocast runs on this CPU build;
    the scaler's state (scale, growth tracker) is checkpointed."""
    original = train("step0", tmp_path / "fp16", small_corpus, "--amp", "fp16", "--save-every", "2")
    resumed = train(
        "step0",
        tmp_path / "resumed",
        small_corpus,
        "--amp",
        "fp16",
        "--save-every",
        "2",
        "--resume",
        str(original / "checkpoints" / "step_2"),
    )
    assert_bitwise_same_run(original, resumed)
    assert metrics(original)["env"]["autocast_dtype"] == "float16"


def test_resume_latest_continues_in_place(step1_ws2, tmp_path, small_corpus):
    """--resume with no path takes the newest checkpoint in --out;
    a finished run just rewrites its result."""
    out = tmp_path / "run"
    shutil.copytree(step1_ws2, out)
    shutil.rmtree(out / "checkpoints" / "step_4")
    result = launch(
        "step1",
        [*TINY, "--data", str(small_corpus), "--out", str(out), "--save-every", "2", "--resume"],
        nproc=2,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "resumed from" in result.stdout and "step_2" in result.stdout
    assert_bitwise_same_run(step1_ws2, out)


@pytest.mark.quick
def test_metrics_schema(step1_ws2):
    m = metrics(step1_ws2)
    assert m["schema_version"] == 2
    assert (
        m["env"]["world_size"] == 2
        and m["env"]["backend"] == "gloo"
        and m["env"]["torch"] == torch.__version__
    )
    assert m["config"]["steps"] == len(m["records"]) == 4
    for i, r in enumerate(m["records"], start=1):
        assert r["step"] == i
        for key in ("loss", "grad_norm", "param_norm", "lr", "tokens_per_s"):
            assert isinstance(r[key], float) and r[key] == r[key], key  # a float, not NaN
        assert r["effective_batch_size"] == 2 * 2 * 2
        assert len(r["memory"]) == 2, "one memory entry per rank"
        for memory in r["memory"]:  # DDP replicates everything: every rank holds the same bytes
            assert set(memory) >= {"params", "grads", "optimizer_state", "peak_rss"}
            # AdamW keeps exp_avg and exp_avg_sq (each the
            # size of the parameter) and a float32 step count
            assert memory["optimizer_state"] == 2 * memory["params"] + 4 * len(weights(step1_ws2))
            assert memory["grads"] == memory["params"]
        # every gradient, once per optimiser step
        assert r["comm"]["all_reduce"] == r["memory"][0]["grads"]
    assert any(r["grad_norm"] > 0.3 for r in m["records"]), (
        "clipping never triggered in the tiny workload"
    )
    final = m["final"]
    assert (step1_ws2 / final["weights"]).is_file()
    assert set(final["fingerprints"]) == set(weights(step1_ws2))
    assert abs(final["param_norm"] - m["records"][-1]["param_norm"]) == 0.0


def test_step1_reduce_modes_at_world_size_2(step1_ws2, tmp_path, small_corpus):
    """At world size 2 a float32 sum is already order-free (a+b == b+a) and halving is exact, so the
    float64 mode (sum in float64, divide, round once) must give the same bits."""
    exact = train("step1", tmp_path / "exact", small_corpus, "--reduce-dtype", "float64")
    assert (
        metrics(exact)["records"][0]["comm"]["all_reduce"]
        == 2 * metrics(step1_ws2)["records"][0]["comm"]["all_reduce"]
    )
    result = parity(step1_ws2, exact)
    assert result.returncode == 0, result.stdout
    assert "verdict: PASS (bitwise identical)" in result.stdout


@pytest.mark.quick
def test_step0_drifts_from_step1_no_further_than_one_process_regrouped(
    tour, step1_ws2, order_reference, tmp_path, small_corpus
):
    """One process accumulating 4 micro-batches (the tour's step 0) sees the global batches of 2
    ranks accumulating 2, summed in another order. How far that drifts depends on the CPU's kernels,
    so the bound is measured here: the same process regrouping the same 8 samples a step (8
    micro-batches of 1, 2 of 4) is another order too, and step 0 stays within
    compare/other_order.py's factor of the larger of those two drifts (measured: 1.3-1.8x on three
    kernel paths), its first loss to float32's rounding. parity.py's fixed tolerances (the
    contract's) are printed beside it, as information."""
    single = tour[0] / "step0_single_gpu"
    assert metrics(single)["config"]["grad_accum"] == 4
    reference = regrouped_drift(single, small_corpus, tmp_path)
    drift, beyond = other_order_drift(reference, step1_ws2, single)
    assert drift == order_reference  # the same pair the other tests' bound comes from
    contract = parity(single, step1_ws2)
    assert contract.returncode in (0, 1), contract.stderr[-2000:]
    assert not beyond, f"{beyond}; step 0 regrouped: {reference}\n{contract.stdout[-1500:]}"
    # another order: bitwise would mean one of the runs did not sum what it says
    assert drift.weights > 0


# ---- the parity tool -----------------------------------------------------------------------------


@pytest.mark.quick
def test_parity_passes_on_a_run_and_its_copy(step1_ws2, tmp_path):
    shutil.copytree(step1_ws2, tmp_path / "copy")
    result = parity(step1_ws2, tmp_path / "copy")
    assert result.returncode == 0
    assert "verdict: PASS (bitwise identical)" in result.stdout
    assert "transformer.wte.weight" in result.stdout  # the per-tensor table


@pytest.mark.quick
def test_parity_fails_on_a_changed_weight_and_names_it(step1_ws2, tmp_path):
    changed = tmp_path / "changed"
    shutil.copytree(step1_ws2, changed)
    w = weights(changed)
    w["transformer.h.1.mlp.c_fc.bias"][3] += 1e-4
    save_file(w, str(changed / "model.safetensors"))
    result = parity(step1_ws2, changed)
    assert result.returncode == 1, result.stdout
    assert "verdict: FAIL" in result.stdout
    line = next(l for l in result.stdout.splitlines() if "transformer.h.1.mlp.c_fc.bias" in l)
    assert "NO" in line and "1.000e-04" in line


@pytest.mark.quick
def test_parity_fails_on_a_param_norm_drift(step1_ws2, tmp_path):
    drifted = tmp_path / "drifted"
    shutil.copytree(step1_ws2, drifted)
    m = metrics(drifted)
    m["records"][2]["param_norm"] += 2e-6
    (drifted / "metrics.json").write_text(json.dumps(m))
    result = parity(step1_ws2, drifted)
    assert result.returncode == 1
    assert "first over the limit at step 3" in result.stdout


# ---- bad input to the trainers: every case is in tests/test_bad_input.py (docs/bad_input.md) -----


@pytest.mark.quick
def test_help_says_what_a_switch_does_without_a_misleading_default():
    """ArgumentDefaultsHelpFormatter printed "--nondeterministic ... (default: True)": the value of
    the setting the switch turns off, read as "nondeterministic by default". Switches say nothing of
    a default; the rest keep it."""
    from config import build_parser

    text = " ".join(build_parser("step0_single_gpu").format_help().split())
    start = text.index("--nondeterministic torch's")
    switch = text[start : text.index("--max-memory-mb MB", start)]
    assert "(default:" not in switch and "Without it, every kernel is deterministic" in switch, (
        switch
    )
    assert "--steps STEPS optimiser steps (default: 40)" in text


@pytest.mark.quick
def test_unsupported_amp_is_refused_with_one_line(monkeypatch):
    """fp16 where the build cannot run it (simulated:
    the CPU scaler refuses) is a UserError, not a traceback."""
    import training
    from config import UserError

    def no_scaler(*args, **kwargs):
        raise RuntimeError("GradScaler is not supported on this device\nmore detail")

    monkeypatch.setattr(training.torch.amp, "GradScaler", no_scaler)
    with pytest.raises(UserError, match="--amp fp16 cannot run on cpu"):
        training.check_amp("fp16", torch.device("cpu"))
    training.check_amp("bf16", torch.device("cpu"))  # bf16 autocast runs on every CPU


# ---- the repository itself -----------------------------------------------------------------------


@pytest.mark.quick
def test_copies_match_their_origin():
    result = subprocess.run(
        [sys.executable, str(REPO / "common" / "sync_copies.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout


@pytest.mark.quick
def test_copy_check_catches_drift(tmp_path):
    clone = tmp_path / "repo"
    shutil.copytree(REPO, clone, ignore=shutil.ignore_patterns("runs", ".git", "__pycache__"))
    with open(clone / "step1_torch_ddp" / "model.py", "a") as f:
        f.write("# a local edit\n")
    result = subprocess.run(
        [sys.executable, str(clone / "common" / "sync_copies.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 1
    assert "step1_torch_ddp/model.py" in result.stdout


def test_committed_tokenizer_is_what_the_script_builds():
    result = subprocess.run(
        [sys.executable, str(REPO / "data" / "train_tokenizer.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout


@pytest.mark.quick
def test_steps_never_import_from_another_folder():
    """A step folder is standalone: every module it imports is a file in the folder or a package."""
    for folder in (p for p in REPO.glob("step*_*") if re.fullmatch(r"step\d+_\w+", p.name)):
        local = {p.stem for p in folder.glob("*.py")}
        for py in folder.glob("*.py"):
            text = py.read_text()
            assert "sys.path" not in text, f"{py} edits sys.path"
            assert "from common" not in text and "import common" not in text, py
        assert (folder / "README.md").is_file(), f"{folder} has no README"
        assert {"train.py"} <= {p.name for p in folder.glob("*.py")} and local
