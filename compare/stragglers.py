"""Is one rank consistently slower than the others? Per-rank step times of a run, and a verdict.

    python compare/stragglers.py step1                   # short step names: runs/<step folder>
    python compare/stragglers.py runs/x --ratio 1.2      # or run folders; a stricter threshold

In synchronous data parallelism every rank's wall time per step is the same (a fast rank waits for
the slowest inside the collectives), so the wall time cannot say which rank is slow. Each record
holds, per rank, ``wall_s`` and ``cpu_s``: the CPU time of the rank's training thread, which counts
its own work and not its waiting (common/metrics.py, ``StepClock``; docs/fault_tolerance.md,
"Stragglers", for the measurements and the limits).

The rule: a rank is a straggler when it is the slowest (most CPU time) in at least ``--fraction``
of the steps (default 75%: consistently, not in a burst) AND its median CPU time is at least
``--ratio`` times the other ranks' (default 1.5: above the 1.32x that identical ranks reached on
a loaded 2-core machine). The first step is left out when there are others: it pays one-time
start-up costs. In a pipeline each stage runs its own blocks, so only the ranks of one stage are
compared (``work_groups``). Fewer than ``MIN_STEPS`` analysed steps get no verdict: with 3, a median
is one step's time and one of two identical ranks is slowest in all of them one time in four. At
most one rank can be slowest in more than half of the steps, so at most one is flagged. Prints a
per-rank table and the verdict; exit 0 whatever the verdict, 2 on bad input.
"""

import argparse
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

# config.py, as every step has it
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "common"))
import parity  # noqa: E402
from config import OneLineParser, UserError, exit_on_user_error  # noqa: E402

FRACTION, RATIO = 0.75, 1.5
MIN_STEPS = 5  # analysed steps (after the first) a verdict needs


@dataclass
class RankTimes:
    rank: int
    wall_s: list[float]
    cpu_s: list[float]
    slowest_in: int = 0  # analysed steps in which this rank had the most CPU time
    vs_others: float = 0.0  # median CPU time / the other ranks' median CPU time


@dataclass
class Result:
    ranks: list[RankTimes]
    steps: list[int]  # the analysed steps
    straggler: int | None
    fraction: float
    ratio: float
    groups: list[list[int]]  # the ranks compared with each other


def step_times(metrics: dict, source) -> tuple[list[int], list[list[dict]]]:
    """(steps, per step the list of per-rank ``{"wall_s",
    "cpu_s"}``), checked; ``UserError`` if unusable."""
    records, env = metrics["records"], metrics["env"]
    world_size = env.get("world_size") if isinstance(env, dict) else None
    if not isinstance(world_size, int) or world_size < 1:
        raise UserError(
            f"{source} is corrupted: env.world_size is {world_size!r}, not a number of ranks"
        )
    if not records:
        raise UserError(f"{source} holds no records")
    times = []
    for record in records:
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise UserError(
                f"{source} is corrupted: a record is not a JSON object with a step number"
            )
        entry = record.get("step_time")
        if entry is None:
            raise UserError(
                f"{source}: step {record.get('step')} has no step_time (written before "
                "per-rank step "
                f"times were logged); run the step again"
            )
        if (
            not isinstance(entry, list)
            or len(entry) != world_size
            or not all(
                isinstance(t, dict)
                and all(
                    isinstance(t.get(k), (int, float)) and t[k] >= 0 for k in ("wall_s", "cpu_s")
                )
                for t in entry
            )
        ):
            raise UserError(
                f"{source}: step {record.get('step')}'s step_time is not one {{wall_s, cpu_s}} "
                f"per rank of a world of {world_size}"
            )
        times.append(entry)
    return [r["step"] for r in records], times


def work_groups(env: dict, world_size: int) -> list[list[int]]:
    """The ranks that do the same work, so that their CPU
    times compare: all of them, but in a pipeline (steps 9 and
    10) each stage runs its own blocks, the last one the output layer and the loss too: only a
        stage's ranks compare
    (the ranks of stage s are s x world/P ... (s + 1) x
    world/P - 1: the mesh's pp axis is its outermost)."""
    stages = env.get("pipeline_stages") or 1
    per_stage = world_size // stages if world_size % stages == 0 else world_size
    return [list(range(first, first + per_stage)) for first in range(0, world_size, per_stage)]


def analyse(
    steps: list[int],
    times: list[list[dict]],
    fraction: float = FRACTION,
    ratio: float = RATIO,
    groups: list[list[int]] | None = None,
) -> Result:
    """``groups``: the ranks compared with each other (``work_groups``; default: all)."""
    # the first step pays one-time costs (first calls, allocator growth), not a rank's pace
    if len(steps) > 1:
        steps, times = steps[1:], times[1:]
    n = len(times[0])
    groups = groups or [list(range(n))]
    ranks = [
        RankTimes(r, [t[r]["wall_s"] for t in times], [t[r]["cpu_s"] for t in times])
        for r in range(n)
    ]
    for per_rank in times:
        for group in groups:
            cpu = [per_rank[r]["cpu_s"] for r in group]
            ranks[group[cpu.index(max(cpu))]].slowest_in += 1
    straggler = None
    if max(map(len, groups)) > 1 and len(steps) >= MIN_STEPS:
        for group in (g for g in groups if len(g) > 1):
            for rank in (ranks[r] for r in group):
                others = statistics.median(
                    c for r in group if r != rank.rank for c in ranks[r].cpu_s
                )
                rank.vs_others = (
                    statistics.median(rank.cpu_s) / others if others > 0 else float("inf")
                )
                if (
                    rank.slowest_in >= fraction * len(steps)
                    and rank.vs_others >= ratio
                    and straggler is None
                ):
                    straggler = rank.rank
    return Result(ranks, steps, straggler, fraction, ratio, groups)


