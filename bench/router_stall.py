"""Does a huge prompt stall other clients' token streams? Inter-token latency of a few short
streams with and without clients that send prompts at the model's context limit, and the
router's event-loop lag over each (issue: "the router never stalls").

    python bench/router_stall.py [--quick] [--json] [--out DIR] [--model demo|tiny|DIR] [--up-args="FLAGS"]
        [--streams 4] [--prompt-len 32] [--output-len 64] [--heavy-clients 2] [--heavy-kind refused|served]
        [--phase-s 20] [--rounds 3] [--timeout 300] [--seed 0]
    python bench/router_stall.py --base-url URL [--model NAME] [--tokenizer DIR] [--api-key KEY] ...

Target. Without ``--base-url`` the script starts one cluster with ``services.up.start_cluster``,
exactly as ``cpserve up`` does (its default shapes: prefill CP 2, decode DCP 2), ``--model``
(default demo, the trained embedded model; --quick tiny, which starts in half the time) and
``--up-args`` (more ``cpserve up`` flags; --quick: prefill CP 1, decode DCP 1 unless given),
and stops it at the end. ``--base-url`` names a running server; ``--model`` is then the name
sent (default: the first id of GET /v1/models).

The limit: ``max_model_len`` of GET /v1/models (cpserve's router: the smaller of the model's
positions and the smallest decode cache, what it refuses prompts against).

Light streams (``--streams``): each sends, one after the other, a streamed /v1/completions
request of ``--prompt-len`` token ids (the stream's own, the same every time: after the first, a
prefix-cache hit), ``--output-len`` tokens, ``temperature 0``, ``ignore_eos`` (bench/http_load.py
sends it, as bench/serving.py does). ITL: every gap between two output chunks (one token a chunk
on cpserve), counted in the phase whose window [start, start + ``--phase-s``] the gap ends in.

Heavy clients (``--heavy-clients``): each sends, one after the other, the same non-streamed
/v1/chat/completions request, one user message of words that the model's chat template (with
the generation prompt) renders to a fixed number of tokens — built here with the checkpoint's
tokenizer (``engine.model.tokenizer.load_tokenizer``; ``--tokenizer`` with ``--base-url``) and
checked once against the server's POST /tokenize (``messages``):

- ``--heavy-kind refused`` (the default): exactly ``max_model_len`` tokens. The router answers
  400 ``context_length_exceeded`` only after it has read, parsed, rendered and tokenized the
  whole prompt (its length alone proves nothing: the router's lower bound, its bytes over the
  most bytes one token covers, is far below the limit for words): the request costs the router
  all it costs it to admit one, and costs the prefill and decode services nothing. That
  isolates the router: on this 2-core machine a served 32k-token prefill would compete with the
  light streams' decode for the same cores, which measures the cluster's CPU sharing, not the
  router's loop.
- ``--heavy-kind served``: ``max_model_len - 1 - max_tokens`` tokens with ``max_tokens`` 1 and a
  fresh ``cache_salt`` each (no prefix-cache hit): the whole cluster under long prompts.

Phases. "alone" (light streams only) and "loaded" (light streams and heavy clients), each
``--phase-s`` seconds, in ``--rounds`` rounds whose order alternates (alone, loaded; loaded,
alone; ...), so that a slow stretch of the machine lands on both. A phase starts no request
after its window and waits for those in flight (their gaps after the window do not count).
Before the first: one light request per stream and one heavy request (which must be refused
with ``context_length_exceeded``, or served).

Figures, per phase, per round and over all phases of a kind: ITL p50 / p99 (ms), light TPOT
p50 and TTFT p50, light requests and errors; heavy requests, their rate, latency p50 and
statuses (``400 context_length_exceeded``, ``200``, ...); and the router's
``cpserve_router_event_loop_lag_seconds`` histogram over the phase (its /metrics read before and
after): samples, mean lag, the bucket bound under which 99 % and all of the samples fell
(``loop_lag_p99_s``, ``loop_lag_max_s``), and the samples over 100 ms. Ratios loaded / alone of
ITL p50 and p99: the median over the rounds of each round's ratio (``itl_p50_ratio``,
``itl_p99_ratio``), and of the pooled gaps. The acceptance: p50 ratio <= 1.3 and p99 ratio <= 2
(``meets_acceptance``), and no loop-lag sample over 100 ms while loaded. A server without the lag
histogram gives None for its figures.

Reading ITL. A held loop sends a stream's waiting tokens together when it runs again: the
client sees one long gap and several near 0, so a stall raises ITL p99 and can lower ITL p50 (a
p50 ratio under 1 is no sign of health). TPOT p50 (per request: its span over its tokens) does
not move with bursts.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import sys
import time
import uuid
from dataclasses import dataclass, field

from common import BYTE_VOCAB, base_parser, emit_json, print_table, save_plot
from common import parse_args as parse_with_quick
from http_load import Prompt, RequestOptions, Result, Target, base_targets, percentile, probe, random_ids, send
from multiturn import OwnClusters, ratio

LOOP_LAG = "cpserve_router_event_loop_lag_seconds"
LAG_BOUND_S = 0.1  # the acceptance: no loop-lag sample over 100 ms while loaded
P50_BOUND, P99_BOUND = 1.3, 2.0  # the acceptance: loaded / alone ITL
PHASES = ("alone", "loaded")
REFUSED_CODE = "context_length_exceeded"


# ---- the heavy prompt -------------------------------------------------------------------------------
WORDS = ("the", "router", "reads", "each", "request", "and", "parses", "its", "body", "before", "any", "token",
         "is", "sent", "a", "long", "prompt", "of", "many", "words", "must", "not", "stall", "other", "streams",
         "while", "it", "renders", "template", "tokenizes", "text", "into", "ids", "for", "prefill", "then",
         "decode", "runs", "one", "step", "at", "time", "cache", "holds", "pages", "context", "parallel", "ranks",
         "share", "work", "across", "cores", "clients", "wait", "when", "loop", "blocks", "latency", "grows")


def word_text(chars: int, seed: int) -> str:
    """At least ``chars`` characters of seeded sentences of common words."""
    rng = random.Random(f"{seed}:words")
    out, n = [], 0
    while n < chars:
        words = [rng.choice(WORDS) for _ in range(rng.randint(6, 16))]
        sentence = " ".join(words).capitalize() + ". "
        out.append(sentence)
        n += len(sentence)
    return "".join(out)


def heavy_messages(tokenizer, tokens: int, seed: int = 0) -> list[dict]:
    """One user message of words that ``tokenizer``'s chat template (generation prompt added)
    renders to exactly ``tokens`` ids: a prefix of a word text, searched by its length (each
    guess scaled by the last one's characters per token, bisecting where a guess falls outside
    the bracket), then the next few prefixes until one renders to exactly that many (a merge can
    make the count grow by two tokens a character). Raises ``RuntimeError`` where none does."""
    def count(content: str) -> int:
        return len(tokenizer.apply_chat_template([{"role": "user", "content": content}]))

    if count("") > tokens:
        raise RuntimeError(f"the chat template alone renders {count('')} tokens, more than {tokens}")
    text = word_text(tokens * 4, seed)
    while count(text) <= tokens:
        text += word_text(len(text), seed + len(text))
    lo, hi = 0, len(text)  # count(text[:lo]) <= tokens < count(text[:hi])
    end = len(text) * tokens // count(text)
    while hi - lo > 1:
        c = count(text[:end])
        if c == tokens:
            return [{"role": "user", "content": text[:end]}]
        lo, hi = (end, hi) if c < tokens else (lo, end)
        guess = end * tokens // max(c, 1)
        end = guess if lo < guess < hi else (lo + hi) // 2
    for end in range(lo, min(lo + 64, len(text))):
        if count(text[:end]) == tokens:
            return [{"role": "user", "content": text[:end]}]
    raise RuntimeError(f"no prefix of the word text renders to exactly {tokens} tokens")


def local_tokenizer(name: str, tokenizer: str | None = None, trust_remote_code: bool = False,
                    chat_template: str | None = None):
    """The tokenizer (and chat template) of checkpoint ``name``, or of ``tokenizer``, as the
    router loads it. Raises ``RuntimeError`` naming what to pass where it cannot be loaded."""
    from engine.model.config import ModelConfigError
    from engine.model.tokenizer import TokenizerError, load_tokenizer

    try:
        tok = load_tokenizer(name, tokenizer, trust_remote_code, chat_template)
    except (TokenizerError, ModelConfigError) as e:
        raise RuntimeError(f"cannot load the tokenizer that renders the heavy prompts ({e}); pass --tokenizer DIR") \
            from None
    if not getattr(tok, "has_chat_template", False):
        raise RuntimeError(f"{tok.source} has no tokenizer with a chat template; pass --tokenizer DIR")
    tok.hf.model_max_length = 1 << 30  # the prompts are meant to be long: no warning about it
    return tok


@dataclass(frozen=True)
class Heavy:
    """The heavy clients' request: ``messages`` render to ``tokens``; ``served``: a fresh
    cache_salt each, max_tokens 1, expected 200; else expected 400 context_length_exceeded."""

    messages: list[dict]
    tokens: int
    limit: int  # the server's max_model_len
    served: bool

    @property
    def expected(self) -> str:
        return "200" if self.served else f"400 {REFUSED_CODE}"

    def body(self, model: str) -> bytes:
        body = {"model": model, "messages": self.messages, "max_tokens": 1, "temperature": 0.0}
        if self.served:
            body["cache_salt"] = uuid.uuid4().hex
        return json.dumps(body).encode()


def heavy_tokens(limit: int, kind: str) -> int:
    """The heavy prompt's tokens for a server whose limit is ``limit``."""
    return limit if kind == "refused" else limit - 2  # served: limit - 1 - max_tokens (1)


