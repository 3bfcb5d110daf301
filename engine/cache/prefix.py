"""Prefix cache: full prompt pages of finished requests, reused by later requests that share
the prefix, so that only their new tokens are prefilled (and split across CP ranks).

A page is cached only when every token in it is a prompt token (its rows never change again).
A cached page is found by a key over (its parent page, its tokens) — the parent being the cached
page of the prefix before it — and a hit is taken only after comparing both with the entry's
own parent and tokens, so a key collision can never hand out rows computed for other tokens:
the chain of verified (parent, tokens) links proves the whole prefix equal. Cached pages are
reference-counted; unreferenced ones are evicted LRU when the allocator runs short, together
with their cached descendants (whose parent id would otherwise be reused by another page).
"""

from __future__ import annotations

from collections import OrderedDict

from engine.cache.slots import PageAllocator

_BROKEN = -1  # the prefix so far is not all cached: no later page can be linked to it


def page_key(parent: int | None, tokens: tuple[int, ...]) -> int:
    """Where the page after ``parent`` holding ``tokens`` is filed (a hit is verified anyway)."""
    return hash((parent, tokens))


class PrefixCache:
    def __init__(self, allocator: PageAllocator, tokens_per_page: int):
        self.allocator, self.tokens_per_page = allocator, tokens_per_page
        self.by_key: dict[int, int] = {}  # page_key → page
        self.entry: dict[int, tuple[int | None, tuple[int, ...], int]] = {}  # page → (parent, tokens, key)
        self.children: dict[int, set[int]] = {}  # cached page → cached pages that continue it
        self.refs: dict[int, int] = {}  # cached page → live requests using it
        self.idle: OrderedDict[int, None] = OrderedDict()  # unreferenced cached pages, LRU first

    def _chunk(self, tokens: list[int], i: int) -> tuple[int, ...]:
        p = self.tokens_per_page
        return tuple(tokens[i * p:(i + 1) * p])

    def _find(self, parent: int | None, chunk: tuple[int, ...]) -> int | None:
        page = self.by_key.get(page_key(parent, chunk))
        if page is None:
            return None
        cached_parent, cached_tokens, _ = self.entry[page]
        return page if cached_parent == parent and cached_tokens == chunk else None

    def match(self, prompt: list[int]) -> list[int]:
        """Cached pages holding the longest page-aligned prefix of `prompt` (at least one prompt
        token is always left to compute, for the first token's logits). Takes a reference."""
        pages: list[int] = []
        parent = None
        for i in range((len(prompt) - 1) // self.tokens_per_page):
            page = self._find(parent, self._chunk(prompt, i))
            if page is None:
                break
            pages.append(page)
            parent = page
        for page in pages:
            self.refs[page] = self.refs.get(page, 0) + 1
            self.idle.pop(page, None)
        return pages

    def _evict(self, page: int) -> None:
        """Drop an unreferenced cached page and its cached descendants (all unreferenced too: a
        request holding a page holds every page of the prefix before it)."""
        for child in sorted(self.children.pop(page, ())):
            self._evict(child)
        parent, _, key = self.entry.pop(page)
        if self.by_key.get(key) == page:
            del self.by_key[key]
        if parent is not None:
            self.children.get(parent, set()).discard(page)
        assert self.refs.pop(page) == 0, f"prefix cache: evicting page {page} while a request holds it"
        self.idle.pop(page, None)
        self.allocator.free([page])

    def _evict_one(self) -> None:
        self._evict(next(iter(self.idle)))

    def allocate(self, n: int) -> list[int] | None:
        """n fresh pages, evicting idle cached pages if needed; None if they cannot be had."""
        while not self.allocator.can_allocate(n) and self.idle:
            self._evict_one()
        return self.allocator.allocate(n) if self.allocator.can_allocate(n) else None

    def release(self, pages: list[int], prompt: list[int], prompt_done: bool) -> None:
        """A request ends: keep its full prompt pages (when its prompt was computed), free the rest."""
        full = len(prompt) // self.tokens_per_page if prompt_done else 0
        to_free = []
        parent: int | None = None
        for i, page in enumerate(pages):
            if page in self.refs:  # shared from the cache
                self.refs[page] -= 1
                if self.refs[page] == 0:
                    self.idle[page] = None
                parent = page
                continue
            if i >= full or parent == _BROKEN:
                to_free.append(page)
                parent = _BROKEN
                continue
            chunk = self._chunk(prompt, i)
            existing = self._find(parent, chunk)
            if existing is not None:  # another request cached the same prefix meanwhile
                to_free.append(page)
                parent = existing
                continue
            key = page_key(parent, chunk)
            if key in self.by_key:  # a different entry under this key (a collision): keep that one
                to_free.append(page)
                parent = _BROKEN
                continue
            self.by_key[key], self.entry[page], self.refs[page] = page, (parent, chunk, key), 0
            if parent is not None:
                self.children.setdefault(parent, set()).add(page)
            self.idle[page] = None
            parent = page
        if to_free:
            self.allocator.free(to_free)

    @property
    def num_cached_pages(self) -> int:
        return len(self.refs)

    def clear(self) -> None:
        """Return every idle cached page to the allocator."""
        while self.idle:
            self._evict_one()
