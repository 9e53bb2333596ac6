"""Sums of squares that come out the same bits however the numbers are split across ranks.

Why parity needs them. Clipping multiplies every gradient by max_norm / norm, so a norm that rounds
one way on a rank holding whole tensors and another way on ranks holding slices (ZeRO), shards (TP)
or stages (PP) changes every weight of the step, and bitwise parity between layouts is gone. Float
addition is not associative: the squares of one 1e4 and eight 1.0s, added in float32 in that order,
give 1e8 (each 1.0 is lost below 1e8's spacing of 8); the eight summed first, as on a rank holding
only them, give 100000008. The clipping norm gets away with float64 (``training.sum_of_squares``): a
float32 square is exact in float64, and the 29 bits float64 keeps beyond float32 absorb any grouping
before the norm is rounded to float32 (unless it sits within ~1e-16 of a float32 rounding boundary).
The logged parameter norm is kept in float64 and compared bit for bit, and there a float64 sum
grouped by shard differs from one grouped by tensor in the last bit (docs/design.md, "Norms"): it is
summed exactly, here (``training.param_norm``).

How the sum is exact. ``frexp`` writes each float32 as m * 2**(e - 24) with an integer |m| < 2**24,
so its square is the integer m**2 (< 2**48) times 2**(2e - 48). The integers are added per exponent
e (277 bins, subnormals included), each split into its high and low 24 bits so that every partial
sum stays an integer below 2**53, exact in float64 and then in int64. Integers add exactly in any
order: the parts of a tensor's slices, summed or all-reduced in any grouping, are the parts of the
tensor, and ``norm_from_parts`` adds the bins in Python integers and rounds once. The squares above
give 100000008 in either order.

Named exact_sums, not exact_norm: what is exact, and what ranks all-reduce and the streaming export
adds tensor by tensor, is the sum (its parts); the norm is its square root, rounded once.
"""

import math

import torch

# Exponents frexp gives a float32 (subnormals included): x = mantissa * 2**e, -148 <= e <= 128.
MIN_EXPONENT, EXPONENTS = -148, 277


def square_sum_parts(tensors) -> torch.Tensor:
    """The sum of the squares of every element of ``tensors`` (float32 or narrower), *exactly*, as
    integers.

    Each float32 is m * 2**(e - 24) with an integer |m| < 2**24, so its square is the integer m**2
    (< 2**48) times 2**(2e - 48). Row 0 and 1 of the result hold, per exponent e, the sums of the
    high and low 24 bits of those integers (each sum is exact: integers below 2**24 added in
    float64, exact up to 2**29 of them per address); row 2 counts NaNs and infinities. Integers add
    exactly in any order, so the parts of a tensor's slices, summed (or all-reduced) in any
    grouping, are the parts of the tensor: a ZeRO-3 rank that holds only slices gets the very bits a
    rank holding everything gets (``training.param_norm``). About fifteen kernels a piece
    (``pieces``) and one copy to the CPU at the end: a GPU is not waited on piece by piece.
    """
    sums, nans, infs = None, [], []  # by exponent, on the pieces' device; NaN, inf counts a piece
    for x in pieces(tensors):
        nans.append(torch.isnan(x).sum())
        infs.append(torch.isinf(x).sum())
        mantissa, exponent = torch.frexp(torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0))
        values = torch.empty(2, x.numel(), dtype=torch.float64, device=x.device)
        square = torch.mul(mantissa, 2.0**24, out=values[1]).square_()  # the integer m**2, exact
        torch.div(square, 2.0**24, rounding_mode="floor", out=values[0])  # its high 24 bits
        square.sub_(values[0], alpha=2.0**24)  # and its low 24 bits (exact: integers), in place
        sums = _add_by_bin(sums, exponent, values)
    parts = torch.zeros(3, EXPONENTS, dtype=torch.int64)
    if sums is not None:
        parts[:2] = sums.cpu()
        parts[2, :2] = torch.stack([torch.stack(nans).sum(), torch.stack(infs).sum()]).cpu()
    return parts


