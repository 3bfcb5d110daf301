"""Cache access for a rank that holds every row of its requests (the one-process reference,
and each prefill CP rank, which keeps a full copy of the cache).

What one rank stores: all cache entries of its requests (see engine/cache/pool.py).
What crosses: nothing — this is the single-device path.
"""

from __future__ import annotations

import torch

from engine.cache.pool import KVPool
from engine.model.attention import absorbed_decode, topk_select


class RowGatherer:
    """Gathers rows per request into [B, Lmax, D] plus a validity mask [B, Lmax] (None when
    every row is valid: one request, or all of the same length).

    The buffer is kept and reused (only grown): a fresh allocation over ~32 MiB is a new mmap
    whose page faults dominated decode at long context (32k rows of 528 values, one request:
    40 ms → 6 ms a gather; padded batches: 229 ms → 12 ms). Small gathers of one request take a
    fresh tensor (one call instead of four). Stale padding is harmless: the mask gives it zero
    weight.
    """

    FRESH_MAX_VALUES = 1 << 20  # one request's rows below this (4 MiB fp32) get a fresh tensor

    def __init__(self):
        self.buf: torch.Tensor | None = None

    def __call__(self, pool_layer: torch.Tensor, row_lists: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        lens = [r.numel() for r in row_lists]
        lmax = max(max(lens, default=0), 1)
        b, d = len(row_lists), pool_layer.shape[-1]
        if b == 1 and lens[0] == lmax and lmax * d <= self.FRESH_MAX_VALUES:
            return pool_layer.index_select(0, row_lists[0]).unsqueeze(0), None
        valid = None if min(lens) == lmax else torch.arange(lmax)[None, :] < torch.tensor(lens)[:, None]
        need = b * lmax * d
        if self.buf is None or self.buf.numel() < need or self.buf.dtype != pool_layer.dtype:
            self.buf = torch.zeros(need, dtype=pool_layer.dtype)
        rows = self.buf[:need].view(b, lmax, d)
        for i, r in enumerate(row_lists):
            torch.index_select(pool_layer, 0, r, out=rows[i, : r.numel()])
        return rows, valid


class LocalKV:
    """KVAccess over a :class:`KVPool` whose rows are addressed directly by slot.

    ``new_rows``: the row of each token this forward computes (own tokens, batch order);
    ``req_rows[i]``: the rows of request i's positions 0..kv_len-1.
    """

    def __init__(self, pool: KVPool, new_rows: torch.Tensor, req_rows: list[torch.Tensor]):
        self.pool, self.new_rows, self.req_rows = pool, new_rows, req_rows

    def store(self, layer, latent, index_key):
        rows = self.pool.latent(layer)
        rows.index_copy_(0, self.new_rows, latent if latent.dtype == rows.dtype else latent.to(rows.dtype))
        if index_key is not None:
            rows = self.pool.index(layer)
            rows.index_copy_(0, self.new_rows, index_key if index_key.dtype == rows.dtype else index_key.to(rows.dtype))

    def latent(self, layer, req):
        return self.pool.latent(layer).index_select(0, self.req_rows[req])

    def index_keys(self, layer, req):
        return self.pool.index(layer).index_select(0, self.req_rows[req])

    def decode_select(self, layer, iq, iw, k, indexer):
        """Per request: the positions its query attends to, or None for all of them."""
        out = []
        for b in range(iq.shape[0]):
            keys = self.index_keys(layer, b)
            if keys.shape[0] <= k:
                out.append(None)
                continue
            out.append(topk_select(indexer.scores(iq[b : b + 1], iw[b : b + 1], keys)[0], k))
        return out

    def decode_attention(self, layer, q, sel, scale):
        rows = []
        for b, r in enumerate(self.req_rows):
            rows.append(r if sel is None or sel[b] is None else r[sel[b]])
        gathered, valid = self.pool.gather(self.pool.latent(layer), rows)
        if gathered.dtype != q.dtype:
            gathered = gathered.to(q.dtype)
        return absorbed_decode(q, gathered, valid, self.pool.cfg.kv_lora_rank, scale, return_lse=False)[0]
