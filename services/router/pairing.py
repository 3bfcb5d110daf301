"""Which (prefill, decode) pair takes a request.

The router's only state about a service is here: whether it is healthy (and why not), how many
of this router's requests it is working on, what the service itself last reported (its queue
depth, which counts every router's requests, and — for decode services — its free cache rows
and how many tokens its cache holds), and which blocks its cache holds (``Endpoint.index``,
prefix_index.py). The health monitor writes health, the polled figures and the index every
``health_interval_s``; the dispatcher counts work and records what a finished request left in
the caches.

A service's load is ``in_flight + queue_depth``. Two policies (:class:`PairingPolicy` ``mode``):

- ``load``: the pair with the least load (prefill's + decode's), then the decode service with
  the most free rows, then round-robin (``turn`` rotates ties, so idle services share
  sequential requests).
- ``cache_aware`` (the default): a service is *much busier* when its load is more than
  ``balance_abs`` above the least load among the candidate services of its kind AND more than
  ``balance_rel`` times it; its cached prefix and its affinity count for nothing (a hit is not
  worth a queue: the pick falls back to load, as SGLang's cache-aware policy does). A service's
  cached prefix also counts for nothing when it covers less than ``cache_threshold`` (0.25) of the
  request's tokens (after SGLang's ``cache_threshold``): a shared system prompt alone does not pull
  every new conversation to the service that cached it first — those spread by load and
  affinity, and each conversation's later turns, mostly cached, follow their cache. Among the
  pairs, in order: the most expected reused tokens (prefill's + decode's, from their indexes),
  then the affinity hint (how many of the pair are the services that rendezvous hashing of the
  request's ``prompt_cache_key``/``user`` picks among the healthy ones of its kind — so a
  conversation's turns meet the same services before any reuse is known), then ``load``'s order.

Every cache-aware decision has a reason (``cpserve_router_pairing_decisions_total``):
``balance`` — the chosen pair reuses fewer tokens than the best pair would have, because a
much busier service was passed over; else ``prefix`` — expected reuse decided; else
``affinity``; else ``load`` (no reuse expected anywhere, no affinity). ``load`` mode's are all
``load``.
"""

from __future__ import annotations

import hashlib
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Literal, Mapping, Sequence

from services.router.prefix_index import PrefixIndex

REASONS = ("prefix", "affinity", "load", "balance")


@dataclass(frozen=True)
class PairingPolicy:
    mode: Literal["cache_aware", "load"] = "cache_aware"
    balance_abs: int = 4  # much busier: load > least + balance_abs ...
    balance_rel: float = 1.5  # ... and load > balance_rel × least
    provisional_ttl_s: float = 30.0  # a finished request's blocks count as cached this long before a poll says
    cache_threshold: float = 0.25  # a cached prefix counts only if it covers this fraction of the request's tokens

    def __post_init__(self) -> None:
        if self.mode not in ("cache_aware", "load"):
            raise ValueError(f"pairing: must be cache_aware or load, got {self.mode!r}")
        if self.balance_abs < 0:
            raise ValueError(f"balance_abs: must be >= 0, got {self.balance_abs}")
        if self.balance_rel < 1:
            raise ValueError(f"balance_rel: must be >= 1, got {self.balance_rel}")
        if not 0 <= self.cache_threshold <= 1:
            raise ValueError(f"cache_threshold: must be in [0, 1], got {self.cache_threshold}")

    @classmethod
    def of(cls, config: Any) -> "PairingPolicy":
        """From the router's config (RouterConfig ``pairing``, ``balance_abs``, ``balance_rel``)."""
        return cls(config.pairing, config.balance_abs, config.balance_rel,
                   cache_threshold=config.cache_threshold)


@dataclass
class Endpoint:
    kind: str  # "prefill" | "decode"
    address: str
    healthy: bool = False
    reason: str = "not checked yet"  # why it is unhealthy ("" when healthy)
    in_flight: int = 0  # this router's requests on it (prefill: during Prefill; decode: Reserve to end of stream)
    capacity_tokens: int | None = None  # decode: rows on all ranks together, from Status
    queue_depth: int = 0  # requests waiting in the service's engine queue, from Status (every router's)
    rows_free: int | None = None  # decode: free rows on all ranks together, from Status
    index: PrefixIndex = field(default_factory=PrefixIndex)  # the blocks its cache holds, from KvEvents

    @property
    def load(self) -> int:
        return self.in_flight + self.queue_depth

    def mark(self, healthy: bool, reason: str = "") -> None:
        self.healthy, self.reason = healthy, "" if healthy else (reason or "unhealthy")


@dataclass(frozen=True)
class Choice:
    prefill: Endpoint
    decode: Endpoint
    reason: str  # one of REASONS
    reused_tokens: int = 0  # expected: the prefill's plus the decode's


def _pairs(prefills: list[Endpoint], decodes: list[Endpoint],
           exclude: set[tuple[str, str]]) -> list[tuple[Endpoint, Endpoint]]:
    return [(p, d) for p in prefills if p.healthy for d in decodes if d.healthy
            if (p.address, d.address) not in exclude]


def pick_pair(prefills: list[Endpoint], decodes: list[Endpoint], exclude: set[tuple[str, str]],
              turn: int = 0) -> tuple[Endpoint, Endpoint] | None:
    """``load`` mode: the healthy pair, not in ``exclude`` (address pairs), with the least load;
    then the most free decode rows; ties go round-robin by ``turn``."""
    pairs = _pairs(prefills, decodes, exclude)
    if not pairs:
        return None
    n = len(pairs)

    def key(i: int):
        p, d = pairs[i]
        return p.load + d.load, -(d.rows_free or 0), (i - turn) % n

    return pairs[min(range(n), key=key)]


