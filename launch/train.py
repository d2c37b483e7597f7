"""Train a GPT with 3D parallelism: `deepspeed launch/train.py --tp 4 --pp 4` (dp = world / 16).

On CPU: `deepspeed --num_gpus 16 launch/train.py --tp 4 --pp 4` runs the same layout as 16
processes over gloo. `python launch/train.py` runs one process.
Order of work: parse and validate everything (exit 2 on bad input, launch/trainer/startup.py),
then start torch.distributed, build the pipeline and DeepSpeed engine, then train
(launch/trainer/loop.py).
"""
import os
import sys
from typing import List, Optional

from data.spec import DataError
from launch.config.cli import parse_training_args, training_recipe
from launch.errors import AlreadyFinished, ConfigError, report_bad_input


def main(argv: Optional[List[str]] = None) -> int:
    try:
        args = parse_training_args(argv, __doc__)
        recipe = training_recipe(args)  # a bad recipe file or --set is refused within a second, before torch is imported
        if not args.verbose:
            from launch.engine.console import silence_known_noise
            silence_known_noise()
        from launch.trainer.startup import prepare_training_job
        job = prepare_training_job(args, recipe)
    except (ConfigError, DataError) as e:
        return report_bad_input(e)
    except AlreadyFinished as e:
        if os.environ.get("RANK", "0") == "0":
            print(e, flush=True)
        return 0
    try:
        from launch.trainer.loop import run_training
        run_training(job)
    except Exception as e:  # one line naming this rank and the cause; every other rank stops too
        from launch.resilience.failure import report_failure
        report_failure(e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
