"""The planner's mixture of experts against independent counts: the published parameter
counts of Mixtral-8x7B, Qwen3-30B-A3B and OLMoE-1B-7B from their recipes, total and active counts
against per-family hand formulas and against the parameters of built models, the FLOPs against a
hand count of the active weights, an MoE block's activations against what autograd saves, the
expert states falling as 1/ep, the expert-parallel all-to-alls against a simulation of the
dispatch protocol over real routings and against what MoEMLP hands torch.distributed on gloo
processes, --search over ep and the recipes' comments (bad --ep: tests/analysis/test_plan.py)."""
import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import yaml

from helpers.distributed import run_distributed
from launch.analysis import experts, formulas, memory_formulas
from launch.analysis.comm_formulas import comm_per_rank_per_step
from launch.config.layout import Layout
from launch.config.recipe import load_recipe
from launch.plan import main
from model.config import GPTConfig
from model.gpt.model import GPT
from model.transformer.moe import is_expert_param, route

REPO = Path(__file__).resolve().parents[2]
# name: (recipe, published total, published active in billions, to 0.1B as published)
PUBLISHED = {"mixtral-8x7b": ("recipes/mixtral-8x7b.yaml", 46_702_792_704, 12.9),
             "qwen3-30b-a3b": ("recipes/qwen3-30b-a3b.yaml", 30_532_122_624, 3.3),
             "olmoe-1b-7b": ("recipes/olmoe-1b-7b.yaml", 6_919_161_856, 1.3)}


def _json(out: str):
    return json.loads(out.strip().splitlines()[-1])


def _hand_counts(shape: dict) -> tuple:
    """(total, active) of a Llama-layout MoE model with every block MoE, untied head, no biases, written
    out per family: embedding and head V*h each, final norm h; per block q, o (h x a*d), k, v
    (h x kv*d), two RMSNorms (h), the q/k norm (per head: d each; over the projection: a*d and kv*d),
    the router E*h and E experts of gate, up, down (3*h*f each), k of them active."""
    V, h, L, a, kv, d = (shape[key] for key in ("V", "h", "L", "a", "kv", "d"))
    E, k, f = shape["E"], shape["k"], shape["f"]
    qk = {None: 0, "head": 2 * d, "projection": (a + kv) * d}[shape["qk"]]
    shared = 2 * h * a * d + 2 * h * kv * d + 2 * h + qk + E * h
    edges = 2 * V * h + h
    return edges + L * (shared + E * 3 * h * f), edges + L * (shared + k * 3 * h * f)


HAND = {"mixtral-8x7b": dict(V=32000, h=4096, L=32, a=32, kv=8, d=128, E=8, k=2, f=14336, qk=None),
        "qwen3-30b-a3b": dict(V=151936, h=2048, L=48, a=32, kv=4, d=128, E=128, k=8, f=768, qk="head"),
        "olmoe-1b-7b": dict(V=50304, h=2048, L=16, a=16, kv=16, d=128, E=64, k=8, f=1024, qk="projection")}


@pytest.mark.parametrize("name", PUBLISHED)
def test_the_recipes_give_the_published_counts(name, capsys):
    """launch/plan.py --recipe R --json: params_total is the published count to the parameter, and
    params_active the per-family hand count, within the published active size's last digit."""
    recipe, total, active_billions = PUBLISHED[name]
    assert main(["--recipe", recipe, "--gpus", "64", "--json"]) == 0
    plan = _json(capsys.readouterr().out)
    hand_total, hand_active = _hand_counts(HAND[name])
    assert plan["params_total"] == total == hand_total
    assert plan["params_active"] == hand_active
    assert abs(plan["params_active"] / 1e9 - active_billions) < 0.06  # published to 0.1B (Qwen's 3.35B: "3.3B")
    print(f"{name}: total {plan['params_total']:,}, active {plan['params_active']:,}")


