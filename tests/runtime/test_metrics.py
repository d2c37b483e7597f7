"""Training metrics (launch/instruments/metrics.py): the pure helpers and the logger's arithmetic on
hand-made numbers, then one real run on 2 CPU processes whose metrics file and console are held
against the built model's parameters and FLOPs as torch counts them, and the run's own clock."""
import functools
import json
import re
from types import SimpleNamespace

import pytest
import torch

from helpers import step_clock
from data.builtin import BUILTIN_VOCAB_SIZE
from helpers.flop_count import counted_flops
from launch.config.layout import Layout
from launch.errors import ConfigError
from launch.instruments import metrics
from helpers.launcher import TINY, launch_forked, read_metrics
from model.config import GPTConfig
from model.gpt.model import GPT

# recipes/tiny.yaml at dp=2: 4 layers, hidden 64, seq 32, micro 2, global 16; 3 steps show every
# property below (a first step, the ones after it, the last with its "eta 0s").
N_LAYER, HIDDEN, SEQ, MICRO, GLOBAL, STEPS = 4, 64, 32, 2, 16, 3
TINY_MODEL = GPTConfig(n_layer=N_LAYER, n_head=4, n_embd=HIDDEN, seq_len=SEQ, vocab_size=BUILTIN_VOCAB_SIZE)
NEW_KEYS = {"samples", "loss_scale", "step_time_s", "tflops_per_device", "mfu", "peak_memory_bytes",
            "peak_reserved_bytes"}
OLD_KEYS = {"step", "loss", "grad_norm", "lr", "tokens", "tokens_per_s", "elapsed_s"}


@functools.cache  # one count per test session: the FLOP counter takes seconds to start
def built_tiny_model():
    """The tiny recipe's model as model/transformer/block.py builds it, its parameters as torch counts them, and
    the FLOPs torch counts in one step: a forward and backward of one sample, times the batch."""
    model = GPT(TINY_MODEL)
    one_sample = counted_flops(model, torch.zeros(1, SEQ, dtype=torch.long))
    return sum(p.numel() for p in model.parameters()), GLOBAL * one_sample


# ---------------------------------------------------------------- pure helpers

def test_logged_record_divides_the_steps_flops_by_time_devices_and_peak(tmp_path, capsys):
    """8e12 model FLOPs in a 2 s step on 4 devices: 1 TFLOP/s each, half of a 2 TFLOP/s peak."""
    layout = Layout(world_size=4, tp=1, pp=1, dp=4, micro_batch_size=1, global_batch_size=4, grad_accum_steps=1)
    run = metrics.RunArithmetic(params=1, layout=layout, seq_len=8, total_steps=1, tokens_per_step=32,
                                model_flops_per_step=8e12, bubble_fraction=0.0, peak_flops=2e12, peak_source="test")
    logger = metrics.MetricsLogger(tmp_path / "m.jsonl", "disabled", "test", None, {}, run)
    logger.log({"step": 1, "samples": 4, "loss": 1.0, "grad_norm": 1.0, "lr": 1e-3, "loss_scale": 1.0, "tokens": 32,
                "tokens_per_s": 16.0, "step_time_s": 2.0, "peak_memory_bytes": 2 ** 30, "peak_reserved_bytes": None})
    logger.close()
    (record,) = read_metrics(tmp_path / "m.jsonl")
    assert record["tflops_per_device"] == pytest.approx(1.0)
    assert record["mfu"] == pytest.approx(0.5)
    assert "| 1 TFLOP/s/dev | mfu 50.0% | mem 1.00 GiB | eta 0s" in capsys.readouterr().out
    assert metrics.tflops_per_device(8e12, 2.0, 4) == pytest.approx(1.0)


@pytest.mark.parametrize("name,gpu,dense_tflops", [("NVIDIA H100 80GB HBM3", "H100", 989),
                                                   ("NVIDIA H200", "H200", 989),
                                                   ("NVIDIA A100-SXM4-80GB", "A100", 312)])
def test_peak_flops_from_the_device_name(name, gpu, dense_tflops):
    """torch's device names to the datasheets' dense bf16 TFLOP/s."""
    peak, source = metrics.peak_flops(name, None)
    assert peak == pytest.approx(dense_tflops * 1e12, rel=1e-3)
    assert gpu in source


