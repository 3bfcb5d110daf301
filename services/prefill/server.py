"""The prefill gRPC service: a CPPrefillEngine behind `cpserve.prefill.Prefill` (protos/prefill.proto).

``Prefill(prompt, sampling, destination)``: the handler checks the request and the destination's
layout fingerprint (a mismatch is refused before the request is even queued), then queues it
for the loop thread (services/common/engine_loop.py), which runs one prefill at a time:
CP prefill → first token → ``BeginWrite`` on the decode service named in the destination (it
may refuse: expired or unknown reservation) → every prefill rank writes its rows straight into
the reserved decode rows. The answer carries the first token and the seed for
``Decode.Generate``. The queue is bounded (``max_queue``): a full queue answers
RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import grpc

from engine.model.sampler import InvalidRequest
from engine.prefill_engine import CPPrefillEngine
from engine.scheduler import MAX_FORKS, validate_prompt
from engine.handoff import KvDestination, ReservationError, check_fingerprint
from kvtransfer.transport import TransferError, use_port_range
from services.common import rpc
from services.common.rpc import ServiceUnavailable
from services.common.security import InternalPlane
from services.common.config import PrefillConfig
from services.common.convert import (check_cache_salt, destination_from_proto, kv_events_to_proto, logprob_to_proto,
                                     sampling_from_proto)
from services.common.engine_loop import EngineLoop
from services.protos import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

logger = logging.getLogger("cpserve.services")

SERVICE_NAME = "cpserve.prefill.Prefill"
BEGIN_WRITE_TIMEOUT_S = 5.0
# BeginWrite answers that mean "this reservation cannot be written" (→ FAILED_PRECONDITION to
# our client); any other failure means the decode service is unreachable (→ UNAVAILABLE).
_REFUSALS = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND)


def _snapshot(engine: CPPrefillEngine) -> tuple[int, int, int, int, int]:
    """(rows used, rows free, rows of idle cached pages, prefix-cache queries, hits in tokens);
    every CP rank keeps the same rows (layer split: for its layers). Idle cached pages are
    reclaimable: their rows count as free."""
    alloc, page, prefix = engine.allocator, engine.scheduler.page_size, engine.scheduler.prefix
    idle = prefix.num_reclaimable if prefix is not None else 0
    return ((alloc.num_pages - alloc.num_free - idle) * page, (alloc.num_free + idle) * page, idle * page,
            prefix.queries if prefix is not None else 0, prefix.hits if prefix is not None else 0)


def _write_seconds(stats: list[dict]) -> float:
    """Time spent in KV writes: each rank reports the seconds its pushes took (with layer-wise
    overlap, the sum over its per-layer pushes, which ran beside the compute); ranks write in
    parallel, so the slowest rank's."""
    return max((r.get("seconds", 0.0) for r in stats), default=0.0)


class DecodePeers:
    """gRPC channels to decode services, by address (loop thread only)."""

    def __init__(self, plane: InternalPlane):
        self.plane = plane
        self.channels: dict[str, grpc.Channel] = {}

    def begin_write(self, address: str, reservation_id: str) -> float:
        """Claim (or renew) the write lease of ``reservation_id`` on decode ``address``; returns
        the lease in seconds. A refusal is a ReservationError: write nothing."""
        channel = self.channels.get(address)
        if channel is None:
            channel = self.channels[address] = self.plane.channel(address, rpc.CHANNEL_OPTIONS)
        stub = decode_pb2_grpc.DecodeStub(channel)
        try:
            return stub.BeginWrite(decode_pb2.ReservationRef(reservation_id=reservation_id),
                                   timeout=BEGIN_WRITE_TIMEOUT_S).lease_s
        except grpc.RpcError as e:
            if e.code() in _REFUSALS:
                raise ReservationError(f"BeginWrite refused by decode {address}: {e.details()}") from None
            raise TransferError(address, f"BeginWrite: {e.code().name}: {e.details()}") from None

    def end_write(self, address: str, reservation_id: str) -> None:
        """Tell decode that every write for ``reservation_id`` has completed or failed (it frees
        the rows of an aborted reservation only then). Best effort: if decode cannot be told,
        its write lease frees them."""
        channel = self.channels.get(address)
        if channel is None:
            return  # no BeginWrite went to it: nothing was written
        try:
            decode_pb2_grpc.DecodeStub(channel).EndWrite(decode_pb2.ReservationRef(reservation_id=reservation_id),
                                                         timeout=BEGIN_WRITE_TIMEOUT_S)
        except grpc.RpcError as e:
            logger.warning("EndWrite of %s to decode %s failed (%s: %s); its write lease will free the rows",
                           reservation_id, address, e.code().name, e.details())

    def close(self) -> None:
        for channel in self.channels.values():
            channel.close()
        self.channels.clear()


