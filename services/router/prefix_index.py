"""What one service's cache holds, as the router knows it: block keys (engine/cache/content_key.py).

A :class:`PrefixIndex` per service mirrors the service's ``KvEvents`` (protos/common.proto): a
count per present block key, the incarnation it belongs to and the last event applied. The
health monitor feeds it every poll; the dispatcher asks it how many leading tokens of a job the
service would reuse. It is a hint for pairing, never a promise: the service verifies every hit.

Invariants:

- a key is present while its count is > 0, or while a provisional entry for it is alive;
- everything (counts and provisional entries) belongs to ``incarnation``: another incarnation,
  or :meth:`clear`, drops it all — no hit is claimed on a service that restarted;
- ``key_seed`` is None when the service gave no index (never answered, UNIMPLEMENTED, failed):
  then nothing is present and no keys can be computed for it.

Provisional entries are the router's own guess between polls: when a request ends, the blocks
it expects the service now holds count as present for ``provisional_ttl_s`` — a conversation's
next turn usually comes before the next poll brings the service's events. An answer to a poll
asked at least ``settle_s`` after an entry was recorded already reports what the service
really did, so it supersedes the entry (a guess never outlives the truth by more than a poll).

Cost: a Counter of every cached block key (8 bytes + dict overhead per block), lookups of the
leading keys only until the first absent one.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Callable, Iterable, Sequence

from engine.cache.content_key import BLOCK_TOKENS, block_keys
from services.protos import common_pb2

_STORED, _REMOVED = common_pb2.KvEvent.KIND_STORED, common_pb2.KvEvent.KIND_REMOVED


class PrefixIndex:
    def __init__(self, provisional_ttl_s: float = 30.0, settle_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic):
        self.provisional_ttl_s, self.settle_s, self.clock = provisional_ttl_s, settle_s, clock
        self.incarnation = ""  # "" until the first answer: the service then sends a snapshot
        self.last = 0  # the last event number applied
        self.key_seed: bytes | None = None
        self._counts: Counter[int] = Counter()
        self._provisional: dict[int, tuple[float, float]] = {}  # key -> (recorded at, expires at)

    @property
    def known(self) -> bool:
        """The service gave an index: its keys can be computed and looked up."""
        return self.key_seed is not None

    @property
    def num_blocks(self) -> int:
        return len(self._counts)

    def clear(self) -> None:
        """Forget everything: the next poll asks for a snapshot."""
        self.incarnation, self.last, self.key_seed = "", 0, None
        self._counts.clear()
        self._provisional.clear()

    def apply(self, answer: common_pb2.KvEvents, asked_at: float | None = None) -> None:
        """One ``KvEvents`` answer; ``asked_at`` (``clock`` time) is when the poll was sent.
        Raises ValueError, with the index cleared, for an answer it cannot use."""
        if answer.block_tokens not in (0, BLOCK_TOKENS):
            self.clear()
            raise ValueError(f"blocks of {answer.block_tokens} tokens; the router keys blocks of {BLOCK_TOKENS}")
        if answer.incarnation != self.incarnation:
            self._provisional.clear()
            if not answer.reset:  # events of an incarnation we never had a snapshot of
                self.clear()
                raise ValueError(f"events of incarnation {answer.incarnation!r} without a snapshot")
        if answer.reset:
            self._counts = Counter(answer.snapshot)
        else:
            for event in answer.events:
                sign = 1 if event.kind == _STORED else -1 if event.kind == _REMOVED else 0
                for key in event.block_keys:
                    self._counts[key] += sign
                    if self._counts[key] <= 0:
                        del self._counts[key]
        self.incarnation, self.last = answer.incarnation, answer.last
        self.key_seed = bytes(answer.key_seed) or None
        # expired entries go, and those this answer already accounts for
        now = self.clock()
        settled = float("-inf") if asked_at is None else asked_at - self.settle_s
        self._provisional = {k: (recorded, expires) for k, (recorded, expires) in self._provisional.items()
                             if expires > now and recorded > settled}

    def remember(self, keys: Iterable[int], incarnation: str) -> None:
        """``keys`` are expected present from now (provisionally), if the index still belongs to
        ``incarnation`` (the one the request was routed under)."""
        if not self.known or incarnation != self.incarnation:
            return
        now = self.clock()
        entry = (now, now + self.provisional_ttl_s)
        for key in keys:
            self._provisional[key] = entry

    def reused_tokens(self, keys: Sequence[int]) -> int:
        """Tokens of the longest run of leading ``keys`` present: what the service would reuse."""
        now, n = self.clock(), 0
        for key in keys:
            if key not in self._counts:
                entry = self._provisional.get(key)
                if entry is None or entry[1] <= now:
                    break
            n += 1
        return n * BLOCK_TOKENS


def keys_by_seed(tokens: Sequence[int], seeds: Iterable[bytes], salt: str = "") -> dict[bytes, list[int]]:
    """The block keys of ``tokens`` under each distinct seed (each hashed once; ~1 µs a block)."""
    return {seed: block_keys(tokens, seed, salt) for seed in set(seeds)}
