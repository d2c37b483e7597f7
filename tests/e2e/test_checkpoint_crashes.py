"""Checkpoints under real failures on CPU: a SIGKILL while a checkpoint is being written leaves
`latest` on a complete one, and so does one during an asynchronous save's background write (the
resume then bit for bit); SIGTERM to the `deepspeed` command makes every rank finish the step, save
together and exit 0, and the run resumes; a frozen rank is named by the others, killed by a sibling
and the job ends; a signalled rank whose peer is frozen leaves after the grace. The tests whose
subject is DeepSpeed's launcher (its SIGTERM, its wait for a frozen rank) start it; those whose
subject is what the ranks do (a save, a stop's grace) fork the same ranks (helpers/children.py:
ForkedRun). (Bad checkpoints, durability, --keep-last:
tests/checkpoints/test_checkpoint.py; a second signal and the same request's rules, in process:
tests/runtime/test_silent_rank.py. A killed rank on gloo: its peers' next collective fails at once
with "a peer rank probably died" (tests/runtime/test_failures.py checks that line's hint); the
heartbeat's part shows only with a rank that is silent but connected, the frozen ranks here.)"""
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

from launch.engine.distributed import launcher_command
from helpers.children import ForkedRun
from helpers.launcher import LAUNCHER_KILL_WAIT_S, REPO, TINY, launch_forked, read_metrics
from helpers.parity_runs import STEPS


def _train(n, tmp_path, name, extra, check=True):
    out = tmp_path / f"{name}.jsonl"
    proc = launch_forked(n, ["--recipe", str(TINY), "--metrics-out", str(out)] + extra)
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, out


def _training_pids(launcher: subprocess.Popen):
    """The launch/train.py ranks under a DeepSpeed launcher (the launcher passes each its
    --local_rank; the launcher processes carry the script path too), in rank order."""
    def local_rank(p):
        try:
            args = [a for a in p.cmdline() if a.startswith("--local_rank=")]
        except psutil.Error:  # exited (a zombie has no command line): not a running rank
            return None
        return int(args[0].split("=")[1]) if args else None
    ranks = [p for p in psutil.Process(launcher.pid).children(recursive=True) if local_rank(p) is not None]
    return sorted(ranks, key=local_rank)


def _start(n, args):
    cmd = launcher_command(n, REPO / "launch" / "train.py") + ["--recipe", str(TINY)] + args
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for(predicate, timeout=240):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def _forked(n, args, env=None) -> ForkedRun:
    return ForkedRun(n, ["--recipe", str(TINY)] + args, env=env)


def _output(run: ForkedRun) -> str:
    """A forked run's output once it has ended (a failed check ends it first)."""
    run.kill()
    proc = run.result()
    return (proc.stdout + proc.stderr)[-3000:]


def _kill_while_saving(ck: Path) -> bool:
    """Run with a save every step and SIGKILL every rank as soon as a checkpoint directory
    exists without complete.json. True if the kill landed mid-save (a fast save can finish
    between the check and the kill; the caller retries)."""
    # A wider model makes each save take longer, so the kill lands inside one.
    job = _forked(2, ["--pp", "2", "--steps", "100", "--save", str(ck), "--save-every", "1",
                      "--set", "model.n_embd=256"])
    ranks = job.ranks()

    def saving_now():
        return (ck / "latest").exists() and any(not (d / "complete.json").exists() for d in ck.glob("step*"))
    assert _wait_for(saving_now), _output(job)
    for p in ranks:
        p.kill()
    assert job.result(timeout=120).returncode == -signal.SIGKILL
    latest = (ck / "latest").read_text()
    assert (ck / latest / "complete.json").exists()  # whatever the timing: latest is complete
    incomplete = [d.name for d in ck.glob("step*") if not (d / "complete.json").exists()]
    assert all(name > latest for name in incomplete)
    return bool(incomplete)


