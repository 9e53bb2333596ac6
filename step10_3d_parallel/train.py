"""Step 10: data, tensor and pipeline parallelism at once, on one device mesh (mesh.py).
Grown from step 9's train.py.

A pp x dp x tp mesh: each pipeline stage (step 9) tensor-parallel over its tp group (step 8); the dp
replicas of a stage read their own samples (step 2), average gradients (step 3), shard AdamW's state
(step 5; --zero 0: not, 2: the gradients too, as step 6: zero_stages.py; 3: the parameters too, step
7's FullyShardedDP: zero3_on_mesh.py). With --cp, a fourth axis: each sequence split over a ring of
cp ranks (step 11), replicas to the gradients. With --moe-experts, step 12's experts: --ep D splits
them over D ranks of the dp x cp plane (experts_on_mesh.py). Bitwise: README.

    torchrun --standalone --nproc_per_node=4 step10_3d_parallel/train.py --dp 2 --tp 2 --pp 1
    torchrun --standalone --nproc_per_node=8 step10_3d_parallel/train.py --dp 2 --tp 2 --pp 2 \\
        --steps 2
    torchrun --standalone --nproc_per_node=8 step10_3d_parallel/train.py --cp 2 --tp 2 --pp 2 \\
        --steps 2
    torchrun --standalone --nproc_per_node=8 step10_3d_parallel/train.py --dp 2 --cp 2 --tp 2 \\
        --ep 2 \
        --moe-experts 4 --steps 2
"""

from datetime import timedelta
from pathlib import Path

import torch

import distributed
from background_writer import BackgroundWriter, add_async_save_flag
from checkpoint import CheckpointWriter, RunState
from checkpoint_files import find_checkpoint
from comm_by_axis import BytesByAxis
from composition import (
    MeshShards,
    add_mesh_flags,
    check_degrees,
    counted_once,
    finish_gradient_synchronization,
    gather_full_model,
    parallelize_on_mesh,
)
from config import Preemption, build_parser, exit_on_user_error, limit_memory, parse_config
from data import MicroBatches, check_enough_data, load_corpus
from experts_on_mesh import DenseAndExperts, moe_record_on_mesh, norm_groups
from mesh import build_mesh
from metrics import RunLog, StepClock, environment, memory_stats, save_final_weights
from model import build_model
from moe_setup import add_moe_flags, check_moe, moe_model, take_moe_record
from offload import OffloadedOptimizer
from resharding import open_checkpoint
from sampler import ShardedSampler
from seeding import seed_everything
from sharded_norms import clip_grad_norm, param_norm
from training import (
    check_amp,
    make_grad_scaler,
    make_scheduler,
)
from zero3_on_mesh import FullyShardedStages
from zero3_on_mesh_state import FullyShardedShards
from zero3_on_mesh_state import gather_full_model as gather_fully_sharded
from zero_stages import (
    add_zero_flag,
    average_gradients,
    check_zero,
    gradient_shards,
    norm_terms,
    optimizer_factory,
)

STEP = Path(__file__).resolve().parent.name


