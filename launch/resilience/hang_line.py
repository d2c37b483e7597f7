"""What the hang watchdog (launch/resilience/hang_watchdog.py) says: where each rank's main thread is,
and the one line that names the ranks that are not where the others are."""
from __future__ import annotations

import sys
import threading
from collections import Counter
from pathlib import Path
from typing import Dict, Optional

from launch.checkpoints.locate import HANG_STACKS
from launch.errors import our_file

_NAMED_AT_MOST = 8  # ranks named in the line; the stacks files hold the rest


def stacks_dir(save: Optional[Path], metrics_out: Optional[Path]) -> Path:
    """Beside the run: DIR/hang-stacks with --save DIR, else beside --metrics-out, else ./hang-stacks."""
    if save is not None:
        return Path(save) / HANG_STACKS
    return (Path(metrics_out).parent if metrics_out is not None else Path.cwd()) / HANG_STACKS


def main_thread_position() -> str:
    """Where the main thread is: "in torch.distributed.NAME (from FILE:LINE)" inside a collective or
    a point-to-point call, else "at FILE:LINE in FUNCTION" (our innermost frame, else the innermost)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    stack = []
    while frame is not None:  # innermost first
        stack.append(frame)
        frame = frame.f_back
    ours = [f for f in stack if our_file(f.f_code.co_filename) is not None]
    caller = f" (from {_where(ours[0])})" if ours else ""
    for f in stack:
        if "/torch/distributed/" in f.f_code.co_filename and f.f_code.co_name != "wrapper":
            return f"in torch.distributed.{f.f_code.co_name}{caller}"
    innermost = (ours or stack)[0] if stack else None
    return f"at {_where(innermost)} in {innermost.f_code.co_name}" if innermost is not None else "unknown"


def _where(frame) -> str:
    return f"{our_file(frame.f_code.co_filename) or frame.f_code.co_filename}:{frame.f_lineno}"


def hang_line(positions: Dict[int, str], world_size: int, causes: Dict[int, str], stacks_dir: Path) -> str:
    """The published cause, "rank Q: hang: <Q's cause>; ..." (or "every rank: hang: ..." when no rank
    stands out): the ranks not where the others are, named with their positions. `causes`: each
    reporting rank's own account of what overran which bound ("no step ended for 130 s (bound ...)")."""
    silent = [r for r in range(world_size) if r not in positions]
    by_position = Counter(positions.values())
    in_collective = {p for p in by_position if p.startswith("in torch.distributed.")}
    if in_collective and len(in_collective) < len(by_position):
        # Some ranks wait in a collective, others are outside any: the latter hold the others up.
        common = max(in_collective, key=lambda p: by_position[p])
        odd = sorted(r for r, p in positions.items() if p not in in_collective)
    else:
        common = max(by_position, key=lambda p: by_position[p]) if by_position else None
        odd = sorted(r for r, p in positions.items() if p != common)
    odd_named = [f"rank {r} {positions[r]}" for r in odd[:_NAMED_AT_MOST]]
    if len(odd) > _NAMED_AT_MOST:
        odd_named.append(f"{len(odd) - _NAMED_AT_MOST} more ranks elsewhere")
    if silent:
        odd_named.append(f"rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent[:_NAMED_AT_MOST]))} "
                         f"gave no position (a main thread holding the interpreter lock, or a lost watcher)")
    others = sum(1 for p in positions.values() if p == common)
    named = (odd or silent or [None])[0]
    head = f"rank {named}" if named is not None else "every rank"
    # The named rank's own account when it gave one (its data wait, its save), else the first reporter's.
    cause = causes.get(named) or (causes[min(causes)] if causes else "no step ended")
    where = (f"{'; '.join(odd_named)}, while {others} other rank{'s wait' if others != 1 else ' waits'} {common}"
             if odd_named else f"all {world_size} ranks wait {common}: a hung collective, kernel or network")
    return f"{head}: hang: {cause}; {where}; every rank's stacks are in {stacks_dir}/rank-*.txt"
