"""Each idea file used the way someone else's training
script uses it, beside its PyTorch counterpart.

    # CASE: naive_dp bucketed_ddp zero1 zero2 zero3 zero1_bf16 zero2_bf16 zero1_fp16 offload
    python tests/drop_in_harness.py CASE [CASE ...] OUT.json

This file is deliberately written like an outside harness (a course's test suite, a learner's own
script): ``torch.multiprocessing.spawn`` starts two workers, each creates the process group itself,
*then* imports the idea file from its step folder, and runs a plain loop that names nothing of this
repository but the idea file's own classes and functions. The same loop runs with the PyTorch
counterpart (``DistributedDataParallel``, ``ZeroRedundancyOptimizer``, FSDP2's ``fully_shard``) in
the same process, and every parameter is compared with ``torch.equal`` after every optimiser step.
The workers leave with ``dist.destroy_process_group()``, as such a script does, not with our
``shutdown()``.

Several cases share one spawn (starting a process is most of a case's time): the group is created
once, every case's idea files are imported next, one case after another and each from its own folder
(so what an import adds to ``sys.modules`` is still its own doing: no loop has run yet), then the
cases' loops run in turn, each with its own files back in place. OUT.json holds ``{"cases": {CASE:
{"problems": [...], "checked": N}}, "threads left": [...]}``. A worker that dies (an exception, or a
signal such as the SIGABRT of a thread left alive into interpreter exit) makes ``mp.spawn`` raise,
and this script exit non-zero.
"""

import contextlib
import importlib
import json
import os
import socket
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

REPO = Path(__file__).resolve().parent.parent
FOLDER = {
    "naive_dp": "step3_naive_dp",
    "bucketed_ddp": "step4_hooks_bucketing",
    "zero1": "step5_zero1",
    "zero2": "step6_zero2",
    "zero3": "step7_zero3",
    "zero1_bf16": "step5_zero1",
    "zero2_bf16": "step6_zero2",
    "zero1_fp16": "step5_zero1",
    "offload": "step7_zero3",
}
IDEA_MODULES = {
    "naive_dp": ["naive_dp"],
    "bucketed_ddp": ["bucketed_ddp"],
    "zero1": ["zero1"],
    "zero2": ["zero2", "zero1", "sharded_gradients"],
    "zero3": ["zero3"],
    "zero1_bf16": ["zero1"],
    "zero2_bf16": ["zero2", "zero1"],
    "zero1_fp16": ["zero1", "sharded_gradients"],
    "offload": ["zero3", "offload"],
}
WORLD_SIZE, STEPS, MICRO_BATCHES, VOCAB = 2, 3, 2, 11


class Toy(nn.Module):
    """An embedding tied to the output layer, a norm, a frozen layer, a layer used only in the first
    micro-batch of each step, sizes no world size divides (9 x 6 ... 6 x 7:
    412 trainable elements)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 6)
        self.norm = nn.LayerNorm(6)
        self.frozen = nn.Linear(6, 6)
        self.frozen.requires_grad_(False)
        self.up = nn.Linear(6, 7)
        self.down = nn.Linear(7, 6)
        self.rare = nn.Linear(6, 6)

    def forward(self, x, use_rare: bool):
        h = self.frozen(self.norm(self.embed(x)))
        h = h + self.down(torch.tanh(self.up(h)))
        if use_rare:
            h = h + self.rare(h)
        return h @ self.embed.weight.T  # the embedding again, as GPT-2's output layer


class Block(nn.Module):
    """A norm, a layer used twice (tied to itself),
    a frozen layer or not, a layer used only in the first micro-batch."""

    def __init__(self, frozen: bool):
        super().__init__()
        self.norm = nn.LayerNorm(6)
        self.mix = nn.Linear(6, 7)
        self.fixed = nn.Linear(7, 7)
        self.rare = nn.Linear(6, 6)
        if frozen:
            self.fixed.requires_grad_(False)

    def forward(self, h, use_rare: bool):
        z = torch.tanh(self.fixed(self.mix(self.norm(h))))
        h = h + z @ self.mix.weight  # mix's weight a second time, transposed
        return h + self.rare(h) if use_rare else h


class TiedEnds(nn.Module):
    """The embedding, called a second time as the output layer."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 6)

    def forward(self, x=None, h=None):
        return self.embed(x) if h is None else h @ self.embed.weight.T


