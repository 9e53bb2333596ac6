"""``--fp8 tensorwise|rowwise`` in the trainers (steps 0-7):
the same sums in every step, bit for bit.

FP8 changes what each block's matmul computes, not where the gradients are summed, so the contract
between the steps holds unchanged: at 2 ranks, steps 2-7 (step 3's naive all-reduce, step 4's
buckets, ZeRO-1/2, and ZeRO-3: every unit's shards gathered, then cast to FP8 in the forward)
bitwise to step 1 (DDP); resume bitwise (step 7, bf16 autocast); and step 0 bitwise to a
plain loop of an outsider's, on the same model and data, whose blocks torchao 0.18 converted
(the oracle:
``convert_to_float8_training`` with the same recipe, test-only). The layer itself: test_fp8.py.
"""

import re
import warnings

import pytest
import torch
from torch.utils.data import DistributedSampler

from conftest import (
    EXACT,
    FP8_RECIPES,
    REPO,
    ROWWISE_RUNS_HERE,
    TIMEOUT,
    TINY,
    assert_bitwise_same_run,
    fp8_cannot_run,
    launch,
    metrics,
    parity,
    run_ranks,
    train,
    weights,
)
from data import MicroBatches, load_corpus  # common/, on the path through conftest
from model import build_model, language_model_loss
from training import adamw_options, adamw_param_groups, autocast, clip_grad_norm, lr_at

RECIPES = ["tensorwise", "rowwise"]


@pytest.fixture(scope="module")
def fp8_runs(tmp_path_factory, small_corpus) -> dict:
    out = tmp_path_factory.mktemp("fp8")
    runs = {}
    for recipe in (r for r in RECIPES if fp8_cannot_run(r, torch.device("cpu")) is None):
        for step in ("step1", "step2", "step3", "step4", "step5", "step6", "step7"):
            runs[step, recipe] = train(
                step, out / f"{step}-{recipe}", small_corpus, "--fp8", recipe
            )
    return runs


@pytest.mark.quick
@pytest.mark.parametrize("recipe", FP8_RECIPES)
@pytest.mark.parametrize("step", ["step2", "step3", "step4", "step5", "step6", "step7"])
def test_step_with_fp8_is_bitwise_step1_at_world_size_2(fp8_runs, step, recipe):
    assert_bitwise_same_run(fp8_runs["step1", recipe], fp8_runs[step, recipe])
    result = parity(fp8_runs["step1", recipe], fp8_runs[step, recipe])
    assert "verdict: PASS (bitwise identical)" in result.stdout, result.stdout
    assert metrics(fp8_runs[step, recipe])["config"]["fp8"] == recipe


EXACT_FP8 = (*EXACT, "--fp8", "rowwise")


@pytest.fixture(scope="module")
def exact_step1(tmp_path_factory, small_corpus):
    return train(
        "step1", tmp_path_factory.mktemp("fp8_exact") / "step1", small_corpus, *EXACT_FP8, nproc=3
    )


@ROWWISE_RUNS_HERE
@pytest.mark.parametrize("step", ["step3", "step5", "step7"])
def test_exact_mode_with_fp8_is_bitwise_step1_at_3_ranks(exact_step1, step, tmp_path, small_corpus):
    """The contract's strictest setting (float64 reduction, bf16 autocast, dropout, clipping) with
    --fp8 rowwise: 3 ranks, where only exact mode makes the sums order-free; FP8 adds nothing a rank
    sums differently."""
    assert_bitwise_same_run(
        exact_step1, train(step, tmp_path / step, small_corpus, *EXACT_FP8, nproc=3)
    )