# ---- reading the router's loop-lag histogram --------------------------------------------------------
@dataclass
class Histogram:
    """A Prometheus histogram (summed over labels): cumulative count per bucket bound, sum, count."""

    buckets: dict[float, float] = field(default_factory=dict)
    sum: float = 0.0
    count: float = 0.0

    def __sub__(self, other: "Histogram") -> "Histogram":
        return Histogram({le: v - other.buckets.get(le, 0.0) for le, v in self.buckets.items()},
                         self.sum - other.sum, self.count - other.count)

    def __add__(self, other: "Histogram") -> "Histogram":
        les = set(self.buckets) | set(other.buckets)
        return Histogram({le: self.buckets.get(le, 0.0) + other.buckets.get(le, 0.0) for le in sorted(les)},
                         self.sum + other.sum, self.count + other.count)

    def within(self, bound_s: float) -> float:
        """Samples in buckets whose bound is at most ``bound_s`` (a lower bound of those <= it)."""
        return max((v for le, v in self.buckets.items() if le <= bound_s), default=0.0)

    def quantile_le(self, q: float) -> float | None:
        """The least bucket bound under which a fraction ``q`` of the samples fell (inf: past
        the last finite bound); None without samples."""
        if self.count <= 0:
            return None
        return next((le for le, v in sorted(self.buckets.items()) if v >= q * self.count - 1e-9), float("inf"))

    def figures(self) -> dict:
        n = int(round(self.count))
        return {"samples": n, "mean_s": self.sum / self.count if self.count > 0 else None,
                "p99_s": self.quantile_le(0.99), "max_s": self.quantile_le(1.0),
                "over_100ms": n - int(round(self.within(LAG_BOUND_S)))}


