"""Make the overlap visible:
the last optimiser step's backward and bucket all-reduces on a timeline.

``OverlapTrace(ddp_model)`` watches a ``BucketedDDP`` from outside: it asks every bucket to record
when its all-reduce was launched and when it finished, and times backward with hooks of its own
(start: the logits' gradient is computed; end: the last parameter's gradient is accumulated). It
keeps the last backward only: the synchronised one of the last optimiser step. ``write`` turns
that into

- ``trace.json``: Chrome trace format (open it in chrome://tracing or https://ui.perfetto.dev);
- ``timeline.png``: backward on one row, each bucket's all-reduce (launch to completion) below it.

If the first bucket's bar starts before backward's bar ends, communication overlapped computation.
"""

import json
import time
import weakref
from pathlib import Path


class OverlapTrace:
    def __init__(self, ddp_model):
        self.buckets = ddp_model.buckets
        for bucket in self.buckets:
            bucket.timeline = []
        self.backward = {}
        ddp_model.module.register_forward_hook(self._on_forward)
        # weakly, as bucketed_ddp.py's hooks: else the buckets (and this) live for good
        me = weakref.ref(self)
        for p in ddp_model.module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(
                    lambda param: me() and me()._on_gradient_ready(param)
                )

    def _on_forward(self, module, inputs, output):
        if output.requires_grad:  # the logits: the first tensor backward reaches
            output.register_hook(self._on_backward_start)

    def _on_backward_start(self, grad):
        self.backward = {"start": time.perf_counter(), "end": None}
        for bucket in self.buckets:  # keep only what the latest backward launched
            bucket.timeline.clear()

    def _on_gradient_ready(self, param):
        self.backward["end"] = time.perf_counter()

    def events(self) -> list[dict]:
        events = [{"name": "backward", "cat": "compute", **self.backward}]
        for bucket in self.buckets:
            size = bucket.buffer.numel() * bucket.buffer.element_size()
            events += [
                {
                    "name": f"all-reduce bucket {bucket.index} ({size:,} B)",
                    "cat": "comm",
                    "start": e["launched"],
                    "end": e["finished"],
                }
                for e in bucket.timeline
            ]
        return events

    def write(self, rank: int, out_dir: Path) -> tuple[Path, Path]:
        return write_trace(self.events(), rank, out_dir)


def write_trace(events: list[dict], rank: int, out_dir: Path) -> tuple[Path, Path]:
    origin = min(e["start"] for e in events)
    microseconds = lambda t: round((t - origin) * 1e6, 1)  # noqa: E731
    chrome = [
        {
            "name": e["name"],
            "cat": e["cat"],
            "ph": "X",
            "pid": rank,
            "tid": 0 if e["cat"] == "compute" else 1,
            "ts": microseconds(e["start"]),
            "dur": microseconds(e["end"]) - microseconds(e["start"]),
        }
        for e in events
    ]
    trace_path = Path(out_dir) / "trace.json"
    trace_path.write_text(
        json.dumps({"traceEvents": chrome, "displayTimeUnit": "ms"}, indent=1) + "\n"
    )

    rows = sorted(events, key=lambda e: (e["cat"] != "compute", e["start"]))
    import matplotlib  # here, not at the top: a rank that draws nothing does not import it (~0.6 s)

    matplotlib.use("Agg")  # files only
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.45 * len(rows)), dpi=110)
    for y, e in enumerate(rows):
        start, end = (e["start"] - origin) * 1e3, (e["end"] - origin) * 1e3
        ax.barh(
            y, end - start, left=start, color="tab:blue" if e["cat"] == "compute" else "tab:orange"
        )
    backward = next(e for e in rows if e["name"] == "backward")
    ax.axvline(
        (backward["end"] - origin) * 1e3,
        color="gray",
        linestyle="--",
        linewidth=1,
        label="backward ends",
    )
    ax.set_yticks(range(len(rows)), [e["name"] for e in rows])
    ax.invert_yaxis()
    ax.set_xlabel("time since backward started (ms)")
    ax.set_title(f"rank {rank}: bucket all-reduces (orange) overlap backward (blue)")
    ax.legend(loc="upper right")
    fig.tight_layout()
    png_path = Path(out_dir) / "timeline.png"
    fig.savefig(png_path)
    plt.close(fig)
    return trace_path, png_path
