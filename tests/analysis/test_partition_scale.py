"""launch/analysis/partition.py at scale: the balanced cut (bisection over the largest stage's cost)
gives exactly the cuts of the O(l^2 pp) dynamic program (written out below as the reference), the
blocks rule exactly DeepSpeed's partition_balanced over weights 1 per block (its "type:Block"), and
100,000 layers partition in well under a second where that table takes minutes."""
import random
import signal
import time
from contextlib import contextmanager

import pytest

from launch.analysis import partition
from model.config import ModelConfig

GPT2 = dict(n_head=4, n_embd=64, seq_len=32)  # embed, wpe, blocks, ln_f, head
LLAMA = dict(arch="llama", n_head=4, n_kv_head=2, n_embd=64, seq_len=32)  # embed, blocks, ln_f, lm_head


def reference_balanced_parts(kinds, costs, pp):
    """The O(l^2 pp) dynamic program, without a cache, the reference for partition.py: best[k][j] is
    the least largest cost of the first j blocks on k stages; from the last stage, the most blocks."""
    first, n = kinds.index("block"), kinds.count("block")
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(i, j):
        start = 0 if i == 0 else first + i
        stop = len(kinds) if j == n else first + j
        return prefix[stop] - prefix[start]

    infinity = float("inf")
    best = [[infinity] * (n + 1) for _ in range(pp + 1)]
    best[0][0] = 0
    for k in range(1, pp + 1):
        for j in range(k, n + 1):
            best[k][j] = min(max(best[k - 1][i], cost(i, j)) for i in range(k - 1, j))
    target, counts, j = best[pp][n], [], n
    for k in range(pp, 0, -1):
        i = min(i for i in range(k - 1, j) if best[k - 1][i] <= target and cost(i, j) <= target)
        counts.append(j - i)
        j = i
    counts = counts[::-1]
    return tuple([0] + [first + sum(counts[:k]) for k in range(1, len(counts))] + [len(kinds)])


def _model(n_layer, vocab=4096, **dims):
    return ModelConfig(n_layer=n_layer, vocab_size=vocab, **dims).resolved()


@contextmanager
def _deadline(seconds):
    """Fail (not hang) when the body runs past `seconds`: SIGALRM interrupts a Python loop."""
    def expire(signum, frame):
        raise TimeoutError(f"partitioning took over {seconds} s")
    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_balanced_cuts_equal_the_dynamic_program_on_random_costs():
    """Costs no model has too: zeros (free blocks, free head), ties, one block dearer than the rest,
    1 to 3 layers before the blocks and 0 to 3 after."""
    rng = random.Random(7)
    for _ in range(1500):
        n = rng.randint(1, 12)
        kinds = ("embed",) * rng.randint(1, 3) + ("block",) * n + ("ln_f",) * rng.randint(0, 3)
        top = rng.choice([1, 3, 10, 10 ** 15])
        costs = tuple(rng.randint(0, top) if rng.random() < 0.8 else 0 for _ in kinds)
        pp = rng.randint(1, n)
        assert partition._balanced_parts(kinds, costs, pp) == reference_balanced_parts(kinds, costs, pp), \
            (kinds, costs, pp)


@pytest.mark.parametrize("dims", [GPT2, LLAMA], ids=["gpt2", "llama"])
@pytest.mark.parametrize("vocab", [256, 4096, 50000])  # the head worth under one block, about 5, about 60
def test_balanced_cuts_of_real_models_equal_the_dynamic_program(dims, vocab):
    for n_layer in range(1, 13):
        model = _model(n_layer, vocab, **dims)
        kinds = tuple(partition._layer_kinds(model))
        costs = tuple(f + b for f, b in partition.layer_flops(model, 1))
        for pp in range(1, n_layer + 1):
            assert tuple(partition.stage_partition(model, pp, "balanced")) == \
                reference_balanced_parts(kinds, costs, pp), (n_layer, pp)


@pytest.mark.parametrize("dims", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_blocks_rule_equals_deepspeeds_partition_balanced(dims):
    from deepspeed.runtime.utils import partition_balanced
    for n_layer in range(1, 17):
        model = _model(n_layer, **dims)
        weights = [int(kind == "block") for kind in partition._layer_kinds(model)]
        for pp in range(1, n_layer + 1):
            assert partition.stage_partition(model, pp, "blocks") == \
                [int(x) for x in partition_balanced(weights, pp)], (n_layer, pp)


@pytest.mark.parametrize("rule", ["balanced", "blocks"])
@pytest.mark.parametrize("pp", [1, 8])
def test_100000_layers_partition_in_well_under_a_second(rule, pp):
    """A hang guard, with room for a loaded machine (about 0.15 s alone): the table of the dynamic
    programs was O(l^2 pp), 18 s at 10,000 layers and pp 1, so hours here."""
    model = _model(100_000 + pp, **LLAMA)  # a size no other test asks for: the cache cannot answer
    with _deadline(5):
        start = time.perf_counter()
        parts = partition.stage_partition(model, pp, rule)
        elapsed = time.perf_counter() - start
    assert elapsed < 5
    counts = partition.blocks_per_stage(model, parts)
    assert sum(counts) == model.n_layer and min(counts) >= 1
    if rule == "blocks":
        assert max(counts) - min(counts) <= 1
    else:  # the optimum: never a larger stage than counting blocks
        blocks = partition.stage_partition(model, pp, "blocks")
        largest = [max(f + b for f, b in partition.stage_flops(model, cut, 1)) for cut in (parts, blocks)]
        assert largest[0] <= largest[1]