def parse_histogram(text: str, name: str) -> Histogram | None:
    """Histogram ``name`` from Prometheus text, summed over its other labels; None where absent."""
    from prometheus_client.parser import text_string_to_metric_families

    out, seen = Histogram(), False
    for family in text_string_to_metric_families(text):
        if family.name != name:
            continue
        for s in family.samples:
            seen = True
            if s.name == f"{name}_bucket":
                le = float(s.labels["le"])
                out.buckets[le] = out.buckets.get(le, 0.0) + s.value
            elif s.name == f"{name}_sum":
                out.sum += s.value
            elif s.name == f"{name}_count":
                out.count += s.value
    out.buckets = dict(sorted(out.buckets.items()))
    return out if seen and out.buckets else None


def read_loop_lag(target: Target) -> Histogram | None:
    import httpx

    try:
        r = httpx.get(f"{target.url}/metrics", headers=target.headers, trust_env=False, timeout=60)
    except httpx.HTTPError:
        return None
    return parse_histogram(r.text, LOOP_LAG) if r.status_code == 200 else None


# ---- one phase --------------------------------------------------------------------------------------
@dataclass
class HeavyResult:
    start: float
    latency_ms: float
    status: str  # "400 context_length_exceeded", "200", "503 ...", or the exception's name
    detail: str = ""  # the error's message (or the exception), where not 200


@dataclass
class Phase:
    round: int
    kind: str  # alone | loaded
    start: float
    end: float  # start + phase_s: the window whose gaps count
    light: list[Result]
    heavy: list[HeavyResult]
    lag: Histogram | None  # the router's loop lag over the phase (None: no such metric)

    @property
    def gaps_ms(self) -> list[float]:
        return gaps_in(self.light, self.start, self.end)


