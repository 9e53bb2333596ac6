"""Step 12 (expert parallelism) against step 0
training the same MoE model on the same micro-batches.

With one sample per micro-batch, step 0 accumulating W micro-batches sees, in order, what W ranks of
one micro-batch each hold (rank r's sampler shard starts at sample r). At W = 2 every sum step 12
changes has two terms (a + b == b + a), and dividing by 2 is exact: bitwise, the aux loss, dropping
and clipping included, at ep 2 and at ep 1 (every expert on both ranks, its gradient reduced over
its two copies). At W = 4 step 0 adds the four micro-batches' gradients one after the other in
float32; step 12 adds a dense gradient in its all-reduce's order (in float64 with --reduce-dtype
float64: exact, any order) and an expert's as autograd adds its per-source products, the last source
first. So at 4 ranks step 12 is proven bitwise against tests/ep_same_order.py, one process that adds
each gradient in step 12's order, and its drift from step 0 is printed and bounded by the drift of
step 12 at W = 2 with two micro-batches a rank against step 0 with four (measured in the same
session; compare/other_order.py). docs/parity.md, "Step 12", says which sums differ and by how much.
"""

import json
import sys

import pytest
import torch

import other_order
from conftest import MOE as TESTS_MOE
from conftest import (
    REPO,
    TINY,
    assert_all_to_all_closed_form,
    assert_bitwise_same_run,
    launch,
    metrics,
    parity,
    run_forked,
    train,
    weights,
)

MOE = (*TESTS_MOE, "--micro-batch-size", "1")  # one sequence a micro-batch: ranks see unequal loads
H, E = 32, 4  # TINY's --n-embd, the experts


@pytest.fixture(scope="module")
def ep_runs(tmp_path_factory, small_corpus):
    top = tmp_path_factory.mktemp("ep")
    runs = {}

    def run(name, step, accum, *extra, nproc=2):
        runs[name] = train(
            step, top / name, small_corpus, *MOE, "--grad-accum", str(accum), *extra, nproc=nproc
        )
        return runs[name]

    run("step0_x2", "step0", 2)
    run("ep2", "step12", 1, "--ep", "2", "--save-every", "2")
    run("ep1", "step12", 1, "--ep", "1")
    run("step0_x4", "step0", 4)
    # the reference: W = 2 accumulating 2 against step 0's 4
    run("ep2_x2", "step12", 2, "--ep", "2")
    for layout, ep in (("ep4", "4"), ("dp2_ep2", "2")):
        run(layout, "step12", 1, "--ep", ep, nproc=4)
        # exact mode: the dense gradients' all-reduce in float64 (order-free)
        run(f"{layout}_exact", "step12", 1, "--ep", ep, "--reduce-dtype", "float64", nproc=4)
    runs["top"], runs["corpus"] = top, small_corpus
    return runs


@pytest.fixture(scope="module")
def same_order(ep_runs):
    """tests/ep_same_order.py on the 4-rank exact runs' config: in step 0's order (once), in step
    12's at each layout. {"step0": folder, "ep4": folder, "dp2_ep2": folder}, each holding a run's
    files and first_step.json."""
    out = ep_runs["top"] / "same_order"
    for layout, orders in (("ep4", ["step0", "ep"]), ("dp2_ep2", ["ep"])):
        result = run_forked(
            [
                sys.executable,
                str(REPO / "tests" / "ep_same_order.py"),
                str(ep_runs[f"{layout}_exact"]),
                str(out / layout),
                *orders,
            ],
            timeout=300,
        )
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return {
        "step0": out / "ep4" / "step0",
        "ep4": out / "ep4" / "ep",
        "dp2_ep2": out / "dp2_ep2" / "ep",
    }


