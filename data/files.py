"""Where a streamed source's files are, and their bytes by range.

A source name resolves to a list of files on one `fsspec` filesystem:
- local paths and globs (`corpus/*.parquet`);
- URLs and globs of them: `https://` (a glob needs a server that lists directories),
  `hf://datasets/ORG/NAME/...` (the hub's filesystem), `s3://`, `gs://`;
- a hub dataset id or a directory of data files: the files `datasets` itself resolves for the
  split (`load_dataset_builder(...).config.data_files`, `hf://` URLs for the hub).
Bytes are read with `cat_file(path, start, end)`: a range request over HTTP and object stores,
never more than asked. Credentials come from each backend's own environment (AWS_*,
GOOGLE_APPLICATION_CREDENTIALS, HF_TOKEN); a URL's user, password and query string are
removed from every message (`shown`)."""
import os
import posixpath
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple

import fsspec

from data.hub import hub_errors_only
from data.job_listing import listed_once_per_job
from data.reading import reading
from data.spec import DataError

FORMATS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".txt": "text", ".md": "text", ".csv": "csv"}
BUILDER_FORMATS = {"parquet": "parquet", "json": "json", "text": "text", "csv": "csv"}
BACKEND_PACKAGES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "http": "aiohttp", "https": "aiohttp",
                    "az": "adlfs", "abfs": "adlfs"}
GLOB = re.compile(r"[*?\[]")
INFO_THREADS = 16


def shown(name: str) -> str:
    """`name` without a URL's user:password@ and ?query (signed URLs carry keys there)."""
    return re.sub(r"\?\S*", "", re.sub(r"://[^/@\s]*@", "://", name))


def is_url(name: str) -> bool:
    return "://" in name


def is_glob(name: str) -> bool:
    """Whether `name` has glob characters; in an http(s) URL a "?" starts the query instead."""
    if name.startswith(("http://", "https://")):
        return re.search(r"[*\[]", name.split("?", 1)[0]) is not None
    return GLOB.search(name) is not None


@dataclass
class SourceFiles:
    """The files of one source: read by `fs`, named for identity by `names` (paths relative to
    the source's common directory: the same on a mirror, no host, no credentials)."""
    fs: fsspec.AbstractFileSystem
    paths: List[str]
    names: List[str]
    sizes: List[int]
    versions: List[str]
    """What changes when a file's content does, the best its filesystem offers (an LFS sha256 or
    blob id on the hub, an ETag over HTTP and object stores, the mtime of a local file): part of
    the cache keys and of the data fingerprint (data/fingerprint.py)."""
    format: str
    label: str
    """The source as the recipe names it, without credentials (for messages)."""
    commit: Optional[str] = None
    """The hub commit a hub source was read at (its revision resolved once per job; every path
    names it, so no rank reads another commit mid-run); None off the hub."""

    def where(self, file: int) -> str:
        """File `file` as a person finds it: its URL, or its path on a local disk; no credentials."""
        path, protocol = self.paths[file], self.fs.protocol
        local = "file" in ((protocol,) if isinstance(protocol, str) else protocol)
        return shown(path if local else self.fs.unstrip_protocol(path))

    def read(self, file: int, start: int, end: int) -> bytes:
        """Bytes [start, end) of file `file`: one range request."""
        try:
            return self.fs.cat_file(self.paths[file], start=start, end=end)
        except Exception as e:
            raise DataError(f"data.name={self.label!r}: reading bytes {start}-{end} of {self.names[file]!r} failed: "
                            f"{type(e).__name__}: {shown(str(e).splitlines()[0][:200]) if str(e) else ''}") from None


def filesystem(url: str, label: str) -> Tuple[fsspec.AbstractFileSystem, str]:
    """(the filesystem of `url`, its path on it); a missing backend is one line naming its package."""
    protocol = url.split("://", 1)[0] if is_url(url) else "file"
    try:
        return fsspec.core.url_to_fs(url)
    except ImportError:
        package = BACKEND_PACKAGES.get(protocol, f"the fsspec backend for {protocol}://")
        raise DataError(f"data.name={label!r} needs {package} for {protocol}:// (not installed): "
                        f"pip install {package}") from None
    except ValueError as e:  # an unknown protocol
        raise DataError(f"data.name={label!r}: {shown(str(e))}") from None
    except Exception as e:  # a backend that connects as it is made (DataSpec.validate refuses ftp:// before)
        raise DataError(f"data.name={label!r}: the {protocol!r} filesystem could not be opened: {type(e).__name__}: "
                        f"{shown(str(e).splitlines()[0][:200]) if str(e) else ''}") from None


