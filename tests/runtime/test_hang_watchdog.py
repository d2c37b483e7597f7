"""The hang watchdog: a rank that sleeps inside its step with its heartbeat
healthy ends the job within the bound, every rank's stacks are written, and one line names the
rank that is not in the collective the others wait in. And what each rank costs rank 0's store:
two connections, which is what the open-file check counts."""
import os
import pickle
import re
import time
from pathlib import Path

import pytest

from helpers.children import end, exit_code, fork, redirect_output
from helpers.distributed import run_body
from helpers.launcher import TINY, launch_forked, read_metrics
from launch.engine.distributed import STORE_CLIENTS_PER_RANK, ensure_open_file_limit, free_port, record_collectives
from launch.errors import ConfigError
from launch.resilience.hang_line import hang_line

BOUND_S = 3.0


def _steps_until_one_rank_hangs(stacks: str, hung_rank: int, hung_step: int) -> None:
    """A rank's training loop in miniature: each step one all-reduce; rank `hung_rank` sleeps
    for ever before step `hung_step` (the training loop's fault hook). An error in the main
    thread goes where launch/train.py sends it (report_failure): once the hung rank has left, a
    waiting rank's all-reduce fails, and the line it says is the published cause."""
    import torch
    import torch.distributed as dist
    from launch.resilience.failure import FailureWatcher, maybe_inject_fault, report_failure
    from launch.resilience.hang_watchdog import HangWatchdog
    rank, world = dist.get_rank(), dist.get_world_size()
    hang = HangWatchdog(rank, world, Path(stacks), hang_timeout_s=BOUND_S, first_step_timeout_s=60)
    FailureWatcher(rank, world, heartbeat_timeout_s=60, hang=hang)
    hang.start()
    try:
        for step in range(1, 1000):
            if (rank, step) == (hung_rank, hung_step):
                (Path(stacks) / "hung-at").write_text(repr(time.time()))
            maybe_inject_fault((hung_rank, hung_step, "hang"), rank, step)
            dist.all_reduce(torch.ones(1))
            time.sleep(0.2)
            hang.step_ended()
    except Exception as error:
        report_failure(error)


def _rank(rank: int, world: int, port: int, err: Path, fn, args) -> None:
    """A forked child: rank `rank` of a gloo group running fn(*args), its stderr into `err`."""
    code = 1
    try:
        redirect_output(err, stdout=False, append=True)
        record_collectives(os.environ)  # as every rank of a run does before its process group starts
        run_body(rank, world, port, fn, args)  # prints a failure
        code = 0
    finally:
        os._exit(code)


def _run_ranks(fn, world: int, *args, timeout: float = 60):
    """fn(*args) on `world` processes forked from this one, in a gloo group on a free port (no rank
    server to start: these tests time what happens in the ranks); (the first non-zero exit code,
    or 0; their stderr together). Ranks still running after `timeout` are killed (code None)."""
    import tempfile
    port, err = free_port(), Path(tempfile.mkdtemp()) / "stderr"
    pids = [fork(_rank, rank, world, port, err, fn, args) for rank in range(world)]
    deadline = time.monotonic() + timeout
    codes = [exit_code(pid, max(0.1, deadline - time.monotonic())) for pid in pids]
    for pid, code in zip(pids, codes):
        if code is None:
            end(pid)
    failing = [c for c in codes if c != 0]
    return (failing[0] if failing else 0), err.read_text() if err.exists() else ""


