"""What the data pipeline reads: the recipe's `data:` section, as a typed dataclass.

Defined here (not in launch/) so that data/ stays independent of the launcher; the recipe
loader uses this class as its `data` section.
"""
import re
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

from data.json_files import printable


class DataError(ValueError):
    """Bad data input (unknown dataset, missing column, empty data...): one line, exit 2."""


@dataclass
class DataSpec:
    name: str = "builtin"
    """`builtin` (Python's pydoc topics, offline), a hub dataset id (`wikitext`), a directory
    written by `Dataset.save_to_disk`, or local files / a glob of .txt, .json, .jsonl,
    .parquet or .csv files; streaming also takes URLs and globs of them (https://, hf://,
    s3://, gs://), without credentials (each backend's environment holds those)."""
    config: Optional[str] = None
    """Hub config name (`wikitext-103-raw-v1`)."""
    split: str = "train"
    """Split to train on."""
    revision: Optional[str] = None
    """Hub revision (a commit or tag); pins the data and is part of the cache key. Only for a hub
    id (or, streaming, a directory of data files): a URL or a file names its data itself."""
    data_files: Optional[Union[str, List[str], Dict[str, Any]]] = None
    """A hub id's (or, streaming, a directory's) files to read, as `datasets` takes them: a pattern
    or list of patterns relative to the dataset's root for the training split (`sample/10BT/*.parquet`),
    or a mapping split -> patterns. null: the dataset's own files of each split."""
    text_field: str = "text"
    """Column holding the raw text."""
    tokenizer: str = "builtin"
    """`builtin` (BPE trained on the embedded corpus) or any name or path AutoTokenizer takes without
    custom code (trust_remote_code stays off: data/builtin.py)."""
    seq_len: Optional[int] = None
    """Tokens per sample; null takes model.seq_len. At most model.seq_len."""
    streaming: bool = False
    """Tokenize and pack on the fly from an IterableDataset (corpora larger than the disk)."""
    shuffle: bool = True
    """Reshuffle the windows every epoch (map-style) / the shard order every epoch and the
    windows within blocks (streaming)."""
    shuffle_buffer: int = 16
    """Streaming: windows per shuffle block of each stream; a resume re-reads the current block
    (from the unit where it starts) of each stream it reads. With the default streams (one per
    sample of the global batch) a step's windows already come from B different units: the block
    only spreads a stream's consecutive windows over steps, and its memory is B/dp blocks per rank."""
    streams: Optional[int] = None
    """Streaming: logical streams; each epoch's shuffled units are dealt to them in turn (unit j
    to stream j % streams), each packs its own and gives global_batch_size/streams windows to
    every step. Fixed by the recipe, not by dp: the samples of a step are the same at every
    layout, and a rank reads only the streams its slice of the batch needs, which dp must divide.
    null: the global batch size (every dp divides it), or for a corpus of fewer training units the
    largest divisor of it they fill (data/streaming.py: default_streams)."""
    unit_bytes: int = 8 * 2 ** 20
    """Streaming: the size of a unit of a line file (.jsonl, .json, .txt, .md): a byte range,
    owning the lines that start in it. Parquet files are read by row group, csv files whole. A
    stream holds its current unit's text: a rank holds B/dp of them with the default streams."""
    read_ahead_steps: Optional[int] = None
    """Streaming: steps of micro-batches a background thread reads and tokenizes ahead of the
    trainer. null: the steps between two refills of a stream's shuffle block (shuffle_buffer x
    streams / global_batch_size, at least 1), so a refill overlaps the steps before it; its
    memory is about the shuffle blocks' once more. 0: read inside the engine's call for the next
    micro-batch."""
    stall_timeout_s: float = 0.0
    """The longest a rank's draw of its micro-batches may wait (reading, tokenizing, or its replica's
    reading rank) before the run is hung, with a line naming the file or URL being read
    (launch/resilience/hang_watchdog.py). 0: 0.8 x train.dist_timeout_s (480 s by default): a storage
    stall of minutes recovers. Below train.dist_timeout_s."""
    val_split: Optional[str] = None
    """A held-out split for validation (`validation`); wins over val_fraction."""
    val_fraction: float = 0.0
    """Hold out this fraction of the documents (chosen by a hash of their text, data/sources.py)
    when there is no val_split."""
    num_proc: int = 1
    """Processes for tokenization (`datasets.map(num_proc=...)`)."""
    mix: List[Dict[str, Any]] = field(default_factory=list)
    """A mixture: a list of sources, each a mapping of the source fields above (name, config,
    split, revision, text_field, streaming, shuffle, shuffle_buffer, streams, val_split,
    val_fraction, num_proc) plus `weight` and an optional `label`. A field a source leaves out
    takes this section's value; tokenizer and seq_len are the run's, one for all sources.
    Empty: the single source above. Checked by data/mixture_spec.py."""
    document_mask: bool = False
    """Attention within documents only: in a packed window each token attends to the earlier tokens
    of its own document, and positions (learned or RoPE) restart at 0 at each document start. Each
    EOS starts the next document, as a BOS would, so no loss is masked (docs/data.md)."""

    def data_files_by_split(self) -> Optional[Dict[str, Any]]:
        """`data_files` as `datasets` takes it: patterns alone are the training split's."""
        if self.data_files is None or isinstance(self.data_files, dict):
            return self.data_files
        return {self.split: self.data_files}

    def validate(self) -> None:
        """Raise DataError on a value no run can read (the sources of data.mix: data/mixture_spec.py)."""
        for key in URL_FIELDS:  # those of data.mix's sources too
            check_no_credentials(f"data.{key}", getattr(self, key))
        for where, source in self.sources():
            check_source(where, source)
        if not 0 <= self.val_fraction < 1:
            raise DataError(f"data.val_fraction={self.val_fraction} must be in [0, 1)")
        if self.num_proc < 1 or self.shuffle_buffer < 1 or self.unit_bytes < 1:
            raise DataError(f"data.num_proc={self.num_proc}, data.shuffle_buffer={self.shuffle_buffer} and "
                            f"data.unit_bytes={self.unit_bytes} must be >= 1")
        if self.streams is not None and self.streams < 1:
            raise DataError(f"data.streams={self.streams} must be >= 1 (or null: one per sample of the global batch)")
        if self.read_ahead_steps is not None and self.read_ahead_steps < 0:
            raise DataError(f"data.read_ahead_steps={self.read_ahead_steps} must be >= 0 (0 reads inline, null: one shuffle block of steps)")

    def sources(self) -> List[Tuple[str, Dict[str, Any]]]:
        """(where, fields) of each source: this section's, or each data.mix source's with the
        fields it leaves out taken from this section (its types are data/mixture_spec.py's to check)."""
        fields = {key: getattr(self, key) for key in ("name", "config", "revision", "data_files", "streaming")}
        if not self.mix:
            return [("data.", fields)]
        return [(f"data.mix[{i}].", dict(fields, **{k: v for k, v in item.items() if k in fields}))
                for i, item in enumerate(self.mix) if isinstance(item, dict)]


