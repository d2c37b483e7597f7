"""An opt-in pytest plugin: each test's CPU seconds, its ranks' included, one JSON line per test.

    PYTHONPATH=tests PYTEST_ADDOPTS="-p helpers.cpu_usage" GPT3D_CPU_USAGE=/tmp/cpu.jsonl python -m pytest tests

Wall time does not say what a test costs the suite: three workers share two cores, and a test
that waits on a timeout holds a worker without using a core. CPU time does. A test's is the sum
of its worker's own time, its waited-for children's (DeepSpeed's launcher and its ranks, which
`subprocess` waits for), and the rank server's children's (tests/helpers/rank_server.py forks the
ranks of launch_forked and run_distributed, and reaps each: /proc/<server>/stat's cutime and
cstime grow by theirs). Where the suite's time went with it: docs/testing.md, "Time and budget"."""
import json
import os
import resource
import time

import pytest

OUT = os.environ.get("GPT3D_CPU_USAGE", "cpu_usage.jsonl")
_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def _rank_server_seconds():
    """(the rank server's CPU seconds, its own and its reaped children's; its pid), or (0, None)."""
    from helpers import forked
    server = forked._server
    if server is None or server.poll() is not None:
        return 0.0, None
    try:
        fields = open(f"/proc/{server.pid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0, None
    return sum(int(x) for x in fields[11:15]) / _TICKS_PER_S, server.pid  # utime, stime, cutime, cstime


def _seconds():
    own, children = (resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime, *_rank_server_seconds()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    own_0, children_0, server_0, pid_0 = _seconds()
    start = time.monotonic()
    yield
    own_1, children_1, server_1, pid_1 = _seconds()
    server = server_1 - server_0 if pid_0 == pid_1 else server_1  # a server started by this test counts whole
    with open(OUT, "a") as f:
        f.write(json.dumps({"test": item.nodeid, "worker": os.environ.get("PYTEST_XDIST_WORKER"),
                            "wall_s": time.monotonic() - start,
                            "cpu_s": own_1 - own_0 + children_1 - children_0 + server}) + "\n")
