"""The gRPC front: ``cpserve.router.Router/Generate`` (protos/router.proto) and grpc.health.v1.

Same semantics as the HTTP front: validation errors are INVALID_ARGUMENT / NOT_FOUND naming the
field, failures before the first token are statuses (RESOURCE_EXHAUSTED, UNAVAILABLE,
DEADLINE_EXCEEDED), failures after it an Error event. A cancelled call cancels the request.
The health service says SERVING while at least one healthy (prefill, decode) pair exists.
"""

from __future__ import annotations

import hmac
import logging
import math
import time
import uuid
from contextlib import aclosing

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.protos import common_pb2, router_pb2, router_pb2_grpc
from services.router.backend import BackendError, Job
from services.router.completion import CompletionRequest, CompletionRunner, Finished
from services.router.metrics import RouterMetrics
from services.router.pairing import Cluster
from services.router.intake import WorkPool
from services.router.params import (MAX_STOP_STRINGS, ApiError, ModelContext, check_length, encode_text, invalid,
                                    refuse_long_ids, stop_token_set, token_ids)

logger = logging.getLogger("cpserve.router")

_FINISH = {"stop": router_pb2.FINISH_REASON_STOP, "length": router_pb2.FINISH_REASON_LENGTH}
_STREAM_ERROR = {grpc.StatusCode.UNAVAILABLE: router_pb2.ERROR_CODE_UNAVAILABLE,
                 grpc.StatusCode.DEADLINE_EXCEEDED: router_pb2.ERROR_CODE_DEADLINE_EXCEEDED}
_STATUS_OF_HTTP = {400: grpc.StatusCode.INVALID_ARGUMENT, 404: grpc.StatusCode.NOT_FOUND,
                   503: grpc.StatusCode.UNAVAILABLE}


def parse_generate(msg: router_pb2.GenerateRequest, ctx: ModelContext) -> CompletionRequest:
    """A validated request; raises ApiError (400/404) naming the field."""
    if msg.model and msg.model != ctx.name:
        raise ApiError(404, f"model: the model '{msg.model}' does not exist; this server serves '{ctx.name}'",
                       "model", "model_not_found")
    kind = msg.WhichOneof("prompt")
    if kind is None:
        raise invalid("prompt", "is required (text or ids)")
    if kind == "ids":
        refuse_long_ids(msg.ids.ids, "ids", ctx)
    ids = encode_text(ctx, msg.text, "text") if kind == "text" else token_ids(list(msg.ids.ids), "ids", ctx.vocab_size)
    if not ids:
        raise invalid(kind, "must not be empty")
    s = msg.sampling if msg.HasField("sampling") else common_pb2.Sampling(
        max_new_tokens=ctx.max_tokens_for(len(ids), None))
    if s.max_new_tokens < 1:
        raise invalid("sampling.max_new_tokens", f"must be >= 1, got {s.max_new_tokens}")
    if not math.isfinite(s.temperature) or s.temperature < 0:
        raise invalid("sampling.temperature", f"must be a finite number >= 0, got {s.temperature}")
    if not (math.isfinite(s.top_p) and 0 <= s.top_p <= 1):
        raise invalid("sampling.top_p", f"must be in (0, 1] (0: unset), got {s.top_p}")
    token_ids(list(s.stop_token_ids), "sampling.stop_token_ids", ctx.vocab_size)
    if any(not x for x in msg.stop):
        raise invalid("stop", "stop strings must not be empty")
    if len(msg.stop) > MAX_STOP_STRINGS:
        raise invalid("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(msg.stop)}")
    check_length(len(ids), s.max_new_tokens, ctx, kind, "sampling.max_new_tokens")
    sampling = common_pb2.Sampling()
    sampling.CopyFrom(s)
    sampling.top_p = s.top_p or 1.0
    sampling.top_k = min(s.top_k, ctx.vocab_size)
    job = Job(msg.request_id or f"grpc-{uuid.uuid4().hex}", tuple(ids), sampling)
    return CompletionRequest(job, tuple(dict.fromkeys(msg.stop)), stop_token_set(sampling, ctx.eos_token_ids))


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(self, ctx: ModelContext, runner: CompletionRunner, metrics: RouterMetrics, api_key: str | None,
                 pool: WorkPool | None = None):
        self.ctx, self.runner, self.metrics, self.api_key = ctx, runner, metrics, api_key
        self.pool = pool or WorkPool()

    def _authorized(self, context: grpc.aio.ServicerContext) -> bool:
        if self.api_key is None:
            return True
        given = dict(context.invocation_metadata() or ()).get("authorization", "")
        scheme, _, key = given.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(key.strip().encode(), self.api_key.encode())

    async def Generate(self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        arrived = time.perf_counter()
        if not self._authorized(context):
            self.metrics.requests.labels("unauthorized").inc()
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or incorrect API key "
                                                                 "(metadata 'authorization: Bearer <key>')")
        try:
            if isinstance(request, Malformed):
                raise invalid("request", f"is not a valid cpserve.router.GenerateRequest ({request.error})",
                              "invalid_message")
            size = len(request.text) if request.WhichOneof("prompt") == "text" else 8 * len(request.ids.ids)
            req = await self.pool.run(size, parse_generate, request, self.ctx)  # tokenizing: off the loop
        except ApiError as e:
            self.metrics.requests.labels("invalid" if e.status < 500 else "unavailable").inc()
            await context.abort(_STATUS_OF_HTTP.get(e.status, grpc.StatusCode.INVALID_ARGUMENT), e.message)
        sent = False
        try:
            async with aclosing(self.runner.run(req, arrived)) as events:
                async for ev in events:
                    if isinstance(ev, Finished):
                        yield router_pb2.GenerateEvent(done=router_pb2.GenerateEvent.Done(
                            finish_reason=_FINISH[ev.reason], prompt_tokens=ev.prompt_tokens,
                            completion_tokens=ev.completion_tokens, text=ev.text))
                        return
                    sent = True
                    yield router_pb2.GenerateEvent(token=router_pb2.GenerateEvent.Token(id=ev.id, text=ev.text,
                                                                                         index=ev.index))
        except BackendError as e:
            if not sent:
                await context.abort(e.code, str(e))
            yield router_pb2.GenerateEvent(error=router_pb2.GenerateEvent.Error(
                code=_STREAM_ERROR.get(e.code, router_pb2.ERROR_CODE_INTERNAL), message=str(e)))


