"""compare/gpu_check.py in its CPU mode (tiny sizes), so the GPU check cannot rot where no GPU is:
every section but the tour runs as a user would start it, and the memory section reads the session's
tour runs (the tour itself is tests/test_plot_and_tour.py's)."""

import sys

import pytest
import torch

import gpu_check  # compare/, on the path through conftest
from conftest import REPO, STEPS, fp8_cannot_run, run_forked


def test_the_cpu_mode_runs_every_section_and_writes_its_report(tmp_path):
    report = tmp_path / "report.md"
    result = run_forked(
        [
            sys.executable,
            str(REPO / "compare" / "gpu_check.py"),
            "--device",
            "cpu",
            "--out",
            str(tmp_path / "runs"),
            "--report",
            str(report),
            "--only",
            "resume",
            "speed",
            "fits",
            "offload",
            "context",
            "experts",
            "fp8",
        ],
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-3000:]
    text = report.read_text()
    assert text.startswith("# GPU check (cpu)") and text.rstrip().splitlines()[-1].startswith(
        "every section passed"
    )
    for title in (
        "Resume and repeat (step 0): PASS",
        "Speed: step 0 beside a plain PyTorch loop: PASS",
        "A model that does not fit one rank's budget: PASS",
        "ZeRO-Offload (step 7): PASS",
        "Context parallelism: step 11's ring beside PyTorch's context_parallel: PASS",
        "Expert parallelism: step 12 at --ep 2 against step 0: PASS",
        "FP8: step 0 in bf16 beside --fp8 tensorwise and rowwise: PASS",
    ):
        assert f"## {title}" in text, text
    # the second run, the resumed one, the offloaded one, step 12
    assert text.count("(bitwise identical)") == 4
    # 2 ranks x 2 MoE layers x 1 micro-batch x 3 steps;
    # a rank's bytes off the formula would be named
    assert (
        "all-to-all bytes, 12 notes (ranks x MoE layers x micro-batches x steps): "
        "every one the formula" in text
    )
    step12 = tmp_path / "runs" / "experts" / "step12" / "metrics.json"
    step12.write_text(step12.read_text().replace('"bytes": ', '"bytes": 1', 1))
    checked, off = gpu_check.all_to_all_off_formula(step12.parent)
    assert checked == 12 and len(off) == 1 and off[0].startswith("step 1 rank 0 note 0: 1"), off
    assert (
        "step 1 (DDP): exit 1: `error: out of memory" in text
        and "step 7 (ZeRO-3): trained 2 steps" in text
    )
    for run in (
        "plain loop, SDPA |",
        "plain loop, SDPA, deterministic |",
        "step 0, SDPA |",
        "step 0, SDPA, --nondeterministic |",
        "step 0, SDPA: train_step alone (records' step_time) |",
    ):
        assert f"| {run}" in text, text
    # FP8: every recipe this CPU's _scaled_mm runs is timed;
    # one it cannot is skipped in one line, saying why
    fp8 = text[text.index("## FP8") :]
    assert "| bf16 autocast | " in fp8 and "| bf16 autocast + --fp8 tensorwise | " in fp8, fp8
    rowwise_runs = fp8_cannot_run("rowwise", torch.device("cpu")) is None
    assert ("| bf16 autocast + --fp8 rowwise | " in fp8) == rowwise_runs, fp8
    assert ("- bf16 autocast + --fp8 rowwise: skipped, " in fp8) != rowwise_runs, fp8


def test_the_context_section_fails_a_ring_off_whole_attention_or_off_pytorchs():
    """compare/cp_reference.py's verdict: the ring within its bound of whole attention on every rank
    (float32 on the CPU: 1e-5), and on a GPU within twice PyTorch's ring's error where that ran."""
    import cp_reference

    errors = lambda e: dict.fromkeys(cp_reference.NAMES, e)  # noqa: E731
    rank = {
        "backend": "gloo",
        "ours": errors(3e-7),
        "ours_ms": 1.0,
        "ours_peak": 0,
        "theirs": "not run: CUDA only",
    }
    config = {"device": "cpu", "batch": 1, "heads": 2, "head_dim": 16, "seq_len": 256, "repeats": 2}
    assert cp_reference.report({0: rank, 1: rank}, config)[1]
    assert not cp_reference.report(
        {0: rank, 1: {**rank, "ours": {**errors(3e-7), "dk": 2e-5}}}, config
    )[1]
    gpu = {**config, "device": "cuda"}
    ran = {**rank, "ours": errors(4e-3), "theirs": errors(3e-3), "theirs_ms": 1.0, "theirs_peak": 0}
    assert cp_reference.report({0: ran, 1: ran}, gpu)[1]
    text, ok = cp_reference.report(
        {0: ran, 1: {**ran, "ours": errors(6e-3), "theirs": errors(1e-3)}}, gpu
    )
    assert not ok and "within twice PyTorch's ring's error: NO" in text


def test_the_memory_section_reads_the_tours_runs_against_the_formulas(tour, tmp_path):
    runs, _ = tour
    check = gpu_check.Check("cpu", tmp_path, tmp_path / "report.md", "# header\n")
    gpu_check.check_memory(check, 2, runs)
    assert check.verdicts == {2: True}
    text = (tmp_path / "report.md").read_text()
    for step in ("step1", "step5", "step6", "step7"):
        assert STEPS[step] in text
    assert text.count("every rank within 2% of the formula: yes") == 4
    # a run whose bytes are off the formula fails the section
    broken = tmp_path / "broken"
    for step in ("step1", "step5", "step6", "step7"):
        (broken / STEPS[step]).mkdir(parents=True)
        for name in ("metrics.json", "model.safetensors"):
            source = runs / STEPS[step] / name
            (broken / STEPS[step] / name).write_bytes(source.read_bytes())
    metrics = broken / STEPS["step5"] / "metrics.json"
    metrics.write_text(metrics.read_text().replace('"optimizer_state": ', '"optimizer_state": 1'))
    gpu_check.check_memory(check, 3, broken)
    assert check.verdicts[3] is False and not check.passed


def test_the_fp8_section_skips_what_the_device_cannot_run_in_one_line(tmp_path, monkeypatch):
    """A device whose _scaled_mm runs no recipe (a GPU before compute capability 8.9): each recipe
    skipped in one line saying why, the section not run (not failed), and no trainer started."""
    why = "torch._scaled_mm is only supported on CUDA devices with compute capability >= 9.0 or 8.9"
    monkeypatch.setattr(gpu_check, "fp8_cannot_run", lambda recipe, device: why)
    monkeypatch.setattr(gpu_check, "run", lambda *a, **k: pytest.fail("a trainer was started"))
    check = gpu_check.Check("cpu", tmp_path, tmp_path / "report.md", "# header\n")
    gpu_check.check_fp8_speed(check, 9)
    assert check.verdicts == {9: None} and check.passed
    text = (tmp_path / "report.md").read_text()
    assert "## FP8: step 0 in bf16 beside --fp8 tensorwise and rowwise: not run" in text, text
    for recipe in ("tensorwise", "rowwise"):
        line = (
            f"- bf16 autocast + --fp8 {recipe}: skipped, this device's `_scaled_mm` cannot "
            f"run it (`{why}`)"
        )
        assert line in text.splitlines(), text
