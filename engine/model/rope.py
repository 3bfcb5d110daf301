"""Rotary position embedding: default and yarn frequencies, interleaved and half-split layouts.

Follows transformers' definitions: ``cos``/``sin`` are computed in fp32 from
``position * inv_freq`` and multiplied by the yarn attention factor. MLA rotates its rope part
with the *interleaved* layout (pairs ``(x0, x1), (x2, x3), …``) when ``rope_interleave`` is set;
DeepSeek-V3.2's indexer rotates with the half-split layout; GLM's indexer is interleaved.
"""

from __future__ import annotations

import math

import torch

from engine.model.config import ModelConfig, yarn_get_mscale


def rope_inv_freq(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """(inverse frequencies of length dim/2, attention factor applied to cos/sin)."""
    dim = cfg.qk_rope_head_dim
    r = cfg.rope
    base = r.theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    if r.type == "default":
        return 1.0 / pos_freqs, 1.0
    factor = r.factor
    if r.attention_factor is not None:
        attention_factor = float(r.attention_factor)
    elif r.mscale and r.mscale_all_dim:
        attention_factor = float(yarn_get_mscale(factor, r.mscale) / yarn_get_mscale(factor, r.mscale_all_dim))
    else:
        attention_factor = yarn_get_mscale(factor)

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(r.original_max_position_embeddings / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(r.beta_fast), correction_dim(r.beta_slow)
    if r.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, attention_factor


class Rotary:
    """Precomputed frequencies; `cos_sin(positions)` gives tables of shape [T, dim] (cat(f, f))."""

    def __init__(self, cfg: ModelConfig):
        self.inv_freq, self.scaling = rope_inv_freq(cfg)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """Rotate `x` [T, ..., dim]; cos/sin are [T, dim] and broadcast over the middle axes."""
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    cos, sin = cos.view(shape), sin.view(shape)
    if interleave:
        half = cos.shape[-1] // 2
        c, s = cos[..., :half], sin[..., :half]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
