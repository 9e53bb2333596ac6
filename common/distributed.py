"""Process-group set-up and tear-down for the distributed steps.

torchrun starts one process per rank and tells each its place through environment variables
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``).
Started as a plain ``python train.py``, a step runs as a world of one.
"""

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# Imported now, before any process group exists, on purpose: this module binds ``group.WORLD`` as a
# default argument of its functions when it is first imported. PyTorch imports it lazily (the
# optimiser's first step does, through torch._dynamo); imported while a group exists, it would hold
# that group for good, and shutdown() could not free it. See shutdown().
import torch.distributed.nn.functional  # noqa: F401

import collective_failures  # noqa: F401  (a failed collective ends the run in one line: skip it on a first read)
from config import UserError
from training import pick_device


def add_flags(parser) -> None:
    """The flags every distributed step has (steps 1 and up)."""
    dist_flags = parser.add_argument_group("distributed")
    dist_flags.add_argument(
        "--backend",
        choices=["auto", "gloo", "nccl"],
        default="auto",
        help="auto: nccl when every rank has its own GPU, else gloo",
    )
    dist_flags.add_argument(
        "--reduce-dtype",
        choices=["float32", "float64"],
        default="float32",
        help="float64: exact, order-free gradient reduction (the parity contract)",
    )
    dist_flags.add_argument(
        "--timeout-s", type=float, default=300.0, help="process-group timeout in seconds"
    )


# The steps whose blocks can be compiled: their communication runs outside the blocks (after
# backward, or in hooks on the parameters' gradients), so a compiled block computes what an eager
# one does. Not the others: ZeRO-3 gathers a block's parameters in hooks around the block's own
# forward, which a compiled block would trace into its graph; tensor parallelism's all-reduces sit
# inside the blocks; the pipeline records and replays each block's random operations under a
# dispatch mode. None of them is tried with compile yet.
COMPILES = (
    "step0_single_gpu",
    "step1_torch_ddp",
    "step2_sharded_data",
    "step3_naive_dp",
    "step4_hooks_bucketing",
    "step5_zero1",
    "step6_zero2",
)


def refuse_compile(config: dict) -> None:
    """``--compile`` in a step whose communication a
    compiled block would trace (steps 7 on): one line."""
    if config["compile"]:
        raise UserError(
            f"--compile is not supported by {config['step']} (its communication runs inside the "
            "blocks, or around them in hooks a compiled block would trace): leave it "
            "out, or compile "
            f"in one of {', '.join(COMPILES)}"
        )


@dataclass
class World:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def world_from_env() -> tuple[int, int, int, int]:
    """(rank, world size, local rank,
    local world size) as torchrun set them; a world of one otherwise."""
    env = os.environ
    world_size = int(env.get("WORLD_SIZE", 1))
    return (
        int(env.get("RANK", 0)),
        world_size,
        int(env.get("LOCAL_RANK", 0)),
        int(env.get("LOCAL_WORLD_SIZE", world_size)),
    )


