"""Activation checkpointing (`train.activation_checkpoint_interval`) changes memory, not maths:
with dropout on, at tp=2 pp=2, the recomputed run replays the same dropout masks (default RNG
and the per-TP-rank RNG of attention dropout) and gives the same losses and gradient norms as
the run that keeps its activations."""
from launcher import TINY, launch, read_metrics


def _run(tmp_path, name, extra):
    out = tmp_path / f"{name}.jsonl"
    proc = launch(4, ["--recipe", str(TINY), "--tp", "2", "--pp", "2", "--steps", "3",
                      "--set", "model.dropout=0.1", "--metrics-out", str(out)] + extra)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return read_metrics(out)


def test_recompute_replays_dropout_and_matches(tmp_path):
    kept = _run(tmp_path, "kept", [])
    recomputed = _run(tmp_path, "recomputed", ["--set", "train.activation_checkpoint_interval=1"])
    for a, b in zip(kept, recomputed):
        assert abs(a["loss"] - b["loss"]) <= 1e-6 * a["loss"], (a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * a["grad_norm"], (a, b)
    assert len(kept) == len(recomputed) == 3