@pytest.mark.parametrize(
    "flags",
    [
        pytest.param(("--fp8", "tensorwise"), id="tensorwise-float32"),
        pytest.param(
            ("--fp8", "rowwise", "--param-dtype", "bf16"),
            id="rowwise-bf16-parameters",
            marks=ROWWISE_RUNS_HERE,
        ),
        pytest.param(
            ("--fp8", "tensorwise", "--param-dtype", "bf16"), id="tensorwise-bf16-parameters"
        ),
        pytest.param(("--fp8", "rowwise"), id="rowwise-float32", marks=ROWWISE_RUNS_HERE),
    ],
)
def test_step7_with_fp8_is_bitwise_fsdp2_with_torchao(flags, tmp_path, small_corpus):
    """ZeRO-3 against PyTorch's: FSDP2 over the blocks, torchao's conversion before sharding
    (compare/fsdp2_reference.py --fp8). Both gather the unit's weight (float32, or bf16 with
    --param-dtype), then cast it to FP8."""
    out = tmp_path / "fsdp2"
    result = run_ranks(
        REPO / "compare" / "fsdp2_reference.py",
        [*TINY, "--data", str(small_corpus), "--out", str(out), *flags, *TIMEOUT],
        nproc=2,
        timeout=300,
    )
    assert result.returncode == 0, f"fsdp2_reference failed:\n{result.stderr[-3000:]}"
    assert_bitwise_same_run(train("step7", tmp_path / "step7", small_corpus, *flags), out)


def test_parity_refuses_fp8_against_high_precision_and_the_state_bytes_are_the_same(
    fp8_runs, tmp_path, small_corpus
):
    plain = train("step1", tmp_path / "plain", small_corpus)
    result = parity(plain, fp8_runs["step1", "tensorwise"])
    assert result.returncode == 2 and "fp8 (None vs 'tensorwise')" in result.stderr, result.stderr
    theirs, ours = weights(plain), weights(fp8_runs["step1", "tensorwise"])
    assert not torch.equal(
        theirs["transformer.h.0.mlp.c_fc.weight"], ours["transformer.h.0.mlp.c_fc.weight"]
    )
    # Dynamic scaling keeps no state and no FP8 copy between steps: parameters, gradients and
    # AdamW's state hold the bytes they hold without --fp8 (the planner's formula
    # unchanged; docs/fp8.md).
    kinds = ("params", "grads", "optimizer_state")
    for a, b in zip(metrics(plain)["records"], metrics(fp8_runs["step1", "tensorwise"])["records"]):
        assert [[m[k] for k in kinds] for m in a["memory"]] == [
            [m[k] for k in kinds] for m in b["memory"]
        ]


