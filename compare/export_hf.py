"""A run's final weights and tokenizer as a Hugging Face GPT-2 folder:
evaluate, serve or fine-tune it elsewhere.

    python compare/export_hf.py step1   # runs/step1_torch_ddp -> runs/step1_torch_ddp/hf
    python compare/export_hf.py runs/x runs/x_hf
    HF_HUB_OFFLINE=1 python -c "from transformers import pipeline; \\
        print(pipeline('text-generation', model='runs/x_hf')('ROMEO:',
        max_new_tokens=20)[0]['generated_text'])"

The folder holds ``config.json``, ``generation_config.json``, ``model.safetensors``,
``tokenizer.json`` and ``tokenizer_config.json``: what ``GPT2LMHeadModel.from_pretrained`` and
``pipeline("text-generation")`` read, no network needed. Nothing here imports ``transformers`` (the
files are plain JSON and safetensors); the tests load the folder with it. This file owns the mapping
from our GPT-2 onto theirs; tests/test_model.py's oracle uses it.

The mapping, rule by rule (our names: common/model.py;
theirs: ``transformers``' ``modeling_gpt2.py``):

1. Embeddings, LayerNorms and biases keep their names and values: both models are nanoGPT's GPT-2.
2. Their projections are ``Conv1D``: ``y = x @ W + b`` with ``W`` laid out ``(in, out)``, the
   transpose of an ``nn.Linear`` weight. So every ``c_fc``, ``c_proj`` weight is ours transposed
   (``.t().contiguous()``: a safetensors file stores a tensor's bytes, not a view).
3. Their ``c_attn`` is q, k and v in one matrix, the outputs side by side ``[q | k | v]``: they
   split its output in thirds, then each third into heads exactly as ours does (``view(B, T, heads,
   head_dim)``). So ``c_attn.weight = cat([Wq^T, Wk^T, Wv^T], dim=1)`` and ``c_attn.bias = cat([bq,
   bk, bv])``.
4. The output layer is the token embedding in both (tied): written once, as
   ``transformer.wte.weight``, with ``tie_word_embeddings`` (what ``save_pretrained`` writes for
   GPT-2 too).
5. The config: ``n_positions`` = our ``--seq-len`` (the rows of ``wpe``: their model cannot go past
   it either), tanh GELU (``gelu_new``), LayerNorm epsilon 1e-5 and scores scaled by
   1/sqrt(head_dim), as ours; dropout as the run trained with (off when ``model.eval()``, as
   ``from_pretrained`` returns it).
6. The tokenizer: the run's own ``tokenizer.json``, byte for byte (checked against the run's record
   first), so ``AutoTokenizer`` tokenizes exactly as ``tokenizers`` does here; ``<|endoftext|>`` is
   bos, eos and pad.
   ``generation_config.json``'s ``max_length`` is ``--seq-len``: generation stops where the position
   embedding ends.

7. A mixture-of-experts run (``--moe-experts``, step 0 or 12): ``transformers`` has no GPT-2 with
   experts, so the folder also holds ``modeling_gpt2_moe.py`` (this folder's copy of it),
   ``GPT2LMHeadModel`` with an MoE in place of the MLPs our run replaced, named in ``config.json``'s
   ``auto_map``: ``AutoModelForCausalLM`` and ``pipeline`` load it with ``trust_remote_code=True``.
   The router keeps its name and layout (an ``nn.Linear`` in both); each expert is a GPT-2 MLP,
   mapped as rule 2 maps the dense one.

An ``OUT`` that holds files is refused (nothing saved is overwritten). The logits' agreement,
measured: README.md and docs/interop.md.
"""

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

# config.py, as every step has it
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "common"))
import parity  # noqa: E402
import sample  # noqa: E402
from config import OneLineParser, UserError, check_writable_folder, exit_on_user_error  # noqa: E402

