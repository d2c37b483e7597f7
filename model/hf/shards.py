"""Which stored transformers tensors, and which slices of them, make one rank's shard of each of our
parameters: the plan that `--init-from-hf` reads lazily (launch/checkpoints/hf_safetensors.py),
so that no rank materialises a tensor it does not hold (whole tensors on every rank cost 2.3x the fp32 model per rank).

A plan is "this rank's tensor = these pieces, each a slice of a stored tensor written to a place
of this rank's tensor, then zero rows (vocab padding)"; each piece is (transformers name, a slice
in its stored layout, where it goes), transposed first where GPT-2's Conv1D stores (in, out). It
follows model/hf/convert.py's rules (`rule_for`), so `split(name, split_experts(name, dense[name],
...), ...)` of the whole tensor gives the same values (tests/checkpoints/test_hf_shards.py,
tests/checkpoints/test_moe_export.py). The expert weights of a mixture-of-experts block are read for this
rank's experts only (EP rank r of ep: experts [r E/ep, (r+1) E/ep)), and of each its TP shard.
No files, no reading here.
"""
from dataclasses import dataclass
from typing import Dict, Iterator, Mapping, Optional, Sequence, Tuple, Union

from model.config import GPTConfig
from model.hf.convert import rule_for
from model.hf.source import Source

Index = Tuple[Union[int, slice], ...]


@dataclass(frozen=True)
class Piece:
    name: str
    index: Index  # in the stored layout (before any transpose)
    at: Index  # where it goes in this rank's tensor


@dataclass(frozen=True)
class ShardPlan:
    pieces: Tuple[Piece, ...]
    transpose: bool
    shape: Tuple[int, ...]  # this rank's tensor
    padding: Optional[int] = None  # its rows from this one on are no piece's: zeros (vocab padding)


def hf_sources(config: GPTConfig, fused_experts: bool = False) -> Dict[str, Source]:
    """Our dense name -> its transformers source, for GPT-2, Llama or a mixture-of-experts family
    (model/hf/moe.py; `fused_experts`: the experts as transformers holds them in memory, one
    (E, ., .) tensor, else one tensor per expert as save_pretrained and the hub store them)."""
    if config.moe.enabled:
        from model.hf.moe import moe_sources
        return moe_sources(config, fused_experts)
    if config.arch == "llama":
        from model.hf.llama import fused_parts, name_pairs
        sources = {ours: Source((theirs,)) for ours, theirs in name_pairs(config)}
        sources.update({ours: Source(tuple(name for name, _ in parts), rows=tuple(rows for _, rows in parts))
                        for ours, parts in fused_parts(config)})
        return sources
    from model.hf.gpt2 import gpt2_name_pairs
    return {ours: Source((theirs,), conv1d) for ours, theirs, conv1d in gpt2_name_pairs(config.n_layer)}


def _share(start: int, stop: int, tp_rank: int, tp_size: int) -> slice:
    per = (stop - start) // tp_size
    return slice(start + tp_rank * per, start + (tp_rank + 1) * per)


