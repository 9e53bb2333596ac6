"""Preemption (``--preempt-grace-s``, failures.py's ``Preemption``): a SIGTERM, as a spot machine's
notice or torchrun passing on its own, ends the run after the step in progress with a checkpoint and
exit code 4, and the run resumed from it ends bitwise equal to one never interrupted. Real torchrun
launches, real signals: sent at a chosen step by tests/writer_hook.py (from inside rank 0, so the
step the run stops after is known), to torchrun, to one rank alone, or in the middle of a save. A
second SIGTERM, or a grace period that runs out, ends the rank without a save (exit 5) and leaves
the checkpoints already written whole."""

import re
import subprocess
import sys

import pytest

from conftest import REPO, STEPS, TIMEOUT, TINY, assert_bitwise_same_run, launch, trainer_command

sys.path.insert(0, str(REPO / "common"))
from failures import PREEMPTED, PREEMPTED_UNSAVED  # noqa: E402

HOOK = REPO / "tests" / "writer_hook.py"
GRACE = ["--preempt-grace-s", "20"]  # under torchrun's 30 s


def tour_args(step: str) -> list[str]:
    """The flags of the tour's run of ``step`` (conftest's ``tour``): TINY, with step 9's ranks
    sharing one stream of micro-batches, as step 0's process accumulates them."""
    args = list(TINY)
    if step == "step9":
        args[args.index("--grad-accum") + 1] = "4"
    return args


def torchrun_with_hook(
    step: str, mode: str, args: list[str], *torchrun_flags: str
) -> subprocess.CompletedProcess:
    command = trainer_command(STEPS[step], 2, args)
    at = command.index("--nproc_per_node=2")
    command[at + 1 : at + 1] = [*torchrun_flags, str(HOOK), mode]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=240)


def checkpoints(out) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").iterdir())


@pytest.mark.parametrize("step", ["step1", "step7", "step9"])
def test_a_sigterm_to_torchrun_saves_the_step_in_progress_and_the_run_resumes_bitwise(
    step, tour, tmp_path, small_corpus
):
    """torchrun gets SIGTERM after step 2 and passes it on to both ranks; they finish the step,
    agree, save step 2 (no --save-every), say so in one line and exit 4 within torchrun's grace.
    Resumed with --resume auto, the run ends bitwise equal to the tour's uninterrupted one: step 1
    (PyTorch DDP), step 7 (ZeRO-3), step 9 (pipeline)."""
    out = tmp_path / "run"
    args = [
        *tour_args(step),
        *TIMEOUT,
        *GRACE,
        "--data",
        str(small_corpus),
        "--out",
        str(out),
        "--quiet",
    ]
    stopped = torchrun_with_hook(step, "sigterm:2:launcher", args)
    output = stopped.stdout + stopped.stderr
    assert stopped.returncode != 0, output[-3000:]  # torchrun itself was told to stop
    assert "Received 15 death signal, shutting down workers" in output, output[-3000:]
    line = (
        f"preempted: SIGTERM; stopped after step 2, saved in {out}/checkpoints/step_2; "
        "go on with --resume auto "
        f"(exit code {PREEMPTED})"
    )
    assert stopped.stdout.splitlines().count(line) == 1, output[-3000:]  # rank 0's line, once
    assert "error:" not in output, output[-3000:]
    assert checkpoints(out) == ["step_2"]  # --save-every 0: the preemption's save, whole
    resumed = launch(step, [*args, "--preempt-grace-s", "0", "--resume", "auto"], nproc=2)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"resumed from {out}/checkpoints/step_2 at step 2" in resumed.stdout
    assert_bitwise_same_run(tour[0] / STEPS[step], out)


def test_one_rank_signalled_stops_both_and_torchrun_restarts_them_from_the_save(
    tour, tmp_path, small_corpus
):
    """Only rank 0 gets SIGTERM (after step 3, during --async-save's writes); rank 1 never does, yet
    stops after the same step, since the ranks agree every step. Both exit 4, torchrun
    (--max-restarts 1) starts them again, and --resume auto goes on from the background-written step
    3: the run ends bitwise equal to the tour's."""
    out = tmp_path / "run"
    args = [
        *TINY,
        *TIMEOUT,
        *GRACE,
        "--data",
        str(small_corpus),
        "--out",
        str(out),
        "--save-every",
        "2",
        "--async-save",
        "--resume",
        "auto",
    ]
    result = torchrun_with_hook("step1", "sigterm:3:self", args, "--max-restarts=1")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "stopped after step 3" in output and f"failed (exitcode: {PREEMPTED})" in output, output[
        -3000:
    ]
    assert f"resumed from {out}/checkpoints/step_3 at step 3" in output, output[-3000:]
    assert checkpoints(out) == ["step_2", "step_3", "step_4"]
    assert_bitwise_same_run(tour[0] / STEPS["step1"], out)


def test_a_sigterm_during_a_save_lets_it_finish_and_stops_after_the_next_step(
    tour, tmp_path, small_corpus
):
    """Rank 1 sends torchrun SIGTERM while checkpoint 2 is being written (its file is in
    .tmp_step_2, rank 0's may not be): the save ends whole, the ranks train step 3, save it and exit
    4; resumed, step 7 ends bitwise."""
    out = tmp_path / "run"
    args = [
        *TINY,
        *TIMEOUT,
        *GRACE,
        "--data",
        str(small_corpus),
        "--out",
        str(out),
        "--save-every",
        "2",
    ]
    stopped = torchrun_with_hook("step7", "sigterm-in-save:2:1", args)
    output = stopped.stdout + stopped.stderr
    assert "SIGTERM sent to torchrun in the save of step 2 by rank 1" in output, output[-3000:]
    assert "stopped after step 3" in output and "error:" not in output, output[-3000:]
    assert checkpoints(out) == ["step_2", "step_3"]
    resumed = launch("step7", [*args, "--resume", "auto"], nproc=2)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert_bitwise_same_run(tour[0] / STEPS["step7"], out)


@pytest.mark.parametrize(
    "mode, why",
    [
        ("sigterm:2:self,slow:5", "--preempt-grace-s 1 s passed"),
        ("sigterm:2:self-twice", "a second SIGTERM came"),
    ],
)
def test_a_second_sigterm_or_the_end_of_the_grace_ends_the_run_unsaved(
    mode, why, tmp_path, small_corpus
):
    """Step 0, one process: told to stop after step 2, it either cannot write step 2 within
    --preempt-grace-s (every write made 5 s slow) or is told a second time; it ends with one line
    and exit 5, step 1's checkpoint whole (resumable), no step 2."""
    out = tmp_path / "run"
    args = [
        *TINY,
        "--data",
        str(small_corpus),
        "--out",
        str(out),
        "--save-every",
        "1",
        "--preempt-grace-s",
        "1",
    ]
    result = subprocess.run(
        [sys.executable, str(HOOK), mode, str(REPO / STEPS["step0"] / "train.py"), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == PREEMPTED_UNSAVED, result.stdout[-2000:] + result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: rank 0 was told to stop (SIGTERM) and {why} before it could save: it "
        "ends without a "
        "checkpoint; the ones already saved are whole (resume with --resume auto)"
    ], result.stderr[-2000:]
    assert [p for p in checkpoints(out) if re.fullmatch(r"step_\d+", p)] == ["step_1"]
    resumed = launch("step0", [*args, "--preempt-grace-s", "0", "--resume", "auto"])
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout, resumed.stderr[-2000:]
