"""RoPE's cos/sin tables and the document mask are built once per micro-batch per stage and shared by
its blocks (model/transformer/attention_inputs.py), counted with torch's profiler against the kernels
of one build of the tables (`rope_cos_sin` run alone), not a hard-coded number: a 2-block Llama
forward computes the cos and sin kernels of one build, not one build per block. A
micro-batch's entry dies with its segment tensor, so nothing outlives it. That DeepSpeed's full
recompute, interleaved with the next micro-batch's forward by 1F1B, finds its micro-batch's entry
instead of building it again is checked in tests/model/test_document_mask.py's pipeline test.
Unchanged numbers: tests/model/test_llama.py (transformers) and the parity tests."""
import collections
import dataclasses

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from model.config import GPTConfig
from model.gpt.model import GPT
from model.transformer.rotary import rope_cos_sin

EOS = 0
LLAMA = GPTConfig(arch="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=32, ffn_hidden_size=48, seq_len=32,
                  vocab_size=97, seed=3)
TABLE_KERNELS = ("aten::cos", "aten::sin")


def _kernel_counts(fn) -> collections.Counter:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return collections.Counter(event.name for event in prof.events())


def _ids(config: GPTConfig, seed: int) -> torch.Tensor:
    ids = torch.randint(1, config.vocab_size, (2, config.seq_len), generator=torch.Generator().manual_seed(seed))
    ids[:, [5, 20]] = EOS
    return ids


@pytest.mark.parametrize("document_mask", [False, True], ids=["causal", "document-mask"])
def test_rope_tables_are_built_once_per_forward(document_mask):
    config = dataclasses.replace(LLAMA, document_mask=document_mask, eos_token_id=EOS)
    model = GPT(config)
    one_build = _kernel_counts(lambda: rope_cos_sin(config.seq_len, config.head_dim, config.rope_theta,
                                                    torch.device("cpu"), torch.float32))
    assert config.n_layer == 2 and all(one_build[name] >= 1 for name in TABLE_KERNELS), one_build
    with torch.no_grad():
        first = _kernel_counts(lambda: model(_ids(config, 1)))
        second = _kernel_counts(lambda: model(_ids(config, 2)))
    for name in TABLE_KERNELS:
        assert first[name] == one_build[name], (name, first[name], one_build[name])
        # Positions 0..T-1 serve every micro-batch; document positions are the micro-batch's own.
        assert second[name] == (one_build[name] if document_mask else 0), (name, second[name])


def test_one_entry_per_micro_batch_which_dies_with_its_segment_ids():
    config = dataclasses.replace(LLAMA, document_mask=True, eos_token_id=EOS)
    model = GPT(config)
    stage = model.blocks[0].attention_inputs
    assert all(block.attention_inputs is stage for block in model.blocks)  # one cache for the stage
    with torch.no_grad():
        first = model.embed(_ids(config, 1))  # (hidden, segment ids), as a stage receives them
        model.blocks[1](model.blocks[0](first))
        assert stage.built == 1 and len(stage._documents) == 1
        second = model.embed(_ids(config, 2))  # the next micro-batch's forward, the first still in flight
        model.blocks[1](model.blocks[0](second))
        detached = (first[0].detach(), first[1].detach())  # as DeepSpeed's checkpoint replays a block
        model.blocks[0](detached)
        assert stage.built == 2 and len(stage._documents) == 2
        del first, detached
        assert len(stage._documents) == 1  # the first micro-batch's mask and tables are gone with it
