"""Asynchronous saves (train.async_save, docs/checkpoints.md "Asynchronous saves"): the save builds
a host snapshot of everything this rank writes and returns; a background thread fills the snapshot,
writes and fsyncs the files, agrees with the other ranks' writers, and rank 0's then commits
complete.json and `latest` as the synchronous save does (store.py: _commit). At most one save is in
flight: the next save, the end of the run and a stop wait for it (`AsyncSaver.wait`).

The snapshot goes through DeepSpeed's own save path (engine.save_checkpoint) with a checkpoint engine
that keeps each state dict instead of writing it (`_Capture`), so the files hold what the synchronous
save writes, byte for byte. Each state dict is deep-copied with its storages shared as they were
(torch.save writes a view's whole storage, once: ZeRO's partitions are views of flat buffers), into
host buffers that the next save reuses, page-locked for device tensors. The save returns with the
buffers allocated but not yet filled: the writer's thread copies into them (device storages on a
side stream) while the next step's forward and backward run, and that step's optimizer step, the
only place the tensors still to copy change (DeepSpeed's save has cloned the layer weights already),
waits until the copies are done (`AsyncSaver._gate`). Host
memory: one snapshot, the bytes this rank's save writes (launch/analysis/memory_formulas.py:
checkpoint_snapshot_bytes).

Why not DeepSpeed's own engines (deepspeed/runtime/checkpoint_engine/ in 0.19.8): the decoupled
engine hands the live state dicts to a subprocess through a torch.multiprocessing queue (shared
memory, not a snapshot: the next optimizer step changes what it writes), writes with the fast
engine, which needs the async_io op (libaio) built and fsyncs files but no directory, then rewrites
`latest` in place after a barrier, with no manifest; the fast engine alone is synchronous. Neither
commits `latest` atomically after every rank's files are durable, which the resume relies on.

Agreement: every rank's writer, after its fsyncs, all-reduces whether it wrote (the minimum) on a
gloo group of its own (created at the first asynchronous save, on every rank, in the same order),
so the commit follows the last rank's durable files without the training thread taking part, and
`latest` moves as soon as the slowest rank has written; a rank whose write failed vetoes the commit
and every rank raises at its next wait. A rank killed during the write never joins: nothing
commits, and the failure watcher (launch/resilience/failure.py) ends the others.

A save directory on object storage (object_store.py) is uploaded by the same thread after the local
commit: each node's files, then a second agreement on the same group (whether every upload
succeeded, in place of the synchronous publish's barrier on the default group, which the training
thread is using meanwhile), then rank 0's complete.json, `latest` and pruning in the store. `wait`
joins the upload too, so at most one save, upload included, is in flight."""
from __future__ import annotations

import contextlib
import copy
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from launch.checkpoints import slow_save
from launch.checkpoints.safe_io import SafeCheckpointEngine, fsync_file


class HostSnapshot:
    """Deep copies of state dicts on the host, one buffer per storage. `copy` returns the copy at once,
    its tensors in buffers that `fill` (the writer's thread) fills later: until then the caller must
    not let anything change the originals (AsyncSaver gates the optimizer's step on it). The buffers
    (page-locked for device storages) are kept for the next snapshot, whose copy then faults in no new
    pages (the previous snapshot's write has ended before the next begins)."""

    def __init__(self):
        self._pinned: List[torch.UntypedStorage] = []
        self._used = 0
        self._pending: List[Tuple[torch.UntypedStorage, torch.UntypedStorage]] = []  # (host, source)
        self._ready = None  # a CUDA event after the work that produced the device sources
        self.bytes = 0  # host bytes of the storages copied since `begin`

    def begin(self) -> None:
        self._used, self.bytes, self._pending = 0, 0, []

    def copy(self, obj: Any) -> Any:
        memo: Dict[int, Any] = {}
        storages: Dict[Tuple[str, int], torch.UntypedStorage] = {}
        for t in _tensors(obj):
            key = (str(t.device), t.untyped_storage().data_ptr())
            if key not in storages:
                storages[key] = self._host_storage(t.untyped_storage(), pin=t.device.type == "cuda")
            host = torch.empty(0, dtype=t.dtype).set_(storages[key], t.storage_offset(), t.size(), t.stride())
            # As torch.save pickles it: the type and requires_grad (a view of a parameter is no leaf,
            # which copy.deepcopy refuses).
            memo[id(t)] = (torch.nn.Parameter(host, t.requires_grad) if isinstance(t, torch.nn.Parameter)
                           else host.requires_grad_(t.requires_grad))
        return copy.deepcopy(obj, memo)  # the containers and other objects (a loss scaler), tensors from memo

    def seal(self) -> None:
        """In the training thread, after the last `copy`: where the device's sources are final."""
        if any(source.device.type == "cuda" for _, source in self._pending):
            self._ready = torch.cuda.Event()
            self._ready.record()

    def fill(self) -> None:
        """Copy every source into its buffer (device storages on a side stream, after `seal`'s event)."""
        pending, self._pending = self._pending, []
        stream = None
        if self._ready is not None:
            stream = torch.cuda.Stream()
            stream.wait_event(self._ready)
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for host, source in pending:
                host.copy_(source, non_blocking=source.device.type == "cuda")
        if stream is not None:
            stream.synchronize()
        self._ready = None

    def _host_storage(self, storage: torch.UntypedStorage, pin: bool) -> torch.UntypedStorage:
        nbytes = storage.nbytes()
        if self._used < len(self._pinned) and self._pinned[self._used].nbytes() == nbytes:
            host = self._pinned[self._used]
        else:
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin).untyped_storage()
            self._pinned[self._used:self._used + 1] = [host]
        self._used += 1
        self.bytes += nbytes
        self._pending.append((host, storage))
        return host


