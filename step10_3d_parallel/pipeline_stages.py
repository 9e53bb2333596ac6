"""The stages: our GPT-2 cut by blocks, one stage per rank, each computing its part of the
model's forward under the model's own names. ``Pipeline`` (pipeline.py) runs any module that maps
one tensor to one tensor; this file makes our GPT-2 into such modules, so it is a file of its own,
read before pipeline.py.

1. **Consecutive blocks, as even as can be** (``stage_blocks``). Stage s of P holds a run of
   consecutive blocks, the first stages one more where P does not divide them; the embedding goes
   with the first stage, the final norm and the output layer with the last.
2. **The model's own modules, under the model's names.** A stage holds the model's modules, not
   copies, its blocks keyed by their index in the model: its ``named_parameters()`` are the model's
   names (``transformer.h.3.mlp.c_fc.weight``), so a checkpoint by name needs no translation. Its
   forward is the model's own code (``GPT2.embed``, the blocks, ``GPT2.head``), so in turn the
   stages compute ``model(ids)`` bit for bit.
3. **The tied embedding, copied.** GPT-2's output layer is its token embedding. With more than one
   stage the first holds it and the last a copy (``tied_parameter``), whose gradients
   tied_embedding.py combines (pipeline.py's rule 3); the copy is no parameter of the model, so
   ``owned_parameters`` leaves it out.
"""

import torch
from torch import nn

from model import GPT2


def stage_blocks(n_blocks: int, num_stages: int) -> list[range]:
    """The blocks of each stage: consecutive, as even as can be (the first stages take one more)."""
    base, extra = divmod(n_blocks, num_stages)
    starts = [s * base + min(s, extra) for s in range(num_stages + 1)]
    return [range(starts[s], starts[s + 1]) for s in range(num_stages)]


class GPT2Stage(nn.Module):
    """Stage ``stage`` of ``num_stages`` of our ``GPT2`` (model.py), under the model's own names.

    A slice of the model's block list: the first stage maps token ids to hidden states (``embed``:
    token and position embeddings, dropout; then its blocks), the middle ones hidden states to
    hidden states, the last hidden states to logits (its blocks, then ``head``: final norm, output
    layer).
    The modules are the model's own, the blocks keyed by their index in the model, so a stage's
    ``named_parameters()`` are the model's names (``transformer.h.3.mlp.c_fc.weight``). With more
    than one stage the last stage's output layer gets a copy of the tied embedding:
    ``tied_parameter``.
    """

    def __init__(self, model, stage: int, num_stages: int):
        super().__init__()
        self.config, self.stage, self.num_stages = model.config, stage, num_stages
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1
        source, self.transformer = model.transformer, nn.Module()
        if self.is_first:
            self.transformer.wte, self.transformer.wpe = source.wte, source.wpe
            self.transformer.drop = source.drop
        blocks = stage_blocks(len(source.h), num_stages)[stage]
        self.transformer.h = nn.ModuleDict({str(i): source.h[i] for i in blocks})
        tied = None
        if self.is_last:
            self.transformer.ln_f = source.ln_f
            # On the meta device: a new Linear would draw its weight from dropout's generator.
            self.lm_head = nn.Linear(
                model.lm_head.in_features, model.lm_head.out_features, bias=False, device="meta"
            )
            if self.is_first:  # one stage: the model's own tie
                self.lm_head.weight = source.wte.weight
            else:
                self.lm_head.weight = tied = nn.Parameter(model.lm_head.weight.detach().clone())
        if self.is_first and num_stages > 1:
            tied = source.wte.weight
        self._tied = (tied,)  # in a tuple: as an attribute it would be registered under a new name

    @property
    def tied_parameter(self) -> nn.Parameter | None:
        """The copy of the tied embedding this stage holds, on the first and the last stage."""
        return self._tied[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``GPT2.forward``'s ops for this stage's part, in its order: in turn the stages compute
        the model."""
        if self.is_first:  # the model's own code, run on the modules this stage holds
            x = GPT2.embed(self, x)
        for block in self.transformer.h.values():
            x = block(x)
        if self.is_last:  # ln_f, then the output layer
            x = GPT2.head(self, x)
        return x

    def owned_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The parameters this stage answers for, by the model's names: the tied embedding counts
        once, on the first stage (the last stage's copy is not a parameter of the model)."""
        return [
            (name, p)
            for name, p in self.named_parameters()
            if not (p is self.tied_parameter and not self.is_first)
        ]
