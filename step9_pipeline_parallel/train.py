"""Step 9: pipeline parallelism, written by hand (pipeline.py):
the model cut into stages, one per rank.

Grown from step 3's train.py, but all ranks together are ONE replica: rank s holds stage s
(consecutive blocks), every rank reads step 0's micro-batches, and each optimiser step pushes them
through the pipeline, --micro-batches at a time, by --schedule (gpipe, 1f1b, interleaved-1f1b,
zero-bubble). Bitwise identical to step 0.

    torchrun --standalone --nproc_per_node=2 step9_pipeline_parallel/train.py --grad-accum 4
    python step0_single_gpu/train.py --grad-accum 4 && python compare/parity.py step0 step9
"""

from pathlib import Path

import torch
import torch.distributed as dist

import distributed
from background_writer import BackgroundWriter, add_async_save_flag
from checkpoint import CheckpointWriter, RunState
from checkpoint_files import find_checkpoint
from comm_accounting import take_comm_bytes
from config import Preemption, build_parser, exit_on_user_error, limit_memory, parse_config
from data import MicroBatches, check_enough_data, load_corpus
from metrics import RunLog, StepClock, environment, memory_stats, save_final_weights
from model import build_model
from pipeline_setup import add_pipeline_flags, check_pipeline, pipeline_gpt2, virtual_stages
from pipeline_stages import GPT2Stage
from pipeline_state import PipelineState, gather_full_model, owned
from resharding import open_checkpoint
from sampler import ShardedSampler
from seeding import seed_everything
from sharded_norms import clip_grad_norm, param_norm
from training import (
    check_amp,
    make_grad_scaler,
    make_optimizer,
    make_scheduler,
)

STEP = Path(__file__).resolve().parent.name


def train_step(
    pipe, optimizer, scaler, micro_batches: list, config: dict, device, named: list
) -> tuple:
    """One optimiser step on ``micro_batches`` (the same on every stage), pushed through the
    pipeline ``--micro-batches`` at a time; this stage's gradients (``named``: by the model's names)
    unscaled, clipped with every stage's norm, applied. Returns the losses' sum (the last stage's;
    zero elsewhere), the gradient norm, this stage's memory. Forwards and backwards interleave: no
    phases to name apart for the profiler."""
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
    pipe.finish_gradient_synchronization()  # the tied embedding's gradient, and every send waited

    scaler.unscale_(optimizer)
    # one norm from
    grad_norm = clip_grad_norm(
        [p for _, p in named],
        config["grad_clip"],
        [dist.group.WORLD],
        # every stage's gradients
        counted=[p for _, p in owned(named)],
        device=device,
    )
    # each stage steps its own parameters (both copies of the tie step alike)
    scaler.step(optimizer)
    scaler.update()
    memory = memory_stats(
        (p for _, p in named), optimizer, device, micro_batches_in_flight=pipe.take_peak_in_flight()
    )
    optimizer.zero_grad(set_to_none=True)
    return loss_sum, grad_norm, memory


