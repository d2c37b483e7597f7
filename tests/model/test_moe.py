"""The mixture-of-experts MLP (model/transformer/moe.py) against dense references, in process and on gloo processes:

- routing: the k largest logits, ties to the lower expert (the same choice at every layout), and the
  weights of both routers against their definitions;
- the dispatch and combine: MoEMLP at (tp, ep) = (1, 1), (1, 2), (1, 4), (2, 2) and with sequence
  parallelism at tp = 2, against a dense reference that runs every expert on every token and masks
  with the routing weights: each rank's output and input gradient, and every parameter's gradient
  summed over the ranks that hold it (the experts' over their expert-data-parallel group), equal the
  reference's; one expert receives no token and gets a zero gradient;
- the router losses: the load-balancing loss (transformers' formula) and the z-loss of each
  micro-batch, recorded and added to the backward with DeepSpeed's scale.
"""
import contextlib
import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch.nn import functional

from helpers.distributed import run_distributed
from model.config import GPTConfig
from model.hf.convert import split, split_experts
from model.parallel.layers import allreduce_sequence_parallel_grads
from model.parallel.state import init_parallel_state
from model.transformer import grouped_gemm
from model.transformer.block import init_generator
from model.transformer.grouped_gemm import expert_rows, grouped_linear, grouped_mm_fits
from model.transformer.moe import MoEMLP, Router, route

B, T = 2, 8
DEAD = 3  # the expert no token reaches (its router row points away from every input)
CONFIG = GPTConfig(arch="qwen3_moe", n_layer=2, n_head=4, n_kv_head=2, n_embd=16, seq_len=T, vocab_size=50, seed=5,
                   moe=dict(num_experts=8, experts_per_token=2, expert_ffn_hidden_size=12, aux_loss_coef=0.1,
                            z_loss_coef=0.01))


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _inputs(replica: int) -> torch.Tensor:
    """(B, T, h) tokens of one data replica, all with a large first component, which the dead
    expert's router row (see `_build`) turns into a logit far below every other."""
    x = _randn(B, T, CONFIG.n_embd, seed=100 + replica)
    x[..., 0] = 4.0 + x[..., 0].abs()
    return x


def _build(config, tp_group=None, ep_group=None) -> MoEMLP:
    moe = MoEMLP(config, 0, tp_group, init_generator(config, 0), contextlib.nullcontext, ep_group=ep_group)
    with torch.no_grad():
        moe.router.weight[DEAD] = 0.0
        moe.router.weight[DEAD, 0] = -3.0
    return moe


def dense_reference(moe: MoEMLP, x: torch.Tensor) -> torch.Tensor:
    """Every expert on every token, weighted by the routing weights (zero for the experts not
    chosen), plus the shared experts; (B, T, h) -> (B, T, h). The module's weights at tp = ep = 1."""
    tokens = x.reshape(-1, x.size(-1))
    logits = functional.linear(tokens, moe.router.weight).float()
    probs = functional.softmax(logits, dim=-1)
    top = torch.topk(logits, moe.k, dim=-1).indices  # random inputs: no ties
    chosen = probs.gather(1, top)
    chosen = chosen / chosen.sum(-1, keepdim=True) if moe.norm_topk_prob else chosen
    mask = torch.zeros_like(probs).scatter(1, top, chosen)  # (N, E)
    out = torch.zeros_like(tokens)
    for e in range(moe.num_experts):
        gate, up = functional.linear(tokens, moe.experts.gate_up_proj[e]).chunk(2, dim=-1)
        out = out + mask[:, e:e + 1] * functional.linear(functional.silu(gate) * up, moe.experts.down_proj[e])
    y = out.view_as(x)
    return y if moe.shared_experts is None else y + moe.shared_experts(x)