def gaps_in(results: list[Result], start: float, end: float) -> list[float]:
    """The ITL gaps (ms) of ``results`` whose later chunk came within [start, end]."""
    out = []
    for r in results:
        if r.error is not None or not r.itl_ms:
            continue
        at = r.start + r.ttft_ms / 1e3
        for gap in r.itl_ms:
            at += gap / 1e3
            if start <= at <= end:
                out.append(gap)
    return out


async def heavy_request(client, target: Target, heavy: Heavy) -> HeavyResult:
    import httpx

    body = heavy.body(target.model)
    t0 = time.perf_counter()
    try:
        r = await client.post(f"{target.url}/v1/chat/completions", content=body,
                              headers={**target.headers, "Content-Type": "application/json"})
        status, detail = str(r.status_code), ""
        if r.status_code != 200:
            try:
                error = r.json()["error"]
                status, detail = f"{status} {error['code']}", str(error["message"])[:300]
            except (ValueError, KeyError, TypeError):
                detail = r.text[:300]
    except httpx.HTTPError as e:
        status, detail = type(e).__name__, str(e)[:300]
    return HeavyResult(t0, (time.perf_counter() - t0) * 1e3, status, detail)


async def heavy_client(client, target: Target, heavy: Heavy, stop_at: float, out: list[HeavyResult]) -> None:
    while time.perf_counter() < stop_at:
        out.append(await heavy_request(client, target, heavy))


async def light_stream(client, target: Target, prompt: Prompt, opts: RequestOptions, stop_at: float,
                       out: list[Result]) -> None:
    while time.perf_counter() < stop_at:
        out.append(await send(client, target, len(out), prompt, opts))


async def run_phase(target: Target, light: list[Prompt], heavy: Heavy | None, clients: int, phase_s: float,
                    timeout_s: float, index: int, kind: str) -> Phase:
    """Every light stream (and with ``heavy``, ``clients`` heavy clients) for ``phase_s``
    seconds, then until the requests in flight end; the loop-lag histogram read around it all."""
    import httpx

    before = await asyncio.to_thread(read_loop_lag, target)
    width = len(light) + clients + 4
    limits = httpx.Limits(max_connections=width, max_keepalive_connections=width)
    results: list[list[Result]] = [[] for _ in light]
    heavy_out: list[HeavyResult] = []
    opts = RequestOptions()
    async with httpx.AsyncClient(trust_env=False, timeout=httpx.Timeout(timeout_s), limits=limits) as client:
        start = time.perf_counter()
        stop_at = start + phase_s
        work = [light_stream(client, target, p, opts, stop_at, rs) for p, rs in zip(light, results)]
        if heavy is not None:
            work += [heavy_client(client, target, heavy, stop_at, heavy_out) for _ in range(clients)]
        await asyncio.gather(*work)
    after = await asyncio.to_thread(read_loop_lag, target)
    lag = after - (before or Histogram()) if after is not None else None
    return Phase(index, kind, start, stop_at, [r for rs in results for r in rs], heavy_out, lag)


def phase_order(rounds: int) -> list[tuple[int, str]]:
    """(round, kind) in the order run: alone first in even rounds, loaded first in odd ones."""
    return [(r, kind) for r in range(rounds) for kind in (PHASES if r % 2 == 0 else PHASES[::-1])]


def measure(target: Target, heavy: Heavy, args: argparse.Namespace) -> list[Phase]:
    """The warm-up, then every phase of every round (progress on stderr)."""
    light = light_prompts(args)
    warm_up(target, heavy, light, args)
    phases = []
    order = phase_order(args.rounds)
    for i, (rnd, kind) in enumerate(order):
        print(f"[{i + 1}/{len(order)}] round {rnd + 1} {kind} ({args.phase_s:g} s) ...", file=sys.stderr, flush=True)
        phase = asyncio.run(run_phase(target, light, heavy if kind == "loaded" else None, args.heavy_clients,
                                      args.phase_s, args.timeout, rnd, kind))
        f = figures_of([phase], heavy.expected)
        lag = "no loop-lag metric" if f["loop_lag_samples"] is None else \
            f"loop lag p99 <= {f['loop_lag_p99_s']:g} s, {f['loop_lag_over_100ms']} samples over 100 ms"
        print(f"    ITL p50 {f['itl_ms_p50']:.1f} ms, p99 {f['itl_ms_p99']:.1f} ms over {f['gaps']} gaps; "
              f"{f['heavy_requests']} heavy requests; {lag}", file=sys.stderr, flush=True)
        phases.append(phase)
    return phases


