"""One rank fails after torch.distributed started: every rank exits within seconds, each with one
line on stderr that names itself and the cause (docs/resilience.md, "A failing rank"), where
otherwise its peers would fail or hang in their next collective without saying why.

The failing rank publishes "rank Q: <cause>" under one key of the rendezvous store (rank 0's
TCPStore, independent of the communication backend), prints its line and exits 1; a daemon
thread on every rank polls that key and exits 1 with "stopping: rank Q failed: <cause>", even
while its main thread is stuck in a collective. The first report wins (a peer's symptom never
hides the cause); a failing rank 0 waits until the others have read it; a vanished store is
reported as such. Test hook: GPT3D_FAULT_INJECT="RANK:STEP" raises before that optimizer step
(":hang" appended: sleeps there for ever, for launch/resilience/hang_watchdog.py).

A rank that dies or freezes without a word (SIGKILL, OOM kill, SIGSTOP, a lost node) is found
by heartbeats in the same store: every HEARTBEAT_INTERVAL_S each watcher writes "count step
host" and reads its successor's (rank+1 mod world: O(1) requests and bytes per rank, a ring that
watches every rank); a count that has not changed for train.heartbeat_timeout_s, by the reader's
own monotonic clock, is published as that rank's failure. A store that stops answering for as
long means rank 0, its host, is lost. These threads beat while the main thread waits in a
collective (the GIL is released there) and stop with the process when it is frozen.

The job, not only its ranks, must end: a launcher (DeepSpeed's, per node) waits 30 s
for a child that ignores its SIGTERM, and a frozen process answers nothing but SIGKILL. So each
heartbeat also carries the rank's pid and its parent's, and a survivor that learns a rank is lost
(or that rank 0's store is silent) SIGKILLs it when it is its sibling: on this host, under the same
parent (the node's launcher, or SLURM's step daemon). Then every process of the node has ended and
the launcher exits at once. A rank on a lost host is that host's launcher's to end, or gone with it."""
import os
import signal
import socket
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import Callable, Optional, Tuple

from launch.checkpoints.commit_guard import exit_after_commit
from launch.config.recipe import HEARTBEAT_INTERVAL_S
from launch.errors import ConfigError, our_file
from launch.resilience.clock import MONOTONIC, Clock
from launch.resilience.hang_watchdog import HangWatchdog

FAULT_ENV = "GPT3D_FAULT_INJECT"
TRACEBACK_ENV = "GPT3D_TRACEBACK"
"""Set to 1 to print the failing rank's whole traceback before its one line."""

_KEY, _ACK, _DONE = "gpt3d/failure", "gpt3d/failure_ack", "gpt3d/failure_done"
_POLL_S = 1.0  # one small store request per rank per second, also at a thousand ranks
_ACK_WAIT_S = 5.0  # the longest a failing rank waits for the others to read its cause
_STORE_LOST_POLLS = 5  # consecutive store errors (not silence: that is timed) before rank 0 is lost
# What a collective or the store says when the rank at the other end is gone (gloo, NCCL's
# watchdog, TCPStore). Only these get the "peer" hint, and never a message naming a CUDA error:
# "CUDA error: the launch timed out" is this rank's own kernel, not a lost peer.
_PEER_LOST = ("connection closed by peer", "connection reset by peer", "broken pipe", "timed out waiting",
              "timed out connecting", "collective operation timeout", "socket timeout", "wait timeout")
_LOCAL = ("cuda error", "cudaerror")
_report_lock = threading.RLock()  # one line per process: the first reporter exits, others block
_watcher: Optional["FailureWatcher"] = None  # this process's, once torch.distributed is up
error_line_hook: Optional[Callable[[str], None]] = None
"""Called with each line say_error writes; rank 0 records the first as how its start ended
(launch/resilience/restarts.py). It must not raise."""


