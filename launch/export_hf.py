"""Export a checkpoint as a transformers model directory (GPT-2; Llama for `arch: llama`; Mixtral,
Qwen3-MoE or OLMoE for a mixture of experts, docs/checkpoints.md):
`python launch/export_hf.py --load CKPT --out DIR [--tokenizer NAME_OR_PATH]`.

Reads DeepSpeed's per-layer weight files of the checkpoint (one per pipeline layer and TP
rank), merges the TP shards and the pipeline stages with `model/hf/convert.py`, strips the vocab
padding and writes `config.json`, `model.safetensors`, `generation_config.json` and the
tokenizer, so `AutoModelForCausalLM.from_pretrained(DIR)` and `pipeline("text-generation",
model=DIR)` work. One process, no DeepSpeed engine, no torch.distributed: any layout exports
on a laptop. Only the model weights are read, never the optimizer state.
"""
import argparse
import sys
from typing import List, Optional

from launch.checkpoints.hf_export import export
from launch.config.cli import OneLineErrorParser, checkpoint_location, local_path
from launch.config.recipe import refuse_credentials
from launch.errors import ConfigError, report_bad_input


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    p = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", type=checkpoint_location, required=True,
                   help="a save directory (its latest complete checkpoint) or one checkpoint directory; local, "
                        "s3:// or gs://")
    p.add_argument("--out", type=local_path, required=True, help="the transformers model directory to write")
    p.add_argument("--tokenizer", help="tokenizer name or directory (default: the checkpoint's data.tokenizer)")
    p.add_argument("--overwrite", action="store_true",
                   help="write into a non-empty --out (files of the same name are replaced, others kept)")
    args = p.parse_args(argv)
    refuse_credentials("--tokenizer", args.tokenizer)  # its load's message repeats it
    return args


def main(argv: Optional[List[str]] = None) -> int:
    try:
        args = parse_args(argv)
        load = args.load
        if isinstance(load, str):  # object storage: downloaded into the local staging directory first
            from launch.checkpoints.object_store import fetch_checkpoint
            load = fetch_checkpoint(load)
        out = export(load, args.out, args.tokenizer, args.overwrite)
    except ConfigError as e:
        return report_bad_input(e)
    print(f"exported {args.load} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
