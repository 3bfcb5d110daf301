"""Long agent conversations against OpenAI-compatible servers: what each later turn costs with KV
reuse on, side by side with the same prompt cold and with a prompt of only the turn's new tokens
(issue 40: long conversations pay only for their new tokens).

    python bench/multiturn.py [--quick] [--json] [--model demo|tiny|bench|DIR] [--clusters P+D[,P+D...]]
        [--compare-off] [--pairings cache_aware,load] [--up-args="FLAGS"] [--system-len 512] [--first-len 8192]
        [--growth 600] [--output-len 32] [--turns 6] [--conversations 1] [--concurrency 1] [--seed 0]
        [--timeout 600]
    python bench/multiturn.py --base-url URL [--base-url URL2 ...] [--model NAME] [--api-key KEY]
        [--vocab-size V] ...

Conversations, as token ids on /v1/completions (streamed, ``temperature 0``, ``ignore_eos``,
``return_token_ids``; bench/http_load.py sends them as bench/serving.py does). Every
conversation starts with the same system prompt (``--system-len`` tokens) and its own first
context (``--first-len``); turn t + 1's prompt is turn t's prompt, then the answer the server
gave to it (the ``--output-len`` token ids it streamed), then a "tool output" (``--growth``
tokens). Ids are seeded random in [3, V) (V: the checkpoint's vocabulary for clusters started
here, else ``--vocab-size``, default 259). ``--conversations`` conversations, ``--concurrency``
of them at a time, each one turn after the other.

Each turn sends three requests, one after the other, their order rotating with the turn and the
conversation (so none is always first after the previous turn):

- on: the conversation's prompt as a client sends it; the server reuses what it holds.
- cold: the same prompt with a fresh random ``cache_salt`` (requests with different salts never
  share cached KV): a cold prompt of the same length, on the same server, right next to "on".
- ideal: a cold prompt (fresh salt) of only the turn's new tokens (the answer and the tool
  output; turn 0: the first context): the turn's price if the context it extends were free.

The "on" requests carry one salt per target for the whole run (the conversations on a target
share the system prompt, which the warm-up request caches with that salt; nothing an earlier run
or another target left counts, even where targets share services). The cold and ideal requests'
KV takes cache space on the server like any other request's.

Targets. ``--base-url`` (repeatable) names running servers; ``--model`` is then the name sent
(default: the first id of GET /v1/models). Without it the script starts clusters with
``services.up.start_cluster``, exactly as ``cpserve up`` does (its defaults: prefill CP 2,
decode DCP 2, KV reuse on), ``--model`` (default demo, the trained embedded model) and
``--up-args`` (more ``cpserve up`` flags, e.g. ``--up-args="--pairing load"``), one per ``--clusters``
shape (named ``cluster P+D``; without the option one ``cluster``); ``--compare-off`` starts a
twin of each with ``--no-prefix-cache`` (``... no-reuse``: reuse really off on prefill and
decode), which gets the same conversations (its own answers) but only the "on" request per turn.
``--pairings cache_aware,load`` starts each shape once per listed router pairing policy, with
``--pairing X`` added to its ``cpserve up`` flags (named ``cluster pairing=X``, ``cluster 1+1
pairing=X``; ``--pairing`` then may not be in ``--up-args``); with two or more, every cluster
gets the "on" requests only (so each router's requests per service are the conversations'), and
``--compare-off`` twins only the first. Targets
take turns per conversation turn, the order rotating, so they share the machine's noise.

Figures, per target and turn (over the conversations):

- TTFT p50 / p99 of on, cold and ideal (client side: request sent -> first output chunk), and
  on / cold and on / ideal (of the p50s). Reuse works when on / cold falls with the turn and
  on / ideal stays near 1.
- the router's TTFT stages of the "on" requests (GET /debug/ttft, matched by response id; mean
  ms per stage; cpserve targets only).
- cached: prompt tokens the prefill prefix cache held (``usage.prompt_tokens_details.
  cached_tokens``, else the router's record); decode cached: prompt tokens decode already held
  (``decode_cached_tokens`` of the record); hit rate: cached / prompt tokens (summed); KV moved:
  ``transfer_bytes`` prefill wrote to decode for the on (and the cold) request. None: the server
  does not say.
- errors: failed requests (a failed "on" request ends that conversation on that target).

Per target, ``pairing`` (what several services behind one router do with a conversation), over
the "on" requests of turns t >= 1 (every conversation):

- reusable: what the services could hold of turn t's prompt from turn t - 1 ("on"), in 16-token
  pages, never the prompt's last token: prefill ``min(P // 16, (L - 1) // 16) * 16`` and decode
  ``min((P + O - 1) // 16, (L - 1) // 16) * 16`` (P, O: turn t - 1's prompt and answer tokens, L:
  turn t's prompt; decode holds the answer's KV but the last token's). Decode's is an upper bound
  at DCP 1: with DCP > 1 decode pages are 16 * DCP tokens and reuse is aligned to those.
- reused: the requests' ``cached_tokens`` (prefill) and ``decode_cached_tokens`` (decode) as above,
  summed, and reused / reusable; over the requests that report them (None: none does). A
  conversation that meets other services than its last turn's reuses less.
- paired requests per service (``cpserve_service_paired_requests_total`` of the router's /metrics,
  kind prefill and decode: read after the warm-up and after the run, the difference; every kind
  of request counts, and a retried one twice), each service's share and the least and greatest
  prefill and decode share, and the pairing decisions by reason
  (``cpserve_router_pairing_decisions_total``, the same difference). None: no such metrics.

Two prefill and two decode services behind one router, 8 interleaved conversations of 5 turns,
cache-aware pairing beside load-only (the acceptance: cache_aware reuses >= 90 % of the reusable
tokens, and each prefill service takes between 30 % and 70 % of the requests)::

    .venv/bin/python bench/multiturn.py --model tiny --pairings cache_aware,load \\
        --up-args="--prefill-services 2 --decode-services 2 --prefill-cp 1 --decode-dcp 1" \\
        --conversations 8 --concurrency 8 --turns 5 --first-len 2048 --growth 256 --json

Per target and kind: requests, prompt and output tokens, the requests' summed durations
(busy s) and tokens per busy second (at concurrency 1: the rate of a conversation run alone);
and the run's wall time. ``summary``: the same TTFT and cache figures over the turns after the
first. ``mismatches``: "on" and "cold" requests of the same prompt whose output token ids
differ (greedy: they must not); ``mismatches_vs_no_reuse``: the same between a cluster's "on"
and its no-reuse twin's, where their prompts are equal. ``salted_cached_nonzero``: cold or
ideal requests that report cached tokens (a fresh salt must find none).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import shlex
import sys
import time
import uuid
from dataclasses import dataclass

from common import (BYTE_VOCAB, base_parser, bench_model_dir, emit_json, parse_shapes, print_table, save_plot,
                    vocab_size)
from common import parse_args as parse_with_quick
from http_load import (Prompt, RequestOptions, Result, Target, base_targets, percentile, probe, request_ttft_records,
                       send)

KINDS = ("on", "cold", "ideal")
RECORDS_EVERY = 512  # requests between two reads of /debug/ttft (the router keeps its last 2,048)
NO_REUSE = " no-reuse"


# ---- conversations -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Conversation:
    """The fixed token ids of one conversation; the answers come from each server as it runs
    (two servers may answer differently), so a prompt is built from the answers given so far."""

    index: int
    system: tuple[int, ...]
    first: tuple[int, ...]
    tools: tuple[tuple[int, ...], ...]  # tools[t - 1]: the tool output that turn t appends

    @property
    def turns(self) -> int:
        return len(self.tools) + 1

    def prompt(self, turn: int, answers: list[list[int]]) -> list[int]:
        """Turn ``turn``'s prompt: system prompt, first context, then for every earlier turn k its
        answer ``answers[k]`` and the tool output of turn k + 1."""
        ids = [*self.system, *self.first]
        for k in range(turn):
            ids += [*answers[k], *self.tools[k]]
        return ids

    def new_tokens(self, turn: int, answers: list[list[int]]) -> list[int]:
        """What turn ``turn`` appends to the previous turn's prompt (turn 0: the first context;
        the system prompt is every conversation's)."""
        return list(self.first) if turn == 0 else [*answers[turn - 1], *self.tools[turn - 1]]


