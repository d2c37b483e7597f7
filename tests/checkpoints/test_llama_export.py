"""Llama checkpoints in and out of transformers (model/hf/llama.py, launch/checkpoints/hf_export.py,
launch/checkpoints/hf_weights.py):
- the split/merge rule table agrees with the shards the layers build at tp=2 and tp=4, also for
  key/value heads shared by two ranks (n_kv_head=2 at tp=4) and multi-query;
- transformers Llama weights -> our shards at tp=2 and tp=4 -> merged -> transformers: bitwise;
- a saved LlamaForCausalLM directory passes `check_hf_source` for the matching recipe, and each
  mismatch is one line naming the key and the fix;
- slow, through the launcher: llama-tiny trained at tp=4 (two ranks per key/value head), exported
  by launch/export_hf.py, loaded by AutoModelForCausalLM with our logits within 1e-5, generating
  text; a run started from that export at tp=2 pp=2 computes its loss at step 1 and exports back
  to the same bits (ours -> transformers -> ours)."""
import dataclasses
import json

import pytest
import torch
from torch.nn import functional

from helpers.fake_groups import fake_groups
from launch import export_hf
from launch.checkpoints import hf_export
from launch.checkpoints.hf_weights import check_hf_source, hf_dense_state_dict
from launch.errors import ConfigError
from helpers.launcher import LLAMA_TINY, launch_forked, read_metrics
from model.config import GPTConfig
from model.gpt.model import GPT
from model.hf.convert import load_dense_into, merge, rule_for, split
from model.hf.llama import from_llama_state_dict, llama_config_kwargs, to_llama_state_dict

LLAMA3_SCALING = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=4)
CONFIG = GPTConfig(arch="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=32, ffn_hidden_size=48, seq_len=8,
                   vocab_size=97, vocab_pad_multiple=8, seed=3)
REL = 1e-5


def _tp_model(config: GPTConfig, tp: int, rank: int, monkeypatch) -> GPT:
    """The model the layers build on TP rank `rank` of `tp` (constructors only: no process group)."""
    fake_groups(monkeypatch, size=lambda g: 1 if g is None else tp, rank=lambda g: 0 if g is None else rank)
    return GPT(config, tp_group="fake-tp-group")


@pytest.mark.parametrize("tp,n_kv_head", [(2, 2), (4, 2), (4, 1)])
def test_split_and_merge_follow_the_llama_layers(tp, n_kv_head, monkeypatch):
    config = dataclasses.replace(CONFIG, n_kv_head=n_kv_head)
    dense = {k: v.detach() for k, v in GPT(config).named_parameters()}
    for name in ("embed.wte.weight", "lm_head.weight"):
        dense[name] = dense[name][: config.vocab_size]
    shards = [dict(_tp_model(config, tp, rank, monkeypatch).named_parameters()) for rank in range(tp)]
    for name, full in dense.items():
        param, rule = shards[0][name], rule_for(name)
        assert rule.dim == (param.partition_dim if getattr(param, "tensor_model_parallel", False) else None), name
        assert rule.blocks(name, config) == getattr(param, "partition_sections", None), name
        for rank in range(tp):
            assert torch.equal(split(name, full, rank, tp, config.padded_vocab_size(tp), config),
                               shards[rank][name]), name
        assert torch.equal(merge(name, [s[name].detach() for s in shards], config.vocab_size, config), full), name


def _random_llama(config: GPTConfig):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**llama_config_kwargs(config)))
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_()  # every value distinct, the RMSNorm weights included
    return hf


def test_llama_weights_round_trip_bitwise_through_every_tp_split():
    hf = _random_llama(CONFIG)
    w = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    dense = from_llama_state_dict(w, CONFIG)
    for tp in (2, 4):
        padded = CONFIG.padded_vocab_size(tp)
        merged = {name: merge(name, [split(name, full, r, tp, padded, CONFIG) for r in range(tp)], CONFIG.vocab_size,
                              CONFIG)
                  for name, full in dense.items()}
        ours = GPT(CONFIG)
        load_dense_into(ours, merged, None, 0, 1, CONFIG.padded_vocab_size(1))
        back = to_llama_state_dict(dict(ours.named_parameters()), CONFIG)
        assert back.keys() == w.keys()
        assert [k for k in w if not torch.equal(back[k], w[k])] == []