SMALL = dict(n_layer=4, n_head=4, n_embd=32, seq_len=16, vocab_size=50, dropout=0.0)
VARIANTS = {
    "mixtral": dict(arch="mixtral", n_kv_head=2, moe=dict(num_experts=4, experts_per_token=2,
                                                          expert_ffn_hidden_size=24)),
    "qwen3-shared-every-2nd": dict(arch="qwen3_moe", n_kv_head=2, head_size=16, ffn_hidden_size=40,
                                   moe=dict(num_experts=8, experts_per_token=3, expert_ffn_hidden_size=12,
                                            shared_experts=2, moe_every=2)),
    "olmoe": dict(arch="olmoe", moe=dict(num_experts=8, experts_per_token=2, expert_ffn_hidden_size=16)),
}


@pytest.mark.parametrize("name", VARIANTS)
def test_parameters_are_the_built_models(name):
    """A GPT built at tp = ep = 1 (every expert on the rank): its parameters are params_total, and
    removing all but k of every block's E routed experts (is_expert_param) leaves params_active;
    dense blocks (moe_every 2), shared experts and head_size included."""
    config = GPTConfig(**SMALL, **VARIANTS[name])
    model = GPT(config)
    total = sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for p in model.parameters() if is_expert_param(p))
    E, k = config.moe.num_experts, config.moe.experts_per_token
    assert formulas.model_params(config) == total
    assert formulas.model_params_active(config) == total - routed * (E - k) // E
    one_stage = [0, len(formulas.layer_kinds(config))]
    assert formulas.model_stage_params_per_rank(config, 1, 1, 0, one_stage) == total  # vocab 50: no padding at tp 1
    assert experts.stage_expert_params_per_rank(config, 1, 1, one_stage, 0) == routed


