"""Serving latency and throughput of OpenAI-compatible servers, measured side by side in one run:
any endpoints (cpserve, vLLM, SGLang, ...), or clusters this script starts against one reference
engine behind the same router and against the same engine offline.

    python bench/serving.py [--quick] [--json] [--base-url URL [--base-url URL2 ...]]
        [--concurrency 1,8,32 | --request-rate R[,R2...]] [--num-prompts N]
        [--dataset random|FILE.jsonl] [--input-len N|LO,HI] [--output-len N] [--random-prompt ids|text]
        [--vocab-size V] [--endpoint completions|chat] [--model NAME] [--api-key KEY]
        [--slo-ttft MS] [--slo-tpot MS] [--no-ignore-eos] [--seed 0] [--level-timeout S]
    python bench/serving.py [--model tiny|bench|DIR] [--clusters 2+2,1+1] [--ref-threads 1] [--reuse on,off] ...

Targets. ``--base-url`` (repeatable) names running servers; ``--model`` is then the name sent
(default: each target's first id of ``GET /v1/models``) and ``--api-key`` goes in every request.
Without ``--base-url`` the script starts its own, all at once, all on 127.0.0.1, and stops them
at the end:

- ``cluster P+D`` for each ``--clusters`` shape (default 2+2,1+1; --quick 1+1):
  ``services.up.start_cluster`` exactly like ``cpserve up --prefill-cp P --decode-dcp D`` — a
  prefill service (P rank processes), a decode service (D rank processes) and a router, each its
  own process, threads per rank as ``up`` picks them (usable cores ÷ all the ranks of that
  cluster). Prompt KV moves prefill → decode over the TCP transfer engine.
- ``reference``: bench/reference_server.py, one ``ReferenceEngine`` (``--ref-threads``) behind
  the very same router code in one process, no KV moving anywhere.

``--reuse on,off`` starts each cluster shape twice: with ``cpserve up``'s defaults (KV reuse on:
``cluster P+D``) and with ``--no-prefix-cache`` (``cluster P+D no-reuse``); ``--reuse off`` only
the second. Then every prompt is distinct — each level its own prompts, the warm-up another, no
two sharing their first 16-token page, so no two share any page-aligned prefix — and every
request's ``usage.prompt_tokens_details.cached_tokens`` (and the router's
``decode_cached_tokens``) must be 0 (``cached_nonzero`` counts those that are not); the table
and the JSON (``reuse_ratios``) give each shape's throughput and TTFT / TPOT with reuse on over
off, per level: what keeping and looking up reusable KV costs when nothing is reused. Before
the levels every cluster's cache pools are written once (``--warm-pools``, the default: as many
tokens of other distinct prompts, ``max_tokens`` 1, as the larger pool holds; ``pools_warmed_s``),
so that both measure servers in their steady state: a pool's memory is mapped on first write,
and a new cluster with reuse on keeps the pages the last request freed, so its requests write
never-mapped pages until the pool has been written once, where one with reuse off reuses the
same mapped, cache-warm pages (docs/benchmarks.md has both measured). ``--no-warm-pools``
measures clusters as started.

Here ``--model`` is the checkpoint (``bench``: the benchmark model of bench/common.py).

Load (bench/http_load.py says what each figure means). Every level runs on every target with the
same prompts (request i of a level sends prompt i everywhere), after one warm-up request per
target, so that the targets share the machine's noise: one request at a time (c=1) interleaves
them request by request (prompt i on A, then on B, ...; the order rotating with i), and a level
with more in flight runs target after target in ``--rounds`` rounds, each round a consecutive
share of the level's prompts on every target in turn, the order rotating per level and round
(c=8: round 1 on B, on A; round 2 on A, on B; ...): default one round, four with ``--reuse on,off``,
whose on / off ratios are the point of the run.
Closed loop: ``--concurrency`` workers; open loop: ``--request-rate`` Poisson arrivals, seeded,
the same arrival times on every target. Random prompts are each level's own (and the warm-up's
its own), and token-id prompts never share their first 16-token page, so a server that reuses
KV (cpserve by default, vLLM) never finds a request's prompt cached; a dataset's prompts are
sent again at every level.
``--num-prompts`` per level (default max(8, 2 x concurrency), at least 32 at concurrency 8, or 32
per rate; --quick max(4, concurrency), or 8 per rate); a level starts no new request after
``--level-timeout`` s. Requests stream, ``temperature 0``, ``max_tokens`` = the prompt's output
length, ``ignore_eos`` (``--no-ignore-eos`` for servers that refuse it).

Prompts. ``--dataset random``: ``--random-prompt ids`` (the default on /v1/completions) sends
token ids uniform in [3, V) (V: ``--vocab-size``; the checkpoint's for clusters started here,
else 259: ids every byte-level tokenizer has), lengths uniform in ``--input-len``; ``text`` (the
default on /v1/chat/completions) sends random lowercase words, as many as make ``--input-len``
tokens in the first target's tokenizer (its POST /tokenize), else that many words. A JSONL file:
one ``{"prompt": ...}`` (text, or token ids on completions) or ``{"messages": [...]}`` per line,
an optional ``max_tokens`` (default ``--output-len``), cycled when shorter than a level.

Figures per target and level: p50/p90/p99 (and mean) of TTFT, TPOT and ITL, request and
output-token throughput, goodput (completed requests per second that meet ``--slo-ttft`` and
``--slo-tpot``; an SLO not given constrains nothing), errors; each target over the first one
(over ``reference`` for clusters started here). For a cpserve target (its /metrics has the
router's TTFT stage histogram, or /version or its model card names cpserve) also its TTFT
breakdown: the mean time per stage of ``cpserve_router_ttft_stage_seconds`` over that level (the
histogram sums and counts read before and after it).

Clusters started here are also checked and compared as issue 15 defined: every completed request
must give the reference's token ids exactly (greedy), and the same engine runs offline in this
process with each cluster's threads per rank, no server: each first-level prompt alone (prefill
= ``generate`` call → first token; step = (last − first token) / (tokens − 1)) — in the c=1
level's rounds, next to the servers' requests for the same prompt, when that level comes first;
else after the servers stop — then, after they stop, ``generate`` of the first 8 prompts at once
(wall clock, prefill included). Each cluster's TTFT is set against the offline prefill, its TPOT
against the offline step, and its throughput at concurrency 8 against the offline ``generate``
of 8.

What that comparison means here. This machine has 2 CPU cores shared with other work. The
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
The load generator (this process) is the same for every target. Numbers move with whatever else
runs on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import contextlib
import os
import statistics
import sys
import time

from common import (BYTE_VOCAB, base_parser, bench_model_dir, emit_json, parse_shapes, print_table, save_plot,
                    vocab_size)
from http_load import (PERCENTILES, DatasetError, Level, Prompt, RequestOptions, Target, base_targets, file_prompts,
                       probe, random_ids, random_text, request_ttft_records, run_level, send, stage_means_ms,
                       summarise, tokens_per_word, ttft_bound_check, ttft_stage_sums)



# ---- arguments -----------------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    p = base_parser(__doc__)
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("--base-url", action="append", default=[], metavar="URL",
                   help="a running OpenAI-compatible server (repeatable: measured side by side); "
                        "none: start clusters and a reference server here")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--concurrency", default=None, help="closed-loop levels, comma-separated (default 1,8,32; "
                                                          "--quick 1,8)")
    load.add_argument("--request-rate", default=None,
                      help="open-loop levels: Poisson arrivals per second, comma-separated (needs --base-url)")
    p.add_argument("--num-prompts", "--requests", type=int, default=None,
                   help="requests per level (default max(8, 2 x concurrency), at least 32 at concurrency 8, "
                        "or 32 per rate; --quick max(4, concurrency), or 8 per rate)")
    p.add_argument("--dataset", default="random", help="random, or a JSONL file (needs --base-url)")
    p.add_argument("--input-len", "--prompt-lengths", default=None,
                   help="random prompt tokens: N or LO,HI (default 64,1024; --quick 32,256)")
    p.add_argument("--output-len", "--max-tokens", type=int, default=None,
                   help="output tokens per request (default 32; --quick 12)")
    p.add_argument("--random-prompt", choices=["ids", "text"], default=None,
                   help="random prompts as token ids (default on completions) or words (default on chat)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help=f"random token ids are below this (default: the checkpoint's, or {BYTE_VOCAB} with --base-url)")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--model", default=None,
                   help="with --base-url: the model name sent (default: each target's first GET /v1/models id); "
                        "without: the checkpoint (tiny, bench or a directory; default tiny)")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY' to every --base-url")
    p.add_argument("--slo-ttft", type=float, default=None, metavar="MS", help="goodput: TTFT at most MS")
    p.add_argument("--slo-tpot", type=float, default=None, metavar="MS", help="goodput: TPOT at most MS")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="ask for exactly the output length (vLLM's ignore_eos; default on)")
    p.add_argument("--level-timeout", type=float, default=None,
                   help="seconds after which a level starts no new requests (default 300; --quick 20)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--clusters", default=None,
                   help="without --base-url: cluster shapes, prefill CP + decode DCP (default 2+2,1+1; --quick 1+1)")
    p.add_argument("--ref-threads", type=int, default=1,
                   help="without --base-url: torch threads of the reference server (default 1)")
    p.add_argument("--reuse", default=None, metavar="on,off",
                   help="without --base-url: each cluster shape with KV reuse on (cpserve up's default) and/or off "
                        "(--no-prefix-cache), as separate targets, on distinct prompts (default: one cluster per "
                        "shape, cpserve up's default)")
    p.add_argument("--rounds", type=int, default=None,
                   help="levels with several requests in flight: split each level's requests into this many "
                        "rounds, every target running each round in turn (the order rotating), so that a slow "
                        "stretch of the machine lands on every target alike (default 1; 4 with --reuse on,off)")
    p.add_argument("--warm-pools", action=argparse.BooleanOptionalAction, default=True,
                   help="with --reuse: before measuring, write every cluster's cache pools once with distinct "
                        "prompts (default on; --no-warm-pools measures clusters as started)")
    args = p.parse_args()

    def numbers(flag: str, text: str, kind) -> list:
        try:
            values = [kind(x) for x in text.split(",")]
        except ValueError:
            p.error(f"{flag}: expected comma-separated numbers, got {text!r}")
        if any(not v > 0 for v in values):
            p.error(f"{flag}: every value must be > 0, got {text!r}")
        return values

    check_mode(p, args)
    args.random_prompt = args.random_prompt or ("text" if args.endpoint == "chat" else "ids")
    if args.request_rate:
        args.levels = [Level(rate=r) for r in numbers("--request-rate", args.request_rate, float)]
    else:
        default = "1,8" if args.quick else "1,8,32"
        args.levels = [Level(concurrency=c) for c in numbers("--concurrency", args.concurrency or default, int)]
    lengths = numbers("--input-len", args.input_len or ("32,256" if args.quick else "64,1024"), int)
    if len(lengths) not in (1, 2) or lengths[0] > lengths[-1]:
        p.error(f"--input-len: expected N or LO,HI with LO <= HI, got {args.input_len!r}")
    args.lengths = (lengths[0], lengths[-1])
    if args.output_len is None:
        args.output_len = 12 if args.quick else 32
    if args.level_timeout is None:
        args.level_timeout = 20.0 if args.quick else 300.0
    for flag, value in (("--num-prompts", args.num_prompts), ("--output-len", args.output_len),
                        ("--vocab-size", args.vocab_size), ("--slo-ttft", args.slo_ttft), ("--slo-tpot", args.slo_tpot),
                        ("--level-timeout", args.level_timeout), ("--ref-threads", args.ref_threads),
                        ("--rounds", args.rounds)):
        if value is not None and not value > 0:
            p.error(f"{flag} must be > 0, got {value}")
    if args.vocab_size is not None and args.vocab_size <= 3:
        p.error(f"--vocab-size must be > 3 (ids 0-2 are special), got {args.vocab_size}")
    if not args.base_url:
        args.model = bench_model_dir() if args.model == "bench" else (args.model or "tiny")
        args.shapes = parse_shapes(p, args.clusters or ("1+1" if args.quick else "2+2,1+1"))
    args.reuse = parse_reuse(p, args.reuse)
    if args.rounds is None:
        args.rounds = 4 if args.reuse and len(args.reuse) == 2 else 1
    args.parser = p
    return args


def check_mode(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Options that belong to one mode only are usage errors in the other."""
    if args.base_url:
        for flag, given in (("--clusters", args.clusters), ("--ref-threads", args.ref_threads != 1),
                            ("--reuse", args.reuse)):
            if given:
                p.error(f"{flag} applies only without --base-url (to the servers this script starts)")
    else:
        if args.api_key:
            p.error("--api-key applies only with --base-url (the servers started here take none)")
        for flag, given in (("--request-rate", args.request_rate), ("--dataset", args.dataset != "random"),
                            ("--endpoint chat", args.endpoint == "chat"),
                            ("--random-prompt text", args.random_prompt == "text")):
            if given:
                p.error(f"{flag} needs --base-url: the clusters started here are checked token for token against "
                        "the engine offline, on token-id prompts over /v1/completions at fixed concurrency")
    if args.endpoint == "chat" and args.random_prompt == "ids":
        p.error("--random-prompt ids needs --endpoint completions (chat messages are text)")
    if args.dataset != "random" and not os.path.isfile(args.dataset):
        p.error(f"--dataset: expected 'random' or a JSONL file, got {args.dataset!r} (no such file)")