def _block_shares(blocks: Sequence[int], tp_rank: int, tp_size: int) -> Iterator[Tuple[slice, slice]]:
    """(this rank's share of each block along the full dimension, where it goes along its shard's)."""
    start, at = 0, 0
    for n in blocks:
        yield _share(start, start + n, tp_rank, tp_size), slice(at, at + n // tp_size)
        start, at = start + n, at + n // tp_size


def _expert_plan(dense_name: str, source: Source, ours: Mapping[str, Tuple[int, ...]], tp_rank: int, tp_size: int,
                 ep_rank: int, ep_size: int, config: Optional[GPTConfig]) -> ShardPlan:
    """An expert weight (E, R, C): this EP rank's E/ep experts, each split over TP along rule.dim."""
    rule = rule_for(dense_name, config)
    dim = rule.dim - 1  # the split dimension of one expert's (R, C) matrix
    if source.experts:
        E = source.experts
        expert_shape = (sum(ours[n][0] for n in source.names[:source.parts]), ours[source.names[0]][1])
    else:
        (name,) = source.names
        E, expert_shape = ours[name][0], ours[name][1:]
    local = E // ep_size
    first = ep_rank * local
    blocks = rule.blocks(dense_name, config) or (expert_shape[dim],)
    shares = list(_block_shares(blocks, tp_rank, tp_size))
    shape = [local, *expert_shape]
    shape[1 + dim] //= tp_size

    def placed(prefix: Index, src: slice, dst: slice, offset: int = 0) -> Tuple[Index, Index]:
        index, at = [slice(None), slice(None)], [slice(None), slice(None)]
        index[dim], at[dim] = slice(src.start - offset, src.stop - offset), dst
        return prefix + tuple(index), tuple(at)

    pieces = []
    if not source.experts:  # transformers' in-memory layout: one (E, R, C) tensor, sliced once per block
        for src, dst in shares:
            index, at = placed((slice(first, first + local),), src, dst)
            pieces.append(Piece(name, index, (slice(None),) + at))
    else:
        P = source.parts
        if P > 1 and (dim != 0 or tuple(source.rows) != tuple(blocks)):
            raise ValueError(f"{dense_name}: stored parts {source.rows} are not the blocks {tuple(blocks)} of "
                             f"its TP split")
        for e in range(first, first + local):
            names = source.names[e * P:(e + 1) * P]
            starts = [sum(blocks[:p]) for p in range(P)] if P > 1 else [0] * len(shares)
            for (src, dst), name, offset in zip(shares, names * len(shares) if P == 1 else names, starts):
                index, at = placed((), src, dst, offset)
                pieces.append(Piece(name, index, (e - first,) + at))
    return ShardPlan(tuple(pieces), False, tuple(shape))


def shard_plan(dense_name: str, source: Source, stored_shapes: Mapping[str, Sequence[int]], tp_rank: int,
               tp_size: int, padded_vocab_size: int, *, ep_rank: int = 0, ep_size: int = 1,
               config: Optional[GPTConfig] = None) -> ShardPlan:
    """The pieces of `dense_name`'s shard on `tp_rank` of `tp_size` (model/hf/convert.py's `split`),
    and for an expert weight on `ep_rank` of `ep_size` (`split_experts` first); `config` tells the
    q/k norms' rule (model/hf/convert.py: rule_for) and the fused blocks' rows."""
    rule = rule_for(dense_name, config)
    ours = {name: tuple(shape)[::-1] if source.conv1d else tuple(shape) for name, shape in stored_shapes.items()}
    if rule.experts:
        return _expert_plan(dense_name, source, ours, tp_rank, tp_size, ep_rank, ep_size, config)
    first = ours[source.names[0]]
    everything = tuple(slice(None) for _ in first)

    def sequence(pieces: Sequence[Tuple[str, Index]]) -> Tuple[Piece, ...]:
        """Pieces that fill this rank's rows in order."""
        out, offset = [], 0
        for name, our_index in pieces:
            rows = len(range(*our_index[0].indices(ours[name][0])))
            out.append(Piece(name, our_index[::-1] if source.conv1d else our_index, (slice(offset, offset + rows),)))
            offset += rows
        return tuple(out)

    if rule.dim is None:  # replicated: the whole tensor
        return ShardPlan(sequence([(n, everything) for n in source.names]), source.conv1d, first)
    if rule.dim == 1:  # row-parallel: this rank's input columns of the one tensor
        (name,) = source.names
        columns = _share(0, first[1], tp_rank, tp_size)
        return ShardPlan(sequence([(name, (slice(None), columns))]), source.conv1d,
                         (first[0], columns.stop - columns.start))
    if rule.vocab:  # vocab rows [a, b) of the padded table; only those below the real vocabulary are stored
        (name,) = source.names
        rows = _share(0, padded_vocab_size, tp_rank, tp_size)
        real = slice(min(rows.start, first[0]), min(rows.stop, first[0]))
        pieces = sequence([(name, (real,) + everything[1:])] if real.stop > real.start else [])
        return ShardPlan(pieces, source.conv1d, (rows.stop - rows.start,) + first[1:],
                         real.stop - real.start)
    # Column-parallel: each block ([Q; K; V] of a fused tensor: `stride` equal blocks; or one
    # tensor per block) gives this rank its share of rows.
    stride = rule.stride if len(source.names) == 1 else 1
    blocks = [(name, start, start + ours[name][0] // stride) for name in source.names
              for start in range(0, ours[name][0], ours[name][0] // stride)]
    pieces = sequence([(name, (_share(a, b, tp_rank, tp_size),) + everything[1:]) for name, a, b in blocks])
    rows = sum((b - a) // tp_size for _, a, b in blocks)
    return ShardPlan(pieces, source.conv1d, (rows,) + first[1:])
