"""BucketedDDP against PyTorch DDP on small models that are not GPT-2, in real gloo processes.

Each case trains two copies of one model with the same data on 2 ranks, one wrapped in PyTorch
DDP and one in BucketedDDP, with gradient accumulation (no_sync on the first micro-batch), and
requires the averaged gradients to be bitwise equal (at world size 2 both sum in an order-free way).
"""

import sys
import traceback

import pytest
import torch
import torch.distributed as dist

from conftest import REPO, init_gloo, shutdown, spawn

sys.path.insert(0, str(REPO / "step4_hooks_bucketing"))
from bucketed_ddp import BucketedDDP, assign_buckets  # noqa: E402

pytestmark = pytest.mark.quick  # python -m pytest -m quick: see pytest.ini

WORLD_SIZE = 2


class Tied(torch.nn.Module):
    """Input embedding and output layer share one weight, as in GPT-2."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(50, 16)
        self.hidden = torch.nn.Linear(16, 16)
        self.out = torch.nn.Linear(16, 50, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, x):
        return self.out(torch.tanh(self.hidden(self.embed(x)))).mean(dim=1)


class FrozenBias(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(8, 32)
        self.first.bias.requires_grad_(False)
        self.second = torch.nn.Linear(32, 32)
        self.third = torch.nn.Linear(32, 4)

    def forward(self, x):
        return self.third(torch.relu(self.second(torch.relu(self.first(x.float())))))


class Unused(torch.nn.Module):
    """``never`` takes no part in the loss: it never receives a gradient."""

    def __init__(self):
        super().__init__()
        self.used = torch.nn.Linear(8, 8)
        self.never = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.head(torch.relu(self.used(x.float())))


class UsedEarly(torch.nn.Module):
    """``early`` takes part in the first micro-batch only: the synchronised backward of the last one
    gives it no gradient, and what must be averaged is the gradient it accumulated
    inside no_sync."""

    def __init__(self):
        super().__init__()
        self.trunk = torch.nn.Linear(8, 8)
        self.early = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x, use_early: bool):
        h = torch.relu(self.trunk(x))
        return self.head(h + self.early(h) if use_early else h)


class WithBuffers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.norm = torch.nn.BatchNorm1d(8)  # running_mean, running_var, num_batches_tracked

    def forward(self, x):
        return self.norm(self.linear(x))


def inputs(model_name: str, rank: int, micro: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * rank + micro)
    if model_name == "Tied":
        return torch.randint(0, 50, (4, 6), generator=g)
    return torch.randn(4, 8, generator=g)


def accumulate(wrapped, model_name: str, rank: int, *, finish) -> None:
    """Two micro-batches: the first under no_sync (local accumulation), the second synchronised."""
    for micro in range(2):
        context = wrapped.no_sync() if micro == 0 else torch.enable_grad()
        with context:
            loss = wrapped(inputs(model_name, rank, micro)).pow(2).mean() / 2
            loss.backward()
    finish()


def fresh(model_name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return {"Tied": Tied, "FrozenBias": FrozenBias, "Unused": Unused, "UsedEarly": UsedEarly}[
        model_name
    ]()


class EarlyHookDDP(BucketedDDP):
    """The classic bug: a hook on the gradient fires *before* it is accumulated into param.grad."""

    def _register_hooks(self, params):
        for p in params:
            p.register_hook(
                lambda grad, p=p: self._on_gradient_ready(p) if p.grad is not None else None
            )


def compare_with_ddp(rank, model_name, cap_mb, expect_buckets, wrapper=BucketedDDP):
    find_unused = model_name == "Unused"
    reference = torch.nn.parallel.DistributedDataParallel(
        fresh(model_name), find_unused_parameters=find_unused
    )
    accumulate(reference, model_name, rank, finish=lambda: None)
    ours = wrapper(
        fresh(model_name),
        bucket_cap_mb=cap_mb,
        first_bucket_cap_mb=cap_mb,
        find_unused_parameters=find_unused,
    )
    n_buckets = len(ours.buckets)
    assert expect_buckets(n_buckets), f"{model_name} cap {cap_mb} MiB: {n_buckets} buckets"
    accumulate(ours, model_name, rank, finish=ours.finish_gradient_synchronization)
    mismatched = []
    for (name, a), b in zip(reference.module.named_parameters(), ours.module.parameters()):
        if (a.grad is None) != (b.grad is None) or (
            a.grad is not None and not torch.equal(a.grad, b.grad)
        ):
            mismatched.append(name)
    return mismatched


CAPS = {  # cap in MiB -> how many buckets it must make (the models are a few KiB)
    1e-9: lambda n: n >= 3,  # every parameter closes its own bucket
    "half": lambda n: n == 2,
    100.0: lambda n: n == 1,
}


def half_model_cap(model_name) -> float:
    """A cap (MiB) that splits the model's gradients into exactly two buckets."""
    params = [p for p in fresh(model_name).parameters() if p.requires_grad][::-1]
    for k in range(1, len(params)):
        cap = sum(p.numel() * 4 for p in params[:k])
        if len(assign_buckets(params, cap, cap)) == 2:
            return cap / 2**20
    raise AssertionError(f"no cap splits {model_name} into two buckets")


