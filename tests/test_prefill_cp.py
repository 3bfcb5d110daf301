"""Prefill context parallelism on real rank processes (gloo), against the one-process reference."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from engine.cache.slots import token_slots
from engine.model.sampler import SamplingParams
from engine.parallel.group import GroupError
from engine.prefill_engine import CPPrefillEngine
from engine.reference import ReferenceEngine

FIRST = SamplingParams(max_new_tokens=1, stop_token_ids=())
LENGTHS = [70, 3, 45, 1, 130, 2]  # below C, not multiples of C or 2C, above index_topk (32)


def prompts(lengths=LENGTHS, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (n,), generator=g).tolist() for n in lengths]


def close(a: torch.Tensor, b: torch.Tensor, rel: float = 1e-5) -> bool:
    """Equal up to fp32 rounding: matmuls over a different set of tokens round differently."""
    return a.shape == b.shape and float((a - b).abs().max()) <= rel * float(b.abs().max())


def run_capturing_pages(engine, ps):
    seqs = [engine.add_request(p, FIRST) for p in ps]
    engine.scheduler._admit()
    pages = {s.id: list(s.pages) for s in seqs}
    while engine.has_work:
        engine.step()
    return seqs, pages


@pytest.fixture(scope="module")
def reference():
    eng = ReferenceEngine("tiny", record_logits=True, trace=True)
    seqs, pages = run_capturing_pages(eng, prompts())
    trace = eng.runner.trace
    return eng, seqs, pages, trace


CONFIGS = [(1, "interleave", False), (2, "interleave", False), (2, "zigzag", False), (2, "interleave", True),
           (3, "zigzag", False), (3, "interleave", True), (4, "zigzag", False),
           (4, "interleave", True)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("cp,strategy,layer_split", CONFIGS)
def test_cp_prefill_matches_reference(reference, cp, strategy, layer_split):
    ref, ref_seqs, ref_pages, ref_trace = reference
    with CPPrefillEngine("tiny", cp=cp, strategy=strategy, layer_split=layer_split, record_logits=True,
                         trace=True) as eng:
        # one unchunked batch: logits, cache entries, DSA selections
        seqs, pages = run_capturing_pages(eng, prompts())
        for a, b in zip(seqs, ref_seqs):
            assert a.output_ids == b.output_ids
            rel = float((a.logits[0] - b.logits[0]).abs().max() / b.logits[0].abs().max())
            assert rel < 1e-5
        traces = eng.group.call("last_trace")
        for s, rs in zip(seqs, ref_seqs):
            n = len(s.prompt_ids)
            slots = token_slots(pages[s.id], n, eng.scheduler.page_size, 1)
            ref_slots = token_slots(ref_pages[rs.id], n, ref.scheduler.page_size, 1)
            owners = set()
            for r in range(cp):
                dump = eng.group.call_rank(r, "dump", slots)
                for layer, rows in dump["latent"].items():
                    assert close(rows, ref.pool.latent(layer)[ref_slots]), (r, layer)
                    owners.add(layer)
                for layer, rows in dump["index"].items():
                    assert close(rows, ref.pool.index(layer)[ref_slots]), (r, layer)
            assert owners == set(range(ref.cfg.num_layers))
        for r, trace in enumerate(traces):
            for layer, per_req in trace.items():
                for i, (q_pos, mask) in enumerate(per_req):
                    ref_pos, ref_mask = ref_trace[layer][i]
                    assert torch.equal(mask, ref_mask[q_pos]), (r, layer, i)
        # chunked (later chunks read a cached prefix) and batched: same first tokens
        eng.scheduler.chunk_size = 17
        chunked = eng.generate(prompts(), FIRST)
        assert [s.output_ids for s in chunked] == [s.output_ids for s in ref_seqs]
        for a, b in zip(chunked, ref_seqs):
            assert float((a.logits[0] - b.logits[0]).abs().max() / b.logits[0].abs().max()) < 1e-5
        # layer split: persistent cache ≤ ceil(L/C) layers + one scratch layer
        if layer_split:
            cfg = ref.cfg
            rows = ref.pool.num_rows
            per_layer = rows * (cfg.latent_dim + cfg.index_head_dim) * 4
            bound = (-(-cfg.num_layers // cp) + 1) * per_layer
            for c in eng.group.call("cache_bytes"):
                assert c["persistent"] + c["scratch"] <= bound
        assert eng.allocator.num_free == eng.allocator.num_pages


@pytest.mark.timeout(300)
@pytest.mark.parametrize("cp,strategy,mode", [(2, "interleave", "pass_kv"), (2, "zigzag", "pass_q"),
                                              (3, "interleave", "pass_q"), (3, "zigzag", "pass_kv")])
def test_ring_prefill_matches_reference(reference, cp, strategy, mode):
    """--cp-attention ring (every row on one rank only: position p on rank p mod C), pass-KV
    and pass-Q, queries striped (interleave) or zigzag (entries sent to the rank that stores
    them): the reference's tokens, logits, cache entries and DSA selections, in one batch and
    chunked (each later chunk reads a cached prefix spread over the ranks)."""
    ref, ref_seqs, ref_pages, ref_trace = reference
    with CPPrefillEngine("tiny", cp=cp, strategy=strategy, cp_attention="ring", cp_ring_mode=mode,
                         record_logits=True, trace=True) as eng:
        seqs, pages = run_capturing_pages(eng, prompts())
        for a, b in zip(seqs, ref_seqs):
            assert a.output_ids == b.output_ids
            assert float((a.logits[0] - b.logits[0]).abs().max() / b.logits[0].abs().max()) < 1e-5
        for s, rs in zip(seqs, ref_seqs):
            n = len(s.prompt_ids)
            slots = token_slots(pages[s.id], n, eng.scheduler.page_size, cp)  # the DCP numbering
            ref_slots = token_slots(ref_pages[rs.id], n, ref.scheduler.page_size, 1)
            holders = torch.zeros(n, dtype=torch.long)
            for r in range(cp):
                dump = eng.group.call_rank(r, "dump", slots)
                held = dump["held"]  # positions this rank holds: p mod C == r, no other
                assert torch.equal(held, torch.arange(r, max(r, n), cp))
                holders[held] += 1
                if not held.numel():
                    continue
                for layer, rows in dump["latent"].items():
                    assert close(rows, ref.pool.latent(layer)[ref_slots[held]]), (r, layer)
                for layer, rows in dump["index"].items():
                    assert close(rows, ref.pool.index(layer)[ref_slots[held]]), (r, layer)
            assert torch.all(holders == 1)
        for r, trace in enumerate(eng.group.call("last_trace")):
            for layer, per_req in trace.items():
                for i, (q_pos, mask) in enumerate(per_req):
                    assert torch.equal(mask, ref_trace[layer][i][1][q_pos]), (r, layer, i)
        stats = eng.group.call("stats")
        assert all(st["ring_steps"] > 0 and st["ring_bytes"] > 0 and st["gathered_bytes"] == 0 for st in stats)
        assert all((st["ring_route_bytes"] > 0) == (strategy == "zigzag") for st in stats)
        assert set(eng.runner.modes) == {mode}
        eng.scheduler.chunk_size = 17
        chunked = eng.generate(prompts(), FIRST)
        assert [s.output_ids for s in chunked] == [s.output_ids for s in ref_seqs]
        for a, b in zip(chunked, ref_seqs):
            assert float((a.logits[0] - b.logits[0]).abs().max() / b.logits[0].abs().max()) < 1e-5
        assert eng.allocator.num_free == eng.allocator.num_pages


@pytest.mark.timeout(120)
def test_ring_serves_a_prompt_one_ranks_pool_cannot_hold():
    """Equal pools per rank (128 rows): the all-gather design keeps every row on every rank and
    refuses a 200-token prompt; the ring keeps 1/2 per rank and serves it exactly, each rank
    holding ⌈N/C⌉ rows (within a page) of every layer — counted from its pool's resident memory."""
    prompt = prompts([200], seed=4)[0]
    ref = ReferenceEngine("tiny", record_logits=True).generate([prompt], FIRST)[0]
    with CPPrefillEngine("tiny", cp=2, max_cache_tokens=128) as eng:
        with pytest.raises(ValueError, match="cache holds 128"):
            eng.generate([prompt], FIRST)
        allgather_rows = eng.group.call("cache_bytes")[0]["rows"]
    with CPPrefillEngine("tiny", cp=2, cp_attention="ring", max_cache_tokens=256, record_logits=True) as eng:
        caches = eng.group.call("cache_bytes")
        assert [c["rows"] for c in caches] == [allgather_rows] * 2
        assert eng.ring_costs is not None  # auto: the selector's constants were measured at start
        seq = eng.generate([prompt], FIRST)[0]
        assert seq.output_ids == ref.output_ids
        assert sum(eng.runner.modes.values()) == 1  # one forward, one choice
        assert float((seq.logits[0] - ref.logits[0]).abs().max() / ref.logits[0].abs().max()) < 1e-5
        cfg, page = eng.cfg, eng.scheduler.page_size
        row_bytes = cfg.num_layers * cfg.latent_dim * 4 + len(cfg.indexer_layer_ids) * cfg.index_head_dim * 4
        for c in eng.group.call("cache_bytes"):  # the pages the prompt's rows were written to
            assert 0 < c["resident"] <= (-(-200 // 2) + page) * row_bytes + 2 * 4096 * cfg.num_layers


@pytest.mark.timeout(120)
def test_ring_prefix_cache_reuses_sharded_pages():
    """The prefix cache over the ring's pages (page_size · C tokens, each rank holding its 1/C of
    them): a second prompt sharing 100 tokens finds the whole pages among them cached and gives
    the reference's token."""
    head = prompts([100], seed=5)[0]
    second = head + prompts([30], seed=6)[0]
    ref = ReferenceEngine("tiny").generate([head + [7, 8], second], FIRST)
    with CPPrefillEngine("tiny", cp=2, cp_attention="ring", prefix_cache=True) as eng:
        first = eng.generate([head + [7, 8]], FIRST)[0]
        again = eng.generate([second], FIRST)[0]
        assert [first.output_ids, again.output_ids] == [s.output_ids for s in ref]
        span = eng.scheduler.page_size * 2
        assert again.num_cached == 100 // span * span > 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.timeout(120)
def test_killing_a_rank_mid_prefill_fails_fast():
    eng = CPPrefillEngine("tiny", cp=3, strategy="zigzag", chunk_size=256)
    pids = eng.group.pids
    long_prompt = prompts([6000], seed=9)[0]
    killer = threading.Timer(1.0, lambda: os.kill(pids[1], signal.SIGKILL))
    killer.start()
    t0 = time.monotonic()
    with pytest.raises(GroupError, match="rank 1") as e:
        eng.generate([long_prompt], FIRST)
    assert time.monotonic() - t0 < 10 + 1.0
    assert e.value.rank == 1
    eng.close()
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids)


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="layer_split"):
        CPPrefillEngine("tiny", cp=2, strategy="zigzag", layer_split=True)
    with pytest.raises(ValueError, match="strategy"):
        CPPrefillEngine("tiny", cp=2, strategy="contiguous")
