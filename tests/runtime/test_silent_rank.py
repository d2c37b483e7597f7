"""A rank that falls silent, checked in process (forked processes on one TCPStore, no launcher):
a peer whose heartbeat stops is declared lost, a frozen store means rank 0 is lost, and a stop
request leaves after train.stop_grace_s when the step never ends (launch/resilience/failure.py,
launch/resilience/signals.py). The launched frozen-rank tests are in tests/e2e/test_checkpoint_crashes.py."""
import json
import os
import signal
import time
from pathlib import Path

import pytest

from helpers.children import end, exit_code, fork, redirect_output, wait_for_file


def _blocked_rank(grace_s: float, ready: Path, out: Path) -> None:
    """A forked child: a StopRequest, then a wait that never ends in C++ code (the store's, as a
    collective with a frozen peer waits), where no Python signal handler can run. Never returns."""
    try:
        redirect_output(out)
        from datetime import timedelta
        import torch.distributed as dist
        from launch.resilience.signals import StopRequest
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(hours=1))
        StopRequest(3, grace_s)
        ready.touch()
        store.wait(["never set"])
    finally:
        os._exit(99)


def _run_signalled(tmp_path, child, child_args, signal_gaps_s, limit_s: float):
    """(exit code, seconds from the first signal to the exit, output) of a forked `child(*child_args,
    ready, out)` sent SIGTERM once it touched `ready`, then again after each of `signal_gaps_s`; an
    AssertionError if it runs for limit_s after the first signal."""
    ready, out = tmp_path / "ready", tmp_path / "out"
    pid = os.fork()
    if pid == 0:
        child(*child_args, ready, out)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready.exists(), out.read_text() if out.exists() else "no output"
        start = time.monotonic()
        os.kill(pid, signal.SIGTERM)
        for gap_s in signal_gaps_s:
            time.sleep(gap_s)
            os.kill(pid, signal.SIGTERM)
        while time.monotonic() < start + limit_s:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return os.waitstatus_to_exitcode(status), time.monotonic() - start, out.read_text()
            time.sleep(0.05)
        raise AssertionError(f"still running {limit_s} s after SIGTERM: {out.read_text()}")
    finally:
        end(pid)


@pytest.mark.waits
def test_stop_request_leaves_without_a_save_when_the_step_never_ends(tmp_path):
    """SIGTERM while the main thread waits forever (a peer frozen inside a collective), and again
    0.5 s later (the same request, as a launcher forwarding it): the rank says so and exits 128+15
    once train.stop_grace_s has passed, not before, without a save."""
    code, seconds, out = _run_signalled(tmp_path, _blocked_rank, (2.0,), [0.5], limit_s=12)
    assert code == 128 + signal.SIGTERM, out
    assert 2.0 <= seconds < 5.0, seconds
    assert "rank 3: SIGTERM received; saving after this step" in out
    lines = [line for line in out.splitlines() if line.startswith("error: ")]
    assert lines == ["error: rank 3: the step did not end within 2 s of the SIGTERM (train.stop_grace_s=2, or twice "
                     "the longest step); leaving without saving (the last complete checkpoint stays the resume "
                     "point)"], out


@pytest.mark.waits
def test_a_second_request_leaves_at_once_while_the_step_never_ends(tmp_path):
    """A signal more than SAME_REQUEST_S after the first is a second request: exit at once. (The
    window runs from when the rank's thread took the first signal, which a loaded machine may
    delay: the second comes 1.5 s after the window.)"""
    from launch.resilience.signals import SAME_REQUEST_S
    code, seconds, out = _run_signalled(tmp_path, _blocked_rank, (60.0,), [SAME_REQUEST_S + 1.5], limit_s=12)
    assert code == 128 + signal.SIGTERM, out
    assert seconds < SAME_REQUEST_S + 4.0, seconds
    assert "error: " not in out, out


