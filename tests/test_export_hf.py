"""compare/export_hf.py as a learner uses it: a trained run exported, then opened by Hugging Face
``transformers`` (a test-only dependency, the independent reader: nobody here wrote it) in a fresh
interpreter with no network and an empty cache, ``GPT2LMHeadModel.from_pretrained`` and
``pipeline("text-generation")`` as their documentation shows them. Its logits against ours, its
greedy generation against our model's choices, its tokenizer against ``tokenizers``; in float64 the
mapping itself, where only the order of additions may differ."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import export_hf  # compare/, on the path through conftest
import sample
from conftest import MOE as TESTS_MOE
from conftest import REPO, run_forked, train

FILES = [
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
]
# float32: each model rounds its own way (their fused c_attn GEMM, Conv1D's addmm on an (in, out)
# matrix, SDPA or their eager softmax with an additive mask); measured on the tiny run: max
# |difference| 1.8e-7 of logits up to 0.74 (docs/interop.md). 1e-5 is float32's rounding a few dozen
# times over, far below a wrong mapping's ~1e-1.
FLOAT32 = {"rtol": 1e-5, "atol": 1e-5}
TEXTS = [
    "ROMEO:\nBut soft, what light through yonder window breaks?\n",
    "  two  spaces,\ttabs\n\n\nand lines",
    "caf\u00e9, na\u00efve \u2603 \u201cquoted\u201d \u2014 \U0001f600",
    "<|endoftext|>JULIET:<|endoftext|>",
    "",
]
PROMPT, NEW_TOKENS = "ROMEO:", 12

# What a learner runs after exporting: a new interpreter, HF_HUB_OFFLINE=1, nothing in the cache.
OFFLINE = r"""
import json, sys
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer, GPT2LMHeadModel, pipeline
folder, io = sys.argv[1], sys.argv[2]
ids = load_file(f"{io}/ids.safetensors")["ids"]
report = {"logits": {}}
for attention in ("default", "eager"):
    kwargs = {} if attention == "default" else {"attn_implementation": attention}
    model = GPT2LMHeadModel.from_pretrained(folder, **kwargs)
    report[f"{attention}_is"] = [model.config._attn_implementation, str(model.dtype),
                                 model.training]
    with torch.no_grad():
        report["logits"][attention] = model(input_ids=ids).logits.contiguous()
