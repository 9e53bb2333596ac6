"""The vocabulary split over the T ranks of a tensor-parallel group: the embedding, the tied output
layer and the loss, with the logits never whole (Megatron-LM's ``VocabParallelEmbedding`` and
``vocab_parallel_cross_entropy``; PyTorch's ``loss_parallel``). tensor_parallel.py's rule 5, apart:
a second idea, for the two ends of the model.

1. **One Parameter, split by rows.** Rank r holds rows ``[r V/T, (r+1) V/T)`` of the token
   embedding, and the output layer *is* that same Parameter (GPT-2 ties them): its gradient sums
   both uses, as in one process.
2. **The lookup.** Every rank gets the whole input ids; it looks up the ids it owns, zeroes the rows
   of the others, and the ranks all-reduce (tensor_parallel_mappings.py's *g*): every rank gets the
   whole output.
3. **The loss, three numbers a token.** The output layer gives this rank's ``(tokens, V/T)`` slice
   of the logits; ``vocab_parallel_cross_entropy`` all-reduces, per token, the max, the sum of
   exponentials and the target's log-probability (from the rank that owns the target): no rank ever
   holds ``(tokens, V)`` logits, and the value is ``F.cross_entropy``'s on the whole logits. The
   arithmetic is PyTorch's ``loss_parallel``, op for op, so the loss and its gradient are bitwise
   PyTorch's tensor parallelism.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from tensor_parallel_mappings import all_reduce, reduce_from_tensor_parallel_region
from tensor_parallel_state import block_length, block_of


class VocabParallelEmbedding(nn.Module):
    """``nn.Embedding(num_embeddings, embedding_dim)`` with its rows
    (the vocabulary) split over ``group``.

    ``.weight`` is rows ``[r V/T, (r+1) V/T)``. Every rank gets the whole input ids and returns the
    whole output (rule 2).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, group=None, reduce_dtype=None):
        super().__init__()
        self.group, self.reduce_dtype = group, reduce_dtype
        self.reduce_output = reduce_from_tensor_parallel_region  # g (sequence_parallel.py: its own)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        local = block_length(num_embeddings, group, "the vocabulary (num_embeddings)")
        self.vocab_start = dist.get_rank(group) * local
        self.weight = nn.Parameter(torch.empty(local, embedding_dim))
        nn.init.normal_(self.weight)

    @classmethod
    def from_full(
        cls, embedding: nn.Embedding, group=None, reduce_dtype=None
    ) -> "VocabParallelEmbedding":
        """This rank's part of ``embedding`` (the same full table on every rank):
        its block of rows (tokens)."""
        with torch.device("meta"):
            layer = cls(
                embedding.num_embeddings,
                embedding.embedding_dim,
                group=group,
                reduce_dtype=reduce_dtype,
            )
        layer.weight = block_of(embedding.weight, 0, group, "the vocabulary (num_embeddings)")
        return layer

    def forward(self, ids):
        elsewhere = (ids < self.vocab_start) | (ids >= self.vocab_start + self.weight.shape[0])
        local_ids = (ids - self.vocab_start).masked_fill(elsewhere, 0)
        rows = F.embedding(local_ids, self.weight)
        rows = rows.masked_fill(elsewhere.unsqueeze(-1), 0.0)
        return self.reduce_output(rows, self.group, self.reduce_dtype)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """The arithmetic of PyTorch's ``loss_parallel``
    (``torch/distributed/tensor/parallel/loss.py``), op for op."""

    @staticmethod
    def forward(ctx, logits, targets, group):
        rows = logits.shape[-1]
        start = dist.get_rank(group) * rows
        top = all_reduce(torch.amax(logits, dim=-1, keepdim=True), group, op=dist.ReduceOp.MAX)
        shifted = logits - top
        sum_exp = all_reduce(torch.sum(torch.exp(shifted), dim=-1, keepdim=True), group)
        log_probs = shifted - torch.log(sum_exp)
        elsewhere = (targets < start) | (targets >= start + rows)
        local = (targets - start).masked_fill(elsewhere, 0)
        picked = torch.gather(log_probs, -1, local.unsqueeze(-1)).masked_fill(
            elsewhere.unsqueeze(-1), 0.0
        )
        # the target's log-probability, from the rank that owns it
        picked = all_reduce(picked, group)
        count = torch.tensor(float(targets.numel()), dtype=logits.dtype, device=logits.device)
        ctx.save_for_backward(log_probs, local, elsewhere, count)
        return (-picked.squeeze(-1)).sum() / count

    @staticmethod
    def backward(ctx, grad):
        log_probs, local, elsewhere, count = ctx.saved_tensors
        one_hot = torch.zeros_like(log_probs)
        one_hot.scatter_(
            -1, local.unsqueeze(-1), (elsewhere.to(log_probs.dtype) - 1.0).unsqueeze(-1)
        )
        return (one_hot + torch.exp(log_probs)) * (grad / count), None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, group=None
) -> torch.Tensor:
    """Mean cross-entropy of ``logits`` (``(N, V/T)``: this rank's vocabulary slice, as the tied
    output layer gives it) against ``targets`` (``(N,)``, ids in the whole vocabulary, the same on
    every rank): the value ``F.cross_entropy`` gives on the whole ``(N, V)`` logits, on every rank,
    without ever building them."""
    return _VocabParallelCrossEntropy.apply(logits, targets, group)
