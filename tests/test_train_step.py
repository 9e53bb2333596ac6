"""Every trainer's loop body is one top-level ``train_step()`` that main() calls, so that
compare/peak_memory.py runs the step the trainer runs (on ``shard_gpt2``'s model, as step 7's main()
does). Here: importing a train.py runs nothing and gives that function, with one shape across steps;
and a train_step is the textbook PyTorch loop (forward, loss / accumulation, backward, AdamW,
zero_grad), bit for bit, checked against that loop written out in plain PyTorch: step 0's in one
process, step 7's on ``shard_gpt2``'s model in a one-rank gloo group, where its sharding is
the identity."""

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO, STEPS

# Each check runs in a fresh interpreter with the step's folder first on sys.path, as the trainer
# runs: the step folders hold modules of the same names (model.py, training.py, ...).
IMPORT_ALL = r"""
import contextlib, importlib, inspect, io, json, os, sys
found, steps = {}, os.path.join(os.path.dirname(sys.argv[1]), "step")
for folder in sys.argv[1:]:
    # the previous step's copies of model.py, training.py, ...
    for name, module in list(sys.modules.items()):
        if (getattr(module, "__file__", None) or "").startswith(steps):
            del sys.modules[name]
    sys.path.insert(0, folder)
    printed, before = io.StringIO(), set(os.listdir("."))
    with contextlib.redirect_stdout(printed):
        train = importlib.import_module("train")
    sys.path.remove(folder)
    step = getattr(train, "train_step", None)
    found[os.path.basename(folder)] = {
        "train_step": list(inspect.signature(step).parameters) if step else None,
        "printed": printed.getvalue(), "new_files": sorted(set(os.listdir(".")) - before),
        # so far: each step's import adds to the same process
        "matplotlib": "matplotlib" in sys.modules}
print(json.dumps(found))
"""

# The same GPT-2, trained two steps of two micro-batches
# each, by the step's train_step and by the textbook loop.
# Clipping off: the clipping norm is training.py's exact sum (order-free by design), not torch's;
# the returned norm is compared with a float64 norm of the same gradients instead, to
# float32's rounding.
AGAINST_TEXTBOOK = r"""
import datetime, json, os, sys
import torch
import torch.distributed as dist
torch.set_num_threads(1)
step = sys.argv[1]
from config import build_parser
from model import build_model, language_model_loss
from training import make_grad_scaler, make_optimizer
import train

flags = ["--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--seq-len", "16", "--grad-clip", "0"]
config = vars(build_parser(step).parse_args(flags))
config.update(activation_checkpointing=False, no_prefetch=False, param_dtype="float32",
              reduce_dtype="float32")
device, vocab, accum = torch.device("cpu"), 97, 2
generator = torch.Generator().manual_seed(0)
def tokens():
    return torch.randint(0, vocab, (2, 16), generator=generator)
steps = [[(tokens(), tokens()) for _ in range(accum)] for _ in range(2)]

reference = build_model(config, vocab, config["seed"])
reference_optimizer = make_optimizer(reference.named_parameters(), config)
expected = []
for micro_batches in steps:
    losses = []
    for inputs, targets in micro_batches:
        loss = language_model_loss(reference, inputs, targets)
        (loss / accum).backward()
        losses.append(loss.detach())
    grads = [p.grad for p in reference.parameters()]
    norm = torch.linalg.vector_norm(torch.cat([g.double().flatten() for g in grads]))
    expected.append({"loss_sum": sum(losses, torch.zeros(())).item(), "norm": norm.item(),
                     "grad_bytes": sum(g.numel() * g.element_size() for g in grads)})
    reference_optimizer.step()
    reference_optimizer.zero_grad(set_to_none=True)

if step == "step0_single_gpu":
    model = build_model(config, vocab, config["seed"])
    optimizer = make_optimizer(model.named_parameters(), config)
    scaler = make_grad_scaler(config, device)
else:  # step 7, one rank: every piece is the whole parameter
    dist.init_process_group("gloo", init_method=f"file://{os.path.abspath('pg')}", rank=0,
                            world_size=1, timeout=datetime.timedelta(seconds=30))
    from sharded_gradients import ShardedGradScaler
    from training import param_dtype
    from zero3_setup import shard_gpt2
    # as step 7's train.py builds it
    model, _ = shard_gpt2(config, vocab, device, param_dtype(config))
    optimizer = make_optimizer(model.named_parameters(), config)
    scaler = make_grad_scaler(config, device, ShardedGradScaler)
got = []
for micro_batches in steps:
    loss_sum, grad_norm, memory = train.train_step(model, optimizer, scaler, micro_batches, config,
                                                   device)
    kept = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    got.append({"loss_sum": loss_sum.item(), "norm": grad_norm.item(),
                "grad_bytes": memory["grads"], "grads_after": len(kept)})
final = dict(model.named_parameters()) if step == "step0_single_gpu" else {
    name: full.clone() for name, full in model.gathered_parameters()}
different = [name for name, p in reference.named_parameters() if not torch.equal(final[name], p)]
result = {"expected": expected, "got": got, "different": different}
if dist.is_initialized():
    dist.destroy_process_group()
print(json.dumps(result))
"""


def python(code: str, folder, *args, cwd=None) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", code, *map(str, args)],
        cwd=cwd or folder,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "PYTHONPATH": str(folder)},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_every_trainer_has_one_train_step_of_one_shape_and_importing_it_runs_nothing(tmp_path):
    folders = [REPO / STEPS[step] for step in STEPS]
    found = python(IMPORT_ALL, REPO, *folders, cwd=tmp_path)
    for folder, got in found.items():
        assert got["printed"] == "" and got["new_files"] == [], (folder, got)
        assert not got["matplotlib"], (
            f"{folder}: a rank that draws no trace imports matplotlib (~0.6 s a rank)"
        )
        assert got["train_step"] is not None, f"{folder}/train.py has no train_step"
    data_parallel = {f: g["train_step"] for f, g in found.items() if int(f[4:].split("_")[0]) <= 8}
    # steps 0-8: (model or ddp_model, optimizer, ...)
    for folder, parameters in data_parallel.items():
        assert parameters[0] == "model" and parameters[1:6] == [
            "optimizer",
            "scaler",
            "micro_batches",
            "config",
            "device",
        ], (folder, parameters)


@pytest.mark.parametrize("step", ["step0", "step7"])
def test_train_step_is_the_textbook_loop_bit_for_bit(step, tmp_path):
    folder = REPO / STEPS[step]
    result = python(AGAINST_TEXTBOOK, folder, STEPS[step], cwd=tmp_path)
    # the weights after two steps, torch.equal
    assert result["different"] == [], result["different"]
    for expected, got in zip(result["expected"], result["got"]):
        assert got["loss_sum"] == expected["loss_sum"]  # the micro-batches' losses, summed in order
        assert abs(got["norm"] - expected["norm"]) <= 2**-23 * expected["norm"], (got, expected)
        assert got["grad_bytes"] == expected["grad_bytes"]  # counted before zero_grad freed them
        assert got["grads_after"] == 0  # and freed: set_to_none
