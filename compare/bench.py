"""Every data-parallel strategy on one workload, in one torchrun job, interleaved: step time, memory
per rank and communication per optimiser step, ours next to PyTorch's.

    torchrun --standalone --nproc_per_node=2 compare/bench.py   # every row: minutes on 2 cores
    torchrun --standalone --nproc_per_node=2 compare/bench.py --strategies ddp,bucketed,naive
    torchrun --standalone --nproc_per_node=2 compare/bench.py --rounds 9 --steps-per-round 10 \\
        --bucket-cap-mb 0.25

Rows (``--strategies`` takes the keys or the names, comma-separated; default: all available). A row
whose module is missing or unfinished is left out with a one-line note; a row's counterpart and
PyTorch DDP are added when the row is asked for without them (they are what its ratios divide by),
and so are the counterpart's own
(``zero3-no-prefetch`` brings ``zero3``, which brings its FSDP2 row).

    key                name                          counterpart
                       what runs
    ddp                pytorch DDP                   -
                       DistributedDataParallel + AdamW
    bucketed           BucketedDDP (step 4)          pytorch DDP
                       step4_hooks_bucketing/bucketed_ddp.py + AdamW
    naive              naive (step 3)                pytorch DDP
                       step3_naive_dp/naive_dp.py + AdamW
    torch-zero1        pytorch ZeRO-1                -
                       DDP + ZeroRedundancyOptimizer(AdamW)
    zero1              ZeRO-1 (step 5)               pytorch ZeRO-1
                       BucketedDDP + step5_zero1/zero1.py
                         ShardedOptimizer(AdamW)
    zero1-bf16         ZeRO-1 bf16 (step 5)          ZeRO-1 (step 5)
                       the same with param_dtype=torch.bfloat16: bf16
                         parameters, float32 masters of the slices (counted
                         in optimizer_state)
    torch-fsdp2        pytorch FSDP2 ZeRO-2          -
                       fully_shard(each block, then the root,
                         reshard_after_forward=False) + AdamW
    zero2              ZeRO-2 (step 6)               pytorch FSDP2 ZeRO-2
                       step6_zero2/zero2.py ShardedGradientDDP +
                         ShardedOptimizer(AdamW) over its buckets
    torch-fsdp2-zero3  pytorch FSDP2 ZeRO-3          -
                       fully_shard(each block, reshard_after_forward=True),
                         then the root (default: kept gathered for backward)
                         + AdamW
    zero3              ZeRO-3 (step 7)               pytorch FSDP2 ZeRO-3
                       step7_zero3/zero3.py FullyShardedDP over the blocks,
                         built on the meta device as step7_zero3/train.py
                         builds it; a plain AdamW over this rank's pieces
    zero3-no-prefetch  ZeRO-3 no prefetch (step 7)   ZeRO-3 (step 7)
                       the same with prefetch=False: each unit gathered only
                         when it is needed
    zero3-offload      ZeRO-3 offload (step 7)       ZeRO-3 (step 7)
                       the same with step7_zero3/offload.py's
                         OffloadedOptimizer: AdamW on host copies
    torch-tp           pytorch TP                    -
                       compare/tp_reference.py's parallelize():
                         parallelize_module (Colwise/Rowwise) + loss_parallel
                         + AdamW
    tp                 tensor parallel (step 8)      pytorch TP
                       step8_tensor_parallel/tensor_parallel.py
                         parallelize_gpt2 + vocab_parallel_cross_entropy +
                         AdamW
    torch-pp-gpipe     pytorch pipelining GPipe      -
                       torch.distributed.pipelining PipelineStage +
                         ScheduleGPipe (scale_grads=False, loss / M) on step
                         9's GPT2Stage + AdamW
    pp-gpipe           pipeline GPipe (step 9)       pytorch pipelining GPipe
                       step9_pipeline_parallel/pipeline.py
                         Pipeline(schedule="gpipe") + AdamW
    torch-pp-1f1b      pytorch pipelining 1F1B       -
                       the same with Schedule1F1B
    pp-1f1b            pipeline 1F1B (step 9)        pytorch pipelining 1F1B
                       Pipeline(schedule="1f1b")
    torch-moe-ddp      pytorch DDP (MoE)             -
                       the MoE model (--moe-experts, default 4 here;
                         common/moe.py), every expert on every rank, under
                         DDP + AdamW
    moe-ep1            MoE ep 1 (step 12)            pytorch DDP (MoE)
                       the same model, step 12's reduce_gradients at --ep 1
                         (no all-to-all)
    ep                 expert parallel (step 12)     MoE ep 1 (step 12)
                       step12_expert_parallel/expert_parallel.py at --ep =
                         world size: E/W experts a rank, all-to-all dispatch
                         and combine

The tensor-parallel rows split the model, not the batch: their ranks share every micro-batch, so an
optimiser step runs accumulation x world size micro-batches (the same on every rank), the tokens per
step of the data-parallel rows; their ``vs DDP`` is TP against data parallelism on as many ranks.

The pipeline rows split the model into world-size stages (one per rank: step 9's ``GPT2Stage``),
which together are one replica: an optimiser step pushes accumulation x world size micro-batches
through the pipeline, the tokens per step of the data-parallel rows. PyTorch's schedules know
nothing of GPT-2's tied embedding: their first and last stage add each other's accumulated half once
per step (one exchange, as Megatron-LM does; not bitwise), where ours adds each micro-batch's halves
in one process's order (one message per micro-batch, and the sum sent back once). The default model
has 2 blocks: 2 ranks at most (--n-layer for more).

The MoE rows train the MoE model (``--moe-*`` as in steps 0 and 12; dropless top-2 of 4 by default):
their ``vs pytorch DDP`` is what the experts cost against the dense model, and the ``ep`` row's
counterpart is the same model and code at ep 1, so its ratio is expert parallelism's effect alone:
the all-to-alls in, the experts' all-reduce out (an expert's gradient is whole on its one rank).

The no-prefetch row's counterpart is our own prefetching row, so its ``vs counterpart`` ratio is
the prefetch's effect alone (above 1.0: gathering on demand was faster).

Method. Every row builds the default GPT-2 (same weights: ZeRO-3 fills its shards from the same
``initial_value``) and trains it on the same random tokens (vocabulary 2,048; micro-batch x
accumulation from the flags; ``no_sync`` on all but the last micro-batch); float32, no clipping,
no LR schedule: what differs between rows is the synchronisation and the optimiser. Each round
runs every row for ``--steps-per-round`` optimiser steps, in an order that rotates by one each
round (no row always first or always after the same neighbour), between barriers; round 0 is a
warm-up and is not timed. Reported, on rank 0:

- median optimiser-step time over the rounds (rank 0's clock) with min and max, and tokens/s;
- ``vs counterpart`` = counterpart's median time / the row's (above 1.0: the row is faster), and
  the same ratio taken round by round (the two ran in the same round, so a slow phase of the
  machine hits both), as median [min, max]; ``vs DDP`` the same against PyTorch DDP;
- bytes per rank, measured on every rank in the last warm-up step and gathered: parameters
  (ZeRO-3: this rank's shard of every unit, padding included), gradients right after the sync
  point (before zero_grad; ZeRO-2 and ZeRO-3: the gradient shards) and optimiser state (after the
  step). Local shards only, for DTensors. Communication buffers (DDP's and BucketedDDP's buckets)
  and ZeRO-3's gathered units (held only while a unit computes) are not counted, as in the
  trainers' records;
- bytes per optimiser step handed to each kind of collective, per rank: our rows count them
  (``count_collective``, in the last warm-up step); PyTorch's rows show analytic figures (DDP:
  all-reduce = gradient bytes; ZeroRedundancyOptimizer adds a broadcast of every parameter;
  FSDP2 ZeRO-2: an all-gather of every parameter per micro-batch (the parameters are resharded
  after each backward) and one reduce-scatter of the gradients; FSDP2 ZeRO-3: per micro-batch,
  every parameter for forward and the blocks again for backward (the root stays gathered), and
  one reduce-scatter; each counted as the whole gathered or scattered buffer, padding included).

Output: the tables on rank 0, a PNG (``--png``) with the time ratios and the per-rank memory, and
the same numbers as JSON beside it. CPU and gloo only; one thread per rank.
"""

