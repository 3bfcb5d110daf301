"""The decode gRPC service: a DCPDecodeEngine behind `cpserve.decode.Decode` (protos/decode.proto).

One request: ``Reserve`` (rows on every decode rank, token p → rank p mod dcp) → the prefill
service calls ``BeginWrite`` and writes the rows → ``Generate`` commits the reservation and
streams tokens from the second on. Continuous batching comes from the engine's scheduler: the
loop thread (services/common/engine_loop.py) applies queued commands between any two steps, so
requests join and leave the running batch every step.

Streams: the loop thread owns ``_streams`` (sequence id → the request's event queue). Each step's
(sequence, token) pairs go to their queues; a finished sequence gets ``Done`` and leaves the
table; a sequence preempted for want of a page (engine/scheduler.py) gets ``Done(PREEMPTED)``,
and its router resumes it elsewhere. A client that goes away (gRPC callback on RPC end) posts
an abort: the sequence is finished as "abort" and its rows are freed on every rank. If the rank
group fails, every open stream receives an ``Error`` event, later calls get UNAVAILABLE and
health says NOT_SERVING.
"""

from __future__ import annotations

import collections
import logging
import queue
from dataclasses import dataclass
from typing import Callable

import grpc

from engine.decode_engine import DCPDecodeEngine
from engine.model.sampler import InvalidRequest
from engine.scheduler import MAX_FORKS, Sequence, validate_prompt
from kvtransfer.transport import use_port_range
from services.common import rpc
from services.common.config import DecodeConfig
from services.common.convert import (check_cache_salt, destination_to_proto, finish_reason_to_proto, kv_events_to_proto,
                                     logprob_to_proto, sampling_from_proto)
from services.common.engine_loop import EngineLoop
from services.protos import decode_pb2, decode_pb2_grpc

logger = logging.getLogger("cpserve.services")

SERVICE_NAME = "cpserve.decode.Decode"
MAX_WORKERS = 256  # each open Generate stream holds one handler thread
POLL_S = 0.5  # how often a waiting stream handler checks that its client is still there


@dataclass(frozen=True)
class _Snapshot:
    rows_used: int  # per rank (the same on every rank: a page spans page_size rows on each)
    rows_free: int  # per rank, idle cached pages' rows included (reclaimable)
    rows_total: int  # per rank
    rows_filled: tuple[int, ...]  # each rank's own: rows holding a prompt or output token there
    running: int
    reservations: int
    rows_cached: int = 0  # per rank: idle cached pages' rows
    prefix_cache_queries: int = 0  # tokens Reserve looked up
    prefix_cache_hits: int = 0  # tokens it found


