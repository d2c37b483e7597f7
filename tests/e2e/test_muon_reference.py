"""Muon against an implementation that shares nothing with ours: transformers' GPT-2,
trained in this process with a plain Muon written from the papers (tests/helpers/plain_muon.py)
for Q, K, V, the attention projection, c_fc and the MLP projection, each logical matrix on its own,
and torch's own AdamW for the embeddings, norms and biases, from the same initial weights (ours,
seeded, under transformers' names: model/hf/gpt2.py), on the same 5 global batches, with the run's
gradient clipping; against the shared (2,2,2) Muon parity run with sequence parallelism (no run of
its own). Its losses and gradient norms at every step agree within 1e-5 (measured: 6e-8 and 4e-8), and
its weights after step 5 (exported from the run's checkpoint): the Muon matrices within 1e-5 of their
largest element (measured 3.4e-7), AdamW's within lr / 100 (measured 1.4e-6 = lr / 2,200: an element
whose gradient is at rounding noise moves by up to lr either way under Adam)."""
import pytest
import torch
from safetensors.torch import load_file
from torch.nn import functional
import transformers  # the model classes load on first use (transformers' lazy module), not at collection

from helpers.launcher import TINY
from helpers.parity_runs import STEPS
from helpers.plain_muon import PlainMuon
from launch import export_hf
from launch.config.layout import check_and_derive_layout
from launch.config.recipe import load_recipe
from launch.feed.run_inputs import load_run_data
from model.gpt.model import GPT
from model.hf.gpt2 import gpt2_config_kwargs, to_gpt2_state_dict

LAYOUT = (2, 2, 2, "sp", "muon")
RTOL = 1e-5
# Conv1D weights (in, out): c_attn's output columns are [Q; K; V]
MUON_MATRICES = {"attn.c_attn.weight": 3, "attn.c_proj.weight": 1, "mlp.c_fc.weight": 1, "mlp.c_proj.weight": 1}


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.mark.slow
def test_muon_run_matches_plain_muon_on_transformers_gpt2(parity_runs, tmp_path):
    run = parity_runs[LAYOUT]
    recipe = load_recipe(TINY, [])
    train_cfg = recipe.train
    run_data, vocab_size = load_run_data(recipe, check_and_derive_layout(recipe, 1, 1, 1, on_cpu=True))
    config = recipe.gpt_config(vocab_size)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(**gpt2_config_kwargs(config)))
    hf.load_state_dict(to_gpt2_state_dict(GPT(config)), strict=False)  # the step-0 weights of every layout

    matrices = {name: (p, MUON_MATRICES[name.split(".", 3)[3]]) for name, p in hf.named_parameters()
                if name.split(".", 3)[-1] in MUON_MATRICES}
    others = [p for name, p in hf.named_parameters() if name not in matrices]
    adamw = torch.optim.AdamW([{"params": [p for p in others if p.dim() >= 2]},
                               {"params": [p for p in others if p.dim() < 2], "weight_decay": 0.0}],
                              lr=train_cfg.lr, betas=(train_cfg.beta1, train_cfg.beta2), eps=train_cfg.eps,
                              weight_decay=train_cfg.weight_decay)
    muon = PlainMuon(train_cfg.muon_momentum)
    batches = run_data.train_batches(0, 1)
    micro_batches = train_cfg.global_batch_size // train_cfg.micro_batch_size
    for metrics in run["metrics"]:
        x, y = (torch.cat(t) for t in zip(*[next(batches) for _ in range(micro_batches)]))
        logits = hf(x).logits
        loss = functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        hf.zero_grad()
        loss.backward()
        # the norm in fp64 (torch's clip_grad_norm_ sums per-tensor fp32 norms: 1e-5 off here), DeepSpeed's clip rule
        norm = sum(p.grad.double().pow(2).sum() for p in hf.parameters()).sqrt().item()
        coef = train_cfg.grad_clip / (norm + 1e-6)
        for p in hf.parameters():
            p.grad.mul_(min(coef, 1.0))
        assert _rel(metrics["loss"], loss.item()) <= RTOL, (metrics["step"], metrics["loss"], loss.item())
        assert _rel(metrics["grad_norm"], norm) <= RTOL, (metrics["step"], metrics["grad_norm"], norm)
        for group in adamw.param_groups:
            group["lr"] = metrics["lr"]
        adamw.step()
        for weight, parts in matrices.values():
            muon.step(weight, weight.grad, metrics["lr"], train_cfg.weight_decay, dim=1,
                      parts=[weight.size(1) // parts] * parts)
    assert metrics["step"] == STEPS

    assert export_hf.main(["--load", str(run["dir"] / "ck" / f"step{STEPS:08d}"), "--out", str(tmp_path / "hf")]) == 0
    trained = load_file(tmp_path / "hf" / "model.safetensors")
    muon_names = {name for name in matrices}
    for name, p in hf.state_dict().items():
        if name not in trained:
            continue  # the tied lm_head: wte
        error = (trained[name] - p).abs().max().item()
        if name in muon_names:  # NS is well conditioned: rounding stays rounding
            assert error <= 1e-5 * p.abs().max().item(), (name, error)
        else:  # Adam moves an element whose gradient is rounding noise by up to lr in either direction
            assert error <= 0.01 * train_cfg.lr, (name, error)
