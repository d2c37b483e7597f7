"""Malformed transformers directories are one line naming the file and the value, before any
process group starts: a tokenizer directory (data.tokenizer, --tokenizer: data/builtin.py
load_tokenizer, a DataError) whose JSON files are not JSON objects, not JSON, not UTF-8, or that
transformers or tokenizers cannot read; an `--init-from-hf` directory (launch/checkpoints/
hf_weights.py, hf_safetensors.py, a ConfigError) whose config.json is not a JSON object or has a
size that is not a positive integer, whose safetensors headers cannot be read, whose index is not
a mapping of tensor names to shard files, or which lacks a tensor the model reads. Each case was a
traceback (AttributeError, TypeError, JSONDecodeError, ZeroDivisionError, SafetensorError, ...), or
a KeyError after the process group started; a few go through launch/train.py and launch/evaluate.py
for the line and exit code 2."""
import json
import shutil
import struct

import pytest
from safetensors import safe_open
from safetensors.torch import load_file, save_file
import transformers  # the model classes load on first use (transformers' lazy module), not at collection

from data.builtin import builtin_tokenizer_dir, load_tokenizer
from data.spec import DataError
from helpers.launcher import TINY
from launch import evaluate, train
from launch.checkpoints.hf_weights import check_hf_source, hf_model_fields, read_hf_config
from launch.config.recipe import load_recipe
from launch.errors import ConfigError
from model.config import GPTConfig
from model.hf.gpt2 import gpt2_config_kwargs
from model.hf.llama import llama_config_kwargs

LLAMA = GPTConfig(arch="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=32, ffn_hidden_size=48, seq_len=8,
                  vocab_size=97, vocab_pad_multiple=8, seed=3)


def _one_line(error, *words):
    message = str(error.value)
    assert "\n" not in message, message
    for word in words:
        assert word in message, (word, message)


# (file, its bytes, words of the message besides the directory)
TOKENIZER_CASES = {
    "config-list": ("tokenizer_config.json", b"[1, 2]", ["tokenizer_config.json is a list, not a JSON object"]),
    "config-null": ("tokenizer_config.json", b"null", ["tokenizer_config.json is null"]),
    "config-number": ("tokenizer_config.json", b"3", ["tokenizer_config.json is a number"]),
    "config-not-json": ("tokenizer_config.json", b"{nope", ["tokenizer_config.json is not valid JSON"]),
    "config-not-utf8": ("tokenizer_config.json", b"\xff\xfe{}", ["tokenizer_config.json is not UTF-8",
                                                                 "byte 0xff at offset 0"]),
    "config-nested": ("tokenizer_config.json", b"[" * 100_000, ["tokenizer_config.json is nested too deeply"]),
    "special-tokens-list": ("special_tokens_map.json", b"[]", ["special_tokens_map.json is a list"]),
    "tokenizer-garbage": ("tokenizer.json", b"garbage\x00\x01", ["tokenizer.json is not valid JSON"]),
    "tokenizer-list": ("tokenizer.json", b"[]", ["tokenizer.json is a list"]),
    # JSON objects that transformers or tokenizers still cannot read: the last resort's line
    "tokenizer-no-model": ("tokenizer.json", b'{"added_tokens": []}',
                           ["tokenizer.json is not a tokenizers serialization", "Model missing"]),
    "config-added-tokens-list": ("tokenizer_config.json", b'{"added_tokens_decoder": [1]}',
                                 ["transformers cannot load a tokenizer", "AttributeError"]),
}


@pytest.fixture(scope="module")
def builtin_dir():
    load_tokenizer("builtin")  # built once into the cache
    return builtin_tokenizer_dir()


def _broken_tokenizer(builtin_dir, tmp_path, case):
    filename, data, _ = TOKENIZER_CASES[case]
    path = tmp_path / "tokenizer"
    shutil.copytree(builtin_dir, path)
    (path / filename).write_bytes(data)
    return path


