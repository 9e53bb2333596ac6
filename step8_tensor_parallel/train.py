"""Step 8: tensor parallelism, written by hand (tensor_parallel.py; sequence_parallel.py on top).
Grown from step 3's train.py.

Steps 1-7 gave every rank its own samples. Here the T ranks read the same micro-batches and split
every layer: whole heads, 1/T of the MLP, of the vocabulary, of every weight matrix; activations are
all-reduced, not gradients.

    torchrun --standalone --nproc_per_node=2 step8_tensor_parallel/train.py
    torchrun --standalone --nproc_per_node=2 compare/tp_reference.py
    python compare/parity.py step8 runs/tp_reference        # bitwise
    python compare/parity.py step1 step8                    # close: other summation order
"""

from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import record_function

import distributed
from background_writer import BackgroundWriter, add_async_save_flag
from checkpoint import CheckpointWriter, RunState
from checkpoint_files import find_checkpoint
from comm_accounting import take_comm_bytes
from config import Preemption, build_parser, exit_on_user_error, limit_memory, parse_config
from data import MicroBatches, check_enough_data, load_corpus
from metrics import RunLog, StepClock, environment, memory_stats, save_final_weights
from model import build_model, language_model_loss
from resharding import open_checkpoint
from sampler import ShardedSampler
from seeding import seed_everything
from sequence_parallel import (
    add_sequence_parallel_flags,
    check_sequence_parallel,
    finish_gradient_synchronization,
    sequence_parallel_gpt2,
)

# step 5's: the fp16 overflow flag agreed by every rank
from sharded_gradients import ShardedGradScaler
from sharded_norms import clip_grad_norm, param_norm
from tensor_parallel import check_tensor_parallel, parallelize_gpt2
from tensor_parallel_state import (
    TensorParallelShards,
    counted_once,
    gather_full_parameters,
    replicated_in_sync,
)
from training import (
    autocast,
    check_amp,
    make_grad_scaler,
    make_optimizer,
    make_scheduler,
)
from vocab_parallel import vocab_parallel_cross_entropy

STEP = Path(__file__).resolve().parent.name


