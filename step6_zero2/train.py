"""Step 6: ZeRO stage 2: gradients partitioned too (zero2.py), on top of step 5's sharded AdamW.

Step 5 all-reduced every bucket; here each is reduce-scattered the moment its last gradient is
ready, each rank receiving only the averaged slice it updates: 4/N gradient bytes per parameter, not
4. Bitwise to step 1 (README).

    torchrun --standalone --nproc_per_node=2 step6_zero2/train.py
    python compare/parity.py step1 step6
"""

import contextlib
from pathlib import Path

import torch
from torch.profiler import record_function

import distributed
from background_writer import BackgroundWriter, add_async_save_flag
from checkpoint import CheckpointWriter, RunState
from checkpoint_files import find_checkpoint
from comm_accounting import take_comm_bytes
from config import Preemption, build_parser, exit_on_user_error, limit_memory, parse_config
from data import MicroBatches, check_enough_data, load_corpus
from dcp_checkpoint import params_in_order
from fp8 import add_fp8_flag, check_fp8, convert_to_fp8
from masters import sharded_optimizer
from metrics import RunLog, StepClock, environment, memory_stats, save_final_weights
from model import build_model, compile_blocks, language_model_loss
from resharding import PerRank, open_checkpoint
from sampler import ShardedSampler, checked_micro_batches
from seeding import seed_everything
from sharded_gradients import ShardedGradScaler
from sharded_norms import clip_grad_norm, param_norm
from training import (
    adamw_options,
    adamw_param_groups,
    add_param_dtype_flag,
    autocast,
    check_amp,
    check_param_dtype,
    make_grad_scaler,
    make_scheduler,
    param_dtype,
)
from zero2 import ShardedGradientDDP, add_zero2_flags

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
        # only the last backward reduce-scatters; the others accumulate locally
        is_last = micro_step == accum - 1
        with contextlib.nullcontext() if is_last else model.no_sync():
            with record_function("forward"), autocast(config["amp"], device):
                loss = language_model_loss(model, inputs.to(device), targets.to(device))
            with record_function("backward"):
                # the hooks launch bucket reduce-scatters in here
                scaler.scale(loss / accum).backward()
        loss_sum += loss.detach()

    with record_function("optimizer"):
        # the single sync point: each rank holds its gradient shard
        model.finish_gradient_synchronization()
        scaler.unscale_(optimizer)  # clip (and log) the true gradient, not the loss-scaled one
        # all ranks'
        grad_norm = clip_grad_norm(
            params_in_order(optimizer), config["grad_clip"], optimizer.norm_groups
        )
        # updates this rank's slices, then all-gathers the parameters; skipped on overflow
        scaler.step(optimizer)
        scaler.update()
        memory = memory_stats(
            model.parameters(), optimizer, device, model.gradient_shards, optimizer.masters
        )
        optimizer.zero_grad(set_to_none=True)
    return loss_sum, grad_norm, memory


def main():
    # ---- everything that can be wrong is checked before anything is written or connected -----
    parser = build_parser(STEP)
    distributed.add_flags(parser)
    add_async_save_flag(parser)  # --async-save (background_writer.py)
    add_zero2_flags(parser)  # --bucket-cap-mb, --reduce-every-micro-batch
    add_param_dtype_flag(parser)
    add_fp8_flag(parser)  # --fp8 tensorwise|rowwise (fp8.py)
    config = parse_config(parser)
    world = distributed.plan_world(config)
    check_amp(config["amp"], world.device)
    # --fp8: no --amp fp16, sizes multiples of 16, a device with _scaled_mm
    check_fp8(config, world.device)
    check_param_dtype(config, world.device)
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
    # Step 2's sampler: disjoint shards, as many samples on every rank, a new shuffle each epoch.
    sampler = ShardedSampler(
        len(corpus.blocks), world.world_size, world.rank, shuffle=True, seed=config["seed"]
    )
    batches = MicroBatches(corpus.blocks, sampler, config["micro_batch_size"])
    # rank 0's is broadcast
    model = build_model(config, corpus.vocab_size, config["seed"] + world.rank).to(device)
    # the blocks' nn.Linears multiply in FP8; embeddings, output layer stay (fp8.py)
    if config["fp8"]:
        convert_to_fp8(model.transformer.h, config["fp8"])
    # block by block, as in step 0: the communication stays outside the blocks
    if config["compile"]:
        compile_blocks(model)
    ddp_model = ShardedGradientDDP(
        model,
        config["bucket_cap_mb"],
        reduce_dtype=getattr(torch, config["reduce_dtype"]),
        reduce_every_micro_batch=config["reduce_every_micro_batch"],
    )
    # ZeRO-1 as in step 5, sliced as the buckets are: AdamW
    # reads each gradient from the reduce-scatter's shard.
    optimizer = sharded_optimizer(
        adamw_param_groups(model.named_parameters(), config),
        torch.optim.AdamW,
        param_dtype(config),
        chunks=ddp_model.bucket_params,
        gradient_shards=ddp_model.gradient_shards,
        **adamw_options(config),
    )
    scheduler = make_scheduler(optimizer, config)
    # one overflow verdict for all ranks
    scaler = make_grad_scaler(config, device, ShardedGradScaler)

    env = environment(device, world.world_size, world.backend, config["amp"], corpus)
    log = RunLog(config, env, is_writer=world.is_main)
    # Checkpoints: each rank its slices of the weights (or
    # masters) and of AdamW's state, read at any world size.
    writer = (BackgroundWriter if config["async_save"] else CheckpointWriter)(
        config,
        world.rank,
        world.world_size,
        {name: p.shape for name, p in model.named_parameters()},
        [
            RunState(scheduler, scaler, batches, log),
            PerRank(optimizer, list(model.named_parameters())),
        ],
    )
    start_step = writer.start(resumed)  # every part loaded, the RNG last; or a fresh start in --out
    accum = config["grad_accum"]
    tokens_per_step = config["micro_batch_size"] * accum * config["seq_len"] * world.world_size

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

        if device.type == "cuda":
            torch.cuda.synchronize()  # the GPU runs ahead of Python; time the work, not its launch
        step_time = clock.stop()  # before the logging's own work and collectives
        log.log(
            {
                "step": step + 1,
                # over every rank and micro-batch
                "loss": distributed.mean_over_ranks(loss_sum, accum),
                "grad_norm": grad_norm.item(),
                # what AdamW steps
                "param_norm": param_norm(params_in_order(optimizer), optimizer.norm_groups, device),
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
    # float32: the masters (collective)
    weights = optimizer.master_weights(model.named_parameters())
    if world.is_main:
        final = save_final_weights(Path(config["out"]), weights)
        log.finish(final)
    distributed.shutdown()


if __name__ == "__main__":
    exit_on_user_error(main)
