"""The internal plane's credentials: a shared token on every internal RPC, and TLS.

Internal gRPC is everything between our own processes: router → prefill / decode services and
prefill → decode (``BeginWrite`` / ``EndWrite``). Two independent protections, each optional:

- **A shared token.** Read from ``$CPSERVE_INTERNAL_TOKEN``, else from the file named by
  ``internal_token_file`` (a Kubernetes Secret mounted as a file) — never from a flag, whose value
  would show in ``ps``. Servers check it on every method but the standard health service
  (Kubernetes probes and the image's health check carry no token): a call without it, or with
  another, gets ``UNAUTHENTICATED``. Clients send it as ``x-cpserve-token`` metadata.
- **TLS.** ``tls_cert`` + ``tls_key`` (PEM files) make servers speak TLS; ``tls_ca`` makes them
  require client certificates signed by it (mutual TLS) and is what clients verify servers with.
  A plaintext client is refused at the handshake. ``health_port`` adds a plaintext listener that
  serves only the health service, for probes that cannot speak TLS.

``cpserve up`` makes a fresh random token for each cluster it starts, so its plane is closed by
default. The token never appears in logs or in a config's repr.
"""

from __future__ import annotations

import hmac
import os
from dataclasses import dataclass, field
from pathlib import Path

import grpc

TOKEN_ENV = "CPSERVE_INTERNAL_TOKEN"
TOKEN_HEADER = "x-cpserve-token"
EXEMPT_PREFIX = "/grpc.health.v1.Health/"  # the standard health service: no token needed


class SecurityError(ValueError):
    """A bad credentials setting; the message names the field."""


def _read(field_name: str, path: str | None) -> bytes | None:
    if not path:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise SecurityError(f"{field_name}: cannot read {path}: {e.strerror or e}") from None


def read_secret(env: str, path: str | None, field_name: str) -> str | None:
    """A secret from the environment variable ``env``, else from the file ``path`` (stripped)."""
    value = os.environ.get(env, "").strip()
    if value:
        return value
    data = _read(field_name, path)
    if data is None:
        return None
    value = data.decode("utf-8", "replace").strip()
    if not value:
        raise SecurityError(f"{field_name}: {path} is empty")
    return value


@dataclass(frozen=True)
class InternalPlane:
    token: str | None = field(default=None, repr=False)
    cert: bytes | None = field(default=None, repr=False)
    key: bytes | None = field(default=None, repr=False)
    ca: bytes | None = field(default=None, repr=False)

    @classmethod
    def from_config(cls, config) -> "InternalPlane":
        """From a service config's ``internal_token_file`` / ``tls_cert`` / ``tls_key`` / ``tls_ca``."""
        if bool(config.tls_cert) != bool(config.tls_key):
            missing = "tls_key" if config.tls_cert else "tls_cert"
            raise SecurityError(f"{missing}: tls_cert and tls_key go together")
        return cls(token=read_secret(TOKEN_ENV, config.internal_token_file, "internal_token_file"),
                   cert=_read("tls_cert", config.tls_cert), key=_read("tls_key", config.tls_key),
                   ca=_read("tls_ca", config.tls_ca))

    @property
    def tls(self) -> bool:
        return self.cert is not None

    # ---- servers ------------------------------------------------------------------------------
    def server_credentials(self) -> grpc.ServerCredentials | None:
        if not self.tls:
            return None
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=self.ca is not None)

    def server_interceptors(self) -> list[grpc.ServerInterceptor]:
        return [_TokenCheck(self.token)] if self.token else []

    # ---- clients ------------------------------------------------------------------------------
    def _channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key if self.ca else None,
                                            certificate_chain=self.cert if self.ca else None)

    def channel(self, address: str, options=()) -> grpc.Channel:
        """A blocking channel to an internal service, with this plane's TLS and token."""
        if self.tls or self.ca is not None:
            ch = grpc.secure_channel(address, self._channel_credentials(), options=options)
        else:
            ch = grpc.insecure_channel(address, options=options)
        return grpc.intercept_channel(ch, _AddToken(self.token)) if self.token else ch

    def aio_channel(self, address: str, options=()) -> grpc.aio.Channel:
        """An asyncio channel to an internal service, with this plane's TLS and token."""
        interceptors = [_AioAddTokenUnary(self.token), _AioAddTokenStream(self.token)] if self.token else None
        if self.tls or self.ca is not None:
            return grpc.aio.secure_channel(address, self._channel_credentials(), options=options,
                                           interceptors=interceptors)
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)


# ---- the token, on the wire --------------------------------------------------------------------
def _deny(context: grpc.ServicerContext):
    context.abort(grpc.StatusCode.UNAUTHENTICATED, f"missing or wrong {TOKEN_HEADER} (the internal token)")


class _TokenCheck(grpc.ServerInterceptor):
    def __init__(self, token: str):
        self._token = token.encode()

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None or details.method.startswith(EXEMPT_PREFIX):
            return handler
        given = next((v for k, v in details.invocation_metadata if k == TOKEN_HEADER), None)
        if isinstance(given, str) and hmac.compare_digest(given.encode(), self._token):
            return handler
        if handler.response_streaming:
            def deny_stream(request, context):
                _deny(context)
                yield  # pragma: no cover — abort raises

            maker = grpc.stream_stream_rpc_method_handler if handler.request_streaming \
                else grpc.unary_stream_rpc_method_handler
            return maker(deny_stream)
        maker = grpc.stream_unary_rpc_method_handler if handler.request_streaming \
            else grpc.unary_unary_rpc_method_handler
        return maker(lambda request, context: _deny(context))


def _with_token(metadata, token: str):
    return tuple(metadata or ()) + ((TOKEN_HEADER, token),)


class _CallDetails:
    """A client call's details with one more metadata entry (grpc's own tuple is immutable)."""

    def __init__(self, details, token: str):
        self.method, self.timeout, self.credentials = details.method, details.timeout, details.credentials
        self.wait_for_ready = getattr(details, "wait_for_ready", None)
        self.compression = getattr(details, "compression", None)
        self.metadata = _with_token(details.metadata, token)


class _AddToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    def __init__(self, token: str):
        self._token = token

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(_CallDetails(details, self._token), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(_CallDetails(details, self._token), request)


def _aio_details(details, token: str) -> grpc.aio.ClientCallDetails:
    return grpc.aio.ClientCallDetails(details.method, details.timeout,
                                      grpc.aio.Metadata(*_with_token(details.metadata, token)),
                                      details.credentials, details.wait_for_ready)


class _AioAddTokenUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, token: str):
        self._token = token

    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(_aio_details(details, self._token), request)


class _AioAddTokenStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, token: str):
        self._token = token

    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(_aio_details(details, self._token), request)
