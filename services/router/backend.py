"""How the router talks to one prefill or one decode service.

Two small interfaces, one implementation each over grpc.aio (tests substitute in-process fakes):

- :class:`PrefillClient` — ``prefill`` (prompt + an opaque KV destination → first token),
  ``status``, ``check_health``, ``kv_events``;
- :class:`DecodeClient` — ``reserve`` (→ :class:`Reservation`, whose ``destination`` the router
  copies into the prefill call without opening it), ``generate`` (one fork's tokens from the
  second on), ``abort`` (the reservation, or one fork of it), ``status``, ``check_health``,
  ``kv_events``.

``kv_events`` (protos/common.proto ``KvEvents``: the blocks the service's cache stores and
evicts, for the router's prefix index) answers None where the service keeps no index (a
service that answers UNIMPLEMENTED, or a client without the call).

A :class:`Job` with ``num_forks`` n is n samples of one prompt: one reservation and one prefill,
then one ``generate`` per fork. A job with ``output_ids`` resumes a preempted generation.

Every failure is a :class:`BackendError` carrying a gRPC status code; the dispatcher decides
what to retry.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, AsyncIterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.rpc import CHANNEL_OPTIONS
from services.common.security import InternalPlane
from services.protos import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

# Codes that say nothing about the pair: the same request fails the same way anywhere.
_FINAL_CODES = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.CANCELLED,
                          grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAUTHENTICATED,
                          grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.OUT_OF_RANGE})


class BackendError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str, service: str = ""):
        super().__init__(f"{service}: {message}" if service else message)
        self.code, self.message, self.service = code, message, service

    @property
    def retryable(self) -> bool:
        """Worth trying on another pair (only ever before the first token)."""
        return self.code not in _FINAL_CODES


@dataclass(frozen=True)
class Job:
    """One generation (or ``num_forks`` of one prompt) as the backends see it: token ids in,
    token ids out. ``output_ids``: a resumed generation's tokens so far (prefilled after the
    prompt; the next token comes back first). ``cache_salt``: jobs with different salts never
    share cached rows ("": no salt). ``affinity``: the client's name for a conversation
    (``prompt_cache_key``, else ``user``): a pairing hint, never sent to a service."""

    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: common_pb2.Sampling
    num_forks: int = 1
    output_ids: tuple[int, ...] = ()
    cache_salt: str = ""
    affinity: str = ""

    @property
    def num_tokens(self) -> int:
        """Tokens the reservation holds: the prompt and a resumed generation's output so far."""
        return len(self.prompt_ids) + len(self.output_ids)


@dataclass(frozen=True)
class Reservation:
    id: str
    destination: Any  # kv_pb2.KvDestination for gRPC; opaque to the router


@dataclass(frozen=True)
class ForkStart:
    """Fork j's first token (j >= 1), drawn by prefill from the same logits with seed + j."""

    token: int
    seed: int
    logprob: Any = None


@dataclass(frozen=True)
class FirstToken:
    token: int  # fork 0's
    seed: int
    prefill_ms: float = 0.0
    transfer_bytes: int = 0
    transfer_ms: float = 0.0
    cached_tokens: int = 0  # prompt tokens the prefill service took from its prefix cache
    # the service's own account of its time (PrefillResponse), for the TTFT breakdown
    queue_ms: float = 0.0
    compute_ms: float = 0.0
    handoff_ms: float = 0.0
    logprob: Any = None  # common_pb2.TokenLogprob of the token, when asked for
    prompt_logprobs: tuple = ()  # common_pb2.TokenLogprob of prompt tokens 1.., when asked for
    forks: tuple[ForkStart, ...] = ()  # forks 1 .. num_forks - 1
    decode_cached_tokens: int = 0  # leading tokens the decode service already held (prefill did not send them)

    def fork(self, j: int) -> ForkStart:
        return ForkStart(self.token, self.seed, self.logprob) if j == 0 else self.forks[j - 1]


@dataclass(frozen=True)
class Token:
    id: int
    index: int  # among generated tokens; the prefill's first is 0
    cached_tokens: int = 0  # on the first token: prompt tokens the prefill prefix cache held
    logprob: Any = None  # common_pb2.TokenLogprob (.logprob, .top_ids, .top_logprobs), when asked for
    prompt_logprobs: tuple = ()  # on the first token, with echo / prompt logprobs
    decode_cached_tokens: int = 0  # on the first token: prompt tokens decode's cache held (not sent)
    transfer_bytes: int = 0  # on the first token: KV bytes prefill sent to decode


