"""A malformed `--load` is one line, exit 2, before any process group starts: a complete.json of
another format, of another shape or of a newer version, a `latest` that is not a tag of its directory, a link named
as a tag. And nothing outside the save directory is read as a checkpoint of it or written through
a link (launch/checkpoints/locate.py: check_format, check_manifest, _latest_of, refuse_another_runs_save_dir;
store.py: save; safe_io.py: write_durably; pruning: test_checkpoint.py). Every checkpoint here is a hand-written complete.json: no training."""
import json
import os
import re
from pathlib import Path

import pytest

from helpers.file_tree import file_tree
from helpers.launcher import TINY
from helpers.manifest import complete_json
from launch.checkpoints.locate import find_resume_point
from launch.errors import ConfigError
from launch.train import main

TAG = "step00000005"


def _meta(**changes):
    """A complete.json that find_checkpoint takes (a manifest of no files) and a tiny.yaml run
    resumes: its recipe as trained, with the builtin tokenizer's vocabulary."""
    from launch.config.recipe import load_recipe
    from launch.feed.run_inputs import resolved_recipe_dict
    layout = {"tp": 1, "pp": 1, "dp": 1, "parts": [0, 6]}
    return complete_json(resolved_recipe_dict(load_recipe(TINY, []), 4096), layout, **changes)


def _save_dir(root: Path, manifest, latest: bytes = TAG.encode()) -> Path:
    """`root` holding one tag directory whose complete.json is `manifest` (bytes as they are, else
    JSON), and `latest`."""
    (root / TAG).mkdir(parents=True)
    (root / TAG / "complete.json").write_bytes(manifest if isinstance(manifest, bytes) else json.dumps(manifest).encode())
    (root / "latest").write_bytes(latest)
    return root


def _refused(load: Path, *words, save=None) -> str:
    with pytest.raises(ConfigError) as refused:
        find_resume_point(load, save, is_writer=True)
    message = str(refused.value)
    assert message.isprintable(), message  # one line, and no raw control character
    for word in words:
        assert word in message, (word, message)
    return message


def _with(path, value):
    """_meta() with the key at `path` (a dotted name) set to `value`, or deleted for None."""
    meta = _meta()
    *parents, last = path.split(".")
    section = meta
    for key in parents:
        section = section[key]
    if value is None:
        del section[last]
    else:
        section[last] = value
    return meta


def test_a_hand_written_manifest_loads(tmp_path):
    """The baseline each case below changes: it loads, with a parent and without (null: a run's first save)."""
    assert find_resume_point(_save_dir(tmp_path / "a", _meta()), None, is_writer=True).meta["step"] == 5
    assert find_resume_point(_save_dir(tmp_path / "b", _meta(parent="step00000004")), None, is_writer=True).tag == TAG


