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
- In fp32 or bf16 (`train.muon_ns_dtype`): Keller Jordan's code and torch.optim.Muon run it in bf16
  (torch: on every device); by default here bf16 on a GPU and fp32 on a CPU, where bf16 matmuls gain
  nothing. The parity runs are fp32: every layout gives the same update to fp32 rounding
  (docs/design.md, the acceptance test).
- The learning rate of an m x n matrix (m outputs, n inputs, as nn.Linear stores it) is scaled by
  `train.muon_lr_rule`:
  - moonlight: 0.2 sqrt(max(m, n)) (Liu et al. 2025, "Muon is Scalable for LLM Training",
    arXiv:2502.16982, eq. 4): the update's RMS matches AdamW's (about 0.2 to 0.4), so AdamW's
    learning rate and weight decay carry over; torch.optim.Muon's adjust_lr_fn="match_rms_adamw";
  - keller: sqrt(max(1, m / n)) (Keller Jordan, Muon, 2024, github.com/KellerJordan/Muon; torch's
    default, adjust_lr_fn="original"): lr about 0.02;
  - none: 1.
  Weight decay is lr wd W under every rule (unscaled, as both references).
"""
import math
from typing import Optional

import torch

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic
NS_STEPS = 5
NORM_EPS = 1e-7  # Keller Jordan's: a zero matrix stays zero
MOONLIGHT_RMS = 0.2  # Liu et al. 2025: AdamW's update RMS, which the Muon update is scaled to
LR_RULES = ("moonlight", "keller", "none")
NS_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def ns_dtype(name: Optional[str], device: torch.device) -> torch.dtype:
    """`train.muon_ns_dtype`; None: bf16 on a GPU (Keller Jordan's and torch's), fp32 elsewhere."""
    return NS_DTYPES[name or ("bf16" if device.type == "cuda" else "fp32")]


def orthogonalise(g: torch.Tensor, steps: int = NS_STEPS, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """About U V^T of each matrix g = U S V^T, computed in `dtype`, returned in fp32:
    (..., m, n) -> (..., m, n); leading dims are a batch (a stack of experts)."""
    a, b, c = NS_COEFFICIENTS
    x = g.to(dtype)
    wide = x.size(-2) <= x.size(-1)
    if not wide:  # iterate on the m x m Gram matrix with m the smaller side: fewer FLOPs
        x = x.mT
    x = x / (torch.linalg.matrix_norm(x, keepdim=True) + NORM_EPS)
    for _ in range(steps):
        gram = x @ x.mT  # (..., m, m)
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x if wide else x.mT).float()


def update_scale(rows: int, cols: int, rule: str = "moonlight") -> float:
    """The lr factor of an update of a rows x cols matrix (the whole logical matrix, never a shard)."""
    if rule == "moonlight":
        return MOONLIGHT_RMS * math.sqrt(max(rows, cols))
    if rule == "keller":
        return math.sqrt(max(1.0, rows / cols))
    assert rule == "none", rule
    return 1.0

