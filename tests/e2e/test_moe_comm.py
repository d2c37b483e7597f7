"""--comm-counts of the expert-parallel all-to-alls equal the planner's formulas
(launch/analysis/experts.py: ep_comm_per_rank_per_step), at ep = 2 and ep = 4.

The MoE parity runs with ep > 1 count their collectives (conftest.py: parity_runs); per MoE block per
micro-batch a rank hands the count exchange its E counts and the dispatch its N*k routed rows
(exact per rank), while what it hands the return all-to-all, and the dispatch's gradient, are the
rows its experts received: exact only summed over the ranks, so those are compared as sums."""
import json

import pytest

from helpers.parity_runs import STEPS, expert_parallel_size
from launch.analysis.experts import ep_comm_per_rank_per_step
from launch.config.recipe import load_recipe
from helpers.launcher import MOE_TINY

LAYOUTS = [(1, 1, 2, "moe", "ep2"), (1, 2, 4, "moe", "ep4")]
PER_RANK_EXACT = ("ep-counts",)


def _stage_blocks(stdout: str) -> dict:
    """{stage: MoE blocks on it} from the role map (every block of moe-tiny is MoE)."""
    stages = {}
    for line in stdout.splitlines():
        if line.strip().startswith("stage ") and "layers" in line:
            stage = int(line.split()[1].rstrip(":"))
            stages[stage] = line.split("|")[0].count("block ")
    return stages


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: "-".join(map(str, layout)))
def test_expert_all_to_alls_equal_the_planner(parity_runs, layout):
    run = parity_runs[layout]
    tp, pp, dp = layout[:3]
    ep = expert_parallel_size(layout)
    recipe = load_recipe(MOE_TINY, [])
    model, train = recipe.model.resolved(), recipe.train
    microbatches = train.global_batch_size // (train.micro_batch_size * dp)
    blocks = _stage_blocks(run["stdout"])
    assert sum(blocks.values()) == model.n_layer
    ranks = [json.loads(path.read_text()) for path in sorted((run["dir"] / "comm").glob("rank*.json"))]
    assert len(ranks) == tp * pp * dp
    for step in range(1, STEPS + 1):
        measured_sum, formula_sum = {}, {}
        for rank in ranks:
            want = {purpose: volume for (purpose, role, op), volume in ep_comm_per_rank_per_step(
                model, ep, 1, train.micro_batch_size, microbatches, blocks[rank["coord"]["pipe"]], 4).items()}
            got = {e["purpose"]: (e["calls"], e["elements"], e["bytes"]) for e in rank["phases"][f"step {step}"]
                   if e["role"] == "ep" and e["op"] == "all_to_all_single"}
            assert set(got) == set(want) == {"ep-counts", "ep-dispatch", "ep-combine"}, (rank["rank"], got, want)
            for purpose in want:
                assert got[purpose][0] == want[purpose][0], (rank["rank"], step, purpose, got, want)  # calls
                if purpose in PER_RANK_EXACT:
                    assert got[purpose] == want[purpose], (rank["rank"], step, purpose)
                for i, side in ((0, measured_sum), (1, formula_sum)):
                    volume = (got, want)[i][purpose]
                    side[purpose] = tuple(a + b for a, b in zip(side.get(purpose, (0, 0, 0)), volume))
        assert measured_sum == formula_sum, (layout, step, measured_sum, formula_sum)
