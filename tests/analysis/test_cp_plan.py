"""The planner's context parallelism against independent counts: the activation bytes
at cp against what autograd saves for a block run on a seq/cp shard (plus what Ulysses' exchange
changes, computed here from its shapes), the all-to-all elements against the head-by-head shapes
of the exchange's interface, the CP and DP groups against DeepSpeed's topology coordinates, the
plan's memory falling as 1/cp, its warnings and bad input, and the long-context recipe's comment."""
import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
import yaml

from launch.analysis import memory_formulas
from launch.analysis.comm_formulas import comm_per_rank_per_step, cp_all_to_all_elements, cp_comm_per_rank_per_step
from launch.analysis.plan_setup import Setup, check_setup, rank_groups
from launch.config.layout import Layout
from launch.config.recipe import load_recipe
from launch.errors import ConfigError
from launch.plan import main
from model.config import GPTConfig

REPO = Path(__file__).resolve().parents[2]
S, B = 32, 2
CONFIGS = {"gpt2": GPTConfig(arch="gpt2", n_layer=1, n_head=4, n_embd=32, seq_len=S, vocab_size=50, dropout=0.0),
           "llama-gqa": GPTConfig(arch="llama", n_layer=1, n_head=4, n_kv_head=2, n_embd=32, ffn_hidden_size=64,
                                  seq_len=S, vocab_size=50, dropout=0.0)}


def _saved_block_bytes(config: GPTConfig) -> int:
    from bench.memory.activation_memory import saved_activation_bytes
    from model.transformer.block import Block
    block = Block(config, 0, None).train()
    x = torch.randn(B, config.seq_len, config.n_embd, requires_grad=True)
    return saved_activation_bytes(lambda: block(x), block.parameters())


