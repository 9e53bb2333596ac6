"""``--async-save``: a trainer waits for its last background write before it says it is done, and a
write that fails reaches the user as one line and a non-zero exit, whichever step it is.

The writer is slowed down or made to fail from outside the trainer (tests/writer_hook.py patches the
step's own checkpoint module, then runs its train.py): the trainers read no test switch of
their own."""

import subprocess
from pathlib import Path

import pytest

from conftest import REPO, STEPS, TIMEOUT, TINY, run_ranks

HOOK = REPO / "tests" / "writer_hook.py"


def hooked(
    step: str, mode: str, out: Path, corpus: Path, nproc: int = 2
) -> subprocess.CompletedProcess:
    """``step``'s trainer on the tiny workload with ``--async-save``, a checkpoint at steps 2 and 4,
    its writer patched by the hook (``slow:SECONDS`` or ``fail:STEP``), on ``nproc`` ranks (step 0
    has no --async-save)."""
    script = str(REPO / STEPS[step] / "train.py")
    args = [*TINY, "--data", str(corpus), "--out", str(out), "--save-every", "2", "--async-save"]
    if nproc == 1:  # one rank: the global batch of TINY's 2 ranks, accumulated by one
        args[args.index("--grad-accum") + 1] = str(2 * int(args[args.index("--grad-accum") + 1]))
    return run_ranks(HOOK, [mode, script, *args, *TIMEOUT], nproc=nproc, timeout=300)


def whole_checkpoints(out: Path) -> list[str]:
    folder = out / "checkpoints"
    return (
        sorted(p.name for p in folder.iterdir() if (p / "meta.json").is_file())
        if folder.is_dir()
        else []
    )


@pytest.mark.parametrize("step, nproc", [("step1", 1), ("step7", 2)])
def test_the_run_waits_for_its_last_background_write(step, nproc, tmp_path, small_corpus):
    """Every write starts 1.5 s late, longer than what is left of training after the last save: the
    trainer must still say it is done only once checkpoint 4 is whole on disk. (A trainer that exits
    without waiting: with several ranks the writer's barrier finds the process group gone and step_4
    is never renamed into place; on one rank, "done" comes before the write.)"""
    result = hooked(step, "slow:1.5", tmp_path / "run", small_corpus, nproc)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = result.stdout.splitlines()
    written = [
        i for i, line in enumerate(lines) if line.startswith("writer hook: step_4 written (rank 0)")
    ]
    done = [i for i, line in enumerate(lines) if line.startswith("done:")]
    assert written and done and written[0] < done[0], (
        f"the run said done before step_4 was written:\n{result.stdout}"
    )
    assert whole_checkpoints(tmp_path / "run") == ["step_2", "step_4"]
    assert not list((tmp_path / "run" / "checkpoints").glob(".*")), (
        "a temporary checkpoint folder was left"
    )


@pytest.mark.parametrize("step", ["step1", "step5", "step6", "step7"])
def test_a_background_write_that_fails_is_one_line_and_exit_2(step, tmp_path, small_corpus):
    """Writing checkpoint 4 raises (a full disk) on every rank, in the background: the run must not
    end as if it had succeeded. Each rank prints one line naming the checkpoint and the cause, and
    exits 2; the checkpoint before it stays whole. (One process, and a write in the foreground: the
    `checkpoint-not-written` case of tests/test_bad_input.py.)"""
    result = hooked(step, "fail:4", tmp_path / "run", small_corpus)
    # as torchrun's, for failed ranks
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stderr.endswith("ranks' exit codes: [2, 2]\n"), result.stderr[-3000:]
    errors = sorted(line for line in result.stderr.splitlines() if line.startswith("error:"))
    assert len(errors) == 2, result.stderr[-3000:]
    for rank, line in enumerate(errors):
        assert line.startswith(f"error: rank {rank} could not write checkpoint step_4 in "), line
        assert "(OSError: [Errno 28] No space left on device" in line and line.endswith(
            "resume with --resume"
        ), line
    assert "Traceback" not in result.stderr, result.stderr
    assert "done:" not in result.stdout
    assert whole_checkpoints(tmp_path / "run") == ["step_2"]
