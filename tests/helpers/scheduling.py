"""How pytest-xdist's workers share the suite (pyproject.toml: `-n 3 --dist loadscope`;
docs/testing.md, "Three workers").

Each test module is one unit of work, sent whole to one worker, so a module's fixtures (a run
several tests read) are built once. A test marked `waits` mostly waits (on a heartbeat timeout, a
signal's grace, DeepSpeed's launcher): it is a unit of its own, and the first worker, gw0, takes
those while the other two take the modules that compute, so the waiting happens beside the
computing instead of after it; the computing workers run at a lower priority (tests/conftest.py),
so the waiting tests' time bounds hold. A worker that runs out of its kind of work helps with the other.
Modules are sent largest first (xdist's own heuristic), each module's tests in their own order.

Which tests wait is known only where the tests are collected, in the workers; the scheduler, in
the session's process, sees node ids. xdist's own channel for that (`--dist loadgroup`: a worker
appends "@group" to each grouped test's node id) does nothing on pytest 9.2, whose node ids
cannot be changed (pytest-dev/pytest-xdist#1386): every waiting test then went with its module to
whichever worker took it, a niced one as often as not. So the workers write the waiting tests'
node ids to a file of the session's (`start_session`), which the scheduler reads once every
worker has collected.

A pytest plugin: tests/conftest.py registers it, and a project of its own can load it
(`-p helpers.scheduling`, as tests/runtime/test_scheduling.py's does)."""
import json
import os
import tempfile
from collections import Counter
from pathlib import Path
from typing import List, Optional

import pytest
from xdist.scheduler import LoadScopeScheduling

WAITS = "waits"
WAITING_WORKER = "gw0"
WAITING_TESTS_VARIABLE = "GPT3D_WAITING_TESTS"
"""The session's file of waiting tests' node ids, as the session's process sets it for its workers."""

_session_file: Optional[str] = None


def with_workers(config) -> bool:
    """This is the session's process, and it hands the tests to xdist's workers."""
    return os.environ.get("PYTEST_XDIST_WORKER") is None and config.getoption("dist", "no") != "no"


def pytest_configure(config):
    if with_workers(config):
        start_session()


def pytest_unconfigure(config):
    stop_session()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    order_for_workers(items)


def pytest_xdist_make_scheduler(config, log):
    return WaitingApartScheduling(config, log)


def start_session() -> None:
    """In the session's process, before the workers start: the file they will write."""
    global _session_file
    handle, _session_file = tempfile.mkstemp(prefix="gpt3d-waiting-tests-", suffix=".json")
    os.close(handle)
    os.environ[WAITING_TESTS_VARIABLE] = _session_file


def stop_session() -> None:
    """In the session's process, at its end."""
    if _session_file is not None:
        os.environ.pop(WAITING_TESTS_VARIABLE, None)
        Path(_session_file).unlink(missing_ok=True)


def order_for_workers(items: List[pytest.Item]) -> None:
    """In place, in every worker alike: the waiting tests first (the launched ones last among
    them), then the other modules by their number of tests, largest first, each module's tests in
    their own order. Under xdist, the waiting tests' node ids written to the session's file (each
    worker writes the same list, whole: a rename)."""
    per_module = Counter(item.nodeid.split("::", 1)[0] for item in items)
    path = os.environ.get(WAITING_TESTS_VARIABLE)
    if path:
        waiting = [item.nodeid for item in items if item.get_closest_marker(WAITS)]
        written = f"{path}.{os.getpid()}"
        Path(written).write_text(json.dumps(waiting))
        os.replace(written, path)

    def key(pair):
        index, item = pair
        module = item.nodeid.split("::", 1)[0]
        waits = item.get_closest_marker(WAITS) is not None
        # Among the waiting tests the launched ones (tests/e2e/, margins of 10-20 s) come last, where
        # a computing worker that runs out of work takes its help from (_assign_work_unit); the
        # in-process ones that time the machine to a second stay with the un-niced worker.
        return (not waits, waits and module.startswith("tests/e2e/"), -per_module[module], module, index)

    items[:] = [item for _, item in sorted(enumerate(items), key=key)]


class WaitingApartScheduling(LoadScopeScheduling):
    """xdist's module-by-module scheduling in the order the workers collected (order_for_workers),
    each `waits` test a unit of its own, given to WAITING_WORKER while any is left."""

    def __init__(self, config, log=None):
        super().__init__(config, log)
        config.option.loadscopereorder = False  # keep order_for_workers' order
        self.waiting: set = set()  # the waiting tests' node ids, once every worker has collected

    def schedule(self) -> None:
        if self.collection is None and os.environ.get(WAITING_TESTS_VARIABLE):  # the first call
            self.waiting = set(json.loads(Path(os.environ[WAITING_TESTS_VARIABLE]).read_text() or "[]"))
        super().schedule()

    def _split_scope(self, nodeid: str) -> str:
        return nodeid if nodeid in self.waiting else nodeid.split("::", 1)[0]

    def _assign_work_unit(self, node) -> None:
        """The next unit of this worker's kind (else of the other kind), moved to the front of
        the queue for xdist's own assignment. A computing worker helps with the waiting tests only with
        the launched ones (tests/e2e/, margins of 10-20 s), from the back of their queue; the
        in-process ones that time the machine (the calibration's auto-sweep, stragglers, stop
        requests) stay with the un-niced worker, and a computing worker with nothing else left
        idles (xdist ends it with the session)."""
        waiting = [scope for scope in self.workqueue if scope in self.waiting]
        computing = [scope for scope in self.workqueue if scope not in self.waiting]
        if node.gateway.id == WAITING_WORKER:
            unit = (waiting or computing)[0]
        else:
            launched = [scope for scope in waiting if scope.startswith("tests/e2e/")]
            unit = computing[0] if computing else (launched[-1] if launched else None)
        if unit is None:  # only tests that time the machine are left: the un-niced worker runs them
            return
        self.workqueue.move_to_end(unit, last=False)
        super()._assign_work_unit(node)
