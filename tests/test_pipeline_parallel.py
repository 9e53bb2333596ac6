"""Step 9, pipeline parallelism: bitwise equal to step 0 with the same micro-batches (both
schedules, 2 and 4 stages, dropout and bf16 on), to torch.distributed.pipelining on the same stages,
and to one process in an outsider's own harness (on the CPU, staged through host memory, and on one
GPU shared over gloo); the stages compute the model's forward bit for bit; checkpoints that resume
at another number of stages and that step 1 reads; the bytes each stage sends and the micro-batches
it holds, against their formulas; a stage that hangs ends the job."""

import importlib.util
import os
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch

from conftest import (
    PIPELINE,
    REPO,
    STEPS,
    TINY,
    assert_bitwise_same_run,
    metrics,
    run_forked,
    spawn,
    train,
)
from slow_rank_hook import HOOK

# The runs are shared (conftest's ``pipeline_runs``, on TINY + PIPELINE: 4 blocks, 4 micro-batches
# per step, dropout, bf16, clipping, checkpoints at steps 2 and 4): step 0, and step 9 on 2 stages
# with each schedule (the 1F1B one is also step 9's original in tests/test_foundation.py's
# resume test).
FLAGS = (*TINY, *PIPELINE)
# TINY's micro-batch, sequence and width; data/tokenizer.json's vocabulary
B, S, E, VOCAB = 2, 32, 32, 2048


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_two_stages_train_bitwise_like_step0(pipeline_runs, schedule):
    """Every weight and every logged number (loss, grad norm, param norm) the same bits as step 0
    accumulating the same 4 micro-batches: the stages run step 0's ops, add gradients in its order,
    draw its dropout masks."""
    assert_bitwise_same_run(
        pipeline_runs("step0"), pipeline_runs("step9", 2, "--schedule", schedule)
    )


def test_resume_at_four_stages_is_bitwise_and_step1_reads_the_checkpoint(
    pipeline_runs, tmp_path, small_corpus
):
    """A 2-stage checkpoint resumed by 4 stages (GPipe, 2 flushes of 2 micro-batches: the boundaries
    move, the state is found by name) finishes bitwise like step 0; step 1 (PyTorch DDP, 2 ranks x 2
    micro-batches) reads the same checkpoint and goes on from it. (Not bitwise: DDP's two ranks draw
    other dropout masks than one process, and sum in another order; its first loss after the resume
    is within dropout's noise.)"""
    two = pipeline_runs("step9", 2, "--schedule", "1f1b")
    checkpoint = two / "checkpoints" / "step_2"
    four = train(
        "step9",
        tmp_path / "four",
        small_corpus,
        *FLAGS,
        "--schedule",
        "gpipe",
        "--micro-batches",
        "2",
        "--resume",
        str(checkpoint),
        nproc=4,
    )
    assert_bitwise_same_run(pipeline_runs("step0"), four)
    ddp = train(
        "step1",
        tmp_path / "ddp",
        small_corpus,
        *FLAGS,
        "--grad-accum",
        "2",
        "--resume",
        str(checkpoint),
    )
    step0, resumed = metrics(pipeline_runs("step0"))["records"], metrics(ddp)["records"]
    assert resumed[:2] == metrics(two)["records"][:2]  # the records so far come from the checkpoint
    assert abs(resumed[2]["loss"] - step0[2]["loss"]) < 0.02 * step0[2]["loss"], (
        resumed[2],
        step0[2],
    )


def test_bytes_sent_and_micro_batches_held_match_the_formulas(pipeline_runs):
    """Per micro-batch each way: batch x sequence x hidden x 4 bytes; the tie: the last stage's half
    of the embedding's gradient per micro-batch, the first stage's combined gradient once per step.
    GPipe holds all M micro-batches' activations on every stage, 1F1B at most P - s on stage s.
    Stage 0 holds the embeddings and its blocks; the last stage its blocks, the final norm and its
    copy of the tied embedding. Both stages add the two norms' all-reduces: the gradient's float64
    sum of squares, the parameters' exact parts."""
    activation, tie, M, norms = B * S * E * 4, VOCAB * E * 4, 4, 8 + 3 * 277 * 8
    for schedule, held in [("1f1b", [2, 1]), ("gpipe", [M, M])]:
        records = metrics(pipeline_runs("step9", 2, "--schedule", schedule))["records"]
        for record in records:
            assert record["comm"] == [
                {
                    "p2p activations": M * activation,
                    "p2p tied-parameter gradient": tie,
                    "all_reduce": norms,
                },
                {
                    "p2p activation gradients": M * activation,
                    "p2p tied-parameter gradient": M * tie,
                    "all_reduce": norms,
                },
            ]
            assert [m["micro_batches_in_flight"] for m in record["memory"]] == held
    # ln, attn, ln, mlp
    block = 2 * E + 3 * E * E + 3 * E + E * E + E + 2 * E + 4 * E * E + 4 * E + 4 * E * E + E
    embeddings = VOCAB * E + S * E
    two_stages = pipeline_runs("step9", 2, "--schedule", "1f1b")
    stage_params = [m["params"] for m in metrics(two_stages)["records"][0]["memory"]]
    assert stage_params == [4 * (embeddings + 2 * block), 4 * (2 * block + 2 * E + VOCAB * E)]
    assert metrics(pipeline_runs("step0"))["records"][0]["memory"][0]["params"] == 4 * (
        embeddings + 4 * block + 2 * E
    )


