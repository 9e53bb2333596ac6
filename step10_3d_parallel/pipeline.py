"""Pipeline parallelism: the model cut into stages by blocks, one stage per rank, micro-batches flowing through.

Steps 1-7 replicated (or sharded) the *whole* model on every rank and split the *batch*: every rank
ran every layer. Here the *layers* are split: rank s holds stage s (a run of consecutive blocks; the
embedding with the first stage, the final norm and the output layer with the last), and a batch
flows through the ranks as micro-batches. Here:

1. **Point-to-point, shapes known in advance.** A stage sends its output activation to the next
   stage (``isend``) and receives the gradient of that activation back; the next stage receives into
   a buffer it allocated from the shape it was told at construction. No shapes travel: one message
   per activation and one per gradient, ``batch x sequence x hidden x dtype size`` bytes each.
   Sends are asynchronous and waited at the end of the step (``finish_gradient_synchronization``),
   so a stage never blocks on a peer that is itself blocked sending to it; receives block, within the
   process group's timeout (a dead or frozen stage ends the job, never hangs it). gloo sends and receives
   CPU tensors only (its collectives take CUDA tensors, its point-to-point does not), so where ranks share
   one GPU over gloo a message goes through host memory: ``host_staged``.
2. **Three schedules.** ``gpipe``: every micro-batch forward, then every backward (M micro-batches of
   activations held at once). ``1f1b``: stage s runs P - s - 1 forwards (warm-up), then alternates one
   forward and one backward, then the remaining backwards (at most P - s micro-batches held). Idle time per
   stage, the bubble, is (P - 1) / (M + P - 1) of the step in both; 1F1B saves memory. ``interleaved-1f1b``
   (Narayanan et al. 2021): the model cut into P x V chunks, rank r holding chunks r, r + P, ..., so a
   micro-batch loops through the ranks V times; micro-batches go in rounds of P, through chunk 0, then the
   same P through chunk 1, ...; the warm-up is (V - 1) P + 2 (P - r - 1) forwards. A chunk is 1/V of a
   stage's work, so the ramp-up and drain cost 1/V as much: the bubble is (P - 1) / (V M + P - 1), for V
   times the messages. Every schedule runs each chunk's backwards in micro-batch order 0, 1, ..., M - 1,
   which is the order one process accumulating M micro-batches adds their gradients in: so every ``.grad``
   holds the same bits.
3. **The tied embedding, combined per micro-batch.** GPT-2's token embedding is also its output
   layer: the first stage holds it for the lookup, the last a copy for the logits. One process sums
   the two gradient contributions of each micro-batch before adding it to ``.grad``. So the last stage
   sends its contribution of each micro-batch to the first, which adds it to its own in the hook that
   runs just before accumulation: the same additions in the same order. (Summing each stage's
   accumulated part once per step is cheaper, but adds in another order: off in the last bits.) After
   the last backward the first stage sends the combined gradient back, and both copies step alike.
4. **One random stream.** Dropout draws from the global generator, in model order, micro-batch after
   micro-batch. Every stage replays the draws of the other stages (the same random ops on
   throw-away tensors of the same shapes, recorded once by ``record_random_ops``) so that it draws
   its own masks from exactly where one process would: the masks are one process's masks. A rank
   holding V chunks runs their forwards out of micro-batch order, so each chunk keeps its own copy of
   the generator's state, one micro-batch further on at each of its forwards.
5. **The loss on the last stage.** Only the last stage has the targets' logits; it divides each
   micro-batch's loss by the number of micro-batches accumulated per optimiser step, as one process
   does (``loss / accum``), and starts that micro-batch's backward.
6. **Zero bubble: the backward split in two** (ZB-H1, Qi et al. 2023). The stage before waits only for
   the gradient of this stage's input, so ``B`` computes that (and, on the way, the gradient of every
   weighted layer's output, which it keeps) and sends it at once; ``W``, later, turns each kept output
   gradient into that layer's weight gradients (``backward(out, grad, inputs=layer's weights)``: the same
   kernels on the same numbers as one whole backward). Stage s defers its W's by s backwards, so they fill
   the slots where 1F1B idles: the bubble falls from 3 (P - 1) to P - 1 units (F = B = W = 1), each stage
   holding min(P, M) micro-batches until their W. The W's add into ``.grad`` in micro-batch order, and the
   first stage runs the tied embedding's W's last, once the last stage's halves have all been sent.
"""
import contextlib
import functools
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from comm_accounting import count_collective
from failures import UserError
from model import GPT2

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")
TIED_TAG = 1  # the tie's stream between the last and the first stage; activations: message_tag


