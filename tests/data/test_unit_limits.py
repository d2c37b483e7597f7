"""Bounded memory when streaming parquet (issue 34, item 4): a process keeps at most FOOTERS_KEPT
footers however many files it reads, and still reads every row group's texts as pyarrow does;
a row group too large to be one unit is refused in one line naming the file."""
import pyarrow.parquet as pq
import pytest

from data import units
from data.files import resolve_files
from data.spec import DataError
from data.units import FileUnits
from helpers.stream_corpus import write_corpus

N_FILES = 3 * units.FOOTERS_KEPT // 2


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("many"), N_FILES * 8, N_FILES, group_rows=4)


def test_footers_kept_are_bounded_and_every_unit_reads_as_pyarrow_reads_it(corpus, stream_cache):
    source = FileUnits(resolve_files(str(corpus / "part*.parquet"), None, "train", None), "text", 2 ** 20)
    assert len(source.units) == 2 * N_FILES  # 8 rows per file in row groups of 4
    for unit in reversed(source.units):  # every file's footer needed again after the listing
        expected = pq.ParquetFile(source.files.paths[unit.file]).read_row_group(unit.part, columns=["text"])
        assert source.texts(unit) == expected.column(0).to_pylist(), unit
        assert len(source._footers) <= units.FOOTERS_KEPT
    assert len(source._footers) == units.FOOTERS_KEPT


def test_a_row_group_above_the_cap_is_refused_naming_the_file(corpus, stream_cache, monkeypatch):
    monkeypatch.setattr(units, "MAX_PARQUET_UNIT_BYTES", 64)  # the test's row groups hold a few hundred bytes
    with pytest.raises(DataError) as refused:
        FileUnits(resolve_files(str(corpus / "part1*.parquet"), None, "train", None), "text", 2 ** 20)
    message = str(refused.value)
    assert "row group 0 holds" in message and "part1" in message and "row_group_size" in message, message
    assert "\n" not in message
