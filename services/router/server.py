"""Start a router: ``serve_router(config) -> RouterHandle``.

Everything runs on one asyncio loop in a background thread: uvicorn (HTTP), the grpc.aio
server (gRPC front), the grpc.aio channels to the services, and the health monitor. So the
router is usable in-process (tests, ``cpserve up``) and ``shutdown()`` stops all of it.
``serve_router`` returns once both fronts listen and every service has been checked once.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import uvicorn

API_KEY_ENV = "CPSERVE_API_KEY"

from services.router.app import build_app
from services.router.backend import DecodeClient, GrpcDecodeClient, GrpcPrefillClient, PrefillClient
from services.router.completion import CompletionRunner
from services.common import rpc
from services.common.config import RouterConfig
from services.common.security import InternalPlane, read_secret
from services.router.admission import Admission
from services.router.dispatch import Dispatcher
from services.router.grpc_front import GrpcFront, RouterServicer
from services.router.health import HealthMonitor
from services.router.intake import (BodyIntake, LoopLagProbe, WorkPool, default_max_request_bytes,
                                    default_parse_workers)
from services.router.metrics import RouterMetrics
from services.router.pairing import Cluster, PairingPolicy
from services.router.params import ModelContext

logger = logging.getLogger("cpserve.router")


@dataclass(frozen=True)
class ModelFiles:
    """What the router reads from the checkpoint: its config, the length limit, the tokenizer."""

    cfg: Any
    max_len: int
    tokenizer: Any


def load_model_files(config: RouterConfig) -> ModelFiles:
    """The model files the router serves with; errors name the flag. (`cpserve serve router
    --backends-from-stdin` loads them before it knows the services' addresses.)"""
    from engine.model.config import ModelConfig, ModelConfigError
    from engine.model.tokenizer import load_tokenizer

    cfg = ModelConfig.load(config.model, config.generation_config)
    max_len = cfg.max_position_embeddings
    if config.max_model_len is not None:
        if config.max_model_len > max_len:
            raise ModelConfigError(f"max_model_len: {config.max_model_len} is more than the model's "
                                   f"max_position_embeddings ({max_len})")
        max_len = config.max_model_len
    tokenizer = load_tokenizer(config.model, config.tokenizer, config.trust_remote_code, config.chat_template)
    return ModelFiles(cfg, max_len, tokenizer)


def model_context(config: RouterConfig, cluster: Cluster, files: ModelFiles | None = None) -> ModelContext:
    files = files or load_model_files(config)
    cfg, max_len, tokenizer = files.cfg, files.max_len, files.tokenizer
    return ModelContext(name=config.model_name, tokenizer=tokenizer,
                        vocab_size=cfg.vocab_size, eos_token_ids=tuple(cfg.eos_token_ids),
                        max_positions=max_len, capacity_tokens=cluster.capacity_tokens,
                        default_max_tokens=config.default_max_tokens, sampling_defaults=cfg.sampling_defaults)


@dataclass
class RouterHandle:
    http_port: int
    grpc_port: int | None
    host: str
    cluster: Cluster
    metrics: RouterMetrics
    _stop: Callable[[], None] = field(repr=False)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    def shutdown(self) -> None:
        self._stop()


def serve_router(config: RouterConfig, prefill_clients: list[PrefillClient] | None = None,
                 decode_clients: list[DecodeClient] | None = None, start_timeout_s: float = 60.0,
                 model_files: ModelFiles | None = None) -> RouterHandle:
    """Start the router in a background thread. ``*_clients`` replace the gRPC clients (tests);
    by default one gRPC client per configured address. ``model_files``: already loaded for
    ``config`` (else loaded here)."""
    plane = rpc.service_plane(config)  # bad credential files: a ConfigError naming the field, now
    api_key = config.api_key or read_secret(API_KEY_ENV, config.api_key_file, "api_key_file")
    config = config.model_copy(update={"api_key": api_key})
    ready = threading.Event()
    box: dict = {}

    def main() -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(_serve(config, plane, prefill_clients, decode_clients, box, ready, model_files))
        except BaseException as e:  # reported to the starting thread if start-up failed
            box.setdefault("error", e)
            ready.set()
        finally:
            loop.close()

    thread = threading.Thread(target=main, name="cpserve-router", daemon=True)
    thread.start()
    if not ready.wait(start_timeout_s):
        raise TimeoutError(f"the router did not start within {start_timeout_s:g} s")
    if "error" in box:
        thread.join(5)
        raise box["error"]

    def stop() -> None:
        loop, event = box["loop"], box["stop"]
        if thread.is_alive():
            loop.call_soon_threadsafe(event.set)
            thread.join(30)

    return RouterHandle(box["http_port"], box["grpc_port"], config.host, box["cluster"], box["metrics"], stop)


def listen_socket(host: str, port: int) -> socket.socket:
    """The HTTP listener, bound. Its proto is IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on
    accepted sockets that say they are TCP (they inherit the listener's proto). Without it Nagle
    holds each small SSE chunk until the client's delayed ACK (~40 ms) on every keep-alive request
    after a connection's first: TTFT +40 ms and tokens delivered in bunches."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    return sock


async def _serve(config: RouterConfig, plane: InternalPlane, prefill_clients, decode_clients, box: dict,
                 ready: threading.Event, model_files: ModelFiles | None = None) -> None:
    prefills = prefill_clients or [GrpcPrefillClient(a, plane) for a in config.prefill]
    decodes = decode_clients or [GrpcDecodeClient(a, plane) for a in config.decode]
    cluster = Cluster([c.address for c in prefills], [c.address for c in decodes], PairingPolicy.of(config))
    metrics = RouterMetrics(config.model_name)
    for e in cluster.endpoints:
        metrics.paired.labels(e.kind, e.address)  # exported from the start, at 0
    p_clients = {c.address: c for c in prefills}
    d_clients = {c.address: c for c in decodes}
    ctx = model_context(config, cluster, model_files)
    max_bytes = config.max_request_bytes or default_max_request_bytes(ctx.max_positions)
    getattr(ctx.tokenizer, "max_token_bytes", None)  # the token-count bound's scan of the vocabulary: now, once
    pool = WorkPool(config.parse_workers or default_parse_workers(), config.max_large_requests)
    dispatcher = Dispatcher(cluster, p_clients, d_clients, metrics, max_retries=config.max_retries,
                            request_timeout_s=config.request_timeout_s, rpc_timeout_s=config.rpc_timeout_s,
                            admission=Admission(config.max_waiting, config.max_wait_s))
    runner = CompletionRunner(dispatcher, ctx.tokenizer, metrics)
    monitor = HealthMonitor(cluster, p_clients, d_clients, metrics, config.health_interval_s, config.rpc_timeout_s)

    grpc_front = None
    if config.grpc_port is not None:
        grpc_front = GrpcFront(RouterServicer(ctx, runner, metrics, config.api_key, pool), config.host,
                               config.grpc_port, max_bytes)
        monitor.on_change.append(grpc_front.set_serving)
        await grpc_front.start()

    sock = listen_socket(config.host, config.port)
    app = BodyIntake(build_app(ctx, runner, cluster, metrics, config.api_key, pool), max_bytes,
                     config.request_read_timeout_s, lambda status: metrics.requests.labels("invalid").inc())
    http = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False,
                                         timeout_graceful_shutdown=2))
    await monitor.poll_once()
    monitor_task = asyncio.create_task(monitor.run())
    lag_task = asyncio.create_task(LoopLagProbe(metrics.loop_lag.observe).run())
    http_task = asyncio.create_task(http.serve(sockets=[sock]))
    while not http.started:
        if http_task.done():
            await http_task
            raise RuntimeError("the HTTP server stopped during start-up")
        await asyncio.sleep(0.01)

    stop = asyncio.Event()
    box.update(loop=asyncio.get_running_loop(), stop=stop, http_port=sock.getsockname()[1],
               grpc_port=grpc_front.port if grpc_front else None, cluster=cluster, metrics=metrics)
    logger.info("router: http %s:%d, grpc %s; prefill %s; decode %s; pairing %s", config.host, box["http_port"],
                box["grpc_port"], ", ".join(config.prefill), ", ".join(config.decode), cluster.policy)
    ready.set()
    try:
        await stop.wait()
    finally:
        http.should_exit = True
        await http_task
        if grpc_front:
            await grpc_front.stop()
        monitor_task.cancel()
        lag_task.cancel()
        await dispatcher.drain()
        pool.shutdown()
        for client in [*prefills, *decodes]:
            await client.close()
        sock.close()
