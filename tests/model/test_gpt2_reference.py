"""Our GPT at tp=1 is GPT-2: same logits and loss as transformers' GPT2LMHeadModel given the
same weights, and the same gradients."""
import torch
from torch.nn import functional
import transformers  # the model classes load on first use (transformers' lazy module), not at collection

from model.config import GPTConfig
from model.gpt.model import GPT
from model.hf.gpt2 import gpt2_config_kwargs, to_gpt2_state_dict
from model.parallel.cross_entropy import vocab_parallel_cross_entropy


def test_dense_gpt_matches_transformers_gpt2():
    config = GPTConfig(n_layer=2, n_head=4, n_embd=32, seq_len=16, vocab_size=97,
                       vocab_pad_multiple=8, seed=3)
    ours = GPT(config)
    theirs = transformers.GPT2LMHeadModel(transformers.GPT2Config(**gpt2_config_kwargs(config)))
    missing, unexpected = theirs.load_state_dict(to_gpt2_state_dict(ours), strict=False)
    assert not unexpected and all(k.endswith("attn.bias") or k.endswith("masked_bias") for k in missing), (missing, unexpected)
    ours.eval(), theirs.eval()

    ids = torch.randint(0, config.vocab_size, (3, config.seq_len), generator=torch.Generator().manual_seed(0))
    logits = ours(ids)
    assert logits.shape[-1] == config.padded_vocab_size(1) == 104
    assert torch.isinf(logits[..., config.vocab_size:]).all()  # padding never takes mass
    ref = theirs(ids).logits
    torch.testing.assert_close(logits[..., :config.vocab_size], ref, atol=2e-5, rtol=1e-5)

    labels = ids.roll(-1, dims=1)
    loss = vocab_parallel_cross_entropy(logits, labels, None).mean()
    ref_loss = functional.cross_entropy(ref.reshape(-1, config.vocab_size), labels.reshape(-1))
    torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=1e-6)

    loss.backward(), ref_loss.backward()
    torch.testing.assert_close(ours.blocks[1].mlp.c_fc.weight.grad,
                               theirs.transformer.h[1].mlp.c_fc.weight.grad.t(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(ours.embed.wte.weight.grad[: config.vocab_size],
                               theirs.transformer.wte.weight.grad, atol=1e-6, rtol=1e-5)
    assert (ours.embed.wte.weight.grad[config.vocab_size:] == 0).all()


def test_init_follows_gpt2():
    """N(0, 0.02) weights, residual projections 0.02/sqrt(2*n_layer), zero biases."""
    config = GPTConfig(n_layer=4, n_head=4, n_embd=256, seq_len=64, vocab_size=500)
    model = GPT(config)
    std = lambda t: t.detach().std().item()  # noqa: E731
    assert abs(std(model.blocks[0].attn.c_attn.weight) - 0.02) < 0.001
    assert abs(std(model.blocks[0].mlp.c_proj.weight) - 0.02 / (2 * 4) ** 0.5) < 0.0005
    assert abs(std(model.embed.wte.weight) - 0.02) < 0.001
    assert (model.blocks[0].attn.c_proj.bias == 0).all()
