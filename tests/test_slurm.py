"""launch/slurm.sbatch and launch/slurm_command.py: the line rendered from Slurm's variables,
checked argument by argument; then the script itself run on this machine as a 2-node job, with
stand-ins for ``srun`` (each node's task started here, ``SLURM_NODEID`` set) and ``scontrol`` (the
nodes' names; a requeue noted in a file). The trainer, torchrun and its c10d rendezvous are the real
ones, as in the two-node test of test_data_parallel.py: the job trains bitwise like step 3 launched
plainly, and stopped by the time limit's signal it saves, is requeued, and its next start ends
bitwise like a run never stopped."""

import os
import shlex
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, TIMEOUT, TINY, assert_bitwise_same_run, free_port, launch

sys.path.insert(0, str(REPO / "launch"))
import slurm_command  # noqa: E402

from config import UserError  # noqa: E402  (common/, on the path through conftest)

SBATCH = REPO / "launch" / "slurm.sbatch"
JOB = {
    "SLURM_JOB_ID": "4242",
    "SLURM_NNODES": "2",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
    "SLURM_NTASKS_PER_NODE": "1",
    "SLURM_GPUS_ON_NODE": "4",
}

# srun: the command once per node of the job, here, each
# with its SLURM_NODEID; the options are Slurm's business.
FAKE_SRUN = """#!/bin/bash
while [[ "$1" == --* ]]; do shift; done
pids=()
for ((node = 0; node < SLURM_NNODES; node++)); do SLURM_NODEID=$node "$@" & pids+=($!); done
code=0; for pid in "${pids[@]}"; do wait "$pid" || code=$?; done
exit $code
"""
# scontrol: every node is this machine; a requeue is written down for the test to read.
FAKE_SCONTROL = """#!/bin/bash
case "$1 $2" in
  "show hostnames") for ((node = 0; node < SLURM_NNODES; node++)); do echo 127.0.0.1; done ;;
  "requeue "*) echo "requeue $2" >> "$FAKE_SLURM_LOG" ;;
  *) exit 1 ;;
esac
"""


@pytest.mark.quick
def test_the_line_is_torchrun_rendezvousing_at_the_first_node_with_resume_and_grace():
    line = slurm_command.torchrun_command("step3", ["--steps", "100"], JOB, ["gpu07", "gpu08"])
    assert line == [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--nproc_per_node=4",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=gpu07:29642",
        "--rdzv-id=4242",
        str(REPO / "step3_naive_dp" / "train.py"),
        "--steps",
        "100",
        "--resume",
        "auto",
        "--preempt-grace-s",
        "20",
    ]


@pytest.mark.quick
def test_what_the_user_gives_wins_over_the_defaults():
    env = {**JOB, "NPROC_PER_NODE": "2", "RDZV_PORT": "31000", "SLURM_NNODES": "1"}
    line = slurm_command.torchrun_command(
        "step7_zero3",
        ["--resume", "runs/x/checkpoints/step_4", "--preempt-grace-s=5"],
        env,
        ["cpu1"],
    )
    assert line[3:8] == [
        "--nnodes=1",
        "--nproc_per_node=2",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=cpu1:31000",
        "--rdzv-id=4242",
    ]
    assert line[8:] == [
        str(REPO / "step7_zero3" / "train.py"),
        "--resume",
        "runs/x/checkpoints/step_4",
        "--preempt-grace-s=5",
    ]


@pytest.mark.quick
@pytest.mark.parametrize(
    "change, message",
    [
        ({"SLURM_JOB_ID": ""}, "SLURM_JOB_ID is not set: run this inside a Slurm job"),
        ({"SLURM_NTASKS_PER_NODE": "4"}, "the job runs 4 tasks per node"),
        ({"SLURM_GPUS_ON_NODE": ""}, "the job has no GPUs per node"),
        ({"SLURM_NNODES": "3"}, "SLURM_JOB_NODELIST names 2 nodes, SLURM_NNODES says 3"),
    ],
)
def test_a_job_it_cannot_launch_is_refused(change, message):
    with pytest.raises(UserError, match=message):
        slurm_command.torchrun_command("step3", [], {**JOB, **change}, ["gpu07", "gpu08"])
    with pytest.raises(UserError, match="no step named 'step99'"):
        slurm_command.torchrun_command("step99", [], JOB, ["gpu07", "gpu08"])


