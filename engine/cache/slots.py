"""Where token p of a request lives on the decode service (DCP): the one slot numbering.

A DCP group of C ranks behaves like one cache C times larger. Slots are numbered over the whole
group and map to a rank and a row of that rank's pool:

    rank = slot % C        row = slot // C

Pages live in a virtual space of ``page_size * C`` slots: virtual page ``v`` covers slots
``[v * page_size * C, (v + 1) * page_size * C)``, which is rows ``[v * page_size,
(v + 1) * page_size)`` on every rank. A request's page table lists its virtual pages; token
``p`` goes to slot ``page_table[p // (page_size * C)] * page_size * C + p % (page_size * C)``,
hence to rank ``p mod C``, and a request of N tokens holds ``ceil(N / C)`` or ``floor(N / C)``
rows on each rank. Allocation and prefix reuse see one pool of virtual pages
(``PageAllocator``); each rank's physical pool has ``num_pages * page_size`` rows.

The three questions: one rank stores the entries of the tokens it owns (about 1/C of each
request); nothing crosses between ranks to locate a token (every rank computes the same slots
from the same page table); the cost is one integer division per token.
"""

from __future__ import annotations

import heapq
from typing import Iterable, Sequence

import torch


def slot_to_rank_row(slot: int, C: int) -> tuple[int, int]:
    """(rank, row) of a group slot: ``(slot % C, slot // C)``."""
    _check_group(C)
    if slot < 0:
        raise ValueError(f"slot must be >= 0, got {slot}")
    return slot % C, slot // C


def slots_to_rank_rows(slots: torch.Tensor, C: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Vectorised ``slot_to_rank_row``: returns (ranks, rows), each shaped like ``slots``."""
    _check_group(C)
    return torch.remainder(slots, C), torch.div(slots, C, rounding_mode="floor")


def pages_needed(num_tokens: int, page_size: int, C: int) -> int:
    """Virtual pages that hold ``num_tokens`` tokens: ``ceil(num_tokens / (page_size * C))``."""
    _check_group(C)
    _check_page_size(page_size)
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    return -(-num_tokens // (page_size * C))


def token_slots(
    page_table: Sequence[int], num_tokens: int, page_size: int, C: int
) -> torch.Tensor:
    """Group slot of each of a request's first ``num_tokens`` tokens (int64, length N).

    Token ``p`` is stored on rank ``p % C``. Raises ``ValueError`` if the page table is too
    short for ``num_tokens``.
    """
    needed = pages_needed(num_tokens, page_size, C)
    if len(page_table) < needed:
        raise ValueError(
            f"page_table has {len(page_table)} pages but {num_tokens} tokens need {needed}"
        )
    span = page_size * C
    positions = torch.arange(num_tokens, dtype=torch.long)
    pages = torch.as_tensor(list(page_table[:needed]), dtype=torch.long)
    return pages[positions // span] * span + positions % span


def local_rows(
    page_table: Sequence[int], num_tokens: int, page_size: int, C: int, rank: int
) -> torch.Tensor:
    """Rows on ``rank`` that hold the request's tokens ``rank, rank + C, ...``, in token order."""
    if not 0 <= rank < C:
        raise ValueError(f"rank must be in [0, {C}), got {rank}")
    slots = token_slots(page_table, num_tokens, page_size, C)[rank::C]
    return torch.div(slots, C, rounding_mode="floor")


class PageAllocator:
    """Free list of the group's virtual pages ``0 .. num_pages - 1``, with reference counts.

    The lowest free pages go first (address-ordered): pages freed together are handed out
    together again, so a request's pages stay in long ascending runs even after many
    requests have come and gone — and each run is one range of the KV hand-off, not one per
    page (a FIFO list interleaves the pages of requests that grew side by side).

    Invariant: every page is either free or allocated, never both, so
    ``num_free + num_allocated == num_pages``. A page may have several holders (forks of one
    prompt share its full pages: ``share``); it is free again when its last holder frees it.
    Callers ask ``can_allocate`` before ``allocate``; freeing a page that is not allocated is
    refused.
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages))  # a heap (sorted is a valid heap)
        self._refs: dict[int, int] = {}  # allocated page -> holders

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_allocated(self) -> int:
        return len(self._refs)

    def holders(self, page: int) -> int:
        return self._refs.get(page, 0)

    def can_allocate(self, n_pages: int) -> bool:
        return 0 <= n_pages <= len(self._free)

    def allocate(self, n_pages: int) -> list[int]:
        """Take ``n_pages`` free pages (one holder each); raises ``ValueError`` if fewer are free."""
        if not self.can_allocate(n_pages):
            raise ValueError(
                f"cannot allocate {n_pages} pages: {len(self._free)} of {self.num_pages} free"
            )
        pages = [heapq.heappop(self._free) for _ in range(n_pages)]
        self._refs.update((p, 1) for p in pages)
        return pages

    def share(self, pages: Iterable[int]) -> None:
        """One more holder for each of ``pages`` (all allocated; all-or-nothing, as ``free``)."""
        pages = self._check_held(pages)
        for p in pages:
            self._refs[p] += 1

    def free(self, pages: Iterable[int]) -> None:
        """One holder fewer for each of ``pages``; a page with none left returns to the pool.
        All-or-nothing: a page that is not allocated (foreign, already free, or listed twice)
        raises ``ValueError`` and nothing is freed."""
        pages = self._check_held(pages)
        for p in pages:
            self._refs[p] -= 1
            if self._refs[p] == 0:
                del self._refs[p]
                heapq.heappush(self._free, p)

    def _check_held(self, pages: Iterable[int]) -> list[int]:
        pages = list(pages)
        if len(set(pages)) != len(pages):
            raise ValueError(f"pages listed more than once: {sorted(pages)}")
        foreign = [p for p in pages if p not in self._refs]
        if foreign:
            raise ValueError(f"pages {foreign} are not allocated (double free or foreign page)")
        return pages


def _check_group(C: int) -> None:
    if C < 1:
        raise ValueError(f"C (DCP group size) must be >= 1, got {C}")


def _check_page_size(page_size: int) -> None:
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