def used_early_matches_ddp(rank, cap_mb) -> list:
    """DDP (find_unused_parameters=True) and BucketedDDP on UsedEarly; also both against the
    definition: the mean over the ranks of the gradient each accumulated locally. Returns
    the mismatches."""
    grads = {}
    for name in ("ddp", "ours"):
        model = fresh("UsedEarly")
        if name == "ddp":
            wrapped = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
            finish = lambda: None  # noqa: E731
        else:
            wrapped = BucketedDDP(
                model, bucket_cap_mb=cap_mb, first_bucket_cap_mb=cap_mb, find_unused_parameters=True
            )
            finish = wrapped.finish_gradient_synchronization
        with wrapped.no_sync():
            wrapped(inputs("UsedEarly", rank, 0), use_early=True).pow(2).mean().backward()
        local = model.early.weight.grad.clone()
        wrapped(inputs("UsedEarly", rank, 1), use_early=False).pow(2).mean().backward()
        finish()
        grads[name] = {n: p.grad for n, p in model.named_parameters()}
        # the definition: sum over ranks, divided by 2 (exact at world size 2)
        dist.all_reduce(local)
        grads[f"{name} mean"] = local / WORLD_SIZE
    mismatched = [n for n in grads["ddp"] if not torch.equal(grads["ddp"][n], grads["ours"][n])]
    for name in ("ddp", "ours"):
        if not torch.equal(grads[name]["early.weight"], grads[f"{name} mean"]):
            mismatched.append(f"{name}: early.weight is not the mean of the accumulated gradients")
    return mismatched


def broadcast_at_wrapping(rank) -> dict:
    """Ranks build different parameters and buffers; after wrapping every rank holds rank 0's."""
    torch.manual_seed(rank)
    model = WithBuffers()
    with torch.no_grad():
        for b in model.buffers():
            b.fill_(rank + 1)  # BatchNorm's buffers start equal on every rank: make them differ too

    def everyone(tensors):
        flat = torch.cat([t.detach().double().flatten() for t in tensors])
        gathered = [torch.zeros_like(flat) for _ in range(WORLD_SIZE)]
        dist.all_gather(gathered, flat)
        return gathered

    params_before, buffers_before = everyone(model.parameters()), everyone(model.buffers())
    BucketedDDP(model)
    params_after, buffers_after = everyone(model.parameters()), everyone(model.buffers())
    return {
        "differed before": not torch.equal(*params_before) and not torch.equal(*buffers_before),
        "parameters are rank 0's": all(torch.equal(p, params_before[0]) for p in params_after),
        "buffers are rank 0's": all(torch.equal(b, buffers_before[0]) for b in buffers_after),
    }


