"""Content keys of cached KV: one name for a run of tokens that every process computes alike.

A sequence is cut into blocks of ``BLOCK_TOKENS`` tokens at 16-aligned positions (a trailing
partial block has no key). Block i's key is a hash of block i-1's chain value and block i's
token ids, so a key names the whole prefix up to its block's end, not the block alone. The chain
starts from a seed made of what makes cached rows meaningful — the layout fingerprint (model,
compute dtype, cache format: engine/handoff.py) — and, per request, an optional ``cache_salt``:
requests with different salts never produce a common key, so they never share rows.

Keys depend on token ids only, never on a service's page size or page ids: a prefill page (16
tokens), a decode page (16 × DCP tokens), the router's index and a shared tier all name the same
prefix the same way. A service caches whole pages, i.e. ``page_tokens / BLOCK_TOKENS`` blocks,
and files a page under the key of its last block; a hit is still verified against the page's own
tokens and parent (engine/cache/prefix.py), so a hash collision can never hand out wrong rows.

Cost: one 16-byte BLAKE2b per block (~1 µs): 128k tokens hash in ~10 ms. The router hashes off
its event loop.
"""

from __future__ import annotations

import hashlib
import json
import threading
import uuid
from array import array
from collections import Counter, deque
from dataclasses import dataclass
from typing import Sequence

BLOCK_TOKENS = 16
_DIGEST = 16


def key_seed(fingerprint: dict) -> bytes:
    """The chain's seed for rows of this layout (``engine.handoff.layout_fingerprint``)."""
    text = json.dumps(fingerprint, sort_keys=True, default=str).encode()
    return hashlib.blake2b(b"cpserve-kv-blocks/1\0" + text, digest_size=_DIGEST).digest()


def salted(seed: bytes, salt: str = "") -> bytes:
    """The seed of a request with ``cache_salt`` ``salt`` (no salt: ``seed`` itself)."""
    if not salt:
        return seed
    return hashlib.blake2b(seed + b"\0salt\0" + salt.encode(), digest_size=_DIGEST).digest()


def block_keys(tokens: Sequence[int], seed: bytes, salt: str = "", num_blocks: int | None = None,
               block_tokens: int = BLOCK_TOKENS) -> list[int]:
    """Keys (unsigned 64-bit) of the first ``num_blocks`` full blocks of ``tokens`` (default: all).
    ``block_tokens`` other than ``BLOCK_TOKENS`` only for unit tests of small pages."""
    n = len(tokens) // block_tokens if num_blocks is None else min(num_blocks, len(tokens) // block_tokens)
    if n <= 0:
        return []
    data = array("I", tokens[: n * block_tokens]).tobytes()
    step = block_tokens * 4
    chain, keys = salted(seed, salt), []
    blake = hashlib.blake2b
    for i in range(n):
        chain = blake(chain + data[i * step:(i + 1) * step], digest_size=_DIGEST).digest()
        keys.append(int.from_bytes(chain[:8], "little"))
    return keys


@dataclass(frozen=True)
class EventBatch:
    """What ``KvEventLog.since`` answers (protos/common.proto ``KvEvents``)."""

    incarnation: str
    last: int
    reset: bool
    snapshot: tuple[int, ...]
    events: tuple[tuple[str, tuple[int, ...]], ...]  # ("stored" | "removed", block keys)


class KvEventLog:
    """The blocks a cache stores and removes, as numbered events, for the router's index.

    Written by the engine thread, read by handler threads (one lock). Keeps the last
    ``max_events`` events and a count of every block key now cached (two pages may share a
    leading block: it is gone only when both are), so a reader that fell behind, or knew
    another incarnation, gets a snapshot instead."""

    def __init__(self, seed: bytes, max_events: int = 4096):
        self.seed = seed
        self.incarnation = uuid.uuid4().hex
        self._lock = threading.Lock()
        self._events: deque[tuple[int, str, tuple[int, ...]]] = deque(maxlen=max_events)
        self._last = 0
        self._held: Counter[int] = Counter()

    def _add(self, kind: str, keys: Sequence[int]) -> None:
        with self._lock:
            for k in keys:
                if kind == "stored":
                    self._held[k] += 1
                else:
                    self._held[k] -= 1
                    if self._held[k] <= 0:
                        del self._held[k]
            self._last += 1
            self._events.append((self._last, kind, tuple(keys)))

    def stored(self, keys: Sequence[int]) -> None:
        self._add("stored", keys)

    def removed(self, keys: Sequence[int]) -> None:
        self._add("removed", keys)

    @property
    def num_blocks(self) -> int:
        with self._lock:
            return len(self._held)

    def since(self, incarnation: str, after: int) -> EventBatch:
        """Events after ``after`` for a reader of ``incarnation``; a snapshot when they do not
        continue what it has (another incarnation, or events it missed were dropped)."""
        with self._lock:
            first = self._events[0][0] if self._events else self._last + 1
            if incarnation != self.incarnation or after > self._last or after + 1 < first:
                # a key held by several pages is listed as often, so that a reader counting
                # keys, as the log does, stays exact through the removals to come
                return EventBatch(self.incarnation, self._last, True, tuple(self._held.elements()), ())
            events = tuple((kind, keys) for n, kind, keys in self._events if n > after)
            return EventBatch(self.incarnation, self._last, False, (), events)
