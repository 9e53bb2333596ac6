"""common/model.py against computations nobody here wrote.

Parity between steps cannot see a bug that every step shares, and every step trains this model. So
the oracle is Hugging Face ``transformers``' GPT-2 (a test-only dependency, imported by this file
and tests/test_export_hf.py alone): the same weights copied into it by compare/export_hf.py's
mapping (its ``Conv1D`` holds ``(in, out)``, the transpose of ``nn.Linear``, and one fused
``c_attn`` laid out ``[q | k | v]``), then logits and every gradient compared in float64, where two
correct implementations of the same formula agree to ~1e-15 whatever order they add in.
"""

import ast
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "compare"), str(REPO / "common")]
import export_hf  # noqa: E402  (compare/export_hf.py: our GPT-2 onto transformers', the one mapping)
from model import GPT2, build_model, gpt2_config, initial_value, language_model_loss  # noqa: E402

CONFIG = {"n_layer": 2, "n_head": 4, "n_embd": 32, "seq_len": 16, "dropout": 0.0}
VOCAB = 64


def hugging_face_copy(model):
    """transformers' GPT2LMHeadModel holding ``model``'s weights (eager attention, float64), mapped
    by the exporter (compare/export_hf.py: the one place that knows how our names and layouts
    become theirs)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = model.config
    config = export_hf.hugging_face_config(
        {
            "seq_len": cfg.seq_len,
            "n_embd": cfg.n_embd,
            "n_layer": cfg.n_layer,
            "n_head": cfg.n_head,
            "dropout": cfg.dropout,
        },
        cfg.vocab_size,
        None,
    )
    hf = GPT2LMHeadModel(GPT2Config(**config, attn_implementation="eager")).double()
    missing, unexpected = hf.load_state_dict(
        export_hf.hugging_face_weights(dict(model.named_parameters())), strict=False
    )
    assert (missing, unexpected) == (["lm_head.weight"], [])  # tied: it is transformer.wte.weight
    assert hf.lm_head.weight is hf.transformer.wte.weight
    return hf


@pytest.mark.quick
@pytest.mark.parametrize("attention", ["math", "sdpa"])
def test_logits_and_gradients_equal_transformers_gpt2(attention):
    model = build_model({**CONFIG, "attention": attention}, VOCAB, seed=3).double()
    hf = hugging_face_copy(model)
    ids = torch.randint(
        0, VOCAB, (3, CONFIG["seq_len"]), generator=torch.Generator().manual_seed(0)
    )
    targets = torch.roll(ids, -1, dims=1)

    ours = model(ids)
    theirs = hf(input_ids=ids).logits
    assert ours.shape == theirs.shape == (3, CONFIG["seq_len"], VOCAB)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)

    torch.nn.functional.cross_entropy(ours.flatten(0, 1), targets.flatten()).backward()
    torch.nn.functional.cross_entropy(theirs.flatten(0, 1), targets.flatten()).backward()
    hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    # linear
    ours_as_theirs = export_hf.hugging_face_weights(
        {n: p.grad for n, p in model.named_parameters()}
    )
    checked = 0
    for name, grad in ours_as_theirs.items():
        torch.testing.assert_close(grad, hf_grads[name], rtol=1e-10, atol=1e-12, msg=name)
        checked += 1
    # q, k, v fused into one c_attn
    assert checked == len(hf_grads) == 2 + 2 + CONFIG["n_layer"] * 12


@pytest.mark.quick
def test_a_deliberate_bug_is_caught_by_the_oracle():
    """The oracle can fail:
    a model whose attention forgets the causal mask differs from transformers'."""
    model = build_model({**CONFIG, "attention": "math"}, VOCAB, seed=3).double()
    hf = hugging_face_copy(model)
    ids = torch.randint(
        0, VOCAB, (2, CONFIG["seq_len"]), generator=torch.Generator().manual_seed(1)
    )
    original = torch.Tensor.masked_fill
    try:
        torch.Tensor.masked_fill = lambda self, mask, value: self  # no causal mask
        broken = model(ids)
    finally:
        torch.Tensor.masked_fill = original
    assert not torch.allclose(broken, hf(input_ids=ids).logits, rtol=1e-6, atol=1e-6)


