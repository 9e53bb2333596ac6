"""Dropout replay: every pipeline stage draws its dropout masks from where one process would.

One process runs the whole model on each micro-batch: its dropout layers draw from the global
generator in model order, micro-batch after micro-batch. A pipeline stage runs only its own layers,
so left alone it would draw the first masks of the stream, not its own. So at start-up
``record_random_ops`` runs one micro-batch through every stage (on a fork of the generator, without
gradients) and records each stage's random ops: the op and the shapes, dtypes and devices of
its tensor arguments (torch tags these ops ``nondeterministic_seeded``; a ``TorchDispatchMode``
sees each one). Around its own forward a stage then replays (``replay_random_ops``) the draws of
the stages before it and after it, into throw-away tensors of the same shapes: the generator moves
on exactly as one process's does, and the stage's own masks are one process's masks. Only shapes
and dtypes are recorded, never what was drawn. ``RandomStream``: a rank's replays around each of
its forwards, and with several chunks each chunk's own copy of the generator's state.

Imported by pipeline.py (its rule 4, "one random stream").
"""

import contextlib

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode


class RandomOps(TorchDispatchMode):
    """Records every op that draws from a random generator (torch tags them
    ``nondeterministic_seeded``): the op and the shapes and dtypes of its tensor arguments, enough
    to draw the same numbers again."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded in func.tags:

            def describe(a):
                return ("tensor", a.shape, a.dtype, a.device) if torch.is_tensor(a) else a

            self.ops.append(
                (func, [describe(a) for a in args], {k: describe(v) for k, v in kwargs.items()})
            )
        return func(*args, **kwargs)


def record_random_ops(
    stages: list[nn.Module], example_input: torch.Tensor, context=contextlib.nullcontext
) -> list:
    """``ops[s]``: the random ops stage ``s`` runs on one micro-batch, in order (none without
    dropout).

    Runs ``example_input`` through every stage in turn, once, inside ``context`` (the autocast of
    the real forward: it decides the dtypes of the masks), without gradients and on a fork of the
    generator, so nothing of the real stream is used. Every rank calls it before it keeps only its
    own stage."""
    ops = []
    device = example_input.device  # on a GPU dropout draws from the GPU's generator: fork that one
    forked = (
        torch.random.fork_rng(devices=[])
        if device.type == "cpu"
        else torch.random.fork_rng(devices=[device], device_type=device.type)
    )
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
        is_tensor = isinstance(a, tuple) and a[:1] == ("tensor",)
        return torch.empty(a[1], dtype=a[2], device=a[3]) if is_tensor else a

    for func, args, kwargs in ops:
        func(*[make(a) for a in args], **{k: make(v) for k, v in kwargs.items()})


def dropout_generator(device) -> torch.Generator:
    """The generator dropout draws from on ``device``: the CPU's, or that GPU's."""
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    return torch.default_generator


class RandomStream:
    """A rank's place in the one random stream, for its chunks (the model's stages ``model_stages``
    of ``random_ops``' P V): around chunk v's forward (``around(v)``) the draws of the stages before
    it and after it. A rank holding several chunks runs their forwards out of micro-batch order, so
    with dropout each chunk keeps its own copy of the generator's state, one micro-batch further on
    at each of its forwards; after a flush (``finish``) every chunk is one flush on: where one
    process's generator is."""

    def __init__(self, random_ops: list | None, model_stages: list[int], device):
        random_ops = random_ops or [[] for _ in range(max(model_stages) + 1)]
        self.before = [[op for ops in random_ops[:k] for op in ops] for k in model_stages]
        self.after = [[op for ops in random_ops[k + 1 :] for op in ops] for k in model_stages]
        self.per_chunk = any(random_ops) and len(model_stages) > 1
        self.device, self.generator, self.states = device, None, None

    def start(self) -> None:
        """Before a flush: each chunk's copy of the generator's state, where the generator is."""
        if self.per_chunk:
            self.generator = dropout_generator(self.device)
            self.states = [self.generator.get_state()] * len(self.before)

    @contextlib.contextmanager
    def around(self, v: int):
        if self.generator is not None:  # this chunk's place in the stream
            self.generator.set_state(self.states[v])
        replay_random_ops(self.before[v])  # the draws of the stages before this one
        yield
        replay_random_ops(self.after[v])
        if self.generator is not None:
            self.states[v] = self.generator.get_state()

    def finish(self) -> None:
        if self.generator is not None:
            self.generator.set_state(self.states[0])
