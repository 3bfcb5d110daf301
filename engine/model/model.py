"""The DeepSeek-V3-family model (deepseek_v3, deepseek_v32, glm_moe_dsa) as plain torch modules.

Module and parameter names match what transformers writes, so a checkpoint loads by name.
The model reads like single-device code; parallelism enters only through the
:class:`engine.model.batch.ForwardBatch` it is given:

- ``batch.kv.store(layer, latents, index_keys)`` — materialise this forward's new cache entries
  (a CP rank all-gathers them first; a DCP rank keeps only the rows it owns);
- ``batch.kv.latent(layer, i)`` / ``batch.kv.index_keys(layer, i)`` — the cache of request i,
  in position order, for extend (prefill) attention;
- ``batch.kv.decode_select(...)`` / ``batch.kv.decode_attention(...)`` — sparse selection and
  absorbed attention for decode (a DCP rank attends over its own rows and merges by LSE);
- ``batch.all_reduce(x)`` — the tensor-parallel reduction after row-parallel projections
  (identity without TP).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.attention import (
    SPARSE_MIN_KEYS_PER_SELECTED,
    extend_attention,
    mask_to_indices,
    merge_partials,
    pick_width,
    sparse_extend_attention,
    topk_mask,
)
from engine.model.batch import ForwardBatch
from engine.model.config import ModelConfig
from engine.model.rope import RopeTables, Rotary
from engine.model.sampler import score_block

EXTEND_QUERY_CHUNK = 1024


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32 and self.weight.dtype == torch.float32:
            # the same pow/mean/rsqrt sequence as below, dispatched as one call
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


# The modules of this file never carry hooks, so calling one runs its forward directly instead
# of going through nn.Module's hook dispatch: ~2 µs a call, ~75 calls a decode step — a tenth
# of a small model's step. (Subclasses keep the parameter names checkpoints use.)
class Linear(nn.Linear):
    __call__ = nn.Linear.forward


class LayerNorm(nn.LayerNorm):
    __call__ = nn.LayerNorm.forward


def _fp32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float32 else x.float()  # (.float() on fp32 is still a torch call)


def _linear(i: int, o: int, bias: bool = False) -> nn.Linear:
    layer = Linear(i, o, bias=bias)
    layer.requires_grad_(False)
    return layer


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = _linear(hidden, inter)
        self.up_proj = _linear(hidden, inter)
        self.down_proj = _linear(inter, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """Grouped sigmoid gating with score-correction bias (DeepSeek-V3 style), in fp32."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.hidden_size), requires_grad=False)
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        scores = F.linear(_fp32(x), _fp32(self.weight)).sigmoid()
        choice = scores + self.e_score_correction_bias
        if cfg.topk_group < cfg.n_group:  # keep the experts of the best topk_group groups
            per_group = cfg.n_routed_experts // cfg.n_group
            grouped = choice.view(-1, cfg.n_group, per_group)
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
            group_idx = torch.topk(group_scores, k=cfg.topk_group, dim=-1, sorted=False)[1]
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
            choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(-1, cfg.n_routed_experts)
        idx = torch.topk(choice, k=cfg.num_experts_per_tok, dim=-1, sorted=False)[1]
        weights = scores.gather(1, idx)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return idx, weights * cfg.routed_scaling_factor


class Experts(nn.Module):
    """Routed experts stored stacked: gate/up [E_local, I, H], down [E_local, H, I].

    ``first`` is the global id of the first expert held here: 0 with every expert (the
    reference), a rank's first expert under expert parallelism (engine/parallel/expert.py).
    The compute is in engine/model/experts.py, called by the batch's expert dispatcher."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        e, h, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_proj = nn.Parameter(torch.empty(e, i, h), requires_grad=False)
        self.up_proj = nn.Parameter(torch.empty(e, i, h), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(e, h, i), requires_grad=False)
        self.first = 0

    @property
    def held(self) -> range:
        """Global ids of the experts held here."""
        return range(self.first, self.first + self.gate_proj.shape[0])


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate = Router(cfg)
        self.experts = Experts(cfg)
        self.shared_experts = (
            MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts) if cfg.n_shared_experts else None
        )

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """The layer's complete output (routed + shared, already reduced across ranks)."""
        idx, weights = self.gate(x)
        return batch.moe(self, x, idx, weights)


