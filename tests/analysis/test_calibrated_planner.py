"""The planner's cost model against given device profiles, and a real calibration.

- A GEMM table slower at fewer rows: a micro-batch's compute costs what the table says for its
  rows (b x seq_len / cp), interpolated in log rows between measured ones, and the ranking follows;
  a flat profile ties the micro-batch sizes, and the tie goes to the larger one.
- The memory-bandwidth floor: a rank holding every expert (ep 1) pays for reading all of them
  each micro-batch, in proportion to the weights it holds; without the floor ep is invisible.
- A data group's all-reduce costs what the profile measured at the group's size.
- A calibration on this CPU measures each shape and block case once, caches it and measures only
  new ones; its links are measured in groups of each size, every group at once.
- --auto-sweep measures the top predicted layouts and trains the fastest measured.
"""
import json
import math
import os
from pathlib import Path

import pytest

from launch.analysis.device_profile import DeviceProfile, gemm_key
from launch.analysis.formulas import PEAK_FLOPS_BF16
from launch.plan import main

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
RATE = 1e12  # FLOP/s at 2,048 rows


def _profile(tmp_path, name, **fields) -> list:
    DeviceProfile(device=name, source=fields.pop("source", "calibrated"), **fields).save(tmp_path / f"{name}.json")
    return ["--profile", str(tmp_path / f"{name}.json")]


