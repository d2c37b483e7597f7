"""Training metrics (launch/instruments/metrics.py): the pure helpers, then one real run on 2 CPU processes
whose metrics file, summary and progress lines are checked against launch/analysis/formulas.py."""
import json
import math
import re
from types import SimpleNamespace

import pytest

from data.builtin import BUILTIN_VOCAB_SIZE
from launch.analysis import formulas
from launch.instruments import metrics
from launch.runtime.recipe import ConfigError
from launch.runtime.layout import Layout
from launcher import TINY, launch, read_metrics

# recipes/tiny.yaml at dp=2: 4 layers, hidden 64, seq 32, micro 2, global 16.
N_LAYER, HIDDEN, SEQ, MICRO, GLOBAL, STEPS = 4, 64, 32, 2, 16, 5
NEW_KEYS = {"samples", "loss_scale", "step_time_s", "tflops_per_device", "mfu", "peak_memory_bytes",
            "peak_reserved_bytes"}
OLD_KEYS = {"step", "loss", "grad_norm", "lr", "tokens", "tokens_per_s", "elapsed_s"}


# ---------------------------------------------------------------- pure helpers

def test_tflops_per_device_divides_by_time_and_devices():
    assert metrics.tflops_per_device(8e12, 2.0, 4) == pytest.approx(1.0)
    # MFU of formulas.mfu is the same number over the peak.
    assert metrics.tflops_per_device(8e12, 2.0, 4) * 1e12 / 989e12 == pytest.approx(formulas.mfu(8e12, 2.0, 989e12, 4))


@pytest.mark.parametrize("name,gpu", [("NVIDIA H100 80GB HBM3", "H100"), ("NVIDIA H200", "H200"),
                                      ("NVIDIA A100-SXM4-80GB", "A100")])
def test_peak_flops_from_the_table(name, gpu):
    peak, source = metrics.peak_flops(name, None)
    assert peak == formulas.PEAK_FLOPS_BF16[gpu]
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
    monkeypatch.delenv(metrics.PEAK_TFLOPS_ENV, raising=False)
    layout = Layout(world_size=8, tp=2, pp=2, dp=2, micro_batch_size=MICRO, global_batch_size=GLOBAL,
                    grad_accum_steps=4)
    from model.config import GPTConfig  # run_arithmetic reads the architecture switches too (#12)
    config = GPTConfig(n_layer=N_LAYER, n_head=4, n_embd=HIDDEN, vocab_size=BUILTIN_VOCAB_SIZE, seq_len=SEQ)
    run = metrics.run_arithmetic(config, layout, SEQ, STEPS)
    assert run.params == formulas.params_exact(N_LAYER, HIDDEN, BUILTIN_VOCAB_SIZE, SEQ)
    assert run.model_flops_per_step == formulas.model_flops_per_step(GLOBAL, SEQ, N_LAYER, HIDDEN, BUILTIN_VOCAB_SIZE)
    assert run.bubble_fraction == pytest.approx(1 / 5)
    assert run.peak_flops is None  # the tests run on CPU
    summary = run.summary()
    assert f"{run.params:,} parameters" in summary
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


# ---------------------------------------------------------------- a real run

@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """tiny.yaml at dp=2 for 5 steps: its metrics file and console."""
    out = tmp_path_factory.mktemp("metrics") / "metrics.jsonl"
    proc = launch(2, ["--recipe", str(TINY), "--steps", str(STEPS), "--metrics-out", str(out)])
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return read_metrics(out), proc.stdout


def test_metrics_file_holds_the_new_keys_with_sane_values(run):
    records, _ = run
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    flops = formulas.model_flops_per_step(GLOBAL, SEQ, N_LAYER, HIDDEN, BUILTIN_VOCAB_SIZE)
    for r in records:
        assert OLD_KEYS | NEW_KEYS <= set(r), set(r)
        assert r["samples"] == r["step"] * GLOBAL and r["tokens"] == r["step"] * GLOBAL * SEQ
        assert r["mfu"] is None  # CPU: no peak, no made-up MFU
        assert r["loss_scale"] == 1.0  # fp32
        assert r["peak_reserved_bytes"] is None  # CPU
        step_time = GLOBAL * SEQ / r["tokens_per_s"]
        assert r["step_time_s"] == pytest.approx(step_time, rel=1e-12)
        expected = flops / (step_time * 2) / 1e12
        assert math.isclose(r["tflops_per_device"], expected, rel_tol=1e-6), (r["tflops_per_device"], expected)
    # Each step's own peak: test_step_memory_peak_starts_again_each_step checks what it measures.
    assert all(isinstance(r["peak_memory_bytes"], int) for r in records)


def test_console_shows_the_summary_once_and_an_eta_per_step(run):
    _, stdout = run
    params = formulas.params_exact(N_LAYER, HIDDEN, BUILTIN_VOCAB_SIZE, SEQ)
    assert stdout.count(f"summary: {params:,} parameters; world 2 = tp 1 x pp 1 x dp 2") == 1
    assert "per step: 4 micro-batches of 2 per pipeline x dp 2 = 16 samples = 512 tokens; 5 steps" in stdout
    assert "1F1B bubble predicted (p-1)/(m+p-1) = 0/4 = 0.0%" in stdout
    assert "MFU peak per device: none on CPU" in stdout
    for step in range(1, STEPS + 1):
        line = re.search(rf"^step {step}/{STEPS} \| loss .* TFLOP/s/dev \| mem [\d.]+ GiB .*\| eta (\S+)$",
                         stdout, re.MULTILINE)
        assert line, (step, stdout[-2000:])
        assert re.fullmatch(r"(\d+s|\d+m\d\ds|\d+h\d\dm)", line.group(1))
    assert re.search(rf"^step {STEPS}/{STEPS} .*\| eta 0s$", stdout, re.MULTILINE)
