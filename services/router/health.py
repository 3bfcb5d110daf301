"""Polls every service: standard gRPC health (grpc.health.v1) and Status, every ``interval_s``.

A service is healthy when its health check answers SERVING and its Status says ``serving``.
Status also feeds the gauges (queue depth; decode rows used/free per rank; the decode services'
cache usage) and each decode service's capacity, which bounds the prompts the router admits. An
unhealthy service is left out of pairing until a later poll finds it healthy again.

A healthy service is then asked for its cache's ``KvEvents`` since the last poll, applied to its
prefix index (prefix_index.py). Anything else — a failed poll, an unhealthy service, no answer
to KvEvents, a service without an index (UNIMPLEMENTED) — clears the index: a service that
restarted must not keep hits it lost. A failed KvEvents never makes a service unhealthy.

The gauges are also refreshed right before every scrape of ``/metrics`` (:meth:`refresh_load`:
Status of each healthy service, nothing else): a poll every few seconds would otherwise show
rows of requests that ended since as still in use.
"""

from __future__ import annotations

import asyncio
import logging

from services.router.backend import BackendError, DecodeClient, DecodeLoad, PrefillClient, PrefillLoad
from services.router.metrics import RouterMetrics
from services.router.pairing import Cluster, Endpoint

logger = logging.getLogger("cpserve.router")

SCRAPE_STATUS_TIMEOUT_S = 1.0  # a scrape waits at most this long for a service's Status


class HealthMonitor:
    def __init__(self, cluster: Cluster, prefill_clients: dict[str, PrefillClient],
                 decode_clients: dict[str, DecodeClient], metrics: RouterMetrics, interval_s: float,
                 rpc_timeout_s: float):
        self.cluster, self.metrics = cluster, metrics
        self.clients: dict[str, PrefillClient | DecodeClient] = {**prefill_clients, **decode_clients}
        self.interval_s, self.rpc_timeout_s = interval_s, rpc_timeout_s
        self.on_change: list = []  # callables(cluster) run after every poll (e.g. the router's own health)
        self._index_failing: set[str] = set()  # addresses whose last KvEvents failed (logged once)
        metrics.before_scrape.append(self.refresh_load)

    async def poll_once(self) -> None:
        await asyncio.gather(*(self._check(e) for e in self.cluster.endpoints))
        self._update_cache_usage()
        for callback in self.on_change:
            await callback(self.cluster)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.poll_once()
            except Exception:  # never let the monitor die; the next poll tries again
                logger.exception("health poll failed")

    async def refresh_load(self) -> None:
        """Status of every healthy service into the gauges; health is left to the polls."""
        async def one(e: Endpoint) -> None:
            try:
                self._apply(e, await self.clients[e.address].status(min(self.rpc_timeout_s, SCRAPE_STATUS_TIMEOUT_S)))
            except BackendError as err:
                logger.debug("Status of %s %s for a scrape failed: %s", e.kind, e.address, err)

        await asyncio.gather(*(one(e) for e in self.cluster.endpoints if e.healthy))
        self._update_cache_usage()

    async def _check(self, e: Endpoint) -> None:
        client = self.clients[e.address]
        try:
            healthy, reason = await client.check_health(self.rpc_timeout_s), "health check: not SERVING"
        except BackendError as err:
            healthy, reason = False, f"unreachable: {err.code.name}: {err.message}"
        if healthy:
            try:
                load = await client.status(self.rpc_timeout_s)
            except BackendError as err:
                healthy, reason = False, f"Status failed: {err.message}"
            else:
                healthy, reason = load.serving, "Status: not serving"
                self._apply(e, load)
        if healthy and self.cluster.cache_aware:
            await self._fetch_index(e)
        else:
            e.index.clear()
        if healthy != e.healthy:
            logger.info("%s %s is now %s%s", e.kind, e.address, "healthy" if healthy else "unhealthy",
                        "" if healthy else f" ({reason})")
        e.mark(healthy, reason)
        self.metrics.healthy.labels(e.kind, e.address).set(int(healthy))

    async def _fetch_index(self, e: Endpoint) -> None:
        asked_at = e.index.clock()
        try:
            answer = await self.clients[e.address].kv_events(e.index.incarnation, e.index.last, self.rpc_timeout_s)
            if answer is None:
                e.index.clear()
            else:
                e.index.apply(answer, asked_at)
        except (BackendError, ValueError) as err:
            if e.address not in self._index_failing:
                logger.warning("KvEvents of %s %s failed: %s; no prefix index until it answers", e.kind, e.address,
                               err)
            self._index_failing.add(e.address)
            e.index.clear()
        else:
            self._index_failing.discard(e.address)

    def _apply(self, e: Endpoint, load: PrefillLoad | DecodeLoad) -> None:
        self.metrics.queue_depth.labels(e.kind, e.address).set(load.queue_depth)
        e.queue_depth = load.queue_depth
        if e.kind == "decode":
            e.capacity_tokens = load.capacity_tokens
            e.rows_free = sum(load.rows_free)
            for rank, (used, free) in enumerate(zip(load.rows_used, load.rows_free)):
                self.metrics.rows_used.labels(e.address, str(rank)).set(used)
                self.metrics.rows_free.labels(e.address, str(rank)).set(free)

    def _update_cache_usage(self) -> None:
        """cpserve:kv_cache_usage_perc: rows in use over all rows, on the healthy decode services."""
        known = [d for d in self.cluster.decodes if d.healthy and d.capacity_tokens]
        total = sum(d.capacity_tokens for d in known)
        used = sum(d.capacity_tokens - (d.rows_free or 0) for d in known)
        self.metrics.kv_cache_usage_perc.set(used / total if total else 0.0)
