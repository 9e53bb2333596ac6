"""ZeRO-3 on step 10's mesh (``--zero 3``): each rank's pipeline stage, already tensor-parallel,
fully sharded over the dp x cp plane by step 7's ``FullyShardedDP`` (zero3.py), as torchtitan
applies FSDP2 to what TP has sharded.

1. **Step 7's units, over the plane.** Each chunk of this rank's stage (a ``GPT2Stage`` of step 8's
   tp shards) is wrapped in ``FullyShardedDP`` over the dp x cp plane laid out as hsdp.py's
   (replicate, shard) array: R rows of S = dp cp / R consecutive plane ranks (``--replicate R``,
   HSDP; R = 1: one row, the plane's own group). Its blocks are units, laid flat and cut into S
   pieces under the model's names, every row holding each piece once; the gradient is
   reduce-scattered in the row and all-reduced across the rows (hsdp.py's rule 3); a plain AdamW
   steps the pieces (``--offload-optimizer``: on host copies of them, step 7's offload.py). A rank
   holds 4Ψ/S + 4Ψ/S + 8Ψ/S bytes (offloaded: 8Ψ/S on the device, 12Ψ/S on the host), Ψ its stage's
   tp share: the planner's ZeRO-3 row over the plane (with R > 1, its HSDP row).
2. **The tie, a root of its own at both ends** (pp > 1). The first stage's root unit is the token
   embedding alone (the positions a unit of their own), the last stage's the tied copy alone (the
   final norm a unit): one (V/tp, h) tensor at both ends, padded and cut alike, so rank (d, c, t) of
   the first stage and of the last hold the same elements. Each micro-batch the last stage's
   contribution goes to the first, which adds it before accumulating (tied_embedding.py's rule, on
   the gathered view instead of the parameter); after the reduce-scatter the first stage's averaged
   slice goes to its peer on the last stage, and both step it alike. At pp = 1 the root holds the
   embeddings and the final norm, as in step 7.
3. **When they gather and reduce-scatter.** A unit is gathered before its forward and again before
   its backward, freed after each (step 7's hooks); a root stays gathered from its forward to its
   backward, and is gathered again if another micro-batch's backward freed it (1F1B's warm-up holds
   several forwards). Every backward but the step's last micro-batch's accumulates the whole
   gradient in its unit (``no_sync()``: 4Ψ held, the planner's ``accumulated``); the last one's
   reduce-scatters each unit as its backward ends, as step 7 does. The schedules run each chunk's
   backwards in micro-batch order, so a hook on the chunk's output knows which backward is the last.
   The collectives of a dp x cp group come in the same order on all its ranks: they hold the same
   stage and follow the same schedule. The tp all-reduces and the pipeline's messages are step 8's
   and 9's, unchanged.
4. **A norm over pieces.** Each rank adds the squares of its pieces of the tensors counted once over
   tp and pp (composition.py's rule 3: tp shards on every tp rank, replicated ones on tp rank 0, the
   tie on the first stage), then over its row of the plane (the other rows hold the same pieces), tp
   and pp in turn: every element of the model's gradient once.
5. **Checkpoints by name** (zero3_on_mesh_state.py): each rank its pieces, slices of its tp shards,
   as boxes of the whole tensors, so a run saved at --zero 3 resumes at 0, 1 or 2 and at any mesh,
   and back.
6. **Not composed**: sequence parallelism (its LayerNorms' gradients are added over tp after the
   backward, by when ZeRO-3 has reduce-scattered them), zero bubble (its W computes weight gradients
   after the backward whose end reduce-scatters them), experts (an expert's gradient has its own
   group). Each refused in one line.
"""

import functools
from datetime import timedelta

import torch

from config import UserError
from expert_parallel import Groups
from hsdp import HybridMesh, replicate_problem
from mesh import axis_groups
from tensor_parallel_state import place_of
from tied_embedding import KIND, TIED_TAG, TiedGradient
from zero3 import FullyShardedDP

TIE = "transformer.wte.weight"  # the name of the tied embedding, and of its copy on the last stage


def check_fully_sharded(config: dict) -> None:
    """Rule 6's refusals, one line each, before anything connects."""
    if config["sequence_parallel"]:
        raise UserError(
            "--zero 3 with --sequence-parallel: the LayerNorms' gradients are added "
            "over tp after the "
            "backward, when ZeRO-3 has reduce-scattered them over dp x cp; use --zero "
            "2, or leave out "
            "--sequence-parallel"
        )
    if config["schedule"] == "zero-bubble":
        raise UserError(
            "--zero 3 with --schedule zero-bubble: its W computes the weight gradients "
            "after the backward "
            "whose end reduce-scatters them; use 1f1b, gpipe or interleaved-1f1b, or --zero 2"
        )
    if config["moe_experts"]:
        raise UserError(
            "--zero 3 with --moe-experts: the experts' gradients have groups of their "
            "own, not the dp x cp "
            "plane ZeRO-3 shards over; use --zero 0, 1 or 2"
        )