import argparse
import contextlib
import gc
import importlib
import json
import math
import os
import statistics
import sys
import time
import weakref
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

REPO_ROOT = Path(__file__).resolve().parent.parent
# The shared modules come from common/ (the masters of the step folders' verbatim copies); each
# step's own module from its folder. Where a name exists in two folders the first listed wins:
# bucketed_ddp.py is step 4's (steps 5 and 6 hold copies), zero1.py step 5's (step 6 holds a copy).
# One `comm_accounting` module is loaded, so every step module adds to the same comm_bytes counter.
FOLDERS = (
    "common",
    "step4_hooks_bucketing",
    "step3_naive_dp",
    "step5_zero1",
    "step6_zero2",
    "step7_zero3",
    "step8_tensor_parallel",
    "step9_pipeline_parallel",
    "step12_expert_parallel",
)
sys.path[:0] = [str(REPO_ROOT / folder) for folder in FOLDERS]
import comm_accounting  # noqa: E402
import distributed  # noqa: E402
import training  # noqa: E402
from bucketed_ddp import BucketedDDP  # noqa: E402
from config import UserError, build_parser, exit_on_user_error, parse_config  # noqa: E402
from model import GPT2, build_model, gpt2_config, initial_value, language_model_loss  # noqa: E402
from moe_setup import add_moe_flags, check_moe, moe_layers, moe_model, with_aux_loss  # noqa: E402
from naive_dp import allreduce_gradients, broadcast_parameters  # noqa: E402
from seeding import seed_everything  # noqa: E402
from training import adamw_options, adamw_param_groups  # noqa: E402

VOCAB_SIZE = 2048  # the tokenizer's; the tokens are random, so the corpus is not read
MEMORY_KINDS = ("params", "grads", "optimizer_state")
# Trainer flags of the shared parser that a benchmark
# does not use (no corpus, checkpoint, schedule, clipping)
UNUSED_FLAGS = {
    "steps",
    "out",
    "save_every",
    "preempt_grace_s",
    "resume",
    "quiet",
    "data",
    "tokenizer",
    "min_lr",
    "warmup_steps",
    "grad_clip",
}


def optional_module(name: str, folder: str, needs: tuple[str, ...]):
    """``(module, None)``, or ``(None, why)`` when ``folder/name.py`` is missing, does not import,
    or lacks one of ``needs``. Files still being written may fail in any way: the row goes, not
    the run."""
    path = REPO_ROOT / folder / f"{name}.py"
    if not path.is_file():
        return None, f"{folder}/{name}.py does not exist yet"
    try:
        module = importlib.import_module(name)
    except Exception as error:  # noqa: BLE001 (any failure of an unfinished file leaves the row out)
        return (
            None,
            f"{folder}/{name}.py does not import: {type(error).__name__}: "
            f"{str(error).splitlines()[0]}",
        )
    if Path(module.__file__).resolve() != path.resolve():
        return None, f"'import {name}' found {module.__file__}, not {folder}/{name}.py"
    missing = [n for n in needs if not hasattr(module, n)]
    if missing:
        empty = " (an empty placeholder)" if path.stat().st_size == 0 else ""
        return None, f"{folder}/{name}.py{empty} defines no {', '.join(missing)}"
    return module, None


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part: a DTensor's local shard, any other tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def local_bytes(tensors) -> int:
    if torch.is_tensor(tensors):
        tensors = [tensors]
    return sum(local(t).numel() * local(t).element_size() for t in tensors if t is not None)


def state_bytes(state) -> int:
    return local_bytes(
        v for per_param in state.values() for v in per_param.values() if torch.is_tensor(v)
    )


# ---- the strategies ------------------------------------------------------------------------------


