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

from conftest import REPO, init_gloo, spawn

sys.path.insert(0, str(REPO / "step4_hooks_bucketing"))
from bucketed_ddp import BucketedDDP, assign_buckets  # noqa: E402

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
    return {"Tied": Tied, "FrozenBias": FrozenBias, "Unused": Unused}[model_name]()


class EarlyHookDDP(BucketedDDP):
    """The classic bug: a hook on the gradient fires *before* it is accumulated into param.grad."""

    def _register_hooks(self, params):
        for p in params:
            p.register_hook(lambda grad, p=p: self._on_gradient_ready(p) if p.grad is not None else None)


def compare_with_ddp(rank, model_name, cap_mb, expect_buckets, wrapper=BucketedDDP):
    find_unused = model_name == "Unused"
    reference = torch.nn.parallel.DistributedDataParallel(fresh(model_name), find_unused_parameters=find_unused)
    accumulate(reference, model_name, rank, finish=lambda: None)
    ours = wrapper(fresh(model_name), bucket_cap_mb=cap_mb, first_bucket_cap_mb=cap_mb,
                   find_unused_parameters=find_unused)
    n_buckets = len(ours.buckets)
    assert expect_buckets(n_buckets), f"{model_name} cap {cap_mb} MiB: {n_buckets} buckets"
    accumulate(ours, model_name, rank, finish=ours.finish_gradient_synchronization)
    mismatched = []
    for (name, a), b in zip(reference.module.named_parameters(), ours.module.parameters()):
        if (a.grad is None) != (b.grad is None) or (a.grad is not None and not torch.equal(a.grad, b.grad)):
            mismatched.append(name)
    return mismatched


CAPS = {  # cap in MiB -> how many buckets it must make (the models are a few KiB)
    1e-9: lambda n: n >= 3,   # every parameter closes its own bucket
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


def worker(rank, world_size, port, queue):
    init_gloo(rank, world_size, port)
    results = {}
    try:
        for model_name in ("Tied", "FrozenBias", "Unused"):
            for cap, expect in CAPS.items():
                cap_mb = half_model_cap(model_name) if cap == "half" else cap
                results[f"{model_name}/{cap}"] = compare_with_ddp(rank, model_name, cap_mb, expect)
        # The bug the post-accumulate hook avoids: with accumulation, an early hook reduces the wrong sum.
        results["early hook"] = compare_with_ddp(rank, "FrozenBias", 100.0, lambda n: True, wrapper=EarlyHookDDP)
        # Default (find_unused_parameters=False): a clear error naming the parameter, on every rank,
        # after all buckets were reduced, so the group is still usable (the barrier below would hang otherwise).
        strict = BucketedDDP(fresh("Unused"))
        strict(inputs("Unused", rank, 0)).sum().backward()
        try:
            strict.finish_gradient_synchronization()
            results["strict error"] = "no error"
        except RuntimeError as error:
            results["strict error"] = str(error)
        dist.barrier()
        queue.put((rank, (results, None)))
    except Exception:
        queue.put((rank, (results, traceback.format_exc())))
    finally:
        dist.destroy_process_group()


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


def test_unused_parameter_is_a_clear_error_without_a_hang(results):
    for rank in range(WORLD_SIZE):
        message = results[rank]["strict error"]
        assert "never.weight" in message and "never.bias" in message and "find_unused_parameters" in message


def test_buckets_follow_gradient_ready_order_with_a_small_first_bucket():
    sizes = [torch.nn.Parameter(torch.zeros(n)) for n in (10, 20, 300_000, 40, 50)]  # 1.2 MB in the middle
    groups = assign_buckets(sizes[::-1], bucket_cap_bytes=25 * 2**20, first_bucket_cap_bytes=1 * 2**20)
    assert [[p.numel() for p in g] for g in groups] == [[50, 40, 300_000], [20, 10]]
