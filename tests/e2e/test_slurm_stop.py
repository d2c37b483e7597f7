"""The SLURM script (launch/slurm/train.sbatch) through the scheduler's stop sequence, with srun and
scontrol stubbed (tests/helpers/slurm_stubs/: srun runs the tasks on this host, each the script's own
`bash -c '... exec python launch/train.py'` up to its exec and then launch/train.py in a child forked
from srun, which has imported torch and DeepSpeed once; it forwards its signals to them; scontrol
records a requeue): the early warning (USR1 to the batch shell only, `--signal=B:USR1@N`), then the
time limit (SIGTERM to every task and to the shell at once) while the stop's save runs. The save
completes, `latest` names it, the job is requeued, and the requeued script resumes from it and
finishes without another requeue."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers.launcher import REPO, TINY, read_metrics
from launch.engine.distributed import free_port

SCRIPT = REPO / "launch" / "slurm" / "train.sbatch"
STUBS = REPO / "tests" / "helpers" / "slurm_stubs"
STEPS = 20  # well beyond where the warning stops the first attempt (step 3)
SLOW_SAVE_S = 6  # the stop's save takes this much longer (GPT3D_SLOW_SAVE): the time limit lands inside it


def _job(tmp_path: Path, attempt: str, env: dict) -> subprocess.Popen:
    """The batch script as SLURM's batch step runs it, its output in tmp_path/ATTEMPT.out."""
    out = open(tmp_path / f"{attempt}.out", "w")
    return subprocess.Popen(["bash", str(SCRIPT), "--recipe", str(TINY), "--pp", "2",
                             "--metrics-out", str(tmp_path / "m.jsonl")],
                            cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _wait_for(predicate, timeout: float = 180) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def _end(job: subprocess.Popen) -> None:
    """A failed check: leave nothing running (the shell's session: srun's stub and its tasks)."""
    if job.poll() is None:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait(timeout=30)


@pytest.mark.waits
@pytest.mark.slow
def test_the_time_limit_during_the_stop_save_keeps_it_and_the_job_requeues(tmp_path):
    ck, metrics, pids, requeues = tmp_path / "ck", tmp_path / "m.jsonl", tmp_path / "pids", tmp_path / "requeues"
    env = dict(os.environ, PATH=f"{STUBS}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="node1", SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="2",
               SLURM_SUBMIT_DIR=str(REPO), SAVE=str(ck), STEPS=str(STEPS), MASTER_PORT=str(free_port()),
               SRUN_STUB_PIDS=str(pids), SCONTROL_STUB_LOG=str(requeues))
    job = _job(tmp_path, "first", dict(env, GPT3D_SLOW_SAVE=str(SLOW_SAVE_S)))
    out = tmp_path / "first.out"
    try:
        assert _wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 2), out.read_text()
        job.send_signal(signal.SIGUSR1)  # the early warning, to the batch shell only
        warned = time.monotonic()
        assert _wait_for(lambda: "this save waits" in out.read_text(), timeout=60), out.read_text()
        # The time limit, past the 2 s in which a signal is the warning's own request, inside the save.
        time.sleep(max(0.0, warned + 3.0 - time.monotonic()))
        for pid in [int(line) for line in pids.read_text().split()] + [job.pid]:
            os.kill(pid, signal.SIGTERM)
        limit = time.monotonic()
        assert job.wait(timeout=120) == 0, out.read_text()[-3000:]
        print(f"the batch script ended {time.monotonic() - warned:.1f} s after the warning, "
              f"{time.monotonic() - limit:.1f} s after the time limit's SIGTERM")
    finally:
        _end(job)
    text = out.read_text()
    assert "train.sbatch: USR1: asking the training step to save and stop" in text, text[-3000:]
    assert "rank 0: SIGTERM again during a save: the save finishes first, then this rank leaves (exit 0)" in text, \
        text[-3000:]
    saved = [line for line in text.splitlines() if line.startswith("saved ")]
    assert len(saved) == 1 and "a stop needs up to" in saved[0], text[-3000:]
    print(saved[0])
    last = read_metrics(metrics)[-1]["step"]
    latest = (ck / "latest").read_text()
    assert latest == f"step{last:08d}" and (ck / latest / "complete.json").exists(), (latest, last)
    assert requeues.read_text() == "requeue 4242\n", text[-3000:]

    # The requeued job: the same script, from the top; it resumes and runs to the last step.
    job = _job(tmp_path, "requeued", env)
    try:
        assert job.wait(timeout=240) == 0, (tmp_path / "requeued.out").read_text()[-3000:]
    finally:
        _end(job)
    text = (tmp_path / "requeued.out").read_text()
    assert f"resumed from {ck / latest} at step {last}" in text, text[-3000:]
    assert f"train.sbatch: {ck}/latest is step{STEPS:08d}, the last step: done" in text, text[-3000:]
    assert requeues.read_text() == "requeue 4242\n"  # not requeued again
    assert [m["step"] for m in read_metrics(metrics)] == list(range(1, STEPS + 1))