def torchao_plain_loop(config: dict, corpus_path, recipe: str, start=None) -> tuple[list, dict]:
    """An outsider's loop: our model and data, torchao's FP8 on the blocks, AdamW with step 0's
    groups and schedule, one micro-batch a step (nothing to accumulate), clipping with the project's
    exact norm, under ``config["amp"]``'s autocast. ``start``: a checkpoint folder to go on from,
    its ``state.pt`` read here (the weights, AdamW's and the schedule's state dicts), not through
    the trainers' loader; the data position by drawing the micro-batches its steps drew. The losses
    of the steps it runs, and the final weights."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    torch.set_num_threads(1)
    corpus = load_corpus(str(corpus_path), config["tokenizer"], config["seq_len"])
    sampler = DistributedSampler(
        range(len(corpus.blocks)), num_replicas=1, rank=0, shuffle=True, seed=config["seed"]
    )
    batches = MicroBatches(corpus.blocks, sampler, config["micro_batch_size"])
    model = build_model(config, corpus.vocab_size, config["seed"])
    convert_to_float8_training(
        model,
        config=Float8LinearConfig.from_recipe_name(recipe),
        module_filter_fn=lambda m, fqn: fqn.startswith("transformer.h."),
    )
    opt = torch.optim.AdamW(
        adamw_param_groups(model.named_parameters(), config), **adamw_options(config)
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_at(s, config) / config["lr"])
    first = 0
    if start is not None:
        state = torch.load(start / "state.pt")
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(state["model"][name])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        first = state["step"]
        for _ in range(first):
            batches.next()
    losses = []
    for _ in range(first, config["steps"]):
        inputs, targets = batches.next()
        with autocast(config["amp"], torch.device("cpu")):
            loss = language_model_loss(model, inputs, targets)
        loss.backward()
        clip_grad_norm(list(model.parameters()), config["grad_clip"])
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_step0_is_bitwise_a_plain_loop_with_torchao(recipe, tmp_path, small_corpus):
    run = train(
        "step0", tmp_path / "step0", small_corpus, "--fp8", recipe, "--grad-accum", "1", nproc=0
    )
    config = metrics(run)["config"]
    losses, theirs = torchao_plain_loop(config, small_corpus, recipe)
    assert [r["loss"] for r in metrics(run)["records"]] == losses
    ours = weights(run)
    assert sorted(ours) == sorted(theirs)
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), (
            f"{recipe}: {name} differs from torchao's loop"
        )


@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_resume_with_fp8_is_bitwise(recipe, tmp_path, small_corpus):
    whole = train(
        "step7",
        tmp_path / "whole",
        small_corpus,
        "--fp8",
        recipe,
        "--amp",
        "bf16",
        "--save-every",
        "2",
    )
    resumed = train(
        "step7",
        tmp_path / "resumed",
        small_corpus,
        "--fp8",
        recipe,
        "--amp",
        "bf16",
        "--resume",
        str(whole / "checkpoints" / "step_2"),
    )
    assert_bitwise_same_run(whole, resumed)


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory, small_corpus):
    """Step 0 under bf16 autocast without FP8, a checkpoint at step 2, one micro-batch a step."""
    out = tmp_path_factory.mktemp("bf16") / "run"
    return train("step0", out, small_corpus, *BF16_ONE, "--save-every", "2", nproc=0)


BF16_ONE = ("--amp", "bf16", "--grad-accum", "1")


@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_a_bf16_checkpoint_resumes_into_fp8_bitwise_to_torchao_from_that_state(
    recipe, bf16_run, tmp_path, small_corpus
):
    """FP8 with dynamic scaling keeps no state: a bf16 checkpoint goes on with --fp8, steps 3-4 bit
    for bit what an outsider's loop computes with torchao's FP8 from the same state (the
    checkpoint's file read in the test, the data position drawn again); steps 1-2 are the bf16
    run's, step 3 differs from it."""
    into = train(
        "step0",
        tmp_path / "into",
        small_corpus,
        *BF16_ONE,
        "--fp8",
        recipe,
        "--resume",
        str(bf16_run / "checkpoints" / "step_2"),
        nproc=0,
    )
    a, b = metrics(bf16_run)["records"], metrics(into)["records"]
    assert [r["loss"] for r in a[:2]] == [r["loss"] for r in b[:2]]
    assert a[2]["loss"] != b[2]["loss"]  # step 3's forward already multiplies in FP8
    config = metrics(into)["config"]
    losses, theirs = torchao_plain_loop(
        config, small_corpus, recipe, start=bf16_run / "checkpoints" / "step_2"
    )
    assert [r["loss"] for r in b[2:]] == losses
    ours = weights(into)
    assert sorted(ours) == sorted(theirs)
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), (
            f"{recipe}: {name} differs from torchao's loop"
        )


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--fp8", "tensorwise", "--amp", "fp16"], "error: --fp8 with --amp fp16 is not a recipe"),
        (
            ["--fp8", "rowwise", "--n-embd", "24", "--n-head", "2"],
            r"error: --fp8 needs --n-embd \(24\)",
        ),
    ],
)
def test_bad_fp8_flags_are_one_line_and_exit_2(flags, message, tmp_path, small_corpus):
    result = launch(
        "step0", [*TINY, "--data", str(small_corpus), "--out", str(tmp_path / "x"), *flags]
    )
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert re.search(message, result.stderr), result.stderr
    assert not (tmp_path / "x").exists()
