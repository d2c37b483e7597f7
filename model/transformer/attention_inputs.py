"""What every attention core of one pipeline stage needs for one micro-batch, built once and shared
by the stage's blocks: RoPE's cos/sin for the positions in use and, with the document
mask, the mask (model/transformer/documents.py), rather than the cos/sin tables rebuilt by each block in every
call and in every recompute.

- Positions 0..T-1 (no document mask): the tables depend on (T, device, dtype) alone, so one pair
  serves every micro-batch; under torch.compile they are built inside the block's graph instead
  (inductor fuses them into RoPE's kernels, and a cache lookup would break the graph).
- Document mask: the positions, the mask and the tables at those positions are built from the
  micro-batch's (B, T) segment ids and kept while that segment tensor lives. 1F1B and ZB-H1 run
  other micro-batches' forwards between a micro-batch's forward and its backward, so several
  entries may be held, one per micro-batch in flight; full recompute (DeepSpeed's checkpoint)
  replays a block with a detached view of the same segment storage, which finds its entry.
- Context parallelism: the segment ids a block holds are its CP rank's shard; the entry is keyed
  by that shard and built from the whole sequence's ids (one all-gather over CP per build; every
  CP rank runs the same schedule, so they build, and gather, together), since after Ulysses'
  all-to-all the core attends over the whole sequence.
"""
import weakref
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

from model.config import GPTConfig
from model.parallel.compile_boundary import opaque_to_compile
from model.parallel.mappings import Group
from model.transformer.documents import (block_document_mask, dense_document_mask, document_positions,
                                         full_sequence_segments, uses_flex_attention)
from model.transformer.rotary import at_positions, rope_cos_sin


@dataclass
class AttentionInputs:
    rope: Optional[Tuple[torch.Tensor, torch.Tensor]]
    """(cos, sin): (T, d) for positions 0..T-1, or (B, 1, T, d) at each token's document position;
    None without RoPE."""
    mask: Any = None
    """None (causal), the boolean (B, 1, T, T) mask, or a BlockMask on the flex_attention path."""


NO_ROPE_CAUSAL = AttentionInputs(None)
"""Learned positions without the document mask: nothing to build."""


def causal_inputs(config: GPTConfig, seq_len: int, device: torch.device, dtype: torch.dtype) -> AttentionInputs:
    """The inputs of plain causal attention over positions 0..seq_len-1."""
    rope = None
    if config.position == "rope":
        rope = rope_cos_sin(seq_len, config.head_dim, config.rope_theta, device, dtype, config.rope_scaling)
    return AttentionInputs(rope)


def document_inputs(config: GPTConfig, segments: torch.Tensor, dtype: torch.dtype) -> AttentionInputs:
    """The inputs of document-masked attention for (B, T) segment ids. Nothing here keeps `segments`
    itself alive (the cache's entries die with it)."""
    with torch.no_grad():
        mask = (block_document_mask(segments) if uses_flex_attention(segments.device, config.dropout)
                else dense_document_mask(segments))
        rope = None
        if config.position == "rope":
            tables = causal_inputs(config, segments.size(-1), segments.device, dtype).rope
            rope = at_positions(*tables, document_positions(segments))  # (B, 1, T, d) each
    return AttentionInputs(rope, mask)


class _Entry:
    """One micro-batch's inputs, keyed by its segment tensor (held weakly) and that tensor's storage."""

    def __init__(self, segments: torch.Tensor, dtype: torch.dtype, inputs: AttentionInputs, on_death):
        self.segments = weakref.ref(segments, on_death)
        self.key = _storage_key(segments)
        self.dtype, self.inputs = dtype, inputs


def _storage_key(segments: torch.Tensor) -> tuple:
    return segments.data_ptr(), segments.shape, segments.stride(), segments._version


class StageAttentionInputs:
    """The cache one stage's blocks share (module docstring); `built` counts the builds."""

    def __init__(self, config: GPTConfig):
        self.config = config
        self.built = 0
        self._causal: Dict[tuple, AttentionInputs] = {}
        self._documents: List[_Entry] = []

    def __call__(self, segments: Optional[torch.Tensor], seq_len: int, device: torch.device,
                 dtype: torch.dtype, cp_group: Group = None) -> AttentionInputs:
        """`segments`: the micro-batch's (B, T) segment ids (B, T/cp with CP: this rank's shard), or
        None without the document mask; seq_len: T, the length attention sees (all TP ranks' chunks
        under sequence parallelism, all CP ranks' shards); dtype: that of the queries and keys."""
        if segments is None and self.config.position != "rope":
            return NO_ROPE_CAUSAL
        if segments is None and torch.compiler.is_compiling():
            return causal_inputs(self.config, seq_len, device, dtype)
        return self._cached(segments, seq_len, device, dtype, cp_group)

    @opaque_to_compile  # Python-side bookkeeping: under train.compile the block's graph breaks here
    def _cached(self, segments, seq_len, device, dtype, cp_group) -> AttentionInputs:
        if torch.is_inference_mode_enabled():  # inference tensors could not be saved for a later backward
            return causal_inputs(self.config, seq_len, device, dtype) if segments is None \
                else document_inputs(self.config, full_sequence_segments(segments, cp_group), dtype)
        if segments is None:
            key = (seq_len, device, dtype)
            if key not in self._causal:
                self._causal = {key: causal_inputs(self.config, seq_len, device, dtype)}  # one length at a time
                self.built += 1
            return self._causal[key]
        # An entry whose segment tensor still lives keeps that storage alive: an equal key is that storage.
        key = _storage_key(segments)
        for entry in self._documents:
            if entry.key == key and entry.dtype == dtype and entry.segments() is not None:
                return entry.inputs
        inputs = document_inputs(self.config, full_sequence_segments(segments, cp_group), dtype)
        entry = _Entry(segments, dtype, inputs, self._forget)
        self._documents.append(entry)
        self.built += 1
        return entry.inputs

    def __getstate__(self) -> dict:
        """A copy (deepcopy, pickle) starts empty: weak references cannot be copied."""
        return {**self.__dict__, "_causal": {}, "_documents": []}

    def _forget(self, dead: weakref.ref) -> None:
        """A micro-batch's segment tensor is gone: its entry (mask and tables) goes with it."""
        self._documents = [entry for entry in self._documents if entry.segments is not dead]
