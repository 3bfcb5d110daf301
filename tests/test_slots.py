"""Decode slot numbering and page allocation (engine/cache/slots.py)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.cache.slots import (
    PageAllocator,
    local_rows,
    pages_needed,
    slot_to_rank_row,
    slots_to_rank_rows,
    token_slots,
)


def test_worked_example_slot_9_at_c4():
    assert slot_to_rank_row(9, 4) == (1, 2)
    ranks, rows = slots_to_rank_rows(torch.tensor([9]), 4)
    assert (ranks.item(), rows.item()) == (1, 2)


def test_token_slots_use_virtual_pages():
    # page_size 2, C 2: a virtual page spans 4 slots; pages [3, 1]
    slots = token_slots([3, 1], num_tokens=6, page_size=2, C=2)
    assert slots.tolist() == [12, 13, 14, 15, 4, 5]
    assert slots.dtype == torch.long
    assert local_rows([3, 1], 6, 2, 2, rank=1).tolist() == [6, 7, 2]


def test_short_page_table_is_refused():
    with pytest.raises(ValueError, match="page_table"):
        token_slots([0], num_tokens=5, page_size=2, C=2)


def test_pages_needed():
    assert pages_needed(0, 16, 4) == 0
    assert pages_needed(64, 16, 4) == 1
    assert pages_needed(65, 16, 4) == 2


def test_allocator_refuses_double_free_and_foreign_pages():
    alloc = PageAllocator(4)
    pages = alloc.allocate(2)
    alloc.free(pages[:1])
    with pytest.raises(ValueError, match="not allocated"):
        alloc.free(pages[:1])
    with pytest.raises(ValueError, match="not allocated"):
        alloc.free([99])
    with pytest.raises(ValueError, match="more than once"):
        alloc.free([pages[1], pages[1]])
    assert not alloc.can_allocate(4)
    with pytest.raises(ValueError, match="cannot allocate"):
        alloc.allocate(4)
    assert alloc.num_free == 3


@settings(max_examples=100, deadline=None)
@given(
    num_tokens=st.integers(0, 300),
    page_size=st.integers(1, 8),
    C=st.integers(1, 8),
)
def test_token_p_lands_on_rank_p_mod_c(num_tokens, page_size, C):
    alloc = PageAllocator(pages_needed(300, 1, 1))
    table = alloc.allocate(pages_needed(num_tokens, page_size, C))[::-1]
    ranks, rows = slots_to_rank_rows(token_slots(table, num_tokens, page_size, C), C)
    assert ranks.tolist() == [p % C for p in range(num_tokens)]
    counts = torch.bincount(ranks, minlength=C).tolist()
    assert set(counts) <= {num_tokens // C, -(-num_tokens // C)}
    for rank in range(C):
        mine = rows[ranks == rank].tolist()
        assert local_rows(table, num_tokens, page_size, C, rank).tolist() == mine
        # each virtual page is page_size rows on every rank
        assert all(row // page_size in table for row in rows[ranks == rank].tolist())


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 200), min_size=1, max_size=8),
    page_size=st.integers(1, 8),
    C=st.integers(1, 8),
)
def test_live_requests_never_share_a_row(lengths, page_size, C):
    alloc = PageAllocator(sum(pages_needed(n, page_size, C) for n in lengths) + 3)
    seen = set()
    total = 0
    for n in lengths:
        table = alloc.allocate(pages_needed(n, page_size, C))
        ranks, rows = slots_to_rank_rows(token_slots(table, n, page_size, C), C)
        seen.update(zip(ranks.tolist(), rows.tolist()))
        total += n
    assert len(seen) == total


ops = st.lists(st.tuples(st.booleans(), st.integers(0, 6)), max_size=40)


@settings(max_examples=100, deadline=None)
@given(num_pages=st.integers(0, 20), ops=ops)
def test_allocator_conserves_pages(num_pages, ops):
    alloc = PageAllocator(num_pages)
    live: list[list[int]] = []
    for is_alloc, n in ops:
        if is_alloc:
            if alloc.can_allocate(n):
                live.append(alloc.allocate(n))
            else:
                with pytest.raises(ValueError):
                    alloc.allocate(n)
        elif live:
            alloc.free(live.pop(n % len(live)))
        held = [p for pages in live for p in pages]
        assert len(held) == len(set(held))
        assert alloc.num_allocated == len(held)
        assert alloc.num_free + alloc.num_allocated == num_pages
        assert all(0 <= p < num_pages for p in held)


def test_a_shared_page_is_free_again_only_after_its_last_holder():
    alloc = PageAllocator(3)
    pages = alloc.allocate(2)
    alloc.share(pages)  # a second holder (a fork of the same prompt)
    assert alloc.holders(pages[0]) == 2
    alloc.free(pages)
    assert alloc.num_free == 1 and alloc.holders(pages[0]) == 1
    alloc.free(pages)
    assert alloc.num_free == 3 and alloc.num_allocated == 0
    with pytest.raises(ValueError, match="not allocated"):
        alloc.share(pages)  # sharing a free page is refused, as freeing it is
    with pytest.raises(ValueError, match="more than once"):
        alloc.share([0, 0])


share_ops = st.lists(st.tuples(st.sampled_from(["allocate", "share", "free"]), st.integers(0, 6)), max_size=60)


@settings(max_examples=100, deadline=None)
@given(num_pages=st.integers(0, 12), ops=share_ops)
def test_allocator_conserves_pages_with_shared_holders(num_pages, ops):
    alloc = PageAllocator(num_pages)
    holds: list[list[int]] = []  # each holder's pages
    for op, n in ops:
        if op == "allocate" and alloc.can_allocate(n):
            holds.append(alloc.allocate(n))
        elif op == "share" and holds:
            pages = holds[n % len(holds)]
            alloc.share(pages)
            holds.append(list(pages))
        elif op == "free" and holds:
            alloc.free(holds.pop(n % len(holds)))
        held = {p for pages in holds for p in pages}
        assert alloc.num_allocated == len(held)
        assert alloc.num_free + alloc.num_allocated == num_pages
        assert all(alloc.holders(p) == sum(p in pages for pages in holds) for p in held)
    for pages in holds:
        alloc.free(pages)
    assert alloc.num_free == num_pages


def test_pages_freed_together_come_back_as_one_ascending_run():
    """Two requests that grew a page at a time side by side hold interleaved pages; once both
    are freed, the next request gets them back as one ascending run (lowest first), so its
    KV hand-off is one range per layer, not one per page."""
    alloc = PageAllocator(16)
    head = alloc.allocate(2)
    a, b = [], []
    for _ in range(5):
        a += alloc.allocate(1)
        b += alloc.allocate(1)
    assert a == [2, 4, 6, 8, 10] and b == [3, 5, 7, 9, 11]
    alloc.free(a)
    alloc.free(b)
    assert alloc.allocate(10) == list(range(2, 12))
    alloc.free(head)
    assert alloc.allocate(3) == [0, 1, 12]
