"""The checkpoint interface (common/checkpoint.py,
rule 3) of the sharding wrappers, against one plain process.

Each wrapper says what this rank saves (``checkpoint_state``) and loads its part back
(``load_checkpoint``). The independent answer is a plain model and a plain AdamW in the same
process, given the same gradients: what every rank saved, joined by ``Checkpoint``, must be that
model's parameters and AdamW's state, bit for bit; and a checkpoint written at one world size,
loaded at another, must step on to the plain model's next bits.
"""

import io
import sys
import zlib

import pytest
import torch

from conftest import REPO, init_gloo, shutdown, spawn

LR = dict(lr=0.1, betas=(0.9, 0.99), weight_decay=0.01)


def toy() -> torch.nn.Sequential:
    """Sizes no world size divides evenly
    (15 + 3 + 12 + 4 elements), the same values on every rank."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Tanh(), torch.nn.Linear(3, 4))


def gradient(name: str, param: torch.Tensor, step: int) -> torch.Tensor:
    """The averaged gradient every rank holds at ``step``:
    a pure function of the name, so ranks agree."""
    generator = torch.Generator().manual_seed(zlib.crc32(f"{name} {step}".encode()))
    return torch.randn(param.shape, generator=generator)


def reference(steps: int) -> tuple[torch.nn.Module, torch.optim.AdamW]:
    """The plain model and AdamW after ``steps`` steps on ``gradient``:
    the answer a sharded run must give."""
    model = toy()
    optimizer = torch.optim.AdamW(model.parameters(), **LR)
    for step in range(steps):
        for name, param in model.named_parameters():
            param.grad = gradient(name, param, step)
        optimizer.step()
    return model, optimizer


def save(folder, rank: int, world_size: int, named_shapes: dict, holder, *args) -> None:
    """Write checkpoint step_1 in ``folder`` with the trainers' writer:
    ``holder.checkpoint_state(*args)`` the rank's part (``resharding.PerRank``)."""
    from checkpoint import CheckpointWriter
    from resharding import PerRank

    config = {"out": str(folder), "async_save": False, "quiet": True}
    CheckpointWriter(config, rank, world_size, named_shapes, [PerRank(holder, *args)]).save(1)


def as_bytes(tensors: dict) -> bytes:
    """Tensors through the result queue as bytes:
    a tensor itself would be shared memory, gone with the worker."""
    buffer = io.BytesIO()
    torch.save({name: t.detach().clone() for name, t in tensors.items()}, buffer)
    return buffer.getvalue()


def from_bytes(data: bytes) -> dict:
    return torch.load(io.BytesIO(data), weights_only=True)


def sharded_optimizer_worker(rank, world_size, port, queue, folder, steps_before):
    """ZeRO-1 with float32 masters (param_dtype=bf16): save after ``steps_before`` steps (``folder``
    empty), or load the checkpoint in ``folder`` (the optimiser alone: it rounds and all-gathers the
    16-bit parameters itself) and take one more step."""
    init_gloo(rank, world_size, port)
    sys.path.insert(0, str(REPO / "step5_zero1"))
    from masters import ShardedOptimizerWithMasters
    from resharding import Checkpoint

    model = toy()
    named = list(model.named_parameters())
    path = folder / "checkpoints" / "step_1"
    loading = path.is_dir()
    if loading:  # other values: the masters must come from the checkpoint, not from the parameters
        with torch.no_grad():
            for _, param in named:
                param.fill_(0.5)
    optimizer = ShardedOptimizerWithMasters(
        model.parameters(), torch.optim.AdamW, torch.bfloat16, **LR
    )
    loaded = {}
    if loading:
        optimizer.load_checkpoint(Checkpoint(path), named)
        # the 16-bit copies the next forward would use
        loaded = {"loaded_parameters": as_bytes(dict(named))}
    for step in range(steps_before, steps_before + 1) if loading else range(steps_before):
        for name, param in named:
            param.main_grad = gradient(name, param, step)  # float32, as the gradient sync leaves it
        optimizer.step()
    if not loading:
        save(folder, rank, world_size, {n: p.shape for n, p in named}, optimizer, named)
    weights = optimizer.master_weights(named)  # collective
    queue.put(
        (rank, {"weights": as_bytes(weights), "dtypes": {str(p.dtype) for _, p in named}, **loaded})
    )
    shutdown()


