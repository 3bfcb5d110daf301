"""Which (prefill, decode) pair takes a request: least outstanding work among healthy services.

The router's only state about a service is here: whether it is healthy (and why not), how many
of this router's requests it is working on, what the service itself last reported (its queue
depth, which counts every router's requests, and — for decode services — its free cache rows
and how many tokens its cache holds). The health monitor writes health and the polled figures
every ``health_interval_s``; the dispatcher counts work.

Order of preference: least outstanding work (this router's in-flight requests plus the queues
the services reported), then the decode service with the most free rows, then round-robin.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator


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

    def mark(self, healthy: bool, reason: str = "") -> None:
        self.healthy, self.reason = healthy, "" if healthy else (reason or "unhealthy")


def pick_pair(prefills: list[Endpoint], decodes: list[Endpoint], exclude: set[tuple[str, str]],
              turn: int = 0) -> tuple[Endpoint, Endpoint] | None:
    """The healthy pair, not in ``exclude`` (address pairs), with the least outstanding work
    (prefill in-flight + decode in-flight). Ties go round-robin: ``turn`` rotates the order in
    which equally loaded pairs are preferred, so idle services share sequential requests."""
    pairs = [(p, d) for p in prefills if p.healthy for d in decodes if d.healthy
             if (p.address, d.address) not in exclude]
    if not pairs:
        return None
    n = len(pairs)

    def key(i: int):
        p, d = pairs[i]
        return (p.in_flight + p.queue_depth + d.in_flight + d.queue_depth, -(d.rows_free or 0), (i - turn) % n)

    return pairs[min(range(n), key=key)]


class Cluster:
    """The configured services and the pairing policy."""

    def __init__(self, prefill_addresses: list[str], decode_addresses: list[str]):
        self.prefills = [Endpoint("prefill", a) for a in prefill_addresses]
        self.decodes = [Endpoint("decode", a) for a in decode_addresses]
        self._turn = 0

    @property
    def endpoints(self) -> list[Endpoint]:
        return self.prefills + self.decodes

    def pick(self, exclude: set[tuple[str, str]]) -> tuple[Endpoint, Endpoint] | None:
        pair = pick_pair(self.prefills, self.decodes, exclude, self._turn)
        self._turn += 1
        return pair

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
