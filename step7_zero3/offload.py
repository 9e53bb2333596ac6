"""ZeRO-Offload: the optimiser's state and its step on the host, so the device holds only what
forward and backward need (``--offload-optimizer``; DeepSpeed's ZeRO-Offload, FSDP2's
``CPUOffloadPolicy``).

1. **What moves.** Per rank, ZeRO-3 holds 4Ψ/N of parameters, 4Ψ/N of gradients and 8Ψ/N of AdamW
   moments on the device. Offloaded, the moments and a float32 copy of the parameters (the masters
   AdamW updates) live in host memory: the device keeps 8Ψ/N, the host 12Ψ/N, plus a host copy of
   the gradients (4Ψ/N) while it steps.
2. **One step, three moves.** The gradient shards go to the host after the reduce-scatter (and after
   clipping, which reads them where they are), AdamW steps the host copies, the updated shards come
   back. On a GPU the host tensors are pinned and the copies non-blocking, the host waiting for the
   device before it reads.
3. **The optimiser the loop already knows.** ``OffloadedOptimizer`` is a ``torch.optim.Optimizer``
   over the device parameters (the scheduler sets their learning rate, the gradient scaler unscales
   and checks their gradients, checkpoints number its state by them), whose ``step`` runs a plain
   optimiser, built by ``make``, over the host copies. Its state dict is the inner one's: a
   checkpoint does not say where the state lived.
4. **The same numbers.** AdamW does the same arithmetic on the copies: on a CPU the run is bitwise
   the run without offload; on a GPU the update runs on the CPU's kernels instead of the GPU's
   (other rounding).
"""

import torch

HOST = torch.device("cpu")  # where the masters, the moments and the step live


class OffloadedOptimizer(torch.optim.Optimizer):
    """``make(named_host_params)`` builds the optimiser that steps on the host (step 7:
    AdamW, by ``make_optimizer``)."""

    def __init__(self, named_params, make, host: torch.device = HOST):
        named_params = list(named_params)
        pinned = torch.cuda.is_available() and any(p.is_cuda for _, p in named_params)
        # rule 1: the float32 masters AdamW updates, trainable where the parameters are
        self.host_copies = []
        for _, param in named_params:
            copy = param.detach().to(host, copy=True)
            self.host_copies.append(
                (copy.pin_memory() if pinned else copy).requires_grad_(param.requires_grad)
            )
        self.inner = make([(name, copy) for (name, _), copy in zip(named_params, self.host_copies)])
        device_of = {id(copy): param for (_, param), copy in zip(named_params, self.host_copies)}
        groups = [
            {**group, "params": [device_of[id(copy)] for copy in group["params"]]}
            for group in self.inner.param_groups
        ]
        # rule 3: the groups hold the device parameters
        super().__init__(groups, self.inner.defaults)
        self.state = self.inner.state  # what memory_stats counts: the moments, on the host
        self.pairs = list(
            zip(
                [p for group in self.param_groups for p in group["params"]],
                [c for group in self.inner.param_groups for c in group["params"]],
            )
        )

    def host_bytes(self) -> int:
        """What rule 1 keeps in host memory:
        the float32 copies and the optimiser's state (a step's ``host``)."""
        state = (v for s in self.state.values() for v in s.values() if torch.is_tensor(v))
        return sum(t.numel() * t.element_size() for t in [*self.host_copies, *state])

    @torch.no_grad()
    def step(self, closure=None):
        """Rule 2: gradients to the host, AdamW on the host, parameters back."""
        # the scheduler's learning rate
        for ours, inner in zip(self.param_groups, self.inner.param_groups):
            inner.update({key: value for key, value in ours.items() if key != "params"})
        for param, copy in self.pairs:
            # copy=True: a host tensor of its own even where
            # the host is the device (a CPU run), as on a GPU
            copy.grad = (
                None
                if param.grad is None
                else param.grad.to(copy.device, copy=True, non_blocking=True)
            )
        if any(param.is_cuda for param, _ in self.pairs):
            # the non-blocking copies have landed before the host reads them
            torch.cuda.synchronize()
        self.inner.step()
        for param, copy in self.pairs:
            param.copy_(copy, non_blocking=True)

    def zero_grad(self, set_to_none: bool = True):
        super().zero_grad(set_to_none)
        self.inner.zero_grad(set_to_none)

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """The state onto the host, and the host copies
        from the device parameters (loaded just before)."""
        self.inner.load_state_dict(state_dict)
        for ours, inner in zip(self.param_groups, self.inner.param_groups):
            ours.update({key: value for key, value in inner.items() if key != "params"})
        for param, copy in self.pairs:
            copy.copy_(param)