def pieces(tensors):
    """The elements of ``tensors`` in float32, flattened and regrouped into pieces of one device
    each, 4M elements on a GPU, 1M on the CPU (the last one shorter). Integer sums do not care how
    the elements are grouped, so the grouping is chosen for speed and memory: on a GPU, a GPT-2's
    148 tensors make 21 pieces, not 148 rounds of a dozen small kernels; a piece's float64
    intermediates take ~44 bytes an element. (``training.sum_of_squares`` takes its GPU pieces from
    here too.)"""
    pending, count, size = [], 0, None
    for t in tensors:
        rest = t.detach().reshape(-1)
        if pending and rest.device != pending[0].device:  # a piece lies on one device
            yield torch.cat(pending)
            pending, count = [], 0
        size = 1 << (22 if rest.is_cuda else 20)
        while rest.numel():
            take = min(size - count, rest.numel())
            pending.append(rest[:take].float())
            rest, count = rest[take:], count + take
            if count == size:
                yield torch.cat(pending) if len(pending) > 1 else pending[0]
                pending, count = [], 0
    if pending:
        yield torch.cat(pending) if len(pending) > 1 else pending[0]


LANES = 4096  # addresses per bin for the GPU's atomic adds


def _add_by_bin(sums, exponent: torch.Tensor, values: torch.Tensor):
    """``sums`` (None at first) plus the sums of ``values`` (2 x n integers below 2**24 in float64)
    by ``exponent`` (``frexp``'s, int32; used up). On the CPU ``bincount``, into int64 sums. On a
    GPU atomic adds (``_LaneSums``)."""
    if values.device.type != "cpu":
        sums = _LaneSums(values.device) if sums is None else sums
        sums.add(exponent, values)
        return sums
    sums = torch.zeros(2, EXPONENTS, dtype=torch.int64) if sums is None else sums
    bins = exponent.sub_(MIN_EXPONENT)
    for row in range(2):
        sums[row] += torch.bincount(bins, weights=values[row], minlength=EXPONENTS).long()
    return sums


class _LaneSums:
    """A GPU's sums by exponent, by atomic adds into EXPONENTS x LANES float64 addresses: each bin's
    adds are spread over ``LANES`` addresses by element position (a GPT-2's values fall in a few
    dozen bins, and atomic adds to one address wait for each other). Their order varies from run to
    run, but every partial sum is an integer below 2**53, exact in float64, so the result cannot;
    ``cpu()`` adds the lanes in int64. Deterministic mode, which refuses atomic adds, is lifted for
    the adds alone: its sorted replacement adds each bin's values one after the other, far slower
    (docs/gpu.md)."""

    offsets = {}  # per device: each position's lane, less MIN_EXPONENT's bins (int32, a piece long)

    def __init__(self, device):
        self.spread = torch.zeros(2, EXPONENTS * LANES, dtype=torch.float64, device=device)
        if device not in self.offsets:
            lanes = torch.arange(1 << 22, dtype=torch.int32, device=device).remainder_(LANES)
            self.offsets[device] = lanes.sub_(MIN_EXPONENT * LANES)

    def add(self, exponent: torch.Tensor, values: torch.Tensor) -> None:
        offsets = self.offsets[values.device][: exponent.numel()]
        index = exponent.mul_(LANES).add_(offsets)  # int32: < 2**21
        deterministic, warn_only = (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        )
        torch.use_deterministic_algorithms(False)
        try:
            self.spread.index_add_(1, index, values)
        finally:
            torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)

    def cpu(self) -> torch.Tensor:
        return self.spread.view(2, EXPONENTS, LANES).long().sum(2).cpu()


def norm_from_parts(parts: torch.Tensor) -> float:
    """sqrt of the sum ``square_sum_parts`` describes: the exact sum, rounded once to float64
    (Python's int division is correctly rounded), then a correctly rounded square root."""
    nans, infs = parts[2].tolist()[:2]
    if nans or infs:
        return math.nan if nans else math.inf
    total = sum(
        ((high << 24) + low) << (2 * i) for i, (high, low) in enumerate(zip(*parts[:2].tolist()))
    )
    return math.sqrt(total / (1 << (48 - 2 * MIN_EXPONENT)))  # bin i: 2**(2(i + MIN_EXPONENT) - 48)
