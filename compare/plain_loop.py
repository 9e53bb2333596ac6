"""The training loop a learner writes in an afternoon, on the same model and data: what step 0's
speed is measured against (compare/gpu_check.py). No exact norms, no checkpoints, no per-step
records: torch's defaults (AdamW's multi-tensor kernel on a GPU), bf16 autocast on CUDA,
``clip_grad_norm_``, and ``loss.item()`` once a step, as nanoGPT's loop logs it. Deterministic
kernels as every step runs them, or ``--nondeterministic`` as torch runs by default (each step takes
the flag too).

    python compare/plain_loop.py --attention sdpa --n-layer 12 --n-head 12 --n-embd 768 \\
        --seq-len 1024 \\
        --micro-batch-size 16 --steps 20 --warmup 5 [--compile] [--nondeterministic]

It takes step 0's flags (the ones it does not use are ignored) and prints one JSON line: tokens/s
over the steps after --warmup, and the peak CUDA bytes.
"""

import json
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "common"))
from config import build_parser, exit_on_user_error, parse_config  # noqa: E402
from data import MicroBatches, load_corpus  # noqa: E402
from model import build_model, language_model_loss  # noqa: E402
from training import adamw_param_groups, autocast, pick_device  # noqa: E402


def main():
    parser = build_parser("plain_loop")
    parser.add_argument(
        "--warmup", type=int, default=5, help="steps before the clock starts (compilation, caches)"
    )
    config = parse_config(parser)
    device = pick_device(config["device"])
    if config["deterministic"]:
        torch.use_deterministic_algorithms(True)
        torch.utils.deterministic.fill_uninitialized_memory = False
    torch.manual_seed(config["seed"])
    corpus = load_corpus(config["data"], config["tokenizer"], config["seq_len"])
    sampler = DistributedSampler(
        range(len(corpus.blocks)), num_replicas=1, rank=0, shuffle=True, seed=config["seed"]
    )
    batches = MicroBatches(corpus.blocks, sampler, config["micro_batch_size"])
    model = build_model(config, corpus.vocab_size, config["seed"]).to(device)
    if config["compile"]:
        for block in model.transformer.h:
            block.compile()
    optimizer = torch.optim.AdamW(
        adamw_param_groups(model.named_parameters(), config),
        lr=config["lr"],
        betas=(config["beta1"], config["beta2"]),
    )
    accum = config["grad_accum"]
    started = None
    for step in range(config["steps"]):
        if step == config["warmup"]:
            if device.type == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
        for _ in range(accum):
            inputs, targets = batches.next()
            with autocast(config["amp"], device):
                loss = language_model_loss(model, inputs.to(device), targets.to(device))
            (loss / accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config["grad_clip"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()
    if device.type == "cuda":
        torch.cuda.synchronize()
    timed = config["steps"] - config["warmup"]
    tokens = timed * accum * config["micro_batch_size"] * config["seq_len"]
    print(
        json.dumps(
            {
                "tokens_per_s": tokens / (time.perf_counter() - started) if timed > 0 else None,
                "cuda_peak": torch.cuda.max_memory_allocated(device)
                if device.type == "cuda"
                else None,
            }
        )
    )


if __name__ == "__main__":
    exit_on_user_error(main)