def same_bits(reference, run) -> None:
    """Final weights torch.equal; every step's loss,
    gradient and param norms, lr, loads and aux loss equal."""
    wa, wb = weights(reference), weights(run)
    assert sorted(wa) == sorted(wb)
    different = [n for n in wa if not torch.equal(wa[n], wb[n])]
    assert not different, f"tensors differ: {different}"
    ra, rb = metrics(reference)["records"], metrics(run)["records"]
    assert len(ra) == len(rb) == 4
    for x, y in zip(ra, rb):
        for key in ("loss", "grad_norm", "param_norm", "lr"):
            assert x[key] == y[key], (x["step"], key, x[key], y[key])
        for key in ("tokens_per_expert", "aux_loss"):
            assert x["moe"][key] == y["moe"][key], (x["step"], key)


def same_numbers(a, b):
    wa, wb = weights(a), weights(b)
    assert sorted(wa) == sorted(wb)
    different = [n for n in wa if not torch.equal(wa[n], wb[n])]
    assert not different, f"tensors differ: {different}"
    for ra, rb in zip(metrics(a)["records"], metrics(b)["records"]):
        assert ra["grad_norm"] == rb["grad_norm"] and ra["param_norm"] == rb["param_norm"]
        assert ra["moe"]["tokens_per_expert"] == rb["moe"]["tokens_per_expert"]
        assert ra["moe"]["dropped_fraction"] == pytest.approx(
            rb["moe"]["dropped_fraction"], abs=1e-12
        )
        assert ra["loss"] == rb["loss"]
    # capacity drops
    assert any(d > 0 for r in metrics(a)["records"] for d in r["moe"]["dropped_fraction"])
    assert any(r["grad_norm"] > 0.3 for r in metrics(a)["records"])  # --grad-clip 0.3 clips
    shown = parity(a, b)
    assert shown.returncode == 0 and "PASS (bitwise identical)" in shown.stdout, (
        shown.stdout + shown.stderr
    )


@pytest.mark.parametrize("ep", ["ep2", "ep1"])
def test_step12_at_two_ranks_is_bitwise_step0(ep_runs, ep):
    same_numbers(ep_runs["step0_x2"], ep_runs[ep])


def test_each_rank_holds_its_experts_and_the_run_their_union(ep_runs):
    whole = weights(ep_runs["ep2"])
    for layer in (0, 1):
        assert all(f"transformer.h.{layer}.mlp.experts.{e}.c_fc.weight" in whole for e in range(E))
    one = metrics(ep_runs["ep1"])["records"][0]["memory"][0]["params"]  # every expert
    # two layers, E experts of c_fc and c_proj, float32
    expert_bytes = 2 * E * (2 * 4 * H * H + 4 * H + H) * 4
    # every rank: the dense parameters whole and 1/ep of the experts' bytes
    for name, ep in (("ep2", 2), ("ep4", 4), ("dp2_ep2", 2)):
        memory = metrics(ep_runs[name])["records"][0]["memory"]
        assert len(memory) == (2 if name == "ep2" else 4)
        for rank in memory:
            assert one - rank["params"] == expert_bytes - expert_bytes // ep, (name, rank)


def test_all_to_all_bytes_equal_the_closed_form_on_every_rank(ep_runs):
    """conftest.assert_all_to_all_closed_form on every rank, layer and micro-batch of the runs with
    capacity factor 1.0 (slots dropped); a dropless run's are checked in
    tests/test_plan_commands.py."""
    for name in ("ep2", "ep4", "dp2_ep2"):
        ranks = 2 if name == "ep2" else 4
        assert (
            assert_all_to_all_closed_form(ep_runs[name]) == 4 * ranks * 2
        )  # steps x ranks x layers
        assert any(
            d > 0 for r in metrics(ep_runs[name])["records"] for d in r["moe"]["dropped_fraction"]
        )


