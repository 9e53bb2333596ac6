"""The shared pieces of common/ against closed forms and independent computations.

Imported from common/, the origins: `test_copies_match_their_origin` proves every step folder holds
the same bytes. No processes here, except the one test that reads the tour's step-1 run.
"""

import json
import math

import numpy as np
import pytest
import torch

import sharded_norms
from checkpoint_files import clear_checkpoints, find_checkpoint
from config import UserError
from conftest import metrics
from training import clip_grad_norm, lr_at, param_norm

pytestmark = pytest.mark.quick  # python -m pytest -m quick: see pytest.ini


# ---- checkpoint_files.find_checkpoint ------------------------------------------------------------


def fake_checkpoint(out, name, meta=True):
    folder = out / "checkpoints" / name
    folder.mkdir(parents=True)
    if meta:
        (folder / "meta.json").write_text(json.dumps({"step": name}))
    return folder


def test_latest_checkpoint_is_the_highest_step_number_and_a_whole_one(tmp_path):
    for name in ("step_2", "step_9", "step_10"):
        fake_checkpoint(tmp_path, name)
    fake_checkpoint(tmp_path, "step_11", meta=False)  # a folder that is not (yet) a checkpoint
    fake_checkpoint(tmp_path, ".tmp_step_12")  # a checkpoint being written: not a checkpoint yet
    # By name, "step_9" > "step_10": the order must be numeric.
    assert find_checkpoint("latest", tmp_path) == tmp_path / "checkpoints" / "step_10"
    assert find_checkpoint("auto", tmp_path) == tmp_path / "checkpoints" / "step_10"
    assert find_checkpoint("auto", tmp_path / "elsewhere") is None  # --resume auto: a fresh start
    assert find_checkpoint(None, tmp_path) is None


def test_resume_path_without_meta_and_empty_folder_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="no checkpoint in"):
        find_checkpoint("latest", tmp_path)
    not_yet = fake_checkpoint(tmp_path, "step_3", meta=False)
    with pytest.raises(UserError, match="is not a checkpoint") as refused:
        find_checkpoint(str(not_yet), tmp_path)
    assert "did you mean" not in str(refused.value)  # no whole checkpoint anywhere near it yet
    whole = fake_checkpoint(tmp_path, "step_4")
    assert find_checkpoint(str(whole), tmp_path) == whole
    # The run folder, its checkpoints/ folder, a file of
    # a checkpoint: each named instead of the checkpoint.
    (whole / "rank0.pt").write_bytes(b"")
    for meant_instead in (tmp_path, tmp_path / "checkpoints", whole / "rank0.pt"):
        with pytest.raises(UserError, match=f"did you mean --resume {whole}\\?$"):
            find_checkpoint(str(meant_instead), tmp_path)


def test_a_fresh_run_removes_only_the_checkpoint_folders_a_run_writes(tmp_path):
    for name in ("step_2", ".tmp_step_4", ".old_step_2"):
        fake_checkpoint(tmp_path, name)
    clear_checkpoints(tmp_path)
    assert not (tmp_path / "checkpoints").exists()
    fake_checkpoint(tmp_path, "step_2")
    (tmp_path / "checkpoints" / "notes.txt").write_text("someone else's")
    fake_checkpoint(tmp_path, "best_model")
    clear_checkpoints(tmp_path)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "best_model",
        "notes.txt",
    ]


class Part:
    """A checkpoint part (checkpoint.py, rule 2) that records what the writer asks of it."""

    def __init__(self, per_rank: bool, value: int, calls: list):
        self.per_rank, self.value, self.calls = per_rank, value, calls
        self.key = f"{'own' if per_rank else 'shared'}_{value}"

    def checkpoint_state(self) -> dict:
        return {self.key: torch.tensor(self.value)}

    def load_checkpoint(self, checkpoint) -> None:
        # a per-rank part's entries are DCP's, read into this
        # rank's tensors; a shared part's are in the run state
        empty = {self.key: torch.zeros((), dtype=torch.int64)}
        state = checkpoint.read(empty) if self.per_rank else checkpoint.shared
        # draws before the RNG is set
        self.calls.append((self.key, int(state[self.key]), float(torch.rand(()))))


