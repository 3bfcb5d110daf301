"""gRPC helpers shared by the services: server start-up with the standard health service, and
the one mapping from engine errors to gRPC status codes.

Error mapping, by exception type only — never by the wording of a message (never a stack trace
to the client; unexpected errors are logged here and answer INTERNAL):

=========================================  =====================================================
InvalidRequest, LayoutMismatch, ConfigError  INVALID_ARGUMENT (the message names the field)
NoCapacity (a ReservationError)             RESOURCE_EXHAUSTED (no free rows now; retry)
BadReservation (a ReservationError)          INVALID_ARGUMENT (never fits the cache / wrong length)
ReservationError (others)                    FAILED_PRECONDITION (unknown/expired/used reservation)
QueueFull                                    RESOURCE_EXHAUSTED
TransferError                                UNAVAILABLE (the message names the peer)
GroupError, ServiceUnavailable               UNAVAILABLE (the health service says NOT_SERVING)
=========================================  =====================================================
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from concurrent import futures
from typing import Callable, NoReturn

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from engine.model.sampler import InvalidRequest
from engine.parallel.group import GroupError
from engine.handoff import BadReservation, LayoutMismatch, NoCapacity, ReservationError
from kvtransfer.transport import TransferError
from services.common.security import InternalPlane

logger = logging.getLogger("cpserve.services")


# Service-to-service channels go straight to the address they are given, never via an HTTP proxy
# from the environment.
CHANNEL_OPTIONS = (("grpc.enable_http_proxy", 0),)


class QueueFull(RuntimeError):
    """The service's bounded request queue is full."""


class ServiceUnavailable(RuntimeError):
    """The service cannot take work: its rank group failed, or it is stopping."""


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    msg = str(exc)
    if isinstance(exc, LayoutMismatch):
        return grpc.StatusCode.INVALID_ARGUMENT, f"destination.fingerprint.{exc.field}: {msg}"
    if isinstance(exc, InvalidRequest):
        return grpc.StatusCode.INVALID_ARGUMENT, msg
    if isinstance(exc, NoCapacity):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, msg
    if isinstance(exc, BadReservation):
        return grpc.StatusCode.INVALID_ARGUMENT, msg
    if isinstance(exc, ReservationError):
        return grpc.StatusCode.FAILED_PRECONDITION, msg
    if isinstance(exc, QueueFull):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, msg
    if isinstance(exc, TransferError):
        return grpc.StatusCode.UNAVAILABLE, msg
    if isinstance(exc, (GroupError, ServiceUnavailable)):
        return grpc.StatusCode.UNAVAILABLE, msg.splitlines()[0]  # a rank's traceback stays in the log
    logger.error("unexpected error", exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__} (details in the service log)"


def abort(context: grpc.ServicerContext, exc: BaseException) -> NoReturn:
    code, msg = status_of(exc)
    context.abort(code, msg)
    raise AssertionError("unreachable")  # context.abort raises


class Health:
    """The standard grpc.health.v1 service; ``""`` (the whole server) plus each named service."""

    def __init__(self, service_names: list[str]):
        self.servicer = health.HealthServicer()
        self.names = ["", *service_names]
        self.set_serving(False)

    def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in self.names:
            self.servicer.set(name, status)


def service_plane(config) -> InternalPlane:
    """The internal plane of a service config; a bad setting is a ConfigError naming the field."""
    from services.common.config import ConfigError
    from services.common.security import SecurityError

    try:
        return InternalPlane.from_config(config)
    except SecurityError as e:
        raise ConfigError(str(e)) from None


def address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _bind(server: grpc.Server, host: str, port: int, credentials: grpc.ServerCredentials | None) -> int:
    try:
        bound = (server.add_secure_port(address(host, port), credentials) if credentials is not None
                 else server.add_insecure_port(address(host, port)))
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise OSError(f"port: cannot bind {address(host, port)}")
    return bound


def start_server(add_servicers: Callable[[grpc.Server], None], service_names: list[str], host: str, port: int,
                 max_workers: int, plane: InternalPlane | None = None,
                 health_port: int | None = None) -> tuple[grpc.Server, int, Health]:
    """Bind ``host:port`` (port 0: a free one), start, and return (server, bound port, health).

    With ``plane``, every method but the health service needs its token, and the port speaks
    TLS if the plane has a certificate. ``health_port`` adds a plaintext port on ``host`` that
    serves only the health service (``server.health_port`` is the bound one). Health starts
    NOT_SERVING; the caller flips it once its engine is ready."""
    plane = plane or InternalPlane()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc"),
                         interceptors=plane.server_interceptors())
    add_servicers(server)
    h = Health(service_names)
    health_pb2_grpc.add_HealthServicer_to_server(h.servicer, server)
    bound = _bind(server, host, port, plane.server_credentials())
    probes = None
    if health_port is not None:
        probes = grpc.server(futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="grpc-health"))
        health_pb2_grpc.add_HealthServicer_to_server(h.servicer, probes)
        server.health_port = _bind(probes, host, health_port, None)
    server.start()
    if probes is not None:
        probes.start()
        stop = server.stop

        def stop_both(grace):
            probes.stop(grace)
            return stop(grace)

        server.stop = stop_both
    return server, bound, h


