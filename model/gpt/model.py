"""The GPT as one module: the token embedding (tied to the head or not), learned positions, the
blocks of model/transformer/block.py, the final norm and the head, built and run in the order of
the layer table (model/gpt/layer_table.py). The dense reference for tests and evaluation; the
pipeline (model/gpt/pipe.py) splits the same modules into stages. No DeepSpeed here."""
import contextlib
from typing import Callable, ContextManager, Optional

import torch
import torch.nn as nn

from model.config import GPTConfig
from model.gpt.layer_table import dense_prefix, pipeline_layers
from model.parallel.layers import group_rank, group_size, mark_sequence_parallel
from model.parallel.mappings import Group
from model.parallel.vocab_embedding import VocabParallelEmbedding
from model.transformer.attention_inputs import StageAttentionInputs
from model.transformer.block import HEAD_STREAM, WPE_STREAM, WTE_STREAM, Block, Carried, init_generator, make_norm, sequence_dropout_rng
from model.transformer.documents import document_ids, document_positions, full_sequence_segments
from model.transformer.moe_losses import MoEStatistics


class TokenEmbedding(nn.Module):
    """wte: vocab-parallel token embedding; also the output head when `tie_embeddings`."""

    def __init__(self, config: GPTConfig, tp_group: Group):
        super().__init__()
        self.wte = VocabParallelEmbedding(config.vocab_size, config.padded_vocab_size(group_size(tp_group)),
                                          config.n_embd, tp_group, init_generator(config, WTE_STREAM),
                                          config.init_std, sequence_parallel=config.sequence_parallel)
        self.document_eos = config.eos_token_id if config.document_mask else None

    def forward(self, ids: torch.Tensor) -> Carried:  # (B, T) -> (B, T, h); (B, T/t, h) with SP
        """With the document mask also the (B, T) segment ids, full length on every TP rank. Under
        CP ids are this rank's (B, T/cp) tokens and the segment ids are counted inside the shard;
        who needs the whole sequence's makes them (model/documents.py: full_sequence_segments)."""
        if self.document_eos is None:
            return self.wte(ids)
        return self.wte(ids), document_ids(ids, self.document_eos)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # (B, T, h) or (B, T/t, h) -> (B, T, V_pad/p)
        return self.wte.logits(hidden)


class LMHead(VocabParallelEmbedding):
    """The output head of a model with untied embeddings: its own vocab-parallel (V_pad/p, h)
    weight, drawn N(0, init_std) from its own stream; forward is the logits.
    (B, T, h) or (B, T/t, h) with SP -> (B, T, V_pad/p)."""

    def __init__(self, config: GPTConfig, tp_group: Group):
        super().__init__(config.vocab_size, config.padded_vocab_size(group_size(tp_group)), config.n_embd,
                         tp_group, init_generator(config, HEAD_STREAM), config.init_std,
                         sequence_parallel=config.sequence_parallel)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits(hidden)


class PositionEmbedding(nn.Module):
    """Adds wpe (replicated) and applies embedding dropout; positions derived here, so only the
    hidden states cross pipeline stages (docs/design.md contract 7). With sequence parallelism the
    input is TP rank r's chunk, positions [r*T/t, (r+1)*T/t). Under context parallelism these are
    offsets inside CP rank c's shard, which starts at c*T/cp: every token takes the row of its
    global position."""

    def __init__(self, config: GPTConfig, tp_group: Group = None,
                 dropout_rng: Callable[[], ContextManager] = contextlib.nullcontext, cp_group: Group = None):
        super().__init__()
        self.cp_group = cp_group
        full = torch.empty(config.seq_len, config.n_embd)
        self.wpe = nn.Parameter(full.normal_(0.0, config.init_std,
                                             generator=init_generator(config, WPE_STREAM)))
        self.drop = nn.Dropout(config.dropout)
        self.sp_group = config.sequence_parallel_group(tp_group)
        mark_sequence_parallel(self.wpe, self.sp_group)  # each rank's gradient reaches only its rows
        self.dropout_rng = sequence_dropout_rng(config, tp_group, dropout_rng)

    def forward(self, x: Carried) -> Carried:  # (B, T, h) -> (B, T, h); SP: (B, T/t, h)
        """With the document mask x is (token embeddings, segment ids): each token takes the row
        of its position inside its document, and the segment ids pass on."""
        tok_emb, segments = x if isinstance(x, tuple) else (x, None)
        T_local = tok_emb.size(1)
        T_shard = T_local * group_size(self.sp_group)  # this CP rank's tokens: T/cp
        start = group_rank(self.cp_group) * T_shard + group_rank(self.sp_group) * T_local
        if segments is None:
            pos_emb = self.wpe[start:start + T_local]
        else:  # segments: (B, T/cp) under CP, made the whole sequence's (B, T)
            positions = document_positions(full_sequence_segments(segments, self.cp_group))
            pos_emb = self.wpe[positions[:, start:start + T_local]]  # (B, T_local, h)
        with self.dropout_rng():
            out = self.drop(tok_emb + pos_emb)
        return out if segments is None else (out, segments)


class GPT(nn.Module):
    """The whole model on one pipeline stage: the dense reference for tests and evaluation.

    Its modules are built and run in the order of the layer table (model/layer_table.py), the
    order in which `model/pipe.py` splits the same modules into stages.
    """

    def __init__(self, config: GPTConfig, tp_group: Optional[Group] = None, ep_group: Optional[Group] = None):
        super().__init__()
        self.config = config
        self.tp_group = tp_group
        self.layer_table = pipeline_layers(config)
        attention_inputs = StageAttentionInputs(config)
        self.moe_statistics = MoEStatistics(config) if config.moe.enabled else None
        for kind, i in self.layer_table:  # each module at its dense name (LAYER_KINDS), in the table's order
            if kind == "embed":
                self.embed = TokenEmbedding(config, tp_group)
            elif kind == "wpe":
                self.pos = PositionEmbedding(config, tp_group)
            elif kind == "block":
                if i == 0:
                    self.blocks = nn.ModuleList()
                self.blocks.append(Block(config, i, tp_group, attention_inputs=attention_inputs, ep_group=ep_group,
                                         moe_statistics=self.moe_statistics))
            elif kind == "ln_f":
                self.ln_f = make_norm(config, tp_group)
            elif kind == "lm_head":
                self.lm_head = LMHead(config, tp_group)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """(B, T) ids -> (B, T, V_pad/p) vocab-sharded logits: each layer of the table in turn."""
        x = ids
        for kind, i in self.layer_table:
            x = self.embed.logits(x) if kind == "head" else self.get_submodule(dense_prefix(kind, i))(x)
        return x
