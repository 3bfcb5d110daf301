"""The router's Prometheus metrics, in a registry of its own (several routers may share a
process, e.g. in tests).

Latency histograms are observed by the completion runner (what the client sees); service
gauges by the health monitor (from each service's Status); transfer counters by the dispatcher
(from each PrefillResponse).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from services.router.stages import TTFT_STAGES

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_STAGE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)

OUTCOMES = ("ok", "invalid", "unauthorized", "overloaded", "unavailable", "error", "cancelled")


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram("cpserve_router_ttft_seconds", "Time to first token, request arrival to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft_stage = Histogram("cpserve_router_ttft_stage_seconds",
                                    "Time to first token by stage (services/router/stages.py); the stages of a "
                                    "request add up to its TTFT", ["stage"], buckets=_STAGE_BUCKETS, registry=r)
        for stage in TTFT_STAGES:
            self.ttft_stage.labels(stage)
        self.tpot = Histogram("cpserve_router_tpot_seconds", "Time per output token after the first, per request",
                              buckets=_TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("cpserve_router_e2e_seconds", "End-to-end request latency",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.in_flight = Gauge("cpserve_router_in_flight_requests", "Requests the router is working on", registry=r)
        self.requests = Counter("cpserve_router_requests", "Finished requests by outcome", ["status"], registry=r)
        self.retries = Counter("cpserve_router_retries", "Requests moved to another pair before the first token",
                               registry=r)
        self.healthy = Gauge("cpserve_service_healthy", "1 if the service passes health checks",
                             ["kind", "service"], registry=r)
        self.queue_depth = Gauge("cpserve_service_queue_depth", "Requests or commands waiting in the service",
                                 ["kind", "service"], registry=r)
        self.rows_used = Gauge("cpserve_decode_cache_rows_used", "Cache rows in use per decode rank",
                               ["service", "rank"], registry=r)
        self.rows_free = Gauge("cpserve_decode_cache_rows_free", "Free cache rows per decode rank",
                               ["service", "rank"], registry=r)
        self.transfer_bytes = Counter("cpserve_kv_transfer_bytes", "KV bytes moved from prefill to decode",
                                      registry=r)
        self.transfer_seconds = Counter("cpserve_kv_transfer_seconds",
                                        "Seconds prefill ranks spent in KV writes (the slowest rank's, summed "
                                        "over requests; compute excluded)", registry=r)
        self.prefix_cached_tokens = Counter("cpserve_prefix_cached_tokens",
                                            "Prompt tokens the prefill services took from their prefix cache",
                                            registry=r)
        for outcome in OUTCOMES:
            self.requests.labels(outcome)  # every outcome is exported from the start, at 0

    def render(self) -> bytes:
        return generate_latest(self.registry)
