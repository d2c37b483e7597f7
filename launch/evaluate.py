"""Loss and perplexity of a checkpoint or of GPT-2-format weights, at any layout:
`deepspeed --num_gpus 4 launch/evaluate.py --tp 2 --pp 2 --load CKPT [--recipe R] [--set ...]`
(or `python launch/evaluate.py --init-from-hf DIR` in one process).

The weights decide the model's shape (the checkpoint's recipe, or the GPT-2 config); the
recipe decides the data and the batch: the recipe of the checkpoint by default, `--recipe`
otherwise (recipes/demo.yaml for --init-from-hf). The model runs through the same pipeline
code as training (`build_pipeline`, `engine.eval_batch`); a checkpoint's shards are merged and
re-split for this layout (`model/convert.py`), so every layout gives the same numbers. The
data: the first --batches global batches of the validation windows, or of the training
stream when the recipe holds out no validation data.
"""
import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from launch.config import ConfigError, load_recipe, report_bad_input  # noqa: E402
from launch.layout import derive_layout  # noqa: E402
from launch.train import DEFAULT_RECIPE, _Parser, ensure_single_process_env, on_cpu, prepare  # noqa: E402

SHAPE_KEYS = ("n_layer", "n_head", "n_embd", "seq_len", "vocab_size")


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    p = _Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--load", type=Path, help="a save directory (its latest complete checkpoint) or one checkpoint")
    source.add_argument("--init-from-hf", metavar="DIR_OR_NAME", help="a transformers GPT-2 model directory")
    p.add_argument("--recipe", type=Path, help="data and batch sizes (default: the checkpoint's recipe, "
                   "or recipes/demo.yaml with --init-from-hf)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (stages)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe field, e.g. --set data.val_fraction=0.05 (repeatable)")
    p.add_argument("--batches", type=int, help="global batches to evaluate (default: train.eval_batches)")
    p.add_argument("--json-out", type=Path, help="write {loss, ppl, ...} here")
    p.add_argument("--local_rank", "--local-rank", type=int, default=0, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _as_overrides(values: Dict[str, Any], prefix: str) -> List[str]:
    """{'model': {'n_layer': 4}} -> ['model.n_layer=4']: `--set` items (JSON is YAML)."""
    out = []
    for key, value in values.items():
        if isinstance(value, dict):
            out += _as_overrides(value, f"{prefix}{key}.")
        else:
            out.append(f"{prefix}{key}={json.dumps(value)}")
    return out


def resolve(args: argparse.Namespace):
    """The recipe: the weights' model shape, the data and batch of --recipe (or the checkpoint's),
    then --set; read from complete.json or config.json only, no weights yet."""
    if args.load is not None:
        from launch.checkpoint import find_checkpoint
        saved = find_checkpoint(args.load).meta["recipe"]
        weights = _as_overrides(saved if args.recipe is None else {"model": saved["model"]}, "")
        shape = {k: saved["model"][k] for k in SHAPE_KEYS}
    else:
        from launch.hf_init import read_hf_config
        hf = read_hf_config(args.init_from_hf)
        shape = dict(n_layer=hf.n_layer, n_head=hf.n_head, n_embd=hf.n_embd, seq_len=hf.n_positions,
                     vocab_size=hf.vocab_size)
        weights = _as_overrides({"model": shape}, "")
    # The weights' shape first, the user's --set last: a --set model.* that contradicts the
    # weights is caught below instead of silently ignored.
    recipe = load_recipe(args.recipe or DEFAULT_RECIPE, weights + args.overrides)
    for key, value in shape.items():
        if getattr(recipe.model, key) != value:
            raise ConfigError(f"model.{key}={getattr(recipe.model, key)!r} but the weights have {value!r}: "
                              f"the weights decide the model's shape; drop --set model.{key}")
    return recipe


def load_weights(pipe, args: argparse.Namespace, config, state) -> None:
    """This rank's shards of the checkpoint (merged, re-split for this layout) or HF weights."""
    if args.init_from_hf is not None:
        from launch.hf_init import init_from_hf
        init_from_hf(pipe, args.init_from_hf, config, state)
        return
    from launch.export_hf import read_checkpoint_weights
    from model.convert import load_dense_into
    _, _, dense = read_checkpoint_weights(args.load)
    load_dense_into(pipe, dense, config.n_layer, state.tp_rank, state.tp_size, config.padded_vocab_size(state.tp_size))


def run(args: argparse.Namespace, recipe, layout, data, vocab_size: int, n_batches: int) -> Dict[str, Any]:
    import deepspeed

    from launch.distributed import shut_down_distributed, start_rank
    from launch.metrics import is_logging_rank
    from model.parallel_state import init_parallel_state
    from model.pipe import build_pipeline, pipeline_config

    start_rank(layout.world_size, recipe.train.dist_timeout_s)
    state = init_parallel_state(layout.tp, layout.pp)
    config = recipe.gpt_config(vocab_size)
    pipe = build_pipeline(config, state)
    load_weights(pipe, args, config, state)
    # No optimizer: the pipeline engine needs one for train_batch only. fp32 whatever the
    # recipe trains in, so every layout and the transformers model agree to rounding.
    engine, _, _, _ = deepspeed.initialize(model=pipe, config={
        "train_batch_size": layout.global_batch_size, "train_micro_batch_size_per_gpu": layout.micro_batch_size,
        "gradient_accumulation_steps": layout.grad_accum_steps, "steps_per_print": 10 ** 9,
        **pipeline_config(config.sequence_parallel)})
    on_validation = data.has_validation
    if on_validation:
        batches = data.val_batches(state.dp_rank, layout.dp, n_batches)
    else:
        batches = data.train_batches(state.dp_rank, layout.dp)
    # One eval_batch is one global batch (grad_accum_steps micro-batches per pipeline), averaged
    # over micro-batches and dp ranks by DeepSpeed and broadcast to every stage.
    loss = sum(engine.eval_batch(data_iter=batches).item() for _ in range(n_batches)) / n_batches
    result = {"loss": loss, "ppl": math.exp(min(loss, 50.0)), "batches": n_batches,
              "tokens": n_batches * layout.global_batch_size * recipe.seq_len,
              "data": "validation" if on_validation else "train", "source": str(args.load or args.init_from_hf),
              "layout": vars(layout)}
    if is_logging_rank(state.global_rank):
        print(f"loss {loss:.6f} ppl {result['ppl']:.4f} ({n_batches} global batches of {result['data']} data, "
              f"tp={layout.tp} pp={layout.pp} dp={layout.dp})", flush=True)
        if args.json_out is not None:
            args.json_out.write_text(json.dumps(result, indent=1) + "\n")
    shut_down_distributed()
    return result


def main(argv: Optional[List[str]] = None) -> int:
    from data.spec import DataError
    try:
        args = parse_args(argv)
        recipe = resolve(args)
        ensure_single_process_env()
        layout = derive_layout(recipe, int(os.environ["WORLD_SIZE"]), args.tp, args.pp, on_cpu())
        data, vocab_size = prepare(recipe, layout)
        if args.init_from_hf is not None:  # the parts of its config the shape check above does not see
            from launch.hf_init import check_hf_source
            check_hf_source(args.init_from_hf, recipe.gpt_config(vocab_size), resuming=False)
        wanted = recipe.train.eval_batches if args.batches is None else args.batches
        if wanted < 1:
            raise ConfigError(f"--batches {wanted} must be >= 1")
        n_batches = data.eval_global_batches(wanted) if data.has_validation else wanted
        if n_batches < 1:
            raise ConfigError(f"the validation data holds fewer windows than one global batch "
                              f"({layout.global_batch_size}); raise data.val_fraction or lower train.global_batch_size")
    except (ConfigError, DataError) as e:
        return report_bad_input(e)
    run(args, recipe, layout, data, vocab_size, n_batches)
    return 0


if __name__ == "__main__":
    sys.exit(main())