def add_pipeline_flags(parser) -> None:
    flags = parser.add_argument_group("pipeline")
    flags.add_argument("--schedule", choices=SCHEDULES, default="1f1b",
                       help="gpipe: all forwards, then all backwards; 1f1b: one forward, one backward (less memory); "
                            "interleaved-1f1b: 1f1b over --virtual-stages chunks per rank (a smaller bubble); "
                            "zero-bubble: 1f1b with each backward split, weight gradients deferred into the bubble")
    flags.add_argument("--virtual-stages", type=int, default=None, metavar="V",
                       help="chunks of layers per rank with --schedule interleaved-1f1b (default 2): rank r holds "
                            "chunks r, r + P, ...")
    flags.add_argument("--micro-batches", type=int, default=None, metavar="M",
                       help="micro-batches in the pipeline at once (default: --grad-accum, one pipeline flush per "
                            "optimiser step); --grad-accum must be a multiple of it")


def virtual_stages(config: dict) -> int:
    """V, the chunks of layers each rank holds: --virtual-stages with the interleaved schedule (default 2), else 1."""
    if config["schedule"] != "interleaved-1f1b":
        return 1
    return 2 if config.get("virtual_stages") is None else config["virtual_stages"]


def check_pipeline(config: dict, num_stages: int, flag: str | None = None) -> int:
    """The pipeline's own mistakes, before anything is connected; returns M, the micro-batches of one flush.
    ``flag``: the option that sets the number of stages, named in the line (step 10's ``--pp``); none: the
    number of ranks sets it."""
    interleaved, chunks = config["schedule"] == "interleaved-1f1b", virtual_stages(config)
    if config.get("virtual_stages") not in (None, 1) and not interleaved:
        raise UserError(f"--virtual-stages {config['virtual_stages']} gives each rank chunks of layers for the "
                        "interleaved schedule: add --schedule interleaved-1f1b, or leave --virtual-stages out")
    if config["schedule"] == "zero-bubble" and num_stages < 2:
        raise UserError("--schedule zero-bubble defers each stage's weight gradients past the next stage's work: it "
                        "needs 2 or more stages (one process: any other schedule)")
    if interleaved and (chunks < 2 or num_stages < 2):
        raise UserError(f"--schedule interleaved-1f1b loops every micro-batch through the stages V times: it needs "
                        f"--virtual-stages 2 or more (got {chunks}) and 2 or more stages (got {num_stages})")
    if num_stages * chunks > config["n_layer"]:
        stages, fix = (f"{flag} {num_stages} stages", f"use {flag} {config['n_layer']} or less") if flag else \
            (f"{num_stages} stages (one per rank)", f"use at most {config['n_layer']} ranks")
        if chunks > 1:
            stages, fix = f"{stages} x {chunks} virtual stages", "use fewer stages or virtual stages"
        raise UserError(f"{stages} but the model has {config['n_layer']} blocks: every stage needs at least one; "
                        f"{fix} or a larger --n-layer")
    micro_batches = config["micro_batches"] or config["grad_accum"]
    if micro_batches < 1 or config["grad_accum"] % micro_batches:
        raise UserError(f"--micro-batches {micro_batches} does not divide --grad-accum {config['grad_accum']} (the "
                        "micro-batches of an optimiser step): use a divisor of it, or leave it out")
    if interleaved and micro_batches % num_stages:
        raise UserError(f"--schedule interleaved-1f1b sends micro-batches through the {num_stages} stages in rounds "
                        f"of {num_stages}: make --micro-batches (or --grad-accum) a multiple of {num_stages}, "
                        f"not {micro_batches}")
    if config["amp"] == "fp16":  # the gradient scaler's overflow verdict would have to be agreed between stages
        raise UserError("--amp fp16 is not supported by a pipeline (its loss scaling would need every stage to agree "
                        "on overflow): use --amp bf16 or --amp none")
    return micro_batches


