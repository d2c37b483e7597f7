"""A failure on one rank after torch.distributed started ends every rank within 60 s, each with
one line on stderr naming itself and the cause (launch/resilience/failure.py); what can be checked before
the start is refused there (launch/trainer/preflight.py). 4 processes at tp=2 pp=2."""
import json
import os
import subprocess

import pytest

from launch.engine.distributed import launcher_command
from helpers.launcher import REPO, TINY, launch_forked

LIMIT_S = 60  # the failing run, start-up included, is over within this


def _error_lines(stderr: str):
    assert "Traceback" not in stderr, stderr[-3000:]
    return [line for line in stderr.splitlines() if line.startswith("error: ")]


@pytest.mark.slow
def test_wandb_online_without_api_key_stops_before_start(tmp_path):
    """Two ranks (forked: the refusal is the ranks' own, not the launcher's): one line for the job,
    not one a rank, before torch.distributed and the engine start."""
    env = {"WANDB_API_KEY": "", "NETRC": str(tmp_path / "netrc"), "WANDB_DIR": str(tmp_path)}  # no key anywhere
    proc = launch_forked(2, ["--recipe", str(TINY), "--wandb", "online"], env=env, timeout=300)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "layout: world" not in proc.stdout  # refused before torch.distributed and the engine started
    lines = _error_lines(proc.stderr)
    assert len(lines) == 1, proc.stderr  # printed once for the job (rank 0)
    assert "--wandb online" in lines[0] and "WANDB_API_KEY" in lines[0], lines


@pytest.mark.slow
def test_exception_on_one_rank_stops_all_ranks_with_one_line_each(tmp_path):
    """Rank 3 (last stage, TP rank 1) raises before step 2, while the others are already in the
    step's collectives: every rank exits, non-zero, and the whole run (forked ranks: the failure
    watcher is the subject, not the launcher) ends within 60 s."""
    proc = launch_forked(4, ["--recipe", str(TINY), "--tp", "2", "--pp", "2", "--steps", "4"],
                         env={"GPT3D_FAULT_INJECT": "3:2"}, timeout=LIMIT_S)
    out, err = proc.stdout, proc.stderr
    assert proc.returncode == 1, out[-3000:] + err[-3000:]
    assert "step 1/" in out and "step 2/" not in out, out[-3000:]
    assert "recvValue failed" not in err  # rank 0 kept the store until rank 3 was done with it
    lines = _error_lines(err)
    cause = "RuntimeError: fault injected by GPT3D_FAULT_INJECT=3:2 before step 2 (at launch/resilience/failure.py:"
    assert len(lines) == 4, err[-3000:]
    by_rank = {int(line.split()[2].rstrip(":")): line for line in lines}
    assert sorted(by_rank) == [0, 1, 2, 3], lines
    assert by_rank[3].startswith(f"error: rank 3: {cause}"), by_rank[3]
    for rank in (0, 1, 2):
        assert by_rank[rank].startswith(f"error: rank {rank}: stopping: rank 3 failed: {cause}"), by_rank[rank]


