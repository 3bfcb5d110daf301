"""Decode cache capacity, measured by filling real pools: tokens resident at a fixed byte budget
per rank, against the formula and against C = 1, and the resident memory each cached token
costs.

    python bench/capacity.py [--quick] [--json] [--budget-mib 12] [--dcp 1,2,4]
                             [--kv-cache-dtypes bf16,fp8,fp8_ds_mla] [--page-size 16]

Every point is a real DCP decode group (``DCPDecodeEngine``, one process per rank, Mooncake TCP)
started with the same ``--kv-cache-memory`` budget per rank — C = 1, 2, 4; copied and split
index (one case at C = 1, where they are the same); bf16, fp8 and fp8_ds_mla — so the pool's
rows are whatever that budget holds in that layout (``pages_in_budget``). It is then filled with
real requests through the real path, as the services run it: ``reserve`` on decode, then a real
CP = 2 prefill group (same cache layout, prefix cache on so that the shared prompt prefix is
computed once) prefills the prompt and writes its KV over Mooncake into the reserved rows. The
fill stops when admission refuses (``NoCapacity``): first with long requests, then with one
virtual page (``page_size`` × C tokens) at a time for the rest. Requests are prompt + 1 new
token; their length leaves half a virtual page empty at the end (the partial last page), which
is 0.5% of a long request.

Reported per point:

- tokens resident (prompt + reserved new token of every admitted request) against the
  formula's tokens for that budget — budget / (E/C + I) with a copied index, budget / ((E + I)/C)
  split, E and I the latent and index bytes per token of the layout (engine/cache/kvformat.py) —
  and against C = 1 of the same layout; fp8 / bf16 tokens against the formula's ratio;
- the pool's real tensor bytes per rank (≤ the budget);
- RSS growth per cached token on each rank, on the pages actually touched: pools are zero
  pages until written (engine/cache/pool.py ``zeroed``), so the pools' resident pages (``mincore``
  over the pool tensors, the rank's ``memory``) grow with what is written; their growth over the fill,
  divided by the tokens resident, against the formula's bytes per token per rank (the busiest
  rank). The whole process's ``VmRSS`` growth is reported too: Mooncake's receive path and
  Python allocate a little as well, so it is an upper bound.

Model: the embedded ``tiny`` (glm_moe_dsa, 4 layers of 64 + 16 latent values, index keys of 32
on 2 layers), so both E and I matter. ``--quick``: C = 1 and 2 (copied) with fp8, 4 MiB per rank.
"""

from __future__ import annotations

import sys
import time

from common import base_parser, emit_json, print_table, proc_status, save_plot

MODEL = "tiny"
PREFILL_CP = 2
LONG_PAGES = 100  # a long request spans this many virtual pages (its last one half full)


def formula(cfg, fmt, dcp: int, indexer: str):
    from engine.cache.capacity import plan_capacity

    index_layers = cfg.num_indexer_layers
    return plan_capacity(fmt.entry_bytes, cfg.num_layers, fmt.index_bytes if index_layers else 0, index_layers,
                         dcp, indexer, None)


def rss(pids: list[int]) -> list[int]:
    return [proc_status(pid)["VmRSS"] for pid in pids]


