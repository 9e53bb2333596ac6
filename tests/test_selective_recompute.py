"""Step 7's --activation-checkpointing selective (selective_recompute.py): a real 2-rank gloo run bitwise to the
same run without recomputation (dropout on: the recomputation replays its masks), and the bytes each block leaves
for backward, counted with saved_tensors_hooks on real tensors for none / selective / full, equal to the closed
forms of the file's rule 3 and to the planner's formula (compare/activation_formula.py)."""
import importlib.util
import sys

import pytest
import torch

import plan
from activation_formula import FormulaActivations
from conftest import EXACT, REPO, assert_bitwise_same_run, launch, metrics, train
from model import GPT2, GPTConfig

STEP7 = REPO / "step7_zero3"
B, S, H, HEADS = 2, 32, 32, 2  # micro-batch, sequence, width, heads (the tiny workload's shape)


def step7_module(name: str):
    """A step 7 file imported by path (its imports are from step 7's folder)."""
    sys.path.insert(0, str(STEP7))
    try:
        spec = importlib.util.spec_from_file_location(f"step7_{name}", STEP7 / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(STEP7))


def saved_per_block(mode: str, dropout: float) -> list[int]:
    """Bytes autograd keeps for backward inside each block (a storage once, weights left out), step 7's own
    wrappers applied as ``shard_gpt2`` applies them."""
    torch.manual_seed(0)
    model = GPT2(GPTConfig(vocab_size=64, seq_len=S, n_layer=2, n_head=HEADS, n_embd=H, dropout=dropout)).train()
    if mode == "full":
        step7_module("zero3_setup").checkpoint_activations(model.transformer.h)
    elif mode == "selective":
        step7_module("selective_recompute").recompute_attention_core(model.transformer.h)
    weights = {p.untyped_storage()._cdata for p in model.parameters()}
    running, seen, saved = [], set(), [0, 0]
    for index, block in enumerate(model.transformer.h):
        block.register_forward_pre_hook(lambda *_, i=index: running.append(i))  # both hooks return None
        block.register_forward_hook(lambda *_: running.clear())

    def pack(tensor):
        storage = tensor.untyped_storage()
        if running and storage._cdata not in weights | seen:
            seen.add(storage._cdata)
            saved[running[-1]] += storage.nbytes()
        return tensor
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(torch.randint(0, 64, (B, S))).sum()
    loss.backward()  # the recomputation runs, and must succeed
    return saved


@pytest.mark.quick
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_bytes_per_block_are_the_closed_forms_and_the_planners(dropout):
    """float32, a CPU's float32 dropout masks: none 64 sbh + 16 sb + 4 a b s² + s² (dropout: 72 sbh + 16 sb +
    12 a b s² + s²), selective the same less every s² term, full the block's input, 4 sbh."""
    torch.set_num_threads(1)
    sbh, sb, s2 = S * B * H, S * B, S * S
    wide, scores = (72, 12) if dropout else (64, 4)
    closed = {"none": wide * sbh + 16 * sb + scores * HEADS * B * s2 + s2, "selective": wide * sbh + 16 * sb,
              "full": 4 * sbh}
    measured = {mode: saved_per_block(mode, dropout) for mode in closed}
    assert measured == {mode: [n, n] for mode, n in closed.items()}, (measured, closed)
    # the planner's formula (element 4, masks of 4 bytes): exact, less the causal mask it leaves out
    shape = plan.Shape(1, H, HEADS, 64, S)
    formula = {selective: FormulaActivations(shape, B, element=4, attention="math", dropout=dropout,
                                             selective=selective, mask=4) for selective in (False, True)}
    assert formula[False].block_bytes(1) + s2 == closed["none"]
    assert formula[True].block_bytes(1) == closed["selective"]
    assert formula[False].kept_per_block(1, False) == closed["full"]


@pytest.mark.quick
def test_recomputed_flops_are_the_matmuls():
    recomputed = step7_module("selective_recompute").recomputed_flops
    assert recomputed("none", B, S, H, 2) == 0
    assert recomputed("selective", B, S, H, 2) == 2 * 4 * B * S * S * H
    assert recomputed("full", B, S, H, 2) == 2 * (24 * B * S * H * H + 4 * B * S * S * H)


def test_selective_is_bitwise_to_no_recomputation_at_two_ranks(tmp_path, small_corpus):
    """bf16 autocast, dropout 0.1, float64 reduction: the selective run's losses, gradient norms and final weights
    are those of the run without recomputation, bit for bit."""
    none = train("step7", tmp_path / "none", small_corpus, *EXACT)
    selective = train("step7", tmp_path / "selective", small_corpus, *EXACT, "--activation-checkpointing",
                      "selective")
    assert metrics(selective)["config"]["activation_checkpointing"] == "selective"
    assert metrics(none)["config"]["activation_checkpointing"] == "none"
    assert_bitwise_same_run(none, selective)


@pytest.mark.quick
def test_a_mode_that_does_not_exist_is_one_line_exit_2(tmp_path, small_corpus):
    result = launch("step7", ["--data", str(small_corpus), "--out", str(tmp_path), "--activation-checkpointing",
                              "attention"], nproc=1)
    assert result.returncode != 0 and "ranks' exit codes: [2]" in result.stderr, result.stderr
    assert ("error: argument --activation-checkpointing: invalid choice: 'attention' (choose from 'none', 'full', "
            "'selective') (see --help)") in result.stderr, result.stderr
