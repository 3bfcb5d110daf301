"""The load generator of ``bench/serving.py``: prompts, streamed requests to any OpenAI-compatible
server (cpserve, vLLM, SGLang, ...), load levels, and the figures of one level.

What one request measures (timestamps in this process, ``perf_counter``):

- TTFT: request sent -> the first streamed chunk that carries output (``text`` or
  ``token_ids`` on ``/v1/completions``; ``delta.content``, ``delta.reasoning_content`` or
  ``token_ids`` on ``/v1/chat/completions``).
- ITL: every gap between two consecutive such chunks (a server that sends several tokens in one
  chunk shows one longer gap, as its client sees it).
- TPOT: (last output chunk - first) / (output tokens - 1), requests with >= 2 tokens.
- output tokens: the final ``usage.completion_tokens`` (``stream_options.include_usage`` is
  always asked for), else the streamed ``token_ids``, else the count of output chunks.
- cached tokens: the final ``usage.prompt_tokens_details.cached_tokens`` (the prompt tokens the
  server's prefix cache held; None where the server does not say).

A request fails (counts in ``errors``) on a non-200 answer, an error event in the stream, a
dropped connection or timeout, or a stream without any output; the caller may also demand an
exact token count. Load levels: closed loop (``concurrency`` workers, each sending its next
request when the last one ends) or open loop (Poisson arrivals at ``rate`` requests/s, seeded,
the same arrival times on every target). A level stops starting requests after its timeout.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx

PERCENTILES = (50, 90, 99)


# ---- prompts ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Prompt:
    """One request's input: ``payload`` is ``{"prompt": str | list[int]}`` or ``{"messages": [...]}``."""

    payload: dict
    output_len: int

    @property
    def token_ids(self) -> list[int] | None:
        prompt = self.payload.get("prompt")
        return prompt if isinstance(prompt, list) else None


class DatasetError(ValueError):
    """A dataset file that cannot be used; the message names the file and line."""


def random_ids(n: int, lengths: tuple[int, int], output_len: int, vocab: int, seed: int) -> list[Prompt]:
    """``n`` prompts of token ids uniform in [3, vocab) (0-2 are special in cpserve's tokenizers),
    lengths uniform in ``lengths`` (inclusive)."""
    rng = random.Random(seed)
    return [Prompt({"prompt": [rng.randrange(3, vocab) for _ in range(rng.randint(*lengths))]}, output_len)
            for _ in range(n)]


def random_text(n: int, lengths: tuple[int, int], output_len: int, tokens_per_word: float, seed: int,
                chat: bool) -> list[Prompt]:
    """``n`` prompts of random lowercase words, about ``lengths`` tokens each at ``tokens_per_word``."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words = max(1, round(rng.randint(*lengths) / tokens_per_word))
        text = " ".join("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 8)))
                        for _ in range(words))
        out.append(Prompt({"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text}, output_len))
    return out


def file_prompts(path: str, n: int, output_len: int, chat: bool) -> list[Prompt]:
    """``n`` prompts from a JSONL file (cycled when it has fewer lines): one object per line with
    ``prompt`` (text, or token ids on /v1/completions) or ``messages`` (chat only), and an
    optional ``max_tokens`` (default ``output_len``)."""
    items = []
    try:
        lines = open(path, encoding="utf-8").read().splitlines()
    except OSError as e:
        raise DatasetError(f"{path}: {e.strerror}") from None
    for lineno, line in enumerate(lines, 1):
        if line.strip():
            items.append(_file_prompt(line, output_len, chat, f"{path}:{lineno}"))
    if not items:
        raise DatasetError(f"{path}: no prompts")
    return [items[i % len(items)] for i in range(n)]


def _file_prompt(line: str, output_len: int, chat: bool, where: str) -> Prompt:
    try:
        obj = json.loads(line)
    except ValueError as e:
        raise DatasetError(f"{where}: not JSON ({e})") from None
    if not isinstance(obj, dict) or ("prompt" in obj) == ("messages" in obj):
        raise DatasetError(f"{where}: needs an object with exactly one of 'prompt' and 'messages'")
    max_tokens = obj.get("max_tokens", output_len)
    if type(max_tokens) is not int or max_tokens < 1:
        raise DatasetError(f"{where}: max_tokens must be a positive integer, got {max_tokens!r}")
    if "messages" in obj:
        messages = obj["messages"]
        if not chat:
            raise DatasetError(f"{where}: 'messages' needs --endpoint chat")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise DatasetError(f"{where}: messages must be a non-empty list of objects")
        return Prompt({"messages": messages}, max_tokens)
    prompt = obj["prompt"]
    if isinstance(prompt, str) and prompt:
        return Prompt({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}, max_tokens)
    if not chat and isinstance(prompt, list) and prompt and all(type(t) is int and t >= 0 for t in prompt):
        return Prompt({"prompt": prompt}, max_tokens)
    raise DatasetError(f"{where}: prompt must be a non-empty string" + ("" if chat else " or list of token ids"))


# ---- a target --------------------------------------------------------------------------------------
@dataclass
class Target:
    """One server under test. ``is_cpserve``: it exports the router's TTFT stage histogram."""

    name: str
    url: str
    model: str = ""
    api_key: str | None = None
    is_cpserve: bool = False

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def probe(target: Target, model: str | None) -> None:
    """Fill in the model name (``model``, else the first id of GET /v1/models) and whether the
    target is cpserve (its /metrics has the router's TTFT stages, or /version or the model card
    names cpserve). Raises ``RuntimeError`` naming the URL when it cannot be reached."""
    with httpx.Client(trust_env=False, timeout=30, headers=target.headers) as client:
        try:
            r = client.get(f"{target.url}/v1/models")
        except httpx.HTTPError as e:
            raise RuntimeError(f"{target.url}: cannot reach GET /v1/models ({type(e).__name__}: {e})") from None
        try:
            cards = r.json().get("data", []) if r.status_code == 200 else []
        except (ValueError, AttributeError):
            cards = []
        if model is None and not (cards and cards[0].get("id")):
            raise RuntimeError(f"{target.url}: GET /v1/models gave HTTP {r.status_code} and no model id; pass --model")
        target.model = model or cards[0]["id"]
        signs = [any(c.get("owned_by") == "cpserve" for c in cards)]
        for path, needle in (("/version", "cpserve"), ("/metrics", "ttft_stage_seconds")):
            try:
                answer = client.get(f"{target.url}{path}")
                signs.append(answer.status_code == 200 and needle in answer.text and "cpserve" in answer.text)
            except httpx.HTTPError:
                pass
    target.is_cpserve = any(signs)