def train_step(
    pipe, optimizer, scaler, micro_batches: list, config: dict, device, named: list, mesh, sharded
) -> tuple:
    """One optimiser step on this replica's ``micro_batches``, through the pipeline
    ``--micro-batches`` at a time; this shard's gradients averaged over dp x cp, unscaled, clipped
    with the whole gradient's norm, applied (ZeRO --zero over dp x cp: zero_stages.py; ``sharded``:
    --zero 3's stages, zero3_on_mesh.py, else None). Returns the losses' sum (the last stage's), the
    gradient norm, this rank's memory, the bytes by axis."""
    accum = len(micro_batches)
    in_flight = config["micro_batches"] or accum
    loss_sum = torch.zeros((), device=device)
    for first in range(0, accum, in_flight):  # one pipeline flush: in_flight micro-batches
        inputs, targets = zip(*micro_batches[first : first + in_flight])
        # each loss / accum before its backward, as in step 0
        losses = pipe.run(
            in_flight,
            [x.to(device) for x in inputs],
            [y.to(device) for y in targets],
            loss_scale=accum,
        )
        for loss in losses:  # the last stage's; in micro-batch order, as step 0 adds them
            loss_sum += loss
    # step 9's (the tie, every send waited), then step 8's (sequence-parallel)
    finish_gradient_synchronization(pipe)
    # the bytes sent so far: over tp inside the stages,
    # point-to-point over pp (--zero 3: its gathers over dp)
    comm = BytesByAxis("tp", ("all_gather", "reduce_scatter") if sharded else ())
    # the replicas of this shard average their gradients (sum, then divide: step 3): all-reduced, or
    # with --zero 2 reduce-scattered, each rank keeping its slice (zero_stages.py); --zero 3
    # reduce-scattered in the last backward
    accumulated = (
        sharded.finish_gradient_synchronization()
        if sharded
        else average_gradients(pipe.module, optimizer, mesh, getattr(torch, config["reduce_dtype"]))
    )
    comm.take("dp")

    scaler.unscale_(optimizer)
    # the whole gradient's
    params, counted, groups = (
        sharded.norm_terms() if sharded else norm_terms(named, optimizer, mesh)
    )
    grad_norm = clip_grad_norm(params, config["grad_clip"], groups, counted=counted, device=device)
    comm.take("norms")  # its sums of squares, over tp, pp (and ep; with --zero 2, dp x cp first)
    # this rank's 1/(dp cp) of its shard's elements (--zero
    # 0: all of them), then all-gathered over dp x cp
    scaler.step(optimizer)
    scaler.update()
    comm.take("dp")  # ZeRO-1's all-gather
    memory = memory_stats(
        sharded.parameter_shards if sharded else (p for _, p in named),  # --zero 3: padded shards
        optimizer,
        device,
        # --zero 2 and 3: this rank's slices; else every param.grad
        sharded.gradient_shards if sharded else gradient_shards(optimizer),
        micro_batches_in_flight=pipe.take_peak_in_flight(),
        # --zero 2 and 3: the whole gradient the micro-batches
        # added up before the reduce-scatter freed it
        **({"accumulated_grads": accumulated} if accumulated is not None else {}),
        # --zero 3: units gathered at once
        **({"gathered_peak": sharded.take_peak_gathered_bytes()} if sharded else {}),
        # --offload-optimizer: the float32 copies and the moments in host memory
        **({"host": optimizer.host_bytes()} if isinstance(optimizer, OffloadedOptimizer) else {}),
    )
    optimizer.zero_grad(set_to_none=True)
    return loss_sum, grad_norm, memory, comm


