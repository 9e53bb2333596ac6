"""A pipeline's state, apart from its schedule (pipeline.py): every stage's parameters and AdamW state gathered
to rank 0 as one process would hold them, which is what step 9's checkpoints and final weights are.

1. **One replica, one checkpoint.** All stages together are one model: rank 0 writes it whole (``model``, and
   ``optimizer`` with ``optimizer_slices`` naming each state), so a checkpoint of step 9 reads as step 0's, at
   any number of stages, and step 0 resumes it.
2. **The tie once.** The last stage's copy of the tied embedding is the first stage's, trained alike: its
   parameter and its AdamW state are taken once, from the first stage (``owned``).
"""

import torch.distributed as dist

import distributed
from checkpoint import load_optimizer, load_parameters, optimizer_state


def owned(named: list) -> list:
    """This stage's share of the model's parameters: the tied embedding once, on the first stage."""
    first = dist.get_rank() == 0
    return [(n, p) for n, p in named if n != "transformer.wte.weight" or first]


def gather_full_state(named: list, optimizer, is_main: bool) -> dict:
    """On rank 0: the whole model by name (``model``) and, given an ``optimizer``, AdamW's state as one process
    would hold it (``optimizer`` and ``optimizer_slices``, the tied embedding's state taken once). Others: {}."""
    mine = {"model": {n: p.detach().cpu() for n, p in owned(named)}}
    if optimizer is not None:
        mine.update(optimizer_state(optimizer, named))
    everyone = distributed.gather_from_every_rank(mine)
    if not is_main:
        return {}
    full = {"model": {n: t for stage in everyone for n, t in stage["model"].items()}}
    if optimizer is not None:
        groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": []}
            for g in everyone[0]["optimizer"]["param_groups"]
        ]
        state, slices = {}, []
        for stage in everyone:
            for group, stage_group in zip(groups, stage["optimizer"]["param_groups"]):
                for i in stage_group["params"]:
                    if any(s[0] == stage["optimizer_slices"][i][0] for s in slices):
                        continue  # the tied embedding's second copy: the same state as the first
                    if i in stage["optimizer"]["state"]:
                        state[len(slices)] = stage["optimizer"]["state"][i]
                    group["params"].append(len(slices))
                    slices.append(stage["optimizer_slices"][i])
        full.update(optimizer={"state": state, "param_groups": groups}, optimizer_slices=slices)
    return full


class PipelineState:
    """checkpoint.py's part for a pipeline stage: every stage's state gathered to rank 0, which saves it as one
    process's (rule 1); each stage loads its own parameters back by name, wherever the stage boundaries now are."""

    per_rank = False

    def __init__(self, named: list, optimizer):
        self.named, self.optimizer = named, optimizer

    def checkpoint_state(self) -> dict:
        # a collective, on every stage
        return gather_full_state(self.named, self.optimizer, dist.get_rank() == 0)

    def load_checkpoint(self, checkpoint) -> None:
        load_parameters(self.named, checkpoint)
        load_optimizer(self.optimizer, checkpoint, self.named)
