"""The router against fake prefill/decode backends (no engines): validation, response and SSE
shapes through the official openai client, stop strings, token ids, API keys, metrics, retries,
errors after the first token, client disconnects, the gRPC front, and the gRPC clients against
fake gRPC services. One end-to-end test with real services is marked slow.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
import dataclasses
import json
from pathlib import Path
import re
import socket
import threading
import time
import uuid

import grpc
import httpx
import openai
import pytest

from services.protos import (common_pb2, decode_pb2, decode_pb2_grpc, kv_pb2, prefill_pb2, prefill_pb2_grpc, router_pb2,
                             router_pb2_grpc)
from services.router.backend import (BackendError, DecodeClient, DecodeLoad, Done, FirstToken, ForkStart, Job,
                                     PrefillClient, PrefillLoad, Reservation, Token)
from services.common.config import RouterConfig
from services.router.pairing import Cluster, Endpoint, pick_pair
from services.router.params import stop_token_set
from services.router.server import listen_socket, serve_router
from services.router.stages import TTFT_STAGES
from services.router.textstream import TextAssembler
from engine.model.tokenizer import load_tokenizer
from tests.processes import cli_process

pytestmark = pytest.mark.timeout(120)

MODEL = "tiny"
EOS = 1  # the tiny model's EOS id (byte tokenizer)
VOCAB = 320
TEXT = "The quick brown fox jumps over the lazy dog. "
TEXT_IDS = [b + 3 for b in TEXT.encode()]  # byte tokenizer: id = byte + 3
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE


# ---- fakes -----------------------------------------------------------------------------------
def reply(job: Job, eos_at: int | None = None, text_ids: list[int] = TEXT_IDS) -> tuple[list[int], str]:
    """What the fake "model" generates for ``job``: ``text_ids`` (TEXT's) over and over (EOS at
    ``eos_at``), under the stop rule of common.proto. Returns (ids, finish_reason)."""
    stop = stop_token_set(job.sampling, (EOS,))
    ids: list[int] = []
    for i in range(job.sampling.max_new_tokens):
        ids.append(EOS if i == eos_at else text_ids[i % len(text_ids)])
        if ids[-1] in stop:
            return ids, "stop"
    return ids, "length"


class FakePrefill(PrefillClient):
    def __init__(self, address: str = "p0", fail: BackendError | None = None, eos_at: int | None = None,
                 text_ids: list[int] = TEXT_IDS, cached_tokens: int = 0):
        self.address, self.fail, self.eos_at, self.text_ids = address, fail, eos_at, text_ids
        self.cached_tokens = cached_tokens
        self.jobs: list[Job] = []
        self.healthy = True

    async def prefill(self, job, destination, timeout):
        self.jobs.append(job)
        assert destination["reservation"]  # the router passes the decode's destination through
        if self.fail:
            raise self.fail
        # the next token (a resumed job's: after its output so far); every fork starts alike (seed 1234 + j)
        token = reply(job, self.eos_at, self.text_ids)[0][len(job.output_ids)]
        return FirstToken(token, 1234, prefill_ms=3.0, transfer_bytes=1000, transfer_ms=2.0,
                          cached_tokens=self.cached_tokens,
                          forks=tuple(ForkStart(token, 1234 + j) for j in range(1, job.num_forks)))

    async def status(self, timeout):
        return PrefillLoad(0)

    async def check_health(self, timeout):
        return self.healthy


class FakeDecode(DecodeClient):
    def __init__(self, address: str = "d0", *, capacity: int = 4096, fail_reserve: BackendError | None = None,
                 fail_after: int | None = None, fail_code=UNAVAILABLE, block_after: int | None = None,
                 delay_s: float = 0.0, eos_at: int | None = None, text_ids: list[int] = TEXT_IDS):
        self.address, self.capacity, self.fail_reserve = address, capacity, fail_reserve
        self.fail_after, self.fail_code, self.block_after = fail_after, fail_code, block_after
        self.delay_s, self.eos_at, self.text_ids = delay_s, eos_at, text_ids
        self.reserved: list[str] = []
        self.aborted: list[str] = []
        self.cancelled = threading.Event()  # a stream was closed before its end
        self.healthy = True

    async def reserve(self, job, timeout):
        if self.fail_reserve:
            raise self.fail_reserve
        rid = uuid.uuid4().hex
        self.reserved.append(rid)
        return Reservation(rid, {"reservation": rid})

    async def generate(self, job, reservation, start, timeout, fork=0):
        assert start.seed == 1234 + fork and reservation.id in self.reserved
        ids, reason = reply(job, self.eos_at, self.text_ids)
        finished = False
        try:
            for i in range(len(job.output_ids) + 1, len(ids)):
                if self.fail_after is not None and i > self.fail_after:
                    raise BackendError(self.fail_code, "rank group died", self.address)
                if self.block_after is not None and i > self.block_after:
                    await asyncio.sleep(3600)
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                yield Token(ids[i], i)
            finished = True
            yield Done(reason, len(ids))
        finally:
            if not finished:
                self.cancelled.set()

    async def abort(self, reservation, timeout, fork=None):
        self.aborted.append(reservation.id)

    async def status(self, timeout):
        half = self.capacity // 2
        return DecodeLoad((10, 6), (half - 10, half - 6), queue_depth=1)

    async def check_health(self, timeout):
        return self.healthy


@pytest.fixture
def start_router():
    handles = []

    def start(prefills=None, decodes=None, **overrides):
        prefills = prefills or [FakePrefill()]
        decodes = decodes or [FakeDecode()]
        # default_max_tokens: 16 tokens for a request without max_tokens (the fakes' replies stay
        # short); the unconfigured default, up to the context limit, has its own test
        cfg = dict(prefill=tuple(p.address for p in prefills), decode=tuple(d.address for d in decodes), model=MODEL,
                   health_interval_s=30.0, max_retries=2, default_max_tokens=16)
        handle = serve_router(RouterConfig(**{**cfg, **overrides}), prefills, decodes)
        handles.append(handle)
        return handle

    yield start
    for h in handles:
        h.shutdown()


def client(handle, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{handle.url}/v1", api_key=api_key, max_retries=0, timeout=30,
                         http_client=openai.DefaultHttpxClient(trust_env=False))  # never through a proxy


def post(handle, path: str, body, **kw) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    headers = {"content-type": "application/json", **kw.pop("headers", {})}
    return httpx.post(f"{handle.url}{path}", content=content, headers=headers, timeout=30, trust_env=False, **kw)


def get(handle, path: str) -> httpx.Response:
    return httpx.get(f"{handle.url}{path}", timeout=30, trust_env=False)


def sse_events(resp: httpx.Response) -> list:
    """The data payloads of an SSE body ("[DONE]" kept as a string)."""
    out = []
    for block in resp.text.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        data = block[len("data: "):]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def wait_for(cond, timeout_s: float = 5.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


# ---- pure parts ------------------------------------------------------------------------------
def test_pick_pair_least_loaded_healthy_and_round_robin():
    p = [Endpoint("prefill", "p0", healthy=True), Endpoint("prefill", "p1", healthy=True)]
    d = [Endpoint("decode", "d0", healthy=True), Endpoint("decode", "d1", healthy=True)]
    d[0].in_flight = 3
    assert {x.address for x in pick_pair(p, d, set())} == {"p0", "d1"}
    p[0].in_flight = 1
    assert [x.address for x in pick_pair(p, d, set())] == ["p1", "d1"]
    assert [x.address for x in pick_pair(p, d, {("p1", "d1")})] == ["p0", "d1"]
    d[1].healthy = False
    assert [x.address for x in pick_pair(p, d, set())] == ["p1", "d0"]
    assert pick_pair(p, d, {("p0", "d0"), ("p1", "d0")}) is None
    # equal load: the turn rotates which pair goes first
    idle_p = [Endpoint("prefill", f"p{i}", healthy=True) for i in range(2)]
    idle_d = [Endpoint("decode", "d0", healthy=True)]
    assert {pick_pair(idle_p, idle_d, set(), turn)[0].address for turn in range(2)} == {"p0", "p1"}


def test_pick_pair_uses_the_queue_depth_and_free_rows_the_services_report():
    """Other routers' work shows only in what the services report: a prefill with a polled
    queue loses to an idle one; between equally loaded decodes, the one with more free rows wins."""
    p = [Endpoint("prefill", "p0", healthy=True, queue_depth=4), Endpoint("prefill", "p1", healthy=True)]
    d = [Endpoint("decode", "d0", healthy=True, rows_free=100), Endpoint("decode", "d1", healthy=True, rows_free=900)]
    for turn in range(4):
        assert [x.address for x in pick_pair(p, d, set(), turn)] == ["p1", "d1"]
    d[1].queue_depth = 2  # a busy decode loses, whatever its free rows
    assert [x.address for x in pick_pair(p, d, set())] == ["p1", "d0"]


def _run_text(text: str, stop=(), stop_ids=frozenset()) -> tuple[list[str], TextAssembler]:
    asm = TextAssembler(load_tokenizer(MODEL), tuple(stop), stop_ids)
    deltas = [asm.push(b + 3) for b in text.encode()]
    deltas.append(asm.flush())
    return deltas, asm


def test_text_assembler_holds_partial_characters_and_stop_prefixes():
    deltas, asm = _run_text("héllo wörld")
    assert "".join(deltas) == "héllo wörld" and "\ufffd" not in "".join(deltas) and not asm.stopped
    deltas, asm = _run_text("one two three", stop=["two"])
    assert "".join(deltas) == "one " and asm.stopped
    # a final "w" could begin "wx": held back, then flushed at the end
    deltas, asm = _run_text("one tw", stop=["wx"])
    assert deltas[-2:] == ["", "w"] and "".join(deltas) == "one tw" and not asm.stopped
    # the earliest of several stop strings wins; a stop string spanning many tokens
    deltas, asm = _run_text("abcdef", stop=["ef", "bcd"])
    assert "".join(deltas) == "a"
    # a stop token's text is not rendered
    asm = TextAssembler(load_tokenizer(MODEL), (), frozenset({ord("!") + 3}))
    assert [asm.push(i) for i in (ord("a") + 3, ord("!") + 3)] == ["a", ""]


def test_incremental_text_equals_the_full_decode(tmp_path):
    """For a byte-level BPE with merges (tokens holding part of a character) and for a Python
    tokenizer (the offset decoder): the streamed pieces join to decode(ids), valid or not, and
    a valid text never shows a replacement character on the way."""
    import random

    from tests.release_fixtures import release_tokenizer, remote_code_tokenizer

    release_tokenizer(tmp_path, 300)
    fast = load_tokenizer(tmp_path)
    (tmp_path / "slow").mkdir()
    remote_code_tokenizer(tmp_path / "slow")
    slow = load_tokenizer(tmp_path / "slow", trust_remote_code=True)
    rng = random.Random(0)
    alphabet = "ab 长上下文 naïve ✓→é世"
    split = 0
    for tok, vocab in ((fast, 300), (slow, 259)):
        for _ in range(150):
            text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 30)))
            ids = tok.encode(text)[1:]
            asm = TextAssembler(tok)
            pieces = [asm.push(i) for i in ids]
            assert "".join(pieces) + asm.flush() == text and not any("\ufffd" in p for p in pieces)
            split += pieces.count("")
            noise = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
            asm = TextAssembler(tok)
            assert "".join(asm.push(i) for i in noise) + asm.flush() == tok.decode(noise)
    assert split > 0  # some tokens really did end inside a character


MULTI = "héllo 长上下文 ✓ → ok"


def test_streaming_sends_one_chunk_per_token_and_never_half_a_character(start_router):
    ids = [b + 3 for b in MULTI.encode()]  # the tiny byte tokenizer: every multi-byte character split
    n = len(ids)
    h = start_router(prefills=[FakePrefill(text_ids=ids)], decodes=[FakeDecode(text_ids=ids)])
    c = client(h)
    full = c.completions.create(model=MODEL, prompt="x", max_tokens=n, temperature=0)
    assert full.choices[0].text == MULTI
    chunks = list(c.completions.create(model=MODEL, prompt="x", max_tokens=n, temperature=0, stream=True,
                                       extra_body={"return_token_ids": True}))
    per_token = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].finish_reason is None]
    assert [ch.token_ids for ch in per_token] == [[i] for i in ids]  # one chunk per token, in order
    texts = [ch.text for ch in per_token]
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == MULTI
    assert texts.count("") == len(MULTI.encode()) - len(MULTI) and not any("\ufffd" in t for t in texts)
    chat = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=n)
    chunks = list(c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                            max_tokens=n, stream=True))
    assert len([ch for ch in chunks if ch.choices[0].finish_reason is None]) == n
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == chat.choices[0].message.content == MULTI
    # a stop string that ends in the middle of a multi-byte character's tokens
    r = c.completions.create(model=MODEL, prompt="x", max_tokens=n, stop=["上下"])
    assert r.choices[0].text == "héllo 长" and r.choices[0].finish_reason == "stop"


# ---- OpenAI shapes ---------------------------------------------------------------------------
def test_completions_non_streaming_and_streaming_shapes(start_router):
    h = start_router()
    c = client(h)
    r = c.completions.create(model=MODEL, prompt="Hello", max_tokens=9, temperature=0)
    assert r.object == "text_completion" and r.model == MODEL and r.id.startswith("cmpl-")
    assert r.choices[0].text == TEXT[:9] and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (6, 9, 15)  # BOS + 5 bytes

    chunks = list(c.completions.create(model=MODEL, prompt="Hello", max_tokens=9, stream=True,
                                       stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == TEXT[:9]
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert finals[-1] == "length" and all(f is None for f in finals[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 9

    # usage asked for: "usage": null on every chunk before the final usage chunk (raw JSON: the
    # SDK cannot tell null from absent); without it, no usage key at all
    def usage_keys(body):
        events = sse_events(post(h, "/v1/completions", body))[:-1]
        return [("usage" in e, e.get("usage")) for e in events]

    base = {"prompt": "Hello", "max_tokens": 3, "stream": True}
    got = usage_keys({**base, "stream_options": {"include_usage": True}})
    assert got[:-1] == [(True, None)] * 4 and got[-1][1]["completion_tokens"] == 3  # 3 tokens, the finish chunk
    assert usage_keys(base) == [(False, None)] * 4
    # continuous_usage_stats (vLLM's; guidellm sends it): the running usage on every chunk
    got = usage_keys({**base, "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    assert [u["completion_tokens"] for _, u in got] == [1, 2, 3, 3, 3]
    assert all(u["prompt_tokens"] == 6 and u["total_tokens"] == 6 + u["completion_tokens"] for _, u in got)
    # without include_usage it changes nothing, as in vLLM
    assert usage_keys({**base, "stream_options": {"continuous_usage_stats": True}}) == [(False, None)] * 4

    # raw SSE framing: data: lines, one [DONE] at the very end
    resp = post(h, "/v1/completions", {"prompt": "Hello", "max_tokens": 3, "stream": True})
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    events = sse_events(resp)
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == TEXT[:3]


def test_chat_completions_shapes_and_template(start_router):
    prefill = FakePrefill()
    h = start_router(prefills=[prefill])
    c = client(h)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    r = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=5)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == TEXT[:5] and r.choices[0].finish_reason == "length"
    assert prefill.jobs[-1].prompt_ids[0] == 0  # the template writes BOS
    rendered = bytes(i - 3 for i in prefill.jobs[-1].prompt_ids[1:]).decode()
    assert rendered == "<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n"  # the tiny model's template

    chunks = list(c.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == TEXT[:5]
    assert chunks[-1].choices[0].finish_reason == "length"
    # content as a list of text parts; max_completion_tokens
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                                  max_completion_tokens=2)
    assert r.choices[0].message.content == TEXT[:2]


def test_return_token_ids(start_router):
    h = start_router()
    c = client(h)
    r = c.completions.create(model=MODEL, prompt=[72, 105], max_tokens=6, extra_body={"return_token_ids": True})
    assert r.choices[0].token_ids == TEXT_IDS[:6] and r.choices[0].prompt_token_ids == [72, 105]
    chunks = list(c.completions.create(model=MODEL, prompt=[72, 105], max_tokens=6, stream=True,
                                       extra_body={"return_token_ids": True}))
    assert sum((ch.choices[0].token_ids for ch in chunks), []) == TEXT_IDS[:6]
    assert chunks[0].choices[0].prompt_token_ids == [72, 105]
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                  extra_body={"return_token_ids": True})
    assert r.choices[0].token_ids == TEXT_IDS[:3] and r.prompt_token_ids == load_tokenizer(MODEL).apply_chat_template(
        [{"role": "user", "content": "x"}])


def test_cached_tokens_survive_a_stop_string(start_router):
    """usage.prompt_tokens_details.cached_tokens is the prefill's figure however the request
    ends: at its length, or on a stop string (the router ends that stream itself)."""
    h = start_router(prefills=[FakePrefill(cached_tokens=32)])
    for extra in ({}, {"stop": ["quick"]}):
        r = post(h, "/v1/completions", {"prompt": [5] * 40, "max_tokens": 12, **extra}).json()
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 32, (extra, r["usage"])
    assert r["choices"][0]["finish_reason"] == "stop" and r["choices"][0]["text"] == "The "


def test_stop_strings_cut_text_and_cancel_the_decode_stream(start_router):
    decode = FakeDecode()
    h = start_router(decodes=[decode])
    c = client(h)
    r = c.completions.create(model=MODEL, prompt="x", max_tokens=40, stop=["fox", "zzz"],
                             extra_body={"return_token_ids": True})
    assert r.choices[0].text == "The quick brown " and r.choices[0].finish_reason == "stop"
    assert r.choices[0].token_ids == TEXT_IDS[:len("The quick brown fox")]  # up to the token completing "fox"
    assert r.usage.completion_tokens == len("The quick brown fox")
    assert wait_for(decode.cancelled.is_set)  # the router stopped the stream, freeing the rows
    chunks = list(c.completions.create(model=MODEL, prompt="x", max_tokens=40, stop="fox", stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == "The quick brown "
    assert chunks[-1].choices[0].finish_reason == "stop"
    # a stop string that never completes: its held-back prefix comes out at the end
    r = c.completions.create(model=MODEL, prompt="x", max_tokens=4, stop=["Thexx"])
    assert r.choices[0].text == "The " and r.choices[0].finish_reason == "length"


def test_stop_token_ids_and_ignore_eos(start_router):
    h = start_router(prefills=[FakePrefill(eos_at=5)], decodes=[FakeDecode(eos_at=5)])
    r = post(h, "/v1/completions", {"prompt": "x", "max_tokens": 12, "return_token_ids": True}).json()
    assert r["choices"][0]["finish_reason"] == "stop" and r["choices"][0]["token_ids"] == TEXT_IDS[:5] + [EOS]
    assert r["choices"][0]["text"] == TEXT[:5]  # EOS has no text
    r = post(h, "/v1/completions", {"prompt": "x", "max_tokens": 12, "ignore_eos": True}).json()
    assert r["choices"][0]["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 12
    q = TEXT_IDS[2]  # "e"
    r = post(h, "/v1/completions", {"prompt": "x", "max_tokens": 12, "stop": [q]}).json()
    assert r["choices"][0]["text"] == "Th" and r["choices"][0]["finish_reason"] == "stop"
    r = post(h, "/v1/completions", {"prompt": "x", "max_tokens": 12, "stop_token_ids": [q], "ignore_eos": True}).json()
    assert r["choices"][0]["text"] == "Th"


def test_include_stop_str_in_output_and_skip_special_tokens(start_router):
    h = start_router(prefills=[FakePrefill(eos_at=5)], decodes=[FakeDecode(eos_at=5)])
    for stream in (False, True):
        def text(**extra):
            body = {"prompt": "x", "max_tokens": 12, "stream": stream, **extra}
            resp = post(h, "/v1/completions", body)
            if not stream:
                return resp.json()["choices"][0]["text"]
            return "".join(ev["choices"][0]["text"] for ev in sse_events(resp)[:-1] if ev["choices"])
        # a stop string: cut before it, or (vLLM's include_stop_str_in_output) just after it
        assert text(stop=[" q"]) == "The"
        assert text(stop=[" q"], include_stop_str_in_output=True) == "The q"
        # a stop token id's text, and EOS's, render only when special tokens are not skipped
        q = TEXT_IDS[2]  # "e"
        assert text(stop=[q]) == "Th"
        assert text(stop=[q], include_stop_str_in_output=True) == "The"
        assert text() == TEXT[:5]
        # as vLLM: EOS's text stays out unless include_stop_str_in_output, even unskipped
        assert text(skip_special_tokens=False) == TEXT[:5]
        assert text(skip_special_tokens=False, include_stop_str_in_output=True) == TEXT[:5] + "<eos>"
        assert text(include_stop_str_in_output=True) == TEXT[:5]


# ---- validation --------------------------------------------------------------------------------
BAD_COMPLETIONS = [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    (b'{"prompt": "x", "temperature": NaN}', 400, None),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": True}, 400, "max_tokens"),
    ({"prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ({"prompt": "x", "top_k": -2}, 400, "top_k"),
    ({"prompt": "x", "seed": -1}, 400, "seed"),
    ({"prompt": "x", "seed": 1.5}, 400, "seed"),
    ({"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ({"prompt": "x", "model": 3}, 400, "model"),
    ({"prompt": "x", "foo": 1}, 400, "foo"),
    ({"prompt": "x", "n": 0}, 400, "n"),
    ({"prompt": "x", "n": 17}, 400, "n"),
    ({"prompt": "x", "best_of": 2}, 400, "best_of"),
    ({"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ({"prompt": "x", "logprobs": True}, 400, "logprobs"),
    ({"prompt": "x", "echo": 1}, 400, "echo"),
    ({"prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ({"prompt": "x", "frequency_penalty": -3}, 400, "frequency_penalty"),
    ({"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ({"prompt": "x", "logit_bias": {"a": 1}}, 400, "logit_bias"),
    ({"prompt": "x", "logit_bias": {str(VOCAB): 1}}, 400, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"1": 101}}, 400, "logit_bias"),
    ({"prompt": "x", "logit_bias": [1]}, 400, "logit_bias"),
    ({"prompt": "x", "max_tokens": 3, "min_tokens": 4}, 400, "min_tokens"),
    ({"prompt": "x", "include_stop_str_in_output": "yes"}, 400, "include_stop_str_in_output"),
    ({"prompt": "x", "skip_special_tokens": 0}, 400, "skip_special_tokens"),
    ({"max_tokens": 3}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": 5}, 400, "prompt"),
    ({"prompt": ["a", []]}, 400, "prompt[1]"),
    ({"prompt": ["a", [1, VOCAB]]}, 400, "prompt[1]"),
    ({"prompt": ["a"] * 65}, 400, "prompt"),
    ({"prompt": [1, VOCAB]}, 400, "prompt"),
    ({"prompt": [1, -1]}, 400, "prompt"),
    ({"prompt": [1, "a"]}, 400, "prompt"),
    ({"prompt": "x", "stop": [""]}, 400, "stop"),
    ({"prompt": "x", "stop": 5}, 400, "stop"),
    ({"prompt": "x", "stop": [VOCAB + 1]}, 400, "stop"),
    ({"prompt": "x", "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    ({"prompt": "x", "stream": "yes"}, 400, "stream"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"prompt": "x", "ignore_eos": "x"}, 400, "ignore_eos"),
    ({"prompt": "x", "return_token_ids": 1}, 400, "return_token_ids"),
    ({"prompt": "x", "user": 7}, 400, "user"),
    ({"prompt": "x" * 64}, 400, "prompt"),  # the fake decode holds 64 tokens
    ({"prompt": "x" * 40, "max_tokens": 30}, 400, "max_tokens"),
    ({"prompt": "\ud800"}, 400, "prompt"),  # a lone surrogate: no UTF-8 for it (was a 500)
    ({"prompt": "x", "stop": ["ok", "\udfff"]}, 400, "stop[1]"),
]
BAD_CHAT = [
    ({"messages": [{"role": "user", "content": "a\udfffb"}]}, 400, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]}, 400,
     "messages[0].content[0].text"),
    ({"max_tokens": 3}, 400, "messages"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "u"}]}]}, 400,
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": "x", "name": "bob"}]}, 400, "messages[0].name"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "max_completion_tokens": 3}, 400,
     "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, 400, "tools"),
    ({"messages": [{"role": "user", "content": "x"}], "prompt": "x"}, 400, "prompt"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": 1}, 400, "logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "echo": True}, 400, "echo"),
]


def test_bad_requests_are_4xx_naming_the_field_and_the_router_keeps_serving(start_router):
    h = start_router(decodes=[FakeDecode(capacity=64)])
    for path, cases in (("/v1/completions", BAD_COMPLETIONS), ("/v1/chat/completions", BAD_CHAT)):
        for body, status, param in cases:
            resp = post(h, path, body)
            assert resp.status_code == status, (path, body, resp.text)
            err = resp.json()["error"]
            assert err["param"] == param and err["type"] == "invalid_request_error", (body, err)
            if param:
                assert param in err["message"], err
    # bodies that crashed a handler or reset the connection: nesting past any sane depth
    for raw in (b'{"prompt": ' + b"[" * 5000, b"[" * 100_000 + b"]" * 100_000,
                b'{"prompt": ' + b"[" * 900 + b"5" + b"]" * 900 + b"}"):
        resp = post(h, "/v1/completions", raw)
        assert resp.status_code == 400 and "deeper than" in resp.json()["error"]["message"], resp.text[:200]
    err = post(h, "/v1/completions", {"prompt": "x" * 64}).json()["error"]
    assert "64" in err["message"] and err["code"] == "context_length_exceeded"
    assert post(h, "/v1/completions", {"prompt": "x", "model": "gpt-4"}).json()["error"]["code"] == "model_not_found"
    # neutral values of unsupported features are fine; the cluster still serves
    ok = post(h, "/v1/completions", {"prompt": "x", "max_tokens": 2, "n": 1, "echo": False, "logprobs": None,
                                     "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "user": "u",
                                     "top_k": -1, "seed": 3})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == TEXT[:2]
    metrics = get(h, "/metrics").text
    assert f'cpserve_router_requests_total{{status="invalid"}} {len(BAD_COMPLETIONS) + len(BAD_CHAT) + 5}.0' in metrics


# Fields that never change the output (accepted, logged once) and output-changing ones we do not
# implement (refused unless neutral): one example value each, so both lists stay covered.
IGNORED_EXAMPLES = {"metadata": {"k": "v"}, "store": False, "service_tier": "auto",
                    "parallel_tool_calls": False, "safety_identifier": "s"}
UNSUPPORTED_EXAMPLES = {"best_of": 2, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto",
                        "functions": [{"name": "f"}], "function_call": "auto", "response_format": {"type": "json_object"},
                        "modalities": ["text", "audio"], "min_p": 0.1, "use_beam_search": True, "echo": True,
                        "add_generation_prompt": False, "add_special_tokens": False}


def test_fields_that_never_change_the_output_are_accepted_and_logged_once(start_router, caplog, monkeypatch):
    from services.router import params

    assert set(IGNORED_EXAMPLES) | {"stream_options.include_obfuscation"} == params.IGNORED
    monkeypatch.setattr(params, "_logged", set())
    h = start_router()
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4}
    with caplog.at_level("INFO", logger="cpserve.router"):
        for _ in range(2):
            for path, body in (("/v1/completions", {"prompt": "x", "max_tokens": 4}), ("/v1/chat/completions", chat)):
                r = post(h, path, {**body, **IGNORED_EXAMPLES, "stream": True,
                                   "stream_options": {"include_obfuscation": False}})
                assert r.status_code == 200, r.text
                choices = [e["choices"][0] for e in sse_events(r)[:-1]]
                assert "".join(c["text"] if "text" in c else c["delta"].get("content", "") for c in choices) == TEXT[:4]
    logged = [m for m in caplog.messages if "accepted and ignored" in m]
    assert sorted(m.split()[2] for m in logged) == sorted(params.IGNORED)  # each name once, not per request
    # still type-checked: a wrong type is a 400 naming the field
    for name, bad in (("user", 7), ("metadata", {"k": 1}), ("store", "yes")):
        err = post(h, "/v1/completions", {"prompt": "x", name: bad}).json()["error"]
        assert err["param"] == name, err


def test_fields_that_would_change_the_output_are_refused_unless_neutral(start_router):
    from services.router import params

    assert set(UNSUPPORTED_EXAMPLES) == set(params.UNSUPPORTED)
    h = start_router()
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    for name, value in UNSUPPORTED_EXAMPLES.items():
        path, base = ("/tokenize", {"prompt": "x"}) if name.startswith("add_") else ("/v1/chat/completions", chat)
        err = post(h, path, {**base, name: value})
        assert err.status_code == 400 and err.json()["error"]["param"] == name, (name, err.text)
        assert err.json()["error"]["code"] == "unsupported_value"
        for neutral in (None, *params.UNSUPPORTED[name]):  # the neutral values (and null) change nothing
            ok = post(h, path, {**base, name: neutral})
            assert ok.status_code == 200, (name, neutral, ok.text)
    # booleans are not integers: best_of: true is not best_of: 1
    assert post(h, "/v1/completions", {"prompt": "x", "best_of": True}).json()["error"]["param"] == "best_of"
    # anything else is refused by name: features we lack, vLLM extensions, typos, unknown stream options
    for body, param in (({"suffix": "!"}, "suffix"), ({"guided_json": {}}, "guided_json"), ({"guided_regex": "a"},
                        "guided_regex"), ({"prompt_logprobs": 1}, "prompt_logprobs"), ({"max_token": 5}, "max_token"),
                        ({"stream": True, "stream_options": {"include_usage": True, "chunked": True}},
                         "stream_options.chunked"),
                        ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage")):
        err = post(h, "/v1/completions", {"prompt": "x", **body}).json()["error"]
        assert err["param"] == param and param in err["message"], (body, err)


def test_api_key(start_router):
    h = start_router(api_key="s3cret")
    body = {"prompt": "x", "max_tokens": 2}
    assert post(h, "/v1/completions", body).status_code == 401
    wrong = post(h, "/v1/completions", body, headers={"authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    assert get(h, "/v1/models").status_code == 401
    with pytest.raises(openai.AuthenticationError):
        client(h, "nope").completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert client(h, "s3cret").completions.create(model=MODEL, prompt="x", max_tokens=2).choices[0].text == TEXT[:2]
    assert [m.id for m in client(h, "s3cret").models.list()] == [MODEL]
    assert get(h, "/health").status_code == 200  # health and metrics stay open


def test_models_health_and_metrics(start_router):
    h = start_router()
    c = client(h)
    models = c.models.list()
    assert [m.id for m in models] == [MODEL]
    health = get(h, "/health").json()
    assert health["status"] == "ok" and health["decode"][0]["healthy"] and health["prefill"][0]["address"] == "p0"
    for _ in range(3):
        c.completions.create(model=MODEL, prompt="Hello", max_tokens=4)
    text = get(h, "/metrics").text
    for name in ("cpserve_router_ttft_seconds_count 3.0", "cpserve_router_tpot_seconds_count 3.0",
                 "cpserve_router_e2e_seconds_count 3.0", 'cpserve_router_requests_total{status="ok"} 3.0',
                 "cpserve_kv_transfer_bytes_total 3000.0", "cpserve_kv_transfer_seconds_total 0.006",
                 'cpserve_decode_cache_rows_used{rank="1",service="d0"} 6.0',
                 'cpserve_decode_cache_rows_free{rank="0",service="d0"} 2038.0',
                 'cpserve_service_queue_depth{kind="decode",service="d0"} 1.0',
                 'cpserve_service_healthy{kind="prefill",service="p0"} 1.0', "cpserve_router_in_flight_requests 0.0"):
        assert name in text, name
    assert "cpserve_router_ttft_seconds_bucket" in text


def scrape(handle) -> dict[str, dict[frozenset, float]]:
    """Every sample of the router's /metrics: name -> {frozenset(label items): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict[frozenset, float]] = {}
    for family in text_string_to_metric_families(get(handle, "/metrics").text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[frozenset(sample.labels.items())] = sample.value
    return out


VLLM_NAMES = ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
              "request_queue_time_seconds", "prompt_tokens", "generation_tokens", "request_success",
              "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries",
              "prefix_cache_hits")