def test_peak_flops_is_none_on_cpu_and_unknown_devices():
    assert metrics.peak_flops(None, None)[0] is None
    assert metrics.peak_flops("NVIDIA GeForce RTX 3090", None)[0] is None
    assert "GPT3D_PEAK_TFLOPS" in metrics.peak_flops("NVIDIA GeForce RTX 3090", None)[1]


def test_peak_flops_override_wins_everywhere():
    assert metrics.peak_flops("NVIDIA H100 80GB HBM3", "500")[0] == 500e12
    assert metrics.peak_flops(None, "1.5")[0] == 1.5e12  # an explicit number, not a guess
    for bad in ("fast", "0", "-3"):
        with pytest.raises(ConfigError, match="GPT3D_PEAK_TFLOPS"):
            metrics.peak_flops(None, bad)


def test_format_duration_and_eta():
    assert [metrics.format_duration(s) for s in (0, 42.4, 185, 7620)] == ["0s", "42s", "3m05s", "2h07m"]
    assert metrics.eta_seconds(elapsed_s=10.0, step=5, total_steps=20) == pytest.approx(30.0)


def test_loss_scale_is_the_optimizers_in_fp16_only():
    def engine(fp16):
        return SimpleNamespace(fp16_enabled=lambda: fp16, _get_optimizer_loss_scale=lambda: 65536)
    assert metrics.loss_scale(engine(True)) == 65536.0
    assert metrics.loss_scale(engine(False)) == 1.0


def test_run_arithmetic_and_summary(monkeypatch):
    """tp 2 x pp 2 x dp 2 with 4 micro-batches of 2: the parameters and FLOPs of the built model,
    and the bubble of 2 stages over 4 micro-batches, (2-1)/(4+2-1) = 1/5."""
    monkeypatch.delenv(metrics.PEAK_TFLOPS_ENV, raising=False)
    layout = Layout(world_size=8, tp=2, pp=2, dp=2, micro_batch_size=MICRO, global_batch_size=GLOBAL,
                    grad_accum_steps=4)
    run = metrics.run_arithmetic(TINY_MODEL, layout, SEQ, STEPS)
    params, flops = built_tiny_model()
    assert run.params == params
    assert run.model_flops_per_step == pytest.approx(flops)
    assert run.tokens_per_step == 16 * 32
    assert run.bubble_fraction == pytest.approx(1 / 5)
    assert run.peak_flops is None  # the tests run on CPU
    summary = run.summary()
    assert f"{params:,} parameters" in summary
    assert "4 micro-batches of 2 per pipeline x dp 2 = 16 samples = 512 tokens" in summary
    assert "(p-1)/(m+p-1) = 1/5 = 20.0%" in summary
    assert "none on CPU" in summary


def test_step_memory_peak_starts_again_each_step():
    """A step that briefly holds 256 MiB peaks at least that much above where it started; the
    next step, which holds nothing new, peaks well below (CPU: the kernel's peak RSS, reset)."""
    import numpy as np
    big = 256 * 2 ** 20
    metrics.reset_step_memory_peak()
    before, reserved = metrics.local_step_memory_peak()
    assert reserved is None  # CPU: no caching allocator
    block = np.ones(big // 8)  # touched: resident
    del block
    peak, _ = metrics.local_step_memory_peak()
    assert peak >= before + big * 0.9, (before, peak)  # freed heap pages may be reused
    metrics.reset_step_memory_peak()
    quiet, _ = metrics.local_step_memory_peak()
    assert quiet < before + big // 4, (before, quiet)


def test_resumed_metrics_file_keeps_the_steps_before_the_checkpoint(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3)) + '{"step": 4, "lo')
    assert metrics.earlier_records(path, 2) == ['{"step": 1}', '{"step": 2}']
    assert metrics.earlier_records(tmp_path / "missing.jsonl", 2) == []


def test_a_resume_never_rewrites_the_metrics_file_in_place(tmp_path):
    """The kept records go to a new file renamed over the old one, so the old file (here
    held open, as by a process killed mid-resume, or a reader) keeps every record it had, and the
    new one holds the kept steps, then the resumed run's."""
    path = tmp_path / "m.jsonl"
    old = "".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3))
    path.write_text(old)
    with open(path) as held:
        metrics.keep_records_until(path, 2)
        assert held.read() == old  # the old file, untouched
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["m.jsonl"]  # no cut file left behind


# ---------------------------------------------------------------- a real run