@dataclass(frozen=True)
class Done:
    finish_reason: str  # "stop" | "length" | "preempted" (decode ran out of rows: the dispatcher resumes it)
    num_tokens: int  # generated in total, the first included
    cached_tokens: int = 0  # prompt tokens served from the prefill prefix cache


@dataclass(frozen=True)
class PrefillLoad:
    queue_depth: int
    serving: bool = True


@dataclass(frozen=True)
class DecodeLoad:
    rows_used: tuple[int, ...]  # per rank
    rows_free: tuple[int, ...]
    queue_depth: int
    serving: bool = True
    rows_total: tuple[int, ...] = ()  # per rank

    @property
    def capacity_tokens(self) -> int:
        """Token p uses one row on rank p mod C, so the cache holds the rows of all ranks."""
        return sum(self.rows_total) if self.rows_total else sum(self.rows_used) + sum(self.rows_free)


class PrefillClient(ABC):
    address: str

    @abstractmethod
    async def prefill(self, job: Job, destination: Any, timeout: float) -> FirstToken: ...

    @abstractmethod
    async def status(self, timeout: float) -> PrefillLoad: ...

    @abstractmethod
    async def check_health(self, timeout: float) -> bool:
        """True if the service says SERVING (grpc.health.v1); BackendError if unreachable."""

    async def kv_events(self, incarnation: str, after: int, timeout: float) -> common_pb2.KvEvents | None:
        """The cache's events after ``after`` of ``incarnation`` (or a snapshot); None: no index."""
        return None

    async def close(self) -> None:
        pass


class DecodeClient(ABC):
    address: str

    @abstractmethod
    async def reserve(self, job: Job, timeout: float) -> Reservation: ...

    @abstractmethod
    def generate(self, job: Job, reservation: Reservation, start: ForkStart, timeout: float,
                 fork: int = 0) -> AsyncIterator[Token | Done]:
        """Fork ``fork``'s tokens after ``start`` (its first), then one Done. Closing the
        iterator early cancels the stream (the service then frees the rows)."""

    @abstractmethod
    async def abort(self, reservation: Reservation, timeout: float, fork: int | None = None) -> None:
        """Release the reservation (``fork``: that fork only); a no-op once committed."""

    @abstractmethod
    async def status(self, timeout: float) -> DecodeLoad: ...

    @abstractmethod
    async def check_health(self, timeout: float) -> bool: ...

    async def kv_events(self, incarnation: str, after: int, timeout: float) -> common_pb2.KvEvents | None:
        """As :meth:`PrefillClient.kv_events`."""
        return None

    async def close(self) -> None:
        pass


# ---- gRPC -----------------------------------------------------------------------------------
def _error(e: grpc.aio.AioRpcError, address: str) -> BackendError:
    return BackendError(e.code(), e.details() or e.code().name, address)


class _GrpcService:
    def __init__(self, address: str, plane: InternalPlane | None = None):
        self.address = address
        # the internal plane's TLS and token; never through an HTTP proxy
        self.channel = (plane or InternalPlane()).aio_channel(address, CHANNEL_OPTIONS)
        self._health = health_pb2_grpc.HealthStub(self.channel)

    async def check_health(self, timeout: float) -> bool:
        """True if SERVING; raises BackendError if the service cannot be reached."""
        try:
            reply = await self._health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        except grpc.aio.AioRpcError as e:
            raise _error(e, self.address) from None
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    async def kv_events(self, incarnation: str, after: int, timeout: float) -> common_pb2.KvEvents | None:
        """None when the service answers UNIMPLEMENTED (it keeps no index)."""
        try:
            return await self.stub.KvEvents(common_pb2.KvEventsRequest(incarnation=incarnation, after=after),
                                            timeout=timeout)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                return None
            raise _error(e, self.address) from None

    async def close(self) -> None:
        await self.channel.close()


