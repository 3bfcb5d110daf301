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


# When every expert runs as one padded bmm per projection instead of one matmul per expert:
# few (token, expert) pairs (a decode step), and most of the held experts busy, since the bmm
# reads every held expert's weights. Three small matmuls per expert then cost more in calls
# than the padding does (benchmark model, 8 experts, a MoE layer's experts at 8 tokens
# ~350 -> ~150 µs, at 32 tokens ~410 -> ~250 µs). Prefill chunks (thousands of tokens) and
# decode over many experts (DeepSeek-V3: 256, 8 a token) keep the per-expert matmuls.
BMM_MAX_PAIRS = 512
BMM_MIN_BUSY = 0.75  # fraction of held experts with a pair


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
    counts = torch.bincount(local, minlength=experts.gate_proj.shape[0])
    rows = order if row_of is None else row_of[order]
    if n <= BMM_MAX_PAIRS and int(torch.count_nonzero(counts)) >= BMM_MIN_BUSY * counts.shape[0]:
        # pair order[i] sits at (expert, its rank among that expert's pairs) of a zero-padded
        # [experts, most pairs, H] batch; padding rows stay 0 through silu(0) * 0
        sorted_ids = local[order]
        pos = torch.arange(n) - (torch.cumsum(counts, 0) - counts)[sorted_ids]
        xb = x.new_zeros(counts.shape[0], int(counts.max()), x.shape[1])
        xb[sorted_ids, pos] = x.index_select(0, rows)
        h = F.silu(torch.bmm(xb, experts.gate_proj.transpose(1, 2))) * torch.bmm(xb, experts.up_proj.transpose(1, 2))
        out[order] = torch.bmm(h, experts.down_proj.transpose(1, 2))[sorted_ids, pos]
        return out
    start = 0
    for e, m in enumerate(counts.tolist()):
        if m == 0:
            continue
        pick = order[start:start + m]
        h = x.index_select(0, rows[start:start + m])
        start += m
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
