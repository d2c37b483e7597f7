import sys
from pathlib import Path

# The repository root, so tests import model/, data/ and launch/ as the scripts do.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pytest  # noqa: E402

from launcher import TINY, launch, read_metrics  # noqa: E402

# The layouts of the acceptance test (DESIGN.md section 3): every one trains the same model.
REFERENCE = (1, 1, 1)
LAYOUTS = [(2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 2), (4, 4, 1)]
STEPS = 5
SAVE_AT = 3  # each parity run also saves a checkpoint here, for the resume tests


@pytest.fixture(scope="session")
def parity_runs(tmp_path_factory):
    """recipes/tiny.yaml for STEPS steps at every layout, once per session, each run saving a
    checkpoint after step SAVE_AT: {layout: metrics, dir (checkpoints under dir/ck), stdout}.
    (1,1,2) also writes a wandb offline run."""
    out = {}
    for tp, pp, dp in [REFERENCE] + LAYOUTS:
        tmp = tmp_path_factory.mktemp(f"tp{tp}pp{pp}dp{dp}")
        wandb = ["--wandb", "offline"] if (tp, pp, dp) == (1, 1, 2) else []
        proc = launch(tp * pp * dp, ["--recipe", str(TINY), "--tp", str(tp), "--pp", str(pp),
                                     "--steps", str(STEPS), "--metrics-out", str(tmp / "metrics.jsonl"),
                                     "--save", str(tmp / "ck"), "--save-every", str(SAVE_AT)] + wandb,
                      env={"WANDB_DIR": str(tmp)})
        assert proc.returncode == 0, f"layout {(tp, pp, dp)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        out[(tp, pp, dp)] = {"metrics": read_metrics(tmp / "metrics.jsonl"), "dir": tmp, "stdout": proc.stdout}
    return out
