"""Bounded memory when streaming parquet: a process keeps at most FOOTERS_KEPT
footers however many files it reads, and still reads every row group's texts as pyarrow does;
a row group too large to be one unit is refused in one line naming the file. The streams serve
every dp."""
import os

import pyarrow.parquet as pq
import pytest

from data import units
from data.files import resolve_files
from data.spec import DataError
from data.units import FileUnits
from launch.errors import ConfigError
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


def _read_share_by_slots(streams: int, dp: int, batch: int) -> float:
    """The dealing written out slot by slot: slot j of the global batch is stream j // (B/S)'s;
    rank r trains slots [r B/dp, (r+1) B/dp) and reads every window of each stream it touches."""
    per_stream, per_rank = batch // streams, batch // dp
    return max(len({j // per_stream for j in range(r * per_rank, (r + 1) * per_rank)}) * per_stream / per_rank
               for r in range(dp))


def test_the_read_share_is_the_dealing_s():
    from data.streaming import read_share
    for batch in (16, 48, 64):
        for streams in (s for s in range(1, batch + 1) if batch % s == 0):
            for dp in (d for d in range(1, batch + 1) if batch % d == 0):
                assert read_share(streams, dp) == _read_share_by_slots(streams, dp, batch), (streams, dp, batch)


def _prepare_job(world: int, files: str, *settings: str):
    from helpers.launcher import TINY
    from launch.config.cli import parse_training_args
    from launch.trainer.startup import prepare_training_job
    os.environ["WORLD_SIZE"] = str(world)
    return prepare_training_job(parse_training_args(
        ["--recipe", str(TINY), "--set", f"data.name={files}", "--set", "data.streaming=true",
         "--set", "train.eval_every=0", *settings], ""))


def test_streams_that_dp_does_not_divide_are_refused_and_unset_ones_serve_any_dp(corpus, stream_cache, tmp_path,
                                                                                  monkeypatch, capsys):
    """Replicas sharing a stream would each read it whole (the recipes' old 16 streams at 1,024
    replicas: 64x): a data.streams that dp does not divide is one line before anything is read.
    Unset, the streams are the global batch (16 here), which every dp divides; a corpus of fewer
    units than that gets fewer streams, and a line says when replicas then share them."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ConfigError) as refused:
        _prepare_job(4, f"{corpus}/part*.parquet", "--set", "data.streams=2")
    message = str(refused.value)
    assert "data.streams=2" in message and "dp=4" in message and "unset" in message and "\n" not in message
    assert not (tmp_path / "cache").exists()  # refused before any listing or reading
    for world in (1, 8):
        job = _prepare_job(world, f"{corpus}/part*.parquet")
        assert job.data.spec.streams == 16 and "warning" not in capsys.readouterr().out
    job = _prepare_job(8, f"{corpus}/part[0-2].parquet")  # 3 files of 2 row groups: 6 units
    lines = [line for line in capsys.readouterr().out.splitlines() if "data.streams" in line]
    assert job.data.spec.streams == 4 and len(lines) == 1 and "up to 2.0x" in lines[0], lines
