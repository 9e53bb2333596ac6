"""Step 2: step 1's loop with a data sampler written from scratch (sampler.py).

Every rank gets a disjoint shard, as many samples as the others, a new shuffle each epoch that all
agree on; each epoch the ranks all-gather their indices and check it. Bitwise identical to step 1's:
same indices.

    torchrun --standalone --nproc_per_node=2 step2_sharded_data/train.py
    python compare/parity.py step1 step2
"""

import contextlib
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import record_function

import distributed
from background_writer import BackgroundWriter, add_async_save_flag
from checkpoint import CheckpointWriter, RunState, WholeModel
from checkpoint_files import find_checkpoint
from comm_accounting import comm_bytes, take_comm_bytes
from config import Preemption, build_parser, exit_on_user_error, limit_memory, parse_config
from data import MicroBatches, check_enough_data, load_corpus
from exact_reduction import float64_allreduce_hook
from fp8 import add_fp8_flag, check_fp8, convert_to_fp8
from metrics import RunLog, StepClock, environment, memory_stats, save_final_weights, tensor_bytes
from model import build_model, compile_blocks, language_model_loss
from resharding import open_checkpoint
from sampler import ShardedSampler, checked_micro_batches
from seeding import seed_everything
from training import (
    autocast,
    check_amp,
    clip_grad_norm,
    make_grad_scaler,
    make_optimizer,
    make_scheduler,
    param_norm,
)

STEP = Path(__file__).resolve().parent.name


def train_step(model, optimizer, scaler, micro_batches: list, config: dict, device) -> tuple:
    """One optimiser step on this rank's ``micro_batches`` (a list of (inputs, targets)): forward
    and backward on each, the gradients synchronised across ranks once, then unscaled, clipped and
    applied. Returns what the loop logs: the losses' sum, the gradient norm before clipping, this
    rank's memory. The phases are named for torch.profiler (compare/peak_memory.py reads them): free
    when no profiler runs."""
    accum = len(micro_batches)
    loss_sum = torch.zeros((), device=device)
    for micro_step, (inputs, targets) in enumerate(micro_batches):
        # only the last backward all-reduces; the others accumulate locally
        is_last = micro_step == accum - 1
        with contextlib.nullcontext() if is_last else model.no_sync():
            with record_function("forward"), autocast(config["amp"], device):
                loss = language_model_loss(model, inputs.to(device), targets.to(device))
            with record_function("backward"):
                scaler.scale(loss / accum).backward()
        loss_sum += loss.detach()

    with record_function("optimizer"):
        scaler.unscale_(optimizer)  # clip (and log) the true gradient, not the loss-scaled one
        grad_norm = clip_grad_norm(model.parameters(), config["grad_clip"])
        scaler.step(optimizer)  # skipped by the scaler if fp16 gradients overflowed
        scaler.update()
        # before zero_grad frees the grads
        memory = memory_stats(model.parameters(), optimizer, device)
        optimizer.zero_grad(set_to_none=True)
    return loss_sum, grad_norm, memory


