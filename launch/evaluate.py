"""Loss and perplexity of a checkpoint or of GPT-2- or Llama-format weights, at any layout:
`deepspeed --num_gpus 4 launch/evaluate.py --tp 2 --pp 2 --load CKPT [--recipe R] [--set ...]`
(or `python launch/evaluate.py --init-from-hf DIR` in one process); with `--tasks NAME[=PATH] ...`
also multiple-choice tasks (acc, acc_norm), the same at every layout.

The weights decide the model's shape; the recipe decides the data and the batch: the recipe of
the checkpoint by default, `--recipe` otherwise (recipes/demo.yaml for --init-from-hf). Every
layout gives the same numbers (launch/evaluation/evaluation.py).
"""
import argparse
import sys
from typing import List, Optional

from data.spec import DataError
from launch.config.cli import OneLineErrorParser, local_path
from launch.config.recipe import refuse_credentials
from launch.errors import ConfigError, report_bad_input


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    p = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--load", type=local_path, help="a save directory (its latest complete checkpoint) or one checkpoint")
    source.add_argument("--init-from-hf", metavar="DIR_OR_NAME", help="a transformers GPT-2 or Llama model directory or hub id")
    p.add_argument("--recipe", type=local_path, help="data and batch sizes (default: the checkpoint's recipe, "
                   "or recipes/demo.yaml with --init-from-hf)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (stages)")
    p.add_argument("--cp", type=int, help="context-parallel size (default: the recipe's train.cp)")
    p.add_argument("--ep", type=int, help="expert-parallel size of a mixture of experts (default: the recipe's train.ep)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe field, e.g. --set data.val_fraction=0.05 (repeatable)")
    p.add_argument("--batches", type=int, help="global batches to evaluate (default: train.eval_batches)")
    p.add_argument("--json-out", type=local_path, help="write {loss, ppl, ...} here")
    p.add_argument("--tasks", nargs="+", default=[], metavar="NAME[=PATH]",
                   help="multiple-choice tasks scored by log-likelihood: NAME=PATH of a JSON Lines file in HellaSwag's, "
                        "ARC's or PIQA's schema, or a hub task's name: hellaswag, arc_easy, arc_challenge, piqa "
                        "(docs/evaluation.md)")
    p.add_argument("--max-examples", type=int, default=0, metavar="N", help="score each task's first N examples")
    p.add_argument("--metrics-out", type=local_path,
                   help="append one JSON record per task: task, acc, acc_norm, n and every choice's log-likelihood")
    p.add_argument("--local_rank", "--local-rank", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    refuse_credentials("--init-from-hf", args.init_from_hf)  # read before the recipe; its result names it
    return args


def main(argv: Optional[List[str]] = None) -> int:
    try:
        args = parse_args(argv)
        from launch.evaluation.evaluation import prepare_evaluation
        job = prepare_evaluation(args)
    except (ConfigError, DataError) as e:
        return report_bad_input(e)
    from launch.evaluation.evaluation import evaluate_weights
    evaluate_weights(job)
    return 0


if __name__ == "__main__":
    sys.exit(main())