def fill(pre, dec, base: list[int], span: int, log) -> tuple[int, int]:
    """Admit requests until ``reserve`` refuses: long ones, then one virtual page each. Returns
    (requests, tokens resident)."""
    from engine.handoff import NoCapacity
    from engine.model.sampler import SamplingParams

    params = SamplingParams(max_new_tokens=1, stop_token_ids=())
    requests = tokens = 0
    for length in (LONG_PAGES * span - span // 2, span):  # prompt + 1 new token
        while True:
            prompt = base[: length - 1]
            try:
                dest = dec.reserve(len(prompt), 1)
            except NoCapacity:
                break
            rid = dest.reservation_id
            pre.prefill_to(prompt, params, dest, before_write=lambda: dec.begin_write(rid),
                           after_write=lambda: dec.end_write(rid))
            requests, tokens = requests + 1, tokens + length
        log(f"    {requests} requests, {tokens:,} tokens after {length}-token requests")
    return requests, tokens


def measure(kind: str, dcp: int, indexer: str, budget: int, page_size: int, pre, base: list[int], log) -> dict:
    from engine.decode_engine import DCPDecodeEngine

    t0 = time.perf_counter()
    with DCPDecodeEngine(MODEL, dcp=dcp, indexer=indexer, page_size=page_size, kv_cache_memory=budget,
                         kv_transport="tcp", reference_prefill=False, lease_s=3600, write_lease_s=3600,
                         kv_cache_dtype=kind) as dec:
        pids = dec.group.pids
        before, pool_before = rss(pids), [m["resident_bytes"] for m in dec.group.call("memory")]
        requests, tokens = fill(pre, dec, base, page_size * dcp, log)
        after, mem = rss(pids), dec.group.call("memory")
        touched = [m["resident_bytes"] - b for m, b in zip(mem, pool_before)]
        free_pages = dec.allocator.num_free
        cfg, fmt = dec.cfg, dec.kv_format
    plan = formula(cfg, fmt, dcp, indexer)
    growth = [b - a for a, b in zip(before, after)]
    pool = [m["latent_bytes"] + m["index_bytes"] for m in mem]
    return {"kv_cache_dtype": kind, "dcp": dcp, "indexer": indexer, "budget_bytes": budget,
            "entry_bytes_per_token": plan.entry_bytes, "index_bytes_per_token": plan.index_bytes,
            "formula_bytes_per_token_per_rank": plan.bytes_per_token_per_rank,
            "tokens_formula": budget / plan.bytes_per_token_per_rank, "tokens_resident": tokens,
            "ratio_to_formula": tokens / (budget / plan.bytes_per_token_per_rank), "requests": requests,
            "free_pages_left": free_pages, "pool_bytes_per_rank": pool, "pool_within_budget": max(pool) <= budget,
            "pool_pages_touched_per_rank": touched, "touched_bytes_per_token_per_rank": max(touched) / tokens,
            "touched_to_formula": max(touched) / tokens / plan.bytes_per_token_per_rank,
            "rss_growth_per_rank": growth, "rss_bytes_per_token_per_rank": max(growth) / tokens,
            "rss_to_formula": max(growth) / tokens / plan.bytes_per_token_per_rank,
            "seconds": time.perf_counter() - t0}


def plot(points: list[dict], out_dir: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.5))
    labels = [f"{p['kv_cache_dtype']}\nC{p['dcp']} {p['indexer']}" for p in points]
    xs = range(len(points))
    a.bar([x - 0.2 for x in xs], [p["tokens_resident"] / 1e3 for p in points], 0.4, label="resident (filled)")
    a.bar([x + 0.2 for x in xs], [p["tokens_formula"] / 1e3 for p in points], 0.4, label="formula")
    a.set_xticks(list(xs), labels, fontsize=7)
    a.set_title(f"tokens (k) in {points[0]['budget_bytes'] / 2**20:g} MiB per rank")
    a.legend(fontsize=8)
    b.bar([x - 0.27 for x in xs], [p["touched_bytes_per_token_per_rank"] for p in points], 0.27,
          label="pool pages touched / token")
    b.bar(list(xs), [p["formula_bytes_per_token_per_rank"] for p in points], 0.27, label="formula")
    b.bar([x + 0.27 for x in xs], [p["rss_bytes_per_token_per_rank"] for p in points], 0.27,
          label="process RSS growth / token")
    b.set_xticks(list(xs), labels, fontsize=7)
    b.set_title("bytes per cached token on the busiest rank")
    b.legend(fontsize=8)
    save_plot(fig, out_dir, "capacity.png")


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--budget-mib", type=float, default=12.0, help="cache bytes per rank, MiB (quick: 4)")
    p.add_argument("--dcp", default="1,2,4", help="decode group sizes")
    p.add_argument("--kv-cache-dtypes", default="bf16,fp8,fp8_ds_mla")
    p.add_argument("--page-size", type=int, default=16)
    args = p.parse_args()
    cases = [(kind, c, ind) for kind in args.kv_cache_dtypes.split(",") for c in map(int, args.dcp.split(","))
             for ind in (("copied",) if c == 1 else ("copied", "split"))]
    if args.quick:
        args.budget_mib = min(args.budget_mib, 4.0)
        cases = [("fp8", 1, "copied"), ("fp8", 2, "copied")]
    budget = int(args.budget_mib * 2**20)
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"  {time.perf_counter() - t_start:6.1f}s {msg}", file=sys.stderr, flush=True)

    import torch

    from engine.prefill_engine import CPPrefillEngine

    torch.set_num_threads(1)
    longest = LONG_PAGES * args.page_size * max(c for _, c, _ in cases)
    base = torch.randint(3, 300, (longest,), generator=torch.Generator().manual_seed(0)).tolist()
    points = []
    for kind in dict.fromkeys(k for k, _, _ in cases):
        with CPPrefillEngine(MODEL, cp=PREFILL_CP, kv_transport="tcp", prefix_cache=True, kv_cache_dtype=kind,
                             max_cache_tokens=2 * longest, chunk_size=longest) as pre:
            for k, c, ind in cases:
                if k == kind:
                    log(f"{kind} C{c} {ind}")
                    points.append(measure(kind, c, ind, budget, args.page_size, pre, base, log))
    for pt in points:
        same = [q for q in points if q["kv_cache_dtype"] == pt["kv_cache_dtype"] and q["dcp"] == 1]
        pt["factor_vs_c1"] = pt["tokens_resident"] / same[0]["tokens_resident"] if same else None
        pt["factor_vs_c1_formula"] = (pt["tokens_formula"] / same[0]["tokens_formula"]) if same else None
    ratios = []
    for pt in points:
        bf16 = [q for q in points if q["kv_cache_dtype"] == "bf16" and (q["dcp"], q["indexer"]) ==
                (pt["dcp"], pt["indexer"])]
        if pt["kv_cache_dtype"] != "bf16" and bf16:
            measured = pt["tokens_resident"] / bf16[0]["tokens_resident"]
            expected = pt["tokens_formula"] / bf16[0]["tokens_formula"]
            ratios.append({"kv_cache_dtype": pt["kv_cache_dtype"], "dcp": pt["dcp"], "indexer": pt["indexer"],
                           "tokens_vs_bf16": measured, "formula_vs_bf16": expected, "of_formula": measured / expected})
    runtime = time.perf_counter() - t_start

    print_table(f"decode cache capacity, {budget / 2**20:g} MiB per rank, model {MODEL}, filled by real requests "
                f"(prefill CP {PREFILL_CP} → Mooncake → decode) until admission refuses",
                ["cache", "C", "index", "E B/tok", "I B/tok", "tokens resident", "tokens formula", "resident/formula",
                 "vs C1", "vs C1 formula", "pool MiB/rank", "formula B/tok/rank", "touched B/tok/rank", "touched/formula",
                 "RSS growth B/tok/rank", "requests", "s"],
                [[q["kv_cache_dtype"], q["dcp"], q["indexer"], q["entry_bytes_per_token"], q["index_bytes_per_token"],
                  q["tokens_resident"], q["tokens_formula"], q["ratio_to_formula"], q["factor_vs_c1"] or "-",
                  q["factor_vs_c1_formula"] or "-", max(q["pool_bytes_per_rank"]) / 2**20,
                  q["formula_bytes_per_token_per_rank"], q["touched_bytes_per_token_per_rank"],
                  q["touched_to_formula"], q["rss_bytes_per_token_per_rank"], q["requests"], q["seconds"]]
                 for q in points])
    if ratios:
        print_table("FP8 against bf16 at the same budget, C and index",
                    ["cache", "C", "index", "tokens / bf16's", "formula's ratio", "of the formula's"],
                    [[r["kv_cache_dtype"], r["dcp"], r["indexer"], r["tokens_vs_bf16"], r["formula_vs_bf16"],
                      r["of_formula"]] for r in ratios])
    print(f"runtime {runtime:.1f} s")
    plot(points, args.out)
    min_ratio = min(q["ratio_to_formula"] for q in points)
    ok = min_ratio >= 0.99 and all(r["of_formula"] >= 0.99 for r in ratios) and all(
        q["pool_within_budget"] for q in points)
    emit_json(args.json, {"model": MODEL, "budget_bytes": budget, "page_size": args.page_size,
                          "prefill_cp": PREFILL_CP, "points": points, "fp8_vs_bf16": ratios,
                          "min_ratio_to_formula": min_ratio, "pass": ok, "runtime_s": runtime})


if __name__ == "__main__":
    main()
