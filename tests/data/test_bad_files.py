"""Malformed task files, training data files and data URLs: one line, `error: ...`, exit 2, before
any process group starts; no traceback, and nothing (a datasets progress bar or log line) before it."""
import json

import pytest

from data.files import filesystem
from data.multiple_choice import read_examples
from data.sources import source_identity
from data.spec import DataError, DataSpec
from helpers.launcher import TINY
from launch.train import main

HELLASWAG = {"activity_label": "Cooking", "ctx_a": "A man takes a pan off the stove.", "ctx_b": "he",
             "endings": ["puts it on the table.", "sings."], "label": 0}
ARC = {"question": "Which is a gas?", "choices": {"text": ["iron", "oxygen"], "label": ["A", "B"]}, "answerKey": "B"}
PIQA = {"goal": "Open a jar.", "sol1": "Twist the lid.", "sol2": "Eat the lid.", "label": 0}


def _line(doc: dict, **fields) -> str:
    return json.dumps(dict(doc, **fields))


TASK_LINES = [
    # (first line, the bad second line, what the one line must say)
    (HELLASWAG, _line(HELLASWAG, ctx_b=5), "line 2: ctx_b is 5, not a string"),
    (HELLASWAG, _line(HELLASWAG, endings=[None]), "line 2: endings is [null]; give a list of at least 2 strings"),
    (HELLASWAG, _line(HELLASWAG, endings=["a", None]), "line 2: endings[1] is null, not a string"),
    (HELLASWAG, _line(HELLASWAG, endings=[]), "line 2: endings is []"),
    (HELLASWAG, _line(HELLASWAG, endings="ab"), 'line 2: endings is "ab"'),
    (HELLASWAG, _line(HELLASWAG, label=0).replace('"label": 0', '"label": 1e400'),
     "line 2: label Infinity is not the index of one of the endings (0 to 1)"),
    (HELLASWAG, _line(HELLASWAG, label=1.5), "line 2: label 1.5 is not the index of one of the endings"),
    (HELLASWAG, _line(HELLASWAG, label="x"), 'line 2: label "x" is not the index of one of the endings'),
    (HELLASWAG, _line(HELLASWAG, label=True), "line 2: label true is not the index"),
    (HELLASWAG, _line(HELLASWAG, label=7), "line 2: label 7 is out of range for 2 endings"),
    (HELLASWAG, _line(HELLASWAG, label=-1), "line 2: label -1 is out of range for 2 endings"),
    (HELLASWAG, _line(PIQA), "line 2: lacks activity_label, ctx_a, ctx_b, endings of the hellaswag schema"),
    (ARC, _line(ARC, answerKey="Z"), 'line 2: answerKey "Z" is not one of choices.label ["A", "B"]'),
    (ARC, _line(ARC, choices={"text": ["a", "b"], "label": ["A"]}), 'line 2: choices.label is ["A"]'),
    (ARC, _line(ARC, choices=["a", "b"]), 'line 2: choices is ["a", "b"]'),
    (ARC, _line(ARC, choices={"text": ["a", "b", "c"], "label": ["A", "B"]}),
     "line 2: choices.text has 3 choices and choices.label 2 labels"),
    (PIQA, _line(PIQA, label=2), "line 2: label 2 is out of range for 2 solutions"),
    (PIQA, _line(PIQA, sol2=None), "line 2: sol2 is null, not a string"),
    (HELLASWAG, "[" * 3000 + "]" * 3000, "line 2 cannot be read as JSON (RecursionError"),
    (HELLASWAG, '{"a": ' + "9" * 5000 + "}", "line 2 cannot be read as JSON (ValueError"),
    (HELLASWAG, "[1, 2]", "line 2 is [1, 2], not a JSON object"),
    (HELLASWAG, "null", "line 2 is null, not a JSON object"),
    (HELLASWAG, "{oops", "line 2 is not JSON (Expecting property name"),
]


