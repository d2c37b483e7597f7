"""Context parallelism, the run side (docs/design.md contract 17): the fourth axis inside
DeepSpeed's data axis, and what each CP rank computes outside attention against the dense,
single-process reference: the document ids, the learned positions of its tokens (global, with and without the document mask, with sequence parallelism) and the loss,
whose token-weighted mean over the CP group is F.cross_entropy's over the whole sequences with
its gradient, also when the shards count unequal numbers of tokens. The layouts' parity is the
parity runs' (tests/e2e/test_parity.py, tests/e2e/test_llama_parity.py); bad input, tests/runtime/test_errors.py."""
import itertools

import pytest
import torch
import torch.distributed as dist
from torch.nn import functional

from helpers.distributed import run_distributed
from model.config import GPTConfig
from model.gpt.model import PositionEmbedding, TokenEmbedding
from model.parallel.context_parallel import sequence_shard, token_weighted_mean
from model.parallel.cross_entropy import IGNORE_INDEX, vocab_parallel_cross_entropy
from model.parallel.state import build_topology, context_parallel_groups
from model.transformer.documents import document_ids, full_sequence_segments

EOS = 7
CONFIG = dict(vocab_size=64, n_layer=1, n_head=4, n_embd=16, seq_len=16, dropout=0.0, seed=3)


@pytest.mark.parametrize("tp,cp,pp,dp", [(2, 2, 2, 2), (1, 4, 1, 2), (2, 2, 1, 1)])
def test_topology_keeps_tp_adjacent_then_cp(tp, cp, pp, dp):
    """Global rank = ((stage * dp + replica) * cp + cp rank) * tp + tp rank: the order
    model/parallel/state.py sets out, derived here by hand; DeepSpeed's data axis holds dp x cp, cp fastest."""
    topology = build_topology(tp, pp, dp, cp)
    groups = sorted(map(tuple, context_parallel_groups(topology, cp)))
    want = sorted(tuple(((stage * dp + replica) * cp + c) * tp + t for c in range(cp))
                  for stage, replica, t in itertools.product(range(pp), range(dp), range(tp)))
    assert groups == want
    for stage, replica, c, t in itertools.product(range(pp), range(dp), range(cp), range(tp)):
        coord = topology.get_coord(((stage * dp + replica) * cp + c) * tp + t)
        assert (coord.pipe, coord.data, coord.model) == (stage, replica * cp + c, t)


def _world():
    return dist.new_group(list(range(dist.get_world_size())))


def _check(name, got, want, atol=1e-6):
    assert got.shape == want.shape, (name, got.shape, want.shape)
    err = (got - want).abs().max().item()
    assert err <= atol, f"{name}: max abs error {err:.3g} (rank {dist.get_rank()})"


def _cp_body():
    """2 ranks, one CP group of the whole world."""
    from model.parallel.state import init_parallel_state
    state = init_parallel_state(1, 1, 2)
    rank, cp = state.cp_rank, state.cp_size
    assert (state.dp_rank, state.dp_size, cp, rank) == (0, 1, 2, dist.get_rank())
    group = state.cp_group
    B, T = 3, CONFIG["seq_len"]
    ids = torch.randint(0, CONFIG["vocab_size"], (B, T), generator=torch.Generator().manual_seed(0))
    ids[0, [2, 9, 12]] = EOS  # a document crossing the shard boundary (T/cp = 8), and one inside a shard
    ids[1, [8]] = EOS  # one starting exactly at the boundary
    local_ids = sequence_shard(ids, rank, cp)

    # Document ids and learned positions: the local rows of the dense model's.
    h = CONFIG["n_embd"]
    for mask in (False, True):
        config = GPTConfig(**CONFIG, document_mask=mask, eos_token_id=EOS)
        dense_embed, dense_pos = TokenEmbedding(config, None), PositionEmbedding(config, None)
        pos = PositionEmbedding(config, None, cp_group=group)
        local = dense_embed(local_ids)  # the token embedding is per token: nothing of CP in it
        if mask:  # the whole sequence's document ids, made from the shard's
            assert torch.equal(full_sequence_segments(local[1], group), document_ids(ids, EOS))
        want, got = dense_pos(dense_embed(ids)), pos(local)
        want, got = (want[0], got[0]) if mask else (want, got)
        _check(f"embeddings (mask {mask})", got, sequence_shard(want, rank, cp))

        # With sequence parallelism as well: the 2 ranks are also one TP group, so this process is
        # CP rank r and TP rank r, and holds the whole sequence's tokens r T/cp + r T/(cp tp) onward.
        sp = PositionEmbedding(GPTConfig(**CONFIG, document_mask=mask, eos_token_id=EOS, sequence_parallel=True),
                               _world(), cp_group=group)
        rows = T // 4
        zeros, dense_zeros = torch.zeros(B, rows, h), torch.zeros(B, T, h)  # positions alone
        got = sp((zeros, local[1]) if mask else zeros)
        want = dense_pos((dense_zeros, document_ids(ids, EOS)) if mask else dense_zeros)
        got, want = (got[0], want[0]) if mask else (got, want)
        first = rank * (T // cp) + rank * rows
        _check(f"SP positions (mask {mask})", got, want[:, first:first + rows])

    # The loss: unequal counted tokens per shard (rank 0 holds 5 ignored labels, rank 1 none).
    logits = torch.randn(B, T, CONFIG["vocab_size"], generator=torch.Generator().manual_seed(1), requires_grad=True)
    labels = torch.randint(0, CONFIG["vocab_size"], (B, T), generator=torch.Generator().manual_seed(2))
    labels[0, :5] = IGNORE_INDEX
    want = functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
    want.backward()
    local_logits = sequence_shard(logits.detach(), rank, cp).requires_grad_()
    local_labels = sequence_shard(labels, rank, cp)
    token_loss = vocab_parallel_cross_entropy(local_logits, local_labels, None)
    loss = token_weighted_mean(token_loss, local_labels != IGNORE_INDEX, group)
    loss.backward()
    # What DeepSpeed reports and reduces over its data axis: the mean over the CP ranks.
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    _check("loss", mean / cp, want.detach())
    _check("logits' gradient", local_logits.grad / cp, sequence_shard(logits.grad, rank, cp))


def test_cp_ranks_compute_their_shard_of_the_dense_model_outside_attention():
    run_distributed(_cp_body, 2)