class GatedPrefill(FakePrefill):
    """Queues every prefill until ``gate`` is set, and reports that time as its queue time."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.gate = threading.Event()

    async def prefill(self, job, destination, timeout):
        t0 = time.perf_counter()
        while not self.gate.is_set():
            await asyncio.sleep(0.005)
        first = await super().prefill(job, destination, timeout)
        return dataclasses.replace(first, queue_ms=(time.perf_counter() - t0) * 1e3)


class RowsDecode(FakeDecode):
    """Reports the rows its reservations hold (prompt + max_tokens, split over 2 ranks) and frees
    them when a stream ends; holds every stream after its first token until ``gate`` is set."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.held: dict[str, int] = {}
        self.gate = threading.Event()

    async def reserve(self, job, timeout):
        r = await super().reserve(job, timeout)
        self.held[r.id] = len(job.prompt_ids) + job.sampling.max_new_tokens
        return r

    async def generate(self, job, reservation, start, timeout, fork=0):
        try:
            async for ev in super().generate(job, reservation, start, timeout, fork):
                while not self.gate.is_set():
                    await asyncio.sleep(0.005)
                yield ev
        finally:
            self.held.pop(reservation.id, None)

    async def abort(self, reservation, timeout, fork=None):
        self.held.pop(reservation.id, None)

    async def status(self, timeout):
        used, half = sum(self.held.values()), self.capacity // 2
        per_rank = (used - used // 2, used // 2)
        return DecodeLoad(per_rank, tuple(half - u for u in per_rank), 0, rows_total=(half, half))


@pytest.mark.timeout(60)
def test_vllm_metrics_with_model_name_and_gauges_current_when_scraped(start_router):
    """vLLM's names under cpserve:, labelled with the served model; the running/waiting split and
    the decode rows as they are at the scrape (the health poll here is every 30 s)."""
    from concurrent.futures import ThreadPoolExecutor

    prefill, decode = GatedPrefill(cached_tokens=2), RowsDecode(capacity=1000)
    h = start_router(prefills=[prefill], decodes=[decode], served_model_name="served")
    model = frozenset({("model_name", "served")})
    body = {"prompt": [5] * 10, "max_tokens": 5, "ignore_eos": True}

    def value(name):
        return scrape(h)[f"cpserve:{name}"][model]

    with ThreadPoolExecutor(3) as pool:
        replies = [pool.submit(post, h, "/v1/completions", body) for _ in range(3)]
        assert wait_for(lambda: value("num_requests_waiting") == 3), scrape(h)  # reserved, held in prefill
        assert value("num_requests_running") == 0
        assert value("kv_cache_usage_perc") == pytest.approx(3 * 15 / 1000)
        prefill.gate.set()
        assert wait_for(lambda: value("num_requests_running") == 3)  # first token out, held in decode
        assert value("num_requests_waiting") == 0
        decode.gate.set()
        assert [r.result().status_code for r in replies] == [200] * 3
    s = scrape(h)  # right after the requests: rows free, nothing running
    assert s["cpserve_decode_cache_rows_used"] == {frozenset({("service", "d0"), ("rank", r)}): 0 for r in "01"}
    assert [s[f"cpserve:{n}"][model] for n in ("kv_cache_usage_perc", "num_requests_running",
                                                "num_requests_waiting")] == [0, 0, 0]
    for name in VLLM_NAMES:  # every name, with the model's name
        samples = {k: v for n, per in s.items() if n.startswith(f"cpserve:{name}") for k, v in per.items()}
        assert samples and all(("model_name", "served") in k for k in samples), name
    counts = {n: s[f"cpserve:{n}_count"][model] for n in VLLM_NAMES[:4]}
    assert counts == {"time_to_first_token_seconds": 3, "inter_token_latency_seconds": 3 * 4,
                      "e2e_request_latency_seconds": 3, "request_queue_time_seconds": 3}
    assert [s[f"cpserve:{n}_total"][model] for n in ("prompt_tokens", "generation_tokens", "prefix_cache_queries",
                                                     "prefix_cache_hits")] == [30, 15, 30, 6]
    success = {dict(k)["finished_reason"]: v for k, v in s["cpserve:request_success_total"].items()}
    assert success == {"stop": 0, "length": 3, "abort": 0}
    # the queue time: arrival until the prefill engine takes the request (here: all but the tail of TTFT)
    queue, ttft = s["cpserve:request_queue_time_seconds_sum"][model], s["cpserve:time_to_first_token_seconds_sum"][model]
    assert 0.5 * ttft < queue < ttft


class TimedPrefill(FakePrefill):
    """Takes 80 ms and says where 60 of them went (queue 10, compute 40, hand-off 10)."""

    async def prefill(self, job, destination, timeout):
        first = await super().prefill(job, destination, timeout)
        await asyncio.sleep(0.08)
        return dataclasses.replace(first, queue_ms=10.0, compute_ms=40.0, handoff_ms=10.0)


class SlowReserve(FakeDecode):
    async def reserve(self, job, timeout):
        await asyncio.sleep(0.03)
        return await super().reserve(job, timeout)


def _histogram(text: str, name: str, label: str = "") -> tuple[float, float]:
    """(sum, count) of a histogram in a Prometheus text page."""
    def value(suffix):
        return float(re.search(rf"^{name}_{suffix}{re.escape(label)} (\S+)", text, re.M).group(1))
    return value("sum"), value("count")


def test_ttft_breakdown_adds_up_to_ttft(start_router):
    h = start_router(prefills=[TimedPrefill()], decodes=[SlowReserve()])
    for _ in range(3):
        assert post(h, "/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "stream": True}).is_success
    text = get(h, "/metrics").text
    ttft, n = _histogram(text, "cpserve_router_ttft_seconds")
    stages = {st: _histogram(text, "cpserve_router_ttft_stage_seconds", f'{{stage="{st}"}}') for st in TTFT_STAGES}
    assert n == 3 and all(count == 3 for _, count in stages.values()), stages
    per = {st: total / 3 for st, (total, _) in stages.items()}
    assert per["prefill_queue"] == pytest.approx(0.010) and per["prefill_compute"] == pytest.approx(0.040)
    assert per["kv_transfer"] == pytest.approx(0.010)
    assert 0.02 <= per["prefill_rpc"] < 0.05  # the 80 ms RPC less the 60 ms the service accounted for
    assert 0.03 <= per["reserve"] < 0.06
    # the stages are the whole TTFT: no time falls between them
    assert sum(per.values()) == pytest.approx(ttft / 3, abs=1e-4)
    # the same breakdown per request (GET /debug/ttft), keyed by the response id
    r = post(h, "/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 2}).json()
    records = get(h, "/debug/ttft").json()["requests"]
    assert len(records) == 4 and records[-1]["id"] == r["id"]
    rec = records[-1]
    assert set(rec["stages_ms"]) == set(TTFT_STAGES)
    assert rec["stages_ms"]["prefill_compute"] == pytest.approx(40.0)
    assert sum(rec["stages_ms"].values()) == pytest.approx(rec["ttft_ms"], abs=0.1)


def test_http_connections_send_without_nagle():
    """Every accepted HTTP connection has TCP_NODELAY (asyncio sets it only when the listener's
    proto says TCP): with Nagle, each SSE chunk after a keep-alive connection's first request
    waited ~40 ms for the client's delayed ACK."""
    async def accepted_nodelay() -> int:
        seen: asyncio.Future = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport):
                sock = transport.get_extra_info("socket")
                seen.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))

        server = await asyncio.get_running_loop().create_server(Probe, sock=listen_socket("127.0.0.1", 0))
        port = server.sockets[0].getsockname()[1]
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            return await asyncio.wait_for(seen, 10)
        finally:
            writer.close()
            server.close()

    assert asyncio.run(accepted_nodelay()) != 0


