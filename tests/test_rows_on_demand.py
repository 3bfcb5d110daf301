"""Decode rows on demand, end to end (real processes: `cpserve serve prefill|decode|router`): many
requests without max_tokens at once on a decode cache that holds about one of them. Decode
gives each request pages as its tokens come; when none is free it preempts the request that
joined last, whose router resumes it on a fresh reservation (prompt + tokens so far prefilled
again), so no request fails at Reserve, none is cut short, every completed one equals the
reference engine, and every pool's free rows come back."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from engine.model.sampler import SamplingParams
from engine.reference import ReferenceEngine
from services.up import Child, stop_cluster
from tests.test_lifecycle_stress import free_rows, settle

pytestmark = pytest.mark.slow
MODEL = "tiny"
CACHE = 128  # decode tokens: 4 pages of 32 (page 16 x DCP 2); the context limit is this too


@pytest.fixture(scope="module")
def cluster():
    children: list[Child] = []
    try:
        common = ["--model", MODEL, "--threads-per-rank", "1"]
        children.append(Child("prefill", [*common, "--cp", "2"], quiet=True))
        children.append(Child("decode", [*common, "--dcp", "2", "--max-cache-tokens", str(CACHE)], quiet=True))
        prefill, decode = (c.wait_ready(120) for c in children)
        children.append(Child("router", ["--model", MODEL, "--port", "0", "--prefill", prefill, "--decode", decode,
                                        "--max-wait-s", "600"],
                              quiet=True))
        children[-1].wait_ready(120)
        yield children
    finally:
        stop_cluster(children)


def stream(url: str, body: dict) -> dict[int, tuple[list[int], str]]:
    """A streamed completion: per choice, its token ids and finish reason."""
    out: dict[int, tuple[list[int], str]] = {}
    with httpx.Client(trust_env=False, timeout=600) as client, client.stream("POST", url, json=body) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for c in chunk["choices"]:
                ids, reason = out.get(c["index"], ([], None))
                out[c["index"]] = (ids + (c.get("token_ids") or []), c["finish_reason"] or reason)
    return out


@pytest.mark.timeout(600)
def test_requests_without_max_tokens_overflow_the_cache_and_stay_exact(cluster):
    router = cluster[-1].address
    models = httpx.get(f"http://{router}/v1/models", trust_env=False).json()
    assert models["data"][0]["max_model_len"] == CACHE  # the smallest decode cache sets the context limit
    g = torch.Generator().manual_seed(21)
    lengths = [16, 40, 33, 25, 9]
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in lengths]
    # greedy: two to the context limit (ignore_eos), two to EOS or the limit; the last: two
    # seeded samples (forks of one prefill)
    greedy = len(prompts) - 1
    bodies = [{"model": MODEL, "prompt": p, "stream": True, "return_token_ids": True, "temperature": 0,
               "ignore_eos": i < 2} for i, p in enumerate(prompts[:greedy])]
    bodies.append({"model": MODEL, "prompt": prompts[-1], "stream": True, "return_token_ids": True,
                   "temperature": 0.9, "seed": 100, "n": 2})
    start_rows = free_rows(cluster)
    url = f"http://{router}/v1/completions"
    with ThreadPoolExecutor(len(bodies)) as pool:
        results = list(pool.map(lambda b: stream(url, b), bodies))

    ref = ReferenceEngine(MODEL)
    jobs = [(p, SamplingParams(max_new_tokens=CACHE - len(p), stop_token_ids=() if b["ignore_eos"] else None))
            for p, b in zip(prompts, bodies[:greedy])]
    jobs += [(prompts[-1], SamplingParams(max_new_tokens=CACHE - lengths[-1], temperature=0.9, seed=100 + j))
             for j in range(2)]
    want = [s.output_ids for s in ref.generate([p for p, _ in jobs], [sp for _, sp in jobs])]
    got = [r[0] for r in results[:greedy]] + [results[-1][j] for j in range(2)]
    for k, ((ids, reason), expected) in enumerate(zip(got, want)):
        assert ids == expected, f"request {k}: {len(ids)} tokens vs {len(expected)}"
        stopped = expected[-1] in ref.cfg.eos_token_ids and len(expected) < jobs[k][1].max_new_tokens
        assert reason == ("stop" if stopped else "length")
    assert [len(ids) for ids, _ in got[:2]] == [CACHE - n for n in lengths[:2]]  # to the context limit
    metrics = httpx.get(f"http://{router}/metrics", trust_env=False).text
    preempted = float(re.search(r'^cpserve:num_preemptions_total\{[^}]*\} (\S+)', metrics, re.M).group(1))
    assert preempted > 0, "the cache never ran out: the test did not exercise preemption"
    assert f'cpserve_router_requests_total{{status="ok"}} {len(got)}.0' in metrics
    assert settle(cluster, start_rows) == start_rows
