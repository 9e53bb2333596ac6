"""ShardedOptimizer (ZeRO-1) against the plain optimiser
on the full parameters, in real gloo processes.

Every rank computes the same full gradients, so the plain optimiser, run in the same process, is the
exact answer: the sharded one must give the same bits at every step. One spawn per world size runs
every check; the world-size-2 run saves optimiser shards that the world-size-3 run must refuse. The
quick tier (``-m quick``) runs world size 2.
"""

import io
import math
import sys
import traceback

import pytest
import torch
import torch.distributed as dist

from conftest import REPO, init_gloo, spawn


class Toy(torch.nn.Module):
    """Tied embedding/output weight, a frozen layer,
    sizes no world size divides: 35 + 65 + 65 + 1 + 13."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(7, 5)
        self.frozen = torch.nn.Linear(5, 5)
        self.frozen.requires_grad_(False)
        self.mix = torch.nn.Linear(5, 13)
        self.back = torch.nn.Linear(13, 5, bias=False)
        self.scale = torch.nn.Parameter(torch.ones(1))

    def forward(self, x):
        h = self.frozen(self.embed(x))
        h = h + self.back(torch.tanh(self.mix(h))) * self.scale
        return h @ self.embed.weight.T  # the embedding used a second time, as GPT-2's output layer


# Trainable parameters in group order: embed, mix.w, back.w | scale, mix.b (a module lists its own
# parameters before its children's, so scale comes first).
NUMELS = [35, 65, 65, 1, 13]
CHUNKS = [[3, 0, 4], [2, 1]]  # two chunks, not in group order (the ZeRO-2 case)
OPTIMIZERS = {
    "AdamW": (torch.optim.AdamW, dict(lr=0.05, foreach=False)),
    "Adam": (torch.optim.Adam, dict(lr=0.05, foreach=False)),
    "SGD": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, foreach=False)),
}
STEPS = 4


def make_model() -> Toy:
    torch.manual_seed(0)
    return Toy()


def trainable(model) -> list:
    return [p for p in model.parameters() if p.requires_grad]


def groups_of(model) -> list[dict]:
    params = trainable(model)
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def in_group_order(model) -> list:
    """Numbered as the optimisers number them (and as NUMELS, CHUNKS and the layout do)."""
    return [p for g in groups_of(model) for p in g["params"]]


def chunks_of(model) -> list[list]:
    params = in_group_order(model)
    return [[params[i] for i in chunk] for chunk in CHUNKS]


def full_gradients(model, step: int, scale: float = 1.0) -> None:
    """The same input on every rank: every rank computes the same full gradients."""
    x = torch.randint(0, 7, (2, 4), generator=torch.Generator().manual_seed(step))
    (model(x).pow(2).mean() * scale).backward()


def copy_gradients(source, target) -> None:
    for a, b in zip(source.parameters(), target.parameters()):
        b.grad = None if a.grad is None else a.grad.clone()


def differences(ref_model, our_model, label) -> list[str]:
    return [
        f"{label}: {name}"
        for (name, a), b in zip(ref_model.named_parameters(), our_model.parameters())
        if not torch.equal(a, b)
    ]


def state_problems(ours: dict, ref: dict) -> list[str]:
    """Differences between two optimiser state dicts: keys, tensors (torch.equal), other values."""
    problems = [] if ours["param_groups"] == ref["param_groups"] else ["param_groups differ"]
    if set(ours["state"]) != set(ref["state"]):
        return problems + [f"state keys {sorted(ours['state'])} != {sorted(ref['state'])}"]
    for i, s in ref["state"].items():
        if set(ours["state"][i]) != set(s):
            problems.append(f"param {i}: keys {sorted(ours['state'][i])} != {sorted(s)}")
        for key, value in s.items():
            mine = ours["state"][i].get(key)
            tensors = torch.is_tensor(value) and torch.is_tensor(mine)
            same = (
                torch.equal(mine, value) if tensors else not torch.is_tensor(mine) and mine == value
            )
            if not same:
                problems.append(f"param {i}: {key} differs")
    return problems


def pieces_of(optimizer) -> list:
    """(parameter number, start, end, chunk) of each of this rank's pieces: where its shard lies."""
    return [(optimizer.index[p.param], p.start, p.end, p.chunk) for p in optimizer.pieces]


