"""Memory of the logits and their loss on DeepSpeed's last pipeline stage, against the plain head
and loss (copies below, swapped in as the peer for one measurement), in the same run:

- default: the padded-vocabulary logits: the in-place -inf fill and the loss that releases consumed
  logits; one process, the real engine (pp=1 is the last stage), one optimizer step under torch's
  memory profiler; the peak of live bytes above the step's start and what the step leaves
  allocated (docs/performance.md, "Padded-vocabulary logits").
- `--loss`: the vocab-parallel cross-entropy alone, forward + backward as the pipeline's loss runs
  it (model/gpt/pipe.py: TokenMeanLoss), at tp = 1 and 2 (gloo processes): the chunked loss against
  the unchunked one (a copy below); peak live bytes above the given logits, and the bytes
  held from forward to backward (docs/performance.md, "Cross-entropy at a large vocabulary").

    python bench/memory/logits_memory.py [--hidden 256 --seq-len 256 --micro 2 --micro-batches 4 --vocab 50257]
    python bench/memory/logits_memory.py --loss [--vocab 128256 --tokens 8192 --tp 1 2 --dtype bf16]"""
import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch.nn import functional


def _before_logits(self, hidden: torch.Tensor) -> torch.Tensor:
    """The plain head: the matmul, then a `masked_fill` copy of the padded columns."""
    logits = functional.linear(hidden, self.weight)
    padded = torch.arange(self.vocab_start, self.vocab_end, device=logits.device) >= self.vocab_size
    return logits.masked_fill(padded, float("-inf"))


def _before_loss_fn(state):
    from model.parallel.cross_entropy import vocab_parallel_cross_entropy

    def loss_fn(logits, labels):  # the logits stay alive in DeepSpeed's buffer
        return vocab_parallel_cross_entropy(logits, labels, state.tp_group).mean()
    return loss_fn


def step_memory(args, before: bool) -> dict:
    """Peak live CPU bytes above the start of one `train_batch`, and the bytes it leaves."""
    import deepspeed

    import model.gpt.pipe
    import model.parallel.vocab_embedding
    from model.config import GPTConfig
    from model.parallel.state import init_parallel_state

    saved = model.parallel.vocab_embedding.VocabParallelEmbedding.logits, model.gpt.pipe.TokenMeanLoss
    if before:
        model.parallel.vocab_embedding.VocabParallelEmbedding.logits, model.gpt.pipe.TokenMeanLoss = _before_logits, _before_loss_fn
    try:
        config = GPTConfig(n_layer=1, n_head=4, n_embd=args.hidden, seq_len=args.seq_len,
                           vocab_size=args.vocab, vocab_pad_multiple=128)
        pipe = model.gpt.pipe.build_pipeline(config, init_parallel_state(1, 1))
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
        model.parallel.vocab_embedding.VocabParallelEmbedding.logits, model.gpt.pipe.TokenMeanLoss = saved


class _BeforeCrossEntropy(torch.autograd.Function):
    """model/parallel/cross_entropy.py without chunking: an fp32 copy of the logits, the fp32 softmax
    saved for backward, and in bf16 a gradient copy; its loss_fn frees the consumed logits."""

    @staticmethod
    def forward(ctx, logits, target, group):
        ctx.logits_dtype = logits.dtype
        fp32 = logits.float()
        logits_max = fp32.max(dim=-1).values
        if group is not None:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = fp32 - logits_max.unsqueeze(-1) if fp32 is logits else fp32.sub_(logits_max.unsqueeze(-1))
        shard_size = logits.size(-1)
        vocab_start = 0 if group is None else dist.get_rank(group) * shard_size
        outside = (target < vocab_start) | (target >= vocab_start + shard_size)
        local_target = (target - vocab_start).masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = shifted.exp_()
        sum_exp = exp.sum(dim=-1)
        if group is not None:
            dist.all_reduce(target_logit, group=group)
            dist.all_reduce(sum_exp, group=group)
        loss = sum_exp.log() - target_logit
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local_target, outside)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad, local_target, outside = ctx.saved_tensors
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -(~outside).to(grad.dtype).unsqueeze(-1))
        return grad.mul_(grad_loss.unsqueeze(-1)).to(ctx.logits_dtype), None, None


def _loss_before(logits, target, group):
    loss = _BeforeCrossEntropy.apply(logits, target, group).mean()
    logits.untyped_storage().resize_(0)
    return loss


def _loss_after(logits, target, group, consume=True):
    from model.parallel.cross_entropy import vocab_parallel_cross_entropy
    loss = vocab_parallel_cross_entropy(logits, target, group, consume_logits=consume).mean()
    if consume:
        logits.data = logits.new_empty(0)
    return loss


