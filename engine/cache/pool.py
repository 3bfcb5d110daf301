"""Paged KV pools.

What one rank stores: per layer, one latent entry of ``kv_lora_rank + qk_rope_head_dim``
values per cache row (shared by all heads); per *indexer* layer (a "full" DSA layer), one index
key of ``index_head_dim`` values per row. "Shared" GLM layers and dense models store no index
keys. Rows are grouped in pages of ``page_size``; which request owns which page is the
allocator's business (engine/cache/slots.py), where a token lives is the slot mapping's.

Memory: rows × (layers × latent_dim + indexer_layers × index_head_dim) × dtype bytes,
allocated once at start-up (``nbytes`` reports it).
"""

from __future__ import annotations

import torch

from engine.cache.gather import RowGatherer, fused_decode_attention
from engine.model.config import ModelConfig


class KVPool:
    """Per-rank cache tensors: ``latent[layer, row]`` and ``index[indexer_slot, row]``.

    ``layers`` restricts the persistent pool to some layers (prefill layer split); a layer
    outside it has no rows here.
    """

    def __init__(self, cfg: ModelConfig, num_rows: int, dtype: torch.dtype, layers: range | None = None,
                 device: str = "cpu"):
        self.cfg = cfg
        self.num_rows = num_rows
        self.layers = layers if layers is not None else range(cfg.num_layers)
        self.index_layers = [l for l in cfg.indexer_layer_ids if l in self.layers]
        self.latent_pool = torch.zeros(len(self.layers), num_rows, cfg.latent_dim, dtype=dtype, device=device)
        self.index_pool = torch.zeros(len(self.index_layers), num_rows, max(cfg.index_head_dim, 1), dtype=dtype,
                                      device=device)
        # per-layer views, made once: indexing the pool tensor each time is a torch call
        self._latent_views = list(self.latent_pool.unbind(0))
        self._index_views = dict(zip(self.index_layers, self.index_pool.unbind(0)))
        # decode attention: the fused kernel where it applies, else torch with a reused buffer
        self.gather = RowGatherer(fused_decode_attention(dtype, device, cfg.latent_dim, cfg.kv_lora_rank))

    def holds(self, layer: int) -> bool:
        return layer in self.layers

    def latent(self, layer: int) -> torch.Tensor:
        """[rows, latent_dim] view of one layer."""
        return self._latent_views[layer - self.layers.start]

    def index(self, layer: int) -> torch.Tensor:
        """[rows, index_head_dim] view of one indexer layer."""
        return self._index_views[layer]

    @property
    def nbytes(self) -> int:
        return self.latent_pool.numel() * self.latent_pool.element_size() + (
            self.index_pool.numel() * self.index_pool.element_size() if self.index_layers else 0
        )