save_file(report.pop("logits"), f"{io}/logits.safetensors")
tokenizer = AutoTokenizer.from_pretrained(folder)
texts = json.loads(open(f"{io}/texts.json").read())
report["ids"] = [tokenizer(text)["input_ids"] for text in texts]
report["decoded"] = [tokenizer.decode(i) for i in report["ids"]]
generator = pipeline("text-generation", model=folder)
prompt, new = sys.argv[3], int(sys.argv[4])
out = generator(prompt, max_new_tokens=new, do_sample=False, return_tensors=True)
report["generated"] = [int(t) for t in out[0]["generated_token_ids"]]
report["text"] = generator(prompt, max_new_tokens=new, do_sample=False)[0]["generated_text"]
print(json.dumps(report))
"""


def run_offline(script: str, io, *args: str) -> dict:
    """``script`` in a fresh interpreter with no network and an empty ``HF_HOME`` under ``io``
    (remote code is cached there too): the JSON its last line prints, once it is checked that
    nothing was downloaded."""
    empty = io / "hf_home"
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(empty),
        "HF_HUB_DISABLE_TELEMETRY": "1",
    }
    result = subprocess.run(
        [sys.executable, "-c", script, *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert not (empty / "hub").exists() or not any((empty / "hub").iterdir()), (
        "something was downloaded"
    )
    return json.loads(result.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def exported(tmp_path_factory, small_corpus):
    """Step 0 on the tiny workload, exported by the command
    line into an empty folder that is already there."""
    top = tmp_path_factory.mktemp("export_hf")
    run = train("step0", top / "run", small_corpus)
    out = top / "hf"
    out.mkdir()
    result = run_forked(
        [sys.executable, str(REPO / "compare" / "export_hf.py"), str(run), str(out)]
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith(f"exported {run} as a Hugging Face GPT-2 in {out}"), (
        result.stdout
    )
    return run, out


@pytest.fixture(scope="module")
def offline(exported, tmp_path_factory):
    """What transformers, offline in a fresh interpreter,
    computes from the folder: (report, logits, ids given)."""
    _, out = exported
    io = tmp_path_factory.mktemp("offline")
    ids = torch.randint(0, 2048, (3, 32), generator=torch.Generator().manual_seed(0))
    save_file({"ids": ids}, str(io / "ids.safetensors"))
    (io / "texts.json").write_text(json.dumps(TEXTS))
    report = run_offline(OFFLINE, io, str(out), str(io), PROMPT, str(NEW_TOKENS))
    return report, load_file(str(io / "logits.safetensors")), ids


def test_the_folder_holds_what_transformers_reads_and_the_runs_tokenizer(exported):
    run, out = exported
    assert sorted(p.name for p in out.iterdir()) == FILES  # and no staging folder left beside it
    assert sorted(p.name for p in out.parent.iterdir()) == ["hf", "run"]
    config = json.loads((run / "metrics.json").read_text())["config"]
    assert (out / "tokenizer.json").read_bytes() == open(config["tokenizer"], "rb").read()
    hf = json.loads((out / "config.json").read_text())
    assert (hf["model_type"], hf["n_positions"], hf["n_layer"], hf["n_embd"], hf["n_head"]) == (
        "gpt2",
        config["seq_len"],
        config["n_layer"],
        config["n_embd"],
        config["n_head"],
    )
    theirs = load_file(str(out / "model.safetensors"))
    assert "lm_head.weight" not in theirs and theirs[
        "transformer.h.0.attn.c_attn.weight"
    ].shape == (32, 96)


def test_transformers_loads_it_offline_and_its_logits_equal_ours_in_float32(exported, offline):
    run, _ = exported
    report, logits, ids = offline
    assert report["default_is"] == ["sdpa", "torch.float32", False]  # eval mode: no dropout
    assert report["eager_is"] == ["eager", "torch.float32", False]
    model, _, _ = sample.load_trained_model(str(run))
    with torch.no_grad():
        ours = model(ids)
    for attention, theirs in logits.items():
        torch.testing.assert_close(theirs, ours, **FLOAT32, msg=attention)


def test_the_pipeline_generates_what_our_model_would_choose(exported, offline):
    """Greedy: every token the pipeline chose is the one our model ranks first given the same prefix
    (up to a tie within the float32 tolerance, where either is right)."""
    run, _ = exported
    report = offline[0]
    model, tokenizer, _ = sample.load_trained_model(str(run))
    prompt = tokenizer.encode(PROMPT).ids
    generated = report["generated"]
    assert generated[: len(prompt)] == prompt and len(generated) == len(prompt) + NEW_TOKENS
    with torch.no_grad():
        logits = model(torch.tensor([generated[:-1]]))[0]
    for position in range(len(prompt), len(generated)):
        row = logits[position - 1]
        assert row[generated[position]] >= row.max() - FLOAT32["atol"], position
    assert report["text"] == tokenizer.decode(generated)


def test_its_tokenizer_tokenizes_and_decodes_as_ours(exported, offline):
    run, _ = exported
    report = offline[0]
    _, tokenizer, _ = sample.load_trained_model(str(run))
    assert report["ids"] == [tokenizer.encode(text).ids for text in TEXTS]
    assert report["decoded"] == [
        tokenizer.decode(tokenizer.encode(text).ids, skip_special_tokens=False) for text in TEXTS
    ]
    # the special token, one id
    assert report["ids"][3][0] == tokenizer.token_to_id("<|endoftext|>") == 0


def test_in_float64_the_mapping_is_exact(exported):
    """The weights, loaded in float64 on both sides:
    the same formula, the order of additions aside (~1e-15)."""
    from transformers import GPT2LMHeadModel

    run, out = exported
    model, _, _ = sample.load_trained_model(str(run))
    hf = GPT2LMHeadModel.from_pretrained(str(out), attn_implementation="eager", dtype=torch.float64)
    ids = torch.randint(0, 2048, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(
            hf(input_ids=ids).logits, model.double()(ids), rtol=1e-12, atol=1e-12
        )


def test_a_wrong_mapping_is_caught(exported, tmp_path, monkeypatch):
    """The comparison can fail: k and v exchanged in c_attn's thirds moves the logits far past the
    float32 tolerance (measured: by 0.40; q and k exchanged, the scores transposed, by 8.8e-4 on
    this barely trained model)."""
    from transformers import GPT2LMHeadModel

    run, _ = exported
    right = export_hf.hugging_face_weights

    def swapped(ours):
        exchange = {
            n: n.replace(".c_k.", ".c_v.") if ".c_k." in n else n.replace(".c_v.", ".c_k.")
            for n in ours
        }
        return right({exchange[n]: t for n, t in ours.items()})

    monkeypatch.setattr(export_hf, "hugging_face_weights", swapped)
    out = export_hf.export(str(run), tmp_path / "wrong")
    model, _, _ = sample.load_trained_model(str(run))
    ids = torch.randint(0, 2048, (2, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        difference = (
            (GPT2LMHeadModel.from_pretrained(str(out))(input_ids=ids).logits - model(ids))
            .abs()
            .max()
        )
    assert difference > 100 * FLOAT32["atol"], difference


# ---- a mixture-of-experts run: GPT-2 with experts, in the folder's modeling file (rule 7) ----
# Experts in block 0 of 2 (--moe-every 2: block 1 stays dense), top-2 of 4, capacity factor 1: on
# the test's 3 x 32 tokens some choices are dropped, so the logits check the capacity rule too
# (asserted below).
MOE = [*TESTS_MOE, "--moe-every", "2"]
MOE_FILES = sorted([*FILES, "modeling_gpt2_moe.py"])

# The same learner, for a model transformers does not have: AutoModelForCausalLM and the pipeline,
# with trust_remote_code. Each folder named on the command line: its logits in float32 (their
# default attention and eager) and in float64; for the first one, greedy generation with and without
# the KV cache.
OFFLINE_MOE = r"""
import json, sys
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, pipeline
io, folders = sys.argv[1], sys.argv[2:]
ids = load_file(f"{io}/ids.safetensors")["ids"]
logits, report = {}, {}
for n, folder in enumerate(folders):
    for name, kwargs in [("default", {}), ("eager", {"attn_implementation": "eager"}),
                         ("float64", {"attn_implementation": "eager", "dtype": torch.float64})]:
        model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, **kwargs)
        report[f"{n}_{name}_is"] = [type(model).__name__, str(model.dtype), model.training]
        with torch.no_grad():
            logits[f"{n}_{name}"] = model(input_ids=ids).logits.contiguous()