def test_model_tokenize_detokenize_version_ping_and_unknown_routes(start_router):
    """The endpoints vLLM users call besides the OpenAI ones, and OpenAI-shaped 404/405s."""
    h = start_router()
    card = get(h, f"/v1/models/{MODEL}").json()
    assert card["id"] == MODEL and card["object"] == "model" and card["max_model_len"] > 0
    missing = get(h, "/v1/models/gpt-4")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"

    tok = load_tokenizer(MODEL)
    r = post(h, "/tokenize", {"model": MODEL, "prompt": "Hello"}).json()
    assert r["tokens"] == tok.encode("Hello") and r["count"] == len(r["tokens"]) == 6  # what a completion prefills
    assert r["max_model_len"] == card["max_model_len"]
    messages = [{"role": "user", "content": "hi"}]
    r = post(h, "/tokenize", {"messages": messages}).json()
    assert r["tokens"] == tok.apply_chat_template(messages)
    for body, param in [({"prompt": "x", "messages": messages}, "prompt"), ({}, "prompt"), ({"prompt": 3}, "prompt"),
                        ({"prompt": "x", "add_special_tokens": False}, "add_special_tokens"),
                        ({"prompt": "x", "model": "gpt-4"}, "model"), ({"prompt": "x", "foo": 1}, "foo")]:
        bad = post(h, "/tokenize", body)
        assert 400 <= bad.status_code < 500 and bad.json()["error"]["param"] == param, (body, bad.text)

    ids = [ord(c) + 3 for c in "Hello"]
    assert post(h, "/detokenize", {"tokens": ids}).json() == {"prompt": "Hello"}
    for body in ({"tokens": [10**6]}, {"tokens": "Hello"}, {}):
        bad = post(h, "/detokenize", body)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens", (body, bad.text)

    assert get(h, "/version").json()["version"]
    assert get(h, "/ping").status_code == 200
    assert httpx.post(f"{h.url}/ping", trust_env=False).status_code == 200
    for resp, status in ((get(h, "/v1/nothing-here"), 404), (get(h, "/v1/completions"), 405)):
        assert resp.status_code == status
        err = resp.json()["error"]
        assert err["type"] == "invalid_request_error" and err["message"], err


