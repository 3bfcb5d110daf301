"""Prefix cache: full prompt pages of finished requests, reused by later requests that share
the prefix, so that only their new tokens are prefilled (and split across CP ranks).

A page is cached only when every token in it is a prompt token (its rows never change again).
Pages are keyed by a hash chain over their tokens, so a page matches only when the whole prefix
before it matches too. Cached pages are reference-counted; unreferenced ones are evicted LRU
when the allocator runs short.
"""

from __future__ import annotations

from collections import OrderedDict

from engine.cache.slots import PageAllocator


class PrefixCache:
    def __init__(self, allocator: PageAllocator, tokens_per_page: int):
        self.allocator, self.tokens_per_page = allocator, tokens_per_page
        self.by_key: dict[int, int] = {}  # chain hash → page
        self.key_of: dict[int, int] = {}  # page → chain hash
        self.refs: dict[int, int] = {}  # cached page → live requests using it
        self.idle: OrderedDict[int, None] = OrderedDict()  # unreferenced cached pages, LRU first

    def _keys(self, tokens: list[int], num_pages: int) -> list[int]:
        keys, h, p = [], 0, self.tokens_per_page
        for i in range(num_pages):
            h = hash((h, tuple(tokens[i * p : (i + 1) * p])))
            keys.append(h)
        return keys

    def match(self, prompt: list[int]) -> list[int]:
        """Cached pages holding the longest page-aligned prefix of `prompt` (at least one prompt
        token is always left to compute, for the first token's logits). Takes a reference."""
        pages = []
        for key in self._keys(prompt, (len(prompt) - 1) // self.tokens_per_page):
            page = self.by_key.get(key)
            if page is None:
                break
            pages.append(page)
        for page in pages:
            self.refs[page] = self.refs.get(page, 0) + 1
            self.idle.pop(page, None)
        return pages

    def _evict_one(self) -> None:
        page, _ = self.idle.popitem(last=False)
        del self.by_key[self.key_of.pop(page)]
        del self.refs[page]
        self.allocator.free([page])

    def allocate(self, n: int) -> list[int] | None:
        """n fresh pages, evicting idle cached pages if needed; None if they cannot be had."""
        while not self.allocator.can_allocate(n) and self.idle:
            self._evict_one()
        return self.allocator.allocate(n) if self.allocator.can_allocate(n) else None

    def release(self, pages: list[int], prompt: list[int], prompt_done: bool) -> None:
        """A request ends: keep its full prompt pages (when its prompt was computed), free the rest."""
        full = len(prompt) // self.tokens_per_page if prompt_done else 0
        keys = self._keys(prompt, full)
        to_free = []
        for i, page in enumerate(pages):
            if page in self.refs:  # shared from the cache
                self.refs[page] -= 1
                if self.refs[page] == 0:
                    self.idle[page] = None
            elif i < full and keys[i] not in self.by_key:
                self.by_key[keys[i]], self.key_of[page], self.refs[page] = page, keys[i], 0
                self.idle[page] = None
            else:
                to_free.append(page)
        if to_free:
            self.allocator.free(to_free)

    @property
    def num_cached_pages(self) -> int:
        return len(self.refs)

    def clear(self) -> None:
        """Return every idle cached page to the allocator."""
        while self.idle:
            self._evict_one()
