"""The HTTP front: OpenAI-compatible completions and chat completions, models, health, metrics.

Responses
---------
- ``/v1/completions``: ``choices[i].text``; ``/v1/chat/completions``: ``choices[i].message``;
  one choice per prompt and sample (``n``), numbered prompt-major, each with its own
  ``finish_reason``. With ``logprobs`` a completion choice carries OpenAI's legacy shape
  (``tokens``, ``token_logprobs``, ``top_logprobs`` as ``{text: logprob}``, ``text_offset``) and
  a chat choice ``logprobs.content`` (``token``, ``logprob``, ``bytes``, ``top_logprobs``);
  ``echo`` puts the prompt (and, with ``logprobs``, its scores, the first ``null``) first.
  ``usage`` counts prompt and completion tokens, and ``prompt_tokens_details.cached_tokens``
  the prompt tokens the prefill service's prefix cache already held (0 unless it runs with
  ``prefix_cache``). With ``return_token_ids`` the choice also
  carries ``token_ids`` (generated ids) and the prompt's ids (``choices[0].prompt_token_ids``
  for completions, top-level ``prompt_token_ids`` for chat), as vLLM does.
- ``stream: true``: server-sent events ``data: {chunk}`` and a final ``data: [DONE]``. Each
  chunk carries the new text (and, with ``return_token_ids``, the ids it covers); the last one
  carries ``finish_reason``; ``stream_options.include_usage`` adds a usage chunk before [DONE]
  (and ``"usage": null`` on every chunk before it); ``continuous_usage_stats`` puts the usage so
  far on every chunk instead.
  The HTTP status is sent with the first token, so failures before it are plain HTTP errors;
  a failure after it is a ``data: {"error": {...}}`` event followed by ``data: [DONE]``.

Errors (OpenAI's body ``{"error": {message, type, param, code}}``): 400 bad input naming the
field, 401 wrong API key, 404 unknown model, 429 + Retry-After when no decode service had rows
for the request within the admission queue's bounded wait (or the queue is full), 503 +
Retry-After when no healthy pair can take it, 504 when the request timeout passes, 502 for
other failures of a service. A client that goes away cancels its request: the decode
stream is cancelled and any reservation aborted.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import time
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, TypeVar

import grpc
from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException as StarletteHTTPException
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from services.router.backend import BackendError
from services.router.completion import CompletionRequest, CompletionRunner, Finished, TokenDelta
from services.router.intake import WorkPool, encode_json
from services.router.metrics import RouterMetrics
from services.router.pairing import Cluster
from services.router.params import (ApiError, ModelContext, ParsedRequest, parse_detokenize, parse_json,
                                    parse_request, parse_tokenize)

logger = logging.getLogger("cpserve.router")
T = TypeVar("T")

RETRY_AFTER_S = "1"
_FIELD_PREFIX = re.compile(r"^([A-Za-z_][\w.\[\]]*): ")


def api_error_of(e: BackendError) -> ApiError:
    """A backend failure (before anything was sent) as an HTTP error."""
    c = grpc.StatusCode
    if e.code == c.INVALID_ARGUMENT:
        m = _FIELD_PREFIX.match(e.message)
        return ApiError(400, e.message, m.group(1) if m else None, "invalid_value")
    if e.code == c.RESOURCE_EXHAUSTED:
        return ApiError(429, str(e), None, "overloaded", "rate_limit_error", {"Retry-After": RETRY_AFTER_S})
    if e.code == c.UNAVAILABLE:
        return ApiError(503, str(e), None, "service_unavailable", "service_unavailable_error",
                        {"Retry-After": RETRY_AFTER_S})
    if e.code == c.DEADLINE_EXCEEDED:
        return ApiError(504, str(e), None, "timeout", "timeout_error")
    return ApiError(502, str(e), None, e.code.name.lower(), "server_error")


class ClientGone(Exception):
    """The HTTP client disconnected before we answered."""


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """``work``'s result; cancels it (and raises ClientGone) if the client goes away first."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watch.cancel()
    if task.cancelled() or not task.done():
        try:
            await task
        except (asyncio.CancelledError, Exception):
            pass
        raise ClientGone()
    return task.result()


