"""Cache access for a rank that holds every row of its requests (the one-process reference,
and each prefill CP rank, which keeps a full copy of the cache).

What one rank stores: all cache entries of its requests (see engine/cache/pool.py).
What crosses: nothing — this is the single-device path.
"""

from __future__ import annotations

import torch

from engine.cache.pool import KVPool
from engine.model.attention import topk_select


class LocalKV:
    """KVAccess over a :class:`KVPool` whose rows are addressed directly by slot.

    ``new_rows``: the row of each token this forward computes (own tokens, batch order);
    ``req_rows[i]``: the rows of request i's positions 0..kv_len-1.
    """

    def __init__(self, pool: KVPool, new_rows: torch.Tensor, req_rows: list[torch.Tensor]):
        self.pool, self.new_rows, self.req_rows = pool, new_rows, req_rows

    def store(self, layer, latent, index_key):
        """Encode (the pool's format: quantized once, here) and write at the tokens' rows."""
        fmt = self.pool.fmt
        self.pool.latent(layer).index_copy_(0, self.new_rows, fmt.encode_latent(layer, latent))
        if index_key is not None:
            self.pool.index(layer).index_copy_(0, self.new_rows, fmt.encode_index(index_key))

    def latent(self, layer, req):
        return self.pool.read_latent(layer, self.req_rows[req])

    def index_keys(self, layer, req):
        return self.pool.read_index(layer, self.req_rows[req])

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
        return self.pool.gather.attend(self.pool.latent(layer), rows, q, self.pool.cfg.kv_lora_rank, scale,
                                       return_lse=False, layer=layer)[0]