def _plan(capsys, *args) -> dict:
    assert main([*args, "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_a_micro_batch_costs_what_the_gemm_table_says_for_its_rows(tmp_path, capsys):
    """demo.yaml (h 128, f 512, seq 128) on one device: micro-batches of 1, 4 and 16 run their
    GEMMs with 128, 512 and 2,048 rows. The table: half the rate at 128 rows."""
    table = _profile(tmp_path, "rows", gemm={gemm_key(128, 128, 512): RATE / 2, gemm_key(2048, 128, 512): RATE})
    common = ["--recipe", str(RECIPES / "demo.yaml"), "--gpus", "1", "--global-batch", "32"]
    compute = {b: _plan(capsys, *common, "--micro-batch", str(b), *table)["step_time_parts_s"]["compute"]
               for b in (1, 4, 16)}
    assert compute[1] / compute[16] == pytest.approx(2.0, rel=1e-9)
    between = RATE / 2 + (math.log(512) - math.log(128)) / (math.log(2048) - math.log(128)) * RATE / 2
    assert compute[4] / compute[16] == pytest.approx(RATE / between, rel=1e-9)  # 0.75 x the rate at 2,048 rows
    ranked = _plan(capsys, *common, "--search", "--top", "40", *table)["search"]
    single = [r["micro_batch"] for r in ranked if (r["tp"], r["pp"], r["cp"]) == (1, 1, 1)]
    assert single == sorted(single, reverse=True), single  # fewer, larger micro-batches faster
    flat = _profile(tmp_path, "flat", source="datasheet", flat_rate=RATE)
    ties = _plan(capsys, *common, "--search", "--top", "40", *flat)["search"]
    times = {r["micro_batch"]: r["step_time_s"] for r in ties if (r["tp"], r["pp"], r["cp"]) == (1, 1, 1)}
    assert len(set(times.values())) == 1 and list(times) == sorted(times, reverse=True), times  # tied: larger first


def test_holding_every_expert_pays_for_reading_them_each_micro_batch(tmp_path, capsys):
    """moe-tiny on 2 devices of an H100's datasheet: its GEMMs are tiny, so each micro-batch is
    bound by reading the rank's weights. At ep 1 a rank reads all 8 experts of each block, at ep 2
    four: the compute part grows with the weights held. Without the floor, ep changes nothing."""
    common = ["--recipe", str(RECIPES / "moe-tiny.yaml"), "--vocab", "4096", "--gpus", "2", "--gpu", "H100"]
    held = {ep: _plan(capsys, *common, "--ep", str(ep)) for ep in (1, 2)}
    for plan in held.values():
        assert plan["memory_bound_stages"] == [0] and plan["cost_model"] == "datasheet"
    ratio = held[1]["step_time_parts_s"]["compute"] / held[2]["step_time_parts_s"]["compute"]
    assert ratio == pytest.approx(held[1]["params_per_device"] / held[2]["params_per_device"], rel=1e-9)
    assert ratio > 1.1  # four experts of 8 a block less (its embeddings are most of moe-tiny's weights)
    compute_only = _profile(tmp_path, "no-floor", source="datasheet", flat_rate=0.5 * PEAK_FLOPS_BF16["H100"])
    blind = {ep: _plan(capsys, *common, "--ep", str(ep), *compute_only)["step_time_parts_s"]["compute"] for ep in (1, 2)}
    assert blind[1] == pytest.approx(blind[2], rel=1e-12)


def test_a_data_groups_all_reduce_costs_what_the_table_says_at_its_size(tmp_path, capsys):
    """tiny on 8 processes: at tp 4 the data groups hold 2 ranks, at tp 2 four. The profile's
    all-reduce in groups of 2 is ten times slower in one table than in the other: the dp part at
    dp 2 is ten times larger, and at dp 4 (groups of 4) unchanged."""
    common = ["--recipe", str(RECIPES / "tiny.yaml"), "--gpus", "8", "--precision", "fp32"]
    dp = {}
    for slow in (1e8, 1e9):
        table = _profile(tmp_path, f"groups-{slow:g}", dtype="fp32", gemm={gemm_key(32, 64, 256): RATE}, link_bw=5e9,
                         group_bw={"all_reduce:2": slow, "all_reduce:4": 1e9, "all_reduce:8": 5e9})
        dp[slow] = {tp: _plan(capsys, *common, "--tp", str(tp), *table)["step_time_parts_s"]["dp"] for tp in (4, 2)}
    assert dp[1e8][4] == pytest.approx(10 * dp[1e9][4], rel=1e-9) and dp[1e9][4] > 0
    assert dp[1e8][2] == dp[1e9][2] > 0


def _group_bandwidths_on_4_processes():
    from launch.autotune.calibrate import group_bandwidths
    measured = group_bandwidths(4)  # two groups of 2 at once; 4 itself is the whole group's link_bw
    assert sorted(measured) == ["all_reduce:2", "all_to_all:2"], measured
    assert all(0 < rate < float("inf") for rate in measured.values()), measured


@pytest.mark.slow  # 8 gloo ranks timing collectives: 9 CPU-s
def test_links_are_measured_in_groups_of_each_size_at_once():
    """The calibration's groups of 2 of 4 gloo processes, every group measuring together (real
    new_group and collectives: every rank creates every group in one order, or this hangs)."""
    from helpers.distributed import run_distributed
    run_distributed(_group_bandwidths_on_4_processes, 4)


@pytest.mark.slow
@pytest.mark.waits  # it times the machine: on the worker that is not niced (a niced one: 207 s in a clean clone's suite, 14 s alone)
def test_calibration_measures_each_shape_and_block_once_and_caches_it(tmp_path, monkeypatch, capsys):
    """A real calibration on this CPU (fp32, one process): every GEMM shape of the plan measured
    and saved with the memory bandwidth, the optimizer's rate, the engine's costs per step and per
    tensor, and the model's block and head timed at the plan's case; the plan then uses the
    measured blocks. The same plan again measures nothing (the file unchanged); `--profile` plans
    a search with it."""
    monkeypatch.setenv("GPT3D_CALIBRATION", str(tmp_path))
    # One process of one thread (the suite's OMP_NUM_THREADS): links at 2+ processes are the sweep
    # bench's and the auto-sweep test's.
    common = ["--recipe", str(RECIPES / "tiny.yaml"), "--gpus", "1", "--precision", "fp32", "--calibrate"]
    first = _plan(capsys, *common, "--micro-batch", "2")
    (cached,) = tmp_path.glob("*.json")
    profile = DeviceProfile.from_json(cached.read_text())
    assert first["cost_model"] == "calibrated" and profile.source == "calibrated" and "torch" in profile.software
    dense = gemm_key(*first["gemm_shapes"]["dense"])
    assert list(profile.gemm) == [dense] and profile.memory_bw > 1e8
    assert profile.gemm[dense] > 1e6  # FLOP/s of a real matmul
    assert profile.optimizer_s_per_param > 0 and profile.per_step_s > 0 and first["measured_blocks"]
    assert profile.per_tensor_microbatch_s is not None and profile.link_bw is None and not profile.group_bw  # one process: no links
    from launch.analysis.device_profile import block_key, model_key
    from launch.analysis.plan_args import resolve
    from launch.plan import parse_args
    model = resolve(parse_args(common[:-1]))[0]
    for piece in ("dense", "head"):  # the backward costs more than nothing
        both = profile.blocks[block_key(model_key(model), piece, 1, 1, 2, model.seq_len)]
        assert 0 < profile.blocks[block_key(model_key(model), piece + ".forward", 1, 1, 2, model.seq_len)] < both
    # The same plan again measures nothing: the cached file stays as it was.
    before = cached.read_text()
    assert _plan(capsys, *common, "--micro-batch", "2")["step_time_s"] == first["step_time_s"]
    assert cached.read_text() == before
    assert main([*common[:-1], "--micro-batch", "2", "--profile", str(cached), "--search"]) == 0
    assert "cost model: calibrated on" in capsys.readouterr().out


@pytest.mark.parametrize("recipe,world,flags", [
    ("llama-tiny.yaml", 8, {"tp": 2, "pp": 2, "recompute": "full", "schedule": "zb-h1"}),
    ("tiny.yaml", 8, {"tp": 1, "pp": 2, "cp": 2, "partition": "blocks"}),
    ("moe-tiny.yaml", 4, {"tp": 1, "pp": 2, "ep": 2})])
def test_a_run_predicts_what_the_planner_prints_for_its_layout(recipe, world, flags, tmp_path, monkeypatch, capsys):
    """The run's own prediction (launch/autotune/step_prediction.py, from the recipe and the
    derived layout, with this machine's cached calibration) equals launch/plan.py's for the same
    recipe, layout and profile given by flags: the recipe's fields reach the planner as its flags do."""
    from data.builtin import BUILTIN_VOCAB_SIZE
    from launch.analysis.partition import with_stage_boundaries
    from launch.autotune.calibrate import cache_path, device_name
    from launch.autotune.step_prediction import predict_step_time
    from launch.config.layout import check_and_derive_layout
    from launch.config.recipe import load_recipe
    monkeypatch.setenv("GPT3D_CALIBRATION", str(tmp_path))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_SIZE", raising=False)
    profile = DeviceProfile(device=device_name(world), source="calibrated", dtype="fp32", memory_bw=5e9, link_bw=1e9,
                            link_latency_s=1e-4, gemm={gemm_key(32, 64, 256): RATE / 4, gemm_key(128, 64, 256): RATE})
    profile.save(cache_path(device_name(world), "fp32"))
    sets = [f"train.{key}={value}" for key, value in flags.items() if key not in ("tp", "pp")]
    config = load_recipe(RECIPES / recipe, sets)
    layout = with_stage_boundaries(check_and_derive_layout(config, world, flags["tp"], flags["pp"], on_cpu=True), config,
                                   BUILTIN_VOCAB_SIZE)
    predicted = predict_step_time(config, layout, BUILTIN_VOCAB_SIZE)
    cli = _plan(capsys, "--recipe", str(RECIPES / recipe), "--gpus", str(world),
                *[arg for key, value in flags.items() for arg in (f"--{key}", str(value))],
                "--profile", str(cache_path(device_name(world), "fp32")))
    assert predicted.seconds == pytest.approx(cli["step_time_s"], rel=1e-12) and cli["step_time_parts_s"]["latency"] > 0
    assert predicted.by.startswith("calibrated on") and "2 GEMM shapes" in predicted.by


def test_layout_auto_trains_the_planners_first_pick_and_keeps_the_axes_given(tmp_path, monkeypatch, capsys):
    """--layout auto on 4 processes with a cached calibration: the job's layout is the first row of
    launch/plan.py --search with the same profile, and with --pp 2 given, the first row with pp 2;
    an axis no layout can keep (--tp 3) is one line."""
    from launch.autotune.calibrate import cache_path, device_name
    from launch.config.cli import parse_training_args
    from launch.errors import ConfigError
    from launch.trainer.startup import prepare_training_job
    monkeypatch.setenv("GPT3D_CALIBRATION", str(tmp_path))  # the test's own calibrations; the data cache stays
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    gemm = {gemm_key(rows, 64, columns): RATE * min(1.0, rows / 256) for rows in (32, 64, 128, 256)
            for columns in (64, 128, 256)}
    profile = DeviceProfile(device=device_name(4), source="calibrated", dtype="fp32", memory_bw=5e9, link_bw=1e9,
                            link_latency_s=2e-4, gemm=gemm)
    profile.save(cache_path(device_name(4), "fp32"))
    tiny = str(RECIPES / "tiny.yaml")
    ranked = _plan(capsys, "--recipe", tiny, "--gpus", "4", "--search", "--top", "60", "--profile",
                   str(cache_path(device_name(4), "fp32")))["search"]
    # The recipe's schedule and recompute given, as launch/plan.py --search keeps them.
    kept = ["--set", "train.schedule=1f1b", "--set", "train.recompute=none"]
    for given, expected in (([], ranked[0]), (["--pp", "2"], next(r for r in ranked if r["pp"] == 2))):
        job = prepare_training_job(parse_training_args(["--recipe", tiny, "--layout", "auto", *given, *kept,
                                                        "--set", "train.eval_every=0"], ""))
        chosen = (job.layout.tp, job.layout.pp, job.layout.cp, job.layout.ep, job.layout.micro_batch_size)
        assert chosen == tuple(expected[k] for k in ("tp", "pp", "cp", "ep", "micro_batch")), (given, chosen)
        assert job.layout_choice.predicted_step_time_s == pytest.approx(expected["step_time_s"], rel=1e-12)
    # Left to the planner at pp 2: ZB-H1's smaller bubble, and no recompute (nothing to fit on a CPU).
    job = prepare_training_job(parse_training_args(["--recipe", tiny, "--layout", "auto", "--pp", "2",
                                                    "--set", "train.eval_every=0"], ""))
    assert (job.recipe.train.schedule, job.recipe.train.recompute) == ("zb-h1", "none")
    assert job.layout_choice.predicted_step_time_s < expected["step_time_s"]
    assert "layout auto: tp" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="--layout auto: no layout of 4 processes .*--tp 3"):
        prepare_training_job(parse_training_args(["--recipe", tiny, "--layout", "auto", "--tp", "3"], ""))


@pytest.mark.slow
@pytest.mark.waits  # it calibrates and times its runs: on the worker that is not niced
def test_auto_sweep_trains_the_fastest_measured_of_the_top_predicted(tmp_path, monkeypatch, capsys, request):
    """--layout auto --auto-sweep 2 in one process, with a given GEMM table that is wrong on
    purpose (32-row GEMMs the fastest): the planner's top 2 are micro-batch 1 and 16 (16 and 1
    micro-batches a step), and each runs as its own launch/train.py for a few steps. Measured, 16
    micro-batches' engine and per-op costs make micro-batch 1 the slower, so the job trains the
    fastest measured trial, not the planner's first, and records what it measured."""
    import re

    from launch.autotune.calibrate import cache_path, device_name
    from launch.config.cli import parse_training_args
    from launch.engine.distributed import free_port
    from launch.trainer.startup import prepare_training_job
    monkeypatch.setenv("GPT3D_CALIBRATION", str(tmp_path))
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1"),
                        ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(free_port()))):
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("LOCAL_SIZE", raising=False)
    # One core for this process and the trials it starts (they inherit the affinity): a trial's
    # two OpenMP threads stall each other on a machine the other test workers keep busy.
    cores = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(cores)})
    request.addfinalizer(lambda: os.sched_setaffinity(0, cores))
    # tiny's GEMM (b x 32 rows, 64, 256): the table says 32 rows run fastest, 512 nearly as fast and
    # every size between ten times slower, so the planner's top 2 are micro-batch 1 and 16.
    gemm = {gemm_key(rows, 64, 256): RATE * {32: 1.0, 512: 0.9}.get(rows, 0.1) for rows in (32, 64, 128, 256, 512)}
    DeviceProfile(device=device_name(1), source="calibrated", dtype="fp32",  # no bandwidth floor
                  gemm=gemm).save(cache_path(device_name(1), "fp32"))
    job = prepare_training_job(parse_training_args(["--recipe", str(RECIPES / "tiny.yaml"), "--layout", "auto",
                                                    "--auto-sweep", "2"], ""))
    out = capsys.readouterr().out
    trials = {int(b): float(s) for b, s in re.findall(r"auto sweep \d/2: .*micro-batch (\d+), recompute none: "
                                                      r"predicted \S+ s, measured (\S+) s a step", out)}
    assert sorted(trials) == [1, 16], out  # the planner's top 2, each measured
    fastest = min(trials, key=trials.get)
    # Which of the two measures faster is the machine's business (a loaded clean-clone run measured
    # micro-batch 1 faster once); that the job trains the one that did is the sweep's.
    assert job.layout.micro_batch_size == fastest and job.layout_choice.swept == 2
    assert job.layout_choice.measured_step_time_s == pytest.approx(trials[fastest], rel=1e-3)
    assert "the fastest measured of the 2 fastest predicted" in out
