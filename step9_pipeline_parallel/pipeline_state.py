"""A pipeline's state, apart from its schedule (pipeline.py): each stage's parameters and AdamW
state given to DCP under the model's own names, which is what step 9's checkpoints are; the whole
model gathered for its final weights.

1. **One replica, one checkpoint.** All stages together are one model: each stage gives DCP its own
   parameters and their AdamW state whole (dcp_checkpoint.py), so a checkpoint of step 9 reads as
   one process's, at any number of stages, and any step 1-12 resumes it; each stage loads back its
   parameters by name, wherever the stage boundaries now are.
2. **The tie once.** The last stage's copy of the tied embedding is the first stage's, trained
   alike: its parameter and its AdamW state are saved once, from the first stage (``owned``), and
   read by both.
"""

import torch.distributed as dist

import distributed
from checkpoint import load_optimizer, load_parameters, whole_places
from dcp_checkpoint import Place, model_state, optimizer_state


def owned(named: list) -> list:
    """This stage's share of the model's parameters: the tied embedding once, on the first stage."""
    first = dist.get_rank() == 0
    return [(n, p) for n, p in named if n != "transformer.wte.weight" or first]


def gather_full_model(named: list, is_main: bool) -> dict | None:
    """On rank 0: the whole model by name, every stage's parameters (the tie once). Others: None."""
    everyone = distributed.gather_from_every_rank({n: p.detach().cpu() for n, p in owned(named)})
    return {n: t for stage in everyone for n, t in stage.items()} if is_main else None


class PipelineState:
    """checkpoint.py's part for a pipeline stage (rule 1):
    its parameters and AdamW state, the tie once (rule 2)."""

    per_rank = True

    def __init__(self, named: list, optimizer):
        self.named, self.optimizer = named, optimizer

    def checkpoint_state(self) -> dict:
        mine = {n for n, _ in owned(self.named)}
        places = [p if p[0] in mine else None for p in whole_places(self.optimizer, self.named)]
        return {
            **model_state([(n, p, Place(tuple(p.shape))) for n, p in owned(self.named)]),
            **optimizer_state(self.optimizer, places),
        }

    def load_checkpoint(self, checkpoint) -> None:
        load_parameters(self.named, checkpoint)
        load_optimizer(self.optimizer, checkpoint, self.named)
