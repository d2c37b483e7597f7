"""The DeepSpeed config, generated from the recipe and the derived layout.

The learning-rate schedule is passed to `deepspeed.initialize` as an object (launch/optim/lr_schedule.py).
"""
from typing import Any, Dict

from launch.analysis.engine_memory import built_zero_stage
from launch.config.layout import Layout
from launch.config.recipe import Recipe, deep_merge
from launch.errors import ConfigError
from model.gpt.pipe import pipeline_config


def batch_config(layout: Layout) -> Dict[str, int]:
    """DeepSpeed's three batch keys, from the layout that derived and checked them. DeepSpeed's
    data axis holds dp x cp ranks (model/parallel/state.py) and it checks train_batch_size =
    micro x accumulation x that axis: each CP rank's shards of a replica's b samples count as its
    b, so its train_batch_size is B x cp, with the same B samples."""
    return {"train_batch_size": layout.global_batch_size * layout.cp,
            "train_micro_batch_size_per_gpu": layout.micro_batch_size,
            "gradient_accumulation_steps": layout.grad_accum_steps}


def deepspeed_config(recipe: Recipe, layout: Layout) -> Dict[str, Any]:
    train_cfg = recipe.train
    config: Dict[str, Any] = {
        **batch_config(layout),
        "optimizer": {
            "type": "AdamW",
            # torch's AdamW: same maths on CPU and GPU, and no CUDA extension to JIT-build.
            "params": {"lr": train_cfg.lr, "betas": [train_cfg.beta1, train_cfg.beta2], "eps": train_cfg.eps,
                       "weight_decay": train_cfg.weight_decay, "torch_adam": True},
        },
        "gradient_clipping": train_cfg.grad_clip,
        "zero_optimization": {"stage": built_zero_stage(train_cfg.zero_stage, train_cfg.precision,
                                                        layout.dp * layout.cp, recipe.model.moe.enabled)},
        "steps_per_print": 10 ** 9,  # we print our own metrics line
        "wall_clock_breakdown": False,
    }
    if train_cfg.optimizer == "muon":  # our optimizer (launch/optim/muon.py), which ZeRO-1 has not vetted
        del config["optimizer"]  # the client optimizer replaces it
        config["zero_allow_untested_optimizer"] = True
    if train_cfg.precision == "bf16":
        config["bf16"] = {"enabled": True}
        # Accumulating micro-batch gradients in bf16 loses bits; fp32 is docs/design.md contract 8.
        config["data_types"] = {"grad_accum_dtype": "fp32"}
        # And so does summing them over the data-parallel replicas: DeepSpeed casts the fp32
        # buffer to the model dtype for its all-reduce unless told otherwise (Megatron-LM reduces
        # bf16 runs' gradients in fp32 too). Twice the DP bytes; a recipe may set bf16 back.
        config["communication_data_type"] = "fp32"
    elif train_cfg.precision == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 16, "loss_scale_window": 1000}
    deep_merge(config, pipeline_config(recipe.model.sequence_parallel))
    deep_merge(config, recipe.deepspeed)
    return config


def evaluation_config(recipe: Recipe, layout: Layout) -> Dict[str, Any]:
    """The config of an engine that only runs `eval_batch` (launch/evaluation/evaluation.py): the same
    batch keys and pipeline settings, no optimizer (the pipeline engine needs one only for
    train_batch), and fp32 whatever the recipe trains in, so every layout and the transformers
    model agree to rounding."""
    return {**batch_config(layout), "steps_per_print": 10 ** 9,
            **pipeline_config(recipe.model.sequence_parallel)}


def check_deepspeed_section(recipe: Recipe, layout: Layout) -> None:
    """Raise ConfigError (one line) where DeepSpeed's own config parser refuses the config the
    recipe's `deepspeed:` keys make: its pydantic sections check types and ranges, but only inside
    deepspeed.initialize, after the process group has started. Parsed here on one process with
    batch keys of one data rank (the real ones are ours, derived and checked by the layout)."""
    if not recipe.deepspeed:
        return
    from deepspeed.runtime.config import DeepSpeedConfig
    config = deepspeed_config(recipe, layout)
    config.update(train_batch_size=layout.micro_batch_size * layout.grad_accum_steps)
    try:
        DeepSpeedConfig(config)
    except Exception as e:  # pydantic's ValidationError, AssertionError, ValueError, TypeError...
        lines = [line.strip() for line in str(e).splitlines()
                 if line.strip() and not line.strip().startswith("For further information")]
        raise ConfigError(f"deepspeed section {recipe.deepspeed!r}: DeepSpeed refuses it: "
                          f"{'; '.join(lines[:4]) or type(e).__name__}") from None