def parse_reuse(p: argparse.ArgumentParser, text: str | None) -> list[bool] | None:
    """``--reuse``: the list of reuse settings (True: on) in the order given; None: not given."""
    if text is None:
        return None
    values = text.split(",")
    if not values or any(v not in ("on", "off") for v in values) or len(set(values)) != len(values):
        p.error(f"--reuse: expected on, off or on,off, got {text!r}")
    return [v == "on" for v in values]


PAGE_TOKENS = 16  # the services' cache page (page_size): KV is reused in whole pages


def distinct_first_pages(prompts: list[Prompt], vocab: int, seed: int) -> list[Prompt]:
    """``prompts`` with the first page of any prompt that repeats an earlier prompt's first
    page drawn again (seeded) until it does not: no two then share a page-aligned prefix, and a
    prefix cache has nothing to reuse between them. Prompts shorter than a page stay as they are
    (a cache reuses whole pages only)."""
    import random

    rng = random.Random(f"{seed}:pages")
    seen, out = set(), []
    for prompt in prompts:
        ids = list(prompt.token_ids)
        if len(ids) >= PAGE_TOKENS:
            while tuple(ids[:PAGE_TOKENS]) in seen:
                ids[:PAGE_TOKENS] = [rng.randrange(3, vocab) for _ in range(PAGE_TOKENS)]
            seen.add(tuple(ids[:PAGE_TOKENS]))
        out.append(Prompt({**prompt.payload, "prompt": ids}, prompt.output_len))
    return out