@pytest.mark.parametrize("manifest,words", [
    (b"[1, 2]", ["it holds [1, 2], not a JSON object"]),
    (b"null", ["it holds null, not a JSON object"]),
    (b"7", ["it holds 7, not a JSON object"]),
    (b'{"step": ', ["JSONDecodeError"]),
    (b'\xff\xfe{"step": 5}', ["UnicodeDecodeError"]),
    (b"[" * 100_000 + b"]" * 100_000, ["RecursionError"]),
    (json.dumps(_with("step", None)).encode(), ["(no step)"]),
    (json.dumps(_with("samples", None)).encode(), ["(no samples)"]),
    (json.dumps(_with("recipe", None)).encode(), ["(no recipe)"]),
    (json.dumps(_with("layout", None)).encode(), ["(no layout)"]),
    (json.dumps(_with("files", None)).encode(), ["(no files)"]),
    (json.dumps(_with("engine_zero_stage", None)).encode(), ["(no engine_zero_stage)"]),
    (json.dumps(_with("data_fingerprint", None)).encode(), ["(no data_fingerprint)"]),
    (json.dumps(_with("data_origin_samples", None)).encode(), ["(no data_origin_samples)"]),
    (json.dumps(_with("world_size", 0)).encode(), ["world_size=0, expected an integer >= 1"]),
    (json.dumps(_with("step", "7")).encode(), ["step='7', expected an integer from 0 to"]),
    (json.dumps(_with("step", -1)).encode(), ["step=-1, expected an integer from 0 to"]),
    (json.dumps(_meta()).replace('"step": 5', '"step": 1e400').encode(), ["step=Infinity"]),
    (json.dumps(_with("step", True)).encode(), ["step=true"]),
    (json.dumps(_with("step", 10 ** 30)).encode(), [f"step={10 ** 30}, expected an integer from 0 to {2 ** 63 - 1}"]),
    (json.dumps(_with("samples", "80")).encode(), ["samples='80'"]),
    (json.dumps(_with("recipe", [])).encode(), ["recipe=[], expected an object"]),
    (json.dumps(_with("recipe.model", [])).encode(), ["recipe.model=[], expected an object"]),
    (json.dumps(_with("recipe.train.zero_stage", None)).encode(), ["no recipe.train.zero_stage"]),
    (json.dumps(_with("recipe.data", None)).encode(), ["no recipe.data, expected an object"]),
    (json.dumps(_with("recipe.data.tokenizer", 7)).encode(), ["recipe.data.tokenizer=7, expected a tokenizer's"]),
    (json.dumps(_with("recipe.train.global_batch_size", "16")).encode(), ["recipe.train.global_batch_size='16'"]),
    (json.dumps(_with("recipe.train.optimizer", None)).encode(), ["no recipe.train.optimizer"]),
    (json.dumps(_with("recipe.train.optimizer", "adamw\x1b[2J")).encode(), ["recipe.train.optimizer='adamw\\x1b[2J'"]),
    (json.dumps(_with("recipe.model.n_embd", "64")).encode(), ["recipe.model.n_embd='64', expected int"]),
    (json.dumps(_with("recipe.model.dropout", float("nan"))).encode(), ["recipe.model.dropout=NaN, expected float"]),
    (json.dumps(_with("recipe.model.arch", "gpt5")).encode(), ["recipe.model.arch='gpt5' is not one of"]),
    (json.dumps(_with("recipe.model.n_layer", 0)).encode(), ["recipe.model.n_layer=0 must be >= 1"]),
    (json.dumps(_with("recipe.model.moe", 3)).encode(), ["recipe.model.moe=3, expected an object"]),
    (json.dumps(_with("recipe.model.moe", None)).encode(), ["no recipe.model.moe"]),
    (json.dumps(_with("recipe.model.sequence_parallel", None)).encode(), ["no recipe.model.sequence_parallel"]),
    (json.dumps(_with("recipe.model.moe.num_experts", None)).encode(), ["no recipe.model.moe.num_experts"]),
    (json.dumps(_with("layout", "tp=1")).encode(), ["layout='tp=1', expected an object"]),
    (json.dumps(_with("layout.tp", "1")).encode(), ["layout.tp='1', expected an integer >= 1"]),
    (json.dumps(_with("layout.ep", None)).encode(), ["no layout.ep, expected an integer >= 1"]),
    (json.dumps(_with("layout.pp", 9)).encode(), ["layout.pp=9, expected at most model.n_layer=4"]),
    (json.dumps(_with("layout.parts", "0,6")).encode(), ["layout.parts='0,6', expected 2 layer indices"]),
    (json.dumps(_with("layout.parts", None)).encode(), ["no layout.parts, expected 2 layer indices"]),
    (json.dumps(_with("layout.virtual_stages", None)).encode(), ["no layout.virtual_stages, expected an integer >= 1"]),
    (json.dumps(_with("layout.chunk_parts", [0, 3, 6])).encode(),
     ["layout.chunk_parts=[0, 3, 6], expected [] at virtual_stages=1"]),
    (json.dumps(_with("layout.virtual_stages", 2)).encode(), ["layout.chunk_parts=[], expected 3 layer indices"]),
    (json.dumps(_with("files", [])).encode(), ["files=[], expected an object"]),
    (json.dumps(_with("files", {"../../etc/passwd": 1})).encode(), ["'../../etc/passwd', expected a path inside"]),
    (json.dumps(_with("files", {"a.pt": "1"})).encode(), ["files['a.pt']='1', expected a size in bytes"]),
    (json.dumps(_with("data_fingerprint", [])).encode(), ["data_fingerprint=[], expected an object or null"]),
    (json.dumps(_with("data_origin_samples", 81)).encode(), ["data_origin_samples=81, expected an integer from 0 to "
                                                             "samples"]),
    (json.dumps(_with("parent", 3)).encode(), ["parent=3, expected a string or null"]),
    (json.dumps(_with("engine_zero_stage", "1")).encode(), ["engine_zero_stage='1', expected 0, 1, 2 or 3"]),
])
def test_a_manifest_of_another_shape_is_one_line(manifest, words, tmp_path):
    ck = _save_dir(tmp_path / "ck", manifest)
    _refused(ck, f"checkpoint {str(ck / TAG)!r} has an unreadable complete.json (", *words,
             "restore it or load another checkpoint")
    _refused(ck / TAG, "has an unreadable complete.json", *words)  # the tag directory itself


