"""compare/activation_formula.py and the planner's published models: Korthikanti et al. 2022's
per-layer accounting term by term (their Table 2 for their four models, every mode), what autograd
really saves on this machine for the trainers' model (each difference named), the presets' parameter
counts as published, and the 175B layout of their Table 3 not fitting in 80 GB without
recomputation; and the model-state tables (the ZeRO paper's Table 1, the Ultra-Scale Playbook's
bytes per parameter)."""

import pytest
import torch

import plan
from activation_formula import TABLE2, FormulaActivations
from model import GPT2, GPTConfig

# their Table 3: micro-batch, t, p
KORTHIKANTI = {
    "megatron-22b": (4, 8, 1),
    "megatron-175b": (1, 8, 8),
    "megatron-530b": (1, 8, 35),
    "megatron-1t": (1, 8, 64),
}
# Table 2 prints full recomputation once, 2 (the layer's input in 16 bits); with sequence
# parallelism that input is split over t, as Megatron-LM keeps it: 2/t. A row the table leaves out,
# asserted with its rows.
ROWS = {**TABLE2, ("full", True): lambda a, s, h, t: 2 / t}


@pytest.mark.quick
@pytest.mark.parametrize("name", KORTHIKANTI)
def test_every_mode_of_table_2_per_layer(name):
    """e = 2, masks of 1 byte, dropout on, math attention: the five rows of their Table 2 in units
    of sbh, at each model's t, and full recomputation with sequence parallelism (ROWS: 2/t, not 2).
    What the paper leaves out (the LayerNorms' float32 statistics, 16 bytes a token) is
    below 0.03%."""
    shape = plan.PRESETS[name]
    b, t, _ = KORTHIKANTI[name]
    sbh = shape.seq_len * b * shape.n_embd
    for (recompute, sequence_parallel), closed_form in ROWS.items():
        formula = FormulaActivations(shape, b, 2, "math", 0.1, selective=recompute == "selective")
        got = (
            formula.kept_per_block(t, sequence_parallel)
            if recompute == "full"
            else formula.block_bytes(t, sequence_parallel)
        )
        expected = closed_form(shape.n_head, shape.seq_len, shape.n_embd, t) * sbh
        assert 0 <= got - expected < 3e-4 * expected, (
            recompute,
            sequence_parallel,
            got / sbh,
            expected / sbh,
        )
    # and at t = 1, the paper's equation (1): sbh (34 +
    # 5as/h), of which the statistics are the only addition
    formula = FormulaActivations(shape, b, 2, "math", 0.1)
    terms = formula.terms()
    assert (
        sum(terms.values()) - terms["norm statistics"]
        == sbh * 34 + 5 * shape.n_head * shape.seq_len**2 * b
    )


@pytest.mark.quick
def test_flash_attention_keeps_no_s_squared_and_swiglu_three_ffn_wide_tensors():
    llama = plan.PRESETS["llama3-8b"]
    flash = FormulaActivations(llama, 1, 2, "sdpa").terms()
    tokens, h = llama.seq_len, llama.n_embd
    assert "scores" not in flash and flash["log-sum-exp"] == llama.n_head * tokens * 4
    assert (
        flash["q, k, v"] == tokens * (h + 2 * 8 * 128) * 2
        and flash["MLP"] == 3 * tokens * 14336 * 2
    )
    assert flash["norm statistics"] == 2 * 4 * tokens  # RMSNorm: one float32 per token
    eager = FormulaActivations(llama, 1, 2, "math").terms()
    # 2 GiB a layer at s = 8192: why flash
    assert eager["scores"] == llama.n_head * tokens * tokens * 2


def saved_by_one_block(config: GPTConfig, micro_batch_size: int, model=None) -> dict:
    """Bytes autograd saves inside block 0 of the real model on this CPU (or of ``model``), each
    storage once, weights left out."""
    torch.manual_seed(0)
    model = model or GPT2(config).train()
    weights = {p.untyped_storage()._cdata for p in model.parameters()}
    saved, inside = {}, []
    block = model.transformer.h[0]
    block.register_forward_pre_hook(lambda *_: inside.append(True))  # both hooks return None
    block.register_forward_hook(lambda *_: inside.clear())

    def pack(tensor):
        storage = tensor.untyped_storage()
        if inside and storage._cdata not in weights:
            saved[storage._cdata] = storage.nbytes()
        return tensor

    tokens = torch.randint(0, config.vocab_size, (micro_batch_size, config.seq_len))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(tokens)
    return saved


