"""Decode attention over a request's cache rows wherever they are in the pool: the fused C
kernel (engine/kernels/mla_decode.c) for fp32 rows on the CPU, else torch — rows gathered,
batched and padded, in cache-sized chunks of requests, and decoded from the pool's
:class:`~engine.cache.kvformat.KVFormat` chunk by chunk."""

from __future__ import annotations

import torch
from torch.nn.utils.rnn import pad_sequence

from engine.cache.kvformat import KVFormat
from engine.kernels import BLK, KINDS, SEG, mla_decode
from engine.model.attention import absorbed_decode


class FusedDecodeAttention:
    """``absorbed_decode`` of every request of a step in one call of the C kernel: each row is
    read from memory once (scored, then summed while still in cache), no gather copy, no
    per-request Python. Work items of ``SEG`` rows of one request run on torch's OpenMP
    threads; a request's result does not depend on the batch or the threads (same bits).

    Rows stored as FP8 (``fp8``, ``fp8_ds_mla``) are decoded in the kernel, BLK rows at a time,
    to the same fp32 values ``KVFormat.decode_latent`` gives.

    Use :func:`fused_decode_attention` to get one where it applies."""

    def __init__(self, fn, fmt: KVFormat):
        self.fn, self.fmt, self.r = fn, fmt, fmt.kv_lora_rank
        self.kind = KINDS[fmt.kind]
        self._rows_cache: tuple[list[torch.Tensor], tuple] | None = None
        self._scratch = torch.empty(0)  # partials and per-thread scores, kept: a fresh MiB is page faults each call

    def _buffer(self, n: int) -> torch.Tensor:
        if self._scratch.numel() < n:
            self._scratch = torch.empty(max(n, self._scratch.numel() * 3 // 2))
        return self._scratch

    def _layout(self, row_lists: list[torch.Tensor]) -> tuple:
        """(all rows, row offsets, item offsets, item count) of the requests' row lists; cached
        while the same tensors come back (every layer of a step asks about the same ones)."""
        cached = self._rows_cache
        if cached is not None and len(cached[0]) == len(row_lists) and all(a is b for a, b in zip(cached[0], row_lists)):
            return cached[1]
        lens = torch.tensor([r.numel() for r in row_lists], dtype=torch.long)
        zero = torch.zeros(1, dtype=torch.long)
        items = torch.cat([zero, ((lens + SEG - 1) // SEG).cumsum(0)])
        rows = torch.cat([r.long() for r in row_lists]) if row_lists else zero
        layout = (rows.contiguous(), torch.cat([zero, lens.cumsum(0)]), items, int(items[-1]))
        self._rows_cache = (list(row_lists), layout)
        return layout

    def __call__(self, pool_layer: torch.Tensor, row_lists: list[torch.Tensor], q: torch.Tensor,
                 scale: float, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """q [B, H, D] → (out [B, H, r], lse [B, H] base e; a request with no rows: 0 and -inf)."""
        rows, offs, items, n_items = self._layout(row_lists)
        b, h, d = q.shape
        q = q.contiguous()
        threads = torch.get_num_threads()
        sizes = (n_items * h * self.r, n_items * 2 * h, threads * (h * SEG + BLK * d))
        part_o, part_ml, scratch = self._buffer(sum(sizes))[: sum(sizes)].split(sizes)
        out = torch.empty(b, h, self.r)
        lse = torch.empty(b, h)
        kv_scale = self.fmt.scales[layer] if self.fmt.kind == "fp8" else 1.0
        self.fn(pool_layer.data_ptr(), self.fmt.entry_bytes, self.kind, kv_scale, d, rows.data_ptr(), offs.data_ptr(),
                items.data_ptr(), q.data_ptr(), b, h, self.r, scale, part_o.data_ptr(), part_ml.data_ptr(),
                scratch.data_ptr(), out.data_ptr(), lse.data_ptr(), threads)
        return out, lse


def fused_decode_attention(fmt: KVFormat, dtype: torch.dtype, device) -> FusedDecodeAttention | None:
    """The fused kernel for a pool stored in ``fmt`` (fp32, fp8 or fp8_ds_mla rows), read in
    compute dtype ``dtype`` on ``device``, or None where it does not apply (an fp32 query is
    needed; not the CPU; widths not multiples of 16) or is unavailable."""
    if fmt.kind not in KINDS or dtype != torch.float32 or torch.device(device).type != "cpu" \
            or fmt.latent_dim % 16 or fmt.kv_lora_rank % 16:
        return None
    fn = mla_decode()
    return None if fn is None else FusedDecodeAttention(fn, fmt)


class RowGatherer:
    """Gathers rows per request into [B, Lmax, D] plus a validity mask [B, Lmax] (None when
    every row is valid: one request, or all of the same length).

    One ``index_select`` fills the whole padded batch: each request's row list is padded to
    Lmax with row 0 of the pool (a real, finite row; the mask gives it zero weight — a
    padding row must be finite, since 0 · NaN is NaN in ``probs @ rows``). One call instead of
    one per request, and no zero-fill of the buffer.

    The buffer is kept and reused (only grown, geometrically): a fresh allocation over ~32 MiB
    is a new mmap whose page faults dominated decode at long context (32k rows of 528 values,
    one request: 40 ms → 6 ms a gather; padded batches: 229 ms → 12 ms), and decode lengthens
    every request by one row a step, so growing to the exact need re-allocated it every step
    (a third of a batch-8 step). Small gathers of one request take a fresh tensor (one call
    instead of four).
    """

    FRESH_MAX_VALUES = 1 << 20  # one request's rows below this (4 MiB fp32) get a fresh tensor

    def __init__(self, fused: FusedDecodeAttention | None = None, fmt: KVFormat | None = None):
        self.fused = fused  # chosen by the pool's owner at construction (fused_decode_attention)
        self.fmt = fmt  # how the pool's rows are stored (None: already in the query's dtype)
        self.buf: torch.Tensor | None = None
        self._span_cache: tuple[list[torch.Tensor], list[int | None]] | None = None

    def __call__(self, pool_layer: torch.Tensor, row_lists: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        lens = [r.numel() for r in row_lists]
        lmax = max(max(lens, default=0), 1)
        b, d = len(row_lists), pool_layer.shape[-1]
        if b == 1 and lens[0] == lmax and lmax * d <= self.FRESH_MAX_VALUES:
            return pool_layer.index_select(0, row_lists[0]).unsqueeze(0), None
        if min(lens) == lmax:
            valid, index = None, torch.cat(row_lists)
        else:
            valid = torch.arange(lmax)[None, :] < torch.tensor(lens)[:, None]
            index = pad_sequence([r.long() for r in row_lists], batch_first=True, padding_value=0)
            if index.shape[1] < lmax:  # every request empty
                index = torch.zeros(b, lmax, dtype=torch.long)
            index = index.view(-1)
        need = b * lmax * d
        if self.buf is None or self.buf.numel() < need or self.buf.dtype != pool_layer.dtype:
            grown = 0 if self.buf is None or self.buf.dtype != pool_layer.dtype else self.buf.numel() * 3 // 2
            self.buf = torch.empty(max(need, grown), dtype=pool_layer.dtype)
        rows = self.buf[:need].view(b * lmax, d)
        torch.index_select(pool_layer, 0, index, out=rows)
        return rows.view(b, lmax, d), valid

    # gathered rows of one chunk of requests: small enough to stay in the CPU's caches between
    # the gather and the two products that read it (scores, then probs @ latent)
    CHUNK_BYTES = 8 << 20
    # a request whose rows are one run of the pool at least this long is attended in place
    VIEW_MIN_ROWS = 256

    def attend(self, pool_layer: torch.Tensor, row_lists: list[torch.Tensor], q: torch.Tensor, kv_lora_rank: int,
               scale: float, return_lse: bool, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``absorbed_decode`` of request b's query ``q[b]`` over its rows ``row_lists[b]``.

        A request whose rows are one contiguous run of the pool (the scheduler allocates a
        request's pages together, so they usually are) is attended over a view of the pool:
        no copy, and its rows are read from memory once, then from cache by the second
        product. The copy of a gather costs more than one small call per request: bench-model
        decode steps (``bench/engine.py``, 1k-token prompts, 2 threads) 15.3 → 11.8 ms at batch
        8, 53 → 42 ms at 32 (docs/benchmarks.md). The other requests go in
        consecutive chunks whose padded rows fit ``CHUNK_BYTES`` (read back from cache by each
        product). A request's arithmetic is the same either way.

        Stored rows are decoded (``self.fmt``, with ``layer``'s scale) as they are read: a chunk
        at a time, or one request's run. FP8 runs are not attended in place (decoding them is a
        copy), so they go by chunks like the rest.

        With the fused kernel (``self.fused``) all of that is one call instead.
        """
        if self.fused is not None:
            out, lse = self.fused(pool_layer, row_lists, q, scale, layer)
            return out, (lse if return_lse else None)
        fmt = self.fmt
        decode = (lambda x: x if x.dtype == q.dtype else x.to(q.dtype)) if fmt is None else (
            lambda x: fmt.decode_latent(layer, x, q.dtype))
        spans = [None] * len(row_lists) if fmt is not None and fmt.quantized else self._spans(row_lists)
        rest = [b for b, start in enumerate(spans) if start is None]
        parts: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        for b, start in enumerate(spans):
            if start is not None:
                rows = pool_layer[start : start + row_lists[b].numel()].unsqueeze(0)
                parts[b] = absorbed_decode(q[b : b + 1], decode(rows), None, kv_lora_rank, scale,
                                           return_lse=return_lse)
        # the chunk's size once decoded (what the two products read back from cache)
        row_bytes = (pool_layer.shape[-1] if fmt is None else fmt.latent_dim) * q.element_size()
        i = 0
        while i < len(rest):
            j, lmax = i + 1, max(row_lists[rest[i]].numel(), 1)
            while j < len(rest) and rest[j] == rest[j - 1] + 1:  # chunks of consecutive requests
                longest = max(lmax, row_lists[rest[j]].numel())
                if (j + 1 - i) * longest * row_bytes > self.CHUNK_BYTES:
                    break
                j, lmax = j + 1, longest
            first, last = rest[i], rest[j - 1] + 1
            rows, valid = self(pool_layer, row_lists[first:last])
            rows = decode(rows)
            parts[first] = absorbed_decode(q[first:last], rows, valid, kv_lora_rank, scale, return_lse=return_lse)
            i = j
        order = sorted(parts)
        if len(order) == 1:
            return parts[order[0]]
        out = torch.cat([parts[b][0] for b in order])
        return out, (torch.cat([parts[b][1] for b in order]) if return_lse else None)

    def _spans(self, row_lists: list[torch.Tensor]) -> list[int | None]:
        """For each request, the first row if its rows are exactly rows first, first + 1, …
        (at least VIEW_MIN_ROWS of them), else None. Cached while the same row tensors come
        back (every layer of a step asks about the same ones)."""
        cached = self._span_cache
        if cached is not None and len(cached[0]) == len(row_lists) and all(
                a is b for a, b in zip(cached[0], row_lists)):
            return cached[1]
        spans = []
        for r in row_lists:
            n = r.numel()
            start = None
            if n >= self.VIEW_MIN_ROWS:
                first = int(r[0])
                if int(r[-1]) - first == n - 1 and bool((r[1:] - r[:-1] == 1).all()):
                    start = first
            spans.append(start)
        self._span_cache = (list(row_lists), spans)
        return spans
