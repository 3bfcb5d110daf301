"""One request over the cluster: pair, reserve, prefill, stream — with retries before the first token.

The protocol per attempt (protos/decode.proto, protos/prefill.proto):

1. ``Decode.Reserve`` on the chosen decode service → a KV destination (opaque here);
2. ``Prefill.Prefill(prompt, destination)`` → the first token (KV goes prefill → decode directly);
3. the first token is handed to the caller at once;
4. ``Decode.Generate`` streams the rest.

Failure rules:

- before the first token is handed out, a retryable :class:`BackendError` aborts the reservation
  and the request moves to the least loaded pair not yet tried (at most ``max_retries`` moves);
- when every pair tried was out of room (RESOURCE_EXHAUSTED: no free cache rows on decode, or a
  full engine queue), the request waits in the router's :class:`CapacityQueue` — at most
  ``queue_size`` requests, each at most ``queue_timeout_s`` — and tries again whenever a request
  of this router ends (its rows are free) or ``POLL_S`` passes (another router's may have ended);
  past the queue's limit it fails with RESOURCE_EXHAUSTED (HTTP 429);
- after it, the error propagates to the caller (who ends its stream with an error);
- a decode service failing with UNAVAILABLE (Reserve or its stream) is marked unhealthy at once;
- whenever the generator is closed early (client gone, stop string found), the decode stream is
  cancelled and the reservation aborted (an Abort after a commit is a harmless no-op).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from contextlib import aclosing
from typing import AsyncIterator

import grpc

from services.router.backend import BackendError, DecodeClient, Done, FirstToken, Job, PrefillClient, Reservation, Token
from services.router.metrics import RouterMetrics
from services.router.pairing import Cluster, Endpoint
from services.router.stages import TtftClock

logger = logging.getLogger("cpserve.router")


class CapacityQueue:
    """Requests of this router waiting for room (cache rows) on the decode services.

    At most ``size`` wait at once, each at most ``timeout_s``; a waiter wakes when a request of
    this router ends (``freed``) or after ``POLL_S`` (rows freed by another router, or a lease
    that lapsed, send no signal here). Waiters race for the rows when they wake: the wait is
    bounded, not first-come-first-served."""

    POLL_S = 0.25

    def __init__(self, size: int, timeout_s: float):
        self.size, self.timeout_s = size, timeout_s
        self.waiting = 0
        self._freed: asyncio.Event | None = None

    def freed(self) -> None:
        """Rows may be free now: wake every waiter."""
        if self._freed is not None:
            self._freed.set()
            self._freed = None

    async def wait(self, until: float) -> None:
        """Sleep until ``freed`` or POLL_S passes (never past ``until``, the loop's clock)."""
        if self._freed is None:
            self._freed = asyncio.Event()
        left = min(self.POLL_S, until - asyncio.get_running_loop().time())
        if left > 0:
            try:
                await asyncio.wait_for(self._freed.wait(), left)
            except TimeoutError:
                pass


class Dispatcher:
    def __init__(self, cluster: Cluster, prefill_clients: dict[str, PrefillClient],
                 decode_clients: dict[str, DecodeClient], metrics: RouterMetrics, *, max_retries: int,
                 request_timeout_s: float, rpc_timeout_s: float, queue: CapacityQueue | None = None):
        self.cluster, self.metrics = cluster, metrics
        self.prefill_clients, self.decode_clients = prefill_clients, decode_clients
        self.max_retries, self.request_timeout_s, self.rpc_timeout_s = max_retries, request_timeout_s, rpc_timeout_s
        self.queue = queue if queue is not None else CapacityQueue(0, 0.0)
        self._background: set[asyncio.Task] = set()

    async def generate(self, job: Job, clock: TtftClock | None = None) -> AsyncIterator[Token | Done]:
        """Token 0 (from prefill), tokens 1.. (from decode), then one Done; or a BackendError.
        ``clock`` gets the stages of the time to token 0 (services/router/stages.py); a wait in
        the capacity queue counts as ``reserve``."""
        clock = clock or TtftClock()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.request_timeout_s
        queue, queued_until, started = self.queue, None, False
        try:
            while True:
                try:
                    async for event in self._attempts(job, clock, deadline):
                        started = True
                        yield event
                    return
                except BackendError as e:
                    if e.code != grpc.StatusCode.RESOURCE_EXHAUSTED or started:
                        raise
                    if queued_until is None:  # enter the queue, if there is room in it
                        if queue.waiting >= queue.size:
                            raise BackendError(e.code, f"{e.message} (and {queue.waiting} requests already "
                                               f"wait for room: the router's queue_size)", e.service) from None
                        queue.waiting += 1
                        queued_until = min(loop.time() + queue.timeout_s, deadline)
                    if loop.time() >= queued_until:
                        raise BackendError(e.code, f"{e.message} (no room came free in the router's "
                                           f"queue_timeout_s, {queue.timeout_s:g} s)", e.service) from None
                    await queue.wait(queued_until)
        finally:
            if queued_until is not None:
                queue.waiting -= 1

    async def _attempts(self, job: Job, clock: TtftClock, deadline: float) -> AsyncIterator[Token | Done]:
        """One round: the least loaded pair, then others on a retryable failure (max_retries)."""
        tried: set[tuple[str, str]] = set()
        last: BackendError | None = None
        for attempt in range(self.max_retries + 1):
            pair = self.cluster.pick(tried)
            if pair is None:
                break
            prefill, decode = pair
            tried.add((prefill.address, decode.address))
            if attempt:
                self.metrics.retries.inc()
            with Cluster.busy(decode):
                try:
                    reservation, first = await self._prefill(prefill, decode, job, deadline, clock)
                except BackendError as e:
                    full = e.code == grpc.StatusCode.RESOURCE_EXHAUSTED  # routine while requests queue
                    logger.log(logging.INFO if full else logging.WARNING, "request %s: attempt %d on (%s, %s) "
                               "failed: %s", job.request_id, attempt + 1, prefill.address, decode.address, e)
                    if not e.retryable:
                        raise
                    last = e
                    continue
                async for event in self._stream(decode, job, reservation, first, deadline):
                    yield event
                return
        if last is not None:
            raise last
        raise BackendError(grpc.StatusCode.UNAVAILABLE, f"no healthy (prefill, decode) pair: {self.cluster.why_none()}")

    async def _prefill(self, prefill: Endpoint, decode: Endpoint, job: Job,
                       deadline: float, clock: TtftClock) -> tuple[Reservation, FirstToken]:
        try:
            reservation = await self.decode_clients[decode.address].reserve(job, self._remaining(deadline))
        except BackendError as e:
            self._note_failure(decode, e)
            raise
        finally:
            clock.lap("reserve")
        try:
            with Cluster.busy(prefill):
                first = await self.prefill_clients[prefill.address].prefill(job, reservation.destination,
                                                                            self._remaining(deadline))
        except BaseException:
            clock.lap("prefill_rpc")
            self._abort_soon(decode, reservation)
            raise
        # the RPC's time: the service's own stages, and the rest (gRPC, the hop) as prefill_rpc
        rpc_s = clock.take()
        parts = {"prefill_queue": first.queue_ms / 1e3, "prefill_compute": first.compute_ms / 1e3,
                 "kv_transfer": first.handoff_ms / 1e3}
        served = sum(parts.values())
        fit = min(1.0, rpc_s / served) if served > 0 else 1.0  # clocks of two processes: never more than the RPC
        for stage, seconds in parts.items():
            clock.add(stage, seconds * fit)
        clock.add("prefill_rpc", rpc_s - served * fit)
        self.metrics.transfer_bytes.inc(first.transfer_bytes)
        self.metrics.transfer_seconds.inc(first.transfer_ms / 1e3)
        self.metrics.prefix_cached_tokens.inc(first.cached_tokens)
        return reservation, first

    async def _stream(self, decode: Endpoint, job: Job, reservation: Reservation, first: FirstToken,
                      deadline: float) -> AsyncIterator[Token | Done]:
        finished = False
        try:
            yield Token(first.token, 0, first.cached_tokens, first.logprob, first.prompt_logprobs)
            events = self.decode_clients[decode.address].generate(job, reservation, first, self._remaining(deadline))
            async with aclosing(events):
                async for event in events:
                    finished = isinstance(event, Done)
                    if finished and first.cached_tokens:
                        event = dataclasses.replace(event, cached_tokens=first.cached_tokens)
                    yield event
        except BackendError as e:
            self._note_failure(decode, e)
            raise
        finally:
            if not finished:
                self._abort_soon(decode, reservation)
            self.queue.freed()

    def _remaining(self, deadline: float) -> float:
        left = deadline - asyncio.get_running_loop().time()
        if left <= 0:
            raise BackendError(grpc.StatusCode.DEADLINE_EXCEEDED,
                               f"the request timeout ({self.request_timeout_s:g} s) passed")
        return left

    def _note_failure(self, decode: Endpoint, e: BackendError) -> None:
        if e.code == grpc.StatusCode.UNAVAILABLE and decode.healthy:
            logger.warning("decode %s marked unhealthy: %s", decode.address, e.message)
            decode.mark(False, f"UNAVAILABLE: {e.message}")
            self.metrics.healthy.labels("decode", decode.address).set(0)

    def _abort_soon(self, decode: Endpoint, reservation: Reservation) -> None:
        """Free the rows without waiting (this may run while the caller is being cancelled)."""
        async def abort() -> None:
            try:
                await self.decode_clients[decode.address].abort(reservation, self.rpc_timeout_s)
            except BackendError as e:
                logger.info("abort of reservation %s on %s failed: %s", reservation.id, decode.address, e)

        task = asyncio.get_running_loop().create_task(abort())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def drain(self) -> None:
        """Wait for pending aborts (at shutdown)."""
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
