"""Checkpoints on object storage: `--save s3://bucket/run`, `--load s3://...` (and gs://), through fsspec.

An object store has no rename, so the local commit (store.py: complete.json, then `latest`
renamed into place) cannot be done there. Instead a remote save directory is mirrored by a local
staging directory, $GPT3D_CACHE/remote/<hash of the URL>: every save is written and committed
there exactly as a local one, then published in the order that makes it a commit:
    1. each node's local rank 0 uploads the tag directory's files (every rank's files lie on its
       node's disk; no shared disk between nodes is needed; on a shared one the uploads repeat);
    2. after a barrier, global rank 0 uploads complete.json, with the sizes listed from the
       store itself (so it names every node's files);
    3. then `latest`, naming the tag; then `--keep-last` deletes the older tags of the history,
       each complete.json first (a half-deleted checkpoint is never complete).
With train.async_save each rank's background writer (async_save.py) publishes after its local
commit, with an all-reduce on its own process group in place of the barrier (an upload that
failed on any node vetoes step 2): the training thread takes no part.
A save cut short before step 2 leaves a tag without complete.json, which no load takes; one cut
between 2 and 3 leaves `latest` naming the previous checkpoint. S3 and GCS read back what was
written (strong read-after-write consistency), so the order written is the order read.

`--load URL` downloads the checkpoint that `latest` names (its complete.json must be there) or
the tag directory given into the staging directory, complete.json last, and loads it as a local
one: re-sharding, the manifest checks and the export are the local code. At a start, global rank
0 deletes the remote tags after the resumed step (a save cut short, or the history a resume of an
older tag abandons: there is no rename to set them aside) and points `latest` at the resumed tag.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

from launch.checkpoints.locate import LATEST, CheckpointRef, own_tag, resumes_from, step_of
from launch.checkpoints.manifest import COMPLETE, inside_tag_dir
from launch.checkpoints.safe_io import write_durably
from launch.errors import ConfigError

if TYPE_CHECKING:  # annotations only
    import argparse

SCHEMES = {"s3": "s3fs", "gs": "gcsfs", "gcs": "gcsfs"}
"""The object stores a checkpoint URL may name, and the fsspec backend each needs."""
WRITER = ".rank0-job"
"""In a staging directory: the job whose global rank 0 saves through it (`_job_id`)."""
STAGING = "remote"
"""$GPT3D_CACHE/remote/<hash>: the local mirror of a remote save directory."""


def is_remote(location: Any) -> bool:
    return isinstance(location, str) and location.split("://", 1)[0] in SCHEMES and "://" in location


def staging_dir(url: str) -> Path:
    from data.cache import default_cache_dir
    return default_cache_dir() / STAGING / hashlib.sha256(url.encode()).hexdigest()[:16]


def split_tag(url: str) -> Tuple[str, Optional[str]]:
    """(save directory URL, tag or None) of a `--load` URL: a save directory or one tag directory."""
    url = url.rstrip("/")
    head, _, last = url.rpartition("/")
    return (head, last) if step_of(last) is not None and "://" in head else (url, None)


def _job_id() -> str:
    """What every rank of one job shares and the next job most likely does not: the rendezvous."""
    return f"{os.environ.get('MASTER_ADDR', '')}:{os.environ.get('MASTER_PORT', '')}"


class RemoteDir:
    """A save directory on object storage and its local staging directory."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.local = staging_dir(self.url)
        scheme = self.url.split("://", 1)[0]
        try:
            import fsspec
            # No listings cache: another process (a rank, the next start) changes the store meanwhile.
            self.fs, self.path = fsspec.core.url_to_fs(self.url, use_listings_cache=False)
        except ImportError:
            raise ConfigError(f"{self.url}: checkpoints on {scheme}:// need {SCHEMES[scheme]}: pip install "
                              f"{SCHEMES[scheme]}") from None

    def _remote(self, *parts: str) -> str:
        return "/".join((self.path,) + parts)

    def _read(self, *parts: str) -> Optional[bytes]:
        try:
            return self.fs.cat_file(self._remote(*parts))
        except FileNotFoundError:
            return None

    def complete_tags(self) -> List[str]:
        """The tags of this save directory that hold a complete.json, oldest first."""
        found = self.fs.glob(self._remote("*", COMPLETE))
        return sorted(tag for tag in (PurePosixPath(p).parent.name for p in found) if step_of(tag) is not None)

    def _tags(self) -> List[str]:
        try:
            entries = self.fs.ls(self.path, detail=False)
        except FileNotFoundError:
            return []
        return sorted(name for name in (PurePosixPath(e).name for e in entries) if step_of(name) is not None)

    @contextlib.contextmanager
    def _locked(self):
        """The ranks of a node share the staging directory: one syncs it, the others then find it synced."""
        self.local.mkdir(parents=True, exist_ok=True)
        with open(self.local.with_name(f".{self.local.name}.lock"), "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def _clear_local(self) -> None:
        """Remove the staging directory's checkpoints and `latest` (not the record of starts or the hang
        watchdog's stacks, which stay with the node)."""
        for entry in self.local.iterdir():
            if entry.name == LATEST or entry.name.startswith((".pruning-", "abandoned-", ".download-")) \
                    or step_of(entry.name) is not None:
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()

    def clear_local(self) -> None:
        """A run that does not resume from this directory starts its staging directory empty."""
        with self._locked():
            self._clear_local()

    def fetch(self, tag: Optional[str], flag: str = "--load", requeue: bool = False) -> Path:
        """Download the checkpoint `tag` (None: the one `latest` names) into the staging directory and
        return the local path to load: the staging directory (with its `latest`) or the tag directory.
        `requeue` (`--load` and `--save` name this directory): one that holds no checkpoint yet is no
        error (locate.find_resume_point starts the run at step 1)."""
        shown = self.url + (f"/{tag}" if tag else "")
        given, write_latest = tag, tag is None
        with self._locked():
            if tag is None:
                latest = self._read(LATEST)
                if latest is None:
                    complete = self.complete_tags()
                    if not complete and requeue:  # nothing saved yet: the run starts at step 1
                        self._clear_local()
                        return self.local
                    if not complete:
                        raise ConfigError(f"{flag} {self.url}: no checkpoint there (no {LATEST}, no tag with a "
                                          f"{COMPLETE})")
                    tag, write_latest = complete[-1], False  # cut before `latest`: locate decides, as on disk
                else:
                    tag = latest.decode("utf-8", "replace").strip()
                    if not own_tag(self.local, tag):
                        raise ConfigError(f"{flag} {self.url}: its {LATEST} names {tag[:100]!r}, which is no tag "
                                          f"(stepNNNNNNNN); load a checkpoint (a tag URL) explicitly")
            manifest = self._read(tag, COMPLETE)
            if manifest is None:
                raise ConfigError(f"{flag} {shown}: {self.url}/{tag} has no {COMPLETE} (a save whose upload was cut "
                                  f"short, or removed), so it is no checkpoint; load a complete one (a tag URL) "
                                  f"explicitly")
            if not self._synced(tag, manifest):
                self._clear_local()
                self._download(tag, manifest)
            if write_latest:
                write_durably(self.local / LATEST, tag)
            return self.local if given is None else self.local / tag

    def _synced(self, tag: str, manifest: bytes) -> bool:
        """Whether the staging directory holds `tag` already (another rank of this node fetched it, or an
        earlier start): the same complete.json and every file of it at its size."""
        local = self.local / tag
        if not (local / COMPLETE).is_file() or (local / COMPLETE).read_bytes() != manifest:
            return False
        try:
            files = json.loads(manifest)["files"]
            return all((local / name).is_file() and (local / name).stat().st_size == size
                       for name, size in files.items())
        except (ValueError, KeyError, TypeError, AttributeError):
            return False  # manifest.read_complete says what is wrong with it, after the download

    def _download(self, tag: str, manifest: bytes) -> None:
        """The files complete.json names into a temporary directory, complete.json last, then renamed
        into place: a download cut short is never a complete checkpoint here. A manifest that cannot
        be read comes alone, and manifest.read_complete says what is wrong with it."""
        tmp = self.local / f".download-{tag}-{os.getpid()}"
        remote = self._remote(tag)
        try:
            names = [name for name in dict(json.loads(manifest)["files"]) if inside_tag_dir(name) and name != COMPLETE]
        except (ValueError, KeyError, TypeError, AttributeError):
            names = []
        for name in names:
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        if names:
            self.fs.get([f"{remote}/{name}" for name in names], [str(tmp / name) for name in names])
        tmp.mkdir(parents=True, exist_ok=True)
        (tmp / COMPLETE).write_bytes(manifest)
        os.replace(tmp, self.local / tag)

    def refuse_another_run(self) -> None:
        """A save into a remote directory of complete checkpoints by a run that does not resume from it
        (its start would delete their later tags, --keep-last the rest): one line, as locate's on disk."""
        complete = self.complete_tags()
        if complete:
            raise ConfigError(f"--save {self.url} holds the checkpoints of another run (the latest: {complete[-1]}), "
                              f"which this run would delete: pass --load {self.url} to resume that run, --save "
                              f"another URL, or remove them")

    def prepare(self, resume_from: Optional[CheckpointRef], is_writer: bool) -> None:
        """store.prepare_save_dir on the store: the tags after the resumed step are deleted (complete.json
        first), and `latest` names the resumed tag if it lies here (else it is removed)."""
        if not is_writer:
            return
        resumed = resume_from.meta["step"] if resume_from is not None else 0
        later = [tag for tag in self._tags() if step_of(tag) > resumed]
        for tag in later:
            self._delete(tag)
        if later:
            print(f"checkpoints after step {resumed} deleted from {self.url}: {', '.join(later)}", flush=True)
        if resumes_from(resume_from, self.local):
            self.fs.pipe_file(self._remote(LATEST), resume_from.tag.encode())
        elif self.fs.exists(self._remote(LATEST)):
            self.fs.rm_file(self._remote(LATEST))

    def _delete(self, tag: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._remote(tag, COMPLETE))  # first: from here it is no checkpoint
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self._remote(tag), recursive=True)

    def publish(self, tag_dir: Path, meta: Dict[str, Any], keep_last: int, is_writer: bool,
                agree: Optional[Callable[[bool], bool]] = None) -> None:
        """After the local commit (every rank calls this): upload the tag directory, then complete.json,
        then `latest`, then prune (the module's docstring). `agree` (train.async_save's background
        writer, async_save.py: AsyncSaver.agree): in place of the barrier, whether every rank's upload
        succeeded, on the writer's own process group; one that failed vetoes the commit."""
        leader = int(os.environ.get("LOCAL_RANK", "0")) == 0
        if agree is None:
            import torch.distributed as dist
            if leader:
                self.upload(tag_dir)
            dist.barrier()  # every node's files are in the store before complete.json names them
        else:
            failed: Optional[BaseException] = None
            try:
                if leader:
                    self.upload(tag_dir)
            except BaseException as e:  # the other ranks must still reach the agreement
                failed = e
            if not agree(failed is None):
                raise failed or RuntimeError(f"another node's upload to {self.url} failed; {tag_dir.name} is not "
                                             f"committed there")
        if is_writer:
            self.commit(tag_dir.name, meta, keep_last)
        elif leader:
            self.drop_uploaded(tag_dir)

    def mark_writer(self) -> None:
        """Global rank 0, at the start: its staging directory is this job's (another node's leader then
        leaves the directory alone where it is shared, `drop_uploaded`)."""
        (self.local / WRITER).write_text(_job_id())

    def drop_uploaded(self, tag_dir: Path) -> None:
        """On a node other than rank 0's: the tag directories before `tag_dir`, all in the store now,
        leave this node's disk (rank 0's --keep-last prunes only its own). Not where rank 0 shares the
        staging directory: there its pruning decides."""
        marker = self.local / WRITER
        if marker.is_file() and marker.read_text() == _job_id():
            return
        for entry in self.local.iterdir():
            if (step_of(entry.name) or 0) and step_of(entry.name) < step_of(tag_dir.name) and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)

    def upload(self, tag_dir: Path) -> None:
        """Every file of the local tag directory but its complete.json, which only `commit` writes."""
        files = [f for f in sorted(tag_dir.rglob("*")) if f.is_file() and f != tag_dir / COMPLETE]
        if files:
            self.fs.put([str(f) for f in files], [self._remote(tag_dir.name, f.relative_to(tag_dir).as_posix())
                                                  for f in files])

    def commit(self, tag: str, meta: Dict[str, Any], keep_last: int) -> None:
        """complete.json (the sizes as the store lists them), then `latest`, then `--keep-last`."""
        remote = self._remote(tag)
        listed = self.fs.find(remote, detail=True)
        files = {PurePosixPath(p).relative_to(remote).as_posix(): info["size"] for p, info in listed.items()}
        files.pop(COMPLETE, None)
        self.fs.pipe_file(self._remote(tag, COMPLETE), json.dumps(dict(meta, files=dict(sorted(files.items()))),
                                                                  indent=1).encode())
        self.fs.pipe_file(self._remote(LATEST), tag.encode())
        self.prune(tag, keep_last)

    def prune(self, tag: str, keep_last: int) -> None:
        """Delete the tags of `tag`'s history (the parents its complete.json files name) beyond the
        newest `keep_last`; the walk stops at a tag with no readable complete.json here."""
        if keep_last < 1:
            return
        chain: List[str] = []
        while own_tag(self.local, tag) and tag not in chain:
            manifest = self._read(tag, COMPLETE)
            if manifest is None:
                break
            chain.append(tag)
            try:
                tag = json.loads(manifest).get("parent")
            except (ValueError, AttributeError):
                break
        for old in chain[keep_last:]:
            self._delete(old)