class Indexer(nn.Module):
    """DSA lightning indexer: scores every (query, key) pair and keeps the top-k keys.

    Score(q, t) = Σ_h w_h(q) · relu(q_h · k_t / sqrt(d)) · H^-1/2, in fp32, over causal keys.
    The index key (one vector of ``index_head_dim`` per token) is what the index cache stores.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.head_dim = cfg.index_n_heads, cfg.index_head_dim
        self.topk = cfg.index_topk
        self.interleave = cfg.indexer_rope_interleave
        self.wq_b = _linear(cfg.q_lora_rank, self.n_heads * self.head_dim)
        self.wk = _linear(cfg.hidden_size, self.head_dim)
        self.k_norm = LayerNorm(self.head_dim, eps=1e-6)
        self.k_norm.requires_grad_(False)
        self.weights_proj = _linear(cfg.hidden_size, self.n_heads)
        self.scale = self.head_dim ** -0.5

    def key(self, x: torch.Tensor, rope: RopeTables) -> torch.Tensor:
        """Index keys [T, d] of tokens with hidden states x [T, hidden] (rotary on the first
        ``qk_rope_head_dim`` values)."""
        return rope.apply(self.k_norm(self.wk(x)), self.interleave)

    def query(self, x: torch.Tensor, q_resid: torch.Tensor, rope: RopeTables) -> tuple[torch.Tensor, torch.Tensor]:
        """(index queries [T, H, d] in fp32, head weights [T, H] in fp32, pre-scaled)."""
        q = self.wq_b(q_resid).view(-1, self.n_heads, self.head_dim)
        q = _fp32(rope.apply(q, self.interleave))
        wdt = self.weights_proj.weight.dtype
        w = _fp32(self.weights_proj(x if x.dtype == wdt else x.to(wdt))) * (self.n_heads ** -0.5)
        return q, w

    def scores(self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """Index scores [Tq, L] for queries q [Tq, H, d], weights w [Tq, H], keys [L, d]."""
        s = F.relu(torch.matmul(q, _fp32(keys).t()) * self.scale)
        return torch.bmm(w.unsqueeze(1), s).squeeze(1)


def _picked(picks: torch.Tensor, kp: torch.Tensor, hi: int) -> torch.Tensor:
    """Mask [n, len(kp)]: which of positions ``kp`` (all < ``hi``) each query picked (``picks``
    [n, K]: positions, −1 for none)."""
    full = torch.zeros(picks.shape[0], hi + 1, dtype=torch.bool)
    full.scatter_(1, torch.where(picks < 0, hi, picks), True)
    return full[:, kp]


def _query_chunks(req):
    """(own-token indices, positions) of a request's queries, ``EXTEND_QUERY_CHUNK`` at a time."""
    for c0 in range(0, req.q_index.numel(), EXTEND_QUERY_CHUNK):
        yield req.q_index[c0 : c0 + EXTEND_QUERY_CHUNK], req.q_pos[c0 : c0 + EXTEND_QUERY_CHUNK]


