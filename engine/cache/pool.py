"""Paged KV pools.

What one rank stores: per layer, one latent entry of ``kv_lora_rank + qk_rope_head_dim``
values per cache row (shared by all heads); per *indexer* layer (a "full" DSA layer), one index
key of ``index_head_dim`` values per row. "Shared" GLM layers and dense models store no index
keys. Rows are grouped in pages of ``page_size``; which request owns which page is the
allocator's business (engine/cache/slots.py), where a token lives is the slot mapping's.

Entries are stored in the pool's :class:`~engine.cache.kvformat.KVFormat` (fp32, bf16, or FP8
bytes: ``--kv-cache-dtype``): ``latent(layer)`` / ``index(layer)`` are the stored rows, raw;
``read_latent`` / ``read_index`` decode the rows asked for into the compute dtype, and
``encode`` is the one quantizer (called once, when an entry is written).

Memory: rows × (layers × entry_bytes + indexer_layers × index_bytes), reserved once at start-up
(``nbytes`` reports it) as zero pages that become resident when first written (:func:`zeroed`).
"""

from __future__ import annotations

import ctypes
import math
import mmap

import torch

from engine.cache.gather import RowGatherer, fused_decode_attention
from engine.cache.kvformat import KVFormat
from engine.model.config import ModelConfig


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device = "cpu") -> torch.Tensor:
    """A zero tensor whose CPU memory is a private anonymous mapping: the kernel hands out zero pages
    as they are first written, so a cache pool costs resident memory for the rows it holds,
    not for its capacity (what ``bench/capacity.py`` measures), and a page-aligned address for
    the transfer engine. torch.zeros would write every page at start-up."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE), dtype=dtype).view(shape)


def resident_bytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s memory pages that are resident now (Linux ``mincore``): for a pool made by
    :func:`zeroed`, what the rows written so far cost."""
    page = mmap.PAGESIZE
    start = t.data_ptr() // page * page
    end = t.data_ptr() + t.numel() * t.element_size()
    if end <= start:
        return 0
    pages = (end - start + page - 1) // page
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(end - start), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return int((torch.frombuffer(vec, dtype=torch.uint8) & 1).sum()) * page


class KVPool:
    """Per-rank cache tensors: ``latent[layer, row]`` and ``index[indexer_slot, row]``.

    ``layers`` restricts the persistent pool to some layers (prefill layer split); a layer
    outside it has no rows here. ``dtype`` is the compute dtype entries are read in; ``fmt`` how
    they are stored (default: the compute dtype itself).
    """

    def __init__(self, cfg: ModelConfig, num_rows: int, dtype: torch.dtype, layers: range | None = None,
                 device: str = "cpu", fmt: KVFormat | None = None):
        self.cfg = cfg
        self.num_rows = num_rows
        self.dtype = dtype
        self.fmt = fmt if fmt is not None else KVFormat.of(cfg, "auto", dtype)
        self.layers = layers if layers is not None else range(cfg.num_layers)
        self.index_layers = [l for l in cfg.indexer_layer_ids if l in self.layers]
        store = self.fmt.storage_dtype
        self.latent_pool = zeroed((len(self.layers), num_rows, self.fmt.entry_width), store, device)
        self.index_pool = zeroed((len(self.index_layers), num_rows, self.fmt.index_width), store, device)
        # per-layer views, made once: indexing the pool tensor each time is a torch call
        self._latent_views = list(self.latent_pool.unbind(0))
        self._index_views = dict(zip(self.index_layers, self.index_pool.unbind(0)))
        # decode attention: the fused kernel where it applies, else torch with a reused buffer
        self.gather = RowGatherer(fused_decode_attention(self.fmt, dtype, device), self.fmt)

    def holds(self, layer: int) -> bool:
        return layer in self.layers

    def latent(self, layer: int) -> torch.Tensor:
        """[rows, entry_width] view of one layer (stored form: raw bytes for FP8)."""
        return self._latent_views[layer - self.layers.start]

    def index(self, layer: int) -> torch.Tensor:
        """[rows, index_width] view of one indexer layer (stored form)."""
        return self._index_views[layer]

    def read_latent(self, layer: int, rows: torch.Tensor) -> torch.Tensor:
        """Entries of ``rows`` of one layer, decoded: [len(rows), latent_dim] in the compute dtype."""
        return self.fmt.decode_latent(layer, self.latent(layer).index_select(0, rows), self.dtype)

    def read_index(self, layer: int, rows: torch.Tensor) -> torch.Tensor:
        """Index keys of ``rows`` of one indexer layer, decoded: [len(rows), index_head_dim]."""
        return self.fmt.decode_index(self.index(layer).index_select(0, rows), self.dtype)

    @property
    def nbytes(self) -> int:
        return self.latent_pool.numel() * self.latent_pool.element_size() + (
            self.index_pool.numel() * self.index_pool.element_size() if self.index_layers else 0
        )
