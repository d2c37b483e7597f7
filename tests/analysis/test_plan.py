"""launch/plan.py: the 128-GPU example, bad input, --search, --plot (read back as pixels), the 1F1B
simulation, and the stage partition and per-rank parameter count it predicts against the real
DeepSpeed PipelineModule our model builds on each rank."""
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import matplotlib
import pytest
import torch
import yaml
from matplotlib import colors

from helpers import chart_pixels
from helpers.distributed import run_distributed, uses_deepspeed
from launch.analysis import formulas, partition
from launch.analysis.pipeline_chart import COLOURS
from launch.analysis.schedule_sim import idle_fraction, simulate_schedule
from launch.plan import main
from model.config import GPTConfig
from model.config import ModelConfig
from model.gpt.pipe import build_pipeline
from model.parallel.state import init_parallel_state

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = ["--layers", "72", "--hidden", "10240", "--heads", "80", "--seq-len", "2048", "--vocab", "51200",
           "--gpus", "128", "--tp", "4", "--pp", "4", "--micro-batch", "8", "--global-batch", "256",
           "--gpu-memory", "80"]
SMALL = ["--layers", "8", "--hidden", "512", "--heads", "8", "--seq-len", "256", "--vocab", "1000"]
CONFIG = GPTConfig(n_layer=5, n_head=4, n_embd=32, seq_len=16, vocab_size=101, vocab_pad_multiple=4)


def _json(out: str):
    """The JSON line of main()'s output. Called in-process, DeepSpeed's first import may log its
    accelerator probe to stdout first (the script sets DS_ACCELERATOR=cpu to skip the probe)."""
    return json.loads(out.strip().splitlines()[-1])


def test_128_gpu_example_json(capsys):
    assert main([*EXAMPLE, "--json"]) == 0
    plan = _json(capsys.readouterr().out)
    assert (plan["dp"], plan["layers_per_stage"], plan["microbatches_per_pipeline"], plan["grad_accum_steps"]) \
        == (8, 18, 4, 4)
    assert plan["bubble_fraction_equal_stages"] == pytest.approx(3 / 7)
    # 18 blocks per stage either way; the last stage's head makes it the slowest: a larger simulated bubble.
    assert plan["blocks_per_stage"] == [18, 18, 18, 18] and plan["bubble_fraction"] > 3 / 7
    assert plan["params_per_device"] == formulas.stage_params_per_rank(
        72, 10240, 51200, 2048, 4, 4, 0, parts=partition.stage_partition(ModelConfig(n_layer=72).resolved(), 4, "blocks"))
    assert plan["memory_per_device_bytes"] > 80 * 2 ** 30  # no recompute: over budget, and it says so
    assert any("micro-batches per pipeline" in w for w in plan["warnings"])
    assert any("exceeds --gpu-memory 80" in w and "--recompute full" in w for w in plan["warnings"])
    assert plan["groups"]["tp"][0] == [0, 1, 2, 3] and plan["groups"]["pp"][0] == [0, 32, 64, 96]


def test_text_report(capsys):
    assert main(EXAMPLE) == 0
    out = capsys.readouterr().out
    for text in ["dp = 128 / (tp 4 * pp 4) = 8", "layers per stage: 18 blocks", "= 4 = gradient accumulation",
                 "3/7 = 0.4286", "TP       4", "[0, 1, 2, 3], [4, 5, 6, 7], ...", "ZeRO-1", "full recompute",
                 "model FLOPs per step", "warning: only 4 micro-batches"]:
        assert text in out, text


def test_warns_when_tp_leaves_the_node(capsys):
    assert main(["--layers", "8", "--hidden", "512", "--heads", "16", "--gpus", "32", "--tp", "16",
                 "--global-batch", "32", "--json"]) == 0
    plan = _json(capsys.readouterr().out)
    assert plan["groups_within_node"]["tp"] is False
    assert any("span nodes of 8 GPUs" in w and "raise --pp" in w for w in plan["warnings"])