class Attention(nn.Module):
    """Multi-head latent attention (MLA), optionally with a DSA indexer.

    The cache holds, per token, the normalised compressed KV (``kv_lora_rank``) followed by the
    rotated shared key (``qk_rope_head_dim``): one latent entry shared by all heads.
    """

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        h, qk, bias = cfg.num_heads, cfg.qk_head_dim, cfg.attention_bias
        if cfg.q_lora_rank:
            self.q_a_proj = _linear(cfg.hidden_size, cfg.q_lora_rank, bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank)
            self.q_b_proj = _linear(cfg.q_lora_rank, h * qk)
        else:
            self.q_proj = _linear(cfg.hidden_size, h * qk)
        self.kv_a_proj_with_mqa = _linear(cfg.hidden_size, cfg.latent_dim, bias)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank)
        self.kv_b_proj = _linear(cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim))
        self.o_proj = _linear(h * cfg.v_head_dim, cfg.hidden_size, bias)
        self.indexer_type = cfg.indexer_types[layer]
        self.indexer = Indexer(cfg) if self.indexer_type == "full" else None
        self.scale = cfg.softmax_scale
        self.head_slice = slice(0, h)  # heads whose output this module produces (a TP slice under DCP)
        self._absorbed: tuple | None = None

    # ---- projections ---------------------------------------------------------------------
    def project_q(self, x: torch.Tensor, rope: RopeTables) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(q_nope [T, H, dn], rotated q_rope [T, H, dr], q latent residual or None)."""
        cfg = self.cfg
        if cfg.q_lora_rank:
            q_resid = self.q_a_layernorm(self.q_a_proj(x))
            q = self.q_b_proj(q_resid)
        else:
            q_resid, q = None, self.q_proj(x)
        q = q.view(x.shape[0], q.shape[-1] // cfg.qk_head_dim, cfg.qk_head_dim)
        q_nope, q_rope = q[..., : cfg.qk_nope_head_dim], q[..., cfg.qk_nope_head_dim :]
        return q_nope, rope.apply(q_rope, cfg.mla_rope_interleave), q_resid

    def project_latent(self, x: torch.Tensor, rope: RopeTables) -> torch.Tensor:
        """The cache entries [T, kv_lora_rank + dr] of tokens with hidden states x."""
        cfg = self.cfg
        kv = self.kv_a_proj_with_mqa(x)
        c = self.kv_a_layernorm(kv[:, : cfg.kv_lora_rank])
        kr = rope.apply(kv[:, cfg.kv_lora_rank :], cfg.mla_rope_interleave)
        return torch.cat([c, kr], dim=-1)

    def _absorbed_weights(self, q_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK of the query's heads [Hq, dn, r], W_UVᵀ of ``head_slice`` [Hs, r, dv]), views of
        ``kv_b_proj`` kept until the weight or the head slice changes."""
        cfg, w = self.cfg, self.kv_b_proj.weight
        key = (w._version, self.head_slice.start, self.head_slice.stop, q_heads)
        cached = self._absorbed
        if cached is None or cached[0] is not w or cached[1] != key:
            wv = w.view(-1, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
            w_uk, w_uv = wv[:, : cfg.qk_nope_head_dim], wv[:, cfg.qk_nope_head_dim :]
            if q_heads != cfg.num_heads:
                w_uk = w_uk[self.head_slice]
            cached = self._absorbed = (w, key, w_uk, w_uv[self.head_slice].transpose(1, 2))
        return cached[2], cached[3]

    # ---- forward -------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, batch: ForwardBatch, rope: RopeTables, prev_sel):
        q_nope, q_rope, q_resid = self.project_q(x, rope)
        latent = self.project_latent(x, rope)
        index_key = self.indexer.key(x, rope) if self.indexer is not None else None
        batch.kv.store(self.layer, latent, index_key)
        if self.indexer is not None:
            iq, iw = self.indexer.query(x, q_resid, rope)
        else:
            iq = iw = None
        if batch.is_decode:
            out, sel = self._decode(batch, q_nope, q_rope, iq, iw, prev_sel)
        else:
            out, sel = self._extend(batch, q_nope, q_rope, iq, iw, prev_sel)
        return batch.all_reduce(self.o_proj(out.flatten(1))), sel

    def _selection_mode(self) -> str:
        return {"full": "own", "shared": "reuse"}.get(self.indexer_type, "dense")

    def _expand(self, latent: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys [n, H, dn + dr] and values [n, H, dv] of latent rows (extend attention's form)."""
        cfg = self.cfg
        kv = self.kv_b_proj(latent[:, : cfg.kv_lora_rank]).view(latent.shape[0], heads, -1)
        k = torch.cat(
            [kv[..., : cfg.qk_nope_head_dim], latent[:, None, cfg.kv_lora_rank :].expand(-1, heads, -1)], dim=-1
        )
        return k, kv[..., cfg.qk_nope_head_dim :]

    def _select(self, batch, i: int, req, iq, iw, prev_sel, mode: str) -> list[torch.Tensor]:
        """Request ``i``'s DSA selection, one mask [chunk, hi] per query chunk (hi: the keys up to
        the chunk's last query), over the request's whole history."""
        cfg = self.cfg
        keys_idx = batch.kv.index_keys(self.layer, i) if mode == "own" else None
        masks = []
        for qi, qp in _query_chunks(req):
            hi = int(qp.max()) + 1  # keys past the chunk's last query are never visible to it
            if mode == "own":
                mask = torch.arange(hi)[None, :] <= qp[:, None]
                mask = topk_mask(self.indexer.scores(iq[qi], iw[qi], keys_idx[:hi]), cfg.index_topk, mask)
            else:
                mask = prev_sel[i][len(masks)]
            masks.append(mask)
        return masks

    def _extend(self, batch, q_nope, q_rope, iq, iw, prev_sel):
        """Prefill: each request's own queries read its whole causal history from the cache —
        in one piece, or under the ring (``batch.kv.ring_mode``) in pieces that meet by pass-KV
        or pass-Q, partials merged by their log-sum-exp."""
        cfg = self.cfg
        heads = q_nope.shape[1]
        out = q_nope.new_empty(q_nope.shape[0], heads, cfg.v_head_dim)
        mode = self._selection_mode()
        sels = ([self._select(batch, i, req, iq, iw, prev_sel, mode) for i, req in enumerate(batch.requests)]
                if mode != "dense" else None)
        ring = getattr(batch.kv, "ring_mode", None)
        if ring == "pass_kv":
            self._extend_pass_kv(batch, q_nope, q_rope, sels, out)
        elif ring == "pass_q":
            self._extend_pass_q(batch, q_nope, q_rope, sels, out)
        else:
            for i, req in enumerate(batch.requests):
                k, v = self._expand(batch.kv.latent(self.layer, i), heads)
                for n, (qi, qp) in enumerate(_query_chunks(req)):
                    hi = int(qp.max()) + 1
                    mask = sels[i][n] if sels is not None else torch.arange(hi)[None, :] <= qp[:, None]
                    q = torch.cat([q_nope[qi], q_rope[qi]], dim=-1)
                    if mode != "dense" and hi >= SPARSE_MIN_KEYS_PER_SELECTED * cfg.index_topk:
                        out[qi] = sparse_extend_attention(q, k[:hi], v[:hi], mask, self.scale, cfg.index_topk)
                    else:
                        out[qi] = extend_attention(q, k[:hi], v[:hi], mask, self.scale)[0]
        if batch.trace is not None and mode != "dense":
            batch.trace[self.layer] = [
                (req.q_pos, torch.cat([F.pad(m, (0, req.kv_len - m.shape[1])) for m in s]) if s
                 else torch.zeros(0, req.kv_len, dtype=torch.bool))
                for req, s in zip(batch.requests, sels)]
        return out, sels

    def _partial(self, q, qp, k, v, kpos, mask_of) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Queries ``q`` at positions ``qp`` against keys ``k``/``v`` at positions ``kpos``
        (ascending): (out, lse), or None when no key is visible to any of them. ``mask_of(kp)``:
        the queries' mask over the visible keys' positions ``kp`` (None: causal)."""
        m = int(torch.searchsorted(kpos, int(qp.max()), right=True))  # keys up to the last query
        if m == 0:
            return None
        kp = kpos[:m]
        mask = mask_of(kp) if mask_of is not None else kp[None, :] <= qp[:, None]
        if mask_of is not None and m >= SPARSE_MIN_KEYS_PER_SELECTED * self.cfg.index_topk:
            return sparse_extend_attention(q, k[:m], v[:m], mask, self.scale, self.cfg.index_topk, return_lse=True)
        return extend_attention(q, k[:m], v[:m], mask, self.scale, return_lse=True)

    def _extend_pass_kv(self, batch, q_nope, q_rope, sels, out) -> None:
        """Pass-KV: key blocks arrive (``batch.kv.key_blocks``), each giving per request some of
        its history's rows and their positions; each query's partial over a block merges into
        its running output with the exact LSE merge (engine/model/attention.py)."""
        heads = q_nope.shape[1]
        lse = torch.full((out.shape[0], heads), float("-inf"))
        out.zero_()
        for block in batch.kv.key_blocks(self.layer):
            for i, req in enumerate(batch.requests):
                latent, kpos = block.rows(i)
                if kpos.numel() == 0:
                    continue
                k, v = self._expand(latent, heads)
                for n, (qi, qp) in enumerate(_query_chunks(req)):
                    mask_of = (lambda kp, m=sels[i][n]: m[:, kp]) if sels is not None else None
                    got = self._partial(torch.cat([q_nope[qi], q_rope[qi]], dim=-1), qp, k, v, kpos, mask_of)
                    if got is not None:
                        merged, lse[qi] = merge_partials(torch.stack([out[qi], got[0]]), torch.stack([lse[qi], got[1]]))
                        out[qi] = merged

    def _extend_pass_q(self, batch, q_nope, q_rope, sels, out) -> None:
        """Pass-Q: query blocks arrive (``batch.kv.query_blocks``) — each rank's queries with
        their DSA picks (selected positions) — and meet this rank's own rows; the cache access
        returns the partials to their owners and merges them."""
        cfg = self.cfg
        heads = q_nope.shape[1]
        picks = None
        width = pick_width(cfg.index_topk, [req.kv_len for req in batch.requests]) if sels is not None else 0
        if width:  # own queries' selections as position lists, -1 padded: what travels
            picks = torch.full((out.shape[0], width), -1, dtype=torch.long)
            for i, req in enumerate(batch.requests):
                for n, (qi, _) in enumerate(_query_chunks(req)):
                    idx, valid = mask_to_indices(sels[i][n], min(width, sels[i][n].shape[1]))
                    picks[qi, : idx.shape[1]] = idx.masked_fill(~valid, -1)
        keys: dict[int, tuple] = {}
        q_own = torch.cat([q_nope, q_rope], dim=-1)
        for block in batch.kv.query_blocks(self.layer, q_own, picks, cfg.v_head_dim):
            for i in range(len(batch.requests)):
                at, q, qpos, pick = block.queries(i)
                if at.numel() == 0:
                    continue
                if i not in keys:
                    latent, kpos = batch.kv.own_rows(self.layer, i)
                    keys[i] = (*self._expand(latent, heads), kpos) if kpos.numel() else None
                if keys[i] is None:  # this rank holds none of the request's rows
                    continue
                k, v, kpos = keys[i]
                for c0 in range(0, at.numel(), EXTEND_QUERY_CHUNK):
                    sl = slice(c0, c0 + EXTEND_QUERY_CHUNK)
                    mask_of = None
                    if pick is not None:
                        mask_of = lambda kp, p=pick[sl], qp=qpos[sl]: _picked(p, kp, int(qp.max()) + 1)
                    got = self._partial(q[sl], qpos[sl], k, v, kpos, mask_of)
                    if got is not None:
                        block.put(at[sl], *got)
        out.copy_(batch.kv.merge_queries(self.layer))

    def _decode(self, batch, q_nope, q_rope, iq, iw, prev_sel):
        """One new token per request: absorbed MLA over the latent rows (sparse if DSA).

        Under DCP, ``q_nope`` holds all heads (``replicate_q_proj``) or this rank's head slice,
        and the cache access returns the merged output of this rank's ``head_slice`` only.
        """
        w_uk, w_uv_t = self._absorbed_weights(q_nope.shape[1])
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [B, Hq, r]
        q = torch.cat([q_lat, q_rope], dim=-1)
        mode = self._selection_mode()
        if mode == "own":
            sel = batch.kv.decode_select(self.layer, iq, iw, self.cfg.index_topk, self.indexer)
        elif mode == "reuse":
            sel = prev_sel
        else:
            sel = None
        if batch.trace is not None and sel is not None:
            batch.trace[self.layer] = sel
        out_lat = batch.kv.decode_attention(self.layer, q, sel, self.scale)
        return torch.bmm(out_lat.transpose(0, 1), w_uv_t).transpose(0, 1), sel


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MoE(cfg) if cfg.is_moe_layer(layer) else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.is_moe = isinstance(self.mlp, MoE)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, batch, rope, prev_sel):
        attn, sel = self.self_attn(self.input_layernorm(x), batch, rope, prev_sel)
        x = x + attn
        h = self.post_attention_layernorm(x)
        x = x + (self.mlp(h, batch) if self.is_moe else batch.all_reduce(self.mlp(h)))
        return x, sel


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


for _module in (RMSNorm, MLP, Router, MoE, Indexer, Attention, DecoderLayer):
    _module.__call__ = _module.forward  # see Linear above


class CausalLM(nn.Module):
    """Embedding → decoder layers → norm → LM head. `forward` returns logits of `batch.logit_index`."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg)
        self.lm_head = _linear(cfg.hidden_size, cfg.vocab_size)
        self.rotary = Rotary(cfg)

    def bind_attributes(self) -> None:
        """Put every submodule and parameter into its owner's instance ``__dict__``.

        ``self.weight`` on an nn.Module is a miss in ``__dict__`` followed by a Python-level
        ``__getattr__`` that searches ``_parameters``/``_buffers``/``_modules``: ~250 of them a
        decode step, ~8% of a small model's step. Binding them makes each a plain lookup. Safe
        against later reassignment: nn.Module's ``__setattr__`` drops the ``__dict__`` entry
        when a parameter or submodule is set again. Buffers are not bound: setting a buffer
        again would leave a stale entry. Call it once the weights are in place.
        """
        for module in self.modules():
            for store in (module._parameters, module._modules):
                for name, value in store.items():
                    if value is not None:
                        module.__dict__[name] = value

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        x = self.model.embed_tokens(batch.input_ids)
        rope = self.rotary.tables(batch.positions, x.dtype, as_matrix=batch.is_decode)
        sel = None
        for layer in self.model.layers:
            x, layer_sel = layer(x, batch, rope, sel)
            if layer_sel is not None:
                sel = layer_sel
        if batch.score_index is not None and batch.score_index.numel():
            batch.scores = self._score(x, batch)
        x = self.model.norm(x[batch.logit_index])
        return _fp32(self.lm_head(x))

    SCORE_BLOCK = 256  # prompt positions per LM-head block: [256, V] fp32 logits at a time

    def _score(self, x: torch.Tensor, batch: ForwardBatch) -> tuple[torch.Tensor, ...]:
        """Log-probabilities of each scored token's next token, block by block (a whole long
        prompt's logits never exist at once)."""
        parts = []
        for i in range(0, batch.score_index.numel(), self.SCORE_BLOCK):
            idx = batch.score_index[i : i + self.SCORE_BLOCK]
            logits = _fp32(self.lm_head(self.model.norm(x[idx])))
            parts.append(score_block(logits, batch.score_targets[i : i + self.SCORE_BLOCK], batch.score_top))
        return tuple(torch.cat(p) for p in zip(*parts))