@dataclass
class _Choice:
    """What one choice has produced so far."""

    req: CompletionRequest
    parts: list[str] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    logprobs: list[tuple[int, Any]] = field(default_factory=list)  # (id, TokenLogprob) per generated token
    prompt_logprobs: tuple = ()
    finished: Finished | None = None

    def add(self, ev: TokenDelta) -> None:
        self.parts.append(ev.text)
        self.ids.append(ev.id)
        if ev.logprob is not None:
            self.logprobs.append((ev.id, ev.logprob))
        if ev.index == 0:
            self.prompt_logprobs = ev.prompt_logprobs


class _Shape:
    """Builds the JSON of one endpoint's responses and stream chunks.

    Logprobs: completions as OpenAI's legacy object (``tokens``, ``token_logprobs``,
    ``top_logprobs`` — the top N as {token text: logprob}, plus the picked token as vLLM adds
    it — and ``text_offset``); chat as ``{"content": [{token, logprob, bytes, top_logprobs}]}``.
    A token's text is its own decode, special tokens included."""

    def __init__(self, parsed: ParsedRequest, chat: bool, model: str, tokenizer):
        self.chat, self.model, self.ids = chat, model, parsed.return_token_ids
        self.id, self.created = parsed.completion.job.request_id, int(time.time())
        self.include_usage, self.continuous_usage = parsed.include_usage, parsed.continuous_usage
        self.logprobs, self.echo, self.tokenizer = parsed.logprobs, parsed.echo, tokenizer
        self._strs: dict[int, str] = {}

    def token_str(self, token: int) -> str:
        s = self._strs.get(token)
        if s is None:
            s = self._strs[token] = self.tokenizer.decode([token], skip_special_tokens=False)
        return s

    def echo_text(self, req: CompletionRequest) -> str:
        if req.prompt_text is not None:
            return req.prompt_text
        return self.tokenizer.decode(list(req.job.prompt_ids), skip_special_tokens=req.skip_special_tokens)

    # ---- logprobs ------------------------------------------------------------------------
    def _top(self, token: int, lp) -> dict[str, float]:
        top: dict[str, float] = {}
        for t, v in zip(lp.top_ids, lp.top_logprobs):  # most likely first: a shared text keeps the larger
            top.setdefault(self.token_str(t), v)
        top.setdefault(self.token_str(token), lp.logprob)
        return top

    def completion_logprobs(self, entries: list[tuple[int, Any]], offset: int = 0,
                            prompt: tuple[list[int], tuple] | None = None) -> dict:
        """``entries``: (id, TokenLogprob) of generated tokens; ``prompt``: (prompt ids, their
        logprobs from token 1 on) for echo, put first (the first prompt token's entries null)."""
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        rows: list[tuple[int, Any]] = []
        if prompt is not None:
            ids, scored = prompt
            rows = [(ids[0], None)] + list(zip(ids[1:], scored))
        for token, lp in rows + entries:
            s = self.token_str(token)
            out["tokens"].append(s)
            out["token_logprobs"].append(None if lp is None else lp.logprob)
            out["top_logprobs"].append(None if lp is None else self._top(token, lp))
            out["text_offset"].append(offset)
            offset += len(s)
        return out

    def _chat_entry(self, token: int, lp) -> dict:
        s = self.token_str(token)
        return {"token": s, "logprob": lp.logprob, "bytes": list(s.encode("utf-8")),
                "top_logprobs": [{"token": (t := self.token_str(i)), "logprob": v, "bytes": list(t.encode("utf-8"))}
                                 for i, v in zip(lp.top_ids, lp.top_logprobs)]}

    def chat_logprobs(self, entries: list[tuple[int, Any]]) -> dict:
        return {"content": [self._chat_entry(t, lp) for t, lp in entries]}

    def _choice_logprobs(self, entries: list[tuple[int, Any]], offset: int = 0, prompt=None) -> dict | None:
        if self.logprobs is None:
            return None
        return self.chat_logprobs(entries) if self.chat else self.completion_logprobs(entries, offset, prompt)

    # ---- bodies --------------------------------------------------------------------------
    def _envelope(self, obj: str, choices: list[dict], **extra: Any) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices, **extra}

    def _prompt_extra(self, req: CompletionRequest) -> tuple[dict, dict]:
        """(top-level extra, choice extra) holding the prompt's ids."""
        if not self.ids:
            return {}, {}
        ids = list(req.job.prompt_ids)
        return ({"prompt_token_ids": ids}, {}) if self.chat else ({}, {"prompt_token_ids": ids})

    def full(self, choices: list[_Choice]) -> dict:
        out, top = [], {}
        for c in choices:
            fin = c.finished
            top, extra = self._prompt_extra(c.req)
            text = "".join(c.parts) + fin.text
            prompt = None
            if self.echo:
                head = self.echo_text(c.req)
                prompt = (list(c.req.job.prompt_ids), c.prompt_logprobs)
                text = head + text
            choice: dict[str, Any] = {"index": c.req.index, "logprobs": self._choice_logprobs(c.logprobs, 0, prompt),
                                      "finish_reason": fin.reason, **extra}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            if self.ids:
                choice["token_ids"] = c.ids
            out.append(choice)
        return self._envelope("chat.completion" if self.chat else "text_completion", out,
                              usage=total_usage(choices), **top)

    def chunk(self, req: CompletionRequest, text: str, token_ids: list[int], finish_reason: str | None, first: bool,
              completion_tokens: int, logprobs: dict | None = None) -> dict:
        """One stream chunk; ``completion_tokens``: generated so far (for continuous usage)."""
        top, extra = self._prompt_extra(req) if first else ({}, {})
        if self.continuous_usage:
            top["usage"] = usage_dict(len(req.job.prompt_ids), completion_tokens)
        elif self.include_usage:
            top["usage"] = None  # as OpenAI: null on every chunk but the final usage chunk
        choice: dict[str, Any] = {"index": req.index, "logprobs": logprobs, "finish_reason": finish_reason, **extra}
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if text or first:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text
        if self.ids:
            choice["token_ids"] = token_ids
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [choice], **top)

    def token_chunk(self, c: _Choice, ev: TokenDelta, first: bool, offset: int) -> dict:
        lp = None
        if self.logprobs is not None and ev.logprob is not None:
            lp = self._choice_logprobs([(ev.id, ev.logprob)], offset)
        return self.chunk(c.req, ev.text, [ev.id], None, first, ev.index + 1, lp)

    def echo_chunk(self, c: _Choice, first_event: TokenDelta) -> dict:
        """Completions with echo, streamed: the prompt's text (and logprobs) before any token."""
        lp = None
        if self.logprobs is not None:
            lp = self.completion_logprobs([], 0, (list(c.req.job.prompt_ids), first_event.prompt_logprobs))
        return self.chunk(c.req, self.echo_text(c.req), [], None, True, 0, lp)

    def usage_chunk(self, choices: list[_Choice]) -> dict:
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [],
                              usage=total_usage(choices))


