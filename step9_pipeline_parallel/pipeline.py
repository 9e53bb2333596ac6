"""Pipeline parallelism: the model cut into stages by blocks, one per rank, micro-batches flowing.

Steps 1-7 replicated (or sharded) the *whole* model on every rank and split the *batch*: every rank
ran every layer. Here the *layers* are split: rank s holds stage s (a run of consecutive blocks; the
embedding with the first stage, the final norm and the output layer with the last: our GPT-2's
stages are pipeline_stages.py, read before this file), and a batch flows through the ranks as
micro-batches. Here:

1. **Point-to-point, shapes known in advance.** A stage sends its output activation to the next
   stage (``isend``) and receives the gradient of that activation back; the next stage receives into
   a buffer it allocated from the shape it was told at construction. No shapes travel: one message
   per activation and one per gradient, ``batch x sequence x hidden x dtype size`` bytes each. Sends
   are asynchronous and waited at the end of the step (``finish_gradient_synchronization``), so a
   stage never blocks on a peer that is itself blocked sending to it; receives block, within the
   process group's timeout (a dead or frozen stage ends the job, never hangs it). Over gloo a
   message between GPUs goes through host memory: host_staging.py.
2. **A schedule, followed.** ``run`` does what ``schedule_actions`` lists for this stage, in
   order: forwards, backwards (and zero bubble's weight gradients) of numbered micro-batches. The
   schedules are pure functions: GPipe and 1F1B in pipeline_schedules.py, read before this file;
   interleaved 1F1B and zero bubble, which shrink the bubble, in interleaved_and_zero_bubble.py,
   read after it. Every one runs the backwards in micro-batch order, as one process accumulates:
   every ``.grad`` holds the same bits.
3. **The tied embedding, combined per micro-batch.** GPT-2's token embedding is also its output
   layer: the first stage holds it, the last a copy. The last stage sends its gradient contribution
   of each micro-batch to the first, which adds it before accumulating, as one process adds the two;
   after the last backward the sum goes back, and both copies step alike (tied_embedding.py).
4. **One random stream.** Dropout draws from the global generator, in model order, micro-batch after
   micro-batch. Every stage replays the draws of the other stages, so that it draws its own masks
   from exactly where one process would: the masks are one process's masks (dropout_replay.py).
5. **The loss on the last stage.** Only the last stage has the targets' logits; it divides each
   micro-batch's loss by the number of micro-batches accumulated per optimiser step, as one process
   does (``loss / accum``), and starts that micro-batch's backward.
"""

import contextlib
import time

import torch
import torch.distributed as dist
from torch import nn

from comm_accounting import count_collective
from dropout_replay import RandomStream
from host_staging import host_staged
from interleaved_and_zero_bubble import BackwardSplit
from pipeline_schedules import SCHEDULES, schedule_actions
from tied_embedding import TiedGradient

CPU = torch.device("cpu")


def message_tag(to_stage: int, gradient: bool) -> int:
    """The point-to-point tag of an activation (``gradient``: an activation's gradient) sent to the
    model's stage ``to_stage``: a stream per receiving stage and direction, so that a receive takes
    its own messages in micro-batch order whatever else the sender sent between them (a rank with V
    chunks talks to its neighbour for several of them). 1 is the tie's (tied_embedding.py)."""
    return 2 + 2 * to_stage + int(gradient)