def fresh_levels(args: argparse.Namespace) -> bool:
    """Random prompts: each level has its own (servers that reuse KV, cpserve by default and
    vLLM, would otherwise find a later level's prompts cached: they are the first level's)."""
    return args.dataset == "random"


def level_prompts(args: argparse.Namespace, prompts: list[Prompt], index: int) -> list[Prompt]:
    """The prompts of level ``index``: a dataset's for every level, random prompts each level's
    own (``per_level`` of the largest level apart)."""
    if not fresh_levels(args):
        return prompts
    n = max(per_level(args, lv) for lv in args.levels)
    return prompts[index * n:(index + 1) * n]


def per_level(args: argparse.Namespace, level: Level) -> int:
    if args.num_prompts:
        return args.num_prompts
    if level.rate:
        return 8 if args.quick else 32
    c = level.concurrency
    return max(4, c) if args.quick else max(8, 2 * c, 32 if c == 8 else 0)


# ---- the servers this script starts (without --base-url) -------------------------------------------
class OwnServers:
    """Each ``--clusters`` shape as ``cpserve up`` starts it, and bench/reference_server.py, all at
    once (the reference loads while the clusters' ranks come up); stopped all at once."""

    def __init__(self, args: argparse.Namespace):
        from services.up import cluster_args, cluster_threads

        self.model, self.ref_threads = args.model, args.ref_threads
        self.spaces, self.reuse_pairs = {}, []  # reuse_pairs: (reuse on, reuse off) names of one shape
        for cp, dcp in args.shapes:
            argv = ["--model", args.model, "--prefill-cp", str(cp), "--decode-dcp", str(dcp),
                    "--cp-strategy", "interleave", "--indexer", "copied", "--dcp-comm", "a2a"]
            name = f"cluster {cp}+{dcp}"
            for reuse in args.reuse or [None]:
                self.spaces[name if reuse is not False else f"{name} no-reuse"] = cluster_args(
                    argv + ([] if reuse is not False else ["--no-prefix-cache"]))
            if args.reuse and len(args.reuse) == 2:
                self.reuse_pairs.append((name, f"{name} no-reuse"))
        self.clusters = list(self.spaces)
        self.threads = {name: cluster_threads(ns, quiet=True)["prefill"] or 1 for name, ns in self.spaces.items()}
        self.running: dict[str, list] = {}
        self.ref = None
        self.startup_s: dict[str, float] = {}
        self.shutdown_s = float("nan")

    def start(self) -> list[Target]:
        from services.up import Child, start_cluster

        t0 = time.perf_counter()
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reference_server.py")
        self.ref = Child("reference", [], quiet=True, command=[
            sys.executable, script, "--model", self.model, "--threads", str(self.ref_threads), "--stop-on-stdin-eof"])
        print(f"starting {', '.join(self.clusters)} (router each) and the reference server ...", file=sys.stderr,
              flush=True)
        for name in self.clusters:
            self.running[name] = start_cluster(self.spaces[name], 0, None, quiet=True)
            self.startup_s[name] = time.perf_counter() - t0
        self.ref.wait_ready()
        self.startup_s["reference"] = self.ref.ready_at - t0
        targets = [Target(name, f"http://{children[-1].address}") for name, children in self.running.items()]
        return targets + [Target("reference", f"http://{self.ref.address}")]

    def stop(self) -> None:
        from services.up import stop_cluster

        t0 = time.perf_counter()
        # Every service shuts down at once (each takes seconds: gRPC grace, rank groups), then wait.
        every = [child for children in self.running.values() for child in children]
        for child in every + ([self.ref] if self.ref else []):
            child.signal_stop()
        for children in self.running.values():
            stop_cluster(children)
        if self.ref:
            self.ref.stop()
        self.shutdown_s = time.perf_counter() - t0