def test_the_writer_saves_each_part_where_it_says_and_starts_from_them_in_order_rng_last(tmp_path):
    """One call each way: ``save(step)`` puts a shared part in the run state (``run``) and a
    per-rank one in DCP's entries, beside the rank's RNG (``rank0``); ``start(checkpoint)`` loads
    every part in the order given, then the RNG (what a part draws while loading must not move the
    stream), and returns the step; ``start(None)`` clears an earlier run's checkpoints."""
    from checkpoint import CheckpointWriter
    from resharding import Checkpoint

    config = {"out": str(tmp_path), "async_save": False, "quiet": True}
    calls = []
    parts = [Part(False, 1, calls), Part(True, 2, calls), Part(False, 3, calls)]
    torch.manual_seed(5)
    CheckpointWriter(config, 0, 1, {}, parts).save(7)
    after_save = torch.rand(3)  # what the run draws next
    folder = tmp_path / "checkpoints" / "step_7"
    saved = Checkpoint(folder)
    shared, own = saved.shared, {*saved.ranks[0], *(set(saved.metadata) - {"run", "rank0"})}
    assert set(shared) == {"step", "shared_1", "shared_3"} and shared["step"] == 7
    assert set(own) == {"rng", "own_2"}
    assert CheckpointWriter(config, 0, 1, {}, parts).start(saved) == 7
    assert [(key, value) for key, value, _ in calls] == [
        ("shared_1", 1),
        ("own_2", 2),
        ("shared_3", 3),
    ]
    assert torch.equal(torch.rand(3), after_save)  # the parts' draws were undone: the RNG came last
    assert CheckpointWriter(config, 0, 1, {}, parts).start(None) == 0
    assert not (tmp_path / "checkpoints").exists()


# ---- training.lr_at: warm-up and cosine in closed form -------------------------------------------

SCHEDULE = {"lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 4, "steps": 10}


def test_warmup_is_linear_and_starts_above_zero():
    c = SCHEDULE
    # The first optimiser step (step 0) already trains: lr/warmup, not 0.
    assert lr_at(0, c) == c["lr"] * 1 / 4
    assert [lr_at(s, c) for s in range(4)] == [c["lr"] * (s + 1) / 4 for s in range(4)]
    assert lr_at(3, c) == c["lr"]  # the last warm-up step reaches the peak


def test_cosine_decays_to_min_lr_on_the_last_step():
    c = SCHEDULE
    decay = c["steps"] - 1 - c["warmup_steps"]  # steps 4..9: progress 0/5 .. 5/5
    for s in range(c["warmup_steps"], c["steps"]):
        expected = c["min_lr"] + 0.5 * (1 + math.cos(math.pi * (s - 4) / decay)) * (
            c["lr"] - c["min_lr"]
        )
        assert lr_at(s, c) == pytest.approx(expected, rel=1e-15, abs=0), s
    # the cosine starts at the peak the warm-up reached one step earlier
    assert lr_at(4, c) == c["lr"]
    assert lr_at(c["steps"] - 1, c) == c["min_lr"]
    assert all(lr_at(s, c) > lr_at(s + 1, c) for s in range(4, 9))


def test_schedule_without_warmup_and_with_one_step():
    no_warmup = {**SCHEDULE, "warmup_steps": 0}
    assert lr_at(0, no_warmup) == no_warmup["lr"]
    assert lr_at(9, no_warmup) == no_warmup["min_lr"]
    one_step = {**SCHEDULE, "warmup_steps": 0, "steps": 1}
    # no division by zero: the one step trains at the peak
    assert lr_at(0, one_step) == one_step["lr"]
    assert lr_at(0, {**one_step, "warmup_steps": 2}) == one_step["lr"] / 2


def test_a_trainer_records_the_closed_form_lr(step1_ws2):
    """The lr a trainer logs for step k is lr_at(k - 1):
    the scheduler does not shift it by one step."""
    m = metrics(step1_ws2)
    c = m["config"]
    assert c["warmup_steps"] == 2
    assert m["records"][0]["lr"] == c["lr"] * 1 / c["warmup_steps"]
    for r in m["records"]:
        assert r["lr"] == pytest.approx(lr_at(r["step"] - 1, c), rel=1e-15), r["step"]


# ---- training.param_norm: float64, not float32 ---------------------------------------------------


def test_param_norm_is_the_float64_norm():
    g = torch.Generator().manual_seed(0)
    params = [
        torch.nn.Parameter(t)
        for t in (
            torch.randn(300, 200, generator=g) * 3,  # large
            torch.randn(5000, generator=g) * 1e-3,  # small
            0.1 + torch.rand(1000, generator=g),
        )
    ]
    values = np.concatenate([p.detach().numpy().ravel() for p in params]).astype(np.float64)
    # each square exact in float64, the sum correctly rounded
    exact = math.sqrt(math.fsum(values * values))
    # what a float32 norm would give
    float32 = torch.sqrt(sum(p.detach().pow(2).sum() for p in params)).item()
    assert abs(float32 - exact) / exact > 1e-9, "the data must tell a float32 accumulation apart"
    assert abs(param_norm(params) - exact) / exact <= 1e-15


# ---- training.clip_grad_norm: torch.nn.utils.clip_grad_norm_ as its oracle -----------------------


def with_gradients(scale):
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in ((16, 8), (8,), (3, 5, 7))]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * scale
    return params


