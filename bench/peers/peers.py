"""Ours against megatron-core, side by side: the same shapes, initial weights, batches and
optimizer settings; per-step loss differences and the tokens/s ratio ours / megatron-core.

    bash bench/peers/peers_setup.sh          # once: .venv-megatron (this project + megatron-core 0.19.2 + triton)
    .venv-megatron/bin/python bench/peers/peers.py [--archs gpt2,llama] [--layouts 2x1,1x2,1x1]
                                                   [--rounds 3] [--steps 8] [--timed-from 3] [--set KEY=VALUE] [--json]

Both sides are launched through DeepSpeed's launcher with one command line each round:
- ours: `launch/train.py`, the real training path (engine, loop, metrics, heartbeat, everything);
- megatron-core: `bench/peers/megatron_peer.py`, which reads that same command line the way train.py
  does (recipe, `--set`, layout, data) and trains megatron-core's GPTModel on it.
The command: the tiny recipes at a small shape (4 layers, hidden 256, 8 heads, seq 128, the
builtin tokenizer's 4,096 tokens, 8 micro-batches of 2 sequences), fp32, dropout 0, no clipping
(train.grad_clip=0), no evaluation, `--init-from-hf` a transformers checkpoint this bench writes
first with seeded random weights (nothing is downloaded). A layout "TxP" is tp T, pp P on T*P
processes (dp 1), each of --threads threads (OMP_NUM_THREADS, which both sides' ranks follow).

Rounds alternate ours, megatron-core, ours, ... so a shared machine's drift hits both alike. A
round's tokens/s is over the loop iterations of steps --timed-from on (their metrics lines'
`elapsed_s`: ours' whole loop, not only `train_batch`; start-up and warm-up steps excluded). Reported: the largest per-step loss difference
over every round (the same run repeats bit for bit, so rounds agree), each round's ratio and their
median. Times from CPU processes on a shared machine: compare only runs made side by side.
Results, and where a step's time goes (bench/peers/step_parts.py): docs/performance.md, "Against megatron-core".
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench import REPO

RECIPES = {"gpt2": REPO / "recipes" / "tiny.yaml", "llama": REPO / "recipes" / "llama-tiny.yaml"}
SHAPE = ["model.n_layer=4", "model.n_embd=256", "model.n_head=8", "model.seq_len=128",
         "train.micro_batch_size=2", "train.global_batch_size=16", "train.grad_clip=0", "train.eval_every=0"]
LLAMA_SHAPE = ["model.n_kv_head=2", "model.ffn_hidden_size=688"]  # grouped-query: 4 query heads per kv head
LOSS_TOLERANCE = 1e-5


def train_argv(arch: str, tp: int, pp: int, steps: int, hf_dir: Path, metrics: Path, overrides=()) -> list:
    argv = ["--recipe", str(RECIPES[arch]), "--tp", str(tp), "--pp", str(pp), "--steps", str(steps),
            "--init-from-hf", str(hf_dir), "--metrics-out", str(metrics)]
    for item in SHAPE + (LLAMA_SHAPE if arch == "llama" else []) + list(overrides):
        argv += ["--set", item]
    return argv


def write_hf_checkpoint(argv: list, out: Path) -> None:
    """A transformers GPT-2 or Llama model of the recipe's shape, seeded random weights, saved."""
    import torch

    from launch.config.cli import parse_training_args, training_recipe
    from launch.feed.run_inputs import load_checked_tokenizer
    recipe = training_recipe(parse_training_args(argv))
    tokenizer, vocab_size = load_checked_tokenizer(recipe)
    config = recipe.gpt_config(vocab_size, tokenizer.eos_token_id)
    torch.manual_seed(recipe.train.seed)
    if config.arch == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        from model.hf.gpt2 import gpt2_config_kwargs
        model = GPT2LMHeadModel(GPT2Config(**gpt2_config_kwargs(config)))
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        from model.hf.llama import llama_config_kwargs
        model = LlamaForCausalLM(LlamaConfig(**llama_config_kwargs(config)))
    model.save_pretrained(out)


def launch(script: Path, procs: int, argv: list, threads: int) -> subprocess.CompletedProcess:
    """`script` on `procs` processes of `threads` threads each, through DeepSpeed's launcher; the
    finished process (its output captured), or SystemExit with its output's tail if it failed."""
    from launch.engine.distributed import launcher_command
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    cmd = launcher_command(procs, script) + argv  # both sides' ranks take OMP_NUM_THREADS threads
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"{script.name} failed (exit {proc.returncode})")
    return proc


