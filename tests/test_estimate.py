"""compare/estimate.py: the bytes it predicts per rank are the bytes real runs hold."""

import json
import sys

import pytest
import torch

import estimate  # compare/, on the path through conftest
from conftest import REPO, STEPS, metrics, run_forked

KIND_OF_STEP = {
    "step0": estimate.STEPS[0],
    "step1": estimate.STEPS[0],
    "step2": estimate.STEPS[0],
    "step3": estimate.STEPS[0],
    "step4": estimate.STEPS[0],
    "step5": estimate.STEPS[1],
    "step6": estimate.STEPS[2],
    "step7": estimate.STEPS[3],
}
# Model-parallel steps hold other shares than a data-parallel layout: their bytes per rank are
# tested against their own formulas (test_tensor_parallel.py, test_pipeline_parallel.py;
# compare/estimate.py has no such layout yet).
DATA_PARALLEL = {short: folder for short, folder in STEPS.items() if short in KIND_OF_STEP}


def test_estimate_matches_every_run_of_the_tour(tour):
    """Every step's run at world size 2 (step 0: one process), every rank, every kind: within 2%
    (the layouts are the steps' own, so in fact to the byte); step 7's gathered peak too."""
    runs, _ = tour
    checked = []
    for short, folder in DATA_PARALLEL.items():
        run = metrics(runs / folder)
        config, world_size = run["config"], run["env"]["world_size"]
        model = estimate.Model(config, estimate.vocabulary_size(config["tokenizer"]))
        assert model.psi == sum(
            torch.Size(f["shape"]).numel() for f in run["final"]["fingerprints"].values()
        )
        predicted = estimate.predict(
            model,
            KIND_OF_STEP[short],
            world_size,
            config.get("bucket_cap_mb", 25.0),
            prefetch=not config.get("no_prefetch", False),
        )
        measured = run["records"][-1]["memory"]
        assert len(predicted) == len(measured) == world_size
        for rank, (p, m) in enumerate(zip(predicted, measured)):
            pairs = [(kind, p[kind], m[kind]) for kind in estimate.KINDS]
            if "gathered" in p:
                pairs.append(
                    (
                        "gathered",
                        p["gathered"],
                        max(r["memory"][rank]["gathered_peak"] for r in run["records"]),
                    )
                )
            for kind, expected, actual in pairs:
                assert abs(expected / actual - 1) <= 0.02, (
                    f"{folder} rank {rank} {kind}: {expected:,} vs {actual:,}"
                )
                checked.append((folder, rank, kind, expected == actual))
    assert {folder for folder, *_ in checked} == set(DATA_PARALLEL.values())
    assert all(exact for *_, exact in checked), [c for c in checked if not c[-1]]


@pytest.mark.quick
def test_activations_counted_on_the_meta_device_are_those_of_a_real_forward():
    """What the estimate counts without memory is what
    autograd saves on a real CPU model (dropout on)."""
    sys.path.insert(0, str(REPO / "common"))
    from model import build_model

    config = {
        "n_layer": 2,
        "n_embd": 32,
        "n_head": 2,
        "seq_len": 16,
        "dropout": 0.1,
        "weight_decay": 0.1,
    }
    meta = estimate.Model(config, 2048)
    real = estimate.Model(config, 2048)
    real.module = build_model(config, 2048, seed=1)
    assert meta.activation_bytes(3) == real.activation_bytes(3) > 0
    assert meta.activation_bytes(6) > meta.activation_bytes(3)
    # With step 7's checkpointing: kept (the root's, the
    # blocks' inputs and mask), and one block recomputed.
    kept, recomputed = meta.checkpointed_activation_bytes(3)
    assert (kept, recomputed) == real.checkpointed_activation_bytes(3)
    assert 0 < recomputed < meta.activation_bytes(3) - kept
    assert meta.activation_bytes(3, checkpointing=True) == kept + recomputed


def run_estimate(*args):
    return run_forked(
        [sys.executable, str(REPO / "compare" / "estimate.py"), *map(str, args)], timeout=120
    )


