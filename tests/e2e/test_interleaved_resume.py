"""Checkpoints of interleaved runs (train.virtual_stages, launch/engine/interleaved.py): saved at v = 2
and resumed at v = 2, steps 4-5 equal the uninterrupted run's to the bit; resumed at v = 1, refused
in one line (each rank's ZeRO-1 partition holds its chunks' parameters: loaded at another v they
would land in other layers)."""
import pytest

from helpers.launcher import TINY, launch_forked, read_metrics

pytestmark = pytest.mark.slow  # three multi-process training runs

ARGS = ["--recipe", str(TINY), "--pp", "2", "--steps", "5", "--set", "model.n_layer=8", "--set", "train.eval_every=0"]


def test_interleaved_checkpoint_resumes_bitwise_at_its_v(tmp_path):
    full = tmp_path / "full.jsonl"
    proc = launch_forked(2, ARGS + ["--set", "train.virtual_stages=2", "--save", str(tmp_path / "ck"),
                                    "--save-every", "3", "--metrics-out", str(full)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    checkpoint = tmp_path / "ck" / "step00000003"
    resumed = tmp_path / "resumed.jsonl"
    proc = launch_forked(2, ARGS + ["--set", "train.virtual_stages=2", "--load", str(checkpoint),
                                    "--metrics-out", str(resumed)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    again = {m["step"]: m for m in read_metrics(resumed)}
    for m in read_metrics(full):
        if m["step"] > 3:
            assert (m["loss"], m["grad_norm"]) == (again[m["step"]]["loss"], again[m["step"]]["grad_norm"]), m["step"]
    proc = launch_forked(2, ARGS + ["--load", str(checkpoint)])
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "saved at train.virtual_stages=2 with train.virtual_stages=1" in proc.stderr, proc.stderr[-2000:]