# ---- forks, preemption, admission ----------------------------------------------------------------
def test_n_samples_are_forks_of_one_reservation_and_one_prefill(start_router):
    prefill, decode = FakePrefill(), FakeDecode()
    h = start_router(prefills=[prefill], decodes=[decode])
    r = client(h).completions.create(model=MODEL, prompt=["ab", "cd"], n=3, max_tokens=4, seed=7,
                                     extra_body={"return_token_ids": True})
    assert [c.index for c in r.choices] == list(range(6)) and all(c.text == TEXT[:4] for c in r.choices)
    assert [j.num_forks for j in prefill.jobs] == [3, 3] and len(decode.reserved) == 2  # one per prompt
    assert [j.sampling.seed for j in prefill.jobs] == [7, 7]  # fork j: 7 + j, drawn by prefill
    assert r.usage.completion_tokens == 24 and r.usage.prompt_tokens == 6
    chunks = sse_events(post(h, "/v1/completions", {"prompt": "ab", "n": 2, "max_tokens": 3, "stream": True}))
    assert sorted(c["choices"][0]["index"] for c in chunks[:-1] if c["choices"][0]["finish_reason"]) == [0, 1]


class PreemptingDecode(FakeDecode):
    """Preempts every fresh generation after ``after`` tokens; resumed ones run to their end."""

    def __init__(self, after: int = 3, **kw):
        super().__init__(**kw)
        self.after, self.resumed_jobs = after, []

    async def generate(self, job, reservation, start, timeout, fork=0):
        if job.output_ids:
            self.resumed_jobs.append(job)
            async for ev in super().generate(job, reservation, start, timeout, fork):
                yield ev
            return
        assert start.seed == 1234 + fork
        ids, _ = reply(job)
        for i in range(1, self.after):
            yield Token(ids[i], i)
        yield Done("preempted", self.after)