def _expand(fs: fsspec.AbstractFileSystem, path: str, label: str) -> List[str]:
    try:
        if not is_glob(path):
            return [path]
        with reading(f"{label}: the files matching {shown(path)}"):
            return sorted(fs.glob(path))
    except Exception as e:
        raise DataError(f"data.name={label!r} could not be listed: {type(e).__name__}: "
                        f"{shown(str(e).splitlines()[0][:200]) if str(e) else ''}") from None


def _hub_files(name: str, config: Optional[str], split: str, revision: Optional[str], label: str,
               data_files: Optional[dict]) -> List[str]:
    """The data files `datasets` resolves for a hub id (or a directory of data files) and split:
    once per process, one listing of the repository (or directory) at `revision`."""
    import datasets
    try:
        with hub_errors_only():
            builder = datasets.load_dataset_builder(name, config, revision=revision, data_files=data_files)
    except Exception as e:
        raise DataError(f"data.name={label!r} (config={config!r}) could not be loaded: {type(e).__name__}: "
                        f"{shown(str(e).splitlines()[0][:200]) if str(e) else ''}") from None
    files = (builder.config.data_files or {}).get(split)
    if not files:
        splits = sorted(builder.config.data_files or {})
        raise DataError(f"data.name={label!r} has no data files for split {split!r} (splits with files: {splits}); "
                        f"streaming reads parquet, json, text or csv files; use data.streaming=false otherwise")
    return list(files)


def file_urls(name: str, config: Optional[str], split: str, revision: Optional[str], label: str,
              data_files: Optional[dict] = None) -> List[str]:
    """What `name` points at, as file names or globs (local or URLs)."""
    path = os.path.expanduser(name)
    if not is_url(name) and (os.path.isdir(path) or not (name.startswith((".", "/", "~")) or GLOB.search(name)
                                                          or Path(name).suffix in FORMATS)):
        return _hub_files(path, config, split, revision, label, data_files)  # a directory of data files, or a hub id
    refuse_hub_options(label, config, revision, data_files)
    if is_url(name) and not is_glob(name) and Path(name.split("?")[0]).suffix not in FORMATS:
        raise DataError(f"data.name={label!r}: name a file or a glob of files ({', '.join(FORMATS)})")
    return [name] if is_url(name) else [path]


def refuse_hub_options(label: str, config: Optional[str], revision: Optional[str], data_files) -> None:
    """A URL or a local file names its data itself: a hub option there would be silently ignored, so it is refused."""
    given = [f"data.{k}={v!r}" for k, v in (("config", config), ("revision", revision), ("data_files", data_files))
             if v is not None]
    if given:
        hint = (" (an hf:// URL pins a revision in its path: hf://datasets/ORG/NAME@REVISION/...)"
                if label.startswith("hf://") else "")
        raise DataError(f"{' and '.join(given)} apply to a hub dataset id or a directory of data files; data.name="
                        f"{label!r} names its files itself: drop {'them' if len(given) > 1 else 'it'}{hint}")


def resolve_files(name: str, config: Optional[str], split: str, revision: Optional[str],
                  data_files: Optional[dict] = None) -> SourceFiles:
    """The files of a streamed source; DataError when there are none or they cannot be listed.
    Listed once per job, by rank 0 (data/job_listing.py); never cached across runs, so a rerun
    sees files added since."""
    label = shown(name)
    listing = listed_once_per_job([name, config, split, revision, data_files], label,
                                  lambda: _resolve(name, config, split, revision, data_files, label))
    return _listing(listing, label)


