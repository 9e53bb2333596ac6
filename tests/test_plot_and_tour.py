"""compare/plot.py on runs made up for the test,
and compare/tour.py (the main job) on the tiny workload."""

import json
import re
import sys

import pytest

from conftest import REPO, STEPS, run_forked

pytestmark = pytest.mark.quick  # python -m pytest -m quick: see pytest.ini


def fake_run(folder, wiggle=0.0):
    folder.mkdir()
    records = [
        {
            "step": s,
            "loss": 7.0 - 0.1 * s + wiggle * s,
            "grad_norm": 1.0 / s,
            "param_norm": 30.0 + s * 1e-3,
            "lr": 1e-3,
        }
        for s in range(1, 6)
    ]
    (folder / "metrics.json").write_text(
        json.dumps(
            {
                "schema_version": 2,
                "config": {"steps": 5},
                "env": {"world_size": 2},
                "records": records,
                "final": {"weights": "model.safetensors", "param_norm": records[-1]["param_norm"]},
            }
        )
    )
    return folder


def plot(*args):
    return run_forked(
        [sys.executable, str(REPO / "compare" / "plot.py"), *map(str, args)], timeout=120
    )


def test_plot_writes_a_png_of_several_runs(tmp_path):
    a, b = fake_run(tmp_path / "a"), fake_run(tmp_path / "b", wiggle=1e-7)
    result = plot(a, b, a, "--out", tmp_path / "x.png")
    assert result.returncode == 0, result.stderr
    png = (tmp_path / "x.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 20_000


def test_the_tour_runs_every_step_and_its_parity_checks(tour):
    """The README's main job (run once per session by the ``tour`` fixture): every step runs, and
    every step from 2 on is bitwise identical to DDP."""
    runs, output = tour
    assert "tour: all parity checks passed" in output
    # The data-parallel steps, bitwise to step 1; the pipeline (step 9), bitwise to step 0.
    bitwise_steps = [step for step in STEPS if 2 <= int(step[4:]) < 8 or step == "step9"]
    assert len(bitwise_steps) >= 5  # steps 2-6 at least
    # A report and a table row each, and the same for step 9's zero-bubble schedule beside step 0,
    # and its interleaved one beside step 0 on 4 blocks, and for step 12 beside step 0 on an
    # MoE model.
    assert output.count("PASS (bitwise identical)") == 2 * len(bitwise_steps) + 4 + 2
    for row, folder in (("  zero bubble", "zero_bubble"), ("  interleaved, V = 2", "interleaved")):
        line = next(line for line in output.splitlines() if line.startswith(row))
        assert (
            "PASS (bitwise identical)" in line
            and (runs / folder / STEPS["step9"] / "metrics.json").exists()
        )
    line = next(line for line in output.splitlines() if line.startswith(STEPS["step12"]))
    assert (
        "on the same MoE model: PASS (bitwise identical)" in line
        and (runs / "moe" / STEPS["step12"]).is_dir()
    )
    assert "same global batches, other summation order" in output  # step 0, measured, not judged
    # The steps that split the model sum in another order: judged by step 0's drift from step 1,
    # measured in the same tour (compare/other_order.py), their first step to float32's rounding.
    for step in ("step8", "step10", "step11"):
        line = next(line for line in output.splitlines() if line.startswith(STEPS[step]))
        first_loss = re.search(r"other summation order: step 1 loss rel diff (\S+),", line)
        assert first_loss and float(first_loss.group(1)) < 1e-6, line
        assert re.search(r"; \d+\.\dx step 0's drift: PASS$", line), line
    assert re.search(r"^machine: .+, ATen kernels [A-Z0-9]+, torch \S+ \(", output, re.M), output[
        -3000:
    ]
    assert (runs / "plots" / "tour.png").read_bytes().startswith(b"\x89PNG")


def test_the_tour_plots_step_12s_expert_load(tour):
    """runs/plots/expert_load.png, drawn from step 12's records (compare/plot.py's ``expert_load``):
    per step and MoE layer the experts' shares sum to 1, and the slots computed plus those dropped
    are every token's k, over every rank's micro-batches of the step (an independent count: the
    run's batch arithmetic)."""
    import plot

    runs, _ = tour
    assert (runs / "plots" / "expert_load.png").read_bytes().startswith(b"\x89PNG")
    run = json.loads((runs / "moe" / STEPS["step12"] / "metrics.json").read_text())
    config, load = run["config"], plot.expert_load(run)
    slots = (
        config["moe_top_k"]
        * config["micro_batch_size"]
        * config["seq_len"]
        * config["grad_accum"]
        * run["env"]["world_size"]
    )
    layers = -(-config["n_layer"] // config["moe_every"])
    assert load["steps"] == [r["step"] for r in run["records"]] and len(load["share"]) == layers
    for layer, (shares, dropped) in enumerate(zip(load["share"], load["dropped"])):
        for record, share, lost in zip(run["records"], shares, dropped):
            assert len(share) == config["moe_experts"] and sum(share) == pytest.approx(1, abs=1e-12)
            computed = sum(record["moe"]["tokens_per_expert"][layer])
            assert computed + round(lost * slots) == slots, (layer, record["step"], computed, lost)