@pytest.mark.parametrize("case", sorted(TOKENIZER_CASES))
def test_a_malformed_tokenizer_file_is_one_line(case, builtin_dir, tmp_path):
    path = _broken_tokenizer(builtin_dir, tmp_path, case)
    with pytest.raises(DataError) as error:
        load_tokenizer(str(path), "--tokenizer")
    _one_line(error, f"--tokenizer={str(path)!r}: ", *TOKENIZER_CASES[case][2])


def test_the_builtin_tokenizer_copied_loads(builtin_dir, tmp_path):
    """The cases' directory before its damage: what fails is the damage."""
    shutil.copytree(builtin_dir, tmp_path / "tokenizer")
    assert len(load_tokenizer(str(tmp_path / "tokenizer"))) == len(load_tokenizer("builtin"))


def _exit_2(main, argv, capsys, *words):
    assert main(argv) == 2, argv
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    for word in words:
        assert word in err, (word, err)


def test_a_malformed_tokenizer_stops_training_in_one_line(builtin_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    path = _broken_tokenizer(builtin_dir, tmp_path, "config-list")
    _exit_2(train.main, ["--recipe", str(TINY), "--set", f"data.tokenizer={path}"], capsys,
            f"data.tokenizer={str(path)!r}", "tokenizer_config.json is a list")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama") / "model"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**llama_config_kwargs(LLAMA))).save_pretrained(path)
    check_hf_source(str(path), LLAMA, resuming=False)  # the cases' directory before its damage passes
    return path


def _copy(llama_dir, tmp_path):
    path = tmp_path / "model"
    shutil.copytree(llama_dir, path)
    return path


def _write_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(dict(config, **changes)))


CONFIG_TEXTS = {"list": (b"[]", "is a list, not a JSON object"), "null": (b"null", "is null"),
                "number": (b"3", "is a number"), "not-json": (b"{x", "is not valid JSON"),
                "not-utf8": (b"\xff{}", "is not UTF-8 text (byte 0xff at offset 0)"),
                "nested": (b"[" * 100_000, "is nested too deeply")}
CONFIG_VALUES = [("num_attention_heads", 0), ("num_attention_heads", -4), ("num_attention_heads", "4"),
                 ("hidden_size", 0), ("hidden_size", 32.0), ("num_hidden_layers", -1), ("vocab_size", "97"),
                 ("vocab_size", None), ("intermediate_size", 0), ("num_key_value_heads", 0),
                 ("num_key_value_heads", True), ("max_position_embeddings", "8")]


def _both_readers_refuse(path, *words):
    """check_hf_source (train, evaluate) and read_hf_config (evaluate's model shape) refuse it alike."""
    with pytest.raises(ConfigError) as error:
        check_hf_source(str(path), LLAMA, resuming=False)
    _one_line(error, f"--init-from-hf {str(path)!r}", *words)
    with pytest.raises(ConfigError) as error:
        hf_model_fields(read_hf_config(str(path)))
    _one_line(error, f"--init-from-hf {str(path)!r}", *words)


@pytest.mark.parametrize("case", sorted(CONFIG_TEXTS))
def test_a_config_json_that_is_not_a_json_object_is_one_line(case, llama_dir, tmp_path):
    path = _copy(llama_dir, tmp_path)
    data, words = CONFIG_TEXTS[case]
    (path / "config.json").write_bytes(data)
    _both_readers_refuse(path, f"config.json {words}")


@pytest.mark.parametrize("key,value", CONFIG_VALUES, ids=[f"{k}={v!r}" for k, v in CONFIG_VALUES])
def test_a_size_that_is_not_a_positive_integer_is_one_line(key, value, llama_dir, tmp_path):
    path = _copy(llama_dir, tmp_path)
    _write_config(path, **{key: value})
    _both_readers_refuse(path, f"config.json has {key}={value!r}, not a positive integer")


