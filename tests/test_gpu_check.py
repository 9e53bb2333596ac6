"""compare/gpu_check.py in its CPU mode (tiny sizes), so the GPU check cannot rot where no GPU is: every section
but the tour runs as a user would start it, and the memory section reads the session's tour runs (the tour
itself is tests/test_plot_and_tour.py's)."""
import sys

import gpu_check  # compare/, on the path through conftest
from conftest import REPO, STEPS, run_forked


def test_the_cpu_mode_runs_every_section_and_writes_its_report(tmp_path):
    report = tmp_path / "report.md"
    result = run_forked([sys.executable, str(REPO / "compare" / "gpu_check.py"), "--device", "cpu", "--out",
                         str(tmp_path / "runs"), "--report", str(report), "--only", "resume", "speed", "fits",
                         "offload"],
                        timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-3000:]
    text = report.read_text()
    assert text.startswith("# GPU check (cpu)") and text.rstrip().splitlines()[-1].startswith("every section passed")
    for title in ("Resume and repeat (step 0): PASS", "Speed: step 0 beside a plain PyTorch loop: PASS",
                  "A model that does not fit one rank's budget: PASS", "ZeRO-Offload (step 7): PASS"):
        assert f"## {title}" in text, text
    assert text.count("(bitwise identical)") == 3  # the second run, the resumed one, the offloaded one
    assert "step 1 (DDP): exit 1: `error: out of memory" in text and "step 7 (ZeRO-3): trained 2 steps" in text
    for run in ("plain loop, SDPA |", "plain loop, SDPA, deterministic |", "step 0, SDPA |",
                "step 0, SDPA, --nondeterministic |", "step 0, SDPA: train_step alone (records' step_time) |"):
        assert f"| {run}" in text, text


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