@pytest.mark.parametrize("found,shown", [(None, "no format"), (0, "format 0"), (1, "format 1"), (3, "format 3"),
                                         ("2", "format '2'"), (True, "format true")])
def test_a_manifest_of_another_format_is_one_line_naming_it(found, shown, tmp_path):
    """Format 2 is what this version writes and reads (launch/checkpoints/manifest.py: CHECKPOINT_FORMAT;
    format 1 recorded no virtual stages); any other, or none, is refused before any other key is read,
    whatever the rest holds."""
    bare = {"step": 5} if found is None else {"format": found}  # the rest of the manifest missing too
    for name, meta in (("whole", _with("format", found)), ("bare", bare)):
        ck = _save_dir(tmp_path / name / "ck", meta)
        message = _refused(ck, f"checkpoint {str(ck / TAG)!r} has {shown}; this version reads format 2: resume it "
                               f"with the version that wrote it")
        assert "unreadable" not in message


@pytest.mark.parametrize("key", ["model.new_thing", "model.moe.new_thing"])
def test_a_manifest_of_a_newer_version_names_the_key(key, tmp_path):
    ck = _save_dir(tmp_path / "ck", _with(f"recipe.{key}", 1))
    _refused(ck, f"checkpoint {str(ck / TAG)!r} was written by a newer version: its recipe has {key}, a key this "
             f"version does not know", "with the version that saved it")


def test_latest_names_only_a_tag_directory_of_its_own(tmp_path):
    """`latest` not UTF-8, empty, with a newline or a terminal escape, or naming a path out of the
    directory (to a complete checkpoint there, which was loaded before) or a tag that is not there."""
    other = _save_dir(tmp_path / "other", _meta(step=7, samples=112))  # another run's complete checkpoint
    cases = [(b"\xff\xfe", ["its latest cannot be read (UnicodeDecodeError"]),
             (b"", ["its latest names '', which is no tag directory of it"]),
             (b"step0000\n0005", ["names 'step0000\\n0005', which is no tag directory"]),
             (b"step\x1b[31m00000005", ["names 'step\\x1b[31m00000005'"]),
             (b"../other/" + TAG.encode(), [f"names '../other/{TAG}', which is no tag directory of it (stepNNNNNNNN, "
                                            f"no path, no symbolic link)"]),
             (str(other / TAG).encode(), [f"names {str(other / TAG)!r}, which is no tag directory"]),
             (b"step00000009\n", ["names 'step00000009', which is not a complete checkpoint in it"])]
    for n, (latest, words) in enumerate(cases):
        ck = _save_dir(tmp_path / f"ck{n}", _meta(), latest)
        _refused(ck, f"--load {str(ck)!r}: ", *words, "load a checkpoint (a tag directory) explicitly")
    assert find_resume_point(_save_dir(tmp_path / "ok", _meta(), TAG.encode() + b"\n"), None, True).tag == TAG


def test_paths_in_messages_escape_control_characters(tmp_path):
    """A save directory's name from the command line is printed with repr, never raw."""
    ck = _save_dir(tmp_path / "ck\x1b[2J\n", b"[]")
    assert "\\x1b[2J\\n" in _refused(ck, "it holds []")
    (ck / "latest").unlink()
    (ck / TAG / "complete.json").write_text(json.dumps(_meta()))
    _refused(ck, "has no latest file but complete checkpoints ('step00000005')", "\\x1b[2J\\n/step00000005")


def _elsewhere(tmp_path: Path) -> Path:
    """Another run's directory holding a complete checkpoint, step00000008, that a link points to."""
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "step00000008").mkdir(parents=True)
    (elsewhere / "step00000008" / "complete.json").write_text(json.dumps(_meta(step=8, samples=128)))
    (elsewhere / "step00000008" / "SENTINEL").write_text("another run's checkpoint")
    return elsewhere


