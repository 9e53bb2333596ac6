"""common/fp8.py against torchao's float8 training
(a test-only dependency, imported by this file alone).

torchao 0.18's ``convert_to_float8_training`` with the same recipe is the oracle: one layer's
output, input gradient and weight gradient, then our GPT-2 for a few AdamW steps, bit for bit
(``torch.equal``), in float32 and under bf16 autocast. Both run in this process, on this CPU's
kernels: nothing is compared with bits recorded elsewhere. The trainers' ``--fp8`` is tested in
test_fp8_steps.py.
"""

import copy
import sys
import warnings
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "common"))
from conftest import FP8_RECIPES, ROWWISE_RUNS_HERE  # noqa: E402
from failures import UserError  # noqa: E402
from fp8 import Float8Linear, check_fp8, convert_to_fp8  # noqa: E402
from model import build_model, language_model_loss  # noqa: E402
from training import autocast, clip_grad_norm  # noqa: E402

RECIPES = ["tensorwise", "rowwise"]
CONFIG = {
    "n_layer": 2,
    "n_head": 4,
    "n_embd": 32,
    "seq_len": 16,
    "dropout": 0.0,
    "attention": "math",
}
VOCAB = 64


def torchao_convert(module, recipe, module_filter_fn=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    return convert_to_float8_training(
        module,
        module_filter_fn=module_filter_fn,
        config=Float8LinearConfig.from_recipe_name(recipe),
    )


def layer_run(layer, x, amp: bool):
    """Output, input gradient and every parameter gradient
    of ``layer`` on ``x`` (a weighted sum as the loss)."""
    x = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        y = layer(x)
    weights = torch.linspace(-1.0, 2.0, y.numel()).reshape(y.shape)
    (y.float() * weights).sum().backward()
    return [y.detach(), x.grad] + [p.grad for p in layer.parameters()]


@pytest.mark.quick
@pytest.mark.parametrize("amp", [False, True], ids=["float32", "bf16-autocast"])
@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_one_layer_bitwise_to_torchao(recipe, amp):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(64, 96))
    x = torch.randn(4, 24, 64) * 3
    x[..., 5] *= 40  # an outlier channel: per-row and per-tensor scales differ
    ours = layer_run(convert_to_fp8(copy.deepcopy(base), recipe), x, amp)
    theirs = layer_run(torchao_convert(copy.deepcopy(base), recipe), x, amp)
    plain = layer_run(base, x, amp)
    for name, a, b, p in zip(
        ["output", "grad_input", "grad_weight", "grad_bias"], ours, theirs, plain
    ):
        assert a.dtype == b.dtype and torch.equal(a, b), f"{recipe}: {name} differs from torchao's"
        error = ((a.float() - p.float()).norm() / p.float().norm()).item()
        assert error < 0.2, f"{recipe}: {name} is {error:.3f} away from nn.Linear's"
    assert not torch.equal(ours[0].float(), plain[0].float()), (
        "the output should carry FP8's rounding"
    )


class OutsidersNet(torch.nn.Module):
    """Someone else's model: no GPT-2, a linear without bias,
    one not a multiple of 16 left out by their filter."""

    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(48, 64, bias=False), torch.nn.Linear(64, 48)
        self.norm, self.head = torch.nn.LayerNorm(48), torch.nn.Linear(48, 10)

    def forward(self, x):
        return self.head(self.norm(x + self.down(torch.relu(self.up(x)))))


