"""The save directory's record of a run's starts, and the cap that ends a requeue loop
(docs/resilience.md, "Requeues").

A scheduler that reruns one command line after every failure (`--save DIR --load DIR`, a SLURM
requeue) reruns a deterministic failure (a bad node, an error at step N, a hang) for ever, each
attempt moving the later tags aside. NVIDIA's resiliency extension stops restarting after a few
cycles without a newer checkpoint (nvidia_resiliency_ext/fault_tolerance/progress_tracker.py:
TrainingProgressTracker). Here `train.max_starts_without_progress` (3; 0: no cap) counts the
starts in a row that began at the current resume point, so that none of them committed a newer
checkpoint; a requeue beyond them is refused in one line, exit 2, before any heavy work and with
nothing in DIR moved or written. A start that finished, stopped with a save, or saved on its way
is progress: the next one begins at a newer checkpoint.

DIR/starts.jsonl holds one JSON object per start (the newest KEEP): "started" (UTC), "from_step"
(the checkpoint's step, null for none) and "ended": "finished at step N", "stopped by a signal
after step N, saved", the first error line global rank 0 said before it exited
(launch/resilience/failure.py: error_line_hook; it says every failure's cause, another rank's too),
or null when the start was killed or lost without a word. Only global rank 0 writes it, each time
the whole file (launch/checkpoints/safe_io.py: write_durably, an atomic rename).

Every rank decides alone, from the same inputs: the record as it was before this start, and the
resume point that each rank already finds for itself (launch/checkpoints/locate.py:
find_resume_point). Rank 0 writes this start's record only after the process group is up and a
barrier has passed, so after every rank has read the file: no rank can see this start's own
record, and all reach the same verdict without a message between them, before torch.distributed
starts. (Rank 0 deciding and publishing the verdict through the TCPStore would refuse only once
the process group is up, after the ranks' heavy imports and start-up.)
"""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional

from launch.checkpoints.locate import STARTS
from launch.errors import ConfigError, printable

if TYPE_CHECKING:  # annotations only
    from launch.checkpoints.locate import CheckpointRef

KEEP = 100
"""Records kept in starts.jsonl: the recent starts are all the cap reads."""
_NO_LINE = "no line recorded: killed or lost, see the job's log"


def _printable(text: str, limit: int = 500) -> str:
    """`text` on one line: control characters escaped, at most `limit` characters."""
    text = printable(text)
    return text if len(text) <= limit else text[:limit] + "..."


def read_starts(save: Path) -> List[Dict[str, Any]]:
    """The records of DIR/starts.jsonl, oldest first ([] when there is none). A line that is not a
    record (hand-edited, or of another version) is left out: the cap is a safety net, not a
    reason to stop a run."""
    path = save / STARTS
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return []
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} cannot be read ({type(e).__name__}: {_printable(str(e), 200)}); fix it or remove "
                          f"it (it only records the run's starts)") from None
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):  # RecursionError: nested too deep
            continue
        if (isinstance(record, dict) and isinstance(record.get("from_step"), (int, type(None)))
                and not isinstance(record.get("from_step"), bool)
                and isinstance(record.get("ended"), (str, type(None)))):
            records.append(record)
    return records


def starts_without_progress(records: List[Dict[str, Any]], from_step: Optional[int]) -> List[Dict[str, Any]]:
    """The newest records in a row that began at `from_step`, oldest first: had one of them saved a
    newer checkpoint, a later start would have begun there."""
    streak: List[Dict[str, Any]] = []
    for record in reversed(records):
        if record["from_step"] != from_step:
            break
        streak.insert(0, record)
    return streak


def refuse_a_requeue_loop(save: Optional[Path], load: Optional[Path], resume_from: Optional[CheckpointRef],
                          cap: int) -> None:
    """ConfigError when this start is a requeue (`--load` and `--save` name one directory) and the
    last `cap` starts all began where it would begin. Every rank calls it before torch.distributed
    starts; it reads DIR and writes nothing."""
    if cap == 0 or save is None or load is None or load.resolve() != save.resolve():
        return
    from_step = resume_from.meta["step"] if resume_from is not None else None
    streak = starts_without_progress(read_starts(save), from_step)
    if len(streak) < cap:
        return
    lines = [r["ended"] for r in streak if r["ended"] is not None]
    where = f"the checkpoint of step {from_step}" if from_step is not None else "no checkpoint (step 1)"
    raise ConfigError(f"--save {_printable(str(save))}: the last {len(streak)} starts all began at {where} and none "
                      f"saved a newer one (train.max_starts_without_progress={cap}); the last failure: "
                      f"{_printable(lines[-1]) if lines else _NO_LINE}. Another start would fail the same way: fix "
                      f"the cause, then remove {_printable(str(save / STARTS))} or raise "
                      f"train.max_starts_without_progress (0: no cap)")


class StartRecord:
    """Global rank 0's record of this start in DIR/starts.jsonl (`begin`), updated with how it
    ended (`ended`, or `failed` with the first error line)."""

    def __init__(self, save: Path, from_step: Optional[int]):
        self.path = save / STARTS
        self.record: Dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                       "from_step": from_step, "ended": None}
        self._lock = threading.Lock()  # the main thread and a failure watcher's thread may both end it
        self._records = read_starts(save)[-(KEEP - 1):] + [self.record]
        self._write()

    @classmethod
    def begin(cls, save: Optional[Path], resume_from: Optional[CheckpointRef], rank: int) -> Optional[StartRecord]:
        """Every rank calls it once the process group is up; global rank 0 records the start and
        returns its StartRecord (None elsewhere, and without --save)."""
        if save is None:
            return None
        import torch.distributed as dist
        from launch.resilience import failure
        dist.barrier()  # every rank has read the record (refuse_a_requeue_loop) before it changes
        if rank != 0:
            return None
        record = cls(save, resume_from.meta["step"] if resume_from is not None else None)
        failure.error_line_hook = record.failed
        return record

    def ended(self, step: int, stopped: bool) -> None:
        """The run finished, or stopped after a save."""
        self._end(f"stopped by a signal after step {step}, saved" if stopped else f"finished at step {step}")

    def failed(self, line: str) -> None:
        """The first error line this rank says (failure.py's hook; it is about to exit): the cause.
        Never raises: a record that cannot be written must not hide the failure."""
        try:
            self._end(line)
        except Exception:
            pass

    def _end(self, how: str) -> None:
        with self._lock:
            if self.record["ended"] is not None:  # the first end is the cause; later lines are its echoes
                return
            self.record["ended"] = how
            self._write()

    def _write(self) -> None:
        from launch.checkpoints.safe_io import write_durably
        write_durably(self.path, "".join(json.dumps(r) + "\n" for r in self._records))
