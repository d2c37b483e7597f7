"""Every test module's asserts rewritten once per session instead of once per xdist worker.

pytest rewrites a test module's asserts as it imports it, and keeps the result as a pyc beside it,
unless bytecode writing is off (PYTHONDONTWRITEBYTECODE=1, as on our CI machine). Then each xdist
worker, since each collects every test, rewrote all the test modules itself: about 2.5 CPU-s a
worker, three times over, at the start of every session. Here the session's process starts
`python rewritten_tests.py DIR FILES...` while the rank server imports torch (one core is idle
then), which writes the rewritten pycs into DIR, a directory of the session's own (nothing is
written into the tree). Each worker collects with DIR as its `sys.pycache_prefix`, where pytest's
import hook looks for its pycs first (_pytest/assertion/rewrite.py: get_cache_dir). Those pycs are
checked against the source's hash, so a module edited since is rewritten as before, and a
worker that collects before this process is done rewrites what it does not find.

The rewrite is pytest's own (`_rewrite_test`, `_write_pyc`, private: pytest is pinned in
requirements.txt) without a config, as a config without `enable_assertion_pass_hook` rewrites:
`start` writes nothing when that option is on."""
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import List, Optional

PREFIX_VARIABLE = "GPT3D_REWRITTEN_TESTS"
"""The session's directory of rewritten test modules, as the session's process sets it for its workers."""

_writer: Optional[subprocess.Popen] = None
_previous_prefix: Optional[str] = None


def start(config) -> None:
    """In the session's process: rewrite the test modules into a new directory, in the background."""
    global _writer
    if config.getini("enable_assertion_pass_hook") or config.getoption("assertmode") != "rewrite":
        return
    files = sorted(str(p) for p in Path(config.rootpath, "tests").rglob("test_*.py"))
    prefix = tempfile.mkdtemp(prefix="gpt3d-rewritten-tests-")
    os.environ[PREFIX_VARIABLE] = prefix
    _writer = subprocess.Popen([sys.executable, __file__, prefix, *files], stdin=subprocess.DEVNULL)


def stop() -> None:
    """In the session's process, at its end: the writer ended, its directory removed."""
    if _writer is None:  # a worker, or no rewriting
        return
    _writer.kill()
    _writer.wait()
    shutil.rmtree(os.environ.pop(PREFIX_VARIABLE), ignore_errors=True)


def collect_with_rewritten_tests() -> None:
    """In a worker, before it collects: look for the test modules' pycs in the session's directory first."""
    global _previous_prefix
    _previous_prefix = sys.pycache_prefix
    if os.environ.get(PREFIX_VARIABLE):
        sys.pycache_prefix = os.environ[PREFIX_VARIABLE]


def collected() -> None:
    """After collection: every other module the worker imports finds its pyc where it always did."""
    sys.pycache_prefix = _previous_prefix


def _write(prefix: str, files: List[str]) -> None:
    from _pytest.assertion.rewrite import PYC_TAIL, _rewrite_test, _write_pyc, get_cache_dir

    class _Quiet:
        trace = staticmethod(lambda message: None)
    sys.pycache_prefix = prefix
    for name in files:
        source = Path(name)
        source_hash, code = _rewrite_test(source, None)
        cache_dir = get_cache_dir(source)
        cache_dir.mkdir(parents=True, exist_ok=True)
        _write_pyc(_Quiet, code, source_hash, cache_dir / (source.name[:-3] + PYC_TAIL))


if __name__ == "__main__":
    _write(sys.argv[1], sys.argv[2:])
