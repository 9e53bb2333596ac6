"""Make prefetching visible: one micro-batch's forward and backward, unit by unit, with every all-gather
and reduce-scatter, on one timeline.

``PrefetchTrace(fsdp_model)`` asks ``FullyShardedDP`` to record its ``timeline``: when each unit's
forward and backward computed (from its weights being gathered to its closing hook), and when each
collective was launched and finished (an all-gather's end is its completion callback; a gloo
reduce-scatter has none, so its end is when the rank waited for it). A forward pre-hook of the
tracer's own empties the record at every forward, so at the end it holds the last micro-batch: the
synchronised one of the last optimiser step. ``write`` turns it into

- ``trace.json``: Chrome trace format (open it in chrome://tracing or https://ui.perfetto.dev);
- ``timeline.png``: compute on the top row, each collective on a row of its own below.

An all-gather bar that ends before its unit's compute bar begins, while the previous unit was
computing, is a prefetch that hid the transfer behind compute.
"""
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"forward": "tab:blue", "backward": "tab:green", "all-gather": "tab:orange", "reduce-scatter": "tab:red"}


class PrefetchTrace:
    def __init__(self, fsdp_model):
        self.fsdp = fsdp_model
        fsdp_model.timeline = []
        # prepend: empty the record before FullyShardedDP's own pre-hook launches this forward's gathers
        fsdp_model.module.register_forward_pre_hook(self._on_forward, prepend=True)

    def _on_forward(self, module, args):
        self.fsdp.timeline.clear()

    def stop(self) -> None:
        """Keep what was recorded so far, and record nothing more (an export's gathers are not training)."""
        self.kept, self.fsdp.timeline = self.events(), None

    def events(self) -> list[dict]:
        if self.fsdp.timeline is None:
            return self.kept
        return [e for e in self.fsdp.timeline if e["end"] is not None]

    def write(self, rank: int, out_dir: Path) -> tuple[Path, Path]:
        events = self.events()
        origin = min(e["start"] for e in events)
        rows = ["compute"] + list(dict.fromkeys(e["name"] for e in events if e["cat"] == "comm"))
        row = lambda e: 0 if e["cat"] == "compute" else rows.index(e["name"])  # noqa: E731
        us = lambda t: round((t - origin) * 1e6, 1)  # noqa: E731
        chrome = [{"name": e["name"], "cat": e["cat"], "ph": "X", "pid": rank, "tid": row(e),
                   "ts": us(e["start"]), "dur": us(e["end"]) - us(e["start"])} for e in events]
        trace_path = Path(out_dir) / "trace.json"
        trace_path.write_text(json.dumps({"traceEvents": chrome, "displayTimeUnit": "ms"}, indent=1) + "\n")

        fig, ax = plt.subplots(figsize=(11, 1.2 + 0.4 * len(rows)), dpi=110)
        for e in events:
            start, end = (e["start"] - origin) * 1e3, (e["end"] - origin) * 1e3
            ax.barh(row(e), end - start, left=start, color=COLORS[e["name"].split(" ")[0]], edgecolor="white")
            if e["cat"] == "compute":
                label = ".".join(e["name"].split(" ")[1].split(".")[-2:])  # transformer.h.3 -> h.3
                ax.text((start + end) / 2, 0, label, ha="center", va="center", fontsize=7, color="white")
        ax.set_yticks(range(len(rows)), rows)
        ax.invert_yaxis()
        ax.set_xlabel("time since the forward began (ms)")
        ax.set_title(f"rank {rank}: forward (blue) and backward (green) per unit; "
                     "all-gathers (orange), reduce-scatters (red)")
        fig.tight_layout()
        png_path = Path(out_dir) / "timeline.png"
        fig.savefig(png_path)
        plt.close(fig)
        return trace_path, png_path
