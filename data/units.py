"""A streamed source cut into units, the pieces that streams read whole.

- parquet: a row group; its bytes are the text column's chunk, found in the file's footer.
- JSON Lines (.jsonl, .json) and text (.txt, .md): a byte range of `data.unit_bytes` of a file;
  a unit owns the lines that start inside its range (the last one may run past its end).
- csv: a whole file (quoted newlines make byte ranges unsafe).
- a dataset in memory (`builtin`, a `save_to_disk` directory): a range of at most 10,000 rows,
  at least 64 units when the rows allow.
Reading a unit fetches its bytes only: one range request, no footer. The list of units of a
parquet source needs every footer: rank 0 reads them once per job and shares the list through the
job's rendezvous store (data/job_listing.py), each node caching it (data/cache.py's build_once). Beside
each row group's byte range the list keeps what decoding its text chunk needs (rows, values, codec,
page offsets, the column's type), from which a read writes a one-row-group footer of its own
(data/parquet_footer.py): 1,000 nodes over 2,000 files would otherwise fetch 2,000 footers at every start
and every process each footer again for its first unit of a file. A text column that this cannot
describe (nested, an LZ4 codec, which pyarrow names alike for two framings) is read with its file's
footer, once per process.

Validation in streaming mode holds out whole units: the ceil(val_fraction x N) units whose
identity (file path relative to the source's directory and unit number) hashes lowest. The rule
depends on the units alone, not on the shuffle, the streams or the run.
"""
import base64
import hashlib
import io
import json
import math
import os
import struct
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq

from data.cache import build_once, default_cache_dir
from data.files import SourceFiles
from data.job_listing import in_a_job, once_per_job
from data.parquet_footer import CHUNK_COLUMNS, CODECS, chunk_footer
from data.reading import reading
from data.spec import DataError

MAGIC = b"PAR1"  # the first bytes of every parquet file

UNITS_VERSION = 2  # bump when the cutting rule changes: units (and the cached lists) change with it
MAX_ROWS_IN_MEMORY, MIN_UNITS_IN_MEMORY = 10_000, 64
FOOTER_THREADS = 16
FIRST_RECORD_READ = 4096  # bytes of a line file's first read for its first record
FOOTERS_KEPT = 32
"""Parquet footers a process keeps (least recently used evicted): a footer of 700 row groups x 10
columns is ~10 MiB, and a rank touching 2,000 files would otherwise keep them all."""
MAX_PARQUET_UNIT_BYTES = 2 ** 30
"""A row group whose text column holds more (uncompressed) is refused: a unit is read, decoded
and held whole, so one 2 GB row group costs ~14 GB of memory per stream that reads it."""
LINE_FIRST_READ = 2 ** 20
"""Bytes of a line unit a stream reads first: about what its first windows need (a default
shuffle block, 16 windows of 2,049 tokens, is ~150 KB of text), where the whole unit is
`data.unit_bytes` (8 MiB). The rest of the unit is read, in one more request, when its first
document is needed, so a rank's 256 streams read 256 MiB before their first batch, not 2 GiB."""
TAIL_READ = 64 * 1024
"""How far past a line unit's end one read looks for the end of its last line: at most 1/64 of
the unit (at least 256 bytes), so the overshoot stays a small share of what the unit reads."""


@dataclass(frozen=True)
class Unit:
    file: int
    """Index of the file in the source's files (0 for a dataset in memory)."""
    part: int
    """Row group (parquet), byte range (lines), row range (in memory) number within the file."""
    start: int
    stop: int
    """Bytes [start, stop) of the file (parquet: the text column's chunk), or rows (in memory)."""
    text_bytes: int = -1
    """At least this many bytes of text (parquet, from the footer), -1 when unknown: lets the
    start-up check pass a large corpus without reading it (data/prepare_source.py: check_streams)."""


class UnitTable(Sequence[Unit]):
    """A source's units as one (N, 5) int64 array of (file, part, start, stop, text_bytes): 40 B a
    unit in every process, where a list of Unit objects takes ~210 B (bench/data/streaming_data.py,
    section 5) and, read from a cached JSON list, 1.4M units of a FineWeb-sized corpus would cost
    640 MiB per process. Indexing gives a Unit; a slice or `take`, a table."""

    def __init__(self, rows: np.ndarray):
        self.rows = rows.reshape(-1, 5).astype(np.int64, copy=False)  # (N, 5)

    @classmethod
    def of(cls, units: Iterable[Unit]) -> "UnitTable":
        return cls(np.array([(u.file, u.part, u.start, u.stop, u.text_bytes) for u in units], dtype=np.int64))

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: Union[int, slice]):
        if isinstance(i, slice):
            return UnitTable(self.rows[i])
        return Unit(*(int(v) for v in self.rows[i]))

    def take(self, indices: np.ndarray) -> "UnitTable":
        return UnitTable(self.rows[np.asarray(indices, dtype=np.int64)])

    def text_bytes(self) -> np.ndarray:
        """(N,) each unit's known floor of text bytes, -1 where unknown."""
        return self.rows[:, 4]


