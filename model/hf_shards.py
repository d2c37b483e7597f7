"""Which stored transformers tensors, and which slices of them, make one TP rank's shard of each
of our parameters: the plan that `--init-from-hf` reads lazily (launch/checkpoints/hf_safetensors.py),
so that no rank materialises a tensor it does not hold (issue 24: 2.3x the fp32 model per rank).

A plan is "this rank's tensor = the concatenation along dim 0 of these pieces, then zero rows
(vocab padding)"; each piece is (transformers name, a slice in its stored layout), transposed
first where GPT-2's Conv1D stores (in, out). It follows model/convert.py's rules (`rule_for`),
so `split(name, dense[name], ...)` of the whole tensor gives the same values
(tests/test_hf_shards.py). No files, no reading here.
"""
from dataclasses import dataclass
from typing import Dict, Mapping, Sequence, Tuple

from model.config import GPTConfig
from model.convert import rule_for


@dataclass(frozen=True)
class Source:
    """The transformers tensors one dense parameter is made of, in order along its dim 0."""
    names: Tuple[str, ...]
    conv1d: bool = False  # GPT-2's Conv1D weight: stored (in, out), ours (out, in)
    rows: Tuple[int, ...] = ()  # several names (Llama's fused qkv_proj, gate_up_proj): the rows of each


@dataclass(frozen=True)
class Piece:
    name: str
    index: Tuple[slice, ...]  # in the stored layout (before any transpose)
    rows: int  # its length along our dim 0: the rows it fills in this rank's tensor


@dataclass(frozen=True)
class ShardPlan:
    pieces: Tuple[Piece, ...]
    transpose: bool
    shape: Tuple[int, ...]  # this rank's tensor; rows after the pieces' are zeros (vocab padding)


def hf_sources(config: GPTConfig) -> Dict[str, Source]:
    """Our dense name -> its transformers source, for GPT-2 or Llama weights."""
    if config.arch == "llama":
        from model.hf_llama import fused_parts, name_pairs
        sources = {ours: Source((theirs,)) for ours, theirs in name_pairs(config)}
        sources.update({ours: Source(tuple(name for name, _ in parts), rows=tuple(rows for _, rows in parts))
                        for ours, parts in fused_parts(config)})
        return sources
    from model.hf_gpt2 import gpt2_name_pairs
    return {ours: Source((theirs,), conv1d) for ours, theirs, conv1d in gpt2_name_pairs(config.n_layer)}


def _share(start: int, stop: int, tp_rank: int, tp_size: int) -> slice:
    per = (stop - start) // tp_size
    return slice(start + tp_rank * per, start + (tp_rank + 1) * per)


def shard_plan(dense_name: str, source: Source, stored_shapes: Mapping[str, Sequence[int]], tp_rank: int,
               tp_size: int, padded_vocab_size: int) -> ShardPlan:
    """The pieces of `dense_name`'s shard on `tp_rank` of `tp_size` (model/convert.py's `split`)."""
    rule = rule_for(dense_name)
    ours = {name: tuple(shape)[::-1] if source.conv1d else tuple(shape) for name, shape in stored_shapes.items()}
    first = ours[source.names[0]]
    everything = tuple(slice(None) for _ in first)

    def piece(name: str, our_index: Tuple[slice, ...]) -> Piece:
        rows = len(range(*our_index[0].indices(ours[name][0])))
        return Piece(name, our_index[::-1] if source.conv1d else our_index, rows)

    if rule.dim is None:  # replicated: the whole tensor
        return ShardPlan(tuple(piece(n, everything) for n in source.names), source.conv1d, first)
    if rule.dim == 1:  # row-parallel: this rank's input columns of the one tensor
        (name,) = source.names
        columns = _share(0, first[1], tp_rank, tp_size)
        return ShardPlan((piece(name, (slice(None), columns)),), source.conv1d, (first[0], columns.stop - columns.start))
    if rule.vocab:  # vocab rows [a, b) of the padded table; only those below the real vocabulary are stored
        (name,) = source.names
        rows = _share(0, padded_vocab_size, tp_rank, tp_size)
        real = slice(min(rows.start, first[0]), min(rows.stop, first[0]))
        pieces = (piece(name, (real,) + everything[1:]),) if real.stop > real.start else ()
        return ShardPlan(pieces, source.conv1d, (rows.stop - rows.start,) + first[1:])
    # Column-parallel: each block ([Q; K; V] of a fused tensor: `stride` equal blocks; or one
    # tensor per block) gives this rank its share of rows.
    stride = rule.stride if len(source.names) == 1 else 1
    blocks = [(name, start, start + ours[name][0] // stride) for name in source.names
              for start in range(0, ours[name][0], ours[name][0] // stride)]
    pieces = tuple(piece(name, (_share(a, b, tp_rank, tp_size),) + everything[1:]) for name, a, b in blocks)
    rows = sum((b - a) // tp_size for _, a, b in blocks)
    return ShardPlan(pieces, source.conv1d, (rows,) + first[1:])