class Malformed:
    """A request whose bytes are not a GenerateRequest (the handler answers INVALID_ARGUMENT)."""

    def __init__(self, error: str):
        self.error = error


def _lenient_parse(raw: bytes):
    try:
        return router_pb2.GenerateRequest.FromString(raw)
    except DecodeError as e:
        return Malformed(str(e))


def add_router_servicer(servicer: RouterServicer, server) -> None:
    """router_pb2_grpc.add_RouterServicer_to_server, except that a request that does not parse
    reaches the handler as :class:`Malformed` (→ INVALID_ARGUMENT) instead of gRPC's UNKNOWN."""
    handlers = {"Generate": grpc.unary_stream_rpc_method_handler(
        servicer.Generate, request_deserializer=_lenient_parse,
        response_serializer=router_pb2.GenerateEvent.SerializeToString)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("cpserve.router.Router", handlers),))


class GrpcFront:
    """The router's grpc.aio server (Router + health)."""

    def __init__(self, servicer: RouterServicer, host: str, port: int, max_message_bytes: int | None = None):
        """``max_message_bytes``: the largest request message accepted (RESOURCE_EXHAUSTED above it;
        the HTTP front's body limit); None: gRPC's default (4 MiB)."""
        options = [] if max_message_bytes is None else [("grpc.max_receive_message_length", max_message_bytes)]
        self.server = grpc.aio.server(options=options)
        add_router_servicer(servicer, self.server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.port = self.server.add_insecure_port(target)
        if self.port == 0:
            raise OSError(f"grpc_port: cannot bind {target}")

    async def start(self) -> None:
        await self.server.start()

    async def set_serving(self, cluster: Cluster) -> None:
        serving = health_pb2.HealthCheckResponse
        status = serving.SERVING if cluster.can_serve else serving.NOT_SERVING
        for name in ("", "cpserve.router.Router"):
            await self.health.set(name, status)

    async def stop(self, grace_s: float = 1.0) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)
