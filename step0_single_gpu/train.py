"""Step 0: the single-process baseline every later step is measured against.

One process, on the CPU or one GPU: a manual training loop with gradient accumulation, AMP,
clipping, a warm-up + cosine schedule, bitwise-exact checkpoint/resume and a per-step log.

    python step0_single_gpu/train.py                 # about 20 s on 2 CPU cores
    python step0_single_gpu/train.py --resume        # continue from the latest checkpoint in --out
"""

from pathlib import Path

import torch
from torch.profiler import record_function
from torch.utils.data import DistributedSampler

from checkpoint import CheckpointWriter, RunState, WholeModel, open_checkpoint
from checkpoint_files import find_checkpoint
from config import Preemption, build_parser, exit_on_user_error, limit_memory, parse_config
from data import MicroBatches, check_enough_data, load_corpus
from fp8 import add_fp8_flag, check_fp8, convert_to_fp8
from metrics import RunLog, StepClock, environment, memory_stats, save_final_weights
from model import build_model, compile_blocks, language_model_loss
from moe_setup import add_moe_flags, check_moe, moe_model, take_moe_record, with_aux_loss  # MoE
from seeding import seed_everything
from training import (
    add_param_dtype_flag,
    autocast,
    check_amp,
    check_one_process,
    check_param_dtype,
    clip_grad_norm,
    float32_masters,
    make_grad_scaler,
    make_optimizer,
    make_scheduler,
    param_dtype,
    param_norm,
    pick_device,
)

STEP = Path(__file__).resolve().parent.name


def train_step(
    model, optimizer, scaler, micro_batches: list, config: dict, device, masters=None
) -> tuple:
    """One optimiser step on ``micro_batches`` (a list of (inputs, targets)): forward and backward
    on each, then the gradients unscaled, clipped and applied (``masters``: the float32 (name,
    master) pairs AdamW steps with --param-dtype). Returns what the loop logs: the losses' sum, the
    gradient norm before clipping, the memory. The phases are named for torch.profiler
    (compare/peak_memory.py reads them): free when no profiler runs."""
    trained = masters or list(model.named_parameters())  # what AdamW steps, by name
    accum = len(micro_batches)
    loss_sum = torch.zeros((), device=device)
    for inputs, targets in micro_batches:
        with record_function("forward"), autocast(config["amp"], device):
            loss = language_model_loss(model, inputs.to(device), targets.to(device))
        with record_function("backward"):
            # Summing loss/accum over the micro-batches makes
            # the gradient the mean over the global batch.
            # MoE: + a * load-balancing loss
            scaler.scale(with_aux_loss(model, loss, config) / accum).backward()
        loss_sum += loss.detach()
        # the micro-batches' 16-bit gradients summed in float32, as the sharded steps sum them
        if masters:
            for (_, master), p in zip(masters, model.parameters()):
                master.grad = p.grad.float() if master.grad is None else master.grad.add_(p.grad)
                p.grad = None

    with record_function("optimizer"):
        scaler.unscale_(optimizer)  # clip (and log) the true gradient, not the loss-scaled one
        grad_norm = clip_grad_norm([p for _, p in trained], config["grad_clip"])
        scaler.step(optimizer)  # skipped by the scaler if fp16 gradients overflowed
        if masters:
            with torch.no_grad():  # the model's 16-bit copy, rounded once from the updated masters
                for (_, master), p in zip(masters, model.parameters()):
                    p.copy_(master)
        scaler.update()
        # before zero_grad frees the grads
        memory = memory_stats(
            model.parameters(),
            optimizer,
            device,
            grads=[p.grad for _, p in trained if p.grad is not None],
            masters=[master for _, master in masters or []],  # none without --param-dtype: 0 bytes
        )
        optimizer.zero_grad(set_to_none=True)
    return loss_sum, grad_norm, memory