def test_a_preempted_stream_is_resumed_and_the_client_sees_one_stream(start_router):
    prefill, decode = FakePrefill(), PreemptingDecode(after=3)
    h = start_router(prefills=[prefill], decodes=[decode])
    chunks = sse_events(post(h, "/v1/completions", {"prompt": "x", "max_tokens": 10, "stream": True, "n": 2,
                                                    "return_token_ids": True}))
    per_choice: dict[int, list[int]] = {}
    for c in chunks[:-1]:
        per_choice.setdefault(c["choices"][0]["index"], []).extend(c["choices"][0].get("token_ids") or [])
    assert per_choice == {0: TEXT_IDS[:10], 1: TEXT_IDS[:10]}
    # each fork resumed as its own job: prompt + its 3 tokens, its own seed, no second prompt scoring
    assert sorted(j.sampling.seed for j in decode.resumed_jobs) == [1234, 1235]
    assert all(j.output_ids == tuple(TEXT_IDS[:3]) and j.num_forks == 1 for j in decode.resumed_jobs)
    assert [j.num_tokens for j in prefill.jobs[1:]] == [len(prefill.jobs[0].prompt_ids) + 3] * 2
    text = get(h, "/metrics").text
    assert re.search(r'^cpserve:num_preemptions_total\{model_name="tiny"\} 2.0$', text, re.M), text


def test_without_max_tokens_a_request_may_run_to_the_context_limit(start_router):
    prefill = FakePrefill()
    h = start_router(prefills=[prefill], decodes=[FakeDecode(capacity=512)], default_max_tokens=None)
    assert wait_for(lambda: get(h, "/v1/models").json()["data"][0]["max_model_len"] == 512)
    r = client(h).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    prompt = len(prefill.jobs[-1].prompt_ids)
    assert prefill.jobs[-1].sampling.max_new_tokens == 512 - prompt
    assert r.usage.completion_tokens == 512 - prompt and r.choices[0].finish_reason == "length"
    client(h).completions.create(model=MODEL, prompt=["a", "abc"])  # each prompt its own room
    assert [j.sampling.max_new_tokens for j in prefill.jobs[-2:]] == [512 - 2, 512 - 4]


class FullForAWhile(FakeDecode):
    """No rows for its first ``busy`` Reserve calls."""

    def __init__(self, busy: int, **kw):
        super().__init__(**kw)
        self.busy, self.refused = busy, 0

    async def reserve(self, job, timeout):
        if self.refused < self.busy:
            self.refused += 1
            raise BackendError(grpc.StatusCode.RESOURCE_EXHAUSTED, "capacity: no free cache rows now", self.address)
        return await super().reserve(job, timeout)