def fsdp_worker(rank, world_size, port, queue, folder, steps_before):
    """ZeRO-3 (its pieces and the plain AdamW that steps them), as ``sharded_optimizer_worker``."""
    init_gloo(rank, world_size, port)
    sys.path.insert(0, str(REPO / "step7_zero3"))
    from resharding import Checkpoint
    from zero3 import FullyShardedDP

    model = toy()
    shapes = {n: p.shape for n, p in model.named_parameters()}
    path = folder / "checkpoints" / "step_1"
    loading = path.is_dir()
    if loading:  # other values: the pieces must come from the checkpoint
        with torch.no_grad():
            for param in model.parameters():
                param.fill_(0.5)
    fsdp = FullyShardedDP(model, [model[0]])
    optimizer = torch.optim.AdamW(fsdp.parameters(), **LR)
    if loading:
        fsdp.load_checkpoint(Checkpoint(path), optimizer)
    ranges = fsdp.piece_ranges()
    for step in range(steps_before, steps_before + 1) if loading else range(steps_before):
        for name, piece in fsdp.named_parameters():  # this rank's slice of the averaged gradient
            piece.grad = (
                gradient(name, torch.empty(shapes[name]), step)
                .view(-1)[slice(*ranges[name])]
                .clone()
            )
        optimizer.step()
    if not loading:
        save(folder, rank, world_size, shapes, fsdp, optimizer)
    weights = {name: t.clone() for name, t in fsdp.gathered_parameters()}  # collective
    queue.put((rank, {"weights": as_bytes(weights)}))
    shutdown()


@pytest.mark.parametrize(
    "worker", [sharded_optimizer_worker, fsdp_worker], ids=["ShardedOptimizer", "FullyShardedDP"]
)
def test_saved_pieces_join_into_the_plain_model_and_load_at_another_world_size(worker, tmp_path):
    from resharding import Checkpoint

    steps = 2
    saved = spawn(worker, 2, tmp_path, steps)
    plain, plain_optimizer = reference(steps)
    checkpoint = Checkpoint(tmp_path / "checkpoints" / "step_1")
    named = list(plain.named_parameters())
    for name, param in named:  # every rank's slices, joined: the plain model's parameters
        assert torch.equal(checkpoint.parameter(name), param), name
    slices = [(name, 0, param.numel()) for name, param in named]
    # and AdamW's whole state
    joined = checkpoint.optimizer_state_dict(slices, [p for _, p in named])
    for i, (name, _) in enumerate(named):
        want = plain_optimizer.state_dict()["state"][i]
        assert set(joined["state"][i]) == set(want), name
        assert all(torch.equal(joined["state"][i][key], want[key]) for key in want), name
    assert joined["param_groups"][0]["lr"] == LR["lr"]
    for rank, result in saved.items():
        weights = from_bytes(result["weights"])
        assert all(torch.equal(weights[n], p) for n, p in named), (
            f"rank {rank}: weights before saving"
        )

    # Loaded at world size 3 (other slices), one more step: the plain model's next bits.
    resumed = spawn(worker, 3, tmp_path, steps)
    plain, _ = reference(steps + 1)
    for rank, result in resumed.items():
        weights = from_bytes(result["weights"])
        different = [n for n, p in plain.named_parameters() if not torch.equal(weights[n], p)]
        assert not different, f"rank {rank}: {different}"
    if worker is sharded_optimizer_worker:
        # the model computes in 16 bits; the masters are float32
        assert resumed[0]["dtypes"] == {"torch.bfloat16"}
        # what was saved, rounded once: every rank's 16-bit parameters
        saved_plain, _ = reference(steps)
        for rank, result in resumed.items():
            loaded = from_bytes(result["loaded_parameters"])
            assert all(
                torch.equal(loaded[n], p.to(torch.bfloat16))
                for n, p in saved_plain.named_parameters()
            ), rank


FIXTURE = REPO / "tests" / "fixtures" / "format2_step5_two_ranks"