@pytest.mark.parametrize("name", VARIANTS)
def test_flops_count_the_active_weights(name):
    """Forward and backward, per token: 6 FLOPs per active matrix weight (each MoE block's router, k
    experts and shared experts; a dense block's MLP) and per head weight, plus 12 s a d per block
    for the attention core, as a hand count over the block list."""
    config = GPTConfig(**SMALL, **VARIANTS[name])
    h, d, a, kv, V, s, B = config.n_embd, config.head_dim, config.n_head, config.n_kv_head, 50, 16, 8
    moe = config.moe
    weights = 0
    for i in range(config.n_layer):
        weights += 2 * h * a * d + 2 * h * kv * d
        if (i + 1) % moe.moe_every == 0:
            f = moe.expert_ffn_hidden_size
            weights += moe.num_experts * h + moe.experts_per_token * 3 * h * f + moe.shared_experts * 3 * h * f
        else:
            weights += 3 * h * config.ffn_hidden_size
    hand = 6 * B * s * (weights + V * h) + 12 * B * s * s * config.n_layer * a * d
    assert formulas.model_flops_per_step_of(config, B, s) == pytest.approx(hand, rel=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("moe", [dict(num_experts=4, experts_per_token=2, expert_ffn_hidden_size=48,
                                      aux_loss_coef=0.01, z_loss_coef=0.001),
                                 dict(num_experts=4, experts_per_token=2, expert_ffn_hidden_size=48, shared_experts=1),
                                 dict(num_experts=8, experts_per_token=3, expert_ffn_hidden_size=16,
                                      norm_topk_prob=False),
                                 dict(num_experts=8, experts_per_token=3, expert_ffn_hidden_size=16,
                                      router="topk_softmax")],
                         ids=["renormalised-z", "shared", "unnormalised", "topk-softmax"])
def test_moe_block_activations_are_what_autograd_saves(moe, dtype):
    """One MoE block at tp = ep = 1 (fused attention: dropout 0): the planner's count of its saved
    tensors (the routed rows, the experts' SwiGLU, indices, the router's fp32 tensors, the shared
    experts) equals the bytes autograd saves, to the byte."""
    from bench.memory.activation_memory import saved_activation_bytes
    from model.transformer.block import Block
    config = GPTConfig(arch="mixtral", n_layer=2, n_head=4, n_embd=32, seq_len=16, vocab_size=50, dropout=0.0,
                       moe=dict(dict(aux_loss_coef=0.01), **moe))
    torch.manual_seed(0)
    block = Block(config, 0, None).train().to(dtype)
    x = torch.randn(2, config.seq_len, config.n_embd, requires_grad=True, dtype=dtype)
    element = torch.finfo(dtype).bits // 8
    planned = memory_formulas.model_activation_bytes_per_layer(config, config.seq_len, 2, element_bytes=element,
                                                               mask_bytes=0, layernorm_stat_bytes=4,
                                                               fused_attention=True, layer_index=0)
    assert planned == saved_activation_bytes(lambda: block(x), block.parameters())


def _plan(capsys, *argv):
    assert main([*argv, "--json"]) == 0
    return _json(capsys.readouterr().out)


def test_expert_states_fall_as_one_over_ep(capsys):
    """Mixtral at 64 GPUs, pp 4 (dp 16): each rank holds E/ep experts per MoE block, 3 h f_e each.
    fp32 ZeRO-0: weights, gradients and Adam's moments (16 bytes) of those, so 1/ep. bf16 ZeRO-1:
    bf16 weights and the fp32 gradient buffer (6 bytes) fall as 1/ep, the optimizer's 12 bytes are
    split over the dp/ep ranks holding the same experts, so stay 12 P_E / dp; the rest of the
    states does not depend on ep."""
    h, f, E, dp = 4096, 14336, 8, 16
    base = ["--recipe", "recipes/mixtral-8x7b.yaml", "--gpus", "64", "--pp", "4"]
    dense_states = set()
    for ep in (1, 2, 4, 8):
        fp32 = _plan(capsys, *base, "--ep", str(ep), "--precision", "fp32", "--zero", "0")
        bf16 = _plan(capsys, *base, "--ep", str(ep))
        assert fp32["ep"] == bf16["ep"] == ep
        for stage, (a, b) in enumerate(zip(fp32["memory_per_stage_bytes"], bf16["memory_per_stage_bytes"])):
            routed = fp32["moe_blocks_per_stage"][stage] * (E // ep) * 3 * h * f  # this rank's expert weights
            assert a["expert_states"] == 16 * routed
            assert (b["expert_weights"], b["expert_gradients"]) == (2 * routed, 4 * routed)
            assert b["expert_optimizer"] == 12 * routed // (dp // ep) == 12 * routed * ep // dp
            dense_states.add((stage, b["weights"] - b["expert_weights"], b["optimizer"] - b["expert_optimizer"]))
        assert bf16["params_per_device"] == max(bf16["params_per_stage"])
    assert len(dense_states) == 4  # one value per stage, whatever ep


def _simulated_volumes(config: GPTConfig, ep: int, tokens: int, seed: int) -> list:
    """Per EP rank, what it hands each all-to-all of one MoE block's forward and backward, by the
    dispatch protocol: its E counts; its N*k rows sorted by expert out; back (forward) the rows it
    received, one per (token, slot) that chose one of its experts; backward the gradients the
    other way: its own N*k output rows' gradients out, the received rows' gradients back. Each
    rank's assignments from the real router on random logits."""
    E, k, h = config.moe.num_experts, config.moe.experts_per_token, config.n_embd
    generator = torch.Generator().manual_seed(seed)
    chosen = [route(torch.randn(tokens, E, generator=generator), k, "softmax_topk", True)[1] for _ in range(ep)]
    owner = torch.arange(E) // (E // ep)  # EP rank r holds experts [r E/ep, (r+1) E/ep)
    received = [sum(int((owner[c] == r).sum()) for c in chosen) for r in range(ep)]
    return [{("forward", "ep-counts"): E, ("forward", "ep-dispatch"): chosen[r].numel() * h,
             ("forward", "ep-combine"): received[r] * h, ("backward", "ep-combine"): chosen[r].numel() * h,
             ("backward", "ep-dispatch"): received[r] * h} for r in range(ep)]


@pytest.mark.parametrize("ep,cp,micro_batch", [(2, 1, 2), (4, 1, 1), (8, 2, 2)])
def test_all_to_all_volume_follows_the_dispatch_protocol(ep, cp, micro_batch):
    """experts.ep_comm_by_pass per MoE block per micro-batch against the simulated protocol: the counts,
    the forward dispatch and the backward combine per rank exactly; the forward combine and the
    backward dispatch (the rows a rank received) summed over the EP group exactly, ep times the
    formula's per-rank count. Full recompute repeats the forward's three; ep 1 has none."""
    config = GPTConfig(arch="mixtral", n_layer=2, n_head=4, n_embd=32, seq_len=16, vocab_size=50,
                       moe=dict(num_experts=8, experts_per_token=2, expert_ffn_hidden_size=16))
    tokens = micro_batch * config.seq_len // cp
    simulated = _simulated_volumes(config, ep, tokens, seed=ep)
    formula = experts.ep_comm_by_pass(config, ep, cp, micro_batch, 1, 1, element_bytes=2)
    assert set(formula) == set(simulated[0])
    for key, (calls, elements, nbytes) in formula.items():
        assert calls == 1 and nbytes == elements * (8 if key[1] == "ep-counts" else 2)
        if key in (("forward", "ep-combine"), ("backward", "ep-dispatch")):
            assert sum(rank[key] for rank in simulated) == ep * elements, key
        else:
            assert all(rank[key] == elements for rank in simulated), key
    m, blocks = 3, 2
    step = experts.ep_comm_per_rank_per_step(config, ep, cp, micro_batch, m, blocks, 2)
    assert step[("ep-dispatch", "ep", "all_to_all_single")] == (2 * m * blocks, 2 * m * blocks * tokens * 2 * 32,
                                                                2 * m * blocks * tokens * 2 * 32 * 2)
    recomputed = experts.ep_comm_by_pass(config, ep, cp, micro_batch, m, blocks, 2, "full")
    assert recomputed[("forward", "ep-counts")][0] == 2 * m * blocks
    assert recomputed[("backward", "ep-dispatch")][0] == m * blocks
    assert experts.ep_comm_by_pass(config, 1, cp, micro_batch, m, blocks, 2) == {}
    # In the step's communication: comm_formulas and the plan's bytes.
    layout = Layout(world_size=8 * cp, tp=1, pp=1, dp=8, cp=cp, ep=ep, micro_batch_size=micro_batch,
                    global_batch_size=8 * micro_batch * m, grad_accum_steps=m, parts=(0, 4))
    volumes = comm_per_rank_per_step(config, layout, 0, element_bytes=2, cp=cp)
    assert {key: v for key, v in volumes.items() if key[0].startswith("ep-")} == \
        experts.ep_comm_per_rank_per_step(config, ep, cp, micro_batch, m, 2, 2)


def _measured_all_to_alls(tp: int, ep: int, sp: bool, queue_path: str):
    """On each rank: one MoEMLP's forward and backward at (tp, ep), recording what it hands
    dist.all_to_all_single, in order, per pass; written to queue_path.rank{R}.json."""
    import contextlib
    from model.transformer.block import init_generator
    from model.transformer.moe import MoEMLP
    from model.parallel.state import init_parallel_state
    state = init_parallel_state(tp, 1, 1, ep, experts=True)
    config = dataclasses.replace(ALL_TO_ALL_CONFIG, sequence_parallel=sp)
    moe = MoEMLP(config, 0, state.tp_group, init_generator(config, 0), contextlib.nullcontext, ep_group=state.ep_group)
    calls, phase = [], ["forward"]
    original = dist.all_to_all_single

    def recorded(output, input, *args, **kwargs):
        calls.append((phase[0], input.numel(), input.element_size()))
        return original(output, input, *args, **kwargs)
    dist.all_to_all_single = recorded
    try:
        x = torch.randn(2, config.seq_len // (tp if sp else 1), config.n_embd,
                        generator=torch.Generator().manual_seed(state.dp_rank)).requires_grad_()
        y = moe(x)
        phase[0] = "backward"
        y.sum().backward()
    finally:
        dist.all_to_all_single = original
    Path(f"{queue_path}.rank{state.global_rank}.json").write_text(json.dumps(
        {"rank": state.global_rank, "ep_rank": state.ep_rank, "tp_rank": state.tp_rank, "calls": calls}))


ALL_TO_ALL_CONFIG = GPTConfig(arch="qwen3_moe", n_layer=2, n_head=4, n_kv_head=2, n_embd=16, seq_len=8, vocab_size=50,
                              moe=dict(num_experts=8, experts_per_token=2, expert_ffn_hidden_size=12, shared_experts=1))


# tp 2 x ep 2 with SP in the fast tier; ep 4 (four processes, 9 CPU-s) in the full suite.
@pytest.mark.parametrize("tp,ep,sp", [pytest.param(1, 4, False, marks=pytest.mark.slow), (2, 2, True)],
                         ids=["tp1-ep4", "tp2-ep2-sp"])
def test_moe_mlp_hands_the_all_to_alls_the_formula_counts(tp, ep, sp, tmp_path):
    """MoEMLP (model/transformer/moe.py) on 4 gloo processes: in forward one int64 count exchange then two row
    exchanges, in backward two, of the sizes ep_comm_by_pass gives (b x seq tokens of the replica
    on every TP rank, SP included): the counts, the forward dispatch and the backward combine on
    every rank; the forward combine and the backward dispatch summed over each EP group."""
    run_distributed(_measured_all_to_alls, 4, tp, ep, sp, str(tmp_path / "calls"))
    ranks = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("calls.rank*.json"))]
    formula = {key: elements for key, (_, elements, _) in
               experts.ep_comm_by_pass(ALL_TO_ALL_CONFIG, ep, 1, 2, 1, 1, element_bytes=4).items()}
    order = [("forward", "ep-counts"), ("forward", "ep-dispatch"), ("forward", "ep-combine"),
             ("backward", "ep-combine"), ("backward", "ep-dispatch")]  # backward runs the exchanges in reverse
    groups = {}
    for rank in ranks:
        assert [phase for phase, _, _ in rank["calls"]] == [key[0] for key in order]
        measured = {key: numel for key, (_, numel, _) in zip(order, rank["calls"])}
        assert rank["calls"][0][2] == 8 and all(size == 4 for _, _, size in rank["calls"][1:])
        for key in order:
            if key in (("forward", "ep-combine"), ("backward", "ep-dispatch")):
                groups.setdefault((rank["tp_rank"], rank["rank"] // (tp * ep), key), []).append(measured[key])
            else:
                assert measured[key] == formula[key], (rank["rank"], key)
    assert groups and all(sum(sizes) == ep * formula[key[2]] for key, sizes in groups.items())


def test_search_tries_every_ep_that_divides_the_data_axis_and_the_experts(capsys):
    """moe-tiny (8 experts) on 8 GPUs: for each (tp, cp, pp, dp, micro-batch) the search tries every
    ep among the divisors of dp x cp that divide 8, and none other."""
    out = _plan(capsys, "--recipe", "recipes/moe-tiny.yaml", "--vocab", "500", "--gpus", "8", "--global-batch", "8",
                "--gpu-memory", "1000", "--search", "--top", "100000")
    tried = {}
    for plan in out["search"]:
        tried.setdefault((plan["tp"], plan["cp"], plan["pp"], plan["micro_batch"]), set()).add(plan["ep"])
    assert len(tried) > 5
    for (tp, cp, pp, _), eps in tried.items():
        data_axis = 8 // (tp * pp)
        assert eps == {e for e in range(1, data_axis + 1) if data_axis % e == 0 and 8 % e == 0}


@pytest.mark.parametrize("name", PUBLISHED)
def test_the_recipes_comments_state_the_planners_numbers(name, capsys):
    """Each MoE recipe's header: its parameter counts are the plan's, and its plan command prints
    the memory per GPU the header states, at the layout the recipe sets (train.ep)."""
    recipe = PUBLISHED[name][0]
    text = (REPO / recipe).read_text()
    assert yaml.safe_load(text)["train"]["ep"] == load_recipe(REPO / recipe, []).train.ep > 1
    command = re.search(r"python launch/plan.py (.*)", text).group(1).split()
    counts = re.search(r"# ([\d,]+) parameters, ([\d,]+) active", text).groups()
    total, active = (int(n.replace(",", "")) for n in counts)
    memory = re.search(r"#\s+([\d.]+) GiB per GPU of 80 \(routed-expert states ([\d.]+) GiB", text)
    assert main(command) == 0
    out = capsys.readouterr().out
    assert re.search(rf"total \(zero 1, recompute \w+\)\s+{memory.group(1)} GiB of 80 GiB", out), out
    assert re.search(rf"of which routed-expert states\s+{memory.group(2)} GiB", out)
    plan = _plan(capsys, *command)
    assert (plan["params_total"], plan["params_active"]) == (total, active)
