"""The console of a default run shows our lines, not the library noise launch/engine/console.py names;
`--verbose` shows it again (so the noise is real and the filter is what hides it). Both runs fork their
ranks (helpers/launcher.py: launch_forked): the noise is what the ranks print while they run, and the
filter is the ranks' own (DeepSpeed's launcher prints none of it)."""
import pytest

from launch.engine.console import KNOWN_NOISE
from helpers.launcher import TINY, launch_forked

pytestmark = pytest.mark.slow  # multi-process training runs (the fast tier: tests/e2e/test_parity.py)
# DeepSpeed's PipelineModule prints these on rank 0; the role map says the same. (Its listing of the
# cut, "stage=0 layers=", is gone: model/gpt/pipe.py sets the cut itself, launch/analysis/partition.py.)
DEEPSPEED_PRINTS = ["SEED_LAYERS=", "Using topology:"]
NOISE = DEEPSPEED_PRINTS + [message for _, message, _ in KNOWN_NOISE]


def test_default_console_is_free_of_known_noise_and_verbose_shows_it(parity_runs):
    quiet = parity_runs[(1, 2, 1)]  # pp=2: the tied-weight broadcast runs
    assert "step 5/5" in quiet["stdout"]
    assert [n for n in NOISE if n in quiet["stdout"] + quiet["stderr"]] == []
    loud = launch_forked(2, ["--recipe", str(TINY), "--pp", "2", "--steps", "1", "--set", "train.eval_every=0",
                             "--verbose"])
    assert loud.returncode == 0, loud.stdout[-3000:] + loud.stderr[-3000:]
    shown = [n for n in NOISE if n in loud.stdout + loud.stderr]
    assert shown == DEEPSPEED_PRINTS + [KNOWN_NOISE[0][1]], shown  # all_gather_into_tensor needs tp > 1
