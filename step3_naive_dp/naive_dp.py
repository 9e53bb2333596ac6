"""Naive data parallelism: the two collectives that make N model replicas train as one.

1. ``broadcast_parameters``: before training, every rank overwrites its parameters with rank 0's.
   Replicas that start different stay different: averaging gradients keeps them in lock-step
   only if they were in lock-step to begin with.
2. ``allreduce_gradients``: after backward, every gradient is summed over the ranks and divided
   by the world size. Each rank then holds the gradient of the mean loss over the global batch,
   and the identical optimiser step on every rank keeps the replicas identical.

One all-reduce per parameter, issued only after backward has finished: correct, and the baseline
that step 4 makes fast (fewer, larger messages, overlapped with backward).
"""

import hashlib

import torch
import torch.distributed as dist

from comm_accounting import count_collective


def broadcast_parameters(module: torch.nn.Module, src: int = 0) -> None:
    """Make every rank's parameters and buffers equal to rank ``src``'s, in place."""
    for tensor in list(module.parameters()) + list(module.buffers()):
        count_collective("broadcast", tensor)
        dist.broadcast(tensor.data, src=src)


def allreduce_gradients(
    module: torch.nn.Module, reduce_dtype: torch.dtype = torch.float32, group=None
) -> None:
    """Replace every gradient by its mean over the ranks:
    all-reduce (sum), then divide by world size.

    ``reduce_dtype=torch.float64`` is the exact mode: summing in float64 does not depend on the
    order in which the ranks' values are added, so the result is the same bits however the
    all-reduce is implemented (see the parity contract in the README).

    Every rank must call this with a gradient for every trainable parameter: the ranks issue one
    all-reduce per parameter in the same order, and a rank that skipped one would pair its next
    all-reduce with a different parameter on the other ranks. ``group``: the ranks that hold
    replicas (default: all; step 10 passes its data-parallel group).
    """
    world_size = dist.get_world_size(group)
    for name, param in module.named_parameters():
        if not param.requires_grad:
            continue  # frozen: no gradient anywhere, nothing to reduce
        if param.grad is None:
            raise RuntimeError(
                f"parameter {name} has no gradient; naive data parallelism needs every "
                "trainable parameter to take part in the loss (step 4 handles unused ones)"
            )
        grad = param.grad if reduce_dtype == param.grad.dtype else param.grad.to(reduce_dtype)
        count_collective("all_reduce", grad)
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=group)
        grad.div_(world_size)
        if grad is not param.grad:
            param.grad.copy_(grad)  # the one rounding back to float32


def replicas_in_sync(module: torch.nn.Module) -> bool:
    """True on every rank when every rank holds bit-identical parameters (a check, not a fix)."""
    digest = hashlib.sha256()
    for param in module.parameters():
        digest.update(param.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    device = next(module.parameters()).device  # nccl gathers GPU tensors, gloo CPU ones
    mine = torch.tensor(
        [int.from_bytes(digest.digest()[:7], "little")], dtype=torch.int64, device=device
    )
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return all(torch.equal(everyone[0], d) for d in everyone)