def reference_losses(moe: MoEMLP, x: torch.Tensor):
    """transformers' load_balancing_loss_func for one block (E * sum_e f_e P_e, f_e the assignments'
    share per token) and the ST-MoE z-loss, for the tokens x."""
    tokens = x.reshape(-1, x.size(-1))
    logits = functional.linear(tokens, moe.router.weight).float()
    probs = functional.softmax(logits, dim=-1)
    top = torch.topk(probs, moe.k, dim=-1).indices
    f = functional.one_hot(top, moe.num_experts).float().sum(1).mean(0)  # (E,)
    aux = moe.num_experts * (f * probs.mean(0)).sum()
    z = torch.logsumexp(logits, dim=-1).pow(2).mean()
    return aux, z, functional.one_hot(top, moe.num_experts).sum((0, 1))


# ------------------------------------------------------------------ in process

def test_route_breaks_ties_toward_the_lower_expert():
    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0, 2.0]])
    _, experts, _ = route(logits, 2, "softmax_topk", True)
    assert experts.tolist() == [[1, 2], [0, 1]]


def test_router_weights_follow_their_definitions():
    logits = _randn(6, 8, seed=1)
    probs = functional.softmax(logits, dim=-1)
    top = torch.topk(logits, 3, dim=-1)
    weights, experts, _ = route(logits, 3, "softmax_topk", False)
    assert torch.equal(experts, top.indices)
    torch.testing.assert_close(weights, probs.gather(1, top.indices))
    normalised, _, _ = route(logits, 3, "softmax_topk", True)
    torch.testing.assert_close(normalised, weights / weights.sum(-1, keepdim=True))
    mixtral, _, _ = route(logits, 3, "topk_softmax", True)  # a softmax over the chosen logits: the same
    torch.testing.assert_close(mixtral, functional.softmax(top.values, dim=-1))
    torch.testing.assert_close(mixtral, normalised)


def test_an_fp32_router_picks_the_fp32_experts_where_bf16_logits_tie():
    """bf16 activations and router weight, 128 experts, top-8, Gaussian tokens: bf16 logits tie at
    the k-th place for some tokens (5.8-7.2%; ties go to the lower expert), fp32 logits of
    the same bf16 values for none. router_dtype fp32 picks the experts of the fp32 reference; the
    router in the activations' dtype picks others for some tokens."""
    E, k, h = 128, 8, 256
    x = _randn(4096, h, seed=11).bfloat16()
    picked, tie_rate = {}, {}
    for router_dtype in ("fp32", "activations"):
        moe = dataclasses.replace(CONFIG.moe, num_experts=E, experts_per_token=k, router_dtype=router_dtype)
        router = Router(dataclasses.replace(CONFIG, n_embd=h, moe=moe), init_generator(CONFIG, 0)).bfloat16()
        logits = router(x)
        assert logits.dtype == (torch.float32 if router_dtype == "fp32" else torch.bfloat16)
        top = torch.sort(logits.float(), dim=-1, descending=True).values
        tie_rate[router_dtype] = (top[:, k - 1] == top[:, k]).float().mean().item()
        picked[router_dtype] = route(logits, k, "softmax_topk", True)[1].sort(dim=-1).values
    reference = torch.topk(functional.linear(x.float(), router.weight.float()), k).indices.sort(dim=-1).values
    assert tie_rate["fp32"] == 0 and tie_rate["activations"] > 0.01, tie_rate
    assert torch.equal(picked["fp32"], reference)
    assert (picked["activations"] != reference).any(dim=-1).float().mean() > 0.01


def test_fp32_runs_do_not_depend_on_the_router_dtype():
    """In fp32 the router computed in fp32 already: both settings give the same numbers, to the bit."""
    results = []
    for router_dtype in ("fp32", "activations"):
        moe = _build(dataclasses.replace(CONFIG, moe=dataclasses.replace(CONFIG.moe, router_dtype=router_dtype)))
        x = _inputs(0).requires_grad_()
        y = moe(x)
        (y * _randn(*x.shape, seed=7)).sum().backward()
        results.append([y, x.grad] + [p.grad for p in moe.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results))