def check_source(where: str, source: Dict[str, Any]) -> None:
    """The source's URLs have a scheme data reads, and `builtin` takes no hub option: the embedded
    corpus would ignore it (and a run whose data is cached already would not even look)."""
    name, given = source["name"], [f"{where}{key}={source[key]!r}" for key in ("config", "revision", "data_files")
                                   if source[key] is not None]
    if name == "builtin" and given:
        raise DataError(f"{' and '.join(given)} {'apply' if len(given) > 1 else 'applies'} to hub datasets only; "
                        f"{where}name='builtin' is the embedded corpus: drop {'them' if len(given) > 1 else 'it'}")
    check_url_scheme(f"{where}name", name)
    check_url_scheme(f"{where}data_files", source["data_files"])
    if isinstance(name, str) and "://" in name and source["streaming"] is False:
        raise DataError(f"{where}name={name!r} is a URL, which streaming reads: set {where}streaming=true "
                        f"(map-style reads a hub id, a directory or local files)")


URL_SCHEMES = ("https", "http", "hf", "s3", "s3a", "gs", "gcs", "az", "abfs", "file")
"""The schemes of the URLs data reads through fsspec (data/files.py: BACKEND_PACKAGES names the
packages of some). Others are refused before any is opened: fsspec's ftp:// backend connects
as it is made, and its socket errors are no DataError."""


def each_string(where: str, value: Any) -> Iterator[Tuple[str, str]]:
    """(where, string) for each string of `value`: a string, or lists and mappings of them
    (data.data_files' forms, a data.mix source), each named as a message shows it."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from each_string(f"{where}.{key}" if isinstance(key, str) and key.isidentifier()
                                   else f"{where}[{key!r}]", item)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from each_string(f"{where}[{i}]", item)
    elif isinstance(value, str):
        yield where, value


def check_url_scheme(where: str, value: Any) -> None:
    """Each URL of `value` has a scheme of URL_SCHEMES, as fsspec spells them (lower case); the
    value is repeated with repr, which escapes a control character. Run after check_no_credentials:
    the value is repeated."""
    for place, text in each_string(where, value):
        if "://" not in text:  # data/files.py: is_url
            continue
        scheme = text.split("://", 1)[0]
        if scheme not in URL_SCHEMES:
            case = " (fsspec spells schemes in lower case)" if scheme.lower() in URL_SCHEMES else ""
            raise DataError(f"{place}={text[:200]!r}: {scheme[:40]!r} is not a scheme data reads{case}; give a "
                            f"local path, a hub id, or a URL of {', '.join(s + '://' for s in URL_SCHEMES)}")


URL_FIELDS = ("name", "data_files", "tokenizer", "mix")
"""The DataSpec fields that may hold a URL (a mix source's own name and data_files among them)."""

URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://([^/?#\s]*)")
"""A URL's scheme and authority (RFC 3986 3.1, 3.2): the authority's user:password@ part is
where basic-auth credentials go."""


def check_no_credentials(where: str, value: Any) -> None:
    """A URL with user:password@ (or a token as the user) or an http(s) query string (where signed
    URLs carry their keys: S3's X-Amz-Signature, Azure's sig) would put a secret into every
    checkpoint's recipe and every log line: refused, naming `where` and the URL's scheme and host,
    never the secret. `value`: a string, or lists and mappings of them (data.data_files' forms, a
    data.mix source); other values pass (their type is checked elsewhere). Schemes are compared
    without case (RFC 3986 3.1; urllib3's parse_url lowercases them): `HTTPS://...?sig=` is the
    same signed URL, and even a URL no reader here takes must not be echoed."""
    for place, text in each_string(where, value):
        for url in URL.finditer(text):
            scheme, authority = url.groups()
            if "@" in authority or (scheme.lower() in ("http", "https") and "?" in text[url.start():]):
                shown = f"{place}={scheme}://{authority.rpartition('@')[2]}/..."
                shown = printable(shown)  # one line
                raise DataError(f"{shown} carries credentials (user:password@ or a ?query): "
                                f"they would be saved with the recipe and logged; give them to the backend's "
                                f"environment instead (HF_TOKEN, AWS_*, GOOGLE_APPLICATION_CREDENTIALS, a .netrc "
                                f"for http)")
