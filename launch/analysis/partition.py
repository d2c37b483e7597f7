"""Where the pipeline is cut into stages: the one partition function of the training run
(launch/engine/engine.py hands its boundaries to model/gpt/pipe.py), the planner, the memory and
communication formulas and the tests, so that predictions and the real PipelineModule agree.

`train.partition`: `balanced` (default) minimises the largest stage's forward + backward FLOPs
per micro-batch (`layer_flops`: blocks and the output head; the embeddings and the final norm
cost 0); `blocks` spreads blocks evenly, as DeepSpeed's "type:Block"; a list gives the blocks per
stage. Every rule cuts just before a block (or after the last), so the embeddings stay on the
first stage and the final norm and head on the last. The result is DeepSpeed's `parts`: stage k
holds layers parts[k]:parts[k+1] of model/gpt/pipe.py's table (docs/planner-and-metrics.md)."""
import dataclasses
import functools
import itertools
from typing import Callable, List, Optional, Sequence, Tuple, Union

from launch.analysis import formulas
from launch.config.layout import Layout, check_partition
from launch.config.recipe import PARTITION_RULES, Recipe, muon_stage_error
from launch.errors import ConfigError
from model.config import ModelConfig
from model.gpt.layer_table import pipeline_layers

Partition = Union[str, Sequence[int]]
DEFAULT = "balanced"


def parse_partition(text: str) -> Partition:
    """launch/plan.py's --partition: 'balanced', 'blocks' or a comma list '3,1'."""
    if text in PARTITION_RULES:
        return text
    try:
        return tuple(int(n) for n in text.split(","))
    except ValueError:
        raise ConfigError(f"--partition {text!r} is not one of {', '.join(PARTITION_RULES)} or a comma list of blocks per "
                          f"stage (e.g. 3,1)") from None


def _layer_kinds(model: ModelConfig) -> Tuple[str, ...]:
    return tuple(formulas.layer_kinds(model))