def _steps_of_one_rank(steps, grace_s: float, ready: Path, out: Path) -> None:
    """A forked child: a one-rank process group and a StopRequest; `steps` is a list of ("step", s)
    (a step of s seconds, then `agreed`) and ("save", s) (a periodic save of s seconds); `ready` is
    touched as the item with a third element starts. Once the ranks agreed to stop: a 0.5 s save,
    the line "saved after the request", exit 0. Never returns."""
    try:
        redirect_output(out)
        import torch.distributed as dist
        from launch.engine.distributed import free_port
        from launch.instruments.stragglers import gather_step_numbers
        from launch.resilience.signals import StopRequest
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        stop = StopRequest(0, grace_s)
        for kind, seconds, *mark in steps:
            if mark:
                ready.touch()
            if kind == "save":
                with stop.saving():
                    time.sleep(seconds)
                continue
            time.sleep(seconds)
            # as launch/trainer/loop.py: the flags ride in the step's all-gather
            if stop.agreed(gather_step_numbers(seconds, 0.0, 0, None, stop.signalled, "cpu").stop_requested):
                with stop.saving():
                    time.sleep(0.5)
                print("saved after the request", flush=True)
                os._exit(0)
        print("never stopped", flush=True)
    finally:
        os._exit(99)


@pytest.mark.waits
def test_a_stop_request_never_cuts_a_save_or_a_long_step_short(tmp_path):
    """With train.stop_grace_s=1, SIGTERM twice (0.3 s apart, one request) during a 2.5 s
    periodic save: the save ends, the next step ends, the run saves and exits 0. And SIGTERM at the
    start of a 1.5 s step, after steps as long: the wait is twice the longest step, so it saves."""
    during_save = [("step", 0.2), ("step", 0.2), ("save", 2.5, "signal here"), ("step", 0.2)]
    code, seconds, out = _run_signalled(tmp_path, _steps_of_one_rank, (during_save, 1.0), [0.3], limit_s=15)
    assert code == 0 and "saved after the request" in out and "error: " not in out, out
    assert seconds >= 2.0, seconds  # the save ran on past the grace
    (tmp_path / "ready").unlink()
    long_steps = [("step", 1.5), ("step", 1.5), ("step", 1.5, "signal here"), ("step", 1.5)]
    code, seconds, out = _run_signalled(tmp_path, _steps_of_one_rank, (long_steps, 1.0), [], limit_s=15)
    assert code == 0 and "saved after the request" in out and "error: " not in out, out


def _a_save_signalled_twice(stop_save: bool, ready: Path, out: Path) -> None:
    """A forked child: a one-rank process group, a StopRequest (grace 1 s), two 0.2 s steps, then a
    5 s save: the stop's own (`stop_save`: the parent's first SIGTERM comes in the 0.5 s step before
    it, so the ranks agree to stop after that step) or a periodic one (the first SIGTERM comes at its
    start). "committed" ends the save; `saved` follows as launch/trainer/loop.py calls it, then
    "trained on" if the rank goes on. Never returns."""
    try:
        redirect_output(out)
        import torch.distributed as dist
        from launch.engine.distributed import free_port
        from launch.instruments.stragglers import gather_step_numbers
        from launch.resilience.signals import StopRequest
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        stop = StopRequest(0, 1.0)
        for _ in range(2):
            time.sleep(0.2)
            stop.agreed(False)
        if stop_save:
            ready.touch()
            time.sleep(0.5)
        else:
            time.sleep(0.2)
        stopping = stop.agreed(gather_step_numbers(0.5, 0.0, 0, None, stop.signalled, "cpu").stop_requested)
        assert stopping == stop_save, stopping
        with stop.saving():
            if not stop_save:
                ready.touch()
            time.sleep(5.0)
            print("committed", flush=True)
        stop.saved(Path("ck/step00000003"), logging_rank=True)
        print("trained on", flush=True)
    finally:
        os._exit(99)


@pytest.mark.waits
@pytest.mark.parametrize("stop_save", [True, False], ids=["stop save", "periodic save"])
def test_a_later_request_during_a_save_lets_it_finish(tmp_path, stop_save):
    """A SIGTERM 3.5 s after the first (a second request) while a 5 s save runs: one line says the
    save finishes first; the rank leaves right after it, without training on: exit 0 after the
    stop's own save (every rank agreed to stop there), 128+15 after a periodic one."""
    from launch.resilience.signals import SAME_REQUEST_S
    code, seconds, out = _run_signalled(tmp_path, _a_save_signalled_twice, (stop_save,),
                                        [SAME_REQUEST_S + 1.5], limit_s=15)
    expected = 0 if stop_save else 128 + signal.SIGTERM
    assert code == expected, out
    lines = out.splitlines()
    assert lines.index(f"rank 0: SIGTERM again during a save: the save finishes first, then this rank leaves "
                       f"(exit {expected})") < lines.index("committed"), out
    assert lines[lines.index("committed") + 1].startswith("saved ck/step00000003 in 5."), out
    assert lines[-1] == f"rank 0: leaving after the save, as the SIGTERM during it asked (exit {expected})", out
    assert "error: " not in out and "trained on" not in out, out


