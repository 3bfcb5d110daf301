"""Rotary position embedding: default and yarn frequencies, interleaved and half-split layouts.

Follows transformers' definitions: ``cos``/``sin`` are computed in fp32 from
``position * inv_freq`` and multiplied by the yarn attention factor. MLA rotates its rope part
with the *interleaved* layout (pairs ``(x0, x1), (x2, x3), …``) when ``rope_interleave`` is set;
DeepSeek-V3.2's indexer rotates with the half-split layout; GLM's indexer is interleaved.
"""

from __future__ import annotations

import functools
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
    """Precomputed frequencies; `tables(positions)` gives the per-forward rotation."""

    def __init__(self, cfg: ModelConfig, device: str | torch.device = "cpu"):
        with torch.device("cpu"):  # (also when the model is built on the meta device)
            inv_freq, self.scaling = rope_inv_freq(cfg)
        self.inv_freq = inv_freq.to(device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Tables of shape [T, dim] (cat(f, f)), times the attention factor."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.scaling != 1.0:
            cos, sin = cos * self.scaling, sin * self.scaling
        return (cos, sin) if dtype == torch.float32 else (cos.to(dtype), sin.to(dtype))

    def tables(self, positions: torch.Tensor, dtype: torch.dtype, as_matrix: bool = False) -> "RopeTables":
        return RopeTables(*self.cos_sin(positions, dtype), as_matrix)


# A decode step rotates its few tokens up to 4 times a layer (q, k, index q, index k): as one
# small batched matmul a rotation instead of ~13 element-wise ops, rotary stops being a third of
# the step's op dispatches. Prefill keeps the element-wise form (a [T, w, w] table per token
# would not pay off, and CP ranks must rotate exactly as the reference does).
class RopeTables:
    """The rotation of one forward's tokens. ``apply(x, interleave)`` rotates the first
    ``dim`` values of the last axis of x [T, ..., w] (w ≥ dim) and keeps the rest.

    ``as_matrix``: rotate by multiplying with a per-token [w, w] matrix (decode); the result
    equals the element-wise form up to floating-point rounding of the two-term sums.
    """

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, as_matrix: bool = False):
        self.cos, self.sin, self.as_matrix = cos, sin, as_matrix
        self.dim = cos.shape[-1]
        self._matrices: dict[tuple[bool, int], torch.Tensor] = {}

    def apply(self, x: torch.Tensor, interleave: bool) -> torch.Tensor:
        w = x.shape[-1]
        if self.as_matrix:
            m = self._matrix(interleave, w)
            t = x.shape[0]
            return torch.bmm(x.reshape(t, -1, w), m).view(x.shape)
        if w == self.dim:
            return apply_rope(x, self.cos, self.sin, interleave)
        rot, rest = x[..., : self.dim], x[..., self.dim :]
        return torch.cat([apply_rope(rot, self.cos, self.sin, interleave), rest], dim=-1)

    def _matrix(self, interleave: bool, width: int) -> torch.Tensor:
        """[T, width, width] with x @ m = rotated x (per token)."""
        key = (interleave, width)
        m = self._matrices.get(key)
        if m is None:
            flat_c, flat_s, identity = _rotation_pattern(self.dim, interleave, width, self.cos.device)
            half = self.dim // 2
            c, s = self.cos[:, :half], self.sin[:, :half]
            m = (identity if identity.dtype == self.cos.dtype else identity.to(self.cos.dtype)).repeat(self.cos.shape[0], 1)  # [T, width²]; axes past dim pass through
            # out[dst] = x[src_c] * cos + x[src_s] * (∓ sin)
            m[:, flat_c] = torch.cat([c, c], dim=1)
            m[:, flat_s] = torch.cat([-s, s], dim=1)
            m = m.view(-1, width, width)
            self._matrices[key] = m
        return m


@functools.lru_cache(maxsize=None)
def _rotation_pattern(dim: int, interleave: bool, width: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flat [width, width] offsets of the cos and sin terms of each rotated output (matching
    :func:`apply_rope`), and the flattened matrix that passes axes ≥ dim through unchanged."""
    half = dim // 2
    j = torch.arange(half, device="cpu")
    if interleave:  # out[j] = x[2j]c - x[2j+1]s ; out[half+j] = x[2j+1]c + x[2j]s
        src_c, src_s, dst = torch.cat([2 * j, 2 * j + 1]), torch.cat([2 * j + 1, 2 * j]), torch.cat([j, half + j])
    else:  # half-split: out[j] = x[j]c - x[j+half]s ; out[j+half] = x[j+half]c + x[j]s
        src_c, src_s, dst = torch.cat([j, j + half]), torch.cat([j + half, j]), torch.cat([j, j + half])
    identity = torch.zeros(width, width, device="cpu")
    rest = torch.arange(dim, width, device="cpu")
    identity[rest, rest] = 1
    return tuple(t.to(device) for t in (src_c * width + dst, src_s * width + dst, identity.view(1, -1)))


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