@pytest.mark.parametrize(
    "scale, max_norm, clipped",
    [(0.03, 0.3, True), (0.01, 1.0, False)],
    ids=["clipped", "below the limit"],
)
def test_clipping_matches_pytorch(scale, max_norm, clipped):
    """A norm of ~0.44 against a limit of 0.3:
    the coefficient's + 1e-6 changes it by ~2e-6, many ulps."""
    ours, theirs = with_gradients(scale), with_gradients(scale)
    unclipped = [p.grad.clone() for p in ours]
    norm = clip_grad_norm(ours, max_norm)
    their_norm = torch.nn.utils.clip_grad_norm_(theirs, max_norm, foreach=False)
    # The norm: float64 sum of squares, rounded once; on this data PyTorch's float32 norm is the
    # same number, so the coefficients can be compared bit for bit.
    assert norm.dtype == torch.float32 and norm.item() == their_norm.item()
    assert (norm.item() > max_norm) == clipped  # the returned norm is the one *before* clipping
    for a, b, before in zip(ours, theirs, unclipped):
        assert torch.equal(a.grad, b.grad)
        # below the limit the gradients stay as they are
        assert torch.equal(a.grad, before) != clipped


def test_max_norm_zero_means_no_clipping():
    params = with_gradients(1.0)
    before = [p.grad.clone() for p in params]
    norm = clip_grad_norm(params, 0.0)
    assert norm.item() > 1 and all(torch.equal(p.grad, b) for p, b in zip(params, before))


def test_one_clipping_function_for_every_layout_counts_each_element_once():
    """clip_grad_norm's ``counted``: the whole model's norm from a rank's share, every element once.
    Here one process plays both ranks of a 2-way split, adding their float64 sums as the all-reduce
    would: the norm of the whole model (torch.nn.utils.clip_grad_norm_ the oracle) and both shares
    clipped by its coefficient."""
    whole, theirs = with_gradients(0.03), with_gradients(0.03)
    their_norm = torch.nn.utils.clip_grad_norm_(theirs, 0.3, foreach=False)
    # rank 0 holds the first two tensors and a replica of the third; rank 1 holds the third alone
    shares = [[whole[0], whole[1], whole[2]], [whole[2]]]
    counted = [[whole[0], whole[1]], [whole[2]]]
    from training import sum_of_squares

    total = sum(sum_of_squares(p.grad for p in c) for c in counted)
    # no clipping: the rank's own sum only
    norm = sharded_norms.clip_grad_norm(shares[0], 0.0, counted=counted[0])
    assert norm.item() == sum_of_squares(p.grad for p in counted[0]).sqrt().float().item()
    assert total.sqrt().float().item() == their_norm.item()
    norm = clip_grad_norm(whole, 0.3)  # one process, every element counted once
    assert norm.item() == their_norm.item() and all(
        torch.equal(a.grad, b.grad) for a, b in zip(whole, theirs)
    )