def tokens_per_word(target: Target, seed: int) -> float:
    """Tokens per word of :func:`random_text`'s words in the target's tokenizer (POST /tokenize,
    which vLLM, SGLang and cpserve answer); 1.0 where it has none."""
    sample = random_text(1, (200, 200), 1, 1.0, seed, chat=False)[0].payload["prompt"]
    try:
        r = httpx.post(f"{target.url}/tokenize", json={"model": target.model, "prompt": sample},
                       headers=target.headers, trust_env=False, timeout=30)
        count = r.json()["count"] if r.status_code == 200 else 0
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        count = 0
    return count / 200 if count else 1.0


TTFT_HISTOGRAMS = ("cpserve_router_ttft_seconds", "cpserve:time_to_first_token_seconds")  # the first present


def ttft_stage_sums(target: Target) -> dict[str, tuple[float, float]]:
    """(sum, count) of a cpserve router's TTFT (``ttft``) and of each TTFT stage, summed over any
    other labels, from its /metrics (in the metric's stage order)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(f"{target.url}/metrics", headers=target.headers, trust_env=False, timeout=30).text
    except httpx.HTTPError:
        return {}  # no breakdown for this level (NaN), not a failed run
    stages: dict[str, list[float]] = {}
    totals: dict[str, list[float]] = {}  # per TTFT histogram name: the router's own, or vLLM's name
    for family in text_string_to_metric_families(text):
        staged = family.name.startswith("cpserve") and family.name.endswith("ttft_stage_seconds")
        if not staged and family.name not in TTFT_HISTOGRAMS:
            continue
        for s in family.samples:
            kind = s.name.rsplit("_", 1)[-1]
            if kind in ("sum", "count"):
                acc = stages.setdefault(s.labels.get("stage", "?"), [0.0, 0.0]) if staged else \
                    totals.setdefault(family.name, [0.0, 0.0])
                acc[kind == "count"] += s.value
    total = next((totals[name] for name in TTFT_HISTOGRAMS if name in totals), None)
    return {k: (v[0], v[1]) for k, v in [*stages.items(), *([("ttft", total)] if total else [])]}


def request_ttft_records(target: Target) -> dict[str, dict]:
    """A cpserve router's recent per-request TTFT breakdowns (GET /debug/ttft) by request id."""
    try:
        body = httpx.get(f"{target.url}/debug/ttft", headers=target.headers, trust_env=False, timeout=30).json()
    except (httpx.HTTPError, ValueError):
        return {}
    return {r["id"]: r for r in body.get("requests", [])}


