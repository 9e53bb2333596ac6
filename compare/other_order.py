"""Two runs that sum in another order: how far apart they are, and whether that is as far as two
correct implementations drift apart *on this machine*.

Steps 0, 8, 10 and 11 add the same numbers as step 1 in another order (one process's micro-batches,
a row-parallel layer's partial products, a ring's softmax blocks), so they cannot be bitwise equal
to it, and how far they drift depends on the CPU's kernels: ATen and MKL choose their vector code
per instruction set (docs/parity.md, "Another summation order, on any CPU"). A fixed tolerance made
on one CPU fails on another. So such a run is judged against a reference pair measured on the same
machine, in the same session:

1. The first step's loss agrees to float32's rounding (< 1e-6 relative): both start from the same
   weights and data, so only the order of one forward's sums differs. That holds on every CPU.
2. Everything that follows (the losses, the param norm, the weights after the last step) drifts no
   further than ``FACTOR`` times the reference pair's drift: step 0 against step 1, two correct
   implementations on the same global batches. A drift of 0 on both sides of a comparison that must
   differ is a test's business.

A real bug (a wrong mask, a lost gradient, a shard cut from the wrong rows) moves the weights by
about the learning rate in one step, a thousand times the reference's drift on the tests' workload.
"""

from dataclasses import dataclass, fields

import torch

FACTOR = 10  # measured: at most 2.3 x the reference, on three kernel paths (docs/parity.md)
FIRST_LOSS = 1e-6  # relative: float32's rounding of one forward (about 8 ulps)
EPS = torch.finfo(torch.float32).eps


@dataclass
class Drift:
    """How far run ``a`` is from run ``b``:
    relative for losses, absolute for the param norm and the weights."""

    first_loss: float
    loss: float  # the largest relative loss difference over the logged steps
    param_norm: float  # the largest |param norm difference| over the logged steps
    weights: float  # the largest |difference| of any final weight

    def __str__(self) -> str:
        return (
            f"first loss {self.first_loss:.1e}, loss {self.loss:.1e}, param norm "
            f"{self.param_norm:.1e}, "
            f"weights {self.weights:.1e}"
        )


def drift(metrics_a: dict, weights_a: dict, metrics_b: dict, weights_b: dict) -> Drift:
    ra, rb = metrics_a["records"], metrics_b["records"]
    return Drift(
        first_loss=abs(ra[0]["loss"] - rb[0]["loss"]) / abs(rb[0]["loss"]),
        loss=max(abs(x["loss"] - y["loss"]) / abs(y["loss"]) for x, y in zip(ra, rb)),
        param_norm=max(abs(x["param_norm"] - y["param_norm"]) for x, y in zip(ra, rb)),
        weights=max(
            (weights_a[n].double() - weights_b[n].double()).abs().max().item() for n in weights_b
        ),
    )


def largest(*drifts: Drift) -> Drift:
    """Each quantity's largest drift over several reference pairs
    (one process regrouped two ways, say)."""
    return Drift(*(max(getattr(d, f.name) for d in drifts) for f in fields(Drift)))


def bound(reference: Drift, metrics: dict, weights: dict) -> Drift:
    """What a run may drift: ``FACTOR`` times the reference's, each at least one float32 ulp of its
    quantity (the reference could, by chance, round alike), and the first loss to
    float32's rounding."""
    biggest = max(w.abs().max().item() for w in weights.values())
    norm = metrics["records"][-1]["param_norm"]
    return Drift(
        first_loss=FIRST_LOSS,
        loss=FACTOR * max(reference.loss, EPS),
        param_norm=FACTOR * max(reference.param_norm, EPS * norm),
        weights=FACTOR * max(reference.weights, EPS * biggest),
    )


def beyond(candidate: Drift, limit: Drift) -> list[str]:
    """The quantities of ``candidate`` over ``limit``: empty when the run is within the bound."""
    return [
        f"{f.name} {getattr(candidate, f.name):.1e} > {getattr(limit, f.name):.1e}"
        for f in fields(Drift)
        if not getattr(candidate, f.name) <= getattr(limit, f.name)
    ]
