"""Routed-expert compute and the dispatch seam between the MoE layer and the parallel code.

The MoE layer (engine/model/model.py) routes each token to k experts and hands the rest to
``batch.moe`` — an :class:`ExpertDispatch`. On one process that is :data:`LOCAL_EXPERTS`;
the parallel code (engine/parallel/expert.py) provides dispatchers that move tokens to the
ranks holding their experts and back. This module stays free of collectives.

Two functions every dispatcher shares, so every layout computes what the reference computes:

- :func:`grouped_experts` — the tokens routed to each local expert go through that expert as
  one matmul per projection (rows grouped by a stable sort on the expert id), never a copy of
  expert weights per token;
- :func:`combine` — a token's output is the sum of its k expert outputs, weighted, added in
  slot order (slot 0 first), then the shared experts' output.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F


def grouped_experts(experts, x: torch.Tensor, expert_ids: torch.Tensor,
                    row_of: torch.Tensor | None = None) -> torch.Tensor:
    """Pair i is row ``x[row_of[i]]`` (``x[i]`` without ``row_of``) through expert
    ``expert_ids[i]`` (a global id held by ``experts``, whose ``first`` is the global id of its
    first expert) → [n, H] in pair order."""
    n = expert_ids.shape[0]
    out = x.new_empty(n, x.shape[1])
    if n == 0:
        return out
    local = expert_ids - experts.first
    order = torch.argsort(local, stable=True)
    counts = torch.bincount(local, minlength=experts.gate_proj.shape[0]).tolist()
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        pick = order[start:start + n]
        start += n
        h = x.index_select(0, pick if row_of is None else row_of[pick])
        h = F.silu(F.linear(h, experts.gate_proj[e])) * F.linear(h, experts.up_proj[e])
        out.index_copy_(0, pick, F.linear(h, experts.down_proj[e]))
    return out


def combine(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """y [T, k, H] expert outputs, weights [T, k] → [T, H]: Σ_j w_j·y_j, added in slot order."""
    w = weights if weights.dtype == y.dtype else weights.to(y.dtype)
    out = y[:, 0] * w[:, 0, None]
    for j in range(1, y.shape[1]):
        out += y[:, j] * w[:, j, None]
    return out


def pair_rows(t: int, k: int) -> torch.Tensor:
    """The token row of each (token, slot) pair of ``idx.reshape(-1)``."""
    return torch.arange(t).repeat_interleave(k)


class ExpertDispatch(Protocol):
    """Runs a MoE layer's experts for this rank's tokens; returns the layer's whole output
    (routed + shared) for them — complete, no reduction left to the caller."""

    def __call__(self, moe, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor: ...


class LocalExperts:
    """Every expert on this process (the reference engine, a group of one, ``replicate``)."""

    def __call__(self, moe, x, idx, weights):
        t, k = idx.shape
        y = grouped_experts(moe.experts, x, idx.reshape(-1), pair_rows(t, k))
        out = combine(y.view(t, k, -1), weights)
        if moe.shared_experts is not None:
            out = out + moe.shared_experts(x)
        return out


LOCAL_EXPERTS = LocalExperts()