def as_table(units: Sequence[Unit]) -> UnitTable:
    return units if isinstance(units, UnitTable) else UnitTable.of(units)


def as_text_array(texts: List[Optional[str]]) -> Union[pa.Array, List[Optional[str]]]:
    """The texts as one Arrow string array (UnitSource.text_array), or the list itself where Arrow
    cannot hold them."""
    try:
        return pa.array(texts, type=pa.large_string())
    except (pa.ArrowException, UnicodeEncodeError, TypeError):
        return texts


def unit_hash(identity: str) -> float:
    """blake2b of a unit's identity, as a number in [0, 1)."""
    return int.from_bytes(hashlib.blake2b(identity.encode(), digest_size=8).digest(), "big") / 2.0 ** 64


class UnitSource:
    """A source's units and how to read each one's texts."""
    label: str
    units: Sequence[Unit]
    """A UnitTable (any sequence of Units for a source of a few)."""

    def identity(self, unit: Unit) -> str:
        raise NotImplementedError

    def identities(self, table: UnitTable) -> List[str]:
        """`identity` of every unit of the table, in order."""
        return [self.identity(u) for u in table]

    def fingerprint(self) -> str:
        """What changes when the units or their content may: part of the caches' keys."""
        raise NotImplementedError

    def texts(self, unit: Unit) -> List[Optional[str]]:
        raise NotImplementedError

    def text_array(self, unit: Unit) -> Union[pa.Array, List[Optional[str]]]:
        """`texts` as one Arrow string array, what a stream holds while it reads the unit: its
        UTF-8 bytes and 8 a document, where Python strings take 1, 2 or 4 bytes a character (by
        each document's widest, PEP 393) and ~60 more (1.6x for web text with an apostrophe ’ in
        every other document). The list itself where Arrow cannot hold it (a lone surrogate,
        which JSON's \\ud800 gives)."""
        return as_text_array(self.texts(unit))

    def text_pieces(self, unit: Unit) -> Iterator[Union[pa.Array, List[Optional[str]]]]:
        """The unit's `text_array` in consecutive pieces, each read when it is asked for: a line
        unit's first LINE_FIRST_READ bytes, then the rest; one piece for other units."""
        yield self.text_array(unit)

    def head_texts(self, unit: Unit, max_bytes: int) -> Optional[List[Optional[str]]]:
        """The texts of a unit's first documents, from about its first `max_bytes`; None where a
        unit cannot be read in part (or is no larger)."""
        return None

    def held_out(self, val_fraction: float) -> Tuple[UnitTable, UnitTable]:
        """(training units, held-out units), both in index order: the ceil(f N) units of lowest hash."""
        table = as_table(self.units)
        if val_fraction <= 0:
            return table, table[:0]
        n_held = math.ceil(val_fraction * len(table))
        hashes = np.fromiter(map(unit_hash, self.identities(table)), dtype=np.float64, count=len(table))
        held = np.zeros(len(table), dtype=bool)
        held[np.argsort(hashes, kind="stable")[:n_held]] = True
        if n_held == len(table):
            raise DataError(f"data.name={self.label!r} (streaming) has {len(self.units)} unit(s), and "
                            f"data.val_fraction={val_fraction} holds out all of them (validation holds out whole "
                            f"units); use more data, a smaller data.unit_bytes or data.val_fraction, or data.val_split")
        return table.take(np.flatnonzero(~held)), table.take(np.flatnonzero(held))


