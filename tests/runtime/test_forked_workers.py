"""xdist's workers are forked by the session's rank server (tests/helpers/worker_client.py, what
execnet runs for `python`): the worker gets the client's stdin, stdout and stderr, directory and
environment, starts with torch already imported, and its exit code is the client's; a client that
is killed (execnet kills it when a worker does not leave at the session's end) takes its worker
with it. The test modules' asserts, rewritten once for the session (helpers/rewritten_tests.py), are
pytest's own rewrite, found by pytest's own lookup."""
import os
import subprocess
import sys
import time
from pathlib import Path

from helpers.forked import REPO, session_socket

CLIENT = REPO / "tests" / "helpers" / "worker_client.py"
REWRITER = REPO / "tests" / "helpers" / "rewritten_tests.py"


def _client(code: str) -> list:
    """The command execnet runs for a worker, with `code` for its bootstrap."""
    return [sys.executable, "-I", "-S", str(CLIENT), str(session_socket()), "-u", "-c", code]


def _gone(pid: int) -> bool:
    """Exited: no such process, or a zombie its parent has not reaped yet."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_forked_worker_has_the_clients_pipes_directory_and_environment_and_its_exit_code(tmp_path):
    code = ("import os, sys; line = sys.stdin.readline().strip(); "
            "print(line, os.getcwd(), os.environ['WORKER_MARK'], 'torch' in sys.modules); "
            "print('to stderr', file=sys.stderr); sys.exit(3)")
    proc = subprocess.Popen(_client(code), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=tmp_path, env=dict(os.environ, WORKER_MARK="m1"))
    out, err = proc.communicate("hello\n", timeout=120)
    assert (proc.returncode, out, err) == (3, f"hello {tmp_path} m1 True\n", "to stderr\n")


def test_a_killed_client_takes_its_worker_with_it():
    code = "import os, time; print(os.getpid(), flush=True); time.sleep(600)"
    client = subprocess.Popen(_client(code), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        worker = int(client.stdout.readline())
        assert not _gone(worker)
    finally:
        client.kill()
        client.wait()
    deadline = time.monotonic() + 10
    while not _gone(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(worker)


def test_a_test_module_rewritten_for_the_session_is_what_pytests_hook_rewrites(tmp_path, monkeypatch, pytestconfig):
    """The rewrite without a config equals the hook's under this session's config, and lies where
    a worker collecting with the session's directory as its pycache prefix looks for it."""
    from _pytest.assertion.rewrite import PYC_TAIL, _read_pyc, _rewrite_test, get_cache_dir
    module = Path(__file__)
    subprocess.run([sys.executable, str(REWRITER), str(tmp_path), str(module)], check=True, timeout=60)
    monkeypatch.setattr(sys, "pycache_prefix", str(tmp_path))
    code = _read_pyc(module, get_cache_dir(module) / (module.name[:-3] + PYC_TAIL))
    assert code is not None and code == _rewrite_test(module, pytestconfig)[1]
