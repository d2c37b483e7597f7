"""Every collective of a training step moves exactly what launch/analysis/comm_formulas.py predicts.

Four launches for 2 steps with `--comm-counts` (launch/instruments/comm_counter.py). GPT-2
(recipes/tiny.yaml): (tp, pp, dp) = (2, 2, 1) covers the TP all-reduces, the cross-entropy
reductions, DeepSpeed's TP-partitioned pipeline sends with their re-assembling all-gathers and the
tied embedding; the same with sequence parallelism its all-gathers and reduce-scatters, whole
chunks between stages and the once-per-step sum of the replicated parameters' gradients;
(1, 2, 2) covers the plain pipeline sends and ZeRO-1's gradient all-reduce and parameter all-gather. Llama (recipes/llama-tiny.yaml with one key/value head) at (2, 2, 2): the
key/value row gathers and their reduce-scattered gradients at tp > n_kv_head, no tied-gradient
all-reduce with the untied head, RoPE (no wpe) and ZeRO-1's groups with RMSNorm and no biases.
Calls, elements and bytes must agree exactly on every rank and step.
"""
import json

import pytest

from bench.step.comm_volume import OVERRIDES, STEPS, compare, run_model
from launch.analysis import formulas, partition
from launch.analysis.comm_formulas import comm_per_rank_per_step, cp_comm_per_rank_per_step, stage_vector_params_per_rank
from launch.config.layout import Layout
from launch.config.recipe import load_recipe
from helpers.launcher import LLAMA_TINY, TINY, launch_forked
from model.config import GPTConfig
from model.gpt.model import GPT

# id -> (recipe, --set overrides, (tp, pp, dp), the purposes that must appear). fp32 at dp 1 builds
# ZeRO-0, which skips the gradient reduction over its one data rank: no dp-grads there.
RUNS = {
    "gpt2-tp2-pp2-dp1": (TINY, [], (2, 2, 1), {"tp-forward", "tp-backward", "tp-loss", "pp-activations", "pp-grads",
                                               "pp-tp-gather", "pp-shape", "tied-grads"}),
    "gpt2-tp1-pp2-dp2": (TINY, [], (1, 2, 2), {"pp-activations", "pp-grads", "pp-shape", "tied-grads", "dp-grads",
                                               "dp-params"}),
    # Sequence parallelism: all-gathers and reduce-scatters instead of the TP all-reduces, whole
    # chunks between stages, the replicated parameters' gradients summed over TP once per step.
    "gpt2-tp2-pp2-dp1-sp": (TINY, ["model.sequence_parallel=true"], (2, 2, 1), {
        "sp-gather", "sp-scatter", "tp-loss", "pp-activations", "pp-grads", "pp-shape", "tied-grads"}),
    # Multi-query (n_kv_head=1): both TP ranks share the one key/value head, so 8 ranks also cover
    # ZeRO-1's gather (llama-tiny's 2 heads need tp=4 for the kv gathers: (4, 2, 1), no dp).
    "llama-mqa-tp2-pp2-dp2": (LLAMA_TINY, ["model.n_kv_head=1"], (2, 2, 2), {
        "tp-forward", "tp-backward", "tp-loss", "tp-kv-gather", "tp-kv-grads", "pp-activations", "pp-grads",
        "pp-tp-gather", "pp-shape", "dp-grads", "dp-params"}),
}
BOOKKEEPING_LIMIT = 256  # bytes per rank per step: a few scalars (loss, grad norm, metrics)