def element_state_bytes(optimizer) -> int:
    """Bytes of the per-element state tensors (moments, momentum), not the 0-dim step counters."""
    return sum(
        v.numel() * v.element_size()
        for s in optimizer.state.values()
        for v in s.values()
        if torch.is_tensor(v) and v.dim() > 0
    )


# ---- The checks, run by every rank ---------------------------------------------------------------


def against_plain_optimizer(name, results, tmp, rank, world_size):
    import comm_accounting
    from zero1 import ShardedOptimizer

    cls, kwargs = OPTIMIZERS[name]
    ref_model, our_model = make_model(), make_model()
    ref = cls(groups_of(ref_model), **kwargs)
    ours = ShardedOptimizer(groups_of(our_model), cls, **kwargs)
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 0.5**s) for o in (ref, ours)]
    initial, problems = [p.clone() for p in ref_model.parameters()], []
    comm_accounting.take_comm_bytes()
    for step in range(STEPS):
        full_gradients(our_model, step)
        copy_gradients(our_model, ref_model)
        ref.step()
        ours.step()
        if step == 0:
            results[f"{name} comm"] = comm_accounting.take_comm_bytes()
        for s in schedulers:
            s.step()
        ref.zero_grad()
        ours.zero_grad()
        problems += differences(ref_model, our_model, f"step {step}")
        if [g["lr"] for g in ours.param_groups] != [g["lr"] for g in ref.param_groups]:
            problems.append(f"step {step}: lr {[g['lr'] for g in ours.param_groups]}")
    results[f"{name} vs plain"] = problems
    results[f"{name} moved"] = [
        n for (n, p), p0 in zip(ref_model.named_parameters(), initial) if not torch.equal(p, p0)
    ]
    results[f"{name} groups"] = [(g["weight_decay"], g["lr"]) for g in ours.param_groups]
    results[f"{name} consolidated"] = state_problems(
        ours.consolidated_state_dict(), ref.state_dict()
    )
    results[f"{name} state bytes"] = (element_state_bytes(ours), element_state_bytes(ref))
    results[f"{name} layout"] = pieces_of(ours)
    if name == "AdamW":
        checkpoint_round_trip(ours, our_model, cls, kwargs, results, tmp, rank, world_size)


def checkpoint_round_trip(ours, our_model, cls, kwargs, results, tmp, rank, world_size):
    from zero1 import ShardedOptimizer

    buffer = io.BytesIO()
    torch.save(ours.state_dict(), buffer)
    torch.save(ours.state_dict(), tmp / f"ws{world_size}_rank{rank}.pt")
    resumed_model = make_model()
    resumed_model.load_state_dict(our_model.state_dict())
    resumed = ShardedOptimizer(groups_of(resumed_model), cls, **kwargs)
    resumed.load_state_dict(torch.load(io.BytesIO(buffer.getvalue())))
    problems = []
    for step in range(STEPS, STEPS + 2):
        for model, optimizer in ((our_model, ours), (resumed_model, resumed)):
            full_gradients(model, step)
            optimizer.step()
            optimizer.zero_grad()
        problems += differences(our_model, resumed_model, f"resumed step {step}")
    results["resume"] = problems

    refusals = {}
    chunked = make_model()
    attempts = {
        "other chunking": (
            ShardedOptimizer(groups_of(chunked), cls, chunks=chunks_of(chunked), **kwargs),
            buffer,
        )
    }
    dist.barrier()  # every rank's shard is on disk
    other = tmp / f"ws{world_size}_rank{(rank + 1) % world_size}.pt"
    attempts["other rank"] = (ShardedOptimizer(groups_of(make_model()), cls, **kwargs), other)
    if world_size == 3:  # the world-size-2 run saved its shards first
        attempts["other world size"] = (
            ShardedOptimizer(groups_of(make_model()), cls, **kwargs),
            tmp / f"ws2_rank{rank % 2}.pt",
        )
    for label, (optimizer, source) in attempts.items():
        if isinstance(source, io.BytesIO):
            source = io.BytesIO(source.getvalue())
        try:
            optimizer.load_state_dict(torch.load(source))
            refusals[label] = "accepted"
        except ValueError as error:
            refusals[label] = str(error)
    results["refusals"] = refusals


