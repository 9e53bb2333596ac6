"""Step 1's loop written with Hugging Face Accelerate:
what a library does for the lines step 1 writes by hand.

    # runs/accelerate_reference
    torchrun --standalone --nproc_per_node=2 compare/accelerate_reference.py
    # the Accelerate way
    accelerate launch --multi_gpu --num_processes 2 compare/accelerate_reference.py
    python compare/parity.py step1 runs/accelerate_reference                          # PASS

``accelerate launch --multi_gpu`` starts the ranks through torchrun, on a CPU too (``--cpu`` would
start one process).

It takes step 1's flags (float32, no --amp). The same model, initial weights and AdamW;
``Accelerator`` joins the process group, ``prepare`` wraps the model in PyTorch's
DistributedDataParallel (as step 1 does) and the optimiser in a wrapper that steps and zeroes only
on the last micro-batch; ``accumulate`` is step 1's ``no_sync()`` on the others, ``backward``
divides the loss by the accumulation count, ``clip_grad_norm_`` is
``torch.nn.utils.clip_grad_norm_``. Two things stay step 1's, each because Accelerate's own would
train on other numbers: the data (a prepared DataLoader gives rank r whole micro-batches r, r + N,
... of one shuffle, where ``DistributedSampler`` deals single samples: the same global batch in
another grouping, other float sums) and the learning-rate schedule (a prepared scheduler steps once
per rank per optimiser step: it counts samples). step1_torch_ddp/README.md sets the two loops side
by side, with the measured result: bitwise to step 1 with ``--grad-clip 0``; with clipping, torch's
``clip_grad_norm_`` takes the norm from per-tensor float32 norms where step 1 adds squares in
float64, so the norms differ by about 1e-6 relative and the weights drift by ~1e-7.
"""

import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs
from torch.utils.data import DistributedSampler

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "common")]
import distributed  # noqa: E402
from config import UserError, build_parser, exit_on_user_error, parse_config  # noqa: E402
from data import MicroBatches, load_corpus  # noqa: E402
from metrics import RunLog, StepClock, environment, memory_stats, save_final_weights  # noqa: E402
from model import build_model, language_model_loss  # noqa: E402
from seeding import seed_everything  # noqa: E402
from training import make_optimizer, make_scheduler, param_norm  # noqa: E402


def main():
    parser = build_parser("accelerate_reference")
    distributed.add_flags(parser)
    config = parse_config(parser)
    if config["reduce_dtype"] != "float32" or config["amp"] != "none":
        raise UserError(
            "the Accelerate reference is step 1 in float32: drop --reduce-dtype and --amp"
        )
    # the device the steps would pick; Accelerate joins the group itself
    world = distributed.plan_world(config)
    seed_everything(config["seed"], config["deterministic"])
    corpus = load_corpus(config["data"], config["tokenizer"], config["seq_len"])
    accum = config["grad_accum"]
    # Accelerate joins the process group itself (gloo on CPUs, nccl on GPUs), with our timeout.
    accelerator = Accelerator(
        gradient_accumulation_steps=accum,
        cpu=world.device.type == "cpu",
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=config["timeout_s"]))],
    )
    device, rank, world_size = (
        accelerator.device,
        accelerator.process_index,
        accelerator.num_processes,
    )

    sampler = DistributedSampler(
        range(len(corpus.blocks)),
        num_replicas=world_size,
        rank=rank,
        shuffle=True,
        seed=config["seed"],
    )
    batches = MicroBatches(corpus.blocks, sampler, config["micro_batch_size"])
    model = build_model(config, corpus.vocab_size, config["seed"])
    optimizer = make_optimizer(model.named_parameters(), config)
    # not prepared: stepped once per optimiser step, as in step 1
    scheduler = make_scheduler(optimizer, config)
    # DistributedDataParallel, AcceleratedOptimizer
    model, optimizer = accelerator.prepare(model, optimizer)

    env = environment(
        device,
        world_size,
        dist.get_backend() if dist.is_initialized() else "none",
        config["amp"],
        corpus,
    )
    log = RunLog(config, env, is_writer=accelerator.is_main_process)
    tokens_per_step = config["micro_batch_size"] * accum * config["seq_len"] * world_size
    for step in range(config["steps"]):
        clock = StepClock()
        lr = scheduler.get_last_lr()[0]
        loss_sum = torch.zeros((), device=device)
        for _ in range(accum):
            inputs, targets = batches.next()
            with accelerator.accumulate(model):  # no_sync() but on the last micro-batch
                loss = language_model_loss(model, inputs.to(device), targets.to(device))
                accelerator.backward(loss)  # (loss / accum).backward()
                # the last micro-batch: gradients averaged over the ranks
                if accelerator.sync_gradients:
                    grad_norm = (
                        accelerator.clip_grad_norm_(model.parameters(), config["grad_clip"])
                        # max_norm 0 would zero every gradient
                        if config["grad_clip"] > 0
                        else torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
                    )
                    memory = memory_stats(model.parameters(), optimizer.optimizer, device)
                optimizer.step()  # only when the gradients are synchronised
                optimizer.zero_grad(set_to_none=True)
            loss_sum += loss.detach()
        scheduler.step()
        loss_mean = loss_sum.double()
        dist.all_reduce(loss_mean)
        step_time = clock.stop()
        log.log(
            {
                "step": step + 1,
                "loss": loss_mean.item() / (accum * world_size),
                "grad_norm": grad_norm.item(),
                "param_norm": param_norm(model.parameters()),
                "lr": lr,
                "tokens_per_s": tokens_per_step / step_time["wall_s"],
                "effective_batch_size": config["micro_batch_size"] * accum * world_size,
                "epoch": batches.epoch,
                **distributed.gather_per_rank(memory=memory, step_time=step_time),
            }
        )

    weights = dict(accelerator.unwrap_model(model).named_parameters())
    if accelerator.is_main_process:
        final = save_final_weights(Path(config["out"]), weights)
        log.write(final)
        print(
            f"done: {config['steps']} steps, Accelerate over {world_size} ranks, final loss "
            f"{log.records[-1]['loss']:.4f}, weights in {config['out']}"
        )
    # Accelerate's references to the DDP model: its reducer must go before the group
    accelerator.free_memory()
    del model, optimizer, weights
    distributed.shutdown()


if __name__ == "__main__":
    exit_on_user_error(main)