class DatasetUnits(UnitSource):
    """An in-memory (memory-mapped) `datasets.Dataset` in row ranges."""

    def __init__(self, dataset: datasets.Dataset, text_field: str, label: str):
        self.dataset, self.text_field, self.label = dataset.with_format("arrow"), text_field, label
        n = len(dataset)
        rows = max(1, min(MAX_ROWS_IN_MEMORY, math.ceil(n / MIN_UNITS_IN_MEMORY)))
        starts = np.arange(0, n, rows)
        self.units = UnitTable(np.stack([np.zeros_like(starts), np.arange(len(starts)), starts,
                                         np.minimum(starts + rows, n), np.full_like(starts, -1)], axis=1))

    def identity(self, unit: Unit) -> str:
        return f"rows {unit.start}-{unit.stop}"

    def fingerprint(self) -> str:
        # the dataset's own identity (builtin's version, a directory's mtime) is in the caches' keys already
        return f"{UNITS_VERSION}:{len(self.dataset)}:{self.text_field}"

    def texts(self, unit: Unit) -> List[Optional[str]]:
        return self.text_array(unit).to_pylist()

    def text_array(self, unit: Unit) -> pa.Array:
        with reading(f"{self.label}: rows {unit.start}-{unit.stop}"):
            return self.dataset[unit.start:unit.stop].column(self.text_field).combine_chunks()


def line_units(sizes: Sequence[int], unit_bytes: int) -> UnitTable:
    """Byte ranges of `unit_bytes` of each line file, from the sizes alone."""
    tables = []
    for f, size in enumerate(sizes):
        starts = np.arange(0, size, unit_bytes, dtype=np.int64)
        tables.append(np.stack([np.full_like(starts, f), np.arange(len(starts)), starts,
                                np.minimum(starts + unit_bytes, size), np.full_like(starts, -1)], axis=1))
    return UnitTable(np.concatenate(tables) if tables else np.empty((0, 5), dtype=np.int64))


class SparseFile(io.RawIOBase):
    """A remote file for pyarrow's parquet reader: the byte ranges already fetched, and a range
    request for anything else (pyarrow reads exactly the column chunk it was given)."""

    def __init__(self, files: SourceFiles, file: int, fetched: Sequence[Tuple[int, bytes]]):
        self.files, self.file, self.size = files, file, files.sizes[file]
        self.ranges, self.pos = list(fetched), 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = offset if whence == 0 else self.pos + offset if whence == 1 else self.size + offset
        return self.pos

    def readinto(self, buffer) -> int:
        want = min(len(buffer), self.size - self.pos)
        for start, blob in self.ranges:
            if start <= self.pos and self.pos + want <= start + len(blob):
                break
        else:
            start, blob = self.pos, self.files.read(self.file, self.pos, self.pos + want)
            self.ranges.append((start, blob))
        buffer[:want] = blob[self.pos - start:self.pos - start + want]
        self.pos += want
        return want


