"""Every idea file dropped into someone else's script:
tests/drop_in_harness.py, run as its own program.

Two workers spawned with ``torch.multiprocessing.spawn`` create the process group first, import the
idea files afterwards, run each case's plain loop beside the PyTorch counterpart, compare every
parameter with ``torch.equal`` after every optimiser step, and leave with
``dist.destroy_process_group()``. A worker that aborts at interpreter exit (the "terminate called
without an active exception" an idea file once caused by importing ``distributed.py``) makes the
program fail, so the run is also an abort check. The cases share that one spawn (the harness imports
every idea file before any loop runs). A module one case's import pulls in is already there for the
next case's, so each step folder's idea files are also imported alone, in a fresh interpreter of
their own (``test_importing_an_idea_file_alone_leaves_the_default_group_alone``).
"""

import json
import subprocess
import sys

import pytest

from conftest import REPO
from drop_in_harness import FOLDER, IDEA_MODULES

CASES = {
    "naive_dp": "broadcast_parameters + allreduce_gradients vs DistributedDataParallel",
    "bucketed_ddp": "BucketedDDP vs DistributedDataParallel",
    "zero1": "ShardedOptimizer vs ZeroRedundancyOptimizer and the plain optimiser (AdamW, SGD), "
    "GradScaler, clipping",
    "zero2": "ShardedGradientDDP + ShardedOptimizer vs DistributedDataParallel + AdamW",
    "zero3": "FullyShardedDP vs FSDP2 fully_shard (float32, and bf16 MixedPrecisionPolicy), and "
    "vs DDP with a unit called twice",
    "zero1_bf16": "ShardedOptimizerWithMasters(bf16) with the outsider's own float32 gradient sync "
    "vs FSDP2 bf16",
    "zero2_bf16": "ShardedGradientDDP + ShardedOptimizerWithMasters(bf16) vs FSDP2 "
    "MixedPrecisionPolicy(bf16, float32)",
    "zero1_fp16": "ShardedOptimizerWithMasters(fp16) + ShardedGradScaler + clip_grad_norm, an "
    "overflowing step "
    "skipped, vs a float32 master copy with torch.amp.GradScaler",
    "offload": "FullyShardedDP + OffloadedOptimizer (AdamW on the host) vs FSDP2 with "
    "CPUOffloadPolicy",
}


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    """The harness run once for every case (one spawn:
    starting the processes is most of a case's time)."""
    folder = tmp_path_factory.mktemp("drop_in")
    out = folder / "result.json"
    result = subprocess.run(
        [sys.executable, str(REPO / "tests" / "drop_in_harness.py"), *CASES, str(out)],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return result, json.loads(out.read_text()) if out.is_file() else None


@pytest.mark.parametrize("case", list(CASES))
def test_idea_file_in_an_outside_harness_equals_its_pytorch_counterpart(case, harness):
    result, report = harness
    assert result.returncode == 0, (
        f"the harness failed\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    )
    assert "terminate called" not in result.stderr
    report = report["cases"][case]
    assert report["problems"] == [], f"{CASES[case]}: {report['problems'][:10]}"
    assert report["checked"] >= 30, "too few tensors compared for the comparison to prove anything"


@pytest.mark.parametrize(
    "folder", sorted({FOLDER[case] for case in CASES}, key=lambda f: int(f[4:].split("_")[0]))
)
def test_importing_an_idea_file_alone_leaves_the_default_group_alone(folder):
    """In the shared harness zero3 once passed only because zero1's import had pulled in
    torch.distributed.nn (through DCP) first: each folder's idea files, imported by an interpreter
    that has imported nothing else."""
    modules = sorted({m for case in CASES if FOLDER[case] == folder for m in IDEA_MODULES[case]})
    probe = (
        "import sys, torch.distributed\n"
        f"sys.path.insert(0, {str(REPO / folder)!r})\n"
        "before = set(sys.modules)\n"
        f"for name in {modules!r}: __import__(name)\n"
        "print(sorted({'distributed', 'torch.distributed.nn', 'torch.distributed.nn.functional'}"
        " & (set(sys.modules) - before)))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]", (
        f"importing {modules} from {folder} imported {result.stdout}"
    )