def stage_blocks(n_blocks: int, num_stages: int) -> list[range]:
    """The blocks of each stage: consecutive, as even as can be (the first stages take one more)."""
    base, extra = divmod(n_blocks, num_stages)
    starts = [s * base + min(s, extra) for s in range(num_stages + 1)]
    return [range(starts[s], starts[s + 1]) for s in range(num_stages)]


class GPT2Stage(nn.Module):
    """Stage ``stage`` of ``num_stages`` of our ``GPT2`` (model.py), under the model's own parameter names.

    A slice of the model's block list: the first stage maps token ids to hidden states (``embed``: token and
    position embeddings, dropout; then its blocks), the middle ones hidden states to hidden states, the last
    hidden states to logits (its blocks, then ``head``: final norm, output layer). The modules are the model's
    own, the blocks keyed by their index in the model, so a stage's ``named_parameters()`` are the model's
    names (``transformer.h.3.mlp.c_fc.weight``). With more than one stage the last stage's output layer gets
    a copy of the tied embedding: ``tied_parameter``.
    """

    def __init__(self, model, stage: int, num_stages: int):
        super().__init__()
        self.config, self.stage, self.num_stages = model.config, stage, num_stages
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1
        source = model.transformer
        self.transformer = nn.Module()
        if self.is_first:
            self.transformer.wte, self.transformer.wpe, self.transformer.drop = source.wte, source.wpe, source.drop
        blocks = stage_blocks(len(source.h), num_stages)[stage]
        self.transformer.h = nn.ModuleDict({str(i): source.h[i] for i in blocks})
        tied = None
        if self.is_last:
            self.transformer.ln_f = source.ln_f
            # On the meta device: a new Linear would draw its initial weight from the generator dropout uses.
            self.lm_head = nn.Linear(model.lm_head.in_features, model.lm_head.out_features, bias=False, device="meta")
            if self.is_first:  # one stage: the model's own tie
                self.lm_head.weight = source.wte.weight
            else:
                self.lm_head.weight = tied = nn.Parameter(model.lm_head.weight.detach().clone())
        if self.is_first and num_stages > 1:
            tied = source.wte.weight
        self._tied = (tied,)  # in a tuple: a Parameter set as an attribute would be registered under a new name

    @property
    def tied_parameter(self) -> nn.Parameter | None:
        """The copy of the tied embedding this stage holds, on the first and the last stage; None otherwise."""
        return self._tied[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``GPT2.forward``'s ops for this stage's part, in its order: the stages in turn compute the model."""
        if self.is_first:  # the model's own code, run on the modules this stage holds (wte, wpe, drop)
            x = GPT2.embed(self, x)
        for block in self.transformer.h.values():
            x = block(x)
        if self.is_last:  # ln_f, then the output layer
            x = GPT2.head(self, x)
        return x

    def owned_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The parameters this stage answers for, by the model's names: the tied embedding counts once, on
        the first stage (the last stage's copy is not a parameter of the model)."""
        return [(name, p) for name, p in self.named_parameters()
                if not (p is self.tied_parameter and not self.is_first)]


# ---- one random stream ------------------------------------------------------------------------------------------

class RandomOps(TorchDispatchMode):
    """Records every op that draws from a random generator (torch tags them ``nondeterministic_seeded``):
    the op and the shapes and dtypes of its tensor arguments, enough to draw the same numbers again."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded in func.tags:
            describe = lambda a: ("tensor", a.shape, a.dtype, a.device) if torch.is_tensor(a) else a  # noqa: E731
            self.ops.append((func, [describe(a) for a in args], {k: describe(v) for k, v in kwargs.items()}))
        return func(*args, **kwargs)


def record_random_ops(stages: list[nn.Module], example_input: torch.Tensor, context=contextlib.nullcontext) -> list:
    """``ops[s]``: the random ops stage ``s`` runs on one micro-batch, in order (none without dropout).

    Runs ``example_input`` through every stage in turn, once, inside ``context`` (the autocast of the real
    forward: it decides the dtypes of the masks), without gradients and on a fork of the generator, so
    nothing of the real stream is used. Every rank calls it before it keeps only its own stage."""
    ops = []
    device = example_input.device  # on a GPU dropout draws from the GPU's generator: fork that one too
    forked = torch.random.fork_rng(devices=[]) if device.type == "cpu" else \
        torch.random.fork_rng(devices=[device], device_type=device.type)
    with torch.no_grad(), forked, context():
        x = example_input
        for stage in stages:
            with RandomOps() as recorder:
                x = stage(x)
            ops.append(recorder.ops)
    return ops


def replay_random_ops(ops: list) -> None:
    """Draw what ``ops`` drew, into throw-away tensors: the generator moves on exactly as it did."""
    def make(a):
        return torch.empty(a[1], dtype=a[2], device=a[3]) if isinstance(a, tuple) and a[:1] == ("tensor",) else a

    for func, args, kwargs in ops:
        func(*[make(a) for a in args], **{k: make(v) for k, v in kwargs.items()})


# ---- point-to-point: gloo moves CPU tensors only ------------------------------------------------------------------

def host_staged(backend: str, device) -> bool:
    """Whether a point-to-point message on ``device`` must go through host memory: over gloo, off the CPU.

    gloo's send and receive move CPU tensors only: given a CUDA tensor they fail in its transport
    (``gloo/transport/tcp/pair.cc: writev: Bad address``), though gloo's all-reduce and broadcast take CUDA
    tensors. So where ranks share one GPU (gloo) the sender copies the message to the CPU and sends that, and
    the receiver receives into a CPU buffer and copies it to its device. The bits do not change; on the CPU,
    and with nccl, nothing is staged."""
    return backend == "gloo" and torch.device(device).type != "cpu"


def message_tag(to_stage: int, gradient: bool) -> int:
    """The point-to-point tag of an activation (``gradient``: an activation's gradient) sent to the model's stage
    ``to_stage``: a stream per receiving stage and direction, so that a receive takes its own messages in
    micro-batch order whatever else the sender sent between them (a rank with V chunks talks to its neighbour for
    several of them). 1 is the tie's (TIED_TAG)."""
    return 2 + 2 * to_stage + int(gradient)


def dropout_generator(device) -> torch.Generator:
    """The generator dropout draws from on ``device``: the CPU's, or that GPU's."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    return torch.default_generator


# ---- the schedule -----------------------------------------------------------------------------------------------

def schedule_actions(schedule: str, stage: int, num_stages: int, micro_batches: int,
                     chunks: int = 1) -> list[tuple]:
    """What stage ``stage`` does, in order: ``("F", i)`` forward of micro-batch i, ``("B", i)`` its backward; with
    the interleaved schedule ``("F", i, v)`` and ``("B", i, v)``, through this rank's chunk v of ``chunks``."""
    if schedule == "interleaved-1f1b":
        return interleaved_actions(stage, num_stages, micro_batches, chunks)
    if schedule == "zero-bubble":
        return zero_bubble_actions(stage, num_stages, micro_batches)
    forwards, backwards = [("F", i) for i in range(micro_batches)], [("B", i) for i in range(micro_batches)]
    if schedule == "gpipe":
        return forwards + backwards
    if schedule != "1f1b":
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    warmup = min(num_stages - stage - 1, micro_batches)  # forwards in flight before the first backward arrives
    steady = [action for pair in zip(forwards[warmup:], backwards) for action in pair]
    return forwards[:warmup] + steady + backwards[micro_batches - warmup:]


def zero_bubble_actions(stage: int, num_stages: int, micro_batches: int) -> list[tuple[str, int]]:
    """ZB-H1 (Qi et al. 2023), as ``ScheduleInterleavedZeroBubble`` orders one stage per rank: 1F1B, its backward
    split into ``("B", i)``, the gradient of the stage's input (what the stage before waits for), and ``("W", i)``,
    the gradients of its weights (what nobody waits for). Stage s runs its first W after its (s + 1)-th B, then one
    W after each B, the rest at the end: the W's fill the slots where 1F1B's stage s idles waiting for gradients."""
    P, M = num_stages, micro_batches
    warmup = min(P - stage - 1, M)
    actions, weights = [("F", i) for i in range(warmup)], 0
    for k in range(M):  # the k-th backward, after the forward 1F1B runs before it
        if warmup + k < M:
            actions.append(("F", warmup + k))
        actions.append(("B", k))
        if k >= stage:
            actions.append(("W", weights))
            weights += 1
    return actions + [("W", i) for i in range(weights, M)]


def interleaved_actions(stage: int, num_stages: int, micro_batches: int, chunks: int) -> list[tuple[str, int, int]]:
    """Interleaved 1F1B (Narayanan et al. 2021, as Megatron-LM and ``ScheduleInterleaved1F1B`` order it; M a
    multiple of P). The k-th forward of a rank: micro-batch ``(k // (P V)) P + k % P`` through chunk
    ``(k // P) % V`` (a round of P micro-batches through chunk 0, the same round through chunk 1, ...); the k-th
    backward the same with the chunks in reverse. The warm-up: the forwards that fill the rank's chunks before the
    first backward comes back, (V - 1) P on the last rank, two more per rank before it (a forward there and a
    backward back)."""
    P, M, V = num_stages, micro_batches, chunks
    total = M * V  # forwards (and backwards) of this rank: every micro-batch through every chunk
    warmup = min((V - 1) * P + 2 * (P - stage - 1), total)
    forward = [("F", (k // (P * V)) * P + k % P, (k // P) % V) for k in range(total)]
    backward = [("B", (k // (P * V)) * P + k % P, V - 1 - (k // P) % V) for k in range(total)]
    steady = [action for pair in zip(forward[warmup:], backward) for action in pair]
    return forward[:warmup] + steady + backward[total - warmup:]


def ideal_bubble(schedule: str, num_stages: int, micro_batches: int, chunks: int = 1) -> float:
    """The idle fraction of a stage in the ideal schedule, a backward twice a forward: (P - 1) / (M + P - 1) for
    GPipe and 1F1B, (P - 1) / (V M + P - 1) interleaved, (P - 1) / (3 M + P - 1) zero bubble (B = W = F; M >= P)."""
    work = {"interleaved-1f1b": chunks, "zero-bubble": 3}.get(schedule, 1) * micro_batches
    return (num_stages - 1) / (work + num_stages - 1)


class Pipeline:
    """Runs one stage of a pipeline: this rank's ``module``, micro-batch by micro-batch, by a schedule.

    ``module``: this stage (any ``nn.Module`` mapping one tensor to one tensor); with
    ``schedule="interleaved-1f1b"``, a list of this rank's V chunks, chunk v being the model's stage v P + ``stage``
    of P V. ``activation_shape`` and ``activation_dtype``: what every stage but the first receives (the previous
    stage's output for one micro-batch). ``loss_fn(output, target)``: the last stage's loss. ``tied_parameter``: on
    the first and the last stage, the parameter both hold a copy of (GPT-2's embedding), or None. ``ranks``: the
    global rank of each stage (default: stage s is rank s). ``schedule``: one of ``SCHEDULES`` (rule 2; zero-bubble's
    split backward: rule 6). ``context``: entered around each forward (autocast).
    ``random_ops``: ``record_random_ops``'s list for every stage of the model (P V of them), or None when nothing
    draws at random. ``device``: where received tensors go (this stage's device).

    ``run(micro_batches, inputs, targets, loss_scale)`` runs the forwards and backwards of that many
    micro-batches (the first stage reads the list ``inputs``, the last ``targets``; the others pass neither)
    and returns the last stage's losses (undivided). Gradients accumulate in ``.grad`` across calls, as with
    ``backward()``;
    ``finish_gradient_synchronization()`` is the single sync point before the optimiser step.
    """

    def __init__(self, module, stage: int, num_stages: int, activation_shape, activation_dtype=torch.float32,
                 loss_fn=None, tied_parameter=None, ranks=None, schedule: str = "1f1b", context=contextlib.nullcontext,
                 random_ops=None, device=torch.device("cpu")):
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        self.chunks = list(module) if isinstance(module, (list, tuple)) else [module]
        if (len(self.chunks) > 1) != (schedule == "interleaved-1f1b"):
            raise ValueError(f"schedule {schedule!r} with {len(self.chunks)} chunks on a rank: the interleaved "
                             "schedule takes a list of 2 or more chunks, the others one module")
        self.module = nn.ModuleList(self.chunks) if len(self.chunks) > 1 else module  # this rank's part: a module
        self.stage, self.num_stages, self.schedule = stage, num_stages, schedule
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1
        self.activation_shape, self.activation_dtype = torch.Size(activation_shape), activation_dtype
        self.loss_fn, self.context, self.device = loss_fn, context, torch.device(device)
        self.ranks = list(ranks) if ranks is not None else list(range(num_stages))
        self.model_stages = num_stages * len(self.chunks)  # P V of them
        self.model_stage = [v * num_stages + stage for v in range(len(self.chunks))]  # chunk v's: receives from k - 1
        random_ops = random_ops or [[] for _ in range(self.model_stages)]
        self.draws = any(random_ops)
        self.ops_before = [[op for ops in random_ops[:k] for op in ops] for k in self.model_stage]
        self.ops_after = [[op for ops in random_ops[k + 1:] for op in ops] for k in self.model_stage]
        self.pending_sends = []  # (work, tensor): a send's tensor must live until it is waited
        self.tied_parameter = tied_parameter if num_stages > 1 else None
        if self.tied_parameter is not None:
            hook = self._add_tied_contribution if self.is_first else self._send_tied_contribution
            self.tied_parameter.register_hook(hook)
        self.layer_outputs, self.deferred, self.peak_deferred, self.tied_weights = None, {}, 0, []  # rule 6
        if schedule == "zero-bubble":  # every layer that holds weights reports its output during a forward
            for layer in self.module.modules():
                if next(layer.parameters(recurse=False), None) is not None:
                    layer.register_forward_hook(self._record_layer_output)
        self.timeline = None  # a list to record (what, micro-batch, start, end, chunk) into: pipeline_trace.py
        self.in_flight, self.peak_in_flight = 0, 0  # micro-batches (per chunk) whose activations are held for backward

    def _record_layer_output(self, layer, args, output) -> None:
        if self.layer_outputs is not None:
            self.layer_outputs.append((layer, output))

    # ---- point-to-point ----------------------------------------------------------------------------------------
    def _send(self, tensor: torch.Tensor, stage: int, kind: str, tag: int) -> None:
        started = time.perf_counter()
        tensor = tensor.detach().contiguous()
        if host_staged(dist.get_backend(), tensor.device):
            tensor = tensor.cpu()  # a copy in host memory (the copy waits for the GPU), kept until the send is waited
        self.pending_sends.append((dist.isend(tensor, self.ranks[stage], tag=tag), tensor))
        count_collective(kind, tensor)
        self._record("send", None, started)

    def _recv(self, shape, dtype, stage: int, tag: int) -> torch.Tensor:
        """Blocks until the tensor is here, at most the process group's timeout (then gloo raises)."""
        started = time.perf_counter()
        staged = host_staged(dist.get_backend(), self.device)
        tensor = torch.empty(shape, dtype=dtype, device="cpu" if staged else self.device)
        dist.irecv(tensor, self.ranks[stage], tag=tag).wait()
        if staged:
            tensor = tensor.to(self.device)  # from the host buffer to this stage's device
        self._record("recv", None, started)
        return tensor

    def _record(self, what: str, micro_batch, started: float, chunk: int = 0) -> None:
        if self.timeline is not None:
            self.timeline.append((what, micro_batch, started, time.perf_counter(), chunk))

    # ---- the tied parameter: one contribution per micro-batch from the last stage, added on the first --------
    def _send_tied_contribution(self, grad: torch.Tensor) -> torch.Tensor:
        self._send(grad.clone(), 0, "p2p tied-parameter gradient", TIED_TAG)  # a copy: .grad may take grad over
        return grad

    def _add_tied_contribution(self, grad: torch.Tensor) -> torch.Tensor:
        # One process sums the two contributions, then accumulates: a + b == b + a, bit for bit.
        return grad + self._recv(grad.shape, grad.dtype, self.num_stages - 1, TIED_TAG)

    # ---- one forward, one backward, of micro-batch i through this rank's chunk v --------------------------------
    def _forward(self, i: int, v: int, inputs, targets, held: dict, losses: list, generators) -> None:
        k = self.model_stage[v]  # receive from the model's stage k - 1, send to k + 1
        first, last = k == 0, k == self.model_stages - 1
        if first:
            x = inputs[i]
        else:
            x = self._recv(self.activation_shape, self.activation_dtype, (k - 1) % self.num_stages,
                           message_tag(k, gradient=False))
            x.requires_grad_(True)  # its gradient is what this stage sends back
        started = time.perf_counter()
        if generators:  # this chunk's place in the random stream (rule 4)
            generators[0].set_state(generators[1][v])
        replay_random_ops(self.ops_before[v])  # the draws of the stages before this one, for this micro-batch
        self.layer_outputs = [] if self.schedule == "zero-bubble" else None
        with self.context():
            output = self.chunks[v](x)
            loss = self.loss_fn(output, targets[i]) if last else None
        replay_random_ops(self.ops_after[v])
        if generators:
            generators[1][v] = generators[0].get_state()
        self._record("forward", i, started, v)
        if last:
            losses.append(loss.detach())
        else:
            if output.shape != self.activation_shape or output.dtype != self.activation_dtype:
                raise ValueError(f"stage {k} produced {tuple(output.shape)} {output.dtype}, the next stage "
                                 f"expects {tuple(self.activation_shape)} {self.activation_dtype}")
            self._send(output, (k + 1) % self.num_stages, "p2p activations", message_tag(k + 1, gradient=False))
        held[i, v] = (x, loss if last else output, self.layer_outputs)
        self.layer_outputs = None
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)

    def _backward(self, i: int, v: int, held: dict, loss_scale: float) -> None:
        """The whole backward of micro-batch i through chunk v; with zero-bubble, its B only (rule 6)."""
        k = self.model_stage[v]
        x, output, layers = held.pop((i, v))
        if k == self.model_stages - 1:
            started = time.perf_counter()
            output, grad = output / loss_scale, None  # as one process does: (loss / accum).backward()
        else:
            grad = self._recv(output.shape, output.dtype, (k + 1) % self.num_stages, message_tag(k, gradient=True))
            started = time.perf_counter()
        if layers is None:
            torch.autograd.backward(output, grad)
            input_grad = x.grad if k > 0 else None
        else:  # B: the gradients of the stage's input and of each weighted layer's output, the graph kept for W
            wanted = ([x] if k > 0 else []) + [out for _, out in layers]
            grads = torch.autograd.grad(output, wanted, grad, retain_graph=True, allow_unused=True)
            input_grad = grads[0] if k > 0 else None
            self.deferred[i, v] = list(zip(layers, grads[len(wanted) - len(layers):]))
            self.peak_deferred = max(self.peak_deferred, len(self.deferred))
        self._record("backward", i, started, v)
        self.in_flight -= layers is None  # zero-bubble: its activations are held until W
        if k > 0:
            self._send(input_grad, (k - 1) % self.num_stages, "p2p activation gradients",
                       message_tag(k - 1, gradient=True))

    def _weights(self, i: int, v: int) -> None:
        """W of micro-batch i: each weighted layer's weight gradients from its output's gradient, saved by B,
        accumulated into ``.grad`` as a whole backward would (the tie's hooks run here)."""
        started = time.perf_counter()
        for (layer, out), grad in self.deferred.pop((i, v)):
            if grad is None:
                continue
            weights = list(layer.parameters(recurse=False))
            if self.is_first and self.tied_parameter is not None and any(w is self.tied_parameter for w in weights):
                self.tied_weights.append((out, grad, weights))  # after the last W: the last stage's halves are in
            else:
                torch.autograd.backward(out, grad, inputs=weights)
        self._record("weights", i, started, v)
        self.in_flight -= 1

    def run(self, micro_batches: int, inputs=None, targets=None, loss_scale: float = 1.0) -> list[torch.Tensor]:
        """Forward and backward ``micro_batches`` micro-batches by the schedule; the last stage's losses."""
        if self.schedule == "interleaved-1f1b" and micro_batches % self.num_stages:
            raise ValueError(f"the interleaved schedule runs micro-batches in rounds of {self.num_stages} (the "
                             f"stages): {micro_batches} is not a multiple")
        held, losses, generators = {}, [], None
        if self.draws and len(self.chunks) > 1:  # each chunk's own copy of the generator's state (rule 4)
            generator = dropout_generator(self.device)
            generators = (generator, [generator.get_state()] * len(self.chunks))
        for kind, i, *chunk in schedule_actions(self.schedule, self.stage, self.num_stages, micro_batches,
                                                len(self.chunks)):
            v = chunk[0] if chunk else 0
            if kind == "F":
                self._forward(i, v, inputs, targets, held, losses, generators)
            elif kind == "B":
                self._backward(i, v, held, loss_scale)
            else:
                self._weights(i, v)
        for out, grad, weights in self.tied_weights:  # zero-bubble: the tie's W's, in micro-batch order (rule 6)
            torch.autograd.backward(out, grad, inputs=weights)
        self.tied_weights.clear()
        if generators:  # every chunk now one step of micro-batches on: where one process's generator is
            generators[0].set_state(generators[1][0])
        return losses

    def finish_gradient_synchronization(self) -> None:
        """After the last ``run`` of an optimiser step: the last stage gets the tied parameter's combined
        gradient from the first, and every send is waited (its tensor may then be freed)."""
        if self.tied_parameter is not None:
            if self.is_first:
                self._send(self.tied_parameter.grad, self.num_stages - 1, "p2p tied-parameter gradient", TIED_TAG)
            else:
                self.tied_parameter.grad = self._recv(self.tied_parameter.shape, self.tied_parameter.dtype, 0, TIED_TAG)
        for work, _ in self.pending_sends:
            work.wait()
        self.pending_sends.clear()

    def from_last_stage(self, value: torch.Tensor, group=None) -> torch.Tensor:
        """What the last stage holds in ``value`` (the loss: only it has the logits), on every stage, in float64:
        a broadcast over ``group`` (the pipeline's ranks; default every rank), on the device: nccl moves GPU tensors
        only. Collective."""
        value = torch.tensor(value.item(), dtype=torch.float64, device=self.device)
        dist.broadcast(value, src=self.ranks[-1], group=group)
        return value

    def take_peak_in_flight(self) -> int:
        """The most micro-batches whose activations this stage held at once since the last call."""
        peak, self.peak_in_flight = self.peak_in_flight, self.in_flight
        return peak


def pipeline_gpt2(stages: list, stage_index: int, config: dict, device, loss_fn, ranks=None,
                  sequence_split: int = 1) -> tuple:
    """``(stage, named, pipe)``: this rank's stage of ``stages`` (the whole model cut into stages, on every rank;
    the caller frees the others), its parameters by the model's names (the tied copy on the last stage under the
    embedding's: what checkpoints speak of), and the ``Pipeline`` that runs it by ``config["schedule"]``, its
    messages one micro-batch's activations (``sequence_split``: a 1/N block of its tokens, step 10's sequence
    parallelism). With the interleaved schedule ``stages`` holds P x V stages (``virtual_stages(config)`` per rank)
    and ``stage`` this rank's chunks in a ``ModuleList``: stages ``stage_index``, ``stage_index + P``, ...
    ``loss_fn(logits, targets)``: the last stage's loss on float32 (B*S, V) logits. Forwards run under --amp's
    autocast; with dropout every stage's random ops are recorded first (rule 4), on a micro-batch of token 0: only
    their shapes and dtypes are kept, not what they draw."""
    from training import autocast  # this project's trainers' autocast: Pipeline itself takes any context
    context = functools.partial(autocast, config["amp"], device)
    random_ops = None
    if config["dropout"] > 0:
        example = torch.zeros(config["micro_batch_size"], config["seq_len"], dtype=torch.long, device=device)
        random_ops = record_random_ops(stages, example, context)
    num_stages = len(stages) // virtual_stages(config)
    chunks = stages[stage_index::num_stages]
    named = [("transformer.wte.weight" if p is chunk.tied_parameter else n, p)
             for chunk in chunks for n, p in chunk.named_parameters()]
    pipe = Pipeline(chunks if len(chunks) > 1 else chunks[0], stage_index, num_stages,
                    activation_shape=(config["micro_batch_size"], config["seq_len"] // sequence_split,
                                      config["n_embd"]),
                    loss_fn=lambda logits, targets: loss_fn(logits.float().flatten(0, 1), targets.flatten()),
                    tied_parameter=(chunks[0] if stage_index == 0 else chunks[-1]).tied_parameter, ranks=ranks,
                    schedule=config["schedule"], context=context, random_ops=random_ops, device=device)
    return pipe.module, named, pipe