@pytest.mark.quick
def test_math_and_sdpa_attention_agree_in_float32():
    ids = torch.randint(
        0, VOCAB, (4, CONFIG["seq_len"]), generator=torch.Generator().manual_seed(2)
    )
    grads = {}
    for attention in ("math", "sdpa"):
        model = build_model({**CONFIG, "attention": attention}, VOCAB, seed=5)
        loss = language_model_loss(model, ids, torch.roll(ids, -1, dims=1))
        loss.backward()
        grads[attention] = (loss.detach(), {n: p.grad for n, p in model.named_parameters()})
    torch.testing.assert_close(grads["math"][0], grads["sdpa"][0], rtol=1e-6, atol=1e-6)
    for name, grad in grads["math"][1].items():
        torch.testing.assert_close(grad, grads["sdpa"][1][name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.quick
def test_parameter_names_shapes_and_initial_values():
    """The documented names and nn.Linear layouts; every value is initial_value(seed, name), so any
    rank can build one parameter alone; the output layer is the token embedding."""
    model = build_model(CONFIG, VOCAB, seed=7)
    h = CONFIG["n_embd"]
    block = {
        "ln_1.weight": (h,),
        "ln_1.bias": (h,),
        "attn.c_q.weight": (h, h),
        "attn.c_q.bias": (h,),
        "attn.c_k.weight": (h, h),
        "attn.c_k.bias": (h,),
        "attn.c_v.weight": (h, h),
        "attn.c_v.bias": (h,),
        "attn.c_proj.weight": (h, h),
        "attn.c_proj.bias": (h,),
        "ln_2.weight": (h,),
        "ln_2.bias": (h,),
        "mlp.c_fc.weight": (4 * h, h),
        "mlp.c_fc.bias": (4 * h,),
        "mlp.c_proj.weight": (h, 4 * h),
        "mlp.c_proj.bias": (h,),
    }
    expected = {
        "transformer.wte.weight": (VOCAB, h),
        "transformer.wpe.weight": (CONFIG["seq_len"], h),
        **{f"transformer.h.{i}.{k}": v for i in range(CONFIG["n_layer"]) for k, v in block.items()},
        "transformer.ln_f.weight": (h,),
        "transformer.ln_f.bias": (h,),
    }
    named = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert named == expected
    assert model.lm_head.weight is model.transformer.wte.weight
    for name, param in model.named_parameters():
        assert torch.equal(param, initial_value(name, param.shape, 7, CONFIG["n_layer"])), name
    std = model.transformer.h[0].mlp.c_proj.weight.std().item()
    # GPT-2's scaled residual projections
    assert abs(std - 0.02 / (2 * CONFIG["n_layer"]) ** 0.5) < 0.002
    assert abs(model.transformer.h[0].mlp.c_fc.weight.std().item() - 0.02) < 0.002
    assert not torch.equal(
        build_model(CONFIG, VOCAB, seed=8).transformer.wte.weight, model.transformer.wte.weight
    )


@pytest.mark.quick
def test_building_the_model_draws_nothing_from_the_global_generator():
    """Dropout's masks must not depend on how (or whether) a rank built the model."""
    torch.manual_seed(0)
    before = torch.get_rng_state()
    build_model(CONFIG, VOCAB, seed=1)
    assert torch.equal(before, torch.get_rng_state())
    with torch.device("meta"):
        assert GPT2(gpt2_config(CONFIG, VOCAB)).transformer.wte.weight.is_meta


@pytest.mark.quick
def test_no_step_or_tool_imports_transformers():
    """Only the tests that use it as an oracle: this file, and tests/test_export_hf.py (which loads
    what compare/export_hf.py writes; the exporter itself writes plain JSON and safetensors), and
    the one file written for transformers to run, never imported here: compare/modeling_gpt2_moe.py,
    which an exported MoE folder carries. The repository's own
    files: not a virtual environment made inside the clone (``python -m venv venv``, as a learner
    may: its site-packages hold files this Python cannot even parse)."""
    importers = []
    environments = {p.parent.name for p in REPO.glob("*/pyvenv.cfg")}
    for path in REPO.rglob("*.py"):
        parts = path.relative_to(REPO).parts
        if parts[0] in environments or any(
            part.startswith(".") or part in ("runs", "__pycache__", "site-packages")
            for part in parts
        ):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else ([node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            )
            if any(n == "transformers" or n.startswith("transformers.") for n in names):
                importers.append(str(path.relative_to(REPO)))
    assert sorted(set(importers)) == [
        "compare/modeling_gpt2_moe.py",
        "tests/test_export_hf.py",
        "tests/test_model.py",
    ]


# ---- common/moe.py's MoE layer against transformers' Mixtral sparse block ------------------------
# Mixtral's experts are gated (act(gate) * up) and have no biases; a GPT-2 MLP fits inside one with
# one more input feature held at 1 (it carries c_fc's bias in the gate rows and makes every up
# unit 1) and one more hidden unit whose gate is 10 (gelu_tanh(10) is 10.0 exactly in float32 and
# float64), which carries c_proj's bias / 10. The block's routing (softmax in float32, top-k,
# renormalised), dispatch and weighted sum are Mixtral's own code. In float64 the two agree to
# ~1e-15 but for the router probabilities both take in float32 (HF's router and ours softmax float32
# logits), whose rounding moves outputs and gradients by up to ~1e-7 relative: 1e-6 is the
# tolerance.
MOE_TOLERANCE = {"rtol": 1e-6, "atol": 1e-9}


def mixtral_copy(moe):
    """transformers' MixtralSparseMoeBlock holding ``moe``'s
    router and experts (float64, eager experts)."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    n_experts, h = moe.router.weight.shape
    inner = moe.experts["0"].c_fc.weight.shape[0]
    config = MixtralConfig(
        hidden_size=h + 1,
        intermediate_size=inner + 1,
        num_local_experts=n_experts,
        num_experts_per_tok=moe.top_k,
        hidden_act="gelu_pytorch_tanh",
        router_jitter_noise=0.0,
    )
    config._experts_implementation = "eager"
    block = MixtralSparseMoeBlock(config).double()
    with torch.no_grad():
        block.gate.weight.zero_()[:, :h] = moe.router.weight
        block.experts.gate_up_proj.zero_()
        block.experts.down_proj.zero_()
        for e in range(n_experts):
            expert = moe.experts[str(e)]
            gate_up, down = block.experts.gate_up_proj[e], block.experts.down_proj[e]
            gate_up[:inner, :h], gate_up[:inner, h] = expert.c_fc.weight, expert.c_fc.bias
            gate_up[inner, h] = 10.0
            gate_up[inner + 1 :, h] = 1.0  # every up unit: 1
            down[:h, :inner], down[:h, inner] = expert.c_proj.weight, expert.c_proj.bias / 10.0
    return block


def moe_layer(n_experts=4, top_k=2, h=16, seed=3):
    import moe as moe_module
    from model import GPTConfig

    layer = moe_module.MoE(
        GPTConfig(vocab_size=8, seq_len=8, n_layer=2, n_head=2, n_embd=h), n_experts, top_k
    )
    with torch.no_grad():
        # biases too: initial_value would leave them 0
        for i, param in enumerate(layer.parameters()):
            param.copy_(
                torch.randn(param.shape, generator=torch.Generator().manual_seed(seed + i)) * 0.3
            )
    return layer.double()


@pytest.mark.parametrize("n_experts,top_k", [(4, 2), (8, 3)])
def test_moe_layer_output_and_gradients_equal_transformers_mixtral_block(n_experts, top_k):
    ours = moe_layer(n_experts, top_k)
    theirs = mixtral_copy(ours)
    x = torch.randn(3, 10, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    upstream = torch.randn(
        3, 10, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1)
    )
    x_ours, x_theirs = (
        x.clone().requires_grad_(),
        torch.cat([x, torch.ones(3, 10, 1, dtype=torch.float64)], -1),
    )
    x_theirs.requires_grad_()
    y_ours, y_theirs = ours(x_ours), theirs(x_theirs)
    assert y_ours.dtype == torch.float64
    torch.testing.assert_close(y_ours, y_theirs[..., :16], **MOE_TOLERANCE)
    assert torch.count_nonzero(y_theirs[..., 16]) == 0
    (y_ours * upstream).sum().backward()
    (y_theirs[..., :16] * upstream).sum().backward()
    inner = ours.experts["0"].c_fc.weight.shape[0]
    pairs = [
        (x_ours.grad, x_theirs.grad[..., :16]),
        (ours.router.weight.grad, theirs.gate.weight.grad[:, :16]),
    ]
    for e in range(n_experts):
        expert, gate_up, down = (
            ours.experts[str(e)],
            theirs.experts.gate_up_proj.grad[e],
            theirs.experts.down_proj.grad[e],
        )
        pairs += [
            (expert.c_fc.weight.grad, gate_up[:inner, :16]),
            (expert.c_fc.bias.grad, gate_up[:inner, 16]),
            (expert.c_proj.weight.grad, down[:16, :inner]),
            (expert.c_proj.bias.grad, down[:16, inner] / 10.0),
        ]
    for a, b in pairs:
        torch.testing.assert_close(a, b, **MOE_TOLERANCE)
    # the weights are renormalised probabilities: a gradient
    assert ours.router.weight.grad.abs().max() > 1e-3


@pytest.mark.parametrize("n_experts,top_k", [(4, 1), (4, 2), (8, 3)])
def test_load_balancing_loss_is_transformers_divided_by_k(n_experts, top_k):
    """Ours divides the slot counts by k*T (1 at perfect balance,
    DeepSeek's form), HF's by T: k times ours."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    import moe as moe_module

    logits = torch.randn(
        40,
        n_experts,
        generator=torch.Generator().manual_seed(n_experts + top_k),
        requires_grad=True,
    )
    ours = moe_module.route(logits, top_k).aux_loss
    theirs = load_balancing_loss_func((logits,), n_experts, top_k)
    torch.testing.assert_close(top_k * ours, theirs, rtol=1e-6, atol=0)
    (g_ours,) = torch.autograd.grad(top_k * ours, logits)
    (g_theirs,) = torch.autograd.grad(theirs, logits)
    torch.testing.assert_close(g_ours, g_theirs, rtol=1e-5, atol=1e-8)


def test_a_deliberate_moe_bug_is_caught_by_the_oracle():
    """Weights not renormalised for k = 2 (Switch's rule where Mixtral's holds):
    the oracle must see it."""
    import moe as moe_module

    ours = moe_layer(4, 2)
    theirs = mixtral_copy(ours)
    x = torch.randn(2, 6, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    original = moe_module.route

    def unnormalised(logits, top_k, capacity_factor=0.0, whole_sequence=None):
        routing = original(logits, 1, capacity_factor, whole_sequence)
        probs = routing.probs
        routing.weights, routing.experts = probs.topk(top_k, dim=-1)
        routing.kept = torch.ones_like(routing.experts, dtype=torch.bool)
        return routing

    moe_module.route = unnormalised
    try:
        y = ours(x)
    finally:
        moe_module.route = original
    theirs_y = theirs(torch.cat([x, torch.ones(2, 6, 1, dtype=torch.float64)], -1))[..., :16]
    assert not torch.allclose(y, theirs_y, **MOE_TOLERANCE)
