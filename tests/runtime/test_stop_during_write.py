"""A second SIGTERM while train.async_save's background write is in flight (launch/resilience/signals.py:
StopRequest.saved, whose `before_leaving` is launch/trainer/loop.py's finish_save): the rank leaves
only once the write is committed. In process: a forked one-rank child, no launcher. (A second
SIGTERM during a synchronous save: tests/runtime/test_silent_rank.py.)"""
import os
import signal
import time
from pathlib import Path

import pytest

from helpers.children import end, exit_code, fork, redirect_output, wait_for_file


def _async_save_signalled_twice(root: Path, ready: Path, out: Path) -> None:
    """A forked child: a one-rank process group, a StopRequest and an asynchronous save whose
    background write is held until `saved` calls `before_leaving` (as finish_save waits for it),
    and whose commit writes `latest`. The parent's first SIGTERM comes as the save starts, the
    second (a later request) during it. Never returns."""
    try:
        redirect_output(out)
        import threading
        import torch
        import torch.distributed as dist
        from launch.checkpoints import async_save
        from launch.engine.distributed import free_port
        from launch.resilience.signals import StopRequest
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        stop = StopRequest(0, 1.0)
        saver = async_save.AsyncSaver(timeout_s=30)
        saver.group = dist.new_group(backend="gloo")
        leaving, write = threading.Event(), async_save.write_file

        def held_write(obj, path):
            leaving.wait(20)  # the write runs on after the save returned, until the rank would leave
            time.sleep(0.5)
            write(obj, path)
        async_save.write_file = held_write

        def commit():
            (root / "latest").write_text("step00000003")
            print("committed", flush=True)

        def finish_save():  # launch/trainer/loop.py's, without the starts record
            leaving.set()
            saver.wait()
        (root / "step00000003").mkdir(parents=True)
        with stop.saving():
            ready.touch()
            saver.start([(root / "step00000003" / "w.pt", {"w": torch.ones(4)})], 0, commit)
            deadline = time.monotonic() + 20
            while stop._after_save is None and time.monotonic() < deadline:  # the parent's second request
                time.sleep(0.05)
        stop.saved(root / "step00000003", logging_rank=False, asynchronous=True, before_leaving=finish_save)
        print("trained on", flush=True)
    finally:
        os._exit(99)


@pytest.mark.waits
def test_a_later_request_during_a_background_write_waits_for_its_commit(tmp_path):
    """SIGTERM as an asynchronous save starts, again SAME_REQUEST_S + 0.5 s later (a second request):
    the rank leaves with 128+15 (a periodic save), after the background write committed `latest`."""
    from launch.resilience.signals import SAME_REQUEST_S
    ready, out, root = tmp_path / "ready", tmp_path / "out", tmp_path / "ck"
    pid = fork(_async_save_signalled_twice, root, ready, out)
    try:
        assert wait_for_file(ready), out.read_text() if out.exists() else "no output"
        os.kill(pid, signal.SIGTERM)
        time.sleep(SAME_REQUEST_S + 0.5)
        os.kill(pid, signal.SIGTERM)
        code = exit_code(pid, 30)
    finally:
        end(pid)
    text = out.read_text()
    assert code == 128 + signal.SIGTERM, text
    lines = text.splitlines()
    assert "rank 0: SIGTERM again during a save: the save finishes first, then this rank leaves (exit 143)" in lines
    assert lines.index("committed") < lines.index(
        "rank 0: leaving after the save, as the SIGTERM during it asked (exit 143)"), text
    assert (root / "latest").read_text() == "step00000003" and (root / "step00000003" / "w.pt").is_file()
    assert "trained on" not in text, text