@pytest.mark.waits
@pytest.mark.slow
def test_threads_per_rank_from_deepspeed_launcher_environment(tmp_path):
    """DeepSpeed's launcher exports LOCAL_SIZE, not LOCAL_WORLD_SIZE: the ranks of a node share
    its cores by that count, not by the world size (which spans every node)."""
    from launch.engine.distributed import threads_per_rank
    cmd = launcher_command(2, REPO / "tests" / "helpers" / "dump_env.py") + [str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    env = json.loads((tmp_path / "env1.json").read_text())
    assert env["LOCAL_SIZE"] == "2" and env["WORLD_SIZE"] == "2" and env["LOCAL_RANK"] == "1"
    for unset in ("LOCAL_WORLD_SIZE", "OMP_NUM_THREADS"):  # not the launcher's: the tests' own environment's
        env.pop(unset, None)
    assert threads_per_rank(env, cpu_count=64, world_size=2) == 32
    # The same launcher on the second of two such nodes: WORLD_SIZE counts both, LOCAL_SIZE this one.
    two_nodes = dict(env, WORLD_SIZE="4", RANK="3", CROSS_RANK="1", CROSS_SIZE="2")
    assert threads_per_rank(two_nodes, cpu_count=64, world_size=4) == 32
    assert threads_per_rank(dict(two_nodes, LOCAL_WORLD_SIZE="1"), cpu_count=64, world_size=4) == 64  # torchrun's


def _raise(message):
    raise RuntimeError(message)


def _caught(message):
    try:
        _raise(message)
    except RuntimeError as e:
        return e


def test_failure_line_keeps_the_cause_and_its_origin():
    """A device error that mentions NCCL is reported as itself (first lines, where it was raised),
    not as "another rank died"; only a lost connection or a timeout gets the peer hint."""
    import inspect
    from launch.resilience.failure import describe
    line = inspect.getsourcelines(_raise)[1] + 1
    cuda = describe(_caught("NCCL error in: ProcessGroupNCCL.cpp:1234, unhandled cuda error\n"
                            "ncclUnhandledCudaError: Call to CUDA function failed.\n"
                            "Last error: illegal memory access"))
    assert cuda == ("RuntimeError: NCCL error in: ProcessGroupNCCL.cpp:1234, unhandled cuda error / "
                    "ncclUnhandledCudaError: Call to CUDA function failed. "
                    f"(at tests/runtime/test_failures.py:{line} in _raise)")
    gloo = describe(_caught("[../third_party/gloo/gloo/transport/tcp/pair.cc:538] Connection closed by peer "
                            "[127.0.0.1]:1"))
    assert gloo.startswith("RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:538] Connection closed by peer")
    assert gloo.endswith(f"(at tests/runtime/test_failures.py:{line} in _raise); a peer rank probably died or hung, "
                         f"see its line and the launcher's")
    assert "\n" not in cuda + gloo
    # This rank's own kernel timing out is not a lost peer; a collective that timed out waiting is.
    watchdog = describe(_caught("CUDA error: the launch timed out and was terminated\n"
                                "CUDA kernel errors might be asynchronously reported at some other API call"))
    assert watchdog.startswith("RuntimeError: CUDA error: the launch timed out and was terminated / ")
    assert "peer" not in watchdog, watchdog
    for message in ("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 60000ms for "
                    "recv operation to complete",
                    "[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE) "
                    "ran for 600000 milliseconds before timing out."):
        assert describe(_caught(message)).endswith("; a peer rank probably died or hung, see its line and the "
                                                   "launcher's"), message


def test_threads_per_rank_count_the_cpus_this_process_may_use():
    """Pinned to one CPU (as taskset, a cgroup cpuset or SLURM does), a rank counts one, not the
    machine's CPUs."""
    from launch.engine.distributed import usable_cpus
    allowed = os.sched_getaffinity(0)
    one = {min(allowed)}
    try:
        os.sched_setaffinity(0, one)  # this thread only: restored below
        assert usable_cpus() == 1
    finally:
        os.sched_setaffinity(0, allowed)
    assert usable_cpus() == len(allowed)


def test_threads_per_rank_honour_omp_num_threads():
    """An explicit OMP_NUM_THREADS (the user's, torchrun's 1 for several ranks, DeepSpeed's
    --bind_cores_to_rank share) is each rank's thread count; unset or empty, the node's CPUs over
    its ranks."""
    from launch.engine.distributed import threads_per_rank
    assert threads_per_rank({"OMP_NUM_THREADS": "3", "LOCAL_SIZE": "2"}, cpu_count=64, world_size=2) == 3
    assert threads_per_rank({"OMP_NUM_THREADS": "", "LOCAL_SIZE": "2"}, cpu_count=64, world_size=2) == 32
    assert threads_per_rank({"LOCAL_SIZE": "4"}, cpu_count=64, world_size=8) == 16
