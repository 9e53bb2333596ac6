"""common/moe.py by hand, and step 0 training it.

The MoE layer's numbers against transformers' Mixtral block are in test_model.py (the one file that
imports transformers). Here: routing, capacity, permutation and the load-balancing loss worked out
by hand on a few tokens (as torchtitan's tests/unit_tests/test_expert_parallel.py does for its
permutation), the layer against a token-by-token loop, the parameter names and initial values, the
flags' checks, and step 0's records.
"""

import math

import pytest
import torch

import moe  # common/, on the path through conftest
import moe_setup
from conftest import MOE, assert_bitwise_same_run, metrics, train, weights
from failures import UserError
from model import GPTConfig, build_model, initial_value


def logits_choosing(choices: list[list[int]], n_experts: int) -> torch.Tensor:
    """Logits under which token t's choices are ``choices[t]``,
    in that order (10, 9, ... for them, 0 for the rest)."""
    logits = torch.zeros(len(choices), n_experts)
    for t, experts in enumerate(choices):
        for j, e in enumerate(experts):
            logits[t, e] = 10.0 - j
    return logits


def test_capacity_is_ceil_of_k_tokens_factor_over_experts():
    assert moe.capacity(64, 4, 2, 1.0) == 32
    assert moe.capacity(10, 4, 1, 1.25) == math.ceil(10 * 1.25 / 4) == 4
    assert moe.capacity(3, 2, 2, 0.5) == 2  # ceil(1.5)
    assert moe.capacity(64, 4, 2, 0.0) is None  # dropless


def test_top1_routing_by_hand_switch_weights_and_drops_by_position():
    logits = logits_choosing([[0], [0], [0], [1]], 3)
    routing = moe.route(logits, top_k=1, capacity_factor=1.0)  # C = ceil(1 * 4 * 1 / 3) = 2
    probs = torch.softmax(logits, -1)
    assert routing.experts.flatten().tolist() == [0, 0, 0, 1]
    # k = 1: the probability, not 1
    assert torch.equal(routing.weights.flatten(), probs.max(-1).values)
    # expert 0's third slot is past C
    assert routing.kept.flatten().tolist() == [True, True, False, True]
    f = torch.tensor([3 / 4, 1 / 4, 0.0])
    torch.testing.assert_close(routing.aux_loss, 3 * (f * probs.mean(0)).sum(), rtol=1e-6, atol=0)
    order, counts = moe.permute(routing, 3)
    assert counts.tolist() == [2, 1, 0] and order.tolist() == [0, 1, 3]


def test_top2_routing_by_hand_renormalised_and_dropped_choice_by_choice():
    # Two experts, each token takes both: slots t0c0 t0c1
    # t1c0 t1c1 t2c0 t2c1; C = ceil(2 * 3 * 0.5 / 2) = 2.
    logits = logits_choosing([[0, 1], [1, 0], [0, 1]], 2)
    routing = moe.route(logits, top_k=2, capacity_factor=0.5)
    assert routing.experts.tolist() == [[0, 1], [1, 0], [0, 1]]
    torch.testing.assert_close(routing.weights.sum(-1), torch.ones(3))  # renormalised (Mixtral)
    # token 2: both past C
    assert routing.kept.tolist() == [[True, True], [True, True], [False, False]]
    order, counts = moe.permute(routing, 2)
    assert counts.tolist() == [2, 2]
    # expert 0: t0c0 (slot 0), t1c1 (slot 3); expert 1: t0c1, t1c0
    assert order.tolist() == [0, 3, 1, 2]
    # perfect balance: f = P = 1/2, E * sum = 1
    assert torch.allclose(routing.aux_loss, torch.tensor(1.0))


def test_permutation_and_counts_when_dropless():
    logits = torch.randn(50, 8, generator=torch.Generator().manual_seed(0))
    routing = moe.route(logits, top_k=3)
    order, counts = moe.permute(routing, 8)
    assert routing.kept.all() and counts.sum() == 150
    assert sorted(order.tolist()) == list(range(150))
    by_expert = routing.experts.flatten()[order]
    assert torch.equal(by_expert, torch.sort(by_expert).values)  # sorted by expert
    for e in range(8):  # within an expert, in order of position
        mine = order[by_expert == e]
        assert torch.equal(mine, torch.sort(mine).values) and len(mine) == counts[e]