@pytest.mark.quick
@pytest.mark.parametrize("attention, dropout", [("math", 0.0), ("math", 0.1), ("sdpa", 0.0)])
def test_the_formula_is_what_autograd_saves_for_the_trainers_model(attention, dropout):
    """Counted on real tensors (the meta device runs SDPA's math path), float32, e = 4. Two
    differences, each named: on a CPU a dropout mask is a float32 tensor (m = 4; a bool on a GPU),
    and the math path keeps its s x s bool causal mask. SDPA's output is laid out (b, s, a, d) under
    its (b, a, s, d) shape, so c_proj's input is the same storage: kept once, as the formula
    counts it."""
    torch.set_num_threads(1)
    b, s, h, heads = 2, 32, 64, 4
    config = GPTConfig(
        vocab_size=128,
        seq_len=s,
        n_layer=1,
        n_head=heads,
        n_embd=h,
        dropout=dropout,
        attention=attention,
    )
    measured = sum(saved_by_one_block(config, b).values())
    shape = plan.Shape(1, h, heads, 128, s)
    formula = FormulaActivations(
        shape, b, element=4, attention=attention, dropout=dropout, mask=4
    ).block_bytes(1)
    differences = s * s if attention == "math" else 0
    assert measured == formula + differences, (measured, formula, differences)


def MOE(config: GPTConfig, flags: dict):
    from moe_setup import moe_model

    return moe_model(GPT2(config), {"seed": 0, "n_layer": config.n_layer, **flags}).train()


MOE_CONFIG = dict(vocab_size=128, seq_len=32, n_layer=1, n_head=4, n_embd=64, attention="math")


@pytest.mark.quick
@pytest.mark.parametrize(
    "top_k, capacity_factor, dropout", [(1, 0.0, 0.0), (2, 0.0, 0.0), (2, 1.0, 0.1)]
)
def test_the_moe_formula_is_what_autograd_saves_in_one_process(top_k, capacity_factor, dropout):
    """An MoE block of common/moe.py (step 0's), float32: the formula's terms with S = R = the kept
    slots the layer counted (k T dropless; fewer with a capacity factor of 1, where some slots
    drop), Switch's k = 1 (no renormalising) and k = 2; the one difference the dense test names
    (math attention's s x s causal mask)."""
    torch.set_num_threads(1)
    b, experts = 2, 4
    config = GPTConfig(**MOE_CONFIG, dropout=dropout)
    flags = dict(
        moe_experts=experts, moe_top_k=top_k, moe_every=1, moe_capacity_factor=capacity_factor
    )
    model = MOE(config, flags)
    saved = saved_by_one_block(config, b, model)
    layer, tokens = model.transformer.h[0].mlp, b * config.seq_len
    kept = layer.totals["slots"] - layer.totals["dropped"]
    assert (kept < top_k * tokens) == (capacity_factor > 0)
    shape = plan.Shape(1, 64, 4, 128, 32)
    formula = FormulaActivations(shape, b, element=4, attention="math", dropout=dropout, mask=4)
    assert sum(saved.values()) == formula.moe_block_bytes(experts, top_k, kept, kept) + 32 * 32