EOS = "<|endoftext|>"  # data/train_tokenizer.py's one special token
# Ours -> theirs inside block i, for the tensors rules 1 and 2 cover (rule 3: c_q, c_k, c_v ->
# c_attn); an MLP's names follow its prefix: "mlp." in a dense block, "mlp.experts.e." for each
# expert e of an MoE block (rule 7).
SAME = ("ln_1.weight", "ln_1.bias", "ln_2.weight", "ln_2.bias", "attn.c_proj.bias")
TRANSPOSED = ("attn.c_proj.weight",)
MLP_SAME, MLP_TRANSPOSED = ("c_fc.bias", "c_proj.bias"), ("c_fc.weight", "c_proj.weight")
TOP = (
    "transformer.wte.weight",
    "transformer.wpe.weight",
    "transformer.ln_f.weight",
    "transformer.ln_f.bias",
)
# Rule 7: the modeling file an MoE folder carries, and the
# names its config.json gives transformers' Auto classes.
MOE_MODELING = Path(__file__).resolve().parent / "modeling_gpt2_moe.py"
MOE_AUTO_MAP = {
    "AutoConfig": "modeling_gpt2_moe.GPT2MoEConfig",
    "AutoModelForCausalLM": "modeling_gpt2_moe.GPT2MoELMHeadModel",
}


def hugging_face_config(config: dict, vocab_size: int, eos_id: int | None) -> dict:
    """``config.json`` of ``transformers``' GPT-2 for a run's ``config`` (rule 5);
    ``GPT2Config(**it)`` takes it."""
    dropout = config.get("dropout", 0.0)
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": vocab_size,
        "n_positions": config["seq_len"],
        "n_embd": config["n_embd"],
        "n_layer": config["n_layer"],
        "n_head": config["n_head"],
        "n_inner": None,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "resid_pdrop": dropout,
        "embd_pdrop": dropout,
        "attn_pdrop": dropout,
        "initializer_range": 0.02,
        "tie_word_embeddings": True,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "pad_token_id": eos_id,
        "dtype": "float32",
        **moe_config(config),
    }


def moe_config(config: dict) -> dict:
    """Rule 7's part of ``config.json``: the architecture in this folder's modeling file, and the
    run's MoE flags; nothing for a dense run."""
    if not config.get("moe_experts"):
        return {}
    return {
        "architectures": ["GPT2MoELMHeadModel"],
        "model_type": "gpt2_moe",
        "auto_map": MOE_AUTO_MAP,
        **{
            key: config[key]
            for key in ("moe_experts", "moe_top_k", "moe_every", "moe_capacity_factor")
        },
    }


