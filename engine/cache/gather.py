"""Row gathering for decode attention: a request's cache rows, batched and padded, and the
absorbed attention over them in cache-sized chunks of requests."""

from __future__ import annotations

import torch
from torch.nn.utils.rnn import pad_sequence

from engine.model.attention import absorbed_decode


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

    def __init__(self):
        self.buf: torch.Tensor | None = None

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

    def attend(self, pool_layer: torch.Tensor, row_lists: list[torch.Tensor], q: torch.Tensor, kv_lora_rank: int,
               scale: float, return_lse: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``absorbed_decode`` of request b's query ``q[b]`` over its rows ``row_lists[b]``.

        Requests go in consecutive chunks whose padded rows fit ``CHUNK_BYTES``: one padded
        gather of the whole batch (tens of MB at batch 32 × 1k) was read back from memory by
        each product, a chunk is read back from cache (−25 % of a batch-32 step's attention
        here). Each request's arithmetic is the same either way; a batch that fits is one chunk.
        """
        row_bytes = pool_layer.shape[-1] * pool_layer.element_size()
        outs, lses, start = [], [], 0
        while start < len(row_lists):
            stop, lmax = start + 1, max(row_lists[start].numel(), 1)
            while stop < len(row_lists):
                longest = max(lmax, row_lists[stop].numel())
                if (stop + 1 - start) * longest * row_bytes > self.CHUNK_BYTES:
                    break
                stop, lmax = stop + 1, longest
            rows, valid = self(pool_layer, row_lists[start:stop])
            if rows.dtype != q.dtype:
                rows = rows.to(q.dtype)
            out, lse = absorbed_decode(q[start:stop], rows, valid, kv_lora_rank, scale, return_lse=return_lse)
            outs.append(out)
            lses.append(lse)
            start = stop
        if len(outs) == 1:
            return outs[0], lses[0]
        return torch.cat(outs), (torch.cat(lses) if return_lse else None)
