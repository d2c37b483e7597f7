"""Mixture-of-experts models in and out of transformers (model/hf/moe.py, model/hf/shards.py,
launch/checkpoints/hf_export.py, hf_weights.py, hf_safetensors.py), for MixtralForCausalLM,
Qwen3MoeForCausalLM (per-head q/k norm; a head size other than n_embd / n_head; dense blocks between
the MoE ones, decoder_sparse_step 2) and OlmoeForCausalLM (q/k norm over the whole projections,
unnormalised top-k weights), plus an `arch: llama` model with experts (exported as Mixtral):

- export: a random fp32 model of ours (norm weights included) written as the family's files (one
  tensor per expert, as save_pretrained writes them) loads with `from_pretrained` and gives our
  logits within 1e-5; one expert receives no token;
- import: a random transformers model of the family, saved, passes `check_hf_source` for the model
  its config.json translates to, and read lazily into ours gives its logits within 1e-5, from the
  per-expert files and from transformers' fused (E, ., .) tensors alike; one expert receives no token;
- the lazy per-rank read at tp 1, 2 x ep 1, 2, 4 (in process, the layers' constructors on each
  rank) and at tp 2 x ep 2 on four gloo processes through `init_from_hf` on the run's pipeline:
  every parameter equals the TP split of the EP split of the whole model, bit for bit;
- refusals in one line naming the field: shared experts (exit 2 through launch/export_hf.py),
  unnormalised weights for Mixtral, moe_every for Mixtral and OLMoE, a config.json that differs.
"""
import dataclasses
import json

import pytest
import torch

from helpers.distributed import run_distributed, uses_deepspeed
from helpers.fake_groups import fake_groups
from launch import export_hf
from launch.checkpoints import hf_export
from launch.checkpoints.hf_export import check_exportable, hf_config
from launch.checkpoints.hf_safetensors import load_hf_shards_into, write_safetensors
from launch.checkpoints.hf_weights import check_hf_source, hf_dense_state_dict, hf_model_fields, read_hf_config
from launch.errors import ConfigError
from model.config import GPTConfig
from model.gpt.model import GPT
from model.hf.convert import split, split_experts
from model.hf.moe import MoEFields, hf_model_class, moe_config_kwargs, to_moe_state_dict
from model.moe_config import MoEConfig

V, T = 97, 16
DEAD = 2  # the expert no token reaches (`_starve`)
MOE = dict(num_experts=4, experts_per_token=2, expert_ffn_hidden_size=24)
BASE = dict(n_layer=2, n_head=4, n_kv_head=2, n_embd=32, ffn_hidden_size=40, seq_len=T, vocab_size=V,
            vocab_pad_multiple=8, seed=3, moe=MOE)
CASES = {
    "mixtral": GPTConfig(arch="mixtral", **BASE),
    "qwen3_moe": GPTConfig(arch="qwen3_moe", **dict(BASE, head_size=12)),
    "qwen3_moe-sparse-step-2": GPTConfig(arch="qwen3_moe", **dict(BASE, moe=dict(MOE, moe_every=2,
                                                                                 norm_topk_prob=False))),
    "olmoe": GPTConfig(arch="olmoe", **BASE),
    "llama-with-experts": GPTConfig(arch="llama", **dict(BASE, moe=dict(MOE, router="topk_softmax"))),
}
FAMILY = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
          "qwen3_moe-sparse-step-2": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM",
          "llama-with-experts": "MixtralForCausalLM"}
TOL = 1e-5


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(seed))