def test_the_command_line_marks_what_fits(tmp_path):
    out = tmp_path / "estimate.json"
    result = run_estimate(
        "--n-layer",
        "4",
        "--n-embd",
        "256",
        "--n-head",
        "4",
        "--micro-batch-size",
        "1",
        "--world-sizes",
        "1,4",
        "--budget-mb",
        "40",
        "--json",
        out,
    )
    assert result.returncode == 0, result.stderr
    numbers = json.loads(out.read_text())
    rows = {(r["step"], r["world_size"]): r for r in numbers["rows"]}
    assert len(rows) == 8
    ddp, zero3 = rows[("DDP (steps 0-4)", 4)], rows[("ZeRO-3 (step 7)", 4)]
    assert ddp["ranks"][0]["params"] == 4 * numbers["psi"]
    assert abs(zero3["ranks"][0]["params"] / ddp["ranks"][0]["params"] - 1 / 4) < 0.01
    fits = [
        line for line in result.stdout.splitlines() if "fits:" in line or "DOES NOT FIT" in line
    ]
    assert len(fits) == 8
    assert "DOES NOT FIT" in next(
        line for line in fits if line.startswith("DDP (steps 0-4)      4")
    )
    assert "fits:" in next(line for line in fits if line.startswith("ZeRO-3 (step 7)      4"))
    # Bad flags: tests/test_bad_input.py (docs/bad_input.md).


@pytest.mark.quick
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_zero_layouts_split_every_element_once(world_size):
    """Whatever the padding, the ranks' pieces add up to the whole model:
    no element lost or counted twice."""
    model = estimate.Model(
        {
            "n_layer": 3,
            "n_embd": 24,
            "n_head": 2,
            "seq_len": 7,
            "dropout": 0.0,
            "weight_decay": 0.1,
        },
        101,
    )
    for step in estimate.STEPS[1:]:
        ranks = estimate.predict(model, step, world_size, bucket_cap_mb=0.01)
        state = sum(r["optimizer_state"] for r in ranks)
        steps_counted = state - 2 * 4 * model.psi
        assert (
            steps_counted % 4 == 0
            and len(model.named) <= steps_counted // 4 <= len(model.named) * world_size
        )
        if step == estimate.STEPS[3]:
            assert (
                sum(r["params"] for r in ranks)
                >= 4 * model.psi
                > sum(r["params"] for r in ranks) - 4 * world_size * 4
            )


# ---- The closed forms with 16-bit parameters (issue 17's table) ----------------------------------


@pytest.mark.quick
def test_the_zero_papers_figure_1_to_its_printed_precision():
    """Ψ = 7.5B, N = 64, K = 12: 120 GB, 31.4 GB, 16.6 GB,
    1.9 GB (GB = 10^9 bytes), from the closed forms."""
    for stage, printed in enumerate(estimate.PAPER_GB):
        gb = (
            sum(estimate.state_bytes(stage, estimate.PAPER_PSI, estimate.PAPER_N, "bf16").values())
            / 1e9
        )
        assert round(gb, 1) == printed, (stage, gb)
    assert [estimate.formula(stage, "bf16") for stage in range(4)] == [
        "2Ψ + 2Ψ + 12Ψ",
        "2Ψ + 2Ψ + 12Ψ/N",
        "2Ψ + 2Ψ/N + 12Ψ/N",
        "2Ψ/N + 2Ψ/N + 12Ψ/N",
    ]


@pytest.mark.quick
def test_4x_and_8x_are_limits():
    """16Ψ / (4Ψ + 12Ψ/N) -> 4 and 16Ψ / (2Ψ + 14Ψ/N) -> 8,
    approached from below as N grows to 1024."""
    assert estimate.reduction_limit(1) == 4 and estimate.reduction_limit(2) == 8
    assert estimate.reduction_limit(3) == float("inf")
    psi = estimate.PAPER_PSI
    for stage, limit in ((1, 4), (2, 8)):
        ratios = [
            sum(estimate.state_bytes(0, psi, n, "bf16").values())
            / sum(estimate.state_bytes(stage, psi, n, "bf16").values())
            for n in (8, 64, 1024)
        ]
        assert ratios == sorted(ratios) and limit * 0.99 < ratios[-1] < limit
        assert ratios[-1] == pytest.approx(16 / (16 / limit + (16 - 16 / limit) / 1024))


