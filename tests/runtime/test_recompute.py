"""Activation recomputation (`train.recompute`) changes memory, not maths: with dropout on, at
tp=2 pp=2, full recompute (DeepSpeed's checkpointing of whole blocks) and selective recompute
(the attention core, under torch.utils.checkpoint) replay the same dropout masks (default RNG and the per-TP-rank RNG of
attention dropout) and give the same losses and gradient norms as the run that keeps its
activations. The same holds with sequence parallelism, whose residual and embedding dropout
draw from the per-TP-rank RNG."""
import pytest

from helpers.launcher import TINY, launch_forked, read_metrics

pytestmark = pytest.mark.slow  # multi-process training runs (the fast tier: tests/e2e/test_parity.py)
SP = ["--set", "model.sequence_parallel=true"]


def _run(tmp_path, name, extra):
    out = tmp_path / f"{name}.jsonl"
    proc = launch_forked(4, ["--recipe", str(TINY), "--tp", "2", "--pp", "2", "--steps", "3",
                      "--set", "model.dropout=0.1", "--metrics-out", str(out)] + extra)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return read_metrics(out)


def _assert_same(kept, recomputed):
    assert len(kept) == len(recomputed) == 3
    for a, b in zip(kept, recomputed):
        assert abs(a["loss"] - b["loss"]) <= 1e-6 * a["loss"], (a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * a["grad_norm"], (a, b)


def test_recompute_replays_dropout_and_matches(tmp_path):
    kept = _run(tmp_path, "kept", [])
    _assert_same(kept, _run(tmp_path, "full", ["--set", "train.recompute=full"]))
    _assert_same(kept, _run(tmp_path, "selective", ["--set", "train.recompute=selective"]))


@pytest.fixture(scope="module")
def sp_kept(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("sp"), "sp-kept", SP)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recompute_with_sequence_parallelism_matches(tmp_path, sp_kept, mode):
    _assert_same(sp_kept, _run(tmp_path, f"sp-{mode}", SP + ["--set", f"train.recompute={mode}"]))
