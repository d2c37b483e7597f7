"""The save directory's record of starts and the cap on a requeue loop, in process
(launch/resilience/restarts.py); the launched proof, five starts of one failing command:
tests/e2e/test_requeue_cap.py."""
import json

import pytest

from helpers.launcher import TINY
from launch.checkpoints.locate import CheckpointRef, find_resume_point
from launch.errors import ConfigError
from launch.resilience import failure
from launch.resilience.restarts import KEEP, StartRecord, read_starts, refuse_a_requeue_loop
from launch.train import main


def _at_step(root, step):
    return CheckpointRef(root, f"step{step:08d}", {"step": step})


def _failed_starts(save, from_step, lines):
    for line in lines:
        record = StartRecord(save, from_step)
        if line is not None:
            record.failed(line)


def test_the_cap_counts_the_starts_in_a_row_from_one_checkpoint(tmp_path):
    """Two failed starts from step 2 pass, a third makes the next one refused; a start from another
    checkpoint breaks the row; a command that is not a requeue (another --load, or none) and a cap of
    0 are never refused."""
    save = tmp_path / "ck"
    save.mkdir()
    _failed_starts(save, 2, ["stopping: rank 1 failed: A", "rank 0: B"])
    refuse_a_requeue_loop(save, save, _at_step(save, 2), cap=3)
    _failed_starts(save, 2, ["rank 0: C"])
    with pytest.raises(ConfigError, match=r"the last 3 starts all began at the checkpoint of step 2 .*the last "
                                          r"failure: rank 0: C\. Another start"):
        refuse_a_requeue_loop(save, save, _at_step(save, 2), cap=3)
    refuse_a_requeue_loop(save, save, _at_step(save, 4), cap=3)  # a newer checkpoint: a new row
    refuse_a_requeue_loop(save, tmp_path / "other", _at_step(save, 2), cap=3)
    refuse_a_requeue_loop(save, None, None, cap=3)
    refuse_a_requeue_loop(save, save, _at_step(save, 2), cap=0)
    _failed_starts(save, 4, ["rank 0: D"])
    _failed_starts(save, 2, ["rank 0: E", "rank 0: F"])  # back at step 2: the row starts again
    refuse_a_requeue_loop(save, save, _at_step(save, 2), cap=3)


def test_a_row_of_starts_killed_without_a_word(tmp_path):
    """No start said a line (SIGKILL, a lost node); from no checkpoint: the line says both. The
    refusal is one line whatever a recorded line holds."""
    save = tmp_path / "ck"
    save.mkdir()
    _failed_starts(save, None, [None, None])
    with pytest.raises(ConfigError) as refused:
        refuse_a_requeue_loop(save, save, None, cap=2)
    assert "began at no checkpoint (step 1)" in str(refused.value)
    assert "the last failure: no line recorded: killed or lost, see the job's log." in str(refused.value)
    _failed_starts(save, None, ["rank 0: a line\nwith a newline\x1b[31m"])
    with pytest.raises(ConfigError) as refused:
        refuse_a_requeue_loop(save, save, None, cap=2)
    assert "\n" not in str(refused.value) and "\x1b" not in str(refused.value)
    assert "rank 0: a line\\nwith a newline\\x1b[31m" in str(refused.value)


def test_a_start_ends_once_with_its_first_line(tmp_path):
    """The first error line is the cause (failure.py says it before the echoes, such as a SIGKILL
    sent); a finished start records its step; the file keeps the newest KEEP starts, and lines that
    are not records are skipped."""
    save = tmp_path / "ck"
    save.mkdir()
    record = StartRecord(save, 2)
    record.failed("stopping: rank 1 failed: RuntimeError: boom")
    record.failed("sent SIGKILL to lost rank 1")
    StartRecord(save, 2).ended(5, stopped=False)
    StartRecord(save, 5).ended(7, stopped=True)
    assert [(r["from_step"], r["ended"]) for r in read_starts(save)] == [
        (2, "stopping: rank 1 failed: RuntimeError: boom"), (2, "finished at step 5"),
        (5, "stopped by a signal after step 7, saved")]
    with open(save / "starts.jsonl", "a") as f:
        f.write("not json\n[1, 2]\n" + json.dumps({"from_step": "2", "ended": None}) + "\n")
    assert len(read_starts(save)) == 3
    for _ in range(KEEP + 5):
        StartRecord(save, 9)
    assert len((save / "starts.jsonl").read_text().splitlines()) == KEEP


def test_rank_0_records_the_line_failure_py_says(tmp_path, monkeypatch, capfd):
    save = tmp_path / "ck"
    save.mkdir()
    record = StartRecord(save, None)
    monkeypatch.setattr(failure, "error_line_hook", record.failed)
    failure.say_error("stopping: rank 3 failed: lost: no heartbeat for 61 s", rank=0)
    assert capfd.readouterr().err == "error: rank 0: stopping: rank 3 failed: lost: no heartbeat for 61 s\n"
    assert read_starts(save)[-1]["ended"] == "stopping: rank 3 failed: lost: no heartbeat for 61 s"


def test_the_record_alone_is_no_checkpoint(tmp_path):
    """A run that failed before its first save left only starts.jsonl (and perhaps a temporary
    file of a write cut short): the requeue starts at step 1, as from an empty directory."""
    save = tmp_path / "ck"
    save.mkdir()
    _failed_starts(save, None, ["rank 0: boom"])
    (save / ".starts.jsonl.tmp123").write_text("cut")
    assert find_resume_point(save, save, is_writer=False) is None


def test_a_refused_requeue_is_one_line_and_exit_2_before_anything_starts(tmp_path, monkeypatch, capsys):
    """Through launch/train.py's main, in process: exit 2, one line, DIR untouched."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    save = tmp_path / "ck"
    save.mkdir()
    _failed_starts(save, None, ["rank 0: boom"] * 3)
    before = (save / "starts.jsonl").read_bytes()
    assert main(["--recipe", str(TINY), "--save", str(save), "--load", str(save)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --save {save}: the last 3 starts all began at no checkpoint") and \
        err.count("\n") == 1, err
    assert sorted(p.name for p in save.iterdir()) == ["starts.jsonl"]
    assert (save / "starts.jsonl").read_bytes() == before