@pytest.mark.waits
def test_a_rank_sleeping_in_its_step_is_named_and_every_rank_leaves_its_stacks(tmp_path):
    code, stderr = _run_ranks(_steps_until_one_rank_hangs, 3, str(tmp_path), 1, 3)
    assert code == 1, stderr[-3000:]
    # The job ended within the bound (from the last step's end, up to 0.2 s before the hang), a
    # poll, the gather and the ranks' exit: 2 s, plus 4 s for a loaded CI machine.
    seconds = time.time() - float((tmp_path / "hung-at").read_text())
    assert seconds < BOUND_S + 6, seconds
    lines = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert sorted(":".join(line.split(":")[:2]) for line in lines) == ["error: rank 0", "error: rank 1", "error: rank 2"], stderr
    named = lines[0].split("stopping: ", 1)[1]
    assert all(line.endswith(named) for line in lines), lines  # one cause, said by every rank
    assert re.match(r"rank 1 failed: hang: no step ended for [345] s \(bound 3 s", named), named
    assert "rank 1 at launch/resilience/failure.py:" in named and "in maybe_inject_fault" in named, named
    assert "while 2 other ranks wait in torch.distributed.all_reduce (from tests/runtime/test_hang_watchdog.py:" in named
    assert named.endswith(f"every rank's stacks are in {tmp_path}/rank-*.txt"), named
    stacks = {r: (tmp_path / f"rank-{r:05d}.txt").read_text() for r in range(3)}
    assert sorted(p.name for p in tmp_path.iterdir()) == (["flight-recorder", "hung-at"]
                                                         + [f"rank-0000{r}.txt" for r in range(3)])
    # torch's flight recorder, dumped beside the stacks: ranks 0 and 2 entered the third all-reduce,
    # rank 1 never did (on NCCL this, not the Python frame, names the collective; gloo records no
    # completion, NCCL does).
    records = {r: pickle.loads((tmp_path / "flight-recorder" / f"rank_{r}").read_bytes())["entries"] for r in range(3)}
    entered = {r: [e["collective_seq_id"] for e in entries if e["profiling_name"] == "gloo:all_reduce"]
               for r, entries in records.items()}
    assert entered == {0: [1, 2, 3], 1: [1, 2], 2: [1, 2, 3]}, entered
    assert "in maybe_inject_fault" in stacks[1] and "in all_reduce" not in stacks[1], stacks[1]
    for r in (0, 2):
        assert "in all_reduce" in stacks[r] and "_steps_until_one_rank_hangs" in stacks[r], stacks[r]
        assert "gpt3d-failure-watcher" in stacks[r] or "Thread 0x" in stacks[r], stacks[r]  # every thread


@pytest.mark.waits
@pytest.mark.slow
def test_a_training_run_with_a_hung_rank_ends_with_its_name_and_keeps_its_saves(tmp_path):
    """launch/train.py at dp 2, a save every 2 steps (the clock pauses in it), rank 1 asleep
    before step 3 with its heartbeat beating: the job exits 1 within the 5 s bound and a few polls,
    every rank names rank 1, the stacks lie in the save directory, step 2's checkpoint is kept."""
    save = tmp_path / "ckpt"
    began = time.monotonic()
    proc = launch_forked(2, ["--recipe", str(TINY), "--steps", "6", "--set", "train.eval_every=0",
                             "--set", "train.hang_timeout_s=5", "--save", str(save), "--save-every", "2"],
                         env={"GPT3D_FAULT_INJECT": "1:3:hang"}, timeout=300)
    seconds = time.monotonic() - began
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 2 and all("stopping: rank 1 failed: hang: no step ended for " in line for line in lines), lines
    assert re.search(r"no step ended for [5-9] s \(bound 5 s", lines[0]), lines
    assert "rank 1 at launch/resilience/failure.py:" in lines[0] and "while 1 other rank waits in torch.distributed." \
        in lines[0], lines
    assert sorted(p.name for p in (save / "hang-stacks").iterdir()) == ["flight-recorder", "rank-00000.txt",
                                                                        "rank-00001.txt"]
    assert sorted(p.name for p in (save / "hang-stacks" / "flight-recorder").iterdir()) == ["rank_0", "rank_1"]
    assert (save / "latest").read_text().strip().endswith("2"), list(save.iterdir())
    print(f"hang: the job ended {seconds:.1f} s after its start; {lines[0]}")


def test_the_line_names_who_is_not_where_the_others_are(tmp_path):
    wait = "in torch.distributed.all_reduce (from launch/trainer/loop.py:170)"
    recv = "in torch.distributed.recv (from deepspeed p2p)"
    outside = "at model/gpt/pipe.py:40 in forward"
    step = "no step ended for 61 s (bound 60 s, train.hang_timeout_s / train.first_step_timeout_s)"
    line = hang_line({0: wait, 1: outside, 2: wait, 3: wait}, 4, {r: step for r in range(4)}, tmp_path)
    assert line == (f"rank 1: hang: {step}; rank 1 {outside}, while 3 other ranks wait {wait}; "
                    f"every rank's stacks are in {tmp_path}/rank-*.txt")
    # The named rank's own cause wins over the others' (they only waited for it).
    stall = "waited 481 s for data (bound 480 s, data.stall_timeout_s); reading x.parquet row group 3 for 481 s"
    line = hang_line({0: wait, 1: outside}, 2, {0: step, 1: stall}, tmp_path)
    assert line.startswith(f"rank 1: hang: {stall}; rank 1 {outside}, while 1 other rank waits"), line
    # Every rank in collectives, one in another than the rest: that one (it moved on, or never came).
    line = hang_line({0: wait, 1: wait, 2: recv}, 3, {r: step for r in range(3)}, tmp_path)
    assert line.startswith("rank 2: hang:") and f"rank 2 {recv}, while 2 other ranks wait {wait};" in line, line
    # All in the same collective: nobody to name.
    line = hang_line({0: wait, 1: wait}, 2, {0: step, 1: step}, tmp_path)
    assert line.startswith("every rank: hang:") and f"all 2 ranks wait {wait}: a hung collective" in line, line
    # A rank whose watcher gave no position is named too, with the cause of the first that reported.
    line = hang_line({0: wait, 2: wait}, 3, {0: step, 2: step}, tmp_path)
    assert line.startswith(f"rank 1: hang: {step};") and "rank 1 gave no position" in line, line


