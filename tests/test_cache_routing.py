"""Cache-aware pairing over real services: two prefill and two decode services behind one router,
conversations interleaved turn by turn. Each turn should land where its prefix is cached (on
both sides), the load should still spread over both prefill services, and every output must
equal the reference engine's."""

from __future__ import annotations

import re

import httpx
import pytest
import torch

from engine.model.sampler import SamplingParams
from engine.reference import ReferenceEngine
from services.common.config import DecodeConfig, PrefillConfig, RouterConfig
from services.decode.server import serve_decode
from services.prefill.server import serve_prefill
from services.router.server import serve_router

MAX_NEW = 8
CONVERSATIONS, TURNS = 8, 5
FIRST, NEW = 93, 40  # tokens of the first prompt, and tokens each later turn adds after the answer


def _metric(url: str, name: str) -> float:
    text = httpx.get(url, trust_env=False, timeout=10).text
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    assert m, f"{name} missing from {url}"
    return float(m.group(1))


@pytest.fixture(scope="module")
def two_by_two():
    started = []
    try:
        decodes = [serve_decode(DecodeConfig(dcp=1, max_cache_tokens=8192)) for _ in range(2)]
        started += decodes
        prefills = [serve_prefill(PrefillConfig(cp=1, max_cache_tokens=8192, metrics_port=0)) for _ in range(2)]
        started += prefills
        router = serve_router(RouterConfig(prefill=tuple(f"127.0.0.1:{p[1]}" for p in prefills),
                                           decode=tuple(f"127.0.0.1:{d[1]}" for d in decodes),
                                           grpc_port=None, health_interval_s=0.5))
        yield router, [f"http://127.0.0.1:{p[0].metrics_port}/metrics" for p in prefills]
        router.shutdown()
    finally:
        for s in started:
            s[2]()


@pytest.mark.timeout(300)
def test_interleaved_conversations_follow_their_cache_and_share_the_load(two_by_two):
    router, prefill_metrics = two_by_two
    ref = ReferenceEngine("tiny")
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 300, (FIRST,), generator=g).tolist() for _ in range(CONVERSATIONS)]
    reusable = reused = 0
    decode_reusable = decode_reused = 0
    with httpx.Client(base_url=router.url, trust_env=False, timeout=60) as http:
        for k in range(TURNS):
            for i in range(CONVERSATIONS):
                prompt = prompts[i]
                r = http.post("/v1/completions", json={
                    "model": "tiny", "prompt": prompt, "max_tokens": MAX_NEW, "temperature": 0,
                    "ignore_eos": True, "return_token_ids": True})
                assert r.status_code == 200, r.text
                body = r.json()
                answer = body["choices"][0]["token_ids"]
                assert answer == ref.generate([prompt], SamplingParams(max_new_tokens=MAX_NEW, stop_token_ids=()))[0] \
                    .output_ids, (k, i)
                if k:
                    before = len(prompt) - NEW - MAX_NEW  # the previous turn's prompt
                    reusable += before // 16 * 16
                    reused += body["usage"]["prompt_tokens_details"]["cached_tokens"]
                    decode_reusable += (before + MAX_NEW - 1) // 16 * 16
                    entry = [e for e in http.get("/debug/ttft").json()["requests"] if e["id"].startswith(body["id"])]
                    decode_reused += entry[-1]["decode_cached_tokens"]
                prompts[i] = prompt + answer + torch.randint(3, 300, (NEW,), generator=g).tolist()
    assert reused >= 0.9 * reusable, (reused, reusable)
    assert decode_reused >= 0.9 * decode_reusable, (decode_reused, decode_reusable)
    served = [_metric(url, "cpserve_prefill_requests_total") for url in prefill_metrics]
    assert sum(served) == CONVERSATIONS * TURNS
    assert all(0.3 <= s / sum(served) <= 0.7 for s in served), served
