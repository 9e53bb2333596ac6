"""The tied embedding across a pipeline: its two gradient contributions combined per micro-batch.

GPT-2's token embedding is also its output layer: a pipeline's first stage holds it for the lookup,
the last a copy for the logits. One process sums the two gradient contributions of each micro-batch
before adding the sum to ``.grad``. So the last stage sends its contribution of each micro-batch to
the first (a hook on its copy), which adds it to its own in the hook that runs just before
accumulation: the same additions in the same order, bit for bit (a + b == b + a). Summing each
stage's accumulated part once per step is cheaper (Megatron-LM's way), but adds in another order:
off in the last bits. After the last backward of an optimiser step the first stage sends the
combined gradient back (``finish``), and both copies step alike.

Imported by pipeline.py (its rule 3), whose point-to-point ``send`` and ``recv`` it is given.
"""

import torch

TIED_TAG = 1  # the tie's stream between the last and the first stage (pipeline.py's message_tag)
KIND = "p2p tied-parameter gradient"  # what comm_accounting counts its messages as


class TiedGradient:
    """The tie of ``parameter``, held on the first stage (``is_first``) and a copy on the last
    (``last_stage``); ``send(tensor, stage, kind, tag)`` and ``recv(shape, dtype, stage, tag)`` are
    the pipeline's point-to-point, by stage."""

    def __init__(self, parameter, is_first: bool, last_stage: int, send, recv):
        self.parameter, self.is_first, self.last_stage = parameter, is_first, last_stage
        self.send, self.recv = send, recv
        parameter.register_hook(self._add_contribution if is_first else self._send_contribution)

    def _send_contribution(self, grad: torch.Tensor) -> torch.Tensor:
        self.send(grad.clone(), 0, KIND, TIED_TAG)  # a copy: .grad may take grad over
        return grad

    def _add_contribution(self, grad: torch.Tensor) -> torch.Tensor:
        # One process sums the two contributions, then accumulates: a + b == b + a, bit for bit.
        return grad + self.recv(grad.shape, grad.dtype, self.last_stage, TIED_TAG)

    def finish(self) -> None:
        """After an optimiser step's last backward: the combined gradient, first stage to last."""
        p = self.parameter
        if self.is_first:
            self.send(p.grad, self.last_stage, KIND, TIED_TAG)
        else:
            p.grad = self.recv(p.shape, p.dtype, 0, TIED_TAG)
