"""Requests waiting for decode rows: a bounded queue, served in order.

When no decode service has rows for a prompt now (``Decode.Reserve`` answers
RESOURCE_EXHAUSTED everywhere), the request does not fail at once: it joins this queue and its
reservation is tried again whenever rows may have come free — a stream of this router ended, a
reservation was released — and every ``poll_s`` (other routers, lapsed leases). Only the
request at the head tries, so requests get rows in order: resumed generations (preempted on
decode: they already stream to a client) before new ones, each kind first come first served.

Bounds: at most ``max_waiting`` new requests wait (one more is refused at once), each for at
most ``max_wait_s``; both end in :class:`Overloaded` (HTTP 429, gRPC RESOURCE_EXHAUSTED).
Resumed generations are not refused and wait until their request's deadline.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from typing import Awaitable, Callable, TypeVar

import grpc

from services.router.backend import BackendError

T = TypeVar("T")


class Overloaded(BackendError):
    """No rows within the bounded wait, or the queue of waiting requests is full."""

    def __init__(self, message: str):
        super().__init__(grpc.StatusCode.RESOURCE_EXHAUSTED, message)

    @property
    def retryable(self) -> bool:
        return False


class Admission:
    def __init__(self, max_waiting: int, max_wait_s: float, poll_s: float = 0.05):
        self.max_waiting, self.max_wait_s, self.poll_s = max_waiting, max_wait_s, poll_s
        self._queue: list[tuple[int, int]] = []  # (0 resumed | 1 new, arrival number): a heap
        self._count = itertools.count()
        self._wake = asyncio.Event()

    @property
    def num_waiting(self) -> int:
        return len(self._queue)

    def notify(self) -> None:
        """Rows may have come free: the head tries again now."""
        self._wake.set()
        self._wake = asyncio.Event()

    async def admit(self, attempt: Callable[[], Awaitable[T | None]], resumed: bool = False,
                    deadline_s: float | None = None) -> T:
        """``attempt()``'s first result that is not None (None: no rows anywhere now). Tried at
        once when nobody waits, else in queue order; ``deadline_s`` (loop time) bounds a resumed
        generation's wait. Raises Overloaded past the bounds, and whatever ``attempt`` raises."""
        if not self._queue:
            got = await attempt()
            if got is not None:
                return got
        if not resumed and sum(1 for kind, _ in self._queue if kind) >= self.max_waiting:
            raise Overloaded(f"no decode rows free, and {self.max_waiting} requests already wait for them "
                             "(max_waiting); retry later")
        loop = asyncio.get_running_loop()
        end = deadline_s if resumed else loop.time() + self.max_wait_s
        ticket = (0 if resumed else 1, next(self._count))
        heapq.heappush(self._queue, ticket)
        try:
            while True:
                if self._queue[0] == ticket:
                    got = await attempt()
                    if got is not None:
                        return got
                left = None if end is None else end - loop.time()
                if left is not None and left <= 0:
                    raise Overloaded(f"no decode rows came free within {self.max_wait_s:g} s (max_wait_s); "
                                     "retry later" if not resumed else "no decode rows came free before the "
                                     "request's deadline")
                try:
                    await asyncio.wait_for(self._wake.wait(), self.poll_s if left is None else min(self.poll_s, left))
                except asyncio.TimeoutError:
                    pass
        finally:
            self._queue.remove(ticket)
            heapq.heapify(self._queue)
            self.notify()  # the next in line tries now
