"""The HTTP front: OpenAI-compatible completions and chat completions, models, health, metrics.

Responses
---------
- ``/v1/completions``: ``choices[0].text``; ``/v1/chat/completions``: ``choices[0].message``.
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
field, 401 wrong API key, 404 unknown model, 503 + Retry-After when no pair can take the
request (no free rows anywhere, or no healthy pair), 504 when the request timeout passes,
502 for other failures of a service. A client that goes away cancels its request: the decode
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
from typing import Any, AsyncIterator, Awaitable, TypeVar

import grpc
from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException as StarletteHTTPException
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from services.router.backend import BackendError
from services.router.completion import CompletionRunner, Finished, TokenDelta
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
    if e.code in (c.RESOURCE_EXHAUSTED, c.UNAVAILABLE):
        code = "overloaded" if e.code == c.RESOURCE_EXHAUSTED else "service_unavailable"
        return ApiError(503, str(e), None, code, "service_unavailable_error", {"Retry-After": RETRY_AFTER_S})
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


class _Shape:
    """Builds the JSON of one endpoint's responses and stream chunks."""

    def __init__(self, parsed: ParsedRequest, chat: bool, model: str):
        self.chat, self.model, self.ids = chat, model, parsed.return_token_ids
        self.id, self.created = parsed.completion.job.request_id, int(time.time())
        self.prompt_ids = list(parsed.completion.job.prompt_ids)
        self.include_usage, self.continuous_usage = parsed.include_usage, parsed.continuous_usage

    def _envelope(self, obj: str, choices: list[dict], **extra: Any) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices, **extra}

    def _prompt_extra(self) -> tuple[dict, dict]:
        """(top-level extra, choice extra) holding the prompt's ids."""
        if not self.ids:
            return {}, {}
        return ({"prompt_token_ids": self.prompt_ids}, {}) if self.chat else ({}, {"prompt_token_ids": self.prompt_ids})

    def full(self, text: str, token_ids: list[int], fin: Finished) -> dict:
        top, extra = self._prompt_extra()
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": fin.reason, **extra}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        if self.ids:
            choice["token_ids"] = token_ids
        usage = _usage(fin)
        return self._envelope("chat.completion" if self.chat else "text_completion", [choice], usage=usage, **top)

    def chunk(self, text: str, token_ids: list[int], finish_reason: str | None, first: bool,
              completion_tokens: int) -> dict:
        """One stream chunk; ``completion_tokens``: generated so far (for continuous usage)."""
        top, extra = self._prompt_extra() if first else ({}, {})
        if self.continuous_usage:
            top["usage"] = usage_dict(len(self.prompt_ids), completion_tokens)
        elif self.include_usage:
            top["usage"] = None  # as OpenAI: null on every chunk but the final usage chunk
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish_reason, **extra}
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

    def usage_chunk(self, fin: Finished) -> dict:
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [], usage=_usage(fin))


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


def _usage(fin: Finished) -> dict:
    return usage_dict(fin.prompt_tokens, fin.completion_tokens, fin.cached_tokens)


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


def build_app(ctx: ModelContext, runner: CompletionRunner, cluster: Cluster, metrics: RouterMetrics,
              api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="cpserve router", docs_url=None, redoc_url=None, openapi_url=None)
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
        try:
            return parse_request(parse_json(await request.body()), ctx, chat)
        except ApiError:
            metrics.requests.labels("invalid").inc()
            raise

    async def complete(request: Request, chat: bool) -> Response:
        arrived = time.perf_counter()
        parsed = await parse(request, chat)
        shape = _Shape(parsed, chat, ctx.name)
        events = runner.run(parsed.completion, arrived)
        try:
            if parsed.stream:
                first = await _unless_disconnected(request, anext(events))
                return StreamingResponse(_stream(shape, first, events, parsed.include_usage),
                                         media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
            return JSONResponse(await _unless_disconnected(request, _collect(shape, events)))
        except BackendError as e:
            raise api_error_of(e) from None
        except ClientGone:
            return Response(status_code=499)

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

    async def body_of(request: Request) -> dict:
        check_key(request)
        return parse_json(await request.body())

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        ids = parse_tokenize(await body_of(request), ctx)
        return {"count": len(ids), "max_model_len": ctx.token_limit()[0], "tokens": ids, "token_strs": None}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        ids = parse_detokenize(await body_of(request), ctx)
        return {"prompt": ctx.tokenizer.decode(ids)}

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

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


async def _collect(shape: _Shape, events: AsyncIterator[TokenDelta | Finished]) -> dict:
    parts: list[str] = []
    ids: list[int] = []
    async with aclosing(events):
        async for ev in events:
            if isinstance(ev, Finished):
                parts.append(ev.text)
                return shape.full("".join(parts), ids, ev)
            parts.append(ev.text)
            ids.append(ev.id)
    raise BackendError(grpc.StatusCode.INTERNAL, "the completion ended without finishing")


async def _stream(shape: _Shape, first: TokenDelta | Finished, events: AsyncIterator[TokenDelta | Finished],
                  include_usage: bool) -> AsyncIterator[str]:
    async with aclosing(events):
        is_first = True
        ev: TokenDelta | Finished | None = first
        try:
            while ev is not None:
                if isinstance(ev, Finished):
                    yield _sse(shape.chunk(ev.text, [], ev.reason, is_first, ev.completion_tokens))
                    if include_usage:
                        yield _sse(shape.usage_chunk(ev))
                    break
                # one chunk per generated token, its text "" while bytes or a stop prefix are held
                yield _sse(shape.chunk(ev.text, [ev.id], None, is_first, ev.index + 1))
                is_first = False
                ev = await anext(events, None)
        except BackendError as e:
            err = api_error_of(e)
            yield _sse({"error": {**err.body()["error"], "code": err.status}})
        except Exception as e:  # never a stack trace to the client
            logger.exception("stream failed")
            yield _sse({"error": {"message": f"internal error: {type(e).__name__}", "type": "server_error",
                                  "param": None, "code": 500}})
        yield "data: [DONE]\n\n"
