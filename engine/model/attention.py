"""Attention math (torch backend, CPU and CUDA), independent of where cache rows live.

Contract of this backend (the "attention backend contract"):
- Every function that returns a log-sum-exp returns it in **base e** (natural log), shape
  [..., heads], fp32. A query with no visible key has ``lse = -inf`` and output exactly 0.
- Partial results over disjoint key sets merge exactly with :func:`merge_partials`.

Two forms of MLA attention:
- *extend* (prefill): keys and values are expanded from the latent cache with ``kv_b_proj``
  and attended with SDPA (compute-bound; same math as transformers).
- *absorbed decode*: ``W_UK`` is folded into the query and ``W_UV`` applied after the
  weighted sum, so each step reads the ``kv_lora_rank + rope`` latent rows only (memory-bound).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

LSE_BASE = "e"


def extend_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    return_lse: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q [Tq, H, dk], k [L, H, dk], v [L, H, dv], mask [Tq, L] bool (True = may attend).

    Returns out [Tq, H, dv] and, if asked, lse [Tq, H] (base e).
    """
    dv = v.shape[-1]
    if dv < q.shape[-1]:
        # torch's fused CPU kernel needs equal q/k and v head dims; zero columns cost less
        # than the unfused fallback (measured 2.2x on a 1024 x 8192 chunk).
        v = F.pad(v, (0, q.shape[-1] - dv))
    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    if not return_lse:
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
        return out.squeeze(0).transpose(0, 1)[..., :dv], None
    if q.device.type == "cpu" and q.dtype == k.dtype == v.dtype:
        # the same fused kernel, asked for its log-sum-exp too (the ring merges partials with it):
        # no [H, Tq, L] score matrix, unlike the generic form below
        bias = torch.zeros(mask.shape, dtype=q.dtype).masked_fill_(~mask, float("-inf"))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qh, kh, vh, 0.0, False, attn_mask=bias, scale=scale)[:2]
        lse = lse.squeeze(0).transpose(0, 1).float()  # [Tq, H]
        empty = ~mask.any(dim=-1)
        if bool(empty.any()):  # the kernel gives such a row output 0 and lse 0: make it −inf
            lse[empty] = float("-inf")
        return out.squeeze(0).transpose(0, 1)[..., :dv], lse
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    scores = scores.masked_fill(~mask.unsqueeze(0), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [H, Tq]
    probs = torch.exp(scores - _finite(lse).unsqueeze(-1))
    out = torch.einsum("hqk,khd->qhd", probs, v[..., :dv].float()).to(q.dtype)
    return out, lse.transpose(0, 1)


# Gathering the selected keys beats dense masked SDPA once keys outnumber the selection ~64×
# (measured on CPU: 2.5× faster at 8k keys and top-k 32, 2× slower at 1k).
SPARSE_MIN_KEYS_PER_SELECTED = 64


def mask_to_indices(mask: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Column indices of the True entries of each row, ascending, padded to `width` (+ validity)."""
    counts = mask.sum(dim=1)
    rows, cols = mask.nonzero(as_tuple=True)
    first = torch.cumsum(counts, 0) - counts
    slot = torch.arange(rows.numel()) - first[rows]
    idx = torch.zeros(mask.shape[0], width, dtype=torch.long)
    idx[rows, slot] = cols
    return idx, torch.arange(width)[None, :] < counts[:, None]


def sparse_extend_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, width: int,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Extend attention when each query reads at most `width` keys (DSA top-k).

    Gathers each query's selected keys instead of scoring all of them: O(Tq·width) instead of
    O(Tq·L). q [Tq, H, dk], k [L, H, dk], v [L, H, dv], mask [Tq, L] with ≤ width True per row.
    Returns out [Tq, H, dv], and with ``return_lse`` also lse [Tq, H] (base e).
    """
    idx, valid = mask_to_indices(mask, min(width, mask.shape[1]))
    flat = idx.view(-1)  # index_select: a row copy, ~2.5x faster here than k[idx]
    ks = k.index_select(0, flat).view(*idx.shape, *k.shape[1:])  # [Tq, W, H, d]
    vs = v.index_select(0, flat).view(*idx.shape, *v.shape[1:])
    scores = (q.unsqueeze(1) * ks).sum(-1).float() * scale  # [Tq, W, H]
    scores = scores.masked_fill(~valid.unsqueeze(-1), float("-inf"))
    if not return_lse:
        probs = torch.softmax(scores, dim=1).to(v.dtype)
        return (probs.unsqueeze(-1) * vs).sum(1)
    lse = torch.logsumexp(scores, dim=1)  # [Tq, H]; −inf where a query selected nothing here
    probs = torch.exp(scores - _finite(lse).unsqueeze(1)).to(v.dtype)
    return (probs.unsqueeze(-1) * vs).sum(1), lse


def absorbed_decode(
    q: torch.Tensor,
    rows: torch.Tensor,
    valid: torch.Tensor | None,
    kv_lora_rank: int,
    scale: float,
    return_lse: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Absorbed MLA over latent rows.

    q [B, H, r + dr]: the query's nope part already multiplied by W_UK, then its rotated part;
    rows [B, L, r + dr] (compressed KV then rotary key); valid [B, L] bool, or None when every
    row is valid. One product scores both parts: q · row = q_lat · c + q_rope · k_rope.
    Returns (out_lat [B, H, r], lse [B, H] base e — None unless ``return_lse``); W_UV is
    applied by the caller. Without the LSE, each query needs at least one valid row.
    """
    scores = torch.bmm(q, rows.transpose(1, 2))
    scores = (scores if scores.dtype == torch.float32 else scores.float()) * scale
    if valid is not None:
        scores = scores.masked_fill(~valid.unsqueeze(1), float("-inf"))
    c = rows[..., :kv_lora_rank]
    if not return_lse:
        probs = torch.softmax(scores, dim=-1)
        return torch.bmm(probs if probs.dtype == rows.dtype else probs.to(rows.dtype), c), None
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - _finite(lse).unsqueeze(-1))
    return torch.bmm(probs if probs.dtype == rows.dtype else probs.to(rows.dtype), c), lse


def merge_partials(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of attention over disjoint key shards.

    outs [S, ..., d] (each shard's normalised output), lses [S, ...] (base e).
    out = Σ_s exp(lse_s − lse) · out_s with lse = logsumexp_s(lse_s). A shard with
    lse = −inf contributes exactly 0 (exp(−inf) is 0); if every shard is empty the result is 0
    with lse −inf (its −inf lse is clamped to a finite one for the weights, so they stay 0, not NaN).
    Few tensor ops: at batch 1 the DCP exchange runs this every layer, and its cost is their count.
    """
    lse = torch.logsumexp(lses, dim=0)
    weights = torch.exp(lses - lse.clamp(min=torch.finfo(lse.dtype).min).unsqueeze(0))
    return (weights.unsqueeze(-1).to(outs.dtype) * outs).sum(dim=0), lse


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """lse with −inf replaced by 0, so exp(score − lse) stays 0 (not NaN) for empty rows."""
    return torch.where(torch.isneginf(lse), 0.0, lse)


def topk_mask(scores: torch.Tensor, k: int, valid: torch.Tensor) -> torch.Tensor:
    """Boolean mask of the top-k valid entries of `scores` along the last axis.

    Order: higher score first, then lower position (a total order, so the selection is exact
    and the same however the candidates were split). Invalid entries are never selected;
    if at most k entries are valid, all of them are.
    """
    scores = scores.masked_fill(~valid, float("-inf"))
    n = scores.shape[-1]
    if k >= n:
        return valid.clone()
    kth = scores.topk(k, dim=-1).values[..., -1:]
    above = scores > kth
    need = k - above.sum(dim=-1, keepdim=True)
    tied = scores == kth
    chosen = above | (tied & (torch.cumsum(tied, dim=-1) <= need))
    return chosen & valid


def topk_select(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices (ascending) of the top-k of a 1-D score vector under :func:`topk_mask`'s order.

    The decode-step form: one ``topk`` settles the set unless the k-th score ties with one
    left out, and only then does the tie-break by position run.
    """
    n = scores.numel()
    if n <= k:
        return torch.arange(n)
    vals, idx = scores.topk(k)
    if int((scores >= vals[-1]).sum()) == k:
        return idx.sort().values
    return topk_mask(scores[None], k, torch.ones(1, n, dtype=torch.bool))[0].nonzero().squeeze(1)


def pick_width(index_topk: int, kv_lens: list[int]) -> int:
    """Positions a pass-Q query carries as its DSA picks in a batch of histories ``kv_lens``:
    none while every history fits the top-k (the selection is then every causal key, which the
    positions already say), else ``index_topk``. Every rank computes the same from the plan."""
    longest = max(kv_lens, default=0)
    return index_topk if 0 < index_topk < longest else 0


def topk_positions(scores: torch.Tensor, positions: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of a 1-D candidate list under the same total order as :func:`topk_mask`.

    Returns (scores, positions) of the chosen candidates, sorted by position.
    """
    if scores.numel() <= k:
        order = torch.argsort(positions)
        return scores[order], positions[order]
    order = torch.argsort(positions)
    s, p = scores[order], positions[order]
    keep = topk_mask(s.unsqueeze(0), k, torch.ones_like(s, dtype=torch.bool).unsqueeze(0)).squeeze(0)
    return s[keep], p[keep]
