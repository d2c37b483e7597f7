"""How pytest-xdist's workers share the suite (pyproject.toml: `-n 3 --dist loadgroup`;
docs/testing.md, "Three workers").

Each test module is one unit of work, sent whole to one worker, so a module's fixtures (a run
several tests read) are built once. A test marked `waits` mostly waits (on a heartbeat timeout, a
signal's grace, DeepSpeed's launcher): it is a unit of its own, and the first worker, gw0, takes
those while the other two take the modules that compute, so the waiting happens beside the
computing instead of after it; the computing workers run at a lower priority (tests/conftest.py),
so the waiting tests' time bounds hold. A worker that runs out of its kind of work helps with the other.
Modules are sent largest first (xdist's own heuristic), each module's tests in their own order."""
from collections import Counter
from typing import List

import pytest
from xdist.scheduler import LoadScopeScheduling

WAITS = "waits"
WAITING_WORKER = "gw0"


def order_for_workers(items: List[pytest.Item]) -> None:
    """In place, in every worker alike: each `waits` test tagged as a group (xdist then adds
    `@waits` to its node id under --dist loadgroup); the waiting tests first (the launched ones
    last among them), then the other modules by their number of tests, largest first, each
    module's tests in their own order."""
    per_module = Counter(item.nodeid.split("::", 1)[0] for item in items)
    for item in items:
        if item.get_closest_marker(WAITS):
            item.add_marker(pytest.mark.xdist_group(WAITS))

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

    def _split_scope(self, nodeid: str) -> str:
        if nodeid.endswith("@" + WAITS):
            return nodeid
        return nodeid.split("::", 1)[0]

    def _assign_work_unit(self, node) -> None:
        """The next unit of this worker's kind (else of the other kind), moved to the front of
        the queue for xdist's own assignment. A computing worker helps with the waiting tests only with
        the launched ones (tests/e2e/, margins of 10-20 s), from the back of their queue; the
        in-process ones that time the machine (the calibration's auto-sweep, stragglers, stop
        requests) stay with the un-niced worker, and a computing worker with nothing else left
        idles (xdist ends it with the session)."""
        waiting = [scope for scope in self.workqueue if scope.endswith("@" + WAITS)]
        computing = [scope for scope in self.workqueue if not scope.endswith("@" + WAITS)]
        if node.gateway.id == WAITING_WORKER:
            unit = (waiting or computing)[0]
        else:
            launched = [scope for scope in waiting if scope.startswith("tests/e2e/")]
            unit = computing[0] if computing else (launched[-1] if launched else None)
        if unit is None:  # only tests that time the machine are left: the un-niced worker runs them
            return
        self.workqueue.move_to_end(unit, last=False)
        super()._assign_work_unit(node)