class _Given(torch.autograd.Function):
    """The head's place: hands over pre-made logits (allocated before the measurement) as a
    non-leaf output, and drops their gradient as the head's backward would after using it."""

    @staticmethod
    def forward(ctx, anchor, logits):
        return logits

    @staticmethod
    def backward(ctx, grad):
        return torch.zeros(1), None


def _allocated(prof, marker: str) -> tuple:
    """(peak, at the marker) of the bytes allocated since the profile's start, from the profiler's
    per-allocation events in time order (their "Total Allocated"); blocks made before the start are
    not in it, so every tensor measured is made inside the profile."""
    import json
    import tempfile
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name))["traceEvents"]
    at = next(e["ts"] for e in events if e.get("name") == marker)
    memory = sorted((float(e["ts"]), e["args"]["Total Allocated"]) for e in events if e.get("name") == "[memory]")
    return max(total for _, total in memory), [total for ts, total in memory if ts <= at][-1]


def loss_memory(args, group, variant) -> tuple:
    """Peak bytes above the logits over one loss forward + backward, the bytes held from forward
    to backward (the logits included), and the logits' bytes, on this rank."""
    tp = 1 if group is None else dist.get_world_size(group)
    from model.config import padded_vocab_size
    shard = padded_vocab_size(args.vocab, tp, multiple=128) // tp
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    g = torch.Generator().manual_seed(0)
    target = torch.randint(0, args.vocab, (args.tokens,), generator=g)
    start = dist.get_rank(group) * shard if group is not None else 0
    anchor = torch.zeros(1, requires_grad=True)
    fn = {"before": _loss_before, "after": _loss_after,
          "after, own gradient buffer": lambda *a: _loss_after(*a, consume=False)}[variant]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        logits = torch.empty(args.tokens, shard, dtype=dtype).normal_(generator=g)
        logits[:, max(0, args.vocab - start):] = float("-inf")  # the head's padded columns
        size = logits.nbytes
        loss = fn(_Given.apply(anchor, logits), target, group)
        del logits
        with torch.profiler.record_function("held"):
            pass
        loss.backward()
        del loss
    peak, held = _allocated(prof, "held")
    return peak - size, held, size


def _loss_rank(rank, world, port, args, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    group = None
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        group = dist.group.WORLD
    try:
        for variant in ("before", "after", "after, own gradient buffer"):
            out[(world, variant, rank)] = loss_memory(args, group, variant)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def loss_main(args) -> int:
    import torch.multiprocessing as mp
    from launch.engine.distributed import free_port
    from model.parallel.cross_entropy import CHUNK_BYTES
    manager = mp.Manager()
    out = manager.dict()
    for tp in args.tp:
        mp.spawn(_loss_rank, args=(tp, free_port(), args, out), nprocs=tp)
    gib = 2 ** 30
    print(f"vocab-parallel cross-entropy, forward + backward as the pipeline's loss runs it: V={args.vocab} "
          f"(padded to a multiple of 128 x tp), {args.tokens} tokens, {args.dtype} logits; "
          f"chunks of {CHUNK_BYTES // 2 ** 20} MiB fp32; per rank, the busiest rank")
    print(f"{'tp':>2} {'':28} {'logits/rank':>11} {'peak above logits':>18} {'held fwd->bwd':>14} {'/ before':>9}")
    for tp in args.tp:
        logits = out[(tp, "before", 0)][2]
        before = max(out[(tp, "before", r)][0] for r in range(tp))
        for variant in ("before", "after", "after, own gradient buffer"):
            peak = max(out[(tp, variant, r)][0] for r in range(tp))
            held = max(out[(tp, variant, r)][1] for r in range(tp))
            print(f"{tp:>2} {variant:28} {logits / gib:7.2f} GiB {peak / gib:14.2f} GiB "
                  f"{held / gib:10.2f} GiB {peak / before:9.3f}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--vocab", type=int, default=None,
                   help="default GPT-2's 50257 (--loss: Llama 3's 128256), padded to a multiple of 128")
    p.add_argument("--loss", action="store_true", help="measure the cross-entropy alone (see above)")
    p.add_argument("--tokens", type=int, default=8192, help="--loss: tokens per micro-batch")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="--loss: TP sizes")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="--loss: the logits' dtype")
    args = p.parse_args(argv)
    if args.loss:
        if args.tokens < 1 or min(args.tp) < 1 or (args.vocab is not None and args.vocab < 1):
            p.error("--tokens, --tp and --vocab must be >= 1")
        args.vocab = args.vocab or 128256
        return loss_main(args)
    args.vocab = args.vocab or 50257
    from launch.engine.distributed import ensure_single_process_env, init_distributed
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