def _kv_heads_needed(config: GPTConfig, tp: int, cp: int, tp_rank: int, cp_rank: int) -> int:
    """Key/value heads the query heads of one (tp, cp) rank use after the exchange: its TP rank's
    n_head/tp heads, of which the cp_rank-th chunk; query head i uses key/value head i // group."""
    per_rank, group = config.n_head // (tp * cp), config.n_head // config.n_kv_head
    first = tp_rank * config.n_head // tp + cp_rank * per_rank
    return len({i // group for i in range(first, first + per_rank)})


@pytest.mark.parametrize("selective", [False, True], ids=["none", "selective"])
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("name", CONFIGS)
def test_activation_bytes_at_cp_are_a_shards_plus_the_exchange(name, cp, selective):
    """Outside attention a CP rank is a block on s/cp tokens: measured. Inside, the exchange makes
    the core attend over all s tokens for n_head/cp heads: the queries and the logsumexp are the
    shard's (a/cp heads x s = a heads x s/cp), RoPE's tables cover all s positions and the keys
    and values are the heads the rank's queries use, over s tokens (two ranks share one key/value
    head at cp 4 here, replicated), and the fused core keeps its output apart from the o_proj
    input (the return all-to-all's new tensor): the differences from the shard, from their shapes.
    test_real_context_parallel_blocks_save_what_the_planner_counts measures real CP blocks."""
    config = dataclasses.replace(CONFIGS[name], recompute_attention=selective)
    measured_shard = _saved_block_bytes(dataclasses.replace(config, seq_len=S // cp))
    E, d = 4, config.head_dim
    rope = 2 * E * d * (S - S // cp) if config.position == "rope" else 0
    needed = _kv_heads_needed(config, 1, cp, 0, 0)
    kv_replication = 2 * E * B * S * d * (needed - config.n_kv_head / cp)
    formula = memory_formulas.model_activation_bytes_per_layer(
        config, S, B, selective=selective, element_bytes=E, mask_bytes=0, layernorm_stat_bytes=4,
        fused_attention=True, cp=cp)
    output = 0 if selective else E * B * S * (config.n_head // cp) * d  # (b, a/cp, s, d), saved by the core
    assert formula == measured_shard + rope + kv_replication + output
    assert (kv_replication > 0) == (name == "llama-gqa" and cp == 4)  # the replicated case is covered


@pytest.mark.parametrize("a,kv,tp,cp", [(8, 8, 1, 2), (8, 8, 2, 2), (8, 2, 1, 2), (8, 2, 2, 2), (8, 2, 1, 4),
                                        (16, 4, 2, 4), (8, 1, 2, 2)])
def test_all_to_all_elements_are_the_exchanges_shapes(a, kv, tp, cp):
    """Sequence to heads takes (b, heads, s/cp, d) and returns (b, heads/cp, s, d): the queries
    hand their TP rank's a/tp heads; the keys (and values) hand, for each of the cp ranks of the
    group, the key/value heads that rank's queries use. The output goes back with the queries'
    shape; backward repeats each exchange once on its gradient; full recompute the forward too."""
    config = GPTConfig(arch="llama", n_head=a, n_kv_head=kv, n_embd=a * 8, seq_len=64, vocab_size=50)
    b, s, d = 3, config.seq_len, config.head_dim
    queries, keys, values = cp_all_to_all_elements(config, tp, cp, b)
    for tp_rank in range(tp):
        assert queries == b * (a // tp) * (s // cp) * d
        assert keys == values == sum(b * _kv_heads_needed(config, tp, cp, tp_rank, c) * (s // cp) * d
                                     for c in range(cp))
    if kv == a:  # Ulysses' count (Jacobs et al. 2023): 4 all-to-alls of b*s*h/(tp*cp) per block per micro-batch
        assert queries + keys + values + queries == 4 * b * s * config.n_embd // (tp * cp)
    m, blocks = 5, 3
    volumes = cp_comm_per_rank_per_step(config, tp, cp, b, m, blocks, element_bytes=2)
    per_block = 2 * queries + keys + values
    assert volumes == {("cp-forward", "cp", "all_to_all_single"): (4 * m * blocks, m * blocks * per_block,
                                                                   2 * m * blocks * per_block),
                       ("cp-backward", "cp", "all_to_all_single"): (4 * m * blocks, m * blocks * per_block,
                                                                    2 * m * blocks * per_block)}
    full = cp_comm_per_rank_per_step(config, tp, cp, b, m, blocks, element_bytes=2, recompute="full")
    assert full[("cp-forward", "cp", "all_to_all_single")][0] == 8 * m * blocks
    assert cp_comm_per_rank_per_step(config, tp, 1, b, m, blocks, element_bytes=2) == {}


def test_exact_comm_counts_take_the_local_tokens_and_the_data_axis():
    """At cp 2 every sequence collective moves half of cp 1's (the rank's s/2 tokens) and ZeRO-1's
    gather splits over DeepSpeed's data axis, dp x cp ranks: the same as cp 1 with twice the dp."""
    config = GPTConfig(n_layer=4, n_head=4, n_embd=32, seq_len=16, vocab_size=64)
    layout = Layout(world_size=16, tp=2, pp=2, dp=2, micro_batch_size=1, global_batch_size=8, grad_accum_steps=4)
    one = comm_per_rank_per_step(config, layout, 0)
    two = comm_per_rank_per_step(config, layout, 0, cp=2)
    wider = comm_per_rank_per_step(config, dataclasses.replace(layout, dp=4), 0)
    for key in [("tp-forward", "tp", "all_reduce"), ("tp-backward", "tp", "all_reduce")]:
        assert two[key][0] == one[key][0] and two[key][1] * 2 == one[key][1]
    assert two[("dp-params", "dp", "all_gather_into_tensor")] == wider[("dp-params", "dp", "all_gather_into_tensor")]
    assert two[("cp-forward", "cp", "all_to_all_single")][0] == 4 * 2 * layout.grad_accum_steps


@pytest.mark.parametrize("tp,cp,pp,dp", [(2, 2, 2, 2), (1, 4, 1, 2), (2, 4, 1, 1)])
def test_groups_follow_the_topology_coordinates(tp, cp, pp, dp):
    """DeepSpeed's data axis holds dp x cp ranks, CP fastest: data index = dp_rank * cp + cp_rank.
    A CP group is the ranks of one (stage, TP rank, replica); a DP group those of one (stage, TP
    rank, CP rank); TP ranks stay adjacent, so a CP group's ranks are tp apart."""
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
    topology = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp * cp)
    cp_of, dp_of = {}, {}
    for rank in range(tp * cp * pp * dp):
        c = topology.get_coord(rank)
        cp_of.setdefault((c.pipe, c.model, c.data // cp), []).append(rank)
        dp_of.setdefault((c.pipe, c.model, c.data % cp), []).append(rank)
    groups = rank_groups(tp, pp, dp, cp)
    assert sorted(groups["cp"]) == sorted(cp_of.values()) and sorted(groups["dp"]) == sorted(dp_of.values())
    assert groups["tp"][0] == list(range(tp)) and groups["cp"][0] == list(range(0, tp * cp, tp))
    assert all(len(g) == dp * cp for g in groups["data"])


def _json(out: str):
    """The JSON line of main()'s output (DeepSpeed's first import may log to stdout before it)."""
    return json.loads(out.strip().splitlines()[-1])


def _plan(*argv):
    assert main(["--recipe", "recipes/llama3.2-1b-32k.yaml", "--json", *argv]) == 0


def test_activation_memory_falls_as_one_over_cp(capsys):
    """Llama-3.2-1B at 32768 tokens on 8 GPUs: each rank's activations are cp 1's over cp, but for
    RoPE's tables (the whole sequence's positions on every rank) and the core's output (a second
    copy beside the o_proj input); the optimizer state is split
    over dp x cp = 8 whatever cp; the all-to-all bytes appear with cp."""
    plans = {}
    for cp in (1, 2, 4, 8):
        _plan("--gpus", "8", "--cp", str(cp))
        plans[cp] = _json(capsys.readouterr().out)
    model = load_recipe(REPO / "recipes/llama3.2-1b-32k.yaml", []).model.resolved()
    rope = model.n_layer * 2 * model.seq_len * model.head_dim * 2  # bf16 tables, one stage of every block
    act = {cp: p["memory_per_stage_bytes"][0]["activations_no_recompute"] for cp, p in plans.items()}
    for cp in (2, 4, 8):
        # and the fused core's output, kept apart from the o_proj input once the exchange returns it
        output = model.n_layer * 2 * (model.seq_len // cp) * model.n_head * model.head_dim  # bf16, b = 1
        assert act[cp] - rope - output == pytest.approx((act[1] - rope) / cp, rel=1e-9, abs=1)
        assert plans[cp]["memory_per_stage_bytes"][0]["optimizer"] == plans[1]["memory_per_stage_bytes"][0]["optimizer"]
        assert plans[cp]["comm_bytes_per_step"]["cp"] > 0 and (plans[cp]["cp"], plans[cp]["dp"]) == (cp, 8 // cp)
    assert plans[1]["comm_bytes_per_step"]["cp"] == 0


def test_warns_when_tp_times_cp_exceeds_the_key_value_heads(capsys):
    _plan("--gpus", "16", "--tp", "2", "--cp", "8")
    notes = _json(capsys.readouterr().out)["warnings"]
    assert any("tp*cp = 2*8 = 16 exceeds the 8 key/value heads" in w and "replicated over 2 ranks" in w
               for w in notes)
    assert any("CP groups of 8" in w and "span nodes" in w for w in notes)
    _plan("--gpus", "8", "--tp", "2", "--cp", "4")
    assert not _json(capsys.readouterr().out)["warnings"]


def test_sequence_parallel_needs_the_sequence_divisible_by_cp_times_tp():
    """The planner applies the training run's own layout rules (launch/config/layout.py)."""
    model = GPTConfig(n_head=8, n_embd=64, seq_len=18, vocab_size=50, sequence_parallel=True)
    setup = Setup(gpus=4, tp=2, pp=1, cp=2, micro_batch=1, global_batch=1)
    with pytest.raises(ConfigError, match=r"18 .* is not divisible by cp\*tp = 2\*2 = 4"):
        check_setup(model, setup)
    check_setup(dataclasses.replace(model, seq_len=20), setup)


def test_text_report_shows_the_fourth_axis(capsys):
    assert main(["--recipe", "recipes/llama3.2-1b-32k.yaml", "--gpus", "8", "--cp", "4"]) == 0
    out = capsys.readouterr().out
    for text in ["tp 1 x cp 4 x pp 1 x dp 2", "CP       4", "all-to-all", "[0, 1, 2, 3], [4, 5, 6, 7]",
                 "dp = 8 / (tp 1 * cp 4 * pp 1) = 2", "split over dp 2 x cp 4"]:
        assert text in out, text


def test_long_context_recipe_states_the_planners_memory(capsys):
    """recipes/llama3.2-1b-32k.yaml: llama3.2-1b's architecture and published RoPE scaling at 32768
    tokens with the document mask; its comment's plan command prints the memory the comment states."""
    text = (REPO / "recipes/llama3.2-1b-32k.yaml").read_text()
    long, base = yaml.safe_load(text), yaml.safe_load((REPO / "recipes/llama3.2-1b.yaml").read_text())
    assert long["model"] == dict(base["model"], seq_len=32768) and long["data"]["document_mask"] is True
    command = re.search(r"python launch/plan.py (.*)", text).group(1).split()
    stated = re.search(r"#\s+([\d.]+) GiB of 80 \(activations ([\d.]+) GiB", text)
    assert main(command) == 0
    out = capsys.readouterr().out
    assert f"{float(stated.group(1)):7.1f} GiB of 80 GiB" in out
    assert re.search(rf"activations \(recompute selective\)\s+{stated.group(2)} GiB", out)


def _measure_cp_rank(seq_len: int, batch: int, out: Path) -> None:
    """On each of cp gloo processes: the bench's measurement of this rank's blocks, as JSON."""
    import torch.distributed as dist
    from bench.memory.context_memory import measure_this_rank
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(measure_this_rank(seq_len, batch)))


@pytest.mark.slow
def test_real_context_parallel_blocks_save_what_the_planner_counts(tmp_path):
    """bench/memory/context_memory.py: GPT-2 (with and without selective recompute) and a GQA Llama block
    on cp = 4 gloo processes, each rank's real Ulysses block on its s/cp tokens, save exactly the
    bytes the planner's formula counts, on every rank (cp = 2 is the bench's too; one size of 4
    ranks tells s/cp from any other share, at half the test's time). The ranks are forked from
    the rank server (helpers.distributed), not spawned as the bench's are: four fresh interpreters
    importing torch cost more than the measurement."""
    from bench.memory.context_memory import configs
    from helpers.distributed import run_distributed
    seq_len, batch, cp = 64, 2, 4
    run_distributed(_measure_cp_rank, cp, seq_len, batch, tmp_path)
    per_rank = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(cp)]
    measured = {name: [r[name] for r in per_rank] for name in per_rank[0]}
    assert sorted(measured) == sorted(n for n, _, _ in configs(seq_len))
    for name, per_rank in measured.items():
        config, selective = next((c, sel) for n, c, sel in configs(seq_len) if n == name)
        planned = memory_formulas.model_activation_bytes_per_layer(
            config, seq_len, batch, selective=selective, element_bytes=4, mask_bytes=0,
            layernorm_stat_bytes=4, fused_attention=True, cp=cp)
        assert per_rank == [planned] * cp, (name, cp, per_rank, planned)
