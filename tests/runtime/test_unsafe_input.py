"""Input that would leak a secret or run code shipped with a model's files stops the start in one
line, exit 2, before any process group: a URL's credentials in a recipe field or flag that takes a
URL (never repeated, in whichever message would have named the value first), and a tokenizer whose
files ask for custom code (refused at once: no terminal prompt, nothing of theirs imported)."""
import json
import subprocess
import sys
import time

import pytest

from data.builtin import load_tokenizer
from helpers.launcher import REPO, TINY
from launch.errors import ConfigError
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


@pytest.fixture
def custom_code_tokenizer(tmp_path):
    """A working tokenizer whose tokenizer_config.json asks AutoTokenizer for a class of its own
    Python file (auto_map, as hub repos with custom code ship it); the file, if ever imported,
    leaves a mark."""
    path = tmp_path / "custom-tokenizer"
    load_tokenizer("builtin").save_pretrained(path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.update(tokenizer_class="EvilTokenizer",
                  auto_map={"AutoTokenizer": [None, "tokenization_evil.EvilTokenizer"]})
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "tokenization_evil.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    return path


@pytest.mark.slow  # a fresh process importing transformers: 4.5 CPU-s
def test_a_tokenizer_asking_for_custom_code_is_refused_at_once(custom_code_tokenizer):
    """A real process with stdin an open pipe nobody answers, as a terminal nobody watches: left to
    its default, transformers asks there "Do you wish to run the custom code? [y/N]" and waits 15 s
    (dynamic_module_utils.TIME_OUT_REMOTE_CODE) before refusing with a traceback."""
    out, err = custom_code_tokenizer.parent / "out", custom_code_tokenizer.parent / "err"
    with open(out, "w") as stdout, open(err, "w") as stderr:
        start = time.monotonic()
        proc = subprocess.Popen([sys.executable, "launch/train.py", "--recipe", str(TINY),
                                 "--set", f"data.tokenizer={custom_code_tokenizer}"],
                                cwd=REPO, stdin=subprocess.PIPE, stdout=stdout, stderr=stderr)
        try:
            returncode = proc.wait(timeout=120)
        finally:
            proc.kill()
            proc.stdin.close()
        elapsed = time.monotonic() - start
    out, err = out.read_text(), err.read_text()
    assert returncode == 2 and err.count("\n") == 1, out + err
    assert err.startswith(f"error: data.tokenizer='{custom_code_tokenizer}': its files ask for custom code (tokenizer_"
                          f"config.json's auto_map AutoTokenizer=[None, 'tokenization_evil.EvilTokenizer'])"), err
    # No prompt on stdout is the proof that nothing asked (transformers prints "Do you wish to run the
    # custom code? [y/N]" before its 15 s wait); the time is only a guard against a hang, with room
    # for a loaded machine's start-up (17 s once in a clean clone's suite, 4 s alone).
    assert "does not run" in err and "custom code" not in out, out
    assert elapsed < 60, elapsed
    assert not (custom_code_tokenizer.parent / "ran").exists()


def test_export_refuses_a_tokenizer_asking_for_custom_code(custom_code_tokenizer):
    from launch.checkpoints.hf_export import load_export_tokenizer
    with pytest.raises(ConfigError, match=r"^--tokenizer='.*': its files ask for custom code .* does not run"):
        load_export_tokenizer(str(custom_code_tokenizer), 4096, "--tokenizer")
