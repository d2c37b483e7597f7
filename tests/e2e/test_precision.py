"""fp16 with DeepSpeed's dynamic loss scaling (the bf16 parity is in tests/e2e/test_parity.py).

recipes/tiny.yaml in fp16 at (1,1,1) and (2,2,2), 5 steps (conftest.py: parity_runs with the
"fp16" tag; DeepSpeed's CPU capability check lifted as conftest.py says). The loss scale starts
at 2**16 (launch/engine/ds_config.py) and, with the runs' loss_scale_window of 2, doubles in steps 3
and 5: its changes show in the metrics, the same at both layouts, and the
losses agree within fp16 rounding. The (2,2,2) checkpoint resumed at (1,2,1) (re-sharded)
continues with the saved scale and its growth counter, and the same losses within FP16_RTOL.
"""
import pytest

from helpers.parity_runs import (REFERENCE, SAVE_AT, STEPS, layout_id, precision_args, precision_env)
from helpers.launcher import TINY, launch_forked, read_metrics

pytestmark = pytest.mark.slow  # multi-process training runs (the fast tier: tests/e2e/test_parity.py)
FP16 = REFERENCE + ("fp16",), (2, 2, 2, "fp16")
# Measured (docs/performance.md, "Layout parity in bf16 and fp16"): losses within 5.1e-5 of (1,1,1),
# gradient norms within 7.9e-4; fp16's unit roundoff is 2**-11 = 4.9e-4, so one rounding of a
# gradient norm's terms already moves it that much. The resume compares against the same numbers.
FP16_RTOL = {"loss": 1e-3, "val_loss": 1e-3, "grad_norm": 1e-2}
INITIAL_SCALE, WINDOW = 2.0 ** 16, 2  # launch/engine/ds_config.py; conftest.py: FP16_SETTINGS


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def _assert_close(ref, got, what):
    for r, g in zip(ref, got):
        assert g["step"] == r["step"] and g["lr"] == r["lr"] and ("val_loss" in g) == ("val_loss" in r)
        for key, rtol in FP16_RTOL.items():
            if key in r:
                assert _rel(g[key], r[key]) <= rtol, (what, r["step"], key, g[key], r[key])


@pytest.mark.parametrize("layout", FP16, ids=layout_id)
def test_fp16_loss_scale_changes_and_layouts_agree(parity_runs, layout):
    got = parity_runs[layout]["metrics"]
    assert [m["step"] for m in got] == list(range(1, STEPS + 1))
    # No overflow in these steps. DeepSpeed's DynamicLossScaler doubles the scale in the update of
    # every step whose count of earlier steps since the last overflow is a positive multiple of
    # WINDOW: steps 3 and 5 here (the metrics read the scale after the step's update).
    assert [m["loss_scale"] for m in got] == [INITIAL_SCALE * 2 ** ((m["step"] - 1) // WINDOW) for m in got]
    assert got[-1]["loss"] < got[0]["loss"] - 0.1
    _assert_close(parity_runs[FP16[0]]["metrics"], got, layout)
    # fp16 trains the fp32 model: the first step (same weights and batch) agrees within fp16 rounding.
    assert _rel(got[0]["loss"], parity_runs[REFERENCE]["metrics"][0]["loss"]) <= FP16_RTOL["loss"]


def test_fp16_resume_at_another_layout_keeps_the_loss_scale(parity_runs, tmp_path):
    saved = parity_runs[FP16[1]]
    metrics = tmp_path / "resumed.jsonl"
    proc = launch_forked(2, ["--recipe", str(TINY), "--pp", "2", "--steps", str(STEPS), "--metrics-out", str(metrics),
                      "--load", str(saved["dir"] / "ck" / f"step{SAVE_AT:08d}")] + precision_args("fp16"),
                  env=precision_env("fp16"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "re-sharded from tp=2 pp=2 dp=2" in proc.stdout
    again, full = read_metrics(metrics), saved["metrics"][SAVE_AT:]
    # The scale saved after step 3 (2**17) and its growth counter (one good step since the last
    # doubling) carry over: 2**17 at step 4, 2**18 at step 5. A reset scale would read 2**16, 2**16;
    # a reset counter 2**17, 2**17.
    assert [m["loss_scale"] for m in again] == [m["loss_scale"] for m in full]
    _assert_close(full, again, "resumed at (1,2,1)")