def check_plane_flags(config: dict, dp: int) -> None:
    """--replicate R and --offload-optimizer: only where parameters are sharded (--zero 3); R must
    cut the dp x cp plane into equal rows."""
    replicate, n = config["replicate"], dp * config["cp"]
    if replicate != 1 and config["zero"] != 3:
        raise UserError(
            f"--replicate {replicate} replicates ZeRO-3's shard groups (HSDP): use it "
            "with --zero 3, or leave it out"
        )
    if config["offload_optimizer"] and config["zero"] != 3:
        raise UserError(
            "--offload-optimizer steps ZeRO-3's pieces on the host: use it with --zero "
            "3, or leave it out"
        )
    if replicate < 1:
        raise UserError(replicate_problem(replicate, n))
    if n % replicate:
        raise UserError(
            f"--replicate {replicate} does not cut the dp x cp plane (dp {dp} x cp "
            f"{config['cp']} = {n} ranks) "
            f"into equal rows: choose R dividing {n}, or change --dp or --cp"
        )


def plane(mesh, replicate: int = 1, timeout=None) -> HybridMesh:
    """The dp x cp plane as step 7's (replicate, shard) array (rule 1, hsdp.py's rule 1): R rows of
    S = dp cp / R consecutive plane ranks, the columns across them. Every rank creates every plane's
    groups, in the same order: expert_parallel.py's ``Groups`` cuts planes just so (there blocks of
    ep ranks and their copies). R = 1: one row, the plane's group, nothing created."""
    n = mesh.dp * mesh.cp
    if replicate == 1:
        return HybridMesh(1, n, 0, mesh.dp_cp_rank, mesh.dp_cp_group, None)
    shard = n // replicate
    rows = Groups(
        shard, axis_groups(("dp", "cp"), mesh.dp, mesh.tp, mesh.pp, mesh.cp), timeout=timeout
    )
    return HybridMesh(
        replicate, shard, mesh.dp_cp_rank // shard, mesh.dp_cp_rank % shard, rows.ep, rows.replicas
    )


