"""An opt-in pytest plugin: each test's CPU seconds, its ranks' included, one JSON line per test.

    PYTHONPATH=tests PYTEST_ADDOPTS="-p helpers.cpu_usage" GPT3D_CPU_USAGE=/tmp/cpu.jsonl python -m pytest tests

Wall time does not say what a test costs the suite: three workers share two cores, and a test
that waits on a timeout holds a worker without using a core. CPU time does. A test's is the sum
of its worker's own time, its waited-for children's (DeepSpeed's launcher and its ranks, which
`subprocess` waits for), and what its forked ranks cost: each reply of the session's one rank
server (tests/helpers/rank_server.py) carries its request's CPU seconds, its ranks', its handler's
and the server's own since the previous request (the imports, for the first), and
helpers/forked.py adds them up in the worker that sent it (the server's own /proc times would count
every worker's ranks). Where the suite's time went with it: docs/testing.md, "Time and budget"."""
import json
import os
import resource
import time

import pytest

OUT = os.environ.get("GPT3D_CPU_USAGE", "cpu_usage.jsonl")


def _seconds():
    from helpers import forked
    own, children = (resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime, forked.cpu_seconds


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    own_0, children_0, forked_0 = _seconds()
    start = time.monotonic()
    yield
    own_1, children_1, forked_1 = _seconds()
    with open(OUT, "a") as f:
        f.write(json.dumps({"test": item.nodeid, "worker": os.environ.get("PYTEST_XDIST_WORKER"),
                            "wall_s": time.monotonic() - start,
                            "cpu_s": own_1 - own_0 + children_1 - children_0 + forked_1 - forked_0}) + "\n")