def light_prompts(args: argparse.Namespace) -> list[Prompt]:
    """One prompt per stream: token ids every byte-level tokenizer has (any vocabulary holds them)."""
    return random_ids(args.streams, (args.prompt_len, args.prompt_len), args.output_len, BYTE_VOCAB, args.seed)


def warm_up(target: Target, heavy: Heavy, light: list[Prompt], args: argparse.Namespace) -> None:
    """One request per light stream and one heavy request; raises ``RuntimeError`` when one fails
    (the heavy one: unless it got what its kind expects)."""
    import httpx

    async def go():
        async with httpx.AsyncClient(trust_env=False, timeout=httpx.Timeout(args.timeout)) as client:
            done = await asyncio.gather(*(send(client, target, -1, p, RequestOptions()) for p in light))
            return done, await heavy_request(client, target, heavy)

    print("warm-up ...", file=sys.stderr, flush=True)
    done, got = asyncio.run(go())
    failed = [r.error for r in done if r.error]
    if failed:
        raise RuntimeError(f"{target.url}: a light warm-up request failed: {failed[0]}")
    if got.status != heavy.expected:
        raise RuntimeError(f"{target.url}: a heavy request of {heavy.tokens} tokens got {got.status}, expected "
                           f"{heavy.expected}" + (f" ({got.detail})" if got.detail else ""))


# ---- figures ----------------------------------------------------------------------------------------
def figures_of(phases: list[Phase], expected: str) -> dict:
    """ITL, light TTFT, heavy requests and loop lag over ``phases`` together (one phase, or every
    phase of a kind); heavy statuses other than ``expected`` count in ``heavy_unexpected``."""
    light = [r for p in phases for r in p.light]
    ok = [r for r in light if r.error is None]
    gaps = [g for p in phases for g in p.gaps_ms]
    heavy = [h for p in phases for h in p.heavy]
    window = sum(p.end - p.start for p in phases)
    statuses: dict[str, int] = {}
    for h in heavy:
        statuses[h.status] = statuses.get(h.status, 0) + 1
    lags = [p.lag for p in phases]
    lag = sum(lags[1:], lags[0]) if lags and None not in lags else None
    lag_figures = lag.figures() if lag is not None else dict.fromkeys(Histogram().figures())
    return {
        "light_requests": len(light), "light_errors": len(light) - len(ok),
        "light_error_messages": sorted({r.error for r in light if r.error})[:3],
        "gaps": len(gaps), "itl_ms_p50": percentile(gaps, 50), "itl_ms_p99": percentile(gaps, 99),
        "ttft_ms_p50": percentile([r.ttft_ms for r in ok], 50),
        "tpot_ms_p50": percentile([r.tpot_ms for r in ok if r.tpot_ms == r.tpot_ms], 50),
        "heavy_requests": len(heavy), "heavy_req_s": len(heavy) / window if window else float("nan"),
        "heavy_latency_ms_p50": percentile([h.latency_ms for h in heavy], 50),
        "heavy_statuses": dict(sorted(statuses.items())),
        "heavy_unexpected": sum(n for s, n in statuses.items() if s != expected),
        **{f"loop_lag_{k}": v for k, v in lag_figures.items()},
        "loop_lag_buckets": None if lag is None else {str(le): v for le, v in lag.buckets.items()},
    }


def median(values: list[float]) -> float:
    known = [v for v in values if v == v]
    return statistics.median(known) if known else float("nan")


