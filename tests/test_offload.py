"""--offload-optimizer (step 7, step7_zero3/offload.py): AdamW's state and step on the host. On a
CPU the run is bitwise the run without it, and bitwise FSDP2 with ``CPUOffloadPolicy``
(compare/fsdp2_reference.py); the state lives on the host, counted apart in each record; checkpoints
do not say where the state lived, so a run resumes another's with or without offload, bit for bit.
The outsider's use: tests/drop_in_harness.py's ``offload`` case."""

import pytest

from conftest import REPO, STEPS, TIMEOUT, TINY, assert_bitwise_same_run, metrics, run_ranks, train

OFFLOAD = "--offload-optimizer"


@pytest.fixture(scope="module")
def offloaded(tmp_path_factory, small_corpus):
    """Step 7 on the tour's flags, offloaded, with checkpoints at steps 2 and 4."""
    return train(
        "step7",
        tmp_path_factory.mktemp("offload") / "step7",
        small_corpus,
        OFFLOAD,
        "--save-every",
        "2",
    )


def test_offloaded_step7_trains_bitwise_like_step7(offloaded, tour):
    assert_bitwise_same_run(tour[0] / STEPS["step7"], offloaded)


def test_offloaded_step7_trains_bitwise_like_fsdp2_cpu_offload(offloaded, tmp_path, small_corpus):
    out = tmp_path / "fsdp2"
    result = run_ranks(
        REPO / "compare" / "fsdp2_reference.py",
        [*TINY, "--data", str(small_corpus), "--out", str(out), OFFLOAD, *TIMEOUT],
        nproc=2,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert_bitwise_same_run(offloaded, out)


def test_the_host_holds_the_masters_and_the_moments(offloaded, tour):
    """Each record's ``host``: the float32 copies of the rank's pieces (as many bytes as the pieces)
    and AdamW's state (its two moments, 8 bytes per element, and a step counter per piece); the
    device's parameters, gradients and state bytes are those of the run without offload."""
    plain = metrics(tour[0] / STEPS["step7"])["records"]
    for record, reference in zip(metrics(offloaded)["records"], plain):
        for memory, same in zip(record["memory"], reference["memory"]):
            assert memory["host"] == memory["params"] + memory["optimizer_state"]
            assert (
                2 * memory["params"] <= memory["optimizer_state"] <= 2 * memory["params"] + 4 * 64
            )
            assert {k: memory[k] for k in ("params", "grads", "optimizer_state")} == {
                k: same[k] for k in ("params", "grads", "optimizer_state")
            }
            assert "host" not in same


def test_the_memory_tool_checks_the_host_bytes_against_12_psi_over_n(offloaded):
    import memory  # compare/, on the path through conftest

    text, ok = memory.report(str(offloaded))
    assert ok and "host (--offload-optimizer), measured / 12Ψ/N: " in text, text


def test_the_planner_predicts_the_host_and_device_bytes(offloaded):
    """compare/plan.py --offload-optimizer's closed form for the run's layout (ZeRO-3, dp 2): the
    host's 12Ψ/N and the device's state without AdamW's, within 0.1% of each rank's record (the
    steps' per-unit padding and AdamW's step counters are all that differ)."""
    import plan  # compare/, on the path through conftest

    config = metrics(offloaded)["config"]
    shape = plan.Shape(
        config["n_layer"], config["n_embd"], config["n_head"], 2048, config["seq_len"]
    )
    predicted = plan.configuration(
        shape,
        2,
        1,
        1,
        3,
        False,
        config["micro_batch_size"],
        config["grad_accum"],
        plan.Activations(shape, config["micro_batch_size"]),
        offload=True,
    )["stages"][0]
    for memory in metrics(offloaded)["records"][-1]["memory"]:
        assert memory["host"] == pytest.approx(predicted["host"], rel=1e-3)
        assert memory["params"] + memory["grads"] == pytest.approx(
            predicted["params"] + predicted["grads"], rel=1e-3
        )


@pytest.mark.parametrize("with_offload", [True, False])
def test_a_checkpoint_resumes_with_or_without_offload_bitwise(
    with_offload, offloaded, tour, tmp_path, small_corpus
):
    """The tour's step-2 checkpoint (no offload) resumed offloaded, and the offloaded one resumed
    without: both end bitwise equal to the uninterrupted run (the host copies are refreshed from the
    loaded pieces)."""
    source = (tour[0] / STEPS["step7"]) if with_offload else offloaded
    out = train(
        "step7",
        tmp_path / "resumed",
        small_corpus,
        *([OFFLOAD] if with_offload else []),
        "--resume",
        str(source / "checkpoints" / "step_2"),
    )
    assert_bitwise_same_run(tour[0] / STEPS["step7"], out)
