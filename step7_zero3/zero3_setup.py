"""GPT-2 fully sharded from step 7's flags: what step 7's train.py calls by name. The idea is
zero3.py's, which needs no particular model: this file imports it, never the other way round.

``add_zero3_flags``: ``--no-prefetch``, ``--activation-checkpointing [full|selective|none]``
(recomputation.py, a second idea, memory against time, that asks of FullyShardedDP one line of its
pre-backward hook, which installs the gathered views again for the forward recomputed in backward),
``--offload-optimizer``, ``--trace``, ``--replicate`` (HSDP, hsdp.py; ``check_replicate`` refuses an
R that does not divide N). ``shard_gpt2``: this project's GPT-2 built on the meta device and wrapped
in ``FullyShardedDP`` with its blocks as units (zero3_units.py's rule 3).
"""

import torch

from config import UserError
from hsdp import hybrid_mesh, replicate_problem
from model import GPT2, gpt2_config, initial_value
from recomputation import add_recomputation_flag, recompute
from zero3 import FullyShardedDP


def add_zero3_flags(parser) -> None:
    flags = parser.add_argument_group("ZeRO-3")
    flags.add_argument(
        "--no-prefetch", action="store_true", help="gather each unit only when it is needed"
    )
    add_recomputation_flag(flags)
    flags.add_argument(
        "--offload-optimizer",
        action="store_true",
        help="AdamW's state and step in host memory (ZeRO-Offload, offload.py): the "
        "device keeps parameters and gradients",
    )
    flags.add_argument(
        "--trace", action="store_true", help="write trace.json and timeline.png of the last step"
    )
    flags.add_argument(
        "--replicate",
        type=int,
        default=1,
        metavar="R",
        help="HSDP (hsdp.py): shard over N/R consecutive ranks (a node), replicate over R "
        "such groups; 1: shard over all N",
    )


def check_replicate(replicate: int, world_size: int) -> None:
    """--replicate R must cut the N ranks into equal shard groups:
    else one line, exit 2, before any group."""
    if problem := replicate_problem(replicate, world_size):
        raise UserError(problem)


def shard_gpt2(config: dict, vocab_size: int, device, param_dtype=None) -> tuple:
    """This project's GPT-2 (model.py), fully sharded with its blocks as units: built on the meta
    device (only shapes: no rank ever holds all of it), each rank filling its own slices from
    ``initial_value``, a pure function of (seed, name), so no broadcast is needed (zero3_units.py's
    rule 3); --activation-checkpointing, --no-prefetch, --reduce-dtype and ``param_dtype``
    (--param-dtype's 16-bit dtype, rule 7) as ``config`` says. Returns ``(wrapper, shapes)``: the
    full parameters' shapes by name, which no rank holds any more."""
    with torch.device("meta"):
        model = GPT2(gpt2_config(config, vocab_size))
    shapes = {name: p.shape for name, p in model.named_parameters()}
    # zero3.py's hooks stay around each block
    recompute(model.transformer.h, config["activation_checkpointing"])

    def init_fn(name, shape):
        return initial_value(name, shape, config["seed"], config["n_layer"])

    wrapper = FullyShardedDP(
        model,
        model.transformer.h,
        device=device,
        init_fn=init_fn,
        prefetch=not config["no_prefetch"],
        param_dtype=param_dtype,
        reduce_dtype=getattr(torch, config["reduce_dtype"]),
        # no keys: no HSDP
        mesh=hybrid_mesh(config.get("replicate", 1), config.get("timeout_s")),
    )
    return wrapper, shapes
