"""Step 7: ZeRO stage 3: the parameters partitioned too (zero3.py); FSDP, from scratch.

Step 6 still kept every parameter on every rank. Here the model is built on the meta device, each
rank keeps 1/N of every block's parameters and of the root's, and gathers a unit only while its
forward or backward runs, the next unit's gather already under way; a plain AdamW steps this rank's
pieces: 4/N + 4/N + 8/N bytes per parameter.

    torchrun --standalone --nproc_per_node=2 step7_zero3/train.py
    # bitwise at 2 ranks (--trace: the prefetch timeline)
    python compare/parity.py step1 step7
    # HSDP: 2 rows of 2 (hsdp.py)
    torchrun --standalone --nproc_per_node=4 step7_zero3/train.py --replicate 2
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
from fp8 import add_fp8_flag, check_fp8, convert_to_fp8
from metrics import RunLog, StepClock, environment, memory_stats
from model import language_model_loss
from offload import OffloadedOptimizer
from prefetch_trace import PrefetchTrace
from resharding import PerRank, open_checkpoint
from sampler import ShardedSampler, checked_micro_batches
from seeding import seed_everything
from sharded_gradients import ShardedGradScaler
from sharded_norms import clip_grad_norm, param_norm
from streaming_export import save_final_weights_streaming
from training import (
    add_param_dtype_flag,
    autocast,
    check_amp,
    check_param_dtype,
    make_grad_scaler,
    make_optimizer,
    make_scheduler,
    param_dtype,
)
from zero3_setup import add_zero3_flags, check_replicate, shard_gpt2

STEP = Path(__file__).resolve().parent.name


def train_step(model, optimizer, scaler, micro_batches: list, config: dict, device) -> tuple:
    """One optimiser step on this rank's ``micro_batches`` (a list of (inputs, targets)): forward
    and backward on each, the gradients synchronised once, unscaled, clipped, applied. Returns the
    losses' sum, the gradient norm before clipping, this rank's memory; the phases named for
    torch.profiler (compare/peak_memory.py reads them)."""
    accum = len(micro_batches)
    loss_sum = torch.zeros((), device=device)
    for micro_step, (inputs, targets) in enumerate(micro_batches):
        # only the last backward reduce-scatters; the others accumulate locally
        is_last = micro_step == accum - 1
        with contextlib.nullcontext() if is_last else model.no_sync():
            with record_function("forward"), autocast(config["amp"], device):
                loss = language_model_loss(model, inputs.to(device), targets.to(device))
            with record_function("backward"):
                # the hooks gather, free and reduce-scatter in here
                scaler.scale(loss / accum).backward()
        loss_sum += loss.detach()

    with record_function("optimizer"):
        # the single sync point: each piece's .grad is its slice
        model.finish_gradient_synchronization()
        scaler.unscale_(optimizer)  # clip (and log) the true gradient, not the loss-scaled one
        # HSDP: a row
        grad_norm = clip_grad_norm(
            model.parameters(), config["grad_clip"], [model.mesh.shard_group]
        )
        scaler.step(optimizer)  # updates this rank's pieces in place; skipped on overflow
        scaler.update()
        memory = memory_stats(
            model.parameter_shards,
            optimizer,
            device,
            grads=model.gradient_shards,
            # full units held at once, this step
            gathered_peak=model.take_peak_gathered_bytes(),
            # --offload-optimizer: the float32 copies and the moments in host memory
            **(
                {"host": optimizer.host_bytes()}
                if isinstance(optimizer, OffloadedOptimizer)
                else {}
            ),
        )
        optimizer.zero_grad(set_to_none=True)
    return loss_sum, grad_norm, memory


def main():
    # ---- everything that can be wrong is checked before anything is written or connected -----
    parser = build_parser(STEP)
    distributed.add_flags(parser)
    add_async_save_flag(parser)  # --async-save (background_writer.py)
    # --no-prefetch, --activation-checkpointing, --offload-optimizer, --trace
    add_zero3_flags(parser)
    add_param_dtype_flag(parser)
    add_fp8_flag(parser)  # --fp8 tensorwise|rowwise (fp8.py)
    config = parse_config(parser)
    distributed.refuse_compile(config)  # its communication runs in or around the blocks
    world = distributed.plan_world(config)
    check_amp(config["amp"], world.device)
    # --fp8: no --amp fp16, sizes multiples of 16, a device with _scaled_mm
    check_fp8(config, world.device)
    check_param_dtype(config, world.device)
    check_replicate(config["replicate"], world.world_size)  # HSDP: R must divide N
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
    # only this rank's pieces
    ddp_model, shapes = shard_gpt2(config, corpus.vocab_size, device, param_dtype(config))
    # the blocks' nn.Linears multiply in FP8; embeddings, output layer stay (fp8.py)
    if config["fp8"]:
        convert_to_fp8(ddp_model.module.transformer.h, config["fp8"])
    # a plain AdamW over this rank's pieces, or
    optimizer = make_optimizer(ddp_model.named_parameters(), config)
    # the same AdamW on host copies of them (ZeRO-Offload, offload.py)
    if config["offload_optimizer"]:
        optimizer = OffloadedOptimizer(
            ddp_model.named_parameters(), lambda named: make_optimizer(named, config)
        )
    scheduler = make_scheduler(optimizer, config)
    # one overflow verdict for all ranks
    scaler = make_grad_scaler(config, device, ShardedGradScaler)
    # keeps the last micro-batch's timeline
    tracer = PrefetchTrace(ddp_model) if config["trace"] else None

    env = environment(device, world.world_size, world.backend, config["amp"], corpus)
    log = RunLog(config, env, is_writer=world.is_main)
    # Checkpoints: each rank its pieces and AdamW's state
    # for them, read at any world size (only those elements).
    writer = (BackgroundWriter if config["async_save"] else CheckpointWriter)(
        config,
        world.rank,
        world.world_size,
        shapes,
        [RunState(scheduler, scaler, batches, log), PerRank(ddp_model, optimizer)],
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
                # HSDP: a row
                "param_norm": param_norm(
                    ddp_model.parameters(), [ddp_model.mesh.shard_group], device
                ),
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
    if tracer:  # stopped first: the export's gathers are not training
        tracer.finish(Path(config["out"]) if world.is_main else None)  # rank 0 writes its timeline
    final = save_final_weights_streaming(
        Path(config["out"]), shapes, ddp_model.gathered_parameters(), world.is_main
    )
    # every rank gathered, unit by unit; rank 0 wrote the tensors as they came, and writes the log
    log.finish(final)
    distributed.shutdown()


if __name__ == "__main__":
    exit_on_user_error(main)