@pytest.mark.waits
@pytest.mark.slow
def test_kill_during_save_keeps_latest_complete(tmp_path):
    """SIGKILL every rank while a checkpoint is being written: `latest` still names a complete
    checkpoint, and --load resumes from it."""
    for attempt in range(3):
        ck = tmp_path / f"ck{attempt}"
        if _kill_while_saving(ck):
            break
    else:
        pytest.fail("three kills all landed between saves")
    step = int((ck / "latest").read_text()[len("step"):])
    _train(2, tmp_path, "after", ["--pp", "2", "--steps", str(step + 1), "--load", str(ck),
                                  "--set", "model.n_embd=256"])


@pytest.mark.waits
@pytest.mark.slow
def test_kill_9_during_a_background_write_resumes_bitwise(tmp_path, parity_runs):
    """train.async_save: SIGKILL rank 1 while step 4's files are written in the background (held
    open by GPT3D_SLOW_SAVE before the agreement): `latest` still names step 2, step 4 has no
    complete.json, and the resumed run ends where the uninterrupted (1,2,1) parity run does, losses
    and weights bit for bit."""
    ck, first = tmp_path / "ck", tmp_path / "first.jsonl"
    async_run = ["--pp", "2", "--steps", str(STEPS), "--save", str(ck), "--set", "train.async_save=true"]
    job = _forked(2, async_run + ["--save-every", "2", "--metrics-out", str(first)], env={"GPT3D_SLOW_SAVE": "8"})
    ranks = job.ranks()
    held = ck / "step00000004" / "rng" / "rank_1.pt"  # rank 1's last file: its writer now waits 8 s
    assert _wait_for(held.exists), _output(job)
    assert (ck / "latest").read_text() == "step00000002"
    ranks[1].kill()
    assert job.result(timeout=120).returncode != 0
    assert (ck / "latest").read_text() == "step00000002" and not (ck / "step00000004" / "complete.json").exists()
    _, resumed = _train(2, tmp_path, "resumed", async_run + ["--load", str(ck)])
    full = parity_runs[(1, 2, 1)]
    assert [(m["step"], m["loss"], m["grad_norm"]) for m in read_metrics(resumed)] == \
        [(m["step"], m["loss"], m["grad_norm"]) for m in full["metrics"][2:]]
    layers = sorted((ck / f"step{STEPS:08d}").glob("layer_*"))
    assert layers
    for new in layers:
        a, b = (torch.load(d / f"step{STEPS:08d}" / new.name, weights_only=True) for d in (ck, full["dir"] / "ck"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), new.name


@pytest.mark.waits
@pytest.mark.slow
def test_sigterm_saves_and_exits_0_then_resumes(tmp_path):
    """SIGTERM to the `deepspeed` command, which dies of it at once (on one node DeepSpeed's runner
    installs no handler) and forwards nothing: it returns while its ranks still run (what
    docs/resilience.md says: a scheduler waiting on it would kill them mid-save). The ranks see it
    gone and stop as on SIGTERM: every rank finishes the step, they save together and exit 0; the
    same command with --load resumes. (A SIGTERM to a rank itself: the fault soak, and the
    frozen-peer test below; the same request's rules in process: tests/runtime/test_silent_rank.py.)"""
    ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    job = _start(2, ["--pp", "2", "--steps", "1000", "--save", str(ck), "--metrics-out", str(metrics)])
    assert _wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 2)
    ranks = _training_pids(job)
    job.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    assert job.wait(timeout=60) == -signal.SIGTERM
    returned_s = time.monotonic() - signalled
    assert not all(_gone(p) for p in ranks), "the ranks had ended before the deepspeed command returned"
    assert _wait_for(lambda: all(_gone(p) for p in ranks), timeout=60)
    print(f"the deepspeed command returned {returned_s:.1f} s after SIGTERM, its ranks ended "
          f"{time.monotonic() - signalled:.1f} s after it")
    out, _ = job.communicate(timeout=60)  # the ranks held the output pipe until they exited
    # Each rank looks for the runner once a second; the first to see it gone stops them all through
    # the step's gathered flags, and the job may end before the others look again.
    assert re.search(rf"^rank \d: the deepspeed command \(pid {job.pid}\) is gone; stopping as on SIGTERM$",
                     out, re.MULTILINE), out[-3000:]
    assert "SIGTERM received" in out and "stopped by signal after step" in out, out[-3000:]
    assert sorted(re.findall(r"Process (\d+) exits successfully", out)) == sorted(str(p.pid) for p in ranks), out[-3000:]
    steps = [m["step"] for m in read_metrics(metrics)]
    latest = (ck / "latest").read_text()
    assert latest == f"step{steps[-1]:08d}" and (ck / latest / "complete.json").exists()
    _train(2, tmp_path, "m", ["--pp", "2", "--steps", str(steps[-1] + 2), "--load", str(ck)])
    assert [m["step"] for m in read_metrics(metrics)] == list(range(1, steps[-1] + 3))