def test_a_request_without_rows_waits_in_the_queue_then_gets_them(start_router):
    decode = FullForAWhile(busy=5)
    h = start_router(decodes=[decode])
    r = client(h).completions.create(model=MODEL, prompt="x", max_tokens=3)
    assert r.choices[0].text == TEXT[:3] and decode.refused == 5 and len(decode.reserved) == 1
    assert 'cpserve_router_retries_total 0.0' in get(h, "/metrics").text  # waiting is not a retry
    # max_waiting 0: no queue, a 429 at once
    h = start_router(decodes=[FullForAWhile(busy=10 ** 6)], max_waiting=0)
    resp = post(h, "/v1/completions", {"prompt": "x"})
    assert resp.status_code == 429 and "max_waiting" in resp.json()["error"]["message"]


def test_admission_serves_resumed_generations_first_then_in_arrival_order():
    from services.router.admission import Admission, Overloaded

    async def main():
        adm = Admission(max_waiting=2, max_wait_s=5.0, poll_s=0.01)
        rows, served = [0], []

        def waiter(name: str, resumed: bool = False):
            async def attempt():
                if rows[0] > 0:
                    rows[0] -= 1
                    served.append(name)
                    return name
                return None
            return asyncio.ensure_future(adm.admit(attempt, resumed, asyncio.get_running_loop().time() + 5))

        tasks = [waiter("new-1")]
        await asyncio.sleep(0.03)
        tasks.append(waiter("new-2"))
        await asyncio.sleep(0.03)
        tasks.append(waiter("resumed", resumed=True))
        await asyncio.sleep(0.03)
        assert adm.num_waiting == 3
        with pytest.raises(Overloaded, match="max_waiting"):
            await adm.admit(lambda: asyncio.sleep(0, None))  # a third new one: the queue is full
        for _ in range(3):
            rows[0] += 1
            adm.notify()
            await asyncio.sleep(0.03)
        await asyncio.gather(*tasks)
        assert served == ["resumed", "new-1", "new-2"] and adm.num_waiting == 0
        quick = Admission(max_waiting=4, max_wait_s=0.05, poll_s=0.01)
        with pytest.raises(Overloaded, match="0.05 s"):
            await quick.admit(lambda: asyncio.sleep(0, None))

    asyncio.run(main())


# ---- failures ----------------------------------------------------------------------------------
def test_failure_before_first_token_retries_on_another_pair(start_router):
    bad = FakePrefill("p0", fail=BackendError(UNAVAILABLE, "KV transfer to 127.0.0.1:1 failed", "p0"))
    good = FakePrefill("p1")
    decode = FakeDecode()
    h = start_router(prefills=[bad, good], decodes=[decode])
    r = client(h).completions.create(model=MODEL, prompt="Hello", max_tokens=5)
    assert r.choices[0].text == TEXT[:5]
    assert len(bad.jobs) == 1 and len(good.jobs) == 1
    assert wait_for(lambda: decode.aborted == decode.reserved[:1])  # the failed attempt's rows were returned
    assert "cpserve_router_retries_total 1.0" in get(h, "/metrics").text


def test_failures_that_exhaust_retries_or_are_final(start_router):
    # no rows anywhere: 429 + Retry-After after the bounded wait in the admission queue
    full = FakeDecode(fail_reserve=BackendError(grpc.StatusCode.RESOURCE_EXHAUSTED, "capacity: no free rows", "d0"))
    h = start_router(decodes=[full], max_wait_s=0.3)
    t0 = time.monotonic()
    resp = post(h, "/v1/completions", {"prompt": "x"})
    assert resp.status_code == 429 and resp.headers["retry-after"] == "1" and time.monotonic() - t0 >= 0.3
    assert resp.json()["error"]["code"] == "overloaded" and "max_wait_s" in resp.json()["error"]["message"]
    # a service's INVALID_ARGUMENT is the request's fault: 400 naming the field, no retry
    strict = FakePrefill("p0", fail=BackendError(grpc.StatusCode.INVALID_ARGUMENT, "prompt: too odd", "p0"))
    other = FakePrefill("p1")
    h = start_router(prefills=[strict, other])
    resp = post(h, "/v1/completions", {"prompt": "x"})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt" and not other.jobs
    # every pair fails: bounded retries, then 503
    prefills = [FakePrefill(f"p{i}", fail=BackendError(UNAVAILABLE, "down", f"p{i}")) for i in range(5)]
    h = start_router(prefills=prefills, max_retries=2)
    assert post(h, "/v1/completions", {"prompt": "x"}).status_code == 503
    assert sum(len(p.jobs) for p in prefills) == 3


class LimitedDecode(FakeDecode):
    """A decode service with room for ``rows`` requests at once: Reserve is RESOURCE_EXHAUSTED
    while they are taken; a request's rows come back when its stream ends or it is aborted."""

    def __init__(self, rows: int, **kw):
        super().__init__(**kw)
        self.rows, self.held, self.refused = rows, set(), 0

    async def reserve(self, job, timeout):
        if len(self.held) >= self.rows:
            self.refused += 1
            raise BackendError(grpc.StatusCode.RESOURCE_EXHAUSTED, "capacity: no free rows", self.address)
        r = await super().reserve(job, timeout)
        self.held.add(r.id)
        return r

    async def generate(self, job, reservation, first, timeout, *fork):
        try:
            async for event in super().generate(job, reservation, first, timeout, *fork):
                yield event
        finally:
            self.held.discard(reservation.id)

    async def abort(self, reservation, timeout):
        self.held.discard(reservation.id)
        await super().abort(reservation, timeout)


def test_requests_wait_in_the_router_for_cache_rows(start_router):
    """Rows for one request at a time: three requests sent together are all served, one after
    the other (the later two queued in the router, retried as rows come free); with no queue,
    the ones that find no rows get 429 at once."""
    decode = LimitedDecode(1, delay_s=0.05)
    h = start_router(decodes=[decode], max_wait_s=20)
    with ThreadPoolExecutor(3) as pool:
        codes = list(pool.map(lambda _: post(h, "/v1/completions", {"prompt": "x", "max_tokens": 6}).status_code,
                              range(3)))
    assert codes == [200, 200, 200] and len(decode.reserved) == 3 and decode.refused >= 2
    decode = LimitedDecode(1, delay_s=0.2)
    h = start_router(decodes=[decode], max_waiting=0)
    with ThreadPoolExecutor(3) as pool:
        codes = sorted(pool.map(lambda _: post(h, "/v1/completions", {"prompt": "x", "max_tokens": 6}).status_code,
                                range(3)))
    assert codes == [200, 429, 429]


def test_failure_after_first_token_ends_stream_with_error_and_marks_decode_unhealthy(start_router):
    decode = FakeDecode(fail_after=3)
    h = start_router(decodes=[decode])
    got = []
    with pytest.raises(openai.APIError) as info:
        for ch in client(h).completions.create(model=MODEL, prompt="x", max_tokens=10, stream=True):
            got.append(ch.choices[0].text)
    assert "".join(got) == TEXT[:4] and "rank group died" in str(info.value)
    health = get(h, "/health")
    assert health.status_code == 503 and not health.json()["decode"][0]["healthy"]
    assert "UNAVAILABLE" in health.json()["decode"][0]["reason"]
    assert post(h, "/v1/completions", {"prompt": "x"}).status_code == 503  # no healthy pair left
    text = get(h, "/metrics").text
    assert 'cpserve_router_requests_total{status="unavailable"} 2.0' in text


def test_unhealthy_service_is_left_out_until_it_recovers(start_router):
    d0, d1 = FakeDecode("d0"), FakeDecode("d1")
    d0.healthy = False
    h = start_router(decodes=[d0, d1], health_interval_s=0.1)
    for _ in range(3):
        assert post(h, "/v1/completions", {"prompt": "x", "max_tokens": 2}).status_code == 200
    assert not d0.reserved and len(d1.reserved) == 3
    d0.healthy = True
    assert wait_for(lambda: all(e["healthy"] for e in get(h, "/health").json()["decode"]))
    for _ in range(4):
        post(h, "/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert d0.reserved  # back in the rotation


def test_client_disconnect_cancels_the_backend_stream(start_router):
    decode = FakeDecode(block_after=2)
    h = start_router(decodes=[decode])
    with httpx.stream("POST", f"{h.url}/v1/completions", json={"prompt": "x", "max_tokens": 50, "stream": True},
                      timeout=30, trust_env=False) as resp:
        data = (json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: "))
        assert "".join(next(data)["choices"][0]["text"] for _ in range(3)) == "The"  # the fake now blocks
    assert wait_for(decode.cancelled.is_set)
    assert wait_for(lambda: 'status="cancelled"} 1.0' in get(h, "/metrics").text)
    # non-streaming: the client gives up while the router waits for tokens
    decode.cancelled.clear()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{h.url}/v1/completions", json={"prompt": "x", "max_tokens": 50}, timeout=0.5,
                   trust_env=False)
    assert wait_for(decode.cancelled.is_set)
    assert wait_for(lambda: "cpserve_router_in_flight_requests 0.0" in get(h, "/metrics").text)


# ---- gRPC front ----------------------------------------------------------------------------------
def test_grpc_front_generate_errors_and_health(start_router):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    h = start_router(api_key="k")
    with grpc.insecure_channel(f"127.0.0.1:{h.grpc_port}") as ch:
        stub = router_pb2_grpc.RouterStub(ch)
        auth = (("authorization", "Bearer k"),)
        req = router_pb2.GenerateRequest(text="Hello", sampling=common_pb2.Sampling(max_new_tokens=12), stop=["ick"])
        events = list(stub.Generate(req, metadata=auth))
        tokens = [e.token for e in events if e.WhichOneof("event") == "token"]
        assert [t.index for t in tokens] == list(range(len("The quick")))  # up to the token completing "ick"
        assert "".join(t.text for t in tokens) == "The qu"
        done = events[-1].done
        assert done.finish_reason == router_pb2.FINISH_REASON_STOP and done.completion_tokens == 9
        assert done.prompt_tokens == 6  # BOS + 5 bytes
        events = list(stub.Generate(router_pb2.GenerateRequest(ids=router_pb2.PromptIds(ids=[5, 6])), metadata=auth))
        assert len(events) == 17 and events[-1].done.finish_reason == router_pb2.FINISH_REASON_LENGTH
        for bad, code, field in [
            (router_pb2.GenerateRequest(ids=router_pb2.PromptIds(ids=[VOCAB])), grpc.StatusCode.INVALID_ARGUMENT,
             "ids"),
            (router_pb2.GenerateRequest(), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
            (router_pb2.GenerateRequest(text="x", sampling=common_pb2.Sampling(max_new_tokens=0)),
             grpc.StatusCode.INVALID_ARGUMENT, "sampling.max_new_tokens"),
            (router_pb2.GenerateRequest(text="x", model="other"), grpc.StatusCode.NOT_FOUND, "model"),
        ]:
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Generate(bad, metadata=auth))
            assert info.value.code() == code and info.value.details().startswith(field), info.value.details()
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(req))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        check = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""))
        assert check.status == health_pb2.HealthCheckResponse.SERVING