def main():
    # ---- everything that can be wrong is checked before anything is written or connected -----
    parser = build_parser(STEP)
    distributed.add_flags(parser)
    add_async_save_flag(parser)  # --async-save (background_writer.py)
    add_pipeline_flags(parser)  # --schedule, --virtual-stages, --micro-batches
    parser.add_argument(
        "--trace", action="store_true", help="write the stages' timelines of the last step"
    )
    config = parse_config(parser)
    distributed.refuse_compile(config)  # its communication runs in or around the blocks
    world = distributed.plan_world(config)
    check_pipeline(config, world.world_size)
    check_amp(config["amp"], world.device)
    seed_everything(config["seed"], config["deterministic"])
    corpus = load_corpus(config["data"], config["tokenizer"], config["seq_len"])
    # the budget: what training adds to libraries and data
    limit_memory(config["max_memory_mb"], STEP, world.device)
    check_enough_data(len(corpus.blocks), 1, config["micro_batch_size"], config["grad_accum"])
    resume_from = find_checkpoint(config["resume"], config["out"])
    # one replica: as step 0
    resumed = open_checkpoint(resume_from, config, 1, world.is_main) if resume_from else None
    device, stage_index, num_stages = (
        distributed.join(world, config["timeout_s"]),
        world.rank,
        world.world_size,
    )

    # ---- data, model, optimiser ----------------------------------------------------------------
    # One replica: every stage draws step 0's micro-batches (the first reads the inputs, the last
    # the targets).
    sampler = ShardedSampler(
        len(corpus.blocks), num_replicas=1, rank=0, shuffle=True, seed=config["seed"]
    )
    batches = MicroBatches(corpus.blocks, sampler, config["micro_batch_size"])
    # Every rank builds the whole model (a pure function of the seed), cuts it into stages and keeps
    # its own: its parameters by the model's names, and the Pipeline that runs it (step 0's loss on
    # the last stage).
    model = build_model(config, corpus.vocab_size, config["seed"]).to(device)
    shapes = {name: p.shape for name, p in model.named_parameters()}  # what the final weights hold
    # the model's stages: V per rank with --schedule interleaved-1f1b
    chunks = num_stages * virtual_stages(config)
    stages = [GPT2Stage(model, s, chunks) for s in range(chunks)]
    stage, named, pipe = pipeline_gpt2(
        stages, stage_index, config, device, torch.nn.functional.cross_entropy
    )
    del model, stages
    optimizer = make_optimizer(named, config)
    scheduler = make_scheduler(optimizer, config)
    # disabled (no fp16 here): kept for the checkpoint's format
    scaler = make_grad_scaler(config, device)

    env = environment(device, world.world_size, world.backend, config["amp"], corpus)
    # compare/parity.py: the global batch is one replica's
    env.update(pipeline_stages=num_stages, data_parallel_size=1)
    log = RunLog(config, env, is_writer=world.is_main)
    # Checkpoints: one process's (one RNG stream), gathered
    # to rank 0, read by name wherever the stages now cut.
    writer = (BackgroundWriter if config["async_save"] else CheckpointWriter)(
        config,
        world.rank,
        1,
        shapes,
        [RunState(scheduler, scaler, batches, log), PipelineState(named, optimizer)],
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
        if config["trace"] and step == config["steps"] - 1:
            pipe.timeline = []  # the last step's forwards, backwards, sends and receives
        # the same micro-batches on every stage
        micro_batches = [batches.next() for _ in range(accum)]
        loss_sum, grad_norm, memory = train_step(
            pipe, optimizer, scaler, micro_batches, config, device, named
        )
        scheduler.step()

        if device.type == "cuda":
            torch.cuda.synchronize()  # the GPU runs ahead of Python; time the work, not its launch
        step_time = clock.stop()  # before the logging's own work and collectives
        log.log(
            {
                "step": step + 1,
                # where the logits are: the last stage's
                "loss": pipe.from_last_stage(loss_sum / accum).item(),
                "grad_norm": grad_norm.item(),
                "param_norm": param_norm((p for _, p in owned(named)), [dist.group.WORLD], device),
                "lr": lr,
                "tokens_per_s": tokens_per_step / step_time["wall_s"],
                "effective_batch_size": config["micro_batch_size"] * accum,
                "epoch": batches.epoch,
                # per stage
                **distributed.gather_per_rank(
                    memory=memory, step_time=step_time, comm=take_comm_bytes()
                ),
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
    full = gather_full_model(named, world.is_main)
    if pipe.timeline is not None:
        from pipeline_trace import write_trace  # operations code, read it after the lesson

        write_trace(
            pipe.timeline,
            stage_index,
            num_stages,
            Path(config["out"]),
            len(pipe.chunks),
            pipe.schedule,
        )
    if world.is_main:
        final = save_final_weights(Path(config["out"]), {name: full[name] for name in shapes})
        log.finish(
            final, f" on {num_stages} pipeline stages ({world.backend}, {config['schedule']})"
        )
    distributed.shutdown()


if __name__ == "__main__":
    exit_on_user_error(main)