def _watchers_one_falls_silent(silent: Path, out: Path) -> None:
    """A forked child: the watchers of ranks 0 and 1 of a world of 2 on one store, live for 5 s
    (longer than their 3 s timeout), then rank 1's stops beating, as a frozen process's does.
    Rank 0's must exit 1; never returns."""
    try:
        redirect_output(out)
        from datetime import timedelta
        import torch.distributed as dist
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), RANK="0")
        from launch.resilience.failure import FailureWatcher
        rank0 = FailureWatcher(0, 2, heartbeat_timeout_s=3)
        rank1 = FailureWatcher(1, 2, heartbeat_timeout_s=3)
        rank0.completed(6)
        rank1.completed(7)
        time.sleep(5)
        rank1.stop()
        silent.touch()
        time.sleep(30)
    finally:
        os._exit(99)


@pytest.mark.waits
def test_a_rank_whose_heartbeat_stops_is_declared_lost():
    """Live heartbeats keep a rank alive past the timeout; once they stop, its watcher (the
    ring's predecessor) names it, its host and its last completed step, and exits 1 within the
    timeout plus a heartbeat interval and a poll."""
    import socket
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        silent, out = Path(tmp) / "silent", Path(tmp) / "out"
        pid = os.fork()
        if pid == 0:
            _watchers_one_falls_silent(silent, out)
        try:
            code = exit_code(pid, limit_s=60)
            exited = time.time()
            text = out.read_text()
            assert silent.exists(), text  # not declared lost while it was beating
            seconds = exited - silent.stat().st_mtime
            assert code == 1, text
            # Not before the timeout after the last beat, which came up to one heartbeat interval (2 s)
            # before the beats stopped (measured once: declared lost 2.06 s after the stop, "no heartbeat
            # for 4 s"); after it, within an interval and a poll, plus 3 s for a loaded CI machine.
            assert 3.0 - 2.0 <= seconds < 10.0, (seconds, text)
            lines = [line for line in text.splitlines() if line.startswith("error: ")]
            assert len(lines) == 1, text
            assert lines[0].startswith("error: rank 0: stopping: rank 1 failed: lost: no heartbeat for "), lines
            assert (f"from host {socket.gethostname()}, last completed step 7; killed, frozen or cut off "
                    f"(noticed by rank 0)") in lines[0], lines
        finally:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _store_host(port_file: Path) -> None:
    """A forked child: the rendezvous store, as rank 0 hosts it; never returns (killed by the test)."""
    try:
        from datetime import timedelta
        import torch.distributed as dist
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
        port_file.write_text(str(store.port))
        time.sleep(120)
    finally:
        os._exit(99)


def _watchers_of(port: int, ready: Path, out: Path) -> None:
    """A forked child: the watchers of ranks 1 and 2 of a world of 3 whose rank 0 hosts the store
    at `port`; never returns."""
    try:
        redirect_output(out)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="1")
        from launch.resilience.failure import FailureWatcher
        watchers = [FailureWatcher(rank, 3, heartbeat_timeout_s=3) for rank in (1, 2)]
        for watcher in watchers:  # either may be the first to leave on a loaded machine
            watcher.completed(4)
        ready.touch()
        time.sleep(60)
    finally:
        os._exit(99)


