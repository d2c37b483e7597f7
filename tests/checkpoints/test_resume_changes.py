"""What a resume may change (launch/checkpoints/locate.py: check_compatible, find_checkpoint), checked
on complete.json contents before any engine: sequence parallelism may change and the shape may not;
the ZeRO stage may change where the state re-shards."""
import pytest

from helpers.manifest import complete_json


def test_sequence_parallelism_may_change_on_resume_the_shape_may_not(tmp_path):
    """SP leaves every weight's shape and shard alone: a checkpoint saved without it resumes with
    it; a different n_embd is still refused."""
    from launch.checkpoints.locate import CheckpointRef, check_compatible
    from launch.config.recipe import Recipe
    from launch.errors import ConfigError
    layout = {"tp": 2, "pp": 2, "dp": 1, "cp": 1, "ep": 1, "virtual_stages": 1, "parts": [], "chunk_parts": []}
    ref = CheckpointRef(tmp_path, "step00000005", complete_json(Recipe().to_dict(), layout))
    now = Recipe()
    now.model.sequence_parallel = True
    check_compatible(ref, now.to_dict(), layout)
    now.model.n_embd = 64
    with pytest.raises(ConfigError, match="model.n_embd=768"):
        check_compatible(ref, now.to_dict(), layout)


def test_a_change_of_zero_stage_re_shards_except_fp16_and_experts_at_zero_0(tmp_path):
    """fp32 on one data rank builds ZeRO-0 (launch/analysis/engine_memory.py:
    built_zero_stage), so a checkpoint re-shards between ZeRO-0 and ZeRO-1, at another layout or at
    the same one (a dp 1 checkpoint saved by ZeRO-1, as a recipe's deepspeed section can force).
    fp16's ZeRO-0 state and a mixture of experts' at ZeRO-0 do not re-shard: one line naming both stages and how to resume."""
    from launch.checkpoints.locate import CheckpointRef, check_compatible
    from launch.checkpoints.manifest import ENGINE_ZERO_STAGE
    from launch.config.recipe import Recipe
    from launch.errors import ConfigError

    def layout(tp, pp, dp, parts=(0, 3, 6)):
        return {"tp": tp, "pp": pp, "dp": dp, "cp": 1, "ep": 1, "virtual_stages": 1, "parts": list(parts),
                "chunk_parts": []}

    def recipe(**train):
        r = Recipe()
        r.model.n_layer = 4
        for key, value in {"precision": "fp32", **train}.items():
            setattr(r.train, key, value)
        return r.to_dict()

    def ref(saved_recipe, saved_layout, stage=None):
        meta = complete_json(saved_recipe, saved_layout)
        if stage is not None:  # else the recipe's
            meta[ENGINE_ZERO_STAGE] = stage
        return CheckpointRef(tmp_path, "step00000005", meta)

    check_compatible(ref(recipe(), layout(2, 1, 2), 1), recipe(), layout(2, 1, 1))  # ZeRO-1 -> ZeRO-0
    check_compatible(ref(recipe(), layout(1, 1, 1), 0), recipe(), layout(1, 1, 2))  # ZeRO-0 -> ZeRO-1
    check_compatible(ref(recipe(), layout(1, 1, 1), 1), recipe(), layout(1, 1, 1))  # forced ZeRO-1 -> ZeRO-0
    fp16 = recipe(precision="fp16", zero_stage=0)
    with pytest.raises(ConfigError, match=r"saved at tp=1 pp=1 dp=2 with ZeRO-0, this run is tp=2 pp=1 dp=1 with "
                                          r"ZeRO-0.*re-sharding fp16 needs ZeRO-1 on both sides, and the checkpoint's "
                                          r"is ZeRO-0; resume at the saved layout with --set train.zero_stage=0"):
        check_compatible(ref(fp16, layout(1, 1, 2)), fp16, layout(2, 1, 1))
    fp16_zero1 = recipe(precision="fp16")
    check_compatible(ref(fp16_zero1, layout(1, 1, 2)), fp16_zero1, layout(2, 1, 1))  # fp16 keeps ZeRO-1 at dp 1
    moe = recipe(zero_stage=0)
    moe["model"].update(arch="mixtral", moe={"num_experts": 4, "experts_per_token": 2})
    with pytest.raises(ConfigError, match="re-sharding a mixture of experts needs ZeRO-1 on both sides, and the run's"):
        check_compatible(ref(dict(moe, train=recipe()["train"]), layout(1, 1, 2), 1), moe, layout(1, 1, 1))
