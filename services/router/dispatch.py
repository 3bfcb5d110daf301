"""One request over the cluster: pair, reserve, prefill, stream — with retries before the first
token, a bounded wait for decode rows, forks, and resumption after a preemption.

The protocol per attempt (protos/decode.proto, protos/prefill.proto):

1. ``Decode.Reserve`` on the chosen decode service → a KV destination (opaque here) for the
   prompt's rows; when no decode service has rows now, the request waits in the admission
   queue (admission.py) and tries again. With cache-aware pairing the pair is chosen by the
   job's block keys (hashed once per start, off the event loop, once per distinct key seed of
   the services) looked up in each service's prefix index (pairing.py has the rule);
2. ``Prefill.Prefill(prompt, destination)`` → the first token (KV goes prefill → decode directly);
3. the first token is handed to the caller at once;
4. ``Decode.Generate`` streams the rest.

A job of ``num_forks`` n (n samples of one prompt) runs steps 1–2 once (:class:`Start`, begun
by whichever fork asks first); each fork then gets its own first token (fork j: seed + j) and
its own ``Generate`` stream (step 4), sharing the prompt's rows on decode.

Failure rules:

- before the first token is handed out, a retryable :class:`BackendError` aborts the reservation
  and the request moves to the least loaded pair not yet tried (at most ``max_retries`` moves);
- after it, the error propagates to the caller (who ends its stream with an error);
- a decode service failing with UNAVAILABLE (Reserve or its stream) is marked unhealthy at once;
- whenever a fork's generator is closed early (client gone, stop string found), its decode
  stream is cancelled and its share of the reservation released (an Abort after a commit is a
  harmless no-op);
- a stream that ends with ``preempted`` (the decode service ran out of rows) is resumed: a new
  job of prompt + the tokens so far, with the fork's seed, salt and affinity, is reserved (ahead
  of new requests in the admission queue), prefilled and streamed on; the caller sees one stream.

What a request leaves in the caches is recorded in the services' indexes at once, provisionally
(prefix_index.py), until a poll brings the services' own events: the prefill's, its prompt's
blocks, when it answers; the decode's, prompt + generated tokens but the last, when a fork's
stream ends with ``stop`` or ``length``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from contextlib import aclosing
from typing import AsyncIterator

import grpc

from engine.cache.content_key import block_keys
from services.protos import common_pb2
from services.router.admission import Admission, Overloaded
from services.router.backend import BackendError, DecodeClient, Done, FirstToken, Job, PrefillClient, Reservation, Token
from services.router.metrics import RouterMetrics
from services.router.pairing import Cluster, Endpoint
from services.router.prefix_index import keys_by_seed
from services.router.stages import TtftClock

logger = logging.getLogger("cpserve.router")

Started = tuple[Endpoint, Reservation, FirstToken]


class Start:
    """A job's pair, reservation and first tokens: made once for all its forks (by the first
    fork that asks), and given back fork by fork (``leave``: a fork that will not commit)."""

    def __init__(self, dispatcher: "Dispatcher", job: Job, resumed: bool = False):
        self.dispatcher, self.job, self.resumed = dispatcher, job, resumed
        self.task: asyncio.Task | None = None
        self.clock: TtftClock | None = None
        self._waiting = 0  # forks awaiting the task
        self._left: set[int] = set()  # forks that left before it finished

    async def get(self, clock: TtftClock, deadline: float) -> Started:
        if self.task is None:
            self.clock = clock
            self.task = asyncio.ensure_future(self.dispatcher._start(self.job, clock, deadline, self.resumed))
            self.task.add_done_callback(self._release_left)
        self._waiting += 1
        try:
            started = await asyncio.shield(self.task)
        finally:
            self._waiting -= 1
            if not self._waiting and not self.task.done():
                self.task.cancel()  # every fork has gone: stop (the reservation is aborted)
        if clock is not self.clock:  # this fork's TTFT has the shared start's stages
            clock.stages.update(self.clock.stages)
            clock.mark = self.clock.mark
        return started

    def leave(self, fork: int) -> None:
        """``fork`` will not commit: release its share of the reservation (now, or when the start
        is done; a failed start has aborted the whole reservation already)."""
        if self.task is None or not self.task.done():
            self._left.add(fork)
        elif not self.task.cancelled() and self.task.exception() is None:
            decode, reservation, _ = self.task.result()
            self.dispatcher._abort_soon(decode, reservation, fork)

    def _release_left(self, task: asyncio.Task) -> None:
        left, self._left = self._left, set()
        for fork in sorted(left):
            self.leave(fork)


class Dispatcher:
    def __init__(self, cluster: Cluster, prefill_clients: dict[str, PrefillClient],
                 decode_clients: dict[str, DecodeClient], metrics: RouterMetrics, *, max_retries: int,
                 request_timeout_s: float, rpc_timeout_s: float, admission: Admission | None = None):
        self.cluster, self.metrics = cluster, metrics
        self.prefill_clients, self.decode_clients = prefill_clients, decode_clients
        self.max_retries, self.request_timeout_s, self.rpc_timeout_s = max_retries, request_timeout_s, rpc_timeout_s
        self.admission = admission or Admission(max_waiting=0, max_wait_s=0.0)
        self._background: set[asyncio.Task] = set()

    async def generate(self, job: Job, clock: TtftClock | None = None, fork: int = 0,
                       start: Start | None = None) -> AsyncIterator[Token | Done]:
        """Fork ``fork`` of ``job``: token 0 (from prefill), tokens 1.. (from decode), then one
        Done; or a BackendError. ``start``: the job's shared start (made here for one fork).
        ``clock`` gets the stages of the time to token 0 (services/router/stages.py)."""
        clock = clock or TtftClock()
        deadline = asyncio.get_running_loop().time() + self.request_timeout_s
        start = start or Start(self, job)
        outputs: list[int] = []
        cached = None  # prompt tokens from the prefix cache, known from the first start
        while True:
            try:
                decode, reservation, first = await start.get(clock, deadline)
            except BaseException:
                start.leave(fork)
                raise
            head = first.fork(fork)
            cached = first.cached_tokens if cached is None else cached
            routed = decode.index.incarnation
            done: Done | None = None
            try:
                with Cluster.busy(decode):
                    if outputs:
                        yield Token(head.token, len(outputs), logprob=head.logprob)
                    else:  # the client's first token carries the start's cache and transfer figures
                        yield Token(head.token, 0, cached, head.logprob, first.prompt_logprobs,
                                    first.decode_cached_tokens, first.transfer_bytes)
                    outputs.append(head.token)
                    events = self.decode_clients[decode.address].generate(start.job, reservation, head,
                                                                          self._remaining(deadline), fork)
                    async with aclosing(events):
                        async for event in events:
                            if isinstance(event, Done):
                                done = event
                                break
                            outputs.append(event.id)
                            yield event
            except BackendError as e:
                self._note_failure(decode, e)
                raise
            finally:
                if done is None:
                    start.leave(fork)
                self.admission.notify()  # its rows are free (or about to be)
            if done.finish_reason != "preempted":
                self._remember_soon(decode, job.prompt_ids + tuple(outputs[:-1]), job.cache_salt, routed)
                yield dataclasses.replace(done, cached_tokens=cached) if cached else done
                return
            logger.info("request %s: fork %d preempted on decode %s after %d tokens; resuming", job.request_id, fork,
                        decode.address, len(outputs))
            self.metrics.preemptions.inc()
            start, fork, clock = Start(self, self._resumed(job, head.seed, outputs), resumed=True), 0, TtftClock()

    @staticmethod
    def _resumed(job: Job, seed: int, outputs: list[int]) -> Job:
        """The job that continues a preempted fork: its prompt + tokens so far, with its seed."""
        sampling = common_pb2.Sampling()
        sampling.CopyFrom(job.sampling)
        sampling.seed = seed
        sampling.ClearField("prompt_logprobs")  # already sent with the first token
        return Job(f"{job.request_id}-r{len(outputs)}", job.prompt_ids, sampling, output_ids=tuple(outputs),
                   cache_salt=job.cache_salt, affinity=job.affinity)

    async def _start(self, job: Job, clock: TtftClock, deadline: float, resumed: bool) -> Started:
        """Reserve and prefill ``job`` on some pair, retrying on other pairs before the first token."""
        tried: set[tuple[str, str]] = set()
        last: BackendError | None = None
        keys = await self._job_keys(job)
        for attempt in range(self.max_retries + 1):
            if attempt:
                self.metrics.retries.inc()
            try:
                try:
                    pair = await self._reserve(job, keys, tried, deadline, resumed)
                finally:
                    clock.lap("reserve")
                if pair is None:
                    break
                prefill, decode, reservation = pair
                routed = prefill.index.incarnation
                with Cluster.busy(decode):
                    first = await self._prefill(prefill, decode, job, reservation, deadline, clock)
                prefill.index.remember(keys.get(prefill.index.key_seed, ()), routed)  # the prompt's blocks
                return decode, reservation, first
            except Overloaded:
                raise
            except BackendError as e:
                logger.warning("request %s: attempt %d failed: %s", job.request_id, attempt + 1, e)
                if not e.retryable:
                    raise
                last = e
        if last is not None:
            raise last
        raise BackendError(grpc.StatusCode.UNAVAILABLE, f"no healthy (prefill, decode) pair: {self.cluster.why_none()}")

    async def _job_keys(self, job: Job) -> dict[bytes, list[int]]:
        """The job's block keys under each key seed of the healthy services with an index
        (cache-aware pairing only), hashed in a worker thread."""
        seeds = self.cluster.key_seeds() if self.cluster.cache_aware else set()
        if not seeds:
            return {}
        return await asyncio.to_thread(keys_by_seed, job.prompt_ids + job.output_ids, seeds, job.cache_salt)

    async def _reserve(self, job: Job, keys: dict[bytes, list[int]], tried: set[tuple[str, str]], deadline: float,
                       resumed: bool) -> tuple[Endpoint, Endpoint, Reservation] | None:
        """A pair not in ``tried`` (chosen by the job's block ``keys`` per seed and its affinity)
        and rows on its decode service, waiting in the admission queue while every decode
        service answers "no rows now"; None if no pair is left to try. A failed Reserve puts its
        pair in ``tried`` and raises."""
        async def attempt():
            full: set[str] = set()  # decode services without rows now
            while True:
                exclude = tried | {(p.address, d) for p in self.cluster.prefills for d in full}
                choice = self.cluster.pick(exclude, keys, job.affinity, job.num_tokens)
                if choice is None:
                    return None if full else ()
                prefill, decode = choice.prefill, choice.decode
                try:
                    reservation = await self.decode_clients[decode.address].reserve(job, self._remaining(deadline))
                except BackendError as e:
                    if e.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                        full.add(decode.address)
                        continue
                    tried.add((prefill.address, decode.address))
                    self._note_failure(decode, e)
                    raise
                tried.add((prefill.address, decode.address))
                self.metrics.pairing_decisions.labels(choice.reason).inc()
                self.metrics.paired.labels("prefill", prefill.address).inc()
                self.metrics.paired.labels("decode", decode.address).inc()
                return prefill, decode, reservation

        got = await self.admission.admit(attempt, resumed, deadline)
        return got or None

    async def _prefill(self, prefill: Endpoint, decode: Endpoint, job: Job, reservation: Reservation,
                       deadline: float, clock: TtftClock) -> FirstToken:
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
        self.metrics.decode_cached_tokens.inc(first.decode_cached_tokens)
        return first

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
            decode.index.clear()  # it may come back empty
            self.metrics.healthy.labels("decode", decode.address).set(0)

    def _remember_soon(self, decode: Endpoint, tokens: tuple[int, ...], salt: str, incarnation: str) -> None:
        """Record in ``decode``'s index the blocks of ``tokens`` it now caches (hashed in a worker
        thread), if it is still the ``incarnation`` the request ran on."""
        seed = decode.index.key_seed
        if not self.cluster.cache_aware or seed is None or incarnation != decode.index.incarnation:
            return

        async def remember() -> None:
            decode.index.remember(await asyncio.to_thread(block_keys, tokens, seed, salt), incarnation)

        self._in_background(remember())

    def _in_background(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _abort_soon(self, decode: Endpoint, reservation: Reservation, fork: int | None = None) -> None:
        """Free the rows (``fork``: that fork's share) without waiting (this may run while the
        caller is being cancelled)."""
        async def abort() -> None:
            try:
                await self.decode_clients[decode.address].abort(reservation, self.rpc_timeout_s, fork)
            except BackendError as e:
                logger.info("abort of reservation %s on %s failed: %s", reservation.id, decode.address, e)
            self.admission.notify()

        self._in_background(abort())

    async def drain(self) -> None:
        """Wait for pending aborts (at shutdown)."""
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
