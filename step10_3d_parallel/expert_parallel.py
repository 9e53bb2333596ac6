"""Expert parallelism: the E experts of every MoE layer split over D ranks,
each token sent to its expert's rank.

The MoE layer (moe.py) routes and permutes on the rank that holds the token, and combines there;
only the step in between, the experts' compute, is replaced. In the order a token travels, for one
MoE layer and one micro-batch:

1. **Route** (moe.py): the router picks the token's k experts; capacity drops slots past C; the kept
   slots are sorted by expert. The ranks of an *expert-parallel group* (D ranks) own E/D consecutive
   experts each, so the sorted slots are already in order of destination rank.
2. **Count exchange**: ``all_to_all_single`` of the E slot counts, E/D to each rank: now every rank
   knows how many slots each source sends to each of its experts, which are the split sizes of step
   3 (uneven, and new every micro-batch).
3. **Dispatch**: ``all_to_all_single`` of the tokens themselves, with those uneven splits. What
   arrives is laid out by source, and within a source by expert.
4. **Expert compute**: each local expert's MLP on each source's slots, **one product per (source,
   expert)**: the product one process would compute for that micro-batch, so the bits are the same.
   A GEMM over two sources' rows concatenated would sum the weight gradient over the rows otherwise
   (tests/test_expert_parallel.py measures it on your CPU; docs/parity.md has the numbers).
5. **Combine**: a second ``all_to_all_single``, splits swapped, brings the outputs home, in the
   order they left; moe.py unpermutes them and sums each token's k outputs with its router weights.
6. **Backward**: each all-to-all's gradient is the all-to-all the other way (``_AllToAll``,
   Megatron's mappings.py style); counts need none.
7. **Gradients**: dense parameters are data-parallel over all W ranks: all-reduce, divide by W. An
   expert's copies live on W/D ranks (one per expert-parallel group); its gradient already holds the
   slots of D ranks' micro- batches, so it is summed over its W/D copies and divided by W too: the
   mean over the global batch. (Autograd adds an expert's D products the last source's first; with 3
   or more terms that is another order than one process's: docs/parity.md, "Where 4 ranks sum
   otherwise than step 0".)

8. **A frozen peer**: gloo's uneven all-to-all (its alltoallv) waits for a frozen peer's rows with
   no timeout of its own (the step's README: the other rank waited forever), so each all-to-all here
   is waited on with the group's timeout, and fails in the words of gloo's other timeouts
   (collective_failures.py explains them).

Groups: ranks [g*D, (g+1)*D) form expert-parallel group g; ranks with the same ``rank % D`` hold the
same experts. (Step 10 cuts each of its dp x cp planes the same way: ``planes``, the lists of ranks
that hold the same dense parameters; here one plane, every rank.) Every all-to-all's bytes are
counted (``comm_accounting``) and noted per layer and micro-batch in ``traffic``.
"""

from datetime import timedelta

import torch
import torch.distributed as dist

from comm_accounting import count_collective