save_file(logits, f"{io}/logits.safetensors")
generator = pipeline("text-generation", model=folders[0], trust_remote_code=True)
for cache in (True, False):
    out = generator("ROMEO:", max_new_tokens=12, do_sample=False, use_cache=cache,
                    return_tensors=True)
    report[f"generated_cache_{cache}"] = [int(t) for t in out[0]["generated_token_ids"]]
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def exported_moe(tmp_path_factory, small_corpus):
    """Step 0 training the MoE, exported by the command line; beside it two folders that must
    disagree with ours: experts 0 and 1 of block 0 exchanged by the mapping, and the right weights
    with the capacity rule off."""
    top = tmp_path_factory.mktemp("export_hf_moe")
    run = train("step0", top / "run", small_corpus, *MOE)
    out = top / "hf"
    result = run_forked(
        [sys.executable, str(REPO / "compare" / "export_hf.py"), str(run), str(out)]
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert (
        result.stdout.startswith(f"exported {run} as a Hugging Face GPT-2 with experts in {out}: ")
        and "trust_remote_code=True" in result.stdout
    ), result.stdout
    right = export_hf.hugging_face_weights

    def exchanged(ours):
        swap = {".experts.0.": ".experts.1.", ".experts.1.": ".experts.0."}
        renamed = {}
        for name, tensor in ours.items():
            for a, b in swap.items():
                if a in name:
                    name = name.replace(a, b)
                    break
            renamed[name] = tensor
        return right(renamed)

    export_hf.hugging_face_weights = exchanged
    try:
        wrong = export_hf.export(str(run), top / "wrong")
    finally:
        export_hf.hugging_face_weights = right
    dropless = top / "dropless"
    shutil.copytree(out, dropless)
    hf_config = json.loads((dropless / "config.json").read_text())
    (dropless / "config.json").write_text(json.dumps({**hf_config, "moe_capacity_factor": 0.0}))
    return run, out, wrong, dropless


@pytest.fixture(scope="module")
def offline_moe(exported_moe, tmp_path_factory):
    """(report, logits, ids) from transformers, offline,
    with an empty HF_HOME (remote code is cached under it)."""
    _, out, wrong, dropless = exported_moe
    io = tmp_path_factory.mktemp("offline_moe")
    ids = torch.randint(0, 2048, (3, 32), generator=torch.Generator().manual_seed(0))
    save_file({"ids": ids}, str(io / "ids.safetensors"))
    report = run_offline(OFFLINE_MOE, io, str(io), str(out), str(wrong), str(dropless))
    return report, load_file(str(io / "logits.safetensors")), ids


def test_an_moe_folder_carries_its_modeling_file_and_the_runs_moe_flags(exported_moe):
    run, out, _, _ = exported_moe
    assert sorted(p.name for p in out.iterdir()) == MOE_FILES
    assert (out / "modeling_gpt2_moe.py").read_bytes() == export_hf.MOE_MODELING.read_bytes()
    config = json.loads((run / "metrics.json").read_text())["config"]
    hf = json.loads((out / "config.json").read_text())
    assert (hf["model_type"], hf["architectures"], hf["auto_map"]) == (
        "gpt2_moe",
        ["GPT2MoELMHeadModel"],
        export_hf.MOE_AUTO_MAP,
    )
    for key in ("moe_experts", "moe_top_k", "moe_every", "moe_capacity_factor"):
        assert hf[key] == config[key], key
    theirs = load_file(str(out / "model.safetensors"))
    assert theirs["transformer.h.0.mlp.router.weight"].shape == (
        4,
        32,
    )  # as ours: an nn.Linear in both
    assert theirs["transformer.h.0.mlp.experts.3.c_fc.weight"].shape == (
        32,
        128,
    )  # Conv1D: (in, out)
    assert "transformer.h.0.mlp.c_fc.weight" not in theirs
    assert theirs["transformer.h.1.mlp.c_fc.weight"].shape == (32, 128)  # block 1: dense


def test_transformers_loads_the_moe_model_offline_and_its_logits_equal_ours(
    exported_moe, offline_moe
):
    run, _, _, _ = exported_moe
    report, logits, ids = offline_moe
    assert report["0_default_is"] == ["GPT2MoELMHeadModel", "torch.float32", False]
    assert report["0_float64_is"] == ["GPT2MoELMHeadModel", "torch.float64", False]
    model, _, _ = sample.load_trained_model(str(run))
    import moe_setup

    moe_setup.take_moe_record(model)
    with torch.no_grad():
        ours = model(ids)
    # the capacity rule is in play: some of these 3 x 32 tokens' choices were dropped
    assert moe_setup.take_moe_record(model)["moe"]["dropped_fraction"][0] > 0
    for attention in ("default", "eager"):
        torch.testing.assert_close(logits[f"0_{attention}"], ours, **FLOAT32, msg=attention)
    with torch.no_grad():
        torch.testing.assert_close(logits["0_float64"], model.double()(ids), rtol=1e-12, atol=1e-12)


def test_a_wrong_expert_mapping_or_a_missing_capacity_rule_is_caught(exported_moe, offline_moe):
    """The comparison can fail: block 0's experts 0 and 1 exchanged, or the same weights without
    dropping, move the logits far past the float32 tolerance."""
    run, _, _, _ = exported_moe
    _, logits, ids = offline_moe
    model, _, _ = sample.load_trained_model(str(run))
    with torch.no_grad():
        ours = model(ids)
    for folder in ("1", "2"):  # wrong, dropless
        difference = (logits[f"{folder}_default"] - ours).abs().max()
        assert difference > 100 * FLOAT32["atol"], (folder, difference)


def test_the_moe_pipeline_generates_what_our_model_would_choose(exported_moe, offline_moe):
    """Without the KV cache each step forwards the whole prefix, as ours does here, capacity and
    all: every token chosen is ours' first choice. With the cache, one new token a forward (none
    dropped): it generates as many."""
    run, _, _, _ = exported_moe
    report = offline_moe[0]
    model, tokenizer, _ = sample.load_trained_model(str(run))
    prompt = tokenizer.encode(PROMPT).ids
    generated = report["generated_cache_False"]
    assert generated[: len(prompt)] == prompt and len(generated) == len(prompt) + NEW_TOKENS
    for position in range(len(prompt), len(generated)):
        with torch.no_grad():
            row = model(torch.tensor([generated[:position]]))[0, -1]
        assert row[generated[position]] >= row.max() - FLOAT32["atol"], position
    cached = report["generated_cache_True"]
    assert cached[: len(prompt)] == prompt and len(cached) == len(prompt) + NEW_TOKENS