@pytest.mark.quick
def test_param_norm_is_the_exact_norm_whatever_the_grouping(monkeypatch):
    """``param_norm`` against a closed form computed with Python's integers (exact), for tensors cut
    into slices in two ways, with values across many exponents, over the 4M-element chunk boundary;
    the GPU's atomic adds give the same parts; subnormals, NaNs and infinities."""
    import fractions

    from exact_sums import norm_from_parts, square_sum_parts

    g = torch.Generator().manual_seed(0)
    whole = torch.randn(4_200_000, generator=g) * torch.exp2(
        torch.randint(-30, 30, (4_200_000,), generator=g).float()
    )
    exact = sum(fractions.Fraction(float(x)) ** 2 for x in whole[:20_000].tolist())
    assert norm_from_parts(square_sum_parts([whole[:20_000]])) == math.sqrt(exact)
    parts = square_sum_parts([whole])
    assert torch.equal(parts, square_sum_parts(whole.split(1_000_003)))
    assert torch.equal(parts, square_sum_parts([whole[:7], whole[7:]]))
    assert param_norm([whole]) == norm_from_parts(parts)
    # the GPU's way of adding by bin (atomic adds into lanes), run on the CPU: the same parts
    import exact_sums

    def gpu_way(sums, exponent, values):
        sums = exact_sums._LaneSums(values.device) if sums is None else sums
        sums.add(exponent, values)
        return sums

    monkeypatch.setattr(exact_sums, "_add_by_bin", gpu_way)
    assert torch.equal(parts, square_sum_parts(whole.split(1_000_003)))
    tiny = torch.tensor([1e-40, -3e-45, 2.5, 0.0])  # subnormals
    assert norm_from_parts(square_sum_parts([tiny])) == math.sqrt(
        sum(fractions.Fraction(float(x)) ** 2 for x in tiny)
    )
    assert math.isnan(
        norm_from_parts(square_sum_parts([whole[:9], torch.tensor([1.0, math.inf, math.nan])]))
    )
    assert norm_from_parts(square_sum_parts([torch.tensor([-math.inf, 2.0])])) == math.inf


def test_the_final_weights_record_their_exact_norm_whole_or_streamed(tmp_path, monkeypatch):
    """``save_final_weights`` (common/) and step 7's ``save_final_weights_streaming`` (tensors one
    at a time, as ZeRO-3 gathers them) record the ``param_norm`` of what they write: the exact norm,
    Python's integers."""
    import fractions

    from conftest import REPO
    from metrics import save_final_weights

    monkeypatch.syspath_prepend(str(REPO / "step7_zero3"))
    from streaming_export import save_final_weights_streaming

    g = torch.Generator().manual_seed(0)
    weights = {
        "a.weight": torch.randn(40, 30, generator=g) * 3,
        "a.bias": torch.randn(30, generator=g) * 1e-3,
        "b": 0.1 + torch.rand(7, generator=g),
    }
    exact = math.sqrt(
        sum(fractions.Fraction(x) ** 2 for t in weights.values() for x in t.flatten().tolist())
    )
    whole = save_final_weights(tmp_path / "whole", weights)
    streamed = save_final_weights_streaming(
        tmp_path / "streamed",
        {n: t.shape for n, t in weights.items()},
        iter(weights.items()),
        is_writer=True,
    )
    assert whole["param_norm"] == streamed["param_norm"] == exact
    assert whole["fingerprints"] == streamed["fingerprints"]


@pytest.mark.quick
def test_the_gpu_bin_sums_equal_bincount_and_leave_deterministic_mode_as_it_was():
    """The GPU path of square_sum_parts (atomic adds,
    deterministic mode lifted for one call), run on the CPU."""
    from exact_sums import EXPONENTS, MIN_EXPONENT, _LaneSums

    g = torch.Generator().manual_seed(1)
    bins = torch.randint(0, EXPONENTS, (100_000,), generator=g)
    values = torch.randint(0, 2**24, (2, 100_000), generator=g).double()
    expected = torch.stack(
        [torch.bincount(bins, weights=values[row], minlength=EXPONENTS) for row in (0, 1)]
    )
    before = torch.are_deterministic_algorithms_enabled()
    try:
        for mode in (True, False):
            torch.use_deterministic_algorithms(mode)
            sums = _LaneSums(torch.device("cpu"))
            exponents = (bins + MIN_EXPONENT).int()  # frexp's, as square_sum_parts hands them
            sums.add(exponents[:60_000].clone(), values[:, :60_000])  # two pieces into one spread
            sums.add(exponents[60_000:].clone(), values[:, 60_000:])
            assert torch.equal(sums.cpu(), expected.long())
            assert torch.are_deterministic_algorithms_enabled() == mode
    finally:
        torch.use_deterministic_algorithms(before)


