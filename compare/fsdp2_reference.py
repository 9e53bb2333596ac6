"""Steps 5-7's mixed-precision training with PyTorch's FSDP2: the run they must equal, bit for bit.

    # runs/fsdp2_reference
    torchrun --standalone --nproc_per_node=2 compare/fsdp2_reference.py --param-dtype bf16
    torchrun --standalone --nproc_per_node=2 step7_zero3/train.py --param-dtype bf16
    python compare/parity.py step7 runs/fsdp2_reference   # PASS (bitwise)

It takes step 7's flags. The model is the same GPT-2 (the same initial weights); each block and then
the whole model get ``fully_shard`` with ``MixedPrecisionPolicy(param_dtype=--param-dtype,
reduce_dtype=torch.float32)``: float32 sharded master weights, gathered in 16 bits, forward and
backward in 16 bits, gradients reduce-scattered in float32 and kept in float32 for AdamW.
(``--param-dtype float32``: no policy, plain FSDP2.) The loop is step 7's: the same data shards,
accumulation with ``set_requires_gradient_sync`` (FSDP2 sums the micro-batches' 16-bit gradients in
float32), clipping by the norm of the whole gradient (its squares summed in float64, as the steps
do), AdamW. The final weights are the float32 master, gathered, so parity.py compares them with the
steps' final weights. fp16 parameters need a loss scaler that FSDP2 does not give a DTensor
optimiser here: refused.
``--offload-optimizer``: ``CPUOffloadPolicy``, the counterpart of step 7's (step7_zero3/offload.py).
``--replicate R``: HSDP, ``fully_shard`` on the 2-D mesh ``(R, N // R)`` named ("replicate",
"shard"), the counterpart of step 7's (step7_zero3/hsdp.py); the norms then sum over the "shard"
group only.
``--fp8 tensorwise|rowwise``: torchao's ``convert_to_float8_training`` on the blocks' linears before
sharding, the counterpart of step 7's ``--fp8`` (FSDP2 gathers the float32 or bf16 weight, torchao
casts it: no FP8 all-gather).
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

REPO = Path(__file__).resolve().parent.parent
# the shared pieces; the sampler
sys.path[:0] = [str(REPO / "common"), str(REPO / "step2_sharded_data")]
import distributed  # noqa: E402
from config import UserError, build_parser, exit_on_user_error, parse_config  # noqa: E402
from data import MicroBatches, load_corpus  # noqa: E402
from exact_sums import norm_from_parts, square_sum_parts  # noqa: E402
from metrics import RunLog, StepClock, environment, memory_stats, save_final_weights  # noqa: E402
from model import build_model, language_model_loss  # noqa: E402
from sampler import ShardedSampler  # noqa: E402
from seeding import seed_everything  # noqa: E402
from training import (  # noqa: E402
    add_param_dtype_flag,
    check_param_dtype,
    make_optimizer,
    make_scheduler,
    param_dtype,
    scale_gradients,
    sum_of_squares,
)


def main():
    parser = build_parser("fsdp2_reference")
    distributed.add_flags(parser)
    add_param_dtype_flag(parser)
    parser.add_argument(
        "--offload-optimizer",
        action="store_true",
        help="CPUOffloadPolicy: the sharded parameters, gradients and AdamW on the host "
        "(step 7's flag)",
    )
    parser.add_argument(
        "--replicate",
        type=int,
        default=1,
        metavar="R",
        help="HSDP: a (replicate, shard) mesh of R x N/R ranks (step 7's flag)",
    )
    parser.add_argument(
        "--fp8",
        choices=["tensorwise", "rowwise"],
        default=None,
        help="torchao's float8 training on the blocks' linears (step 7's --fp8 counterpart)",
    )
    config = parse_config(parser)
    if (
        config["reduce_dtype"] != "float32"
        or config["amp"] != "none"
        or config["param_dtype"] == "fp16"
    ):
        raise UserError(
            "the FSDP2 reference runs --param-dtype float32 or bf16, gradients reduced in float32, "
            "no --amp: drop --reduce-dtype, --amp and --param-dtype fp16"
        )
    world = distributed.plan_world(config)
    check_param_dtype(config, world.device)
    if config["replicate"] < 1 or world.world_size % config["replicate"]:
        # step 7's words (step7_zero3/hsdp.py)
        raise UserError(
            f"--replicate {config['replicate']} does not divide the {world.world_size} "
            "ranks: choose R "
            f"with N / R whole (the ranks of one node, typically), or launch a multiple of "
            f"{config['replicate']} ranks"
        )
    seed_everything(config["seed"], config["deterministic"])
    corpus = load_corpus(config["data"], config["tokenizer"], config["seq_len"])
    distributed.join(world, config["timeout_s"])
    device = world.device
    if config["replicate"] == 1:
        mesh = init_device_mesh(device.type, (world.world_size,))
        norm_group = dist.group.WORLD
    else:  # HSDP: FSDP2 reduce-scatters over "shard", then all-reduces over "replicate"
        replicate = config["replicate"]
        mesh = init_device_mesh(
            device.type,
            (replicate, world.world_size // replicate),
            mesh_dim_names=("replicate", "shard"),
        )
        # the other rows hold the same elements: count them once
        norm_group = mesh["shard"].get_group()

    sampler = ShardedSampler(
        len(corpus.blocks),
        num_replicas=world.world_size,
        rank=world.rank,
        shuffle=True,
        seed=config["seed"],
    )
    batches = MicroBatches(corpus.blocks, sampler, config["micro_batch_size"])
    model = build_model(config, corpus.vocab_size, config["seed"]).to(device)
    # torchao, the oracle: the blocks' nn.Linears, as step 7's fp8.py converts them
    if config["fp8"]:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(
            model,
            config=Float8LinearConfig.from_recipe_name(config["fp8"]),
            module_filter_fn=lambda layer, name: name.startswith("transformer.h."),
        )
    dtype = param_dtype(config)
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)
    offload = (
        CPUOffloadPolicy(pin_memory=device.type == "cuda")
        if config["offload_optimizer"]
        else OffloadPolicy()
    )
    # the units step 7 gathers; the root keeps embeddings and the last norm
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh, mp_policy=policy, offload_policy=offload)
    fully_shard(model, mesh=mesh, mp_policy=policy, offload_policy=offload)
    optimizer = make_optimizer(model.named_parameters(), config)  # steps the float32 shards
    scheduler = make_scheduler(optimizer, config)
    env = environment(device, world.world_size, world.backend, config["amp"], corpus)
    log = RunLog(config, env, is_writer=world.is_main)
    accum = config["grad_accum"]
    shards = lambda tensors: [t.to_local() for t in tensors]  # noqa: E731  (this rank's rows of each)

    for step in range(config["steps"]):
        clock = StepClock()
        lr = scheduler.get_last_lr()[0]
        loss_sum = torch.zeros((), device=device)
        for micro_step in range(accum):
            inputs, targets = batches.next()
            model.set_requires_gradient_sync(micro_step == accum - 1)  # FSDP2's no_sync()
            loss = language_model_loss(model, inputs.to(device), targets.to(device))
            (loss / accum).backward()
            loss_sum += loss.detach()
        grads = shards(p.grad for p in model.parameters())
        # float64: the norm the steps compute from their slices
        total = sum_of_squares(grads).to(device)
        dist.all_reduce(total, group=norm_group)
        grad_norm = total.cpu().sqrt().float()
        scale_gradients(grads, grad_norm, config["grad_clip"])
        optimizer.step()
        scheduler.step()
        memory = memory_stats(shards(model.parameters()), optimizer, device, grads=grads)
        optimizer.zero_grad(set_to_none=True)
        loss_mean = loss_sum.double()
        dist.all_reduce(loss_mean)
        # exact: any sharding, the same bits
        parts = square_sum_parts(shards(model.parameters())).to(device)
        dist.all_reduce(parts, group=norm_group)
        step_time = clock.stop()
        log.log(
            {
                "step": step + 1,
                "loss": loss_mean.item() / (accum * world.world_size),
                "grad_norm": grad_norm.item(),
                "param_norm": norm_from_parts(parts.cpu()),
                "lr": lr,
                "tokens_per_s": config["micro_batch_size"]
                * accum
                * config["seq_len"]
                * world.world_size
                / step_time["wall_s"],
                "effective_batch_size": config["micro_batch_size"] * accum * world.world_size,
                "epoch": batches.epoch,
                **distributed.gather_per_rank(memory=memory, step_time=step_time),
            }
        )

    # the float32 master
    weights = {name: p.full_tensor().detach() for name, p in model.named_parameters()}
    if world.is_main:
        final = save_final_weights(Path(config["out"]), weights)
        log.write(final)
        print(
            f"done: {config['steps']} steps, FSDP2 over {world.world_size} ranks (param_dtype "
            f"{config['param_dtype']}), final loss {log.records[-1]['loss']:.4f}, "
            f"weights in {config['out']}"
        )
    del model, optimizer, weights  # DTensors hold the mesh's group: free them before the group goes
    distributed.shutdown()


if __name__ == "__main__":
    exit_on_user_error(main)