def _store_sockets(port: int) -> int:
    """This process's TCP connections to `port` (its store clients), from /proc."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except FileNotFoundError:  # the listing's own descriptor, closed since
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    count = 0
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            fields = row.split()
            remote_port, state, inode = int(fields[2].rsplit(":", 1)[1], 16), fields[3], fields[9]
            count += remote_port == port and state == "01" and inode in inodes  # 01: established
    return count


def _count_store_connections() -> None:
    import torch.distributed as dist
    from launch.resilience.failure import FailureWatcher
    port = int(os.environ["MASTER_PORT"])
    watcher = FailureWatcher(dist.get_rank(), dist.get_world_size(), heartbeat_timeout_s=60)
    deadline = time.monotonic() + 20
    while watcher._client is None and time.monotonic() < deadline:
        time.sleep(0.05)
    connections = _store_sockets(port)
    watcher.stop()
    assert connections == STORE_CLIENTS_PER_RANK, (dist.get_rank(), connections)


def test_each_rank_holds_the_store_connections_rank_0s_limit_is_checked_for():
    """Counted in the kernel's socket table of each of 3 ranks in a real process group with its
    failure watcher running (the process group's client, the watcher's: the main thread reuses the
    first)."""
    code, stderr = _run_ranks(_count_store_connections, 3)
    assert code == 0, stderr[-3000:]


def _limits_checked(world: int, soft: int, hard: int):
    import resource
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    try:
        ensure_open_file_limit(world, rank=0)
    except ConfigError as e:
        return str(e)
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def test_rank_0_raises_its_open_file_limit_or_names_the_one_needed():
    """In a forked child (the limits are the process's): the soft limit is raised to what the
    store's clients need when the hard limit allows, else one line names both."""
    import multiprocessing
    with multiprocessing.get_context("fork").Pool(1) as pool:
        needed = STORE_CLIENTS_PER_RANK * 1000
        raised = pool.apply(_limits_checked, (1000, 256, 8192))
        assert raised[1] == 8192 and needed < raised[0] <= 8192, raised
        refused = pool.apply(_limits_checked, (4096, 256, 4096))
        assert isinstance(refused, str) and "4096 ranks" in refused and "ulimit -n" in refused, refused
        assert pool.apply(_limits_checked, (4, 2048, 4096)) == (2048, 4096)  # enough already: untouched


@pytest.mark.slow  # it computes (not `waits`): a validation longer than the bound
def test_a_validation_and_a_save_longer_than_the_hang_bound_train_to_the_last_step(tmp_path):
    """launch/train.py at dp 2 with a 5 s hang bound: at its last step, a validation longer than the
    bound (170 batches of tiny.yaml made 4x as wide, its validation share doubled to hold them: about
    8 s on a quiet 2-core machine; timed batch by batch) and a save made to take 6 s (a save has its
    own rule), both inside the loop the watchdog times: the run ends, saved, and nothing is reported."""
    save, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    proc = launch_forked(2, ["--recipe", str(TINY), "--steps", "2", "--set", "train.hang_timeout_s=5",
                             "--set", "train.first_step_timeout_s=60", "--set", "train.eval_every=2",
                             "--set", "model.n_embd=256", "--set", "train.eval_batches=170",
                             "--set", "data.val_fraction=0.2", "--save", str(save), "--save-every", "2",
                             "--metrics-out", str(metrics)], env={"GPT3D_SLOW_SAVE": "6"}, timeout=300)
    assert proc.returncode == 0 and "error:" not in proc.stderr, proc.stderr[-3000:]
    records = read_metrics(metrics)
    assert [r["step"] for r in records] == [1, 2] and "val_loss" in records[1], records
    validation_s = records[1]["elapsed_s"] - records[0]["elapsed_s"] - records[1]["step_time_s"]
    assert validation_s > 5, validation_s  # longer than the bound, or the test proves nothing
    assert proc.stdout.count("this save waits 6 s before its commit") == 2, proc.stdout[-3000:]  # each rank's
    assert (save / "latest").read_text() == "step00000002" and not (save / "hang-stacks").exists()
    print(f"validation at step 2: {validation_s:.1f} s against a 5 s bound")