@contextlib.contextmanager
def store_errors(url: str):
    """What the store answers at a start (no such bucket, no access, no credentials, no endpoint) in
    one line, as any bad input."""
    errors: Tuple[type, ...] = (OSError,)
    with contextlib.suppress(ImportError):
        from botocore.exceptions import BotoCoreError, ClientError
        errors += (BotoCoreError, ClientError)
    try:
        yield
    except errors as e:
        why = str(e).splitlines()[0][:300] if str(e) else ""
        raise ConfigError(f"{url}: the object store refused ({type(e).__name__}: {why}); check the URL, "
                          f"the credentials and the endpoint (AWS_ENDPOINT_URL) in the environment") from None


def stage(args: argparse.Namespace) -> Optional[RemoteDir]:
    """Every rank, at its start: a remote `--save` becomes its staging directory and a remote `--load`
    the checkpoint downloaded there (args.save and args.load are then local paths). Returns the remote
    save directory, which store.save publishes to (with train.async_save, from the background writer),
    or None."""
    remote = RemoteDir(args.save) if is_remote(args.save) else None
    loaded_here = False
    if is_remote(args.load):
        root, tag = split_tag(args.load)
        source = remote if remote is not None and remote.url == root else RemoteDir(root)
        loaded_here = source is remote
        with store_errors(args.load):
            args.load = source.fetch(tag, requeue=loaded_here and tag is None)
    if remote is not None:
        if not loaded_here:
            with store_errors(remote.url):
                remote.refuse_another_run()
            remote.clear_local()
        if os.environ.get("RANK", "0") == "0":
            remote.mark_writer()
        args.save = remote.local
    return remote


def fetch_checkpoint(url: str) -> Path:
    """A remote checkpoint (a save directory's latest, or a tag directory) downloaded, for one process
    that reads it (launch/export_hf.py)."""
    root, tag = split_tag(url)
    with store_errors(url):
        return RemoteDir(root).fetch(tag)