def _close(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """The largest difference; asserted within TOL of the logits' scale (at least 1)."""
    diff = (ours - theirs).abs().max().item()
    assert diff <= TOL * max(1.0, theirs.abs().max().item()), diff
    assert theirs.std() > 0.5  # logits of a random model, not near zero
    return diff


def _starve(weights, blocks, names) -> None:
    """Make expert DEAD of every MoE block unreachable, in place, on our or transformers' weights
    (`names`: embedding, o_proj, router and down-projection names by block): hidden dimension 0 is
    a large positive constant on every token (the embedding's column; no attention or expert writes
    it), and DEAD's router row points against it."""
    with torch.no_grad():
        weights[names["embed"]][:V, 0] = 6.0
        for i in range(blocks):
            weights[names["o_proj"].format(i=i)][0] = 0.0
            if names["router"].format(i=i) in weights:
                weights[names["down"].format(i=i)][:, 0] = 0.0
                router = weights[names["router"].format(i=i)]
                router[DEAD] = 0.0
                router[DEAD, 0] = -5.0
            elif names["dense_down"].format(i=i) in weights:
                weights[names["dense_down"].format(i=i)][0] = 0.0


OUR_NAMES = dict(embed="embed.wte.weight", o_proj="blocks.{i}.attn.o_proj.weight",
                 router="blocks.{i}.mlp.router.weight", down="blocks.{i}.mlp.experts.down_proj",
                 dense_down="blocks.{i}.mlp.down_proj.weight")
HF_NAMES = dict(embed="model.embed_tokens.weight", o_proj="model.layers.{i}.self_attn.o_proj.weight",
                router="model.layers.{i}.mlp.gate.weight", down="model.layers.{i}.mlp.experts.down_proj",
                dense_down="model.layers.{i}.mlp.down_proj.weight")


def _random_ours(config: GPTConfig) -> GPT:
    """Our dense model with every weight random (norms around 1) and expert DEAD starved."""
    ours = GPT(config).eval()
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if "norm" in name or ".ln_" in name or name.startswith("ln_"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=generator))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=generator))
            if name in ("embed.wte.weight", "lm_head.weight"):
                p[V:] = 0.0  # the vocabulary padding rows stay zeros, as at init
    _starve(dict(ours.named_parameters()), config.n_layer, OUR_NAMES)
    return ours


def _random_hf(config: GPTConfig):
    """A transformers model of the family, every weight random, expert DEAD starved."""
    torch.manual_seed(0)
    hf = hf_model_class(config)(hf_config(config, _Ids())).eval()
    generator = torch.Generator().manual_seed(12)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            scale, centre = (0.2, 1.0) if "norm" in name else (0.2, 0.0)
            p.copy_(centre + scale * torch.randn(p.shape, generator=generator))
    _starve(dict(hf.named_parameters()), config.n_layer, HF_NAMES)
    return hf


class _Ids:
    bos_token_id, eos_token_id = 1, 2


def _expert_loads(ours: GPT, ids: torch.Tensor):
    """Tokens routed to each expert of each MoE block of ours, for these ids (router hooks)."""
    loads = {}

    def hook(index):
        def record(module, inputs, logits):
            chosen = torch.sort(logits, dim=-1, descending=True, stable=True).indices[..., :module_k]
            loads[index] = torch.bincount(chosen.reshape(-1), minlength=logits.size(-1))
        return record

    module_k = ours.config.moe.experts_per_token
    handles = [block.mlp.router.register_forward_hook(hook(i)) for i, block in enumerate(ours.blocks)
               if hasattr(block.mlp, "router")]
    with torch.no_grad():
        ours(ids)
    for handle in handles:
        handle.remove()
    return loads


def _export_dir(ours: GPT, path) -> str:
    """Our weights written as launch/checkpoints/hf_export.py writes them (files, then config)."""
    from model.hf.shards import hf_sources
    from model.hf.source import stored_tensors
    config = ours.config
    dense = {k: v.detach() for k, v in ours.named_parameters()}
    sources = hf_sources(config)
    tensors = ((name, tensor) for ours_name, source in sources.items()
               for name, tensor in stored_tensors(source, dense[ours_name][: V] if ours_name in
                                                   ("embed.wte.weight", "lm_head.weight") else dense[ours_name]))
    write_safetensors(path, tensors, 64 * 1024)  # several files and their index
    hf_config(config, _Ids()).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("case", sorted(CASES))