def random_prompts(args: argparse.Namespace, first: Target, n: int) -> list[Prompt]:
    """``n`` prompts for each level and one more (last) for the warm-up; token ids: no two
    sharing a first page (so no request finds another's KV cached)."""
    total = n * len(args.levels) + 1
    if args.random_prompt == "text":
        return random_text(total, args.lengths, args.output_len, tokens_per_word(first, args.seed), args.seed,
                           chat=args.endpoint == "chat")
    prompts = random_ids(total, args.lengths, args.output_len, vocab_size(args), args.seed)
    return distinct_first_pages(prompts, vocab_size(args), args.seed)


def warm_up(target: Target, prompt: Prompt, opts: RequestOptions) -> None:
    import httpx

    ids = prompt.token_ids
    short = Prompt({"prompt": ids[:16]} if ids else prompt.payload, 2)

    async def go():
        async with httpx.AsyncClient(trust_env=False, timeout=300) as client:
            return await send(client, target, -1, short, RequestOptions(opts.chat, opts.ignore_eos))

    r = asyncio.run(go())
    if r.error:
        raise RuntimeError(f"{target.name}: the warm-up request failed: {r.error}")


def warm_pools(args: argparse.Namespace, targets: list[Target], opts: RequestOptions) -> dict[str, float]:
    """Write each cluster's cache pools once: distinct prompts (max_tokens 1, 8 at a time) until
    as many tokens as the larger of the prefill and decode pools (``cpserve up``'s defaults) have
    gone through. A pool's memory is mapped on first write (engine/cache/pool.py); with KV reuse
    off a new request takes the pages the last one freed, already mapped and warm, while with reuse
    on the kept pages push it onto never-written ones until the pool has been written once — a
    one-time cost of a new server, not one of a prompt. Returns the seconds each took."""
    from services.common.config import DecodeConfig, PrefillConfig

    pool_tokens = max(PrefillConfig().max_cache_tokens, DecodeConfig().max_cache_tokens)
    mean_len = sum(args.lengths) / 2
    n = math.ceil(pool_tokens / mean_len) + 8
    prompts = distinct_first_pages(random_ids(n, args.lengths, 1, vocab_size(args), args.seed + 7919),
                                   vocab_size(args), args.seed + 7919)
    took = {}
    for t in targets:
        t0 = time.perf_counter()
        results, _ = asyncio.run(run_level(t, prompts, n, Level(concurrency=8),
                                           RequestOptions(opts.chat, opts.ignore_eos), args.level_timeout, args.seed))
        failed = [r.error for r in results if r.error]
        if failed:
            raise RuntimeError(f"{t.name}: a pool warm-up request failed: {failed[0]}")
        took[t.name] = time.perf_counter() - t0
        print(f"warmed {t.name}'s pools: {n} distinct prompts in {took[t.name]:.1f} s", file=sys.stderr, flush=True)
    return took