def layer_flops(model: ModelConfig, micro_batch: int = 1, seq_len: Optional[int] = None,
                recompute: bool = False) -> List[Tuple[int, int]]:
    """(forward, backward) FLOPs of each pipeline layer for one micro-batch: blocks by
    formulas.model_layer_flops_per_microbatch (backward twice the forward, plus the forward again
    with full recompute), the head by formulas.logits_flops_per_microbatch (never recomputed),
    0 for the embeddings and the final norm; with experts each block by its index (an MoE block
    counts its active weights, a dense one its MLP). `model` is resolved (vocab_size set)."""
    s = seq_len or model.seq_len

    def block(index: Optional[int]) -> Tuple[int, int]:
        both = formulas.model_layer_flops_per_microbatch(model, micro_batch, s, recompute, index)
        forward = formulas.model_layer_flops_per_microbatch(model, micro_batch, s, layer_index=index) // 3
        return forward, both - forward
    head = formulas.logits_flops_per_microbatch(micro_batch, s, model.n_embd, model.vocab_size)
    costs = {"block": block(None), "head": (head // 3, head - head // 3)}
    costs["lm_head"] = costs["head"]
    if model.moe.enabled and model.moe.moe_every > 1:  # MoE and dense blocks differ
        return [block(i) if kind == "block" else costs.get(kind, (0, 0)) for kind, i in pipeline_layers(model)]
    return [costs.get(kind, (0, 0)) for kind in _layer_kinds(model)]


def stage_partition(model: ModelConfig, pp: int, partition: Partition = DEFAULT,
                    seq_len: Optional[int] = None, recompute: bool = False) -> List[int]:
    """The stage boundaries `parts` of `partition` (module docstring) for a resolved config. The
    balanced cut does not depend on the micro-batch size (every cost scales with it)."""
    kinds = _layer_kinds(model)
    if not isinstance(partition, str):
        check_partition(partition, kinds.count("block"), pp)
        return _from_counts(kinds, list(partition))
    if partition == "blocks":
        return list(_type_block_parts(kinds, pp))
    if partition != "balanced":
        check_partition(partition, kinds.count("block"), pp)
    costs = tuple(forward + backward for forward, backward in layer_flops(model, 1, seq_len, recompute))
    return list(_balanced_parts(kinds, costs, pp))


def blocks_per_stage(model: ModelConfig, parts: Sequence[int]) -> List[int]:
    kinds = _layer_kinds(model)
    return [kinds[parts[k]:parts[k + 1]].count("block") for k in range(len(parts) - 1)]


def stage_weight_grad_flops(model: ModelConfig, parts: Sequence[int], micro_batch: int,
                            seq_len: Optional[int] = None) -> List[int]:
    """The part of each stage's backward FLOPs that computes weight gradients, 2 FLOPs per matrix
    weight per token (ZB-H1's W pass, launch/analysis/zero_bubble_schedule.py): a block's matrices, the head
    (whose FLOPs are 6bshV: a third each for forward, input and weight gradients); an MoE block's
    active matrices (router, k experts, shared experts)."""
    s = seq_len or model.seq_len
    head = formulas.logits_flops_per_microbatch(micro_batch, s, model.n_embd, model.vocab_size) // 3
    costs = [2 * micro_batch * s * formulas.block_matmul_params(model, i, active=True) if kind == "block"
             else head if kind in ("head", "lm_head") else 0 for kind, i in pipeline_layers(model)]
    return [sum(costs[parts[k]:parts[k + 1]]) for k in range(len(parts) - 1)]


def stage_flops(model: ModelConfig, parts: Sequence[int], micro_batch: int, seq_len: Optional[int] = None,
                recompute: bool = False) -> List[Tuple[int, int]]:
    """(forward, backward) FLOPs of each stage for one micro-batch, the whole stage (all TP ranks)."""
    layers = layer_flops(model, micro_batch, seq_len, recompute)
    return [(sum(f for f, _ in layers[parts[k]:parts[k + 1]]), sum(b for _, b in layers[parts[k]:parts[k + 1]]))
            for k in range(len(parts) - 1)]


def with_stage_boundaries(layout: Layout, recipe: Recipe, vocab_size: int) -> Layout:
    """The layout with the training run's stage boundaries: the recipe's train.partition on its model
    with the vocabulary resolved; at v > 1 also the pp x v chunks' (chunk c of rank r is stage r + c x pp), which the engine builds."""
    model = dataclasses.replace(recipe.model, vocab_size=vocab_size).resolved()
    parts = stage_partition(model, layout.pp, recipe.train.partition, recipe.seq_len,
                            recipe.train.recompute == "full")
    v, partition = layout.virtual_stages, recipe.train.partition
    if v > 1 and not isinstance(partition, str):  # blocks per rank
        partition = chunk_blocks(partition, layout.pp, v)
    chunks = stage_partition(model, layout.pp * v, partition, recipe.seq_len,
                             recipe.train.recompute == "full") if v > 1 else ()
    return dataclasses.replace(layout, parts=tuple(parts), chunk_parts=tuple(chunks))


def chunk_blocks(counts: Sequence[int], pp: int, v: int) -> List[int]:
    """A train.partition list at v > 1, blocks per pipeline rank as at v = 1, as blocks per stage of the
    pp x v (chunk c of rank r is stage r + c x pp): each rank's blocks split over its chunks, the earlier
    chunks taking the remainder (the last rank's last chunk, which holds the head, the fewest). A rank
    then holds the blocks the list gives it at any v (launch/config/layout.py: check_virtual_stages
    refuses a list that would leave a chunk but the last empty)."""
    return [counts[s % pp] // v + (s // pp < counts[s % pp] % v) for s in range(pp * v)]


def check_muon_stages(recipe: Recipe, layout: Layout, vocab_size: int) -> None:
    """train.optimizer=muon needs a hidden matrix on every stage: a ConfigError naming the blocks
    per stage before the engine is built (a train.partition list is checked with the recipe)."""
    model = dataclasses.replace(recipe.model, vocab_size=vocab_size).resolved()
    counts = blocks_per_stage(model, layout.parts)
    if recipe.train.optimizer == "muon" and 0 in counts:
        raise muon_stage_error(counts, f"train.partition={recipe.train.partition!r} at --pp {layout.pp}")


def _from_counts(kinds: Tuple[str, ...], counts: List[int]) -> List[int]:
    """Boundaries from blocks per stage: stage k starts at its first block (stage 0 at layer 0)."""
    starts = list(itertools.accumulate(counts[:-1], initial=kinds.index("block")))  # running sums: linear in pp
    return [0] + starts[1:] + [len(kinds)]


@functools.lru_cache(maxsize=None)
def _type_block_parts(kinds: Tuple[str, ...], pp: int) -> Tuple[int, ...]:
    """DeepSpeed's "type:Block" (runtime/utils.py partition_balanced of weight 1 per block, 0 per other
    layer) in closed form: its dynamic program takes O(l^2 p) numpy scalar steps, over a minute at 10,000
    layers. On this table (one run of blocks, other layers around it) it gives the first n % pp stages one
    block more and cuts just before a block (the same cuts for every n and pp <= n: checked against it in
    tests/analysis/test_partition_scale.py)."""
    n = kinds.count("block")
    if pp > n:  # a stage without a block, which the layout refuses: DeepSpeed's own answer, cheap for so few
        from deepspeed.runtime.utils import partition_balanced  # imported late: a slow import
        return tuple(int(x) for x in partition_balanced([int(name == "block") for name in kinds], pp))
    q, extra = divmod(n, pp)
    return tuple(_from_counts(kinds, [q + 1] * extra + [q] * (pp - extra)))


@functools.lru_cache(maxsize=None)
def _balanced_parts(kinds: Tuple[str, ...], costs: Tuple[int, ...], pp: int) -> Tuple[int, ...]:
    """Blocks per stage (each >= 1) minimising the largest stage cost, exactly; integer costs, so no
    rounding decides. DeepSpeed's partition_balanced minimises the spread (largest minus smallest)
    instead, which is not the same optimum. Among optimal cuts, later stages take as many blocks as
    they can: under 1F1B they hold fewer micro-batches in flight, so this keeps the first stage's
    activations low.

    The least largest cost is found by bisection over the cost (`_fits` checks one in O(pp log l) on
    prefix sums), not by a table over every stage and block count, which is O(l^2 pp): half a minute
    at 10,000 layers. The costs are >= 0, so a stage's cost only grows with its blocks: the first k
    stages can end at any block from k to the furthest a greedy fill reaches, and the cut taken from
    the last stage is the first block whose stage to the current end stays within the optimum."""
    first, n = kinds.index("block"), kinds.count("block")
    if pp > n:
        raise ValueError(f"{pp} stages need at least {pp} blocks, got {n}")
    prefix = list(itertools.accumulate(costs, initial=0))

    def cost(i: int, j: int) -> int:  # blocks i..j-1 plus, on the first and last stage, the layers before and after
        start = 0 if i == 0 else first + i
        stop = len(kinds) if j == n else first + j
        return prefix[stop] - prefix[start]

    # Every stage holds a block, so the optimum is at least the dearest single block (with its
    # neighbours on the first and last stage) and at most everything on one stage.
    low, high = max(cost(i, i + 1) for i in range(n)), cost(0, n)
    while low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if _fits(cost, n, pp, middle) else (middle + 1, high)
    counts, j = [], n
    for k in range(pp, 1, -1):  # from the last stage: the most blocks that keep the optimum
        i = max(k - 1, _first_within(cost, j, low))
        counts.append(j - i)
        j = i
    return tuple(_from_counts(kinds, [j] + counts[::-1]))


def _first_within(cost: Callable[[int, int], int], j: int, limit: int) -> int:
    """The first block i < j whose stage i..j-1 costs at most `limit` (j if none): the cost falls as i grows."""
    low, high = 0, j
    while low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if cost(middle, j) <= limit else (middle + 1, high)
    return low


def _last_within(cost: Callable[[int, int], int], i: int, stop: int, limit: int) -> int:
    """The last end j in i+1..stop whose stage i..j-1 costs at most `limit` (i if none)."""
    low, high = i, stop
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if cost(i, middle) <= limit else (low, middle - 1)
    return low


def _fits(cost: Callable[[int, int], int], n: int, pp: int, limit: int) -> bool:
    """Whether n blocks fit on pp stages of >= 1 block each, none costing more than `limit` (at least
    every single block's cost): the first pp - 1 stages filled greedily reach some block `reach`, and
    can end anywhere from pp - 1 to it; the last stage must start where its cost to the end fits."""
    if pp == 1:
        return cost(0, n) <= limit
    reach = 0
    for _ in range(pp - 1):
        reach = _last_within(cost, reach, n - 1, limit)  # the last stage keeps at least one block
    return max(pp - 1, _first_within(cost, n, limit)) <= reach
