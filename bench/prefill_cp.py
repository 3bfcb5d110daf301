"""Prefill context parallelism (CP): load balance of the layouts, C=1 vs C=2 prefill time,
all-gather bytes against the formula, C=2 prefill time with expert parallelism (EP) against
replicated experts, ring attention against the all-gather, and ring pass-KV against pass-Q over
a cached prefix — all measured in one run (``--parts`` picks some: b and c run together).

    python bench/prefill_cp.py [--quick] [--json] [--parts abcdef] [--lengths 4096,16384]
                               [--strategies zigzag,interleave] [--repeats 1] [--balance-tokens 131072]
                               [--balance-cp 8] [--moe-repeats 4]
                               [--ring-lengths 4096,16384,65536] [--ring-cp 2,3,4] [--ring-repeats 3]
                               [--sweep-tokens 16384] [--sweep-cp 2] [--sweep-fractions 1/256,1/64,1/16,1/4,1/2,1]
                               [--sweep-repeats 3] [--sweep-model dense|dsa]

(a) Balance. Per-rank causal query-key pairs (``RankLayout.pairs`` from
    ``engine.parallel.layout.split_batch``) of one prompt of 131,072 tokens over C = 8 ranks, for
    interleave, zigzag and contiguous; max/mean against the targets (zigzag 1.000, interleave
    <= 1.001, contiguous (2C-1)/C = 1.875).

(b) Scaling. Prefill of the same prompt on a C=1 group and on a C=2 group (one thread per rank,
    so C=2 uses both cores of this machine and C=1 one: the same compute per rank), warm-up
    first, chunk_size >= the prompt (one forward, no chunking). T = max over ranks of the
    per-rank forward seconds (``CPRunner.rank_seconds`` deltas); the wall TTFT is shown next to
    it. Scaling efficiency = T1 / (2 * T2); target >= 0.8 at 16k. Each rank's CPU seconds (from
    /proc) are shown too: CPU share = CPU s / forward s (below ~0.95 the rank was off-CPU: other
    processes on the cores, or waiting for its peer), and a CPU-seconds efficiency, which says
    whether CP splits the work even when the machine is shared. With --repeats, the fastest
    prefill of each engine is reported. One C=1 engine and one C=2
    engine per strategy serve every length (group start-ups are the expensive part), and all
    engines stay open so C=1 and C=2 run back to back for each length.

    The model is a tiny ``glm_moe_dsa`` checkpoint made "wide" so that attention dominates:
    8 heads with q/k head dim 96 (64 nope + 32 rope) and v head dim 64, so every query-key pair
    costs 2*8*(96+64) = 2,560 flops, while hidden 128, a 128-wide dense MLP (no routed experts),
    q/kv LoRA ranks 64 and 2 layers keep the per-token linear work near 0.5 Mflop per layer.
    A query at position p reads p+1 keys (the engine's masked SDPA even computes the whole
    1,024-query x L-key rectangle), so attention is >= 90% of the flops at 4k and >= 97% at 16k.
    ``index_topk`` (131,072) exceeds every prompt, so the DSA selection keeps every causal key:
    attention is dense, yet the model keeps an indexer layer ("full", stores index keys) and a
    "shared" layer, so part (c) checks both kinds of all-gather entry. The indexer (2 heads x
    64) adds ~10% more quadratic work on layer 0, split by CP like the attention.

(c) All-gather bytes. ``stats`` ``gathered_bytes`` deltas over one C=2 prefill against the
    formula: per layer every rank receives C * max_tokens_per_rank rows (the padded
    all-gather output) of (latent_dim + index_head_dim on indexer layers) * 4 bytes (fp32).
    Reported as padded bytes (the formula; should equal the measurement) and useful bytes
    (tokens x entry bytes), and their ratio. An odd-length prompt is added so the zigzag
    padding shows.

(d) EP vs replicated experts. The wide model of (b) has no routed experts, so this part uses its
    own MoE checkpoint (``MOE_MODEL``: make_tiny deepseek_v3, 4 layers of which 3 are MoE with 8
    routed experts, top-2, 1 shared expert, hidden 256, expert width 256, unrestricted routing
    (n_group 1), and small attention: 2 heads, q/k head dim 32, v 16). Two C=2 engines of it
    (first strategy of --strategies), one with ``moe_parallel="ep"`` (each rank holds 4 of the
    8 experts; every MoE layer sends each token row to its experts' owner and back with two
    uneven gloo all-to-alls) and one with ``moe_parallel="replicate"`` (each rank holds all 8 and
    computes its own tokens locally: no expert traffic), prefill the same prompt at each of the
    --lengths, alternating which goes first (ABBA...) for --moe-repeats runs each (quick: 2),
    after a warm-up. Reported: the fastest TTFT (wall s) of each and ratio = ep / replicate
    (> 1: EP is slower), the median over the runs paired in time of ep / replicate (less swayed
    by one lucky run), the same for the forward time T (max rank forward s), the expert
    all-to-all bytes each rank sent (``stats`` ``expert_bytes``), and an estimate of the share of
    the forward's flops in the MoE layers (experts x 3 matmuls; attention counted as causal
    pairs, so the share falls with the length: ~60% at 4k, ~1/3 at 16k). The ratio is the cost
    of moving the routed rows (what EP buys: each rank loads half the experts, see
    ``weights_held``), here on a loopback gloo group (CPU) with one thread per rank. ``--json``: under
    ``moe_parallel``, one entry per length (``results``: tokens, cp, ep_s, replicate_s, ratio, ...).

(e) Ring vs all-gather. For each C of --ring-cp, two fresh engines of the wide model of (b)
    (interleave layout, i.e. striped by position under the ring; C ranks x max(1, cores // C)
    threads, so with C > cores the ranks share cores; chunk_size >= the prompt): an all-gather one
    and a ring one with ``cp_ring_mode="pass_kv"`` (the acceptance bound is about pass-KV). After a
    warm-up, each prompt length of --ring-lengths (ascending) is prefilled by the two alternately
    (ABAB...) --ring-repeats times; TTFT = wall seconds of ``generate([prompt], max_new_tokens=1)``.
    Reported per (length, C):
    - the median TTFT of each and ring / all-gather (target <= 1.05 at 16k and 64k, C = 2);
    - resident cache bytes per rank: the largest rank's ``cache_bytes`` ``resident`` (mincore: the
      pool's pages written) after the first prefill of that length. Pages are handed out lowest
      first and the lengths ascend, so that is this prompt's footprint. Given for both engines,
      with ring / all-gather (~1/C), and for the ring against the acceptance bound
      (ceil(N/C) + one page) rows x bytes per row, plus the OS pages each per-layer slice of the
      pool straddles (the ring's in-flight blocks are not pool memory);
    - the hidden-communication fraction of the ring forward, from ``stats`` deltas summed over the
      ring runs: hidden = 1 - ring_exposed_s / (ring_bytes x byte_s), clamped to [0, 1].
      ring_exposed_s is the time a rank waited for a transfer after its attention to the block in
      hand was done, ring_bytes what it sent round the ring, and byte_s the slowest rank's
      measured seconds per byte sent round the ring (``RingCosts.byte_s``: what an auto engine
      measures at start-up, measured here once per ring engine). A rank also waits there for a
      slower peer's block, so imbalance or ranks sharing cores (C > cores) lower it. Also
      ring_hidden_steps / ring_steps: the steps whose transfer was complete when attention was;
    - "auto picks": what ``cp_ring_mode="auto"`` would run for that prompt (``ring_estimates``
      with those costs), not timed: a fresh prompt is (f)'s point T/(T+P) = 1.
    ``--json``: under ``ring``.

(f) Pass-KV vs pass-Q. A history of N = --sweep-tokens tokens at C = --sweep-cp is split into a
    cached prefix of P tokens and a turn of T new ones, for each T/(T+P) of --sweep-fractions. P
    is rounded down to the page span page_size x C, so all of it is cached and the turn computes
    exactly T = N - P tokens; points that round alike run once. Three ring engines with
    prefix_cache=True, one per ``cp_ring_mode`` (pass_kv, pass_q, auto), each prefill the prefix
    (longest first, so after the first point it is already cached), then time turns: the prefix
    plus T fresh random tokens (a new suffix every run, so the turn itself is never cached; the
    pool holds every page, so nothing is evicted; each run checks ``seq.num_cached == P``). The
    three engines run in rotated order, --sweep-repeats times; the median per mode is reported.
    Per point: pass-KV s, pass-Q s, the faster, auto's pick (``runner.modes`` delta) and its s,
    auto / min(pass-KV, pass-Q) (target <= 1.10 at every point), the selector's per-layer
    estimates (``ring_estimates`` with the auto engine's ``ring_costs``) and its pick. Then the
    measured crossover (the first T/(T+P) where pass-Q stops being faster, linear in
    log T/(T+P) between the two points around it) beside the formula's (where ``ring_estimates``
    at fixed N stops preferring pass-Q: a scan over T, then bisection).
    The default model (--sweep-model dense) has the wide model's shapes as deepseek_v3, without
    the indexer; --sweep-model dsa keeps it (its index_topk, 131,072, exceeds every history, so
    the selection is every causal key and pass-Q sends no picks: ``pick_width``).
    ``--json``: under ``ring_sweep``.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import statistics
import tempfile
import time

from common import base_parser, emit_json, parse_args, print_table, save_plot

BALANCE_TARGETS = {"zigzag": ("== 1.000", lambda r, c: abs(r - 1.0) < 1e-9),
                   "interleave": ("<= 1.001", lambda r, c: r <= 1.001),
                   "contiguous": ("(2C-1)/C", None)}
EFFICIENCY_TARGET = 0.8
FP32_BYTES = 4
WIDE_MODEL = dict(
    num_hidden_layers=2, hidden_size=128, intermediate_size=128, first_k_dense_replace=2, n_routed_experts=0,
    num_attention_heads=8, num_key_value_heads=8, q_lora_rank=64, kv_lora_rank=64,
    qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
    index_topk=131072, index_head_dim=64, index_n_heads=2,
    indexer_types=["full", "shared"], mlp_layer_types=["dense", "dense"],
)
MOE_TYPE = "deepseek_v3"
MOE_MODEL = dict(
    num_hidden_layers=4, first_k_dense_replace=1, hidden_size=256, intermediate_size=256,
    moe_intermediate_size=256, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
    n_group=1, topk_group=1, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=64, kv_lora_rank=64,
    qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
)
MOE_PARALLEL = ("ep", "replicate")
# (f)'s default model: the wide shapes without the indexer (see the module docstring)
DENSE_WIDE_MODEL = {k: v for k, v in WIDE_MODEL.items()
                    if not k.startswith("index") and k not in ("indexer_types", "mlp_layer_types")}
CORES = os.cpu_count() or 1
PAGE_SIZE = 16
RING_TTFT_BOUND = 1.05  # ring pass-KV TTFT / all-gather TTFT at RING_ACCEPTANCE's (tokens, C)
RING_ACCEPTANCE = {(16384, 2), (65536, 2)}
AUTO_BOUND = 1.10  # auto's TTFT / the faster of pass-KV and pass-Q, every sweep point
RING_PAIR = ("allgather", "ring")
SWEEP_MODES = ("pass_kv", "pass_q", "auto")


# ---------------------------------------------------------------------------------- (a)

def part_a(num_tokens: int, cp: int) -> tuple[list[list], dict]:
    from engine.parallel.layout import split_batch

    rows, figures = [], {"tokens": num_tokens, "cp": cp, "layouts": {}}
    for strategy in ("interleave", "zigzag", "contiguous"):
        layout = split_batch([num_tokens], [0], cp, strategy)
        pairs = [r.pairs for r in layout.ranks]
        mean = sum(pairs) / cp
        ratio = max(pairs) / mean
        label, check = BALANCE_TARGETS[strategy]
        target = (2 * cp - 1) / cp
        ok = abs(ratio - target) < 1e-3 if check is None else check(ratio, cp)
        label = f"{label} = {target:.3f}" if check is None else label
        rows.append([strategy, " ".join(f"{p / 1e9:.3f}" for p in pairs), f"{max(pairs) / 1e9:.3f}",
                     f"{mean / 1e9:.3f}", f"{ratio:.4f}", label, "yes" if ok else "NO"])
        figures["layouts"][strategy] = {"pairs_per_rank": pairs, "max": max(pairs), "mean": mean,
                                        "max_over_mean": ratio, "target": label, "meets_target": ok}
    return rows, figures


# ---------------------------------------------------------------------------------- (b), (c)

def make_prompt(n: int, vocab: int, seed: int) -> list[int]:
    import torch

    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (Linux /proc; NaN elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return float("nan")


def prefill(engine, prompt: list[int]) -> dict:
    """One prefill (max_new_tokens=1): per-rank forward seconds, wall TTFT, gathered-byte deltas,
    and each rank's CPU share (CPU seconds / forward seconds: < 1 means it waited, on a peer or
    on other processes competing for the cores)."""
    from engine.model.sampler import SamplingParams

    before_s = list(engine.runner.rank_seconds)
    before_b = [s["gathered_bytes"] for s in engine.group.call("stats")]
    before_cpu = [cpu_seconds(pid) for pid in engine.group.pids]
    seq = engine.generate([prompt], SamplingParams(max_new_tokens=1, stop_token_ids=()))[0]
    cpu = [cpu_seconds(pid) - b for pid, b in zip(engine.group.pids, before_cpu)]
    rank_s = [a - b for a, b in zip(engine.runner.rank_seconds, before_s)]
    gathered = [s["gathered_bytes"] - b for s, b in zip(engine.group.call("stats"), before_b)]
    return {"rank_s": rank_s, "t": max(rank_s), "ttft_s": seq.ttft_ms / 1e3, "gathered_bytes": gathered,
            "cpu_s": cpu, "cpu_share": [c / t for c, t in zip(cpu, rank_s)]}


def gather_formula(cfg, n: int, cp: int, strategy: str) -> dict:
    """Bytes each rank receives from the all-gathers of one prefill of n new tokens (no prefix)."""
    from engine.parallel.layout import split_batch

    width = split_batch([n], [0], cp, strategy).max_tokens_per_rank
    entry = [(cfg.latent_dim + (cfg.index_head_dim if layer in cfg.indexer_layer_ids else 0)) * FP32_BYTES
             for layer in range(cfg.num_layers)]
    padded = sum(cp * width * e for e in entry)
    useful = sum(n * e for e in entry)
    return {"tokens": n, "max_tokens_per_rank": width, "entry_bytes_per_layer": entry,
            "padded_bytes_per_layer": [cp * width * e for e in entry],
            "useful_bytes_per_layer": [n * e for e in entry],
            "padded_bytes": padded, "useful_bytes": useful, "padded_over_useful": padded / useful}


def parts_b_c(lengths: list[int], strategies: list[str], repeats: int, odd_length: int):
    from engine.model.config import ModelConfig
    from engine.model.tiny import make_tiny
    from engine.prefill_engine import CPPrefillEngine

    rows_b, rows_c = [], []
    fig_b = {"model": {"model_type": "glm_moe_dsa", **WIDE_MODEL}, "threads_per_rank": 1, "repeats": repeats,
             "target_efficiency_at_largest": EFFICIENCY_TARGET, "results": []}
    fig_c = {"results": []}
    startup_s = {}
    with tempfile.TemporaryDirectory(prefix="cpserve-bench-") as tmp, contextlib.ExitStack() as stack:
        model_dir = make_tiny(f"{tmp}/wide", "glm_moe_dsa", seed=0, **WIDE_MODEL)
        cfg = ModelConfig.from_dir(model_dir)
        top = max(lengths + [odd_length])
        common = dict(model=str(model_dir), layer_split=False, dtype="fp32", chunk_size=top, page_size=16,
                      max_cache_tokens=2 * top + 1024, threads_per_rank=1)
        engines = {}
        for key, cp, strategy in [("C=1", 1, strategies[0])] + [(f"C=2 {s}", 2, s) for s in strategies]:
            t0 = time.perf_counter()
            engines[key] = stack.enter_context(CPPrefillEngine(cp=cp, strategy=strategy, **common))
            startup_s[key] = time.perf_counter() - t0
        warm = make_prompt(256, cfg.vocab_size, 1)
        for engine in engines.values():
            prefill(engine, warm)
        for n in lengths:
            prompt = make_prompt(n, cfg.vocab_size, n)
            runs = {key: [] for key in engines}
            for _ in range(repeats):  # C=1 and C=2 back to back, so background load hits both alike
                for key, engine in engines.items():
                    runs[key].append(prefill(engine, prompt))
            best1 = min(runs["C=1"], key=lambda r: r["t"])
            t1, ttft1 = best1["t"], min(r["ttft_s"] for r in runs["C=1"])
            for s in strategies:
                key = f"C=2 {s}"
                best2 = min(runs[key], key=lambda r: r["t"])
                t2, ttft2 = best2["t"], min(r["ttft_s"] for r in runs[key])
                eff, eff_wall = t1 / (2 * t2), ttft1 / (2 * ttft2)
                eff_cpu = best1["cpu_s"][0] / (2 * max(best2["cpu_s"]))
                rows_b.append([n, s, t1, t2, " / ".join(f"{x:.2f}" for x in best2["rank_s"]), eff, ttft1, ttft2,
                               eff_wall, f"{best1['cpu_share'][0]:.2f}",
                               " / ".join(f"{x:.2f}" for x in best2["cpu_share"]), eff_cpu])
                fig_b["results"].append({
                    "tokens": n, "strategy": s, "t1_s": t1, "t2_s": t2,
                    "t1_runs_s": [r["t"] for r in runs["C=1"]], "t2_runs_s": [r["t"] for r in runs[key]],
                    "t2_rank_s": best2["rank_s"], "ttft1_s": ttft1, "ttft2_s": ttft2,
                    "efficiency": eff, "efficiency_wall": eff_wall,
                    "cpu_s_c1": best1["cpu_s"], "cpu_s_c2": best2["cpu_s"], "efficiency_cpu": eff_cpu,
                    "cpu_share_c1": best1["cpu_share"], "cpu_share_c2": best2["cpu_share"]})
                for r in runs[key][:1]:
                    rows_c.append(c_row(cfg, n, s, r, fig_c))
        odd = make_prompt(odd_length, cfg.vocab_size, odd_length)
        for s in strategies:
            rows_c.append(c_row(cfg, odd_length, s, prefill(engines[f"C=2 {s}"], odd), fig_c))
    fig_b["startup_s"] = startup_s
    largest = [r for r in fig_b["results"] if r["tokens"] == max(lengths)]
    # the headline is wall time: TTFT of C=1 over 2 x TTFT of C=2 (what a client sees)
    fig_b["efficiency_at_largest"] = {r["strategy"]: r["efficiency_wall"] for r in largest}
    return rows_b, fig_b, rows_c, fig_c


def c_row(cfg, n: int, strategy: str, run: dict, fig_c: dict) -> list:
    f = gather_formula(cfg, n, 2, strategy)
    measured = run["gathered_bytes"]
    match = all(m == f["padded_bytes"] for m in measured)
    fig_c["results"].append({"strategy": strategy, "cp": 2, **f, "measured_bytes_per_rank": measured,
                             "matches_formula": match})
    return [n, strategy, f["max_tokens_per_rank"], "+".join(str(e) for e in f["entry_bytes_per_layer"]),
            " / ".join(f"{m:,}" for m in measured), f"{f['padded_bytes']:,}", "yes" if match else "NO",
            f"{f['useful_bytes']:,}", f"{f['padded_over_useful']:.5f}"]


# ---------------------------------------------------------------------------------- (d)

def flop_estimate(cfg, n: int) -> dict:
    """Forward flops per token of an n-token prompt (one forward, no prefix): MoE layers (routed
    + shared experts), dense MLPs, attention (causal pairs: (n+1)/2 keys a query) and the MLA
    projections."""
    h = cfg.hidden_size
    moe_layers = sum(cfg.is_moe_layer(l) for l in range(cfg.num_layers))
    experts = moe_layers * (cfg.num_experts_per_tok + cfg.n_shared_experts) * 3 * h * cfg.moe_intermediate_size * 2
    dense = (cfg.num_layers - moe_layers) * 3 * h * cfg.intermediate_size * 2
    heads = cfg.num_heads
    attn = cfg.num_layers * (n + 1) / 2 * heads * (cfg.qk_head_dim + cfg.v_head_dim) * 2
    q_out = heads * cfg.qk_head_dim
    q = h * cfg.q_lora_rank + cfg.q_lora_rank * q_out if cfg.q_lora_rank else h * q_out
    proj = cfg.num_layers * 2 * (q + h * cfg.latent_dim
                                 + cfg.kv_lora_rank * heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
                                 + heads * cfg.v_head_dim * h)
    total = experts + dense + attn + proj
    return {"experts": experts, "dense_mlp": dense, "attention": attn, "projections": proj,
            "moe_share": experts / total}


def start_prefill_engines(specs: dict[str, dict]) -> dict:
    """Start CPPrefillEngines in parallel threads (their start-ups overlap)."""
    from concurrent.futures import ThreadPoolExecutor

    from engine.prefill_engine import CPPrefillEngine

    with ThreadPoolExecutor(len(specs)) as ex:
        futures = {key: ex.submit(CPPrefillEngine, **kw) for key, kw in specs.items()}
    engines, errors = {}, []
    for key, f in futures.items():
        try:
            engines[key] = f.result()
        except Exception as exc:  # noqa: BLE001 — close the others, then re-raise
            errors.append(exc)
    if errors:
        for e in engines.values():
            e.close()
        raise errors[0]
    return engines


def part_d(lengths: list[int], strategy: str, repeats: int) -> tuple[list[list], dict]:
    """C=2 prefill with moe_parallel ep vs replicate, alternated (see the module docstring)."""
    from engine.model.config import ModelConfig
    from engine.model.tiny import make_tiny

    rows = []
    fig = {"model": {"model_type": MOE_TYPE, **MOE_MODEL}, "cp": 2, "strategy": strategy, "repeats": repeats,
           "threads_per_rank": 1,
           "measure": "fastest TTFT (wall s) of one C=2 prefill per engine; ratio = ep / replicate",
           "results": []}
    with tempfile.TemporaryDirectory(prefix="cpserve-bench-moe-") as tmp:
        model_dir = make_tiny(f"{tmp}/moe", MOE_TYPE, seed=0, **MOE_MODEL)
        cfg = ModelConfig.from_dir(model_dir)
        if not any(cfg.is_moe_layer(l) for l in range(cfg.num_layers)):
            raise RuntimeError("part (d): the MoE model has no MoE layers")
        top = max(lengths)
        common = dict(model=str(model_dir), cp=2, strategy=strategy, dtype="fp32", chunk_size=top, page_size=16,
                      max_cache_tokens=2 * top + 1024, threads_per_rank=1)
        t0 = time.perf_counter()
        engines = start_prefill_engines({m: dict(common, moe_parallel=m) for m in MOE_PARALLEL})
        fig["startup_s"] = time.perf_counter() - t0
        try:
            # what each rank holds (``weights_held``): EP halves the expert bytes at C=2
            fig["weights_held"] = {m: e.group.call("weights") for m, e in engines.items()}
            warm = make_prompt(256, cfg.vocab_size, 1)
            for engine in engines.values():
                prefill(engine, warm)
            for n in lengths:
                prompt = make_prompt(n, cfg.vocab_size, n)
                runs = {m: [] for m in MOE_PARALLEL}
                for i in range(repeats):  # ABBA...: each order as often, so drift hits both alike
                    for m in (MOE_PARALLEL if i % 2 == 0 else MOE_PARALLEL[::-1]):
                        before = [s["expert_bytes"] for s in engines[m].group.call("stats")]
                        r = prefill(engines[m], prompt)
                        r["expert_bytes"] = [s["expert_bytes"] - b
                                             for s, b in zip(engines[m].group.call("stats"), before)]
                        runs[m].append(r)
                best = {m: min(runs[m], key=lambda r: r["ttft_s"]) for m in MOE_PARALLEL}
                fwd = {m: min(r["t"] for r in runs[m]) for m in MOE_PARALLEL}
                ep_s, rep_s = best["ep"]["ttft_s"], best["replicate"]["ttft_s"]
                est = flop_estimate(cfg, n)
                low = min(min(r["cpu_share"]) for m in MOE_PARALLEL for r in runs[m])
                ratios = [a["ttft_s"] / b["ttft_s"] for a, b in zip(runs["ep"], runs["replicate"])]
                fig["results"].append({
                    "tokens": n, "cp": 2, "ep_s": ep_s, "replicate_s": rep_s, "ratio": ep_s / rep_s,
                    "ep_forward_s": fwd["ep"], "replicate_forward_s": fwd["replicate"],
                    "forward_ratio": fwd["ep"] / fwd["replicate"],
                    "ep_runs_s": [r["ttft_s"] for r in runs["ep"]],
                    "replicate_runs_s": [r["ttft_s"] for r in runs["replicate"]],
                    "paired_ratios": ratios, "ratio_median_of_pairs": statistics.median(ratios),
                    "ep_expert_bytes_per_rank": best["ep"]["expert_bytes"],
                    "replicate_expert_bytes_per_rank": best["replicate"]["expert_bytes"],
                    "ep_rank_s": best["ep"]["rank_s"], "replicate_rank_s": best["replicate"]["rank_s"],
                    "min_cpu_share": low, "flops_per_token": est, "moe_flop_share": est["moe_share"]})
                rows.append([n, ep_s, rep_s, ep_s / rep_s, fwd["ep"], fwd["replicate"], fwd["ep"] / fwd["replicate"],
                             " ".join(f"{x:.2f}" for x in ratios), statistics.median(ratios),
                             " / ".join(f"{b / 2**20:.1f}" for b in best["ep"]["expert_bytes"]),
                             f"{est['moe_share']:.0%}", f"{low:.2f}"])
        finally:
            for e in engines.values():
                e.close()
    return rows, fig


# ---------------------------------------------------------------------------------- (e)

def wide_model(tmp: str, positions: int, dense: bool = False):
    """The wide checkpoint of (b) under ``tmp``, for prompts of up to ``positions`` - 1 tokens
    (one more is sampled); ``dense``: the same shapes as deepseek_v3 (no indexer)."""
    from engine.model.tiny import make_tiny

    longest = max(131072, positions)  # the tiny default, raised for a --ring-lengths 131072 run
    if dense:
        return make_tiny(f"{tmp}/wide-dense", "deepseek_v3", seed=0, max_position_embeddings=longest,
                         **DENSE_WIDE_MODEL)
    return make_tiny(f"{tmp}/wide", "glm_moe_dsa", seed=0, max_position_embeddings=longest, **WIDE_MODEL)


def pick(est: dict[str, float]) -> str:
    """The mode ``cp_ring_mode="auto"`` runs for these ``ring_estimates`` (the engine's rule)."""
    from engine.parallel.ring import pick_ring_mode
    return pick_ring_mode(est)


def timed_prefill(engine, prompt: list[int]) -> dict:
    """One ``generate([prompt], max_new_tokens=1)``: wall seconds, the ``stats`` deltas per rank,
    the ring modes chosen (``runner.modes`` delta) and the prompt tokens found cached."""
    from engine.model.sampler import SamplingParams
    from engine.parallel.prefill_cp import RING_STATS

    keys = ("gathered_bytes", *RING_STATS)
    before, modes = engine.group.call("stats"), dict(engine.runner.modes)
    t0 = time.perf_counter()
    seq = engine.generate([prompt], SamplingParams(max_new_tokens=1, stop_token_ids=()))[0]
    wall = time.perf_counter() - t0
    after = engine.group.call("stats")
    return {"s": wall, "num_cached": seq.num_cached,
            "stats": [{k: a[k] - b[k] for k in keys} for a, b in zip(after, before)],
            "modes": {m: n - modes.get(m, 0) for m, n in engine.runner.modes.items() if n > modes.get(m, 0)}}


def hidden_fraction(runs: list[dict], byte_s: float) -> dict:
    """Over ``runs``' ring forwards: per rank 1 − exposed_s / (ring_bytes · byte_s), clamped to
    [0, 1] (the transfer time estimated from the measured bandwidth), the same over all ranks
    summed, and the share of ring steps whose transfer was done when attention was."""
    ranks = len(runs[0]["stats"])
    exposed = [sum(r["stats"][k]["ring_exposed_s"] for r in runs) for k in range(ranks)]
    transfer = [sum(r["stats"][k]["ring_bytes"] for r in runs) * byte_s for k in range(ranks)]
    steps = sum(s["ring_steps"] for r in runs for s in r["stats"])
    hidden_steps = sum(s["ring_hidden_steps"] for r in runs for s in r["stats"])

    def frac(e, t):
        return min(1.0, max(0.0, 1.0 - e / t)) if t > 0 else None

    return {"hidden": frac(sum(exposed), sum(transfer)),
            "hidden_per_rank": [frac(e, t) for e, t in zip(exposed, transfer)],
            "exposed_s_per_rank": exposed, "transfer_s_per_rank": transfer,
            "ring_bytes_per_rank": [sum(r["stats"][k]["ring_bytes"] for r in runs) for k in range(ranks)],
            "hidden_steps": hidden_steps, "steps": steps, "hidden_step_share": hidden_steps / steps if steps else None}


def resident(engine) -> dict:
    """The largest rank's pool bytes resident now (mincore) and its bytes per row (all layers)."""
    per_rank = engine.group.call("cache_bytes")
    return {"resident_bytes": max(c["resident"] for c in per_rank),
            "resident_per_rank": [c["resident"] for c in per_rank],
            "row_bytes": per_rank[0]["persistent"] // per_rank[0]["rows"]}


def part_e(lengths: list[int], cps: list[int], repeats: int) -> tuple[list[list], dict]:
    """Ring (pass-KV) vs all-gather prefill per (length, C), alternated (see the module docstring)."""
    from engine.model.config import ModelConfig

    lengths = sorted(lengths)  # ascending: each prompt is the largest so far, so "resident" is its footprint
    rows = []
    fig = {"model": {"model_type": "glm_moe_dsa", **WIDE_MODEL}, "cores": CORES, "repeats": repeats,
           "page_size": PAGE_SIZE, "bound": RING_TTFT_BOUND, "threads_per_rank": {}, "startup_s": {},
           "ring_costs": {}, "results": []}
    with tempfile.TemporaryDirectory(prefix="cpserve-bench-ring-") as tmp:
        model_dir = wide_model(tmp, max(lengths) + 1)
        cfg = ModelConfig.from_dir(model_dir)
        segments = cfg.num_layers + len(cfg.indexer_layer_ids)  # pool tensors' per-layer slices
        top = max(lengths)
        for cp in cps:
            threads = max(1, CORES // cp)
            common = dict(model=str(model_dir), cp=cp, strategy="interleave", dtype="fp32", chunk_size=top,
                          page_size=PAGE_SIZE, max_cache_tokens=2 * top + 1024, threads_per_rank=threads)
            t0 = time.perf_counter()
            engines = start_prefill_engines({"allgather": dict(common, cp_attention="allgather"),
                                             "ring": dict(common, cp_attention="ring", cp_ring_mode="pass_kv")})
            fig["startup_s"][cp], fig["threads_per_rank"][cp] = time.perf_counter() - t0, threads
            try:
                # what an auto engine measures at start-up: byte_s is the slowest rank's
                costs = engines["ring"].measure_ring_costs()
                fig["ring_costs"][cp] = costs.__dict__
                warm = make_prompt(256, cfg.vocab_size, 1)
                for engine in engines.values():
                    timed_prefill(engine, warm)
                for n in lengths:
                    prompt = make_prompt(n, cfg.vocab_size, n)
                    runs, held = {k: [] for k in RING_PAIR}, {}
                    for i in range(repeats):  # ABAB...: each order as often, so drift hits both alike
                        for key in (RING_PAIR if i % 2 == 0 else RING_PAIR[::-1]):
                            runs[key].append(timed_prefill(engines[key], prompt))
                            if i == 0:
                                held[key] = resident(engines[key])
                    rows.append(e_row(n, cp, threads, runs, held, costs, segments, fig))
            finally:
                for e in engines.values():
                    e.close()
    checked = [r for r in fig["results"] if r["acceptance_point"]]
    fig["meets_bound"] = all(r["meets_bound"] for r in checked) if checked else None
    return rows, fig


def e_row(n: int, cp: int, threads: int, runs: dict, held: dict, costs, segments: int, fig: dict) -> list:
    from engine.parallel.ring import ring_estimates

    ag = statistics.median(r["s"] for r in runs["allgather"])
    ring = statistics.median(r["s"] for r in runs["ring"])
    ratio = ring / ag
    at = (n, cp) in RING_ACCEPTANCE
    hid = hidden_fraction(runs["ring"], costs.byte_s)
    res_ag, res_ring = held["allgather"]["resident_bytes"], held["ring"]["resident_bytes"]
    # the acceptance bound: ⌈N/C⌉ + one page of rows of every layer, plus the OS pages that each
    # per-layer slice of the pool tensors straddles at its two ends
    bound = (-(-n // cp) + PAGE_SIZE) * held["ring"]["row_bytes"] + 2 * segments * mmap.PAGESIZE
    est = ring_estimates([n], [0], cp, costs)  # a fresh prompt: what auto would weigh
    fig["results"].append({
        "tokens": n, "cp": cp, "threads_per_rank": threads, "allgather_s": ag, "ring_pass_kv_s": ring, "ratio": ratio,
        "allgather_runs_s": [r["s"] for r in runs["allgather"]], "ring_runs_s": [r["s"] for r in runs["ring"]],
        "acceptance_point": at, "meets_bound": ratio <= RING_TTFT_BOUND,
        "resident_allgather_bytes": res_ag, "resident_ring_bytes": res_ring, "resident_ratio": res_ring / res_ag,
        "resident_ring_per_rank": held["ring"]["resident_per_rank"], "row_bytes": held["ring"]["row_bytes"],
        "resident_ring_bound_bytes": bound, "resident_ring_within_bound": res_ring <= bound,
        "gathered_bytes_per_rank": [s["gathered_bytes"] for s in runs["allgather"][0]["stats"]],
        "byte_s": costs.byte_s, **hid, "auto_estimates_s_per_layer": est, "auto_pick": pick(est)})
    return [n, cp, ag, ring, ratio, ("yes" if ratio <= RING_TTFT_BOUND else "NO") if at else "—",
            " | ".join(" ".join(f"{r['s']:.2f}" for r in runs[k]) for k in RING_PAIR),
            f"{res_ag / 2**20:.2f}", f"{res_ring / 2**20:.2f}", f"{res_ring / res_ag:.3f}",
            "yes" if res_ring <= bound else "NO", "—" if hid["hidden"] is None else f"{hid['hidden']:.2f}",
            f"{hid['hidden_steps']}/{hid['steps']}", pick(est)]


# ---------------------------------------------------------------------------------- (f)

def sweep_points(n: int, fractions: list[float], span: int) -> list[tuple[int, int, float]]:
    """(T, P, nominal fraction) per point, P rounded down to the page span (so the whole prefix
    is cached and the turn computes exactly T = N − P tokens), in ascending T; points that
    round to the same P are kept once."""
    out, seen = [], set()
    for f in sorted(fractions):
        t0 = max(1, round(f * n))
        p = (n - t0) // span * span
        if p not in seen:
            seen.add(p)
            out.append((n - p, p, f))
    return out


def crossover(xs: list[float], q_minus_kv: list[float]) -> float | None:
    """The first x where pass_q stops being faster (q_minus_kv goes from < 0 to >= 0), linear
    in log x between the two points around it; None if there is no such change."""
    for (x0, d0), (x1, d1) in zip(zip(xs, q_minus_kv), zip(xs[1:], q_minus_kv[1:])):
        if d0 < 0 <= d1:
            w = -d0 / (d1 - d0)
            return math.exp(math.log(x0) + w * (math.log(x1) - math.log(x0)))
    return None


def formula_crossover(n: int, cp: int, costs) -> tuple[float | None, str]:
    """T/N where ``ring_estimates`` (history N = T + P fixed) stops preferring pass_q: a scan of
    T over [1, N] (log-spaced), then bisection inside the first change; (None, why) if none."""
    from engine.parallel.ring import ring_estimates

    def gap(t: float) -> float:  # < 0: auto picks pass_q
        est = ring_estimates([t], [n - t], cp, costs)
        return est["pass_q"] - est["pass_kv"]

    ts = [math.exp(math.log(n) * i / 400) for i in range(401)]
    for lo, hi in zip(ts, ts[1:]):
        if gap(lo) < 0 <= gap(hi):
            for _ in range(60):
                mid = (lo + hi) / 2
                lo, hi = (mid, hi) if gap(mid) < 0 else (lo, mid)
            return hi / n, ""
    faster = {gap(t) < 0 for t in ts}
    if faster == {True}:
        return None, "the formula prefers pass-Q at every T <= N"
    return None, "the formula prefers pass-KV at every T" if faster == {False} else "no change from pass-Q to pass-KV"


def part_f(n: int, cp: int, fractions: list[float], repeats: int, dense: bool) -> tuple[list[list], dict]:
    """A turn of T new tokens over a cached prefix P (T + P = N): pass-KV, pass-Q and auto, one
    engine each (see the module docstring)."""
    from engine.model.config import ModelConfig
    from engine.parallel.ring import ring_estimates

    span = PAGE_SIZE * cp
    points = sweep_points(n, fractions, span)
    rows = []
    model = {"model_type": "deepseek_v3", **DENSE_WIDE_MODEL} if dense else {"model_type": "glm_moe_dsa", **WIDE_MODEL}
    fig = {"model": model, "tokens": n, "cp": cp, "repeats": repeats, "page_span": span, "bound": AUTO_BOUND,
           "threads_per_rank": max(1, CORES // cp), "results": []}
    with tempfile.TemporaryDirectory(prefix="cpserve-bench-sweep-") as tmp:
        model_dir = wide_model(tmp, n + 1, dense)
        cfg = ModelConfig.from_dir(model_dir)
        # room for the history and every turn's pages, so nothing is evicted
        capacity = n + sum(repeats * (t + span) for t, _, _ in points) + 256 + 4 * span
        common = dict(model=str(model_dir), cp=cp, strategy="interleave", dtype="fp32", chunk_size=n,
                      page_size=PAGE_SIZE, max_cache_tokens=capacity, threads_per_rank=fig["threads_per_rank"],
                      cp_attention="ring", prefix_cache=True)
        t0 = time.perf_counter()
        engines = start_prefill_engines({m: dict(common, cp_ring_mode=m) for m in SWEEP_MODES})
        fig["startup_s"] = time.perf_counter() - t0
        try:
            costs = engines["auto"].ring_costs
            fig["ring_costs"] = costs.__dict__
            for engine in engines.values():
                timed_prefill(engine, make_prompt(256, cfg.vocab_size, 1))
            history = make_prompt(n, cfg.vocab_size, n)
            for k, (t, p, nominal) in enumerate(points):
                for engine in engines.values():  # the prefix, cached (from a longer one: nearly free)
                    if p:
                        timed_prefill(engine, history[:p])
                runs = {m: [] for m in SWEEP_MODES}
                for i in range(repeats):
                    turn = history[:p] + make_prompt(t, cfg.vocab_size, 10_000 * (k + 1) + i)  # fresh every run
                    for m in SWEEP_MODES[i % len(SWEEP_MODES):] + SWEEP_MODES[:i % len(SWEEP_MODES)]:  # rotated
                        runs[m].append(timed_prefill(engines[m], turn))
                rows.append(f_row(t, p, nominal, runs, ring_estimates([t], [p], cp, costs), fig))
        finally:
            for e in engines.values():
                e.close()
    res = fig["results"]
    xs = [r["fraction"] for r in res]
    fig["crossover_measured"] = crossover(xs, [r["pass_q_s"] - r["pass_kv_s"] for r in res])
    fig["crossover_formula"], fig["crossover_formula_note"] = formula_crossover(n, cp, costs)
    fig["pass_q_faster_at"] = [r["fraction"] for r in res if r["faster"] == "pass_q"]
    fig["formula_pass_q_at"] = [r["fraction"] for r in res if r["estimate_pick"] == "pass_q"]
    fig["auto_within_bound_everywhere"] = all(r["auto_within_bound"] for r in res)
    fig["prefix_cached_everywhere"] = all(r["prefix_cached"] for r in res)
    return rows, fig


def f_row(t: int, p: int, nominal: float, runs: dict, est: dict, fig: dict) -> list:
    med = {m: statistics.median(r["s"] for r in runs[m]) for m in SWEEP_MODES}
    best = min(med["pass_kv"], med["pass_q"])
    faster = "pass_q" if med["pass_q"] < med["pass_kv"] else "pass_kv"
    picks: dict[str, int] = {}
    for r in runs["auto"]:
        for m, c in r["modes"].items():
            picks[m] = picks.get(m, 0) + c
    ran = "+".join(sorted(picks)) or "?"
    cached = all(r["num_cached"] == p for m in SWEEP_MODES for r in runs[m])
    est_pick = pick(est)
    ratio = med["auto"] / best
    fig["results"].append({
        "fraction": t / (t + p), "fraction_nominal": nominal, "new_tokens": t, "cached_tokens": p,
        "prefix_cached": cached, "num_cached": sorted({r["num_cached"] for m in SWEEP_MODES for r in runs[m]}),
        "pass_kv_s": med["pass_kv"], "pass_q_s": med["pass_q"], "auto_s": med["auto"],
        **{f"{m}_runs_s": [r["s"] for r in runs[m]] for m in SWEEP_MODES},
        "faster": faster, "auto_pick": ran, "auto_picks": picks, "auto_over_best": ratio,
        "auto_within_bound": ratio <= AUTO_BOUND, "estimates_s_per_layer": est, "estimate_pick": est_pick,
        "ring_bytes_per_rank": {m: [s["ring_bytes"] for s in runs[m][0]["stats"]] for m in SWEEP_MODES}})
    return [f"1/{round(1 / nominal)}" if nominal < 1 else "1", f"{t / (t + p):.4f}", t, p, "yes" if cached else "NO",
            med["pass_kv"], med["pass_q"], faster, ran, med["auto"], ratio, "yes" if ratio <= AUTO_BOUND else "NO",
            f"{est['pass_kv'] * 1e3:.2f}", f"{est['pass_q'] * 1e3:.2f}", est_pick]


# ---------------------------------------------------------------------------------- plot (e), (f)

def plot_ring(fig_e: dict | None, fig_f: dict | None, out_dir: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(12, 4.5))
    for a, part, draw, name in ((ax[0], fig_e, plot_e, "(e)"), (ax[1], fig_f, plot_f, "(f)")):
        if part is None:
            a.set_axis_off()
            a.text(0.5, 0.5, f"{name} not run", ha="center")
        else:
            draw(a, part)
    save_plot(fig, out_dir, "prefill_cp_ring.png")


def plot_e(ax, fig_e: dict) -> None:
    for j, cp in enumerate(sorted({r["cp"] for r in fig_e["results"]})):
        res = [r for r in fig_e["results"] if r["cp"] == cp]
        xs = [r["tokens"] for r in res]
        ax.plot(xs, [r["allgather_s"] for r in res], "--o", color=f"C{j}", label=f"C={cp} all-gather")
        ax.plot(xs, [r["ring_pass_kv_s"] for r in res], "-s", color=f"C{j}", label=f"C={cp} ring pass-KV")
        for r in res:
            ax.annotate(f"{r['ratio']:.2f}", (r["tokens"], r["ring_pass_kv_s"]), fontsize=7,
                        textcoords="offset points", xytext=(4, -10))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel(f"TTFT s (median of {fig_e['repeats']})")
    ax.set_title("(e) ring pass-KV vs all-gather (labels: ring / all-gather)")
    ax.legend(fontsize=7)


def plot_f(ax, fig_f: dict) -> None:
    res = fig_f["results"]
    xs = [r["fraction"] for r in res]
    for m, style in zip(SWEEP_MODES, ("-o", "-s", ":x")):
        ax.plot(xs, [r[f"{m}_s"] for r in res], style, label=m)
    for key, color, ls, label in (("crossover_measured", "k", "--", "measured crossover"),
                                  ("crossover_formula", "r", ":", "formula crossover")):
        if fig_f[key] is not None:
            ax.axvline(fig_f[key], color=color, ls=ls, lw=1, label=f"{label} {fig_f[key]:.3g}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("T / (T + P)")
    ax.set_ylabel(f"TTFT s (median of {fig_f['repeats']})")
    ax.set_title(f"(f) turn over a cached prefix, N={fig_f['tokens']:,}, C={fig_f['cp']}")
    ax.legend(fontsize=7)


# ---------------------------------------------------------------------------------- plot

def plot(fig_a: dict, fig_b: dict, fig_c: dict, fig_d: dict, out_dir: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 4, figsize=(20, 4))
    cp = fig_a["cp"]
    width = 0.8 / len(fig_a["layouts"])
    for i, (s, d) in enumerate(fig_a["layouts"].items()):
        xs = [r + (i - 1) * width for r in range(cp)]
        ax[0].bar(xs, [p / d["mean"] for p in d["pairs_per_rank"]], width,
                  label=f"{s} (max/mean {d['max_over_mean']:.3f})")
    ax[0].axhline(1.0, color="k", lw=0.8)
    ax[0].set_xlabel("rank")
    ax[0].set_ylabel("causal pairs / mean")
    ax[0].set_title(f"(a) balance, {fig_a['tokens']:,} tokens, C={cp}")
    ax[0].legend(fontsize=8)

    res = fig_b["results"]
    labels = [f"{r['tokens'] // 1024}k {r['strategy']}" for r in res]
    xs = range(len(res))
    ax[1].bar([x - 0.2 for x in xs], [r["t1_s"] for r in res], 0.4, label="T1 (C=1)")
    ax[1].bar([x + 0.2 for x in xs], [r["t2_s"] for r in res], 0.4, label="T2 (C=2)")
    for x, r in zip(xs, res):
        ax[1].text(x, max(r["t1_s"], r["t2_s"]), f"eff {r['efficiency']:.2f}\nCPU-s {r['efficiency_cpu']:.2f}",
                   ha="center", va="bottom", fontsize=8)
    ax[1].set_xticks(list(xs), labels, fontsize=8)
    ax[1].set_ylabel("max rank forward seconds")
    ax[1].margins(y=0.2)
    ax[1].set_title(f"(b) prefill, 1 thread/rank (target eff >= {EFFICIENCY_TARGET})")
    ax[1].legend(fontsize=8)

    rc = fig_c["results"]
    xs = range(len(rc))
    ax[2].bar([x - 0.2 for x in xs], [r["padded_bytes"] / 2**20 for r in rc], 0.4, label="padded (formula)")
    ax[2].bar([x + 0.2 for x in xs], [r["useful_bytes"] / 2**20 for r in rc], 0.4, label="useful")
    ax[2].plot(list(xs), [r["measured_bytes_per_rank"][0] / 2**20 for r in rc], "kx", label="measured (rank 0)")
    ax[2].set_xticks(list(xs), [f"{r['tokens']} {r['strategy'][:3]}" for r in rc], fontsize=8)
    ax[2].set_ylabel("MiB received per rank per prefill")
    ax[2].set_title("(c) all-gather bytes, C=2")
    ax[2].legend(fontsize=8)

    rd = fig_d["results"]
    xs = range(len(rd))
    ax[3].bar([x - 0.2 for x in xs], [r["ep_s"] for r in rd], 0.4, label="moe_parallel ep")
    ax[3].bar([x + 0.2 for x in xs], [r["replicate_s"] for r in rd], 0.4, label="moe_parallel replicate")
    for x, r in zip(xs, rd):
        ax[3].text(x, max(r["ep_s"], r["replicate_s"]),
                   f"ep/repl {r['ratio']:.2f}\nMoE ~{r['moe_flop_share']:.0%} flops", ha="center", va="bottom",
                   fontsize=8)
    ax[3].set_xticks(list(xs), [f"{r['tokens']}" for r in rd], fontsize=8)
    ax[3].set_xlabel("prompt tokens")
    ax[3].set_ylabel("TTFT s (fastest)")
    ax[3].margins(y=0.25)
    ax[3].set_title(f"(d) C=2 {fig_d['strategy']}, MoE model: EP vs replicated experts")
    ax[3].legend(fontsize=8)
    save_plot(fig, out_dir, "prefill_cp.png")


def parse_fractions(p, text: str) -> list[float]:
    from fractions import Fraction

    try:
        out = [float(Fraction(x)) for x in text.split(",") if x]
    except (ValueError, ZeroDivisionError):
        out = []
    if not out or any(not 0 < f <= 1 for f in out):
        p.error(f"--sweep-fractions: expected fractions in (0, 1] like 1/64,1/4,1, got {text!r}")
    return out


def int_list(p, flag: str, text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        p.error(f"{flag}: expected positive integers like 2,3,4, got {text!r}")
    return out


def report_e(rows: list[list], fig: dict) -> None:
    shared = [cp for cp in fig["threads_per_rank"] if cp > CORES]
    print_table(f"(e) ring pass-KV vs all-gather (AG), wide glm_moe_dsa, one prompt, no chunking, C ranks x "
                f"max(1, {CORES} // C) threads; ABAB, median of {fig['repeats']}"
                + (f"; C={','.join(map(str, shared))} > {CORES} cores: ranks share cores" if shared else ""),
                ["tokens", "C", "AG s", "ring s", "ring/AG", f"<= {RING_TTFT_BOUND}", "runs s AG | ring",
                 "resid. MiB AG", "resid. MiB ring", "resid. ring/AG", "ring <= bound", "hidden", "hidden steps",
                 "auto picks"], rows)
    print(f"target: ring/all-gather <= {RING_TTFT_BOUND} at "
          + ", ".join(f"{n:,} C={c}" for n, c in sorted(RING_ACCEPTANCE))
          + ("" if fig["meets_bound"] is None else f" ({'met' if fig['meets_bound'] else 'NOT met'})")
          + ". resident = the largest rank's pool pages in memory after the first prefill of that length (mincore; "
          "lengths ascending, so it is that prompt's footprint); ring/AG should be ~1/C; bound = (ceil(N/C) + one "
          "page) rows x bytes per row + the OS pages each layer slice straddles. hidden = 1 - exposed s / (ring bytes "
          "x byte_s), byte_s measured once per ring engine ("
          + ", ".join(f"C={c} {1 / v['byte_s'] / 2**30:.2f} GiB/s" for c, v in fig["ring_costs"].items())
          + "); hidden steps: ring steps whose transfer was done when attention was. auto picks: what "
          "--cp-ring-mode auto runs for this prompt (not timed). Group start-ups: "
          + ", ".join(f"C={c} {v:.1f}s" for c, v in fig["startup_s"].items()))


def report_f(rows: list[list], fig: dict) -> None:
    print_table(f"(f) a turn of T new tokens over a cached prefix of P (T+P = {fig['tokens']:,}), ring C={fig['cp']}, "
                f"{fig['model']['model_type']} wide; one engine per mode, order rotated, median of {fig['repeats']}",
                ["nominal", "T/(T+P)", "T", "P", "P cached", "pass-KV s", "pass-Q s", "faster", "auto ran", "auto s",
                 "auto/best", f"<= {AUTO_BOUND}", "est KV ms/l", "est Q ms/l", "est picks"], rows)

    def points(xs):
        return ", ".join(f"{x:.4g}" for x in xs) or "no point"

    def where(x, why):
        return f"none ({why})" if x is None else f"T/(T+P) = {x:.4g}"

    faster = fig["pass_q_faster_at"]
    print(f"crossover (where pass-Q stops being faster): measured "
          f"{where(fig['crossover_measured'], f'pass-Q faster at {points(faster)}')}; formula (ring_estimates, "
          f"bisection over T at N fixed) {where(fig['crossover_formula'], fig['crossover_formula_note'])}. "
          f"At the points the formula prefers pass-Q at {points(fig['formula_pass_q_at'])}. "
          f"auto within {AUTO_BOUND} of the faster everywhere: "
          f"{'yes' if fig['auto_within_bound_everywhere'] else 'NO'}; prefix P cached (seq.num_cached == P, P a "
          f"multiple of the page span {fig['page_span']}) at every run: "
          f"{'yes' if fig['prefix_cached_everywhere'] else 'NO'}. Start-up {fig['startup_s']:.1f}s.")


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--parts", default="abcdef", help="which parts to run, e.g. ef (b and c run together)")
    p.add_argument("--lengths", default=None, help="prompt lengths for (b) (default 4096,16384; --quick 2048,4096)")
    p.add_argument("--strategies", default="zigzag,interleave", help="C=2 strategies for (b) (--quick: zigzag)")
    p.add_argument("--repeats", type=int, default=1, help="prefills per (length, engine); the fastest is reported")
    p.add_argument("--balance-tokens", type=int, default=131072)
    p.add_argument("--balance-cp", type=int, default=8)
    p.add_argument("--odd-length", type=int, default=1001, help="extra prompt for (c) that needs padding")
    p.add_argument("--moe-repeats", type=int, default=4,
                   help="prefills per (length, moe_parallel) in (d), order alternated (--quick: 2)")
    p.add_argument("--ring-lengths", default="4096,16384,65536",
                   help="prompt lengths for (e) (add 131072 for the full run; --quick: 2048)")
    p.add_argument("--ring-cp", default="2,3,4", help="group sizes C for (e) (--quick: 2)")
    p.add_argument("--ring-repeats", type=int, default=3, help="prefills per (length, C, engine) in (e), "
                   "alternated; the median is reported (--quick: 1)")
    p.add_argument("--sweep-tokens", type=int, default=16384, help="history N = T + P for (f) (--quick: 2048)")
    p.add_argument("--sweep-cp", type=int, default=2, help="C for (f)")
    p.add_argument("--sweep-fractions", default="1/256,1/64,1/16,1/4,1/2,1",
                   help="T/(T+P) points for (f) (--quick: 1/64,1/4,1)")
    p.add_argument("--sweep-repeats", type=int, default=3, help="turns per (point, mode) in (f); the median "
                   "is reported (--quick: 1)")
    p.add_argument("--sweep-model", choices=("dense", "dsa"), default="dense",
                   help="(f)'s model: the wide shapes without (dense) or with (dsa) the indexer; with dsa, pass-Q "
                        "sends index_topk = 131,072 picks (1 MiB) a query, so keep --sweep-tokens small")
    args = parse_args(p, dict(ring_lengths="2048", ring_cp="2", ring_repeats=1, sweep_tokens=2048,
                              sweep_fractions="1/64,1/4,1", sweep_repeats=1))
    parts = set(args.parts)
    if not parts <= set("abcdef"):
        p.error(f"--parts: expected letters from abcdef, got {args.parts!r}")
    lengths = [int(x) for x in (args.lengths or ("2048,4096" if args.quick else "4096,16384")).split(",")]
    strategies = ["zigzag"] if args.quick else [s for s in args.strategies.split(",") if s]
    ring_lengths, ring_cps = int_list(p, "--ring-lengths", args.ring_lengths), int_list(p, "--ring-cp", args.ring_cp)
    if min(ring_cps) < 2 or args.sweep_cp < 2:
        p.error("--ring-cp, --sweep-cp: a ring needs C >= 2")
    fractions = parse_fractions(p, args.sweep_fractions)
    t_start = time.perf_counter()
    figures = {"quick": args.quick}

    if "a" in parts:
        rows_a, fig_a = part_a(args.balance_tokens, args.balance_cp)
        print_table(f"(a) causal query-key pairs per rank (billions), {args.balance_tokens:,} tokens, "
                    f"C={args.balance_cp}",
                    ["layout", "pairs per rank (1e9)", "max", "mean", "max/mean", "target", "meets"], rows_a)
        figures["balance"] = fig_a

    if parts & set("bc"):
        rows_b, fig_b, rows_c, fig_c = parts_b_c(lengths, strategies, args.repeats, args.odd_length)
        print_table("(b) prefill C=1 vs C=2, 1 thread per rank, wide glm_moe_dsa (dense attention), no chunking; "
                    "T = max rank forward s",
                    ["tokens", "strategy", "T1 s", "T2 s", "T2 per rank s", "eff T1/(2·T2)", "TTFT1 s", "TTFT2 s",
                     "eff (wall)", "CPU share C=1", "CPU share C=2", "eff CPU-s"], rows_b)
        print("CPU share = rank CPU seconds / rank forward seconds; below ~0.95 the rank was off-CPU (waiting for its "
              "peer in an all-gather, or for other processes using the cores), so T is not compute-only. "
              "eff CPU-s = C=1 CPU seconds / (2 x max C=2 rank CPU seconds): how evenly CP splits the work, "
              "whatever else runs on the machine.")
        print(f"target: efficiency >= {EFFICIENCY_TARGET} at 16,384 tokens (largest here: {max(lengths):,}); "
              "group start-ups: " + ", ".join(f"{k} {v:.1f}s" for k, v in fig_b["startup_s"].items()))
        low = min(min(r["cpu_share_c1"] + r["cpu_share_c2"]) for r in fig_b["results"])
        fig_b["min_cpu_share"] = low
        if low < 0.9:
            print(f"warning: a rank ran only {low:.0%} of its forward time: other processes were using the cores, "
                  "so T1/T2 are skewed (C=2 needs both cores, C=1 one); compare 'eff CPU-s', or rerun on an idle "
                  "machine.")
        print_table("(c) all-gather bytes received per rank over one C=2 prefill vs formula "
                    "C·max_tokens_per_rank·Σ_layers entry bytes",
                    ["tokens", "strategy", "max tok/rank", "entry B/layer", "measured B (rank 0 / 1)",
                     "formula (padded) B", "match", "useful B (tokens·entry)", "padded/useful"], rows_c)
        figures["scaling"], figures["allgather"] = fig_b, fig_c

    if "d" in parts:
        rows_d, fig_d = part_d(lengths, strategies[0], 2 if args.quick else args.moe_repeats)
        print_table(f"(d) C=2 {strategies[0]} prefill of an MoE model ({MOE_TYPE}, {MOE_MODEL['n_routed_experts']} "
                    f"experts top-{MOE_MODEL['num_experts_per_tok']} + {MOE_MODEL['n_shared_experts']} shared, "
                    f"3 of 4 layers MoE): moe_parallel ep vs replicate, alternated, fastest of {fig_d['repeats']}",
                    ["tokens", "TTFT ep s", "TTFT repl s", "ep/repl", "T ep s", "T repl s", "T ep/repl",
                     "ep/repl per pair", "median pair", "expert a2a MiB/rank (ep)", "MoE flops (est.)",
                     "min CPU share"], rows_d)
        print("ep: each rank holds half the routed experts and sends token rows to their owners and back (two gloo "
              "all-to-alls per MoE layer); replicate: every rank holds all experts, no expert traffic. "
              "ep/repl > 1: EP is slower. T = max rank forward s.")
        held = {m: max(r["bytes"] for r in ranks) / 2**20 for m, ranks in fig_d["weights_held"].items()}
        experts = {m: max(r["expert_bytes"] for r in ranks) / 2**20 for m, ranks in fig_d["weights_held"].items()}
        print("weights per rank (MiB, routed experts in brackets): "
              + ", ".join(f"{m} {held[m]:.1f} ({experts[m]:.1f})" for m in held))
        figures["moe_parallel"] = fig_d

    if "e" in parts:
        rows_e, figures["ring"] = part_e(ring_lengths, ring_cps, args.ring_repeats)
        report_e(rows_e, figures["ring"])
    if "f" in parts:
        rows_f, figures["ring_sweep"] = part_f(args.sweep_tokens, args.sweep_cp, fractions, args.sweep_repeats,
                                               args.sweep_model == "dense")
        report_f(rows_f, figures["ring_sweep"])

    if set("abcd") <= parts:
        plot(figures["balance"], figures["scaling"], figures["allgather"], figures["moe_parallel"], args.out)
    if parts & set("ef"):
        plot_ring(figures.get("ring"), figures.get("ring_sweep"), args.out)
    elapsed = time.perf_counter() - t_start
    print(f"runtime: {elapsed:.1f} s")
    emit_json(args.json, {**figures, "runtime_s": elapsed})


if __name__ == "__main__":
    main()
