"""Every idea file dropped into someone else's script: tests/drop_in_harness.py, run as its own program.

Each case spawns two workers with ``torch.multiprocessing.spawn`` that create the process group first,
import the idea file afterwards, run a plain loop beside the PyTorch counterpart, compare every parameter
with ``torch.equal`` after every optimiser step, and leave with ``dist.destroy_process_group()``. A worker
that aborts at interpreter exit (the "terminate called without an active exception" an idea file once
caused by importing ``distributed.py``) makes the program fail, so every run is also an abort check.
"""
import json
import subprocess
import sys

import pytest

from conftest import REPO

CASES = {
    "naive_dp": "broadcast_parameters + allreduce_gradients vs DistributedDataParallel",
    "bucketed_ddp": "BucketedDDP vs DistributedDataParallel",
    "zero1": "ShardedOptimizer vs ZeroRedundancyOptimizer and the plain optimiser (AdamW, SGD), GradScaler, clipping",
    "zero2": "ShardedGradientDDP + ShardedOptimizer vs DistributedDataParallel + AdamW",
    "zero3": "FullyShardedDP vs FSDP2 fully_shard (float32, and bf16 MixedPrecisionPolicy), and vs DDP with a unit called twice",
}


@pytest.mark.parametrize("case", list(CASES))
def test_idea_file_in_an_outside_harness_equals_its_pytorch_counterpart(case, tmp_path):
    out = tmp_path / "result.json"
    result = subprocess.run([sys.executable, str(REPO / "tests" / "drop_in_harness.py"), case, str(out)],
                            cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{CASES[case]}: the harness failed\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    assert "terminate called" not in result.stderr
    report = json.loads(out.read_text())
    assert report["problems"] == [], f"{CASES[case]}: {report['problems'][:10]}"
    assert report["checked"] >= 30, "too few tensors compared for the comparison to prove anything"
