"""A checkpoint's complete.json as launch/checkpoints/store.py: save writes it, for the tests that
hand-write one (no training): every key of the current format, each overridable."""
from typing import Any, Dict

from launch.checkpoints.manifest import CHECKPOINT_FORMAT


def complete_json(recipe: Dict[str, Any], layout: Dict[str, Any], **changes: Any) -> Dict[str, Any]:
    """`recipe`: the saved recipe (launch/feed/run_inputs.py: resolved_recipe_dict for one that
    find_checkpoint takes); `layout`: tp, pp, dp and what else differs from cp = ep = 1, one chunk per
    pipeline rank and a pipeline cut by DeepSpeed (parts []). Step 5 of 16-sample steps, saved by
    ZeRO-`recipe`'s stage, no files."""
    layout = {"cp": 1, "ep": 1, "virtual_stages": 1, "parts": [], "chunk_parts": [], **layout}
    meta = {"format": CHECKPOINT_FORMAT, "step": 5, "samples": 80, "layout": layout, "recipe": recipe,
            "engine_zero_stage": recipe["train"]["zero_stage"],
            "world_size": layout["tp"] * layout["pp"] * layout["dp"] * layout["cp"], "wandb_run_id": None,
            "data_state": None, "data_fingerprint": None, "data_origin_samples": 0, "parent": None,
            "layout_auto": None, "files": {}}
    meta.update(changes)
    return meta
