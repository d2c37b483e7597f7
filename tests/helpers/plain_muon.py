"""Muon written from its papers, for tests to check launch/optim/muon.py against: Keller
Jordan's `zeropower_via_newtonschulz5` (github.com/KellerJordan/Muon) and Moonlight's Algorithm 1
with Nesterov momentum (Liu et al. 2025, "Muon is Scalable for LLM Training", and their reference
code), one whole logical matrix at a time, in fp32."""
import math

import torch


def newton_schulz5(g: torch.Tensor) -> torch.Tensor:
    """About U V^T of g = U S V^T (a stack of matrices: each on its own)."""
    a, b, c = (3.4445, -4.7750, 2.0315)
    x = g.float()
    if g.size(-2) > g.size(-1):
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(5):
        a_mat = x @ x.mT
        x = a * x + (b * a_mat + c * a_mat @ a_mat) @ x
    return x.mT if g.size(-2) > g.size(-1) else x


class PlainMuon:
    """Muon on whole weights; each weight's logical matrices are the blocks `parts` along `dim`."""

    def __init__(self, momentum: float = 0.95):
        self.momentum = momentum
        self.buffers = {}

    @torch.no_grad()
    def step(self, weight: torch.Tensor, grad: torch.Tensor, lr: float, weight_decay: float, dim: int = 0,
             parts=None) -> None:
        """In place: M <- mu M + (1 - mu) G, W <- W (1 - lr wd) - lr 0.2 sqrt(max(m, n)) NS((1 - mu) G + mu M),
        per part. The momentum is torch.optim.Muon's average; Moonlight's paper keeps the sum, 1/(1 - mu)
        of it, the same direction once Newton-Schulz has normalised it."""
        buffer = self.buffers.setdefault(id(weight), torch.zeros_like(weight))
        buffer.lerp_(grad, 1 - self.momentum)
        direction = grad.lerp(buffer, self.momentum)
        update = []
        for part in direction.split(list(parts or [weight.size(dim)]), dim=dim):
            m, n = part.shape[-2:]
            update.append(0.2 * math.sqrt(max(m, n)) * newton_schulz5(part))
        weight.mul_(1 - lr * weight_decay).sub_(lr * torch.cat(update, dim=dim))
