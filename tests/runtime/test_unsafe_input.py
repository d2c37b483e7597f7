"""Input that would leak a secret stops the start in one line, exit 2, before any process group: a
URL's credentials in a recipe field or flag that takes a URL (never repeated, in whichever message
would have named the value first)."""

import pytest

from helpers.launcher import TINY
from launch.train import main

SECRET = "s3cr3t-Tk9"

CASES = [
    (["--set", f"data.data_files=https://user:{SECRET}@host.example/train.parquet"],
     "data.data_files=https://host.example/..."),
    (["--set", f"data.data_files=[a.parquet, 'https://user:{SECRET}@host.example/b.parquet']"],
     "data.data_files[1]=https://host.example/..."),
    (["--set", f"data.data_files={{train: ['https://user:{SECRET}@host.example/t.parquet']}}"],
     "data.data_files.train[0]=https://host.example/..."),
    (["--set", f"data.tokenizer=https://host.example/tok?sig={SECRET}"], "data.tokenizer=https://host.example/..."),
    (["--set", f"data.name=HTTPS://host.example/c.parquet?X-Amz-Signature={SECRET}"],
     "data.name=HTTPS://host.example/..."),
    (["--set", f"data.mix=[{{name: 'https://user:{SECRET}@host.example/m.jsonl', weight: 1}}]"],
     "data.mix[0].name=https://host.example/..."),
    (["--set", f"eval.tasks=['hellaswag=https://user:{SECRET}@host.example/hs.jsonl']"],
     "eval.tasks[0]=https://host.example/..."),
    # --layout auto loads the tokenizer before Recipe.validate: the recipe is checked as it is read
    (["--layout", "auto", "--set", f"data.tokenizer=https://host.example/tok?sig={SECRET}"],
     "data.tokenizer=https://host.example/..."),
    # a wrong type's message, or invalid YAML's, repeats the value
    (["--set", f"data.tokenizer=['https://user:{SECRET}@host.example/tok']"],
     "data.tokenizer[0]=https://host.example/..."),
    (["--set", f"data.data_files=['https://user:{SECRET}@host.example/a.parquet'"],
     "--set data.data_files=https://host.example/..."),
    (["--init-from-hf", f"https://user:{SECRET}@host.example/gpt2"], "--init-from-hf=https://host.example/..."),
]


def _refused_in_one_line(out: str, err: str, shown: str) -> None:
    assert err.startswith(f"error: {shown} carries credentials") and err.count("\n") == 1, err
    assert "environment" in err and SECRET not in out + err, out + err


@pytest.mark.parametrize("argv,shown", CASES, ids=[c[1] for c in CASES])
def test_train_refuses_a_secret_without_repeating_it(argv, shown, monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert main(["--recipe", str(TINY)] + argv) == 2
    _refused_in_one_line(*capsys.readouterr(), shown)


def test_evaluate_and_export_refuse_a_secret_in_their_flags(tmp_path, monkeypatch, capsys):
    from launch.evaluate import main as evaluate
    from launch.export_hf import main as export
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert evaluate(["--init-from-hf", f"https://host.example/gpt2?token={SECRET}"]) == 2
    _refused_in_one_line(*capsys.readouterr(), "--init-from-hf=https://host.example/...")
    assert export(["--load", str(tmp_path), "--out", str(tmp_path / "hf"),
                   "--tokenizer", f"https://user:{SECRET}@host.example/tok"]) == 2
    _refused_in_one_line(*capsys.readouterr(), "--tokenizer=https://host.example/...")