def _tick(engine: CPPrefillEngine) -> bool:
    """The write-lease heartbeats that are due, one forward over every queued prefill (batched
    by the scheduler), then the hand-offs; whether any request was handed off."""
    engine.renew_leases()
    if engine.has_work:
        engine.step()
    return bool(engine.finish_ready())


RING_COUNTERS = ("ring_bytes", "ring_attend_s", "ring_exposed_s")  # of the ranks' stats (prefill_cp.RING_STATS)


def _fail_pending(engine: CPPrefillEngine, message: str) -> None:
    """The engine thread ends (rank group failed, or shutdown): no queued prefill is left waiting."""
    for p in list(engine.pending):
        engine.pending.remove(p)
        if not p.future.done():
            p.future.set_exception(ServiceUnavailable(message))


class PrefillService(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, engine: CPPrefillEngine, config: PrefillConfig, on_failure: Callable[[str], None],
                 plane: InternalPlane | None = None):
        self.engine, self.config = engine, config
        self.cfg, self.fingerprint = engine.cfg, engine.fingerprint  # immutable: read by handlers
        self.peers = DecodePeers(plane or InternalPlane())
        self._on_failure = on_failure
        self.metrics = None  # ServiceMetrics, set by serve_engine when metrics_port is given
        self.restart(engine)

    def restart(self, engine: CPPrefillEngine) -> None:
        """Serve with ``engine`` (at start, and after a rebuild of a failed rank group: its new
        ranks have new transfer engines, so no session of the old group is reused)."""
        self.engine = engine
        self._ring_seen = dict.fromkeys(RING_COUNTERS, 0)  # a new group's ranks count from zero
        self.loop = EngineLoop(engine, "prefill", self.config.max_queue, on_failure=self._on_failure,
                               snapshot=_snapshot, has_work=lambda e: e.has_work or bool(e.pending), tick=self._tick,
                               on_stop=_fail_pending)

    def _tick(self, engine: CPPrefillEngine) -> None:
        """:func:`_tick`; with ring CP attention and /metrics, then the ranks' ring counters after
        each tick that handed requests off (one stats call to the group, between forwards)."""
        if not _tick(engine) or self.metrics is None or not engine.sharded:
            return
        stats = engine.group.call("stats")
        totals = {k: sum(s[k] for s in stats) for k in RING_COUNTERS}
        self.metrics.count_ring(**{k: totals[k] - self._ring_seen[k] for k in RING_COUNTERS})
        self._ring_seen = totals

    def _prefill(self, engine: CPPrefillEngine, prompt: list[int], params, dest: KvDestination, address: str,
                 is_active: Callable[[], bool], output_ids: list[int], num_forks: int, cache_salt: str):
        """Runs on the engine thread: queue the request into the engine; the loop's ticks batch
        every queued prefill into the same forwards and hand each off when its prompt is done."""
        if not is_active():
            raise ReservationError("the client went away before its prefill started")
        rid = dest.reservation_id
        # Claim the rows now, as the group starts the request (not after its compute): the
        # lease is then renewed per chunk (renew) and right before the write (before_write).
        lease_s = self.peers.begin_write(address, rid) or 60.0

        def renew() -> None:
            self.peers.begin_write(address, rid)

        def before_write() -> None:
            if not is_active():
                raise ReservationError("the client went away during its prefill")
            self.peers.begin_write(address, rid)

        def after_write() -> None:
            self.peers.end_write(address, rid)

        try:
            pending = engine.submit_prefill(prompt, params, dest, before_write=before_write, after_write=after_write,
                                            output_ids=output_ids, num_forks=num_forks, cache_salt=cache_salt)
        except BaseException:
            after_write()  # claimed, nothing written: decode may free the rows
            raise
        pending.cleared = True  # claimed: EndWrite is owed however the request ends
        pending.renew, pending.renew_every_s, pending.is_active = renew, lease_s / 4, is_active
        pending.queued_at = time.perf_counter()
        return pending

    def Prefill(self, request, context):
        try:
            prompt, outputs = list(request.prompt_ids), list(request.output_ids)
            params = sampling_from_proto(request.sampling, self.cfg.eos_token_ids)
            validate_prompt(prompt, params, self.cfg.vocab_size, self.cfg.max_position_embeddings, outputs)
            num_forks = max(request.num_forks, 1)
            if num_forks > MAX_FORKS:
                raise InvalidRequest("num_forks", f"must be at most {MAX_FORKS}, got {num_forks}")
            if num_forks > 1 and outputs:
                raise InvalidRequest("num_forks", "a resumed generation (output_ids) is one fork")
            if not request.HasField("destination"):
                raise InvalidRequest("destination", "is missing")
            dest = destination_from_proto(request.destination)
            check_fingerprint(self.fingerprint, dest.fingerprint)
            dest.validate_for(len(prompt) + len(outputs))
            salt = check_cache_salt(request.cache_salt)
            arrived = time.perf_counter()
            fut = self.loop.submit(lambda e: self._prefill(e, prompt, params, dest, request.destination.decode_address,
                                                           context.is_active, outputs, num_forks, salt), admit=True)
            pending = fut.result()
            queued = pending.queued_at
            seq = pending.future.result()
            stats = pending.transfer_stats or []
            computed, written = pending.computed_at, pending.written_at
            response = prefill_pb2.PrefillResponse(
                seed=seq.seed, prefill_ms=(computed - queued) * 1e3,
                transfer_bytes=sum(r["bytes"] for r in stats), transfer_ms=_write_seconds(stats) * 1e3,
                cached_tokens=seq.num_cached, queue_ms=(queued - arrived) * 1e3, compute_ms=(computed - queued) * 1e3,
                handoff_ms=(written - computed) * 1e3, service_ms=(time.perf_counter() - arrived) * 1e3,
                prompt_logprobs=[logprob_to_proto(lp) for lp in seq.prompt_logprobs()],
                forks=[prefill_pb2.ForkStart(token=token, seed=seed, logprob=lp and logprob_to_proto(lp))
                       for token, seed, lp in seq.fork_starts], decode_cached_tokens=dest.prefix)
            response.first_token = seq.output_ids[len(outputs)]
            if seq.logprobs:
                response.first_logprob.CopyFrom(logprob_to_proto(seq.logprobs[0]))
            if self.metrics is not None:
                self.metrics.requests.inc()
                self.metrics.transfer_bytes.inc(response.transfer_bytes)
                self.metrics.transfer_seconds.inc(response.transfer_ms / 1e3)
        except Exception as e:
            rpc.abort(context, e)
        logger.debug("prefill: request %r → first token %d", request.request_id, response.first_token)
        return response

    def metrics_state(self) -> dict:
        """What /metrics reports: every CP rank keeps the same number of rows (layer split: for
        its layers; ring: its 1/C share of each request, a page being page_size rows on each)."""
        used, free, cached, queries, hits = self.loop.snapshot
        cp = self.config.cp
        return {"rows_used": [used] * cp, "rows_free": [free] * cp, "rows_cached": [cached] * cp,
                "prefix_cache_queries": queries, "prefix_cache_hits": hits, "queue_depth": self.loop.queue_depth,
                "serving": int(self.loop.failure is None)}

    def Status(self, request, context):
        used, free, cached, queries, hits = self.loop.snapshot
        return prefill_pb2.ServiceStatus(model=self.config.model, cp=self.config.cp, queue_depth=self.loop.queue_depth,
                                         rows_used=used, rows_free=free, serving=self.loop.failure is None,
                                         rows_cached=cached, prefix_cache_queries=queries, prefix_cache_hits=hits)

    def KvEvents(self, request, context):
        prefix = self.engine.scheduler.prefix
        return kv_events_to_proto(prefix.events if prefix is not None else None, request)

    def stop(self) -> None:
        self.loop.stop()
        self.peers.close()