def sharded_like_zero2(params, world_size):
    """A ShardedOptimizer over one chunk whose gradient this rank holds only a slice of (ZeRO-2),
    and a function that plays the reduce-scatter: it copies this rank's slice of the given full
    gradients into the shard."""
    from zero1 import ShardedOptimizer

    rank, n = dist.get_rank(), math.ceil(sum(p.numel() for p in params) / world_size)
    shard = torch.zeros(n)
    optimizer = ShardedOptimizer(
        params, torch.optim.AdamW, gradient_shards=[shard], lr=0.1, foreach=False
    )

    def fill(grads):
        flat = torch.cat([g.reshape(-1) for g in grads] + [torch.zeros(n * world_size)])
        shard.copy_(flat[rank * n : (rank + 1) * n])

    return optimizer, fill


def scaler_skips_together(results, rank, world_size):
    """4 elements at world size 2 or 3: shards of 2,
    rank 1 owns elements 2 and 3, rank 2 owns none."""
    import comm_accounting
    from sharded_gradients import ShardedGradScaler

    ref_p, our_p = (torch.nn.Parameter(torch.arange(1.0, 5.0)) for _ in range(2))
    ref = torch.optim.AdamW([ref_p], lr=0.1, foreach=False)
    ours, fill = sharded_like_zero2([our_p], world_size)
    ref_scaler, our_scaler = (
        torch.amp.GradScaler("cpu", init_scale=256.0),
        ShardedGradScaler("cpu", init_scale=256.0),
    )
    found, unchanged, problems = [], [], []
    for step, poison in enumerate((True, False, False)):
        for p, scaler in ((ref_p, ref_scaler), (our_p, our_scaler)):
            scaler.scale(
                (p * torch.tensor([1.0, -2.0, 3.0, 0.5]) * (step + 1)).pow(2).sum()
            ).backward()
            if poison:
                p.grad[3] = float("inf")  # only rank 1 owns element 3
        fill([our_p.grad])
        our_p.grad = None  # as ShardedGradientDDP leaves it: only the shard holds the gradient
        before = our_p.detach().clone()
        our_scaler.unscale_(ours)
        found.append(
            sum(
                v.item()
                for v in our_scaler._per_optimizer_states[id(ours)]["found_inf_per_device"].values()
            )
        )
        for optimizer, scaler in ((ref, ref_scaler), (ours, our_scaler)):
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
        unchanged.append(torch.equal(before, our_p))
        if not torch.equal(ref_p, our_p):
            problems.append(f"step {step}")
    results["scaler"] = {
        "found inf": found,
        "unchanged": unchanged,
        "vs plain": problems,
        "scale": (our_scaler.get_scale(), ref_scaler.get_scale()),
    }
    comm_accounting.take_comm_bytes()
    ShardedGradScaler("cpu", enabled=False).unscale_(ours)
    results["disabled scaler comm"] = comm_accounting.take_comm_bytes()