class FileUnits(UnitSource):
    """Units of files (local or remote, data/files.py)."""

    def __init__(self, files: SourceFiles, text_field: str, unit_bytes: int):
        self.files, self.text_field, self.unit_bytes, self.label = files, text_field, unit_bytes, files.label
        self._footers: "OrderedDict[int, pq.FileMetaData]" = OrderedDict()  # least recently used first
        self._footers_lock = threading.Lock()  # footers are read from a thread pool at start-up
        if files.format == "parquet":
            self.units = self._parquet_units()
        elif files.format == "csv":
            self.units = UnitTable.of(Unit(f, 0, 0, size) for f, size in enumerate(files.sizes))
        else:
            self.units = line_units(files.sizes, unit_bytes)
        if files.format in ("json", "csv") and self.units:
            self._check_first_record()

    def identity(self, unit: Unit) -> str:
        return f"{self.files.names[unit.file]}#{unit.part}"

    def identities(self, table: UnitTable) -> List[str]:
        names = self.files.names  # from the columns: no Unit object per unit (100k units: 0.3 s of them)
        return [f"{names[f]}#{part}" for f, part in zip(table.rows[:, 0].tolist(), table.rows[:, 1].tolist())]

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps([UNITS_VERSION, self.files.names, self.files.sizes, self.files.versions,
                                          self.text_field, self.unit_bytes]).encode()).hexdigest()[:20]

    # -- parquet --

    def footer(self, file: int) -> pq.FileMetaData:
        """The file's metadata: two range requests (its length, then the footer); the last
        FOOTERS_KEPT files' are kept. A stream reads its units file after file in the shuffled
        order, so a footer read again costs two small requests per unit at most."""
        with self._footers_lock:
            if file in self._footers:
                self._footers.move_to_end(file)
                return self._footers[file]
        size = self.files.sizes[file]
        with reading(f"{self.label}: {self.files.where(file)} footer"):
            tail = self.files.read(file, size - 8, size) if size >= 12 else b""
            if tail[4:] != b"PAR1":
                raise DataError(f"data.name={self.label!r}: {self.files.names[file]!r} is not a parquet file")
            length = struct.unpack("<I", tail[:4])[0]
            footer = self.files.read(file, size - 8 - length, size - 8)
        meta = pq.read_metadata(pa.BufferReader(b"PAR1" + footer + tail))
        with self._footers_lock:
            self._footers[file] = meta
            while len(self._footers) > FOOTERS_KEPT:
                self._footers.popitem(last=False)
        return meta

    def _text_column(self, file: int) -> int:
        meta = self.footer(file)
        names = [meta.schema.column(j).path for j in range(meta.num_columns)]
        if self.text_field not in names:
            raise DataError(f"data.text_field={self.text_field!r} is not a column of {self.files.names[file]!r} "
                            f"in {self.label!r}; columns: {', '.join(names)}")
        return names.index(self.text_field)

    def _file_units(self, file: int) -> Tuple[List[Unit], List[Tuple[int, ...]], Tuple[int, int, int]]:
        """The file's row groups: their units, each one's CHUNK_COLUMNS, and the file's text column
        (physical type, repetition, converted type; -1 first where a read needs the footer)."""
        meta, column = self.footer(file), self._text_column(file)
        leaf = meta.schema.column(column)
        converted = 0 if str(leaf.converted_type) == "UTF8" else \
            -1 if str(leaf.converted_type) == "NONE" and leaf.logical_type.type == "NONE" else -2
        plain = leaf.physical_type == "BYTE_ARRAY" and leaf.max_repetition_level == 0 and \
            leaf.max_definition_level <= 1 and leaf.path == leaf.name and converted > -2
        units, chunks = [], []
        for g in range(meta.num_row_groups):
            chunk = meta.row_group(g).column(column)
            start = min(chunk.dictionary_page_offset or chunk.data_page_offset, chunk.data_page_offset)
            rows = meta.row_group(g).num_rows
            if chunk.total_uncompressed_size > MAX_PARQUET_UNIT_BYTES:
                raise DataError(f"data.name={self.label!r}: {self.files.names[file]!r} row group {g} holds "
                                f"{chunk.total_uncompressed_size / 2 ** 20:,.0f} MiB of {self.text_field!r}, above the "
                                f"{MAX_PARQUET_UNIT_BYTES / 2 ** 20:,.0f} MiB a unit may hold (each is read and decoded "
                                f"whole); rewrite the file with smaller row groups, e.g. pyarrow.parquet.write_table"
                                f"(table, path, row_group_size=100_000)")
            # the chunk's uncompressed bytes less 4-byte lengths and page headers: a floor of its text
            text = chunk.total_uncompressed_size - 4 * rows - 256 * (1 + chunk.total_uncompressed_size // 65536)
            units.append(Unit(file, g, start, start + chunk.total_compressed_size, max(0, text)))
            plain = plain and chunk.compression in CODECS
            chunks.append((rows, chunk.num_values, chunk.data_page_offset - start, chunk.total_uncompressed_size,
                           CODECS.get(chunk.compression, 0) + 256 * bool(chunk.has_dictionary_page)))
        return units, chunks, ((6 if plain else -1), leaf.max_definition_level, max(converted, -1))

    def _parquet_units(self) -> UnitTable:
        """Every file's row groups from its footer, listed by rank 0 once per job (and cached on
        its node), read by every other rank from the job's store once per node."""
        key = self.fingerprint()
        path = default_cache_dir() / "data" / f"units-{key}.npz"

        def build(tmp) -> None:
            with ThreadPoolExecutor(FOOTER_THREADS) as pool:  # footers of many files, overlapped
                per_file = list(pool.map(self._file_units, range(len(self.files.paths))))
            with open(tmp, "wb") as f:
                # compressed: it travels through the store to every node (small integers, ~4x smaller)
                # int32: a unit's rows, values and bytes are below MAX_PARQUET_UNIT_BYTES
                np.savez_compressed(f, units=UnitTable.of(u for units, _, _ in per_file for u in units).rows,
                                    chunks=np.array([c for _, chunks, _ in per_file for c in chunks], dtype=np.int32
                                                    ).reshape(-1, CHUNK_COLUMNS),
                                    schema=np.array([s for _, _, s in per_file], dtype=np.int32).reshape(-1, 3))

        def shared() -> str:
            return once_per_job(["units", key], lambda: base64.b64encode(build_once(path, build).read_bytes()).decode(),
                                f"data.name={self.label!r}: rank 0 failed to list the row groups",
                                f"data.name={self.label!r}: rank 0 did not list the row groups")

        if not in_a_job():
            build_once(path, build)
        elif os.environ["RANK"] == "0":
            shared()  # its own list (built, or cached by an earlier job), put in the store for every node
        elif not path.exists():  # another name: rank 0 may hold `path`'s lock on this node while this rank waits for it
            path = build_once(path.with_name(f"units-{key}-from-rank-0.npz"),
                              lambda tmp: tmp.write_bytes(base64.b64decode(shared())))
        with np.load(path) as saved:
            self._chunks, self._schema = saved["chunks"], saved["schema"]
            units = UnitTable(saved["units"])
        self._first_unit = np.searchsorted(units.rows[:, 0], np.arange(len(self.files.paths)))
        return units

    def _parquet_texts(self, unit: Unit) -> List[Optional[str]]:
        return self._parquet_column(unit).to_pylist()

    def _parquet_column(self, unit: Unit) -> pa.Array:
        with reading(f"{self.label}: {self.files.where(unit.file)} row group {unit.part}"):
            schema = self._schema[unit.file]
            data = self.files.read(unit.file, unit.start, unit.stop)
            if schema[0] >= 0:  # the unit table says what decoding the chunk needs: no footer read
                # The chunk as a file of its own, after the magic that starts every parquet file
                # (pyarrow takes a dictionary page at offset 0 for none), in a buffer Arrow reads
                # natively: its pool threads then never call back into Python, as they do to read
                # a Python file object, which aborts the process's exit once torch is imported
                # ("terminate called without an active exception", apache/arrow#34314): 8 of 20
                # exits of a script reading 4 row groups so on a busy machine, 0 of 20 natively.
                meta = chunk_footer(self.text_field, len(MAGIC), len(MAGIC) + len(data),
                                    self._chunks[self._first_unit[unit.file] + unit.part], schema)
                source, group = pa.BufferReader(MAGIC + data), 0
            else:
                meta, group = self.footer(unit.file), unit.part
                source = pa.PythonFile(SparseFile(self.files, unit.file, [(unit.start, data)]), mode="r")
            reader = pq.ParquetFile(source, metadata=meta, pre_buffer=False)
            return reader.read_row_group(group, columns=[self.text_field]).column(0).combine_chunks()

    # -- lines --

    def _lines(self, unit: Unit) -> List[bytes]:
        """The lines that start in [start, stop), read whole: [start - 1, stop) in one request."""
        return [line for piece in self._line_pieces(unit, unit.stop - unit.start) for line in piece]

    def _line_pieces(self, unit: Unit, first_bytes: int) -> Iterator[List[bytes]]:
        """The lines that start in [start, stop), in pieces, each read when asked for: the complete
        lines of [start - 1, start + first_bytes) (is start a line start?), then those of the rest
        of the range, then the last line, read on past stop until it ends. A line cut by a read's
        end is kept and completed by the next read: every byte is fetched once, and the pieces'
        lines are the lines of the whole range."""
        f, size = unit.file, self.files.sizes[unit.file]
        at, held, started = max(0, unit.start - 1), b"", unit.start == 0
        for end in sorted({min(unit.stop, unit.start + first_bytes), unit.stop}):
            blob, at = held + self.files.read(f, at, end), end
            if not started:
                cut = blob.find(b"\n")
                if cut < 0:  # the line that runs in belongs to an earlier unit
                    held = b""
                    continue
                blob, started = blob[cut + 1:], True
            cut = blob.rfind(b"\n") + 1  # cut after a newline: "\r\n" stays whole for splitlines
            if cut:
                yield blob[:cut].splitlines()
            held = blob[cut:]
        if not held:
            return  # no line starts in the range, or its last one ends at stop
        tail = min(TAIL_READ, max(256, self.unit_bytes // 64))
        while at < size:
            more = self.files.read(f, at, min(at + tail, size))
            cut = more.find(b"\n")
            held, at = held + (more if cut < 0 else more[:cut + 1]), at + len(more) if cut < 0 else size
        yield held.splitlines()

    def _check_first_record(self) -> None:
        """The text field is in the first file's first record (parquet: in every footer), so a
        wrong data.text_field fails at start-up rather than at the first read."""
        size, end, blob, step = self.files.sizes[0], 0, b"", FIRST_RECORD_READ
        while b"\n" not in blob and end < size:  # every process checks: a few KiB each, doubling for a long record
            blob += self.files.read(0, end, min(end + step, size))
            end, step = end + step, 2 * step
        first = blob.split(b"\n", 1)[0]
        if self.files.format == "csv":
            columns = pa_csv.read_csv(pa.BufferReader(first + b"\n")).column_names if first.strip() else []
            if self.text_field not in columns:
                raise DataError(f"data.text_field={self.text_field!r} is not a column of {self.label!r}; "
                                f"columns: {', '.join(columns)}")
        elif first.strip():
            self._line_texts(Unit(0, 0, 0, len(first) + 1), lines=[first])

    def _line_texts(self, unit: Unit, lines: Optional[List[bytes]] = None, lines_before: int = 0
                    ) -> List[Optional[str]]:
        """The documents of `lines` (the unit's, read whole when None), the unit's lines from its
        `lines_before`-th (for the line numbers errors give)."""
        if lines is None:
            with reading(f"{self.label}: {self.files.where(unit.file)} bytes {unit.start}-{unit.stop}"):
                lines = self._lines(unit)
        texts: List[Optional[str]] = []
        for n, line in enumerate(lines, start=lines_before):
            text = line.decode("utf-8", errors="replace")
            if self.files.format == "text":
                texts.append(text)
                continue
            if not text.strip():
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError as e:
                raise DataError(f"data.name={self.label!r}: {self.files.names[unit.file]!r}, line {n + 1} of the unit "
                                f"at byte {unit.start}, is not JSON ({e.msg}); streaming reads .json as JSON Lines"
                                ) from None
            if not isinstance(record, dict) or self.text_field not in record:
                columns = ", ".join(record) if isinstance(record, dict) else type(record).__name__
                raise DataError(f"data.text_field={self.text_field!r} is not a column of {self.label!r}; "
                                f"columns: {columns}")
            text = record[self.text_field]
            if not isinstance(text, (str, type(None))):  # null is no document; a number, the tokenizer's TypeError
                raise DataError(f"data.name={self.label!r}: {self.files.names[unit.file]!r}, line {n + 1} of the "
                                f"unit at byte {unit.start}: {self.text_field} is {json.dumps(text)[:60]}, not a "
                                f"string; give every document's text as a string")
            texts.append(text)
        return texts

    def head_texts(self, unit: Unit, max_bytes: int) -> Optional[List[Optional[str]]]:
        """A line unit's lines that start in its first `max_bytes` (the last read on to its end)."""
        if self.files.format not in ("json", "text") or unit.stop - unit.start <= max_bytes:
            return None
        return self._line_texts(Unit(unit.file, unit.part, unit.start, unit.start + max_bytes))

    def _csv_texts(self, unit: Unit) -> List[Optional[str]]:
        with reading(f"{self.label}: {self.files.where(unit.file)} (the whole file)"):
            blob = self.files.read(unit.file, unit.start, unit.stop)
        table = pa_csv.read_csv(pa.BufferReader(blob))
        if self.text_field not in table.column_names:
            raise DataError(f"data.text_field={self.text_field!r} is not a column of {self.label!r}; "
                            f"columns: {', '.join(table.column_names)}")
        return table.column(self.text_field).to_pylist()

    def text_array(self, unit: Unit) -> Union[pa.Array, List[Optional[str]]]:
        return self._parquet_column(unit) if self.files.format == "parquet" else super().text_array(unit)

    def text_pieces(self, unit: Unit) -> Iterator[Union[pa.Array, List[Optional[str]]]]:
        """A line unit's documents from its first LINE_FIRST_READ bytes, then from the rest, each
        read when its first document is needed (the lines of the whole unit, in its order)."""
        if self.files.format not in ("json", "text"):
            yield self.text_array(unit)
            return
        pieces, lines_before = self._line_pieces(unit, LINE_FIRST_READ), 0
        while True:
            with reading(f"{self.label}: {self.files.where(unit.file)} bytes {unit.start}-{unit.stop}"):
                lines = next(pieces, None)
            if lines is None:
                return
            yield as_text_array(self._line_texts(unit, lines, lines_before))
            lines_before += len(lines)

    def texts(self, unit: Unit) -> List[Optional[str]]:
        if self.files.format == "parquet":
            return self._parquet_texts(unit)
        if self.files.format == "csv":
            return self._csv_texts(unit)
        return self._line_texts(unit)