BAD = [  # (argv, words the message must contain)
    (["--gpus", "6", "--tp", "4"], ["--gpus 6", "tp*cp*pp = 4*1*1 = 4"]),
    (["--gpus", "8", "--tp", "2", "--cp", "3", *SMALL], ["--gpus 8", "tp*cp*pp = 2*3*1 = 6"]),
    (["--gpus", "8", "--cp", "0", *SMALL], ["--cp 0", ">= 1"]),
    (["--gpus", "16", "--tp", "2", "--cp", "8", *SMALL], ["n_head=8", "tp*cp = 2*8 = 16", "divisors of 8"]),
    (["--gpus", "4", "--cp", "4", *SMALL, "--seq-len", "250"], ["sequence length 250", "--cp 4", "multiple of 4"]),
    (["--gpus", "3", "--cp", "3", "--layers", "2", "--hidden", "96", "--heads", "6", "--seq-len", "48",
      "--vocab", "64", "--recipe", "recipes/llama-tiny.yaml"], ["n_kv_head=2", "tp*cp = 1*3 = 3", "choose a --cp"]),
    (["--gpus", "12", "--tp", "3", *SMALL], ["n_head=8", "--tp 3"]),
    (["--gpus", "16", "--pp", "16", *SMALL], ["n_layer=8", "16 pipeline stages"]),
    (["--gpus", "16", "--micro-batch", "3", "--global-batch", "100", *SMALL], ["global_batch_size=100", "3*16 = 48"]),
    (["--gpus", "8", "--hidden", "100", "--heads", "8"], ["n_embd=100", "n_head=8"]),
    (["--gpus", "0"], ["--gpus 0"]),
    (["--gpus", "8", "--heads", "0"], ["--heads 0", ">= 1"]),
    (["--tp", "2"], ["--gpus"]),
    (["--gpus", "8", "--zero", "2"], ["--zero", "invalid choice"]),
    (["--gpus", "8", "--zero", "0"], ["--zero 0 with bf16", "--zero 1", "--precision fp32"]),
    (["--gpus", "8", "--zero", "0", "--search"], ["--zero 0 with bf16", "--zero 1", "--precision fp32"]),
    (["--gpus", "8", "--precision", "fp8"], ["--precision", "invalid choice"]),
    (["--gpus", "8", "--recipe", "recipes/nope.yaml"], ["recipes/nope.yaml", "not found"]),
    # Expert parallelism: ep against the data axis and the experts, and a dense model.
    (["--recipe", "recipes/mixtral-8x7b.yaml", "--gpus", "8", "--ep", "3"], ["--ep 3", "does not divide", "8"]),
    (["--recipe", "recipes/mixtral-8x7b.yaml", "--gpus", "32", "--ep", "16"], ["num_experts=8", "--ep 16"]),
    (["--recipe", "recipes/mixtral-8x7b.yaml", "--gpus", "8", "--ep", "0"], ["--ep 0", ">= 1"]),
    (["--recipe", "recipes/llama2-7b.yaml", "--gpus", "8", "--ep", "2"], ["--ep 2", "num_experts=0"]),
]


@pytest.mark.parametrize("argv,words", BAD, ids=[" ".join(b[0]) for b in BAD])
def test_bad_input_is_one_line_and_exit_2(argv, words, capsys):
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("error: ") and captured.err.count("\n") == 1, captured.err
    for word in words:
        assert word in captured.err, (word, captured.err)


