"""A parquet footer of one row group and one column, written from a few integers: what pyarrow
needs to decode a unit's text chunk (data/units.py) without fetching the file's own footer.

The unit list keeps, per row group, the integers of CHUNK_COLUMNS (20 bytes a unit) and per file
the text column's type; `chunk_footer` writes from them the FileMetaData (parquet.thrift, in
Thrift's compact protocol) of a file holding that chunk alone, at the offset it is given
(data/units.py: after the parquet magic, in a buffer of its own), so the chunk's byte range is all
a read fetches. 1,000 nodes over 2,000 files would otherwise fetch
2,000 footers at every start, and every process each footer again for its first unit of a file.
"""
import struct
from typing import Optional, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

CODECS = {"UNCOMPRESSED": 0, "SNAPPY": 1, "GZIP": 2, "BROTLI": 4, "ZSTD": 6}
"""parquet.thrift's CompressionCodec of the codecs a chunk footer may name (not LZ4: pyarrow says
"LZ4" for both LZ4 (Hadoop's framing) and LZ4_RAW, parquet-format issue PARQUET-2032)."""
CHUNK_COLUMNS = 5
"""Per unit of a parquet source: rows, values, data page offset (from the unit's start), uncompressed
bytes, codec + 256 x (has a dictionary page); per file: physical type (-1: read with the footer),
repetition, converted type (-1: none)."""


class _Thrift:
    """Thrift's compact protocol, the few types a parquet footer needs (parquet.thrift)."""

    def __init__(self):
        self.out, self.last = bytearray(), [0]

    def varint(self, n: int) -> None:
        while True:
            byte, n = n & 0x7F, n >> 7
            self.out.append(byte | (0x80 if n else 0))
            if not n:
                return

    def field(self, fid: int, kind: int) -> None:
        delta, self.last[-1] = fid - self.last[-1], fid
        self.out.append(delta << 4 | kind)  # every field id here is at most 15 past the last

    def int(self, fid: int, n: int, kind: int = 6) -> None:  # 5: i32, 6: i64, zigzag varints both
        self.field(fid, kind)
        self.varint((n << 1) ^ (n >> 63))

    def string(self, fid: Optional[int], text: str) -> None:
        if fid is not None:
            self.field(fid, 8)
        self.varint(len(text.encode()))
        self.out += text.encode()

    def list(self, fid: int, kind: int, n: int) -> None:
        self.field(fid, 9)
        self.out.append(n << 4 | kind if n < 15 else 0xF0 | kind)
        if n >= 15:
            self.varint(n)

    def begin(self, fid: Optional[int] = None) -> None:
        if fid is not None:
            self.field(fid, 12)
        self.last.append(0)

    def end(self) -> None:
        self.out.append(0)
        self.last.pop()


def chunk_footer(column: str, start: int, stop: int, chunk: Sequence[int], schema: Sequence[int]) -> pq.FileMetaData:
    """A footer of one row group and one column, the unit's text chunk at its place in the file:
    what pyarrow needs to decode it, from the unit table's columns (CHUNK_COLUMNS)."""
    rows, values, data_at, uncompressed, codec = (int(v) for v in chunk)
    ptype, repetition, converted = (int(v) for v in schema)
    t = _Thrift()
    t.begin()  # FileMetaData
    t.int(1, 1, kind=5)  # version
    t.list(2, 12, 2)  # schema: the root, then the text column
    t.begin(), t.string(4, "schema"), t.int(5, 1, kind=5), t.end()
    t.begin(), t.int(1, ptype, kind=5), t.int(3, repetition, kind=5), t.string(4, column)
    if converted >= 0:
        t.int(6, converted, kind=5)
    t.end()
    t.int(3, rows)
    t.list(4, 12, 1)  # row_groups
    t.begin(), t.list(1, 12, 1)  # RowGroup.columns
    t.begin(), t.int(2, start), t.begin(3)  # ColumnChunk: file_offset, meta_data
    t.int(1, ptype, kind=5)
    t.list(2, 5, 3)  # encodings: PLAIN, RLE, RLE_DICTIONARY (the pages name their own)
    t.varint(0), t.varint(3 << 1), t.varint(8 << 1)
    t.list(3, 8, 1), t.string(None, column)
    t.int(4, codec & 0xFF, kind=5), t.int(5, values), t.int(6, uncompressed), t.int(7, stop - start)
    t.int(9, start + data_at)
    if codec >> 8:
        t.int(11, start)  # dictionary_page_offset: the chunk starts with its dictionary
    t.end(), t.end()
    t.int(2, uncompressed), t.int(3, rows), t.end()
    # a current writer's name: pyarrow pads the chunk's range for old parquet-mr writers (PARQUET-816)
    t.string(6, f"parquet-cpp-arrow version {pa.__version__}")
    t.end()
    blob = bytes(t.out)
    return pq.read_metadata(pa.BufferReader(b"PAR1" + blob + struct.pack("<I", len(blob)) + b"PAR1"))
