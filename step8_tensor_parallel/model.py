"""GPT-2, written out: the model every step trains (nanoGPT's shape, our names).

    tokens -> wte + wpe -> dropout -> n_layer x Block -> ln_f -> lm_head (= wte, tied) -> logits
    Block:  x + attn(ln_1(x)),  then  x + mlp(ln_2(x))            (pre-LayerNorm, residuals)

Parameter names (stable: checkpoints, the tensor-parallel plan and the pipeline's stages use them):
``transformer.wte.weight`` (V, h), ``transformer.wpe.weight`` (seq_len, h), per block ``i``
``transformer.h.i.ln_1.{weight,bias}``, ``.attn.c_q``, ``.attn.c_k``, ``.attn.c_v``,
``.attn.c_proj``, ``.ln_2``, ``.mlp.c_fc``, ``.mlp.c_proj`` (each an ``nn.Linear``: ``.weight`` laid
out ``(out_features, in_features)``, and ``.bias``), then ``transformer.ln_f``. ``lm_head.weight``
*is* ``transformer.wte.weight`` (one Parameter, listed once, under that name).

q, k and v are three ``nn.Linear`` rather than GPT-2's one fused matrix so that each is split by
whole heads with a plain contiguous block of rows (step 8's column-parallel layers).

Why not ``torch.manual_seed(seed); GPT2(...)``? That ties each parameter's values to the order in
which the whole model draws from one generator: to know one parameter you must build them all. Here
every parameter has its own generator, seeded from the run's seed and its name (``initial_value``),
so any rank can build any single parameter, or a slice of it, alone. ZeRO-3 needs exactly that.
"""

import hashlib
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    vocab_size: int
    seq_len: int  # the longest sequence: rows of the position embedding
    n_layer: int
    n_head: int
    n_embd: int
    dropout: float = 0.0
    # "math": scores, mask and softmax written out; "sdpa": one fused kernel
    attention: str = "math"


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        h = cfg.n_embd
        self.c_q, self.c_k, self.c_v = nn.Linear(h, h), nn.Linear(h, h), nn.Linear(h, h)
        self.c_proj = nn.Linear(h, h)
        self.head_dim, self.attention, self.dropout = h // cfg.n_head, cfg.attention, cfg.dropout
        self.attn_dropout, self.resid_dropout = nn.Dropout(cfg.dropout), nn.Dropout(cfg.dropout)

    def forward(self, x):
        B, T, _ = x.shape
        # (B, T, heads * head_dim) -> (B, heads, T, head_dim). The number of heads is read off the
        # width, so a tensor-parallel rank holding a block of whole heads runs this code unchanged.
        q, k, v = (
            proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
            for proj in (self.c_q, self.c_k, self.c_v)
        )
        # the heads side by side again
        y = self.core(q, k, v).transpose(1, 2).contiguous().view(B, T, -1)
        return self.resid_dropout(self.c_proj(y))

    def core(self, q, k, v):
        """Attention's core, (B, heads, T, head_dim) in and out: no weights, every s x s tensor
        (what step 7's --activation-checkpointing selective recomputes in backward)."""
        if self.attention == "sdpa":  # flash / memory-efficient attention where the device has it
            return F.scaled_dot_product_attention(
                q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
            )
        # softmax(q k^T / sqrt(d), causal) v, every intermediate a tensor you can print
        T = q.shape[-2]
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
        causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        # under autocast: in float32 (autocast's rule for softmax)
        weights = F.softmax(scores, dim=-1)
        return self.attn_dropout(weights).to(v.dtype) @ v


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc, self.c_proj = (
            nn.Linear(cfg.n_embd, 4 * cfg.n_embd),
            nn.Linear(4 * cfg.n_embd, cfg.n_embd),
        )
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(cfg.n_embd), CausalSelfAttention(cfg)
        self.ln_2, self.mlp = nn.LayerNorm(cfg.n_embd), MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
                wpe=nn.Embedding(cfg.seq_len, cfg.n_embd),
                drop=nn.Dropout(cfg.dropout),
                h=nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer)),
                ln_f=nn.LayerNorm(cfg.n_embd),
            )
        )
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        # tied: one matrix reads tokens in and writes them out
        self.lm_head.weight = self.transformer.wte.weight

    def embed(self, ids):
        positions = torch.arange(ids.shape[1], device=ids.device)
        return self.transformer.drop(self.transformer.wte(ids) + self.transformer.wpe(positions))

    def head(self, x):
        return self.lm_head(self.transformer.ln_f(x))

    def forward(self, ids):
        """Logits ``(B, T, V)`` for token ids ``(B, T)``."""
        x = self.embed(ids)
        for block in self.transformer.h:
            x = block(x)
        return self.head(x)


def gpt2_config(config: dict, vocab_size: int) -> GPTConfig:
    """The model's shape from the run's flags (``--n-layer``, ``--attention``, ...)."""
    return GPTConfig(
        vocab_size=vocab_size,
        seq_len=config["seq_len"],
        n_layer=config["n_layer"],
        n_head=config["n_head"],
        n_embd=config["n_embd"],
        dropout=config["dropout"],
        attention=config.get("attention", "math"),
    )


def parameter_seed(seed: int, name: str) -> int:
    """A 63-bit seed for one parameter;
    stable across processes and Python versions (unlike ``hash``)."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def initial_value(name: str, shape: torch.Size, seed: int, n_layer: int) -> torch.Tensor:
    """GPT-2's initialisation of one parameter, drawn from a generator of its own.

    Weights ~ N(0, 0.02); residual projections (``c_proj``) ~ N(0, 0.02 / sqrt(2 * n_layer)) as in
    the GPT-2 paper; biases 0; LayerNorm weights 1.
    """
    if name.endswith(".bias"):
        return torch.zeros(shape)
    if ".ln_" in name or name.startswith("transformer.ln_f"):
        return torch.ones(shape)
    std = 0.02 / math.sqrt(2 * n_layer) if name.endswith("c_proj.weight") else 0.02
    generator = torch.Generator().manual_seed(parameter_seed(seed, name))
    return torch.empty(shape).normal_(0.0, std, generator=generator)


def compile_blocks(model: GPT2) -> GPT2:
    """``torch.compile`` each block in place, as torchtitan does: the parameters keep their names
    and the loop does not change; the compiled kernels round differently from eager ones (fused
    operations)."""
    for block in model.transformer.h:
        block.compile()
    return model


def build_model(config: dict, vocab_size: int, seed: int) -> GPT2:
    """The GPT-2 of ``config`` on the CPU, every parameter set by ``initial_value``.

    Built on the meta device first (no memory, no random draws: dropout's masks must not depend on
    how the model was built), then given storage and filled parameter by parameter."""
    with torch.device("meta"):
        model = GPT2(gpt2_config(config, vocab_size))
    model.to_empty(device="cpu")
    model.lm_head.weight = model.transformer.wte.weight
    with torch.no_grad():
        # the tied weight is listed once, by its first name
        for name, param in model.named_parameters():
            param.copy_(initial_value(name, param.shape, seed, config["n_layer"]))
    return model


def language_model_loss(
    model, inputs: torch.Tensor, targets: torch.Tensor, cross_entropy=F.cross_entropy
):
    """Mean next-token cross-entropy; the logits go to
    float32 first, so AMP changes the model, not the loss.
    ``cross_entropy(logits, targets)``: on (B*S, V) logits and (B*S,) targets (step 8's: over
    vocabulary slices)."""
    logits = model(inputs)
    return cross_entropy(logits.float().flatten(0, 1), targets.flatten())
