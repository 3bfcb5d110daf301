"""The byte layout of one cache entry, and the one quantizer every rank and the reference use.

``--kv-cache-dtype`` (vLLM's names) picks the layout of a latent entry (one token, one layer:
``kv_lora_rank`` latent values + ``qk_rope_head_dim`` rotary values) and of an index key (one
token, one indexer layer: ``index_head_dim`` values):

=============  =====================================================  ==========================
kind           latent entry (r = kv_lora_rank, dr = rope dim)          index key (d = index dim)
=============  =====================================================  ==========================
fp32 / bf16    r + dr values of that dtype (4 / 2 bytes each)         d values of that dtype
fp8            r + dr ``float8_e4m3fn`` bytes, x / s with the          d e4m3 bytes + one float32
               layer's scale s (1.0, or the checkpoint's k_scale):    scale (amax / 448) per
               576 bytes at r = 512, dr = 64                          token: 132 bytes at d = 128
fp8_ds_mla     DeepSeek's: r e4m3 bytes, one float32 scale (amax /    as fp8
               448) per tile of 128 latent values, then dr bf16
               rotary values: 512 + 16 + 128 = 656 bytes
=============  =====================================================  ==========================

``auto`` is the compute dtype. Byte order inside an fp8_ds_mla entry: ``[r e4m3][ceil(r/128)
float32 scales][dr bf16]``; inside an fp8 index key: ``[d e4m3][float32 scale]``. Multi-byte
values are the host's byte order (little-endian on every platform we run), as in memory.

Quantized pools are ``uint8`` tensors of ``entry_bytes`` per row: a row is moved (all-gather,
Mooncake write) as the bytes it is, and gloo cannot move fp8 tensors anyway.

Exactness: :meth:`KVFormat.encode_latent` / :meth:`encode_index` are the one quantizer — every
prefill CP rank, every DCP rank and the reference engine call it on the same values, with the
same scale and the same rounding (torch's round-to-nearest-even cast, after clamping to ±448),
once, when the entry is written. Decoding is exact arithmetic up to one rounding (e4m3 → fp32
is exact; times the scale rounds once), so the fused C kernel's dequantization
(engine/kernels/mla_decode.c) gives the same bits as :meth:`decode_latent`.

Store / cross / cost: a rank stores ``entry_bytes`` per row and layer (``index_bytes`` per index
row); what crosses is those bytes; encoding costs one pass over the new entries, decoding one
pass over the rows read, block by block (never the whole pool).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

KV_CACHE_DTYPES = ("auto", "fp32", "bf16", "fp8", "fp8_ds_mla")
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
TILE = 128  # fp8_ds_mla: latent values per float32 scale
_PLAIN = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_QUANTIZED = ("fp8", "fp8_ds_mla")


def resolve_kv_cache_dtype(kv_cache_dtype: str, compute_dtype: str | torch.dtype) -> str:
    """``auto`` → the compute dtype's name (fp32, bf16 or fp16); other names are checked."""
    if kv_cache_dtype == "auto":
        from engine.model.loader import parse_dtype

        dtype = parse_dtype(compute_dtype)
        return next(name for name, d in _PLAIN.items() if d == dtype)
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype: {kv_cache_dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
    return kv_cache_dtype


@dataclass(frozen=True)
class KVFormat:
    """How one rank stores cache entries; derived sizes are properties.

    ``scales`` (kind ``fp8`` only): the per-layer scale s, entry bytes = e4m3(x / s).
    """

    kind: str
    kv_lora_rank: int
    rope_dim: int
    index_head_dim: int
    scales: tuple[float, ...] = ()

    def __post_init__(self):
        if self.kind not in _PLAIN and self.kind not in _QUANTIZED:
            raise ValueError(f"kv_cache_dtype: {self.kind!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
        if self.kind == "fp8_ds_mla" and self.kv_lora_rank % 4:
            raise ValueError(f"kv_cache_dtype: fp8_ds_mla needs kv_lora_rank % 4 == 0, got {self.kv_lora_rank}")
        if any(not (math.isfinite(s) and s > 0) for s in self.scales):
            raise ValueError(f"kv cache scales must be finite and > 0, got {list(self.scales)}")

    @classmethod
    def of(cls, cfg, kv_cache_dtype: str, compute_dtype: str | torch.dtype = "fp32",
           scales: tuple[float, ...] | None = None) -> "KVFormat":
        """The format of ``cfg``'s cache; ``scales`` (per layer) apply to ``fp8`` only (default 1.0)."""
        kind = resolve_kv_cache_dtype(kv_cache_dtype, compute_dtype)
        per_layer = ()
        if kind == "fp8":
            per_layer = tuple(float(s) for s in scales) if scales else (1.0,) * cfg.num_layers
            if len(per_layer) != cfg.num_layers:
                raise ValueError(f"kv cache scales: {len(per_layer)} for {cfg.num_layers} layers")
        return cls(kind, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.index_head_dim, per_layer)

    @classmethod
    def for_checkpoint(cls, model_dir, cfg, kv_cache_dtype: str, compute_dtype: str | torch.dtype) -> "KVFormat":
        """The format of ``cfg``'s cache, with the checkpoint's k_scale per layer for ``fp8``
        (engine/model/loader.py ``read_kv_scales``; 1.0 where it ships none). Every process of a
        cluster builds it from the same files, so every rank quantizes with the same scales."""
        scales = None
        if resolve_kv_cache_dtype(kv_cache_dtype, compute_dtype) == "fp8":
            from engine.model.loader import read_kv_scales

            scales = read_kv_scales(model_dir, cfg)
        return cls.of(cfg, kv_cache_dtype, compute_dtype, scales)

    # ---- sizes -----------------------------------------------------------------------------
    @property
    def quantized(self) -> bool:
        return self.kind in _QUANTIZED

    @property
    def storage_dtype(self) -> torch.dtype:
        """dtype of the pool tensors: uint8 (raw bytes) for fp8 kinds."""
        return torch.uint8 if self.quantized else _PLAIN[self.kind]

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.rope_dim

    @property
    def tiles(self) -> int:
        """fp8_ds_mla: float32 scales per entry, one per TILE latent values."""
        return -(-self.kv_lora_rank // TILE)

    @property
    def entry_bytes(self) -> int:
        """Bytes of one latent entry (one token, one layer)."""
        if self.kind == "fp8":
            return self.latent_dim
        if self.kind == "fp8_ds_mla":
            return self.kv_lora_rank + 4 * self.tiles + 2 * self.rope_dim
        return self.latent_dim * _PLAIN[self.kind].itemsize

    @property
    def index_bytes(self) -> int:
        """Bytes of one index key (one token, one indexer layer); 0 without an indexer."""
        if not self.index_head_dim:
            return 0
        if self.quantized:
            return self.index_head_dim + 4
        return self.index_head_dim * _PLAIN[self.kind].itemsize

    @property
    def entry_width(self) -> int:
        """Elements of the storage dtype per latent row."""
        return self.entry_bytes // self.storage_dtype.itemsize

    @property
    def index_width(self) -> int:
        return max(self.index_bytes // self.storage_dtype.itemsize, 1)

    def describe(self) -> dict:
        """What a peer must agree on to read these bytes (part of the layout fingerprint)."""
        return {"kind": self.kind, "entry_bytes": self.entry_bytes, "index_bytes": self.index_bytes,
                "scales": list(self.scales)}

    # ---- the quantizer ---------------------------------------------------------------------
    def encode_latent(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Entries [T, latent_dim] (any float dtype) → stored rows [T, entry_width]."""
        if not self.quantized:
            return x if x.dtype == self.storage_dtype else x.to(self.storage_dtype)
        x = x.float()
        if self.kind == "fp8":
            return _to_e4m3(x, self.scales[layer])
        r = self.kv_lora_rank
        q, s = _tile_quantize(x[:, :r], TILE)
        rope = x[:, r:].to(torch.bfloat16).contiguous().view(torch.uint8)
        return torch.cat([q, s.view(torch.uint8), rope], dim=1)

    def decode_latent(self, layer: int, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Stored rows [..., entry_width] → entries [..., latent_dim] in ``dtype``."""
        if not self.quantized:
            return rows if rows.dtype == dtype else rows.to(dtype)
        lead, flat = rows.shape[:-1], rows.reshape(-1, self.entry_width)
        if self.kind == "fp8":
            out = flat.view(FP8).float()
            if self.scales[layer] != 1.0:
                out.mul_(self.scales[layer])
        else:
            r, t = self.kv_lora_rank, self.tiles
            latent = _tile_dequantize(flat[:, :r], flat[:, r : r + 4 * t].contiguous().view(torch.float32), TILE)
            out = torch.cat([latent, flat[:, r + 4 * t :].contiguous().view(torch.bfloat16).float()], dim=1)
        out = out.view(*lead, self.latent_dim)
        return out if dtype == torch.float32 else out.to(dtype)

    def encode_index(self, x: torch.Tensor) -> torch.Tensor:
        """Index keys [T, index_head_dim] → stored rows [T, index_width]."""
        if not self.quantized:
            return x if x.dtype == self.storage_dtype else x.to(self.storage_dtype)
        q, s = _tile_quantize(x.float(), self.index_head_dim)
        return torch.cat([q, s.view(torch.uint8)], dim=1)

    def decode_index(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Stored index rows [..., index_width] → keys [..., index_head_dim] in ``dtype``."""
        if not self.quantized:
            return rows if rows.dtype == dtype else rows.to(dtype)
        d = self.index_head_dim
        lead, flat = rows.shape[:-1], rows.reshape(-1, self.index_width)
        out = _tile_dequantize(flat[:, :d], flat[:, d:].contiguous().view(torch.float32), d).view(*lead, d)
        return out if dtype == torch.float32 else out.to(dtype)


def _to_e4m3(x: torch.Tensor, scale: float) -> torch.Tensor:
    """fp32 [T, n] → e4m3(x / scale) as uint8 [T, n]: clamped to ±448, rounded to nearest even."""
    if scale != 1.0:
        x = x / scale
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8).view(torch.uint8)


def _tile_quantize(x: torch.Tensor, tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [T, n] → (e4m3 bytes [T, n], float32 scales [T, ceil(n / tile)]): each tile of
    ``tile`` values is divided by its own scale amax / 448 (1.0 for an all-zero tile)."""
    t, n = x.shape
    tiles = -(-n // tile)
    padded = x if n == tiles * tile else torch.nn.functional.pad(x, (0, tiles * tile - n))
    blocks = padded.view(t, tiles, tile)
    amax = blocks.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(torch.uint8)
    return q.view(t, tiles * tile)[:, :n], scale.contiguous()


def _tile_dequantize(q: torch.Tensor, scales: torch.Tensor, tile: int) -> torch.Tensor:
    """e4m3 bytes [T, n] times their tile's float32 scale [T, ceil(n / tile)] → fp32 [T, n]
    (exact up to the one rounding of the product)."""
    t, n = q.shape
    values = q.contiguous().view(FP8).float()
    if scales.shape[1] == 1:
        return values.mul_(scales)
    if n % tile == 0:
        return values.view(t, n // tile, tile).mul_(scales.unsqueeze(-1)).view(t, n)
    return values.mul_(scales.repeat_interleave(tile, dim=1)[:, :n])