def build_conversations(n: int, system_len: int, first_len: int, growth: int, turns: int, vocab: int,
                        seed: int) -> list[Conversation]:
    """``n`` conversations of ``turns`` turns, ids uniform in [3, vocab); one system prompt for all."""
    import random

    def ids(rng: random.Random, k: int) -> tuple[int, ...]:
        return tuple(rng.randrange(3, vocab) for _ in range(k))

    system = ids(random.Random(f"{seed}:system"), system_len)
    out = []
    for c in range(n):
        rng = random.Random(f"{seed}:conversation:{c}")
        out.append(Conversation(c, system, ids(rng, first_len), tuple(ids(rng, growth) for _ in range(turns - 1))))
    return out


# ---- one run -------------------------------------------------------------------------------------
@dataclass
class Sent:
    """One request of a run and what came back."""

    target: str
    conversation: int
    turn: int
    kind: str  # on | cold | ideal
    prompt_tokens: int  # sent
    new_tokens: int  # the turn's new tokens (the ideal request's prompt)
    prompt_key: int  # hash of the prompt's ids: equal prompts, equal keys
    result: Result


async def run_conversations(targets: list[Target], kinds: dict[str, tuple[str, ...]], convs: list[Conversation],
                            args: argparse.Namespace, opts: RequestOptions, salts: dict[str, str],
                            on_done=lambda: None) -> tuple[list[Sent], dict[str, dict], float]:
    """Every conversation on every target, the "on" requests with the target's salt (``salts``);
    returns the requests, the router records per target (by response id) and the run's wall time."""
    import httpx

    sent: list[Sent] = []
    records: dict[str, dict] = {t.name: {} for t in targets}
    since = {t.name: 0 for t in targets}
    width = min(args.concurrency, len(convs))
    limits = httpx.Limits(max_connections=width + 4, max_keepalive_connections=width + 4)
    async with httpx.AsyncClient(trust_env=False, timeout=httpx.Timeout(args.timeout), limits=limits) as client:

        async def collect(t: Target, force: bool = False) -> None:
            if t.is_cpserve and (force or since[t.name] >= RECORDS_EVERY):
                since[t.name] = 0
                records[t.name].update(await asyncio.to_thread(request_ttft_records, t))

        async def one(t: Target, conv: Conversation, turn: int, kind: str, ids: list[int], new: int) -> Sent:
            salt = salts[t.name] if kind == "on" else uuid.uuid4().hex
            prompt = Prompt({"prompt": ids, "cache_salt": salt, "return_token_ids": True}, args.output_len)
            res = await send(client, t, len(sent), prompt, opts)
            if res.error is None and len(res.ids) != res.output_tokens:
                res.error = (f"{len(res.ids)} token ids streamed for {res.output_tokens} output tokens (the next turn "
                             "needs the answer's ids: the server must honour return_token_ids)")
            s = Sent(t.name, conv.index, turn, kind, len(ids), new, hash(tuple(ids)), res)
            sent.append(s)
            on_done()
            return s

        async def conversation(conv: Conversation) -> None:
            answers: dict[str, list[list[int]]] = {t.name: [] for t in targets}
            broken: set[str] = set()
            for turn in range(conv.turns):
                k = (conv.index + turn) % len(targets)
                for t in targets[k:] + targets[:k]:
                    if t.name in broken:
                        continue
                    ids = conv.prompt(turn, answers[t.name])
                    new = conv.new_tokens(turn, answers[t.name])
                    mine = kinds[t.name]
                    r = (conv.index + turn) % len(mine)
                    got = {kind: await one(t, conv, turn, kind, new if kind == "ideal" else ids, len(new))
                           for kind in mine[r:] + mine[:r]}
                    if got["on"].result.error:
                        broken.add(t.name)
                    else:
                        answers[t.name].append(got["on"].result.ids)
                    since[t.name] += len(mine)
                    await collect(t)

        pending = iter(convs)

        async def worker() -> None:
            for conv in pending:  # one shared iterator: each worker takes the next conversation
                await conversation(conv)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(width)))
        wall = time.perf_counter() - start
        for t in targets:
            await collect(t, force=True)
    return sent, records, wall