def fault_injection() -> Optional[Tuple[int, int, str]]:
    """(rank, step, kind) from GPT3D_FAULT_INJECT="RANK:STEP[:hang]", None when unset; a
    ConfigError when malformed. kind "raise" (the default) raises, "hang" sleeps for ever."""
    value = os.environ.get(FAULT_ENV)
    if not value:
        return None
    parts = value.split(":")
    try:
        rank, step = int(parts[0]), int(parts[1])
        kind = parts[2] if len(parts) == 3 else "raise"
        if len(parts) not in (2, 3) or kind not in ("raise", "hang"):
            raise ValueError
    except (ValueError, IndexError):
        raise ConfigError(f"{FAULT_ENV}={value!r} must be RANK:STEP or RANK:STEP:hang "
                          f"(a test hook, e.g. 1:2)") from None
    return rank, step, kind


def maybe_inject_fault(fault: Optional[Tuple[int, int, str]], rank: int, step: int) -> None:
    if fault is None or fault[:2] != (rank, step):
        return
    if fault[2] == "hang":  # the heartbeat thread beats on: only the hang watchdog can see this
        while True:
            time.sleep(3600)
    raise RuntimeError(f"fault injected by {FAULT_ENV}={rank}:{step} before step {step}")


def describe(error: BaseException) -> str:
    """`Type: first lines of the message (at file:line in function)`, at the innermost frame of
    this repository's code (else the innermost frame), so the one line says where it started."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    message = " / ".join(lines[:2])
    if len(message) > 400:
        message = message[:400] + "..."
    frames = traceback.extract_tb(error.__traceback__)
    ours = [f for f in frames if our_file(f.filename) is not None]
    where = ""
    if ours or frames:
        frame = (ours or frames)[-1]
        where = f" (at {our_file(frame.filename) or frame.filename}:{frame.lineno} in {frame.name})"
    lowered = message.lower()
    peer = any(symptom in lowered for symptom in _PEER_LOST) and not any(local in lowered for local in _LOCAL)
    hint = "; a peer rank probably died or hung, see its line and the launcher's" if peer else ""
    return (f"{type(error).__name__}: {message}" if message else type(error).__name__) + where + hint


def _connect_store(timeout_s: float):
    """A client of the run's rendezvous store (the TCPStore torch.distributed's env:// started)."""
    import torch.distributed as dist
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


def say_error(line: str, rank: Optional[int] = None) -> None:
    """stderr: "error: rank R: <line>", R this process's RANK unless given."""
    # One write(2) of the whole line: ranks share the launcher's stderr, and a pipe keeps a write of
    # up to PIPE_BUF bytes whole, where print's separate text and newline writes can interleave.
    sys.stderr.flush()
    who = os.environ.get("RANK", "?") if rank is None else rank
    os.write(sys.stderr.fileno(), f"error: rank {who}: {line}\n".encode())
    if error_line_hook is not None:
        error_line_hook(line)


def report_failure(error: BaseException) -> None:
    """The main thread caught `error` on this rank: one line, exit 1 (never returns). Through
    the watcher once torch.distributed is up, so that every other rank stops too."""
    if _watcher is not None:
        _watcher.fail(error)
    if os.environ.get(TRACEBACK_ENV) == "1":
        traceback.print_exception(error)
    with _report_lock:
        say_error(describe(error))
        exit_after_commit(1)  # a normal exit could wait on a half-started process group


