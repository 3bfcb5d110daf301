"""One reference engine behind the router: a single-process OpenAI server that compares
directly with a cpserve cluster (the same router code, HTTP API and metrics, no disaggregation).

    python bench/reference_server.py [--model tiny|bench|DIR] [--port 8001] [--threads 1]
                                     [--served-model-name NAME]

It prints ``serving reference on HOST:PORT`` once it serves and stops on SIGTERM or Ctrl-C.
``bench/serving.py`` starts it as its ``reference`` system, and it is the single reference engine
to point ``bench/serving.py --base-url`` at beside ``cpserve up``.

The engine: one ``ReferenceEngine`` (``--threads`` torch threads) on the services' engine thread
(services/common/engine_loop.py), behind ``serve_router`` with in-process backends
(:class:`LocalBackend`): the router's Reserve is a local object, Prefill adds the request to the
engine and waits for its first token, Generate streams the rest of that same sequence.
Continuous batching comes from the engine's scheduler (requests join and leave every step;
prefill chunks go first, so new arrivals pause the running decodes). No KV moves anywhere. The
router and the engine share one Python process (GIL), as a monolithic server's would.
``--threads`` defaults to 1: with other work on the cores a 2-thread torch engine spin-waits and
ran ~20x slower than with 1 thread on the 2-core CI machine.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import threading
import time
from dataclasses import dataclass

from common import bench_model_dir

READY = "serving reference on "


class LocalBackend:
    """One ReferenceEngine on an engine thread, seen by the router as one prefill and one decode
    service (``self.prefill``, ``self.decode``).

    The reservation's destination is a :class:`_Request` (a local object: the router passes it
    through to ``prefill`` without opening it). ``prefill`` adds the sequence to the engine and
    waits for its first token; the engine thread keeps decoding it and queues every later token
    (and the final ``Done``) on the request, from where ``generate`` streams them. Engine state is
    touched on the loop thread only; tokens reach the router's asyncio loop through one
    ``call_soon_threadsafe`` per step.
    """

    def __init__(self, model: str, max_cache_tokens: int = 1 << 16, max_queue: int = 256):
        from engine.reference import ReferenceEngine
        from services.common.engine_loop import EngineLoop

        engine = ReferenceEngine(model, max_cache_tokens=max_cache_tokens)
        self.cfg, self.page_size = engine.cfg, engine.scheduler.page_size
        self._streams: dict[int, _Request] = {}  # loop thread only
        self._aio: asyncio.AbstractEventLoop | None = None  # the router's loop (set on first reserve)
        self._ids = iter(range(1 << 62))
        self.loop = EngineLoop(engine, "reference", max_queue, on_failure=self._failed,
                               has_work=lambda e: e.has_work, tick=self._step, snapshot=self._snapshot)
        local_prefill, local_decode = _backend_classes()
        self.prefill, self.decode = local_prefill(self), local_decode(self)

    # ---- loop thread ------------------------------------------------------------------------
    def _snapshot(self, engine) -> tuple[int, int]:
        alloc = engine.allocator
        return (alloc.num_pages - alloc.num_free) * self.page_size, alloc.num_free * self.page_size

    def _step(self, engine) -> None:
        from services.router.backend import Done, Token

        out = []
        for seq, token in engine.step():
            req = self._streams.get(seq.id)
            if req is None:
                continue
            out.append((req, Token(token, len(seq.output_ids) - 1)))
            if seq.is_finished:
                del self._streams[seq.id]
                out.append((req, Done(seq.finish_reason, len(seq.output_ids))))
        self._deliver(out)

    def _add(self, engine, req: "_Request", prompt: list[int], params) -> int:
        import grpc

        from services.router.backend import BackendError

        if req.cancelled:
            raise BackendError(grpc.StatusCode.CANCELLED, "the request was aborted", "reference")
        req.seq = engine.add_request(prompt, params)
        self._streams[req.seq.id] = req
        return req.seq.seed

    def _cancel(self, engine, req: "_Request") -> None:
        req.cancelled = True
        if req.seq is not None:
            self._streams.pop(req.seq.id, None)
            if not req.seq.is_finished:
                engine.abort(req.seq)

    def _failed(self, message: str) -> None:
        import grpc

        from services.router.backend import BackendError

        streams, self._streams = self._streams, {}
        err = BackendError(grpc.StatusCode.UNAVAILABLE, message, "reference")
        self._deliver([(req, err) for req in streams.values()])

    def _deliver(self, items: list) -> None:
        if not items or self._aio is None:
            return

        def put_all() -> None:
            for req, item in items:
                req.events.put_nowait(item)

        try:
            self._aio.call_soon_threadsafe(put_all)
        except RuntimeError:  # the router's loop is closed (shutdown)
            pass

    # ---- router side (its asyncio loop) -----------------------------------------------------
    async def run(self, fn, admit: bool = False):
        import grpc

        from engine.model.sampler import InvalidRequest
        from services.common.rpc import QueueFull, ServiceUnavailable
        from services.router.backend import BackendError

        try:
            return await asyncio.wrap_future(self.loop.submit(fn, admit))
        except InvalidRequest as e:
            raise BackendError(grpc.StatusCode.INVALID_ARGUMENT, str(e), "reference") from None
        except QueueFull as e:
            raise BackendError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e), "reference") from None
        except ServiceUnavailable as e:
            raise BackendError(grpc.StatusCode.UNAVAILABLE, str(e), "reference") from None

    async def check_health(self, timeout: float) -> bool:
        return self.loop.failure is None

    async def close(self) -> None:
        await asyncio.to_thread(self.loop.stop)


@dataclass(eq=False)
class _Request:
    id: str
    events: asyncio.Queue
    seq: object = None  # engine.scheduler.Sequence, set on the loop thread by _add
    cancelled: bool = False  # loop thread only


def _backend_classes():
    """The two adaptors, built lazily so ``--help`` and the load generator don't import torch."""
    import grpc

    from services.common.convert import sampling_from_proto
    from services.router.backend import (BackendError, DecodeClient, DecodeLoad, Done, FirstToken, PrefillClient,
                                         PrefillLoad, Reservation)

    async def next_event(req: _Request, timeout: float):
        try:
            item = await asyncio.wait_for(req.events.get(), timeout)
        except asyncio.TimeoutError:
            raise BackendError(grpc.StatusCode.DEADLINE_EXCEEDED, "no token within the timeout", "reference") from None
        if isinstance(item, BackendError):
            raise item
        return item

    class LocalPrefill(PrefillClient):
        address = "reference-prefill"

        def __init__(self, core: LocalBackend):
            self.core = core

        async def prefill(self, job, destination: _Request, timeout: float) -> FirstToken:
            if job.num_forks > 1:  # one engine request per job: its samples are not forks here
                raise BackendError(grpc.StatusCode.INVALID_ARGUMENT, "n: the reference server takes n = 1",
                                   "reference")
            params = sampling_from_proto(job.sampling, tuple(self.core.cfg.eos_token_ids))
            seed = await self.core.run(lambda e: self.core._add(e, destination, list(job.prompt_ids), params),
                                       admit=True)
            t0 = time.perf_counter()
            first = await next_event(destination, timeout)
            return FirstToken(first.id, seed, prefill_ms=(time.perf_counter() - t0) * 1e3)

        async def status(self, timeout: float) -> PrefillLoad:
            return PrefillLoad(self.core.loop.queue_depth, self.core.loop.failure is None)

        async def check_health(self, timeout: float) -> bool:
            return await self.core.check_health(timeout)

        async def close(self) -> None:
            await self.core.close()

    class LocalDecode(DecodeClient):
        address = "reference-decode"

        def __init__(self, core: LocalBackend):
            self.core = core

        async def reserve(self, job, timeout: float) -> Reservation:
            self.core._aio = asyncio.get_running_loop()
            req = _Request(f"local-{next(self.core._ids)}", asyncio.Queue())
            return Reservation(req.id, req)

        async def generate(self, job, reservation: Reservation, start, timeout: float, fork: int = 0):
            req: _Request = reservation.destination
            finished = False
            try:
                while True:
                    item = await next_event(req, timeout)
                    if isinstance(item, Done):
                        finished = True
                        yield item
                        return
                    yield item
            finally:
                if not finished:
                    self.core.loop.post(lambda e: self.core._cancel(e, req))

        async def abort(self, reservation: Reservation, timeout: float, fork: int | None = None) -> None:
            self.core.loop.post(lambda e: self.core._cancel(e, reservation.destination))

        async def status(self, timeout: float) -> DecodeLoad:
            used, free = self.core.loop.snapshot
            return DecodeLoad((used,), (free,), self.core.loop.queue_depth, self.core.loop.failure is None)

        async def check_health(self, timeout: float) -> bool:
            return await self.core.check_health(timeout)

        async def close(self) -> None:
            await self.core.close()

    return LocalPrefill, LocalDecode