class GrpcPrefillClient(_GrpcService, PrefillClient):
    def __init__(self, address: str, plane: InternalPlane | None = None):
        super().__init__(address, plane)
        self.stub = prefill_pb2_grpc.PrefillStub(self.channel)

    async def prefill(self, job: Job, destination: Any, timeout: float) -> FirstToken:
        req = prefill_pb2.PrefillRequest(request_id=job.request_id, prompt_ids=job.prompt_ids, sampling=job.sampling,
                                         destination=destination, num_forks=job.num_forks, output_ids=job.output_ids,
                                         cache_salt=job.cache_salt)
        try:
            r = await self.stub.Prefill(req, timeout=timeout)
        except grpc.aio.AioRpcError as e:
            raise _error(e, self.address) from None
        return FirstToken(r.first_token, r.seed, r.prefill_ms, r.transfer_bytes, r.transfer_ms, r.cached_tokens,
                          r.queue_ms, r.compute_ms, r.handoff_ms,
                          r.first_logprob if r.HasField("first_logprob") else None, tuple(r.prompt_logprobs),
                          tuple(ForkStart(f.token, f.seed, f.logprob if f.HasField("logprob") else None)
                                for f in r.forks), r.decode_cached_tokens)

    async def status(self, timeout: float) -> PrefillLoad:
        try:
            s = await self.stub.Status(common_pb2.StatusRequest(), timeout=timeout)
        except grpc.aio.AioRpcError as e:
            raise _error(e, self.address) from None
        return PrefillLoad(s.queue_depth, s.serving)


_FINISH = {decode_pb2.FINISH_REASON_STOP: "stop", decode_pb2.FINISH_REASON_LENGTH: "length",
           decode_pb2.FINISH_REASON_PREEMPTED: "preempted"}
_STREAM_ERRORS = {decode_pb2.ERROR_CODE_UNAVAILABLE: grpc.StatusCode.UNAVAILABLE}


class GrpcDecodeClient(_GrpcService, DecodeClient):
    def __init__(self, address: str, plane: InternalPlane | None = None):
        super().__init__(address, plane)
        self.stub = decode_pb2_grpc.DecodeStub(self.channel)

    async def reserve(self, job: Job, timeout: float) -> Reservation:
        req = decode_pb2.ReserveRequest(request_id=job.request_id, num_tokens=job.num_tokens,
                                        max_new_tokens=job.sampling.max_new_tokens - len(job.output_ids),
                                        num_forks=job.num_forks, prompt_ids=job.prompt_ids + job.output_ids,
                                        cache_salt=job.cache_salt)
        try:
            dest = await self.stub.Reserve(req, timeout=timeout)
        except grpc.aio.AioRpcError as e:
            raise _error(e, self.address) from None
        return Reservation(dest.reservation_id, dest)

    async def generate(self, job: Job, reservation: Reservation, start: ForkStart, timeout: float,
                       fork: int = 0) -> AsyncIterator[Token | Done]:
        req = decode_pb2.GenerateRequest(reservation_id=reservation.id, prompt_ids=job.prompt_ids,
                                         sampling=job.sampling, seed=start.seed, first_token=start.token, fork=fork,
                                         output_ids=job.output_ids)
        call = self.stub.Generate(req, timeout=timeout)
        done: Done | None = None
        try:
            async for ev in call:
                kind = ev.WhichOneof("event")
                if kind == "token" and done is None:
                    yield Token(ev.token.id, ev.token.index,
                                logprob=ev.token.logprob if ev.token.HasField("logprob") else None)
                elif kind == "done":
                    reason = _FINISH.get(ev.done.finish_reason)
                    if reason is None:
                        raise BackendError(grpc.StatusCode.ABORTED, "the decode service aborted the request",
                                           self.address)
                    done = Done(reason, ev.done.num_tokens)  # handed out once the stream has ended cleanly
                elif kind == "error":
                    raise BackendError(_STREAM_ERRORS.get(ev.error.code, grpc.StatusCode.INTERNAL),
                                       ev.error.message, self.address)
        except grpc.aio.AioRpcError as e:
            raise _error(e, self.address) from None
        finally:
            call.cancel()  # no-op once the call has finished; frees the rows when we leave early
        if done is None:
            raise BackendError(grpc.StatusCode.INTERNAL, "the decode stream ended without a Done event", self.address)
        yield done

    async def abort(self, reservation: Reservation, timeout: float, fork: int | None = None) -> None:
        try:
            await self.stub.Abort(decode_pb2.ReservationRef(reservation_id=reservation.id, fork=fork), timeout=timeout)
        except grpc.aio.AioRpcError as e:
            raise _error(e, self.address) from None

    async def status(self, timeout: float) -> DecodeLoad:
        try:
            s = await self.stub.Status(common_pb2.StatusRequest(), timeout=timeout)
        except grpc.aio.AioRpcError as e:
            raise _error(e, self.address) from None
        return DecodeLoad(tuple(s.rows_used), tuple(s.rows_free), s.queue_depth, s.serving, tuple(s.rows_total))
