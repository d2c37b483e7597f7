import sys
from pathlib import Path

# The repository root, so tests import model/, data/ and launch/ as the scripts do.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pytest  # noqa: E402

from launcher import TINY, launch, read_metrics  # noqa: E402

# The layouts of the acceptance test (DESIGN.md section 3): every one trains the same model.
REFERENCE = (1, 1, 1)
LAYOUTS = [(2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 2), (4, 4, 1)]
SP_LAYOUTS = [(2, 2, 2, "sp"), (4, 1, 1, "sp"), (4, 4, 1, "sp")]  # sequence parallelism on
STEPS = 5
SAVE_AT = 3  # each parity run also saves a checkpoint here, for the resume tests


def layout_id(layout) -> str:
    return "-".join([f"tp{layout[0]}", f"pp{layout[1]}", f"dp{layout[2]}"] + list(layout[3:]))


class ParityRuns:
    """recipes/tiny.yaml for STEPS steps at a layout, launched when a test first asks for it and
    kept for the session (so `-k sp` launches only the reference and the SP layouts); each run
    saves a checkpoint after step SAVE_AT. runs[layout] = {metrics, dir (checkpoints under
    dir/ck), stdout}. (1,1,2) also writes a wandb offline run."""

    def __init__(self, tmp_path_factory):
        self.tmp_path_factory, self.done = tmp_path_factory, {}

    def __getitem__(self, layout):
        if layout not in self.done:
            tp, pp, dp = layout[:3]
            sp = ["--set", "model.sequence_parallel=true"] if "sp" in layout else []
            tmp = self.tmp_path_factory.mktemp(layout_id(layout))
            wandb = ["--wandb", "offline"] if layout == (1, 1, 2) else []
            proc = launch(tp * pp * dp, ["--recipe", str(TINY), "--tp", str(tp), "--pp", str(pp),
                                         "--steps", str(STEPS), "--metrics-out", str(tmp / "metrics.jsonl"),
                                         "--save", str(tmp / "ck"), "--save-every", str(SAVE_AT)] + sp + wandb,
                          env={"WANDB_DIR": str(tmp)})
            assert proc.returncode == 0, f"layout {layout} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
            self.done[layout] = {"metrics": read_metrics(tmp / "metrics.jsonl"), "dir": tmp, "stdout": proc.stdout}
        return self.done[layout]


@pytest.fixture(scope="session")
def parity_runs(tmp_path_factory):
    return ParityRuns(tmp_path_factory)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: a long multi-launch test (deselect with -m \"not slow\")")
