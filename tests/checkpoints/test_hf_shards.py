"""`--init-from-hf` reads each rank's shards lazily from safetensors (model/hf/shards.py,
launch/checkpoints/hf_safetensors.py): on every TP rank at tp 1, 2 and 4, for GPT-2 (tied head,
Conv1D weights, fused QKV), Llama with a tied and an untied head (grouped-query heads shared by
two ranks at tp 4), from one file and from a sharded directory with its index, every parameter
equals the split of the whole model that transformers loads, bit for
bit, vocabulary padding included. A source without safetensors, or with an index naming a file
outside the model directory, is refused in one line."""
import dataclasses
import json
import shutil

import pytest
import torch
import transformers  # the model classes load on first use (transformers' lazy module), not at collection

from helpers.fake_groups import fake_groups
from launch.checkpoints.hf_safetensors import load_hf_shards_into
from launch.checkpoints.hf_weights import check_hf_source, hf_dense_state_dict
from launch.errors import ConfigError
from model.config import GPTConfig
from model.gpt.model import GPT
from model.hf.convert import split
from model.hf.gpt2 import gpt2_config_kwargs
from model.hf.llama import llama_config_kwargs

GPT2 = GPTConfig(n_layer=2, n_head=4, n_embd=32, seq_len=8, vocab_size=97, vocab_pad_multiple=8, seed=3)
LLAMA = GPTConfig(arch="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=32, ffn_hidden_size=48, seq_len=8,
                  vocab_size=97, vocab_pad_multiple=8, seed=3)
CASES = {"gpt2": GPT2, "llama-untied": LLAMA, "llama-tied": dataclasses.replace(LLAMA, tie_embeddings=True)}


def _tp_model(config: GPTConfig, tp: int, rank: int, monkeypatch) -> GPT:
    """The model the layers build on TP rank `rank` of `tp` (constructors only: no process group)."""
    fake_groups(monkeypatch, size=lambda g: 1 if g is None else tp, rank=lambda g: 0 if g is None else rank)
    return GPT(config, tp_group="fake-tp-group" if tp > 1 else None)


def _saved(config: GPTConfig, path, max_shard_size):
    torch.manual_seed(0)
    if config.arch == "llama":
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**llama_config_kwargs(config)))
    else:
        hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(**gpt2_config_kwargs(config)))
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_()  # every value distinct, norms and biases included
    hf.save_pretrained(path, max_shard_size=max_shard_size)
    return str(path)


@pytest.mark.parametrize("sharded", [False, True], ids=["one-file", "sharded"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_lazy_shards_equal_the_split_of_the_whole_model(case, sharded, tmp_path, monkeypatch):
    config = CASES[case]
    source = _saved(config, tmp_path, "20KB" if sharded else "1GB")
    assert (tmp_path / "model.safetensors.index.json").exists() == sharded
    check_hf_source(source, config, resuming=False)
    dense = hf_dense_state_dict(source, config)  # the whole model, through transformers
    for tp in (1, 2, 4):
        padded = config.padded_vocab_size(tp)
        for rank in range(tp):
            ours = _tp_model(config, tp, rank, monkeypatch)
            with torch.no_grad():
                for p in ours.parameters():
                    p.fill_(float("nan"))  # a row the loader forgets stays visible
            load_hf_shards_into(ours, source, config, False, rank, tp)
            for name, param in ours.named_parameters():
                assert torch.equal(param, split(name, dense[name], rank, tp, padded, config)), (case, tp, rank, name)


def test_a_source_without_safetensors_is_refused_in_one_line(tmp_path):
    config = CASES["llama-untied"]
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**llama_config_kwargs(config)))
    hf.config.save_pretrained(tmp_path)
    torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(ConfigError) as error:
        check_hf_source(str(tmp_path), config, resuming=False)
    assert "no model.safetensors" in str(error.value) and "save_pretrained" in str(error.value)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("entry", ["../elsewhere/{shard}", "{elsewhere}/{shard}", "shards/../../elsewhere/{shard}"],
                         ids=["parent", "absolute", "through-a-subdirectory"])
def test_an_index_naming_a_file_outside_the_model_directory_is_refused(entry, tmp_path, monkeypatch):
    """A weight_map entry that leads out of the model directory is refused in one line naming it,
    though the file it names is a valid shard, which is never read. A shard in a
    subdirectory of the model directory is read as before."""
    config = CASES["gpt2"]
    model, elsewhere = tmp_path / "model", tmp_path / "elsewhere"
    source = _saved(config, model, "20KB")
    index = model / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"]
    shard = sorted(weight_map.values())[0]
    elsewhere.mkdir()
    shutil.copy(model / shard, elsewhere / shard)
    (model / "shards").mkdir()
    whole = _tp_model(config, 1, 0, monkeypatch)
    load_hf_shards_into(whole, source, config, False, 0, 1)

    def point(name):
        index.write_text(json.dumps({"weight_map": {t: name if f == shard else f for t, f in weight_map.items()}}))
    name = entry.format(elsewhere=elsewhere, shard=shard)
    point(name)
    with pytest.raises(ConfigError) as error:
        check_hf_source(source, config, resuming=False)
    assert f"names {name!r} for " in str(error.value) and "not a file inside the model directory" in str(error.value)
    assert "\n" not in str(error.value)
    (model / shard).rename(model / "shards" / shard)
    point(f"shards/{shard}")
    ours = _tp_model(config, 1, 0, monkeypatch)
    load_hf_shards_into(ours, source, config, False, 0, 1)
    assert all(torch.equal(p, q) for p, q in zip(ours.parameters(), whole.parameters()))


def test_the_export_writes_shards_and_an_index_transformers_loads(tmp_path):
    """launch/checkpoints/hf_safetensors.py's writer, as the export calls it with a small shard
    limit: several files, none above the limit, an index; transformers loads every tensor, and
    so does the lazy reader, through the index."""
    from launch.checkpoints.hf_export import hf_config
    from launch.checkpoints.hf_safetensors import write_safetensors
    from model.hf.llama import to_llama_state_dict

    config = CASES["llama-untied"]
    dense = {k: v.detach() for k, v in GPT(config).named_parameters()}
    weights = to_llama_state_dict(dense, config)
    tokenizer = type("Ids", (), {"bos_token_id": 1, "eos_token_id": 2})()
    limit = 8 * 1024
    write_safetensors(tmp_path, iter(weights.items()), limit)
    hf_config(config, tokenizer).save_pretrained(tmp_path)
    files = sorted(tmp_path.glob("model-*.safetensors"))
    assert len(files) > 2 and (tmp_path / "model.safetensors.index.json").is_file()
    largest = max(t.numel() * t.element_size() for t in weights.values())
    assert all(f.stat().st_size <= max(limit, largest) + 4096 for f in files)  # + the header
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path).state_dict()
    assert [k for k, v in weights.items() if not torch.equal(loaded[k], v)] == []
    ours = GPT(config)
    load_hf_shards_into(ours, str(tmp_path), config, False, 0, 1)
    assert [k for k, v in ours.named_parameters() if not torch.equal(v, dense[k])] == []