@pytest.mark.waits
def test_a_frozen_store_means_rank_0_is_lost(tmp_path):
    """A slow store is not a lost one; rank 0 frozen (its store with it) is: the other ranks' watchers
    exit 1 within the heartbeat timeout plus a request's timeout and a poll, naming rank 0, the
    store's address and their last completed step. (Rank 0's heartbeat is never written here: the store's silence, not a
    stale heartbeat, must be what they report.)"""
    port_file, ready, out = tmp_path / "port", tmp_path / "ready", tmp_path / "out"
    host = fork(_store_host, port_file)
    watchers = None
    try:
        assert wait_for_file(port_file)
        port = int(port_file.read_text())
        watchers = fork(_watchers_of, port, ready, out)
        assert wait_for_file(ready), out.read_text()
        # First slow, not gone: each request answered within 1.5 s, a poll's five requests in up to
        # ~5 s, longer than the 3 s timeout. Timed per request, the store is not declared lost.
        # Rank 0's heartbeat goes on meanwhile (written here: this test has no rank 0 watcher).
        from datetime import timedelta
        import torch.distributed as dist
        rank0 = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=30))
        for beat in range(2):
            rank0.set("gpt3d/heartbeat/0", f"{beat} 4 elsewhere 1 1")
            os.kill(host, signal.SIGSTOP)
            time.sleep(1.5)
            os.kill(host, signal.SIGCONT)
            time.sleep(0.2)
        assert exit_code(watchers, limit_s=0.1) is None, out.read_text()
        os.kill(host, signal.SIGSTOP)  # the store stops answering, as it does when rank 0 is frozen
        frozen_at = time.monotonic()
        code = exit_code(watchers, limit_s=20)
        seconds = time.monotonic() - frozen_at
        text = out.read_text()
        assert code == 1, text
        assert 3.0 <= seconds < 3 + 1 + 1 + 3 + 2, (seconds, text)  # + 2 s for a loaded CI machine
        lines = [line for line in text.splitlines() if line.startswith("error: ")]
        assert len(lines) == 1, text
        assert lines[0].startswith(f"error: rank 1: stopping: rank 0 lost: the rendezvous store it hosts "
                                   f"(127.0.0.1:{port}) did not answer a request for "), lines
        assert lines[0].endswith("see its log; last completed step here: 4"), lines
    finally:
        for pid in (host, watchers):
            if pid is not None:
                end(pid)


def _frozen_then_resumed(ready: Path, out: Path) -> None:
    """A forked child: the watcher of rank 0 of a world of 1 (timeout 3 s) beside a main thread
    that waits, as in a collective. The parent freezes it (SIGSTOP) for longer than the timeout and
    resumes it: its peers have declared it lost and left, so it must leave too. Never returns."""
    try:
        redirect_output(out)
        from datetime import timedelta
        import torch.distributed as dist
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(hours=1))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), RANK="0")
        from launch.resilience.failure import FailureWatcher
        FailureWatcher(0, 1, heartbeat_timeout_s=3)
        ready.touch()
        time.sleep(60)
    finally:
        os._exit(99)


@pytest.mark.waits
def test_a_resumed_frozen_rank_leaves_with_one_line(tmp_path):
    """A rank frozen past the timeout and resumed (SIGCONT: a rank on a host whose launcher did not
    kill it) finds the gap in its own clock and exits 1 at once, saying why."""
    ready, out = tmp_path / "ready", tmp_path / "out"
    pid = fork(_frozen_then_resumed, ready, out)
    try:
        assert wait_for_file(ready), out.read_text()
        os.kill(pid, signal.SIGSTOP)
        time.sleep(4.5)
        os.kill(pid, signal.SIGCONT)
        resumed = time.monotonic()
        code = exit_code(pid, limit_s=10)
        assert code == 1 and time.monotonic() - resumed < 3.0, (code, out.read_text())
        lines = [line for line in out.read_text().splitlines() if line.startswith("error: ")]
        assert len(lines) == 1 and "this process did not run for" in lines[0] \
            and "its peers have declared it lost" in lines[0], lines
    finally:
        end(pid)


def _named_store_host(port_file: Path, out: Path) -> None:
    """A forked child: rank 0 of a world of 2, hosting the store, its failure watcher running;
    never returns (its watcher ends it)."""
    try:
        redirect_output(out)
        from datetime import timedelta
        import torch.distributed as dist
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), RANK="0")
        from launch.resilience.failure import FailureWatcher
        FailureWatcher(0, 2, heartbeat_timeout_s=60)
        port_file.write_text(str(store.port))
        time.sleep(60)
    finally:
        os._exit(99)


