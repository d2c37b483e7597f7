"""model/config.py and model/moe_config.py: every number of the model section in its range, and
model.rope_scaling's keys and values, each refused in one line naming the field, the value the
user gave and the range, before anything is computed from it (through the recipe loader, through
ModelConfig for what a checkpoint or a caller hands over, and through launch/train.py)."""
import pytest

from helpers.launcher import LLAMA_TINY, MOE_TINY, TINY
from launch.config.recipe import load_recipe
from launch.errors import ConfigError
from launch.train import main
from model.config import ModelConfig

SCALING = "factor: 32.0, low_freq_factor: 1.0, high_freq_factor: 4.0, original_max_position_embeddings: 8192"
BIG = 10 ** 18  # under the loader's 64-bit bound, so the model's own range decides


def _scaling(**changed) -> str:
    values = dict(item.split(": ") for item in SCALING.split(", "))
    return "model.rope_scaling={" + ", ".join(f"{k}: {v}" for k, v in dict(values, **changed).items()) + "}"


CASES = [
    # (recipe, --set, words the message must contain)
    (TINY, "model.n_layer=4097", ["model.n_layer=4097", ">= 1 and <= 4096"]),
    (TINY, f"model.n_layer={BIG}", [f"model.n_layer={BIG}", "<= 4096"]),
    (TINY, "model.n_layer=0", ["model.n_layer=0", "must be >= 1"]),
    (TINY, f"model.n_head={BIG}", [f"model.n_head={BIG}", "<= 4096"]),
    (LLAMA_TINY, "model.n_kv_head=8192", ["model.n_kv_head=8192", "<= 4096"]),
    (TINY, f"model.n_embd={2 ** 21}", [f"model.n_embd={2 ** 21}", f"<= {2 ** 20}"]),
    (LLAMA_TINY, "model.head_size=0", ["model.head_size=0", ">= 1"]),
    (LLAMA_TINY, f"model.ffn_hidden_size={BIG}", [f"model.ffn_hidden_size={BIG}", f"<= {2 ** 20}"]),
    (TINY, f"model.seq_len={2 ** 24 + 1}", [f"model.seq_len={2 ** 24 + 1}", f"<= {2 ** 24}"]),
    (LLAMA_TINY, f"model.max_positions={BIG}", [f"model.max_positions={BIG}", f"<= {2 ** 24}"]),
    (TINY, f"model.vocab_size={BIG}", [f"model.vocab_size={BIG}", f"<= {2 ** 24}"]),
    (TINY, f"model.vocab_pad_multiple={BIG}", [f"model.vocab_pad_multiple={BIG}", f"<= {2 ** 24}"]),
    (TINY, "model.init_std=-1", ["model.init_std=-1.0", "> 0 and <= 1"]),
    (TINY, "model.init_std=0", ["model.init_std=0.0", "> 0"]),
    (TINY, "model.init_std=2", ["model.init_std=2.0", "<= 1"]),
    (TINY, "model.norm_eps=2", ["model.norm_eps=2.0", "> 0 and < 1"]),
    (TINY, "model.norm_eps=0", ["model.norm_eps=0.0", "> 0 and < 1"]),
    (LLAMA_TINY, "model.rope_theta=0", ["model.rope_theta=0.0", "> 0"]),
    (MOE_TINY, "model.moe.num_experts=-1", ["model.moe.num_experts=-1", ">= 0 and <= 4096"]),
    (MOE_TINY, "model.moe.num_experts=5000", ["model.moe.num_experts=5000", "<= 4096"]),
    (MOE_TINY, f"model.moe.experts_per_token={BIG}", [f"model.moe.experts_per_token={BIG}", "<= 4096"]),
    (MOE_TINY, "model.moe.shared_experts=-1", ["model.moe.shared_experts=-1", ">= 0"]),
    (MOE_TINY, "model.moe.moe_every=5", ["model.moe.moe_every=5", "<= model.n_layer=4"]),
    (MOE_TINY, f"model.moe.expert_ffn_hidden_size={BIG}", [f"model.moe.expert_ffn_hidden_size={BIG}",
                                                           f"<= {2 ** 20}"]),
    (MOE_TINY, "model.moe.aux_loss_coef=-0.01", ["model.moe.aux_loss_coef=-0.01", ">= 0"]),
    (MOE_TINY, "model.moe.z_loss_coef=-1", ["model.moe.z_loss_coef=-1.0", ">= 0"]),
    (MOE_TINY, "model.moe.bias_update_rate=-1", ["model.moe.bias_update_rate=-1.0", ">= 0"]),
    (TINY, "model.moe.aux_loss_coef=-1", ["model.moe.aux_loss_coef=-1.0", ">= 0"]),  # a dense model's too
    (LLAMA_TINY, "model.rope_scaling={1: 2, a: 3}", ["model.rope_scaling has keys 1, a", "factor, low_freq_factor"]),
    (LLAMA_TINY, _scaling(factor=".nan"), ["model.rope_scaling.factor=nan", "finite number >= 1"]),
    (LLAMA_TINY, _scaling(factor="1.0e+400"), ["model.rope_scaling.factor=inf", "finite number >= 1"]),
    (LLAMA_TINY, _scaling(factor="1" + "0" * 400), ["model.rope_scaling.factor=an integer of about 401 digits"]),
    (LLAMA_TINY, _scaling(factor="0.5"), ["model.rope_scaling.factor=0.5", ">= 1"]),
    (LLAMA_TINY, _scaling(high_freq_factor="-.inf"), ["model.rope_scaling.high_freq_factor=-inf", "> 0"]),
    (LLAMA_TINY, _scaling(low_freq_factor="true"), ["model.rope_scaling.low_freq_factor=True", "> 0"]),
    (LLAMA_TINY, _scaling(original_max_position_embeddings="1" + "0" * 400),
     ["model.rope_scaling.original_max_position_embeddings=an integer of about 401 digits", f"<= {2 ** 24}"]),
    (LLAMA_TINY, _scaling(original_max_position_embeddings="8192.5"),
     ["model.rope_scaling.original_max_position_embeddings=8192.5", "whole number"]),
]