def total_usage(choices: list[_Choice]) -> dict:
    """Usage of a request: each prompt counted once (with its prefix-cache hits), every choice's tokens."""
    prompts: dict[int, tuple[int, int]] = {}
    completion = 0
    for c in choices:
        fin = c.finished
        prompts.setdefault(c.req.prompt_index, (fin.prompt_tokens, fin.cached_tokens))
        completion += fin.completion_tokens
    return usage_dict(sum(p for p, _ in prompts.values()), completion, sum(c for _, c in prompts.values()))


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("cpserve")
    except PackageNotFoundError:
        return "unknown"


_VERSION = _package_version()


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


def _sse_bytes(obj: dict) -> bytes:
    """:func:`_sse` for a large object, encoded in pieces (intake.encode_json) in a worker thread."""
    return b"data: " + encode_json(obj) + b"\n\n"


def _response_weight(parsed: ParsedRequest, choices: list[_Choice] | None = None) -> int:
    """Roughly the bytes of work in building a response's JSON: 0 when it is small (no echo, no
    logprobs), else ~64 bytes a token scored or echoed (decides whether a worker builds it)."""
    if not parsed.echo and parsed.logprobs is None:
        return 0
    prompt = sum(len(c.job.prompt_ids) for c in parsed.completions) if parsed.echo else 0
    generated = sum(len(c.ids) for c in choices) if choices and parsed.logprobs is not None else 0
    return 64 * (prompt + generated) * (1 + (parsed.logprobs or 0))