def test_a_checkpoint_keeps_the_hyperparameters_and_leaves_the_update_code_to_the_resuming_run(
    tmp_path,
):
    """A run on the CPU saves AdamW with ``foreach=False`` (training.adamw_options); resumed on a
    GPU it must run the multi-tensor update every step there uses, so only the hyperparameters come
    from the checkpoint."""
    from checkpoint import CheckpointWriter, WholeModel, load_optimizer
    from resharding import Checkpoint

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    named = list(model.named_parameters())
    saved = torch.optim.AdamW(
        model.parameters(), lr=0.01, betas=(0.8, 0.9), weight_decay=0.3, foreach=False
    )
    model(torch.randn(4, 3)).sum().backward()
    saved.step()
    config = {"out": str(tmp_path), "async_save": False, "quiet": True}
    CheckpointWriter(
        config, 0, 1, {name: p.shape for name, p in named}, [WholeModel(model, saved)]
    ).save(1)
    resumed = torch.optim.AdamW(model.parameters(), lr=0.5, foreach=True)
    load_optimizer(resumed, Checkpoint(find_checkpoint("auto", tmp_path)), named)
    group = resumed.param_groups[0]
    assert (group["lr"], group["betas"], group["weight_decay"]) == (0.01, (0.8, 0.9), 0.3)
    # None: torch's default for the device, which adamw_options pins
    assert group["foreach"] is not False
    assert all(
        torch.equal(resumed.state[p]["exp_avg_sq"], saved.state[p]["exp_avg_sq"])
        for p in model.parameters()
    )


def test_memory_stats_on_a_gpu_read_its_utilisation_or_say_none(monkeypatch):
    """On a GPU each rank's memory entry carries NVML's utilisation through torch.cuda (faked here:
    no GPU), and None where NVML cannot be read (torch.cuda.utilization raises without pynvml)
    instead of ending the run."""
    import metrics

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 1)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: 2)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    monkeypatch.setattr(torch.cuda, "utilization", lambda device: 87)
    assert metrics.memory_stats([], optimizer, cuda)["gpu_utilization"] == 87

    def no_pynvml(device):
        raise ModuleNotFoundError("pynvml does not seem to be installed")

    monkeypatch.setattr(torch.cuda, "utilization", no_pynvml)
    assert metrics.memory_stats([], optimizer, cuda)["gpu_utilization"] is None
    assert "gpu_utilization" not in metrics.memory_stats([], optimizer, torch.device("cpu"))


def test_the_done_line_names_the_layout_the_last_loss_and_where_the_weights_are(
    tmp_path, monkeypatch, capsys
):
    from metrics import RunLog

    cases = (
        ({"world_size": 1, "backend": None}, None, "done: 3 steps, final loss 2.5000"),
        (
            {"world_size": 4, "backend": "gloo"},
            None,
            "done: 3 steps on 4 ranks (gloo), final loss 2.5000",
        ),
        (
            {"world_size": 4, "backend": "gloo"},
            " on 2 pipeline stages (gloo, 1f1b)",
            "done: 3 steps on 2 pipeline stages (gloo, 1f1b), final loss 2.5000",
        ),
    )
    for env, layout, said in cases:
        for is_writer in (True, False):
            log = RunLog(
                {"out": str(tmp_path), "steps": 3, "quiet": True}, env, is_writer, [{"loss": 2.5}]
            )
            written = []
            monkeypatch.setattr(log, "write", written.append)
            log.finish({"param_norm": 1.0}, layout)
            # write() itself leaves metrics.json to the writer
            assert written == [{"param_norm": 1.0}]
            assert capsys.readouterr().out == (
                f"{said}, weights in {tmp_path}\n" if is_writer else ""
            )


@pytest.mark.quick
def test_nondeterministic_lifts_deterministic_kernels_and_the_default_keeps_them():
    """``--nondeterministic`` (every step,
    compare/plain_loop.py) reaches seed_everything: torch's default kernels."""
    from config import build_parser, parse_config
    from seeding import seed_everything

    before = torch.are_deterministic_algorithms_enabled()
    try:
        for argv, deterministic in (([], True), (["--nondeterministic"], False)):
            config = parse_config(build_parser("step0_single_gpu"), argv)
            assert config["deterministic"] is deterministic
            seed_everything(config["seed"], config["deterministic"])
            assert torch.are_deterministic_algorithms_enabled() is deterministic
    finally:
        torch.use_deterministic_algorithms(before)