class FailureWatcher:
    """Start on every rank right after torch.distributed is up; call `completed(step)` after each
    step (the heartbeat carries it). A run that finished calls, on every rank: a barrier (all
    work done, still watched), `stop()`, then the final barrier (after which rank 0 may exit and
    its store go away: no watcher may poll any more)."""

    def __init__(self, rank: int, world_size: int, heartbeat_timeout_s: float = 60.0,
                 hang: Optional[HangWatchdog] = None, clock: Clock = MONOTONIC):
        global _watcher
        _watcher = self
        self.rank, self.world_size, self.timeout_s, self.hang = rank, world_size, heartbeat_timeout_s, hang
        self.clock = clock  # heartbeat ages and store silences (the polls themselves wait in real time)
        self.step = 0  # the last completed step, as the heartbeat reports it
        self.host = socket.gethostname()
        self.store = _main_thread_store()
        self._client: Optional[_TimedClient] = None  # the watcher thread's, once connected
        self._ran_at = self.clock.now()  # the last wake-up of either thread
        self._rank0_beat: Optional[str] = None  # rank 0's heartbeat, read once: who to end if its store falls silent
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="gpt3d-failure-watcher", daemon=True)
        self._thread.start()
        # A request to a frozen store never returns (TCPStore's timeout bounds connecting and
        # waiting for a key, not a reply): a second thread times the first.
        threading.Thread(target=self._time_the_store, name="gpt3d-store-timer", daemon=True).start()

    def completed(self, step: int) -> None:
        self.step = step

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _woke(self) -> None:
        """Every wake-up of either thread: a gap above the timeout means this process was frozen."""
        now = self.clock.now()
        if now - self._ran_at > self.timeout_s:
            self._leave_frozen(now - self._ran_at)
        self._ran_at = now

    def _time_the_store(self) -> None:
        while not self._stop.wait(_POLL_S):
            self._woke()
            silent_s = self.clock.now() - self._client.answered_at if self._client is not None else 0.0
            if silent_s > self.timeout_s:
                self._leave(f"{_store_lost()} did not answer a request for {silent_s:.0f} s "
                            f"(train.heartbeat_timeout_s={self.timeout_s:g}): rank 0 was killed, frozen or cut off, "
                            f"see its log; last completed step here: {self.step}", lost=(0, self._rank0_beat))

    def _watch(self) -> None:
        """The thread's body; it never ends silently: an error of its own ends the rank, with a line."""
        try:
            self._watch_until_stopped(self._connect())
        except Exception as e:
            self._leave(f"stopping: this rank's failure watcher failed, so the rank can no longer be watched: "
                        f"{describe(e)}")

    def _connect(self) -> "_TimedClient":
        """A store client of the watcher's own (the main thread's waits on the process group's
        client must not delay a heartbeat), retried for up to the heartbeat timeout."""
        first = self.clock.now()
        while True:
            try:
                self._client = _TimedClient(_connect_store(timeout_s=min(30.0, self.timeout_s)), self.clock)
                return self._client
            except Exception as e:
                if self.clock.now() - first > self.timeout_s:
                    self._leave(f"{_store_lost()} refused this rank's watcher for {self.clock.now() - first:.0f} s "
                                f"({type(e).__name__}): rank 0 died, or its process ran out of open files "
                                f"(see its log and `ulimit -n`)", lost=(0, None))
                time.sleep(_POLL_S)

    def _watch_until_stopped(self, store: "_TimedClient") -> None:
        peer = (self.rank + 1) % self.world_size
        seen, seen_at = None, self.clock.now()  # the peer's heartbeat count, when it last changed
        next_beat, count, errors = 0.0, 0, 0
        while not self._stop.wait(_POLL_S):
            self._woke()
            now = self.clock.now()
            try:
                if now >= next_beat:
                    count += 1
                    store.set(_beat_key(self.rank), f"{count} {self.step} {self.host} {os.getpid()} {os.getppid()}")
                    if self._rank0_beat is None and self.rank != 0 and store.check([_beat_key(0)]):
                        self._rank0_beat = store.get(_beat_key(0)).decode()
                    next_beat = now + HEARTBEAT_INTERVAL_S
                    if peer != self.rank:
                        beat = store.get(_beat_key(peer)).decode() if store.check([_beat_key(peer)]) else None
                        if beat is not None and beat.split()[0] != seen:
                            seen, seen_at = beat.split()[0], now
                        elif now - seen_at > self.timeout_s:
                            self._declare_lost(store, peer, beat, now - seen_at)
                published = store.get(_KEY).decode() if store.check([_KEY]) else None
                if published is None and self.hang is not None:
                    self.hang.poll(store, lambda line: self._publish(store, line, self.world_size - 1))
            except Exception as e:  # the store's host (rank 0) is gone, or the network is
                errors += 1
                if errors >= _STORE_LOST_POLLS:  # refused or reset: no need to wait for the timeout
                    self._leave(f"{_store_lost()} is gone ({type(e).__name__}): rank 0 probably "
                                f"died, see its log; last completed step here: {self.step}", lost=(0, self._rank0_beat))
                continue
            errors = 0
            if published is None:
                continue
            if published.startswith(f"rank {self.rank}: lost:"):  # slow or resumed: the others have left
                self._until_published(store)
                self._leave(f"stopping: the other ranks declared this rank lost:{published.split(':', 2)[2]}")
            if published.startswith(f"rank {self.rank}: hang:"):  # its main thread will not get to it
                try:
                    store.add(_ACK, 1)  # read: the publisher waits for every other rank, this one too
                except Exception:
                    pass
                self._until_published(store)
                self._leave(f"stopping: rank {self.rank} failed:{published.split(':', 1)[1]}")
            if published.startswith(f"rank {self.rank}:"):  # our own report: the main thread is on it
                return
            self._follow(store, published)

    def _declare_lost(self, store, peer: int, beat: Optional[str], silent_s: float) -> None:
        """Publish that `peer` is lost (unless a cause is already there: then follow that one),
        let the other survivors read it, exit 1."""
        _, step, host = beat.split()[:3] if beat is not None else ("", "none", "unknown (no heartbeat yet)")
        mine = (f"rank {peer}: lost: no heartbeat for {silent_s:.0f} s (train.heartbeat_timeout_s={self.timeout_s:g}) "
                f"from host {host}, last completed step {step}; killed, frozen or cut off (noticed by rank {self.rank})")
        self._publish(store, mine, self.world_size - 2, before_waiting=lambda: self._end_if_sibling(peer, beat))

    def _publish(self, store, mine: str, readers: int, before_waiting=lambda: None) -> None:
        """Publish the cause `mine` ("rank Q: ..." or "every rank: ...") unless one is already there
        (then follow that one), say it, let `readers` other ranks read it, exit 1."""
        with _report_lock:
            if self._stop.is_set():  # every rank finished its work (stop() was called): nothing to end
                return
            published = store.compare_set(_KEY, "", mine).decode()
            if published != mine:
                self._follow(store, published)
            who, cause = mine.split(":", 1)
            say_error(f"stopping: {who} failed:{cause}")
            before_waiting()
            self._wait_for(store, lambda: store.add(_ACK, 0) >= readers)
            try:
                store.set(_DONE, "1")
            except Exception:
                pass
            exit_after_commit(1)

    def _follow(self, store, published: str) -> None:
        """Another rank published `published` ("rank Q: cause"): acknowledge it, say it, exit 1;
        rank 0, the store's host, first waits until the publisher is done with the store."""
        with _report_lock:
            try:
                store.add(_ACK, 1)
            except Exception:
                pass
            rank, cause = published.split(":", 1)
            say_error(f"stopping: {rank} failed:{cause}")
            if cause.startswith(" lost:"):
                lost = int(rank.split()[1])
                try:
                    self._end_if_sibling(lost, store.get(_beat_key(lost)).decode() if store.check([_beat_key(lost)])
                                         else None)
                except Exception:
                    pass
            self._until_published(store)
            exit_after_commit(1)

    def _until_published(self, store) -> None:
        """Rank 0, the store's host, leaving on another rank's report: first wait (bounded) until
        the publisher is done with the store (it reads the acknowledgements, then marks the report
        done); leaving at once closed the store under it, whose requests then failed with
        "Broken pipe" on its stderr."""
        if self.rank == 0:
            self._wait_for(store, lambda: store.check([_DONE]))

    def _leave_frozen(self, gap_s: float) -> None:
        self._leave(f"stopping: this process did not run for {gap_s:.0f} s (stopped or starved), longer than "
                    f"train.heartbeat_timeout_s={self.timeout_s:g}: its peers have declared it lost")

    def _leave(self, line: str, lost: Optional[Tuple[int, Optional[str]]] = None) -> None:
        """Say `line` and exit 1, unless the run finished (stop() was called); `lost`: (rank, its
        last heartbeat) of a lost rank to end first if it is a sibling. Another thread may hold the
        lock inside a store request that never returns: then leave without it."""
        if _report_lock.acquire(timeout=_ACK_WAIT_S + 1) and self._stop.is_set():
            _report_lock.release()
            return
        say_error(line)
        if lost is not None:
            self._end_if_sibling(*lost)
        exit_after_commit(1)

    def _end_if_sibling(self, rank: int, beat: Optional[str]) -> None:
        """SIGKILL lost rank `rank` if its last heartbeat says it runs on this host under this
        process's parent (a frozen process ignores the launcher's SIGTERM for the 30 s it waits)."""
        fields = beat.split() if beat is not None else []
        if len(fields) < 5 or rank == self.rank:
            return
        host, pid, parent = fields[2], int(fields[3]), int(fields[4])
        if host != self.host or parent != os.getppid() or pid == os.getpid():
            return
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            return
        say_error(f"sent SIGKILL to lost rank {rank} (pid {pid} on this host), so that its launcher ends the job")

    def fail(self, error: BaseException) -> None:
        """This rank's main thread caught `error`: report it once (or the cause another rank
        published first), let the others read it, exit 1. Never returns."""
        if os.environ.get(TRACEBACK_ENV) == "1":
            traceback.print_exception(error)
        gap_s = self.clock.now() - self._ran_at
        if gap_s > self.timeout_s + _POLL_S:  # resumed after a freeze: the error is the peers having left
            self._leave_frozen(gap_s)
        with _report_lock:
            mine = f"rank {self.rank}: {describe(error)}"
            try:
                # First report wins: set only if no rank published yet; returns the value now there.
                published = self.store.compare_set(_KEY, "", mine).decode()
            except Exception as e:  # the store is gone, so rank 0 is: the cause, of which `error` is a symptom
                self._leave(f"{_store_lost()} is gone ({type(e).__name__}): rank 0 probably died, see its log; "
                            f"this rank then failed with {describe(error)}; last completed step here: {self.step}",
                            lost=(0, self._rank0_beat))
            if published != mine:
                self._follow(self.store, published)
            say_error(mine.split(": ", 1)[1])
            self._wait_for(self.store, lambda: self.store.add(_ACK, 0) >= self.world_size - 1)
            try:
                self.store.set(_DONE, "1")
            except Exception:
                pass
            exit_after_commit(1)

    @staticmethod
    def _wait_for(store, condition) -> None:
        """Poll `condition` for at most _ACK_WAIT_S seconds; a store error ends the wait."""
        deadline = time.monotonic() + _ACK_WAIT_S
        try:
            while not condition() and time.monotonic() < deadline:
                time.sleep(0.1)
        except Exception:
            pass