def ttft_bound_check(results: list[Result], records: dict[str, dict], factor: float = 1.2,
                     slack_ms: float = 20.0) -> dict:
    """Issue 15's per-request TTFT bound: each request's TTFT (as the client saw it) within
    ``factor`` × (its time in the prefill queue — the prefill of the requests ahead of it — plus
    its own prefill compute, from the router's breakdown) + ``slack_ms``."""
    checked, over = 0, []
    for r in results:
        rec = records.get(r.response_id) if r.error is None else None
        if rec is None:
            continue
        stages = rec["stages_ms"]
        bound = factor * (stages.get("prefill_queue", 0.0) + stages.get("prefill_compute", 0.0)) + slack_ms
        checked += 1
        if r.ttft_ms > bound:
            over.append(r.ttft_ms - bound)
    return {"requests_checked": checked, "within_bound": checked - len(over),
            "worst_over_bound_ms": max(over, default=0.0), "factor": factor, "slack_ms": slack_ms}


def stage_means_ms(before: dict, after: dict) -> dict[str, float]:
    """Mean ms per request of each stage between two :func:`ttft_stage_sums` readings."""
    out = {}
    for stage, (total, count) in after.items():
        t0, c0 = before.get(stage, (0.0, 0.0))
        out[stage] = (total - t0) / (count - c0) * 1e3 if count > c0 else float("nan")
    return out


# ---- one request ----------------------------------------------------------------------------------
@dataclass
class Result:
    index: int
    start: float = 0.0
    end: float = 0.0
    ttft_ms: float = float("nan")
    tpot_ms: float = float("nan")
    itl_ms: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int | None = None
    ids: list[int] = field(default_factory=list)  # the streamed token_ids, where the server sends them
    error: str | None = None
    response_id: str | None = None  # the stream's "id" (cpserve: the router's /debug/ttft key)
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, where the server sends it


@dataclass(frozen=True)
class RequestOptions:
    chat: bool = False
    ignore_eos: bool = True
    temperature: float = 0.0
    exact_length: bool = False  # a request with another number of output tokens fails

    def body(self, target: Target, prompt: Prompt) -> dict:
        body = {"model": target.model, **prompt.payload, "max_tokens": prompt.output_len, "stream": True,
                "stream_options": {"include_usage": True}, "temperature": self.temperature}
        if self.ignore_eos:
            body["ignore_eos"] = True
        if target.is_cpserve:  # a vLLM extension: exact token timing even while text is held back
            body["return_token_ids"] = True
        return body


def _output(chunk: dict, chat: bool) -> tuple[bool, list[int]]:
    """(whether the chunk carries output, its token ids)."""
    choices = chunk.get("choices") or []
    if not choices:
        return False, []
    choice = choices[0]
    ids = choice.get("token_ids") or []
    if chat:
        delta = choice.get("delta") or {}
        text = delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")
    else:
        text = choice.get("text")
    return bool(text or ids), ids


async def send(client: httpx.AsyncClient, target: Target, index: int, prompt: Prompt,
               opts: RequestOptions) -> Result:
    res = Result(index)
    path = "/v1/chat/completions" if opts.chat else "/v1/completions"
    times: list[float] = []
    completion_tokens = None
    res.start = time.perf_counter()
    try:
        async with client.stream("POST", f"{target.url}{path}", json=opts.body(target, prompt),
                                 headers=target.headers) as resp:
            if resp.status_code != 200:
                await resp.aread()
                res.error = f"HTTP {resp.status_code}: {resp.text[:200]}"
            else:
                async for line in resp.aiter_lines():
                    if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                        continue
                    chunk = json.loads(line[5:])
                    if "error" in chunk:
                        err = chunk["error"]
                        res.error = str(err.get("message") if isinstance(err, dict) else err)[:200]
                        break
                    res.response_id = res.response_id or chunk.get("id")
                    has_output, ids = _output(chunk, opts.chat)
                    if has_output:
                        times.append(time.perf_counter())
                        res.ids += ids
                    usage = chunk.get("usage")
                    if usage:
                        completion_tokens = usage.get("completion_tokens")
                        res.prompt_tokens = usage.get("prompt_tokens")
                        res.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    except (httpx.HTTPError, ValueError) as e:  # a timeout, a dropped connection, a broken event
        res.error = f"{type(e).__name__}: {e}"
    res.end = time.perf_counter()
    res.output_tokens = completion_tokens or len(res.ids) or len(times)
    if times:
        res.ttft_ms = (times[0] - res.start) * 1e3
        res.itl_ms = [(b - a) * 1e3 for a, b in zip(times, times[1:])]
        if res.output_tokens > 1:
            res.tpot_ms = (times[-1] - times[0]) * 1e3 / (res.output_tokens - 1)
    if res.error is None and not times:
        res.error = "the stream carried no output"
    if res.error is None and opts.exact_length and res.output_tokens != prompt.output_len:
        res.error = f"{res.output_tokens} tokens, expected {prompt.output_len}"
    return res