def build_app(ctx: ModelContext, runner: CompletionRunner, cluster: Cluster, metrics: RouterMetrics,
              api_key: str | None = None, pool: WorkPool | None = None) -> FastAPI:
    """The HTTP app. ``pool`` runs parsing, tokenization and large responses off the event loop
    (services/router/intake.py; a pool of its own when not given)."""
    app = FastAPI(title="cpserve router", docs_url=None, redoc_url=None, openapi_url=None)
    pool = pool or WorkPool()
    started = int(time.time())

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _no_route(request: Request, e: StarletteHTTPException) -> JSONResponse:  # 404 / 405 as OpenAI's
        what = "not found" if e.status_code == 404 else str(e.detail).lower()
        return JSONResponse({"error": {"message": f"{request.method} {request.url.path}: {what}",
                                       "type": "invalid_request_error", "param": None,
                                       "code": "not_found" if e.status_code == 404 else "method_not_allowed"}},
                            status_code=e.status_code, headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception) -> JSONResponse:  # never a stack trace to the client
        logger.error("unexpected error on %s", request.url.path, exc_info=e)
        return JSONResponse({"error": {"message": f"internal error: {type(e).__name__}", "type": "server_error",
                                       "param": None, "code": "internal_error"}}, status_code=500)

    def check_key(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), api_key.encode()):
            metrics.requests.labels("unauthorized").inc()
            raise ApiError(401, "missing or incorrect API key (send 'Authorization: Bearer <key>')", None,
                           "invalid_api_key")

    async def parse(request: Request, chat: bool) -> ParsedRequest:
        check_key(request)
        raw = await request.body()  # already in memory (intake.BodyIntake read it)
        try:
            return await pool.run(len(raw), lambda: parse_request(parse_json(raw), ctx, chat))
        except ApiError as e:
            metrics.requests.labels("invalid" if e.status < 500 else "unavailable").inc()
            raise

    async def complete(request: Request, chat: bool) -> Response:
        arrived = time.perf_counter()
        parsed = await parse(request, chat)
        shape = _Shape(parsed, chat, ctx.name, ctx.tokenizer)
        streams = runner.run_all(parsed.completions, arrived)
        try:
            if parsed.stream:
                firsts = await _unless_disconnected(request, _all([anext(s) for s in streams]))
                return StreamingResponse(_stream(shape, parsed, firsts, streams, pool), media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache"})
            choices = await _unless_disconnected(
                request, _all([_collect(_Choice(c), s) for c, s in zip(parsed.completions, streams)]))
            weight = _response_weight(parsed, choices)
            if not weight:
                return JSONResponse(shape.full(choices))
            return Response(await pool.run(weight, lambda: encode_json(shape.full(choices))),
                            media_type="application/json")
        except BackendError as e:
            await _close_all(streams)
            raise api_error_of(e) from None
        except ClientGone:
            await _close_all(streams)
            return Response(status_code=499)
        except BaseException:
            await _close_all(streams)
            raise

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await complete(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await complete(request, chat=True)

    def model_card() -> dict:
        limit, _ = ctx.token_limit()
        return {"id": ctx.name, "object": "model", "created": started, "owned_by": "cpserve", "max_model_len": limit}

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        check_key(request)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> dict:
        check_key(request)
        if model_id != ctx.name:
            raise ApiError(404, f"model: the model '{model_id}' does not exist; this server serves '{ctx.name}'",
                           "model", "model_not_found")
        return model_card()

    async def in_pool(request: Request, work) -> Response:
        """``work(body)`` → a JSON-able answer, in the work pool, encoded there too."""
        check_key(request)
        raw = await request.body()
        return Response(await pool.run(len(raw), lambda: encode_json(work(parse_json(raw)))),
                        media_type="application/json")

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        def work(body: dict) -> dict:
            ids = parse_tokenize(body, ctx)
            return {"count": len(ids), "max_model_len": ctx.token_limit()[0], "tokens": ids, "token_strs": None}
        return await in_pool(request, work)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await in_pool(request, lambda body: {"prompt": ctx.tokenizer.decode(parse_detokenize(body, ctx))})

    @app.get("/version")
    async def version() -> dict:
        return {"version": _VERSION}

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        return Response(status_code=200 if cluster.can_serve else 503)

    @app.get("/health")
    async def health() -> JSONResponse:
        def rows(kind: str, eps) -> list[dict]:
            return [{"address": e.address, "healthy": e.healthy, "reason": e.reason, "in_flight": e.in_flight}
                    for e in eps]

        ok = cluster.can_serve
        body = {"status": "ok" if ok else "unavailable", "prefill": rows("prefill", cluster.prefills),
                "decode": rows("decode", cluster.decodes)}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/debug/ttft")
    async def recent_ttft(request: Request) -> JSONResponse:
        """The last requests' TTFT and its stages, per request (choice) id, oldest first: the
        per-request view of cpserve_router_ttft_stage_seconds (bench/serving.py reads it)."""
        check_key(request)
        return JSONResponse({"requests": list(metrics.recent_ttft)})

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        await metrics.refresh()  # the services' rows and queues as they are now, not at the last poll
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


async def _all(works: list[Awaitable[T]], then=None):
    """Every result in order (passed to ``then``); if one fails, the others are cancelled first."""
    tasks = [asyncio.ensure_future(w) for w in works]
    try:
        results = await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    return then(results) if then is not None else results


async def _close_all(streams: list[AsyncIterator]) -> None:
    for s in streams:
        try:
            await s.aclose()
        except (RuntimeError, Exception):  # already running (being cancelled) or already failed
            pass


async def _collect(choice: _Choice, events: AsyncIterator[TokenDelta | Finished]) -> _Choice:
    async with aclosing(events):
        async for ev in events:
            if isinstance(ev, Finished):
                choice.finished = ev
                return choice
            choice.add(ev)
    raise BackendError(grpc.StatusCode.INTERNAL, "the completion ended without finishing")


async def _merged(firsts: list, streams: list[AsyncIterator]) -> AsyncIterator[tuple[int, Any]]:
    """(choice k, event) from every stream as they come, each stream's own order kept; one
    stream is iterated directly (no task, no queue on the one-choice path)."""
    if len(streams) == 1:
        ev = firsts[0]
        while ev is not None:
            yield 0, ev
            if isinstance(ev, Finished):
                return
            ev = await anext(streams[0], None)
        raise BackendError(grpc.StatusCode.INTERNAL, "the completion ended without finishing")
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(k: int) -> None:
        ev = firsts[k]
        try:
            while ev is not None:
                await queue.put((k, ev))
                if isinstance(ev, Finished):
                    return
                ev = await anext(streams[k], None)
            raise BackendError(grpc.StatusCode.INTERNAL, "the completion ended without finishing")
        except Exception as e:  # noqa: BLE001 — handed to the consumer
            await queue.put((k, e))

    tasks = [asyncio.ensure_future(pump(k)) for k in range(len(streams))]
    try:
        for _ in range(len(streams)):
            while True:
                k, ev = await queue.get()
                if isinstance(ev, Exception):
                    raise ev
                yield k, ev
                if isinstance(ev, Finished):
                    break
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _stream(shape: _Shape, parsed: ParsedRequest, firsts: list, streams: list[AsyncIterator],
                  pool: WorkPool) -> AsyncIterator[str | bytes]:
    choices = [_Choice(c) for c in parsed.completions]
    fresh = [True] * len(choices)  # no chunk sent yet (chat: the role goes in the first)
    offsets = [0] * len(choices)  # text_offset of the next token (completions logprobs)
    try:
        if shape.echo:
            for k, c in enumerate(choices):
                if isinstance(firsts[k], TokenDelta):  # the prompt's text and scores: built in the pool
                    yield await pool.run(_response_weight(parsed),
                                         lambda c=c, ev=firsts[k]: _sse_bytes(shape.echo_chunk(c, ev)))
                    fresh[k] = False
        async with aclosing(_merged(firsts, streams)) as events:
            async for k, ev in events:
                c = choices[k]
                if isinstance(ev, Finished):
                    c.finished = ev
                    yield _sse(shape.chunk(c.req, ev.text, [], ev.reason, fresh[k], ev.completion_tokens))
                    continue
                # one chunk per generated token, its text "" while bytes or a stop prefix are held
                c.add(ev)
                yield _sse(shape.token_chunk(c, ev, fresh[k], offsets[k]))
                offsets[k] += len(shape.token_str(ev.id)) if shape.logprobs is not None else 0
                fresh[k] = False
        if parsed.include_usage:
            yield _sse(shape.usage_chunk(choices))
    except BackendError as e:
        err = api_error_of(e)
        yield _sse({"error": {**err.body()["error"], "code": err.status}})
    except Exception as e:  # never a stack trace to the client
        logger.exception("stream failed")
        yield _sse({"error": {"message": f"internal error: {type(e).__name__}", "type": "server_error",
                              "param": None, "code": 500}})
    finally:
        await _close_all(streams)
    yield "data: [DONE]\n\n"