def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny",
                   help="checkpoint directory, an embedded model, or 'bench': the benchmark model of bench/common.py")
    p.add_argument("--served-model-name", default=None, help="the name clients send as \"model\" (default: --model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="HTTP port (default 0: a free one, printed)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the engine (default 1)")
    p.add_argument("--stop-on-stdin-eof", action="store_true", help=argparse.SUPPRESS)  # a parent's pipe
    args = p.parse_args()
    if args.threads < 1:
        p.error(f"--threads must be >= 1, got {args.threads}")
    if not 0 <= args.port <= 65535:
        p.error(f"--port must be 0-65535, got {args.port}")
    model = bench_model_dir() if args.model == "bench" else args.model

    import logging

    import torch

    from services.common.config import RouterConfig
    from services.router.server import serve_router

    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    core = LocalBackend(model)
    config = RouterConfig(prefill=(core.prefill.address,), decode=(core.decode.address,), model=model,
                          served_model_name=args.served_model_name, host=args.host, port=args.port, grpc_port=None)
    handle = serve_router(config, prefill_clients=[core.prefill], decode_clients=[core.decode])
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if args.stop_on_stdin_eof:
        threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    print(f"{READY}{handle.host}:{handle.http_port}", flush=True)
    stop.wait()
    handle.shutdown()
    core.loop.stop()


if __name__ == "__main__":
    main()
