"""One rank fails after torch.distributed started: every rank exits within seconds, each with one
line on stderr that names itself and the cause (docs/checkpoints.md, "A failing rank"), where
otherwise its peers would fail or hang in their next collective without saying why.

The failing rank publishes "rank Q: <cause>" under one key of the rendezvous store (rank 0's
TCPStore, independent of the communication backend), prints its line and exits 1; a daemon
thread on every rank polls that key and exits 1 with "stopping: rank Q failed: <cause>", even
while its main thread is stuck in a collective. The first report wins (a peer's symptom never
hides the cause); a failing rank 0 waits until the others have read it; a vanished store is
reported as such. Test hook: GPT3D_FAULT_INJECT="RANK:STEP" raises before that optimizer step."""
import os
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Optional, Tuple

from launch.errors import ConfigError

FAULT_ENV = "GPT3D_FAULT_INJECT"
TRACEBACK_ENV = "GPT3D_TRACEBACK"
"""Set to 1 to print the failing rank's whole traceback before its one line."""

_KEY, _ACK, _DONE = "gpt3d/failure", "gpt3d/failure_ack", "gpt3d/failure_done"
_POLL_S = 1.0  # one small store request per rank per second, also at a thousand ranks
_ACK_WAIT_S = 5.0  # the longest a failing rank waits for the others to read its cause
_STORE_LOST_POLLS = 5  # consecutive store errors before a watcher concludes rank 0 is gone
_REPO = str(Path(__file__).resolve().parents[2])  # the repository root: launch/runtime/failure.py
# What a collective says when the rank at the other end is gone. Only these get the "peer"
# hint: an NCCL or CUDA error raised by this rank's own device is reported as what it is.
_PEER_LOST = ("connection closed by peer", "connection reset by peer", "broken pipe", "timed out", "timeout")
_report_lock = threading.Lock()  # one line per process: the first reporter exits, others block
_watcher: Optional["FailureWatcher"] = None  # this process's, once torch.distributed is up


def fault_injection() -> Optional[Tuple[int, int]]:
    """(rank, step) from GPT3D_FAULT_INJECT, None when unset; a ConfigError when malformed."""
    value = os.environ.get(FAULT_ENV)
    if not value:
        return None
    try:
        rank, step = (int(part) for part in value.split(":"))
    except ValueError:
        raise ConfigError(f"{FAULT_ENV}={value!r} must be RANK:STEP (a test hook, e.g. 1:2)") from None
    return rank, step


def maybe_inject_fault(fault: Optional[Tuple[int, int]], rank: int, step: int) -> None:
    if fault == (rank, step):
        raise RuntimeError(f"fault injected by {FAULT_ENV}={rank}:{step} before step {step}")


def describe(error: BaseException) -> str:
    """`Type: first lines of the message (at file:line in function)`, at the innermost frame of
    this repository's code (else the innermost frame), so the one line says where it started."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    message = " / ".join(lines[:2])
    if len(message) > 400:
        message = message[:400] + "..."
    frames = traceback.extract_tb(error.__traceback__)
    ours = [f for f in frames if f.filename.startswith(_REPO)]
    where = ""
    if ours or frames:
        frame = (ours or frames)[-1]
        name = os.path.relpath(frame.filename, _REPO) if frame.filename.startswith(_REPO) else frame.filename
        where = f" (at {name}:{frame.lineno} in {frame.name})"
    hint = "; a peer rank probably died or hung, see its line and the launcher's" \
        if any(symptom in message.lower() for symptom in _PEER_LOST) else ""
    return (f"{type(error).__name__}: {message}" if message else type(error).__name__) + where + hint


def _connect_store(timeout_s: float):
    """A client of the run's rendezvous store (the TCPStore torch.distributed's env:// started)."""
    import torch.distributed as dist
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


def _say(line: str) -> None:
    print(f"error: rank {os.environ.get('RANK', '?')}: {line}", file=sys.stderr, flush=True)


def report_failure(error: BaseException) -> None:
    """The main thread caught `error` on this rank: one line, exit 1 (never returns). Through
    the watcher once torch.distributed is up, so that every other rank stops too."""
    if _watcher is not None:
        _watcher.fail(error)
    if os.environ.get(TRACEBACK_ENV) == "1":
        traceback.print_exception(error)
    with _report_lock:
        _say(describe(error))
        os._exit(1)  # a normal exit could wait on a half-started process group


class FailureWatcher:
    """Start on every rank right after torch.distributed is up. A run that finished calls, on
    every rank: a barrier (all work done, still watched), `stop()`, then the final barrier
    (after which rank 0 may exit and its store go away: no watcher may poll any more)."""

    def __init__(self, rank: int, world_size: int):
        global _watcher
        _watcher = self
        self.rank, self.world_size = rank, world_size
        self.store = _connect_store(timeout_s=30)  # the main thread's client
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="gpt3d-failure-watcher", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        store = _connect_store(timeout_s=10)  # a client of its own: no contention with the main thread
        errors = 0
        while not self._stop.wait(_POLL_S):
            try:
                if not store.check([_KEY]):
                    errors = 0
                    continue
                cause = store.get(_KEY).decode()
            except Exception as e:  # the store's host (rank 0) is gone, or the network is
                errors += 1
                if errors < _STORE_LOST_POLLS:
                    continue
                with _report_lock:
                    if self._stop.is_set():
                        return
                    _say(f"stopping: lost the rendezvous store on rank 0 ({os.environ.get('MASTER_ADDR')}:"
                         f"{os.environ.get('MASTER_PORT')}: {type(e).__name__}); rank 0 probably died, see its log")
                    os._exit(1)
            if cause.startswith(f"rank {self.rank}:"):  # our own report: the main thread is on it
                return
            with _report_lock:
                try:
                    store.add(_ACK, 1)
                except Exception:
                    pass
                _say(f"stopping: {cause.split(':', 1)[0]} failed:{cause.split(':', 1)[1]}")
                if self.rank == 0:  # the store's host stays until the failing rank is done with it
                    self._wait_for(store, lambda: store.check([_DONE]))
                os._exit(1)

    def fail(self, error: BaseException) -> None:
        """This rank's main thread caught `error`: report it once (or the cause another rank
        published first), let the others read it, exit 1. Never returns."""
        if os.environ.get(TRACEBACK_ENV) == "1":
            traceback.print_exception(error)
        with _report_lock:
            mine = f"rank {self.rank}: {describe(error)}"
            try:
                # First report wins: set only if no rank published yet; returns the value now there.
                published = self.store.compare_set(_KEY, "", mine).decode()
            except Exception:
                published = mine  # the store is gone (rank 0 died): our own symptom is all we know
            if published != mine:
                try:
                    self.store.add(_ACK, 1)
                except Exception:
                    pass
                rank, cause = published.split(":", 1)
                _say(f"stopping: {rank} failed:{cause}")
                if self.rank == 0:
                    self._wait_for(self.store, lambda: self.store.check([_DONE]))
                os._exit(1)
            _say(mine.split(": ", 1)[1])
            self._wait_for(self.store, lambda: self.store.add(_ACK, 0) >= self.world_size - 1)
            try:
                self.store.set(_DONE, "1")
            except Exception:
                pass
            os._exit(1)

    @staticmethod
    def _wait_for(store, condition) -> None:
        """Poll `condition` for at most _ACK_WAIT_S seconds; a store error ends the wait."""
        deadline = time.monotonic() + _ACK_WAIT_S
        try:
            while not condition() and time.monotonic() < deadline:
                time.sleep(0.1)
        except Exception:
            pass
