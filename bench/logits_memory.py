"""Memory of the padded-vocabulary logits on DeepSpeed's last pipeline stage: the in-place -inf fill
and the loss that releases consumed logits, against the earlier code (swapped back in as the peer
for one measurement), in the same run: one process, the real engine (pp=1 is the last stage), one
optimizer step under torch's memory profiler; the peak of live bytes above the step's start and
what the step leaves allocated (docs/performance.md, "Padded-vocabulary logits").

    python bench/logits_memory.py [--hidden 256 --seq-len 256 --micro 2 --micro-batches 4 --vocab 50257]"""
import argparse
import sys

import torch
from torch.nn import functional


def _before_logits(self, hidden: torch.Tensor) -> torch.Tensor:
    """The head as it was: the matmul, then a `masked_fill` copy of the padded columns."""
    logits = functional.linear(hidden, self.weight)
    padded = torch.arange(self.vocab_start, self.vocab_end, device=logits.device) >= self.vocab_size
    return logits.masked_fill(padded, float("-inf"))


def _before_loss_fn(state):
    from model.loss import vocab_parallel_cross_entropy

    def loss_fn(logits, labels):  # the logits stay alive in DeepSpeed's buffer
        return vocab_parallel_cross_entropy(logits, labels, state.tp_group).mean()
    return loss_fn


def step_memory(args, before: bool) -> dict:
    """Peak live CPU bytes above the start of one `train_batch`, and the bytes it leaves."""
    import deepspeed

    import model.layers
    import model.pipe
    from model.gpt import GPTConfig
    from model.parallel_state import init_parallel_state

    saved = model.layers.VocabParallelEmbedding.logits, model.pipe.make_loss_fn
    if before:
        model.layers.VocabParallelEmbedding.logits, model.pipe.make_loss_fn = _before_logits, _before_loss_fn
    try:
        config = GPTConfig(n_layer=1, n_head=4, n_embd=args.hidden, seq_len=args.seq_len,
                           vocab_size=args.vocab, vocab_pad_multiple=128)
        pipe = model.pipe.build_pipeline(config, init_parallel_state(1, 1))
        engine, _, _, _ = deepspeed.initialize(
            model=pipe, optimizer=torch.optim.SGD(pipe.parameters(), lr=0.0),
            config={"train_batch_size": args.micro * args.micro_batches,
                    "train_micro_batch_size_per_gpu": args.micro, "steps_per_print": 10 ** 9})
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, args.vocab, (args.micro_batches, args.micro, args.seq_len + 1), generator=g)
        batches = [(t[:, :-1], t[:, 1:]) for t in tokens]
        engine.train_batch(iter(batches))  # warm-up: optimizer state, buffers
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            engine.train_batch(iter(batches))
        live = peak = 0
        for event in sorted(prof.events(), key=lambda e: e.time_range.start):
            # An op's own allocations net of its own frees; frees outside any op are "[memory]".
            live += event.cpu_memory_usage if event.name == "[memory]" else event.self_cpu_memory_usage
            peak = max(peak, live)
        return {"peak": peak, "left": live, "logits": args.micro * args.seq_len * config.padded_vocab_size(1) * 4}
    finally:
        model.layers.VocabParallelEmbedding.logits, model.pipe.make_loss_fn = saved


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--vocab", type=int, default=50257, help="GPT-2's, padded to a multiple of 128")
    args = p.parse_args(argv)
    from launch.runtime.distributed import ensure_single_process_env, init_distributed
    ensure_single_process_env()
    init_distributed(600, dist_backend="gloo", verbose=False)
    torch.set_num_threads(1)
    results = {name: step_memory(args, before=name == "before") for name in ("before", "after")}
    mib = 2 ** 20
    logits = results["after"]["logits"]
    print(f"one micro-batch's logits (B, T, V_pad) fp32: {logits / mib:.1f} MiB "
          f"(b={args.micro}, T={args.seq_len}, V_pad={logits // (4 * args.micro * args.seq_len)}); "
          f"{args.micro_batches} micro-batches per step")
    print(f"{'':8} {'peak above step start':>22} {'= logits x':>11} {'left after step':>16}")
    for name, r in results.items():
        print(f"{name:8} {r['peak'] / mib:18.1f} MiB {r['peak'] / logits:11.2f} {r['left'] / mib:12.1f} MiB")
    saved = results["before"]["peak"] - results["after"]["peak"]
    print(f"after / before peak: {results['after']['peak'] / results['before']['peak']:.2f} "
          f"({saved / mib:.1f} MiB = {saved / logits:.2f} micro-batches' logits less)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
