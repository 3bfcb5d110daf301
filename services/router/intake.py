"""What keeps the router's event loop free: request bodies read under a size limit and a
deadline, heavy per-request work in worker threads, and a probe of the loop's lag.

The loop runs every client's streams (services/router/server.py), so anything that holds it for
long — reading a huge body, parsing its JSON, rendering a chat template, tokenizing, decoding an
echoed prompt, encoding a large response — delays every other client's next token by as much.

- :class:`BodyIntake` (ASGI middleware) reads each request's body before the app sees it: a
  ``Content-Length`` over ``max_bytes`` is answered 413 before any of the body is read (the
  connection kept alive, so the server discards the rest as it arrives and the client reads the
  413 instead of a reset); a body without a length that grows past the limit is answered 413
  and the connection closed; a body not complete within ``read_timeout_s`` of the request's
  arrival is answered 408 and the connection closed. Errors are OpenAI's shape.
- :class:`WorkPool` runs blocking work in threads, in two lanes: bodies up to ``small_bytes``
  in a lane of their own, so that a flood of large prompts never delays small ones; larger
  bodies in a bounded lane — at most ``max_large`` running or waiting, more is a 503 with
  Retry-After (the admission style of services/router/admission.py). Threads suffice: the
  fast tokenizers release the GIL while they encode, and Jinja rendering and the Python-level
  parts of parsing are preempted every switch interval (5 ms), so the loop keeps its turn; a
  process pool would add a copy of every prompt and of its ids each way. What does hold the
  GIL for its whole duration is a single C call on a large object — ``json.loads`` of the
  body (bounded by the body limit) and ``json.dumps`` of a response, which
  :func:`encode_json` therefore does in pieces (tests/test_router_intake.py holds the loop to
  100 ms beside a 2 s tokenization; bench/router_stall.py measures streams beside it).
- :class:`LoopLagProbe` wakes every ``interval_s`` and records how late it woke: the time any
  scheduled callback waits (``cpserve_router_event_loop_lag_seconds``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

from services.router.params import ApiError

logger = logging.getLogger("cpserve.router")
T = TypeVar("T")

MIB = 1 << 20


def default_max_request_bytes(max_model_len: int) -> int:
    """The default body limit: 1 MiB plus 64 bytes per token of the context limit — room for one
    prompt at the limit as text (typical text is 3-5 bytes a token; JSON escapes of non-ASCII
    text up to ~12) or as token ids (at most 8 bytes each: ``131071, ``), with the other fields."""
    return MIB + 64 * max_model_len


def default_parse_workers() -> int:
    """Threads for large bodies: half the CPUs this process may use, 1 to 4. Tokenizing takes a
    whole core while it runs; more threads than that would take the cores the event loop and,
    where they share the machine, the engine ranks need (on 2 cores: 1)."""
    return max(1, min(4, len(os.sched_getaffinity(0)) // 2))


class BodyIntake:
    """ASGI middleware reading every HTTP request body whole, within ``max_bytes`` and
    ``read_timeout_s``, before the app runs; the app then reads it from memory."""

    def __init__(self, app, max_bytes: int, read_timeout_s: float, on_refused: Callable[[int], None] = lambda s: None):
        self.app, self.max_bytes, self.read_timeout_s, self.on_refused = app, max_bytes, read_timeout_s, on_refused

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = None
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    length = int(value)
                except ValueError:
                    await self._refuse(send, 400, "Content-Length: not a number", "invalid_request", close=True)
                    return
        if length is not None and length > self.max_bytes:
            await self._refuse(send, 413, f"the request body is {length} bytes; this server accepts at most "
                                          f"{self.max_bytes} (--max-request-bytes)", "request_too_large")
            return
        deadline = asyncio.get_running_loop().time() + self.read_timeout_s
        chunks, size = [], 0
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                await self._refuse(send, 408, f"the request body did not arrive within {self.read_timeout_s:g} s "
                                              f"({size} bytes came)", "request_timeout", close=True)
                return
            if message["type"] == "http.disconnect":
                return  # the client went away before its request was whole: nothing was started
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._refuse(send, 413, f"the request body exceeds {self.max_bytes} bytes "
                                              "(--max-request-bytes)", "request_too_large", close=True)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        whole = False

        async def replay():
            nonlocal whole
            if not whole:
                whole = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # afterwards: http.disconnect when the client goes away

        await self.app(scope, replay, send)

    async def _refuse(self, send, status: int, message: str, code: str, close: bool = False) -> None:
        self.on_refused(status)
        body = json.dumps(ApiError(status, message, None, code).body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if close:
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


class WorkPool:
    """Blocking per-request work in threads; see the module docstring for the two lanes."""

    def __init__(self, workers: int = 2, max_large: int = 16, small_bytes: int = 16 * 1024):
        self.small_bytes, self.max_large = small_bytes, max_large
        self._small = ThreadPoolExecutor(max_workers=2, thread_name_prefix="router-small")
        self._large = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="router-large")
        self.large_in_use = 0  # large-lane jobs running or waiting

    async def run(self, size: int, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in a worker thread of the lane for ``size`` bytes of input. If the caller
        is cancelled the thread still finishes its job (a thread cannot be stopped); its result
        is dropped and its place in the lane freed then."""
        loop = asyncio.get_running_loop()
        if size <= self.small_bytes:
            return await loop.run_in_executor(self._small, fn, *args)
        if self.large_in_use >= self.max_large:
            raise ApiError(503, f"the router is busy with {self.large_in_use} large requests; retry shortly", None,
                           "busy", "service_unavailable_error", {"Retry-After": "1"})
        self.large_in_use += 1
        future = loop.run_in_executor(self._large, fn, *args)
        future.add_done_callback(self._large_done)
        return await asyncio.shield(future)

    def _large_done(self, _future) -> None:
        self.large_in_use -= 1

    def shutdown(self) -> None:
        self._small.shutdown(wait=False, cancel_futures=True)
        self._large.shutdown(wait=False, cancel_futures=True)


_PIECE_ITEMS = 256  # list items encoded per json.dumps call


def encode_json(obj: Any) -> bytes:
    """``json.dumps(obj)`` (compact separators as Starlette's JSONResponse) in pieces: lists and
    dicts are walked in Python and their items encoded a few at a time, so that no single C call
    holds the GIL for long when this runs in a worker thread."""
    out: list[str] = []

    def walk(o: Any) -> None:
        if isinstance(o, dict) and any(isinstance(v, (list, tuple, dict)) for v in o.values()):
            out.append("{")
            for i, (k, v) in enumerate(o.items()):
                out.append(("," if i else "") + json.dumps(str(k), ensure_ascii=False) + ":")
                walk(v)
            out.append("}")
        elif isinstance(o, (list, tuple)) and len(o) > _PIECE_ITEMS:
            out.append("[")
            for start in range(0, len(o), _PIECE_ITEMS):
                piece = json.dumps(list(o[start:start + _PIECE_ITEMS]), ensure_ascii=False, allow_nan=False,
                                   separators=(",", ":"))
                out.append(("," if start else "") + piece[1:-1])
            out.append("]")
        else:
            out.append(json.dumps(o, ensure_ascii=False, allow_nan=False, separators=(",", ":")))

    walk(obj)
    return "".join(out).encode("utf-8")


class LoopLagProbe:
    """Records, every ``interval_s``, how late the loop woke it (``observe(seconds)``)."""

    def __init__(self, observe: Callable[[float], None], interval_s: float = 0.02):
        self.observe, self.interval_s = observe, interval_s

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + self.interval_s
            await asyncio.sleep(self.interval_s)
            self.observe(max(0.0, loop.time() - due))
