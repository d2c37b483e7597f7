"""Bad user input: the one error class every layer of launch/ raises, and how entry points
report it (one line, exit code 2). The lowest layer of launch/ (docs/design.md, Layers of launch/)."""
import os
import sys
import time
from pathlib import Path
from typing import Optional

from data.json_files import printable  # noqa: F401 (every entry point's one line escapes through it)

REPO_ROOT = Path(__file__).resolve().parents[1]
"""The checkout this code runs from (launch/errors.py is its lowest layer, so every layer may read it)."""


class ConfigError(Exception):
    """Bad user input: printed as one line, exit code 2, before any heavy work."""


class AlreadyFinished(Exception):
    """Not an error: a rerun (a scheduler's requeue) of a run whose checkpoint is at its last step.
    Printed as one line, exit code 0."""


BAD_INPUT_EXIT = 2


PRINTING_RANK_GRACE_S = 10.0
"""How long a rank other than 0 waits before it exits on bad input (below)."""


def report_bad_input(error: Exception) -> int:
    """Print `error: ...` once for the whole job (global rank 0 only); return exit code 2.

    The other ranks, which found the same error, leave only after a grace: DeepSpeed's launcher
    kills every rank as soon as one exits non-zero, and a rank 1 that exited first took rank 0 down
    before it printed (a run that ended with exit 2 and no line). Rank 0 exits within the grace,
    and the launcher then stops the waiting ranks."""
    if os.environ.get("RANK", "0") == "0":
        print(f"error: {printable(str(error))}", file=sys.stderr, flush=True)
    else:
        time.sleep(PRINTING_RANK_GRACE_S)
    return BAD_INPUT_EXIT


def our_file(filename: str) -> Optional[str]:
    """`filename` relative to the repository when it is this repository's code, else None (a
    virtual environment inside the checkout, as CI makes one, is not ours)."""
    if not filename.startswith(str(REPO_ROOT) + os.sep):
        return None
    relative = os.path.relpath(filename, REPO_ROOT)
    return None if "site-packages" in relative.split(os.sep) else relative