@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_any_module_in_an_outsiders_loop_trains_like_torchao(recipe):
    """An outsider's loop (SGD with momentum, their own module and filter):
    bitwise to torchao after every step."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = OutsidersNet()
    keep = lambda layer, name: name != "head"  # noqa: E731  (their choice, as torchao's module_filter_fn)
    ours, theirs = (
        convert_to_fp8(copy.deepcopy(net), recipe, keep),
        torchao_convert(copy.deepcopy(net), recipe, keep),
    )
    assert type(ours.head) is torch.nn.Linear and isinstance(ours.up, Float8Linear)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ours, theirs)]
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        x, y = torch.randn(32, 48, generator=gen), torch.randint(0, 10, (32,), generator=gen)
        for model, opt in zip((ours, theirs), opts):
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
            assert torch.equal(a, b), f"{recipe}: {name}"


def test_zero_input_gives_zero_output_not_nan():
    """The amax epsilon (1e-12):
    an all-zero tensor scales to a finite number, so the layer returns zeros."""
    layer = convert_to_fp8(torch.nn.Sequential(torch.nn.Linear(16, 16, bias=False)), "tensorwise")
    y = layer(torch.zeros(16, 16))
    assert torch.equal(y, torch.zeros(16, 16))


def train_gpt2(model, steps: int, amp: str) -> tuple[list, dict]:
    """A plain loop: AdamW with clipping on fixed random batches; the losses and final weights."""
    torch.set_num_threads(1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (4, CONFIG["seq_len"] + 1), generator=gen)
        with autocast(amp, torch.device("cpu")):
            loss = language_model_loss(model, ids[:, :-1], ids[:, 1:])
        loss.backward()
        clip_grad_norm(list(model.parameters()), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.quick
@pytest.mark.parametrize("amp", ["none", "bf16"])
@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_gpt2_adamw_steps_bitwise_to_torchao(recipe, amp):
    ours = build_model(CONFIG, VOCAB, seed=3)
    convert_to_fp8(ours.transformer.h, recipe)
    theirs = torchao_convert(
        build_model(CONFIG, VOCAB, seed=3),
        recipe,
        module_filter_fn=lambda m, fqn: fqn.startswith("transformer.h."),
    )
    converted = [n for n, m in ours.named_modules() if isinstance(m, Float8Linear)]
    assert converted == [n for n, m in theirs.named_modules() if type(m).__name__ == "Float8Linear"]
    assert len(converted) == 6 * CONFIG["n_layer"] and type(ours.lm_head) is torch.nn.Linear
    loss_ours, w_ours = train_gpt2(ours, 4, amp)
    loss_theirs, w_theirs = train_gpt2(theirs, 4, amp)
    assert loss_ours == loss_theirs
    assert w_ours.keys() == w_theirs.keys()
    for name in w_ours:
        assert torch.equal(w_ours[name], w_theirs[name]), (
            f"{recipe} {amp}: {name} differs after 4 steps"
        )
    plain_loss, _ = train_gpt2(build_model(CONFIG, VOCAB, seed=3), 4, amp)
    assert (
        loss_ours[0] != plain_loss[0] and abs(loss_ours[0] - plain_loss[0]) < 0.05 * plain_loss[0]
    )


def test_sizes_not_multiples_of_16_are_refused():
    with pytest.raises(UserError, match="multiples of 16; 0 is 24 x 32"):
        convert_to_fp8(torch.nn.Sequential(torch.nn.Linear(24, 32)), "rowwise")
    with pytest.raises(UserError, match="not one of tensorwise, rowwise"):
        convert_to_fp8(torch.nn.Linear(16, 16), "blockwise")
    config = {
        "fp8": "tensorwise",
        "amp": "none",
        "n_embd": 24,
        "micro_batch_size": 8,
        "seq_len": 64,
    }
    with pytest.raises(UserError, match=r"--n-embd \(24\)"):
        check_fp8(config, torch.device("cpu"))
    with pytest.raises(UserError, match="--amp fp16"):
        check_fp8({**config, "amp": "fp16"}, torch.device("cpu"))
    check_fp8({**config, "n_embd": 32}, torch.device("cpu"))  # accepted


@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_the_bytes_a_layer_casts_are_the_planners_formula(recipe, monkeypatch):
    """docs/planner.md: one Float8Linear, one micro-batch (T tokens, K in, N out), forward and
    backward: FP8 copies of 2 (T K + N K + T N) bytes (each operand cast once per matmul it enters),
    scales of 4 x 6 bytes (tensorwise) or 4 x 2 (T + N + K) (rowwise: one per row of each operand,
    along the axis its matmul keeps)."""
    import fp8

    cast, original = [], fp8.to_fp8

    def counting(t, dtype, dim, pow2):
        bits, scale = original(t, dtype, dim, pow2)
        cast.append((bits.numel() * bits.element_size(), scale.numel() * scale.element_size()))
        return bits, scale

    monkeypatch.setattr(fp8, "to_fp8", counting)
    T, K, N = 64, 48, 80
    layer = convert_to_fp8(torch.nn.Sequential(torch.nn.Linear(K, N)), recipe)
    layer(torch.randn(T, K, requires_grad=True)).sum().backward()
    copies, scales = map(sum, zip(*cast))
    assert len(cast) == 6 and copies == 2 * (T * K + N * K + T * N)
    assert scales == 4 * (6 if recipe == "tensorwise" else 2 * (T + N + K))


@ROWWISE_RUNS_HERE
def test_rowwise_scales_keep_ordinary_tokens_that_one_tensorwise_scale_flushes():
    """One token in 64 at 1e5 times the others (massive activations): one scale per tensor maps the
    outliers onto e4m3's 448 and pushes the ordinary tokens below its smallest normal (2^-6), where
    few bits are left; one scale per token keeps every token's own range. Measured 2026-12-02: 52%
    vs 3.6% error on the ordinary tokens."""
    torch.manual_seed(0)
    base = torch.nn.Linear(256, 256)
    x = torch.randn(512, 256)
    x[::64] *= 1e5
    ordinary = torch.ones(512, dtype=torch.bool)
    ordinary[::64] = False
    exact = base(x).detach()[ordinary]
    error = {
        r: (
            (convert_to_fp8(copy.deepcopy(base), r)(x).detach()[ordinary] - exact).norm()
            / exact.norm()
        ).item()
        for r in RECIPES
    }
    assert error["rowwise"] < 0.06 < 0.3 < error["tensorwise"], error


@pytest.fixture(scope="module")
def outliers() -> dict:
    """compare/fp8_outliers.py at a tiny size: the MLP trained in bf16 and each recipe, with no
    outliers, outlier tokens and an outlier channel (x 1e5), then each matmul's error measured, all
    in this run (6-12 s)."""
    import argparse

    import fp8_outliers  # compare/, on the path through conftest

    args = argparse.Namespace(steps=40, factor=1e5, width=32, hidden=32, tokens=128, lr=1e-3)
    return fp8_outliers.run(args)["results"]


@ROWWISE_RUNS_HERE
def test_rowwise_beats_tensorwise_on_outlier_tokens_and_not_on_an_outlier_channel(outliers):
    """A scale helps only along the axis its matmul keeps (fp8.py, rule 3). Rowwise scales x per
    token in the forward: outlier tokens leave the others' error as it was, an outlier channel sits
    in every token's row. In the weight gradient it scales x per channel over the tokens: the
    reverse. Training follows the forward."""
    none, tokens, channel = outliers["none"], outliers["tokens"], outliers["channel"]
    # outlier tokens: rowwise's forward as without outliers,
    # tensorwise's flushed; both weight gradients hit
    assert tokens["rowwise"]["forward"] < 1.5 * none["rowwise"]["forward"]
    assert tokens["tensorwise"]["forward"] > 3 * none["tensorwise"]["forward"]
    assert tokens["rowwise"]["grad_weight"] > 2 * none["rowwise"]["grad_weight"]
    # an outlier channel: both forwards hit alike; rowwise's weight gradient as without outliers
    assert all(channel[r]["forward"] > 2 * none[r]["forward"] for r in RECIPES), channel
    assert 2 / 3 < channel["rowwise"]["forward"] / channel["tensorwise"]["forward"] < 1.5, channel
    assert (
        channel["rowwise"]["grad_weight"]
        < 1.5 * none["rowwise"]["grad_weight"]
        < channel["tensorwise"]["grad_weight"]
    )
    # the final losses: rowwise near bf16 with outlier
    # tokens, tensorwise far; alike with an outlier channel
    final = {kind: {r: outliers[kind][r]["final"] for r in outliers[kind]} for kind in outliers}
    assert final["tokens"]["rowwise"] < 1.5 * final["tokens"]["bf16"], final
    assert final["tokens"]["tensorwise"] > 3 * final["tokens"]["rowwise"], final
    assert 0.5 < final["channel"]["rowwise"] / final["channel"]["tensorwise"] < 2, final


@ROWWISE_RUNS_HERE
def test_bench_fp8_times_every_row_and_refuses_bad_shapes():
    import json
    import subprocess

    bench = [sys.executable, str(REPO / "compare" / "bench_fp8.py")]
    done = subprocess.run(
        [*bench, "--tokens", "32", "--shapes", "32x64", "--rounds", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    row = json.loads(done.stdout.strip().splitlines()[-1])["ms"]["32x64"]
    assert sorted(row) == sorted(
        ["nn.Linear float32", "nn.Linear bf16 autocast"]
        + [f"{who} {r}" for who in ("ours", "torchao") for r in RECIPES]
    )
    assert all(ms > 0 for ms in row.values())
    bad = subprocess.run([*bench, "--shapes", "24x64"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.startswith("error: --tokens and every size"), (
        bad.stderr
    )
