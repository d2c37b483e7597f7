"""The suite's scheduler (tests/helpers/scheduling.py, a plugin) in a real xdist session of three
plain workers over a small project that loads it as its only plugin: every test marked `waits`
runs on the waiting worker, gw0, and a module's other tests stay together on one worker. (xdist's
own grouping, a suffix written into each node id, does nothing on pytest 9.2: with it, waiting
tests ran wherever their module went.)"""
import os
import re
import subprocess
import sys

from helpers.forked import REPO

INI = "[pytest]\nmarkers = waits: mostly waits\n"


def _module(computing: int, waiting: int) -> str:
    tests = [f"def test_computes_{i}():\n    time.sleep(0.05)\n" for i in range(computing)]
    tests += [f"@pytest.mark.waits\ndef test_waits_{i}():\n    time.sleep(0.05)\n" for i in range(waiting)]
    return "import time\n\nimport pytest\n\n\n" + "\n\n".join(tests)


def test_waiting_tests_run_on_the_waiting_worker_and_modules_stay_whole(tmp_path):
    (tmp_path / "pytest.ini").write_text(INI)
    for name, computing, waiting in (("mixed", 4, 3), ("only_waits", 0, 2), ("a", 6, 0), ("b", 5, 0), ("c", 5, 0)):
        (tmp_path / f"test_{name}.py").write_text(_module(computing, waiting))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-p", "helpers.scheduling",
                           "-n", "3", "--dist", "loadscope", str(tmp_path)],
                          cwd=tmp_path, env={**{k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"},
                                             "PYTHONPATH": str(REPO / "tests")},  # this session's plugins stay out
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ran = dict((test, worker) for worker, test in
               re.findall(r"^\[(gw\d)\] \[[ \d]+%\] PASSED \S*?(test_\w+\.py::\w+)", proc.stdout, re.MULTILINE))
    assert len(ran) == 25, proc.stdout[-3000:]
    waiting = {test: worker for test, worker in ran.items() if "::test_waits_" in test}
    assert len(waiting) == 5 and set(waiting.values()) == {"gw0"}, waiting
    for module in ("test_mixed.py", "test_a.py", "test_b.py", "test_c.py"):
        assert len({worker for test, worker in ran.items() if test.startswith(module) and "waits" not in test}) == 1, ran
