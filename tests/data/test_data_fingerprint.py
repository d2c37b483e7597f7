"""A source's identity, on a directory of data files read the way
`datasets` reads a hub repository: `data.data_files` selects its files; a resume whose revision,
files or files' content differ from the checkpoint's is refused naming the change (content
rewritten in place at the same size: a local file's mtime, an HTTP file's ETag; a hub commit that
moved, compared on two recorded fingerprints: the hub is not reachable offline); hub options given
to a URL or a file, which name their data themselves, are refused instead of ignored."""
import os
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data.builtin import load_tokenizer
from data.fingerprint import data_fingerprint
from data.run import prepare_run_data
from data.spec import DataError, DataSpec
from helpers.range_server import RangeServer
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


def _plain(folder: Path) -> None:
    """The folder's parquet files rewritten uncompressed, without dictionaries or statistics: each
    document's bytes lie in the file as they are, for _rewrite_in_place to change."""
    for path in sorted(folder.glob("*.parquet")):
        pq.write_table(pq.read_table(path), path, row_group_size=5, compression="NONE", use_dictionary=False,
                       write_statistics=False)


def _rewrite_in_place(path: Path, keep_mtime: bool) -> None:
    """Other documents at the same size: the first document's ASCII letters in the other case, its
    mtime moved on by a second or kept (set back after the write)."""
    before, data = os.stat(path), path.read_bytes()
    first = pq.read_table(path).column("text")[0].as_py().encode()
    assert data.count(first) == 1
    path.write_bytes(data.replace(first, first.swapcase()))
    assert pq.read_table(path).column("text")[0].as_py().encode() == first.swapcase()
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns if keep_mtime else before.st_mtime_ns + 10**9))


def test_local_content_changed_in_place_at_the_same_size_is_refused(repository, tokenizer, stream_cache):
    """Same names, same sizes, another mtime: the unit positions would read other documents."""
    glob = str(repository / "sample" / "*.parquet")
    _plain(repository / "sample")
    saved = _saved(_prepare(tokenizer, name=glob))
    _rewrite_in_place(repository / "sample" / "part1.parquet", keep_mtime=False)
    now = data_fingerprint(_prepare(tokenizer, name=glob))
    with pytest.raises(ConfigError, match=r"data\.files: 1 changed in place at the same size \(part1\.parquet\): "
                                          r"another ETag, blob id or mtime.*--restart-data"):
        data_position(saved, now, restart=False)
    assert data_position(saved, now, restart=True) == (None, 12)


def test_an_http_file_whose_etag_changed_is_refused(repository, tokenizer, stream_cache):
    """Over HTTP the server's ETag (a digest of the bytes, tests/helpers/range_server.py) is the
    identity: content rewritten at the same size with its mtime set back is still seen."""
    _plain(repository / "sample")
    server = RangeServer(repository)
    try:
        url = f"{server.url}/sample/*.parquet"
        saved = _saved(_prepare(tokenizer, name=url))
        assert all(e[2].startswith("etag:") for e in saved.meta["data_fingerprint"]["data.files"])
        assert data_position(saved, data_fingerprint(_prepare(tokenizer, name=url)), restart=False) == (None, 0)
        _rewrite_in_place(repository / "sample" / "part2.parquet", keep_mtime=True)
        with pytest.raises(ConfigError, match=r"1 changed in place at the same size \(part2\.parquet\)"):
            data_position(saved, data_fingerprint(_prepare(tokenizer, name=url)), restart=False)
    finally:
        server.close()


def test_a_hub_revision_that_moved_is_refused_naming_the_commit_to_pin(repository, tokenizer, stream_cache):
    """Two recorded fingerprints of a hub source, its files' blob ids the same (an update that
    touched other files) and its branch resolved to another commit: refused, naming the saved commit
    to pin."""
    base = data_fingerprint(_prepare(tokenizer, name=str(repository / "sample" / "*.parquet")))
    saved = {**base, "data.files": [[n, s, f"blob:{i}"] for i, (n, s, _) in enumerate(base["data.files"])],
             "data.commit": "a" * 40}
    moved = {**saved, "data.commit": "b" * 40}
    ref = _saved(_prepare(tokenizer, name=str(repository / "sample" / "*.parquet")))
    ref.meta["data_fingerprint"] = saved
    with pytest.raises(ConfigError) as refused:
        data_position(ref, moved, restart=False)
    assert f"the hub revision moved from commit {'a' * 40!r} to {'b' * 40!r} (pin data.revision={'a' * 40}" \
        in str(refused.value) and "--restart-data" in str(refused.value) and "\n" not in str(refused.value)
    ref.meta["data_fingerprint"] = base
    assert data_position(ref, base, restart=False) == (None, 0)  # the same commit and files: resumes


def test_an_unpinned_hub_source_resumes_at_its_saved_commit(repository, tokenizer, stream_cache):
    """A resume of an unpinned hub source reads the commit its checkpoint saved (data.revision set
    to it), and that pin is no change of the data; a pinned, a non-hub or a fresh source is kept."""
    from data.fingerprint import at_saved_commit, fingerprint_changes
    saved = {"data.revision": None, "data.commit": "a" * 40}
    hub = DataSpec(name="org/corpus", streaming=True)
    assert at_saved_commit(hub, saved).revision == "a" * 40
    assert at_saved_commit(DataSpec(name="org/corpus", streaming=True, revision="v1"), saved).revision == "v1"
    assert at_saved_commit(hub, {"data.revision": None, "data.commit": None}).revision is None
    assert at_saved_commit(hub, None).revision is None
    assert fingerprint_changes(saved, {"data.revision": "a" * 40, "data.commit": "a" * 40}) == []
    assert fingerprint_changes(saved, {"data.revision": "b" * 40, "data.commit": "b" * 40}) != []