def main():
    # ---- everything that can be wrong is checked before anything is written or connected -----
    parser = build_parser(STEP)
    distributed.add_flags(parser)
    add_async_save_flag(parser)  # --async-save (background_writer.py)
    add_mesh_flags(parser)
    add_moe_flags(parser)
    add_zero_flag(parser)  # --zero 0|1|2|3 (zero_stages.py; 3: zero3_on_mesh.py)
    config = parse_config(parser)
    distributed.refuse_compile(config)  # its communication runs in or around the blocks
    check_moe(config)
    world = distributed.plan_world(config)
    check_amp(config["amp"], world.device)
    seed_everything(config["seed"], config["deterministic"])
    corpus = load_corpus(config["data"], config["tokenizer"], config["seq_len"])
    # the budget: what training adds to libraries and data
    limit_memory(config["max_memory_mb"], STEP, world.device)
    dp, _ = check_degrees(config, world.world_size, corpus.vocab_size)
    check_zero(config, dp)  # the stage, and --replicate's rows of the dp x cp plane
    check_enough_data(len(corpus.blocks), dp, config["micro_batch_size"], config["grad_accum"])
    resume_from = find_checkpoint(config["resume"], config["out"])
    resumed = open_checkpoint(resume_from, config, dp, world.is_main) if resume_from else None
    device = distributed.join(world, config["timeout_s"])  # this rank's device
    mesh = build_mesh(
        dp,
        config["tp"],
        config["pp"],
        timeout_s=config["timeout_s"],
        cp=config["cp"],
        ep=config["ep"] if config["moe_experts"] else None,
    )

    # ---- data, model, optimiser ----------------------------------------------------------------
    # The dp replicas read disjoint shards (step 2); the cp, tp and pp ranks of one replica read the
    # same samples.
    sampler = ShardedSampler(
        len(corpus.blocks), num_replicas=dp, rank=mesh.dp_rank, shuffle=True, seed=config["seed"]
    )
    batches = MicroBatches(corpus.blocks, sampler, config["micro_batch_size"])
    # The same whole model on every rank (the seed's), tensor-parallel over tp, cut into stages over
    # pp: rank keeps one. With --moe-experts, every rank builds every expert, then keeps its own
    # (experts_on_mesh.py).
    stage, named, pipe, shapes = parallelize_on_mesh(
        moe_model(build_model(config, corpus.vocab_size, config["seed"]), config),
        mesh,
        config,
        device,
    )
    take_moe_record(stage)  # forget the tokens dropout's recording run routed
    # --zero 3: each chunk of the stage fully sharded over
    # dp x cp (zero3_on_mesh.py); named: this rank's pieces
    sharded_stages = (
        FullyShardedStages(pipe, named, mesh, config, device) if config["zero"] == 3 else None
    )
    named = sharded_stages.named if sharded_stages else named
    # ZeRO --zero over dp x cp: AdamW's state for a slice (zero_stages.py)
    sharded = optimizer_factory(
        config, timedelta(seconds=config["timeout_s"]) if config["timeout_s"] else None
    )
    optimizer = (
        DenseAndExperts(
            named, config, mesh, sharded
        )  # the dense and the expert parameters, each kind's
        if mesh.experts
        else sharded(named, mesh.dp_cp_group)
    )
    scheduler = make_scheduler(optimizer, config)
    # disabled (no fp16 here): kept for the checkpoint's format
    scaler = make_grad_scaler(config, device)

    env = environment(device, world.world_size, world.backend, config["amp"], corpus)
    env.update(mesh.record())  # the degrees (parity.py: the global batch)
    log = RunLog(config, env, is_writer=world.is_main)
    # Checkpoints: each rank its TP/PP shard, the same
    # whatever dp, any step's read back at any mesh (rule 4).
    writer = (BackgroundWriter if config["async_save"] else CheckpointWriter)(
        config,
        world.rank,
        world.world_size,
        shapes,
        [
            RunState(scheduler, scaler, batches, log),
            FullyShardedShards(sharded_stages, optimizer)
            if sharded_stages
            else MeshShards(named, optimizer, mesh),
        ],
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
        # the same on every tp and pp rank of a replica
        micro_batches = [batches.next() for _ in range(accum)]
        loss_sum, grad_norm, memory, comm = train_step(
            pipe, optimizer, scaler, micro_batches, config, device, named, mesh, sharded_stages
        )
        scheduler.step()

        if device.type == "cuda":
            torch.cuda.synchronize()  # the GPU runs ahead of Python; time the work, not its launch
        step_time = clock.stop()  # before the logging's own work and collectives
        # The loss is where the logits are, on the last stage: sent to the stage's peers, then
        # averaged over dp x cp (a cp rank's loss is the mean over its positions, as many on
        # every rank).
        loss = distributed.mean_over_ranks(
            pipe.from_last_stage(loss_sum, mesh.pp_group), accum, mesh.dp_cp_group
        )
        log.log(
            {
                "step": step + 1,
                # an MoE run's rounded to float32, as step 12 (and step 0) round theirs
                "loss": torch.tensor(loss).float().item() if mesh.experts else loss,
                "grad_norm": grad_norm.item(),
                "param_norm": param_norm(
                    sharded_stages.counted if sharded_stages else counted_once(named, mesh),
                    sharded_stages.norm_groups if sharded_stages else norm_groups(mesh),
                    device,
                ),
                "lr": lr,
                "tokens_per_s": tokens_per_step / step_time["wall_s"],
                "effective_batch_size": config["micro_batch_size"] * accum * dp,
                "epoch": batches.epoch,
                **distributed.gather_per_rank(
                    memory=memory, step_time=step_time, comm=comm.take("norms")
                ),
                # the experts' load and each rank's all-to-all notes, as step 12's
                **(moe_record_on_mesh(stage, mesh) if mesh.experts else {}),
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
    # every rank takes part; rank 0 writes the plain model
    full = (
        gather_fully_sharded(sharded_stages, mesh)
        if sharded_stages
        else gather_full_model(stage, named, mesh)
    )
    if world.is_main:
        final = save_final_weights(Path(config["out"]), {name: full[name] for name in shapes})
        shape, axes = (mesh.pp, dp, mesh.cp, mesh.tp), "pp x dp x cp x tp"
        if mesh.cp == 1:  # three axes, as before --cp
            shape, axes = (mesh.pp, dp, mesh.tp), "pp x dp x tp"
        experts = f", experts over ep {mesh.ep}" if mesh.experts else ""
        # the default, ZeRO-1, unsaid
        zero = (
            f", {('DDP', '', 'ZeRO-2', 'ZeRO-3')[config['zero']]} over "
            f"{'dp x cp' if mesh.cp > 1 else 'dp'}"
            if config["zero"] != 1
            else ""
        )
        log.finish(
            final,
            f" on a {' x '.join(map(str, shape))} ({axes}) mesh{experts}{zero} ({world.backend})",
        )
    distributed.shutdown()


if __name__ == "__main__":
    exit_on_user_error(main)