def test_grpc_front_error_event_after_first_token(start_router):
    h = start_router(decodes=[FakeDecode(fail_after=2, fail_code=grpc.StatusCode.INTERNAL)])
    with grpc.insecure_channel(f"127.0.0.1:{h.grpc_port}") as ch:
        events = list(router_pb2_grpc.RouterStub(ch).Generate(router_pb2.GenerateRequest(text="x")))
    kinds = [e.WhichOneof("event") for e in events]
    assert kinds == ["token", "token", "token", "error"]
    assert events[-1].error.code == router_pb2.ERROR_CODE_INTERNAL and "rank group died" in events[-1].error.message


# ---- the gRPC clients, against fake gRPC services (no engines) ----------------------------------
class FakeDecodeService(decode_pb2_grpc.DecodeServicer):
    """Decode's wire contract: Reserve → opaque destination, Generate from index 1, Abort, Status."""

    def __init__(self):
        self.destinations: dict[str, kv_pb2.KvDestination] = {}
        self.aborted: list[str] = []
        self.error_after: int | None = None  # stream an UNAVAILABLE Error event after this many tokens
        self.block = False  # stream one token, then wait for the client to go away
        self.cancelled = threading.Event()

    def Reserve(self, request, context):
        rid = uuid.uuid4().hex
        dest = kv_pb2.KvDestination(reservation_id=rid, dcp=2, page_size=16, slots=range(request.num_tokens),
                                    decode_address="fake-decode", expires_at_unix_s=time.time() + 30)
        self.destinations[rid] = dest
        return dest

    def Generate(self, request, context):
        assert request.reservation_id in self.destinations and request.seed == 99
        n = request.sampling.max_new_tokens
        for i in range(1, n):
            if self.error_after is not None and i > self.error_after:
                yield decode_pb2.GenerateEvent(error=decode_pb2.GenerateEvent.Error(
                    code=decode_pb2.ERROR_CODE_UNAVAILABLE, message="rank 1 died"))
                return
            yield decode_pb2.GenerateEvent(token=decode_pb2.GenerateEvent.Token(id=TEXT_IDS[i], index=i))
            while self.block and context.is_active():
                time.sleep(0.01)
            if not context.is_active():
                self.cancelled.set()
                return
        yield decode_pb2.GenerateEvent(done=decode_pb2.GenerateEvent.Done(
            finish_reason=decode_pb2.FINISH_REASON_LENGTH, num_tokens=n))

    def Abort(self, request, context):
        self.aborted.append(request.reservation_id)
        return decode_pb2.AbortResponse(freed=True)

    def Status(self, request, context):
        return decode_pb2.DecodeStatus(dcp=2, rows_used=[4, 4], rows_free=[60, 60], queue_depth=2, serving=True)


class FakePrefillService(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, decode: FakeDecodeService):
        self.decode = decode
        self.same_destination = []  # did each request carry exactly what Reserve returned?

    def Prefill(self, request, context):
        sent = self.decode.destinations.get(request.destination.reservation_id)
        self.same_destination.append(sent is not None and sent.SerializeToString(deterministic=True)
                                     == request.destination.SerializeToString(deterministic=True))
        return prefill_pb2.PrefillResponse(first_token=TEXT_IDS[0], seed=99, prefill_ms=1.0, transfer_bytes=4096,
                                           transfer_ms=0.5)

    def Status(self, request, context):
        return prefill_pb2.ServiceStatus(cp=2, queue_depth=0, serving=True)


