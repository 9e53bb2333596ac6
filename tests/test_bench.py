"""compare/bench.py end to end on a tiny model: every row that can run is in the table, and the
memory it reports per rank is what each strategy is meant to hold. One timed round of one step:
this checks the harness, not the speed."""
import json
import os
import re
import socket
import subprocess
import sys

import pytest

from conftest import REPO

TINY = ["--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--seq-len", "16", "--micro-batch-size", "2",
        "--rounds", "1", "--steps-per-round", "1", "--timeout-s", "60"]
ALWAYS = ["pytorch DDP", "BucketedDDP (step 4)", "naive (step 3)", "pytorch ZeRO-1"]
OURS_ZERO = {"ZeRO-1 (step 5)": ("step5_zero1/zero1.py", "class ShardedOptimizer"),
             "ZeRO-2 (step 6)": ("step6_zero2/zero2.py", "class ShardedGradientDDP")}


def bench(*args, nproc: int = 2, **kwargs) -> subprocess.CompletedProcess:
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc else []
    with socket.socket() as s:  # a world of one started without torchrun picks MASTER_PORT itself
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    return subprocess.run([sys.executable, *launcher, str(REPO / "compare" / "bench.py"), *map(str, args)],
                          cwd=REPO, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "MASTER_PORT": port}, **kwargs)


@pytest.fixture(scope="module")
def every_row(tmp_path_factory):
    png = tmp_path_factory.mktemp("bench") / "bench.png"
    result = bench(*TINY, "--png", png)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout, json.loads(png.with_suffix(".json").read_text()), png


def table_rows(stdout: str) -> list[str]:
    """The names in the step-time table (its lines end with the vs-DDP ratio)."""
    section = stdout.split("Step time")[1].split("\n\n")[0]
    return [m.group(1).strip() for m in re.finditer(r"^(.+?)\s+\d+\.\dms", section, re.M)]


def test_every_available_row_is_in_the_table(every_row):
    stdout, numbers, png = every_row
    rows = table_rows(stdout)
    assert rows == list(numbers["rows"])
    assert set(ALWAYS) <= set(rows)
    fsdp2 = "pytorch FSDP2 ZeRO-2"
    assert fsdp2 in rows or f"note: {fsdp2}: left out:" in stdout
    for name, (path, definition) in OURS_ZERO.items():
        file = REPO / path
        if file.is_file() and definition in file.read_text():
            assert name in rows, f"{path} defines it, but the row is missing:\n{stdout}"
        else:
            assert name not in rows and f"note: {name}: left out:" in stdout
    for header in ("median step", "tokens/s", "vs counterpart", "vs pytorch DDP", "params", "grads",
                   "optimizer_state", "all_reduce", "analytic", "counted"):
        assert header in stdout
    assert png.read_bytes().startswith(b"\x89PNG")


def test_memory_per_rank_matches_each_strategy(every_row):
    _, numbers, _ = every_row
    rows, whole = numbers["rows"], numbers["model_bytes"]
    mem = {name: row["memory"] for name, row in rows.items()}
    adam = mem["pytorch DDP"]["optimizer_state"][0]
    assert 2 * whole <= adam <= 2.01 * whole  # two moments, plus one step counter per tensor
    for name in ("pytorch DDP", "BucketedDDP (step 4)", "naive (step 3)"):  # replicated: everything, every rank
        assert mem[name] == {"params": [whole] * 2, "grads": [whole] * 2, "optimizer_state": [adam] * 2}
        assert rows[name]["comm"] == [{"all_reduce": whole}] * 2

    # PyTorch's ZeRO-1 assigns whole tensors to ranks: the state is split exactly, but not evenly
    # (the tied embedding alone is 83% of this tiny model).
    zero = mem["pytorch ZeRO-1"]
    assert zero["params"] == zero["grads"] == [whole] * 2
    assert sum(zero["optimizer_state"]) == adam and max(zero["optimizer_state"]) < adam

    def about_half(values, of):
        return all(0.45 * of <= v <= 0.55 * of for v in values)

    if "pytorch FSDP2 ZeRO-2" in mem:  # every tensor sharded at rest (dim 0 padded to the world size)
        fsdp = mem["pytorch FSDP2 ZeRO-2"]
        assert about_half(fsdp["params"], whole) and about_half(fsdp["grads"], whole)
        assert about_half(fsdp["optimizer_state"], adam)
    if "ZeRO-1 (step 5)" in mem:  # AdamW's state split by elements; gradients still whole
        ours = mem["ZeRO-1 (step 5)"]
        assert ours["params"] == ours["grads"] == [whole] * 2
        assert about_half(ours["optimizer_state"], adam)
        assert rows["ZeRO-1 (step 5)"]["comm"][0]["all_reduce"] == whole  # step 4's buckets
    if "ZeRO-2 (step 6)" in mem:  # gradients split too
        ours = mem["ZeRO-2 (step 6)"]
        assert ours["params"] == [whole] * 2
        assert about_half(ours["grads"], whole) and about_half(ours["optimizer_state"], adam)


def test_one_row_brings_its_references_and_runs_as_a_world_of_one(tmp_path):
    result = bench(*TINY, "--strategies", "bucketed", "--png", tmp_path / "b.png", nproc=0)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert table_rows(result.stdout) == ["pytorch DDP", "BucketedDDP (step 4)"]
    assert "note: pytorch DDP: added as the reference of BucketedDDP (step 4)" in result.stdout