def main():
    # ---- everything that can be wrong is checked before anything is written ------------------
    parser = build_parser(STEP)
    add_param_dtype_flag(parser)
    add_fp8_flag(parser)  # --fp8 tensorwise|rowwise (fp8.py)
    add_moe_flags(parser)  # MoE
    config = parse_config(parser)
    check_moe(config)  # MoE
    check_one_process(STEP)  # not several copies under torchrun, each training alone
    device = pick_device(config["device"])
    check_amp(config["amp"], device)
    # --fp8: no --amp fp16, sizes multiples of 16, a device with _scaled_mm
    check_fp8(config, device)
    check_param_dtype(config, device)
    seed_everything(config["seed"], config["deterministic"])
    corpus = load_corpus(config["data"], config["tokenizer"], config["seq_len"])
    # the budget: what training adds to libraries and data
    limit_memory(config["max_memory_mb"], STEP, device)
    check_enough_data(len(corpus.blocks), 1, config["micro_batch_size"], config["grad_accum"])
    resume_from = find_checkpoint(config["resume"], config["out"])
    # the whole state, or refused
    resumed = open_checkpoint(resume_from, config) if resume_from else None

    # ---- data, model, optimiser ----------------------------------------------------------------
    # One replica makes this sampler a seeded shuffle, new each epoch. Step 1 uses the same sampler
    # with N replicas: one process accumulating A*N micro-batches sees the global batches that N
    # ranks accumulating A micro-batches see.
    sampler = DistributedSampler(
        range(len(corpus.blocks)), num_replicas=1, rank=0, shuffle=True, seed=config["seed"]
    )
    batches = MicroBatches(corpus.blocks, sampler, config["micro_batch_size"])
    # MoE: moe_model
    model = moe_model(build_model(config, corpus.vocab_size, config["seed"]), config).to(device)
    # the blocks' nn.Linears multiply in FP8; embeddings, output layer stay (fp8.py)
    if config["fp8"]:
        convert_to_fp8(model.transformer.h, config["fp8"])
    # block by block: the parameters keep their names, the loop does not change
    if config["compile"]:
        compile_blocks(model)
    # --param-dtype bf16|fp16: AdamW steps a float32 master of every parameter; the model computes
    # in a 16-bit copy, rounded from the masters after every step (the sharded steps keep 1/N of
    # the masters).
    masters = float32_masters(model, param_dtype(config))  # None without --param-dtype
    trained = masters or list(model.named_parameters())  # what AdamW steps, by name
    optimizer = make_optimizer(trained, config)
    scheduler = make_scheduler(optimizer, config)
    scaler = make_grad_scaler(config, device)

    env = environment(device, 1, None, config["amp"], corpus)
    log = RunLog(config, env, is_writer=True)
    # What a checkpoint holds, each part saving and loading its own state (checkpoint.py).
    writer = CheckpointWriter(
        config, [RunState(scheduler, scaler, batches, log), WholeModel(model, optimizer, masters)]
    )
    start_step = writer.start(resumed)  # every part loaded, the RNG last; or a fresh start in --out
    accum = config["grad_accum"]
    tokens_per_step = config["micro_batch_size"] * accum * config["seq_len"]

    # ---- the training loop ---------------------------------------------------------------------
    # --preempt-grace-s: SIGTERM saves, then exits
    preemption = Preemption(config["preempt_grace_s"])
    for step in range(start_step, config["steps"]):
        clock = StepClock()  # this rank's wall and CPU time for the step
        lr = scheduler.get_last_lr()[0]
        micro_batches = [batches.next() for _ in range(accum)]
        loss_sum, grad_norm, memory = train_step(
            model, optimizer, scaler, micro_batches, config, device, masters
        )
        scheduler.step()

        if device.type == "cuda":
            torch.cuda.synchronize()  # the GPU runs ahead of Python; time the work, not its launch
        step_time = clock.stop()  # before the logging's own work and collectives
        log.log(
            {
                "step": step + 1,
                "loss": (loss_sum / accum).item(),
                "grad_norm": grad_norm.item(),
                "param_norm": param_norm(p for _, p in trained),
                "lr": lr,
                "tokens_per_s": tokens_per_step / step_time["wall_s"],
                "effective_batch_size": config["micro_batch_size"] * accum,
                "epoch": batches.epoch,
                "memory": [memory],  # one entry per rank
                "step_time": [step_time],
                **take_moe_record(model),  # MoE: aux loss, tokens per expert, dropped fraction
            }
        )
        # a SIGTERM came: the run stops after this step
        preempted = preemption.signalled()
        if preempted or (config["save_every"] and (step + 1) % config["save_every"] == 0):
            writer.save(step + 1)
        if preempted:
            preemption.leave(writer, step + 1, config["out"])  # says where it saved, exits 4

    final = save_final_weights(Path(config["out"]), dict(trained))
    log.finish(final)


if __name__ == "__main__":
    exit_on_user_error(main)