@pytest.mark.parametrize("shared", [0, 1], ids=["routed", "shared-expert"])
def test_moe_matches_every_expert_on_every_token_masked(shared):
    config = dataclasses.replace(CONFIG, moe=dataclasses.replace(CONFIG.moe, shared_experts=shared))
    moe = _build(config)
    x = _inputs(0).requires_grad_()
    probe = _randn(*x.shape, seed=7)
    (moe(x) * probe).sum().backward()
    got = {name: p.grad.clone() for name, p in moe.named_parameters()}
    grad_x = x.grad.clone()

    moe.zero_grad()
    x.grad = None
    y = dense_reference(moe, x)
    aux, z, counts = reference_losses(moe, x)
    weight = moe.statistics.block_weight  # the losses are means over the model's MoE blocks
    ((y * probe).sum() + weight * (config.moe.aux_loss_coef * aux + config.moe.z_loss_coef * z)).backward()
    torch.testing.assert_close(grad_x, x.grad, rtol=1e-5, atol=1e-6)
    for name, p in moe.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=1e-5, atol=1e-6, msg=name)
    assert counts[DEAD] == 0 and got["experts.gate_up_proj"][DEAD].abs().max() == 0  # no token: no gradient
    record = moe.statistics.take()[0]  # [aux, z, micro-batches, counts] of block 0
    torch.testing.assert_close(record[:3].float(), torch.stack([aux, z, torch.tensor(1.0)]).detach())
    assert record[3:].long().tolist() == counts.tolist()


def test_the_router_losses_enter_backward_with_the_set_scale():
    """backward_scale (DeepSpeed's 1/gas x loss scale x cp, set by the run) multiplies the losses'
    gradient only: with y's gradient zero, the router's gradient is scale times that of the losses."""
    moe = _build(CONFIG)
    x = _inputs(0)
    grads = []
    for scale in (1.0, 0.25):
        moe.statistics.backward_scale = scale
        moe.zero_grad()
        (moe(x) * 0.0).sum().backward()
        grads.append(moe.router.weight.grad.clone())
    assert grads[0].abs().max() > 0
    torch.testing.assert_close(grads[1], 0.25 * grads[0], rtol=1e-6, atol=0)


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped-mm", "gemm-per-expert"])
def test_grouped_linear_matches_a_linear_per_expert(monkeypatch, grouped):
    """Both ways of running the experts (torch's grouped GEMM where it fits, one GEMM per expert
    otherwise) against functional.linear per expert under autograd; a group of no rows included,
    and the weight gradient added into an fp32 main gradient (bf16 gradient-accumulation fusion)."""
    x, weight = _randn(12, 16, seed=1), _randn(4, 8, 16, seed=2)
    assert grouped_mm_fits(x, weight)  # 16-byte rows: this torch's CPU grouped GEMM takes them
    if not grouped:
        monkeypatch.setattr(grouped_gemm, "grouped_mm_fits", lambda *args: False)
    sizes, probe = [3, 0, 5, 4], _randn(12, 8, seed=3)
    rows = expert_rows(torch.tensor(sizes), sizes)
    x_ours, w_ours = x.clone().requires_grad_(), weight.clone().requires_grad_()
    (grouped_linear(x_ours, w_ours, rows) * probe).sum().backward()
    x_ref, w_ref = x.clone().requires_grad_(), weight.clone().requires_grad_()
    y_ref = torch.cat([functional.linear(x_g, w_g) for x_g, w_g in zip(x_ref.split(sizes), w_ref)])
    (y_ref * probe).sum().backward()
    torch.testing.assert_close(x_ours.grad, x_ref.grad)
    torch.testing.assert_close(w_ours.grad, w_ref.grad)
    assert w_ours.grad[1].abs().max() == 0
    main = torch.ones_like(weight)  # a main gradient: added into, no .grad
    w_main = weight.clone().requires_grad_()
    w_main.main_grad = main
    (grouped_linear(x.clone(), w_main, rows) * probe).sum().backward()
    assert w_main.grad is None
    torch.testing.assert_close(main, 1 + w_ref.grad)


