"""Peak host memory per rank of `--init-from-hf` against its target: the rank's
shard plus the largest single tensor plus 1 GiB.

Creates a Llama of ~1.1B parameters locally (TinyLlama's shape by default: 22 layers, hidden
2048, 4 key/value heads, vocabulary 32000; random bf16 weights, as published checkpoints are
stored), saved with `save_pretrained` as sharded safetensors in a temporary directory (removed
at the end), then starts `deepspeed --num_gpus N` ranks of this script at (tp, pp). Each rank
does what a training run does before `deepspeed.initialize` (the optimizer is left out: its
states would not fit 8 ranks of a 1B model in a small machine's memory, and a run allocates
them after the load): `build_pipeline`, then `init_from_hf`, the path `--init-from-hf` takes;
and reports its peak RSS (VmHWM: everything since the process started, imports included), its
shard's fp32 bytes and its RSS after the imports. `--path dense` loads the plain way, the peer (the
whole model through transformers on every rank, then split), for a size that fits in memory.

    python bench/memory/hf_weights_memory.py [--ranks 8 --tp 2 --pp 4] [--layers 22 --hidden 2048] [--path lazy|dense]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench import REPO

GIB = 2 ** 30


def status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def create_llama(args, out: Path) -> dict:
    """A random Llama of the given shape saved as transformers does (bf16 safetensors shards)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=2048, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM._from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out, max_shard_size="1GB")
    sizes = {name: p.numel() for name, p in model.named_parameters()}
    del model
    return {"params": sum(sizes.values()), "largest": max(sizes.values())}


def worker(args) -> None:
    """One rank: build this stage as a run does, load the weights, report memory."""
    import torch

    from launch.checkpoints.hf_weights import check_hf_source, hf_dense_state_dict, hf_model_fields, init_from_hf
    from launch.checkpoints.hf_weights import read_hf_config
    from launch.engine.distributed import start_rank
    from model.config import GPTConfig
    from model.hf.convert import load_dense_into
    from model.parallel.state import init_parallel_state
    from model.gpt.pipe import build_pipeline
    after_imports = status_kib("VmRSS") * 1024
    start_rank(int(os.environ["WORLD_SIZE"]), 600)
    state = init_parallel_state(args.tp, args.pp)
    config = GPTConfig(**hf_model_fields(read_hf_config(args.source)), seq_len=64, seed=1)
    check_hf_source(args.source, config, resuming=False)
    pipe = build_pipeline(config, state)
    after_build = status_kib("VmHWM") * 1024
    if args.path == "lazy":
        init_from_hf(pipe, args.source, config, state)
    else:  # dense: the whole model in fp32 on every rank, then this rank's split
        load_dense_into(pipe, hf_dense_state_dict(args.source, config), config, state.tp_rank, state.tp_size,
                        config.padded_vocab_size(state.tp_size))
    shard = sum(p.numel() * p.element_size() for p in pipe.parameters())
    result = dict(rank=state.global_rank, tp_rank=state.tp_rank, stage=state.pp_rank, shard=shard,
                  after_imports=after_imports, hwm_after_build=after_build, peak=status_kib("VmHWM") * 1024)
    (Path(args.results) / f"rank{state.global_rank}.json").write_text(json.dumps(result))
    torch.distributed.barrier()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=4)
    p.add_argument("--layers", type=int, default=22)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=5632)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--path", choices=("lazy", "dense"), default="lazy")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--source", help=argparse.SUPPRESS)
    p.add_argument("--results", help=argparse.SUPPRESS)
    p.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)  # DeepSpeed's launcher passes it
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    from launch.engine.distributed import launcher_command
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        source, results = Path(tmp) / "llama", Path(tmp) / "results"
        results.mkdir()
        made = create_llama(args, source)
        cmd = launcher_command(args.ranks, Path(__file__).resolve()) + [
            "--worker", "--source", str(source), "--results", str(results), "--tp", str(args.tp),
            "--pp", str(args.pp), "--path", args.path]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"the ranks failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        ranks = sorted((json.loads(f.read_text()) for f in results.glob("rank*.json")), key=lambda r: r["rank"])
    largest = made["largest"] * 4  # fp32, as every rank holds it
    print(f"Llama of {made['params'] / 1e9:.3f}B parameters (bf16 safetensors; fp32 model {made['params'] * 4 / GIB:.2f} "
          f"GiB, largest tensor {largest / GIB:.3f} GiB fp32), {args.ranks} ranks at tp={args.tp} pp={args.pp}, "
          f"path {args.path}")
    print(f"{'rank':>4} {'stage':>5} {'tp':>2} {'shard GiB':>9} {'imports GiB':>11} {'after build':>11} "
          f"{'peak GiB':>8} {'target GiB':>10} {'peak/target':>11}")
    for r in ranks:
        target = r["shard"] + largest + GIB
        print(f"{r['rank']:>4} {r['stage']:>5} {r['tp_rank']:>2} {r['shard'] / GIB:9.3f} {r['after_imports'] / GIB:11.3f} "
              f"{r['hwm_after_build'] / GIB:11.3f} {r['peak'] / GIB:8.3f} {target / GIB:10.3f} {r['peak'] / target:11.2f}")
    worst = max(r["peak"] / (r["shard"] + largest + GIB) for r in ranks)
    print(f"worst peak / target: {worst:.2f} ({'within' if worst <= 1 else 'over'} the target)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