@pytest.mark.parametrize("changes,words", [
    (dict(rope_parameters={"rope_type": "default", "rope_theta": "x"}), ["rope_parameters rope_theta='x'"]),
    (dict(rms_norm_eps="x"), ["config.json is not a valid LlamaConfig", "rms_norm_eps"]),
    (dict(rope_parameters=[1]), ["config.json is not a valid LlamaConfig", "rope_parameters"]),
    (dict(model_type=["llama"]), ["is a ['llama'] model"]),
], ids=["rope-theta-string", "eps-string", "rope-list", "model-type-list"])
def test_other_malformed_config_values_are_one_line(changes, words, llama_dir, tmp_path):
    path = _copy(llama_dir, tmp_path)
    _write_config(path, **changes)
    _both_readers_refuse(path, *words)


def _header(length: int, text: bytes) -> bytes:
    return struct.pack("<Q", length) + text


SAFETENSORS_CASES = {
    "empty": (lambda data: b"", ["header too small", "0 bytes"]),
    "garbage": (lambda data: b"garbage bytes, not safetensors", ["header too large"]),
    "header-past-the-end": (lambda data: _header(10**6, b"{}"), ["invalid header length", "10 bytes"]),
    "header-not-json": (lambda data: _header(4, b"{xx}"), ["invalid JSON in header"]),
    "truncated": (lambda data: data[:-100], ["incomplete metadata"]),
}


@pytest.mark.parametrize("case", sorted(SAFETENSORS_CASES))
def test_an_unreadable_safetensors_file_is_one_line(case, llama_dir, tmp_path):
    path = _copy(llama_dir, tmp_path)
    damage, words = SAFETENSORS_CASES[case]
    (path / "model.safetensors").write_bytes(damage((path / "model.safetensors").read_bytes()))
    with pytest.raises(ConfigError) as error:
        check_hf_source(str(path), LLAMA, resuming=False)
    _one_line(error, f"--init-from-hf {str(path)!r}: model.safetensors is not a safetensors file", *words)


def _sharded(llama_dir, tmp_path):
    """The model as two shards and their index (the tensors stay where they are: shard 2 is a copy)."""
    path = _copy(llama_dir, tmp_path)
    shutil.copy(path / "model.safetensors", path / "model-00002-of-00002.safetensors")
    (path / "model.safetensors").rename(path / "model-00001-of-00002.safetensors")
    with safe_open(str(path / "model-00001-of-00002.safetensors"), "pt") as f:
        names = sorted(f.keys())
    weight_map = {name: f"model-0000{1 + i % 2}-of-00002.safetensors" for i, name in enumerate(names)}
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return path, weight_map


INDEX_CASES = {
    "garbage": (lambda wm: "garbage", ["model.safetensors.index.json is not valid JSON"]),
    "list": (lambda wm: [], ["model.safetensors.index.json is a list, not a JSON object"]),
    "no-weight-map": (lambda wm: {"metadata": {}}, ["weight_map is missing"]),
    "weight-map-list": (lambda wm: {"weight_map": list(wm)}, ["weight_map is a list, not a mapping"]),
    "weight-map-number": (lambda wm: {"weight_map": dict(wm, **{"lm_head.weight": 5})},
                          ["weight_map['lm_head.weight'] is a number (5), not a shard file's name"]),
    "weight-map-list-value": (lambda wm: {"weight_map": dict(wm, **{"lm_head.weight": ["a"]})},
                              ["weight_map['lm_head.weight'] is a list ([\"a\"])"]),
}


@pytest.mark.parametrize("case", sorted(INDEX_CASES))
def test_a_malformed_index_is_one_line(case, llama_dir, tmp_path):
    path, weight_map = _sharded(llama_dir, tmp_path)
    check_hf_source(str(path), LLAMA, resuming=False)  # the two shards and their index, undamaged
    index, words = INDEX_CASES[case]
    value = index(weight_map)
    (path / "model.safetensors.index.json").write_text(value if isinstance(value, str) else json.dumps(value))
    with pytest.raises(ConfigError) as error:
        check_hf_source(str(path), LLAMA, resuming=False)
    _one_line(error, f"--init-from-hf {str(path)!r}: model.safetensors.index.json", *words)