def _resolve(name: str, config: Optional[str], split: str, revision: Optional[str], data_files: Optional[dict],
             label: str) -> dict:
    """The listing: the filesystem's URL, and the files' paths, names, sizes, versions and format."""
    paths, fs_url = [], None
    for url in file_urls(name, config, split, revision, label, data_files):
        fs, path = filesystem(url, label)
        fs_url = url
        paths += _expand(fs, path, label)
    if not paths:
        raise DataError(f"data.name={label!r} matches no file")
    suffixes = {Path(p.split("?")[0]).suffix for p in paths}
    if len(suffixes) != 1 or next(iter(suffixes)) not in FORMATS:
        raise DataError(f"data.name={label!r}: files must share one of the suffixes {', '.join(FORMATS)}; "
                        f"got {sorted(suffixes)}")
    paths, commit = _at_one_commit(fs, paths, label)
    with ThreadPoolExecutor(INFO_THREADS) as pool:  # one HEAD (or listing lookup) per file, overlapped
        infos = list(pool.map(lambda p: _info(fs, p, label), paths))
    root = posixpath.commonpath([posixpath.dirname(shown(p)) for p in paths])
    return {"fs_url": fs_url, "paths": paths, "names": [shown(posixpath.relpath(p, root) if root else p) for p in paths],
            "sizes": [size for size, _ in infos], "versions": [version for _, version in infos],
            "format": FORMATS[suffixes.pop()], "commit": commit}


COMMIT = re.compile(r"[0-9a-f]{40}$")


def _at_one_commit(fs: fsspec.AbstractFileSystem, paths: List[str], label: str) -> Tuple[List[str], Optional[str]]:
    """(the paths, each naming the hub commit its revision resolves to now, that commit) on the hub's
    filesystem; (paths, None) elsewhere. A branch (`main`, the default) or a tag names a commit
    that moves when the dataset is updated: HfFileSystem resolves it again at each call, so an
    update mid-run would mix two commits. `datasets` names the commit already (hf://...@<sha>)."""
    if not hasattr(fs, "resolve_path") or not paths:  # HfFileSystem only
        return paths, None
    try:
        with reading(f"{label}: the hub commit of {shown(paths[0])}"), hub_errors_only():
            first = fs.resolve_path(paths[0])
            if not hasattr(first, "repo_id"):  # a hub path outside a repository (a bucket): no commit
                return paths, None
            revision = first.revision
            if not COMMIT.match(revision or ""):
                revision = fs._api.repo_info(first.repo_id, repo_type=first.repo_type, revision=revision).sha
            resolved = [fs.resolve_path(p) for p in paths]
    except Exception as e:
        raise DataError(f"data.name={label!r}: the hub revision could not be resolved: {type(e).__name__}: "
                        f"{shown(str(e).splitlines()[0][:200]) if str(e) else ''}") from None
    if len({(r.repo_type, r.repo_id, r.revision) for r in resolved}) != 1:
        raise DataError(f"data.name={label!r} names files of more than one hub repository or revision; "
                        f"stream one repository at one revision per source")
    return [type(r)(r.repo_type, r.repo_id, revision, r.path_in_repo).unresolve() for r in resolved], revision


def _listing(listing: dict, label: str) -> SourceFiles:
    fs, _ = filesystem(listing["fs_url"], label)
    return SourceFiles(fs, listing["paths"], listing["names"], listing["sizes"], listing["versions"],
                       listing["format"], label, listing.get("commit"))


def _info(fs: fsspec.AbstractFileSystem, path: str, label: str) -> Tuple[int, str]:
    try:
        with reading(f"{label}: the size of {shown(path)}"):
            info = fs.info(path)
    except FileNotFoundError:
        raise DataError(f"data.name={label!r}: no such file: {shown(path)}") from None
    except Exception as e:
        raise DataError(f"data.name={label!r}: {shown(path)} could not be read: {type(e).__name__}: "
                        f"{shown(str(e).splitlines()[0][:200]) if str(e) else ''}") from None
    if info.get("size") is None:
        raise DataError(f"data.name={label!r}: the server does not say the size of {shown(path)} (no Content-Length); "
                        f"streaming reads files by byte ranges")
    return int(info["size"]), content_version(info)


def content_version(info: dict) -> str:
    """What changes when a file's content does, from fsspec's `info`: the LFS sha256 or the git blob
    id (the hub: both hash the content), the ETag (HTTP, S3, GCS: the server's content identity),
    else the mtime (a local file: its content changed in place moves it); "" when none is given."""
    lfs = info.get("lfs")
    sha256 = (lfs.get("sha256") if isinstance(lfs, dict) else getattr(lfs, "sha256", None)) if lfs else None
    if sha256:
        return f"sha256:{sha256}"
    return next((f"{tag}:{info[k]}" for k, tag in (("blob_id", "blob"), ("ETag", "etag"), ("etag", "etag"),
                                                   ("mtime", "mtime"), ("LastModified", "mtime"))
                 if info.get(k) is not None), "")