@pytest.mark.quick
def test_the_gradient_dtype_decides_zero_2s_shard():
    """Kept in 16 bits (the paper): 2Ψ + 14Ψ/N; reduced and kept in float32 (FSDP2's reduce_dtype,
    step 7's param_dtype): 2Ψ + 16Ψ/N. ZeRO-3 held as FSDP2 holds it (the fp32 shard is the master)
    is 16Ψ/N either way, as is float32 (4 + 4 + 8); padding: a sharded kind holds
    ceil(Ψ/N) elements."""
    psi, n = 1001, 4
    assert estimate.state_bytes(2, psi, n, "bf16") == {
        "params": 2 * psi,
        "grads": 2 * 251,
        "optimizer_state": 12 * 251,
    }
    assert estimate.state_bytes(2, psi, n, "bf16", "float32")["grads"] == 4 * 251
    for args in (("bf16",), ("bf16", "float32"), ("float32",)):
        assert sum(estimate.state_bytes(3, psi, n, *args).values()) == 16 * 251
    assert estimate.formula(3, "bf16", "float32") == "4Ψ/N + 4Ψ/N + 8Ψ/N"


def test_step7_with_bf16_parameters_holds_16_psi_over_n(tmp_path):
    """Step 7's FullyShardedDP(param_dtype=torch.bfloat16) at N = 2, measured by
    compare/peak_memory.py (the bytes live through a whole step, from the profiler's records):
    within 2% of 16Ψ/N, padding included; its units in flight are gathered in 2 bytes an element."""
    out = tmp_path / "peak.json"
    result = run_forked(
        [
            sys.executable,
            str(REPO / "compare" / "peak_memory.py"),
            "--param-dtype",
            "bf16",
            "--world-sizes",
            "2",
            "--n-layer",
            "2",
            "--n-embd",
            "32",
            "--n-head",
            "2",
            "--seq-len",
            "16",
            "--micro-batch-size",
            "2",
            "--profiled-steps",
            "1",
            "--timed-steps",
            "0",
            "--timeout-s",
            "60",
            "--json",
            str(out),
        ]
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2
    for row in rows:
        closed = sum(estimate.state_bytes(3, row["psi"], 2, "bf16", "float32").values())
        assert abs(max(row["state_measured"]) / closed - 1) <= 0.02, (
            row["state_measured"],
            closed,
            row["state_parts"],
            row["collective_copies"],
        )
        assert row["gathered_peak"] == row["gathered"]


def test_the_fp8_rows_beside_the_playbooks_table_are_the_planners_bytes():
    """docs/planner.md sets our --fp8 rows beside the Ultra-Scale Playbook's FP8 table: each total
    there is what estimate.bytes_per_parameter gives the planner (FP8 adds no state: the rows are
    those without it)."""
    text = (REPO / "docs" / "planner.md").read_text()
    rows = {
        "float32 parameters": (0, "float32", None),
        "steps 5, 6: `main_grad`": (1, "bf16", "float32"),
        "step 7: the fp32 shard is the master": (3, "bf16", "float32"),
    }
    for label, (stage, param_dtype, reduce_dtype) in rows.items():
        line = next(
            line for line in text.splitlines() if line.startswith("| ours:") and label in line
        )
        total = sum(estimate.bytes_per_parameter(stage, param_dtype, reduce_dtype)[0])
        assert line.rstrip(" |").endswith(f"| {total}"), (line, total)
    assert [
        sum(estimate.bytes_per_parameter(3, "bf16", "float32")[0]),
        sum(estimate.bytes_per_parameter(1, "bf16", "float32")[0]),
    ] == [16, 18]