@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """tiny.yaml at dp=2 for 3 steps without evaluation: its metrics file and console, and each
    rank's train_batch times and tokens on the tests' own clock (tests/helpers/step_clock.py)."""
    directory = tmp_path_factory.mktemp("metrics")
    out = directory / "metrics.jsonl"
    no_calibration = tmp_path_factory.mktemp("calibration")  # whatever this machine has cached elsewhere
    # Forked ranks (helpers/launcher.py: launch_forked): what this run computes and logs is the
    # subject, not DeepSpeed's launcher (its two processes and the ranks' own imports of torch).
    proc = launch_forked(2, ["--recipe", str(TINY), "--steps", str(STEPS), "--set", "train.eval_every=0",
                             "--metrics-out", str(out)],
                         env=dict(step_clock.env(directory), GPT3D_CALIBRATION=str(no_calibration)))
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return read_metrics(out), proc.stdout, step_clock.read(directory, 2)


@pytest.mark.slow  # a 2-process training run
def test_metrics_file_holds_the_built_models_flops_over_the_measured_step(run):
    """Each record: the batch arithmetic of the recipe, the FLOPs torch counts in the built model
    over the step's time on 2 devices, and a step time that fits between the logger's clock
    readings (elapsed_s, rounded to 0.1 ms) and fills most of them."""
    records, _, clock = run
    _, flops = built_tiny_model()
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    previous_elapsed = 0.0
    for r in records:
        assert OLD_KEYS | NEW_KEYS <= set(r), set(r)
        assert r["samples"] == r["step"] * 16 and r["tokens"] == r["step"] * 16 * 32
        assert r["mfu"] is None  # CPU: no peak, no made-up MFU
        assert r["loss_scale"] == 1.0  # fp32
        assert r["peak_reserved_bytes"] is None  # CPU
        # Against the tests' clock: the tokens both ranks drew in this step over rank 0's train_batch time.
        tokens = sum(rank[r["step"] - 1]["tokens"] for rank in clock)
        assert tokens == 16 * 32
        assert step_clock.implied_step_time_fits(r["tokens_per_s"], tokens, clock[0][r["step"] - 1]["seconds"]), \
            (r, clock[0])
        assert r["tflops_per_device"] == pytest.approx(flops / (r["step_time_s"] * 2) / 1e12, rel=1e-6)
        between_records = r["elapsed_s"] - previous_elapsed
        assert 0.5 * between_records < r["step_time_s"] <= between_records + 1e-4, (r, previous_elapsed)
        previous_elapsed = r["elapsed_s"]
    # Each step's own peak: test_step_memory_peak_starts_again_each_step checks what it measures.
    assert all(isinstance(r["peak_memory_bytes"], int) for r in records)
    assert all(r["predicted_step_time_s"] is None for r in records)  # no calibration of this CPU


@pytest.mark.slow  # the same run
def test_console_shows_the_summary_once_and_an_eta_per_step(run):
    _, stdout, _ = run
    params, _ = built_tiny_model()
    assert stdout.count(f"summary: {params:,} parameters; world 2 = tp 1 x pp 1 x dp 2") == 1
    assert f"per step: 4 micro-batches of 2 per pipeline x dp 2 = 16 samples = 512 tokens; {STEPS} steps" in stdout
    assert "1F1B bubble predicted (p-1)/(m+p-1) = 0/4 = 0.0%" in stdout
    # No calibration of this CPU in the tests' cache: no predicted step time, and how to make one;
    # the last step, after 2 of warm-up, measured (tests/analysis/test_calibrated_planner.py: with one).
    assert "step time predicted: none (no calibration of" in stdout and "--calibrate` measures one" in stdout
    assert "step time: measured" in stdout and "(median of 1 steps after 2 of warm-up); no prediction" in stdout
    assert "MFU peak per device: none on CPU" in stdout
    for step in range(1, STEPS + 1):
        line = re.search(rf"^step {step}/{STEPS} \| loss .* TFLOP/s/dev \| mem [\d.]+ GiB .*\| eta (\S+)$",
                         stdout, re.MULTILINE)
        assert line, (step, stdout[-2000:])
        assert re.fullmatch(r"(\d+s|\d+m\d\ds|\d+h\d\dm)", line.group(1))
    assert re.search(rf"^step {STEPS}/{STEPS} .*\| eta 0s$", stdout, re.MULTILINE)