def figures(phases: list[Phase], heavy: Heavy) -> dict:
    """Every figure of a run (the JSON's body, less the run's settings)."""
    kinds = {kind: figures_of([p for p in phases if p.kind == kind], heavy.expected) for kind in PHASES}
    rounds = []
    for rnd in sorted({p.round for p in phases}):
        mine = {p.kind: figures_of([p], heavy.expected) for p in phases if p.round == rnd}
        rounds.append({"round": rnd, **{f"itl_{q}_ratio": ratio(mine["loaded"][f"itl_ms_{q}"],
                                                                mine["alone"][f"itl_ms_{q}"]) for q in ("p50", "p99")}})
    out = {
        "phases": [{"round": p.round, "phase": p.kind, **figures_of([p], heavy.expected)} for p in phases],
        "per_round": rounds, **kinds,
        "itl_p50_ratio": median([r["itl_p50_ratio"] for r in rounds]),
        "itl_p99_ratio": median([r["itl_p99_ratio"] for r in rounds]),
        "itl_p50_ratio_pooled": ratio(kinds["loaded"]["itl_ms_p50"], kinds["alone"]["itl_ms_p50"]),
        "itl_p99_ratio_pooled": ratio(kinds["loaded"]["itl_ms_p99"], kinds["alone"]["itl_ms_p99"]),
    }
    for kind in PHASES:
        for k in ("samples", "mean_s", "p99_s", "max_s", "over_100ms"):
            out[f"loop_lag_{k}_{kind}"] = kinds[kind][f"loop_lag_{k}"]
    loaded = kinds["loaded"]
    out.update({
        "loop_lag_metric": loaded["loop_lag_samples"] is not None,
        "heavy_req_s": loaded["heavy_req_s"], "heavy_requests": loaded["heavy_requests"],
        "heavy_statuses": loaded["heavy_statuses"], "heavy_unexpected": loaded["heavy_unexpected"],
        "light_errors": sum(kinds[k]["light_errors"] for k in PHASES),
        "meets_acceptance": out["itl_p50_ratio"] <= P50_BOUND and out["itl_p99_ratio"] <= P99_BOUND,
        "loop_lag_within_100ms_loaded": None if loaded["loop_lag_over_100ms"] is None
        else loaded["loop_lag_over_100ms"] == 0,
    })
    return out


# ---- report -----------------------------------------------------------------------------------------
def _cell(v):
    return "-" if v is None else v


def report(out: dict, heavy: Heavy, args: argparse.Namespace) -> None:
    columns = ["round", "phase", "light req", "errors", "gaps", "ITL p50 ms", "ITL p99 ms", "TPOT p50 ms",
               "TTFT p50 ms", "heavy req", "heavy/s", "heavy p50 ms", "heavy other", "lag samples", "lag mean ms",
               "lag p99 <= ms", "lag max <= ms", "lag > 100 ms"]

    def ms(v):
        return "-" if v is None else v * 1e3

    def row(first, second, f):
        return [first, second, f["light_requests"], f["light_errors"], f["gaps"], f["itl_ms_p50"], f["itl_ms_p99"],
                f["tpot_ms_p50"], f["ttft_ms_p50"], f["heavy_requests"], f["heavy_req_s"], f["heavy_latency_ms_p50"],
                f["heavy_unexpected"], _cell(f["loop_lag_samples"]), ms(f["loop_lag_mean_s"]),
                ms(f["loop_lag_p99_s"]), ms(f["loop_lag_max_s"]), _cell(f["loop_lag_over_100ms"])]

    print_table(f"{args.streams} light streams ({args.prompt_len} prompt ids, {args.output_len} tokens each) alone "
                f"and with {args.heavy_clients} heavy clients ({heavy.tokens}-token chat prompts, {args.heavy_kind}; "
                f"other: not {heavy.expected}); {args.phase_s:g} s phases; lag: the router's event loop", columns,
                [row(p["round"] + 1, p["phase"], p) for p in out["phases"]]
                + [row("all", kind, out[kind]) for kind in PHASES])
    print_table("ITL loaded / alone (acceptance: p50 <= 1.3, p99 <= 2)", ["round", "p50 ratio", "p99 ratio"],
                [[r["round"] + 1, r["itl_p50_ratio"], r["itl_p99_ratio"]] for r in out["per_round"]]
                + [["median", out["itl_p50_ratio"], out["itl_p99_ratio"]],
                   ["pooled", out["itl_p50_ratio_pooled"], out["itl_p99_ratio_pooled"]]])
    if not out["loop_lag_metric"]:
        print(f"the server's /metrics has no {LOOP_LAG} histogram: no loop-lag figures")
    if out["light_errors"] or out["heavy_unexpected"]:
        print(f"{out['light_errors']} light requests failed ("
              + "; ".join(m for k in PHASES for m in out[k]["light_error_messages"])
              + f"); heavy requests' answers: {out['heavy_statuses']}")


