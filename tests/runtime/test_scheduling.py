"""The suite's scheduler (tests/helpers/scheduling.py) in a real xdist session of three plain
workers over a small project: every test marked `waits` runs on the waiting worker, gw0, and a
module's other tests stay together on one worker. (xdist's own grouping, a suffix written into
each node id, does nothing on pytest 9.2: with it, waiting tests ran wherever their module went.)"""
import re
import subprocess
import sys
import textwrap

from helpers.forked import REPO

CONFTEST = f"""
import os
import sys

import pytest

sys.path.insert(0, {str(REPO / "tests")!r})
from helpers import scheduling


def pytest_configure(config):
    config.addinivalue_line("markers", "waits: mostly waits")
    if os.environ.get("PYTEST_XDIST_WORKER") is None and config.getoption("dist", "no") != "no":
        scheduling.start_session()


def pytest_unconfigure(config):
    scheduling.stop_session()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    scheduling.order_for_workers(items)


def pytest_xdist_make_scheduler(config, log):
    return scheduling.WaitingApartScheduling(config, log)
"""


def _module(computing: int, waiting: int) -> str:
    tests = [f"def test_computes_{i}():\n    time.sleep(0.05)\n" for i in range(computing)]
    tests += [f"@pytest.mark.waits\ndef test_waits_{i}():\n    time.sleep(0.05)\n" for i in range(waiting)]
    return "import time\n\nimport pytest\n\n\n" + "\n\n".join(tests)


def test_waiting_tests_run_on_the_waiting_worker_and_modules_stay_whole(tmp_path):
    (tmp_path / "conftest.py").write_text(textwrap.dedent(CONFTEST))
    for name, computing, waiting in (("mixed", 4, 3), ("only_waits", 0, 2), ("a", 6, 0), ("b", 5, 0), ("c", 5, 0)):
        (tmp_path / f"test_{name}.py").write_text(_module(computing, waiting))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-n", "3",
                           "--dist", "loadscope", "-p", "no:randomly", str(tmp_path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ran = dict((test, worker) for worker, test in
               re.findall(r"^\[(gw\d)\] \[[ \d]+%\] PASSED \S*?(test_\w+\.py::\w+)", proc.stdout, re.MULTILINE))
    assert len(ran) == 25, proc.stdout[-3000:]
    waiting = {test: worker for test, worker in ran.items() if "::test_waits_" in test}
    assert len(waiting) == 5 and set(waiting.values()) == {"gw0"}, waiting
    for module in ("test_mixed.py", "test_a.py", "test_b.py", "test_c.py"):
        assert len({worker for test, worker in ran.items() if test.startswith(module) and "waits" not in test}) == 1, ran
