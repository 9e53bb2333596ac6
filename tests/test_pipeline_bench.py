"""compare/bench.py's step-9 rows on a tiny model: ours and torch.distributed.pipelining's hold the
same bytes per stage and send the same activations and gradients (counted for ours, the formula for
theirs); only the tied embedding's traffic differs, by the price of adding its halves in one
process's order. One timed round of one step: this checks the harness, not the speed."""

import json

from test_bench import bench

TINY = [
    "--n-layer",
    "2",
    "--n-embd",
    "32",
    "--n-head",
    "2",
    "--seq-len",
    "16",
    "--micro-batch-size",
    "2",
    "--rounds",
    "1",
    "--steps-per-round",
    "1",
    "--timeout-s",
    "60",
]
# TINY's, the tokenizer's, bench.py's default accumulation
B, S, H, VOCAB, ACCUM, RANKS = 2, 16, 32, 2048, 2, 2


def test_pipeline_rows_hold_and_send_what_pytorchs_pipelining_does(tmp_path):
    png = tmp_path / "bench.png"
    result = bench(*TINY, "--strategies", "pp-gpipe,pp-1f1b", "--png", png)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = json.loads(png.with_suffix(".json").read_text())["rows"]
    assert list(rows) == [
        "pytorch DDP",
        "pytorch pipelining GPipe",
        "pipeline GPipe (step 9)",
        "pytorch pipelining 1F1B",
        "pipeline 1F1B (step 9)",
    ]
    micro_batches = ACCUM * RANKS  # the data-parallel rows' tokens per step, through one pipeline
    activation = micro_batches * B * S * H * 4
    tie = VOCAB * H * 4
    for schedule in ("GPipe", "1F1B"):
        ours, theirs = rows[f"pipeline {schedule} (step 9)"], rows[f"pytorch pipelining {schedule}"]
        assert ours["counterpart"] == f"pytorch pipelining {schedule}" and "vs_counterpart" in ours
        assert ours["memory"] == theirs["memory"]  # the same stages, the same AdamW
        for counted, formula in zip(ours["comm"], theirs["comm"]):
            for kind in ("p2p activations", "p2p activation gradients"):
                assert counted.get(kind, 0) == formula[kind]
        assert [c["p2p activations"] for c in theirs["comm"]] == [activation, 0]
        assert [c["p2p activation gradients"] for c in theirs["comm"]] == [0, activation]
        # Ours: the last stage sends each micro-batch's half, the first sends the sum back once;
        # theirs: one accumulated half each way.
        assert [c["p2p tied-parameter gradient"] for c in ours["comm"]] == [
            tie,
            micro_batches * tie,
        ]
        assert [c["p2p tied-parameter gradient"] for c in theirs["comm"]] == [tie, tie]