class Stack(nn.Module):
    """For FSDP: a root with no parameter of its own; the embedding, each block and the head are
    units, each called once. ``tied=True``: the embedding is also the output layer, one unit called
    at both ends."""

    def __init__(self, tied: bool = False):
        super().__init__()
        self.ends = TiedEnds() if tied else None
        self.embed = None if tied else nn.Embedding(VOCAB, 6)
        self.blocks = nn.ModuleList([Block(frozen=False), Block(frozen=True)])
        self.head = None if tied else nn.Linear(6, VOCAB)
        self.units = [self.ends, *self.blocks] if tied else [self.embed, *self.blocks, self.head]

    def forward(self, x, use_rare: bool):
        h = self.ends(x=x) if self.ends is not None else self.embed(x)
        for block in self.blocks:
            h = block(h, use_rare)
        return self.ends(h=h) if self.ends is not None else self.head(h)


def batch(step: int, micro_step: int, rank: int) -> torch.Tensor:
    return torch.randint(
        0,
        VOCAB,
        (3, 5),
        generator=torch.Generator().manual_seed(1000 * step + 10 * micro_step + rank),
    )


def loss_of(model, step, micro_step, rank) -> torch.Tensor:
    logits = model(batch(step, micro_step, rank), use_rare=micro_step == 0)
    return logits.pow(2).mean() / MICRO_BATCHES


