"""What the sharded trainers (steps 5-7) record where parity cannot see a mistake: the gradient norm
when clipping is off (nothing is scaled, so the weights are right even if the logged norm is one
rank's slice), and the bytes each step hands to its collectives in the default float32 mode (a
reduction in float64 gives the same bits at 2 ranks, at twice the traffic)."""

import math

import pytest

from conftest import STEPS, metrics, train

SHARDED = ("step5", "step6", "step7")


def psi(run, root_only: bool = False) -> int:
    """Parameters in all (Ψ), or only those outside the transformer blocks (step 7's root unit)."""
    return sum(
        math.prod(f["shape"])
        for name, f in metrics(run)["final"]["fingerprints"].items()
        if not (root_only and ".h." in name)
    )


@pytest.fixture(scope="module")
def unclipped(tmp_path_factory, small_corpus):
    """Steps 1 and 5-7 on 2 ranks with ``--grad-clip 0`` (no clipping), default float32 mode."""
    return {
        step: train(
            step, tmp_path_factory.mktemp(f"unclipped_{step}"), small_corpus, "--grad-clip", "0"
        )
        for step in ("step1", *SHARDED)
    }


@pytest.mark.parametrize("step", SHARDED)
def test_without_clipping_the_logged_grad_norm_is_the_global_one(step, unclipped, step1_ws2):
    """Every record's norm equals step 1's, where PyTorch DDP holds the whole averaged gradient on
    every rank. Independently of step 1's run at --grad-clip 0: the first step's norm comes before
    any update, so it is the one the tour's run (clipping at 0.3) logged; and one rank's slice is
    half the gradient, so its norm would be smaller."""
    records = metrics(unclipped[step])["records"]
    reference = metrics(unclipped["step1"])["records"]
    assert metrics(unclipped[step])["config"]["grad_clip"] == 0
    assert [r["grad_norm"] for r in records] == [r["grad_norm"] for r in reference]
    assert records[0]["grad_norm"] == metrics(step1_ws2)["records"][0]["grad_norm"]
    # the premise: clipping at 0.3 did change the tour's run, so the two settings really differ
    assert records[-1]["param_norm"] != metrics(step1_ws2)["records"][-1]["param_norm"]


@pytest.mark.quick
@pytest.mark.parametrize("step", ["step1", "step2", "step3", "step4", *SHARDED])
def test_the_default_mode_moves_each_gradient_once_in_float32(step, tour):
    """Per optimiser step (accumulation 2, so ``no_sync`` keeps the first micro-batch silent), on
    every record of the tour's float32 runs at 2 ranks: the gradient collective carries 4 bytes per
    parameter once, padding included (at most 64 elements per rank); ZeRO-1 and -2 all-gather the
    4-byte parameters once; ZeRO-3 gathers each unit per micro-batch in forward and again in
    backward, the root once. Besides these, only scalars (the clipping norm, step 7's exact
    param-norm parts) are all-reduced: 8 kB at most."""
    run = tour[0] / STEPS[step]
    n, world_size = psi(run), metrics(run)["env"]["world_size"]
    config = metrics(run)["config"]
    accum = config["grad_accum"]
    assert config["reduce_dtype"] == "float32" and world_size == 2 and accum == 2
    pad = 64 * world_size
    for r in metrics(run)["records"]:
        comm = r["comm"]
        gradients = comm["reduce_scatter" if step in ("step6", "step7") else "all_reduce"]
        assert 4 * n <= gradients <= 4 * (n + pad) + 8, (
            f"{step} step {r['step']}: {comm} for Ψ = {n}"
        )
        if step in ("step5", "step6"):
            assert 4 * n <= comm["all_gather"] <= 4 * (n + pad), f"{step} step {r['step']}: {comm}"
        if step in ("step6", "step7"):
            assert comm["all_reduce"] <= 8192, f"{step} step {r['step']}: {comm}"
        # root: everything outside the blocks; a unit pads to at most N - 1 more elements
        if step == "step7":
            root, units = psi(run, root_only=True), config["n_layer"] + 1
            gathered = comm["all_gather"] / 4
            assert (
                accum * (2 * n - root) <= gathered < accum * (2 * n - root + 2 * units * world_size)
            ), comm
        if step in ("step1", "step2", "step3", "step4"):
            assert gradients == 4 * n and set(comm) <= {"all_reduce", "broadcast"}, (
                f"{step}: {comm}"
            )
