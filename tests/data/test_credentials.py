"""A URL's credentials (user:password@, or an http(s) ?query, where signed URLs carry their keys)
in any data field that takes a URL are one DataError line naming the field, the scheme and the
host, never the secret (data/spec.py: check_no_credentials): data.name, data.data_files in each
of its forms, data.tokenizer, a data.mix source, a task item. URLs without them pass."""
import pytest

from data.mixture_spec import parse_mixture
from data.multiple_choice import read_tasks
from data.spec import DataError, DataSpec, check_no_credentials

SECRET = "s3cr3t-Tk9"


def _refused(call, shown: str) -> None:
    with pytest.raises(DataError) as e:
        call()
    message = str(e.value)
    assert message.startswith(f"{shown} carries credentials") and "\n" not in message, message
    assert SECRET not in message, message


@pytest.mark.parametrize("fields,shown", [
    ({"data_files": f"https://user:{SECRET}@host.example/train.parquet"}, "data.data_files=https://host.example/..."),
    ({"data_files": ["a.parquet", f"https://user:{SECRET}@host.example/b.parquet"]},
     "data.data_files[1]=https://host.example/..."),
    ({"data_files": {"train": "a.parquet", "validation": [f"s3://key:{SECRET}@bucket/v.parquet"]}},
     "data.data_files.validation[0]=s3://bucket/..."),
    ({"tokenizer": f"https://host.example/tok?sig={SECRET}"}, "data.tokenizer=https://host.example/..."),
    ({"tokenizer": f"hf://{SECRET}@models/org/tok"}, "data.tokenizer=hf://models/..."),
    # RFC 3986: the scheme is case-insensitive, so is the check
    ({"name": f"HTTPS://host.example/c.parquet?X-Amz-Signature={SECRET}"}, "data.name=HTTPS://host.example/..."),
    ({"mix": [{"name": "builtin"}, {"name": f"https://user:{SECRET}@host.example/m.jsonl", "weight": 1}]},
     "data.mix[1].name=https://host.example/..."),
    ({"mix": [{"data_files": {"train": [f"https://host.example/m.parquet?sv=2024&sig={SECRET}"]}}]},
     "data.mix[0].data_files.train[0]=https://host.example/..."),
])
def test_a_secret_in_any_url_field_is_refused_without_repeating_it(fields, shown):
    _refused(DataSpec(**fields).validate, shown)


@pytest.mark.parametrize("value", [
    "builtin", "wikitext", "/data/user@example/corpus.jsonl",  # no scheme: a path, "@" and all
    "https://host.example/corpus/part-*.parquet",
    "hf://datasets/org/name@main/data/*.parquet",  # a revision after the authority, not a user
    "s3://bucket/corpus.parquet?versionId=3",  # an object version, not a signature
    ["a.parquet", {"train": ["https://host.example/t.parquet"]}],
])
def test_urls_without_credentials_pass(value):
    check_no_credentials("data.name", value)


def test_a_mixture_source_is_checked_before_its_types_are():
    """parse_mixture's type and shape messages repeat the value they refuse: the check comes first."""
    _refused(lambda: parse_mixture(DataSpec(mix=[{"data_files": [f"https://user:{SECRET}@host.example/a.jsonl"]}])),
             "data.mix[0].data_files[0]=https://host.example/...")
    _refused(lambda: parse_mixture(DataSpec(mix=[f"https://user:{SECRET}@host.example/a.jsonl"])),
             "data.mix[0]=https://host.example/...")


def test_a_task_item_with_a_secret_is_refused_before_its_file_is_looked_for():
    """--tasks and eval.tasks items are NAME=PATH: 'task file ... does not exist' would repeat it."""
    _refused(lambda: read_tasks([f"hellaswag=https://user:{SECRET}@host.example/hs.jsonl"], 0, "--tasks"),
             "--tasks[0]=https://host.example/...")