def read_steps(path: Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines()]


def loop_tokens_per_s(steps: list, timed_from: int) -> float:
    """Tokens over the loop's wall time from the end of step timed_from - 1 to the end of the last:
    whole iterations of each side's loop (ours: train_batch and everything launch/trainer/loop.py
    does around it), from the `tokens` and `elapsed_s` of the metrics lines."""
    first, last = steps[timed_from - 2], steps[-1]
    return (last["tokens"] - first["tokens"]) / (last["elapsed_s"] - first["elapsed_s"])


def compare(arch: str, tp: int, pp: int, args, work: Path) -> dict:
    hf_dir = work / f"{arch}-hf"
    if not hf_dir.exists():
        write_hf_checkpoint(train_argv(arch, tp, pp, args.steps, hf_dir, work / "unused.jsonl"), hf_dir)
    sides = {"ours": REPO / "launch" / "train.py", "megatron": REPO / "bench" / "peers" / "megatron_peer.py"}
    rates, losses, max_diff = {name: [] for name in sides}, {}, 0.0
    for round_index in range(args.rounds):
        for name, script in sides.items():
            metrics = work / f"{arch}-{tp}x{pp}-{name}-{round_index}.jsonl"
            launch(script, tp * pp, train_argv(arch, tp, pp, args.steps, hf_dir, metrics, args.overrides), args.threads)
            steps = read_steps(metrics)
            if len(steps) != args.steps:  # a rank failed after some steps: its output says why
                raise SystemExit(f"{script.name} wrote {len(steps)} of {args.steps} steps to {metrics}")
            losses[name] = [s["loss"] for s in steps]
            rates[name].append(loop_tokens_per_s(steps, args.timed_from))
        diffs = [abs(a - b) for a, b in zip(losses["ours"], losses["megatron"])]
        max_diff = max([max_diff] + diffs)
        ratio = rates["ours"][-1] / rates["megatron"][-1]
        print(f"{arch} tp {tp} pp {pp} round {round_index + 1}: ours {rates['ours'][-1]:,.0f} tok/s, megatron-core "
              f"{rates['megatron'][-1]:,.0f} tok/s, ratio {ratio:.3f}; loss differences per step "
              + " ".join(f"{d:.1e}" for d in diffs), flush=True)
    ratios = [a / b for a, b in zip(rates["ours"], rates["megatron"])]
    result = {"arch": arch, "tp": tp, "pp": pp, "losses": losses, "max_loss_diff": max_diff,
              "tokens_per_s": rates, "ratios": ratios, "median_ratio": statistics.median(ratios)}
    verdict = "agree" if max_diff <= LOSS_TOLERANCE else f"DIFFER (tolerance {LOSS_TOLERANCE:.0e})"
    print(f"{arch} tp {tp} pp {pp}: losses {verdict}, largest difference {max_diff:.1e} over {args.steps} steps; "
          f"ratio ours / megatron-core per round {' '.join(f'{r:.3f}' for r in ratios)}, "
          f"median {result['median_ratio']:.3f}", flush=True)
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--archs", default="gpt2,llama")
    p.add_argument("--layouts", default="2x1,1x2,1x1", help="TxP: tp T, pp P on T*P processes (default %(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds per shape (default %(default)s)")
    p.add_argument("--steps", type=int, default=8, help="steps per run (default %(default)s)")
    p.add_argument("--timed-from", type=int, default=3, help="first step timed, >= 2 (default %(default)s: two warm-up)")
    p.add_argument("--threads", type=int, default=1, help="threads per process (default %(default)s)")
    p.add_argument("--work", type=Path, default=None, help="keep the checkpoints and metrics here (default: a temp dir)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="one more recipe override for both sides (repeatable), e.g. train.zero_stage=0")
    p.add_argument("--json", action="store_true", help="last line: every result as one JSON object")
    args = p.parse_args()
    if not 2 <= args.timed_from <= args.steps:
        p.error("--timed-from must be within --steps")
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        raise SystemExit("megatron-core is not installed here: run `bash bench/peers/peers_setup.sh`, then "
                         "`.venv-megatron/bin/python bench/peers/peers.py`")
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        results = [compare(arch, *map(int, layout.split("x")), args, work)
                   for arch in args.archs.split(",") for layout in args.layouts.split(",")]
    if args.json:
        print(json.dumps(results))
    return 0 if all(r["max_loss_diff"] <= LOSS_TOLERANCE for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