def _gone(p: psutil.Process) -> bool:
    try:
        return p.status() == psutil.STATUS_ZOMBIE  # exited; the launcher reaps it within a second
    except psutil.NoSuchProcess:
        return True


FROZEN_HEARTBEAT_S = 8  # four missed beats (every 2 s); shorter than the runs' 60 s default to keep the suite short


class _TimedLines:
    """A job's combined output read line by line in a thread, each line with the time it came:
    a job that outlives its bound is reported with when each line came, not only what it said."""

    def __init__(self, job: subprocess.Popen):
        self.lines = []
        self._thread = threading.Thread(target=self._read, args=(job.stdout,), daemon=True)
        self._thread.start()

    def _read(self, stream) -> None:
        for line in stream:
            self.lines.append((time.monotonic(), line))

    def text(self, join_timeout_s: float = 30.0) -> str:
        """Everything, once the stream has ended (the ranks hold it until they exit)."""
        self._thread.join(timeout=join_timeout_s)
        return "".join(line for _, line in self.lines)

    def since(self, start: float) -> str:
        return "".join(f"{at - start:+7.1f} s  {line}" for at, line in self.lines
                       if "real_accelerator.py" not in line)


def _freeze_one_rank(tmp_path, frozen: int):
    """A pp=3 job, its collectives allowed 600 s, with rank `frozen` SIGSTOPped after step 3:
    its silence stalls the others inside a collective as a frozen GPU peer does on NCCL. The
    others leave after train.heartbeat_timeout_s (8), and a sibling must SIGKILL the frozen one:
    the `deepspeed` command ends sooner than its launcher's own kill could have ended it (the
    heartbeat bound + 30 s). Returns the job's output and its metrics file; the checkpoint
    directory's `latest` is complete."""
    ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    job = _start(3, ["--pp", "3", "--steps", "1000", "--save", str(ck), "--save-every", "2",
                     "--metrics-out", str(metrics), "--set", f"train.heartbeat_timeout_s={FROZEN_HEARTBEAT_S}",
                     "--set", "train.dist_timeout_s=600"])
    output = _TimedLines(job)
    try:
        assert _wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 3)
        time.sleep(2.5)  # a heartbeat (every 2 s) after step 3: the line must name a step >= 3
        ranks = _training_pids(job)
        ranks[frozen].suspend()  # SIGSTOP
        frozen_at = time.monotonic()
        # The whole job, launcher included, before the launcher's own SIGKILL could have ended it:
        # on an idle machine it ends about 12 s after the freeze; a niced test worker beside busy
        # ones has taken more than 28 s.
        try:
            job.wait(timeout=FROZEN_HEARTBEAT_S + LAUNCHER_KILL_WAIT_S)
        except subprocess.TimeoutExpired:
            pass
        ended_s = time.monotonic() - frozen_at
        print(f"the job ended {ended_s:.1f} s after rank {frozen} froze")
    finally:
        if job.poll() is None:  # a failed check: leave nothing running (the frozen rank included)
            for p in _training_pids(job) + [psutil.Process(job.pid)]:
                p.kill()
            job.wait(timeout=30)
    out = output.text()
    assert ended_s < FROZEN_HEARTBEAT_S + LAUNCHER_KILL_WAIT_S, (
        f"the job outlived the freeze by {ended_s:.0f} s; its output, timed from the freeze:\n"
        + output.since(frozen_at)[-6000:])
    assert all(_gone(p) for p in ranks), "a rank outlived the job"
    assert job.returncode != 0, out[-3000:]
    assert f"sent SIGKILL to lost rank {frozen} (pid {ranks[frozen].pid} on this host)" in out, out[-3000:]
    print("\n".join(line for line in out.splitlines() if line.startswith("error: ")))
    latest = (ck / "latest").read_text()
    assert (ck / latest / "complete.json").exists()  # the resume point a requeued job starts from
    return out, metrics