def test_expert_biases_change_the_choice_and_not_the_weights():
    """balance=bias (DeepSeek-V3): the k largest probabilities plus bias are chosen; the weights are
    the chosen experts' own probabilities, renormalised as without a bias."""
    logits = _randn(32, 8, seed=4)
    probs = functional.softmax(logits, dim=-1)
    bias = torch.tensor([0.3, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -0.3])
    weights, experts, _ = route(logits, 2, "softmax_topk", True, bias)
    expected = torch.topk(probs + bias, 2, dim=-1).indices
    assert torch.equal(experts, expected) and not torch.equal(experts, torch.topk(logits, 2).indices)
    chosen = probs.gather(1, expected)
    torch.testing.assert_close(weights, chosen / chosen.sum(-1, keepdim=True))


def test_the_balancing_state_moves_after_a_step():
    """From a step's assignments per expert: each bias moves by the rate toward the mean load (up for
    an expert below it, down above, unchanged at it), and balance_scope=global_batch keeps the share
    k * c_e / sum(c) for the next step's loss; both stay fp32 in a bf16 module."""
    from model.transformer.moe_balance import balance_after_step
    load = torch.tensor([[5.0, 1.0, 3.0, 3.0, 0.0, 4.0, 3.0, 5.0]])  # mean 3
    for balance, scope in (("bias", "micro_batch"), ("aux_loss", "global_batch")):
        config = dataclasses.replace(CONFIG, moe=dataclasses.replace(CONFIG.moe, balance=balance, balance_scope=scope,
                                                                     bias_update_rate=0.01))
        moe = _build(config).bfloat16()
        balance_after_step(moe, load, config.moe)
        balance_after_step(moe, load, config.moe)
        if balance == "bias":
            assert moe.router.expert_bias.dtype == torch.float32
            torch.testing.assert_close(moe.router.expert_bias,
                                       torch.tensor([-0.02, 0.02, 0.0, 0.0, 0.02, -0.02, 0.0, -0.02]))
        else:
            assert moe.router.step_load.dtype == torch.float32
            torch.testing.assert_close(moe.router.step_load, 2 * load[0] / 24)


def test_global_batch_balance_takes_f_from_the_last_step():
    """balance_scope=global_batch: the load-balancing loss is E * sum_e f_e P_e with f the router's
    step_load (the last step's shares) and P this micro-batch's mean probabilities: its gradient
    equals autograd's of that formula. Before any step f is uniform (k/E), which gives none."""
    config = dataclasses.replace(CONFIG, moe=dataclasses.replace(CONFIG.moe, balance_scope="global_batch",
                                                                 z_loss_coef=0.0))
    moe, x = _build(config), _inputs(0)
    for f in (torch.full((8,), 2 / 8), torch.tensor([0.5, 0.1, 0.2, 0.3, 0.0, 0.4, 0.3, 0.2])):
        moe.router.step_load.copy_(f)
        moe.zero_grad()
        (moe(x) * 0.0).sum().backward()
        weight = moe.router.weight.detach().clone().requires_grad_()
        probs = functional.softmax(functional.linear(x.reshape(-1, x.size(-1)), weight), dim=-1)
        aux = 8 * (f * probs.mean(0)).sum() * config.moe.aux_loss_coef / 2  # the mean over n_layer=2 blocks' weight
        aux.backward()
        torch.testing.assert_close(moe.router.weight.grad, weight.grad, rtol=1e-5, atol=1e-9)
    moe.router.step_load.fill_(2 / 8)
    moe.zero_grad()
    (moe(x) * 0.0).sum().backward()
    assert moe.router.weight.grad.abs().max() < 1e-8


def test_evaluation_records_nothing():
    moe = _build(CONFIG)
    with torch.no_grad():
        moe(_inputs(0))
    assert moe.statistics.take().abs().sum() == 0