def hugging_face_weights(ours: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our GPT-2's tensors (``named_parameters()``' names, the tied weight once; or their gradients:
    the mapping is linear) under ``GPT2LMHeadModel``'s names and layouts (rules 1-4, 7). Refuses
    tensors GPT-2 does not have."""
    layers = sorted(
        {int(m.group(1)) for n in ours if (m := re.match(r"transformer\.h\.(\d+)\.", n))}
    )
    theirs, used = {}, set()

    def take(name):
        if name not in ours:
            raise UserError(f"the weights have no {name}: they are not common/model.py's GPT-2")
        used.add(name)
        return ours[name]

    for name in TOP:
        theirs[name] = take(name)
    for i in layers:
        block = f"transformer.h.{i}"
        mlps = [f"{block}.mlp."]
        if f"{block}.mlp.router.weight" in ours:  # rule 7: the router as it is, then each expert
            theirs[f"{block}.mlp.router.weight"] = take(f"{block}.mlp.router.weight")
            pattern = rf"{block}\.mlp\.experts\.(\d+)\."
            experts = sorted({int(m.group(1)) for n in ours if (m := re.match(pattern, n))})
            mlps = [f"{block}.mlp.experts.{e}." for e in experts]
        same = [f"{block}.{n}" for n in SAME] + [m + n for m in mlps for n in MLP_SAME]
        transposed = [f"{block}.{n}" for n in TRANSPOSED] + [
            m + n for m in mlps for n in MLP_TRANSPOSED
        ]
        for name in same:
            theirs[name] = take(name)
        for name in transposed:
            theirs[name] = take(name).t().contiguous()
        theirs[f"{block}.attn.c_attn.weight"] = torch.cat(
            [take(f"{block}.attn.c_{x}.weight").t() for x in "qkv"], 1
        )
        theirs[f"{block}.attn.c_attn.bias"] = torch.cat(
            [take(f"{block}.attn.c_{x}.bias") for x in "qkv"]
        )
    extra = sorted(set(ours) - used)
    if extra or layers != list(range(len(layers))):
        raise UserError(
            f"the weights hold {', '.join(extra[:3]) or 'blocks out of order'}, which "
            "GPT-2 does not "
            "have: they are not common/model.py's GPT-2"
        )
    return theirs


def tokenizer_config(seq_len: int, has_eos: bool) -> dict:
    """``tokenizer_config.json``: the fast tokenizer built from ``tokenizer.json`` as it is (rule
    6); no clean-up of spaces when decoding, so the text is what ``tokenizers`` decodes."""
    specials = {"bos_token": EOS, "eos_token": EOS, "pad_token": EOS} if has_eos else {}
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": seq_len,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        **specials,
    }


def check_exportable(name: str) -> tuple[Path, dict]:
    """The run folder and its metrics, or a ``UserError`` saying why it cannot be exported."""
    # not a run, cut short, another schema, unfinished: its own lines
    run, metrics = parity.load_run(name)
    weights = metrics["final"].get("weights")
    if not weights or not (run / weights).is_file():
        raise UserError(
            f"{run} has no final weights ({run / (weights or 'model.safetensors')} not "
            "found); run it "
            "to the end (or --resume it), then export"
        )
    return run, metrics


def check_out(out: Path) -> None:
    """An ``OUT`` that does not exist or is an empty folder: nothing saved is ever overwritten."""
    if out.is_dir() and any(out.iterdir()):
        raise UserError(
            f"{out} exists and is not empty; export into a new or empty folder (nothing saved is "
            "overwritten)"
        )
    check_writable_folder(out, f"exporting into {out}")


def export(name: str, out: Path | None = None) -> Path:
    """Write run ``name``'s Hugging Face folder into ``out`` (default:
    ``<run>/hf``) and return it."""
    run, metrics = check_exportable(name)
    out = Path(out) if out is not None else run / "hf"
    check_out(out)
    # the tokenizer checked against the run
    model, tokenizer, config = sample.load_trained_model(str(run))
    eos = tokenizer.token_to_id(EOS)
    weights = hugging_face_weights({n: p.detach() for n, p in model.named_parameters()})
    out.parent.mkdir(parents=True, exist_ok=True)
    # Written beside OUT, then renamed: a folder that
    # is there is whole (as the trainers' checkpoints).
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        save_file(weights, str(staging / "model.safetensors"), metadata={"format": "pt"})
        files = {
            "config.json": {
                **hugging_face_config(config, tokenizer.get_vocab_size(), eos),
                "exported_from": {
                    "run": str(run),
                    "weights_sha256": metrics["final"].get("sha256"),
                },
            },
            "generation_config.json": {
                "bos_token_id": eos,
                "eos_token_id": eos,
                "pad_token_id": eos,
                "max_length": config["seq_len"],
            },
            "tokenizer_config.json": tokenizer_config(config["seq_len"], eos is not None),
        }
        for file, content in files.items():
            (staging / file).write_text(json.dumps(content, indent=2) + "\n")
        shutil.copyfile(config["tokenizer"], staging / "tokenizer.json")
        if config.get("moe_experts"):
            shutil.copyfile(MOE_MODELING, staging / MOE_MODELING.name)
        if out.is_dir():
            out.rmdir()  # empty (check_out): rename needs the name free
        os.rename(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def main() -> int:
    parser = OneLineParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run", help="step name (step1), step folder or run folder")
    parser.add_argument(
        "out", nargs="?", default=None, help="the folder to write (default: <run>/hf); new or empty"
    )
    args = parser.parse_args()
    out = export(args.run, args.out)
    if json.loads((out / "config.json").read_text())["model_type"] == "gpt2_moe":
        print(
            f"exported {parity.resolve_run(args.run)} as a Hugging Face GPT-2 with "
            f"experts in {out}: "
            "AutoModelForCausalLM.from_pretrained or pipeline('text-generation', "
            "model=...) load it "
            "with trust_remote_code=True"
        )
        return 0
    print(
        f"exported {parity.resolve_run(args.run)} as a Hugging Face GPT-2 in {out}: "
        "GPT2LMHeadModel.from_pretrained or pipeline('text-generation', model=...) load it"
    )
    return 0


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main))
