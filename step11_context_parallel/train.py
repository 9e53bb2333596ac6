"""Step 11: context parallelism, ring attention written by hand (context_parallel.py).
Grown from step 3's train.py.

Step 3 gave every rank its own samples. Here the C ranks read the same micro-batches and split every
sequence: each keeps 1/C of the positions (two chunks, zig-zag), attention passes key/value blocks
around a ring, and the gradients are averaged over the ranks as in step 3. The softmax merges in
another order than one process's: bitwise to a blockwise reference, close to step 1 (README).

    torchrun --standalone --nproc_per_node=2 step11_context_parallel/train.py
    python compare/parity.py step1 step11                   # close: other summation order
"""

from pathlib import Path

import torch
from torch.profiler import record_function

import distributed
from background_writer import BackgroundWriter, add_async_save_flag
from checkpoint import CheckpointWriter, RunState, WholeModel
from checkpoint_files import find_checkpoint
from comm_accounting import take_comm_bytes
from config import Preemption, build_parser, exit_on_user_error, limit_memory, parse_config
from context_parallel import (
    add_context_parallel_flags,
    check_context_parallel,
    context_parallel_gpt2,
    context_parallel_groups,
)
from data import MicroBatches, check_enough_data, load_corpus
from metrics import RunLog, StepClock, environment, memory_stats, save_final_weights
from model import build_model, language_model_loss
from naive_dp import allreduce_gradients, replicas_in_sync
from resharding import open_checkpoint
from sampler import ShardedSampler
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
    """One optimiser step on ``micro_batches`` (a list of (inputs, targets), the same on every rank
    of a ring): forward and backward on this rank's positions of each, the gradients averaged across
    ranks once, then unscaled, clipped and applied. Returns what the loop logs: the losses' sum, the
    gradient norm before clipping, this rank's memory. The phases are named for torch.profiler
    (compare/peak_memory.py reads them): free when no profiler runs."""
    accum = len(micro_batches)
    loss_sum = torch.zeros((), device=device)
    for inputs, targets in micro_batches:
        with record_function("forward"), autocast(config["amp"], device):
            # The model computes this rank's positions
            # (rule 1): the loss is over this rank's tokens.
            loss = language_model_loss(
                model, inputs.to(device), model.sequence_shard(targets.to(device))
            )
        with record_function("backward"):
            scaler.scale(loss / accum).backward()  # the key/value gradients travel the ring in here
        loss_sum += loss.detach()

    with record_function("optimizer"):
        # Each rank's gradient is its tokens' share: the mean
        # over ranks is the mean over every token (rule 6).
        allreduce_gradients(model, getattr(torch, config["reduce_dtype"]))
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
    add_context_parallel_flags(parser)  # --cp, --cp-layout
    config = parse_config(parser)
    distributed.refuse_compile(config)  # its communication runs in or around the blocks
    world = distributed.plan_world(config)
    check_amp(config["amp"], world.device)
    seed_everything(config["seed"], config["deterministic"])
    corpus = load_corpus(config["data"], config["tokenizer"], config["seq_len"])
    # the budget: what training adds to libraries and data
    limit_memory(config["max_memory_mb"], STEP, world.device)
    # dp rings of cp ranks, sequences cut in 2 x cp chunks
    cp, dp = check_context_parallel(config, world.world_size)
    check_enough_data(len(corpus.blocks), dp, config["micro_batch_size"], config["grad_accum"])
    resume_from = find_checkpoint(config["resume"], config["out"])
    resumed = open_checkpoint(resume_from, config, dp, world.is_main) if resume_from else None
    device = distributed.join(world, config["timeout_s"])  # this rank's device

    # ---- data, model, optimiser ----------------------------------------------------------------
    # The ranks of a ring share each micro-batch and split its sequences; the rings split the batch
    # (step 2).
    ring, dp_rank = context_parallel_groups(cp)
    sampler = ShardedSampler(
        len(corpus.blocks), num_replicas=dp, rank=dp_rank, shuffle=True, seed=config["seed"]
    )
    batches = MicroBatches(corpus.blocks, sampler, config["micro_batch_size"])
    # the same on every rank (the seed's)
    model = build_model(config, corpus.vocab_size, config["seed"]).to(device)
    # in place: ring attention, this rank's positions
    context_parallel_gpt2(model, ring, config["cp_layout"])
    optimizer = make_optimizer(model.named_parameters(), config)
    scheduler = make_scheduler(optimizer, config)
    scaler = make_grad_scaler(config, device)

    env = environment(device, world.world_size, world.backend, config["amp"], corpus)
    env.update(context_parallel_size=cp, data_parallel_size=dp)  # parity.py: the global batch
    log = RunLog(config, env, is_writer=world.is_main)
    # What a checkpoint holds, each part saving and loading its own state (checkpoint.py);
    # --async-save: the state is copied to memory and a thread writes it (background_writer.py).
    writer = (BackgroundWriter if config["async_save"] else CheckpointWriter)(
        config,
        world.rank,
        world.world_size,
        {name: p.shape for name, p in model.named_parameters()},
        [RunState(scheduler, scaler, batches, log), WholeModel(model, optimizer)],
        data_parallel_size=dp,
    )
    start_step = writer.start(resumed)  # every part loaded, the RNG last; or a fresh start in --out
    accum = config["grad_accum"]
    tokens_per_step = config["micro_batch_size"] * accum * config["seq_len"] * dp

    # ---- the training loop ---------------------------------------------------------------------
    # --preempt-grace-s: SIGTERM saves, then exits
    preemption = Preemption(config["preempt_grace_s"], world.rank)
    for step in range(start_step, config["steps"]):
        clock = StepClock()  # this rank's wall and CPU time for the step
        lr = scheduler.get_last_lr()[0]
        # the same micro-batches on every rank of a ring
        micro_batches = [batches.next() for _ in range(accum)]
        loss_sum, grad_norm, memory = train_step(
            model, optimizer, scaler, micro_batches, config, device
        )
        scheduler.step()

        if device.type == "cuda":
            torch.cuda.synchronize()  # the GPU runs ahead of Python; time the work, not its launch
        step_time = clock.stop()  # before the logging's own work and collectives
        log.log(
            {
                "step": step + 1,
                # every rank's tokens, every micro-batch
                "loss": distributed.mean_over_ranks(loss_sum, accum),
                "grad_norm": grad_norm.item(),
                "param_norm": param_norm(model.parameters()),
                "lr": lr,
                "tokens_per_s": tokens_per_step / step_time["wall_s"],
                "effective_batch_size": config["micro_batch_size"] * accum * dp,
                "epoch": batches.epoch,
                # one entry per rank
                **distributed.gather_per_rank(memory=memory, step_time=step_time),
                "comm": take_comm_bytes(),
            }
        )
        # a SIGTERM reached a rank: every rank stops after this step
        preempted = distributed.preempted_anywhere(preemption)
        if preempted or (config["save_every"] and (step + 1) % config["save_every"] == 0):
            writer.save(step + 1)
        if preempted:
            # waits for the write, says where, exits 4
            preemption.leave(writer, step + 1, config["out"])

    in_sync = replicas_in_sync(model)  # every rank must hold the same weights, bit for bit
    writer.wait()  # the last checkpoint is whole on disk before the run says it is done
    if world.is_main:
        final = save_final_weights(Path(config["out"]), dict(model.named_parameters()))
        final["replicas_identical"] = in_sync
        log.finish(final)
    distributed.shutdown()


if __name__ == "__main__":
    exit_on_user_error(main)