def choose_backend(requested: str, device: torch.device, local_world_size: int) -> str:
    """nccl needs a GPU of its own per rank on a node;
    gloo runs anywhere (CPU, or ranks sharing a GPU)."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if requested == "nccl":
        if gpus < local_world_size or device.type != "cuda":
            raise UserError(
                f"--backend nccl needs one GPU per rank: {local_world_size} ranks on this node, "
                f"{gpus} GPU(s) visible; use --backend gloo"
            )
        return "nccl"
    if requested == "gloo":
        return "gloo"
    return "nccl" if device.type == "cuda" and gpus >= local_world_size else "gloo"


def plan_world(config: dict) -> World:
    """This rank's place, device and backend, checked but not yet connected.

    Everything a user can get wrong is checked before ``join``, so a mistake ends every rank with
    one line and exit 2, never with a rank waiting in a collective for peers that already left.
    """
    # torch would time out connecting to the store, with a traceback
    if not config["timeout_s"] > 0:
        raise UserError(
            f"--timeout-s must be positive, got {config['timeout_s']:g}: it is how "
            "long a rank waits "
            "for its peers (default 300)"
        )
    rank, world_size, local_rank, local_world_size = world_from_env()
    device = pick_device(config["device"], local_rank)
    backend = choose_backend(config["backend"], device, local_world_size)
    return World(rank, world_size, local_rank, device, backend)


def join(world: World, timeout_s: float) -> torch.device:
    """Join the process group; a peer that does not answer within ``timeout_s`` is an error, not a
    hang. Returns the device this rank computes on (a GPU: made the current one, as nccl expects).

    Under torchrun the ranks meet in the store that torchrun's agent keeps for the whole job. When
    torchrun restarts a failed group (``--max-restarts``), the new ranks would find the keys the
    dead ranks left in it (gloo's addresses among them) and connect to processes that no longer
    exist. So each attempt gets keys of its own: the store seen through a prefix named after
    ``TORCHELASTIC_RESTART_COUNT``."""
    if world.device.type == "cuda":
        torch.cuda.set_device(world.device)
    timeout = timedelta(seconds=timeout_s)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:  # a world of one started without torchrun, or spawned test workers
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        dist.init_process_group(
            world.backend, rank=world.rank, world_size=world.world_size, timeout=timeout
        )
        return world.device
    # torchrun's agent serves it
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world.world_size,
        is_master=not agent_store and world.rank == 0,
        timeout=timeout,
    )
    dist.init_process_group(
        world.backend,
        store=dist.PrefixStore(f"attempt_{attempt}/", store),
        rank=world.rank,
        world_size=world.world_size,
        timeout=timeout,
    )
    return world.device


def shutdown() -> None:
    """Leave together, and leave no thread of the group behind.

    The barrier: nobody tears down the group while a peer still has a collective in flight.

    ``destroy_process_group`` then frees the group, whose destructor stops gloo's worker threads. A
    worker thread lets go of a collective (and of the Python tensors it was given) only *after* the
    caller's wait has returned, and letting go of a tensor Python already dropped needs the GIL. The
    destructor waits for that with the GIL released,
    so it is safe. Two ways to break it, both seen here:

    - Something else still holds the group, so ``destroy_process_group`` frees nothing and the
      worker threads live on into interpreter exit. A thread that asks for the GIL once exit has
      begun is killed in the middle of a C++ destructor: "terminate called without an active
      exception", SIGABRT (1 test run in 6 on a loaded machine). PyTorch's own
      ``torch.distributed.nn.functional`` holds the group if it is first imported while the group
      exists: this module imports it first. A tensor hook that holds the wrapper holding the group
      does too (the garbage collector cannot see into autograd's graph): steps 4 and 7 hook weakly.
    - The last reference is dropped by C++ code that holds the GIL while gloo's threads stop, and a
      thread still releasing a tensor waits for the GIL forever (~1 run in 30 hung at exit). DDP's
      C++ reducer holds the group: free every ``DistributedDataParallel`` before calling this.
    """
    if dist.is_initialized():
        # nccl's barrier needs to be told its GPU (else a warning, or a guess)
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[torch.cuda.current_device()])
        else:
            dist.barrier()
        dist.destroy_process_group()


def preempted_anywhere(preemption) -> bool:
    """Whether a SIGTERM reached any rank (``failures.Preemption``): each rank's flag all-reduced
    (max) once per step, so every rank stops after the same step and saves it, whichever of them the
    signal reached first. No collective when ``--preempt-grace-s`` is 0."""
    if not preemption.grace_s:
        return False
    on_gpu = dist.get_backend() == "nccl"  # nccl reduces only what is on a GPU
    flag = torch.tensor(
        [preemption.signalled()],
        dtype=torch.int32,
        device=f"cuda:{torch.cuda.current_device()}" if on_gpu else "cpu",
    )
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def gather_from_every_rank(value) -> list:
    """``[rank 0's value, rank 1's, ...]`` on every rank: what rank 0 logs about all of them."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, value)
    return everyone


def gather_per_rank(**values) -> dict:
    """``{name: [rank 0's value, rank 1's, ...]}`` for every keyword,
    in one gather: a record's per-rank fields."""
    everyone = gather_from_every_rank(values)
    return {name: [value[name] for value in everyone] for name in values}


def mean_over_ranks(total: torch.Tensor, count: int, group=None) -> float:
    """The mean over every rank of ``group`` of ``count`` values each rank summed into ``total``
    (the loop's loss: micro-batches' losses on every rank). Collective. Summed in float64: the same
    bits whatever the order."""
    total = total.detach().double()
    dist.all_reduce(total, group=group)
    return total.item() / (count * dist.get_world_size(group))