@pytest.mark.parametrize("first,bad,words", TASK_LINES, ids=[c[2][:50] for c in TASK_LINES])
def test_a_bad_task_line_is_one_line_naming_it(first, bad, words, tmp_path):
    path = tmp_path / "task.jsonl"
    path.write_text(json.dumps(first) + "\n" + bad + "\n")
    with pytest.raises(DataError) as e:
        read_examples(path)
    assert str(e.value).startswith(f"task file {str(path)!r} "), str(e.value)
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_task_line_not_utf8_is_refused_not_replaced(tmp_path):
    path = tmp_path / "task.jsonl"
    path.write_bytes(f"{json.dumps(HELLASWAG)}\n{_line(HELLASWAG, ctx_a='caf')}\n".replace("caf", "caf\xff", 1)
                     .encode("latin-1"))
    with pytest.raises(DataError, match=r"line 2 is not UTF-8 \(byte \d+: b'\\xff'\)"):
        read_examples(path)


def test_good_task_lines_still_read(tmp_path):
    """The hub's spellings pass: HellaSwag's label as a string of digits, ARC's labels as digits."""
    path = tmp_path / "task.jsonl"
    path.write_text(_line(HELLASWAG, label="1") + "\n\n" + _line(HELLASWAG, ctx_a="a\u2028b") + "\n")
    assert [e.gold for e in read_examples(path)] == [1, 0]
    path.write_text(_line(ARC, choices={"text": ["a", "b", "c"], "label": ["1", "2", "3"]}, answerKey="3") + "\n")
    assert read_examples(path)[0].gold == 2


def _one_line_exit_2(argv, capfd, *words):
    """launch/train.py's main in this process: stderr (the file descriptor, where datasets' bars and
    log lines go) holds exactly the error line."""
    assert main(["--recipe", str(TINY)] + argv) == 2
    err = capfd.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    for word in words:
        assert word in err, (word, err)