def test_bad_input_as_a_script_prints_no_traceback():
    proc = subprocess.run([sys.executable, "launch/plan.py", "--gpus", "6", "--tp", "4"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr


def test_search_lists_every_valid_layout_fastest_first(capsys):
    gpus, global_batch, heads, layers = 16, 64, 8, 8
    assert main([*SMALL, "--gpus", str(gpus), "--global-batch", str(global_batch), "--gpu-memory", "1000",
                 "--search", "--json", "--top", "1000"]) == 0
    result = _json(capsys.readouterr().out)
    plans = result["search"]
    times = [p["step_time_s"] for p in plans]
    assert times == sorted(times)
    got = {(p["tp"], p["cp"], p["pp"], p["micro_batch"], p["virtual_stages"]) for p in plans}
    # cp: each of the tp*cp ranks of a stage attends with whole heads (seq 256 divides by any cp here).
    # v > 1 (interleaved 1F1B, 2 or 4 chunks a rank): pp x v dividing the layers, m a multiple of pp.
    want = {(tp, cp, pp, b, v) for tp in range(1, gpus + 1) for cp in range(1, gpus + 1) for pp in range(1, layers + 1)
            for b in range(1, global_batch + 1) for v in (1, 2, 4)
            if gpus % (tp * cp * pp) == 0 and heads % (tp * cp) == 0
            and global_batch % (b * gpus // (tp * cp * pp)) == 0
            and (v == 1 or (pp > 1 and layers % (pp * v) == 0
                            and global_batch // (b * gpus // (tp * cp * pp)) % pp == 0))}
    assert any(cp > 1 for _, cp, _, _, _ in want) and any(v > 1 for *_, v in want)
    assert got == want and result["valid_layouts"] == result["fitting_layouts"] == len(want)
    for p in plans:
        assert p["tp"] * p["cp"] * p["pp"] * p["dp"] == gpus


def test_search_respects_the_memory_budget(capsys):
    assert main([*SMALL, "--gpus", "16", "--global-batch", "64", "--gpu-memory", "0.3", "--search"]) == 0
    out = capsys.readouterr().out
    assert "valid layouts fit for 16 GPUs" in out and "why" in out
    assert main([*SMALL, "--gpus", "16", "--global-batch", "64", "--gpu-memory", "0.3", "--search", "--json"]) == 0
    result = _json(capsys.readouterr().out)
    plans = result["search"]
    assert len(plans) == 10 and result["fitting_layouts"] < result["valid_layouts"]
    assert all(p["fits"] and p["memory_per_device_bytes"] <= 0.3 * 2 ** 30 for p in plans)


def test_plot_shows_the_layout_and_its_schedule(tmp_path, capsys):
    """The PNG read back as pixels. 16 GPUs at tp 2, pp 4 make dp 2, and m = 32 / (2 * dp) = 8
    micro-batches of 2: the grid shows one row per stage of tp * dp device cells in that stage's
    colour; the schedule one row per stage with m forward and m backward boxes, idle for
    (p-1)/(m+p-1) of the row [N21 sec. 2.2.1]."""
    gpus, tp, pp, micro, global_batch = 16, 2, 4, 2, 32
    dp = gpus // (tp * pp)
    m = global_batch // (micro * dp)
    path = tmp_path / "plan.png"
    assert main([*SMALL, "--gpus", str(gpus), "--tp", str(tp), "--pp", str(pp), "--micro-batch", str(micro),
                 "--global-batch", str(global_batch), "--plot", str(path)]) == 0
    assert f"wrote {path}" in capsys.readouterr().out
    rgb = chart_pixels.read_rgb(path)
    (top, bottom), (left, right) = chart_pixels.schedule_area(rgb)
    grid, schedule = rgb[:top], rgb[top:bottom, left:right]

    stage_colours = matplotlib.colormaps["tab10"]  # the grid's palette, drawn at alpha 0.55
    grid_rows = []
    for stage in range(pp):
        cells = chart_pixels.colour_mask(grid, colors.to_hex(stage_colours(stage)), alpha=0.55)
        (band,) = chart_pixels.box_rows(cells)  # one row per stage
        assert chart_pixels.boxes_in_row(cells, band) == tp * dp, stage
        grid_rows.append(band)
    assert grid_rows == sorted(grid_rows)  # stage 0 on top

    forward, backward = (chart_pixels.colour_mask(schedule, COLOURS[kind]) for kind in "FB")
    rows = chart_pixels.box_rows(forward | backward)
    assert len(rows) == pp
    assert [chart_pixels.boxes_in_row(forward, row) for row in rows] == [m] * pp
    assert [chart_pixels.boxes_in_row(backward, row) for row in rows] == [m] * pp
    idle = [chart_pixels.idle_share(schedule, row) for row in rows]
    assert sum(idle) / pp == pytest.approx((pp - 1) / (m + pp - 1), abs=0.01), idle


def test_recipe_gives_the_model(capsys):
    assert main(["--recipe", "recipes/tiny.yaml", "--vocab", "4096", "--gpus", "8", "--tp", "2", "--pp", "2",
                 "--json"]) == 0
    plan = _json(capsys.readouterr().out)
    expected = dict(yaml.safe_load((REPO / "recipes" / "tiny.yaml").read_text())["model"], vocab_size=4096)
    assert {key: plan["model"][key] for key in expected} == expected
    assert (plan["dp"], plan["micro_batch"], plan["global_batch"], plan["zero"]) == (2, 2, 16, 1)
    assert (plan["precision"], plan["recompute"]) == ("fp32", "none")  # the recipe's train section


def test_recompute_mode_chooses_the_activations(capsys):
    """The total counts the chosen mode's activations; full < selective < none (selective keeps no
    logsumexp under fused attention: a little less than none)."""
    plans = {}
    for mode in ("none", "selective", "full"):
        assert main([*SMALL, "--gpus", "2", "--precision", "fp32", "--zero", "0", "--recompute", mode, "--json"]) == 0
        plans[mode] = _json(capsys.readouterr().out)
    keys = {"none": "activations_no_recompute", "selective": "activations_selective", "full": "activations_recompute"}
    for mode, plan in plans.items():
        stage = plan["memory_per_stage_bytes"][0]
        states = sum(stage[k] for k in ("weights", "gradients", "optimizer", "buffers"))
        # One stage, the last: its logits and the loss's chunk live with the activations
        # (tests/analysis/test_gpu_memory_terms.py measures them); the step's temporaries are smaller here.
        forward = stage["activations"] + stage["logits"] + stage["loss_temporaries"]
        assert plan["recompute"] == mode and stage["total"] == states + max(forward, stage["optimizer_step_temporaries"])
        assert stage["activations"] == plans["none"]["memory_per_stage_bytes"][0][keys[mode]]
    # The forward's peak (here below AdamW's step temporaries, which then set the total).
    totals = [sum(plans[mode]["memory_per_stage_bytes"][0][k] for k in ("activations", "logits", "loss_temporaries"))
              for mode in ("full", "selective", "none")]
    assert totals == sorted(set(totals))


@pytest.mark.parametrize("pp,m", [(1, 4), (2, 1), (4, 4), (4, 8), (8, 3), (3, 32)])
def test_simulated_1f1b_bubble_matches_the_formula(pp, m):
    events = simulate_schedule("1f1b", pp, m, 1.0, 2.0)
    assert len(events) == 2 * pp * m
    assert idle_fraction(events) == pytest.approx(formulas.bubble_fraction(pp, m))
    assert max(e[4] for e in events) == pytest.approx((m + pp - 1) * 3.0)


LLAMA = GPTConfig(arch="llama", n_layer=3, n_head=4, n_kv_head=2, n_embd=32, ffn_hidden_size=48, seq_len=16,
                  vocab_size=97)


@pytest.mark.parametrize("config,kinds,specs", [
    (CONFIG, ["embed", "wpe"] + ["block"] * 5 + ["ln_f", "head"],
     [("TokenEmbedding", "embed", None), ("PositionEmbedding", None, None)] + [("Block", None, i) for i in range(5)]
     + [("LayerNorm", None, None), ("TokenEmbedding", "embed", "logits")]),
    (LLAMA, ["embed"] + ["block"] * 3 + ["ln_f", "lm_head"],
     [("TokenEmbedding", None, None)] + [("Block", None, i) for i in range(3)]
     + [("RMSNorm", None, None), ("LMHead", None, None)]),
], ids=["gpt2-tied", "llama-untied"])
def test_built_layer_specs_follow_the_layer_table(config, kinds, specs):
    """The planner's layer kinds and the specs DeepSpeed builds, layer by layer, against the table
    written out here: (module, tie key, block index); the tied head is the embedding under the
    same key with a forward that returns (B, T, V_pad) logits."""
    from model.parallel.state import single_process_state
    from model.gpt.pipe import layer_specs
    assert formulas.layer_kinds(config) == kinds
    built = layer_specs(config, single_process_state())

    def described(spec):
        tied_key = getattr(spec, "key", None)
        if spec.typename.__name__ == "Block":
            return "Block", tied_key, spec.module_args[1]
        return spec.typename.__name__, tied_key, None if getattr(spec, "forward_fn", None) is None else "logits"
    assert [described(spec) for spec in built] == specs
    hidden = torch.zeros(1, 3, config.n_embd)
    logits = built[-1].forward_fn(built[-1].build(), hidden) if config.tie_embeddings else built[-1].build()(hidden)
    assert logits.shape == (1, 3, config.padded_vocab_size(1))


@uses_deepspeed
def _real_stage_matches_the_plan(config: GPTConfig, tp: int, pp: int) -> None:
    """On each rank: DeepSpeed's own type:Block partition of the real PipelineModule is the
    `blocks` rule, a module built at the balanced rule's boundaries holds them, and the parameters
    this rank holds are the planner's count for its stage either way."""
    state = init_parallel_state(tp, pp)
    for rule in ("blocks", "balanced"):
        parts = partition.stage_partition(config, pp, rule)
        pipe = build_pipeline(config, state) if rule == "blocks" else build_pipeline(config, state, parts=parts)
        assert pipe.parts == parts, (rule, pipe.parts, parts)
        held = sum(p.numel() for p in pipe.parameters())  # a tied module is one module on its stage
        predicted = formulas.stage_params_per_rank(config.n_layer, config.n_embd, config.vocab_size, config.seq_len,
                                                   tp, pp, state.pp_rank, config.vocab_pad_multiple, parts=parts)
        assert held == predicted, \
            f"{rule}, tp {tp} pp {pp}, rank {state.global_rank}: holds {held}, planned {predicted}"


@pytest.mark.slow  # 4 spawned processes
def test_per_rank_parameters_match_the_real_pipeline_module():
    """tp 2 x pp 2, one layout that shows every rule: 5 blocks split unevenly over the stages
    ((3, 2) by count; (4, 1) balanced, the 1001-word head being worth 2.4 blocks), the vocabulary
    padded (1001 -> 1008) and split over TP, and the last stage holding a tied copy of wte."""
    config = dataclasses.replace(CONFIG, vocab_size=1001)
    assert partition.blocks_per_stage(config, partition.stage_partition(config, 2, "balanced")) == [4, 1]
    run_distributed(_real_stage_matches_the_plan, 4, config, 2, 2)
