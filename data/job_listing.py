"""What rank 0 computes once for the whole job, read by every other rank (`once_per_job`): first of
all a source's files listed once per job: rank 0 lists them (a hub id's
resolution, a glob's directory listing, one HEAD per file) and puts the listing in the job's
rendezvous store; every other rank reads it there. Listing in every process would mean 1,024 hub
resolutions and 1,024 x files HEADs at once at 1,024 GPUs, and one process per node still 128.

The store is torch's TCPStore at MASTER_ADDR:MASTER_PORT, opened before the process group starts
(the data is checked first, so that bad input fails before anything heavy), with multi_tenant=True
as torch.distributed's env:// rendezvous opens it: rank 0's server is the one the process group
then uses, so no port is opened twice. A listing that fails on rank 0 reaches every rank as the
same one line. A process alone (no WORLD_SIZE > 1 with a MASTER_ADDR and MASTER_PORT) lists for
itself."""
import hashlib
import json
import os
from datetime import timedelta
from typing import Any, Callable, Optional

from data.spec import DataError

KEY_PREFIX = "gpt3d/listing/"
DEFAULT_WAIT_S = 1800  # torch.distributed's default timeout; the launcher sets train.dist_timeout_s
_wait_s = DEFAULT_WAIT_S
_kept_server: Optional[Any] = None
"""Rank 0's store, kept until the process ends: the process group's rendezvous reuses its server."""


def set_wait_limit(seconds: int) -> None:
    """How long a rank waits for rank 0's listing (the run's train.dist_timeout_s)."""
    global _wait_s
    _wait_s = seconds


def in_a_job() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ


def listed_once_per_job(what: Any, label: str, list_files: Callable[[], dict]) -> dict:
    """list_files() (a JSON-able listing) on rank 0, its result on every rank; `what` (JSON-able)
    names the listing, `label` the source in messages."""
    return once_per_job(what, list_files, f"data.name={label!r}: rank 0 failed to list the files",
                        f"data.name={label!r}: rank 0 did not list the files")


def once_per_job(what: Any, compute: Callable[[], Any], failed: str, silent: str) -> Any:
    """compute() (JSON-able) on rank 0 and its result on every rank, through the job's rendezvous
    store; a process alone computes for itself. `failed` and `silent` begin the one-line errors
    the other ranks raise when rank 0 fails or never answers."""
    if not in_a_job():
        return compute()
    import torch.distributed as dist
    global _kept_server
    key = KEY_PREFIX + hashlib.sha256(json.dumps(what, default=str).encode()).hexdigest()[:20]
    rank = int(os.environ["RANK"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None, rank == 0,
                          timeout=timedelta(seconds=_wait_s), wait_for_workers=False, multi_tenant=True)
    if rank == 0:
        _kept_server = store
        try:
            result = compute()
        except DataError as e:
            store.set(key, json.dumps({"error": str(e)}))
            raise
        except BaseException as e:
            store.set(key, json.dumps({"error": f"{failed} ({type(e).__name__}); its own error says why"}))
            raise
        store.set(key, json.dumps({"result": result}))
        return result
    try:
        answer = json.loads(store.get(key))
    except RuntimeError:  # torch's DistStoreError (a RuntimeError): rank 0 never answered
        raise DataError(f"{silent} within train.dist_timeout_s={_wait_s} s; see rank 0's output") from None
    finally:
        del store  # this rank's connection; the process group opens its own
    if "error" in answer:
        raise DataError(answer["error"])
    return answer["result"]