@pytest.fixture
def one_process(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setattr("data.windows.default_cache_dir", lambda: tmp_path / "cache")  # the tokenizer's stays shared


def test_a_bad_task_file_stops_the_run_in_one_line(tmp_path, one_process, capfd):
    path = tmp_path / "hs.jsonl"
    path.write_text(json.dumps(HELLASWAG) + "\n" + _line(HELLASWAG, label=7) + "\n")
    _one_line_exit_2(["--set", f"eval.tasks=[hs={path}]"], capfd,
                     f"task file {str(path)!r} line 2: label 7 is out of range for 2 endings")


GOOD = '{"text": "A first document of some words."}\n'
DATA_FILES = [
    # (file name, content, extra settings, what the one line must say)
    ("number.jsonl", GOOD + '{"text": 5}\n', [], "number.jsonl' line 2: text is 5, not a string"),
    ("null.jsonl", GOOD + '\n{"text": null}\n', [], "null.jsonl' line 3: text is null, not a string"),
    ("missing.jsonl", GOOD + '{"body": "x"}\n', [], "missing.jsonl' line 2: text is missing, not a string"),
    ("list.jsonl", GOOD + "[1, 2]\n", [], "list.jsonl' line 2: is [1, 2], not a JSON object"),
    ("bad.jsonl", GOOD + '{"text": \n', [], "bad.jsonl' line 2: is not JSON"),
    ("array.json", '[{"text": "a"},\n {"text": 5}]', [], "array.json' row 2: text is 5, not a string"),
    ("number.jsonl", GOOD + '{"text": 5}\n', ["--set", "data.streaming=true", "--set", "data.val_fraction=0"],
     "'number.jsonl', line 2 of the unit at byte 0: text is 5, not a string"),
]


@pytest.mark.parametrize("name,content,extra,words", DATA_FILES, ids=[f"{c[0]}{c[2][1:2]}" for c in DATA_FILES])
def test_a_bad_training_file_is_the_only_line_on_stderr(name, content, extra, words, tmp_path, one_process, capfd):
    path = tmp_path / name
    path.write_text(content)
    _one_line_exit_2(["--set", f"data.name={path}", "--set", "train.eval_every=0"] + extra, capfd, words)


def test_a_training_line_not_utf8_is_refused(tmp_path, one_process, capfd):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(GOOD.encode() + '{"text": "caf\u00e9"}\n'.encode("latin-1"))
    _one_line_exit_2(["--set", f"data.name={path}", "--set", "train.eval_every=0"], capfd,
                     "latin1.jsonl' line 2: is not UTF-8 (byte 14: b'\\xe9')")


SCHEMES = "https://, http://, hf://, s3://, s3a://, gs://, gcs://, az://, abfs://, file://"


@pytest.mark.parametrize("argv,words", [
    (["--set", "data.name=ftp://host/x.jsonl", "--set", "data.streaming=true"],
     ["data.name='ftp://host/x.jsonl': 'ftp' is not a scheme data reads", SCHEMES]),
    (["--set", "data.name=wikitext", "--set", "data.data_files=[a.jsonl, 'ftp://host/x.jsonl']"],
     ["data.data_files[1]='ftp://host/x.jsonl': 'ftp' is not a scheme"]),
    (["--set", "data.mix=[{name: 'sftp://host/x.jsonl', streaming: true}]"],
     ["data.mix[0].name='sftp://host/x.jsonl'"]),
    (["--set", "data.name=https://host.example/x.jsonl"], ["is a URL, which streaming reads", "data.streaming=true"]),
    (["--set", "data.name=HTTPS://host.example/x.jsonl", "--set", "data.streaming=true"],
     ["'HTTPS' is not a scheme data reads (fsspec spells schemes in lower case)"]),
])
def test_a_url_of_a_scheme_data_cannot_read_is_one_line(argv, words, one_process, capfd):
    _one_line_exit_2(argv, capfd, *words)


def test_a_backend_that_fails_as_it_is_made_is_one_line():
    """fsspec's ftp:// backend connects in its constructor (here to a closed port): past the scheme
    check (a caller that skips DataSpec.validate), its socket error is still a DataError."""
    with pytest.raises(DataError, match=r"data.name='ftp://127.0.0.1:1/x.jsonl': the 'ftp' filesystem could not be "
                                        r"opened: ConnectionRefusedError"):
        filesystem("ftp://127.0.0.1:1/x.jsonl", "ftp://127.0.0.1:1/x.jsonl")


def test_a_scheme_with_a_control_character_is_escaped():
    with pytest.raises(DataError) as e:
        DataSpec(name="f\x1b[31mtp://host/x.jsonl", streaming=True).validate()
    assert "'f\\x1b[31mtp' is not a scheme" in str(e.value) and "\x1b" not in str(e.value), str(e.value)


@pytest.mark.parametrize("fields,words", [
    ({"config": "x"}, "data.config='x' applies to hub datasets only; data.name='builtin' is the embedded corpus"),
    ({"revision": "main"}, "data.revision='main' applies to hub datasets only"),
    ({"data_files": "a.txt", "streaming": True}, "data.data_files='a.txt' applies to hub datasets only"),
    ({"config": "x", "mix": [{"name": "wikitext"}, {"name": "builtin"}]}, "data.mix[1].config='x' applies"),
])
def test_builtin_refuses_hub_options_before_any_cache_is_looked_at(fields, words):
    """The refusal in data/sources.py's reading comes only when the tokenized data is not cached yet."""
    with pytest.raises(DataError, match="drop it") as e:
        DataSpec(**fields).validate()
    assert words in str(e.value), str(e.value)


def test_hub_options_of_a_mixture_of_hub_sources_pass():
    DataSpec(config="x", mix=[{"name": "wikitext"}, {"name": "https://host.example/a.jsonl", "streaming": True,
                                                     "config": None}]).validate()


def test_a_local_file_refuses_hub_options_in_the_cache_key_too(tmp_path):
    """The cache key is computed on every run, its data read only on the first."""
    path = tmp_path / "a.jsonl"
    path.write_text(GOOD)
    with pytest.raises(DataError, match="data.config='x' apply to a hub dataset id"):
        source_identity(DataSpec(name=str(path), config="x"))
    assert source_identity(DataSpec(name=str(path)))  # and without, the key
