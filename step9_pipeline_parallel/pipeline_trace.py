"""Make the bubble visible: every stage's forwards, backwards, sends and receives of one optimiser
step, on one timeline, and the fraction of the step each stage sat idle.

``Pipeline.timeline``, set to a list, records ``(what, micro-batch, start, end, chunk)`` for each
forward and backward (the micro-batch's number; the chunk: 0, or the rank's chunk with the
interleaved schedule) and each send and receive (a send's bar is only its launch: the bytes go in
the background; a receive's bar is the wait), and zero bubble's W's ("weights"). ``write_trace``
(every stage calls it: it gathers the stages' timelines) writes, from rank 0, in the run folder:

- ``trace.json``: Chrome trace format, one row per
  stage (chrome://tracing or https://ui.perfetto.dev);
- ``pipeline.png``: one row per stage, forwards blue and backwards green with their micro-batch's
  number (a rank's later chunks paler);
- ``bubble.json``: per stage the idle fraction, 1 - (its forward, backward and W time) / (the step's
  time, first event of any stage to the last), beside the ideal schedule's (pipeline_schedules.py's
  ``ideal_bubble``).

On this 2-core machine 4 stages share 2 cores, so a stage's compute is slower while others compute:
the idle fractions measured at P = 4 mix the bubble with that sharing (the step README says
how much).
Operations code: read it after pipeline.py.
"""

import json
from pathlib import Path

import distributed
from pipeline_schedules import ideal_bubble

COLORS = {
    "forward": "tab:blue",
    "backward": "tab:green",
    "weights": "tab:purple",
    "send": "tab:orange",
    "recv": "tab:red",
}
COMPUTE = ("forward", "backward", "weights")  # weights: zero bubble's W, split from its backward


def idle_fractions(timelines: list[list]) -> list[float]:
    """Per stage: the share of the step (first event of any stage to the last) it spent neither in a
    forward nor in a backward."""
    start = min(e[2] for events in timelines for e in events)
    end = max(e[3] for events in timelines for e in events)
    return [
        1 - sum(e[3] - e[2] for e in events if e[0] in COMPUTE) / (end - start)
        for events in timelines
    ]


def write_trace(
    timeline: list,
    stage: int,
    num_stages: int,
    out_dir: Path,
    chunks: int = 1,
    schedule: str = "1f1b",
) -> None:
    timelines = distributed.gather_from_every_rank(timeline)
    if stage != 0:
        return
    micro_batches = 1 + max(e[1] for e in timelines[0] if e[1] is not None)
    origin = min(e[2] for events in timelines for e in events)
    ms = lambda t: (t - origin) * 1e3  # noqa: E731
    name = lambda what, i, v: (
        what if i is None else f"{what} {i}" + (f" chunk {v}" if chunks > 1 else "")
    )  # noqa
    chrome = [
        {
            "name": name(what, i, v),
            "cat": what,
            "ph": "X",
            "pid": 0,
            "tid": s,
            "ts": round(ms(start) * 1e3, 1),
            "dur": round((end - start) * 1e6, 1),
        }
        for s, events in enumerate(timelines)
        for what, i, start, end, v in events
    ]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "trace.json").write_text(
        json.dumps({"traceEvents": chrome, "displayTimeUnit": "ms"}) + "\n"
    )
    idle = idle_fractions(timelines)
    ideal = ideal_bubble(schedule, num_stages, micro_batches, chunks)
    (out_dir / "bubble.json").write_text(
        json.dumps(
            {
                "stages": num_stages,
                "micro_batches": micro_batches,
                "chunks": chunks,
                "schedule": schedule,
                "idle": idle,
                "ideal": ideal,
            },
            indent=1,
        )
        + "\n"
    )

    import matplotlib  # here, not at the top: a rank that draws nothing does not import it (~0.6 s)

    matplotlib.use("Agg")  # files only
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 1.0 + 0.55 * num_stages), dpi=110)
    for s, events in enumerate(timelines):
        for what, i, start, end, v in events:
            compute = what in COMPUTE
            height = 0.8 if compute else 0.25
            offset = 0 if compute else (0.3 if what == "send" else -0.3)
            ax.barh(
                s + offset,
                ms(end) - ms(start),
                left=ms(start),
                height=height,
                color=COLORS[what],
                edgecolor="white" if compute else None,
                alpha=1 - 0.5 * v / max(1, chunks - 1),
            )
            if compute:
                ax.text(
                    (ms(start) + ms(end)) / 2,
                    s,
                    str(i),
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white",
                )
    ax.set_yticks(range(num_stages), [f"stage {s}\nidle {f:.0%}" for s, f in enumerate(idle)])
    ax.invert_yaxis()
    ax.set_xlabel("time since the step's first event (ms)")
    layout = f"{num_stages} stages" + (f" x {chunks} chunks" if chunks > 1 else "")
    ax.set_title(
        f"{layout}, {micro_batches} micro-batches: forward (blue), backward (green), W (purple) "
        f"by micro-batch; receive waits (red), sends (orange); ideal bubble {ideal:.0%}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(out_dir / "pipeline.png")
    plt.close(fig)
