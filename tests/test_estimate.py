"""compare/estimate.py: the bytes it predicts per rank are the bytes real runs hold."""
import json
import subprocess
import sys

import pytest
import torch

from conftest import REPO, STEPS, metrics

import estimate  # compare/, on the path through conftest

KIND_OF_STEP = {"step0": estimate.STEPS[0], "step1": estimate.STEPS[0], "step2": estimate.STEPS[0],
                "step3": estimate.STEPS[0], "step4": estimate.STEPS[0], "step5": estimate.STEPS[1],
                "step6": estimate.STEPS[2], "step7": estimate.STEPS[3]}
# Model-parallel steps hold other shares than a data-parallel layout: their bytes per rank are tested against
# their own formulas (test_tensor_parallel.py, test_pipeline_parallel.py; compare/estimate.py has no such layout yet).
DATA_PARALLEL = {short: folder for short, folder in STEPS.items() if short in KIND_OF_STEP}


def test_estimate_matches_every_run_of_the_tour(tour):
    """Every step's run at world size 2 (step 0: one process), every rank, every kind: within 2% (the
    layouts are the steps' own, so in fact to the byte); step 7's gathered peak too."""
    runs, _ = tour
    checked = []
    for short, folder in DATA_PARALLEL.items():
        run = metrics(runs / folder)
        config, world_size = run["config"], run["env"]["world_size"]
        model = estimate.Model(config, estimate.vocabulary_size(config["tokenizer"]))
        assert model.psi == sum(torch.Size(f["shape"]).numel() for f in run["final"]["fingerprints"].values())
        predicted = estimate.predict(model, KIND_OF_STEP[short], world_size, config.get("bucket_cap_mb", 25.0),
                                     prefetch=not config.get("no_prefetch", False))
        measured = run["records"][-1]["memory"]
        assert len(predicted) == len(measured) == world_size
        for rank, (p, m) in enumerate(zip(predicted, measured)):
            pairs = [(kind, p[kind], m[kind]) for kind in estimate.KINDS]
            if "gathered" in p:
                pairs.append(("gathered", p["gathered"], max(r["memory"][rank]["gathered_peak"]
                                                             for r in run["records"])))
            for kind, expected, actual in pairs:
                assert abs(expected / actual - 1) <= 0.02, f"{folder} rank {rank} {kind}: {expected:,} vs {actual:,}"
                checked.append((folder, rank, kind, expected == actual))
    assert {folder for folder, *_ in checked} == set(DATA_PARALLEL.values())
    assert all(exact for *_, exact in checked), [c for c in checked if not c[-1]]


@pytest.mark.quick
def test_activations_counted_on_the_meta_device_are_those_of_a_real_forward():
    """What the estimate counts without memory is what autograd saves on a real CPU model (dropout on)."""
    sys.path.insert(0, str(REPO / "common"))
    from model import build_model
    config = {"n_layer": 2, "n_embd": 32, "n_head": 2, "seq_len": 16, "dropout": 0.1, "weight_decay": 0.1}
    meta = estimate.Model(config, 2048)
    real = estimate.Model(config, 2048)
    real.module = build_model(config, 2048, seed=1)
    assert meta.activation_bytes(3) == real.activation_bytes(3) > 0
    assert meta.activation_bytes(6) > meta.activation_bytes(3)
    # With step 7's checkpointing: kept (the root's, the blocks' inputs and mask), and one block recomputed.
    kept, recomputed = meta.checkpointed_activation_bytes(3)
    assert (kept, recomputed) == real.checkpointed_activation_bytes(3)
    assert 0 < recomputed < meta.activation_bytes(3) - kept
    assert meta.activation_bytes(3, checkpointing=True) == kept + recomputed


def run_estimate(*args):
    return subprocess.run([sys.executable, str(REPO / "compare" / "estimate.py"), *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_the_command_line_marks_what_fits(tmp_path):
    out = tmp_path / "estimate.json"
    result = run_estimate("--n-layer", "4", "--n-embd", "256", "--n-head", "4", "--micro-batch-size", "1",
                          "--world-sizes", "1,4", "--budget-mb", "40", "--json", out)
    assert result.returncode == 0, result.stderr
    numbers = json.loads(out.read_text())
    rows = {(r["step"], r["world_size"]): r for r in numbers["rows"]}
    assert len(rows) == 8
    ddp, zero3 = rows[("DDP (steps 0-4)", 4)], rows[("ZeRO-3 (step 7)", 4)]
    assert ddp["ranks"][0]["params"] == 4 * numbers["psi"]
    assert abs(zero3["ranks"][0]["params"] / ddp["ranks"][0]["params"] - 1 / 4) < 0.01
    fits = [line for line in result.stdout.splitlines() if "fits:" in line or "DOES NOT FIT" in line]
    assert len(fits) == 8
    assert "DOES NOT FIT" in next(line for line in fits if line.startswith("DDP (steps 0-4)      4"))
    assert "fits:" in next(line for line in fits if line.startswith("ZeRO-3 (step 7)      4"))
    # Bad flags: tests/test_bad_input.py (docs/bad_input.md).


@pytest.mark.quick
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_zero_layouts_split_every_element_once(world_size):
    """Whatever the padding, the ranks' pieces add up to the whole model: no element lost or counted twice."""
    model = estimate.Model({"n_layer": 3, "n_embd": 24, "n_head": 2, "seq_len": 7, "dropout": 0.0,
                            "weight_decay": 0.1}, 101)
    for step in estimate.STEPS[1:]:
        ranks = estimate.predict(model, step, world_size, bucket_cap_mb=0.01)
        state = sum(r["optimizer_state"] for r in ranks)
        steps_counted = state - 2 * 4 * model.psi
        assert steps_counted % 4 == 0 and len(model.named) <= steps_counted // 4 <= len(model.named) * world_size
        if step == estimate.STEPS[3]:
            assert sum(r["params"] for r in ranks) >= 4 * model.psi > sum(r["params"] for r in ranks) - 4 * world_size * 4