def test_a_checkpoint_written_before_the_reader_was_split_out_reads_back_its_own_tensors():
    """tests/fixtures/format2_step5_two_ranks: step 5's checkpoint at step 2 of a 4-step run at 2
    ranks (ZeRO-1 slices of AdamW's state in each rank's file, the whole model in state.pt, dropout
    on), written by the code before checkpoint.py was split into checkpoint.py, resharding.py and
    background_writer.py. The reader of format 2 (compare/format2.py, what consolidate.py converts
    with) gives back exactly the tensors the files hold: every parameter, and every rank's slice of
    exp_avg and exp_avg_sq, bit for bit. (Nothing here depends on the CPU: the bits are read,
    not computed.)"""
    from format2 import Checkpoint

    checkpoint = Checkpoint(FIXTURE / "step_2")
    raw = torch.load(FIXTURE / "step_2" / "state.pt", weights_only=True)
    # the output layer is tied to wte
    assert set(checkpoint.shapes) == set(raw["model"]) - {"lm_head.weight"}
    assert [
        n for n in checkpoint.shapes if not torch.equal(checkpoint.parameter(n), raw["model"][n])
    ] == []
    for rank in range(2):
        held = torch.load(FIXTURE / "step_2" / f"rank{rank}.pt", weights_only=True)
        slices = [tuple(piece) for piece in held["optimizer_slices"]]
        params = [torch.empty(end - start) for _, start, end in slices]
        state = checkpoint.optimizer_state_dict(slices, params)["state"]
        for i, saved in held["optimizer"]["state"].items():
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(state[i][key].view(-1), saved[key].view(-1)), (
                    rank,
                    slices[i],
                    key,
                )
    assert raw["records"][:2] == checkpoint.shared["records"][:2]


@pytest.mark.parametrize("step", ["step5", "step1"])
def test_a_checkpoint_written_before_the_reader_was_split_out_resumes_as_todays_does(
    step, small_corpus, tmp_path
):
    """The same fixture, converted to today's format (DCP) by consolidate.py as the trainers'
    one-line refusal of format 2 says, resumed today in step 5 and in step 1 (DDP: the slices joined
    into whole tensors) ends on the bits of the same state written anew, on this machine: (a) the
    fixture consolidated again (every tensor one chunk), (b) the step-3 checkpoint today's trainer
    writes when it resumes the fixture. The final bits themselves depend on the CPU's kernels (the
    fixture was written on another machine), so they are compared between runs made here, never with
    numbers recorded there. The records the fixture holds come back unchanged, and every step is
    logged once."""
    import json
    import shutil

    from conftest import assert_bitwise_same_run, launch, metrics
    from consolidate import consolidate

    expected = json.loads((FIXTURE / "expected.json").read_text())
    tokenizer = str(REPO / "data" / "tokenizer.json")

    def resume(out, checkpoint, *extra):
        # a copy in the run's own folder, its machine-specific paths ours
        if checkpoint.parent.parent != out:
            shutil.copytree(checkpoint, out / "checkpoints" / checkpoint.name)
        meta_path = out / "checkpoints" / checkpoint.name / "meta.json"
        meta = json.loads(meta_path.read_text())
        meta["config"].update(data=str(small_corpus), tokenizer=tokenizer)
        meta_path.write_text(json.dumps(meta, indent=1) + "\n")
        args = [
            "--steps",
            "4",
            "--micro-batch-size",
            "2",
            "--grad-accum",
            "2",
            "--seq-len",
            "32",
            "--n-layer",
            "1",
            "--n-embd",
            "8",
            "--n-head",
            "2",
            "--grad-clip",
            "0.3",
            "--warmup-steps",
            "2",
            "--dropout",
            "0.1",
            "--quiet",
            "--data",
            str(small_corpus),
            "--tokenizer",
            tokenizer,
            "--out",
            str(out),
            "--resume",
            str(out / "checkpoints" / checkpoint.name),
            *extra,
        ]
        result = launch(step, args, nproc=2)
        assert result.returncode == 0, result.stderr[-3000:]
        return out

    converted = consolidate(FIXTURE / "step_2", tmp_path / "converted")
    old = resume(tmp_path / "old", converted, "--save-every", "1")
    consolidated = consolidate(converted, tmp_path / "consolidated")
    assert_bitwise_same_run(
        old, resume(tmp_path / "consolidated", consolidated, "--save-every", "0")
    )
    written = tmp_path / "written"
    shutil.copytree(old / "checkpoints" / "step_3", written / "checkpoints" / "step_3")
    assert_bitwise_same_run(
        old, resume(written, written / "checkpoints" / "step_3", "--save-every", "0")
    )
    records = metrics(old)["records"]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    keep = expected["records"][0].keys()
    assert [{k: r[k] for k in keep} for r in records[:2]] == expected["records"]
