"""Each prefill and decode service's own Prometheus metrics (``metrics_port``), beside the router's.

Read at scrape time from what the service already keeps — the engine loop's snapshot (replaced
whole by the loop thread, so a scrape never touches the engine) and a few counters the
handlers bump:

===========================================  ==================================================
cpserve_<kind>_cache_rows_used{rank}         rows of allocated pages on that rank
cpserve_<kind>_cache_rows_free{rank}         rows of unallocated pages on that rank
cpserve_decode_cache_rows_filled{rank}       rows holding a token on that rank (token p: rank p mod C)
cpserve_<kind>_cache_rows_cached{rank}       rows of idle cached pages on that rank (reclaimable: in rows_free)
cpserve_<kind>_prefix_cache_queries_total    tokens looked up in the prefix cache (vLLM's name)
cpserve_<kind>_prefix_cache_hits_total       of those, tokens found (prefill: not computed; decode: not sent)
cpserve_<kind>_queue_depth                   requests waiting for the engine
cpserve_<kind>_serving                       1 while the rank group serves (0: failed/rebuilding)
cpserve_<kind>_step_seconds                  histogram: one engine step (a forward)
cpserve_prefill_requests_total               prefill requests this service answered
cpserve_prefill_kv_transfer_bytes_total      KV bytes this service wrote to decode
cpserve_prefill_kv_transfer_seconds_total    time its ranks spent in those writes (slowest rank)
cpserve_prefill_ring_bytes_total             ring CP: bytes the ranks passed round the ring (rows under
                                             pass-KV; queries and their returned partials under pass-Q)
cpserve_prefill_ring_attend_seconds_total    ring CP: rank-seconds of attention with a message in flight
cpserve_prefill_ring_exposed_seconds_total   ring CP: rank-seconds waited for it after that attention
                                             (0: the ring hid behind attention; exposed ÷ attend: the wait
                                             per second of attention)
===========================================  ==================================================
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class _Live:
    """A collector of gauges computed from the service's state at scrape time."""

    def __init__(self, kind: str, read: Callable[[], dict]):
        self.kind, self.read = kind, read

    def collect(self):
        state = self.read()
        k = self.kind
        used = GaugeMetricFamily(f"cpserve_{k}_cache_rows_used", "Rows of allocated pages, per rank",
                                 labels=["rank"])
        free = GaugeMetricFamily(f"cpserve_{k}_cache_rows_free", "Rows of unallocated pages, per rank",
                                 labels=["rank"])
        for rank, (u, f) in enumerate(zip(state["rows_used"], state["rows_free"])):
            used.add_metric([str(rank)], u)
            free.add_metric([str(rank)], f)
        yield used
        yield free
        if "rows_filled" in state:
            filled = GaugeMetricFamily(f"cpserve_{k}_cache_rows_filled", "Rows holding a token, per rank",
                                       labels=["rank"])
            for rank, n in enumerate(state["rows_filled"]):
                filled.add_metric([str(rank)], n)
            yield filled
        if "rows_cached" in state:
            cached = GaugeMetricFamily(f"cpserve_{k}_cache_rows_cached",
                                       "Rows of cached pages no request uses (reclaimable; counted in rows_free)",
                                       labels=["rank"])
            for rank, n in enumerate(state["rows_cached"]):
                cached.add_metric([str(rank)], n)
            yield cached
        if "prefix_cache_queries" in state:  # vLLM's names, in tokens
            yield CounterMetricFamily(f"cpserve_{k}_prefix_cache_queries", "Tokens looked up in the prefix cache",
                                      value=state["prefix_cache_queries"])
            yield CounterMetricFamily(f"cpserve_{k}_prefix_cache_hits", "Tokens found in the prefix cache",
                                      value=state["prefix_cache_hits"])
        yield GaugeMetricFamily(f"cpserve_{k}_queue_depth", "Requests waiting for the engine",
                                value=state["queue_depth"])
        yield GaugeMetricFamily(f"cpserve_{k}_serving", "1 while the rank group serves", value=state["serving"])


class ServiceMetrics:
    def __init__(self, kind: str, read: Callable[[], dict]):
        self.kind = kind
        r = self.registry = CollectorRegistry()
        r.register(_Live(kind, read))
        self.step_seconds = Histogram(f"cpserve_{kind}_step_seconds", "One engine step (a forward over the batch)",
                                      buckets=_STEP_BUCKETS, registry=r)
        if kind == "prefill":
            self.requests = Counter("cpserve_prefill_requests", "Prefill requests answered", registry=r)
            self.transfer_bytes = Counter("cpserve_prefill_kv_transfer_bytes", "KV bytes written to decode",
                                          registry=r)
            self.transfer_seconds = Counter("cpserve_prefill_kv_transfer_seconds",
                                            "Seconds the ranks spent in KV writes (slowest rank per request)",
                                            registry=r)
            # ring CP attention only (allgather: they stay 0); summed over the ranks
            self.ring_bytes = Counter("cpserve_prefill_ring_bytes", "Bytes passed round the ring (rows or queries)",
                                      registry=r)
            self.ring_attend_seconds = Counter("cpserve_prefill_ring_attend_seconds",
                                               "Rank-seconds of attention while a ring message was in flight",
                                               registry=r)
            self.ring_exposed_seconds = Counter("cpserve_prefill_ring_exposed_seconds",
                                                "Rank-seconds waited for a ring message after that attention "
                                                "(communication not hidden)", registry=r)
        self._server = None

    def count_ring(self, ring_bytes: int, ring_attend_s: float, ring_exposed_s: float) -> None:
        """Add what the prefill ranks' ring counters grew by (services/prefill/server.py)."""
        self.ring_bytes.inc(ring_bytes)
        self.ring_attend_seconds.inc(ring_attend_s)
        self.ring_exposed_seconds.inc(ring_exposed_s)

    def serve(self, host: str, port: int) -> int:
        """Serve ``/metrics`` over HTTP on ``host:port`` (0: a free port); returns the bound port."""
        self._server, _ = start_http_server(port, addr=host, registry=self.registry)
        return self._server.server_port

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