def serve_prefill(config: PrefillConfig, engine: CPPrefillEngine | None = None):
    """Start the prefill service in this process; return ``(server, bound_port, shutdown)``.

    Starts the CP rank group (seconds), binds ``config.host:config.port`` (0: a free port), and
    marks health SERVING. ``shutdown()`` is idempotent: health NOT_SERVING, queued requests fail
    UNAVAILABLE, the server stops, the rank group exits."""
    plane = rpc.service_plane(config)  # a bad credentials file fails before the model loads
    use_port_range(config.kv_port_range)  # before the rank processes start their engines
    make_engine = None if engine is not None else (lambda: CPPrefillEngine(**config.engine_kwargs))
    engine = engine or make_engine()
    _, server, port, _, shutdown = rpc.serve_engine(
        "prefill", engine, lambda on_failure: PrefillService(engine, config, on_failure=on_failure, plane=plane),
        prefill_pb2_grpc.add_PrefillServicer_to_server, SERVICE_NAME, config, config.max_queue + 16,
        f"cp={config.cp}, {config.strategy}{', layer split' if config.layer_split else ''}, "
        f"{config.cp_attention} attention{f' ({config.cp_ring_mode})' if config.cp_attention == 'ring' else ''}, "
        f"model {config.model}, "
        f"dtype {engine.dtype}", plane, make_engine)
    return server, port, shutdown