def main():
    # ---- everything that can be wrong is checked before anything is written or connected -----
    parser = build_parser(STEP)
    distributed.add_flags(parser)
    add_async_save_flag(parser)  # --async-save (background_writer.py)
    add_fp8_flag(parser)  # --fp8 tensorwise|rowwise (fp8.py)
    config = parse_config(parser)
    world = distributed.plan_world(config)
    check_amp(config["amp"], world.device)
    # --fp8: no --amp fp16, sizes multiples of 16, a device with _scaled_mm
    check_fp8(config, world.device)
    seed_everything(config["seed"], config["deterministic"])
    corpus = load_corpus(config["data"], config["tokenizer"], config["seq_len"])
    # the budget: what training adds to libraries and data
    limit_memory(config["max_memory_mb"], STEP, world.device)
    check_enough_data(
        len(corpus.blocks), world.world_size, config["micro_batch_size"], config["grad_accum"]
    )
    resume_from = find_checkpoint(config["resume"], config["out"])
    resumed = (
        open_checkpoint(resume_from, config, world.world_size, world.is_main)
        if resume_from
        else None
    )
    device = distributed.join(world, config["timeout_s"])  # this rank's device

    # ---- data, model, optimiser ----------------------------------------------------------------
    # Every rank shuffles with the same seed, then takes every world_size-th index from its rank on:
    # disjoint shards, the same number of samples on every rank (padded by repeating if needed).
    sampler = ShardedSampler(
        len(corpus.blocks), world.world_size, world.rank, shuffle=True, seed=config["seed"]
    )
    batches = MicroBatches(corpus.blocks, sampler, config["micro_batch_size"])
    model = build_model(config, corpus.vocab_size, config["seed"]).to(device)
    # the blocks' nn.Linears multiply in FP8; embeddings, output layer stay (fp8.py)
    if config["fp8"]:
        convert_to_fp8(model.transformer.h, config["fp8"])
    # block by block, as in step 0: the communication stays outside the blocks
    if config["compile"]:
        compile_blocks(model)
    # DDP broadcasts rank 0's parameters at construction,
    # then all-reduces gradients during backward.
    ddp_model = DistributedDataParallel(
        model, device_ids=[device.index] if world.backend == "nccl" else None
    )
    # the exact mode: DDP reduces in float64 (exact_reduction.py)
    if config["reduce_dtype"] == "float64":
        ddp_model.register_comm_hook(None, float64_allreduce_hook)
    optimizer = make_optimizer(model.named_parameters(), config)
    scheduler = make_scheduler(optimizer, config)
    scaler = make_grad_scaler(config, device)

    env = environment(device, world.world_size, world.backend, config["amp"], corpus)
    log = RunLog(config, env, is_writer=world.is_main)
    # What a checkpoint holds, each part saving and loading its own state (checkpoint.py);
    # --async-save: the state is copied to memory and a thread writes it (background_writer.py).
    writer = (BackgroundWriter if config["async_save"] else CheckpointWriter)(
        config,
        world.rank,
        world.world_size,
        {name: p.shape for name, p in model.named_parameters()},
        [RunState(scheduler, scaler, batches, log), WholeModel(model, optimizer)],
    )
    start_step = writer.start(resumed)  # every part loaded, the RNG last; or a fresh start in --out
    accum = config["grad_accum"]
    tokens_per_step = config["micro_batch_size"] * accum * config["seq_len"] * world.world_size
    # counted here: DDP's reducer is C++
    grad_bytes = tensor_bytes(p for p in model.parameters() if p.requires_grad)

    # ---- the training loop ---------------------------------------------------------------------
    # --preempt-grace-s: SIGTERM saves, then exits
    preemption = Preemption(config["preempt_grace_s"], world.rank)
    for step in range(start_step, config["steps"]):
        clock = StepClock()  # this rank's wall and CPU time for the step
        lr = scheduler.get_last_lr()[0]
        micro_batches, shard_check = checked_micro_batches(
            batches, accum, world.is_main and not config["quiet"]
        )
        loss_sum, grad_norm, memory = train_step(
            ddp_model, optimizer, scaler, micro_batches, config, device
        )
        scheduler.step()
        # DDP's C++ reducer all-reduces every gradient once a step
        if config["reduce_dtype"] == "float32":
            comm_bytes["all_reduce"] += grad_bytes

        if device.type == "cuda":
            torch.cuda.synchronize()  # the GPU runs ahead of Python; time the work, not its launch
        step_time = clock.stop()  # before the logging's own work and collectives
        log.log(
            {
                "step": step + 1,
                # over every rank and micro-batch
                "loss": distributed.mean_over_ranks(loss_sum, accum),
                "grad_norm": grad_norm.item(),
                "param_norm": param_norm(model.parameters()),
                "lr": lr,
                "tokens_per_s": tokens_per_step / step_time["wall_s"],
                "effective_batch_size": config["micro_batch_size"] * accum * world.world_size,
                "epoch": batches.epoch,
                # one entry per rank
                **distributed.gather_per_rank(memory=memory, step_time=step_time),
                "comm": take_comm_bytes(),
                "shard_check": shard_check,
            }
        )
        # a SIGTERM reached a rank: every rank stops after this step
        preempted = distributed.preempted_anywhere(preemption)
        if preempted or (config["save_every"] and (step + 1) % config["save_every"] == 0):
            writer.save(step + 1)
        if preempted:
            # waits for the write, says where, exits 4
            preemption.leave(writer, step + 1, config["out"])

    writer.wait()  # the last checkpoint is whole on disk before the run says it is done
    if world.is_main:
        final = save_final_weights(Path(config["out"]), dict(model.named_parameters()))
        log.finish(final)
    del ddp_model  # its C++ reducer must let go of the process group first: see shutdown()
    distributed.shutdown()


if __name__ == "__main__":
    exit_on_user_error(main)