def clipping_matches(results, world_size):
    import torch.distributed as dist

    from sharded_norms import clip_grad_norm

    ref_model, our_model = make_model(), make_model()
    ours, fill = sharded_like_zero2(in_group_order(our_model), world_size)
    full_gradients(ref_model, 0, scale=1e4)
    fill([p.grad for p in in_group_order(ref_model)])
    ref_norm = clip_grad_norm(trainable(ref_model), max_norm=0.5)
    # this rank's slices: each element on one rank
    mine = [p for g in ours.param_groups for p in g["params"]]
    our_norm = clip_grad_norm(mine, max_norm=0.5, groups=[dist.group.WORLD])
    clipped = [a.grad.view(-1) for a in in_group_order(ref_model)]
    slices_equal = all(
        torch.equal(view.grad, clipped[index][start:end])
        for view, (index, start, end) in zip(mine, ours.slices())
    )
    results["clip"] = {
        "norms": (our_norm.item(), ref_norm.item()),
        "same bits": torch.equal(our_norm, ref_norm),
        "slices equal": slices_equal,
        "dtype": str(our_norm.dtype),
    }


def gradient_shards_mode(results, rank, world_size):
    """ZeRO-2's contract:
    the views' gradients are slices of flat per-chunk buffers that someone else fills."""
    from zero1 import ShardedOptimizer

    ref_model, our_model = make_model(), make_model()
    ref = torch.optim.AdamW(groups_of(ref_model), lr=0.05, foreach=False)
    chunks = chunks_of(our_model)
    shard_sizes = [math.ceil(sum(p.numel() for p in c) / world_size) for c in chunks]
    buffers = [torch.zeros(n) for n in shard_sizes]
    ours = ShardedOptimizer(
        groups_of(our_model),
        torch.optim.AdamW,
        chunks=chunks,
        gradient_shards=buffers,
        lr=0.05,
        foreach=False,
    )
    problems = []
    for step in range(STEPS):
        full_gradients(ref_model, step)
        for chunk, buffer, n in zip(CHUNKS, buffers, shard_sizes):  # a reduce-scatter would do this
            flat = torch.cat(
                [in_group_order(ref_model)[i].grad.view(-1) for i in chunk]
                + [torch.zeros(n * world_size)]
            )
            buffer.copy_(flat[rank * n : (rank + 1) * n])
        ref.step()
        ours.step()
        ref.zero_grad()
        ours.zero_grad()
        problems += differences(ref_model, our_model, f"step {step}")
    results["zero2 vs plain"] = problems
    results["zero2 layout"] = pieces_of(ours)


def worker(rank, world_size, port, queue, tmp):
    # zero1.py; sharded_gradients.py
    sys.path[:0] = [str(REPO / "step5_zero1"), str(REPO / "step6_zero2")]
    init_gloo(rank, world_size, port)
    results = {}
    try:
        for name in OPTIMIZERS:
            against_plain_optimizer(name, results, tmp, rank, world_size)
        scaler_skips_together(results, rank, world_size)
        clipping_matches(results, world_size)
        gradient_shards_mode(results, rank, world_size)
        queue.put((rank, (results, None)))
    except Exception:
        queue.put((rank, (results, traceback.format_exc())))
    finally:
        dist.destroy_process_group()


# ---- The assertions, in the parent ---------------------------------------------------------------


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("zero1_shards")


def run(world_size, shard_dir):
    got = spawn(worker, world_size, shard_dir)
    for rank, (_, error) in got.items():
        assert error is None, f"rank {rank} failed:\n{error}"
    return {rank: r for rank, (r, _) in got.items()}


@pytest.fixture(scope="module")
def ws2(shard_dir):
    return run(2, shard_dir)


@pytest.fixture(scope="module")
def ws3(ws2, shard_dir):  # after ws2: it reads the shards ws2 saved
    return run(3, shard_dir)