def _tensors(obj: Any):
    """The tensors in nested dicts, lists and tuples (DeepSpeed's state dicts); tensors inside other
    objects (a loss scaler's) are left to copy.deepcopy."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


class _Capture(SafeCheckpointEngine):
    """DeepSpeed's save path, each file kept as a host snapshot instead of written."""

    def __init__(self, config_params, snapshot: HostSnapshot):
        super().__init__(config_params)
        self.snapshot = snapshot
        self.files: List[Tuple[Path, Any]] = []

    def save(self, state_dict, path: str):
        self.files.append((Path(path), self.snapshot.copy(state_dict)))


def write_file(obj: Any, path: Path) -> None:
    """One snapshot file, written and fsynced (store.py's save_durably; a test wraps it to hold a write)."""
    torch.save(obj, path)
    fsync_file(path)


class AsyncSaver:
    """One rank's background writer. `capture` collects a save's files; `start` writes them in a thread
    and then calls `commit` (rank 0's: complete.json and `latest`) after every rank's writer is done;
    `wait` joins it and raises what it raised."""

    def __init__(self, timeout_s: float = 600.0):
        self.snapshot = HostSnapshot()
        self.timeout_s = timeout_s  # the agreement's bound: the synchronous save's barrier has train.dist_timeout_s
        self.group = None
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self.write_s: Optional[float] = None  # the last background write, barrier and commit included
        self.copied = threading.Event()  # the snapshot's copies are taken: the optimizer may step
        self.copied.set()
        self.gated_s = 0.0  # seconds optimizer steps waited for `copied` since the last capture

    def capture(self, engine) -> _Capture:
        if self.group is None:  # collective: every rank's first asynchronous save creates it
            self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout_s))
        self._gate(engine.optimizer)
        self.snapshot.begin()
        self.gated_s = 0.0
        return _Capture(engine._config, self.snapshot)

    def _gate(self, optimizer) -> None:
        """Between a save and the end of its copies, the weights and optimizer states it holds change
        only in the optimizer's step (DeepSpeed's _take_model_step; forward and backward write
        activations and gradients, which a checkpoint does not hold): that step waits for `copied`,
        so the copies overlap the next step's forward and backward (as Megatron-core's and
        torchtitan's asynchronous saves overlap their device-to-host copy)."""
        if getattr(optimizer, "_snapshot_gate", None) is self:
            return
        step = optimizer.step

        def step_after_the_snapshot(*args, **kwargs):
            if not self.copied.is_set():
                start = time.perf_counter()
                self.copied.wait()
                self.gated_s += time.perf_counter() - start
            return step(*args, **kwargs)
        optimizer.step, optimizer._snapshot_gate = step_after_the_snapshot, self

    def start(self, files: List[Tuple[Path, Any]], rank: int, commit: Optional[Callable[[], None]],
              publish: Optional[Callable[[Callable[[bool], bool]], None]] = None) -> None:
        """`publish` (every rank, --save on object storage): after the commit, called with `agree` in
        place of a barrier (object_store.py: RemoteDir.publish)."""
        assert self._thread is None, "at most one save in flight: wait() first"
        self._error = None
        self.snapshot.seal()
        self.copied.clear()
        self._thread = threading.Thread(target=self._write, args=(files, rank, commit, publish),
                                        name="checkpoint-write", daemon=True)  # a failure leaves by os._exit
        self._thread.start()

    def agree(self, ok: bool) -> bool:
        """Whether every rank's writer is `ok` (an all-reduce on this saver's own group, never the
        training's default group, which the training thread uses meanwhile)."""
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item())

    def _write(self, files: List[Tuple[Path, Any]], rank: int, commit: Optional[Callable[[], None]],
               publish: Optional[Callable[[Callable[[bool], bool]], None]] = None) -> None:
        start = time.perf_counter()
        agreed = None  # the agreement's answer; None if it raised (a rank gone): no collective after it
        try:
            try:
                self.snapshot.fill()
            finally:
                self.copied.set()
            while files:
                path, obj = files.pop(0)
                write_file(obj, path)
            slow_save.wait_if_asked(rank)  # a test hook, nothing unless GPT3D_SLOW_SAVE is set
        except BaseException as e:  # raised in the training thread by wait(); the others learn it below
            print(f"rank {rank}: the background checkpoint write failed: {type(e).__name__}: {e}", flush=True)
            self._error = e
        try:
            # Every rank's files are durable before the commit; a rank whose write failed vetoes it.
            agreed = self.agree(self._error is None)
            if not agreed and self._error is None:
                self._error = RuntimeError("another rank's write failed; this checkpoint is not committed")
            if commit is not None and self._error is None:
                commit()
        except BaseException as e:
            self._error = self._error or e
        if publish is not None and agreed is not None:
            try:
                # Every rank calls `agree` once more, inside publish or here: a rank whose write or
                # local commit failed vetoes the upload's commit.
                if self._error is None:
                    publish(self.agree)
                else:
                    self.agree(False)
            except BaseException as e:
                print(f"rank {rank}: the background upload failed: {type(e).__name__}: {e}", flush=True)
                self._error = self._error or e
        self.write_s = time.perf_counter() - start

    @property
    def in_flight(self) -> bool:
        return self._thread is not None

    def wait(self) -> None:
        """Until the save in flight (if any) is written and committed; raise its error."""
        if self._thread is None:
            return
        self._thread.join()
        self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"the background checkpoint write failed: {type(error).__name__}: {error}") from error
