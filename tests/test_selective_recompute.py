"""Step 7's --activation-checkpointing selective (recomputation.py): a real 2-rank gloo run bitwise
to the same run without recomputation (dropout on: the recomputation replays its masks), and the
bytes each block leaves for backward, counted with saved_tensors_hooks on real tensors for none /
selective / full, equal to the closed forms of the file's rule 3 and to the planner's formula
(compare/activation_formula.py)."""

import importlib.util
import sys

import pytest
import torch

import plan
from activation_formula import FormulaActivations
from conftest import (
    EXACT,
    MESH_RUNS,
    REPO,
    TINY,
    assert_bitwise_same_run,
    launch,
    metrics,
    spawn,
    train,
)
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


def saved_per_block(mode: str, dropout: float, prepare=None) -> list[int]:
    """Bytes autograd keeps for backward inside each block (a storage once, weights left out),
    recomputed as ``recomputation.recompute`` does it in steps 7 and 10; ``prepare(model)`` first
    returns the model to count (step 10's tensor-parallel one)."""
    torch.manual_seed(0)
    model = GPT2(
        GPTConfig(vocab_size=64, seq_len=S, n_layer=2, n_head=HEADS, n_embd=H, dropout=dropout)
    ).train()
    if prepare is not None:
        model = prepare(model)
    step7_module("recomputation").recompute(model.transformer.h, mode)
    weights = {p.untyped_storage()._cdata for p in model.parameters()}
    running, seen, saved = [], set(), [0, 0]
    for index, block in enumerate(model.transformer.h):
        # both hooks return None
        block.register_forward_pre_hook(lambda *_, i=index: running.append(i))
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
    """float32, a CPU's float32 dropout masks: none 64 sbh + 16 sb + 4 a b s² + s²
    (dropout: 72 sbh + 16 sb + 12 a b s² + s²), selective the same less every s² term, full the
    block's input, 4 sbh."""
    torch.set_num_threads(1)
    sbh, sb, s2 = S * B * H, S * B, S * S
    wide, scores = (72, 12) if dropout else (64, 4)
    closed = {
        "none": wide * sbh + 16 * sb + scores * HEADS * B * s2 + s2,
        "selective": wide * sbh + 16 * sb,
        "full": 4 * sbh,
    }
    measured = {mode: saved_per_block(mode, dropout) for mode in closed}
    assert measured == {mode: [n, n] for mode, n in closed.items()}, (measured, closed)
    # the planner's formula (element 4, masks of 4 bytes): exact, less the causal mask it leaves out
    shape = plan.Shape(1, H, HEADS, 64, S)
    formula = {
        selective: FormulaActivations(
            shape, B, element=4, attention="math", dropout=dropout, selective=selective, mask=4
        )
        for selective in (False, True)
    }
    assert formula[False].block_bytes(1) + s2 == closed["none"]
    assert formula[True].block_bytes(1) == closed["selective"]
    assert formula[False].kept_per_block(1, False) == closed["full"]


@pytest.mark.quick
def test_recomputed_flops_are_the_matmuls():
    recomputed = step7_module("recomputation").recomputed_flops
    assert recomputed("none", B, S, H, 2) == 0
    assert recomputed("selective", B, S, H, 2) == 2 * 4 * B * S * S * H
    assert recomputed("full", B, S, H, 2) == 2 * (24 * B * S * H * H + 4 * B * S * S * H)


def test_selective_is_bitwise_to_no_recomputation_at_two_ranks(tmp_path, small_corpus):
    """bf16 autocast, dropout 0.1, float64 reduction: the selective run's losses, gradient norms and
    final weights are those of the run without recomputation, bit for bit."""
    none = train("step7", tmp_path / "none", small_corpus, *EXACT)
    selective = train(
        "step7",
        tmp_path / "selective",
        small_corpus,
        *EXACT,
        "--activation-checkpointing",
        "selective",
    )
    assert metrics(selective)["config"]["activation_checkpointing"] == "selective"
    assert metrics(none)["config"]["activation_checkpointing"] == "none"
    assert_bitwise_same_run(none, selective)


@pytest.mark.quick
def test_a_mode_that_does_not_exist_is_one_line_exit_2(tmp_path, small_corpus):
    result = launch(
        "step7",
        [
            "--data",
            str(small_corpus),
            "--out",
            str(tmp_path),
            "--activation-checkpointing",
            "attention",
        ],
        nproc=1,
    )
    assert result.returncode != 0 and "ranks' exit codes: [2]" in result.stderr, result.stderr
    assert (
        "error: argument --activation-checkpointing: invalid choice: 'attention' "
        "(choose from 'none', 'full', "
        "'selective') (see --help)"
    ) in result.stderr, result.stderr