@pytest.mark.parametrize("recipe,override,words", CASES, ids=[c[1][:60] for c in CASES])
def test_recipe_value_out_of_range_is_one_line(recipe, override, words):
    with pytest.raises(ConfigError) as error:
        load_recipe(recipe, [override]).validate()
    message = str(error.value)
    assert "\n" not in message, message
    for word in words:
        assert word in message, (word, message)


def test_the_bounds_leave_every_shipped_recipe_and_the_largest_values_valid():
    """The real models (recipes/) pass, and so do the bounds themselves and Llama 3.2's scaling."""
    for path in sorted(TINY.parent.glob("*.yaml")):
        load_recipe(path, []).validate()
    load_recipe(LLAMA_TINY, ["model.n_layer=4096", f"model.max_positions={2 ** 24}", "model.n_head=4096",
                             "model.n_embd=4096", "model.head_size=2", "model.n_kv_head=4096", "model.init_std=1",
                             _scaling()]).validate()
    load_recipe(MOE_TINY, ["model.moe.num_experts=4096", "model.moe.experts_per_token=4096", "model.moe.moe_every=4",
                           "model.moe.aux_loss_coef=0"]).validate()


@pytest.mark.parametrize("changes,words", [
    (dict(n_layer=10 ** 30), ["model.n_layer=1000000000000000000000000000000", "<= 4096"]),
    (dict(n_layer=10 ** 400), ["model.n_layer=an integer of about 401 digits", "<= 4096"]),
    # llama's preset computes its MLP width as a float from n_embd: OverflowError without the bound first
    (dict(arch="llama", n_embd=10 ** 400, n_head=1), ["model.n_embd=an integer of about 401 digits"]),
    (dict(init_std=float("nan")), ["model.init_std=nan", "> 0"]),  # a checkpoint's JSON can hold NaN
    (dict(norm_eps=float("nan")), ["model.norm_eps=nan"]),
    (dict(dropout=float("nan")), ["model.dropout=nan"]),
    (dict(arch="qwen3_moe", moe=dict(num_experts=10 ** 30)), ["model.moe.num_experts=10000000000000000000000000"]),
    (dict(arch="qwen3_moe", moe=dict(num_experts=8, z_loss_coef=float("nan"))), ["model.moe.z_loss_coef=nan"]),
    (dict(arch="llama", rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": float("nan")}),
     ["original_max_position_embeddings=nan", "whole number"]),
])
def test_model_config_from_a_caller_is_one_line(changes, words):
    """What launch/checkpoints/locate.py and the HF import hand over comes through ModelConfig, not the loader."""
    with pytest.raises(ValueError) as error:
        ModelConfig(**dict(dict(n_layer=4, n_head=4, n_embd=64, seq_len=32), **changes)).validate()
    message = str(error.value)
    assert type(error.value) is ValueError and "\n" not in message, message
    for word in words:
        assert word in message, (word, message)


@pytest.mark.parametrize("recipe,override,words", [
    (TINY, "model.init_std=-1", ["model.init_std=-1.0", "> 0"]),  # was accepted, then failed in the engine
    (MOE_TINY, "model.moe.num_experts=-1", ["model.moe.num_experts=-1", ">= 0"]),  # was reported as 0
    (LLAMA_TINY, "model.rope_scaling={1: 2, a: 3}", ["model.rope_scaling has keys 1, a"]),  # was a TypeError
], ids=["init_std", "num_experts", "rope_scaling_keys"])
def test_through_train_main_one_line_and_exit_2(recipe, override, words, monkeypatch, capsys, tmp_path):
    """Not model.n_layer=10**18 here: without its bound, main would build a list of that many layers."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert main(["--recipe", str(recipe), "--set", override, "--metrics-out", str(tmp_path / "m.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    for word in words:
        assert word in err, (word, err)
    assert not (tmp_path / "m.jsonl").exists()

