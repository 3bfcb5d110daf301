"""Ring CP prefill (``cp_attention: ring``) end to end: a batch of mixed lengths gets the
reference's greedy tokens, each request's KV hand-off moves each of its rows once (bytes on the
wire = rows × bytes per row, from the services' transfer counters), and the prefill service
counts the ring's traffic on its /metrics.

CP 2 → DCP 2 (copied index) runs as `cpserve up` runs it, each service its own process, so the
flag's path from `up` to the engine is covered; CP 3 → DCP 4 (split index, the ring in pass-Q
mode) runs the two services in this process, which starts in half the time."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from engine.cache.kvformat import KVFormat
from engine.model.config import ModelConfig
from engine.model.tiny import resolve_model_dir
from services.common.config import DecodeConfig, PrefillConfig
from services.decode.server import serve_decode
from services.prefill.server import serve_prefill
from services.up import start_cluster, stop_cluster
from tests.test_cluster_e2e import cluster_args, reference
from tests.test_services import Client, greedy

pytestmark = pytest.mark.slow
MAX_TOKENS = 6
LENGTHS = (3, 40, 130)


def prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (n,), generator=g).tolist() for n in LENGTHS]


def bytes_per_row(dcp: int, indexer: str) -> int:
    """What one token's hand-off moves: its latent entry of every layer, and its index key of
    every indexer layer once per decode rank that keeps it (every rank for a copied index)."""
    cfg = ModelConfig.from_dir(resolve_model_dir("tiny"))
    fmt = KVFormat.of(cfg, "auto", "fp32")  # the tiny model computes and caches in fp32
    return cfg.num_layers * fmt.entry_bytes + cfg.num_indexer_layers * fmt.index_bytes * (
        dcp if indexer == "copied" else 1)


def together(fn, items: list) -> list:
    """``fn`` over ``items`` at once: requests that arrive together are prefilled in one batch."""
    with ThreadPoolExecutor(len(items)) as pool:
        return list(pool.map(fn, items))


@pytest.mark.timeout(240)
def test_ring_cp2_to_dcp2_through_cpserve_up_is_exact_and_moves_each_row_once():
    ps = prompts(22)
    expected = [reference("tiny", p, MAX_TOKENS) for p in ps]
    children = start_cluster(cluster_args(cp_attention="ring"), 0, None, quiet=True)
    try:
        argv = children[0].proc.args  # the prefill service's command line, as `cpserve up` builds it
        assert argv[argv.index("--cp-attention") + 1] == "ring"
        assert "cp=2, interleave, ring attention (auto)" in "".join(children[0].lines)  # its start-up line
        url = f"http://{children[-1].address}"

        def complete(prompt):
            r = httpx.post(f"{url}/v1/completions", trust_env=False, timeout=120, json={
                "model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True})
            assert r.status_code == 200, r.text
            return r.json()

        bodies = together(complete, ps)
        assert [b["choices"][0]["token_ids"] for b in bodies] == expected
        # the router's per-request record of PrefillResponse.transfer_bytes (what the ranks wrote)
        records = httpx.get(f"{url}/debug/ttft", trust_env=False).json()["requests"]
        for body, prompt in zip(bodies, ps):
            (record,) = [r for r in records if r["id"].startswith(body["id"])]
            assert record["decode_cached_tokens"] == 0
            assert record["transfer_bytes"] == len(prompt) * bytes_per_row(2, "copied"), len(prompt)
    finally:
        stop_cluster(children)


@pytest.mark.timeout(240)
def test_ring_cp3_to_dcp4_pass_q_services_are_exact_move_each_row_once_and_count_the_ring():
    ps = prompts(34)
    expected = [reference("tiny", p, MAX_TOKENS) for p in ps]
    pre = dec = client = None
    try:
        dec = serve_decode(DecodeConfig(dcp=4, indexer="split", port=0, max_cache_tokens=4096))
        pre = serve_prefill(PrefillConfig(cp=3, cp_attention="ring", cp_ring_mode="pass_q", port=0,
                                          max_cache_tokens=4096, metrics_port=0))
        client = Client(pre[1], dec[1])
        sampling = greedy(MAX_TOKENS)

        def run(prompt):
            dest = client.reserve(len(prompt), MAX_TOKENS)
            first = client.prefill_to(prompt, dest, sampling)
            tokens = [first.first_token] + [ev.token.id for ev in client.generate(dest, prompt, first, sampling)
                                            if ev.WhichOneof("event") == "token"]
            return tokens, first.transfer_bytes

        got = together(run, ps)
        assert [tokens for tokens, _ in got] == expected
        assert [moved for _, moved in got] == [len(p) * bytes_per_row(4, "split") for p in ps]
        text = httpx.get(f"http://127.0.0.1:{pre[0].metrics_port}/metrics", trust_env=False).text

        def value(name: str) -> float:
            m = re.search(rf"^{name} (\S+)$", text, re.M)
            assert m, f"{name} missing"
            return float(m.group(1))

        assert value("cpserve_prefill_ring_bytes_total") > 0 and value("cpserve_prefill_ring_attend_seconds_total") > 0
        assert value("cpserve_prefill_ring_exposed_seconds_total") >= 0
    finally:
        if client is not None:
            client.close()
        for s in (pre, dec):
            if s is not None:
                s[2]()