def build(cls, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return cls()


def groups(model) -> list[dict]:
    """Weight decay for the matrices, chosen by name (a sharded piece may have lost its shape)."""
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decayed = {n for n, _ in trainable if n.endswith("weight") and "norm" not in n}
    return [
        {"params": [p for n, p in trainable if n in decayed], "weight_decay": 0.1},
        {"params": [p for n, p in trainable if n not in decayed], "weight_decay": 0.0},
    ]


def compare(problems: list, label: str, ours: dict, theirs: dict) -> int:
    for name, tensor in theirs.items():
        if not torch.equal(ours[name], tensor):
            problems.append(
                f"{label}: {name} differs (max abs {(ours[name] - tensor).abs().max().item():.3g})"
            )
    return len(theirs)


def params(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# ---- The cases: our loop and PyTorch's, step by step ---------------------------------------------


def case_naive_dp(rank, problems) -> int:
    from naive_dp import allreduce_gradients, broadcast_parameters

    ours = build(Toy, 100 + rank)  # a different start on every rank: the broadcast must fix it
    broadcast_parameters(ours)
    theirs = DDP(build(Toy, 100), find_unused_parameters=True)
    opts = [torch.optim.AdamW(groups(m), lr=0.05) for m in (ours, theirs.module)]
    checked = 0
    for step in range(STEPS):
        for micro_step in range(MICRO_BATCHES):
            loss_of(ours, step, micro_step, rank).backward()  # naive DP: nothing to switch off
            with theirs.no_sync() if micro_step < MICRO_BATCHES - 1 else contextlib.nullcontext():
                loss_of(theirs, step, micro_step, rank).backward()
        allreduce_gradients(ours)
        for model, opt in ((ours, opts[0]), (theirs.module, opts[1])):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            opt.zero_grad()
        checked += compare(problems, f"step {step}", params(ours), params(theirs.module))
    del theirs  # DDP's reducer holds the group: free it before the group goes
    return checked


def case_bucketed_ddp(rank, problems) -> int:
    from bucketed_ddp import BucketedDDP

    # ~3 buckets
    ours = BucketedDDP(build(Toy, 100 + rank), bucket_cap_mb=0.0002, find_unused_parameters=True)
    theirs = DDP(build(Toy, 100), find_unused_parameters=True)
    opts = [torch.optim.AdamW(groups(m.module), lr=0.05) for m in (ours, theirs)]
    checked = 0
    for step in range(STEPS):
        for micro_step in range(MICRO_BATCHES):
            for model in (ours, theirs):
                with (
                    model.no_sync() if micro_step < MICRO_BATCHES - 1 else contextlib.nullcontext()
                ):
                    loss_of(model, step, micro_step, rank).backward()
        ours.finish_gradient_synchronization()
        for model, opt in ((ours, opts[0]), (theirs, opts[1])):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            opt.zero_grad()
        checked += compare(problems, f"step {step}", params(ours.module), params(theirs.module))
    del theirs
    return checked


def case_zero1(rank, problems) -> int:
    """DDP syncs the gradients; the optimisers differ:
    ours, ZeroRedundancyOptimizer, and a plain one."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from zero1 import ShardedOptimizer

    checked = 0
    for optimizer_cls, kwargs in (
        (torch.optim.AdamW, dict(lr=0.05)),
        (torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
    ):
        models = [DDP(build(Toy, 100), find_unused_parameters=True) for _ in range(3)]
        opts = [
            ShardedOptimizer(groups(models[0]), optimizer_cls, **kwargs),
            ZeroRedundancyOptimizer(groups(models[1]), optimizer_class=optimizer_cls, **kwargs),
            optimizer_cls(groups(models[2]), **kwargs),
        ]
        schedulers = [torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.7**s) for opt in opts]
        scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**10) for _ in opts]
        for step in range(STEPS + 1):
            for model, opt, scaler, scheduler in zip(models, opts, scalers, schedulers):
                for micro_step in range(MICRO_BATCHES):
                    with (
                        model.no_sync()
                        if micro_step < MICRO_BATCHES - 1
                        else contextlib.nullcontext()
                    ):
                        # forward inside no_sync: DDP decides there
                        loss = loss_of(model, step, micro_step, rank)
                        if step == 1:
                            # an overflow: every scaler must skip this step
                            loss = loss * float("inf")
                        scaler.scale(loss).backward()
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                scaler.step(opt)
                scaler.update()
                scheduler.step()
                opt.zero_grad()
            label = f"{optimizer_cls.__name__} step {step}"
            checked += compare(
                problems,
                f"{label} vs ZeroRedundancyOptimizer",
                params(models[0]),
                params(models[1]),
            )
            checked += compare(
                problems,
                f"{label} vs {optimizer_cls.__name__}",
                params(models[0]),
                params(models[2]),
            )
        if (
            len({scaler.get_scale() for scaler in scalers}) != 1
            or scalers[0].get_scale() == 2.0**10
        ):
            problems.append(
                f"scales {[s.get_scale() for s in scalers]}: the overflow step was not "
                "skipped alike"
            )
        del models, opts
    return checked


def case_zero2(rank, problems) -> int:
    """Sharded gradients: ours end to end,
    against DDP with a plain AdamW, a GradScaler and clip_grad_norm_."""
    from sharded_gradients import ShardedGradScaler
    from sharded_norms import clip_grad_norm
    from zero1 import ShardedOptimizer
    from zero2 import ShardedGradientDDP

    ours = ShardedGradientDDP(
        build(Toy, 100 + rank), bucket_cap_mb=0.0002, find_unused_parameters=True
    )
    our_opt = ShardedOptimizer(
        groups(ours.module),
        torch.optim.AdamW,
        chunks=ours.bucket_params,
        gradient_shards=ours.gradient_shards,
        lr=0.05,
    )
    theirs = DDP(build(Toy, 100), find_unused_parameters=True)
    their_opt = torch.optim.AdamW(groups(theirs.module), lr=0.05)
    our_scaler, their_scaler = (
        ShardedGradScaler("cpu", init_scale=2.0**10),
        torch.amp.GradScaler("cpu", init_scale=2.0**10),
    )
    checked = 0
    for step in range(STEPS):
        for micro_step in range(MICRO_BATCHES):
            for model, scaler in ((ours, our_scaler), (theirs, their_scaler)):
                with (
                    model.no_sync() if micro_step < MICRO_BATCHES - 1 else contextlib.nullcontext()
                ):
                    scaler.scale(loss_of(model, step, micro_step, rank)).backward()
        ours.finish_gradient_synchronization()
        our_scaler.unscale_(our_opt)
        # slices
        clip_grad_norm(
            [p for g in our_opt.param_groups for p in g["params"]], 0.5, [dist.group.WORLD]
        )
        our_scaler.step(our_opt)
        our_scaler.update()
        our_opt.zero_grad()
        their_scaler.unscale_(their_opt)
        # clip_grad_norm adds the squares in float64 (any grouping of the slices rounds to the same
        # float32 norm); clip_grad_norm_ adds float32 norms. So: PyTorch's clipping rule, with
        # that norm.
        grads = [p.grad for p in theirs.parameters() if p.grad is not None]
        norm = sum(g.double().pow(2).sum() for g in grads).sqrt().float()
        torch.nn.utils.clip_grads_with_norm_(theirs.parameters(), 0.5, norm)
        their_scaler.step(their_opt)
        their_scaler.update()
        their_opt.zero_grad()
        checked += compare(problems, f"step {step}", params(ours.module), params(theirs.module))
    del theirs
    return checked


def case_zero3(rank, problems) -> int:
    """FullyShardedDP against FSDP2's fully_shard (every unit called once), and against DDP with the
    embedding tied to the output layer (a unit called at both ends: FSDP2 reduce-scatters each
    call's gradient on its own, which rounds differently from DDP; FullyShardedDP sums every use
    first, as DDP does)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from zero3 import FullyShardedDP

    mesh, checked, float32_result = init_device_mesh("cpu", (WORLD_SIZE,)), 0, None
    # (tied ends, param_dtype): FSDP2 in float32; DDP with a unit called twice; FSDP2's mixed
    # precision, bf16 parameters and computation over float32 master shards, gradients reduced
    # in float32.
    for tied, param_dtype in ((False, None), (True, None), (False, torch.bfloat16)):
        ours_model = build(lambda tied=tied: Stack(tied), 100)
        ours = FullyShardedDP(ours_model, ours_model.units, param_dtype=param_dtype)
        theirs = build(lambda tied=tied: Stack(tied), 100)
        if tied:
            theirs = DDP(theirs, find_unused_parameters=True)
        else:
            policy = MixedPrecisionPolicy(
                param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None
            )
            for module in (*theirs.units, theirs):
                fully_shard(module, mesh=mesh, mp_policy=policy)
        opts = [
            torch.optim.AdamW(groups(ours), lr=0.05),
            torch.optim.AdamW(groups(theirs), lr=0.05),
        ]
        for step in range(STEPS):
            for micro_step in range(MICRO_BATCHES):
                last = micro_step == MICRO_BATCHES - 1
                with ours.no_sync() if not last else contextlib.nullcontext():
                    loss_of(ours, step, micro_step, rank).backward()
                if tied:
                    with theirs.no_sync() if not last else contextlib.nullcontext():
                        loss_of(theirs, step, micro_step, rank).backward()
                else:
                    theirs.set_requires_gradient_sync(last)
                    loss_of(theirs, step, micro_step, rank).backward()
            ours.finish_gradient_synchronization()
            for opt in opts:
                opt.step()
                opt.zero_grad()
            mine = {name: tensor.clone() for name, tensor in ours.gathered_parameters()}
            full = (
                params(theirs.module)
                if tied
                else {name: p.full_tensor() for name, p in theirs.named_parameters()}
            )
            label = (
                f"{'tied, vs DDP' if tied else 'vs FSDP2'}{', bf16' if param_dtype else ''}"
                f" step {step}"
            )
            checked += compare(problems, label, mine, full)
        if (tied, param_dtype) == (False, None):
            float32_result = mine
        elif param_dtype is not None and all(torch.equal(mine[n], float32_result[n]) for n in mine):
            problems.append(
                "bf16 parameters trained exactly as float32 ones: param_dtype was not applied"
            )
        frozen = [n for n, p in ours.named_parameters() if not p.requires_grad]
        if frozen != ["blocks.1.fixed.weight", "blocks.1.fixed.bias"]:
            problems.append(f"frozen pieces: {frozen}")
        # a synchronised backward, its sync point forgotten
        loss_of(ours, STEPS, 0, rank).backward()
        try:
            loss_of(ours, STEPS, 1, rank)
            problems.append(
                "a forward after a forgotten finish_gradient_synchronization() was accepted"
            )
        except RuntimeError as error:
            if "finish_gradient_synchronization()" not in str(error):
                problems.append(f"unclear error for a forgotten sync point: {error}")
        ours.finish_gradient_synchronization()
        del theirs
    return checked


def case_offload(rank, problems) -> int:
    """FullyShardedDP with OffloadedOptimizer (AdamW on host copies) against FSDP2 with
    CPUOffloadPolicy, an LR schedule on both: bitwise at every step; the moments and the masters on
    the host, apart from the parameters."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    from offload import OffloadedOptimizer
    from zero3 import FullyShardedDP

    ours_model = build(lambda: Stack(False), 100)
    ours = FullyShardedDP(ours_model, ours_model.units)
    theirs = build(lambda: Stack(False), 100)
    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    for module in (*theirs.units, theirs):
        fully_shard(module, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
    opts = [
        OffloadedOptimizer(
            ours.named_parameters(), lambda named: torch.optim.AdamW(groups_of(named), lr=0.05)
        ),
        torch.optim.AdamW(groups(theirs), lr=0.05),
    ]
    schedules = [
        torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1 / (step + 1)) for opt in opts
    ]
    checked = 0
    for step in range(STEPS):
        for micro_step in range(MICRO_BATCHES):
            last = micro_step == MICRO_BATCHES - 1
            with ours.no_sync() if not last else contextlib.nullcontext():
                loss_of(ours, step, micro_step, rank).backward()
            theirs.set_requires_gradient_sync(last)
            loss_of(theirs, step, micro_step, rank).backward()
        ours.finish_gradient_synchronization()
        for opt, schedule in zip(opts, schedules):
            opt.step()
            opt.zero_grad()
            schedule.step()
        mine = {name: tensor.clone() for name, tensor in ours.gathered_parameters()}
        checked += compare(
            problems,
            f"offloaded, vs FSDP2 CPUOffloadPolicy step {step}",
            mine,
            {name: p.full_tensor() for name, p in theirs.named_parameters()},
        )
    pieces = {p.untyped_storage().data_ptr() for p in ours.parameters()}
    held = [
        t for state in opts[0].state.values() for t in state.values() if torch.is_tensor(t)
    ] + opts[0].host_copies
    if not held or any(
        t.device.type != "cpu" or t.untyped_storage().data_ptr() in pieces for t in held
    ):
        problems.append("the optimiser's state or masters are not host tensors of their own")
    del theirs
    return checked


def groups_of(named) -> list[dict]:
    """``groups`` for (name, tensor) pairs,
    as OffloadedOptimizer hands its host copies to the optimiser it builds."""
    named = list(named)
    decayed = {n for n, _ in named if n.endswith("weight") and "norm" not in n}
    return [
        {"params": [p for n, p in named if n in decayed], "weight_decay": 0.1},
        {"params": [p for n, p in named if n not in decayed], "weight_decay": 0.0},
    ]


def fsdp2_bf16(model):
    """FSDP2 with bf16 parameters over float32 shards,
    gradients reduced in float32: every unit, then the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for module in (*model.units, model):
        fully_shard(module, mesh=mesh, mp_policy=policy)
    return model


def trained_fsdp2_bf16(rank: int) -> list[dict]:
    """FSDP2's float32 masters after each of STEPS steps of the plain loop:
    what the two cases below must equal."""
    theirs = fsdp2_bf16(build(lambda: Stack(False), 100))
    opt = torch.optim.AdamW(groups(theirs), lr=0.05)
    after = []
    for step in range(STEPS):
        for micro_step in range(MICRO_BATCHES):
            theirs.set_requires_gradient_sync(micro_step == MICRO_BATCHES - 1)
            loss_of(theirs, step, micro_step, rank).backward()
        opt.step()
        opt.zero_grad()
        after.append({n: p.full_tensor() for n, p in theirs.named_parameters() if p.requires_grad})
    del theirs, opt
    return after


def summed_and_averaged(model, step, rank, scaler) -> dict:
    """The outsider's own gradient sync for 16-bit parameters: each micro-batch's scaled 16-bit
    gradient added to a float32 sum, the sums all-reduced in float32 and averaged. ``{parameter: its
    float32 averaged gradient}``."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    sums = {}
    for micro_step in range(MICRO_BATCHES):
        scaler.scale(loss_of(model, step, micro_step, rank)).backward()
        for p in trainable:
            if p.grad is not None:
                sums[p] = p.grad.float() if p not in sums else sums[p].add_(p.grad)
                p.grad = None
    for p in trainable:
        sums[p] = sums.get(p, torch.zeros(p.shape))
        dist.all_reduce(sums[p])
        sums[p].div_(WORLD_SIZE)
    return sums


def case_zero1_bf16(rank, problems) -> int:
    """ShardedOptimizerWithMasters(param_dtype=bf16) with the outsider's own gradient sync (float32
    sums into ``main_grad``, as the optimiser's docstring asks) against FSDP2's
    MixedPrecisionPolicy(bf16, float32)."""
    from masters import ShardedOptimizerWithMasters

    expected = trained_fsdp2_bf16(rank)
    model = build(lambda: Stack(False), 100)
    opt = ShardedOptimizerWithMasters(groups(model), torch.optim.AdamW, torch.bfloat16, lr=0.05)
    # what the optimiser does not step (the frozen layer) computes in bf16 too
    model.to(torch.bfloat16)
    no_scaling = torch.amp.GradScaler("cpu", enabled=False)  # bf16 has float32's range
    checked = 0
    for step in range(STEPS):
        for p, grad in summed_and_averaged(model, step, rank, no_scaling).items():
            p.main_grad = grad
        opt.step()
        opt.zero_grad()
        names = {p: n for n, p in model.named_parameters()}
        ours = {names[p]: full for p, full in opt.gathered_masters().items()}
        checked += compare(
            problems, f"ShardedOptimizer bf16 vs FSDP2 step {step}", ours, expected[step]
        )
        for name, p in model.named_parameters():  # the bf16 copy is the master rounded once
            if p.requires_grad and not torch.equal(p, ours[name].bfloat16()):
                problems.append(f"step {step}: {name}'s bf16 copy is not its master rounded")
    return checked


def case_zero1_fp16(rank, problems) -> int:
    """ShardedOptimizerWithMasters(fp16) with ShardedGradScaler and clip_grad_norm over its slices,
    the outsider's float32 gradient sync into ``main_grad``, against PyTorch's plain mixed
    precision: an fp16 copy of the model for forward and backward, AdamW over a float32 master of
    all of it, torch.amp.GradScaler, clip_grad_norm_'s rule. The first loss scale (2^30) overflows
    fp16 and backs off to 2^10: both must skip that step, and only it."""
    from masters import ShardedOptimizerWithMasters
    from sharded_gradients import ShardedGradScaler
    from sharded_norms import clip_grad_norm

    scaling = {"init_scale": 2.0**30, "backoff_factor": 2.0**-20}
    model = build(lambda: Stack(False), 100)
    opt = ShardedOptimizerWithMasters(groups(model), torch.optim.AdamW, torch.float16, lr=0.05)
    model.to(torch.float16)
    scaler = ShardedGradScaler("cpu", **scaling)
    master, half = (
        build(lambda: Stack(False), 100),
        build(lambda: Stack(False), 100).to(torch.float16),
    )
    their_opt, their_scaler = (
        torch.optim.AdamW(groups(master), lr=0.05),
        torch.amp.GradScaler("cpu", **scaling),
    )
    initial = {n: p.detach().clone() for n, p in master.named_parameters() if p.requires_grad}
    checked = 0
    for step in range(STEPS):
        for p, grad in summed_and_averaged(model, step, rank, scaler).items():
            p.main_grad = grad
        # this rank's slices of main_grad, in place; one verdict for both ranks
        scaler.unscale_(opt)
        # masters' slices
        clip_grad_norm([p for g in opt.param_groups for p in g["params"]], 0.5, [dist.group.WORLD])
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        grads = summed_and_averaged(half, step, rank, their_scaler)
        for p, hp in zip(master.parameters(), half.parameters()):
            p.grad = grads.get(hp)
        their_scaler.unscale_(their_opt)
        # as clip_grad_norm adds
        norm = sum(g.double().pow(2).sum() for g in grads.values()).sqrt().float()
        torch.nn.utils.clip_grads_with_norm_(master.parameters(), 0.5, norm)
        their_scaler.step(their_opt)
        their_scaler.update()
        their_opt.zero_grad()
        with torch.no_grad():
            for p, hp in zip(master.parameters(), half.parameters()):
                hp.copy_(p)  # the fp16 copy: the master rounded once
        names = {p: n for n, p in model.named_parameters()}
        ours = {names[p]: full for p, full in opt.gathered_masters().items()}
        theirs = {n: p.detach() for n, p in master.named_parameters() if p.requires_grad}
        checked += compare(
            problems,
            f"ShardedOptimizer fp16 vs float32 master + GradScaler step {step}",
            ours,
            theirs,
        )
        if step == 0 and any(not torch.equal(ours[n], initial[n]) for n in initial):
            problems.append("the overflowing first step was not skipped")
        for name, p in model.named_parameters():
            if p.requires_grad and not torch.equal(p, ours[name].half()):
                problems.append(f"step {step}: {name}'s fp16 copy is not its master rounded")
    if (scaler.get_scale(), their_scaler.get_scale()) != (2.0**10, 2.0**10):
        problems.append(
            f"scales {scaler.get_scale()}, {their_scaler.get_scale()}: not backed off once, alike"
        )
    if all(torch.equal(ours[n], initial[n]) for n in initial):
        problems.append("every step was skipped")
    return checked


def case_zero2_bf16(rank, problems) -> int:
    """ShardedGradientDDP + ShardedOptimizerWithMasters(bf16) against FSDP2's
    MixedPrecisionPolicy(bf16, float32)."""
    from masters import ShardedOptimizerWithMasters
    from zero2 import ShardedGradientDDP

    expected = trained_fsdp2_bf16(rank)
    ours = ShardedGradientDDP(
        build(lambda: Stack(False), 100 + rank), bucket_cap_mb=0.0002, find_unused_parameters=True
    )
    opt = ShardedOptimizerWithMasters(
        groups(ours.module),
        torch.optim.AdamW,
        torch.bfloat16,
        chunks=ours.bucket_params,
        gradient_shards=ours.gradient_shards,
        lr=0.05,
    )
    ours.module.to(torch.bfloat16)
    checked = 0
    for step in range(STEPS):
        for micro_step in range(MICRO_BATCHES):
            with ours.no_sync() if micro_step < MICRO_BATCHES - 1 else contextlib.nullcontext():
                loss_of(ours, step, micro_step, rank).backward()
        ours.finish_gradient_synchronization()
        opt.step()
        opt.zero_grad()
        names = {p: n for n, p in ours.module.named_parameters()}
        mine = {names[p]: full for p, full in opt.gathered_masters().items()}
        checked += compare(problems, f"ZeRO-2 bf16 vs FSDP2 step {step}", mine, expected[step])
    return checked


def from_folder(folder: Path) -> dict:
    """The modules loaded from ``folder``'s files."""
    return {
        name: module
        for name, module in sys.modules.items()
        if Path(getattr(module, "__file__", None) or "/").parent == folder
    }


def set_aside(folder: Path) -> dict:
    """Take ``folder`` off the path and its modules out of ``sys.modules`` (another step folder
    holds files of the same names: the next case must load its own); returns them, to be put back
    for the case's loop."""
    sys.path.remove(str(folder))
    modules = from_folder(folder)
    for name in modules:
        del sys.modules[name]
    return modules


def worker(rank: int, cases: list[str], port: int, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE, timeout=timedelta(seconds=60))
    problems, modules = {case: [] for case in cases}, {}
    for case in cases:  # imported only now, with the group already there
        folder = REPO / FOLDER[case]
        sys.path.insert(0, str(folder))
        before = set(sys.modules)
        for module in IDEA_MODULES[case]:
            importlib.import_module(module)
        # Importing an idea file must do nothing to the group: no set-up module of the trainers,
        # nothing that binds the default group (torch.distributed.nn.functional does, as a default
        # argument, when first imported).
        side_effects = {
            "distributed",
            "torch.distributed.nn",
            "torch.distributed.nn.functional",
        } & (set(sys.modules) - before)
        if side_effects:
            problems[case].append(f"importing {IDEA_MODULES[case]} imported {sorted(side_effects)}")
        modules[case] = set_aside(folder)
    checked = {}
    for case in cases:
        folder = REPO / FOLDER[case]
        sys.path.insert(0, str(folder))
        sys.modules.update(modules[case])
        checked[case] = globals()[f"case_{case}"](rank, problems[case])
        set_aside(folder)
    dist.destroy_process_group()
    # A group that something still holds is not freed:
    # its threads would run on into interpreter exit.
    left = gloo_threads()
    Path(f"{out}.rank{rank}").write_text(
        json.dumps({"problems": problems, "checked": checked, "threads left": left})
    )


def gloo_threads() -> list[str]:
    """The names of this process's gloo and store threads (Linux; elsewhere none are seen)."""
    tasks = Path("/proc/self/task")
    names = (
        [(tasks / t / "comm").read_text().strip() for t in os.listdir(tasks)]
        if tasks.is_dir()
        else []
    )
    return [n for n in names if "gloo" in n or "tcpstore" in n]


def main() -> None:
    *cases, out = sys.argv[1:]
    unknown = sorted(set(cases) - set(FOLDER))
    if not cases or unknown:
        sys.exit(
            "usage: python tests/drop_in_harness.py CASE [CASE ...] OUT.json, CASE "
            f"one of {sorted(FOLDER)}" + (f" (not {unknown})" if unknown else "")
        )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(cases, port, out), nprocs=WORLD_SIZE, join=True)
    ranks = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(WORLD_SIZE)]
    reports = {
        case: {
            "problems": [p for r in ranks for p in r["problems"][case]],
            "checked": ranks[0]["checked"][case],
        }
        for case in cases
    }
    Path(out).write_text(
        json.dumps({"cases": reports, "threads left": [r["threads left"] for r in ranks]})
    )


if __name__ == "__main__":
    main()
