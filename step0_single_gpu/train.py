"""Step 0: the single-process baseline every later step is measured against.

One process, on the CPU or one GPU: a manual training loop with gradient accumulation, AMP,
clipping, a warm-up + cosine schedule, bitwise-exact checkpoint/resume and a per-step log.

    python step0_single_gpu/train.py                 # about 20 s on 2 CPU cores
    python step0_single_gpu/train.py --resume        # continue from the latest checkpoint in --out
"""
import os
from pathlib import Path

import torch
from torch.utils.data import DistributedSampler

from checkpoint import (CheckpointWriter, clear_checkpoints, find_checkpoint, load_optimizer, load_parameters,
                        open_checkpoint, optimizer_slices)
from config import UserError, build_parser, exit_on_user_error, limit_memory, parse_config
from data import MicroBatches, check_enough_data, load_corpus
from metrics import RunLog, StepClock, environment, memory_stats, save_final_weights
from model import build_model, language_model_loss
from seeding import rng_state, seed_everything
from training import (autocast, check_amp, clip_gradients, make_grad_scaler, make_optimizer, make_scheduler,
                      param_norm, pick_device)

STEP = Path(__file__).resolve().parent.name


def main():
    # ---- everything that can be wrong is checked before anything is written ------------------
    config = parse_config(build_parser(STEP))
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:  # torchrun started several copies: each would train alone
        raise UserError(f"{STEP} is one process, but torchrun started {os.environ['WORLD_SIZE']}: each would train "
                        "the whole model alone and write the same --out; run it with python, or run "
                        "step1_torch_ddp under torchrun")
    device = pick_device(config["device"])
    check_amp(config["amp"], device)
    seed_everything(config["seed"])
    corpus = load_corpus(config["data"], config["tokenizer"], config["seq_len"])
    limit_memory(config["max_memory_mb"], STEP)  # the budget: what training adds to libraries and data
    check_enough_data(len(corpus.blocks), 1, config["micro_batch_size"], config["grad_accum"])
    resume_from = find_checkpoint(config["resume"], config["out"])
    resumed = open_checkpoint(resume_from, config, 1, is_main=True) if resume_from else None

    # ---- data, model, optimiser ----------------------------------------------------------------
    # One replica makes this sampler a seeded shuffle, new each epoch. Step 1 uses the same sampler
    # with N replicas: one process accumulating A*N micro-batches sees the global batches that N
    # ranks accumulating A micro-batches see.
    sampler = DistributedSampler(range(len(corpus.blocks)), num_replicas=1, rank=0, shuffle=True, seed=config["seed"])
    batches = MicroBatches(corpus.blocks, sampler, config["micro_batch_size"])
    model = build_model(config, corpus.vocab_size, config["seed"]).to(device)
    optimizer = make_optimizer(model.named_parameters(), config)
    scheduler = make_scheduler(optimizer, config)
    scaler = make_grad_scaler(config, device)

    start_step, records = 0, []
    if resumed:
        load_parameters(model.named_parameters(), resumed)
        load_optimizer(optimizer, resumed, optimizer_slices(optimizer, model.named_parameters()))
        start_step, records = resumed.restore(scheduler, scaler, batches, 0, 1)  # RNG last
        print(f"resumed from {resume_from} at step {start_step}")
    else:
        clear_checkpoints(config["out"])

    env = environment(device, 1, None, config["amp"], corpus.data_sha256, corpus.tokenizer_sha256, len(corpus.blocks))
    log = RunLog(config, env, is_writer=True, records=records)
    writer = CheckpointWriter(config, 0, 1, {name: p.shape for name, p in model.named_parameters()})
    accum = config["grad_accum"]
    tokens_per_step = config["micro_batch_size"] * accum * config["seq_len"]

    # ---- the training loop ---------------------------------------------------------------------
    for step in range(start_step, config["steps"]):
        clock = StepClock()  # this rank's wall and CPU time for the step
        lr = scheduler.get_last_lr()[0]
        loss_sum = torch.zeros((), device=device)
        for micro_step in range(accum):
            inputs, targets = batches.next()
            with autocast(config["amp"], device):
                loss = language_model_loss(model, inputs.to(device), targets.to(device))
            # Summing loss/accum over the micro-batches makes the gradient the mean over the global batch.
            scaler.scale(loss / accum).backward()
            loss_sum += loss.detach()

        scaler.unscale_(optimizer)  # clip (and log) the true gradient, not the loss-scaled one
        grad_norm = clip_gradients(model.parameters(), config["grad_clip"])
        scaler.step(optimizer)  # skipped by the scaler if fp16 gradients overflowed
        scaler.update()
        scheduler.step()
        memory = memory_stats(model.parameters(), optimizer, device)  # before zero_grad frees the grads
        optimizer.zero_grad(set_to_none=True)

        if device.type == "cuda":
            torch.cuda.synchronize()  # the GPU runs ahead of Python; time the work, not its launch
        step_time = clock.stop()  # before the logging's own work and collectives
        log.log({
            "step": step + 1,
            "loss": (loss_sum / accum).item(),
            "grad_norm": grad_norm.item(),
            "param_norm": param_norm(model.parameters()),
            "lr": lr,
            "tokens_per_s": tokens_per_step / step_time["wall_s"],
            "effective_batch_size": config["micro_batch_size"] * accum,
            "epoch": batches.epoch,
            "memory": [memory],  # one entry per rank
            "step_time": [step_time],
        })
        if config["save_every"] and (step + 1) % config["save_every"] == 0:
            shared = {"step": step + 1, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                      "optimizer_slices": optimizer_slices(optimizer, model.named_parameters()),
                      "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
                      "data": batches.state_dict(), "records": log.records}
            writer.save(step + 1, shared, {"rng": rng_state()})

    writer.wait()  # the last checkpoint is whole on disk before the run says it is done
    final = save_final_weights(Path(config["out"]), dict(model.named_parameters()))
    final["param_norm"] = param_norm(model.parameters())
    log.write(final)
    print(f"done: {config['steps']} steps, final loss {log.records[-1]['loss']:.4f}, weights in {config['out']}")


if __name__ == "__main__":
    exit_on_user_error(main)
