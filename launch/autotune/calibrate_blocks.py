"""The model's own pieces timed as each candidate layout runs them (the planner's
measured path, launch/analysis/device_profile.py): a dense block, an MoE block and the embedding
with the head and loss, forward and backward, built from the run's layers (model/) in real TP and
EP groups of the calibration's processes, every process timing at once.

A case is (tp, ep, micro-batch, tokens): tokens is a rank's share of a sequence, s / cp (the
context-parallel all-to-alls are costed from the measured links, not here). A rank's block at tp
is the block of a TP group of tp processes, so its GEMMs, element-wise ops, dispatch and TP
all-reduces are what the run's are; likewise an MoE block's expert all-to-alls at ep.

Every rank must run the same collectives in the same order: the cases are sorted, and the number
of timed calls is agreed (the slowest rank's first call decides) before the timing loop. On GPUs
the pieces run on each process's device in an NCCL group, and each timed span ends with a
synchronize (nothing on CPU): the calls of a round run back to back, as a training step's."""
import math
import time
from typing import Callable, Dict, Iterable, Tuple

from launch.autotune.calibrate_timing import no_sync

Case = Tuple[int, int, int, int]  # (tp, ep, micro-batch, tokens of a sequence on the rank)
MIN_SECONDS = 0.03  # per round of a piece and case, after one warm-up call
ROUNDS = 3


def _agreed_calls(seconds: float, device=None) -> int:
    """Calls that take MIN_SECONDS on the slowest rank (the same number on every rank; `device`: the
    group's, NCCL reduces a GPU's tensors only)."""
    import torch
    import torch.distributed as dist
    slowest = torch.tensor([seconds], device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return max(2, math.ceil(MIN_SECONDS / max(slowest.item(), 1e-6)))


def _seconds_each(calls: Dict[str, Callable[[], None]], device=None,
                  synchronize: Callable[[], object] = no_sync) -> Dict[str, float]:
    """Seconds of each of `calls` after a warm-up: the fastest of ROUNDS means, each round started
    by every rank together (the fastest round is the one least disturbed by anything else on the
    machine). The rounds alternate between the calls, so that a disturbance lasting a while hits
    all of them rather than one: a piece's forward alone and its forward and backward are
    compared (a forward timed in a quiet spell and its backward in a busy one would invert them)."""
    import torch.distributed as dist
    repeats = {}
    for name, call in calls.items():
        call()
        synchronize()
        dist.barrier()
        start = time.perf_counter()
        call()
        synchronize()
        repeats[name] = _agreed_calls(time.perf_counter() - start, device)
    rounds: Dict[str, list] = {name: [] for name in calls}
    for _ in range(ROUNDS):
        for name, call in calls.items():
            synchronize()
            dist.barrier()
            start = time.perf_counter()
            for _ in range(repeats[name]):
                call()
            synchronize()
            rounds[name].append((time.perf_counter() - start) / repeats[name])
    return {name: min(seconds) for name, seconds in rounds.items()}


def _forward_and_backward(module, make_input, loss) -> Tuple[Callable[[], None], Callable[[], None]]:
    """(forward and backward, forward alone as full recompute reruns it: with autograd recording)."""
    def both():
        loss(module(make_input())).backward()

    def forward():
        module(make_input())
    return both, forward


def time_pieces(model, cases: Iterable[Case], dtype: str, device=None,
                synchronize: Callable[[], object] = no_sync) -> Dict[str, float]:
    """block_key -> seconds for every case and piece, in the process group already started, on
    `device` (None: the CPU), `synchronize` waiting for it."""
    import dataclasses

    import torch

    from launch.analysis.device_profile import block_key, has_dense_blocks, model_key
    from model.config import GPTConfig
    from model.gpt.model import GPT
    from model.parallel.cross_entropy import vocab_parallel_cross_entropy
    from model.parallel.state import init_parallel_state
    from model.transformer.block import Block
    from model.transformer.moe_losses import MoEStatistics
    arch = model.resolved()
    element = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    key = model_key(arch)
    config = GPTConfig(**dataclasses.asdict(arch))
    head_config = dataclasses.replace(config, n_layer=0)  # embedding, final norm, head: GPT without blocks
    kinds = {kind: next(i for i in range(arch.n_layer) if arch.moe.is_moe_block(i) == (kind == "moe"))
             for kind, present in (("dense", has_dense_blocks(arch)), ("moe", arch.moe.enabled)) if present}
    out: Dict[str, float] = {}
    by_groups: Dict[Tuple[int, int], list] = {}
    for tp, ep, b, s in sorted(set(cases)):
        by_groups.setdefault((tp, ep), []).append((b, s))
    for (tp, ep), shapes in sorted(by_groups.items()):
        state = init_parallel_state(tp, 1, ep_size=ep, experts=arch.moe.enabled)
        sharded = arch.sequence_parallel and tp > 1  # a block's input is its TP rank's chunk of the tokens
        pieces = {kind: Block(config, index, state.tp_group, ep_group=state.ep_group,
                              moe_statistics=MoEStatistics(config) if arch.moe.enabled else None).to(device, element)
                  for kind, index in kinds.items()}
        head = GPT(head_config, state.tp_group).to(device, element)
        for b, s in shapes:
            hidden = lambda: torch.randn(b, s // tp if sharded else s, arch.n_embd, dtype=element,  # noqa: E731
                                         device=device, requires_grad=True)
            ids = torch.randint(0, arch.vocab_size, (b, s), device=device)
            timed = {kind: _forward_and_backward(block, hidden, lambda y: y.float().square().mean())
                     for kind, block in pieces.items()}
            timed["head"] = _forward_and_backward(
                head, lambda: ids, lambda logits: vocab_parallel_cross_entropy(logits.float(), ids, state.tp_group).mean())
            for piece, (both, forward) in timed.items():
                seconds = _seconds_each({"both": both, "forward": forward}, device, synchronize)
                out[block_key(key, piece, tp, ep, b, s)] = seconds["both"]
                out[block_key(key, piece + ".forward", tp, ep, b, s)] = seconds["forward"]
    return out
