"""The session's shared runs (helpers/parity_runs.py), the fast tier's rule enforced, the
streaming tests' private caches, and one CPU thread per rank."""
import os
import subprocess
from pathlib import Path

# One thread for every process the suite starts (xdist's workers, the ranks, benches): three
# workers keep both cores busy, and a process of two OpenMP threads whose second core is taken
# spins at barriers, 16x slower per step (a one-process llama-tiny run beside a busy core: 125
# tokens/s at 2 threads, 2,079 at 1; docs/testing.md, "Time and budget"). Ranks honour it
# (launch/engine/distributed.py: threads_per_rank). Set it yourself to override.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402 (after the thread setting: torch reads it when first imported)

from helpers import launcher, rewritten_tests, scheduling
from helpers.forked import forked_worker_python, start_rank_server, stop_rank_server
from helpers.launcher import refuse_in_fast_tier
from helpers.parity_runs import ParityRuns
from helpers.scheduling import WAITING_WORKER, with_workers


@pytest.fixture(scope="session")
def parity_runs(tmp_path_factory):
    return ParityRuns(tmp_path_factory)


class FastTierPopen(subprocess.Popen):
    """subprocess.Popen while a fast test runs: refuses DeepSpeed's launcher and the benchmarks
    (which train, most through the launcher). A Python entry point that stops at a bad input
    (exit 2) is allowed."""

    def __init__(self, args, *rest, **kwargs):
        words = [str(w) for w in ([args] if isinstance(args, (str, bytes, os.PathLike)) else args)]
        refused = [w for w in words if Path(w).name == "deepspeed"
                   or (w.endswith(".py") and "bench" in Path(w).parts[:-1])]
        if refused:
            refuse_in_fast_tier(refused[0])
        super().__init__(args, *rest, **kwargs)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """The fast tier's rule, enforced: during a fast test (setup, call and teardown, so a fixture
    that launches counts too), every launch but the acceptance runs fails it (launch_forked,
    ParityRuns, FastTierPopen)."""
    fast = item.get_closest_marker("slow") is None
    launcher.fast_test = item.nodeid if fast else None
    popen = subprocess.Popen
    subprocess.Popen = FastTierPopen if fast else popen
    try:
        yield
    finally:
        launcher.fast_test, subprocess.Popen = None, popen


def pytest_sessionstart(session):
    """The session's one rank server (tests/helpers/rank_server.py), started by its process (the
    xdist controller, or pytest under `-n 0`) before any worker: it outlives every worker, and runs
    at the session's priority, which a reniced worker (pytest_configure) could not give it back
    without privileges. It imports torch only when a test first forks ranks."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        start_rank_server()


def pytest_sessionfinish(session):
    stop_rank_server()  # in the session's process: the server ends with the session


@pytest.fixture
def stream_cache(tmp_path, monkeypatch):
    """Streaming caches of the test's own: unit lists, stream checks and validation windows built afresh."""
    for module in ("data.windows", "data.units", "data.prepare_source"):
        monkeypatch.setattr(f"{module}.default_cache_dir", lambda: tmp_path / "cache")


def pytest_configure(config):
    """In the controller: its workers forked by the session's rank server, with the heavy imports
    done (helpers/worker_client.py), unless given execnet specs of their own (--tx). In a worker: a
    computing worker (and every rank it starts) yields the CPU to the waiting worker, whose
    tests measure time (heartbeat bounds, step times): they see an unloaded machine, and the
    computing workers lose only the little CPU the waiting tests use."""
    config.pluginmanager.register(scheduling, "helpers.scheduling")  # the waiting tests on a worker of their own
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if with_workers(config) and set(config.option.tx) == {"popen"}:
        config.option.tx = [f"popen//python={forked_worker_python()}"] * len(config.option.tx)
        rewritten_tests.start(config)
    if worker is not None:
        rewritten_tests.collect_with_rewritten_tests()
    if worker is not None and worker != WAITING_WORKER:
        os.nice(10)


def pytest_collection_finish(session):
    rewritten_tests.collected()


def pytest_unconfigure(config):
    rewritten_tests.stop()