def much_busier(endpoints: Sequence[Endpoint], balance_abs: int, balance_rel: float) -> set[str]:
    """Addresses of the ``endpoints`` (one kind) whose load is far above the least one's."""
    least = min(e.load for e in endpoints)
    return {e.address for e in endpoints if e.load > least + balance_abs and e.load > balance_rel * least}


def rendezvous(key: str, addresses: Sequence[str]) -> str | None:
    """The address ``key`` goes to by highest-random-weight hashing (stable across routers and
    restarts; a service leaving moves only its own keys); None without a key or addresses."""
    if not key or not addresses:
        return None
    return max(addresses, key=lambda a: hashlib.blake2b(f"{key}\0{a}".encode(), digest_size=8).digest())


def pick_cache_aware(prefills: list[Endpoint], decodes: list[Endpoint], exclude: set[tuple[str, str]],
                     reuse: Mapping[str, int], affinity: str, policy: PairingPolicy, turn: int = 0,
                     num_tokens: int = 0) -> Choice | None:
    """``cache_aware`` mode (the module docstring has the rule). ``reuse``: expected reused
    tokens per service address (absent: none) of a request of ``num_tokens`` tokens."""
    pairs = _pairs(prefills, decodes, exclude)
    if not pairs:
        return None
    floor = policy.cache_threshold * num_tokens
    reuse = {a: n for a, n in reuse.items() if n > 0 and n >= floor}
    busy: set[str] = set()
    for side in (0, 1):
        candidates = list({pair[side].address: pair[side] for pair in pairs}.values())
        busy |= much_busier(candidates, policy.balance_abs, policy.balance_rel)
    favoured = {rendezvous(affinity, [e.address for e in eps if e.healthy]) for eps in (prefills, decodes)}
    favoured -= busy | {None}

    def credit(e: Endpoint) -> int:
        return 0 if e.address in busy else reuse.get(e.address, 0)

    n = len(pairs)

    def key(i: int):
        p, d = pairs[i]
        return (-(credit(p) + credit(d)), -((p.address in favoured) + (d.address in favoured)), p.load + d.load,
                -(d.rows_free or 0), (i - turn) % n)

    p, d = pairs[min(range(n), key=key)]
    got = credit(p) + credit(d)
    best = max(reuse.get(a.address, 0) + reuse.get(b.address, 0) for a, b in pairs)
    reason = ("balance" if best > got else "prefix" if got else
              "affinity" if {p.address, d.address} & favoured else "load")
    return Choice(p, d, reason, got)


class Cluster:
    """The configured services and the pairing policy."""

    def __init__(self, prefill_addresses: list[str], decode_addresses: list[str],
                 policy: PairingPolicy | None = None):
        self.policy = policy or PairingPolicy()

        def endpoint(kind: str, address: str) -> Endpoint:
            return Endpoint(kind, address, index=PrefixIndex(self.policy.provisional_ttl_s))

        self.prefills = [endpoint("prefill", a) for a in prefill_addresses]
        self.decodes = [endpoint("decode", a) for a in decode_addresses]
        self._turn = 0

    @property
    def endpoints(self) -> list[Endpoint]:
        return self.prefills + self.decodes

    @property
    def cache_aware(self) -> bool:
        return self.policy.mode == "cache_aware"

    def key_seeds(self) -> set[bytes]:
        """The distinct key seeds of the healthy services that keep an index."""
        return {e.index.key_seed for e in self.endpoints if e.healthy and e.index.known}

    def expected_reuse(self, keys: Mapping[bytes, Sequence[int]]) -> dict[str, int]:
        """Reused tokens per healthy service, from a job's ``keys`` per seed (prefix_index.keys_by_seed)."""
        return {e.address: e.index.reused_tokens(keys[e.index.key_seed]) for e in self.endpoints
                if e.healthy and e.index.key_seed in keys}

    def pick(self, exclude: set[tuple[str, str]], keys: Mapping[bytes, Sequence[int]] | None = None,
             affinity: str = "", num_tokens: int = 0) -> Choice | None:
        """The pair for a job of ``num_tokens`` tokens whose block keys per seed are ``keys``
        (cache_aware mode only)."""
        if self.cache_aware:
            choice = pick_cache_aware(self.prefills, self.decodes, exclude, self.expected_reuse(keys or {}), affinity,
                                      self.policy, self._turn, num_tokens)
        else:
            pair = pick_pair(self.prefills, self.decodes, exclude, self._turn)
            choice = None if pair is None else Choice(*pair, "load")
        self._turn += 1
        return choice

    @property
    def can_serve(self) -> bool:
        return any(p.healthy for p in self.prefills) and any(d.healthy for d in self.decodes)

    def capacity_tokens(self) -> int | None:
        """The smallest decode cache (tokens), so that any request we admit fits every decode service."""
        known = [d.capacity_tokens for d in self.decodes if d.capacity_tokens]
        return min(known) if known else None

    def why_none(self) -> str:
        """Why no pair is available, for the error message."""
        bad = [f"{e.kind} {e.address}: {e.reason}" for e in self.endpoints if not e.healthy]
        return "; ".join(bad) if bad else "every pair was tried"

    @staticmethod
    @contextmanager
    def busy(endpoint: Endpoint) -> Iterator[None]:
        endpoint.in_flight += 1
        try:
            yield
        finally:
            endpoint.in_flight -= 1
