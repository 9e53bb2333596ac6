"""The schedules beyond 1F1B: interleaved 1F1B (virtual stages), zero bubble (a split backward).

Named for the two schedules it holds: GPipe and 1F1B, the schedules a learner meets first, are in
pipeline_schedules.py; these two are second ideas, each shrinking the bubble 1F1B leaves. Each
schedule is a pure function from (stage, stages, micro-batches) to the stage's action list, which
pipeline_schedules.py's ``schedule_actions`` returns and ``Pipeline.run`` (pipeline.py) follows;
``BackwardSplit`` is zero bubble's B and W, which ``Pipeline`` calls.

1. **Interleaved 1F1B** (Narayanan et al. 2021): the model cut into P x V chunks, rank r holding
   chunks r, r + P, ..., so a micro-batch loops through the ranks V times; micro-batches go in
   rounds of P, through chunk 0, then the same P through chunk 1, ...; the warm-up is (V - 1) P + 2
   (P - r - 1) forwards. A chunk is 1/V of a stage's work, so the ramp-up and drain cost 1/V as
   much: the bubble is (P - 1) / (V M + P - 1), for V times the messages. Each chunk's backwards
   still go in micro-batch order 0, 1, ..., M - 1, as one process accumulates: every ``.grad`` holds
   its bits. A rank runs its chunks' forwards out of micro-batch order, so with dropout each chunk
   keeps its own copy of the generator's state, one micro-batch further on at each of its forwards
   (``Pipeline.run``).
2. **Zero bubble: the backward split in two** (ZB-H1, Qi et al. 2023). The stage before waits only
   for the gradient of this stage's input, so ``B`` computes that (and, on the way, the gradient of
   every weighted layer's output, which it keeps) and sends it at once; ``W``, later, turns each
   kept output gradient into that layer's weight gradients (``backward(out, grad, inputs=layer's
   weights)``: the same kernels on the same numbers as one whole backward). Stage s defers its W's
   by s backwards, so they fill the slots where 1F1B idles: the bubble falls from 3 (P - 1) to P - 1
   units (F = B = W = 1), each stage holding min(P, M) micro-batches until their W. The W's add into
   ``.grad`` in micro-batch order, and the first stage runs the tied embedding's W's last, once the
   last stage's halves have all been sent (``BackwardSplit``).
"""

import contextlib

import torch


def interleaved_actions(
    stage: int, num_stages: int, micro_batches: int, chunks: int
) -> list[tuple[str, int, int]]:
    """Interleaved 1F1B (rule 1; as Megatron-LM and ``ScheduleInterleaved1F1B`` order it; M a
    multiple of P). The k-th forward of a rank: micro-batch ``(k // (P V)) P + k % P`` through chunk
    ``(k // P) % V`` (a round of P micro-batches through chunk 0, the same round through chunk 1,
    ...); the k-th backward the same with the chunks in reverse. The warm-up: the forwards that fill
    the rank's chunks before the first backward comes back, (V - 1) P on the last rank, two more per
    rank before it (a forward there and a backward back)."""
    P, M, V = num_stages, micro_batches, chunks
    total = M * V  # forwards (and backwards) of this rank: every micro-batch through every chunk
    warmup = min((V - 1) * P + 2 * (P - stage - 1), total)
    forward = [("F", (k // (P * V)) * P + k % P, (k // P) % V) for k in range(total)]
    backward = [("B", (k // (P * V)) * P + k % P, V - 1 - (k // P) % V) for k in range(total)]
    steady = [action for pair in zip(forward[warmup:], backward) for action in pair]
    return forward[:warmup] + steady + backward[total - warmup :]


def zero_bubble_actions(stage: int, num_stages: int, micro_batches: int) -> list[tuple[str, int]]:
    """ZB-H1 (rule 2), as ``ScheduleInterleavedZeroBubble`` orders one stage per rank: 1F1B, its
    backward split into ``("B", i)``, the gradient of the stage's input (what the stage before waits
    for), and ``("W", i)``, the gradients of its weights (what nobody waits for). Stage s runs its
    first W after its (s + 1)-th B, then one W after each B, the rest at the end: the W's fill the
    slots where 1F1B's stage s idles waiting for gradients."""
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


class BackwardSplit:
    """Zero bubble's backward of one stage's ``module`` in two (rule 2): ``backward_input`` (B) now,
    ``backward_weights`` (W) later. ``tied_parameter``: on the first stage, the tied embedding,
    whose W's wait for ``finish`` (the last stage's halves are added in its hook)."""

    def __init__(self, module, tied_parameter=None):
        self.tied_parameter, self.recording = tied_parameter, None
        self.deferred, self.peak_deferred, self.tied_weights = {}, 0, []
        for layer in module.modules():  # every layer that holds weights reports its output
            if next(layer.parameters(recurse=False), None) is not None:
                layer.register_forward_hook(self._record_layer_output)

    def _record_layer_output(self, layer, args, output) -> None:
        if self.recording is not None:
            self.recording.append((layer, output))

    @contextlib.contextmanager
    def recorded(self):
        """Around a forward: the (weighted layer, output) pairs it ran, for ``backward_input``."""
        self.recording = []
        try:
            yield self.recording
        finally:
            self.recording = None

    def backward_input(self, key, output, grad, x, layers) -> torch.Tensor | None:
        """B of micro-batch ``key``: the gradient of the stage's input ``x`` (None: the first
        stage's token ids, nothing to send back) and of each weighted layer's output, kept for W,
        with the graph."""
        wanted = ([x] if x is not None else []) + [out for _, out in layers]
        grads = torch.autograd.grad(output, wanted, grad, retain_graph=True, allow_unused=True)
        self.deferred[key] = list(zip(layers, grads[len(wanted) - len(layers) :]))
        self.peak_deferred = max(self.peak_deferred, len(self.deferred))
        return grads[0] if x is not None else None

    def backward_weights(self, key) -> None:
        """W of micro-batch ``key``: each weighted layer's weight gradients from its output's
        gradient, saved by B, accumulated into ``.grad`` as a whole backward would (the tie's hooks
        run here)."""
        for (layer, out), grad in self.deferred.pop(key):
            if grad is None:
                continue
            weights = list(layer.parameters(recurse=False))
            if self.tied_parameter is not None and any(w is self.tied_parameter for w in weights):
                self.tied_weights.append((out, grad, weights))  # after the last W (``finish``)
            else:
                torch.autograd.backward(out, grad, inputs=weights)

    def finish(self) -> None:
        """After a flush's last W: the tie's W's, in micro-batch order (the last stage's halves
        are in)."""
        for out, grad, weights in self.tied_weights:
            torch.autograd.backward(out, grad, inputs=weights)
        self.tied_weights.clear()
