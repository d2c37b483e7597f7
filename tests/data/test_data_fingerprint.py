"""A source's identity, on a directory of data files read the way
`datasets` reads a hub repository: `data.data_files` selects its files; a resume whose revision or
files differ from the checkpoint's is refused naming the change; hub options given to a URL or a
file, which name their data themselves, are refused instead of ignored."""
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data.builtin import load_tokenizer
from data.fingerprint import data_fingerprint
from data.run import prepare_run_data
from data.spec import DataError, DataSpec
from helpers.stream_corpus import document_texts
from launch.checkpoints.locate import CheckpointRef, data_position
from launch.errors import ConfigError


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("builtin")


@pytest.fixture
def repository(tmp_path):
    """Two folders of parquet files, as a hub dataset lays out its configs or samples."""
    texts = document_texts(240)
    for folder, files in (("sample", 4), ("full", 2)):
        (tmp_path / folder).mkdir()
        for f in range(files):
            rows = texts[(f * 40):(f + 1) * 40]
            pq.write_table(pa.table({"text": rows}), tmp_path / folder / f"part{f}.parquet", row_group_size=5)
    return tmp_path


def _prepare(tokenizer, **fields):
    spec = DataSpec(**{"streaming": True, "streams": 2, "shuffle_buffer": 4, **fields})
    return prepare_run_data(spec, tokenizer, 15, seed=1, global_batch_size=4, micro_batch_size=2, evaluate=False)


def _saved(data, step=3):
    """A checkpoint's record of the run's data (what launch/checkpoints/store.py writes)."""
    return CheckpointRef(root=Path("ck"), tag=f"step{step:08d}",
                         meta={"step": step, "samples": 4 * step, "data_fingerprint": data_fingerprint(data),
                               "data_state": None, "data_origin_samples": 0})


def test_data_files_select_the_files_of_a_repository(repository, tokenizer, stream_cache):
    every = _prepare(tokenizer, name=str(repository))
    sample = _prepare(tokenizer, name=str(repository), data_files="sample/*.parquet")
    assert sorted(every.train_stream.reader.files.names) == [f"full/part{f}.parquet" for f in range(2)] + \
        [f"sample/part{f}.parquet" for f in range(4)]
    assert sorted(sample.train_stream.reader.files.names) == [f"part{f}.parquet" for f in range(4)]


def test_a_resume_with_another_revision_or_an_added_file_is_refused(repository, tokenizer, stream_cache):
    saved = _saved(_prepare(tokenizer, name=str(repository), data_files="sample/*.parquet"))
    same = _prepare(tokenizer, name=str(repository), data_files="sample/*.parquet")
    assert data_position(saved, data_fingerprint(same), restart=False) == (None, 0)
    other_revision = _prepare(tokenizer, name=str(repository), data_files="sample/*.parquet", revision="v2")
    with pytest.raises(ConfigError, match=r"data\.revision was unset, now 'v2'.*--restart-data to start the data "
                                          r"order again at step 4"):
        data_position(saved, data_fingerprint(other_revision), restart=False)
    shutil.copy(repository / "sample" / "part0.parquet", repository / "sample" / "part9.parquet")
    added = _prepare(tokenizer, name=str(repository), data_files="sample/*.parquet")
    with pytest.raises(ConfigError, match=r"data\.files: 1 added \(part9\.parquet\)"):
        data_position(saved, data_fingerprint(added), restart=False)
    assert data_position(saved, data_fingerprint(added), restart=True) == (None, 12)  # the order begins at step 4


@pytest.mark.parametrize("name", ["{root}/sample/part0.parquet", "{root}/sample/*.parquet", "builtin"])
def test_hub_options_for_files_that_name_themselves_are_refused(name, repository, tokenizer, stream_cache):
    for streaming in (True, False):
        for option in ({"revision": "v2"}, {"config": "sample-10BT"}, {"data_files": "x/*.parquet"}):
            spec = DataSpec(name=name.format(root=repository), streaming=streaming, streams=2, **option)
            with pytest.raises(DataError) as refused:
                prepare_run_data(spec, tokenizer, 15, seed=1, global_batch_size=4, micro_batch_size=2, evaluate=False)
            key = next(iter(option))
            assert f"data.{key}=" in str(refused.value) and "names its files itself" in str(refused.value), refused.value
