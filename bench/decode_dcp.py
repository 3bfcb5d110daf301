"""DCP decode: step latency for C = 1 vs C = 2 (and the C = 2 variants, among them expert
parallelism vs replicated experts). Cache capacity is measured by bench/capacity.py (real pools
filled by real requests).

    python bench/decode_dcp.py [--quick] [--json] [--contexts 8192,32768] [--batch 1]
                               [--steps 16] [--rounds 8] [--synthetic-kv]

Part 1, decode step latency. Every variant is a real ``DCPDecodeEngine`` (one thread per rank)
kept alive for the whole part, so the variants are measured side by side: for each context
length every engine gets the same request(s), then ``--rounds`` rounds of ``steps/rounds``
decode steps are run engine after engine (order rotated each round), after one warm-up step.
Step latency = the diffs of ``seq.token_times`` (the first measured step from the time the
step started); the table gives the median. Prefill is excluded.

- ``dense``: make_tiny deepseek_v3 (no indexer) with kv_lora_rank 512 and small heads, so the
  step is dominated by absorbed attention over the whole cache. Variants: C1, C2 a2a, C2 ag_rs,
  C2 a2a + replicate_q_proj, C2 a2a repl-moe. (No index here: copied vs split does not apply.)
- ``dsa``: make_tiny glm_moe_dsa with the same attention and an indexer (4 heads x 64,
  index_topk 2048 < context, FSFS layers), so decode = indexer over all keys + attention over
  the top-k. Variants: C1, C2 a2a copied, C2 a2a split, C2 a2a copied repl-moe.

Both models keep make_tiny's MoE: layers 1-3 of 4 are MoE (8 routed experts of width 64, top-2,
1 shared expert; hidden 128). Every C2 variant runs with ``moe_parallel="ep"`` (the default:
each rank holds 4 of the 8 experts, applies them to every token and all-reduces a
[T, k+1, H] buffer) except ``repl-moe`` (``moe_parallel="replicate"``: each rank holds all 8,
computes every token's routed experts itself and all-reduces only the shared expert's
tensor-parallel partial, [T, H]). EP vs replicate: the ``repl-moe`` variant and its ep twin
(C2 a2a, resp. C2 a2a copied) run interleaved with the others in the same rounds; the report
gives median step seconds of each, ratio = ep / replicate (> 1: EP is slower) and the bytes
each rank sends per step (the MoE all-reduce is (k+1)x larger with ep) — in a table, as the
last plot panel, and under ``moe_parallel`` in the ``--json`` line (one entry per model and
context: ep_s, replicate_s, ratio, ...). ``--quick`` measures it on the dense model only.

Prompt KV. The one-process reference prefills each (model, context) prompt ONCE in the driver
(``--prefill-threads`` threads); its latent/index rows and first-token logits are then replayed
into every engine through the engine's own path (``DCPRunner`` -> ``load_rows``), so the
ranks hold exactly the rows the reference computed, without paying one 32k reference prefill
per variant. The dsa model's prompt rows are random (``synthetic``) by default, because its
reference prefill at 32k takes minutes here (``--dsa-reference-kv`` to compute them);
``--synthetic-kv`` makes the dense model's rows random too (``--quick`` does, to stay under a
minute: 2k and 4k contexts, C1 vs C2 a2a vs C2 a2a repl-moe, 16 steps in 8 rounds). Decode cost does not depend on the row values (the dsa top-k selects 2048 of N keys
either way).

Breakdown (how a step's time divides): each rank's time in ``DecodeRank.run``
(``runner.rank_seconds``) is split by bench-only wrappers installed in the rank processes
(``CPSERVE_DCP_BENCH_TIMERS``; engine files are not changed): time inside the group's collectives (engine/parallel/comm.py: shared memory, gloo for large ones)
(incl. waiting for the peer), ``gather_rows`` (copying own rows into a padded batch), absorbed
attention math, index selection, exchange merge, and the rest (projections, MLP, Python);
driver = step latency - slowest rank's run time (pipe round trip, plan pickling, sampling).
Two probes of the gloo group itself: an all_reduce of one float back to back, and after 1 ms of
busy compute on each rank — the second stays near the first only if both ranks really get a
core at the same time (on a shared 2-core machine they take turns, and every collective of a
step then costs about the peer's compute slice). And one of the shared-memory collectives a step
actually uses (engine/parallel/comm.py): all_reduce, all_gather and all_to_all of 1 KiB back to
back, the cost of the operation itself when no rank is late (``shm_collective_us``).
"""

from __future__ import annotations

import functools
import os
import statistics
import sys
import time
from collections import defaultdict

from common import base_parser, emit_json, parse_args, print_table, save_plot

_TIMER_ENV = "CPSERVE_DCP_BENCH_TIMERS"
_COLLECTIVES = ("all_gather_single", "all_to_all_single", "reduce_scatter_single", "all_reduce")