def layer(n_experts=4, top_k=2, capacity_factor=0.0, h=8):
    m = moe.MoE(
        GPTConfig(vocab_size=8, seq_len=8, n_layer=2, n_head=2, n_embd=h),
        n_experts,
        top_k,
        capacity_factor,
    )
    with torch.no_grad():
        for i, p in enumerate(m.parameters()):
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) * 0.5)
    return m.double()


@pytest.mark.parametrize("top_k,capacity_factor", [(1, 0.0), (2, 0.0), (2, 0.6), (3, 0.5)])
def test_layer_equals_a_token_by_token_loop(top_k, capacity_factor):
    m = layer(4, top_k, capacity_factor)
    x = torch.randn(2, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = m(x).view(10, 8)
    tokens = x.view(10, 8)
    routing = moe.route(m.router(tokens), top_k, capacity_factor)
    for t in range(10):
        expected = torch.zeros(8, dtype=torch.float64)
        for j in range(top_k):
            if routing.kept[t, j]:
                expected += routing.weights[t, j] * m.experts[str(int(routing.experts[t, j]))](
                    tokens[t]
                )
        torch.testing.assert_close(y[t], expected, rtol=1e-12, atol=1e-14)
        if not routing.kept[t].any():
            # dropped everywhere: the residual alone carries it
            assert torch.count_nonzero(y[t]) == 0
    assert m.totals["dropped"] == int((~routing.kept).sum()) and m.totals["slots"] == 10 * top_k
    if capacity_factor:
        assert m.totals["dropped"] > 0  # the case drops something
        assert max(m.totals["tokens_per_expert"]) <= moe.capacity(10, 4, top_k, capacity_factor)


CONFIG = {
    "n_layer": 3,
    "n_head": 2,
    "n_embd": 16,
    "seq_len": 8,
    "dropout": 0.0,
    "seed": 5,
    "moe_experts": 4,
    "moe_top_k": 2,
    "moe_every": 2,
    "moe_capacity_factor": 0.0,
    "moe_aux_loss_coef": 0.01,
}


def test_parameter_names_and_initial_values_are_a_function_of_seed_and_name():
    before = torch.get_rng_state()
    model = moe_setup.moe_model(build_model(CONFIG, 32, CONFIG["seed"]), CONFIG)
    assert torch.equal(before, torch.get_rng_state())  # nothing drawn from the global generator
    names = dict(model.named_parameters())
    assert moe_setup.moe_blocks(CONFIG) == [0, 2]
    for i in (0, 2):
        assert names[f"transformer.h.{i}.mlp.router.weight"].shape == (4, 16)
        for e in range(4):
            for part, shape in (
                ("c_fc.weight", (64, 16)),
                ("c_fc.bias", (64,)),
                ("c_proj.weight", (16, 64)),
                ("c_proj.bias", (16,)),
            ):
                assert names[f"transformer.h.{i}.mlp.experts.{e}.{part}"].shape == shape
    assert (
        "transformer.h.1.mlp.c_fc.weight" in names
        and "transformer.h.0.mlp.c_fc.weight" not in names
    )
    for name, p in names.items():
        assert torch.equal(p, initial_value(name, p.shape, CONFIG["seed"], CONFIG["n_layer"])), name
    # GPT-2's stds: c_proj scaled by 1/sqrt(2 n_layer); the
    # router and c_fc 0.02; experts differ from each other
    fc, proj = (
        names["transformer.h.0.mlp.experts.1.c_fc.weight"],
        names["transformer.h.0.mlp.experts.1.c_proj.weight"],
    )
    assert (
        abs(fc.std().item() - 0.02) < 0.002 and abs(proj.std().item() - 0.02 / math.sqrt(6)) < 0.001
    )
    assert abs(names["transformer.h.2.mlp.router.weight"].std().item() - 0.02) < 0.006
    assert not torch.equal(fc, names["transformer.h.0.mlp.experts.0.c_fc.weight"])


def test_a_dense_model_is_left_alone():
    dense = {**CONFIG, "moe_experts": 0}
    model = build_model(dense, 32, 5)
    before = {n: p.clone() for n, p in model.named_parameters()}
    assert moe_setup.moe_model(model, dense) is model
    assert {n: p for n, p in model.named_parameters()}.keys() == before.keys()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    loss = torch.tensor(1.5)
    assert (
        moe_setup.with_aux_loss(model, loss, dense) is loss
        and moe_setup.take_moe_record(model) == {}
    )


@pytest.mark.parametrize(
    "flags,message",
    [
        ({"moe_experts": 0, "moe_top_k": 2}, "--moe-top-k given with --moe-experts 0"),
        ({"moe_experts": 4, "moe_top_k": 5}, "--moe-top-k 5 must be between 1 and --moe-experts 4"),
        ({"moe_experts": 4, "moe_top_k": 0}, "--moe-top-k 0 must be between 1 and --moe-experts 4"),
        (
            {"moe_experts": 4, "moe_capacity_factor": -1.0},
            "--moe-capacity-factor cannot be negative, got -1",
        ),
        (
            {"moe_experts": 4, "moe_aux_loss_coef": float("nan")},
            "--moe-aux-loss-coef cannot be negative, got nan",
        ),
        ({"moe_experts": 4, "moe_every": 0}, "--moe-every must be at least 1, got 0"),
        ({"moe_experts": -2}, "--moe-experts cannot be negative, got -2"),
    ],
)
def test_moe_flags_that_mean_nothing_clear_are_refused(flags, message):
    config = {key: None for key in moe_setup.MOE_DEFAULTS} | flags
    with pytest.raises(UserError, match="^" + message.replace("(", r"\(")):
        moe_setup.check_moe(config)


@pytest.fixture(scope="module")
def moe_runs(tmp_path_factory, small_corpus):
    top = tmp_path_factory.mktemp("moe")
    return {
        "step0": train("step0", top / "step0", small_corpus, *MOE, "--save-every", "2"),
        "top": top,
        "corpus": small_corpus,
    }


def test_step0_records_the_experts_load_and_what_was_dropped(moe_runs):
    records = metrics(moe_runs["step0"])["records"]
    tokens = 2 * 32  # a micro-batch: 2 sequences of 32
    slots = 2 * 2 * tokens  # a step: 2 micro-batches, k = 2
    limit = moe.capacity(tokens, 4, 2, 1.0)
    for r in records:
        record = r["moe"]
        assert len(record["tokens_per_expert"]) == 2  # --moe-every 1: both blocks
        for counts, dropped in zip(record["tokens_per_expert"], record["dropped_fraction"]):
            assert len(counts) == 4 and max(counts) <= 2 * limit
            assert sum(counts) == round(slots * (1 - dropped))
        # per layer: 1 at perfect balance, E at the worst
        assert 1.0 <= record["aux_loss"] / 2 < 4.0
    # capacity 1.0 drops some
    assert any(d > 0 for r in records for d in r["moe"]["dropped_fraction"])
    assert "transformer.h.1.mlp.experts.3.c_proj.weight" in weights(moe_runs["step0"])


def test_step0_the_load_balancing_loss_reaches_the_weights(moe_runs):
    other = train("step0", moe_runs["top"] / "no_aux", moe_runs["corpus"], *MOE[:-1], "0")
    a, b = weights(moe_runs["step0"]), weights(other)
    assert not torch.equal(
        a["transformer.h.0.mlp.router.weight"], b["transformer.h.0.mlp.router.weight"]
    )
    # logged: CE
    assert metrics(other)["records"][0]["loss"] == metrics(moe_runs["step0"])["records"][0]["loss"]


def test_step0_moe_resumes_bit_for_bit(moe_runs):
    resumed = train(
        "step0",
        moe_runs["top"] / "resumed",
        moe_runs["corpus"],
        *MOE,
        "--resume",
        str(moe_runs["step0"] / "checkpoints" / "step_2"),
    )
    assert_bitwise_same_run(moe_runs["step0"], resumed)