def plot(out: dict, phases: list[Phase], args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(15, 3.8))
    for kind, color in zip(PHASES, ("tab:blue", "tab:red")):
        gaps = sorted(g for p in phases if p.kind == kind for g in p.gaps_ms)
        if gaps:
            ax[0].plot(gaps, [(i + 1) / len(gaps) for i in range(len(gaps))], color=color, label=kind)
        lag = out[kind]["loop_lag_buckets"]
        if lag and out[kind]["loop_lag_samples"]:
            bounds = [float(le) for le in lag if float(le) != float("inf")]
            ax[2].step(bounds, [lag[str(le)] / out[kind]["loop_lag_samples"] for le in bounds], where="post",
                       color=color, label=kind)
    ax[0].set(xscale="log", xlabel="ITL ms", ylabel="fraction of gaps", title="light streams' ITL (CDF)")
    rounds = out["per_round"]
    width = 0.2
    for i, (kind, q) in enumerate((k, q) for q in ("p50", "p99") for k in PHASES):
        values = [next(p[f"itl_ms_{q}"] for p in out["phases"] if p["round"] == r["round"] and p["phase"] == kind)
                  for r in rounds]
        ax[1].bar([r["round"] + 1 + (i - 1.5) * width for r in rounds], values, width,
                  color=("tab:blue", "tab:red")[PHASES.index(kind)], alpha=1.0 if q == "p50" else 0.45,
                  label=f"{kind} {q}")
    ax[1].set(xlabel="round", ylabel="ms", title="ITL per round (light: p99)", xticks=[r["round"] + 1 for r in rounds])
    if out["loop_lag_metric"]:
        ax[2].set(xscale="log", xlabel="lag s (bucket bound)", ylabel="fraction of samples <=",
                  title="router event-loop lag (CDF of buckets)")
        ax[2].axvline(LAG_BOUND_S, color="grey", ls=":")
    else:
        ax[2].text(0.5, 0.5, f"no {LOOP_LAG}\non the server's /metrics", ha="center", va="center",
                   transform=ax[2].transAxes)
        ax[2].set_axis_off()
    for a in ax:
        if a.get_legend_handles_labels()[0]:
            a.legend(fontsize=7)
    save_plot(fig, args.out, "router_stall.png")


# ---- the target -------------------------------------------------------------------------------------
@contextlib.contextmanager
def own_cluster(model: str, up_args: str = ""):
    """One cluster as ``cpserve up --model MODEL UP_ARGS`` starts it (bench/multiturn.py's
    ``OwnClusters``), stopped on leaving: yields its target and the ``OwnClusters``."""
    own = OwnClusters(argparse.Namespace(model=model, up_args=up_args, shapes=[], pairings=[], compare_off=False))
    try:
        (target,) = own.start()
        yield target, own
    finally:
        own.stop()