REBUILD_BACKOFF_S = (1.0, 2.0, 5.0, 10.0, 30.0)  # between failed attempts to rebuild a rank group


def serve_engine(kind: str, engine, make_service: Callable, add_servicer: Callable, service_name: str, config,
                 max_workers: int, details: str, plane: InternalPlane | None = None,
                 make_engine: Callable[[], object] | None = None):
    """Start an engine-backed gRPC service: build the service around `engine`, bind
    ``config.host:config.port``, mark health SERVING. Returns ``(service, server, port, address,
    shutdown)``; ``shutdown(grace_s)`` is idempotent (health NOT_SERVING, service stopped, server
    stopped, rank group closed). On a failed start the engine is closed.

    Self-healing, with ``make_engine``: when the rank group fails (a rank died), the engine loop
    fails what it holds at once and health goes NOT_SERVING; a supervisor thread then closes
    the old group, builds a new engine (``make_engine()``, retried with back-off), hands it to
    the service (``service.restart``) and marks health SERVING again. The new group has new
    rank processes and new transfer engines (new sessions), and an empty reservation table: a
    destination of the old group is refused as unknown."""
    health: list[Health] = []
    plane = plane or InternalPlane()
    current = {"engine": engine}
    done: list[bool] = []
    lock = threading.Lock()

    def heal(message: str) -> None:
        try:
            rebuild(message)
        finally:
            healing.clear()
        if service.loop.failure is not None:  # the new group failed too (its report found us busy)
            start_healing(service.loop.failure)

    def rebuild(message: str) -> None:
        t0 = time.monotonic()
        service.loop.join(30)  # it ends right after reporting the failure
        try:
            current["engine"].close()
        except Exception:  # noqa: BLE001 — the group is broken; its processes are reaped anyway
            logger.warning("%s: closing the failed rank group raised", kind, exc_info=True)
        for attempt in itertools.count():
            if done:
                return
            try:
                new = make_engine()
                break
            except Exception:  # noqa: BLE001 — retried
                wait = REBUILD_BACKOFF_S[min(attempt, len(REBUILD_BACKOFF_S) - 1)]
                logger.exception("%s: rebuilding the rank group failed (attempt %d); again in %g s", kind,
                                 attempt + 1, wait)
                time.sleep(wait)
        with lock:
            if done:
                new.close()
                return
            current["engine"] = new
            service.restart(new)
            if metrics is not None:
                service.loop.observe_tick = metrics.step_seconds.observe
            health[0].set_serving(service.loop.failure is None)
        logger.info("%s: rank group rebuilt in %.1f s after: %s; serving again", kind, time.monotonic() - t0,
                    message)

    healing: list[bool] = []  # one rebuild at a time

    def start_healing(message: str) -> None:
        with lock:
            if make_engine is None or done or healing:
                return
            healing.append(True)
        logger.warning("%s: rank group failed (%s); rebuilding it", kind, message)
        threading.Thread(target=heal, args=(message,), name=f"{kind}-rebuild", daemon=True).start()

    def on_failure(message: str) -> None:
        if health:  # (a failure during start-up is picked up below, once the service exists)
            health[0].set_serving(False)
            start_healing(message)

    try:
        service = make_service(on_failure=on_failure)
        try:
            server, port, h = start_server(lambda s: add_servicer(service, s), [service_name], config.host,
                                           config.port, max_workers, plane, config.health_port)
        except BaseException:
            service.stop()
            raise
    except BaseException:
        engine.close()
        raise
    health.append(h)
    advertised = address(config.advertised_host, port)
    metrics = None
    if config.metrics_port is not None:
        from services.common.service_metrics import ServiceMetrics

        metrics = service.metrics = ServiceMetrics(kind, service.metrics_state)
        service.loop.observe_tick = metrics.step_seconds.observe
        try:
            server.metrics_port = metrics.serve(config.host, config.metrics_port)
        except OSError as e:
            service.stop()
            server.stop(0)
            engine.close()
            raise OSError(f"metrics_port: cannot bind {address(config.host, config.metrics_port)}: {e}") from None
    h.set_serving(service.loop.failure is None)
    if service.loop.failure is not None:
        start_healing(service.loop.failure)
    closed = ", ".join(n for n, on in (("token", plane.token), ("TLS", plane.tls), ("mutual TLS", plane.ca)) if on)
    extra = f"; health-only plaintext port {server.health_port}" if config.health_port is not None else ""
    if metrics is not None:
        extra += f"; metrics on http://{address(config.host, server.metrics_port)}/metrics"
    logger.info("serving %s on %s (%s; internal plane: %s%s)", kind, advertised, details, closed or "open", extra)

    def shutdown(grace_s: float = 2.0) -> None:
        with lock:
            if done:
                return
            done.append(True)
        h.set_serving(False)
        service.stop()
        server.stop(grace_s).wait()
        if metrics is not None:
            metrics.close()
        current["engine"].close()
        logger.info("%s service on %s stopped", kind, advertised)

    return service, server, port, advertised, shutdown
