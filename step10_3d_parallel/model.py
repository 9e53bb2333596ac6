"""A small GPT-2 from ``transformers``, built from a config, with initial weights that are a pure
function of (seed, parameter name).

Why not ``torch.manual_seed(seed); GPT2LMHeadModel(config)``? That ties each parameter's values to
the order in which the whole model draws from one generator: to know one parameter you must build
them all. Here every parameter has its own generator, seeded from the run's seed and the
parameter's name, so any rank can build any single parameter (or a slice of it) alone. ZeRO-3
needs exactly that; the earlier steps simply get the same weights by the same route.
"""
import hashlib
import math

import torch
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.utils import logging as hf_logging

hf_logging.set_verbosity_error()  # the vocabulary is ours, so GPT-2's default bos/eos ids draw warnings


def gpt2_config(config: dict, vocab_size: int) -> GPT2Config:
    gpt = GPT2Config(
        vocab_size=vocab_size,
        n_positions=config["seq_len"],
        n_embd=config["n_embd"],
        n_layer=config["n_layer"],
        n_head=config["n_head"],
        resid_pdrop=config["dropout"],
        embd_pdrop=config["dropout"],
        attn_pdrop=config["dropout"],
        bos_token_id=None,
        eos_token_id=None,
        tie_word_embeddings=True,  # GPT-2 shares the token embedding with the output layer
    )
    gpt._attn_implementation = "eager"  # plain matmul + softmax: the same kernels on every device
    return gpt


def parameter_seed(seed: int, name: str) -> int:
    """A 63-bit seed for one parameter; stable across processes and Python versions (unlike ``hash``)."""
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


def build_model(config: dict, vocab_size: int, seed: int) -> GPT2LMHeadModel:
    """The GPT-2 of ``config`` on the CPU, every parameter set by ``initial_value``.

    Construction runs on a fork of the global generator: transformers' own initialisation draws from it
    (values that ``initial_value`` then replaces), and dropout's masks must not depend on how the model
    was built. ZeRO-3 builds it on the meta device, which draws nothing, and must see the same masks."""
    with torch.random.fork_rng(devices=[]):
        model = GPT2LMHeadModel(gpt2_config(config, vocab_size))
    with torch.no_grad():
        for name, param in model.named_parameters():  # a tied weight is listed once, by its first name
            param.copy_(initial_value(name, param.shape, seed, config["n_layer"]))
    return model


def language_model_loss(model, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy; the logits go to float32 first, so AMP changes the model, not the loss."""
    logits = model(input_ids=inputs).logits
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