def test_equal_to_torch_distributed_pipelining_on_the_same_stages():
    """compare/pipeline_reference.py: PyTorch's PipelineStage with ScheduleGPipe and Schedule1F1B
    (scale_grads=False, loss / M) against ours, 2 stages, 3 micro-batches: every gradient and weight
    torch.equal; and the two traps it avoids cost something (their default scale_grads=True, and
    adding the tie's accumulated halves)."""
    result = run_forked(
        [sys.executable, str(REPO / "compare" / "pipeline_reference.py"), "--steps", "1"]
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("bitwise identical") == 2 and result.stdout.rstrip().endswith(
        "PASS"
    ), result.stdout
    # M = 3: not exact
    assert "scale_grads=True: max abs gradient diff 0.0e+00" not in result.stdout


def step9_module(name: str):
    """Step 9's ``name``.py, imported under a name of its own (other steps have modules of the same
    names); the modules it imports that only step 9 has (pipeline.py's dropout_replay.py, ...) are
    found in step 9's folder."""
    spec = importlib.util.spec_from_file_location(
        f"step9_{name}", REPO / STEPS["step9"] / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    # after common/: the copies step 9 shares are common's own
    sys.path.append(str(REPO / STEPS["step9"]))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(REPO / STEPS["step9"]))
    return module


# ---- the stages: a slice of the model's blocks, the model's forward ------------------------------


@pytest.mark.parametrize("n_layer, num_stages", [(4, 1), (4, 2), (3, 2), (4, 4)])
def test_stages_in_turn_compute_the_models_forward_bitwise(n_layer, num_stages):
    """The stages one after the other give the logits of ``model(ids)`` bit for bit, dropout on (the
    same draws in the same order), under the model's parameter names: each block once, the tie held
    by the first stage and copied by the last."""
    stages_py, model_py = step9_module("pipeline_stages"), step9_module("model")
    config = dict(seq_len=S, n_layer=n_layer, n_head=2, n_embd=E, dropout=0.1, attention="math")
    model = model_py.build_model(config, VOCAB, seed=0)
    ids = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(2)
    expected = model(ids)
    stages = [stages_py.GPT2Stage(model, s, num_stages) for s in range(num_stages)]
    torch.manual_seed(2)
    x = ids
    for stage in stages:
        x = stage(x)
    assert torch.equal(x, expected)
    names = [n for stage in stages for n, _ in stage.owned_parameters()]
    assert names == [n for n, _ in model.named_parameters()]
    if num_stages > 1:
        assert stages[0].tied_parameter is model.transformer.wte.weight
        assert torch.equal(stages[-1].tied_parameter, model.transformer.wte.weight)
        assert stages[-1].tied_parameter is not model.transformer.wte.weight


# ---- gloo moves CPU tensors only: a GPU's messages go through host memory ------------------------


def test_only_gloo_off_the_cpu_stages_through_host_memory():
    host_staged = step9_module("host_staging").host_staged
    assert host_staged("gloo", torch.device("cuda", 0)) and host_staged("gloo", "cuda")
    assert not host_staged("gloo", torch.device("cpu")) and not host_staged("gloo", "cpu")
    assert not host_staged("nccl", torch.device("cuda", 1))


# ---- an outsider's harness: their model, their loop, our Pipeline --------------------------------


def outsider_worker(rank, world_size, port, queue, where="cpu"):
    """Process group first, our module imported after; a two-stage toy model whose first and last
    layer share a weight; a plain loop; the gradients compared with one process accumulating the
    same micro-batches.
    ``where``: "cpu"; "cpu staged" (every message through the host-memory path, a no-op copy on the
    CPU); "cuda" (both ranks on one GPU, over gloo: staged for real)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=30))
    sys.path.insert(0, str(REPO / STEPS["step9"]))
    import pipeline
    from pipeline import Pipeline

    device = torch.device("cuda", 0) if where == "cuda" else torch.device("cpu")
    if where == "cpu staged":
        pipeline.host_staged = lambda backend, device: True
    assert pipeline.host_staged(dist.get_backend(), device) == (where != "cpu")

    # the same toy model every time: a first layer whose weight the last layer uses again
    def build():
        torch.manual_seed(0)
        return torch.nn.Parameter(torch.randn(16, 8).to(device)), torch.nn.Linear(16, 16).to(device)

    # same everywhere
    data, targets = torch.randn(2, 5, 3, 8, generator=torch.Generator().manual_seed(1)).to(device)
    loss_fn = torch.nn.functional.mse_loss

    def first(x, shared):  # x (3, 8) -> (3, 16)
        return torch.tanh(x @ shared.t())

    def last(h, inner, weight):  # (3, 16) -> (3, 8), through the shared weight again
        return torch.tanh(inner(h)) @ weight

    shared, inner = build()  # one process: 5 micro-batches accumulated, loss / 5
    for i in range(5):
        (loss_fn(last(first(data[i], shared), inner, shared), targets[i]) / 5).backward()
    expected = {"shared": shared.grad, "inner.weight": inner.weight.grad}

    class First(torch.nn.Module):
        def __init__(self, shared):
            super().__init__()
            self.shared = shared

        def forward(self, x):
            return first(x, self.shared)

    class Last(torch.nn.Module):
        def __init__(self, shared, inner):
            super().__init__()
            self.inner, self.copy = inner, torch.nn.Parameter(shared.detach().clone())

        def forward(self, h):
            return last(h, self.inner, self.copy)

    equal = {}
    for schedule in ("gpipe", "1f1b"):
        shared, inner = build()
        module = First(shared) if rank == 0 else Last(shared, inner)
        tied = shared if rank == 0 else module.copy
        pipe = Pipeline(
            module,
            rank,
            2,
            (3, 16),
            loss_fn=loss_fn,
            tied_parameter=tied,
            schedule=schedule,
            device=device,
        )
        pipe.run(
            5,
            inputs=list(data) if rank == 0 else None,
            targets=list(targets) if rank == 1 else None,
            loss_scale=5,
        )
        pipe.finish_gradient_synchronization()
        got = {"shared": tied.grad, **({"inner.weight": inner.weight.grad} if rank == 1 else {})}
        equal.update(
            {f"{schedule} {name}": torch.equal(g, expected[name]) for name, g in got.items()}
        )
    queue.put((rank, equal))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize(
    "where",
    [
        "cpu",
        "cpu staged",
        pytest.param(
            "cuda",
            marks=pytest.mark.skipif(
                not torch.cuda.is_available(), reason="needs a GPU: two ranks share it over gloo"
            ),
        ),
    ],
)
def test_an_outsider_pipeline_equals_one_process_accumulating(where):
    results = spawn(outsider_worker, 2, where)
    assert results == {
        0: {"gpipe shared": True, "1f1b shared": True},
        1: {
            "gpipe shared": True,
            "gpipe inner.weight": True,
            "1f1b shared": True,
            "1f1b inner.weight": True,
        },
    }


# ---- a stage that hangs --------------------------------------------------------------------------


def test_a_hung_stage_ends_the_job_within_the_timeout(tmp_path, small_corpus):
    """Stage 1 computes 20 s longer per micro-batch (slow_rank_hook.py): stage 0 waits for its
    gradient in a receive, gives up after --timeout-s 3 with the one line of every failed
    collective, and torchrun stops the job: long before the 320 s the slow stage would take, and
    never a hang."""
    started = time.monotonic()
    args = [*TINY, "--data", str(small_corpus), "--out", str(tmp_path / "run"), "--timeout-s", "3"]
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(HOOK),
            "1:20",
            str(REPO / STEPS["step9"] / "train.py"),
            *args,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    elapsed = time.monotonic() - started
    errors = [
        line for line in (result.stdout + result.stderr).splitlines() if line.startswith("error:")
    ]
    assert result.returncode == 1 and elapsed < 90, (elapsed, result.stderr[-2000:])
    assert errors == [
        "error: rank 0 waited 3 s in a collective; rank(s) 1 did not answer a roll call within 2 s "
        "either: dead, frozen, or slower than --timeout-s; see docs/fault_tolerance.md"
    ], errors
    lines = (result.stdout + result.stderr).splitlines()
    assert not [
        line
        for line in lines
        if "gloo" in line or (line.startswith("[rank") and "Traceback" in line)
    ], "gloo's error or a worker's traceback reached the output"
