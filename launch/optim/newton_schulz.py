"""Muon's orthogonalisation: the Newton-Schulz iteration that maps a matrix G = U S V^T to
about U V^T, and Moonlight's update scale.

- The iteration is Keller Jordan's (Muon, 2024, https://kellerjordan.github.io/posts/muon/): G is
  scaled to Frobenius norm 1 (so every singular value is <= 1), then 5 steps of the quintic
  X <- a X + (b A + c A^2) X, A = X X^T, with (a, b, c) = (3.4445, -4.7750, 2.0315). Each step
  maps every singular value s to a s + b s^3 + c s^5 and leaves the singular vectors alone, so
  the result is U p(S) V^T exactly (to rounding); the coefficients trade exact convergence for
  speed: after 5 steps p(s) lies in [0.68, 1.14] for every s >= 3e-3 ||G||_F (smaller ones are
  only amplified, by up to 3.4445^5; Keller Jordan: "S'_ii ~ Uniform(0.5, 1.5)", which "turns out
  not to hurt model performance at all relative to U V^T"). tests/runtime/test_muon.py checks both
  against an SVD.
- Here in fp32 (Keller Jordan's runs use bf16 on GPUs): every layout must give the same update to
  fp32 rounding (docs/design.md, the acceptance test).
- Moonlight (Liu et al. 2025, "Muon is Scalable for LLM Training", arXiv:2502.16982, eq. 4) scales
  the update of an m x n matrix by 0.2 sqrt(max(m, n)), so its RMS matches AdamW's (about 0.2 to
  0.4) and AdamW's learning rate and weight decay carry over unchanged.
"""
import math

import torch

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic
NS_STEPS = 5
NORM_EPS = 1e-7  # Keller Jordan's: a zero matrix stays zero
MOONLIGHT_RMS = 0.2  # Liu et al. 2025: AdamW's update RMS, which the Muon update is scaled to


def orthogonalise(g: torch.Tensor, steps: int = NS_STEPS) -> torch.Tensor:
    """About U V^T of each matrix g = U S V^T, in fp32: (..., m, n) -> (..., m, n); leading dims
    are a batch (a stack of experts)."""
    a, b, c = NS_COEFFICIENTS
    x = g.float()
    wide = x.size(-2) <= x.size(-1)
    if not wide:  # iterate on the m x m Gram matrix with m the smaller side: fewer FLOPs
        x = x.mT
    x = x / (torch.linalg.matrix_norm(x, keepdim=True) + NORM_EPS)
    for _ in range(steps):
        gram = x @ x.mT  # (..., m, m)
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x if wide else x.mT


def update_scale(rows: int, cols: int) -> float:
    """Moonlight's factor for an update of a rows x cols matrix (the whole logical matrix, never a shard)."""
    return MOONLIGHT_RMS * math.sqrt(max(rows, cols))