# ---- one load level --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Level:
    """Closed loop with ``concurrency`` requests in flight, or Poisson arrivals at ``rate``/s."""

    concurrency: int | None = None
    rate: float | None = None

    @property
    def label(self) -> str:
        return f"c={self.concurrency}" if self.concurrency else f"{self.rate:g} req/s"

    @property
    def x(self) -> float:
        return self.concurrency or self.rate


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Seconds after the level's start at which each of ``n`` Poisson arrivals comes (the first at 0)."""
    rng = random.Random(f"{seed}:{rate}")
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


async def run_level(target: Target, prompts: list[Prompt], n: int, level: Level, opts: RequestOptions,
                    timeout_s: float, seed: int, on_done=lambda: None) -> tuple[list[Result], float]:
    """Requests 0..n-1 (request i sends ``prompts[i]``); returns the results of those started and
    the level's start time."""
    results: list[Result] = []
    width = level.concurrency or n
    limits = httpx.Limits(max_connections=width + 4, max_keepalive_connections=width + 4)
    async with httpx.AsyncClient(trust_env=False, timeout=httpx.Timeout(timeout_s + 120), limits=limits) as client:
        start = time.perf_counter()
        stop_at = start + timeout_s

        async def one(i: int) -> None:
            results.append(await send(client, target, i, prompts[i], opts))
            on_done()

        if level.concurrency:
            indices = iter(range(n))

            async def worker() -> None:
                for i in indices:  # one shared iterator: each worker takes the next request when free
                    if time.perf_counter() > stop_at:
                        return
                    await one(i)

            await asyncio.gather(*(worker() for _ in range(level.concurrency)))
        else:
            tasks = []
            for i, at in enumerate(arrival_times(n, level.rate, seed)):
                await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
                if time.perf_counter() > stop_at:
                    break
                tasks.append(asyncio.create_task(one(i)))
            await asyncio.gather(*tasks)
    return results, start


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (NaN for no values)."""
    if not values:
        return float("nan")
    values = sorted(values)
    pos = (len(values) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


def summarise(results: list[Result], requested: int, start: float, slo_ttft_ms: float | None,
              slo_tpot_ms: float | None, wall_s: float | None = None) -> dict:
    """The level's figures: p50/p90/p99 and mean of TTFT, TPOT and ITL (ms) over completed
    requests, request / output-token throughput and goodput (completed requests meeting every
    given SLO) per second of the level's wall time (start -> last request done, or ``wall_s``
    where the caller knows better: one request at a time interleaved with other targets'), errors."""
    ok = [r for r in results if r.error is None]
    wall = max((r.end for r in results), default=start) - start if wall_s is None else wall_s
    series = {"ttft": [r.ttft_ms for r in ok], "tpot": [r.tpot_ms for r in ok if r.tpot_ms == r.tpot_ms],
              "itl": [gap for r in ok for gap in r.itl_ms]}
    good = [r for r in ok if (slo_ttft_ms is None or r.ttft_ms <= slo_ttft_ms)
            and (slo_tpot_ms is None or not r.tpot_ms > slo_tpot_ms)]  # one token: no TPOT to miss
    out = {"requests": requested, "completed": len(ok), "errors": len(results) - len(ok),
           "not_started": requested - len(results)}
    for name, values in series.items():
        for q in PERCENTILES:
            out[f"{name}_ms_p{q}"] = percentile(values, q)
        out[f"{name}_ms_mean"] = sum(values) / len(values) if values else float("nan")
    per_s = (lambda x: x / wall) if wall > 0 else (lambda x: float("nan"))
    prompt_tokens = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    out.update({
        "request_throughput_req_s": per_s(len(ok)),
        "output_throughput_tok_s": per_s(sum(r.output_tokens for r in ok)),
        "goodput_req_s": per_s(len(good)),
        "slo_ttft_ms": slo_ttft_ms, "slo_tpot_ms": slo_tpot_ms,
        "mean_prompt_tokens": sum(prompt_tokens) / len(prompt_tokens) if prompt_tokens else float("nan"),
        "mean_output_tokens": sum(r.output_tokens for r in ok) / len(ok) if ok else float("nan"),
        "wall_s": wall,
        "error_messages": sorted({r.error for r in results if r.error})[:3],
    })
    return out


def base_targets(args) -> list[Target]:
    """The servers of ``--base-url`` (with ``--api-key``), named by host:port."""
    targets = []
    for url in args.base_url:
        url = url.rstrip("/").removesuffix("/v1")
        name = url.split("://", 1)[-1]
        while name in {t.name for t in targets}:  # the same server twice: still two targets
            name += "'"
        targets.append(Target(name, url, api_key=args.api_key))
    return targets
