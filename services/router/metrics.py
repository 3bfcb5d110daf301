"""The router's Prometheus metrics, in a registry of its own (several routers may share a
process, e.g. in tests).

Two families:

- vLLM's names under a ``cpserve:`` prefix, labelled ``model_name`` (the served model name), for
  dashboards and autoscalers written against vLLM (definitions for the disaggregated path in
  the README, "The HTTP API (router)"): TTFT, inter-token latency, end-to-end latency, queue time,
  prompt/generation token counters, finished requests by reason, requests running/waiting, KV
  cache usage of the decode services, prefix-cache queries and hits (tokens), preemptions;
- ``cpserve_*``: the router's own (outcomes, retries, the TTFT stages, per-service health, queue
  depth and decode rows per rank, KV transfer, pairing decisions by reason, tokens decode
  already held). ``cpserve_router_ttft_seconds``,
  ``_tpot_seconds`` and ``_e2e_seconds`` stay for bench/serving.py and the tests that read them.

Request metrics are observed by the completion runner (what the client sees, per choice);
service gauges by the health monitor, from each service's Status, on every poll and again
before every scrape (``before_scrape``), so rows freed by finished requests show at once;
transfer and cache counters and pairing decisions by the dispatcher (from each
PrefillResponse; a decision once its Reserve succeeded).
"""

from __future__ import annotations

import collections

from typing import Awaitable, Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from services.router.pairing import REASONS
from services.router.stages import TTFT_STAGES

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_STAGE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)

OUTCOMES = ("ok", "invalid", "unauthorized", "overloaded", "unavailable", "error", "cancelled")
FINISHED_REASONS = ("stop", "length", "abort")  # vLLM's; abort: the client went away


class RouterMetrics:
    RECENT = 2048  # per-request TTFT breakdowns kept for GET /debug/ttft

    def __init__(self, model_name: str = "") -> None:
        r = self.registry = CollectorRegistry()
        self.model_name = model_name
        self.before_scrape: list[Callable[[], Awaitable[None]]] = []  # refresh the service gauges
        # the last RECENT requests' TTFT, its stages and cache figures, oldest first: {"id", "ttft_ms",
        # "stages_ms", "cached_tokens", "decode_cached_tokens", "transfer_bytes"} (completion.py)
        self.recent_ttft: collections.deque[dict] = collections.deque(maxlen=self.RECENT)

        # ---- vLLM's names, per served model -------------------------------------------------
        def per_model(kind, name: str, doc: str, **kw):
            return kind(f"cpserve:{name}", doc, ["model_name"], registry=r, **kw).labels(model_name)

        self.time_to_first_token = per_model(Histogram, "time_to_first_token_seconds",
                                             "Time to first token: arrival at the router to the first token",
                                             buckets=_LATENCY_BUCKETS)
        self.inter_token_latency = per_model(Histogram, "inter_token_latency_seconds",
                                             "Every gap between two consecutive tokens of a request",
                                             buckets=_TOKEN_BUCKETS)
        self.e2e_request_latency = per_model(Histogram, "e2e_request_latency_seconds",
                                             "Arrival at the router to the last token", buckets=_LATENCY_BUCKETS)
        self.request_queue_time = per_model(Histogram, "request_queue_time_seconds",
                                            "Arrival to the prefill engine taking the request (TTFT stages parse, "
                                            "reserve and prefill_queue)", buckets=_LATENCY_BUCKETS)
        self.prompt_tokens = per_model(Counter, "prompt_tokens", "Prompt tokens prefilled (each choice its own)")
        self.generation_tokens = per_model(Counter, "generation_tokens", "Tokens generated")
        self.request_success = Counter("cpserve:request_success", "Finished requests (choices) by finish reason",
                                       ["model_name", "finished_reason"], registry=r)
        for reason in FINISHED_REASONS:
            self.request_success.labels(model_name, reason)
        self.num_requests_running = per_model(Gauge, "num_requests_running",
                                              "Requests streaming tokens from decode (after the first token)")
        self.num_requests_waiting = per_model(Gauge, "num_requests_waiting",
                                              "Requests before their first token (reserving, queued or prefilling)")
        self.kv_cache_usage_perc = per_model(Gauge, "kv_cache_usage_perc",
                                             "Fraction of the healthy decode services' cache rows in use (0..1)")
        self.prefix_cache_queries = per_model(Counter, "prefix_cache_queries",
                                              "Prompt tokens looked up in the prefill prefix caches")
        self.prefix_cache_hits = per_model(Counter, "prefix_cache_hits",
                                           "Prompt tokens found in the prefill prefix caches")
        self.preemptions = per_model(Counter, "num_preemptions",
                                     "Generations preempted on decode for want of cache rows (each then resumed)")

        # ---- the router's own -----------------------------------------------------------------
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
        self.decode_cached_tokens = Counter("cpserve_router_decode_cached_tokens",
                                            "Prompt tokens the decode services already held (prefill did not send "
                                            "them)", registry=r)
        self.pairing_decisions = Counter("cpserve_router_pairing_decisions",
                                         "Pairs chosen, by what decided (services/router/pairing.py): prefix, "
                                         "affinity, load, balance", ["reason"], registry=r)
        for reason in REASONS:
            self.pairing_decisions.labels(reason)
        self.paired = Counter("cpserve_service_paired_requests",
                              "Requests paired with the service (a successful Reserve; retries count again)",
                              ["kind", "service"], registry=r)
        self.loop_lag = Histogram("cpserve_router_event_loop_lag_seconds",
                                  "How late the router's event loop ran a callback due at a known time (sampled "
                                  "every 20 ms): what every stream's next token waited behind other work",
                                  buckets=_LAG_BUCKETS, registry=r)
        for outcome in OUTCOMES:
            self.requests.labels(outcome)  # every outcome is exported from the start, at 0

    async def refresh(self) -> None:
        """Bring the service gauges up to date (before a scrape)."""
        for refresh in self.before_scrape:
            await refresh()

    def render(self) -> bytes:
        return generate_latest(self.registry)