class Strategy:
    """One row: a model, its data-parallel wrapper and optimiser, and how one optimiser step runs.

    Subclasses set ``wrap`` and ``make_optimizer``; the defaults are what most rows share."""

    key = name = ""
    counterpart = None  # the PyTorch row this one is measured against (ours only)
    pytorch = False  # PyTorch's rows get analytic comm bytes; ours count them
    module_needed = None  # (module, folder, names) a row needs beyond what always exists

    def __init__(self, config: dict):
        self.config = config
        self.model = self.build()
        self.total_bytes = local_bytes(self.model.parameters())  # before sharding: the whole model
        self.wrapped = self.wrap(self.model)
        self.optimizer = self.make_optimizer()

    @classmethod
    def unavailable(cls):
        """None when this row can run here, else one line saying why not."""
        if cls.module_needed is None:
            return None
        return optional_module(*cls.module_needed)[1]

    def build(self):
        return build_model(self.config, VOCAB_SIZE, self.config["seed"])

    def wrap(self, model):
        return model

    def make_optimizer(self):
        return torch.optim.AdamW(
            adamw_param_groups(self.model.named_parameters(), self.config),
            **adamw_options(self.config),
        )

    def loss(self, inputs, targets):
        return language_model_loss(self.wrapped, inputs, targets)

    def own_batches(self, batches: list) -> list:
        """The micro-batches of one optimiser step on this rank
        (the tensor-parallel rows share theirs)."""
        return batches

    def micro_batch(self, syncing: bool):
        """The context of one micro-batch's forward and backward:
        no communication unless ``syncing``."""
        no_sync = getattr(self.wrapped, "no_sync", None)
        return no_sync() if (no_sync and not syncing) else contextlib.nullcontext()

    def synchronize(self):
        """The sync point after the last backward (DDP and FSDP2 sync inside backward)."""

    def gradients(self):
        return [p.grad for p in self.model.parameters()]

    def held_parameters(self):
        return self.model.parameters()

    def optimizer_state(self) -> int:
        return state_bytes(self.optimizer.state)

    def analytic_comm(self) -> dict:
        raise NotImplementedError

    def forward_backward(self, batches: list) -> None:
        """The micro-batches of one optimiser step, forward and backward, up to the sync point."""
        accum = len(batches)
        for micro, (inputs, targets) in enumerate(batches):
            with self.micro_batch(syncing=micro == accum - 1):
                (self.loss(inputs, targets) / accum).backward()
        self.synchronize()

    def step(self, batches: list, probe: dict | None = None) -> None:
        self.forward_backward(self.own_batches(batches))
        if probe is not None:
            probe["grads"] = local_bytes(self.gradients())
        self.optimizer.step()
        if probe is not None:
            probe["params"] = local_bytes(self.held_parameters())
            probe["optimizer_state"] = self.optimizer_state()
        self.optimizer.zero_grad(set_to_none=True)


class TorchDDP(Strategy):
    key, name, pytorch = "ddp", "pytorch DDP", True

    def wrap(self, model):
        return torch.nn.parallel.DistributedDataParallel(
            model, bucket_cap_mb=self.config["bucket_cap_mb"]
        )

    def analytic_comm(self):
        return {"all_reduce": self.total_bytes}


class Bucketed(Strategy):
    key, name, counterpart = "bucketed", "BucketedDDP (step 4)", "pytorch DDP"

    def wrap(self, model):
        return BucketedDDP(model, bucket_cap_mb=self.config["bucket_cap_mb"])

    def synchronize(self):
        self.wrapped.finish_gradient_synchronization()


class Naive(Strategy):
    key, name, counterpart = "naive", "naive (step 3)", "pytorch DDP"

    def wrap(self, model):
        broadcast_parameters(model)
        return model

    def synchronize(self):
        allreduce_gradients(self.model)


class TorchZero1(TorchDDP):
    key, name = "torch-zero1", "pytorch ZeRO-1"

    def make_optimizer(self):
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(
            adamw_param_groups(self.model.named_parameters(), self.config),
            optimizer_class=torch.optim.AdamW,
            **adamw_options(self.config),
        )

    def optimizer_state(self):
        # the local AdamW's; the wrapper's own .state stays empty
        return state_bytes(self.optimizer.optim.state)

    def analytic_comm(self):
        # After its slice's update, every rank broadcasts the parameters it owns: every rank takes
        # part in a broadcast of every parameter.
        return {"all_reduce": self.total_bytes, "broadcast": self.total_bytes}


class Zero1(Bucketed):
    key, name, counterpart = "zero1", "ZeRO-1 (step 5)", "pytorch ZeRO-1"
    module_needed = ("zero1", "step5_zero1", ("ShardedOptimizer",))

    def make_optimizer(self):
        zero1 = importlib.import_module("zero1")
        return zero1.ShardedOptimizer(
            adamw_param_groups(self.model.named_parameters(), self.config),
            torch.optim.AdamW,
            **adamw_options(self.config),
        )


class Zero1Bf16(Zero1):
    """Step 5 with --param-dtype bf16: bf16 parameters, forward and backward, and all-gathers;
    float32 masters of this rank's slices; the gradient reduced in float32 into ``main_grad``.
    Measured against its float32 self."""

    key, name, counterpart = "zero1-bf16", "ZeRO-1 bf16 (step 5)", "ZeRO-1 (step 5)"
    module_needed = ("masters", "step5_zero1", ("ShardedOptimizerWithMasters",))

    # step 5's BucketedDDP for 16-bit parameters: their gradients summed in float32
    def wrap(self, model):
        return importlib.import_module("main_grad").MainGradDDP(
            model, bucket_cap_mb=self.config["bucket_cap_mb"]
        )

    def make_optimizer(self):
        masters = importlib.import_module("masters")
        return masters.ShardedOptimizerWithMasters(
            adamw_param_groups(self.model.named_parameters(), self.config),
            torch.optim.AdamW,
            torch.bfloat16,
            **adamw_options(self.config),
        )

    def gradients(self):
        return [p.main_grad for p in self.model.parameters()]  # the float32 reduced gradient, whole

    def optimizer_state(self):
        # the moments and the masters
        return state_bytes(self.optimizer.state) + local_bytes(self.optimizer.views)