@pytest.fixture(scope="module", params=list(RUNS))
def run(request, tmp_path_factory):
    recipe, overrides, (tp, pp, dp), _ = RUNS[request.param]
    out = tmp_path_factory.mktemp("counts")
    # bench/step/comm_volume.py's measure(), its ranks forked (tests/helpers/launcher.py): the same run and counts.
    proc = launch_forked(tp * pp * dp, ["--recipe", str(recipe), "--tp", str(tp), "--pp", str(pp),
                                        "--comm-counts", str(out)]
                         + [arg for o in OVERRIDES + overrides for arg in ("--set", o)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    counts = [json.loads((out / f"rank{r}.json").read_text()) for r in range(tp * pp * dp)]
    rows, bookkeeping = compare(counts, *run_model(tp, pp, dp, recipe, overrides))
    return request.param, rows, bookkeeping


@pytest.mark.slow
def test_measured_equals_formula_on_every_rank_and_step(run):
    name, rows, _ = run
    wrong = [r for r in rows if r["measured"] != r["formula"]]
    assert not wrong, f"{name}: (calls, elements, bytes) differ:\n" + "\n".join(map(str, wrong))
    _, _, (tp, pp, dp), purposes = RUNS[name]
    assert {(r["rank"], r["step"]) for r in rows} == {(k, s) for k in range(tp * pp * dp) for s in range(1, STEPS + 1)}
    assert {r["purpose"] for r in rows} == purposes


@pytest.mark.slow
def test_shape_header_only_in_the_first_step(run):
    _, rows, _ = run
    assert {r["step"] for r in rows if r["purpose"] == "pp-shape"} == {1}


@pytest.mark.slow
def test_bookkeeping_is_a_few_scalars(run):
    name, _, bookkeeping = run
    assert bookkeeping and max(bookkeeping.values()) <= BOOKKEEPING_LIMIT, (name, dict(bookkeeping))


def test_exact_formulas_contain_the_design_leading_terms():
    """docs/design.md, Formulas: 4 TP all-reduces of b*s*h per block per micro-batch, b*s*h per
    boundary per micro-batch each way, the local gradient over dp; here at a middle stage."""
    config = GPTConfig(n_layer=8, n_head=4, n_embd=64, seq_len=32, vocab_size=1000)
    b, m, h, s = 2, 6, config.n_embd, config.seq_len
    pipeline = dict(pp=4, dp=2, micro_batch_size=b, global_batch_size=b * m * 2, grad_accum_steps=m)
    plain = comm_per_rank_per_step(config, Layout(world_size=8, tp=1, **pipeline), stage=1)
    split = comm_per_rank_per_step(config, Layout(world_size=16, tp=2, **pipeline), stage=1)
    blocks = partition.blocks_per_stage(config, partition.stage_partition(config, 4, "blocks"))[1]
    tp_elements = split[("tp-forward", "tp", "all_reduce")][1] + split[("tp-backward", "tp", "all_reduce")][1]
    assert tp_elements == formulas.tp_allreduce_bytes_per_step(b, s, h, blocks, m) // formulas.ACTIVATION_BYTES
    boundary = formulas.pp_p2p_bytes_per_step(b, s, h, m) // formulas.ACTIVATION_BYTES
    assert plain[("pp-activations", "pp-p2p", "send")][1] == boundary == plain[("pp-grads", "pp-p2p", "recv")][1]
    # At tp=2 each TP rank sends half of it (plus a partition header) and all-gathers the rest.
    assert split[("pp-activations", "pp-p2p", "send")][1] == boundary // 2 + 9 * m  # header: ndims, 3 sizes, t, rank, t+1 offsets
    local = formulas.stage_params_per_rank(config.n_layer, h, config.vocab_size, s, 2, 4, 1,
                                           parts=partition.stage_partition(config, 4, "blocks"))
    assert split[("dp-grads", "dp", "all_reduce")][1] == local
    assert split[("dp-params", "dp", "all_gather_into_tensor")][1] * 2 >= local  # padded to 2*d


@pytest.mark.parametrize("switches", [{}, {"arch": "llama", "n_kv_head": 2},
                                      {"arch": "llama", "bias": True, "norm": "layernorm"}],
                         ids=["gpt2", "llama", "llama-bias-layernorm"])
def test_zero1_vector_group_is_the_built_models(switches):
    """ZeRO-1 gathers the weight-decay groups separately (launch/engine/engine.py: parameters of
    dim < 2 apart); the launches' groups are multiples of 2*d, so their measured gather sees only
    the sum. Here the vector group's size against the built dense model's parameters."""
    config = GPTConfig(n_layer=3, n_head=4, n_embd=64, seq_len=32, vocab_size=300, **switches)
    vectors = sum(p.numel() for p in GPT(config).parameters() if p.dim() < 2)
    assert stage_vector_params_per_rank(config, tp=1, pp=1, stage=0) == vectors


@pytest.mark.slow
@pytest.mark.parametrize("tp,cp", [(1, 2), (2, 2), (1, 4)], ids=lambda v: str(v))
def test_context_parallel_all_to_alls_are_four_per_block_each_way(tmp_path, tp, cp):
    """Ulysses (docs/design.md contract 17), counted by --comm-counts on every rank:
    per block per micro-batch 4 all-to-alls in forward (q, k, v to heads, the output back) and 4
    in backward, each of this rank's b x s/cp x h/tp elements (GPT-2: as many key/value heads as
    query heads), over the CP group; no other collective is named for CP. The planner's formula
    (comm_formulas.cp_comm_per_rank_per_step) gives the same calls, elements and bytes."""
    world = tp * cp
    proc = launch_forked(world, ["--recipe", str(TINY), "--tp", str(tp), "--cp", str(cp), "--comm-counts", str(tmp_path)]
                         + [arg for o in OVERRIDES for arg in ("--set", o)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    recipe = load_recipe(TINY, [])
    config, train_cfg = recipe.model, recipe.train
    b, m = train_cfg.micro_batch_size, train_cfg.global_batch_size // train_cfg.micro_batch_size  # dp = 1
    per_call = b * (config.seq_len // cp) * (config.n_embd // tp)
    for rank in range(world):
        step = json.loads((tmp_path / f"rank{rank}.json").read_text())["phases"][f"step {STEPS}"]
        cp_rows = {e["purpose"]: e for e in step if e["role"] == "cp"}
        assert set(cp_rows) == {"cp-forward", "cp-backward"}, step
        planned = cp_comm_per_rank_per_step(config.resolved(), tp, cp, b, m, config.n_layer, element_bytes=4)
        for purpose, row in cp_rows.items():
            calls = m * config.n_layer * 4
            assert (row["op"], row["calls"], row["elements"], row["bytes"]) == \
                ("all_to_all_single", calls, calls * per_call, 4 * calls * per_call), (rank, row)
            assert planned[(purpose, "cp", row["op"])] == (row["calls"], row["elements"], row["bytes"]), (rank, row)
