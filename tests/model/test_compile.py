"""`train.compile`: each block compiled with torch.compile trains the same model as eager, and a
machine where inductor cannot build kernels trains eagerly after one line.

The compiled runs are parity runs (conftest.py: parity_runs, recipes/tiny.yaml for 5 steps, fp32,
clipping active) compared with the eager (1,1,1) reference within the acceptance test's 1e-5: at
(1,1,1) with selective recompute (the attention core's checkpoint inside the compiled block), and
at tp=2 with sequence parallelism (our collectives and autograd Functions inside the compiled
block) and full recompute (DeepSpeed's checkpoint around it). Pipeline stages add nothing inside a
block (a stage compiles its own blocks, as pp 1 does), so the TP run is one stage: two ranks compile,
not four. The fallback is tested with a real
PATH that holds no C++ compiler, not with a stand-in for our own check.
"""
import os
import stat

import pytest

from helpers.parity_runs import REFERENCE, STEPS
from launch.engine.compiler import blocks_to_compile, compile_unavailable, cpp_compiler_candidates
from helpers.launcher import TINY, launch_forked, read_metrics

RTOL = 1e-5
SINGLE = (1, 1, 1, "compile", "selective")
TENSOR_PARALLEL = (2, 1, 1, "sp", "full", "compile")
COMPILE_LINE = "compile: each transformer block with torch.compile (inductor)"


def _assert_matches_reference(ref, got):
    assert len(got) == len(ref) == STEPS
    for r, g in zip(ref, got):
        for key in ("loss", "grad_norm", "val_loss"):
            assert (key in g) == (key in r)
            if key in r:
                assert abs(g[key] - r[key]) <= RTOL * abs(r[key]), (r["step"], key, g[key], r[key])


@pytest.mark.slow  # a training run of its own, compiling on two cores
def test_compiled_blocks_match_eager(parity_runs):
    run = parity_runs[SINGLE]
    _assert_matches_reference(parity_runs[REFERENCE]["metrics"], run["metrics"])
    assert run["stdout"].count(COMPILE_LINE) == 1, run["stdout"][-2000:]


@pytest.mark.slow  # two ranks compiling on two cores: about 30 s with an empty inductor cache
def test_compiled_blocks_match_eager_with_tp_sp_and_full_recompute(parity_runs):
    run = parity_runs[TENSOR_PARALLEL]
    _assert_matches_reference(parity_runs[REFERENCE]["metrics"], run["metrics"])
    assert run["stdout"].count(COMPILE_LINE) == 1  # the logging rank only


def _no_compiler_path(tmp_path):
    """A PATH with none of inductor's C++ compilers on it (absolute names in $CXX ignore PATH)."""
    if any(os.path.isabs(name) for name in cpp_compiler_candidates()):
        pytest.skip("$CXX names a compiler by its absolute path")
    empty = tmp_path / "bin"
    empty.mkdir()
    return str(empty)


def test_no_cpp_compiler_on_path_turns_compile_off(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", _no_compiler_path(tmp_path))
    reason = compile_unavailable("cpu")
    assert reason is not None and all(name in reason for name in cpp_compiler_candidates()), reason
    assert blocks_to_compile(True, "cpu", logging_rank=True) is False
    assert capsys.readouterr().out == f"compile: off, training eagerly: {reason}\n"
    assert blocks_to_compile(True, "cpu", logging_rank=False) is False
    assert capsys.readouterr().out == ""  # the other ranks say nothing
    assert blocks_to_compile(False, "cpu", logging_rank=True) is False  # not asked: no line, no check
    assert capsys.readouterr().out == ""


def test_a_working_compiler_on_path_keeps_compile_on(tmp_path, monkeypatch):
    """Each candidate replaced by a script that answers `--version` as a compiler does."""
    directory = _no_compiler_path(tmp_path)
    for name in cpp_compiler_candidates():
        script = tmp_path / "bin" / name
        script.write_text("#!/bin/sh\necho 'g++ (fake) 13.2.0'\n")
        script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", directory)
    assert compile_unavailable("cpu") is None


@pytest.mark.slow  # a training run of its own
def test_training_without_a_compiler_falls_back_to_eager(parity_runs, tmp_path):
    """The same run as the eager reference, asked to compile on a machine without a C++ compiler:
    one line says why, and the losses are the reference's to the bit."""
    out = tmp_path / "metrics.jsonl"
    proc = launch_forked(1, ["--recipe", str(TINY), "--steps", str(STEPS), "--set", "train.compile=true",
                             "--metrics-out", str(out)], env={"PATH": _no_compiler_path(tmp_path)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("compile:")]
    assert len(lines) == 1 and lines[0].startswith("compile: off, training eagerly: no working C++ compiler"), lines
    ref = parity_runs[REFERENCE]["metrics"]
    assert [(m["loss"], m["grad_norm"]) for m in read_metrics(out)] == [(m["loss"], m["grad_norm"]) for m in ref]