def test_a_link_named_as_a_tag_is_never_loaded_nor_written_through(tmp_path):
    """DIR/step00000008 -> elsewhere: `latest` naming it, --load of the link, a requeue (--save DIR
    --load DIR) whose set-aside leaves it and whose save would write through it, and a save of that
    step are refused in one line; a requeue without `latest` resumes DIR's own step 5. The linked
    directory stays byte for byte."""
    from launch.checkpoints import store
    from launch.checkpoints.locate import refuse_another_runs_save_dir
    elsewhere = _elsewhere(tmp_path)
    before = file_tree(elsewhere)
    ck = _save_dir(tmp_path / "ck", _meta(), latest=b"step00000008")
    (ck / "step00000008").symlink_to(elsewhere / "step00000008")
    _refused(ck, "its latest names 'step00000008', which is no tag directory of it")
    _refused(ck / "step00000008", f"--load {str(ck / 'step00000008')!r} is a symbolic link to a checkpoint",
             f"load it where it lies: --load {elsewhere / 'step00000008'}")
    (ck / "latest").unlink()  # a save killed before `latest`: the newest complete tag of DIR's own
    resumed = find_resume_point(ck, ck, is_writer=False)
    assert resumed.tag == TAG
    for resume_from in (resumed, None):  # a requeue, a fresh run
        with pytest.raises(ConfigError, match=re.escape(f"--save {str(ck)!r}: 'step00000008' is a symbolic link to "
                                                        f"{str(elsewhere / 'step00000008')!r}, which a save would write "
                                                        f"through, where this run would save step 8; remove it")):
            refuse_another_runs_save_dir(ck, resume_from)
    assert (ck / "step00000008").is_symlink() and not list(ck.glob("abandoned-*"))
    with pytest.raises(ConfigError, match="'step00000008' is a symbolic link .* where this run saves step 8"):
        store.save(None, ck, 8, 128, {}, {}, keep_last=1, is_writer=True)  # a link made during the run
    assert file_tree(elsewhere) == before


def test_a_durable_write_never_follows_a_link_at_its_temporary_name(tmp_path):
    """write_durably (latest, complete.json, starts.jsonl) writes a new file: a link left at its
    temporary name is replaced, its target untouched."""
    from launch.checkpoints.safe_io import write_durably
    target = tmp_path / "elsewhere.txt"
    target.write_text("another run's file")
    (tmp_path / f".latest.tmp{os.getpid()}").symlink_to(target)
    write_durably(tmp_path / "latest", TAG)
    assert (tmp_path / "latest").read_text() == TAG and not (tmp_path / "latest").is_symlink()
    assert target.read_text() == "another run's file"


def test_a_start_record_nested_too_deep_is_left_out(tmp_path):
    """starts.jsonl, which a requeue reads: a line nested past the recursion limit is no record."""
    from launch.resilience.restarts import read_starts
    record = {"started": "2026-12-01T00:00:00Z", "from_step": None, "ended": "rank 0: boom"}
    (tmp_path / "starts.jsonl").write_text("[" * 100_000 + "]" * 100_000 + "\n" + json.dumps(record) + "\n")
    assert read_starts(tmp_path) == [record]


def _one_line_exit_2(argv, capsys, *words) -> str:
    assert main(["--recipe", str(TINY)] + argv) == 2, argv
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and err[:-1].isprintable(), err
    for word in words:
        assert word in err, (word, err)
    return err


def test_through_train_main_exit_2_one_line(tmp_path, monkeypatch, capsys):
    """launch/train.py, in process: each refusal is `error: ...` and exit 2, the save directory and
    the linked one byte for byte."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    _one_line_exit_2(["--load", str(_save_dir(tmp_path / "list", b"[1, 2]"))], capsys,
                     "has an unreadable complete.json (it holds [1, 2], not a JSON object)")
    _one_line_exit_2(["--load", str(_save_dir(tmp_path / "newer", _with("recipe.model.new_thing", 1)))], capsys,
                     "was written by a newer version: its recipe has model.new_thing")
    _one_line_exit_2(["--load", str(_save_dir(tmp_path / "step", _with("step", "7")))], capsys, "step='7'")
    for found, shown in ((None, "no format"), (1, "format 1"), (3, "format 3")):
        ck = _save_dir(tmp_path / f"format-{found}", _with("format", found))
        kept = file_tree(ck)
        _one_line_exit_2(["--save", str(ck), "--load", str(ck)], capsys,
                         f"checkpoint {str(ck / TAG)!r} has {shown}; this version reads format 2")
        assert file_tree(ck) == kept
    out = _save_dir(tmp_path / "out", _meta(step=7, samples=112))
    _one_line_exit_2(["--load", str(_save_dir(tmp_path / "abs", _meta(), str(out / TAG).encode()))], capsys,
                     f"its latest names {str(out / TAG)!r}, which is no tag directory of it")
    elsewhere = _elsewhere(tmp_path)
    ck = _save_dir(tmp_path / "ck", _meta())
    (ck / "step00000008").symlink_to(elsewhere / "step00000008")
    before = (file_tree(elsewhere), file_tree(ck))
    _one_line_exit_2(["--load", str(ck / "step00000008")], capsys, "is a symbolic link to a checkpoint")
    _one_line_exit_2(["--save", str(ck), "--load", str(ck), "--steps", "9"], capsys,
                     "'step00000008' is a symbolic link to", "where this run would save step 8")
    assert (file_tree(elsewhere), file_tree(ck)) == before