def measure(args: argparse.Namespace, targets: list[Target], prompts: list[Prompt], opts: RequestOptions,
            offline: dict | None = None):
    """Every level on every target. Returns {(target, level): figures} and {(target, level):
    {request index: token ids}}.

    One request at a time (c=1) interleaves the targets request by request — request i on each
    target in turn, the order rotating with i, then request i + 1 — so that a slow stretch of
    the machine lands on every target alike: the ratios between targets (and the engine offline:
    each of ``offline``'s engines runs prompt i in the same round) are side by side at the
    finest grain. Levels with more in flight run target after target, in ``args.rounds`` rounds
    (see :func:`rounds`)."""
    from tqdm import tqdm

    stats, ids = {}, {}
    total = len(targets) * sum(per_level(args, lv) for lv in args.levels)
    with tqdm(total=total, desc="requests", unit="req", file=sys.stderr, dynamic_ncols=True) as bar:
        for li, level in enumerate(args.levels):
            n = per_level(args, level)
            lp = level_prompts(args, prompts, li)
            before = {t.name: ttft_stage_sums(t) if t.is_cpserve else {} for t in targets}
            if level.concurrency == 1:
                bar.set_postfix_str(f"every target {level.label}, interleaved")
                got = interleaved(args, targets, lp, n, opts, offline if li == 0 else None, lambda: bar.update(1))
            else:
                got = rounds(args, targets, lp, n, level, opts, li, bar)
            for t in targets:
                results, start, wall = got[t.name]
                s = stats[t.name, level] = summarise(results, n, start, args.slo_ttft, args.slo_tpot, wall)
                s["cached_nonzero"] = sum(1 for r in results if r.error is None and (r.cached_tokens or 0) > 0)
                if t.is_cpserve:
                    records = request_ttft_records(t)
                    s["ttft_stages_ms"] = stage_means_ms(before[t.name], ttft_stage_sums(t))
                    s["ttft_bound"] = ttft_bound_check(results, records)
                    s["decode_cached_nonzero"] = sum(
                        1 for r in results if r.error is None
                        and ((records.get(r.response_id) or {}).get("decode_cached_tokens") or 0) > 0)
                ids[t.name, level] = {r.index: r.ids for r in results if r.error is None}
                bar.update(s["not_started"])
    return stats, ids