class _TimedClient:
    """A store client that knows when the store last answered one of its requests: a store that
    answers none for the heartbeat timeout means rank 0 is lost (timed per request, where
    a clock per poll of five requests declared a merely slow store lost early, with a wrong "for
    N s"). A failed request is no answer: a store that went away (rank 0 killed) stays silent
    from its last answer on, so every survivor leaves at the timeout, not later."""

    def __init__(self, store, clock: Clock):
        self._store, self.clock = store, clock
        self.answered_at = clock.now()

    def __getattr__(self, name: str):
        request = getattr(self._store, name)

        def timed(*args):
            answer = request(*args)
            self.answered_at = self.clock.now()
            return answer
        return timed


def _main_thread_store():
    """The process group's own client of the rendezvous store, not a new connection: rank 0's
    process holds one socket per client, so each rank keeps two (this one and the watcher's), and
    launch/engine/distributed.py checks rank 0's open-file limit for them. A new client where no
    process group is up (the tests' bare watchers)."""
    import torch.distributed as dist
    if not dist.is_initialized():
        return _connect_store(timeout_s=30)
    store = dist.distributed_c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):  # torch adds a prefix per group; our keys have none
        store = store.underlying_store
    return store


def _store_lost() -> str:
    return (f"stopping: rank 0 lost: the rendezvous store it hosts "
            f"({os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')})")


def _beat_key(rank: int) -> str:
    return f"gpt3d/heartbeat/{rank}"