class Pipeline:
    """Runs one stage of a pipeline: this rank's ``module``, micro-batch by micro-batch, by a
    schedule.

    ``module``: this stage (any ``nn.Module`` mapping one tensor to one tensor); with
    ``schedule="interleaved-1f1b"``, a list of this rank's V chunks, chunk v being the model's stage
    v P + ``stage`` of P V. ``activation_shape`` and ``activation_dtype``: what every stage but the
    first receives (the previous stage's output for one micro-batch). ``loss_fn(output, target)``:
    the last stage's loss. ``tied_parameter``: on the first and the last stage, the parameter both
    hold a copy of (GPT-2's embedding), or None. ``ranks``: the global rank of each stage (default:
    stage s is rank s). ``schedule``: one of ``SCHEDULES`` (rule 2). ``context``: entered around
    each forward (autocast). ``random_ops``: ``record_random_ops``'s list for every stage of the
    model (P V of them), or None when nothing draws at random. ``device``: where received tensors go
    (this stage's device).

    ``run(micro_batches, inputs, targets, loss_scale)`` runs the forwards and backwards of that many
    micro-batches (the first stage reads the list ``inputs``, the last ``targets``; the others pass
    neither) and returns the last stage's losses (undivided). Gradients accumulate in ``.grad``
    across calls, as with ``backward()``; ``finish_gradient_synchronization()`` is the single sync
    point before the optimiser step.
    """

    def __init__(
        self,
        module,
        stage: int,
        num_stages: int,
        activation_shape,
        activation_dtype=torch.float32,
        loss_fn=None,
        tied_parameter=None,
        ranks=None,
        schedule: str = "1f1b",
        context=contextlib.nullcontext,
        random_ops=None,
        device=CPU,
    ):
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        self.chunks = list(module) if isinstance(module, (list, tuple)) else [module]
        if (len(self.chunks) > 1) != (schedule == "interleaved-1f1b"):
            raise ValueError(
                f"schedule {schedule!r} with {len(self.chunks)} chunks on a rank: "
                "the interleaved schedule takes a list of 2 or more chunks, the "
                "others one module"
            )
        self.module = nn.ModuleList(self.chunks) if len(self.chunks) > 1 else module  # this rank's
        self.stage, self.num_stages, self.schedule = stage, num_stages, schedule
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1
        self.activation_shape = torch.Size(activation_shape)
        self.activation_dtype, self.loss_fn = activation_dtype, loss_fn
        self.context, self.device = context, torch.device(device)
        self.ranks = list(ranks) if ranks is not None else list(range(num_stages))
        self.model_stages = num_stages * len(self.chunks)  # P V of them
        self.model_stage = [v * num_stages + stage for v in range(len(self.chunks))]  # chunk v's
        self.random_stream = RandomStream(random_ops, self.model_stage, self.device)  # rule 4
        self.pending_sends = []  # (work, tensor): a send's tensor must live until it is waited
        self.tied_parameter = tied_parameter if num_stages > 1 else None
        self.tie = (
            None
            if self.tied_parameter is None
            else TiedGradient(
                self.tied_parameter, self.is_first, num_stages - 1, self._send, self._recv
            )
        )
        self.split = None  # zero bubble: every weighted layer reports its output during a forward
        if schedule == "zero-bubble":
            self.split = BackwardSplit(self.module, self.tied_parameter if self.is_first else None)
        self.timeline = None  # a list to record (what, micro-batch, start, end, chunk) into
        self.in_flight, self.peak_in_flight = 0, 0  # micro-batches (per chunk) held for backward

    @property
    def peak_deferred(self) -> int:
        """Zero bubble: the most micro-batches whose W this stage held back at once (else 0)."""
        return self.split.peak_deferred if self.split else 0

    # ---- point-to-point ----------------------------------------------------------------------
    def _send(self, tensor: torch.Tensor, stage: int, kind: str, tag: int) -> None:
        started = time.perf_counter()
        tensor = tensor.detach().contiguous()
        if host_staged(dist.get_backend(), tensor.device):
            tensor = tensor.cpu()  # a copy in host memory, kept until the send is waited
        self.pending_sends.append((dist.isend(tensor, self.ranks[stage], tag=tag), tensor))
        count_collective(kind, tensor)
        self._record("send", None, started)

    def _recv(self, shape, dtype, stage: int, tag: int) -> torch.Tensor:
        """Blocks until the tensor is here, at most the process group's timeout (then raises)."""
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

    # ---- one forward, one backward, of micro-batch i through this rank's chunk v ----------------
    def _forward(self, i: int, v: int, inputs, targets, held: dict, losses: list) -> None:
        k = self.model_stage[v]  # receive from the model's stage k - 1, send to k + 1
        first, last = k == 0, k == self.model_stages - 1
        if first:
            x = inputs[i]
        else:
            x = self._recv(
                self.activation_shape,
                self.activation_dtype,
                (k - 1) % self.num_stages,
                message_tag(k, gradient=False),
            )
            x.requires_grad_(True)  # its gradient is what this stage sends back
        started = time.perf_counter()
        recording = self.split.recorded() if self.split else contextlib.nullcontext()
        with self.random_stream.around(v), self.context(), recording as layers:  # rule 4
            output = self.chunks[v](x)  # layers: zero bubble's weighted layers, for its B
            loss = self.loss_fn(output, targets[i]) if last else None
        self._record("forward", i, started, v)
        if last:
            losses.append(loss.detach())
        else:
            if output.shape != self.activation_shape or output.dtype != self.activation_dtype:
                raise ValueError(
                    f"stage {k} produced {tuple(output.shape)} {output.dtype}, the "
                    f"next stage expects {tuple(self.activation_shape)} "
                    f"{self.activation_dtype}"
                )
            self._send(
                output,
                (k + 1) % self.num_stages,
                "p2p activations",
                message_tag(k + 1, gradient=False),
            )
        held[i, v] = (x, loss if last else output, layers)
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)

    def _backward(self, i: int, v: int, held: dict, loss_scale: float) -> None:
        """The whole backward of micro-batch i through chunk v; with zero bubble, its B only."""
        k = self.model_stage[v]
        x, output, layers = held.pop((i, v))
        if k == self.model_stages - 1:
            started = time.perf_counter()
            output, grad = output / loss_scale, None  # as one process: (loss / accum).backward()
        else:
            grad = self._recv(
                output.shape, output.dtype, (k + 1) % self.num_stages, message_tag(k, gradient=True)
            )
            started = time.perf_counter()
        if layers is None:
            torch.autograd.backward(output, grad)
            input_grad = x.grad if k > 0 else None
        else:  # B: the input's gradient now; the weights' (W) later, from what B keeps
            x = x if k > 0 else None  # the first stage's input: token ids, nothing to send back
            input_grad = self.split.backward_input((i, v), output, grad, x, layers)
        self._record("backward", i, started, v)
        self.in_flight -= layers is None  # zero bubble: its activations are held until W
        if k > 0:
            self._send(
                input_grad,
                (k - 1) % self.num_stages,
                "p2p activation gradients",
                message_tag(k - 1, gradient=True),
            )

    def _weights(self, i: int, v: int) -> None:
        """Zero bubble's W of micro-batch i: its weight gradients, into ``.grad``."""
        started = time.perf_counter()
        self.split.backward_weights((i, v))
        self._record("weights", i, started, v)
        self.in_flight -= 1

    def run(
        self, micro_batches: int, inputs=None, targets=None, loss_scale: float = 1.0
    ) -> list[torch.Tensor]:
        """Forward and backward ``micro_batches`` micro-batches by the schedule; the last stage's
        losses."""
        if self.schedule == "interleaved-1f1b" and micro_batches % self.num_stages:
            raise ValueError(
                f"the interleaved schedule runs micro-batches in rounds of "
                f"{self.num_stages} (the stages): {micro_batches} is not a multiple"
            )
        held, losses = {}, []
        self.random_stream.start()
        for kind, i, *chunk in schedule_actions(
            self.schedule, self.stage, self.num_stages, micro_batches, len(self.chunks)
        ):
            v = chunk[0] if chunk else 0
            if kind == "F":
                self._forward(i, v, inputs, targets, held, losses)
            elif kind == "B":
                self._backward(i, v, held, loss_scale)
            else:
                self._weights(i, v)
        if self.split:  # zero bubble: the tie's W's, last, in micro-batch order
            self.split.finish()
        self.random_stream.finish()  # every chunk one flush on: where one process's generator is
        return losses

    def finish_gradient_synchronization(self) -> None:
        """After the last ``run`` of an optimiser step: the last stage gets the tied parameter's
        combined gradient from the first, and every send is waited (its tensor may then be
        freed)."""
        if self.tie is not None:
            self.tie.finish()
        for work, _ in self.pending_sends:
            work.wait()
        self.pending_sends.clear()

    def from_last_stage(self, value: torch.Tensor, group=None) -> torch.Tensor:
        """What the last stage holds in ``value`` (the loss: only it has the logits), on every
        stage, in float64: a broadcast over ``group`` (the pipeline's ranks; default every rank), on
        the device: nccl moves GPU tensors only. Collective."""
        value = torch.tensor(value.item(), dtype=torch.float64, device=self.device)
        dist.broadcast(value, src=self.ranks[-1], group=group)
        return value

    def take_peak_in_flight(self) -> int:
        """The most micro-batches whose activations this stage held at once since the last call."""
        peak, self.peak_in_flight = self.peak_in_flight, self.in_flight
        return peak
