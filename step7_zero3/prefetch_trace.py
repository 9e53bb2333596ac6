"""Make prefetching visible: one micro-batch's forward and backward, unit by unit, with every
all-gather and reduce-scatter, on one timeline.

``PrefetchTrace(fsdp_model)`` watches a ``FullyShardedDP`` from outside, as step 4's
``OverlapTrace`` watches its buckets: hooks of its own on each unit's module time its forward (from
its weights being gathered to its post-hook), and it wraps the wrapper's methods to see each
backward (from the hook that gathers the unit to the one that frees it) and each collective launched
and finished (an all-gather's end is its completion callback; a gloo reduce-scatter has none, so its
end is when the rank waited for it). The record is emptied at every forward, so at the end it holds
the last micro-batch: the synchronised one of the last optimiser step. ``write`` turns it into

- ``trace.json``: Chrome trace format (open it in chrome://tracing or https://ui.perfetto.dev);
- ``timeline.png``: compute on the top row, each collective on a row of its own below.

An all-gather bar that ends before its unit's compute bar begins, while the previous unit was
computing, is a prefetch that hid the transfer behind compute.
"""

import json
import time
from pathlib import Path

import torch.distributed as dist

from zero3_units import SHARDED

COLORS = {
    "forward": "tab:blue",
    "backward": "tab:green",
    "all-gather": "tab:orange",
    "reduce-scatter": "tab:red",
}


class PrefetchTrace:
    def __init__(self, fsdp_model):
        self.fsdp, self.timeline, self.recording, self.open = fsdp_model, [], True, {}
        # prepend: empty the record before FullyShardedDP's
        # own pre-hook launches this forward's gathers
        fsdp_model.module.register_forward_pre_hook(self._on_forward, prepend=True)
        for unit in fsdp_model.units:
            # after FullyShardedDP's pre-hook (gathered), before its post-hook
            if unit is not fsdp_model.root:
                unit.module.register_forward_pre_hook(
                    lambda m, a, unit=unit: self._start("forward", unit)
                )
                unit.module.register_forward_hook(
                    lambda m, a, o, unit=unit: self._end("forward", unit), prepend=True
                )
        # The rest from outside FullyShardedDP's methods, which its hooks look up at each call.
        self._around("_launch_gather", before=self._gather_launching, after=self._gather_launched)
        self._around("_pre_backward", after=lambda unit: self._start("backward", unit))
        # the first thing a backward ends with
        self._around("_free", before=lambda unit: self._end("backward", unit))
        self._around(
            "_reduce_scatter", after=lambda unit: self._start("reduce-scatter", unit, "comm")
        )
        self._around("_finish_reduce_scatter", after=lambda unit: self._end("reduce-scatter", unit))

    def _on_forward(self, module, args) -> None:
        if self.recording:  # keep the last micro-batch's record only
            self.timeline.clear()

    def _around(self, method: str, before=None, after=None) -> None:
        original = getattr(self.fsdp, method)

        def wrapped(unit, *args):
            if before:
                before(unit)
            result = original(unit, *args)
            if after:
                after(unit)
            return result

        setattr(self.fsdp, method, wrapped)

    def _start(self, what: str, unit, category: str = "compute") -> None:
        if self.recording:
            event = {
                "name": f"{what} {unit.name}",
                "cat": category,
                "start": time.perf_counter(),
                "end": None,
            }
            self.timeline.append(event)
            self.open[what, unit.name] = event

    def _end(self, what: str, unit) -> None:
        event = self.open.pop((what, unit.name), None)
        if event is not None:
            event["end"] = time.perf_counter()

    def _gather_launching(self, unit) -> None:
        if unit.state == SHARDED:  # _launch_gather launches exactly then
            self._start("all-gather", unit, "comm")

    def _gather_launched(self, unit) -> None:
        event = self.open.pop(("all-gather", unit.name), None)
        if event is not None:  # its end: the completion callback, on gloo's thread
            unit.handle.get_future().then(lambda _: event.update(end=time.perf_counter()))

    def stop(self) -> None:
        """Record nothing more (an export's gathers are not training)."""
        self.recording = False

    def finish(self, out_dir: Path | None) -> None:
        """``stop``, then (given ``out_dir``:
        one rank gives it) ``write`` this rank's timeline there."""
        self.stop()
        if out_dir is not None:
            self.write(dist.get_rank() if dist.is_initialized() else 0, out_dir)

    def events(self) -> list[dict]:
        return [e for e in self.timeline if e["end"] is not None]

    def write(self, rank: int, out_dir: Path) -> tuple[Path, Path]:
        events = self.events()
        origin = min(e["start"] for e in events)
        rows = ["compute"] + list(dict.fromkeys(e["name"] for e in events if e["cat"] == "comm"))
        row = lambda e: 0 if e["cat"] == "compute" else rows.index(e["name"])  # noqa: E731
        us = lambda t: round((t - origin) * 1e6, 1)  # noqa: E731
        chrome = [
            {
                "name": e["name"],
                "cat": e["cat"],
                "ph": "X",
                "pid": rank,
                "tid": row(e),
                "ts": us(e["start"]),
                "dur": us(e["end"]) - us(e["start"]),
            }
            for e in events
        ]
        trace_path = Path(out_dir) / "trace.json"
        trace_path.parent.mkdir(parents=True, exist_ok=True)
        trace_path.write_text(
            json.dumps({"traceEvents": chrome, "displayTimeUnit": "ms"}, indent=1) + "\n"
        )

        # here, not at the top: a rank that draws nothing does not import it (~0.6 s)
        import matplotlib

        matplotlib.use("Agg")  # files only
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(11, 1.2 + 0.4 * len(rows)), dpi=110)
        for e in events:
            start, end = (e["start"] - origin) * 1e3, (e["end"] - origin) * 1e3
            ax.barh(
                row(e),
                end - start,
                left=start,
                color=COLORS[e["name"].split(" ")[0]],
                edgecolor="white",
            )
            if e["cat"] == "compute":
                label = ".".join(e["name"].split(" ")[1].split(".")[-2:])  # transformer.h.3 -> h.3
                ax.text(
                    (start + end) / 2, 0, label, ha="center", va="center", fontsize=7, color="white"
                )
        ax.set_yticks(range(len(rows)), rows)
        ax.invert_yaxis()
        ax.set_xlabel("time since the forward began (ms)")
        ax.set_title(
            f"rank {rank}: forward (blue) and backward (green) per unit; "
            "all-gathers (orange), reduce-scatters (red)"
        )
        fig.tight_layout()
        png_path = Path(out_dir) / "timeline.png"
        fig.savefig(png_path)
        plt.close(fig)
        return trace_path, png_path
