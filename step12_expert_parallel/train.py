"""Step 12: expert parallelism (expert_parallel.py).
Grown from step 3's train.py (naive data parallelism).

An MoE model (moe.py, --moe-experts E) whose experts are split over --ep D ranks: every rank routes
its own micro-batches, sends each token to the rank that owns its expert and gets the output back
(two all-to-alls a layer). Dense parameters are data-parallel over all ranks, each expert over the
W/D ranks that hold it; after the last micro-batch both are all-reduced over those ranks and divided
by W (step 3's rule, two groups).

    torchrun --standalone --nproc_per_node=2 step12_expert_parallel/train.py --ep 2 \\
        --micro-batch-size 1
    # the reference
    python step0_single_gpu/train.py --moe-experts 4 --micro-batch-size 1 --grad-accum 4
"""

from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import record_function

import distributed
from background_writer import BackgroundWriter, add_async_save_flag
from checkpoint import CheckpointWriter, RunState, WholeModel
from checkpoint_files import find_checkpoint
from comm_accounting import take_comm_bytes
from config import (
    Preemption,
    UserError,
    build_parser,
    exit_on_user_error,
    limit_memory,
    parse_config,
)
from data import MicroBatches, check_enough_data, load_corpus
from expert_parallel import Groups, counted_once, is_expert, reduce_gradients, shard_experts
from metrics import RunLog, StepClock, environment, memory_stats, save_final_weights
from model import build_model, language_model_loss
from moe_setup import (
    add_moe_flags,
    check_moe,
    moe_layers,
    moe_model,
    take_moe_record,
    with_aux_loss,
)
from resharding import open_checkpoint
from sampler import ShardedSampler, checked_micro_batches
from seeding import seed_everything
from sharded_norms import clip_grad_norm, param_norm
from training import (
    autocast,
    check_amp,
    make_grad_scaler,
    make_optimizer,
    make_scheduler,
)

STEP = Path(__file__).resolve().parent.name


def train_step(
    model, optimizer, scaler, micro_batches: list, config: dict, device, groups
) -> tuple:
    """One optimiser step on this rank's ``micro_batches`` (a list of (inputs, targets)): forward
    and backward on each, the gradients synchronised across ranks once, then unscaled, clipped and
    applied. Returns what the loop logs: the losses' sum, the gradient norm before clipping, this
    rank's memory. The phases are named for torch.profiler (compare/peak_memory.py reads them): free
    when no profiler runs."""
    accum = len(micro_batches)
    loss_sum = torch.zeros((), device=device)
    for inputs, targets in micro_batches:
        with record_function("forward"), autocast(config["amp"], device):
            loss = language_model_loss(model, inputs.to(device), targets.to(device))
        with record_function("backward"):
            # + a * the load-balancing loss; the all-to-alls
            # of the MoE layers run inside forward and backward
            scaler.scale(with_aux_loss(model, loss, config) / accum).backward()
        loss_sum += loss.detach()

    with record_function("optimizer"):
        # Once per optimiser step: dense gradients over every
        # rank, each expert's over its copies; both / W.
        reduce_gradients(model, groups, getattr(torch, config["reduce_dtype"]))
        scaler.unscale_(optimizer)  # clip (and log) the true gradient, not the loss-scaled one
        # The whole model's norm: every element counted once
        # over the world (dense on rank 0, experts once each)
        grad_norm = clip_grad_norm(
            model.parameters(),
            config["grad_clip"],
            groups=(dist.group.WORLD,),
            counted=counted_once(model, groups),
        )
        scaler.step(optimizer)  # skipped by the scaler if fp16 gradients overflowed
        scaler.update()
        # before zero_grad frees the grads
        memory = memory_stats(model.parameters(), optimizer, device)
        optimizer.zero_grad(set_to_none=True)
    return loss_sum, grad_norm, memory


def add_ep_flag(parser) -> None:
    parser.add_argument(
        "--ep",
        type=int,
        default=None,
        metavar="D",
        help="expert-parallel degree: each MoE layer's experts split over D ranks (E/D each); "
        "default: the world size",
    )