# ---- step 10: recomputation on a tensor-parallel rank's heads, through the pipeline's schedules


def _tensor_parallel_saved_bytes(rank, world_size, port, queue):
    """Each block's saved bytes on this rank of a tp group of two, step 10's own wrappers (step 8's
    files), with and without sequence parallelism, for each mode."""
    from conftest import init_gloo, shutdown

    init_gloo(rank, world_size, port)
    sys.path.insert(0, str(REPO / "step10_3d_parallel"))
    from sequence_parallel import sequence_parallel_gpt2
    from tensor_parallel import parallelize_gpt2

    result = {}
    for sequence_parallel in (False, True):

        def prepare(model, sequence_parallel=sequence_parallel):
            model = parallelize_gpt2(model)
            return sequence_parallel_gpt2(model) if sequence_parallel else model

        for mode in ("none", "selective", "full"):
            result[sequence_parallel, mode] = saved_per_block(mode, 0.0, prepare)
    queue.put((rank, result))
    shutdown()


def test_step10_bytes_per_block_at_tp2_are_the_closed_forms_and_the_planners():
    """A rank of a tp pair holds a/t heads: its s² terms and everything between a column- and a
    row-parallel linear are 1/t. Float32, no dropout: none
    16 sbh + 16 sb + 48 sbh/t + 4 (a/t) b s² + s², selective the same less the s² terms, full the
    block's input, 4 sbh. With sequence parallelism the LayerNorms' inputs and statistics are 1/t
    too, but each all-gathered LayerNorm output is kept whole by the linear it feeds:
    8 sbh + (56 sbh + 16 sb)/t (+ the s² terms), full 4 sbh/t. The planner counts Megatron-LM's
    sequence parallelism, which keeps those inputs sharded and gathers them again in backward:
    8 sbh (1 - 1/t) less, the only difference."""
    t, sbh, sb, s2 = 2, S * B * H, S * B, S * S
    scores = 4 * (HEADS // t) * B * s2 + s2
    selective = {
        False: 16 * sbh + 16 * sb + 48 * sbh // t,
        True: 8 * sbh + (56 * sbh + 16 * sb) // t,
    }
    closed = {
        (sp, mode): n
        for sp in (False, True)
        for mode, n in (
            ("none", selective[sp] + scores),
            ("selective", selective[sp]),
            ("full", 4 * sbh // (t if sp else 1)),
        )
    }
    results = spawn(_tensor_parallel_saved_bytes, t, timeout=180)
    for rank, measured in results.items():
        assert measured == {key: [n, n] for key, n in closed.items()}, (rank, measured, closed)
    for sp in (False, True):
        # the gathered LayerNorm outputs ours keeps whole
        gathered = 8 * sbh * (t - 1) // t if sp else 0
        formula = {
            recompute: FormulaActivations(
                plan.Shape(1, H, HEADS, 64, S),
                B,
                element=4,
                attention="math",
                selective=recompute,
                mask=4,
            )
            for recompute in (False, True)
        }
        assert formula[False].block_bytes(t, sp) + s2 + gathered == closed[sp, "none"]
        assert formula[True].block_bytes(t, sp) + gathered == closed[sp, "selective"]
        assert formula[False].kept_per_block(t, sp) == closed[sp, "full"]


@pytest.mark.parametrize("mode, schedule", [("selective", "zero-bubble"), ("full", "1f1b")])
def test_step10_recomputation_is_bitwise_to_none_at_tp2_pp2_with_sequence_parallelism(
    mode, schedule, mesh_runs, tmp_path, small_corpus
):
    """tp 2 x pp 2, sequence parallelism, dropout 0.1, bf16 autocast (the shared run ``tp2pp2sp``,
    which keeps everything): recomputing attention's core under zero bubble's split backward (B
    recomputes it; W needs only what the linears kept), or whole blocks under 1F1B, changes no bit
    of losses, norms or weights."""
    none = mesh_runs("tp2pp2sp")
    step, nproc, flags = MESH_RUNS["tp2pp2sp"]
    at = TINY.index("--grad-accum")
    out = tmp_path / mode
    result = launch(
        step,
        [
            *TINY[:at],
            *TINY[at + 2 :],
            *flags,
            "--activation-checkpointing",
            mode,
            "--schedule",
            schedule,
            "--data",
            str(small_corpus),
            "--out",
            str(out),
        ],
        nproc=nproc,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert metrics(out)["config"]["activation_checkpointing"] == mode
    assert metrics(none)["config"]["activation_checkpointing"] == "none"
    assert_bitwise_same_run(none, out)


def test_step10_resumes_with_another_mode_bitwise(mesh_runs, tmp_path, small_corpus):
    """The mode changes what is kept, not what is computed, so a run may resume with another one
    (resharding.py's RESUMABLE_KEYS): tp 2 x pp 2 saved at step 2 without recomputation, resumed
    with selective, ends bitwise where the uninterrupted run ended."""
    saved = mesh_runs("tp2pp2")
    step, nproc, flags = MESH_RUNS["tp2pp2"]
    at = TINY.index("--grad-accum")
    out = tmp_path / "resumed"
    result = launch(
        step,
        [
            *TINY[:at],
            *TINY[at + 2 :],
            *flags,
            "--activation-checkpointing",
            "selective",
            "--resume",
            str(saved / "checkpoints" / "step_2"),
            "--data",
            str(small_corpus),
            "--out",
            str(out),
        ],
        nproc=nproc,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert_bitwise_same_run(saved, out)


def _attention_cores_run(rank, world_size, port, queue, runs):
    """Two pipeline stages (step 10's files, pp = 2, one block each), 4 micro-batches: how many
    times each stage's attention core runs, forwards and recomputations together, for each (mode,
    schedule) of ``runs``."""
    from conftest import init_gloo, shutdown

    init_gloo(rank, world_size, port)
    sys.path.insert(0, str(REPO / "step10_3d_parallel"))
    from pipeline_setup import pipeline_gpt2
    from pipeline_stages import GPT2Stage
    from recomputation import recompute

    micro_batches, b, s = 4, 2, 16
    result = {}
    for mode, schedule in runs:
        torch.manual_seed(0)
        model = GPT2(GPTConfig(vocab_size=64, seq_len=s, n_layer=2, n_head=HEADS, n_embd=H)).train()
        calls = [0]
        for block in model.transformer.h:
            core = block.attn.core

            def counted(*args, core=core, calls=calls):
                calls[0] += 1
                return core(*args)

            block.attn.core = counted
        recompute(model.transformer.h, mode)
        config = {
            "micro_batch_size": b,
            "seq_len": s,
            "n_embd": H,
            "schedule": schedule,
            "dropout": 0.0,
            "amp": "none",
            "virtual_stages": None,
        }
        stages = [GPT2Stage(model, i, 2) for i in range(2)]
        _, _, pipe = pipeline_gpt2(
            stages, rank, config, torch.device("cpu"), torch.nn.functional.cross_entropy
        )
        batch = torch.randint(
            0, 64, (micro_batches, b, s + 1), generator=torch.Generator().manual_seed(1)
        )
        pipe.run(
            micro_batches, list(batch[:, :, :-1]), list(batch[:, :, 1:]), loss_scale=micro_batches
        )
        pipe.finish_gradient_synchronization()
        result[mode, schedule] = calls[0]
    queue.put((rank, result))
    shutdown()


def test_step10_recomputes_each_core_once_a_micro_batch_and_full_under_zero_bubble_would_not():
    """Counted on both stages of a real 2-rank pipeline (one block each, 4 micro-batches): without
    recomputation a core runs once a micro-batch; selective and full recomputation run it once more
    in backward, under 1F1B and, for selective, under zero bubble (B recomputes it, W needs nothing
    inside it). Full under zero bubble recomputes the block once per backward call that reaches it,
    B's and each layer's W (measured: 10 runs a micro-batch instead of 2, 2026-12-03): why step 10
    refuses it."""
    runs = [
        ("none", "1f1b"),
        ("selective", "1f1b"),
        ("full", "1f1b"),
        ("selective", "zero-bubble"),
        ("full", "zero-bubble"),
    ]
    results = spawn(_attention_cores_run, 2, runs, timeout=180)
    for rank, calls in results.items():
        once = calls["none", "1f1b"]
        assert once == 4, (rank, calls)  # one block a stage, 4 micro-batches
        assert (
            calls["selective", "1f1b"]
            == calls["full", "1f1b"]
            == calls["selective", "zero-bubble"]
            == 2 * once
        ), (rank, calls)
        assert calls["full", "zero-bubble"] > 2 * once, (rank, calls)
    print(
        {rank: calls["full", "zero-bubble"] / 4 for rank, calls in results.items()},
        "core runs a micro-batch",
    )