def worker(rank, world_size, port, queue):
    init_gloo(rank, world_size, port)
    results = {}
    try:
        for model_name in ("Tied", "FrozenBias", "Unused"):
            for cap, expect in CAPS.items():
                cap_mb = half_model_cap(model_name) if cap == "half" else cap
                results[f"{model_name}/{cap}"] = compare_with_ddp(rank, model_name, cap_mb, expect)
        for cap in (1e-9, 100.0):
            results[f"used early/{cap}"] = used_early_matches_ddp(rank, cap)
        results["broadcast"] = broadcast_at_wrapping(rank)
        # The bug the post-accumulate hook avoids: with
        # accumulation, an early hook reduces the wrong sum.
        results["early hook"] = compare_with_ddp(
            rank, "FrozenBias", 100.0, lambda n: True, wrapper=EarlyHookDDP
        )
        # Default (find_unused_parameters=False): a clear error naming the parameter, on every rank,
        # after all buckets were reduced, so the group is still usable (shutdown's barrier would
        # hang otherwise).
        strict = BucketedDDP(fresh("Unused"))
        strict(inputs("Unused", rank, 0)).sum().backward()
        try:
            strict.finish_gradient_synchronization()
            results["strict error"] = "no error"
        except RuntimeError as error:
            results["strict error"] = str(error)
        del strict
        shutdown()
        queue.put((rank, (results, None)))
    except Exception:
        queue.put((rank, (results, traceback.format_exc())))
        dist.destroy_process_group()  # no barrier: the peer may be anywhere


@pytest.fixture(scope="module")
def results():
    got = spawn(worker, WORLD_SIZE)
    for rank, (_, error) in got.items():
        assert error is None, f"rank {rank} failed:\n{error}"
    return {rank: r for rank, (r, _) in got.items()}


@pytest.mark.parametrize("model_name", ["Tied", "FrozenBias", "Unused"])
@pytest.mark.parametrize("cap", list(CAPS))
def test_gradients_match_pytorch_ddp_bitwise(results, model_name, cap):
    for rank in range(WORLD_SIZE):
        assert results[rank][f"{model_name}/{cap}"] == [], f"rank {rank}: gradients differ from DDP"


def test_a_hook_before_accumulation_breaks_gradient_accumulation(results):
    """The comparison above would catch the classic bug: it fails for a pre-accumulation hook."""
    for rank in range(WORLD_SIZE):
        assert results[rank]["early hook"], "a pre-accumulation hook went unnoticed"


@pytest.mark.parametrize("cap", [1e-9, 100.0])
def test_gradient_accumulated_in_no_sync_but_unused_at_the_sync_is_averaged_like_ddp(results, cap):
    """find_unused_parameters=True;
    one bucket per parameter (1e-9 MiB) and one bucket for all (100 MiB)."""
    for rank in range(WORLD_SIZE):
        assert results[rank][f"used early/{cap}"] == [], f"rank {rank}"


def test_wrapping_broadcasts_rank_0s_parameters_and_buffers(results):
    for rank in range(WORLD_SIZE):
        assert results[rank]["broadcast"] == {
            "differed before": True,
            "parameters are rank 0's": True,
            "buffers are rank 0's": True,
        }, f"rank {rank}"


def test_unused_parameter_is_a_clear_error_without_a_hang(results):
    for rank in range(WORLD_SIZE):
        message = results[rank]["strict error"]
        assert (
            "never.weight" in message
            and "never.bias" in message
            and "find_unused_parameters" in message
        )


def test_buckets_follow_gradient_ready_order_with_a_small_first_bucket():
    # 1.2 MB in the middle
    sizes = [torch.nn.Parameter(torch.zeros(n)) for n in (10, 20, 300_000, 40, 50)]
    groups = assign_buckets(
        sizes[::-1], bucket_cap_bytes=25 * 2**20, first_bucket_cap_bytes=1 * 2**20
    )
    assert [[p.numel() for p in g] for g in groups] == [[50, 40, 300_000], [20, 10]]