def rows_per_rank(num_tokens: int, dcp: int) -> list[int]:
    """Rows a request of ``num_tokens`` tokens fills on each rank: token p lives on rank p mod dcp."""
    return [max(0, (num_tokens - r + dcp - 1) // dcp) for r in range(dcp)]


def _snapshot(engine: DCPDecodeEngine) -> _Snapshot:
    """Rows by state. Forks share their prompt's full pages: those rows count once per
    reservation (``shared``), the rest of each fork's tokens on their own. Cached pages (full,
    whether a request uses them or not) count once each; a request's tokens in them are not
    counted again. Idle cached pages are reclaimable: their rows count as free, not used."""
    alloc, page, dcp = engine.allocator, engine.page_size, engine.dcp
    prefix = engine.scheduler.prefix
    seqs = [*engine.scheduler.running, *engine.scheduler.waiting]
    owned = [len(s.prompt_ids) + len(s.output_ids) - max(s.shared_tokens, s.num_cached) for s in seqs]
    shared = {s.group: s.shared_tokens - s.num_cached for s in seqs if s.group is not None}
    for r in engine.reservations.active.values():
        n_shared = len(r.shared) * engine.reservations.span if r.num_forks > 1 else 0
        shared[r.id] = max(n_shared - r.prefix_tokens, 0)
        if r.state != "forking":  # before its first fork commits, the reservation holds the prompt
            owned.append(r.num_tokens - max(n_shared, r.prefix_tokens))
    cached_pages = prefix.num_cached_pages if prefix is not None else 0
    idle = prefix.num_reclaimable if prefix is not None else 0
    filled = [cached_pages * page] * dcp
    for n in owned + list(shared.values()):  # shared counts are whole pages: a multiple of dcp
        filled = [f + k for f, k in zip(filled, rows_per_rank(n, dcp))]
    return _Snapshot((alloc.num_pages - alloc.num_free - idle) * page, (alloc.num_free + idle) * page,
                     alloc.num_pages * page, tuple(filled), len(seqs), len(engine.reservations.active),
                     idle * page, prefix.queries if prefix is not None else 0, prefix.hits if prefix is not None else 0)


def _token(token: int, seq: Sequence, later: int) -> decode_pb2.GenerateEvent:
    """The event of ``seq``'s token that has ``later`` tokens after it in ``output_ids`` already
    (a step collected early, while a command needed the ranks, is delivered with the next one)."""
    index = len(seq.output_ids) - 1 - later
    event = decode_pb2.GenerateEvent(token=decode_pb2.GenerateEvent.Token(id=token, index=index))
    if seq.params.logprobs is not None and len(seq.logprobs) > later:  # the first token's came from prefill
        event.token.logprob.CopyFrom(logprob_to_proto(seq.logprobs[-1 - later]))
    return event


def _done(seq: Sequence) -> decode_pb2.GenerateEvent:
    return decode_pb2.GenerateEvent(done=decode_pb2.GenerateEvent.Done(
        finish_reason=finish_reason_to_proto(seq.finish_reason), num_tokens=len(seq.output_ids)))


def _error(code: int, message: str) -> decode_pb2.GenerateEvent:
    return decode_pb2.GenerateEvent(error=decode_pb2.GenerateEvent.Error(code=code, message=message))


class DecodeService(decode_pb2_grpc.DecodeServicer):
    def __init__(self, engine: DCPDecodeEngine, config: DecodeConfig, on_failure: Callable[[str], None]):
        self.config = config
        self.address = ""  # host:port, set once bound; goes into every KvDestination
        self.cfg = engine.cfg  # immutable: handlers validate against it without the loop
        self._streams: dict[int, tuple[Sequence, queue.SimpleQueue]] = {}  # loop thread only
        self._on_failure = on_failure
        self.restart(engine)

    def restart(self, engine: DCPDecodeEngine) -> None:
        """Serve with ``engine`` (at start, and after a rebuild of a failed rank group: the old
        loop has ended, its streams and reservations with it)."""
        self._streams = {}
        self.engine = engine
        self.loop = EngineLoop(engine, "decode", self.config.max_queue, on_failure=self._failed,
                               has_work=lambda e: e.has_work, tick=self._step,
                               idle=lambda e: e.reservations.expire(), snapshot=_snapshot)
        # Reserve, BeginWrite, EndWrite and new streams run while the ranks compute a step, not
        # after it (a prefill service's hand-off waits on BeginWrite)
        engine.while_ranks_compute = self.loop.serve_until

    # ---- loop thread ------------------------------------------------------------------------
    def _step(self, engine: DCPDecodeEngine) -> None:
        events = engine.step()
        later = collections.Counter(seq.id for seq, _ in events)  # a sequence may have two steps' tokens here
        for seq, token in events:
            later[seq.id] -= 1
            entry = self._streams.get(seq.id)
            if entry is None:
                continue
            entry[1].put(_token(token, seq, later[seq.id]))
            if seq.is_finished and not later[seq.id]:
                del self._streams[seq.id]
                entry[1].put(_done(seq))
        for seq in engine.scheduler.take_preempted():  # out of rows: their router resumes them elsewhere
            entry = self._streams.pop(seq.id, None)
            if entry is not None:
                entry[1].put(_done(seq))
                logger.info("decode: sequence %d preempted after %d tokens (no free page)", seq.id,
                            len(seq.output_ids))

    def _commit(self, engine: DCPDecodeEngine, req: decode_pb2.GenerateRequest, params, events) -> int:
        seq = engine.commit(req.reservation_id, list(req.prompt_ids), params, req.seed, req.first_token,
                            list(req.output_ids), req.fork)
        if seq.is_finished:  # the first token (from prefill) already ended it
            events.put(_done(seq))
        else:
            self._streams[seq.id] = (seq, events)
        return seq.id

    def _cancel(self, engine: DCPDecodeEngine, seq_id: int) -> None:
        entry = self._streams.pop(seq_id, None)
        if entry is not None and not entry[0].is_finished:
            engine.abort(entry[0])
            logger.info("decode: client went away; aborted sequence %d, rows freed", seq_id)

    def _failed(self, message: str) -> None:
        self._on_failure(message)
        self._end_streams(decode_pb2.ERROR_CODE_UNAVAILABLE, message)

    def _end_streams(self, code: int, message: str) -> None:
        streams, self._streams = self._streams, {}
        for _, events in streams.values():
            events.put(_error(code, message))

    def stop(self) -> None:
        self.loop.stop()
        self._end_streams(decode_pb2.ERROR_CODE_UNAVAILABLE, "decode service stopping")

    # ---- handlers ---------------------------------------------------------------------------
    def Reserve(self, request, context):
        try:
            if request.num_tokens < 1:
                raise InvalidRequest("num_tokens", f"must be >= 1, got {request.num_tokens}")
            if request.max_new_tokens < 1:
                raise InvalidRequest("max_new_tokens", f"must be >= 1, got {request.max_new_tokens}")
            num_forks = max(request.num_forks, 1)
            if num_forks > MAX_FORKS:
                raise InvalidRequest("num_forks", f"must be at most {MAX_FORKS}, got {num_forks}")
            total, limit = request.num_tokens + request.max_new_tokens, self.cfg.max_position_embeddings
            if total > limit:
                raise InvalidRequest("max_new_tokens", f"num_tokens plus max_new_tokens is {total}; the model "
                                                       f"has {limit} positions")
            tokens = list(request.prompt_ids)
            if tokens and len(tokens) != request.num_tokens:
                raise InvalidRequest("prompt_ids", f"{len(tokens)} tokens, but num_tokens is {request.num_tokens}")
            bad = [t for t in tokens if t >= self.cfg.vocab_size]
            if bad:
                raise InvalidRequest("prompt_ids", f"token id {bad[0]} is outside the vocabulary [0, "
                                                   f"{self.cfg.vocab_size})")
            salt = check_cache_salt(request.cache_salt)
            dest = self.loop.call(lambda e: e.reserve(request.num_tokens, request.max_new_tokens, num_forks, tokens,
                                                      salt), admit=True)
        except Exception as e:
            rpc.abort(context, e)
        logger.debug("decode: reserved %s for request %r", dest.reservation_id, request.request_id)
        return destination_to_proto(dest, self.address)

    def _on_loop(self, context, fn):
        """``fn(engine)`` on the engine thread; its error becomes the call's gRPC status."""
        try:
            return self.loop.call(fn)
        except Exception as e:
            rpc.abort(context, e)

    def BeginWrite(self, request, context):
        return decode_pb2.BeginWriteResponse(lease_s=self._on_loop(context,
                                                                   lambda e: e.begin_write(request.reservation_id)))

    def EndWrite(self, request, context):
        return decode_pb2.EndWriteResponse(found=self._on_loop(context, lambda e: e.end_write(request.reservation_id)))

    def Abort(self, request, context):
        fork = request.fork if request.HasField("fork") else None
        return decode_pb2.AbortResponse(freed=self._on_loop(context,
                                                            lambda e: e.abort_reservation(request.reservation_id, fork)))

    def Generate(self, request, context):
        events: queue.SimpleQueue = queue.SimpleQueue()
        try:
            if not request.reservation_id:
                raise InvalidRequest("reservation_id", "must not be empty")
            params = sampling_from_proto(request.sampling, self.cfg.eos_token_ids)
            validate_prompt(list(request.prompt_ids), params, self.cfg.vocab_size, self.cfg.max_position_embeddings,
                            list(request.output_ids))
            if request.first_token >= self.cfg.vocab_size:
                raise InvalidRequest("first_token", f"token id {request.first_token} is outside the vocabulary "
                                                    f"[0, {self.cfg.vocab_size})")
            seq_id = self.loop.call(lambda e: self._commit(e, request, params, events), admit=True)
        except Exception as e:
            rpc.abort(context, e)
        if not context.add_callback(lambda: self.loop.post(lambda e: self._cancel(e, seq_id))):
            self.loop.post(lambda e: self._cancel(e, seq_id))  # the RPC has already ended
            return
        while True:
            try:
                event = events.get(timeout=POLL_S)
            except queue.Empty:
                if not context.is_active():
                    return
                continue
            yield event
            if event.WhichOneof("event") != "token":
                return

    def metrics_state(self) -> dict:
        """What /metrics reports (services/common/service_metrics.py), from the loop's snapshot."""
        s, dcp = self.loop.snapshot, self.config.dcp
        return {"rows_used": [s.rows_used] * dcp, "rows_free": [s.rows_free] * dcp, "rows_filled": list(s.rows_filled),
                "rows_cached": [s.rows_cached] * dcp, "prefix_cache_queries": s.prefix_cache_queries,
                "prefix_cache_hits": s.prefix_cache_hits,
                "queue_depth": self.loop.queue_depth, "serving": int(self.loop.failure is None)}

    def KvEvents(self, request, context):
        prefix = self.engine.scheduler.prefix
        return kv_events_to_proto(prefix.events if prefix is not None else None, request)

    def Status(self, request, context):
        s = self.loop.snapshot
        dcp = self.config.dcp
        return decode_pb2.DecodeStatus(model=self.config.model, dcp=dcp, rows_used=[s.rows_used] * dcp,
                                       rows_free=[s.rows_free] * dcp, rows_total=[s.rows_total] * dcp,
                                       rows_filled=list(s.rows_filled),
                                       running=s.running,
                                       reservations=s.reservations, queue_depth=self.loop.queue_depth,
                                       serving=self.loop.failure is None, rows_cached=[s.rows_cached] * dcp,
                                       prefix_cache_queries=s.prefix_cache_queries,
                                       prefix_cache_hits=s.prefix_cache_hits)


def serve_decode(config: DecodeConfig, engine: DCPDecodeEngine | None = None):
    """Start the decode service in this process; return ``(server, bound_port, shutdown)``.

    Starts the DCP rank group (seconds), binds ``config.host:config.port`` (0: a free port),
    and marks health SERVING. ``shutdown()`` is idempotent: health NOT_SERVING, open streams end
    with an UNAVAILABLE error event, the server stops, the rank group exits. ``engine`` lets a
    caller supply a ready engine (tests); it is closed by ``shutdown`` all the same."""
    plane = rpc.service_plane(config)  # a bad credentials file fails before the model loads
    use_port_range(config.kv_port_range)  # before the rank processes start their engines
    make_engine = None if engine is not None else (lambda: DCPDecodeEngine(**config.engine_kwargs))
    engine = engine or make_engine()
    service, server, port, service_address, shutdown = rpc.serve_engine(
        "decode", engine, lambda on_failure: DecodeService(engine, config, on_failure=on_failure),
        decode_pb2_grpc.add_DecodeServicer_to_server, SERVICE_NAME, config, MAX_WORKERS,
        f"dcp={config.dcp}, {config.dcp_comm}, {config.indexer} index, model {config.model}, dtype {engine.dtype}",
        plane, make_engine)
    service.address = service_address
    return server, port, shutdown
