"""Step 8's training with PyTorch's own tensor parallelism: the run step 8 must equal, bit for bit.

    torchrun --standalone --nproc_per_node=2 compare/tp_reference.py   # writes runs/tp_reference
    python compare/parity.py step8 runs/tp_reference                   # PASS (bitwise identical)

It takes step 8's flags. The model is the same GPT-2 (common/model.py, the same initial weights),
and ``parallelize_module`` gets step 8's plan in PyTorch's styles: ``ColwiseParallel`` for each
block's c_q, c_k, c_v (a contiguous block of rows: whole heads) and c_fc, and for the output layer
with its logits left sharded;
``RowwiseParallel`` for both c_proj and the token embedding; the loss under ``loss_parallel()``. One
thing the built-in does not do for GPT-2, done here: it breaks the tie between the embedding and the
output layer (each gets its own DTensor), so the tie is made again. The attention reads its number
of heads off the width: it runs on the local heads as it is. The loop is step 8's: same data, AMP,
accumulation, clipping by the norm of the whole gradient (computed exactly, as step 8 does), AdamW.
The final weights are gathered by name and written as they are, so parity.py compares them.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from torch.utils.data import DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "common"))
import distributed  # noqa: E402
from config import UserError, build_parser, exit_on_user_error, parse_config  # noqa: E402
from data import MicroBatches, load_corpus  # noqa: E402
from metrics import RunLog, StepClock, environment, memory_stats, save_final_weights  # noqa: E402
from model import build_model  # noqa: E402
from seeding import seed_everything  # noqa: E402
from sharded_norms import param_norm  # noqa: E402
from training import (  # noqa: E402
    autocast,
    check_amp,
    make_grad_scaler,
    make_optimizer,
    make_scheduler,
    scale_gradients,
    sum_of_squares,
)

# Step 8's plan (tensor_parallel.BLOCK_PLAN), in PyTorch's styles: a style per layer of every block.
BLOCK_PLAN = {
    "attn.c_q": ColwiseParallel,
    "attn.c_k": ColwiseParallel,
    "attn.c_v": ColwiseParallel,
    "attn.c_proj": RowwiseParallel,
    "mlp.c_fc": ColwiseParallel,
    "mlp.c_proj": RowwiseParallel,
}


def sequence_parallel_plan(n_layer: int) -> dict:
    """Step 8's plan with --sequence-parallel, as torchtitan writes it for Llama: the activations
    between the layers ``Shard(1)`` (split along the sequence), ``SequenceParallel`` LayerNorms,
    each attention and MLP gathering its input once (``PrepareModuleInput``), the row-parallel
    layers reduce-scattering into ``Shard(1)``. GPT-2's learned position embedding (Llama has none)
    gives each rank its block of positions (``Shard(0)``)."""
    gather = lambda: PrepareModuleInput(
        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
    )  # noqa: E731
    plan = {
        "transformer.wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "transformer.wpe": PrepareModuleOutput(
            output_layouts=Replicate(), desired_output_layouts=Shard(0)
        ),
        "transformer.ln_f": SequenceParallel(),
        "lm_head": ColwiseParallel(
            input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False
        ),
    }
    for i in range(n_layer):
        plan.update(
            {
                f"transformer.h.{i}.{name}": style
                for name, style in {
                    "ln_1": SequenceParallel(),
                    "attn": gather(),
                    "attn.c_q": ColwiseParallel(),
                    "attn.c_k": ColwiseParallel(),
                    "attn.c_v": ColwiseParallel(),
                    "attn.c_proj": RowwiseParallel(output_layouts=Shard(1)),
                    "ln_2": SequenceParallel(),
                    "mlp": gather(),
                    "mlp.c_fc": ColwiseParallel(),
                    "mlp.c_proj": RowwiseParallel(output_layouts=Shard(1)),
                }.items()
            }
        )
    return plan


def parallelize(model, mesh, sequence_parallel: bool = False):
    """Our GPT-2 -> PyTorch tensor parallelism over ``mesh``,
    with step 8's plan (and --sequence-parallel's)."""
    plan = {
        "transformer.wte": RowwiseParallel(input_layouts=Replicate()),
        # logits stay sharded
        "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
        **{
            f"transformer.h.{i}.{name}": style()
            for i in range(len(model.transformer.h))
            for name, style in BLOCK_PLAN.items()
        },
    }
    parallelize_module(
        model, mesh, sequence_parallel_plan(len(model.transformer.h)) if sequence_parallel else plan
    )
    # both Shard(0) of the same matrix: tie them again
    model.lm_head.weight = model.transformer.wte.weight
    return model


def local(t):
    return t._local_tensor if isinstance(t, DTensor) else t


def counted_once(params) -> list:
    """Which parameters this rank counts in a norm of the whole model, as step 8 counts them: shards
    on every rank, replicas on rank 0 only (a row-parallel bias is a DTensor too, but
    ``Replicate``)."""
    first = dist.get_rank() == 0
    return [
        p
        for p in params
        if first or (isinstance(p, DTensor) and any(x.is_shard() for x in p.placements))
    ]


def full_weights(model) -> dict:
    """Every parameter whole, by name (the model's own layout: nothing to undo)."""
    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().contiguous()
        for name, p in model.named_parameters()
    }