class Groups:
    """This rank's two groups: ``ep`` (the D ranks that split the experts) and ``replicas`` (the W/D
    ranks that hold the same experts). ``dist.new_group`` is collective: every rank creates every
    group, in the same order.

    ``planes``: lists of the W ranks that hold the same dense parameters, each cut as above
    (default: one plane, every rank); ``data``: this rank's plane as a process group (default: every
    rank); ``timeout``: the new groups'."""

    def __init__(self, ep: int, planes: list | None = None, data=None, timeout=None):
        rank, self.data = dist.get_rank(), data
        planes = planes or [list(range(dist.get_world_size()))]
        plane = next(ranks for ranks in planes if rank in ranks)
        self.ep_size, self.ep_rank, self.world_size = ep, plane.index(rank) % ep, len(plane)
        for ranks in planes:
            for g in range(len(ranks) // ep):
                group = dist.new_group(ranks[g * ep : (g + 1) * ep], timeout=timeout)
                if rank in ranks[g * ep : (g + 1) * ep]:
                    self.ep = group
        for ranks in planes:
            for q in range(ep):
                group = dist.new_group(ranks[q::ep], timeout=timeout)
                if rank in ranks[q::ep]:
                    self.replicas = group


def local_experts_of(n_experts: int, ep_size: int, ep_rank: int) -> range:
    per_rank = n_experts // ep_size
    return range(ep_rank * per_rank, (ep_rank + 1) * per_rank)


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` as an autograd op: forward sends ``input_splits`` rows to each rank and
    receives ``output_splits``; backward sends the gradient back the same way, splits swapped
    (rule 6)."""

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group, note):
        ctx.splits, ctx.group, ctx.note = (output_splits, input_splits), group, note
        return _all_to_all(x.contiguous(), output_splits, input_splits, group, note)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return (
            _all_to_all(grad.contiguous(), input_splits, output_splits, ctx.group, ctx.note),
            None,
            None,
            None,
            None,
        )


def _all_to_all(x, output_splits, input_splits, group, note):
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    count_collective("all_to_all", x)
    note["bytes"] += x.numel() * x.element_size()
    _wait(
        dist.all_to_all_single(out, x, output_splits, input_splits, group=group, async_op=True),
        group,
    )
    return out


def _wait(work, group) -> None:
    """Rule 8: on gloo, wait at most the process group's timeout."""
    if dist.get_backend(group) != "gloo":
        return work.wait()
    default = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    timeout = getattr(getattr(default, "options", None), "_timeout", timedelta(minutes=30))
    try:
        work.wait(timeout)
    except RuntimeError as error:
        if "timed out" not in str(error).lower():
            raise
        raise RuntimeError(
            f"Timed out waiting {timeout.total_seconds() * 1000:.0f}ms for an all-to-all"
        ) from None


class ExpertParallel:
    """What moe.py's ``MoE.dispatch`` calls on this rank: ``(tokens sorted by expert, counts per
    expert (E,), this rank's experts) -> their outputs, in the same order``. ``traffic``: one note
    per call (layer ``name``, the counts sent, the slots received, the bytes of its four all-to-alls
    once backward has run)."""

    def __init__(self, groups: Groups, n_experts: int, name: str):
        self.groups, self.n_experts, self.name = groups, n_experts, name
        self.traffic = []

    def __call__(self, tokens: torch.Tensor, counts: torch.Tensor, experts) -> torch.Tensor:
        d, group = self.groups.ep_size, self.groups.ep
        local = local_experts_of(self.n_experts, d, self.groups.ep_rank)
        note = {"layer": self.name, "sent_per_expert": counts.tolist(), "bytes": 0}
        # 2. counts: E/D to each rank of the group; back
        #    come, from each source, its counts for my experts
        received = torch.empty_like(counts)
        count_collective("all_to_all", counts)
        note["bytes"] += counts.numel() * counts.element_size()
        _wait(dist.all_to_all_single(received, counts, group=group, async_op=True), group)
        send_splits = counts.view(d, len(local)).sum(1).tolist()
        from_source = received.view(d, len(local))  # [source, local expert]: slots it sends
        receive_splits = from_source.sum(1).tolist()
        note["received"] = sum(receive_splits)
        # 3. dispatch: every kept slot to its expert's rank
        arrived = _AllToAll.apply(tokens, receive_splits, send_splits, group, note)
        # 4. compute: one product per (source, expert), the
        #    product one process computes for that micro-batch
        chunks = arrived.split(from_source.flatten().tolist())
        outputs = [
            experts[str(e)](chunks[s * len(local) + j])
            for s in range(d)
            for j, e in enumerate(local)
        ]
        outputs = torch.cat(outputs)
        self.traffic.append(note)
        # 5. combine: the outputs back where their tokens came from, in the order they left
        return _AllToAll.apply(outputs, send_splits, receive_splits, group, note)


def shard_experts(model, moe_layers, groups: Groups) -> list:
    """Keep this rank's E/D experts of every MoE layer (their global names kept), drop the others,
    and give each layer an ``ExpertParallel`` dispatcher. Returns the dispatchers, layer
    by layer."""
    dispatchers = []
    for name, module in model.named_modules():
        if module in moe_layers:
            keep = {
                str(e) for e in local_experts_of(module.n_experts, groups.ep_size, groups.ep_rank)
            }
            for e in [e for e in module.experts if e not in keep]:
                del module.experts[e]
            module.dispatch = ExpertParallel(groups, module.n_experts, name)
            dispatchers.append(module.dispatch)
    return dispatchers


def is_expert(name: str) -> bool:
    """An expert's parameter, by name:
    ``...experts.<e>....`` (moe.py's names, or a layer of one's own)."""
    return name.startswith("experts.") or ".experts." in name


def reduce_gradients(model, groups: Groups, reduce_dtype: torch.dtype = torch.float32) -> None:
    """Rule 7: dense gradients summed over all ranks (``groups.data``), expert gradients over their
    copies; both divided by W.

    Each group's gradients go in one flat buffer and one all-reduce (step 4's bucket, without its
    hooks): a collective per tensor would pay gloo's fixed cost per call once per parameter, dozens
    of times a step."""
    named = list(model.named_parameters())
    dense = [p for name, p in named if not is_expert(name)]
    experts = [p for name, p in named if is_expert(name)]
    # --ep = world size: each expert on one rank only, nothing to add up
    alone = dist.get_world_size(groups.replicas) == 1
    for params, group in ((dense, groups.data), (experts, groups.replicas)):
        if not params:
            continue
        flat = torch.cat([p.grad.flatten().to(reduce_dtype) for p in params])
        if not (alone and group is groups.replicas):
            count_collective("all_reduce", flat)
            dist.all_reduce(flat, group=group)
        flat.div_(groups.world_size)
        for p, grad in zip(params, flat.split([p.numel() for p in params])):
            p.grad.copy_(grad.view_as(p.grad))


def counted_once(model, groups: Groups) -> list:
    """The parameters whose squares this rank adds to a norm, so that across the world each element
    counts once: dense ones on rank 0, experts on the ranks of the first expert-parallel group."""
    rank = dist.get_rank()
    return [
        p
        for name, p in model.named_parameters()
        if (rank < groups.ep_size if is_expert(name) else rank == 0)
    ]
