"""Step 9, a stage that dies or freezes: the job ends within --timeout-s with the one line per
surviving rank and exit code 3 of every failed collective (docs/fault_tolerance.md), never a hang,
and the point-to-point waits obey the process group's timeout. Real torchrun launches with real
signals, and spawned stages for the waits."""

import os
import re
import signal
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch

from collective_failures import COLLECTIVE_FAILED, ROLL_CALL_S
from conftest import REPO, STEPS, TINY, trainer_command
from test_dead_rank import (
    SLACK_S,
    Lines,
    continue_once_sigterm_is_pending,
    stop_job,
    workers_by_rank,
)

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads torchrun's workers from /proc"
)

TIMEOUT_S = 3  # --timeout-s of the torchrun runs
P2P_TIMEOUT_S = 2  # the spawned stages' process-group timeout


# ---- the point-to-point waits themselves ---------------------------------------------------------


def waiting_stage(rank, world_size, port, queue, waiter):
    """Stage ``waiter`` of a two-stage toy pipeline runs a step; the other stage never does (as if
    frozen) and stays alive until the roll call is over. The waiter reports how long its receive
    waited, gloo's error and the line the trainers would print for it."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    sys.path.insert(0, str(REPO / STEPS["step9"]))
    # imported first: a slow import must not count against the short timeout
    from collective_failures import explain_collective_failure
    from pipeline import Pipeline

    # The meeting point waits long (a loaded machine starts
    # processes slowly); the group's operations, P2P_TIMEOUT_S.
    store = dist.TCPStore(
        "127.0.0.1", port, world_size, is_master=rank == 0, timeout=timedelta(seconds=60)
    )
    store.set(f"ready{rank}", "1")
    store.wait([f"ready{r}" for r in range(world_size)])
    dist.init_process_group(
        "gloo",
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=P2P_TIMEOUT_S),
    )
    if rank == waiter:
        module = torch.nn.Linear(4, 4)
        pipe = Pipeline(
            module, rank, 2, (3, 4), loss_fn=torch.nn.functional.mse_loss, schedule="1f1b"
        )
        started = time.monotonic()
        try:  # stage 0 waits for the gradient of its output, stage 1 for its input
            pipe.run(
                1,
                inputs=[torch.randn(3, 4)] if rank == 0 else None,
                targets=[torch.randn(3, 4)] if rank == 1 else None,
            )
            result = ("no error", time.monotonic() - started, "", "", None)
        except RuntimeError as error:
            waited = time.monotonic() - started
            line, code = explain_collective_failure(error)
            result = ("RuntimeError", waited, str(error), line, code)
    else:
        # alive, silent: it answers neither the receive nor the roll call
        time.sleep(P2P_TIMEOUT_S + ROLL_CALL_S + 4)
        result = "idle"
    queue.put((rank, result))
    queue.close()
    queue.join_thread()
    # as the trainers leave after a failed collective: tearing the broken group down could wait
    os._exit(0)


@pytest.mark.parametrize("waiter", [0, 1])
def test_a_point_to_point_wait_obeys_the_process_group_timeout(waiter):
    """Stage 0 waits in the receive of its output's gradient, stage 1 in the receive of its input,
    for a peer that never sends: gloo raises after the process group's timeout, and the trainers'
    explainer turns that into the line every failed collective gets, naming the silent stage."""
    from conftest import spawn

    results = spawn(waiting_stage, 2, waiter, timeout=300)  # importing torch: slow when loaded
    kind, waited, text, line, code = results[waiter]
    assert kind == "RuntimeError" and re.search(
        rf"Timed out waiting {P2P_TIMEOUT_S * 1000}ms", text
    ), text
    assert P2P_TIMEOUT_S <= waited <= P2P_TIMEOUT_S + SLACK_S, waited
    assert code == COLLECTIVE_FAILED
    assert line == (
        f"rank {waiter} waited {P2P_TIMEOUT_S} s in a collective; rank(s) {1 - waiter} "
        "did not answer a "
        f"roll call within {ROLL_CALL_S:g} s either: dead, frozen, or slower than --timeout-s; "
        "see docs/fault_tolerance.md"
    ), line


# ---- a whole job: three stages, the middle one killed or frozen ----------------------------------

# 2 chunks per stage
INTERLEAVED = ["--n-layer", "6", "--grad-accum", "3", "--schedule", "interleaved-1f1b"]


def start_three_stages(tmp_path, small_corpus, *extra: str) -> tuple[subprocess.Popen, Lines, dict]:
    """Step 9 on 3 stages (a 3-block TINY model, or ``extra``'s), training until stopped; returns
    once two optimiser steps are done (every message and collective of a step has run), with
    torchrun's workers by rank."""
    args = [
        *TINY,
        "--steps",
        "10000",
        "--n-layer",
        "3",
        "--data",
        str(small_corpus),
        "--out",
        str(tmp_path / "run"),
        "--timeout-s",
        str(TIMEOUT_S),
        *extra,
    ]
    args.remove("--quiet")  # rank 0's per-step lines say when training is under way
    proc = subprocess.Popen(
        trainer_command(STEPS["step9"], 3, args),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    output = Lines(proc)
    try:
        output.wait_for(r"^step\s+2/", timeout=180)
        ranks = workers_by_rank(proc.pid)
        assert sorted(ranks) == [0, 1, 2], ranks
    except BaseException:
        stop_job(proc)
        raise
    return proc, output, ranks


def exit_codes(lines: list[str], ranks: dict) -> dict:
    """{rank: exit code} from torchrun's report."""
    text = "\n".join(lines)
    return {
        rank: int(re.search(rf"exitcode\s+: (-?\d+) \(pid: {pid}\)", text).group(1))
        for rank, pid in ranks.items()
    }


def assert_no_traceback(lines: list[str]) -> None:
    assert not [
        line
        for line in lines
        if "gloo" in line
        and not line.startswith("error:")
        or (line.startswith("[rank") and "Traceback" in line)
    ], "gloo's error or a worker's traceback"


def test_a_killed_stage_ends_the_job_at_once(tmp_path, small_corpus):
    """SIGKILL the middle stage of three: its neighbours' sockets close, their receives fail at
    once, each prints the line of a lost connection (naming rank 1, which did not answer the roll
    call) and exits 3, or is stopped by torchrun before it can (-15: torchrun stops every worker 0.1
    s after the first one ends)."""
    proc, output, ranks = start_three_stages(tmp_path, small_corpus)
    try:
        os.kill(ranks[1], signal.SIGKILL)
        killed_at = time.monotonic()
        proc.wait(timeout=TIMEOUT_S + ROLL_CALL_S + 60)
        ended_at = time.monotonic()
    finally:
        stop_job(proc)
    lines = output.rest()
    codes = exit_codes(lines, ranks)
    errors = [line for line in lines if line.startswith("error:")]

    assert ended_at - killed_at <= ROLL_CALL_S + SLACK_S, (
        f"job ended {ended_at - killed_at:.1f} s after SIGKILL"
    )
    assert proc.returncode == 1 and codes[1] == -signal.SIGKILL, codes
    assert codes[0] in (COLLECTIVE_FAILED, -signal.SIGTERM) and codes[2] in (
        COLLECTIVE_FAILED,
        -signal.SIGTERM,
    ), codes
    assert COLLECTIVE_FAILED in (codes[0], codes[2]), (codes, lines[-30:])
    said = sorted(int(re.match(r"error: rank (\d)", e).group(1)) for e in errors)
    # one line per rank that exited 3
    assert said == [r for r in (0, 2) if codes[r] == COLLECTIVE_FAILED], errors
    # the roll call had not heard from rank 1, and perhaps not yet from the other survivor
    for error in errors:
        match = re.fullmatch(
            r"error: rank [02] lost its connection to a peer in a collective \(gloo: Connection "
            r"(?:reset|closed) by peer\); rank\(s\) ([\d, ]+) had not answered a roll "
            r"call when the "
            r"launcher stopped this rank \d+\.\d s later \(another rank failed first: torchrun's "
            r"report says how\); see docs/fault_tolerance.md",
            error,
        )
        assert match and "1" in match.group(1).split(", "), error
    assert_no_traceback(lines)


@pytest.mark.parametrize(
    "extra",
    [[], INTERLEAVED, ["--schedule", "zero-bubble"]],
    ids=["1f1b", "interleaved", "zero-bubble"],
)
def test_a_frozen_stage_ends_the_job_within_the_timeout(tmp_path, small_corpus, extra):
    """SIGSTOP the middle stage of three: both neighbours wait --timeout-s in a point-to-point
    receive, take a roll call that rank 1 cannot answer, print one line each and exit 3. torchrun
    then stops rank 1 (continued here, as a rank that hangs without being stopped acts on torchrun's
    SIGTERM at once: tests/test_dead_rank.py). Zero bubble, the same. Interleaved (6 blocks in 2
    chunks per stage), the same, but rank 2 also feeds rank 0 (the ring wraps): the survivor still
    waiting may see the other leave first, and says so (rank 1 named in both)."""
    proc, output, ranks = start_three_stages(tmp_path, small_corpus, *extra)
    try:
        os.kill(ranks[1], signal.SIGSTOP)
        frozen_at = time.monotonic()
        first_at, _ = output.wait_for(r"^error:", timeout=TIMEOUT_S + ROLL_CALL_S + 30)
        output.wait_for(rf"Sending process {ranks[1]} closing signal SIGTERM", timeout=30)
        continue_once_sigterm_is_pending(ranks[1])
        proc.wait(timeout=30)
        ended_at = time.monotonic()
    finally:
        stop_job(proc)
    lines = output.rest()
    codes = exit_codes(lines, ranks)
    errors = sorted(line for line in lines if line.startswith("error:"))
    # The frozen rank says nothing: it is continued only once torchrun's SIGTERM is pending on it,
    # which ends it before it runs again (continued earlier, it once found its peers gone and said
    # so: test_dead_rank.py).
    assert not [line for line in lines if line.startswith("error: rank 1 ")], lines

    bound = TIMEOUT_S + ROLL_CALL_S + SLACK_S
    assert TIMEOUT_S <= first_at - frozen_at <= bound, (
        f"first error line {first_at - frozen_at:.1f} s after SIGSTOP"
    )
    assert ended_at - frozen_at <= bound, f"job ended {ended_at - frozen_at:.1f} s after SIGSTOP"
    waited = [
        f"error: rank {r} waited {TIMEOUT_S} s in a collective; rank(s) 1 did not "
        "answer a roll call "
        f"within {ROLL_CALL_S:g} s either: dead, frozen, or slower than --timeout-s; "
        "see docs/fault_tolerance.md"
        for r in (0, 2)
    ]
    if "interleaved-1f1b" not in extra:
        assert errors == waited, errors
    # the ring wraps (rank 2 feeds rank 0): a survivor may also see the other survivor leave first
    else:
        lost = (
            r"lost its connection to a peer in a collective \(gloo: Connection "
            r"(?:closed|reset) by peer\)"
        )
        assert len(errors) == 2 and all(
            e == w
            or re.fullmatch(
                re.escape(w).replace(re.escape(f"waited {TIMEOUT_S} s in a collective"), lost), e
            )
            for e, w in zip(errors, waited)
        ), errors
    assert proc.returncode == 1 and codes[0] == codes[2] == COLLECTIVE_FAILED, codes
    assert_no_traceback(lines)
