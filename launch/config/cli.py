"""The training command line (launch/train.py's flags; bench/step/profile_step.py parses the same) and
the parser every entry point uses: a bad flag is one line and exit code 2, like any bad input."""
import argparse
from pathlib import Path
from typing import List, Optional

from launch.config.recipe import WANDB_MODES, Recipe, load_recipe, refuse_credentials
from launch.errors import REPO_ROOT, ConfigError

DEFAULT_RECIPE = REPO_ROOT / "recipes" / "demo.yaml"


class OneLineErrorParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line and exit 2, like every other bad input
        raise ConfigError(f"{message} (see --help)")


def local_path(text: str) -> Path:
    """Every entry point's path flags: a file or directory on this machine's filesystems. A URL
    (s3://bucket/run) made a Path would be a relative directory named `s3:`, written in the working
    directory."""
    if "://" in text:
        refuse_credentials("the path", text)  # the message below repeats it
        raise argparse.ArgumentTypeError(
            f"{text!r} is a URL: recipes, metrics and the other files are read and written on a local or shared "
            f"filesystem; give a path there (object storage can be mounted, e.g. with mountpoint-s3 or gcsfuse; "
            f"training's --save and --load take s3:// and gs:// themselves)")
    return Path(text)


CHECKPOINT_SCHEMES = ("s3://", "gs://", "gcs://")
"""The object stores --save and --load take (launch/checkpoints/object_store.py)."""


def checkpoint_location(text: str):
    """--save and --load: a local path, or a URL of object storage (s3://, gs://), kept as text:
    launch/checkpoints/object_store.py stages it through a local directory."""
    if text.startswith(CHECKPOINT_SCHEMES):
        refuse_credentials("the checkpoint URL", text)  # keys come from the environment, never the command line
        return text
    if "://" in text:
        refuse_credentials("the path", text)
        raise argparse.ArgumentTypeError(
            f"{text!r} is a URL: checkpoints are saved and loaded on a local or shared filesystem or on object "
            f"storage ({', '.join(s + '...' for s in CHECKPOINT_SCHEMES[:2])})")
    return Path(text)


def training_parser(description: str = "") -> OneLineErrorParser:
    """launch/train.py's flags, as docs/configuration.md's table lists them (tests/runtime/test_flag_table.py
    holds the two equal); the checks across flags are parse_training_args's."""
    p = OneLineErrorParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", type=local_path, default=DEFAULT_RECIPE, help="YAML recipe (default: %(default)s)")
    p.add_argument("--tp", type=int, help="tensor-parallel size (default 1)")
    p.add_argument("--pp", type=int, help="pipeline-parallel size (stages; default 1)")
    p.add_argument("--layout", choices=["auto"],
                   help="auto: the planner chooses tp, pp, cp, ep and the micro-batch for these processes from this "
                        "machine's calibration (made first if missing) or a known GPU's datasheet; --tp, --pp, --cp "
                        "and --ep given are kept (docs/planner-and-metrics.md)")
    p.add_argument("--auto-sweep", type=int, metavar="K",
                   help="with --layout auto: run the K fastest predicted layouts for a few steps each, then train the "
                        "fastest measured")
    p.add_argument("--cp", type=int, help="context-parallel size: ranks sharing each sequence (overrides train.cp)")
    p.add_argument("--ep", type=int, help="expert-parallel size: ranks of the data-parallel axis sharing each MoE "
                   "block's experts (overrides train.ep)")
    p.add_argument("--steps", type=int, help="optimizer steps (overrides train.steps)")
    p.add_argument("--seed", type=int, help="seed (overrides train.seed)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe field, e.g. --set train.lr=3e-4 (repeatable)")
    p.add_argument("--metrics-out", type=local_path, help="JSON lines, one per optimizer step")
    p.add_argument("--wandb", choices=WANDB_MODES, help="overrides wandb.mode")
    p.add_argument("--save", type=checkpoint_location, help="save checkpoints under this directory")
    p.add_argument("--save-every", type=int, default=0, metavar="N",
                   help="save every N steps (and always at the end, or when signalled)")
    p.add_argument("--keep-last", type=int, default=0, metavar="K", help="keep only the K newest checkpoints")
    p.add_argument("--load", type=checkpoint_location,
                   help="resume: a save directory (its latest complete checkpoint) or one "
                   "checkpoint directory; --steps stays the run's total")
    p.add_argument("--restart-data", action="store_true",
                   help="with --load: start the data order again at the resume step instead of continuing it "
                        "(needed when the data changed since the checkpoint: files, streams, shuffle_buffer...)")
    p.add_argument("--init-from-hf", metavar="DIR_OR_NAME",
                   help="start from GPT-2- or Llama-format (transformers) weights of the recipe's model shape")
    p.add_argument("--timeline", type=local_path, metavar="FILE.png",
                   help="draw the measured pipeline schedule (per-stage forward/backward times) of a few steps")
    p.add_argument("--timeline-steps", type=int, default=3, metavar="N",
                   help="steps --timeline records, after one warm-up step (default: %(default)s)")
    p.add_argument("--metrics-per-rank", action="store_true",
                   help="also write every rank's compute seconds per step (compute_s_by_rank) to --metrics-out; "
                   "by default a record keeps their max, median and slowest rank, overall and per stage")
    p.add_argument("--comm-counts", type=local_path, metavar="DIR",
                   help="count each collective's bytes per step into DIR/rank{R}.json (bench/step/comm_volume.py)")
    p.add_argument("--verbose", action="store_true",
                   help="show every library message, including the known-harmless ones launch/engine/console.py "
                   "silences")
    p.add_argument("--local_rank", "--local-rank", type=int, default=0, help=argparse.SUPPRESS)
    return p