def test_a_damaged_shard_or_one_without_its_tensors_is_one_line(llama_dir, tmp_path):
    """A damaged shard, or one without a tensor its index places there, is one line before the process
    group starts."""
    path, weight_map = _sharded(llama_dir, tmp_path)
    (path / "model-00002-of-00002.safetensors").write_bytes(b"xx")
    with pytest.raises(ConfigError) as error:
        check_hf_source(str(path), LLAMA, resuming=False)
    _one_line(error, "model-00002-of-00002.safetensors is not a safetensors file", "header too small")
    path, weight_map = _sharded(llama_dir, tmp_path / "other")
    shard = path / "model-00002-of-00002.safetensors"
    tensors = load_file(shard)
    save_file({name: t for name, t in tensors.items() if name != "model.norm.weight"}, shard)
    weight_map["model.norm.weight"] = shard.name
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ConfigError) as error:
        check_hf_source(str(path), LLAMA, resuming=False)
    _one_line(error, "places 'model.norm.weight' in model-00002-of-00002.safetensors, which does not hold it")


def test_a_missing_tensor_is_one_line_before_the_start(llama_dir, tmp_path):
    """A tensor missing from the file is one line before the process group starts, not a KeyError on
    the first rank to plan its shard."""
    path = _copy(llama_dir, tmp_path)
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError) as error:
        check_hf_source(str(path), LLAMA, resuming=False)
    _one_line(error, f"--init-from-hf {str(path)!r} has no tensor 'model.layers.1.mlp.down_proj.weight'",
              "1 of the")


@pytest.fixture(scope="module")
def tiny_gpt2_dir(tmp_path_factory):
    """GPT-2 weights of TINY's model (the builtin tokenizer's vocabulary): only the damage stops a run."""
    path = tmp_path_factory.mktemp("tiny") / "gpt2"
    tokenizer = load_tokenizer("builtin")
    config = load_recipe(TINY, []).gpt_config(len(tokenizer), tokenizer.eos_token_id)
    transformers.GPT2LMHeadModel(transformers.GPT2Config(**gpt2_config_kwargs(config))).save_pretrained(path)
    check_hf_source(str(path), config, resuming=False)
    return path


@pytest.mark.parametrize("damage,words", [
    (lambda path: _write_config(path, n_head=0), ["config.json has n_head=0, not a positive integer"]),
    (lambda path: (path / "model.safetensors").write_bytes(b""), ["model.safetensors is not a safetensors file"]),
    (lambda path: (path / "model.safetensors.index.json").write_text("[]"),
     ["model.safetensors.index.json is a list"]),
], ids=["heads-0", "empty-safetensors", "index-list"])
def test_training_from_a_malformed_directory_stops_in_one_line(damage, words, tiny_gpt2_dir, tmp_path, monkeypatch,
                                                               capsys):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    path = tmp_path / "gpt2"
    shutil.copytree(tiny_gpt2_dir, path)
    damage(path)
    _exit_2(train.main, ["--recipe", str(TINY), "--init-from-hf", str(path)], capsys,
            f"--init-from-hf {str(path)!r}", *words)


def test_evaluating_a_malformed_directory_stops_in_one_line(tiny_gpt2_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    path = tmp_path / "gpt2"
    shutil.copytree(tiny_gpt2_dir, path)
    (path / "config.json").write_bytes(b"null")
    _exit_2(evaluate.main, ["--init-from-hf", str(path), "--recipe", str(TINY)], capsys,
            f"--init-from-hf {str(path)!r}: config.json is null, not a JSON object")