def max_model_len(target: Target) -> int:
    """``max_model_len`` of the target's first model card (GET /v1/models)."""
    import httpx

    try:
        r = httpx.get(f"{target.url}/v1/models", headers=target.headers, trust_env=False, timeout=60)
        return int(r.json()["data"][0]["max_model_len"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as e:
        raise RuntimeError(f"{target.url}: GET /v1/models gave no max_model_len ({type(e).__name__}: {e})") from None


def build_heavy(tokenizer, target: Target, kind: str, seed: int = 0) -> Heavy:
    """The heavy request for ``target``'s context limit, its token count checked against the
    server's POST /tokenize (where it has one). Raises ``RuntimeError`` on a mismatch."""
    import httpx

    limit = max_model_len(target)
    tokens = heavy_tokens(limit, kind)
    print(f"heavy prompt: {tokens} tokens through the chat template ...", file=sys.stderr, flush=True)
    heavy = Heavy(heavy_messages(tokenizer, tokens, seed), tokens, limit, kind == "served")
    try:
        r = httpx.post(f"{target.url}/tokenize", json={"model": target.model, "messages": heavy.messages},
                       headers=target.headers, trust_env=False, timeout=120)
        count = r.json().get("count") if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        count = None
    if count is None:
        print(f"{target.url}: no POST /tokenize count; the heavy prompt's length is this tokenizer's "
              f"({tokenizer.source})", file=sys.stderr, flush=True)
    elif count != tokens:
        raise RuntimeError(f"the heavy prompt renders to {tokens} tokens with {tokenizer.source} but to {count} "
                           f"on {target.url} (POST /tokenize): pass the server's --tokenizer")
    return heavy


# ---- arguments --------------------------------------------------------------------------------------
QUICK = dict(phase_s=5.0, rounds=2, output_len=16)
QUICK_UP_ARGS = "--prefill-cp 1 --decode-dcp 1"  # --quick without --base-url and --up-args: the quickest start
HEAVY_KINDS = ("refused", "served")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = base_parser(__doc__)
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("--base-url", default=None, metavar="URL", help="a running server; none: start a cluster here")
    p.add_argument("--model", default=None,
                   help="with --base-url: the model name sent (default: the first GET /v1/models id); without: the "
                        "checkpoint (demo, tiny or a directory; default demo, --quick tiny)")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="with --base-url: the checkpoint or tokenizer directory whose chat template renders the heavy "
                        "prompts (default: the served model's name: demo, tiny or a directory here)")
    p.add_argument("--api-key", default=None, help="with --base-url: sent as 'Authorization: Bearer KEY'")
    p.add_argument("--up-args", default="", metavar="FLAGS",
                   help="without --base-url: more `cpserve up` flags (e.g. --up-args=\"--prefill-cp 1\")")
    p.add_argument("--streams", type=int, default=4, help="light streams (default 4)")
    p.add_argument("--prompt-len", type=int, default=32, help="token ids of each light prompt (default 32)")
    p.add_argument("--output-len", type=int, default=64, help="tokens of each light request (default 64; --quick 16)")
    p.add_argument("--heavy-clients", type=int, default=2, help="heavy clients in the loaded phases (default 2)")
    p.add_argument("--heavy-kind", choices=HEAVY_KINDS, default="refused",
                   help="refused: prompts of exactly max_model_len tokens (a 400 after the router's whole parse; "
                        "default); served: max_model_len - 2 tokens, max_tokens 1 (the whole cluster)")
    p.add_argument("--phase-s", type=float, default=20.0, help="seconds of each phase (default 20; --quick 5)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of an alone and a loaded phase (default 3; --quick 2)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one request may take (default 300)")
    p.add_argument("--seed", type=int, default=0)
    args = parse_with_quick(p, QUICK, argv)
    for flag, value, low in (("--streams", args.streams, 1), ("--prompt-len", args.prompt_len, 1),
                             ("--output-len", args.output_len, 2), ("--heavy-clients", args.heavy_clients, 1),
                             ("--rounds", args.rounds, 1)):
        if value < low:
            p.error(f"{flag} must be >= {low}, got {value}")
    for flag, value in (("--phase-s", args.phase_s), ("--timeout", args.timeout)):
        if not value > 0:
            p.error(f"{flag} must be > 0, got {value}")
    if args.base_url:
        if args.up_args:
            p.error("--up-args applies only without --base-url (to the cluster this script starts)")
    else:
        for flag, given in (("--api-key", args.api_key), ("--tokenizer", args.tokenizer)):
            if given:
                p.error(f"{flag} applies only with --base-url (the cluster started here: put it in --up-args)")
        args.model = args.model or ("tiny" if args.quick else "demo")
        if args.quick and not args.up_args:
            args.up_args = QUICK_UP_ARGS
    return args


def main() -> None:
    t_all = time.perf_counter()
    args = parse_args()
    with contextlib.ExitStack() as stack:
        try:
            if args.base_url:
                (target,) = base_targets(argparse.Namespace(base_url=[args.base_url], api_key=args.api_key))
                own = None
            else:
                print(f"starting `cpserve up --model {args.model} {args.up_args}` ...", file=sys.stderr, flush=True)
                target, own = stack.enter_context(own_cluster(args.model, args.up_args))
            probe(target, None if own else args.model)
            if own:
                ns = own.spaces["cluster"]
                tokenizer = local_tokenizer(args.model, ns.tokenizer, ns.trust_remote_code, ns.chat_template)
            else:
                tokenizer = local_tokenizer(args.tokenizer or target.model)
            t0 = time.perf_counter()
            heavy = build_heavy(tokenizer, target, args.heavy_kind, args.seed)
            heavy_build_s = time.perf_counter() - t0
            phases = measure(target, heavy, args)
        except RuntimeError as e:
            sys.exit(f"bench/router_stall.py: {e}")
    out = figures(phases, heavy)
    report(out, heavy, args)
    plot(out, phases, args)
    wall = time.perf_counter() - t_all
    print(f"wall time: {wall:.1f} s")
    emit_json(args.json, {
        "mode": "own" if own else "base_url", "model": target.model, "url": target.url, "is_cpserve": target.is_cpserve,
        "up_argv": own.argv["cluster"] if own else None, "startup_s": own.startup_s.get("cluster") if own else None,
        "quick": args.quick, "cpus": os.cpu_count(), "max_model_len": heavy.limit,
        "heavy_kind": args.heavy_kind, "heavy_tokens": heavy.tokens, "heavy_clients": args.heavy_clients,
        "heavy_build_s": heavy_build_s, "streams": args.streams, "prompt_len": args.prompt_len,
        "output_len": args.output_len, "phase_s": args.phase_s, "rounds": args.rounds, "seed": args.seed,
        **out, "wall_s": wall,
    })


if __name__ == "__main__":
    main()