@pytest.fixture
def cluster(tmp_path):
    """A PATH with the stand-ins, and a job's environment:
    2 nodes, 1 rank each, a free rendezvous port."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {
        **os.environ,
        **JOB,
        "SLURM_GPUS_ON_NODE": "",
        "NPROC_PER_NODE": "1",
        "RDZV_PORT": str(free_port()),
        "SLURM_SUBMIT_DIR": str(REPO),
        "TMPDIR": str(tmp_path),
        "FAKE_SLURM_LOG": str(tmp_path / "slurm.log"),
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": "",
    }
    return env, tmp_path


def test_the_rendered_line_reads_the_nodes_from_scontrol(cluster):
    env, _ = cluster
    shown = subprocess.run(
        [
            sys.executable,
            str(REPO / "launch" / "slurm_command.py"),
            "step3",
            "--steps",
            "8",
            "--show",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shown.returncode == 0, shown.stderr
    expected = slurm_command.torchrun_command(
        "step3",
        ["--steps", "8"],
        {**JOB, **{k: env[k] for k in ("NPROC_PER_NODE", "RDZV_PORT")}, "SLURM_GPUS_ON_NODE": ""},
        ["127.0.0.1", "127.0.0.1"],
    )
    assert shown.stdout.strip() == shlex.join(expected)


def sbatch(env: dict, args: list[str]) -> subprocess.Popen:
    """The script as Slurm's batch step runs it,
    in a session of its own (``finish`` can end all it started)."""
    return subprocess.Popen(
        ["bash", str(SBATCH), "step3", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def finish(job: subprocess.Popen, timeout: float) -> str:
    """Its output once it has ended; past ``timeout``,
    it and everything it started are killed (no stray ranks)."""
    try:
        return job.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        raise


def test_the_job_trains_bitwise_like_step3_launched_plainly(cluster, small_corpus):
    env, tmp = cluster
    args = [*TINY, *TIMEOUT, "--data", str(small_corpus)]
    job = sbatch(env, [*args, "--out", str(tmp / "job")])
    output = finish(job, 300)
    assert job.returncode == 0, output[-3000:]
    assert (
        "on 2 nodes: " in output
        and "--rdzv-backend=c10d" in output
        and "done: 4 steps on 2 ranks" in output
    )
    plain = launch(
        "step3", [*TINY, "--data", str(small_corpus), "--out", str(tmp / "plain")], nproc=2
    )
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert_bitwise_same_run(tmp / "plain", tmp / "job")
    assert not (tmp / "slurm.log").exists()  # a job that ended is not requeued
    assert not (tmp / "dtfs_slurm_4242").exists()  # the pid files: gone with the job


def test_the_time_limit_signal_saves_requeues_and_the_next_start_resumes_bitwise(
    cluster, small_corpus
):
    """SIGUSR1 to the script (Slurm's --signal=B:USR1@90) once checkpoint 2 exists: each torchrun
    gets one SIGTERM, the ranks finish their step, save it and exit 4; the job is requeued; started
    again, it resumes there and ends bitwise like a run never stopped."""
    env, tmp = cluster
    out = tmp / "job"
    args = [
        *TINY,
        *TIMEOUT,
        "--data",
        str(small_corpus),
        "--steps",
        "40",
        "--save-every",
        "2",
        "--out",
        str(out),
    ]
    job = sbatch(env, args)
    deadline = time.monotonic() + 240
    while (
        not (out / "checkpoints" / "step_2").is_dir()
        and job.poll() is None
        and time.monotonic() < deadline
    ):
        time.sleep(0.05)
    job.send_signal(signal.SIGUSR1)
    output = finish(job, 240)
    assert job.returncode != 0, output[-3000:]
    assert "SIGUSR1: the time limit is near" in output and "requeued" in output, output[-3000:]
    stopped = [
        line
        for line in output.splitlines()
        if line.startswith("preempted: SIGTERM; stopped after step")
    ]
    # rank 0's line; no rank ended unsaved
    assert len(stopped) == 1 and "error:" not in output, output[-3000:]
    step = int(stopped[0].split("stopped after step ")[1].split(",")[0])
    assert 2 <= step < 40 and (out / "checkpoints" / f"step_{step}").is_dir()
    assert (tmp / "slurm.log").read_text() == "requeue 4242\n"

    again = sbatch({**env, "SLURM_RESTART_COUNT": "1"}, args)
    output = finish(again, 300)
    assert again.returncode == 0, output[-3000:]
    assert f"resumed from {out}/checkpoints/step_{step} at step {step}" in output, output[-3000:]
    plain = launch(
        "step3",
        [*TINY, "--data", str(small_corpus), "--steps", "40", "--out", str(tmp / "plain")],
        nproc=2,
    )
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert_bitwise_same_run(tmp / "plain", out)
