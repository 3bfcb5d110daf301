"""Prefix cache: full pages of finished requests, reused by later requests that share the prefix.

Prefill keeps prompt pages (only the new tokens of a later prompt are computed and split across
CP ranks); decode keeps a finished request's prompt and output rows (a conversation's next turn
is sent only its new tokens). Both use this class over their own allocator.

A page is cached only when every token in it has its KV written (its rows never change again).
It is filed under the content key of its last block (engine/cache/content_key.py: a chained hash
of the token ids from the start, seeded with the layout and the request's ``cache_salt``), and a
hit is taken only after comparing the entry's own parent page and tokens, so a key collision can
never hand out rows computed for other tokens: the chain of verified (parent, tokens) links proves
the whole prefix equal (and the salt is compared too, so tenants never share on a collision). Cached pages are reference-counted; unreferenced ones ("idle") are
evicted LRU when the allocator runs short, together with their cached descendants (whose parent
id would otherwise be reused by another page).

Holds: the allocator holds a cached page once (the cache's hold) however many requests use it;
those count in ``refs``. ``hold``/``drop`` take and give back one use of a list of pages,
cached or not, so a caller need not know which of its pages came from the cache.

Every page stored or evicted is reported to ``events`` (its block keys), the router's index.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from engine.cache.content_key import BLOCK_TOKENS, KvEventLog, block_keys
from engine.cache.slots import PageAllocator

_BROKEN = -1  # the prefix so far is not all cached: no later page can be linked to it


class PrefixCache:
    def __init__(self, allocator: PageAllocator, tokens_per_page: int, seed: bytes = b"",
                 block_tokens: int = BLOCK_TOKENS, events: KvEventLog | None = None):
        if tokens_per_page % block_tokens:
            raise ValueError(f"page_size: a cached page must be whole {block_tokens}-token blocks, but a page holds "
                             f"{tokens_per_page} tokens (use a page size that makes it a multiple of "
                             f"{block_tokens}, or turn the prefix cache off)")
        self.allocator, self.tokens_per_page, self.seed = allocator, tokens_per_page, seed
        self.block_tokens, self.blocks_per_page = block_tokens, tokens_per_page // block_tokens
        self.events = events if events is not None else KvEventLog(seed)
        self.by_key: dict[int, int] = {}  # content key of the page's last block → page
        # page → (parent page, tokens, block keys, salt): what a hit is verified against
        self.entry: dict[int, tuple[int | None, tuple[int, ...], tuple[int, ...], str]] = {}
        self.children: dict[int, set[int]] = {}  # cached page → cached pages that continue it
        self.refs: dict[int, int] = {}  # cached page → live requests using it
        self.idle: OrderedDict[int, None] = OrderedDict()  # unreferenced cached pages, LRU first
        self.queries = self.hits = 0  # tokens looked up by match(), and found (vLLM's counters)

    def _chunk(self, tokens: Sequence[int], i: int) -> tuple[int, ...]:
        p = self.tokens_per_page
        return tuple(tokens[i * p:(i + 1) * p])

    def _keys(self, tokens: Sequence[int], num_pages: int, salt: str) -> list[tuple[int, ...]]:
        """Each page's block keys (the last one files the page)."""
        keys = block_keys(tokens, self.seed, salt, num_pages * self.blocks_per_page, self.block_tokens)
        b = self.blocks_per_page
        return [tuple(keys[i * b:(i + 1) * b]) for i in range(len(keys) // b)]

    def _find(self, parent: int | None, chunk: tuple[int, ...], key: int, salt: str) -> int | None:
        page = self.by_key.get(key)
        if page is None:
            return None
        cached_parent, cached_tokens, _, cached_salt = self.entry[page]
        return page if cached_parent == parent and cached_tokens == chunk and cached_salt == salt else None

    def match(self, prompt: Sequence[int], salt: str = "", limit: int | None = None) -> list[int]:
        """Cached pages holding the longest page-aligned prefix of `prompt` (at least one prompt
        token is always left to compute, for the first token's logits; ``limit``: at most that
        many tokens). Takes a reference; counts the lookup."""
        n = (len(prompt) - 1) // self.tokens_per_page
        if limit is not None:
            n = min(n, limit // self.tokens_per_page)
        pages: list[int] = []
        parent = None
        for i, keys in enumerate(self._keys(prompt, n, salt)):
            page = self._find(parent, self._chunk(prompt, i), keys[-1], salt)
            if page is None:
                break
            pages.append(page)
            parent = page
        self.hold(pages)
        self.queries += len(prompt)
        self.hits += len(pages) * self.tokens_per_page
        return pages

    def hold(self, pages: Sequence[int]) -> None:
        """One more use of each page: a cached page's reference, another page's allocator hold."""
        for page in pages:
            if page in self.refs:
                self.refs[page] += 1
                self.idle.pop(page, None)
            else:
                self.allocator.share([page])

    def drop(self, pages: Sequence[int]) -> None:
        """One use fewer of each page (``hold``'s inverse); nothing new is cached."""
        to_free = []
        for page in pages:
            if page in self.refs:
                self._unref(page)
            else:
                to_free.append(page)
        if to_free:
            self.allocator.free(to_free)

    def _unref(self, page: int) -> None:
        self.refs[page] -= 1
        if self.refs[page] == 0:
            self.idle[page] = None

    def _evict(self, page: int) -> None:
        """Drop an unreferenced cached page and its cached descendants (all unreferenced too: a
        request holding a page holds every page of the prefix before it)."""
        for child in sorted(self.children.pop(page, ())):
            self._evict(child)
        parent, _, keys, _ = self.entry.pop(page)
        if self.by_key.get(keys[-1]) == page:
            del self.by_key[keys[-1]]
        if parent is not None:
            self.children.get(parent, set()).discard(page)
        assert self.refs.pop(page) == 0, f"prefix cache: evicting page {page} while a request holds it"
        self.idle.pop(page, None)
        self.allocator.free([page])
        self.events.removed(keys)

    def _evict_one(self) -> None:
        self._evict(next(iter(self.idle)))

    @property
    def num_reclaimable(self) -> int:
        """Pages that eviction can free now (idle cached pages)."""
        return len(self.idle)

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= self.allocator.num_free + len(self.idle)

    def make_free(self, n: int) -> bool:
        """Evict idle cached pages (LRU) until ``n`` pages are free; False if they cannot be."""
        while self.allocator.num_free < n and self.idle:
            self._evict_one()
        return self.allocator.can_allocate(n)

    def allocate(self, n: int) -> list[int] | None:
        """n fresh pages, evicting idle cached pages if needed; None if they cannot be had."""
        return self.allocator.allocate(n) if self.make_free(n) else None

    def release(self, pages: list[int], tokens: Sequence[int], num_done: int, salt: str = "") -> None:
        """A request ends: keep its pages whose every token's KV is written (the first
        ``num_done`` tokens of ``tokens``), give back its use of the rest."""
        full = min(num_done, len(tokens)) // self.tokens_per_page
        keys = self._keys(tokens, full, salt)
        to_free = []
        parent: int | None = None
        for i, page in enumerate(pages):
            if page in self.refs:  # shared from the cache
                self._unref(page)
                parent = page
                continue
            if i >= full or parent == _BROKEN:
                to_free.append(page)
                parent = _BROKEN
                continue
            chunk, key = self._chunk(tokens, i), keys[i][-1]
            existing = self._find(parent, chunk, key, salt)
            if existing is not None or key in self.by_key or self.allocator.holders(page) != 1:
                # cached meanwhile by another request (link on to it); a different entry under
                # this key (a collision: keep that one); or another holder still writes the page
                to_free.append(page)
                parent = existing if existing is not None else _BROKEN
                continue
            self.by_key[key], self.entry[page], self.refs[page] = page, (parent, chunk, keys[i], salt), 0
            if parent is not None:
                self.children.setdefault(parent, set()).add(page)
            self.idle[page] = None
            self.events.stored(keys[i])
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