def parse_training_args(argv: Optional[List[str]], description: str = "") -> argparse.Namespace:
    p = training_parser(description)
    args = p.parse_args(argv)
    refuse_credentials("--init-from-hf", args.init_from_hf)  # a hub id or a directory; a URL is logged
    if args.auto_sweep is not None and (args.layout != "auto" or args.auto_sweep < 1):
        raise ConfigError(f"--auto-sweep {args.auto_sweep} needs --layout auto and K >= 1 (the number of predicted "
                          f"layouts to measure)")
    given = {flag: getattr(args, flag) for flag in ("tp", "pp", "cp", "ep") if getattr(args, flag) is not None}
    if any(size < 1 for size in given.values()):  # `--tp 0` read as "not given" became 1, silently
        raise ConfigError(f"{' '.join(f'--{k} {v}' for k, v in given.items())}: each must be >= 1 (leave one out "
                          f"for 1{', or for --layout auto to choose' if args.layout == 'auto' else ''})")
    if args.layout is None:  # the axes not given are 1; with --layout auto the planner picks them
        args.tp = 1 if args.tp is None else args.tp
        args.pp = 1 if args.pp is None else args.pp
    if args.timeline_steps < 1:
        p.error(f"--timeline-steps {args.timeline_steps} must be >= 1")
    if args.save_every < 0 or args.keep_last < 0:
        raise ConfigError(f"--save-every {args.save_every} and --keep-last {args.keep_last} must be >= 0")
    if (args.save_every or args.keep_last) and args.save is None:
        raise ConfigError("--save-every and --keep-last need --save DIR")
    return args


def training_recipe(args: argparse.Namespace) -> Recipe:
    """The recipe file with --set, then the --steps / --seed / --cp / --ep / --wandb shorthands, applied."""
    overrides = list(args.overrides)
    if args.cp is not None:
        overrides.append(f"train.cp={args.cp}")
    if args.ep is not None:
        overrides.append(f"train.ep={args.ep}")
    if args.steps is not None:
        overrides.append(f"train.steps={args.steps}")
    if args.seed is not None:
        overrides.append(f"train.seed={args.seed}")
    if args.wandb is not None:
        overrides.append(f"wandb.mode={args.wandb}")
    return load_recipe(args.recipe, overrides)