def train_step(model, optimizer, scaler, micro_batches: list, config: dict, device) -> tuple:
    """One optimiser step on ``micro_batches`` (a list of (inputs, targets), the same on every
    rank): forward and backward on each, then this rank's gradient shards unscaled, clipped and
    applied. Returns the losses' sum, the gradient norm before clipping, this rank's memory; the
    phases named for torch.profiler (compare/peak_memory.py)."""
    accum = len(micro_batches)
    loss_sum = torch.zeros((), device=device)
    for inputs, targets in micro_batches:
        with record_function("forward"), autocast(config["amp"], device):
            loss = language_model_loss(
                model, inputs.to(device), targets.to(device), vocab_parallel_cross_entropy
            )
        with record_function("backward"):
            # activations all-reduced in here; no gradient to synchronise
            scaler.scale(loss / accum).backward()
        loss_sum += loss.detach()

    with record_function("optimizer"):
        # --sequence-parallel: the LayerNorms' partial gradients added up
        finish_gradient_synchronization(model)
        scaler.unscale_(optimizer)  # clip (and log) the true gradient, not the loss-scaled one
        # the whole gradient's
        grad_norm = clip_grad_norm(
            model.parameters(),
            config["grad_clip"],
            [dist.group.WORLD],
            counted=counted_once(model.parameters()),
        )
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
    add_sequence_parallel_flags(parser)  # --sequence-parallel
    config = parse_config(parser)
    distributed.refuse_compile(config)  # its communication runs in or around the blocks
    world = distributed.plan_world(config)
    check_amp(config["amp"], world.device)
    seed_everything(config["seed"], config["deterministic"])
    corpus = load_corpus(config["data"], config["tokenizer"], config["seq_len"])
    # the budget: what training adds to libraries and data
    limit_memory(config["max_memory_mb"], STEP, world.device)
    check_tensor_parallel(config, corpus.vocab_size, world.world_size)  # whole heads, vocab slices
    check_sequence_parallel(config, world.world_size)  # and whole slices of the sequence
    check_enough_data(len(corpus.blocks), 1, config["micro_batch_size"], config["grad_accum"])
    resume_from = find_checkpoint(config["resume"], config["out"])
    resumed = open_checkpoint(resume_from, config, 1, world.is_main) if resume_from else None
    device = distributed.join(world, config["timeout_s"])  # this rank's device

    # ---- data, model, optimiser ----------------------------------------------------------------
    # Every rank reads every sample: the ranks share each micro-batch, they do not split the batch.
    sampler = ShardedSampler(
        len(corpus.blocks), num_replicas=1, rank=0, shuffle=True, seed=config["seed"]
    )
    batches = MicroBatches(corpus.blocks, sampler, config["micro_batch_size"])
    # The same full model on every rank (the seed's), then each keeps its shards. Activations are
    # all-reduced in their own dtype (bf16 under --amp bf16), as PyTorch's TP; --reduce-dtype
    # float64: order-free, not step 1's sums.
    reduce_dtype = torch.float64 if config["reduce_dtype"] == "float64" else None
    model = build_model(config, corpus.vocab_size, config["seed"])
    # what checkpoints describe
    full_shapes = {name: p.shape for name, p in model.named_parameters()}
    model = parallelize_gpt2(model, reduce_dtype=reduce_dtype)
    if config["sequence_parallel"]:
        model = sequence_parallel_gpt2(model, reduce_dtype=reduce_dtype)
    model = model.to(device)
    optimizer = make_optimizer(model.named_parameters(), config)
    scheduler = make_scheduler(optimizer, config)
    # fp16: every rank skips, or steps, together
    scaler = make_grad_scaler(config, device, ShardedGradScaler)

    env = environment(device, world.world_size, world.backend, config["amp"], corpus)
    # parity.py: the global batch
    env.update(tensor_parallel_size=world.world_size, data_parallel_size=1)
    log = RunLog(config, env, is_writer=world.is_main)
    # Checkpoints: each rank its shards, as blocks that steps 0-8 and 10 read back at any degree.
    writer = (BackgroundWriter if config["async_save"] else CheckpointWriter)(
        config,
        world.rank,
        world.world_size,
        full_shapes,
        [RunState(scheduler, scaler, batches, log), TensorParallelShards(model, optimizer)],
        data_parallel_size=1,
    )
    start_step = writer.start(resumed)  # every part loaded, the RNG last; or a fresh start in --out
    accum = config["grad_accum"]
    tokens_per_step = config["micro_batch_size"] * accum * config["seq_len"]

    # ---- the training loop ---------------------------------------------------------------------
    # --preempt-grace-s: SIGTERM saves, then exits
    preemption = Preemption(config["preempt_grace_s"], world.rank)
    for step in range(start_step, config["steps"]):
        clock = StepClock()  # this rank's wall and CPU time for the step
        lr = scheduler.get_last_lr()[0]
        # the same micro-batches on every rank
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
                # every rank computed the same loss: nothing to average
                "loss": loss_sum.double().item() / accum,
                "grad_norm": grad_norm.item(),
                "param_norm": param_norm(counted_once(model.parameters()), [dist.group.WORLD]),
                "lr": lr,
                "tokens_per_s": tokens_per_step / step_time["wall_s"],
                "effective_batch_size": config["micro_batch_size"] * accum,
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

    # the replicated parameters must be the same bits on every rank
    in_sync = replicated_in_sync(model)
    full = gather_full_parameters(model)  # every rank takes part; rank 0 writes the plain model
    writer.wait()  # the last checkpoint is whole on disk before the run says it is done
    if world.is_main:
        final = save_final_weights(Path(config["out"]), full)
        final["replicas_identical"] = in_sync
        log.finish(final)
    distributed.shutdown()


if __name__ == "__main__":
    exit_on_user_error(main)