def padded_bytes(params, world_size: int) -> int:
    """What FSDP2 moves for ``params``:
    every parameter's dim 0 padded to a multiple of the world size."""
    return sum(
        -(-p.shape[0] // world_size) * world_size * math.prod(p.shape[1:]) * p.element_size()
        for p in params
    )


class TorchFSDP2(Strategy):
    key, name, pytorch = "torch-fsdp2", "pytorch FSDP2 ZeRO-2", True
    reshard_after_forward = root_reshard_after_forward = False

    @classmethod
    def unavailable(cls):
        try:
            from torch.distributed.fsdp import fully_shard  # noqa: F401
        except ImportError as error:
            return f"torch {torch.__version__} has no torch.distributed.fsdp.fully_shard ({error})"
        return None

    def wrap(self, model):
        from torch.distributed.fsdp import fully_shard

        world_size = dist.get_world_size()
        self.padded_bytes = padded_bytes(model.parameters(), world_size)  # what goes over the wire
        self.padded_block_bytes = sum(
            padded_bytes(block.parameters(), world_size) for block in model.transformer.h
        )
        for block in model.transformer.h:
            fully_shard(block, reshard_after_forward=self.reshard_after_forward)
        fully_shard(model, reshard_after_forward=self.root_reshard_after_forward)
        return model

    def micro_batch(self, syncing):
        self.model.set_requires_gradient_sync(syncing)
        return contextlib.nullcontext()

    def analytic_comm(self):
        accum = self.config["grad_accum"]
        return {"all_gather": accum * self.padded_bytes, "reduce_scatter": self.padded_bytes}


class Zero2(Strategy):
    key, name, counterpart = "zero2", "ZeRO-2 (step 6)", "pytorch FSDP2 ZeRO-2"

    @classmethod
    def unavailable(cls):
        reasons = [
            optional_module("zero2", "step6_zero2", ("ShardedGradientDDP",))[1],
            optional_module("zero1", "step5_zero1", ("ShardedOptimizer",))[1],
        ]
        return "; ".join(r for r in reasons if r) or None

    def wrap(self, model):
        zero2 = importlib.import_module("zero2")
        return zero2.ShardedGradientDDP(model, bucket_cap_mb=self.config["bucket_cap_mb"])

    def make_optimizer(self):
        zero1 = importlib.import_module("zero1")
        return zero1.ShardedOptimizer(
            adamw_param_groups(self.model.named_parameters(), self.config),
            torch.optim.AdamW,
            chunks=self.wrapped.bucket_params,
            gradient_shards=self.wrapped.gradient_shards,
            **adamw_options(self.config),
        )

    def synchronize(self):
        self.wrapped.finish_gradient_synchronization()

    def gradients(self):
        return self.wrapped.gradient_shards


class TorchFSDP2Zero3(TorchFSDP2):
    key, name = "torch-fsdp2-zero3", "pytorch FSDP2 ZeRO-3"
    reshard_after_forward = True  # the blocks
    # FSDP2's default for the root: kept gathered from forward to backward
    root_reshard_after_forward = None

    def analytic_comm(self):
        # Per micro-batch: every parameter gathered for forward, the blocks again for backward (the
        # root stays gathered); one reduce-scatter per optimiser step (no_sync
        # accumulates unsharded).
        accum = self.config["grad_accum"]
        return {
            "all_gather": accum * (self.padded_bytes + self.padded_block_bytes),
            "reduce_scatter": self.padded_bytes,
        }


class Zero3(Strategy):
    key, name, counterpart = "zero3", "ZeRO-3 (step 7)", "pytorch FSDP2 ZeRO-3"
    module_needed = ("zero3", "step7_zero3", ("FullyShardedDP",))
    prefetch = True

    def build(self):
        # As step7_zero3/train.py builds it: shapes only, on the meta device; FullyShardedDP fills
        # each rank's slices from initial_value, so the weights are every other row's.
        with torch.device("meta"):
            return GPT2(gpt2_config(self.config, VOCAB_SIZE))

    def wrap(self, model):
        zero3 = importlib.import_module("zero3")
        seed, n_layer = self.config["seed"], self.config["n_layer"]
        return zero3.FullyShardedDP(
            model,
            model.transformer.h,
            init_fn=lambda name, shape: initial_value(name, shape, seed, n_layer),
            device="cpu",
            prefetch=self.prefetch,
        )

    # make_optimizer: the default, a plain AdamW over model.named_parameters(): this rank's pieces

    def synchronize(self):
        self.wrapped.finish_gradient_synchronization()

    def gradients(self):
        return self.wrapped.gradient_shards

    def held_parameters(self):
        return self.wrapped.parameter_shards  # the pieces are views of these, padding included


class Zero3NoPrefetch(Zero3):
    key, name, counterpart = "zero3-no-prefetch", "ZeRO-3 no prefetch (step 7)", "ZeRO-3 (step 7)"
    prefetch = False


class Zero3Offload(Zero3):
    """step7_zero3/offload.py: AdamW on host copies of the pieces. On a CPU the host is the device:
    the row measures what the moves cost (gradients out, parameters back), not what they save."""

    key, name, counterpart = "zero3-offload", "ZeRO-3 offload (step 7)", "ZeRO-3 (step 7)"
    module_needed = ("offload", "step7_zero3", ("OffloadedOptimizer",))

    def make_optimizer(self):  # the AdamW every row steps, built on the host copies
        offload = importlib.import_module("offload")
        return offload.OffloadedOptimizer(
            self.model.named_parameters(), lambda named: training.make_optimizer(named, self.config)
        )


class TorchTensorParallel(Strategy):
    key, name, pytorch = "torch-tp", "pytorch TP", True

    def build(self):
        from torch.distributed.device_mesh import init_device_mesh

        import tp_reference

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        return tp_reference.parallelize(
            build_model(self.config, VOCAB_SIZE, self.config["seed"]), mesh
        )

    def own_batches(self, batches):
        """accumulation x world size micro-batches,
        the same on every rank: the data-parallel rows' tokens."""
        generator = torch.Generator().manual_seed(0)
        n = len(batches) * dist.get_world_size()
        blocks = [
            torch.randint(
                0,
                VOCAB_SIZE,
                (batches[0][0].shape[0], batches[0][0].shape[1] + 1),
                generator=generator,
            )
            for _ in range(n)
        ]
        return [(block[:, :-1], block[:, 1:]) for block in blocks]

    def micro_batch(self, syncing):
        from torch.distributed.tensor.parallel import loss_parallel

        # cross-entropy on the vocabulary-sharded logits, forward and backward
        return loss_parallel()

    def loss(self, inputs, targets):
        logits = self.wrapped(inputs)
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    def analytic_comm(self):
        """Step 8's formula (its README): per micro-batch (6 n_layer + 2) all-reduces of b x s x h
        floats and the loss's 3 x b x s; accumulation x world size micro-batches per step."""
        c = self.config
        b, s, h = c["micro_batch_size"], c["seq_len"], c["n_embd"]
        per_micro_batch = ((6 * c["n_layer"] + 2) * b * s * h + 3 * b * s) * 4
        return {"all_reduce": per_micro_batch * c["grad_accum"] * dist.get_world_size()}


class TensorParallel(TorchTensorParallel):
    key, name, pytorch, counterpart = "tp", "tensor parallel (step 8)", False, "pytorch TP"
    module_needed = (
        "tensor_parallel",
        "step8_tensor_parallel",
        ("parallelize_gpt2",),
    )

    def build(self):
        tensor_parallel = importlib.import_module("tensor_parallel")
        return tensor_parallel.parallelize_gpt2(
            build_model(self.config, VOCAB_SIZE, self.config["seed"])
        )

    def micro_batch(self, syncing):
        return contextlib.nullcontext()

    def loss(self, inputs, targets):
        vocab_parallel = importlib.import_module("vocab_parallel")
        logits = self.wrapped(inputs)  # this rank's vocabulary slice
        return vocab_parallel.vocab_parallel_cross_entropy(
            logits.float().flatten(0, 1), targets.flatten()
        )


class TorchPipelineGPipe(TorchTensorParallel):
    """PyTorch's ``PipelineStage`` and schedule on step 9's ``GPT2Stage`` of this rank."""

    key, name, pytorch = "torch-pp-gpipe", "pytorch pipelining GPipe", True
    schedule = "gpipe"
    module_needed = ("pipeline_stages", "step9_pipeline_parallel", ("GPT2Stage",))

    @classmethod
    def unavailable(cls):
        why = optional_module(*cls.module_needed)[1]
        world_size = int(os.environ.get("WORLD_SIZE", 1))
        if why is None and world_size < 2:
            why = "a pipeline needs at least 2 ranks (one stage each)"
        return why

    def build(self):
        pipeline_stages = importlib.import_module("pipeline_stages")
        rank, stages = dist.get_rank(), dist.get_world_size()
        if stages > self.config["n_layer"]:
            raise ValueError(
                f"{stages} stages but {self.config['n_layer']} blocks: run with --n-layer {stages}"
            )
        stage = pipeline_stages.GPT2Stage(
            build_model(self.config, VOCAB_SIZE, self.config["seed"]), rank, stages
        )
        self.first, self.last, self.tied = stage.is_first, stage.is_last, stage.tied_parameter
        return stage

    def wrap(self, model):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        self.micro_batches = self.config["grad_accum"] * dist.get_world_size()
        schedule = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[self.schedule]
        stage = PipelineStage(model, dist.get_rank(), dist.get_world_size(), torch.device("cpu"))
        m = self.micro_batches
        return schedule(
            stage, m, loss_fn=lambda out, y: self.cross_entropy(out, y) / m, scale_grads=False
        )

    @staticmethod
    def cross_entropy(logits, targets):
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    def make_optimizer(self):
        named = [
            ("transformer.wte.weight" if p is self.tied else n, p)
            for n, p in self.model.named_parameters()
        ]
        return torch.optim.AdamW(
            adamw_param_groups(named, self.config), **adamw_options(self.config)
        )

    def forward_backward(self, batches):
        inputs, targets = (torch.cat(part) for part in zip(*batches))
        self.wrapped.step(
            *([inputs] if self.first else []), **({"target": targets} if self.last else {})
        )
        if self.tied is not None:  # first <-> last: each adds the other's accumulated half
            other, peer = (
                torch.empty_like(self.tied.grad),
                dist.get_world_size() - 1 if self.first else 0,
            )
            for work in (dist.isend(self.tied.grad, peer), dist.irecv(other, peer)):
                work.wait()
            self.tied.grad = self.tied.grad + other if self.first else other + self.tied.grad

    def analytic_comm(self):
        """Per micro-batch b x s x h floats to the next stage and as many back to the previous one;
        the tied embedding's accumulated half once per step, each way between the first and the
        last stage."""
        c = self.config
        activation = c["micro_batch_size"] * c["seq_len"] * c["n_embd"] * 4 * self.micro_batches
        comm = {
            "p2p activations": 0 if self.last else activation,
            "p2p activation gradients": 0 if self.first else activation,
        }
        if self.tied is not None:
            comm["p2p tied-parameter gradient"] = local_bytes(self.tied)
        return comm


class PipelineGPipe(TorchPipelineGPipe):
    key, name, pytorch, counterpart = (
        "pp-gpipe",
        "pipeline GPipe (step 9)",
        False,
        "pytorch pipelining GPipe",
    )

    @classmethod
    def unavailable(cls):  # the stages (as PyTorch's row), and the Pipeline that runs them
        return (
            super().unavailable()
            or optional_module("pipeline", "step9_pipeline_parallel", ("Pipeline",))[1]
        )

    def wrap(self, model):
        pipeline = importlib.import_module("pipeline")
        self.micro_batches = self.config["grad_accum"] * dist.get_world_size()
        c = self.config
        return pipeline.Pipeline(
            model,
            dist.get_rank(),
            dist.get_world_size(),
            (c["micro_batch_size"], c["seq_len"], c["n_embd"]),
            loss_fn=self.cross_entropy,
            tied_parameter=self.tied,
            schedule=self.schedule,
        )

    def forward_backward(self, batches):
        inputs, targets = zip(*batches)
        self.wrapped.run(len(batches), list(inputs), list(targets), loss_scale=len(batches))
        self.wrapped.finish_gradient_synchronization()


class TorchPipeline1F1B(TorchPipelineGPipe):
    key, name, schedule = "torch-pp-1f1b", "pytorch pipelining 1F1B", "1f1b"


class Pipeline1F1B(PipelineGPipe):
    key, name, schedule, counterpart = (
        "pp-1f1b",
        "pipeline 1F1B (step 9)",
        "1f1b",
        "pytorch pipelining 1F1B",
    )


# ---- the mixture of experts: the same MoE model with its experts replicated, then split ----------


class MoEModel(Strategy):
    """The MoE model (``--moe-experts``,
    4 by default here) and its loss, + a * the load-balancing loss."""

    def build(self):
        if not self.config["moe_experts"]:
            raise ValueError("--moe-experts 0 builds no experts: give E > 0 for the MoE rows")
        return moe_model(super().build(), self.config)

    def loss(self, inputs, targets):
        return with_aux_loss(self.model, super().loss(inputs, targets), self.config)


class TorchDDPMoE(MoEModel, TorchDDP):
    """Every expert on every rank, under DDP."""

    key, name = "torch-moe-ddp", "pytorch DDP (MoE)"


class MoEReplicated(MoEModel):
    """Step 12 at ``--ep 1``: the MoE model whole on every rank, its gradients all-reduced over the
    world in one flat buffer after backward (expert_parallel.reduce_gradients): the same model and
    code as the next row, without expert parallelism."""

    key, name, counterpart = "moe-ep1", "MoE ep 1 (step 12)", "pytorch DDP (MoE)"
    module_needed = (
        "expert_parallel",
        "step12_expert_parallel",
        ("Groups", "shard_experts", "reduce_gradients"),
    )
    ep = 1

    def wrap(self, model):
        import expert_parallel

        ep, experts = self.ep or dist.get_world_size(), self.config["moe_experts"]
        if experts % ep:
            raise ValueError(
                f"--moe-experts {experts} is not divisible by {ep} ranks: give a multiple"
            )
        self.reduce = expert_parallel.reduce_gradients
        self.groups = expert_parallel.Groups(ep)
        self.dispatchers = []
        if self.groups.ep_size > 1:
            self.dispatchers = expert_parallel.shard_experts(model, moe_layers(model), self.groups)
        return model

    def synchronize(self):
        self.reduce(self.model, self.groups)
        for dispatcher in self.dispatchers:  # the per-micro-batch notes the trainer logs
            dispatcher.traffic.clear()


class ExpertParallelRow(MoEReplicated):
    """Step 12 at ``--ep`` = the world size: each rank keeps E/W experts; two all-to-alls per MoE
    layer and micro-batch each way; an expert's gradient is already whole on its one rank."""

    key, name, counterpart = "ep", "expert parallel (step 12)", "MoE ep 1 (step 12)"
    ep = None  # the world size


STRATEGIES = (
    TorchDDP,
    Bucketed,
    Naive,
    TorchZero1,
    Zero1,
    Zero1Bf16,
    TorchFSDP2,
    Zero2,
    TorchFSDP2Zero3,
    Zero3,
    Zero3NoPrefetch,
    Zero3Offload,
    TorchTensorParallel,
    TensorParallel,
    TorchPipelineGPipe,
    PipelineGPipe,
    TorchPipeline1F1B,
    Pipeline1F1B,
    TorchDDPMoE,
    MoEReplicated,
    ExpertParallelRow,
)
BY_NAME = {s.name: s for s in STRATEGIES}


def choose(requested: str | None) -> tuple[list, list[str]]:
    """The rows to run, in the table's order, and one note per row left out or added."""
    lookup = {k.lower(): s for s in STRATEGIES for k in (s.key, s.name)}
    if requested is None:
        wanted = list(STRATEGIES)
    else:
        wanted = []
        for item in filter(None, (i.strip() for i in requested.split(","))):
            if item.lower() not in lookup:
                raise UserError(
                    f"--strategies: unknown '{item}'; choose from "
                    f"{', '.join(s.key for s in STRATEGIES)} (or their names)"
                )
            wanted.append(lookup[item.lower()])
    notes, chosen, queue = [], set(), list(wanted)
    # a reference added brings its own (no prefetch -> ZeRO-3 (step 7) -> FSDP2 ZeRO-3)
    while queue:
        strategy = queue.pop(0)
        why = strategy.unavailable()
        if why:
            notes.append(f"{strategy.name}: left out: {why}")
            continue
        chosen.add(strategy)
        for reference in (BY_NAME.get(strategy.counterpart), TorchDDP):
            if (
                reference
                and reference not in chosen
                and reference not in queue
                and reference not in wanted
                and not reference.unavailable()
            ):
                queue.append(reference)
                notes.append(f"{reference.name}: added as the reference of {strategy.name}")
    if step6_copy_differs():
        notes.append(
            "step6_zero2/zero1.py differs from step5_zero1/zero1.py (run common/sync_copies.py): "
            "ZeRO-2 (step 6) runs step 5's"
        )
    return [s for s in STRATEGIES if s in chosen], notes


def step6_copy_differs() -> bool:
    a, b = REPO_ROOT / "step5_zero1" / "zero1.py", REPO_ROOT / "step6_zero2" / "zero1.py"
    return a.is_file() and b.is_file() and a.read_bytes() != b.read_bytes()


# ---- measuring -----------------------------------------------------------------------------------


def measure(
    strategies: list, config: dict, rounds: int, steps_per_round: int, rank: int
) -> tuple[dict, dict]:
    """Seconds per optimiser step of each row (one entry per timed round), and this rank's probe of
    each row (bytes held, bytes per collective) from the last warm-up step."""
    accum, micro, seq_len = config["grad_accum"], config["micro_batch_size"], config["seq_len"]
    generator = torch.Generator().manual_seed(rank)
    tokens = [
        torch.randint(0, VOCAB_SIZE, (micro, seq_len + 1), generator=generator)
        for _ in range(accum)
    ]
    batches = [(block[:, :-1], block[:, 1:]) for block in tokens]
    times = {s.name: [] for s in strategies}
    probes = {s.name: {} for s in strategies}
    for round_ in range(rounds + 1):
        shift = round_ % len(strategies)
        for strategy in strategies[shift:] + strategies[:shift]:
            dist.barrier()
            started = time.perf_counter()
            for i in range(steps_per_round):
                # the last warm-up step: steady state, not timed
                if round_ == 0 and i == steps_per_round - 1:
                    # drop what construction and earlier steps sent
                    comm_accounting.take_comm_bytes()
                    strategy.step(batches, probes[strategy.name])
                    probes[strategy.name]["comm"] = comm_accounting.take_comm_bytes()
                else:
                    strategy.step(batches)
            dist.barrier()
            if round_ > 0:
                times[strategy.name].append((time.perf_counter() - started) / steps_per_round)
    for strategy in strategies:
        if strategy.pytorch:
            probes[strategy.name]["comm"] = strategy.analytic_comm()
    return times, probes


def build(classes: list, config: dict) -> tuple[list, list[str]]:
    """Build every row;
    a row that fails to build on any rank is left out on every rank, with a note."""
    built, notes = [], []
    for cls in classes:
        try:
            strategy, error = cls(config), None
        except Exception as exc:  # noqa: BLE001 (an unfinished module may fail in any way)
            strategy, error = (
                None,
                f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
            )
        errors = distributed.gather_from_every_rank(error)
        if any(errors):
            first = next((r, e) for r, e in enumerate(errors) if e)
            notes.append(f"{cls.name}: left out: building it failed on rank {first[0]}: {first[1]}")
            del strategy
            continue
        built.append(strategy)
    return built, notes


# ---- reporting -----------------------------------------------------------------------------------


def ratio(reference: list, mine: list) -> dict:
    """Reference time / mine: of the medians, and round by round (median, min, max)."""
    paired = [r / m for r, m in zip(reference, mine)]
    return {
        "median_ratio": statistics.median(reference) / statistics.median(mine),
        "paired_median": statistics.median(paired),
        "paired_min": min(paired),
        "paired_max": max(paired),
    }


def summarise(strategies: list, times: dict, everyone: list, config: dict, world_size: int) -> dict:
    tokens = config["micro_batch_size"] * config["grad_accum"] * config["seq_len"] * world_size
    rows = {}
    for s in strategies:
        t = times[s.name]
        row = {
            "median_s": statistics.median(t),
            "min_s": min(t),
            "max_s": max(t),
            "times_s": t,
            "tokens_per_s": tokens / statistics.median(t),
            "counterpart": s.counterpart,
            "comm_source": "analytic" if s.pytorch else "counted",
            "memory": {k: [probe[s.name][k] for probe in everyone] for k in MEMORY_KINDS},
            "comm": [probe[s.name]["comm"] for probe in everyone],
        }
        if s.counterpart in times:
            row["vs_counterpart"] = ratio(times[s.counterpart], t)
        if "pytorch DDP" in times:
            row["vs_ddp"] = ratio(times["pytorch DDP"], t)
        rows[s.name] = row
    return {"tokens_per_step": tokens, "model_bytes": strategies[0].total_bytes, "rows": rows}


def per_rank(values: list) -> str:
    if len(set(values)) == 1:
        return f"{values[0]:,}" + (" (each)" if len(values) > 1 else "")
    if len(values) <= 4:
        return " / ".join(f"{v:,}" for v in values)
    return f"{min(values):,} .. {max(values):,}"


def print_report(summary: dict, notes: list, header: str) -> None:
    rows = summary["rows"]
    name_w = max(len(n) for n in rows) + 2

    def ratio_text(r):
        if r is None:
            return "-"
        return (
            f"{r['median_ratio']:.3f}  {r['paired_median']:.3f} "
            f"[{r['paired_min']:.3f}, {r['paired_max']:.3f}]"
        )

    print(header)
    print(
        "\nStep time (ratios: reference time / row time, above 1.0 = the row is faster; "
        "of the medians, then round by round: median [min, max])"
    )
    print(
        f"{'strategy':<{name_w}}{'median step':>12} {'min':>8} {'max':>8} {'tokens/s':>9}  "
        f"{'vs counterpart':<31} {'vs pytorch DDP':<31}"
    )
    for name, row in rows.items():
        counterpart = ratio_text(row.get("vs_counterpart")) if row["counterpart"] else "(reference)"
        print(
            f"{name:<{name_w}}{row['median_s'] * 1e3:>10.1f}ms {row['min_s'] * 1e3:>6.1f}ms "
            f"{row['max_s'] * 1e3:>6.1f}ms {row['tokens_per_s']:>9,.0f}  {counterpart:<31} "
            f"{ratio_text(row.get('vs_ddp')):<31}"
        )
    counterparts = {n: r["counterpart"] for n, r in rows.items() if r["counterpart"]}
    if counterparts:
        print("counterparts: " + "; ".join(f"{n} vs {c}" for n, c in counterparts.items()))

    print(
        "\nBytes per rank (rank 0 / rank 1 / ..., or '(each)' when every rank holds "
        "the same; the whole "
        f"model: {summary['model_bytes']:,} B of float32 parameters): parameters, "
        "gradients at the sync point, "
        "optimiser state"
    )
    widths = {
        k: max(len(k), *(len(per_rank(r["memory"][k])) for r in rows.values())) + 2
        for k in MEMORY_KINDS
    }
    print(f"{'strategy':<{name_w}}" + "".join(f"{k:>{widths[k]}}" for k in MEMORY_KINDS))
    for name, row in rows.items():
        print(
            f"{name:<{name_w}}"
            + "".join(f"{per_rank(row['memory'][k]):>{widths[k]}}" for k in MEMORY_KINDS)
        )

    kinds = sorted({k for r in rows.values() for c in r["comm"] for k in c})
    print(
        "\nBytes per optimiser step handed to each collective, per rank (counted: our modules' "
        "count_collective; analytic: PyTorch's rows, see --help)"
    )
    cells = {
        n: {
            k: per_rank([c.get(k, 0) for c in r["comm"]])
            if any(c.get(k) for c in r["comm"])
            else "-"
            for k in kinds
        }
        for n, r in rows.items()
    }
    widths = {k: max(len(k), *(len(cells[n][k]) for n in rows)) + 2 for k in kinds}
    print(f"{'strategy':<{name_w}}{'source':<10}" + "".join(f"{k:>{widths[k]}}" for k in kinds))
    for name, row in rows.items():
        print(
            f"{name:<{name_w}}{row['comm_source']:<10}"
            + "".join(f"{cells[name][k]:>{widths[k]}}" for k in kinds)
        )
    for note in notes:
        print(f"note: {note}")


def plot(summary: dict, path: Path, title: str, notes: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only
    import matplotlib.pyplot as plt

    rows = summary["rows"]
    names = list(rows)
    fig, (left, right) = plt.subplots(1, 2, figsize=(15, 0.6 * len(names) + 3.5), dpi=110)
    for offset, key, label, color in (
        (-0.2, "vs_counterpart", "vs counterpart", "C0"),
        (0.2, "vs_ddp", "vs PyTorch DDP", "C1"),
    ):
        ys, values, low, high = [], [], [], []
        for i, name in enumerate(names):
            r = rows[name].get(key)
            if r is None or (key == "vs_counterpart" and not rows[name]["counterpart"]):
                continue
            ys.append(i + offset)
            values.append(r["median_ratio"])
            low.append(max(0.0, r["median_ratio"] - r["paired_min"]))
            high.append(max(0.0, r["paired_max"] - r["median_ratio"]))
        left.barh(ys, values, height=0.38, color=color, label=label, xerr=[low, high], capsize=3)
        for y, v in zip(ys, values):
            left.text(0.02, y, f"{v:.3f}", va="center", fontsize=7, color="white")
    left.axvline(1.0, color="black", linewidth=0.8)
    left.set_yticks(range(len(names)), names)
    left.invert_yaxis()
    left.set_xlabel("reference time / row time (>1: row faster); whiskers: per-round min..max")
    left.legend(loc="lower right", fontsize=8)
    left.set_title("step time ratio")

    world_size = len(next(iter(rows.values()))["memory"]["params"])
    width = 0.8 / world_size
    colors = {"params": "C2", "grads": "C3", "optimizer_state": "C4"}
    for rank in range(world_size):
        x = [i - 0.4 + width * (rank + 0.5) for i in range(len(names))]
        bottom = [0.0] * len(names)
        for kind in MEMORY_KINDS:
            values = [rows[n]["memory"][kind][rank] / 2**20 for n in names]
            right.bar(
                x,
                values,
                width=width * 0.9,
                bottom=bottom,
                color=colors[kind],
                label=kind if rank == 0 else None,
                edgecolor="white",
                linewidth=0.5,
            )
            bottom = [b + v for b, v in zip(bottom, values)]
        for xi, b in zip(x, bottom):
            right.text(xi, b, f"r{rank}", ha="center", va="bottom", fontsize=6)
    right.set_xticks(range(len(names)), names, rotation=25, ha="right", fontsize=8)
    right.set_ylabel("MiB per rank")
    right.set_title("memory per rank (bars: rank 0, 1, ...)")
    right.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    if notes:
        fig.text(0.01, 0.005, "\n".join(notes), fontsize=7, va="bottom")
    fig.tight_layout(rect=(0, 0.025 * len(notes), 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


# ---- main ----------------------------------------------------------------------------------------


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The docstring as written, the flags with their defaults."""


def parse_flags() -> dict:
    parser = build_parser("bench")
    parser.prog = "compare/bench.py"
    parser.description = __doc__
    parser.formatter_class = HelpFormatter
    for action in parser._actions:  # shared flags with no meaning here: accepted, not advertised
        if action.dest in UNUSED_FLAGS:
            action.help = argparse.SUPPRESS
    bench = parser.add_argument_group("benchmark")
    bench.add_argument(
        "--strategies",
        default=None,
        help="comma-separated keys or names (default: every available row): "
        + ", ".join(f"{s.key} ({s.name})" for s in STRATEGIES),
    )
    bench.add_argument(
        "--rounds", type=int, default=21, help="timed rounds (plus one warm-up round)"
    )
    bench.add_argument(
        "--steps-per-round", type=int, default=5, help="optimiser steps per row per round"
    )
    bench.add_argument(
        "--bucket-cap-mb", type=float, default=25.0, help="bucket cap of every bucketing row"
    )
    bench.add_argument(
        "--png",
        default=str(REPO_ROOT / "runs" / "bench" / "bench.png"),
        help="the plot; the numbers go beside it as .json",
    )
    bench.add_argument(
        "--timeout-s", type=float, default=300.0, help="process-group timeout in seconds"
    )
    add_moe_flags(parser)  # the MoE rows' model; the dense rows ignore it
    parser.set_defaults(moe_experts=4)
    config = parse_config(parser)
    check_moe(config)
    if config["rounds"] < 1 or config["steps_per_round"] < 1:
        raise UserError("--rounds and --steps-per-round must be at least 1")
    if not config["timeout_s"] > 0:
        raise UserError(f"--timeout-s must be positive, got {config['timeout_s']:g}")
    if config["device"] == "cuda" or config["amp"] != "none":
        raise UserError(
            "compare/bench.py runs on the CPU with gloo, in float32: drop --device cuda / --amp"
        )
    # compare/plot.py (matplotlib): a --png it cannot write fails now, not at the end
    from plot import check_figure_path

    check_figure_path(Path(config["png"]), "--png")
    return config


def main():
    config = parse_flags()
    classes, notes = choose(config["strategies"])
    if not classes:
        raise UserError("no row of --strategies can run here: " + "; ".join(notes))
    seed_everything(config["seed"], config["deterministic"])  # also: one CPU thread per process
    rank, world_size, _, _ = distributed.world_from_env()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # a world of one started without torchrun
    os.environ.setdefault("MASTER_PORT", "29500")
    dist.init_process_group(
        "gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=config["timeout_s"])
    )
    strategies, build_notes = build(classes, config)
    if not strategies:
        raise UserError("no row could be built: " + "; ".join(build_notes))
    times, probe = measure(strategies, config, config["rounds"], config["steps_per_round"], rank)
    everyone = distributed.gather_from_every_rank(probe)
    summary = summarise(strategies, times, everyone, config, world_size)

    # Free PyTorch's wrappers (DDP's C++ reducer holds the process group) before the group goes: see
    # shutdown(). Then check that they went. (Our wrappers hold no group; BucketedDDP's hooks keep
    # it alive in a cycle through its parameters that the collector does not break, which
    # is harmless.)
    held = [(s.name, weakref.ref(s.wrapped)) for s in strategies if s.pytorch]
    del strategies
    gc.collect()
    alive = [name for name, ref in held if ref() is not None]

    if rank == 0:
        header = (
            f"{world_size} ranks, gloo, {torch.get_num_threads()} thread(s) each, "
            f"torch {torch.__version__}; "
            f"{config['rounds']} rounds x {config['steps_per_round']} steps (+1 "
            "warm-up round); global batch "
            f"{summary['tokens_per_step']:,} tokens ({config['micro_batch_size']} x "
            f"{config['seq_len']} x "
            f"{config['grad_accum']} accum x {world_size} ranks); model "
            f"{config['n_layer']}x{config['n_embd']}, "
            f"bucket cap {config['bucket_cap_mb']} MiB"
        )
        all_notes = (
            notes
            + build_notes
            + ([f"still alive at shutdown: {', '.join(alive)}"] if alive else [])
        )
        print_report(summary, all_notes, header)
        png = Path(config["png"]).resolve()
        plot(summary, png, header, all_notes)
        png.with_suffix(".json").write_text(
            json.dumps(
                {
                    "config": config,
                    "world_size": world_size,
                    "torch": torch.__version__,
                    "notes": all_notes,
                    **summary,
                },
                indent=1,
            )
        )
        print(f"\nplot: {png}\nnumbers: {png.with_suffix('.json')}")
    distributed.shutdown()


if __name__ == "__main__":
    exit_on_user_error(main)