def check_ep(config: dict, world_size: int) -> int:
    """The expert-parallel degree, or a UserError saying what to change."""
    experts, ep = config["moe_experts"], config["ep"] or world_size
    if not experts:
        raise UserError(
            f"{STEP} trains a mixture of experts: give --moe-experts E (a multiple of --ep)"
        )
    if ep < 1 or world_size % ep:
        raise UserError(
            f"--ep {ep} must divide the world size {world_size} (ranks = data-parallel "
            "copies x --ep)"
        )
    if experts % ep:
        raise UserError(
            f"--moe-experts {experts} is not divisible by --ep {ep}: each rank holds E/D experts; "
            f"choose E a multiple of {ep}"
        )
    return ep


def main():
    # ---- everything that can be wrong is checked before anything is written or connected -----
    parser = build_parser(STEP)
    distributed.add_flags(parser)
    add_async_save_flag(parser)  # --async-save (background_writer.py)
    add_moe_flags(parser)
    add_ep_flag(parser)
    config = parse_config(parser)
    distributed.refuse_compile(config)  # its communication runs in or around the blocks
    check_moe(config)
    world = distributed.plan_world(config)
    config["ep"] = check_ep(config, world.world_size)
    check_amp(config["amp"], world.device)
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
    # Every rank builds the same dense parameters and all
    # the experts from (seed, name), then keeps its own E/D.
    model = moe_model(build_model(config, corpus.vocab_size, config["seed"]), config)
    # the whole model's, for the checkpoints
    shapes = {name: p.shape for name, p in model.named_parameters()}
    groups = Groups(config["ep"])
    dispatchers = shard_experts(model, moe_layers(model), groups)
    model.to(device)
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
        shapes,
        [RunState(scheduler, scaler, batches, log), WholeModel(model, optimizer)],
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
            model, optimizer, scaler, micro_batches, config, device, groups
        )
        scheduler.step()

        if device.type == "cuda":
            torch.cuda.synchronize()  # the GPU runs ahead of Python; time the work, not its launch
        step_time = clock.stop()  # before the logging's own work and collectives
        log.log(
            {
                "step": step + 1,
                # over every rank and micro-batch, rounded to float32
                # as step 0 rounds its mean: at 2 ranks the same bits
                "loss": torch.tensor(distributed.mean_over_ranks(loss_sum, accum)).float().item(),
                "grad_norm": grad_norm.item(),
                "param_norm": param_norm(counted_once(model, groups), groups=(dist.group.WORLD,)),
                "lr": lr,
                "tokens_per_s": tokens_per_step / step_time["wall_s"],
                "effective_batch_size": config["micro_batch_size"] * accum * world.world_size,
                "epoch": batches.epoch,
                # one entry per rank
                **distributed.gather_per_rank(memory=memory, step_time=step_time),
                # the experts' load and each rank's all-to-all bytes
                **moe_record_over_ranks(model, dispatchers),
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
    whole = gather_experts(model, groups)  # rank 0: the dense parameters and every expert
    if world.is_main:
        log.finish(save_final_weights(Path(config["out"]), whole))
    distributed.shutdown()


def moe_record_over_ranks(model, dispatchers) -> dict:
    """The MoE record over every rank: tokens per expert summed (what one process routing every
    micro-batch counts), the load-balancing loss and dropped fraction averaged; and each rank's
    all-to-all notes."""
    mine = take_moe_record(model)["moe"]
    traffic = [note for d in dispatchers for note in d.traffic]
    for d in dispatchers:
        d.traffic = []
    everyone = distributed.gather_per_rank(moe=mine, all_to_all=traffic)
    records = everyone["moe"]
    n = len(records)
    merged = {
        "aux_loss": sum(r["aux_loss"] for r in records) / n,
        "tokens_per_expert": [
            [sum(c) for c in zip(*layer)]
            for layer in zip(*(r["tokens_per_expert"] for r in records))
        ],
        "dropped_fraction": [sum(f) / n for f in zip(*(r["dropped_fraction"] for r in records))],
    }
    return {"moe": merged, "all_to_all": everyone["all_to_all"]}


def gather_experts(model, groups) -> dict:
    """Every parameter by name on rank 0: its own,
    and the experts of the first expert-parallel group's ranks."""
    own = {name: p.detach().cpu() for name, p in model.named_parameters()}
    experts = (
        {n: t for n, t in own.items() if is_expert(n)} if dist.get_rank() < groups.ep_size else {}
    )
    for held in distributed.gather_from_every_rank(experts):
        own.update(held)
    return own


if __name__ == "__main__":
    exit_on_user_error(main)