def warm_up(target: Target, system: list[int], opts: RequestOptions, salt: str) -> None:
    """The system prompt alone, with the target's "on" salt: the first requests' start-up costs
    go here, and the system prompt is in the cache when the first conversation starts."""
    import httpx

    async def go():
        async with httpx.AsyncClient(trust_env=False, timeout=600) as client:
            prompt = Prompt({"prompt": list(system), "cache_salt": salt, "return_token_ids": True}, 2)
            return await send(client, target, -1, prompt, RequestOptions(ignore_eos=opts.ignore_eos))

    r = asyncio.run(go())
    if r.error:
        raise RuntimeError(f"{target.name}: the warm-up request failed: {r.error}")


# ---- figures -------------------------------------------------------------------------------------
def mean(values: list) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def ratio(a: float, b: float) -> float:
    return a / b if b and b == b and a == a else float("nan")


def _record(records: dict[str, dict], s: Sent) -> dict:
    return records.get(s.target, {}).get(s.result.response_id) or {}


def _cached(records: dict[str, dict], s: Sent) -> int | None:
    if s.result.cached_tokens is not None:
        return s.result.cached_tokens
    return _record(records, s).get("cached_tokens")


def cache_figures(ok: dict[str, list[Sent]], records: dict[str, dict]) -> dict:
    """Cache and KV-transfer figures of the "on" requests (and the cold ones' KV bytes)."""
    on = ok["on"]
    cached = [_cached(records, s) for s in on]
    decode = [_record(records, s).get("decode_cached_tokens") for s in on]

    def rate(values: list) -> float | None:
        pairs = [(v, s.result.prompt_tokens or s.prompt_tokens) for v, s in zip(values, on) if v is not None]
        return sum(v for v, _ in pairs) / sum(p for _, p in pairs) if pairs and sum(p for _, p in pairs) else None

    return {"cached_tokens": mean(cached), "decode_cached_tokens": mean(decode),
            "hit_rate": rate(cached), "decode_hit_rate": rate(decode),
            "transfer_bytes": mean([_record(records, s).get("transfer_bytes") for s in on]),
            "cold_transfer_bytes": mean([_record(records, s).get("transfer_bytes") for s in ok["cold"]])}


def ttft_figures(ok: dict[str, list[Sent]]) -> dict:
    out = {}
    for kind in KINDS:
        ttft = [s.result.ttft_ms for s in ok[kind]]
        out[f"{kind}_ttft_ms_p50"] = percentile(ttft, 50)
        out[f"{kind}_ttft_ms_p99"] = percentile(ttft, 99)
    out["on_over_cold"] = ratio(out["on_ttft_ms_p50"], out["cold_ttft_ms_p50"])
    out["on_over_ideal"] = ratio(out["on_ttft_ms_p50"], out["ideal_ttft_ms_p50"])
    return out


def stage_means(on: list[Sent], records: dict[str, dict]) -> tuple[dict[str, float], float | None]:
    """Mean ms per router TTFT stage over the requests that have a record (in the records'
    stage order), and the mean router TTFT."""
    recs = [r for r in (_record(records, s) for s in on) if r]
    stages: dict[str, list[float]] = {}
    for r in recs:
        for k, v in (r.get("stages_ms") or {}).items():
            stages.setdefault(k, []).append(v)
    return {k: sum(v) / len(v) for k, v in stages.items()}, mean([r.get("ttft_ms") for r in recs])


def _split(mine: list[Sent]) -> dict[str, list[Sent]]:
    return {kind: [s for s in mine if s.kind == kind and s.result.error is None] for kind in KINDS}


def turn_rows(sent: list[Sent], records: dict[str, dict], targets: list[str], turns: int) -> list[dict]:
    """One row of figures per target and turn."""
    rows = []
    for name in targets:
        for turn in range(turns):
            mine = [s for s in sent if s.target == name and s.turn == turn]
            ok = _split(mine)
            stages, router_ttft = stage_means(ok["on"], records)
            rows.append({"target": name, "turn": turn, "conversations": len(ok["on"]),
                         "prompt_tokens": mean([s.prompt_tokens for s in ok["on"]]),
                         "new_tokens": mean([s.new_tokens for s in ok["on"]]),
                         **ttft_figures(ok), "stages_ms": stages, "router_ttft_ms": router_ttft,
                         **cache_figures(ok, records),
                         "errors": sum(s.result.error is not None for s in mine)})
    return rows