def _steps_named(lines, marker: str, last_logged: int) -> None:
    for line in lines:
        step = int(line.split(marker)[1].split(";")[0].split()[0])
        assert 3 <= step <= last_logged, (line, last_logged)


@pytest.mark.waits
@pytest.mark.slow
def test_frozen_rank_is_named_and_every_other_rank_exits(tmp_path):
    """Rank 1 frozen: each other rank names it, its host and its last completed step."""
    out, metrics = _freeze_one_rank(tmp_path, 1)
    lost = [line for line in out.splitlines() if "stopping: rank 1 failed: lost: no heartbeat for" in line]
    assert sorted(line.split()[2] for line in lost) == ["0:", "2:"], out[-3000:]
    assert all(line.endswith("(noticed by rank 0)") for line in lost), lost
    _steps_named(lost, "last completed step ", read_metrics(metrics)[-1]["step"])


@pytest.mark.waits
@pytest.mark.slow
def test_frozen_rank_0_is_named_as_the_lost_store(tmp_path):
    """Rank 0 frozen: it hosts the rendezvous store, so the others find the store silent and each
    says rank 0 is lost; once the first of them has killed rank 0, the others may find the store
    gone instead of silent (a reset connection), and say that."""
    out, metrics = _freeze_one_rank(tmp_path, 0)
    lost = [line for line in out.splitlines() if "stopping: rank 0 lost: the rendezvous store it hosts" in line
            and ("did not answer" in line or "is gone" in line)]
    assert sorted(line.split()[2] for line in lost) == ["1:", "2:"], out[-3000:]
    # rank 0 writes the metrics: frozen between a step's end and its record, it logged one step
    # fewer than the others completed
    _steps_named(lost, "last completed step here: ", read_metrics(metrics)[-1]["step"] + 1)


@pytest.mark.waits
@pytest.mark.slow
def test_sigterm_while_a_peer_is_frozen_leaves_after_the_grace(tmp_path):
    """SIGTERM to rank 0 while rank 1 is frozen (its step can never end; heartbeats and
    collectives allowed longer than the test): rank 0 leaves without a save within
    train.stop_grace_s (5) + 15 s, with one line, exit 128+15; `latest` stays complete."""
    ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    job = _forked(2, ["--pp", "2", "--steps", "1000", "--save", str(ck), "--save-every", "2",
                      "--metrics-out", str(metrics), "--set", "train.stop_grace_s=5",
                      "--set", "train.heartbeat_timeout_s=600", "--set", "train.dist_timeout_s=600"])
    try:
        ranks = job.ranks()
        assert _wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 3)
        ranks[1].suspend()
        time.sleep(1.0)  # rank 0 is now waiting for rank 1 inside the step
        ranks[0].send_signal(signal.SIGTERM)
        signalled_at = time.monotonic()
        assert _wait_for(lambda: _gone(ranks[0]), timeout=5 + 15), "rank 0 still running"
        seconds = time.monotonic() - signalled_at
        print(f"rank 0 left {seconds:.1f} s after SIGTERM")
        assert seconds >= 5.0
    finally:
        job.kill()  # rank 1 is frozen: the rank server would wait its own grace for it
    proc = job.result()
    assert proc.returncode == 128 + signal.SIGTERM, proc.returncode  # rank 0's, the first to exit
    out = proc.stdout + proc.stderr
    assert "rank 0: SIGTERM received; saving after this step" in out, out[-3000:]
    line = next((line for line in out.splitlines() if line.startswith("error: rank 0: the step did not end")), "")
    assert ("of the SIGTERM (train.stop_grace_s=5, or twice the longest step); leaving without saving (the last "
            "complete checkpoint stays the resume point)") in line, out[-3000:]
    assert "stopped by signal" not in out
    latest = (ck / "latest").read_text()
    assert (ck / latest / "complete.json").exists()