# python -m pytest -m quick (pytest.ini) runs world size 2.
@pytest.fixture(params=[pytest.param(2, marks=pytest.mark.quick), 3])
def world(request):
    return request.param, request.getfixturevalue(f"ws{request.param}")


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_sharded_steps_are_bitwise_the_plain_optimizers(world, name):
    world_size, results = world
    for rank, r in results.items():
        assert r[f"{name} vs plain"] == [], f"rank {rank}"
        assert len(r[f"{name} moved"]) == len(NUMELS), (
            "some parameter never moved: the comparison proves little"
        )
        lr = OPTIMIZERS[name][1]["lr"] * 0.5**STEPS  # the scheduler reached this rank's groups
        assert r[f"{name} groups"] == [(0.1, lr), (0.0, lr)], (
            "the two groups' hyperparameters were lost"
        )


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_consolidated_state_dict_is_the_plain_optimizers(world, name):
    for rank, r in world[1].items():
        assert r[f"{name} consolidated"] == [], f"rank {rank}"


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_each_rank_holds_its_share_of_the_state(world, name):
    world_size, results = world
    plain = results[0][f"{name} state bytes"][1]
    per_element = plain // (4 * sum(NUMELS))  # AdamW and Adam: 2 moments; SGD: 1 momentum buffer
    assert per_element == (1 if name == "SGD" else 2)
    shard = math.ceil(sum(NUMELS) / world_size)
    mine = [results[rank][f"{name} state bytes"][0] for rank in range(world_size)]
    assert sum(mine) == plain, "state for some elements is missing or held twice"
    assert all(m <= shard * per_element * 4 for m in mine), (
        f"{mine}: more than a 1/{world_size} shard"
    )


def test_layout_is_element_balanced(world):
    """Rank r's pieces lie in [r * Lp/N,
    (r+1) * Lp/N) of their chunk's flat range and tile every parameter."""
    world_size, results = world
    for key, chunks in (("AdamW layout", [list(range(len(NUMELS)))]), ("zero2 layout", CHUNKS)):
        covered = {i: [] for i in range(len(NUMELS))}
        for rank in range(world_size):
            for index, start, end, c in results[rank][key]:
                chunk = chunks[c]
                begin = sum(NUMELS[i] for i in chunk[: chunk.index(index)])
                shard = math.ceil(sum(NUMELS[i] for i in chunk) / world_size)
                assert rank * shard <= begin + start < begin + end <= (rank + 1) * shard, (
                    key,
                    rank,
                    index,
                )
                covered[index].append((start, end))
        for index, ranges in covered.items():
            ranges.sort()
            assert ranges[0][0] == 0 and ranges[-1][1] == NUMELS[index], (key, index, ranges)
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])), (key, index, ranges)


def test_step_all_gathers_the_padded_parameters_once(world):
    world_size, results = world
    padded = math.ceil(sum(NUMELS) / world_size) * world_size
    for r in results.values():
        assert r["AdamW comm"] == {"all_gather": 4 * padded}


def test_resumed_shard_continues_bitwise(world):
    for rank, r in world[1].items():
        assert r["resume"] == [], f"rank {rank}"


def test_a_shard_of_another_layout_is_refused(world):
    world_size, results = world
    expected = {"other chunking", "other rank"} | (
        {"other world size"} if world_size == 3 else set()
    )
    for rank, r in results.items():
        assert set(r["refusals"]) == expected
        for label, message in r["refusals"].items():
            assert "other slices" in message, f"rank {rank}, {label}: {message}"


def test_grad_scaler_skips_on_every_rank_when_one_rank_sees_inf(world):
    world_size, results = world
    for rank, r in results.items():
        scaler = r["scaler"]
        assert scaler["found inf"] == [1.0, 0.0, 0.0], f"rank {rank}"
        assert scaler["unchanged"] == [True, False, False], f"rank {rank}"
        assert scaler["vs plain"] == [], f"rank {rank}"
        assert scaler["scale"][0] == scaler["scale"][1] == 128.0
        assert r["disabled scaler comm"] == {}


def test_clipping_matches_clip_grad_norm_of_the_full_gradients(world):
    for rank, r in world[1].items():
        clip = r["clip"]
        assert clip["norms"][0] > 0.5, "clipping never triggered"
        assert clip["same bits"] and clip["slices equal"] and clip["dtype"] == "torch.float32", (
            f"rank {rank}: {clip}"
        )


def test_gradient_shards_mode_is_bitwise_the_plain_optimizer(world):
    for rank, r in world[1].items():
        assert r["zero2 vs plain"] == [], f"rank {rank}"