def summary(sent: list[Sent], records: dict[str, dict], targets: list[str]) -> dict[str, dict]:
    """Per target, the TTFT and cache figures over every turn after the first (those that can
    reuse a conversation's own context)."""
    out = {}
    for name in targets:
        later = [s for s in sent if s.target == name and s.turn > 0]
        ok = _split(later)
        out[name] = {**ttft_figures(ok), **cache_figures(ok, records), "requests": len(later)}
    return out


def throughput(sent: list[Sent], targets: list[str]) -> list[dict]:
    """Per target and kind: tokens over the requests' summed durations."""
    rows = []
    for name in targets:
        for kind in KINDS:
            mine = [s for s in sent if s.target == name and s.kind == kind]
            if not mine:
                continue
            ok = [s for s in mine if s.result.error is None]
            busy = sum(s.result.end - s.result.start for s in ok)
            prompt = sum(s.result.prompt_tokens or s.prompt_tokens for s in ok)
            output = sum(s.result.output_tokens for s in ok)
            rows.append({"target": name, "kind": kind, "requests": len(mine), "errors": len(mine) - len(ok),
                         "prompt_tokens": prompt, "output_tokens": output, "busy_s": busy,
                         "prompt_tok_s": prompt / busy if busy else float("nan"),
                         "output_tok_s": output / busy if busy else float("nan")})
    return rows


def mismatches(sent: list[Sent], twins: dict[str, str]) -> dict:
    """Output ids of "on" vs "cold" (same target, same prompt), and of a cluster's "on" vs its
    no-reuse twin's where both got the same prompt. Failed requests are not compared."""
    ok = {(s.target, s.conversation, s.turn, s.kind): s for s in sent if s.result.error is None}
    pairs = [(s, ok.get((s.target, s.conversation, s.turn, "cold")), "cold") for s in ok.values() if s.kind == "on"]
    pairs += [(s, ok.get((twins[s.target], s.conversation, s.turn, "on")), twins[s.target])
              for s in ok.values() if s.kind == "on" and s.target in twins]
    out = {"compared": 0, "mismatches": 0, "compared_vs_no_reuse": 0, "mismatches_vs_no_reuse": 0, "examples": []}
    for a, b, what in pairs:
        if b is None or a.prompt_key != b.prompt_key:
            continue
        suffix = "" if what == "cold" else "_vs_no_reuse"
        out["compared" + suffix] += 1
        if a.result.ids != b.result.ids:
            out["mismatches" + suffix] += 1
            at = next((i for i, (x, y) in enumerate(zip(a.result.ids, b.result.ids)) if x != y),
                      min(len(a.result.ids), len(b.result.ids)))
            out["examples"].append(f"{a.target} conversation {a.conversation} turn {a.turn}: on vs {what}, "
                                   f"first differs at output {at}")
    out["examples"] = sorted(out["examples"])[:5]
    return out


def salted_cached_nonzero(sent: list[Sent], records: dict[str, dict]) -> int:
    return sum(1 for s in sent if s.kind != "on" and s.result.error is None and (_cached(records, s) or 0) > 0)


# ---- reuse across turns and pairing over services -----------------------------------------------
PAGE_TOKENS = 16  # a cache page (prefill's, and decode's at DCP 1)
PAIRED = "cpserve_service_paired_requests_total"
DECISIONS = "cpserve_router_pairing_decisions_total"