@pytest.fixture
def fake_grpc_services():
    from concurrent import futures

    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    decode = FakeDecodeService()
    prefill = FakePrefillService(decode)
    servers, addresses = [], []
    for add, servicer in ((prefill_pb2_grpc.add_PrefillServicer_to_server, prefill),
                          (decode_pb2_grpc.add_DecodeServicer_to_server, decode)):
        server = grpc.server(futures.ThreadPoolExecutor(8))
        add(servicer, server)
        h = health.HealthServicer()
        h.set("", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(h, server)
        addresses.append(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
        server.start()
        servers.append(server)
    yield prefill, decode, addresses
    for server in servers:
        server.stop(0)


def test_grpc_clients_relay_the_protocol(fake_grpc_services):
    prefill, decode, (p_addr, d_addr) = fake_grpc_services
    h = serve_router(RouterConfig(prefill=(p_addr,), decode=(d_addr,), model=MODEL, health_interval_s=30))
    try:
        r = client(h).completions.create(model=MODEL, prompt="x", max_tokens=7)
        assert r.choices[0].text == TEXT[:7] and r.choices[0].finish_reason == "length"
        assert prefill.same_destination == [True]  # the router copied the destination untouched
        text = get(h, "/metrics").text
        assert f'cpserve_decode_cache_rows_free{{rank="1",service="{d_addr}"}} 60.0' in text
        assert "cpserve_kv_transfer_bytes_total 4096.0" in text
        # client gone mid-stream: the router cancels the decode call
        decode.block = True
        with httpx.stream("POST", f"{h.url}/v1/completions", json={"prompt": "x", "max_tokens": 9, "stream": True},
                          timeout=30, trust_env=False) as resp:
            data = (line for line in resp.iter_lines() if line.startswith("data: "))
            next(data), next(data)  # token 1 came from the decode stream: the call is open
        assert wait_for(decode.cancelled.is_set)
        decode.block = False
        # an UNAVAILABLE Error event after the first token: error to the client, decode marked unhealthy
        decode.error_after = 2
        resp = post(h, "/v1/completions", {"prompt": "x", "max_tokens": 9, "stream": True})
        events = sse_events(resp)
        assert "rank 1 died" in events[-2]["error"]["message"] and events[-1] == "[DONE]"
        assert get(h, "/health").json()["decode"][0]["healthy"] is False
    finally:
        h.shutdown()


# ---- end to end, real services --------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_end_to_end_real_services_match_the_reference():
    """prefill CP=2 → decode DCP=2 through the router, via the openai client: greedy tokens equal
    the one-process reference (ignore_eos, so both run max_tokens)."""
    from engine.model.sampler import SamplingParams
    from engine.reference import ReferenceEngine
    from services.common.config import DecodeConfig, PrefillConfig
    from services.decode.server import serve_decode
    from services.prefill.server import serve_prefill

    n = 12
    prompts = ["Context parallelism splits long prompts across ranks.", "Hi"]
    ref = ReferenceEngine(MODEL)
    expected = [seq.output_ids for seq in ref.generate([ref.tokenizer.encode(p) for p in prompts],
                                                       SamplingParams(max_new_tokens=n, stop_token_ids=()))]
    started = []
    try:
        started.append(serve_decode(DecodeConfig(dcp=2, port=0, max_cache_tokens=4096)))
        started.append(serve_prefill(PrefillConfig(cp=2, port=0, max_cache_tokens=4096)))
        (_, d_port, _), (_, p_port, _) = started
        h = serve_router(RouterConfig(prefill=(f"127.0.0.1:{p_port}",), decode=(f"127.0.0.1:{d_port}",),
                                      model=MODEL))
        started.append((None, None, h.shutdown))
        c = client(h)
        extra = {"ignore_eos": True, "return_token_ids": True}
        r = c.completions.create(model=MODEL, prompt=prompts[0], max_tokens=n, temperature=0, extra_body=extra)
        assert r.choices[0].token_ids == expected[0]
        assert r.choices[0].text == ref.tokenizer.decode(expected[0]) and r.choices[0].finish_reason == "length"
        chunks = list(c.completions.create(model=MODEL, prompt=prompts[1], max_tokens=n, temperature=0, stream=True,
                                           extra_body=extra))
        assert sum((ch.choices[0].token_ids for ch in chunks), []) == expected[1]
        text = get(h, "/metrics").text
        assert "cpserve_router_ttft_seconds_count 2.0" in text and 'status="ok"} 2.0' in text
        assert "cpserve_kv_transfer_bytes_total 0.0" not in text
        assert get(h, "/health").json()["status"] == "ok"
    finally:
        for _, _, shutdown in reversed(started):
            shutdown()


# ---- configuration and the command line -----------------------------------------------------------
def test_router_config_from_yaml_and_cli_serve_router(tmp_path):
    import os
    import signal
    import subprocess

    import yaml

    from services.common.config import ConfigError, load_config

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"router": {"prefill": ["127.0.0.1:1"], "decode": ["127.0.0.1:2"],
                                               "max_retries": 1, "grpc_port": None}}))
    cfg = load_config("router", path, {"port": 0, "api_key": None})
    assert (cfg.prefill, cfg.max_retries, cfg.grpc_port, cfg.host, cfg.model_name) == (("127.0.0.1:1",), 1, None,
                                                                                          "127.0.0.1", "tiny")
    with pytest.raises(ConfigError, match="router.decode"):
        load_config("router", None, {"prefill": ["a:1"]})
    with pytest.raises(ConfigError, match="router.max_retries"):
        load_config("router", path, {"max_retries": -1})

    with cli_process(["serve", "router", "--config", str(path), "--decode", "127.0.0.1:3,127.0.0.1:4",
                      "--health-interval-s", "0.2"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                     env={**os.environ, "CPSERVE_API_KEY": "k"}) as proc:
        address = next(line.split()[-1] for line in proc.stdout if line.startswith("serving router on "))
        health = httpx.get(f"http://{address}/health", timeout=10, trust_env=False)
        assert health.status_code == 503
        body = health.json()
        assert [d["address"] for d in body["decode"]] == ["127.0.0.1:3", "127.0.0.1:4"]
        assert body["prefill"][0]["reason"].startswith("unreachable")
        assert httpx.get(f"http://{address}/v1/models", timeout=10, trust_env=False).status_code == 401
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0


# ---- the checkpoint's tokenizer, chat template and limits --------------------------------------
def _tiny_copy(tmp_path, name="m"):
    import shutil

    from engine.model.tiny import resolve_model_dir

    return Path(shutil.copytree(resolve_model_dir(MODEL), tmp_path / name))


def test_model_without_tokenizer_refuses_text_and_serves_ids(start_router, tmp_path):
    path = _tiny_copy(tmp_path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (path / f).unlink()
    h = start_router(model=str(path))
    for route, body in (("/v1/completions", {"prompt": "hello"}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        resp = post(h, route, {**body, "max_tokens": 2})
        assert resp.status_code == 400 and "no tokenizer" in resp.json()["error"]["message"], resp.text
    r = client(h).completions.create(model=str(path), prompt=[5, 6, 7], max_tokens=3,
                                     extra_body={"return_token_ids": True})
    assert r.choices[0].token_ids == TEXT_IDS[:3] and r.choices[0].text == ""  # ids out, no text to render


def test_chat_template_missing_or_overridden(start_router, tmp_path):
    path = _tiny_copy(tmp_path)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    h = start_router(model=str(path))
    resp = post(h, "/v1/chat/completions", chat)
    assert resp.status_code == 400 and "no chat template" in resp.json()["error"]["message"]
    assert resp.json()["error"]["param"] == "messages"
    assert post(h, "/v1/completions", {"prompt": "hi", "max_tokens": 2}).status_code == 200  # text still works

    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] ")
    prefill = FakePrefill()
    h = start_router(prefills=[prefill], model=str(path), chat_template=str(template))
    r = client(h).chat.completions.create(model=str(path), messages=[{"role": "system", "content": "s"},
                                                                      {"role": "user", "content": "hi"}],
                                          max_tokens=2)
    assert r.usage.prompt_tokens == len("[system] s\n[user] hi\n[assistant] ")  # no BOS: the template has none
    assert bytes(i - 3 for i in prefill.jobs[-1].prompt_ids).decode() == "[system] s\n[user] hi\n[assistant] "
    # a template's own check (raise_exception) is a 400 naming messages, not a 500
    template.write_text("{{ raise_exception('roles must alternate') }}")
    h = start_router(model=str(path), chat_template=str(template))
    resp = post(h, "/v1/chat/completions", chat)
    assert resp.status_code == 400 and "roles must alternate" in resp.json()["error"]["message"]


def test_max_model_len_and_generation_config_flags(start_router, tmp_path):
    path = _tiny_copy(tmp_path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 1], "temperature": 0.25}))
    h = start_router(model=str(path), max_model_len=64)
    models = httpx.get(f"{h.url}/v1/models", trust_env=False).json()["data"]
    assert models[0]["max_model_len"] == 64
    resp = post(h, "/v1/completions", {"prompt": [5] * 60, "max_tokens": 8})
    assert resp.status_code == 400 and "64" in resp.json()["error"]["message"]
    prefill = FakePrefill()
    h = start_router(prefills=[prefill], model=str(path))
    post(h, "/v1/completions", {"prompt": [5], "max_tokens": 1})
    assert prefill.jobs[-1].sampling.temperature == pytest.approx(0.25)
    h = start_router(prefills=[prefill], model=str(path), generation_config="none")
    post(h, "/v1/completions", {"prompt": [5], "max_tokens": 1})
    assert prefill.jobs[-1].sampling.temperature == 1.0
    from services.router.server import model_context

    def eos(**kw):
        return model_context(RouterConfig(prefill=("p",), decode=("d",), model=str(path), **kw),
                             Cluster(["p"], ["d"])).eos_token_ids

    assert eos() == (7, 1) and eos(generation_config="none") == (1,)
    with pytest.raises(ValueError, match="max_model_len"):
        start_router(model=str(path), max_model_len=10**9)


# ---- fuzz ------------------------------------------------------------------------------------
def _fuzz_bodies(rng, n: int) -> list[bytes]:
    """Malformed and odd request bodies: mutated valid ones, wrong types, deep nesting, lone
    surrogates, invalid UTF-8, truncations, huge numbers, non-finite constants."""
    values = [None, True, -1, 0, 2**70, 1e308, -0.5, "", "x", "\\ud800", "a\\udfffb", [], {}, [5, 6],
              [[5]], [1, 2**40], ["x", 5], {"type": "text"}, "NaN", "Infinity"]
    fields = ["prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream",
              "stream_options", "n", "logprobs", "model", "stop_token_ids", "ignore_eos", "return_token_ids",
              "max_completion_tokens", "user", "\\ud800"]
    out = [b'{"prompt": ' + b"[" * 5000, b"[" * 100_000 + b"]" * 100_000, b'{"prompt": "\\ud800"}', b"",
           b"\xff\xfe\x00", b"null", b"[]", b'{"prompt": NaN}', b'{"prompt": Infinity, "max_tokens": 1}']
    while len(out) < n:
        kind = rng.random()
        if kind < 0.6:
            body = {"prompt": "hi", "max_tokens": 2} if rng.random() < 0.5 else \
                {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            for _ in range(rng.randint(1, 3)):
                body[rng.choice(fields)] = rng.choice(values)
            raw = json.dumps(body).replace('"NaN"', "NaN").replace('"Infinity"', "Infinity")
            raw = raw.replace('"\\\\ud800"', '"\\ud800"').replace('"a\\\\udfffb"', '"a\\udfffb"').encode()
        elif kind < 0.75:
            depth = rng.choice([10, 63, 65, 900, 3000])
            raw = (b'{"prompt": ' + b"[" * depth + b"5" + b"]" * depth + b"}")
        elif kind < 0.9:
            good = json.dumps({"prompt": "hello", "max_tokens": 3, "stop": ["x"]}).encode()
            raw = good[:rng.randrange(len(good))]
        else:
            raw = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
        out.append(raw)
    return out


@pytest.mark.timeout(300)
def test_fuzzed_bodies_get_4xx_never_5xx_and_the_router_keeps_serving(start_router):
    """1,000 malformed HTTP bodies (four clients at a time) and 300 malformed gRPC messages:
    every answer is a 2xx/4xx (gRPC: not INTERNAL/UNKNOWN) within 5 s, no reset; afterwards the
    router still answers exactly."""
    import random
    import time as _time
    from concurrent.futures import ThreadPoolExecutor

    rng = random.Random(13)
    h = start_router(decodes=[FakeDecode(capacity=4096)])
    bodies = _fuzz_bodies(rng, 1000)

    local = threading.local()  # one keep-alive client per sender (a new client costs ~10 ms)
    clients = []

    def send(item):
        i, raw = item
        if not hasattr(local, "http"):
            local.http = httpx.Client(base_url=h.url, trust_env=False, timeout=10)
            clients.append(local.http)
        t0 = _time.perf_counter()
        resp = local.http.post("/v1/chat/completions" if i % 2 else "/v1/completions", content=raw,
                               headers={"content-type": "application/json"})
        return raw, resp.status_code, resp.text[:300], _time.perf_counter() - t0

    try:
        with ThreadPoolExecutor(4) as pool:
            for raw, status, text, seconds in pool.map(send, enumerate(bodies)):
                assert status < 500 and seconds < 5, (raw[:120], status, text, seconds)
    finally:
        for http in clients:
            http.close()
    with grpc.insecure_channel(f"127.0.0.1:{h.grpc_port}") as ch:
        generate = ch.unary_stream("/cpserve.router.Router/Generate", request_serializer=lambda b: b,
                                   response_deserializer=lambda b: b)
        for _ in range(300):
            raw = bytes(rng.randrange(256) for _ in range(rng.randrange(0, 48)))
            try:
                list(generate(raw, timeout=5))
            except grpc.RpcError as e:
                assert e.code() not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
                                        grpc.StatusCode.DEADLINE_EXCEEDED), (raw, e.code(), e.details())
    r = client(h).completions.create(model=MODEL, prompt="Hello", max_tokens=9, temperature=0)
    assert r.choices[0].text == TEXT[:9] and r.usage.prompt_tokens == 6