# ---- rank-side instrumentation (installed only in the rank processes) ------------------------
def _install_rank_timers() -> None:
    """Exclusive wall-clock timers around the collectives and the attention pieces of a DCP rank,
    plus two inspection methods on DecodeRank (``bench_timers``, ``bench_ping``)."""
    import torch
    import torch.distributed as dist

    import engine.cache.gather as gather
    import engine.parallel.dcp as dcp

    totals: dict[str, float] = defaultdict(float)  # exclusive wall seconds per category
    cpu: dict[str, float] = defaultdict(float)  # exclusive CPU seconds of the calling thread
    counts: dict[str, int] = defaultdict(int)
    stack: list[list[float]] = []
    import engine.parallel.comm as comm


    def timed(category: str, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            frame = [0.0, 0.0]  # children's wall, children's cpu
            stack.append(frame)
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                wall, used = time.perf_counter() - t0, time.thread_time() - c0
                stack.pop()
                totals[category] += wall - frame[0]
                cpu[category] += used - frame[1]
                counts[category] += 1
                if stack:
                    stack[-1][0] += wall
                    stack[-1][1] += used
        return wrapper

    for name in _COLLECTIVES:  # the rank group's collectives (shared memory, or gloo for large ones)
        setattr(comm.Comm, name, timed("comm:" + name, getattr(comm.Comm, name)))
    gather.RowGatherer.__call__ = timed("gather_rows", gather.RowGatherer.__call__)
    gather.absorbed_decode = timed("attention", gather.absorbed_decode)  # RowGatherer.attend calls it
    dcp.DCPKV.decode_select = timed("index_select", dcp.DCPKV.decode_select)
    dcp.DCPKV._exchange = timed("exchange_local", dcp.DCPKV._exchange)
    dcp.DCPKV._gather_heads = timed("q_gather_local", dcp.DCPKV._gather_heads)
    dcp.DecodeRank.run = timed("other", dcp.DecodeRank.run)  # the rest of the step

    def bench_timers(self) -> dict:
        return {"seconds": dict(totals) | {"cpu:" + k: v for k, v in cpu.items()}
                | {"process_cpu": time.process_time()}, "counts": dict(counts)}

    def bench_ping(self, n: int = 200, spin_ms: float = 0.0) -> dict:
        """Median seconds of one gloo all_reduce of 1 float (un-instrumented), with `spin_ms` of
        busy compute before each: if the ranks really run in parallel the all_reduce stays at its
        idle latency; if they share cores it grows towards spin_ms (the peer's turn on the CPU)."""
        x = torch.zeros(1)
        times = []
        for _ in range(n):
            until = time.perf_counter() + spin_ms / 1e3
            while time.perf_counter() < until:
                pass
            t0 = time.perf_counter()
            dist.all_reduce(x, group=self.group)
            times.append(time.perf_counter() - t0)
        return {"median_s": statistics.median(times), "min_s": min(times)}

    def bench_comm(self, n: int = 1000, numel: int = 256) -> dict:
        """Median µs of the group's shared-memory collectives (engine/parallel/comm.py, the
        path a decode step's collectives take) on 1 KiB of fp32, back to back: the cost of one
        operation itself when both ranks arrive together (no waiting for a late peer)."""
        c = self.comm
        x, out = torch.randn(numel), torch.empty(self.world * numel)
        ops = {"all_reduce": lambda: c.all_reduce(x), "all_gather": lambda: c.all_gather_single(out, x),
               "all_to_all": lambda: c.all_to_all_single(out[:numel], x)}
        got = {}
        for name, op in ops.items():
            times = []
            for _ in range(n):
                t0 = time.perf_counter()
                op()
                times.append(time.perf_counter() - t0)
            got[name] = statistics.median(times[n // 10:]) * 1e6
        return got

    dcp.DecodeRank.bench_timers = bench_timers
    dcp.DecodeRank.bench_ping = bench_ping
    dcp.DecodeRank.bench_comm = bench_comm


if os.environ.get(_TIMER_ENV) == "1" and __name__ != "__main__":  # a rank importing us as its main module
    _install_rank_timers()


# ---- models -----------------------------------------------------------------------------------
_ATTN = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=512,
             qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, q_lora_rank=64,
             num_hidden_layers=4, intermediate_size=256)
MODELS = {
    "dense": ("deepseek_v3", dict(_ATTN)),
    "dsa": ("glm_moe_dsa", dict(_ATTN, index_topk=2048, index_head_dim=64, index_n_heads=4)),
}


def model_dir(name: str):
    import json

    from engine.model.tiny import cache_dir, make_tiny

    model_type, overrides = MODELS[name]
    path = cache_dir() / "models" / f"bench-decode-dcp-{name}"
    want = json.dumps([model_type, overrides], sort_keys=True)
    stamp = path / "bench-config.json"
    if not (stamp.is_file() and stamp.read_text() == want):
        make_tiny(path, model_type, **overrides)
        stamp.write_text(want)
    return path


# ---- prompt KV: computed once, replayed into every engine ----------------------------------------
def reference_kv(path, prompt: list[int], threads: int) -> dict:
    """Prefill `prompt` with the one-process reference; return its rows and first logits."""
    import torch

    from engine.model.sampler import SamplingParams
    from engine.reference import ReferenceEngine

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ref = ReferenceEngine(str(path), max_cache_tokens=len(prompt) + 64, record_logits=True)
        seq = ref.add_request(prompt, SamplingParams(max_new_tokens=2, stop_token_ids=()))
        while not seq.output_ids:
            ref.step()
        slots = ref.scheduler.slots(seq, len(prompt))
        pool = ref.pool
        kv = {"latent": {l: pool.latent(l)[slots].clone() for l in range(ref.cfg.num_layers)},
              "index": {l: pool.index(l)[slots].clone() for l in pool.index_layers},
              "logits": seq.logits[0].clone(), "source": "reference"}
        ref.abort(seq)
        return kv
    finally:
        torch.set_num_threads(old)


def synthetic_kv(cfg, n: int, seed: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    return {"latent": {l: torch.randn(n, cfg.latent_dim, generator=g) for l in range(cfg.num_layers)},
            "index": {l: torch.randn(n, cfg.index_head_dim, generator=g) for l in cfg.indexer_layer_ids},
            "logits": torch.randn(cfg.vocab_size, generator=g), "source": "synthetic"}


class ReplayPrefill:
    """Stands in for DCPRunner.prefill: writes stored prompt rows into `pool` at the plan's slots
    (DCPRunner then hands them to the ranks with ``load_rows``) and returns the stored logits."""

    def __init__(self, pool):
        self.pool = pool
        self.kv_of: dict[int, dict] = {}  # req_id -> stored kv
        self.scores: dict = {}  # no prompt scoring here (the runner contract's field)

    def run(self, plan) -> dict:
        out = {}
        for it in plan.items:
            kv = self.kv_of[it.req_id]
            slots = it.slots[it.start : it.end]
            for l, rows in kv["latent"].items():
                self.pool.latent(l)[slots] = rows[it.start : it.end]
            for l, rows in kv["index"].items():
                self.pool.index(l)[slots] = rows[it.start : it.end]
            if it.wants_logits:
                out[it.req_id] = kv["logits"].clone()
        return out


# ---- engines ----------------------------------------------------------------------------------
def start_engines(specs: list[tuple[str, dict]], log, tag: str) -> dict:
    """Start DCPDecodeEngines in parallel threads (overlapping their start-ups shortens the
    wait). Returns {name: engine}."""
    from concurrent.futures import ThreadPoolExecutor

    from engine.decode_engine import DCPDecodeEngine

    t0 = time.perf_counter()

    def start(spec):
        return DCPDecodeEngine(**spec[1])

    engines: dict = {}
    with ThreadPoolExecutor(max(1, len(specs))) as ex:
        futures = [(name, ex.submit(start, (name, kw))) for name, kw in specs]
        errors = []
        for name, f in futures:
            try:
                engines[name] = f.result()
            except Exception as exc:  # noqa: BLE001 — close the others, then re-raise
                errors.append(exc)
    if errors:
        close_engines(engines)
        raise errors[0]
    ranks = sum(e.group.world_size for e in engines.values())
    log(f"[{tag}] started {len(engines)} engine(s), {ranks} rank(s), in {time.perf_counter() - t0:.1f}s")
    return engines


def close_engines(engines: dict) -> None:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max(1, len(engines))) as ex:
        list(ex.map(lambda e: e.close(), engines.values()))


# ---- part 1: decode step latency -----------------------------------------------------------------
def _variants(model: str, quick: bool) -> list[tuple[str, dict]]:
    if model == "dense":
        v = [("C1", dict(dcp=1)), ("C2 a2a", dict(dcp=2, exchange="a2a", moe_parallel="ep")),
             ("C2 a2a repl-moe", dict(dcp=2, exchange="a2a", moe_parallel="replicate"))]
        if not quick:
            v += [("C2 ag_rs", dict(dcp=2, exchange="ag_rs")),
                  ("C2 a2a repl-q", dict(dcp=2, exchange="a2a", replicate_q_proj=True))]
        return v
    return [("C1", dict(dcp=1)), ("C2 a2a copied", dict(dcp=2, exchange="a2a", indexer="copied", moe_parallel="ep")),
            ("C2 a2a split", dict(dcp=2, exchange="a2a", indexer="split")),
            ("C2 a2a copied repl-moe", dict(dcp=2, exchange="a2a", indexer="copied", moe_parallel="replicate"))]


# (model, ep variant, replicate variant): the EP vs replicated-experts pairs, measured side by side
MOE_PAIRS = [("dense", "C2 a2a", "C2 a2a repl-moe"), ("dsa", "C2 a2a copied", "C2 a2a copied repl-moe")]


def _snapshot(eng) -> list[dict[str, float]]:
    """Per rank: {category: wall s, "cpu:" + category: cpu s, "n:" + category: calls, process_cpu}."""
    return [dict(t["seconds"]) | {"n:" + k: float(v) for k, v in t["counts"].items()}
            for t in eng.group.call("bench_timers")]


def _delta(after: list[dict], before: list[dict]) -> list[dict[str, float]]:
    return [{k: a.get(k, 0.0) - b.get(k, 0.0) for k in a} for a, b in zip(after, before)]


COMPUTE = ("attention", "gather_rows", "index_select", "exchange_local", "q_gather_local", "other")


def _breakdown(t: dict[str, float], steps: int) -> dict[str, float]:
    """ms per step of one rank from its timer deltas."""
    ms = lambda x: x / steps * 1e3  # noqa: E731
    comm = sum(v for k, v in t.items() if k.startswith("comm:"))
    comm_cpu = sum(v for k, v in t.items() if k.startswith("cpu:comm:"))
    compute = sum(t.get(k, 0.0) for k in COMPUTE)
    compute_cpu = sum(t.get("cpu:" + k, 0.0) for k in COMPUTE)
    return {
        "attention": ms(t.get("attention", 0.0)), "gather_rows": ms(t.get("gather_rows", 0.0)),
        "index_select": ms(t.get("index_select", 0.0)),
        "exchange_local": ms(t.get("exchange_local", 0.0) + t.get("q_gather_local", 0.0)),
        "other": ms(t.get("other", 0.0)), "comm": ms(comm), "comm_cpu": ms(comm_cpu),
        "compute": ms(compute), "compute_cpu": ms(compute_cpu),
        "descheduled": ms(compute - compute_cpu), "process_cpu": ms(t.get("process_cpu", 0.0)),
        # CPU of the rank's other threads (gloo's I/O threads) and of its command loop
        "outside_cpu": ms(t.get("process_cpu", 0.0) - compute_cpu - comm_cpu),
        "collectives": sum(v for k, v in t.items() if k.startswith("n:comm:")) / steps,
    }


def plan_pickle_cost(ctx: int, batch: int) -> dict:
    """What the driver pickles per decode step and rank (with the group's own pickler,
    engine/parallel/group.py ``dumps``): a request's first plan carries its whole slot list,
    later ones (``SlotSync``, engine/plan.py) only the step's new slot."""
    import pickle

    import torch

    from engine.parallel.group import dumps
    from engine.plan import DecodeItem, SlotSync, StepPlan

    def cost(plan) -> tuple[int, float]:
        msg = ("call", "run", (plan, False), {})
        t0 = time.perf_counter()
        for _ in range(20):
            data = dumps(msg)
            pickle.loads(data)
        return len(data), (time.perf_counter() - t0) / 20 * 1e3

    sync = SlotSync()
    first = sync.wire(StepPlan("decode", [DecodeItem(i, 5, ctx, torch.arange(ctx + 1)) for i in range(batch)]))
    later = sync.wire(StepPlan("decode", [DecodeItem(i, 5, ctx + 1, torch.arange(ctx + 2)) for i in range(batch)]))
    (b_first, ms_first), (b_later, ms_later) = cost(first), cost(later)
    return {"bytes": b_first, "pickle_unpickle_ms": ms_first, "later_bytes": b_later, "later_pickle_unpickle_ms": ms_later}


def _decode_shape(args) -> tuple[int, int, int]:
    """(steps per round, max_new_tokens per request, max_cache_tokens of every engine)."""
    per_round = max(1, args.steps // args.rounds)
    new_tokens = 2 + per_round * args.rounds + 2
    return per_round, new_tokens, args.batch * (max(args.contexts) + new_tokens + args.page_size * 2)


def decode_specs(model: str, args) -> list[tuple[str, dict]]:
    max_tokens = _decode_shape(args)[2]
    return [(name, dict(model=str(model_dir(model)), max_cache_tokens=max_tokens, page_size=args.page_size,
                        threads_per_rank=1, reference_prefill=False, **kw))
            for name, kw in _variants(model, args.quick)]


def bench_model(model: str, args, log, engines: dict | None = None) -> list[dict]:
    """Part 1 for one model; `engines` ({variant: engine} from decode_specs) are started here
    if not given, and closed here either way."""
    import torch

    from engine.cache.pool import KVPool
    from engine.cache.slots import pages_needed
    from engine.model.config import ModelConfig
    from engine.model.sampler import SamplingParams

    path = model_dir(model)
    cfg = ModelConfig.from_dir(path)
    contexts, batch = args.contexts, args.batch
    per_round, new_tokens, max_tokens = _decode_shape(args)
    variants = _variants(model, args.quick)
    if engines is None:
        engines = start_engines(decode_specs(model, args), log, model)
    results: list[dict] = []
    try:
        replays = {}
        for name, kw in variants:  # the prompt rows go in through the engine's prefill path
            rows = pages_needed(max_tokens, args.page_size, kw["dcp"]) * args.page_size * kw["dcp"]
            replays[name] = ReplayPrefill(KVPool(cfg, rows, torch.float32))
            engines[name].runner.prefill = replays[name]
        kw_of = dict(variants)
        held = {name: [w["expert_bytes"] for w in eng.group.call("weights")] for name, eng in engines.items()}
        ping = {name: (eng.group.call("bench_ping", 200)[0], eng.group.call("bench_ping", 100, 1.0)[0],
                       eng.group.call("bench_comm")[0])
                for name, eng in engines.items() if eng.group.world_size > 1}
        for ctx in contexts:
            prompt = torch.randint(3, cfg.vocab_size, (ctx,), generator=torch.Generator().manual_seed(ctx)).tolist()
            t0 = time.perf_counter()
            synthetic = args.synthetic_kv or (model == "dsa" and not args.dsa_reference_kv)
            kv = synthetic_kv(cfg, ctx, ctx) if synthetic else reference_kv(path, prompt, args.prefill_threads)
            log(f"[{model}] ctx {ctx}: prompt KV ({kv['source']}) in {time.perf_counter() - t0:.1f}s")
            seqs: dict[str, list] = {}
            for name, eng in engines.items():
                t0 = time.perf_counter()
                seqs[name] = []
                for _ in range(batch):
                    s = eng.add_request(prompt, SamplingParams(max_new_tokens=new_tokens, stop_token_ids=()))
                    replays[name].kv_of[s.id] = kv
                    seqs[name].append(s)
                while any(not s.output_ids for s in seqs[name]):
                    eng.step()  # prefill: stored rows -> DCPRunner -> load_rows on the ranks
                eng.step()  # warm-up decode step
                log(f"[{model}] ctx {ctx}: {name} rows loaded + warm-up step in {time.perf_counter() - t0:.1f}s")
            del kv
            lat = {n: [] for n in engines}
            rank_s = {n: [0.0] * engines[n].group.world_size for n in engines}
            timers = {n: [defaultdict(float) for _ in range(engines[n].group.world_size)] for n in engines}
            sent = {n: [0] * engines[n].group.world_size for n in engines}
            sent_experts = {n: [0] * engines[n].group.world_size for n in engines}
            order = list(engines)
            load0 = os.getloadavg()[0]
            for r in range(args.rounds):
                for name in order[r % len(order):] + order[: r % len(order)]:
                    eng, s0 = engines[name], seqs[name][0]
                    t_before, st_before = _snapshot(eng), eng.group.call("stats")
                    rs_before = list(eng.runner.rank_seconds)
                    n0 = len(s0.token_times)
                    t_start = time.perf_counter()
                    for _ in range(per_round):
                        eng.step()
                    tt = [t_start] + s0.token_times[n0:]
                    lat[name] += [b - a for a, b in zip(tt, tt[1:])]
                    for i, (a, b) in enumerate(zip(eng.runner.rank_seconds, rs_before)):
                        rank_s[name][i] += a - b
                    for i, d in enumerate(_delta(_snapshot(eng), t_before)):
                        for k, v in d.items():
                            timers[name][i][k] += v
                    for i, (a, b) in enumerate(zip(eng.group.call("stats"), st_before)):
                        sent[name][i] += sum(a.values()) - sum(b.values())
                        sent_experts[name][i] += a.get("experts", 0) - b.get("experts", 0)
            load1 = os.getloadavg()[0]
            pickle_cost = plan_pickle_cost(ctx, batch)
            for name, eng in engines.items():
                for s in seqs[name]:
                    eng.abort(s)
                n_steps, world = len(lat[name]), eng.group.world_size
                slowest = max(range(world), key=lambda i: rank_s[name][i])
                bd = _breakdown(timers[name][slowest], n_steps)
                run_ms = rank_s[name][slowest] / n_steps * 1e3
                bd["driver"] = sum(lat[name]) / n_steps * 1e3 - run_ms
                results.append({
                    "model": model, "context": ctx, "batch": batch, "variant": name, "dcp": world,
                    "steps": n_steps, "median_ms": statistics.median(lat[name]) * 1e3,
                    "mean_ms": sum(lat[name]) / n_steps * 1e3,
                    "min_ms": min(lat[name]) * 1e3, "max_ms": max(lat[name]) * 1e3,
                    "rank_run_ms": [x / n_steps * 1e3 for x in rank_s[name]],
                    "breakdown_ms": bd,
                    "bytes_sent_per_rank_per_step": [x / n_steps for x in sent[name]],
                    "expert_bytes_sent_per_rank_per_step": [x / n_steps for x in sent_experts[name]],
                    "moe_parallel": kw_of[name].get("moe_parallel", "ep"),
                    "expert_weight_bytes_per_rank": held[name],
                    "gloo_allreduce_latency_ms": ping[name][0]["median_s"] * 1e3 if name in ping else None,
                    "gloo_allreduce_after_1ms_compute_ms": ping[name][1]["median_s"] * 1e3 if name in ping else None,
                    "shm_collective_us": ping[name][2] if name in ping else None,
                    "comm_ms_all_ranks": [_breakdown(t, n_steps)["comm"] for t in timers[name]],
                    "process_cpu_ms_all_ranks": [_breakdown(t, n_steps)["process_cpu"] for t in timers[name]],
                    "plan_pickle": pickle_cost, "loadavg_1m": [load0, load1],
                })
                log(f"[{model}] ctx {ctx}: {name}: median {results[-1]['median_ms']:.1f} ms/step")
    finally:
        close_engines(engines)
    return results


def _collectives_per_step(variant: str, cfg) -> int:
    """Collectives one rank issues per decode step, read off engine/parallel/dcp.py."""
    if variant == "C1":
        return 0
    per_layer = 2  # all-reduce after o_proj and after the MLP
    per_layer += 0 if "repl-q" in variant else 1  # query all-gather
    per_layer += 2 if "ag_rs" in variant else 1  # a2a, or LSE all-gather + reduce-scatter
    return per_layer * cfg.num_layers + (cfg.num_indexer_layers if "split" in variant else 0)


# ---- report -----------------------------------------------------------------------------------
def _plot(results, moe, out_dir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in results}, key=lambda m: list(MODELS).index(m))
    ncols = len(models) + 2
    fig, ax = plt.subplots(1, ncols, figsize=(4.6 * ncols, 4.2))
    for i, m in enumerate(models):
        rs = [r for r in results if r["model"] == m]
        ctxs = sorted({r["context"] for r in rs})
        names = list(dict.fromkeys(r["variant"] for r in rs))
        w = 0.8 / len(names)
        for j, n in enumerate(names):
            ys = [next(r["median_ms"] for r in rs if r["context"] == c and r["variant"] == n) for c in ctxs]
            ax[i].bar([x + j * w for x in range(len(ctxs))], ys, w, label=n)
        ax[i].set_xticks([x + 0.4 - w / 2 for x in range(len(ctxs))], [f"{c // 1024}k" for c in ctxs])
        ax[i].set_title(f"{m}: median decode step (ms)")
        ax[i].set_xlabel("context tokens")
        ax[i].legend(fontsize=7)
    longest = max(r["context"] for r in results)
    rs = [r for r in results if r["context"] == longest]
    parts = [("attention", "attention"), ("gather_rows", "gather_rows copy"), ("index_select", "index select"),
             ("exchange_local", "exchange merge"), ("other", "other rank compute"), ("comm", "in collectives"),
             ("driver", "driver + pipe")]
    bottom = [0.0] * len(rs)
    b = ax[len(models)]
    for k, label in parts:
        ys = [max(r["breakdown_ms"][k], 0.0) for r in rs]
        b.bar(range(len(rs)), ys, 0.7, bottom=bottom, label=label)
        bottom = [x + y for x, y in zip(bottom, ys)]
    b.set_xticks(range(len(rs)), [f"{r['model']}\n{r['variant']}" for r in rs], fontsize=6, rotation=45)
    b.set_title(f"a step at {longest // 1024}k, slowest rank (ms, mean)")
    b.legend(fontsize=6)
    e = ax[len(models) + 1]
    if moe:
        xs = range(len(moe))
        e.bar(list(xs), [m["ratio"] for m in moe], 0.6, color="tab:purple")
        for x, m in zip(xs, moe):
            e.text(x, m["ratio"], f"{m['ratio']:.2f}\n{m['ep_s'] * 1e3:.1f}/{m['replicate_s'] * 1e3:.1f} ms",
                   ha="center", va="bottom", fontsize=7)
        e.axhline(1.0, color="k", lw=0.8)
        e.set_xticks(list(xs), [f"{m['model']} {m['context'] // 1024}k" for m in moe], fontsize=8)
        e.margins(y=0.25)
    e.set_title("C2 step: moe_parallel ep / replicate")
    e.set_ylabel("median step ratio (> 1: EP slower)")
    return save_plot(fig, out_dir, "decode_dcp.png")


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--contexts", default="8192,32768", help="context lengths (default 8192,32768; quick 2048,4096)")
    p.add_argument("--batch", type=int, default=1, help="requests decoded together (same prompt)")
    p.add_argument("--steps", type=int, default=16, help="measured decode steps per variant and context")
    p.add_argument("--rounds", type=int, default=8, help="interleaving rounds the steps are split into")
    p.add_argument("--models", default="dense,dsa", help="dense and/or dsa (quick: dense)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--prefill-threads", type=int, default=2, help="threads of the driver's reference prefill")
    p.add_argument("--synthetic-kv", action="store_true", help="random prompt rows for the dense model too "
                   "(default with --quick)")
    p.add_argument("--dsa-reference-kv", action="store_true", help="reference-prefill the dsa prompts (slow)")
    args = parse_args(p, {"contexts": "2048,4096", "models": "dense", "synthetic_kv": True})
    args.contexts = [int(x) for x in args.contexts.split(",")]
    models = [m for m in args.models.split(",") if m]
    for m in models:
        if m not in MODELS:
            p.error(f"--models: unknown {m!r}; expected dense and/or dsa")

    # before any group starts: the rank server, and so every rank, inherits it (_install_rank_timers)
    os.environ[_TIMER_ENV] = "1"
    import torch

    torch.set_num_threads(1)
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"  {time.perf_counter() - t_start:6.1f}s {msg}", file=sys.stderr, flush=True)

    from engine.model.config import ModelConfig

    first_engines = None
    try:
        results = []
        for i, m in enumerate(models):
            results += bench_model(m, args, log, first_engines if i == 0 else None)
    finally:
        if first_engines:
            close_engines(first_engines)  # closed already unless something failed (idempotent)
    t_total = time.perf_counter() - t_start

    # table 1: step latency and where it goes
    rows = []
    for r in results:
        base = next(x for x in results if (x["model"], x["context"], x["variant"]) == (r["model"], r["context"], "C1"))
        cfg = ModelConfig.from_dir(model_dir(r["model"]))
        bd = r["breakdown_ms"]
        rows.append([r["model"], r["context"], r["variant"], r["median_ms"], r["min_ms"],
                     base["median_ms"] / r["median_ms"],
                     max(r["rank_run_ms"]), bd["attention"] + bd["gather_rows"], bd["gather_rows"], bd["index_select"],
                     bd["other"] + bd["exchange_local"], bd["descheduled"], bd["comm"],
                     f"{bd['collectives']:.0f} ({_collectives_per_step(r['variant'], cfg)})",
                     bd["driver"], sum(r["process_cpu_ms_all_ranks"]),
                     max(r["bytes_sent_per_rank_per_step"]) / 1024])
    print_table(f"DCP decode step latency: batch {args.batch}, median of {results[0]['steps']} steps "
                f"(variants interleaved), 1 thread/rank, fp32. Breakdown: slowest rank, mean ms/step",
                ["model", "ctx", "variant", "median", "min", "C1/it", "rank run", "attn+copy", "gather_rows", "index",
                 "other", "desched", "in colls", "colls (exp)", "driver", "CPU all ranks", "KiB sent"], rows)
    print("  columns (ms/step unless noted): rank run = slowest rank inside DecodeRank.run; attn+copy = "
          "gather_rows copy + absorbed attention; index = top-k selection (comm excluded); other = projections, "
          "MLP, norms, exchange merge, Python; desched = compute wall - thread CPU (waiting for a core); "
          "in colls = inside collectives (incl. waiting for the peer); driver = step - rank run "
          "(plan, pipe, sampling); CPU all ranks = process CPU time summed over ranks; KiB sent = per rank")

    # table 2: ratios measured side by side
    ratio_rows, ratios = [], []
    pairs = [("dense", "C1", "C2 a2a", "C2 speed-up (C1 / C2 a2a)"),
             ("dense", "C2 ag_rs", "C2 a2a", "a2a speed-up over ag_rs"),
             ("dense", "C2 a2a", "C2 a2a repl-q", "replicate_q_proj speed-up"),
             ("dsa", "C1", "C2 a2a copied", "C2 speed-up, copied index"),
             ("dsa", "C1", "C2 a2a split", "C2 speed-up, split index"),
             ("dsa", "C2 a2a copied", "C2 a2a split", "split speed-up over copied")]
    pairs += [(model, ep, repl, "EP / replicated experts (ep/replicate)") for model, ep, repl in MOE_PAIRS]
    for model, slow, fast, label in pairs:
        for ctx in args.contexts:
            a = next((r for r in results if (r["model"], r["context"], r["variant"]) == (model, ctx, slow)), None)
            b = next((r for r in results if (r["model"], r["context"], r["variant"]) == (model, ctx, fast)), None)
            if a and b:
                ratio_rows.append([model, ctx, label, slow, a["median_ms"], fast, b["median_ms"],
                                   a["median_ms"] / b["median_ms"]])
                ratios.append({"model": model, "context": ctx, "ratio": label, "a": slow, "b": fast,
                               "value": a["median_ms"] / b["median_ms"]})
    print_table("ratios of median step latency (> 1: the second variant is faster)",
                ["model", "ctx", "ratio", "first", "ms", "second", "ms", "first/second"], ratio_rows)

    # table 2b: EP vs replicated experts, the same rounds
    moe, moe_rows = [], []
    for model, ep, repl in MOE_PAIRS:
        for ctx in args.contexts:
            a = next((r for r in results if (r["model"], r["context"], r["variant"]) == (model, ctx, ep)), None)
            b = next((r for r in results if (r["model"], r["context"], r["variant"]) == (model, ctx, repl)), None)
            if not (a and b):
                continue
            moe.append({
                "model": model, "context": ctx, "dcp": a["dcp"], "batch": args.batch, "steps": a["steps"],
                "ep_variant": ep, "replicate_variant": repl,
                "ep_s": a["median_ms"] / 1e3, "replicate_s": b["median_ms"] / 1e3,
                "ratio": a["median_ms"] / b["median_ms"],
                "ep_mean_s": a["mean_ms"] / 1e3, "replicate_mean_s": b["mean_ms"] / 1e3,
                "mean_ratio": a["mean_ms"] / b["mean_ms"],
                "ep_rank_run_ms": max(a["rank_run_ms"]), "replicate_rank_run_ms": max(b["rank_run_ms"]),
                "ep_comm_ms": a["breakdown_ms"]["comm"], "replicate_comm_ms": b["breakdown_ms"]["comm"],
                "ep_bytes_sent_per_rank_per_step": max(a["bytes_sent_per_rank_per_step"]),
                "replicate_bytes_sent_per_rank_per_step": max(b["bytes_sent_per_rank_per_step"]),
                "ep_expert_bytes_sent_per_rank_per_step": max(a["expert_bytes_sent_per_rank_per_step"]),
                "replicate_expert_bytes_sent_per_rank_per_step": max(b["expert_bytes_sent_per_rank_per_step"]),
                "ep_expert_weight_bytes_per_rank": max(a["expert_weight_bytes_per_rank"]),
                "replicate_expert_weight_bytes_per_rank": max(b["expert_weight_bytes_per_rank"])})
            m = moe[-1]
            moe_rows.append([model, ctx, ep, a["median_ms"], b["median_ms"], m["ratio"], m["mean_ratio"],
                             f"{m['ep_rank_run_ms']:.1f} / {m['replicate_rank_run_ms']:.1f}",
                             f"{m['ep_comm_ms']:.1f} / {m['replicate_comm_ms']:.1f}",
                             f"{m['ep_expert_bytes_sent_per_rank_per_step'] / 1024:.1f} / "
                             f"{m['replicate_expert_bytes_sent_per_rank_per_step'] / 1024:.1f}",
                             f"{m['ep_expert_weight_bytes_per_rank'] / 2**20:.2f} / "
                             f"{m['replicate_expert_weight_bytes_per_rank'] / 2**20:.2f}"])
    if moe_rows:
        print_table("moe_parallel ep vs replicate, C2, same rounds (3 of 4 layers MoE: 8 experts top-2 + 1 shared); "
                    "ep/repl > 1: EP is slower",
                    ["model", "ctx", "ep variant", "ep median ms", "repl median ms", "ep/repl", "ep/repl (mean)",
                     "rank run ms ep / repl", "in colls ms ep / repl", "MoE all-reduce KiB/step ep / repl",
                     "expert weights MiB/rank ep / repl"], moe_rows)

    pings = [r["gloo_allreduce_latency_ms"] for r in results if r["gloo_allreduce_latency_ms"]]
    if pings:
        per_coll = [r["breakdown_ms"]["comm"] / r["breakdown_ms"]["collectives"] for r in results
                    if r["breakdown_ms"]["collectives"]]
        spun = [r["gloo_allreduce_after_1ms_compute_ms"] for r in results if r["gloo_allreduce_latency_ms"]]
        print(f"gloo all_reduce of 1 float, median: back to back {min(pings):.3f}-{max(pings):.3f} ms; after 1 ms "
              f"of compute on each rank {min(spun):.3f}-{max(spun):.3f} ms (~{min(pings):.2f} if both ranks have a "
              f"core, ~1 if they take turns); inside decode steps {min(per_coll):.2f}-{max(per_coll):.2f} ms per "
              f"collective (incl. waiting for the peer)")
        shm = [r["shm_collective_us"] for r in results if r["shm_collective_us"]]
        print("shared-memory collectives of 1 KiB back to back (the op itself, no late peer), median µs: "
              + ", ".join(f"{op} {min(x[op] for x in shm):.1f}-{max(x[op] for x in shm):.1f}" for op in shm[0]))
    for ctx in args.contexts:
        pc = next(r["plan_pickle"] for r in results if r["context"] == ctx)
        print(f"decode plan per rank at {ctx}: a request's first step {pc['bytes'] / 1024:.0f} KiB pickled "
              f"({pc['pickle_unpickle_ms']:.2f} ms to pickle + unpickle), later steps {pc['later_bytes']} B "
              f"({pc['later_pickle_unpickle_ms']:.3f} ms)")
    loads = [x for r in results for x in r["loadavg_1m"]]
    print(f"1-minute load average during the measurements: {min(loads):.1f}-{max(loads):.1f} "
          f"({os.cpu_count()} CPUs)")

    print(f"runtime: {t_total:.1f}s")
    _plot(results, moe, args.out)
    emit_json(args.json, {"batch": args.batch, "threads_per_rank": 1, "contexts": args.contexts,
                          "models": {m: MODELS[m][1] | {"model_type": MODELS[m][0]} for m in models},
                          "decode": results, "ratios": ratios,
                          "moe_parallel": {"measure": "median decode step seconds, variants interleaved in the "
                                                      "same rounds; ratio = ep / replicate", "results": moe},
                          "runtime_s": {"total": t_total}})


if __name__ == "__main__":
    main()