def main():
    parser = build_parser("tp_reference")
    distributed.add_flags(parser)
    parser.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="step 8's --sequence-parallel: PyTorch's plan",
    )
    config = parse_config(parser)
    if config["reduce_dtype"] != "float32":
        raise UserError(
            "PyTorch's tensor parallelism all-reduces in the activations' dtype: drop "
            "--reduce-dtype"
        )
    if config["sequence_parallel"] and config["dropout"] > 0:
        raise UserError(
            "PyTorch's sequence-parallel dropout draws the same mask on every rank's block of the "
            "sequence, step 8 one process's mask: compare them with --dropout 0"
        )
    world = distributed.plan_world(config)
    check_amp(config["amp"], world.device)
    seed_everything(config["seed"], config["deterministic"])
    corpus = load_corpus(config["data"], config["tokenizer"], config["seq_len"])
    if config["n_head"] % world.world_size or corpus.vocab_size % world.world_size:
        raise UserError(
            f"{world.world_size} ranks must divide --n-head {config['n_head']} and the vocabulary "
            f"({corpus.vocab_size})"
        )
    distributed.join(world, config["timeout_s"])
    device = world.device
    mesh = init_device_mesh(device.type, (world.world_size,))

    sampler = DistributedSampler(
        range(len(corpus.blocks)), num_replicas=1, rank=0, shuffle=True, seed=config["seed"]
    )
    batches = MicroBatches(corpus.blocks, sampler, config["micro_batch_size"])
    model = parallelize(
        build_model(config, corpus.vocab_size, config["seed"]).to(device),
        mesh,
        config["sequence_parallel"],
    )
    params = list(model.parameters())
    optimizer = make_optimizer(model.named_parameters(), config)
    scheduler = make_scheduler(optimizer, config)
    scaler = make_grad_scaler(config, device)
    env = environment(device, world.world_size, world.backend, config["amp"], corpus)
    env.update(tensor_parallel_size=world.world_size, data_parallel_size=1)
    log = RunLog(config, env, is_writer=world.is_main)
    accum = config["grad_accum"]

    for step in range(config["steps"]):
        clock = StepClock()
        lr = scheduler.get_last_lr()[0]
        loss_sum = torch.zeros((), device=device)
        for _ in range(accum):
            inputs, targets = batches.next()
            with loss_parallel():  # cross-entropy on logits sharded by vocabulary, and its backward
                with autocast(config["amp"], device):
                    logits = model(inputs.to(device))
                    loss = F.cross_entropy(
                        logits.float().flatten(0, 1), targets.to(device).flatten()
                    )
                scaler.scale(loss / accum).backward()
            loss_sum += local(loss).detach()
        # SequenceParallel's LayerNorm gradients are partial sums: added up here, once per step
        for p in params:
            if isinstance(p.grad, DTensor) and any(x.is_partial() for x in p.grad.placements):
                p.grad = p.grad.redistribute(placements=[Replicate()])
        scaler.unscale_(optimizer)
        # as step 8 adds them
        squares = sum_of_squares(local(p.grad) for p in counted_once(params)).to(device)
        dist.all_reduce(squares)
        grad_norm = squares.cpu().sqrt().float()
        grads = [p.grad for p in params]
        scale_gradients([local(g) for g in grads], grad_norm, config["grad_clip"])
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        memory = memory_stats(
            [local(p) for p in params], optimizer, device, grads=[local(g) for g in grads]
        )
        optimizer.zero_grad(set_to_none=True)
        step_time = clock.stop()
        log.log(
            {
                "step": step + 1,
                "loss": loss_sum.double().item() / accum,
                "grad_norm": grad_norm.item(),
                "param_norm": param_norm(
                    [local(p) for p in counted_once(params)], [dist.group.WORLD]
                ),
                "lr": lr,
                "tokens_per_s": config["micro_batch_size"]
                * accum
                * config["seq_len"]
                / step_time["wall_s"],
                "effective_batch_size": config["micro_batch_size"] * accum,
                "epoch": batches.epoch,
                **distributed.gather_per_rank(memory=memory, step_time=step_time),
            }
        )

    weights = full_weights(model)
    if world.is_main:
        final = save_final_weights(Path(config["out"]), weights)
        log.write(final)
        print(
            f"done: {config['steps']} steps, PyTorch tensor parallelism over "
            f"{world.world_size} ranks, "
            f"final loss {log.records[-1]['loss']:.4f}, weights in {config['out']}"
        )
    # DTensors hold the mesh's group: free them before the group goes
    del model, optimizer, params, grads
    distributed.shutdown()


if __name__ == "__main__":
    exit_on_user_error(main)