def moe_activations_worker(rank, world_size, port, queue):
    """Step 12's dispatcher at ep = world size: each rank its own tokens, what its MoE block saves
    and the slots it sent and its experts received."""
    import os
    import sys
    import traceback

    import torch.distributed as dist

    from conftest import REPO

    try:
        torch.set_num_threads(1)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        sys.path.insert(0, str(REPO / "step12_expert_parallel"))
        from expert_parallel import Groups, shard_experts

        config = GPTConfig(**MOE_CONFIG, dropout=0.1)
        flags = dict(moe_experts=4, moe_top_k=2, moe_every=1, moe_capacity_factor=0.0)
        torch.manual_seed(0)
        model = MOE(config, flags)
        layer = model.transformer.h[0].mlp
        (dispatcher,) = shard_experts(model, [layer], Groups(world_size))
        weights = {p.untyped_storage()._cdata for p in model.parameters()}
        saved, inside = {}, []
        model.transformer.h[0].register_forward_pre_hook(lambda *_: inside.append(True))
        model.transformer.h[0].register_forward_hook(lambda *_: inside.clear())

        def pack(tensor):
            storage = tensor.untyped_storage()
            if inside and storage._cdata not in weights:
                saved[storage._cdata] = storage.nbytes()
            return tensor

        torch.manual_seed(1 + rank)  # each rank its own micro-batch: uneven slots arrive
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            model(torch.randint(0, config.vocab_size, (2, config.seq_len)))
        note = dispatcher.traffic[-1]
        queue.put((rank, (sum(saved.values()), sum(note["sent_per_expert"]), note["received"])))
    except Exception:  # noqa: BLE001
        queue.put((rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_the_moe_formula_is_what_each_rank_saves_under_expert_parallelism():
    """Step 12 at ep 2, dropless, dropout on: on each rank the formula with the slots its tokens
    sent (S = k T) and the slots its experts computed (R, uneven: the router does not balance this
    micro-batch), to the byte; and their mean is the planner's balanced default (R = k T: what one
    rank receives, all ranks send)."""
    from conftest import spawn

    got = spawn(moe_activations_worker, 2)
    assert all(isinstance(r, tuple) for r in got.values()), got
    formula = FormulaActivations(
        plan.Shape(1, 64, 4, 128, 32), 2, element=4, attention="math", dropout=0.1, mask=4
    )
    for measured, sent, received in got.values():
        assert sent == 2 * 64
        assert measured == formula.moe_block_bytes(4, 2, sent, received) + 32 * 32
    assert got[0][2] != got[1][2] and got[0][2] + got[1][2] == 2 * 2 * 64
    mean = sum(measured for measured, _, _ in got.values()) / 2
    assert mean == formula.moe_block_bytes(4, 2) + 32 * 32


@pytest.mark.quick
def test_presets_have_their_published_parameter_counts():
    """Exact where the count is published to the parameter (Hugging Face's GPT-2s; Llama 3's), else
    within the paper's rounding."""
    exact = {
        "gpt2": 124_439_808,
        "gpt2-medium": 354_823_168,
        "gpt2-large": 774_030_080,
        "gpt2-xl": 1_557_611_200,
        "llama3-8b": 8_030_261_248,
        "llama3-70b": 70_553_706_496,
        "llama3-405b": 405_853_388_800,
    }
    assert {name: plan.PRESETS[name].psi for name in exact} == exact
    rounded = {
        "gpt3-125m": 125e6,
        "gpt3-350m": 350e6,
        "gpt3-760m": 760e6,
        "gpt3-1.3b": 1.3e9,
        "gpt3-2.7b": 2.7e9,
        "gpt3-6.7b": 6.7e9,
        "gpt3-13b": 13e9,
        "gpt3-175b": 175e9,
        "megatron-22b": 22e9,
        "megatron-175b": 175e9,
        "megatron-530b": 530e9,
        "megatron-1t": 1e12,
    }
    for name, count in rounded.items():
        assert abs(plan.PRESETS[name].psi / count - 1) < 0.02, name


@pytest.mark.quick
def test_llama_tensor_parallel_shares_split_gqa_and_swiglu():
    """Llama 3 8B at t = 8: q and c_proj 1/8 of h², k and v 1/8 of their 8 heads, the three MLP
    matrices 1/8; the RMSNorms whole; untied, the output layer's own matrix is split like
    the embedding."""
    llama = plan.PRESETS["llama3-8b"]
    h, kv, f, vocab = 4096, 1024, 14336, 128256
    block = (2 * h * h + 2 * h * kv + 3 * h * f) // 8 + 2 * h
    assert plan.rank_params(llama, 8, 1, 0) == {
        "blocks": 32 * block,
        "rest": 2 * vocab * h // 8 + h,
    }
    assert sum(plan.rank_params(llama, 1, 1, 0).values()) == llama.psi


@pytest.mark.quick
def test_the_175b_layout_of_table_3_does_not_fit_without_recomputation():
    """t 8, p 8, micro-batch 1, 64 micro-batches, 16-bit: the first stage holds 8 micro-batches of
    12 layers, 96 x 23 sbh (10 + 24/8 + 5as/(ht)), 55.6 GB, beside 16 bytes a parameter of its 2.8
    B: about 100 GB, over 80 GiB. Selective recomputation with sequence parallelism (34/t) brings
    it under."""
    shape = plan.PRESETS["megatron-175b"]
    hardware = plan.Hardware(64, 80 * plan.GIB)
    formula = FormulaActivations(shape, 1, 2, "math", 0.1)
    fit, rejected = plan.plan(shape, hardware, 1, 64, "bf16", activations=formula)
    layout = next(
        c
        for c in rejected
        if (c["dp"], c["tp"], c["pp"], c["zero"], c["checkpointing"]) == (1, 8, 8, 0, False)
    )
    first = layout["stages"][0]
    sbh = shape.seq_len * shape.n_embd
    layers = 96 * 23 * sbh + 8 * sbh  # and the embedding dropout's mask per micro-batch held
    assert first["in_flight"] == 8 and 0 <= first["activations"] - layers < 1e-4 * layers
    assert 95e9 < layout["total"] < 105e9 and layout["worst_stage"] == 0
    selective = FormulaActivations(shape, 1, 2, "math", 0.1, selective=True)
    c = plan.configuration(
        shape, 1, 8, 8, 0, False, 1, 64, selective, "bf16", sequence_parallel=True
    )
    assert c["total"] < 80 * plan.GIB


# the ZeRO paper's Table 1 (GB per device, K = 12): rows
# N = 1, 4, 16, 64; per model ZeRO-1, ZeRO-2, ZeRO-3
ZERO_TABLE_1 = {
    1: ((120, 120, 120), (2048, 2048, 2048), (16000, 16000, 16000)),
    4: ((52.5, 41.3, 30), (896, 704, 512), (7000, 5500, 4000)),
    16: ((35.6, 21.6, 7.5), (608, 368, 128), (4750, 2875, 1000)),
    64: ((31.4, 16.6, 1.88), (536, 284, 32), (4187, 2218, 250)),
}


def last_digit(printed: float) -> float:
    """One unit of the last printed digit: the paper rounds some entries and truncates others."""
    text = f"{printed:g}"
    return 10 ** -len(text.split(".")[1]) if "." in text else 1


@pytest.mark.quick
def test_the_zero_papers_table_1_within_its_printed_digits():
    import estimate

    for n, models in ZERO_TABLE_1.items():
        for psi, printed in zip((7.5e9, 128e9, 1e12), models):
            for stage, value in zip((1, 2, 3), printed):
                got = sum(estimate.state_bytes(stage, int(psi), n, "bf16").values()) / 1e9
                assert abs(got - value) < last_digit(value), (n, psi, stage, got, value)


@pytest.mark.quick
def test_the_ultra_scale_playbooks_bytes_per_parameter():
    """Its table: float32 training 4 + 4 + 8 = 16 bytes a parameter; mixed precision 2 + 2 + 4 (the
    float32 master) + 8 = 16; with float32 gradients as well, 20. The trainers' float32 gradients
    (FSDP2's reduce_dtype) replace the 16-bit ones instead of adding to them: 18, and 16 under
    ZeRO-3, whose shard is the master."""
    import estimate

    assert sum(estimate.bytes_per_parameter(0, "float32")[0]) == 16
    assert sum(estimate.bytes_per_parameter(0, "bf16")[0]) == 16
    assert sum(estimate.bytes_per_parameter(0, "bf16", "float32")[0]) == 20 - 2
    assert sum(estimate.bytes_per_parameter(3, "bf16", "float32")[0]) == 16


def test_the_command_line_describes_a_model_by_its_shape_or_a_preset(tmp_path):
    """Llama 3 8B by flags is the preset; a preset takes --seq-len and --vocab-size over its own; a
    shape that is not the trainers' model is sized by the formula."""
    import json
    import sys

    from conftest import REPO, run_forked

    def shape(*flags) -> tuple[dict, str]:
        out = tmp_path / "plan.json"
        result = run_forked(
            [
                sys.executable,
                str(REPO / "compare" / "plan.py"),
                "--devices",
                "8",
                "--top",
                "1",
                "--micro-batch-size",
                "1",
                "--json",
                str(out),
                *flags,
            ],
            timeout=120,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        text = result.stdout
        return json.loads(out.read_text())["shape"], text

    by_flags, text = shape(
        "--n-layer",
        "32",
        "--n-embd",
        "4096",
        "--n-head",
        "32",
        "--n-kv-head",
        "8",
        "--ffn",
        "14336",
        "--mlp",
        "swiglu",
        "--norm",
        "rmsnorm",
        "--untied",
        "--no-bias",
        "--rotary",
        "--vocab-size",
        "128256",
        "--seq-len",
        "8192",
    )
    assert plan.Shape(**by_flags) == plan.PRESETS["llama3-8b"] and "activations by formula" in text
    preset, text = shape("--preset", "gpt3-175b", "--seq-len", "4096", "--vocab-size", "51200")
    assert (preset["seq_len"], preset["vocab"], preset["n_layer"]) == (4096, 51200, 96)
    _, text = shape()
    assert "counted on the meta device" in text