@pytest.mark.parametrize("tp,n_kv_head", [(2, 2), (4, 2), (4, 1)])
def test_each_rank_holds_its_heads_of_the_transformers_tensors(tp, n_kv_head, monkeypatch):
    """Rank r's fused shards, loaded from transformers' weights at tp, are their tensors cut by head: its
    a/tp query heads, then the rows of the key/value heads they use (all of them when tp divides
    n_kv_head, else its 1/(tp/n_kv_head) share of the one they share), for k then v; and its
    gate rows then the up rows of the same MLP columns."""
    config = dataclasses.replace(CONFIG, n_kv_head=n_kv_head)
    hf = {k: v.detach() for k, v in _random_llama(config).state_dict().items()}
    d, a, f = config.head_dim, config.n_head, config.ffn_hidden_size
    for rank in range(tp):
        ours = _tp_model(config, tp, rank, monkeypatch)
        with torch.no_grad():
            load_dense_into(ours, from_llama_state_dict(hf, config), None, rank, tp, config.padded_vocab_size(tp))
        params = dict(ours.named_parameters())
        layer = "model.layers.1."
        heads = range(rank * a // tp, (rank + 1) * a // tp)
        if n_kv_head % tp == 0:
            kv_rows = [row for j in range(rank * n_kv_head // tp, (rank + 1) * n_kv_head // tp)
                       for row in range(j * d, (j + 1) * d)]
        else:  # tp / n_kv_head ranks share head `rank // share`, each its part of the head's rows
            share = tp // n_kv_head
            head, part = rank // share, rank % share
            kv_rows = list(range(head * d + part * d // share, head * d + (part + 1) * d // share))
        q_rows = [row for i in heads for row in range(i * d, (i + 1) * d)]
        want_qkv = torch.cat([hf[layer + "self_attn.q_proj.weight"][q_rows], hf[layer + "self_attn.k_proj.weight"][kv_rows],
                              hf[layer + "self_attn.v_proj.weight"][kv_rows]])
        columns = slice(rank * f // tp, (rank + 1) * f // tp)
        want_gate_up = torch.cat([hf[layer + "mlp.gate_proj.weight"][columns], hf[layer + "mlp.up_proj.weight"][columns]])
        for name, want in (("blocks.1.attn.qkv_proj.weight", want_qkv), ("blocks.1.mlp.gate_up_proj.weight", want_gate_up)):
            assert torch.equal(params[name], want), name


def test_saved_llama_directory_is_checked_and_read(tmp_path):
    hf = _random_llama(CONFIG)
    hf.save_pretrained(tmp_path)
    check_hf_source(str(tmp_path), CONFIG, resuming=False)
    check_hf_source(str(tmp_path), dataclasses.replace(CONFIG, seq_len=16), resuming=False)  # a longer context
    check_hf_source(str(tmp_path), dataclasses.replace(CONFIG, seq_len=4, max_positions=8), resuming=False)
    dense = hf_dense_state_dict(str(tmp_path), CONFIG)
    assert all(torch.equal(dense[k], v) for k, v in from_llama_state_dict(hf.state_dict(), CONFIG).items())
    for changes, words in [(dict(n_kv_head=4), "has n_kv_head=2 where this run's model has model.n_kv_head=4; "
                                               "set model.n_kv_head=2"),
                           (dict(ffn_hidden_size=64), "ffn_hidden_size=48 where"),
                           (dict(tie_embeddings=True), "tie_embeddings=False where"),
                           (dict(rope_theta=5e5), "rope_theta=10000.0 where"),
                           (dict(rope_scaling=LLAMA3_SCALING), "rope_scaling=None where"),
                           (dict(norm="layernorm"), "set model.norm=rmsnorm"),
                           (dict(arch="gpt2", n_kv_head=4, mlp="gelu"), "set model.arch='llama'"),
                           (dict(seq_len=4), "max_position_embeddings=8 where this run's model is built for 4 "
                                             "positions; set model.max_positions=8")]:
        with pytest.raises(ConfigError) as error:
            check_hf_source(str(tmp_path), dataclasses.replace(CONFIG, **changes), resuming=False)
        assert words in str(error.value) and "\n" not in str(error.value), str(error.value)


def test_llama3_rope_scaling_is_written_and_read_back(tmp_path):
    """A model with Llama 3's RoPE scaling exports it as transformers' rope_type llama3, and a
    directory with it imports into a recipe with the same model.rope_scaling (not another)."""
    scaled = dataclasses.replace(CONFIG, rope_theta=5e5, rope_scaling=LLAMA3_SCALING)
    _random_llama(scaled).save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())["rope_parameters"]
    assert written == {"rope_type": "llama3", "rope_theta": 5e5, **LLAMA3_SCALING}, written
    check_hf_source(str(tmp_path), scaled, resuming=False)
    with pytest.raises(ConfigError, match="has rope_scaling=.*'factor': 8.0.* where this run's model has "
                                          "model.rope_scaling=None"):
        check_hf_source(str(tmp_path), dataclasses.replace(scaled, rope_scaling=None), resuming=False)


def test_export_refuses_what_llama_cannot_express():
    with pytest.raises(ConfigError, match="model.mlp='gelu'.*cannot express"):
        hf_export.check_exportable(dataclasses.replace(CONFIG, mlp="gelu"))
    with pytest.raises(ConfigError, match="model.position='rope'.*GPT2LMHeadModel"):
        hf_export.check_exportable(GPTConfig(n_layer=1, n_head=4, n_embd=32, vocab_size=97, position="rope"))
    hf_export.check_exportable(CONFIG)


# ------------------------------------------------------------------ through the launcher

def _logits_of_transformers(path, ids) -> torch.Tensor:
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        return hf(ids[:, :-1]).logits


@pytest.mark.slow
def test_llama_tiny_exports_imports_and_exports_back(tmp_path, capsys):
    from safetensors.torch import load_file
    from transformers import pipeline
    proc = launch_forked(4, ["--recipe", str(LLAMA_TINY), "--tp", "4", "--steps", "2", "--save", str(tmp_path / "ck")])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # launch/export_hf.py's main in this process: a fresh interpreter would only import torch again
    # (the script is `sys.exit(main())`; export is one process, no engine).
    assert export_hf.main(["--load", str(tmp_path / "ck"), "--out", str(tmp_path / "hf")]) == 0
    assert "exported" in capsys.readouterr().out
    assert '"model_type": "llama"' in (tmp_path / "hf" / "config.json").read_text()

    _, config, dense = hf_export.read_checkpoint_weights(tmp_path / "ck")
    ours = hf_export.dense_gpt(config, {**dense})
    ids = torch.randint(0, config.vocab_size, (4, config.seq_len + 1), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = ours(ids[:, :-1])[..., :config.vocab_size]
    # Logits, not the loss: two steps from the initialisation leave attention nearly uniform, and an
    # export with q_proj's rows reversed moved the loss by 9e-6 of itself but the logits by 9e-3.
    torch.testing.assert_close(_logits_of_transformers(tmp_path / "hf", ids), logits, rtol=REL, atol=1e-5)
    generated = pipeline("text-generation", model=str(tmp_path / "hf"))("def", max_new_tokens=5, do_sample=False)
    assert generated[0]["generated_text"].startswith("def")

    # ours -> transformers -> ours: a run from the export at another layout, lr far below one ulp.
    metrics = tmp_path / "m.jsonl"
    proc = launch_forked(4, ["--recipe", str(LLAMA_TINY), "--tp", "2", "--pp", "2", "--steps", "1", "--init-from-hf",
                      str(tmp_path / "hf"), "--set", "train.lr=1e-30", "--set", "train.eval_every=0",
                      "--save", str(tmp_path / "ck2"), "--metrics-out", str(metrics)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len(read_metrics(metrics)) == 1
    assert export_hf.main(["--load", str(tmp_path / "ck2"), "--out", str(tmp_path / "hf2")]) == 0
    before, after = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "hf2" / "model.safetensors")
    assert before.keys() == after.keys() and [k for k in before if not torch.equal(before[k], after[k])] == []


def test_gpt2_weights_need_the_gpt2_switches(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    from model.hf.gpt2 import gpt2_config_kwargs
    config = GPTConfig(n_layer=1, n_head=4, n_embd=32, seq_len=8, vocab_size=97)
    GPT2LMHeadModel(GPT2Config(**gpt2_config_kwargs(config))).save_pretrained(tmp_path)
    check_hf_source(str(tmp_path), config, resuming=False)
    for changes, words in [(dict(position="rope"), "model.position='rope'"), (dict(arch="llama"), "model.arch='llama'")]:
        with pytest.raises(ConfigError, match=words) as error:
            check_hf_source(str(tmp_path), dataclasses.replace(config, **changes), resuming=False)
        assert "\n" not in str(error.value)


# ------------------------------------------------------------------ the tokenizer's convention

TEXTS = ["The quick brown fox jumps over the lazy dog. " * 3, "Pack my box with five dozen liquor jugs.", ""]


def _trained_tokenizer(bos: bool):
    """A Llama-3-like tokenizer built here (no download): BOS prepended by its post-processor
    when `bos`, EOS separate; without it, GPT-2's convention (nothing added)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    bpe.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|begin|>", "<|end|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if bos:
        bpe.post_processor = processors.TemplateProcessing(single="<|begin|> $A", special_tokens=[("<|begin|>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|begin|>", eos_token="<|end|>")


@pytest.mark.parametrize("bos", [True, False], ids=["bos", "no-bos"])
def test_training_tokenizes_as_transformers_and_the_export_computes_our_loss(bos, tmp_path):
    """Training's document ids are `tokenizer(text)` with its defaults (then EOS), map-style and
    streamed; the exported config carries the tokenizer's real BOS/EOS ids and the model's
    position range; transformers' loss on the text tokenized with its defaults equals ours on
    the ids training packs."""
    import datasets
    import numpy as np

    from data.streaming import packed_windows
    from data.tokens import tokenize_batch, write_token_stream
    from launch.checkpoints.hf_export import hf_config
    from transformers import LlamaForCausalLM
    tokenizer = _trained_tokenizer(bos)
    theirs = tokenizer(TEXTS[0])["input_ids"]
    assert (theirs[0] == tokenizer.bos_token_id) == bos
    assert tokenize_batch(TEXTS, tokenizer) == [tokenizer(t)["input_ids"] + [tokenizer.eos_token_id] for t in TEXTS[:2]]
    n = write_token_stream(datasets.Dataset.from_dict({"text": TEXTS}), tokenizer, "text", 1, tmp_path / "s.npy")
    stream = np.load(tmp_path / "s.npy")
    streamed = [w for _, w in packed_windows(iter([((0, 0, i, 0), t) for i, t in enumerate(TEXTS)]
                                                  + [((0, 1, 0, 0), None)]), tokenizer, len(theirs))]
    assert n == len(stream) and stream[:len(theirs)].tolist() == theirs == streamed[0].tolist()

    config = dataclasses.replace(CONFIG, vocab_size=len(tokenizer), seq_len=len(theirs) - 1, max_positions=64)
    ours = GPT(config).eval()
    hf = LlamaForCausalLM(hf_config(config, tokenizer)).eval()
    hf.load_state_dict(to_llama_state_dict(dict(ours.named_parameters()), config), strict=True)
    assert (hf.config.bos_token_id, hf.config.eos_token_id) == (tokenizer.bos_token_id, tokenizer.eos_token_id)
    assert hf.config.max_position_embeddings == 64
    ids = torch.tensor(stream[None, :len(theirs)], dtype=torch.long)  # what training packs
    with torch.no_grad():
        logits = ours(ids[:, :-1])[..., :config.vocab_size]
        their_loss = hf(**tokenizer(TEXTS[0], return_tensors="pt"), labels=torch.tensor([theirs])).loss.item()
    our_loss = functional.cross_entropy(logits.reshape(-1, config.vocab_size), ids[:, 1:].reshape(-1)).item()
    assert abs(their_loss - our_loss) <= REL * our_loss, (their_loss, our_loss)


def test_the_data_cache_key_follows_the_tokenizers_convention():
    """A tokenizer that adds BOS tokenizes into other streams: it must not reuse a cache built
    without (its serialisation, post-processor included, is in the key)."""
    from data.spec import DataSpec
    from data.windows import cache_key
    spec = DataSpec(name="builtin")
    assert cache_key(spec, _trained_tokenizer(True)) != cache_key(spec, _trained_tokenizer(False))
