"""Step 12 (expert parallelism) against step 0 training the same MoE model on the same micro-batches.

With one sample per micro-batch, step 0 accumulating W micro-batches sees, in order, what W ranks of one micro-batch
each hold (rank r's sampler shard starts at sample r). At W = 2 every sum step 12 changes has two terms
(a + b == b + a), and dividing by 2 is exact: bitwise, the aux loss, dropping and clipping included, at ep 2 and at
ep 1 (every expert on both ranks, its gradient reduced over its two copies). At W = 4 the four micro-batches'
gradients are added in another order (pairs, then the pair sums; the all-reduce's order), so the runs drift as
two correct implementations do: bounded by the drift of step 12 at W = 2 with two micro-batches a rank against
step 0 with four (the same kind of reordering, measured in this session; compare/other_order.py).
"""

import pytest
import torch

import other_order
from conftest import MOE as TESTS_MOE
from conftest import TINY, assert_bitwise_same_run, launch, metrics, parity, train, weights

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
    run("ep4", "step12", 1, "--ep", "4", nproc=4)
    run("dp2_ep2", "step12", 1, "--ep", "2", nproc=4)
    runs["top"], runs["corpus"] = top, small_corpus
    return runs


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
    memory = metrics(ep_runs["ep2"])["records"][0]["memory"]
    one = metrics(ep_runs["ep1"])["records"][0]["memory"]
    # two layers, E experts of c_fc and c_proj, float32
    expert_bytes = 2 * E * (2 * 4 * H * H + 4 * H + H) * 4
    # ep 2: half the experts a rank
    assert one[0]["params"] - memory[0]["params"] == expert_bytes // 2


def test_all_to_all_bytes_equal_the_closed_form_on_every_rank(ep_runs):
    """Per MoE layer and micro-batch, on each rank: the E counts (int64), then the tokens sent and received,
    forward and backward (float32 rows of H): 8 E + 4 H * 2 * (sent + received). What a rank receives is what
    the ranks of its group sent to its experts."""
    for name, ep in (("ep2", 2), ("ep4", 4), ("dp2_ep2", 2)):
        records = metrics(ep_runs[name])["records"]
        for record in records:
            notes = record["all_to_all"]  # [rank][layer x micro-batch]
            for rank, mine in enumerate(notes):
                group = range(rank // ep * ep, rank // ep * ep + ep)
                local = range(rank % ep * E // ep, (rank % ep + 1) * E // ep)
                for i, note in enumerate(mine):
                    received = sum(notes[s][i]["sent_per_expert"][e] for s in group for e in local)
                    assert note["received"] == received
                    sent = sum(note["sent_per_expert"])
                    assert note["bytes"] == 8 * E + 4 * H * 2 * (sent + received), (name, rank, i)
            # rank 0's, as counted
            assert sum(n["bytes"] for n in notes[0]) == record["comm"]["all_to_all"]


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
def test_step12_at_four_ranks_drifts_from_step0_as_another_order_does(ep_runs, layout):
    reference = other_order.drift(
        metrics(ep_runs["ep2_x2"]),
        weights(ep_runs["ep2_x2"]),
        metrics(ep_runs["step0_x4"]),
        weights(ep_runs["step0_x4"]),
    )
    run = ep_runs[layout]
    drift = other_order.drift(
        metrics(run), weights(run), metrics(ep_runs["step0_x4"]), weights(ep_runs["step0_x4"])
    )
    print(f"{layout}: {drift}; reference (ep 2 x 2 micro-batches vs step 0): {reference}")
    assert not other_order.beyond(
        drift, other_order.bound(reference, metrics(run), weights(run))
    ), (drift, reference)
    first, ref_first = metrics(run)["records"][0], metrics(ep_runs["step0_x4"])["records"][0]
    # the same routing
    assert first["moe"]["tokens_per_expert"] == ref_first["moe"]["tokens_per_expert"]


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
    """ep 2's checkpoint (each rank's file holds its experts) read by name at ep 1 (every expert on both ranks):
    both layouts compute step 0's bits, so the resumed run is the uninterrupted one."""
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
    """compare/plan.py's EP axis against real runs: a rank's parameters (dense whole, E/ep experts) as its record
    counts them, and the all-to-all bytes per layer, averaged over the ranks, with the kept fraction the run logged."""
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