def test_export_gives_our_logits_in_transformers(case, tmp_path):
    from transformers import AutoModelForCausalLM
    config = CASES[case]
    check_exportable(config)
    ours = _random_ours(config)
    ids = _ids()
    loads = _expert_loads(ours, ids)
    assert loads and all(load[DEAD] == 0 and load.sum() == ids.numel() * 2 for load in loads.values()), loads
    source = _export_dir(ours, tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["architectures"] == [FAMILY[case]] and saved["output_router_logits"] is False
    hf = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    assert type(hf).__name__ == FAMILY[case]
    fused = to_moe_state_dict({k: v.detach() for k, v in ours.named_parameters()}, config, fused_experts=True)
    loaded = hf.state_dict()
    assert sorted(loaded) == sorted(fused) and [k for k, v in fused.items() if not torch.equal(loaded[k], v)] == []
    with torch.no_grad():
        theirs = hf(ids).logits
        diff = _close(ours(ids)[..., :V], theirs)
    print(f"{case}: export max |logit difference| {diff:.2e} (logits up to {theirs.abs().max():.1f})")
    # ... and the files read back into ours (lazily, at tp 1) are our weights, bit for bit.
    back = GPT(config)
    load_hf_shards_into(back, source, config, False, 0, 1)
    theirs = dict(back.named_parameters())
    assert [k for k, v in ours.named_parameters() if not torch.equal(v, theirs[k])] == []


@pytest.mark.parametrize("fused", [False, True], ids=["per-expert-files", "fused-experts"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_import_gives_transformers_logits_in_ours(case, fused, tmp_path):
    config = CASES[case]
    hf = _random_hf(config)
    hf.save_pretrained(tmp_path, save_original_format=not fused)
    names = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"] \
        if (tmp_path / "model.safetensors.index.json").exists() else None
    from safetensors import safe_open
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        names = names or list(f.keys())
    assert any(".experts.gate_up_proj" in n for n in names) == fused
    source = str(tmp_path)
    # config.json translates to this model (the recipe's fields an evaluation takes from it) ...
    fields = hf_model_fields(read_hf_config(source))
    imported = GPTConfig(**fields, seq_len=T, vocab_pad_multiple=8, seed=3)
    family_arch = "mixtral" if case == "llama-with-experts" else config.arch
    assert imported.arch == family_arch and imported.moe.num_experts == 4
    assert isinstance(fields["moe"], MoEFields) and fields["moe"] == imported.moe
    check_hf_source(source, imported, resuming=False)
    check_hf_source(source, config, resuming=False)  # the case's own model is the same function
    ours = GPT(imported).eval()
    load_hf_shards_into(ours, source, imported, False, 0, 1)
    ids = _ids(1)
    loads = _expert_loads(ours, ids)
    assert all(load[DEAD] == 0 for load in loads.values()), loads
    with torch.no_grad():
        diff = _close(ours(ids)[..., :V], hf(ids).logits)
    print(f"{case} ({'fused' if fused else 'per-expert'}): import max |logit difference| {diff:.2e}")
    dense = hf_dense_state_dict(source, imported)  # the whole model through transformers
    assert [k for k, v in ours.named_parameters() if not torch.equal(v[: V] if k in (
        "embed.wte.weight", "lm_head.weight") else v, dense[k])] == []


class _Tokenizer:
    bos_token_id, eos_token_id, pad_token_id = 1, 2, None

    def save_pretrained(self, out):
        pass


@pytest.mark.parametrize("case", ["mixtral", "qwen3_moe-sparse-step-2", "olmoe"])
def test_export_merges_the_tp_shards_of_a_checkpoints_layer_files(case, tmp_path, monkeypatch):
    """launch/export_hf.py on per-layer weight files as DeepSpeed writes them at tp 2 (one
    state_dict per pipeline layer and TP rank; the checkpoint's lookup and tokenizer stubbed):
    transformers loads the export and gives our logits."""
    import dataclasses as dc

    from model.config import ModelConfig
    from model.hf.convert import load_dense_into
    from model.gpt.layer_table import dense_prefix, pipeline_layers
    config, tp = CASES[case], 2
    ours = _random_ours(config)
    dense = {k: v.detach() for k, v in ours.named_parameters()}
    ck = tmp_path / "ck"
    ck.mkdir()
    for rank in range(tp):
        _fake_groups(tp, rank, 1, 0, monkeypatch)
        shard = GPT(config, tp_group="tp")
        load_dense_into(shard, dense, None, rank, tp, config.padded_vocab_size(tp))
        for index, (kind, block) in enumerate(pipeline_layers(config)):
            if kind != "head":
                module = shard.get_submodule(dense_prefix(kind, block))
                torch.save(module.state_dict(), ck / f"layer_{index:02d}-model_{rank:02d}-model_states.pt")
    monkeypatch.undo()
    recipe = {"model": {f.name: getattr(config, f.name) for f in dc.fields(ModelConfig)},
              "train": {"seed": config.seed}, "data": {"tokenizer": "stub"}}
    recipe["model"]["moe"] = dc.asdict(config.moe)
    monkeypatch.setattr("launch.checkpoints.locate.find_checkpoint",
                        lambda load: type("Ref", (), {"path": ck, "meta": {"recipe": recipe, "layout": {"tp": tp}}}))
    monkeypatch.setattr(hf_export, "load_export_tokenizer", lambda name, vocab, flag: _Tokenizer())
    assert export_hf.main(["--load", str(ck), "--out", str(tmp_path / "hf")]) == 0
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    assert type(hf).__name__ == FAMILY[case]
    ids = _ids(2)
    with torch.no_grad():
        _close(ours(ids)[..., :V], hf(ids).logits)


# ------------------------------------------------------------------ lazy per-rank slices

def _fake_groups(tp: int, tp_rank: int, ep: int, ep_rank: int, monkeypatch) -> None:
    """The layers' constructors on TP rank tp_rank of tp and EP rank ep_rank of ep, no process group."""
    sizes, ranks = {"tp": tp, "ep": ep, None: 1}, {"tp": tp_rank, "ep": ep_rank, None: 0}
    fake_groups(monkeypatch, size=lambda g: sizes[g], rank=lambda g: ranks[g])


def _saved_hf(config: GPTConfig, path, fused: bool) -> str:
    hf = _random_hf(config)
    hf.save_pretrained(path, max_shard_size="40KB", save_original_format=not fused)
    return str(path)


@pytest.mark.parametrize("fused", [False, True], ids=["per-expert-files", "fused-experts"])
@pytest.mark.parametrize("case", ["mixtral", "qwen3_moe-sparse-step-2", "olmoe"])
def test_each_rank_reads_the_split_of_its_experts(case, fused, tmp_path, monkeypatch):
    config = CASES[case]
    source = _saved_hf(config, tmp_path, fused)
    assert (tmp_path / "model.safetensors.index.json").exists()
    dense = hf_dense_state_dict(source, config)
    for tp, ep in ((1, 1), (2, 1), (1, 2), (2, 2), (1, 4), (2, 4)):
        padded = config.padded_vocab_size(tp)
        for tp_rank in range(tp):
            for ep_rank in range(ep):
                _fake_groups(tp, tp_rank, ep, ep_rank, monkeypatch)
                ours = GPT(config, tp_group="tp" if tp > 1 else None, ep_group="ep" if ep > 1 else None)
                with torch.no_grad():
                    for p in ours.parameters():
                        p.fill_(float("nan"))  # a place the loader forgets stays visible
                load_hf_shards_into(ours, source, config, False, tp_rank, tp, ep_rank=ep_rank, ep_size=ep)
                for name, param in ours.named_parameters():
                    want = split(name, split_experts(name, dense[name], ep_rank, ep), tp_rank, tp, padded, config)
                    assert torch.equal(param, want), (case, tp, tp_rank, ep, ep_rank, name)


@uses_deepspeed
def _pipeline_body(source: str, config: GPTConfig, tp: int, ep: int) -> None:
    from launch.checkpoints.hf_weights import init_from_hf
    from model.hf.convert import dense_name
    from model.parallel.state import init_parallel_state
    from model.gpt.pipe import build_pipeline
    state = init_parallel_state(tp, 1, 1, ep, experts=True)
    pipe = build_pipeline(config, state)
    with torch.no_grad():
        for p in pipe.parameters():
            p.fill_(float("nan"))
    init_from_hf(pipe, source, config, state)
    dense = hf_dense_state_dict(source, config)
    padded = config.padded_vocab_size(tp)
    experts = 0
    for name, param in pipe.named_parameters():
        key = dense_name(name, config)
        want = split(key, split_experts(key, dense[key], state.ep_rank, ep), state.tp_rank, tp, padded, config)
        assert torch.equal(param, want), (state.global_rank, key)
        experts += ".experts." in key
    assert experts == 2 * config.n_layer


@pytest.mark.slow  # four gloo ranks each reading the checkpoint: 3.6 CPU-s a case
@pytest.mark.parametrize("case", ["qwen3_moe", "olmoe"])
def test_init_from_hf_reads_each_ranks_experts_at_tp2_ep2(case, tmp_path):
    """Four gloo processes, the run's ParallelState and pipeline: (tp, dp) = (2, 2) with ep 2."""
    config = CASES[case]
    source = _saved_hf(config, tmp_path, fused=False)
    run_distributed(_pipeline_body, 4, source, config, 2, 2)


# ------------------------------------------------------------------ config translation and refusals

@pytest.mark.parametrize("case", sorted(CASES))
def test_config_translation_round_trips(case):
    config = CASES[case]
    hf = hf_config(config, _Ids())
    fields = hf_model_fields(hf)
    back = GPTConfig(**fields, seq_len=T, vocab_pad_multiple=8, seed=3)
    for key in ("n_layer", "n_head", "n_kv_head", "n_embd", "head_dim", "vocab_size", "rope_theta", "norm_eps",
                "qk_norm", "tie_embeddings", "bias", "expert_ffn_hidden_size"):
        assert getattr(back, key) == getattr(config, key), key
    for key in ("num_experts", "experts_per_token", "moe_every", "shared_experts"):
        assert getattr(back.moe, key) == getattr(config.moe, key), key
    kwargs = moe_config_kwargs(config)
    assert kwargs["num_experts_per_tok"] == 2 and kwargs["output_router_logits"] is False
    assert kwargs["router_aux_loss_coef"] == config.moe.aux_loss_coef
    if config.arch == "qwen3_moe":
        assert kwargs["decoder_sparse_step"] == config.moe.moe_every and kwargs["mlp_only_layers"] == []
        assert kwargs["moe_intermediate_size"] == 24 and kwargs["head_dim"] == config.head_dim
        assert kwargs["norm_topk_prob"] == config.moe.norm_topk_prob
    assert MoEFields(num_experts=4) == MoEConfig(num_experts=4) and MoEFields(num_experts=4) != MoEConfig()


def _refusal(config: GPTConfig) -> str:
    with pytest.raises(ConfigError) as error:
        check_exportable(config)
    message = str(error.value)
    assert "\n" not in message
    return message


def test_export_refuses_expert_biases():
    """balance=bias routes by probability plus a learned per-expert bias: transformers' MoE families
    route by probability alone, so the exported model would choose other experts."""
    config = dataclasses.replace(CASES["qwen3_moe"], moe=dataclasses.replace(CASES["qwen3_moe"].moe, balance="bias"))
    assert "model.moe.balance='bias' (its router has no per-expert bias)" in _refusal(config)


def test_export_refuses_shared_experts_in_one_line_with_exit_2(tmp_path, monkeypatch, capsys):
    config = dataclasses.replace(CASES["qwen3_moe"], moe=dataclasses.replace(CASES["qwen3_moe"].moe, shared_experts=1))
    assert _refusal(config).startswith("Qwen3MoeForCausalLM cannot express the checkpoint's model: "
                                       "model.moe.shared_experts=1 (it has no shared experts)")
    # Through launch/export_hf.py: the checkpoint reader stubbed with this model; exit 2, one line.
    monkeypatch.setattr(hf_export, "_checkpoint_layers", lambda load: (None, config, {}))
    assert export_hf.main(["--load", str(tmp_path / "ck"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model.moe.shared_experts=1" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("change, field", [
    (dict(arch="mixtral", moe=dict(MOE, norm_topk_prob=False)), "model.moe.norm_topk_prob=False"),
    (dict(arch="mixtral", moe=dict(MOE, moe_every=2)), "model.moe.moe_every=2"),
    (dict(arch="olmoe", moe=dict(MOE, moe_every=2)), "model.moe.moe_every=2"),
    (dict(arch="olmoe", head_size=12), "model.head_size=12"),
    (dict(arch="mixtral", qk_norm="head"), "model.qk_norm='head'"),
    (dict(arch="mixtral", bias=True), "model.bias=True"),
], ids=["mixtral-unnormalised", "mixtral-moe-every", "olmoe-moe-every", "olmoe-head-size", "mixtral-qk-norm",
        "mixtral-bias"])
def test_export_refuses_what_the_family_cannot_express(change, field):
    assert field in _refusal(GPTConfig(**dict(BASE, **change)))


def test_import_refuses_a_different_model_in_one_line(tmp_path):
    config = CASES["olmoe"]
    source = _saved_hf(config, tmp_path, fused=False)
    for change, expected in ((dict(moe=dict(MOE, num_experts=8)), "num_experts=4 where this run's model has "
                                                                   "model.moe.num_experts=8"),
                             (dict(moe=dict(MOE, norm_topk_prob=True)), "norm_topk_prob=False"),
                             (dict(moe=dict(MOE, shared_experts=1)), "shared_experts=0"),
                             (dict(arch="mixtral"), "set model.arch=olmoe"),
                             (dict(arch="llama", moe=dict(num_experts=0)), "no experts")):
        other = GPTConfig(**{**BASE, "arch": "olmoe", **change})
        with pytest.raises(ConfigError) as error:
            check_hf_source(source, other, resuming=False)
        assert expected in str(error.value) and "\n" not in str(error.value), str(error.value)


def test_an_evaluation_takes_the_model_from_config_json(tmp_path):
    """launch/evaluate.py --init-from-hf builds its recipe's model from config.json's fields
    (model.moe as a mapping): the recipe's model is the source's; a --set that contradicts it is refused."""
    import argparse

    from launch.evaluation.evaluation import evaluation_recipe
    config = CASES["qwen3_moe"]
    source = _saved_hf(config, tmp_path, fused=False)
    args = argparse.Namespace(load=None, init_from_hf=source, recipe=None, overrides=[], cp=None)
    model = evaluation_recipe(args).model.resolved()
    assert (model.arch, model.head_dim, model.moe.num_experts, model.expert_ffn_hidden_size) == ("qwen3_moe", 12, 4, 24)
    args.overrides = ["model.moe.experts_per_token=1"]
    with pytest.raises(ConfigError, match="drop --set model.moe"):
        evaluation_recipe(args)


def test_a_dense_llama_export_refuses_a_qk_norm():
    config = GPTConfig(**{**BASE, "arch": "llama", "qk_norm": "head", "moe": None})
    assert "model.qk_norm='head'" in _refusal(config)


@pytest.mark.slow
def test_trained_ep2_checkpoint_exports_and_comes_back(tmp_path):
    """moe-tiny without its shared expert (Qwen3-MoE has none) trained at (tp, pp, dp, ep) = (1,1,2,2),
    exported by launch/export_hf.py from a checkpoint whose experts two EP ranks saved: transformers'
    Qwen3MoeForCausalLM gives our loss within 1e-5; a run started from that export at (2,1,2,2) with
    a learning rate far below one ulp exports back the same bits (ours -> transformers -> ours)."""
    from safetensors.torch import load_file
    from torch.nn import functional
    from transformers import AutoModelForCausalLM

    from helpers.launcher import MOE_TINY, REPO, launch_forked, read_metrics
    no_shared = ["--set", "model.moe.shared_experts=0", "--set", "train.eval_every=0"]
    proc = launch_forked(2, ["--recipe", str(MOE_TINY), "--ep", "2", "--steps", "2", "--save", str(tmp_path / "ck")]
                         + no_shared)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert export_hf.main(["--load", str(tmp_path / "ck"), "--out", str(tmp_path / "hf")]) == 0
    assert '"model_type": "qwen3_moe"' in (tmp_path / "hf" / "config.json").read_text()

    _, config, dense = hf_export.read_checkpoint_weights(tmp_path / "ck")
    ours = hf_export.dense_gpt(config, {**dense})
    ids = torch.randint(0, config.vocab_size, (4, config.seq_len + 1), generator=torch.Generator().manual_seed(1))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        losses = [functional.cross_entropy(logits.reshape(-1, config.vocab_size), ids[:, 1:].reshape(-1)).item()
                  for logits in (ours(ids[:, :-1])[..., :config.vocab_size], hf(ids[:, :-1]).logits)]
    assert abs(losses[1] - losses[0]) <= 1e-5 * losses[0], losses

    metrics = tmp_path / "m.jsonl"
    proc = launch_forked(4, ["--recipe", str(MOE_TINY), "--tp", "2", "--ep", "2", "--steps", "1", "--init-from-hf",
                             str(tmp_path / "hf"), "--set", "train.lr=1e-30", "--save", str(tmp_path / "ck2"),
                             "--metrics-out", str(metrics)] + no_shared)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len(read_metrics(metrics)) == 1
    assert export_hf.main(["--load", str(tmp_path / "ck2"), "--out", str(tmp_path / "hf2")]) == 0
    before, after = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "hf2" / "model.safetensors")
    assert before.keys() == after.keys() and [k for k in before if not torch.equal(before[k], after[k])] == []