# ------------------------------------------------------------------ on gloo processes

def _data_axis_group(state):
    """This rank's data axis (the ranks at its TP coordinate), made as a process group."""
    own = None
    for ranks in state.topology.get_axis_comm_lists("data"):
        group = dist.new_group(ranks)
        if state.global_rank in ranks:
            own = group
    return own


def _sharded_body(tp: int, ep: int, sp: bool, shared: int):
    state = init_parallel_state(tp, 1, 1, ep, experts=True)
    config = dataclasses.replace(CONFIG, sequence_parallel=sp, moe=dataclasses.replace(CONFIG.moe, shared_experts=shared))
    data_group = _data_axis_group(state)
    replicas = state.dp_size

    dense = _build(config)  # every rank runs the reference on every replica's tokens
    reference = {name: torch.zeros_like(p) for name, p in dense.named_parameters()}
    ref_out, ref_grad_x = None, None
    for replica in range(replicas):
        dense.zero_grad()
        x = _inputs(replica).requires_grad_()
        y = dense_reference(dense, x)
        aux, z, _ = reference_losses(dense, x)
        weight = dense.statistics.block_weight
        loss = (y * _randn(*x.shape, seed=200 + replica)).sum()
        (loss + weight * (config.moe.aux_loss_coef * aux + config.moe.z_loss_coef * z)).backward()
        for name, p in dense.named_parameters():
            reference[name] += p.grad
        if replica == state.dp_rank:
            ref_out, ref_grad_x = y.detach(), x.grad

    moe = _build(config, state.tp_group, state.ep_group)
    x = _inputs(state.dp_rank)
    probe = _randn(*x.shape, seed=200 + state.dp_rank)
    if sp:  # this TP rank's chunk of the sequence
        x, probe = x.chunk(tp, dim=1)[state.tp_rank], probe.chunk(tp, dim=1)[state.tp_rank]
        ref_out, ref_grad_x = ref_out.chunk(tp, dim=1)[state.tp_rank], ref_grad_x.chunk(tp, dim=1)[state.tp_rank]
    x.requires_grad_()
    y = moe(x)
    (y * probe).sum().backward()
    torch.testing.assert_close(y.detach(), ref_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad, ref_grad_x, rtol=1e-5, atol=1e-6)
    allreduce_sequence_parallel_grads(moe, state.tp_group)  # the router's, under SP: summed over TP
    for name, p in moe.named_parameters():
        grad = p.grad.clone()
        expert = getattr(p, "allreduce", True) is False
        dist.all_reduce(grad, group=state.expert_dp_group if expert else data_group)
        dense_name = f"blocks.0.mlp.{name}"  # model/hf/convert.py's rules are keyed by the dense GPT's names
        want = split(dense_name, split_experts(dense_name, reference[name], state.ep_rank, ep), state.tp_rank, tp,
                     config.padded_vocab_size(tp), config)
        torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-6, msg=f"{name} on rank {state.global_rank}")
    experts = moe.experts.gate_up_proj
    first = state.ep_rank * moe.local_experts
    if first <= DEAD < first + moe.local_experts:
        assert experts.grad[DEAD - first].abs().max() == 0


# The fast tier keeps the layout with every kind of split (TP, EP, SP, shared experts); the others are slow.
@pytest.mark.parametrize("tp, ep, sp, shared", [pytest.param(*case, marks=[] if case == (2, 2, True, 1) else pytest.mark.slow)
                                                for case in [(1, 2, False, 0), (1, 4, False, 1), (2, 2, False, 1),
                                                             (2, 2, True, 1), (2, 1, True, 0)]],
                         ids=["tp1-ep2", "tp1-ep4-shared", "tp2-ep2-shared", "tp2-ep2-sp-shared", "tp2-ep1-sp"])
def test_sharded_moe_matches_the_dense_reference(tp, ep, sp, shared):
    run_distributed(_sharded_body, 4, tp, ep, sp, shared)