class FullyShardedStages:
    """Every chunk of ``pipe`` (step 9's ``Pipeline`` of this rank's stage) wrapped in
    ``FullyShardedDP`` over the plane of ``mesh`` (rules 1-3). ``named``: the chunks' parameters by
    the model's names (``pipeline_gpt2``'s); afterwards ``self.named`` holds the pieces under those
    names, and the caller keeps no other reference to the parameters.
    ``finish_gradient_synchronization()`` after the step's last flush, then ``norm_terms()``."""

    def __init__(self, pipe, named: list, mesh, config: dict, device):
        self.pipe, self.mesh = pipe, mesh
        self.last_micro_batch = config["grad_accum"] - 1
        # what a piece no longer says, by the model's name:
        # its tp shard's place in the whole tensor, and blocks
        self.shards = {name: (place_of(p), getattr(p, "tp_blocks", None)) for name, p in named}
        self.wrappers, self.local_names, self.tie, self.forwards = [], [], None, []
        self.accumulated = 0
        reduce_dtype = getattr(torch, config["reduce_dtype"])
        timeout = timedelta(seconds=config["timeout_s"]) if config["timeout_s"] else None
        # rule 1's rows and columns, made once for every chunk
        self.hybrid = plane(mesh, config["replicate"], timeout)
        for chunk in pipe.chunks:
            tied = chunk.tied_parameter  # the first or the last stage's, at pp > 1 (rule 2)
            self.local_names.append(
                {n: TIE if p is tied else n for n, p in chunk.named_parameters()}
            )
            units = list(chunk.transformer.h.values())
            if tied is not None and chunk.is_first:
                units = [chunk.transformer.wpe, *units]  # the root: the token embedding alone
            if tied is not None and chunk.is_last:
                units = [*units, chunk.transformer.ln_f]  # the root: the tied copy alone
            wrapper = FullyShardedDP(
                chunk, units, reduce_dtype=reduce_dtype, device=device, mesh=self.hybrid
            )
            wrapper.require_sync = False  # rule 3: the last micro-batch's backward sets it
            chunk.register_forward_hook(functools.partial(self._count, len(self.wrappers)))
            if tied is not None:
                self.tie = ShardedTie(pipe, wrapper.root, chunk, chunk.is_first)
                chunk._tied = (None,)  # the whole tensor is gone: the root's pieces hold it now
            self.wrappers.append(wrapper)
            self.forwards.append(0)
        pipe.tie = pipe.tied_parameter = (
            None  # step 9's tie, on the parameter: ShardedTie's instead
        )
        self.named = [
            (names[n], p)
            for wrapper, names in zip(self.wrappers, self.local_names)
            for n, p in wrapper.named_parameters()
        ]

    # ---- rule 3: which backward reduce-scatters --------------------------------------------------
    def _count(self, index: int, module, args, output) -> None:
        """After chunk ``index``'s forward of a micro-batch:
        its number, for the hook that runs before its backward."""
        micro_batch, self.forwards[index] = self.forwards[index], self.forwards[index] + 1
        if torch.is_grad_enabled() and output.requires_grad:
            hook = functools.partial(self._before_backward, self.wrappers[index], micro_batch)
            torch.autograd.graph.register_multi_grad_hook([output], hook, mode="any")

    def _before_backward(self, wrapper, micro_batch: int, grad) -> None:
        wrapper.require_sync = micro_batch == self.last_micro_batch
        if wrapper.require_sync:  # what the others accumulated: the whole gradient of every unit
            self.accumulated += sum(
                u.flat.grad.numel() * u.flat.grad.element_size()
                for u in wrapper.units
                if u.flat is not None and u.flat.grad is not None
            )

    def finish_gradient_synchronization(self) -> int | None:
        """After the step's last flush (and the pipeline's own sync): every reduce-scatter waited,
        each piece's ``.grad`` its slice of the averaged gradient, the tie's slice sent on (rule 2).
        Returns the bytes of whole gradient the micro-batches held before the last one's backward
        (None at one micro-batch a step)."""
        for wrapper in self.wrappers:
            wrapper.finish_gradient_synchronization()
            wrapper.require_sync = False
        if self.tie is not None:
            self.tie.finish()
            # its send waited: clipping scales that slice next
            self.pipe.finish_gradient_synchronization()
        self.forwards = [0] * len(self.wrappers)
        accumulated, self.accumulated = self.accumulated, 0
        return accumulated if self.last_micro_batch > 0 else None

    # ---- rule 4 and what the trainer measures ----------------------------------------------------
    @property
    def counted(self) -> list:
        """The pieces whose squares this rank adds to a norm over dp x cp, tp and pp (rule 4)."""
        return [
            p
            for n, p in self.named
            if (self.shards[n][1] is not None or self.mesh.tp_rank == 0)
            and not (n == TIE and self.mesh.pp_rank > 0)
        ]

    @property
    def norm_groups(self) -> list:
        return [self.hybrid.shard_group, self.mesh.tp_group, self.mesh.pp_group]

    def norm_terms(self) -> tuple[list, list, list]:
        """``sharded_norms.clip_grad_norm``'s (params, counted,
        groups): every piece scaled, rule 4's counted."""
        return [p for _, p in self.named], self.counted, self.norm_groups

    @property
    def parameter_shards(self) -> list:
        return [shard for wrapper in self.wrappers for shard in wrapper.parameter_shards]

    @property
    def gradient_shards(self) -> list:
        return [shard for wrapper in self.wrappers for shard in wrapper.gradient_shards]

    def take_peak_gathered_bytes(self) -> int:
        """The most gathered bytes held at once this step:
        each chunk's, added (one chunk but interleaved)."""
        return sum(wrapper.take_peak_gathered_bytes() for wrapper in self.wrappers)


class ShardedTie(TiedGradient):
    """Rule 2: tied_embedding.py's per-micro-batch combination on the gathered view of the tie
    (``root``, the unit of the tie alone, on ``chunk``: the first stage's if ``is_first``, else the
    last's), and its finish on the averaged slices, the same elements at both ends."""

    def __init__(self, pipe, root, chunk, is_first: bool):
        self.root, self.is_first, self.last_stage = root, is_first, pipe.num_stages - 1
        self.send, self.recv = pipe._send, pipe._recv
        module = chunk.transformer.wte if is_first else chunk.lm_head
        module.register_forward_pre_hook(self._on_this_forwards_view)

    def _on_this_forwards_view(self, module, args) -> None:
        # each forward gathers the root into new views: the hook goes on the one this forward uses
        module.weight.register_hook(
            self._add_contribution if self.is_first else self._send_contribution
        )

    def finish(self) -> None:
        """After the reduce-scatters:
        the first stage's averaged slice to the last stage's same ranks."""
        shard = self.root.grad_shard
        if self.is_first:
            self.send(shard, self.last_stage, KIND, TIED_TAG)
        else:
            shard.copy_(self.recv(shard.shape, shard.dtype, 0, TIED_TAG))