def reusable_tokens(prev_prompt: int, prev_output: int, prompt: int) -> tuple[int, int]:
    """(prefill, decode): tokens of a ``prompt``-token turn that the previous turn (its prompt and
    its answer) left in whole pages, never the prompt's last token (it is always computed).
    Prefill held the previous prompt; decode also the answer's KV, but its last token's."""
    cap = (prompt - 1) // PAGE_TOKENS * PAGE_TOKENS
    return (min(prev_prompt // PAGE_TOKENS * PAGE_TOKENS, cap),
            min(max(prev_prompt + prev_output - 1, 0) // PAGE_TOKENS * PAGE_TOKENS, cap))


def reuse_figures(sent: list[Sent], records: dict[str, dict], name: str) -> dict:
    """Reusable vs reused tokens, prefill and decode, of target ``name``'s "on" requests of turns
    >= 1 (each against its conversation's previous turn), over the requests that report reuse."""
    on = {(s.conversation, s.turn): s for s in sent
          if s.target == name and s.kind == "on" and s.result.error is None}
    pairs: dict[str, list[tuple[int, int | None]]] = {"prefill": [], "decode": []}
    for (conv, turn), s in sorted(on.items()):
        prev = on.get((conv, turn - 1))
        if prev is None:
            continue
        prefill, decode = reusable_tokens(prev.prompt_tokens, len(prev.result.ids), s.prompt_tokens)
        pairs["prefill"].append((prefill, _cached(records, s)))
        pairs["decode"].append((decode, _record(records, s).get("decode_cached_tokens")))
    out: dict = {"requests": len(pairs["prefill"])}
    for side, got in pairs.items():
        known = [(a, b) for a, b in got if b is not None]
        reusable = sum(a for a, _ in (known or got))
        reused = sum(b for _, b in known) if known else None
        out[side] = {"reusable_tokens": reusable, "reused_tokens": reused, "requests_reporting": len(known),
                     "reused_over_reusable": reused / reusable if reused is not None and reusable else None}
    return out


def parse_pairing_counters(text: str) -> dict | None:
    """From a router's /metrics text: requests paired per service (``{"prefill": {service: n},
    "decode": {...}}``) and pairing decisions by reason; None where the text has no paired-requests
    counter (not a cpserve router, or an older one)."""
    from prometheus_client.parser import text_string_to_metric_families

    paired: dict[str, dict[str, float]] = {}
    decisions: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == PAIRED:
                    paired.setdefault(sample.labels.get("kind", "?"), {})[sample.labels.get("service", "?")] = \
                        sample.value
                elif sample.name == DECISIONS:
                    decisions[sample.labels.get("reason", "?")] = sample.value
    except ValueError:  # not Prometheus text
        return None
    return {"paired": paired, "decisions": decisions} if paired else None


def read_pairing_counters(target: Target) -> dict | None:
    import httpx

    try:
        r = httpx.get(f"{target.url}/metrics", headers=target.headers, trust_env=False, timeout=30)
    except httpx.HTTPError:
        return None
    return parse_pairing_counters(r.text) if r.status_code == 200 else None


def _delta(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    return {k: int(round(v - before.get(k, 0.0))) for k, v in sorted(after.items())}


def shares(counts: dict[str, int]) -> dict[str, float]:
    """Each service's fraction of the requests ({} when there were none)."""
    total = sum(counts.values())
    return {k: v / total for k, v in counts.items()} if total else {}


def pairing_counter_figures(before: dict | None, after: dict | None) -> dict:
    """The run's paired requests per service (``after`` - ``before``), each service's share, the
    least and greatest share per kind, and the decisions by reason; None each where unknown."""
    if before is None or after is None:
        return {"paired_requests": None, "shares": None, "prefill_share_min": None, "prefill_share_max": None,
                "decode_share_min": None, "decode_share_max": None, "decisions": None}
    paired = {kind: _delta(before["paired"].get(kind, {}), after["paired"].get(kind, {}))
              for kind in ("prefill", "decode")}
    share = {kind: shares(counts) for kind, counts in paired.items()}
    out = {"paired_requests": paired, "shares": share}
    for kind in ("prefill", "decode"):
        out[f"{kind}_share_min"] = min(share[kind].values(), default=None)
        out[f"{kind}_share_max"] = max(share[kind].values(), default=None)
    out["decisions"] = _delta(before["decisions"], after["decisions"]) if after["decisions"] else None
    return out


def pairing_figures(sent: list[Sent], records: dict[str, dict], targets: list[str],
                    pairings: dict[str, str | None] | None = None,
                    counters: dict[str, tuple[dict | None, dict | None]] | None = None) -> dict[str, dict]:
    """Per target: its pairing policy (None: the server's default), the reuse figures over turns
    >= 1 and the router's pairing counters over the run (``counters``: before, after)."""
    return {name: {"pairing": (pairings or {}).get(name), **reuse_figures(sent, records, name),
                   **pairing_counter_figures(*(counters or {}).get(name, (None, None)))} for name in targets}


def figures(sent: list[Sent], records: dict[str, dict], targets: list[str], twins: dict[str, str], turns: int,
            wall_s: float, pairings: dict[str, str | None] | None = None,
            counters: dict[str, tuple[dict | None, dict | None]] | None = None) -> dict:
    """Every figure of a run (the JSON's body, less the run's settings)."""
    ok = [s for s in sent if s.result.error is None]
    return {"turns": turn_rows(sent, records, targets, turns), "summary": summary(sent, records, targets),
            "pairing": pairing_figures(sent, records, targets, pairings, counters),
            "throughput": throughput(sent, targets), **mismatches(sent, twins),
            "salted_cached_nonzero": salted_cached_nonzero(sent, records),
            "requests": len(sent), "errors": len(sent) - len(ok),
            "error_messages": sorted({s.result.error for s in sent if s.result.error})[:3],
            "wall_s": wall_s,
            "output_tok_s": sum(s.result.output_tokens for s in ok) / wall_s if wall_s else float("nan")}


# ---- the clusters this script starts (without --base-url) ----------------------------------------
class OwnClusters:
    """Each ``--clusters`` shape (or ``cpserve up``'s default one) started as ``cpserve up``
    starts it, once per ``--pairings`` policy, and with ``--compare-off`` the first policy's
    ``--no-prefix-cache`` twin; all started at once, stopped at once. When policies are compared,
    every cluster gets "on" requests only (``kinds``), so that its router's counts of requests
    per service are the conversations' alone."""

    def __init__(self, args: argparse.Namespace):
        from services.up import cluster_args

        shapes = args.shapes or [None]
        base = ["--model", args.model, *shlex.split(args.up_args or "")]
        self.argv: dict[str, list[str]] = {}
        self.pairing: dict[str, str | None] = {}  # None: cpserve up's default
        on_only: set[str] = set()
        for shape in shapes:
            for i, pairing in enumerate(args.pairings or [None]):
                name = (f"cluster {shape[0]}+{shape[1]}" if shape else "cluster") + \
                    (f" pairing={pairing}" if pairing else "")
                argv = base + (["--prefill-cp", str(shape[0]), "--decode-dcp", str(shape[1])] if shape else []) + \
                    (["--pairing", pairing] if pairing else [])
                self.argv[name], self.pairing[name] = argv, pairing
                if len(args.pairings or []) > 1:  # a comparison of policies: where "on" requests go
                    on_only.add(name)
                if not i and args.compare_off:
                    self.argv[name + NO_REUSE], self.pairing[name + NO_REUSE] = argv + ["--no-prefix-cache"], pairing
                    on_only.add(name + NO_REUSE)
        self.kinds = {name: ("on",) if name in on_only else KINDS for name in self.argv}
        self.spaces = {}
        for name, argv in self.argv.items():
            try:
                self.spaces[name] = cluster_args(argv)
            except SystemExit:
                raise RuntimeError(f"{name}: `cpserve up` does not take {shlex.join(argv)} (its message is above)") \
                    from None
        self.running: dict[str, list] = {}
        self.startup_s: dict[str, float] = {}

    @property
    def twins(self) -> dict[str, str]:
        return {name: name + NO_REUSE for name in self.argv if name + NO_REUSE in self.argv}

    def start(self) -> list[Target]:
        from concurrent.futures import ThreadPoolExecutor

        from services.up import start_cluster

        print(f"starting {', '.join(self.argv)} ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()

        def one(name: str) -> list:
            children = start_cluster(self.spaces[name], 0, None, quiet=True)
            self.startup_s[name] = time.perf_counter() - t0
            return children

        failed = None
        with ThreadPoolExecutor(len(self.spaces)) as pool:
            futures = {name: pool.submit(one, name) for name in self.spaces}
            for name, f in futures.items():
                try:
                    self.running[name] = f.result()
                except Exception as e:  # the others are stopped below; the first failure is the message
                    failed = failed or RuntimeError(f"{name} did not start: {e}")
        if failed:
            raise failed
        return [Target(name, f"http://{children[-1].address}") for name, children in self.running.items()]

    def stop(self) -> None:
        from services.up import stop_cluster

        every = [child for children in self.running.values() for child in children]
        for child in every:
            child.signal_stop()
        for children in self.running.values():
            stop_cluster(children)


# ---- arguments -------------------------------------------------------------------------------------
QUICK = dict(first_len=1024, system_len=128, growth=256, output_len=8, turns=3, timeout=60.0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = base_parser(__doc__)
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("--base-url", action="append", default=[], metavar="URL",
                   help="a running OpenAI-compatible server (repeatable); none: start clusters here")
    p.add_argument("--model", default=None,
                   help="with --base-url: the model name sent (default: the first GET /v1/models id); without: the "
                        "checkpoint (demo, tiny, bench or a directory; default demo, --quick tiny)")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY' to every --base-url")
    p.add_argument("--vocab-size", type=int, default=None,
                   help=f"random ids are below this (default: the checkpoint's, or {BYTE_VOCAB} with --base-url)")
    p.add_argument("--clusters", default=None,
                   help="without --base-url: cluster shapes, prefill CP + decode DCP (default: `cpserve up`'s; "
                        "--quick 1+1)")
    p.add_argument("--compare-off", action="store_true",
                   help="without --base-url: also a --no-prefix-cache twin of each cluster (reuse really off)")
    p.add_argument("--pairings", default=None, metavar="P[,P...]",
                   help="without --base-url: start each cluster once per router pairing policy (cache_aware, "
                        "load), --pairing P added to its flags; with two or more, 'on' requests only")
    p.add_argument("--up-args", default="", metavar="FLAGS",
                   help="without --base-url: more `cpserve up` flags for every cluster "
                        "(e.g. --up-args=\"--pairing load\")")
    p.add_argument("--system-len", type=int, default=512, help="tokens of the shared system prompt (default 512)")
    p.add_argument("--first-len", type=int, default=8192, help="tokens of each conversation's first context "
                                                               "(default 8192; --quick 1024)")
    p.add_argument("--growth", type=int, default=600, help="tokens of each later turn's tool output (default 600)")
    p.add_argument("--output-len", type=int, default=32, help="tokens of each answer (default 32; --quick 8)")
    p.add_argument("--turns", type=int, default=6, help="turns per conversation (default 6; --quick 3)")
    p.add_argument("--conversations", type=int, default=1, help="conversations (default 1)")
    p.add_argument("--concurrency", type=int, default=1, help="conversations in flight at once (default 1)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take (default 600)")
    p.add_argument("--seed", type=int, default=0)
    args = parse_with_quick(p, QUICK, argv)
    check(p, args)
    return args


def check(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for flag, value, low in (("--system-len", args.system_len, 0), ("--first-len", args.first_len, 1),
                             ("--growth", args.growth, 1), ("--output-len", args.output_len, 1),
                             ("--turns", args.turns, 1), ("--conversations", args.conversations, 1),
                             ("--concurrency", args.concurrency, 1), ("--timeout", args.timeout, 1)):
        if not value >= low:
            p.error(f"{flag} must be >= {low}, got {value}")
    if args.vocab_size is not None and args.vocab_size <= 3:
        p.error(f"--vocab-size must be > 3 (ids 0-2 are special), got {args.vocab_size}")
    if args.base_url:
        for flag, given in (("--clusters", args.clusters), ("--compare-off", args.compare_off),
                            ("--up-args", args.up_args), ("--pairings", args.pairings)):
            if given:
                p.error(f"{flag} applies only without --base-url (to the clusters this script starts)")
        args.shapes, args.pairings = [], []
    else:
        if args.api_key:
            p.error("--api-key applies only with --base-url (the clusters started here take none)")
        args.model = bench_model_dir() if args.model == "bench" else (args.model or ("tiny" if args.quick else "demo"))
        clusters = args.clusters or ("1+1" if args.quick else None)
        args.shapes = parse_shapes(p, clusters) if clusters else []
        args.pairings = parse_pairings(p, args.pairings, args.up_args)


PAIRINGS = ("cache_aware", "load")  # cpserve up --pairing


def parse_pairings(p: argparse.ArgumentParser, text: str | None, up_args: str) -> list[str]:
    if text is None:
        return []
    pairings = [x.strip() for x in text.split(",")]
    if not all(x in PAIRINGS for x in pairings) or len(set(pairings)) != len(pairings):
        p.error(f"--pairings: expected distinct policies of {', '.join(PAIRINGS)} (e.g. cache_aware,load), "
                f"got {text!r}")
    if any(a == "--pairing" or a.startswith("--pairing=") for a in shlex.split(up_args or "")):
        p.error("--pairings sets each cluster's --pairing: leave --pairing out of --up-args")
    return pairings


# ---- report --------------------------------------------------------------------------------------
def _cell(v, digits: int = 1):
    """None (the server does not say) as '-'; counts and milliseconds with ``digits`` decimals."""
    return "-" if v is None else v if isinstance(v, str) else "nan" if v != v else f"{v:,.{digits}f}"


def report(args: argparse.Namespace, out: dict, twins: dict[str, str]) -> None:
    rows = out["turns"]
    print_table(f"TTFT ms per turn: {args.conversations} conversation(s) at concurrency {args.concurrency}, "
                f"system {args.system_len} + first {args.first_len} tokens, each later turn + {args.output_len} "
                f"answer + {args.growth} tool tokens",
                ["target", "turn", "prompt tok", "new tok", "on p50", "on p99", "cold p50", "cold p99", "ideal p50",
                 "ideal p99", "on / cold", "on / ideal", "errors"],
                [[r["target"], r["turn"], _cell(r["prompt_tokens"], 0), _cell(r["new_tokens"], 0),
                  *(_cell(r[f"{k}_ttft_ms_{q}"]) for k in KINDS for q in ("p50", "p99")), r["on_over_cold"],
                  r["on_over_ideal"], r["errors"]] for r in rows])
    print_table("the 'on' requests' cache (prefill: usage cached_tokens; decode: the router's record) and KV moved "
                "prefill -> decode per request ('-': the server does not say)",
                ["target", "turn", "prompt tok", "cached", "hit rate", "decode cached", "decode hit rate", "KV MB on",
                 "KV MB cold"],
                [[r["target"], r["turn"], _cell(r["prompt_tokens"], 0), _cell(r["cached_tokens"], 0),
                  _cell(r["hit_rate"], 3), _cell(r["decode_cached_tokens"], 0), _cell(r["decode_hit_rate"], 3),
                  *(_cell(None if r[k] is None else r[k] / 2**20, 2)
                    for k in ("transfer_bytes", "cold_transfer_bytes"))] for r in rows])
    stages = list(dict.fromkeys(k for r in rows for k in r["stages_ms"]))
    if stages:
        print_table("where the 'on' requests' TTFT goes, mean ms (the router's GET /debug/ttft)",
                    ["target", "turn", *stages, "TTFT (router)"],
                    [[r["target"], r["turn"], *(_cell(r["stages_ms"].get(k), 2) for k in stages),
                      _cell(r["router_ttft_ms"])] for r in rows if r["stages_ms"]])
    print_table(f"throughput per kind (tokens / the requests' summed durations); the run: {out['wall_s']:.1f} s, "
                f"{out['output_tok_s']:.1f} output tok/s",
                ["target", "kind", "requests", "errors", "prompt tokens", "output tokens", "busy s", "prompt tok/s",
                 "output tok/s"],
                [[r["target"], r["kind"], r["requests"], r["errors"], r["prompt_tokens"], r["output_tokens"],
                  r["busy_s"], r["prompt_tok_s"], r["output_tok_s"]] for r in out["throughput"]])
    pairing = out["pairing"]

    def spread(f: dict, kind: str) -> str:
        return "-" if f[f"{kind}_share_min"] is None else \
            f"{f[f'{kind}_share_min']:.0%}-{f[f'{kind}_share_max']:.0%} of {len(f['shares'][kind])}"

    print_table("reuse over turns >= 1 ('on': reusable = what the previous turn left, in 16-token pages; decode's an "
                "upper bound at DCP 1) and the router's pairing over the run (shares: least-greatest of N services)",
                ["target", "requests", "prefill reusable", "reused", "ratio", "decode reusable", "reused", "ratio",
                 "prefill shares", "decode shares", "decisions"],
                [[name, f["requests"], *(v for side in ("prefill", "decode") for v in (
                    _cell(f[side]["reusable_tokens"], 0), _cell(f[side]["reused_tokens"], 0),
                    _cell(f[side]["reused_over_reusable"], 3))),
                  spread(f, "prefill"), spread(f, "decode"),
                  "-" if f["decisions"] is None else " ".join(f"{k} {v}" for k, v in f["decisions"].items() if v)]
                 for name, f in pairing.items()])
    for name, twin in twins.items():
        mine = {r["turn"]: r for r in rows if r["target"] == name}
        other = {r["turn"]: r for r in rows if r["target"] == twin}
        print_table(f"{name} (reuse on) vs {twin}: 'on' TTFT p50 ms",
                    ["turn", "reuse on", "reuse off", "on / off"],
                    [[t, mine[t]["on_ttft_ms_p50"], other[t]["on_ttft_ms_p50"],
                      ratio(mine[t]["on_ttft_ms_p50"], other[t]["on_ttft_ms_p50"])] for t in sorted(mine)])
    print(f"output ids: {out['mismatches']} of {out['compared']} on/cold pairs differ"
          + (f"; {out['mismatches_vs_no_reuse']} of {out['compared_vs_no_reuse']} vs the no-reuse twin"
             if twins else "")
          + f"; salted requests reporting cached tokens: {out['salted_cached_nonzero']}")
    for m in out["examples"]:
        print(f"  {m}")
    if out["errors"]:
        print(f"{out['errors']} of {out['requests']} requests failed: {'; '.join(out['error_messages'])}")


def plot(args: argparse.Namespace, out: dict, targets: list[str], kinds: dict[str, tuple[str, ...]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def num(v):
        return float("nan") if v is None else v

    fig, ax = plt.subplots(1, 3, figsize=(15, 3.8))
    styles = {"on": "-", "cold": "--", "ideal": ":"}
    for name, marker in zip(targets, "os^Dv<>"):
        rows = [r for r in out["turns"] if r["target"] == name]
        turns = [r["turn"] for r in rows]
        for kind in kinds[name]:
            label = name if kind == "on" and name.endswith(NO_REUSE) else f"{name} {kind}"
            line, = ax[0].plot(turns, [r[f"{kind}_ttft_ms_p50"] for r in rows], marker=marker, ls=styles[kind],
                               label=f"{label} p50")
            if args.conversations > 1:
                ax[0].plot(turns, [r[f"{kind}_ttft_ms_p99"] for r in rows], ls=styles[kind], lw=0.8, alpha=0.5,
                           color=line.get_color())
        if "cold" in kinds[name]:
            ax[1].plot(turns, [num(r["prompt_tokens"]) for r in rows], marker=marker, ls=":", label=f"{name} prompt")
            ax[1].plot(turns, [num(r["cached_tokens"]) for r in rows], marker=marker, label=f"{name} cached (prefill)")
            ax[1].plot(turns, [num(r["decode_cached_tokens"]) for r in rows], marker=marker, ls="--",
                       label=f"{name} cached (decode)")
        line, = ax[2].plot(turns, [num(r["transfer_bytes"]) / 2**20 for r in rows], marker=marker, label=f"{name} on")
        if "cold" in kinds[name]:
            ax[2].plot(turns, [num(r["cold_transfer_bytes"]) / 2**20 for r in rows], marker=marker, ls="--",
                       color=line.get_color(), label=f"{name} cold")
    for a, title in zip(ax, ("TTFT ms p50 (thin: p99)", "prompt tokens per request", "KV MB moved per request")):
        a.set_title(title)
        a.set_xlabel("turn")
        a.set_xticks(range(args.turns))
        a.legend(fontsize=7)
    save_plot(fig, args.out, "multiturn.png")


def main() -> None:
    t_all = time.perf_counter()
    args = parse_args()
    opts = RequestOptions(exact_length=not args.base_url)
    own = None
    try:
        own = None if args.base_url else OwnClusters(args)
        targets = own.start() if own else base_targets(args)
        for t in targets:
            probe(t, None if own else args.model)
        convs = build_conversations(args.conversations, args.system_len, args.first_len, args.growth, args.turns,
                                    vocab_size(args), args.seed)
        twins = own.twins if own else {}
        kinds = own.kinds if own else {t.name: KINDS for t in targets}
        salts = {t.name: uuid.uuid4().hex for t in targets}  # targets sharing services share no cache entry
        for t in targets:
            warm_up(t, list(convs[0].system) or [3] * 16, opts, salts[t.name])
        before = {t.name: read_pairing_counters(t) for t in targets}
        from tqdm import tqdm

        total = args.conversations * args.turns * sum(len(k) for k in kinds.values())
        with tqdm(total=total, desc="requests", unit="req", file=sys.stderr, dynamic_ncols=True) as bar:
            sent, records, wall = asyncio.run(run_conversations(targets, kinds, convs, args, opts, salts,
                                                                lambda: bar.update(1)))
        counters = {t.name: (before[t.name], read_pairing_counters(t)) for t in targets}
    except RuntimeError as e:
        sys.exit(f"bench/multiturn.py: {e}")
    finally:
        if own:
            own.stop()

    names = [t.name for t in targets]
    pairings = own.pairing if own else {}
    out = figures(sent, records, names, twins, args.turns, wall, pairings, counters)
    report(args, out, twins)
    plot(args, out, names, kinds)
    total_wall = time.perf_counter() - t_all
    print(f"wall time: {total_wall:.1f} s")
    emit_json(args.json, {
        "mode": "own" if own else "base_url", "model": args.model or targets[0].model, "quick": args.quick,
        "cpus": os.cpu_count(),
        "system_len": args.system_len, "first_len": args.first_len, "growth": args.growth,
        "output_len": args.output_len, "turns_per_conversation": args.turns, "conversations": args.conversations,
        "concurrency": args.concurrency, "seed": args.seed,
        "targets": [{"name": t.name, "url": t.url, "model": t.model, "is_cpserve": t.is_cpserve,
                     "kinds": list(kinds[t.name]), "pairing": pairings.get(t.name),
                     **({"up_argv": own.argv[t.name], "startup_s": own.startup_s.get(t.name)} if own else {})}
                    for t in targets],
        **out, "total_wall_s": total_wall,
    })


if __name__ == "__main__":
    main()
