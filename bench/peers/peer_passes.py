"""Our model's forward and backward passes against megatron-core's, in the same processes, taking
turns: the model alone, without either side's engine, loop or optimizer, and without the drift of
a shared machine between two launches (bench/peers/peers.py compares whole loops, one launch after the
other; there the same layout varies by 5-10% from one run to the next).

    bash bench/peers/peers_setup.sh          # once: .venv-megatron (this project + megatron-core 0.19.2 + triton)
    .venv-megatron/bin/python bench/peers/peer_passes.py [--archs gpt2,llama] [--tp 2] [--rounds 12]

Every rank of a tp-rank group (DeepSpeed's launcher, one thread each) builds both models from the
same transformers checkpoint (bench/peers/peers.py writes it: our `--init-from-hf` path for ours,
bench/peers/megatron_weights.py for megatron-core's GPTModel with the local layer spec), then runs
rounds of one step's micro-batches (bench/peers/peers.py's job: 8 micro-batches of 2 sequences of 128
tokens), each micro-batch's forward, loss and backward, ours then megatron-core's in odd rounds
and the other way round in even ones, all ranks starting each side together (a barrier). Ours is
our PipelineModule's forward (its layers in order at pp 1) and TokenMeanLoss as the engine calls
them; megatron-core's its GPTModel with the labels (its per-token loss), then the mean. Reported
(TP rank 0): the median seconds of each side over the rounds after two of warm-up, their ratio,
and the largest difference of the two sides' losses (the same weights and batches: the same work).
Results: docs/performance.md, "Against megatron-core"."""
import argparse
import os
import statistics
import sys
import time
from pathlib import Path

WARM_UP = 2


def run_rank(train_argv, rounds: int) -> int:
    """Inside one launched process: build both models, time the rounds, print the result on rank 0."""
    import torch

    from launch.checkpoints.hf_weights import init_from_hf
    from launch.config.cli import parse_training_args
    from launch.engine.distributed import init_distributed
    from launch.trainer.startup import prepare_training_job
    from model.gpt.pipe import build_pipeline
    from model.parallel.state import init_parallel_state
    job = prepare_training_job(parse_training_args(train_argv))
    recipe, layout = job.recipe, job.layout
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    init_distributed(recipe.train.dist_timeout_s)  # DeepSpeed's PipelineModule asks its comm for the rank
    from bench.peers.megatron_peer import loaded_model, token_losses
    config = recipe.gpt_config(job.vocab_size, job.data.tokenizer.eos_token_id)
    megatron = loaded_model(job, config)
    state = init_parallel_state(layout.tp, 1)
    ours = build_pipeline(config, state)
    init_from_hf(ours, job.args.init_from_hf, config, state)
    batches = job.data.train_batches(0, 1)
    micro_batches = [next(batches) for _ in range(layout.grad_accum_steps)]  # (ids, labels), each (b, s)

    def ours_step() -> float:
        losses = []
        for ids, labels in micro_batches:
            loss = ours.loss_fn(ours(ids), labels)  # the micro-batch's mean over its tokens
            loss.backward()
            losses.append(loss.item())
        return statistics.fmean(losses)

    def megatron_step() -> float:
        losses = []
        for ids, labels in micro_batches:
            loss = token_losses(megatron, ids, labels).float().mean()
            loss.backward()
            losses.append(loss.item())
        return statistics.fmean(losses)

    sides = {"ours": ours_step, "megatron": megatron_step}
    seconds, losses = {name: [] for name in sides}, {}
    for index in range(rounds):
        for name in (list(sides) if index % 2 == 0 else list(sides)[::-1]):
            for model in (ours, megatron):
                model.zero_grad(set_to_none=True)
            torch.distributed.barrier()
            start = time.perf_counter()
            losses[name] = sides[name]()
            seconds[name].append(time.perf_counter() - start)
    if torch.distributed.get_rank() == 0:
        ours_s, megatron_s = (statistics.median(seconds[name][WARM_UP:]) for name in sides)
        print(f"PASSES ours {ours_s * 1e3:.1f} ms, megatron-core {megatron_s * 1e3:.1f} ms, ratio of times ours / "
              f"megatron-core {ours_s / megatron_s:.3f}, loss difference {abs(losses['ours'] - losses['megatron']):.1e}",
              flush=True)
    torch.distributed.destroy_process_group()
    return 0


def main() -> int:
    argv = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # DeepSpeed's launcher adds it
    if argv[:1] == ["--rank"]:  # inside the launcher: --rank ROUNDS, then launch/train.py's argv
        return run_rank(argv[2:], int(argv[1]))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--archs", default="gpt2,llama")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--rounds", type=int, default=12, help=f"rounds per side, the first {WARM_UP} untimed")
    p.add_argument("--work", type=Path, default=Path("/tmp/peer_passes"))
    args = p.parse_args(argv)
    if args.rounds <= WARM_UP:
        p.error(f"--rounds must exceed the {WARM_UP} warm-up rounds")

    from bench.peers.peers import launch, train_argv, write_hf_checkpoint
    args.work.mkdir(parents=True, exist_ok=True)
    for arch in args.archs.split(","):
        hf_dir = args.work / f"{arch}-hf"
        argv = train_argv(arch, args.tp, 1, 1, hf_dir, args.work / "unused.jsonl")
        if not hf_dir.exists():
            write_hf_checkpoint(argv, hf_dir)
        proc = launch(Path(__file__).resolve(), args.tp, ["--rank", str(args.rounds)] + argv, threads=1)
        line = next(line for line in proc.stdout.splitlines() if line.startswith("PASSES "))  # rank 0 prints it
        print(f"{arch} tp {args.tp}: {line[len('PASSES '):]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