def rounds(args: argparse.Namespace, targets: list[Target], prompts: list[Prompt], n: int, level: Level,
           opts: RequestOptions, li: int, bar) -> dict:
    """A level with several requests in flight: its requests 0..n-1 split into ``args.rounds``
    consecutive rounds; each round runs on every target in turn (the order rotating with the
    level and the round), the same prompts on each. {target: (results, start, wall_s)}, wall_s
    the sum of the target's rounds (each from its start to its last request done)."""
    sizes = [n // args.rounds + (1 if r < n % args.rounds else 0) for r in range(args.rounds)]
    got = {t.name: ([], time.perf_counter(), 0.0) for t in targets}
    offset = 0
    for ri, size in enumerate(s for s in sizes if s):
        k = (li + ri) % len(targets)
        for t in targets[k:] + targets[:k]:
            bar.set_postfix_str(f"{t.name} {level.label}" + (f" round {ri + 1}/{args.rounds}" if args.rounds > 1 else ""))
            results, start = asyncio.run(run_level(t, prompts[offset:offset + size], size, level, opts,
                                                   args.level_timeout, args.seed, lambda: bar.update(1)))
            for r in results:
                r.index += offset
            done, first, wall = got[t.name]
            done.extend(results)
            got[t.name] = done, first, wall + max((r.end for r in results), default=start) - start
        offset += size
    return got


def interleaved(args: argparse.Namespace, targets: list[Target], prompts: list[Prompt], n: int,
                opts: RequestOptions, offline: dict | None, on_done) -> dict:
    """Requests 0..n-1 one at a time, round i sending prompt i to every target (and running it on
    every engine of ``offline``), the order rotating with i. {target: (results, start, wall_s)},
    wall_s being the sum of the target's own requests' durations (the level's time on it)."""
    import httpx

    units = list(targets) + list((offline or {}).values())
    results: dict[str, list] = {t.name: [] for t in targets}
    start = time.perf_counter()
    stop_at = start + args.level_timeout

    async def go():
        async with httpx.AsyncClient(trust_env=False, timeout=httpx.Timeout(args.level_timeout + 120)) as client:
            for i in range(n):
                if time.perf_counter() > stop_at:
                    return
                k = i % len(units)
                for u in units[k:] + units[:k]:
                    if isinstance(u, OfflineEngine):
                        u.single(i, prompts[i].token_ids)
                    else:
                        results[u.name].append(await send(client, u, i, prompts[i], opts))
                        on_done()

    asyncio.run(go())
    return {name: (rs, start, sum(r.end - r.start for r in rs)) for name, rs in results.items()}


# ---- the engine offline, for the clusters started here -------------------------------------------
class OfflineEngine:
    """The reference engine in this process with ``threads`` torch threads (the serving ranks'),
    no server. ``single``: one prompt alone — its prefill (generate() call → first token) and
    decode step ((last − first token) / (tokens − 1)); ``batch``: ``generate`` of several at
    once, wall clock with their prefill. Token ids too, to check the servers against."""

    def __init__(self, model: str, threads: int, max_prompt: int, batch: int, max_tokens: int):
        from engine.model.sampler import SamplingParams
        from engine.reference import ReferenceEngine

        self.threads = threads
        self.params = SamplingParams(max_new_tokens=max_tokens, stop_token_ids=())
        with self._threads():
            self.engine = ReferenceEngine(model, max_cache_tokens=max(batch, 1) * (max_prompt + max_tokens) + 64)
            self.engine.generate([[5] * 16], SamplingParams(max_new_tokens=2, stop_token_ids=()))  # warm-up
        self.prefill_ms, self.step_ms, self.ids = [], [], {}

    @contextlib.contextmanager
    def _threads(self):
        import torch

        before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            yield
        finally:
            torch.set_num_threads(before)

    def single(self, index: int, prompt: list[int]) -> None:
        with self._threads():
            t0 = time.perf_counter()
            seq = self.engine.generate([prompt], self.params)[0]
        self.prefill_ms.append((seq.token_times[0] - t0) * 1e3)
        self.step_ms.append((seq.token_times[-1] - seq.token_times[0]) * 1e3 / (len(seq.token_times) - 1))
        self.ids[index] = seq.output_ids

    def batch(self, prompts: list[list[int]]) -> dict:
        with self._threads():
            t0 = time.perf_counter()
            seqs = self.engine.generate(prompts, self.params)
            wall = time.perf_counter() - t0
        return {"threads": self.threads, "prefill_ms": self.prefill_ms, "step_ms": self.step_ms, "_ids": self.ids,
                "batch": len(prompts), "batch_wall_s": wall,
                "batch_throughput_tok_s": sum(len(s.output_ids) for s in seqs) / wall}


def offline_engines(args: argparse.Namespace, own: OwnServers, prompts: list[Prompt]) -> dict:
    """One offline engine per threads-per-rank figure of the clusters started here."""
    longest = max(len(p.token_ids) for p in prompts)
    out = {}
    for t in sorted(set(own.threads.values())):
        print(f"offline engine, {t} thread(s) ...", file=sys.stderr, flush=True)
        out[t] = OfflineEngine(args.model, t, longest, batch_size(args), args.output_len)
    return out


def batch_size(args: argparse.Namespace) -> int:
    levels = args.levels
    return 8 if any(lv.concurrency == 8 for lv in levels) else max(lv.concurrency or 1 for lv in levels)


def offline_comparison(args: argparse.Namespace, own: OwnServers, stats: dict, ids: dict,
                       prompts: list[Prompt], engines: dict) -> dict:
    """Token ids of every cluster against the reference's and the offline engine's; each
    cluster's TTFT, TPOT and throughput against the engine offline (issue 15's ratios). The
    engines ran the first level's prompts during it when that level is c=1 (interleaved); else
    they run them now, after the servers stopped."""
    levels = args.levels
    first = levels[0]
    batch_c = batch_size(args)
    offline = {}
    for t, engine in engines.items():
        if not engine.step_ms:
            print(f"offline engine, {t} thread(s): the first level's prompts ...", file=sys.stderr, flush=True)
            for i, p in enumerate(prompts[:stats["reference", first]["requests"]]):
                engine.single(i, p.token_ids)
        offline[t] = engine.batch([p.token_ids for p in prompts[:batch_c]])

    compared, mismatches = 0, []

    def compare(what: str, a: dict, b: dict, sent: list[Prompt]) -> None:
        nonlocal compared
        for i in sorted(set(a) & set(b)):
            compared += 1
            if a[i] != b[i]:
                at = next((k for k, (x, y) in enumerate(zip(a[i], b[i])) if x != y), min(len(a[i]), len(b[i])))
                mismatches.append(f"{what} request {i} ({len(sent[i].token_ids)} prompt tokens): first differs at "
                                  f"output {at}")

    for li, level in enumerate(levels):
        for name in own.clusters:
            compare(f"{name} vs reference {level.label}", ids[name, level], ids["reference", level],
                    level_prompts(args, prompts, li))
    for name in own.clusters:
        compare(f"{name} {first.label} vs offline", ids[name, first], offline[own.threads[name]]["_ids"], prompts)
    match = compared > 0 and not mismatches

    batch_level = Level(concurrency=batch_c)
    vs_offline, rows = [], []
    for name in own.clusters:
        off, one = offline[own.threads[name]], stats[name, first]
        pre, step = statistics.median(off["prefill_ms"]), statistics.median(off["step_ms"])
        row = {"system": name, "threads_per_rank": own.threads[name], "offline_prefill_ms": pre,
               "offline_step_ms": step, "ttft_ms": one["ttft_ms_p50"], "tpot_ms": one["tpot_ms_p50"],
               "ttft_over_offline_prefill": ratio(one["ttft_ms_p50"], pre),
               "ttft_minus_1_15x_prefill_ms": one["ttft_ms_p50"] - 1.15 * pre,
               "tpot_over_offline_step": ratio(one["tpot_ms_p50"], step),
               "offline_batch": off["batch"], "offline_batch_throughput_tok_s": off["batch_throughput_tok_s"]}
        if (name, batch_level) in stats:
            row["throughput_at_batch"] = stats[name, batch_level]["output_throughput_tok_s"]
            row["throughput_over_offline_generate"] = ratio(row["throughput_at_batch"], off["batch_throughput_tok_s"])
            row["ttft_bound_at_batch"] = stats[name, batch_level].get("ttft_bound")
        vs_offline.append(row)
        rows.append([name, own.threads[name], pre, row["ttft_ms"], row["ttft_over_offline_prefill"],
                     row["ttft_minus_1_15x_prefill_ms"], step, row["tpot_ms"], row["tpot_over_offline_step"],
                     off["batch_throughput_tok_s"], row.get("throughput_at_batch", float("nan")),
                     row.get("throughput_over_offline_generate", float("nan"))])
    print_table(f"each cluster vs the engine offline, {first.label} (TTFT, TPOT medians) and c={batch_c} "
                f"(throughput vs offline generate of {batch_c} prompts)",
                ["system", "threads/rank", "offline prefill ms", "TTFT ms", "TTFT / prefill", "TTFT - 1.15 prefill ms",
                 "offline step ms", "TPOT ms", "TPOT / step", f"offline gen({batch_c}) tok/s", "served tok/s",
                 "served / offline"], rows)
    for row in vs_offline:
        b = row.get("ttft_bound_at_batch")
        if b:
            print(f"{row['system']} at c={batch_c}: {b['within_bound']}/{b['requests_checked']} requests' TTFT within "
                  f"{b['factor']} x (prefill queue + own prefill compute) + {b['slack_ms']:.0f} ms"
                  + (f"; worst {b['worst_over_bound_ms']:.1f} ms over" if b['within_bound'] < b['requests_checked'] else ""))
    if len(own.clusters) > 1:
        print(f"TPOT at {first.label}: " + ", ".join(f"{n} {stats[n, first]['tpot_ms_p50']:.2f} ms"
                                                     for n in own.clusters))
    print(f"token ids: {'MATCH' if match else 'MISMATCH'} — {compared - len(mismatches)}/{compared} requests "
          f"identical (clusters vs reference, and vs the engine offline)")
    for m in mismatches[:5]:
        print(f"  {m}")
    print("start-up (started together): " + ", ".join(f"{k} {v:.1f} s" for k, v in own.startup_s.items())
          + f"; shut-down {own.shutdown_s:.1f} s")
    return {"ref_threads": own.ref_threads, "startup_s": own.startup_s, "shutdown_s": own.shutdown_s,
            "vs_offline": vs_offline,
            "offline": {str(t): {k: v for k, v in o.items() if k != "_ids"} for t, o in offline.items()},
            "token_ids_match": match, "token_ids_compared": compared, "token_ids_mismatched": len(mismatches)}


# ---- report ----------------------------------------------------------------------------------------
def reuse_report(args: argparse.Namespace, own: OwnServers, stats: dict) -> dict:
    """``--reuse``: every request's cached tokens (distinct prompts: all must be 0), and each
    shape's reuse-on figures over its reuse-off twin's, per level."""
    keys = ("output_throughput_tok_s", "ttft_ms_p50", "tpot_ms_p50")
    ratios, rows = [], []
    for on, off in own.reuse_pairs:
        for level in args.levels:
            a, b = stats[on, level], stats[off, level]
            row = {"target": on, "no_reuse_target": off, "level": level.label,
                   "throughput_on_tok_s": a["output_throughput_tok_s"],
                   "throughput_off_tok_s": b["output_throughput_tok_s"],
                   **{f"{k}_on_over_off": ratio(a[k], b[k]) for k in keys},
                   "cached_nonzero_on": a["cached_nonzero"], "cached_nonzero_off": b["cached_nonzero"]}
            ratios.append(row)
            rows.append([on, level.label, row["throughput_on_tok_s"], row["throughput_off_tok_s"],
                         *(row[f"{k}_on_over_off"] for k in keys), row["cached_nonzero_on"], row["cached_nonzero_off"]])
    if rows:
        print_table("KV reuse on / off (--no-prefix-cache), distinct prompts",
                    ["cluster", "level", "on out tok/s", "off out tok/s", "throughput on/off", "TTFT p50 on/off",
                     "TPOT p50 on/off", "cached>0 on", "cached>0 off"], rows)
    clusters = [(name, lv) for name in own.clusters for lv in args.levels]
    cached = sum(stats[k]["cached_nonzero"] for k in clusters)
    decode = sum(stats[k].get("decode_cached_nonzero", 0) for k in clusters)
    completed = sum(stats[k]["completed"] for k in clusters)
    print(f"cached tokens (distinct prompts, expected none): {cached} of {completed} cluster requests reported prefill "
          f"cached tokens, {decode} decode cached tokens")
    return {"reuse": ["on" if r else "off" for r in args.reuse], "reuse_ratios": ratios, "cached_nonzero": cached,
            "decode_cached_nonzero": decode}


FIGURES = [f"{m}_ms_p{q}" for m in ("ttft", "tpot", "itl") for q in PERCENTILES]


def report(args: argparse.Namespace, targets: list[Target], stats: dict, baseline: str) -> list[dict]:
    """The figures table, each target over ``baseline``, and cpserve targets' TTFT breakdown;
    returns the ratio rows."""
    latency, load = [], []
    for level in args.levels:
        for t in targets:
            s = stats[t.name, level]
            latency.append([t.name, level.label, *(s[k] for k in FIGURES)])
            load.append([t.name, level.label, f"{s['completed']}/{s['requests']}", s["errors"], s["not_started"],
                         s["request_throughput_req_s"], s["output_throughput_tok_s"], s["goodput_req_s"],
                         s["mean_prompt_tokens"], s["mean_output_tokens"]])
    where = f"/v1/{'chat/' if args.endpoint == 'chat' else ''}completions, {describe_dataset(args)}"
    print_table(f"latency, ms: {where}", ["target", "level", *(f"{m} p{q}" for m in ("TTFT", "TPOT", "ITL")
                                                                 for q in PERCENTILES)], latency)
    slo = ", ".join(f"{k} <= {v:g} ms" for k, v in (("TTFT", args.slo_ttft), ("TPOT", args.slo_tpot)) if v) or "no SLO"
    print_table(f"throughput; goodput: {slo}", ["target", "level", "completed", "errors", "not started", "req/s",
                                                "output tok/s", "goodput req/s", "prompt tokens", "output tokens"],
                load)

    ratios = []
    keys = ("ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "itl_ms_p99", "output_throughput_tok_s")
    for level in args.levels:
        b = stats[baseline, level]
        for t in targets:
            if t.name != baseline:
                s = stats[t.name, level]
                ratios.append({"target": t.name, "baseline": baseline, "level": level.label,
                               **{k: ratio(s[k], b[k]) for k in keys}})
    if ratios:
        print_table(f"each target / {baseline}", ["target", "level", "TTFT p50", "TTFT p99", "TPOT p50", "ITL p99",
                                                  "out tok/s"],
                    [[r["target"], r["level"], *(r[k] for k in keys)] for r in ratios])

    cpserve = [t for t in targets if t.is_cpserve]
    stages = list(dict.fromkeys(k for t in cpserve for lv in args.levels
                                for k in stats[t.name, lv]["ttft_stages_ms"] if k != "ttft"))
    if cpserve:
        print_table("where TTFT goes on cpserve targets, mean ms per request (cpserve_router_ttft_stage_seconds)",
                    ["target", "level", *stages, "TTFT (router)"],
                    [[t.name, lv.label, *(stats[t.name, lv]["ttft_stages_ms"].get(k, float("nan"))
                                          for k in stages + ["ttft"])] for lv in args.levels for t in cpserve])
    for (name, level), s in stats.items():
        if s["errors"] or s["not_started"]:
            print(f"{name} {level.label}: {s['errors']} failed, {s['not_started']} not started (level timeout "
                  f"{args.level_timeout:g} s); {'; '.join(s['error_messages'])}")
    return ratios


def describe_dataset(args: argparse.Namespace) -> str:
    if args.dataset != "random":
        return f"prompts from {args.dataset}"
    lo, hi = args.lengths
    return (f"random {'token-id' if args.random_prompt == 'ids' else 'text'} prompts of "
            f"{lo if lo == hi else f'{lo}-{hi}'} tokens, {args.output_len} output tokens")


def plot(args: argparse.Namespace, targets: list[Target], stats: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [lv.x for lv in args.levels]
    fig, ax = plt.subplots(1, 4, figsize=(15, 3.6))
    panels = [("ttft", "TTFT ms"), ("tpot", "TPOT ms"), ("itl", "ITL ms")]
    for t, marker in zip(targets, "os^Dv<>"):
        for i, (key, title) in enumerate(panels):
            line, = ax[i].plot(xs, [stats[t.name, lv][f"{key}_ms_p50"] for lv in args.levels], marker=marker,
                               label=f"{t.name} p50")
            ax[i].plot(xs, [stats[t.name, lv][f"{key}_ms_p99"] for lv in args.levels], marker=marker, ls="--",
                       color=line.get_color(), label=f"{t.name} p99")
            ax[i].set_title(title)
        ax[3].plot(xs, [stats[t.name, lv]["output_throughput_tok_s"] for lv in args.levels], marker=marker,
                   label=t.name)
        ax[3].set_title("output tokens/s")
    for a in ax:
        a.set_xlabel("request rate (/s)" if args.levels[0].rate else "concurrency")
        a.set_xscale("log", base=2)
        a.set_xticks(xs, [f"{x:g}" for x in xs])
        a.legend(fontsize=7)
    save_plot(fig, args.out, "serving.png")


def ratio(a: float, b: float) -> float:
    return a / b if b and b == b and a == a else float("nan")


def main() -> None:
    t_all = time.perf_counter()
    args = parse_args()
    n = max(per_level(args, lv) for lv in args.levels)
    prompts = None
    if args.dataset != "random":  # checked before any server is touched
        try:
            prompts = file_prompts(args.dataset, n, args.output_len, chat=args.endpoint == "chat")
        except DatasetError as e:
            args.parser.error(f"--dataset {e}")
    own = None if args.base_url else OwnServers(args)
    warmed: dict[str, float] = {}
    opts = RequestOptions(chat=args.endpoint == "chat", ignore_eos=args.ignore_eos, exact_length=own is not None)
    try:
        targets = own.start() if own else base_targets(args)
        for t in targets:
            probe(t, None if own else args.model)
        prompts = prompts or random_prompts(args, targets[0], n)
        for t in targets:
            warm_up(t, prompts[-1] if fresh_levels(args) else prompts[0], opts)
        warmed = warm_pools(args, [t for t in targets if t.name in own.clusters], opts) \
            if own and args.reuse is not None and args.warm_pools else {}
        engines = offline_engines(args, own, prompts) if own else {}
        stats, ids = measure(args, targets, prompts, opts, engines)
    except RuntimeError as e:
        sys.exit(f"bench/serving.py: {e}")
    finally:
        if own:
            own.stop()

    ratios = report(args, targets, stats, "reference" if own else targets[0].name)
    extra = offline_comparison(args, own, stats, ids, prompts, engines) if own else {}
    if own and args.reuse is not None:
        extra.update(reuse_report(args, own, stats))
    plot(args, targets, stats)
    wall = time.perf_counter() - t_all
    print(f"wall time: {wall:.1f} s")
    emit_json(args.json, {
        "mode": "own" if own else "base_url", "model": args.model, "endpoint": args.endpoint,
        "dataset": args.dataset, "random_prompt": args.random_prompt, "input_len": list(args.lengths),
        "output_len": args.output_len, "levels": [lv.label for lv in args.levels], "quick": args.quick,
        "cpus": os.cpu_count(), "wall_s": wall,
        "targets": [{"name": t.name, "url": t.url, "model": t.model, "is_cpserve": t.is_cpserve} for t in targets],
        "results": [{"target": t.name, "level": lv.label, "concurrency": lv.concurrency, "request_rate": lv.rate,
                     **stats[t.name, lv]} for lv in args.levels for t in targets],
        "ratios_over_baseline": ratios, "pools_warmed_s": warmed,
        **extra,
    })


if __name__ == "__main__":
    main()
