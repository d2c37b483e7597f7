"""Rotary position embeddings (RoPE, Su et al. 2021) in transformers' Llama layout.

Each head's dimensions are two halves [x1; x2], and dimension i of the first half rotates with
dimension i of the second ("rotate_half"), by the angle position * theta^(-2i/d). Meta's
original code pairs adjacent dimensions (2i, 2i+1) instead; transformers' conversion script
permutes the rows of q_proj and k_proj once so that the halves layout computes the same. We
use the halves layout, so our q_proj / k_proj rows are transformers' and export is a rename
(docs/architectures.md). No parameters: the angles are a function of the positions.

Llama 3's frequency scaling (`model.rope_scaling`, transformers' rope_type "llama3"; Meta's
`apply_scaling` in llama3/model.py): frequencies whose wavelength exceeds
original_max_position_embeddings / low_freq_factor are divided by `factor`, those shorter than
original_max_position_embeddings / high_freq_factor are kept, and the ones between are
interpolated smoothly. It changes every angle of those dimensions at any sequence length.
"""
import math
from typing import Dict, Optional, Tuple

import torch


def scale_llama3(inv_freq: torch.Tensor, scaling: Dict[str, float]) -> torch.Tensor:
    """Llama 3's scaled inverse frequencies (module docstring), as transformers computes them."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelength - low) / (high - low)  # 0 at the long end, 1 at the short end
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelength >= context / high) & (wavelength <= context / low)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(seq_len: int, head_dim: int, theta: float, device: torch.device, dtype: torch.dtype,
                 scaling: Optional[Dict[str, float]] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each (seq_len, head_dim), of positions 0..seq_len-1; computed in fp32 as
    transformers' LlamaRotaryEmbedding does, then cast to the activations' dtype. `scaling`:
    Llama 3's frequency scaling, or None."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
    if scaling is not None:
        inv_freq = scale_llama3(inv_freq, scaling)
    positions = torch.arange(seq_len, device=device).float()
    freqs = torch.outer(positions, inv_freq)  # (T, d/2)
    angles = torch.cat((freqs, freqs), dim=-1)  # (T, d): both halves rotate by the same angle
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[x1; x2] -> [-x2; x1] along the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """(B, heads, T, d) queries or keys rotated by their position: x*cos + rotate_half(x)*sin."""
    return x * cos + rotate_half(x) * sin


def at_positions(cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(T, d) tables -> (B, 1, T, d): the rows of each token's (B, T) position (positions that
    restart at every document, model/transformer/documents.py), broadcast over the heads."""
    return cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
