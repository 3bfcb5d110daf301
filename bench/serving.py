"""Serving latency and throughput over HTTP: disaggregated clusters against one reference engine
behind the same router, and against the same engine offline, measured in one run.

    python bench/serving.py [--quick] [--json] [--model tiny|bench|DIR] [--clusters 2+2,1+1]
                            [--concurrency 1,8,32] [--requests N] [--prompt-lengths 64,1024]
                            [--max-tokens 32] [--ref-threads 1]

Systems (all started by this script at once, all on 127.0.0.1, all reached through a router's
OpenAI HTTP front by the same load generator in this process):

- ``cluster P+D`` for each ``--clusters`` shape: ``services.up.start_cluster`` exactly like
  ``cpserve up --prefill-cp P --decode-dcp D`` — a prefill service (P rank processes), a decode
  service (D rank processes) and a router, each its own process, threads per rank as ``up``
  picks them (usable cores ÷ all the ranks of that cluster). Prompt KV moves prefill → decode
  over the TCP transfer engine.
- ``reference``: one ``ReferenceEngine`` (``--ref-threads`` torch threads) in a child process of
  this script, on the services' engine thread (services/common/engine_loop.py), behind the very
  same router code (``serve_router`` with in-process backends, :class:`LocalBackend`): the
  router's Reserve is a local object, Prefill adds the request to the engine and waits for its
  first token, Generate streams the rest of that same sequence. Continuous batching comes from
  the engine's scheduler (requests join and leave every step; prefill chunks go first, so new
  arrivals pause the running decodes). No KV moves anywhere.
- ``offline`` (after the servers have stopped, nothing else running): the same engine in this
  process with each cluster's threads per rank, no server: each first-level prompt alone
  (prefill = ``generate`` call → first token; step = (last − first token) / (tokens − 1)), then
  ``generate`` of the first 8 prompts at once (wall clock, prefill included). Each cluster's
  TTFT is set against the offline prefill, its TPOT against the offline step, and its
  throughput at concurrency 8 against the offline ``generate`` of 8.

The router's TTFT breakdown (``cpserve_router_ttft_stage_seconds``, scraped before and after each
level) gives each cluster's mean time per stage.

Load: a fixed, seeded set of prompts (lengths uniform in ``--prompt-lengths``), streaming
``/v1/completions`` with ``temperature 0``, ``ignore_eos``, ``max_tokens`` and
``return_token_ids``; ``--requests`` per level (default max(8, 2 x concurrency), at least 32 at
concurrency 8) taken by N closed-loop asyncio workers (N = concurrency), each request timing its
first token and the rest. Request i of a level uses prompt i on every system, so every
completed request is compared token id for token id with the reference's and the offline
engine's (greedy: they must agree exactly). Levels run in turn on every system (the order
rotating per level) after one warm-up request per system; a level stops starting new requests
after ``--level-timeout`` seconds.

Figures per (system, concurrency): TTFT = request sent → first token chunk received (median,
p90); TPOT = (last token - first token) / (tokens - 1) per request, median; throughput = output
tokens of completed requests / (first request sent → last request done).

What this comparison means here. This machine has 2 CPU cores shared with other work. The
2 + 2 cluster is 7 processes on them (4 rank processes, prefill/decode/router services); every CP/DCP
collective needs both ranks of a group on a core at the same moment, the prefill and decode
groups compete for the same 2 cores, and the KV hand-off and each token's gRPC hop cost CPU that
the one-process engine never spends. Disaggregation buys isolation (prefill does not stall
decode, each side scales on its own hardware) that 2 shared cores cannot give, so the ratios
here measure the overhead of the distributed path (processes, collectives, KV transfer, gRPC)
on the tiny model, not what CP/DCP gains on real accelerators with long contexts: expect the
cluster to be slower per request. One effect does show even here: under load the reference
engine runs new arrivals' prefill chunks before its running decodes, so its TPOT grows with
concurrency, while the cluster's decode group keeps stepping as the prefill group works (its
TPOT stays flatter; its TTFT grows instead, the prefill service running one prefill at a time).
``--ref-threads`` defaults to 1: with other work on the cores a 2-thread torch engine
spin-waits and ran ~20x slower than with 1 thread here (the cluster's ranks use 1 thread each).
The reference's router and engine share one Python process (GIL), as a monolithic server's
would; the load generator (this process) is the same for both systems. Numbers move with
whatever else runs on the machine; the systems alternate per level to share that noise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field

from common import base_parser, bench_model_dir, emit_json, print_table, save_plot

from services.router.stages import TTFT_STAGES as STAGES

_READY = "serving reference on "


# ---- the reference engine as the router's backend ---------------------------------------------
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

        async def generate(self, job, reservation: Reservation, first: FirstToken, timeout: float):
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

        async def abort(self, reservation: Reservation, timeout: float) -> None:
            self.core.loop.post(lambda e: self.core._cancel(e, reservation.destination))

        async def status(self, timeout: float) -> DecodeLoad:
            used, free = self.core.loop.snapshot
            return DecodeLoad((used,), (free,), self.core.loop.queue_depth, self.core.loop.failure is None)

        async def check_health(self, timeout: float) -> bool:
            return await self.core.check_health(timeout)

        async def close(self) -> None:
            await self.core.close()

    return LocalPrefill, LocalDecode


def serve_reference(args: argparse.Namespace) -> None:
    """Child-process mode: the reference engine behind the router until stdin closes or SIGTERM."""
    import logging

    import torch

    from services.common.config import RouterConfig
    from services.router.server import serve_router

    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.ref_threads)
    core = LocalBackend(args.model)
    config = RouterConfig(prefill=(core.prefill.address,), decode=(core.decode.address,), model=args.model,
                          host="127.0.0.1", port=0, grpc_port=None)
    handle = serve_router(config, prefill_clients=[core.prefill], decode_clients=[core.decode])
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    print(f"{_READY}{handle.host}:{handle.http_port}", flush=True)
    stop.wait()
    handle.shutdown()
    core.loop.stop()


# ---- the load generator -------------------------------------------------------------------------
@dataclass
class Result:
    index: int
    prompt_tokens: int
    ttft_ms: float = float("nan")
    tpot_ms: float = float("nan")
    ids: list[int] = field(default_factory=list)
    end: float = 0.0
    error: str | None = None


async def one_request(client, url: str, model: str, index: int, prompt: list[int], max_tokens: int) -> Result:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "stream": True}
    res = Result(index, len(prompt))
    times: list[float] = []
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                res.error = f"HTTP {resp.status_code}: {resp.text[:200]}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = str(chunk["error"].get("message"))[:200]
                    break
                new = chunk["choices"][0].get("token_ids") or [] if chunk.get("choices") else []
                if new:
                    now = time.perf_counter()
                    times += [now] * len(new)
                    res.ids += new
    except Exception as e:  # a timeout or a dropped connection counts as a failed request
        res.error = f"{type(e).__name__}: {e}"
    res.end = time.perf_counter()
    if times:
        res.ttft_ms = (times[0] - t0) * 1e3
        if len(times) > 1:
            res.tpot_ms = (times[-1] - times[0]) * 1e3 / (len(times) - 1)
    if res.error is None and len(res.ids) != max_tokens:
        res.error = f"{len(res.ids)} tokens, expected {max_tokens}"
    return res


async def run_level(url: str, model: str, prompts: list[list[int]], n: int, concurrency: int, max_tokens: int,
                    level_timeout_s: float, bar) -> dict:
    import httpx

    results: list[Result] = []
    indices = iter(range(n))
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(trust_env=False, timeout=httpx.Timeout(level_timeout_s + 120),
                                 limits=limits) as client:
        start = time.perf_counter()
        stop_at = start + level_timeout_s

        async def worker() -> None:
            for i in indices:  # one shared iterator: each worker takes the next request when free
                if time.perf_counter() > stop_at:
                    return
                results.append(await one_request(client, url, model, i, prompts[i], max_tokens))
                bar.update(1)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    ok = [r for r in results if r.error is None]
    wall = (max(r.end for r in results) - start) if results else float("nan")
    ttft = sorted(r.ttft_ms for r in ok)
    tpot = [r.tpot_ms for r in ok if r.tpot_ms == r.tpot_ms]
    return {
        "concurrency": concurrency, "requests": n, "completed": len(ok), "failed": len(results) - len(ok),
        "not_started": n - len(results),
        "ttft_ms_median": statistics.median(ttft) if ttft else float("nan"),
        "ttft_ms_p90": percentile(ttft, 90),
        "tpot_ms_median": statistics.median(tpot) if tpot else float("nan"),
        "throughput_tok_s": sum(len(r.ids) for r in ok) / wall if ok else 0.0,
        "wall_s": wall,
        "errors": sorted({r.error for r in results if r.error})[:3],
        "_ids": {r.index: r.ids for r in ok},
    }


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolated percentile of an ascending list."""
    if not sorted_values:
        return float("nan")
    pos = (len(sorted_values) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def make_prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


# ---- the engine offline, and the router's TTFT breakdown ----------------------------------------
def offline_figures(model: str, threads: int, single: list[list[int]], batch: list[list[int]],
                    max_tokens: int) -> dict:
    """The reference engine in this process with ``threads`` torch threads (the serving ranks'),
    no server: per prompt of ``single`` its prefill (generate() call → first token) and decode
    step ((last − first token) / (tokens − 1)), one at a time; then ``generate`` of ``batch`` at
    once, wall clock with its prefill. Token ids too, to check the servers against."""
    import torch

    from engine.model.sampler import SamplingParams
    from engine.reference import ReferenceEngine

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        need = max(len(batch), 1) * (max(map(len, single + batch)) + max_tokens) + 64
        engine = ReferenceEngine(model, max_cache_tokens=need)
        params = SamplingParams(max_new_tokens=max_tokens, stop_token_ids=())
        engine.generate([single[0][:16]], SamplingParams(max_new_tokens=2, stop_token_ids=()))  # warm-up
        prefill_ms, step_ms, ids = [], [], {}
        for i, prompt in enumerate(single):
            t0 = time.perf_counter()
            seq = engine.generate([prompt], params)[0]
            prefill_ms.append((seq.token_times[0] - t0) * 1e3)
            step_ms.append((seq.token_times[-1] - seq.token_times[0]) * 1e3 / (len(seq.token_times) - 1))
            ids[i] = seq.output_ids
        t0 = time.perf_counter()
        seqs = engine.generate(batch, params)
        wall = time.perf_counter() - t0
    finally:
        torch.set_num_threads(before)
    return {"threads": threads, "prefill_ms": prefill_ms, "step_ms": step_ms, "_ids": ids,
            "batch": len(batch), "batch_wall_s": wall,
            "batch_throughput_tok_s": sum(len(s.output_ids) for s in seqs) / wall}


def router_stages(url: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of the router's TTFT and of each of its TTFT stages, from its /metrics."""
    import re

    import httpx

    text = httpx.get(f"{url}/metrics", trust_env=False, timeout=30).text
    out = {}
    for m in re.finditer(r'^cpserve_router_ttft(?:_stage)?_seconds_(sum|count)(?:\{stage="(\w+)"\})? (\S+)$',
                         text, re.M):
        kind, stage, value = m.groups()
        total, count = out.get(stage or "ttft", (0.0, 0.0))
        out[stage or "ttft"] = (float(value), count) if kind == "sum" else (total, float(value))
    return out


def stage_means_ms(before: dict, after: dict) -> dict[str, float]:
    """Mean ms per request of each stage between two router_stages() readings."""
    out = {}
    for stage, (total, count) in after.items():
        t0, c0 = before.get(stage, (0.0, 0.0))
        out[stage] = (total - t0) / (count - c0) * 1e3 if count > c0 else float("nan")
    return out


# ---- main ---------------------------------------------------------------------------------------
def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--model", default="tiny",
                   help="checkpoint directory, an embedded model, or 'bench': the benchmark model of bench/engine.py")
    p.add_argument("--clusters", default=None,
                   help="cluster shapes, prefill CP + decode DCP (default 2+2,1+1; --quick 1+1)")
    p.add_argument("--concurrency", default=None, help="comma-separated levels (default 1,8,32; --quick 1,8)")
    p.add_argument("--requests", type=int, default=None,
                   help="requests per level (default max(8, 2 x concurrency), at least 32 at concurrency 8; "
                        "--quick max(4, concurrency))")
    p.add_argument("--prompt-lengths", default=None, help="min,max prompt tokens (default 64,1024; --quick 32,256)")
    p.add_argument("--max-tokens", type=int, default=None, help="output tokens per request (default 32; --quick 12)")
    p.add_argument("--ref-threads", type=int, default=1, help="torch threads of the reference engine (default 1)")
    p.add_argument("--level-timeout", type=float, default=None,
                   help="seconds after which a level starts no new requests (default 300; --quick 20)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--serve-reference", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.model == "bench":
        args.model = bench_model_dir()
    if args.serve_reference:
        serve_reference(args)
        return

    from tqdm import tqdm

    from engine.model.config import ModelConfig
    from services.up import Child, cluster_args, cluster_threads, start_cluster, stop_cluster

    t_all = time.perf_counter()
    levels = [int(x) for x in (args.concurrency or ("1,8" if args.quick else "1,8,32")).split(",")]
    lo, hi = (int(x) for x in (args.prompt_lengths or ("32,256" if args.quick else "64,1024")).split(","))
    max_tokens = args.max_tokens or (12 if args.quick else 32)
    level_timeout = args.level_timeout or (20.0 if args.quick else 300.0)
    shapes = [tuple(int(x) for x in sh.split("+")) for sh in (args.clusters or ("1+1" if args.quick else "2+2,1+1")).split(",")]
    clusters = [f"cluster {cp}+{dcp}" for cp, dcp in shapes]
    systems = clusters + ["reference"]

    def per_level(c: int) -> int:
        if args.requests:
            return args.requests
        return max(4, c) if args.quick else max(8, 2 * c, 32 if c == 8 else 0)

    vocab = ModelConfig.load(args.model).vocab_size
    prompts = make_prompts(max(per_level(c) for c in levels), lo, hi, vocab, args.seed)

    # Every system starts at once (the reference loads while the clusters' ranks come up).
    t0 = time.perf_counter()
    ref = Child("reference", [], quiet=True, command=[
        sys.executable, os.path.abspath(__file__), "--serve-reference", "--model", args.model,
        "--ref-threads", str(args.ref_threads)])
    spaces = {name: cluster_args(["--model", args.model, "--prefill-cp", str(cp), "--decode-dcp", str(dcp),
                                  "--cp-strategy", "interleave", "--indexer", "copied", "--dcp-comm", "a2a"])
              for name, (cp, dcp) in zip(clusters, shapes)}
    threads = {name: cluster_threads(ns, quiet=True)["prefill"] or 1 for name, ns in spaces.items()}
    running: dict[str, list] = {}
    try:
        print(f"starting {', '.join(clusters)} (router each) and the reference server ...", file=sys.stderr, flush=True)
        startup = {}
        for name in clusters:
            running[name] = start_cluster(spaces[name], 0, None, quiet=True)
            startup[name] = time.perf_counter() - t0
        ref.wait_ready()
        startup["reference"] = ref.ready_at - t0
        urls = {name: f"http://{children[-1].address}" for name, children in running.items()}
        urls["reference"] = f"http://{ref.address}"

        async def warm_up(url: str) -> None:
            import httpx

            async with httpx.AsyncClient(trust_env=False, timeout=120) as client:
                r = await one_request(client, url, args.model, -1, prompts[0][:16], 2)
            if r.error:
                raise RuntimeError(f"warm-up request to {url} failed: {r.error}")

        for name in systems:
            asyncio.run(warm_up(urls[name]))

        stats: dict[tuple[str, int], dict] = {}
        total = len(systems) * sum(per_level(c) for c in levels)
        with tqdm(total=total, desc="requests", unit="req", file=sys.stderr, dynamic_ncols=True) as bar:
            for li, c in enumerate(levels):
                order = systems[li % len(systems):] + systems[:li % len(systems)]  # rotate: share the noise
                for name in order:
                    bar.set_postfix_str(f"{name} c={c}")
                    n = per_level(c)
                    before = router_stages(urls[name])
                    stats[name, c] = asyncio.run(run_level(urls[name], args.model, prompts, n, c, max_tokens,
                                                           level_timeout, bar))
                    stats[name, c]["ttft_stages_ms"] = stage_means_ms(before, router_stages(urls[name]))
                    bar.update(n - stats[name, c]["completed"] - stats[name, c]["failed"])  # not started
    finally:
        t_stop = time.perf_counter()
        # Every service shuts down at once (each takes seconds: gRPC grace, rank groups), then wait.
        every = [child for children in running.values() for child in children]
        for child in [*every, ref]:
            child.signal_stop()
        for children in running.values():
            stop_cluster(children)
        ref.stop()
        shutdown_s = time.perf_counter() - t_stop

    # ---- the engine offline, with each cluster's threads per rank (nothing else running now) ----
    n1 = stats[systems[0], levels[0]]["requests"]
    batch_c = 8 if 8 in levels else max(levels)
    offline = {}
    for t in sorted(set(threads.values())):
        print(f"offline engine, {t} thread(s) ...", file=sys.stderr, flush=True)
        offline[t] = offline_figures(args.model, t, prompts[:n1], prompts[:batch_c], max_tokens)

    # ---- token ids: the same prompt must give the same ids on every system and offline ----------
    compared, mismatches = 0, []

    def compare(what: str, a: dict, b: dict) -> None:
        nonlocal compared
        for i in sorted(set(a) & set(b)):
            compared += 1
            if a[i] != b[i]:
                at = next((k for k, (x, y) in enumerate(zip(a[i], b[i])) if x != y), min(len(a[i]), len(b[i])))
                mismatches.append(f"{what} request {i} ({len(prompts[i])} prompt tokens): first differs at "
                                  f"output {at}")

    for c in levels:
        for name in clusters:
            compare(f"{name} vs reference c={c}", stats[name, c]["_ids"], stats["reference", c]["_ids"])
    for name in clusters:
        compare(f"{name} c={levels[0]} vs offline", stats[name, levels[0]]["_ids"], offline[threads[name]]["_ids"])
    match = compared > 0 and not mismatches

    # ---- tables -----------------------------------------------------------------------------
    rows = []
    for c in levels:
        for name in systems:
            s = stats[name, c]
            rows.append([name, c, s["ttft_ms_median"], s["ttft_ms_p90"], s["tpot_ms_median"], s["throughput_tok_s"],
                         f"{s['completed']}/{s['requests']}"])
    ratios = []
    for c in levels:
        rf = stats["reference", c]
        for name in clusters:
            cl = stats[name, c]
            ratios.append({"system": name, "concurrency": c,
                           "ttft_median": ratio(cl["ttft_ms_median"], rf["ttft_ms_median"]),
                           "ttft_p90": ratio(cl["ttft_ms_p90"], rf["ttft_ms_p90"]),
                           "tpot_median": ratio(cl["tpot_ms_median"], rf["tpot_ms_median"]),
                           "throughput": ratio(cl["throughput_tok_s"], rf["throughput_tok_s"])})
            rows.append([f"{name} / reference", c, ratios[-1]["ttft_median"], ratios[-1]["ttft_p90"],
                         ratios[-1]["tpot_median"], ratios[-1]["throughput"], ""])
    print_table(f"serving over HTTP: {', '.join(clusters)} vs the reference engine behind the router "
                f"({args.ref_threads} thread{'s' if args.ref_threads > 1 else ''}), {args.model}, prompts {lo}-{hi} "
                f"tokens, {max_tokens} output tokens, {os.cpu_count()} CPUs",
                ["system", "concurrency", "TTFT ms median", "TTFT ms p90", "TPOT ms median", "output tok/s",
                 "completed"], rows)

    # each cluster against the engine offline (same threads per rank, same prompts)
    vs_offline, rows = [], []
    for name in clusters:
        off, one = offline[threads[name]], stats[name, levels[0]]
        pre, step = statistics.median(off["prefill_ms"]), statistics.median(off["step_ms"])
        row = {"system": name, "threads_per_rank": threads[name], "offline_prefill_ms": pre, "offline_step_ms": step,
               "ttft_ms": one["ttft_ms_median"], "tpot_ms": one["tpot_ms_median"],
               "ttft_over_offline_prefill": ratio(one["ttft_ms_median"], pre),
               "ttft_minus_1_15x_prefill_ms": one["ttft_ms_median"] - 1.15 * pre,
               "tpot_over_offline_step": ratio(one["tpot_ms_median"], step),
               "offline_batch": off["batch"], "offline_batch_throughput_tok_s": off["batch_throughput_tok_s"]}
        if (name, batch_c) in stats:
            row["throughput_at_batch"] = stats[name, batch_c]["throughput_tok_s"]
            row["throughput_over_offline_generate"] = ratio(row["throughput_at_batch"], off["batch_throughput_tok_s"])
        vs_offline.append(row)
        rows.append([name, threads[name], pre, row["ttft_ms"], row["ttft_over_offline_prefill"],
                     row["ttft_minus_1_15x_prefill_ms"], step, row["tpot_ms"], row["tpot_over_offline_step"],
                     off["batch_throughput_tok_s"], row.get("throughput_at_batch", float("nan")),
                     row.get("throughput_over_offline_generate", float("nan"))])
    print_table(f"each cluster vs the engine offline, concurrency {levels[0]} (TTFT, TPOT) and {batch_c} "
                f"(throughput vs offline generate of {batch_c} prompts)",
                ["system", "threads/rank", "offline prefill ms", "TTFT ms", "TTFT / prefill", "TTFT - 1.15 prefill ms",
                 "offline step ms", "TPOT ms", "TPOT / step", f"offline gen({batch_c}) tok/s", "served tok/s",
                 "served / offline"], rows)
    if len(clusters) > 1:
        tp = {name: stats[name, levels[0]]["tpot_ms_median"] for name in clusters}
        print("TPOT at concurrency", levels[0], ": " + ", ".join(f"{n} {v:.2f} ms" for n, v in tp.items()))

    stage_rows = []
    for name in clusters:
        for c in levels:
            st = stats[name, c]["ttft_stages_ms"]
            stage_rows.append([name, c] + [st.get(k, float("nan")) for k in STAGES + ("ttft",)])
    print_table("where TTFT goes, mean ms per request (router's cpserve_router_ttft_stage_seconds)",
                ["system", "concurrency", *STAGES, "TTFT (router)"], stage_rows)

    for (name, c), s in stats.items():
        if s["failed"] or s["not_started"]:
            print(f"{name} c={c}: {s['failed']} failed, {s['not_started']} not started (level timeout "
                  f"{level_timeout:g} s); {'; '.join(s['errors'])}")
    print(f"token ids: {'MATCH' if match else 'MISMATCH'} — {compared - len(mismatches)}/{compared} requests "
          f"identical (clusters vs reference, and vs the engine offline)")
    for m in mismatches[:5]:
        print(f"  {m}")
    print("start-up (started together): " + ", ".join(f"{k} {v:.1f} s" for k, v in startup.items())
          + f"; shut-down {shutdown_s:.1f} s")

    # ---- plot -------------------------------------------------------------------------------
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(12, 3.6))
    panels = [("ttft_ms_median", "TTFT ms (median)"), ("tpot_ms_median", "TPOT ms (median)"),
              ("throughput_tok_s", "output tokens/s")]
    for name, marker in zip(systems, "os^D"):
        for i, (key, title) in enumerate(panels):
            ax[i].plot(levels, [stats[name, c][key] for c in levels], marker=marker, label=name)
            ax[i].set_title(title)
            ax[i].set_xlabel("concurrency")
            ax[i].set_xscale("log", base=2)
            ax[i].set_xticks(levels, [str(c) for c in levels])
            ax[i].legend(fontsize=8)
    save_plot(fig, args.out, "serving.png")
    wall = time.perf_counter() - t_all
    print(f"wall time: {wall:.1f} s")

    emit_json(args.json, {
        "model": args.model, "ref_threads": args.ref_threads, "cpus": os.cpu_count(), "max_tokens": max_tokens,
        "prompt_lengths": [lo, hi], "quick": args.quick, "startup_s": startup, "shutdown_s": shutdown_s,
        "wall_s": wall,
        "results": [{"system": name, **{k: v for k, v in stats[name, c].items() if k != "_ids"}}
                    for c in levels for name in systems],
        "ratios_over_reference": ratios,
        "vs_offline": vs_offline,
        "offline": {str(t): {k: v for k, v in o.items() if k != "_ids"} for t, o in offline.items()},
        "token_ids_match": match, "token_ids_compared": compared, "token_ids_mismatched": len(mismatches),
    })


def ratio(a: float, b: float) -> float:
    return a / b if b and b == b and a == a else float("nan")


if __name__ == "__main__":
    main()