def test_step12_resumes_bit_for_bit(ep_runs):
    resumed = launch(
        "step12",
        [
            *TINY,
            *MOE,
            "--grad-accum",
            "1",
            "--ep",
            "2",
            "--data",
            str(ep_runs["corpus"]),
            "--out",
            str(ep_runs["top"] / "resumed"),
            "--resume",
            str(ep_runs["ep2"] / "checkpoints" / "step_2"),
        ],
        nproc=2,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_bitwise_same_run(ep_runs["ep2"], ep_runs["top"] / "resumed")


@pytest.mark.parametrize("layout", ["ep4", "dp2_ep2"])
def test_step12_at_four_ranks_is_bitwise_the_same_order_reference_and_drifts_from_step0(
    ep_runs, same_order, layout
):
    """Exact mode (--reduce-dtype float64) at 4 ranks: bitwise to tests/ep_same_order.py adding each
    gradient in step 12's order. Both modes' drift from step 0 accumulating 4 is printed, and
    bounded by the drift of step 12 at 2 ranks x 2 micro-batches (another regrouping by two correct
    implementations, measured here)."""
    same_bits(same_order[layout], ep_runs[f"{layout}_exact"])
    step0 = ep_runs["step0_x4"]
    reference = other_order.drift(
        metrics(ep_runs["ep2_x2"]), weights(ep_runs["ep2_x2"]), metrics(step0), weights(step0)
    )
    for mode in (f"{layout}_exact", layout):
        run = ep_runs[mode]
        drift = other_order.drift(metrics(run), weights(run), metrics(step0), weights(step0))
        print(
            f"{mode} vs step 0 x 4: {drift}; reference (ep 2 x 2 micro-batches vs step "
            f"0): {reference}"
        )
        assert not other_order.beyond(
            drift, other_order.bound(reference, metrics(run), weights(run))
        ), (mode, drift, reference)
        first, ref_first = metrics(run)["records"][0], metrics(step0)["records"][0]
        assert first["moe"]["tokens_per_expert"] == ref_first["moe"]["tokens_per_expert"]
    # float32 mode: only the dense all-reduce's order
    # changes (gloo's, four quarters added in four orders)
    exact, plain = weights(ep_runs[f"{layout}_exact"]), weights(ep_runs[layout])
    assert any(not torch.equal(exact[n], plain[n]) for n in exact)


def test_the_same_order_reference_is_step0_in_step0s_order_and_differs_where_the_sums_do(
    ep_runs, same_order
):
    """The reference is no copy of step 12: in step 0's order it is step 0 bit for bit; in step 12's
    order, from the same per-micro-batch gradients, its first step's sums differ from step 0's in
    many elements, the dense gradients' (float64, rounded once, against float32 one after the other)
    and the experts' (at ep 4: the last source first; at dp 2 x ep 2: two pairs), and its weights
    end elsewhere."""
    same_bits(same_order["step0"], ep_runs["step0_x4"])
    step0 = weights(ep_runs["step0_x4"])
    for layout in ("ep4", "dp2_ep2"):
        first = json.loads((same_order[layout] / "first_step.json").read_text())
        print(f"{layout}, step 1, elements that differ from step 0's sums: {first}")
        for kind in ("dense", "experts"):
            differ, total = first[kind]
            assert 0 < differ < total, (layout, kind, first)
        ours = weights(same_order[layout])
        assert sum(not torch.equal(ours[n], step0[n]) for n in step0) > len(step0) // 2


def test_a_product_over_two_sources_rows_at_once_sums_otherwise_than_one_per_source():
    """Why expert_parallel.py computes one product per (source, expert) (its rule 4), measured on
    this CPU: an expert's first layer (h -> 4h) on two sources' rows concatenated, against one
    product per source (the one step 0 computes per micro-batch, its weight gradient accumulated
    over the two backwards), for 35 pairs of row counts, float32, one thread. The weight gradient
    sums over the rows, and one GEMM over all of them groups that sum otherwise; the output rows may
    differ too, where the kernel's blocking changes with the row count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        g = torch.Generator().manual_seed(0)
        layer = torch.nn.Linear(H, 4 * H)
        outputs = gradients = pairs = 0
        for n1 in (1, 2, 3, 5, 8):
            for n2 in (1, 2, 3, 5, 8, 13, 21):
                x1, x2 = torch.randn(n1, H, generator=g), torch.randn(n2, H, generator=g)
                d1, d2 = torch.randn(n1, 4 * H, generator=g), torch.randn(n2, 4 * H, generator=g)
                layer.zero_grad(set_to_none=True)
                together = layer(torch.cat([x1, x2]))
                together.backward(torch.cat([d1, d2]))
                grad_together = layer.weight.grad.clone()
                layer.zero_grad(set_to_none=True)
                y1, y2 = layer(x1), layer(x2)
                y1.backward(d1)
                y2.backward(d2)
                outputs += not torch.equal(together, torch.cat([y1, y2]))
                gradients += not torch.equal(grad_together, layer.weight.grad)
                pairs += 1
    finally:
        torch.set_num_threads(threads)
    print(
        f"of {pairs} row-count pairs, concatenated differs in: outputs {outputs}, "
        f"weight gradient {gradients}"
    )
    assert gradients > 0  # on any CPU: else one product over every source's rows would do


def test_the_dispatcher_in_an_outsiders_moe_layer_and_spawn_loop_equals_the_layer_whole(tmp_path):
    import json
    import subprocess
    import sys

    from conftest import REPO

    out = tmp_path / "result.json"
    result = subprocess.run(
        [sys.executable, str(REPO / "tests" / "ep_drop_in_harness.py"), str(out)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = json.loads(out.read_text())
    assert ranks["0"]["experts"] == ["0", "1"] and ranks["1"]["experts"] == ["2", "3"]
    for rank in ranks.values():
        assert rank["equal_every_step"] == [True] * 3 and rank["received"] > 0


def test_step12_resumes_at_another_ep_degree_bit_for_bit(ep_runs):
    """ep 2's checkpoint (each rank's file holds its experts) read by name at ep 1 (every expert on
    both ranks): both layouts compute step 0's bits, so the resumed run is the uninterrupted one."""
    out = ep_runs["top"] / "resumed_ep1"
    resumed = launch(
        "step12",
        [
            *TINY,
            *MOE,
            "--grad-accum",
            "1",
            "--ep",
            "1",
            "--data",
            str(ep_runs["corpus"]),
            "--out",
            str(out),
            "--resume",
            str(ep_runs["ep2"] / "checkpoints" / "step_2"),
        ],
        nproc=2,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_bitwise_same_run(ep_runs["ep2"], out)


def test_the_planners_moe_formulas_equal_what_runs_hold_and_send(ep_runs):
    """compare/plan.py's EP axis against real runs: a rank's parameters (dense whole, E/ep experts)
    as its record counts them, and the all-to-all bytes per layer, averaged over the ranks, with the
    kept fraction the run logged."""
    import plan

    whole = weights(ep_runs["ep2"])
    shape = plan.Shape(2, H, 2, whole["transformer.wte.weight"].shape[0], 32)
    moe = plan.MoE(E, 2, 1)
    assert plan.moe_psi(shape, moe)["dense"] + plan.moe_psi(shape, moe)["experts"] == sum(
        t.numel() for t in whole.values()
    )
    for name, ep in (("ep2", 2), ("ep1", 1)):
        assert metrics(ep_runs[name])["records"][0]["memory"][0][
            "params"
        ] == 4 * plan.moe_rank_params(shape, moe, ep)
    for name, ep in (("ep2", 2), ("ep4", 4), ("dp2_ep2", 2)):
        for record in metrics(ep_runs[name])["records"]:
            notes = record["all_to_all"]
            for layer, dropped in enumerate(record["moe"]["dropped_fraction"]):
                mean = sum(n[layer]["bytes"] for n in notes) / len(notes)
                planned = plan.all_to_all_bytes(moe, 32, H, ep, kept=1 - dropped)["handed"]
                assert mean == pytest.approx(planned, rel=1e-9), (name, layer)