@pytest.mark.waits
def test_rank_0_named_in_another_ranks_report_keeps_the_store_until_the_publisher_is_done(tmp_path):
    """Rank 1 publishes a hang line naming rank 0 (here the test, as rank 1): rank 0 reads it and
    acknowledges, but leaves only once the publisher marked the report done, since its exit takes
    the store with it (leaving at once, it closed the store under the publisher, whose last
    requests failed with "Broken pipe")."""
    from datetime import timedelta
    import torch.distributed as dist
    from launch.resilience.failure import _ACK, _DONE, _KEY
    port_file, out = tmp_path / "port", tmp_path / "out"
    host = fork(_named_store_host, port_file, out)
    try:
        assert wait_for_file(port_file), out.read_text() if out.exists() else "no output"
        rank1 = dist.TCPStore("127.0.0.1", int(port_file.read_text()), is_master=False, wait_for_workers=False,
                              timeout=timedelta(seconds=30))
        rank1.compare_set(_KEY, "", "rank 0: hang: no step ended for 9 s (bound 5 s); rank 0 at x.py:1")
        deadline = time.monotonic() + 20
        while int(rank1.add(_ACK, 0)) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert int(rank1.add(_ACK, 0)) == 1, out.read_text()
        assert exit_code(host, limit_s=1.0) is None, out.read_text()  # still hosting the store
        rank1.set(_DONE, "1")
        assert exit_code(host, limit_s=5) == 1, out.read_text()
        lines = [line for line in out.read_text().splitlines() if line.startswith("error: ")]
        assert lines == ["error: rank 0: stopping: rank 0 failed: hang: no step ended for 9 s (bound 5 s); "
                         "rank 0 at x.py:1"], out.read_text()
    finally:
        end(host)


def _store_host_committing(root: Path, ready: Path, out: Path) -> None:
    """A forked child: rank 0 of a world of 2, hosting the store with its failure watcher, then
    committing a checkpoint whose directory fsyncs take 0.75 s each (slow storage); never returns
    (its watcher ends it)."""
    try:
        redirect_output(out)
        from datetime import timedelta
        import torch.distributed as dist
        from launch.checkpoints import store as checkpoint_store
        served = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(served.port), RANK="0")
        from launch.resilience.failure import FailureWatcher
        FailureWatcher(0, 2, heartbeat_timeout_s=60)
        fsync_dir = checkpoint_store.fsync_dir

        def slow_fsync_dir(path):
            time.sleep(0.75)
            fsync_dir(path)
        checkpoint_store.fsync_dir = slow_fsync_dir
        ready.write_text(str(served.port))
        checkpoint_store._commit(root, "step00000002", {"step": 2})
        time.sleep(60)
    finally:
        os._exit(99)


@pytest.mark.waits
def test_a_rank_leaving_on_another_ranks_failure_lets_its_commit_end(tmp_path):
    """Rank 1 fails while rank 0 commits a checkpoint every rank has written (complete.json, then
    `latest`, on storage slow to fsync): rank 0 follows the report, but leaves only once the commit
    has ended, so the checkpoint stays the resume point (leaving at the report, it cut the commit:
    no `latest`, and a requeued job started from the save before)."""
    from datetime import timedelta
    import torch.distributed as dist
    import launch.checkpoints.store  # noqa: F401 (imported once here: the child forks with it)
    from launch.resilience.failure import _DONE, _KEY
    root, ready, out = tmp_path / "ck", tmp_path / "port", tmp_path / "out"
    (root / "step00000002" / "global_step2").mkdir(parents=True)
    (root / "step00000002" / "global_step2" / "layer_00-model_states.pt").write_bytes(b"0" * 64)
    host = fork(_store_host_committing, root, ready, out)
    try:
        assert wait_for_file(ready), out.read_text() if out.exists() else "no output"
        rank1 = dist.TCPStore("127.0.0.1", int(ready.read_text()), is_master=False, wait_for_workers=False,
                              timeout=timedelta(seconds=30))
        rank1.compare_set(_KEY, "", "rank 1: RuntimeError: boom (at x.py:1)")
        rank1.set(_DONE, "1")  # the publisher is done with the store: rank 0 may leave as soon as it read it
        assert exit_code(host, limit_s=20) == 1, out.read_text()
        assert (root / "latest").read_text() == "step00000002", out.read_text()
        assert json.loads((root / "step00000002" / "complete.json").read_text())["step"] == 2
        lines = [line for line in out.read_text().splitlines() if line.startswith("error: ")]
        assert lines == ["error: rank 0: stopping: rank 1 failed: RuntimeError: boom (at x.py:1)"], out.read_text()
    finally:
        end(host)