def verdict(result: Result) -> str:
    """One line: who is flagged and by how much,
    or why nobody is (the closest candidate's numbers)."""
    if len(result.ranks) == 1:
        return "one rank: nothing to compare"
    if max(map(len, result.groups)) == 1:
        return (
            "one rank per pipeline stage, each running its own blocks: no two ranks do the "
            "same work to compare"
        )
    n = len(result.steps)
    if n < MIN_STEPS:
        return f"too few steps to call: {n} analysed, a verdict needs {MIN_STEPS} (run more steps)"
    rule = (
        f"rule: slowest in >= {result.fraction:.0%} of steps and median CPU time >= "
        f"{result.ratio:g}x the others'"
    )
    if result.straggler is not None:
        r = result.ranks[result.straggler]
        return (
            f"rank {r.rank} is a straggler: slowest in {r.slowest_in} of {n} steps, "
            f"median CPU time {r.vs_others:.2f}x the other ranks' ({rule})"
        )
    r = max(result.ranks, key=lambda rank: (rank.slowest_in, rank.vs_others))
    return (
        f"no straggler: the most often slowest, rank {r.rank}, was slowest in "
        f"{r.slowest_in} of {n} steps "
        f"at {r.vs_others:.2f}x the others' median CPU time ({rule})"
    )


def check(name: str, fraction: float = FRACTION, ratio: float = RATIO) -> tuple[Path, dict, Result]:
    run, metrics = parity.load_run(name)
    steps, times = step_times(metrics, run / "metrics.json")
    return (
        run,
        metrics,
        analyse(steps, times, fraction, ratio, work_groups(metrics["env"], len(times[0]))),
    )


def report(run: Path, metrics: dict, result: Result) -> str:
    c = metrics["config"]
    try:  # what one rank trains on per step, for its own throughput
        tokens_per_rank = c["micro_batch_size"] * c["grad_accum"] * c["seq_len"]
    except (KeyError, TypeError):
        tokens_per_rank = float("nan")
    steps = result.steps
    ms = lambda seconds: seconds * 1000  # noqa: E731
    lines = [
        f"stragglers: {run} ({len(result.ranks)} ranks, steps {steps[0]}-{steps[-1]}"
        + ("; step 1 left out: start-up costs)" if steps[0] > 1 else ")"),
        f"  {'rank':>4} {'wall ms':>8} {'CPU ms median [min - max]':>25} {'waiting ms':>10} "
        f"{'own tok/s':>10} {'slowest in':>10} {'CPU vs others':>13}",
    ]
    for r in result.ranks:
        cpu = statistics.median(r.cpu_s)
        waiting = statistics.median(w - c for w, c in zip(r.wall_s, r.cpu_s))
        lines.append(
            f"  {r.rank:>4} {ms(statistics.median(r.wall_s)):>8.1f} {ms(cpu):>7.1f} "
            f"[{ms(min(r.cpu_s)):>6.1f} - {ms(max(r.cpu_s)):>6.1f}] {ms(waiting):>10.1f} "
            f"{tokens_per_rank / cpu if cpu else float('inf'):>10,.0f} "
            f"{f'{r.slowest_in}/{len(steps)}':>10} {r.vs_others:>12.2f}x"
        )
    lines.append(
        "  CPU: the rank's own work (its training thread's CPU time); waiting: wall - "
        "CPU, mostly blocked "
        "in collectives for slower peers; own tok/s: its tokens per step / its CPU time"
    )
    lines.append(f"verdict: {verdict(result)}")
    return "\n".join(lines)


def main() -> int:
    parser = OneLineParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run", help="step name (step1), step folder or run folder")
    parser.add_argument(
        "--fraction",
        type=float,
        default=FRACTION,
        help="flag only a rank slowest in at least this share of the steps (default %(default)s)",
    )
    parser.add_argument(
        "--ratio",
        type=float,
        default=RATIO,
        help="... and whose median CPU time is at least this many times the others' "
        "(default %(default)s)",
    )
    args = parser.parse_args()
    if not 0.5 < args.fraction <= 1:
        raise UserError(
            f"--fraction must be in (0.5, 1], got {args.fraction:g} (above half: one rank at most)"
        )
    if not args.ratio >= 1:
        raise UserError(f"--ratio must be at least 1, got {args.ratio:g}")
    run, metrics, result = check(args.run, args.fraction, args.ratio)
    print(report(run, metrics, result))
    return 0


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main))
