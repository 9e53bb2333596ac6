"""A pipeline set up from a trainer's flags: the flags, their mistakes refused, GPT-2 wired in.

``add_pipeline_flags``: ``--schedule`` (one of pipeline_schedules.py's ``SCHEDULES``),
``--virtual-stages``, ``--micro-batches``; ``virtual_stages``: V, the chunks of layers per rank they
ask for; ``check_pipeline``: a flag that cannot work (a schedule the stages cannot run, more stages
than blocks, micro-batches that do not divide the accumulation, fp16's loss scaling) ends the run
with one line (``UserError``: exit 2), before anything is connected. ``pipeline_gpt2``: this rank's
``GPT2Stage`` chunks (pipeline_stages.py) wrapped in the ``Pipeline`` that runs them, under --amp's
autocast, with dropout's random ops recorded. What step 9's train.py and step 10's composition.py
call by name; the idea is pipeline.py's.
"""

import functools

import torch

from dropout_replay import record_random_ops
from failures import UserError
from pipeline import Pipeline
from pipeline_schedules import SCHEDULES


def add_pipeline_flags(parser) -> None:
    flags = parser.add_argument_group("pipeline")
    flags.add_argument(
        "--schedule",
        choices=SCHEDULES,
        default="1f1b",
        help="gpipe: all forwards, then all backwards; 1f1b: one forward, one "
        "backward (less memory); interleaved-1f1b: 1f1b over --virtual-stages "
        "chunks per rank (a smaller bubble); zero-bubble: 1f1b with each "
        "backward split, weight gradients deferred into the bubble",
    )
    flags.add_argument(
        "--virtual-stages",
        type=int,
        default=None,
        metavar="V",
        help="chunks of layers per rank with --schedule interleaved-1f1b "
        "(default 2): rank r holds chunks r, r + P, ...",
    )
    flags.add_argument(
        "--micro-batches",
        type=int,
        default=None,
        metavar="M",
        help="micro-batches in the pipeline at once (default: --grad-accum, one "
        "pipeline flush per optimiser step); --grad-accum must be a "
        "multiple of it",
    )


def virtual_stages(config: dict) -> int:
    """V, the chunks of layers each rank holds: --virtual-stages with the interleaved schedule
    (default 2), else 1."""
    if config["schedule"] != "interleaved-1f1b":
        return 1
    return 2 if config.get("virtual_stages") is None else config["virtual_stages"]


def check_pipeline(config: dict, num_stages: int, flag: str | None = None) -> int:
    """The pipeline's own mistakes, before anything is connected; returns M, the micro-batches of
    one flush. ``flag``: the option that sets the number of stages, named in the line (step 10's
    ``--pp``); none: the number of ranks sets it."""
    interleaved, chunks = config["schedule"] == "interleaved-1f1b", virtual_stages(config)
    if config.get("virtual_stages") not in (None, 1) and not interleaved:
        raise UserError(
            f"--virtual-stages {config['virtual_stages']} gives each rank chunks of "
            "layers for the interleaved schedule: add --schedule interleaved-1f1b, or "
            "leave --virtual-stages out"
        )
    if config["schedule"] == "zero-bubble" and num_stages < 2:
        raise UserError(
            "--schedule zero-bubble defers each stage's weight gradients past the next "
            "stage's work: it needs 2 or more stages (one process: any other schedule)"
        )
    if interleaved and (chunks < 2 or num_stages < 2):
        raise UserError(
            f"--schedule interleaved-1f1b loops every micro-batch through the stages V "
            f"times: it needs --virtual-stages 2 or more (got {chunks}) and 2 or more "
            f"stages (got {num_stages})"
        )
    if num_stages * chunks > config["n_layer"]:
        if flag:
            stages = f"{flag} {num_stages} stages"
            fix = f"use {flag} {config['n_layer']} or less"
        else:
            stages = f"{num_stages} stages (one per rank)"
            fix = f"use at most {config['n_layer']} ranks"
        if chunks > 1:
            stages = f"{stages} x {chunks} virtual stages"
            fix = "use fewer stages or virtual stages"
        raise UserError(
            f"{stages} but the model has {config['n_layer']} blocks: every stage needs "
            f"at least one; {fix} or a larger --n-layer"
        )
    micro_batches = config["micro_batches"] or config["grad_accum"]
    if micro_batches < 1 or config["grad_accum"] % micro_batches:
        raise UserError(
            f"--micro-batches {micro_batches} does not divide --grad-accum "
            f"{config['grad_accum']} (the micro-batches of an optimiser step): use a "
            "divisor of it, or leave it out"
        )
    if interleaved and micro_batches % num_stages:
        raise UserError(
            f"--schedule interleaved-1f1b sends micro-batches through the {num_stages} "
            f"stages in rounds of {num_stages}: make --micro-batches (or --grad-accum) "
            f"a multiple of {num_stages}, not {micro_batches}"
        )
    if config["amp"] == "fp16":  # the stages would have to agree the scaler's overflow verdict
        raise UserError(
            "--amp fp16 is not supported by a pipeline (its loss scaling would need "
            "every stage to agree on overflow): use --amp bf16 or --amp none"
        )
    return micro_batches


def pipeline_gpt2(
    stages: list,
    stage_index: int,
    config: dict,
    device,
    loss_fn,
    ranks=None,
    sequence_split: int = 1,
) -> tuple:
    """``(stage, named, pipe)``: this rank's stage of ``stages`` (the whole model cut into stages,
    on every rank; the caller frees the others), its parameters by the model's names (the tied copy
    on the last stage under the embedding's: what checkpoints speak of), and the ``Pipeline`` that
    runs it by ``config["schedule"]``, its messages one micro-batch's activations
    (``sequence_split``: a 1/N block of its tokens, step 10's sequence parallelism). With the
    interleaved schedule ``stages`` holds P x V stages (``virtual_stages(config)`` per rank) and
    ``stage`` this rank's chunks in a ``ModuleList``: stages ``stage_index``, ``stage_index + P``,
    ... ``loss_fn(logits, targets)``: the last stage's loss on float32 (B*S, V) logits. Forwards run
    under --amp's autocast; with dropout every stage's random ops are recorded first (pipeline.py's
    rule 4), on a micro-batch of token 0: only their shapes and dtypes are kept, not what they
    draw."""
    from training import autocast  # this project's trainers' autocast: Pipeline takes any context

    context = functools.partial(autocast, config["amp"], device)
    random_ops = None
    if config["dropout"] > 0:
        example = torch.zeros(
            config["micro_batch_size"], config["seq_len"], dtype=torch.long, device=device
        )
        random_ops = record_random_ops(stages, example, context)
    num_stages = len(stages) // virtual_stages(config)
    chunks = stages[stage_index::num_stages]
    named = [
        ("transformer.wte.weight" if p is chunk.tied_parameter else n, p)
        for chunk in chunks
        for n, p in chunk.named_parameters()
    ]
    shape = (config["micro_batch_size"], config["seq_len"] // sequence_split, config["n_embd"])
    tied = (chunks[0] if stage_index == 0 else chunks[-1]).tied_parameter
    pipe = Pipeline(
        chunks if len(chunks) > 1 else chunks[0],
        stage_index,
        num_stages,
        activation_shape=shape,
        loss_fn=lambda logits, targets: loss_fn(logits.float().flatten(0, 1), targets.flatten()),
        tied_parameter=tied,
        ranks=ranks,
        schedule=config["schedule"],
        context=context,
        random_ops=random_ops,
        device=device,
    )
    return pipe.module, named, pipe
