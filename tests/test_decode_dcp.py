"""Decode context parallelism on real rank processes (gloo), against the one-process reference."""

from __future__ import annotations

import math

import pytest
import torch

from engine.cache.capacity import plan_capacity
from engine.cache.slots import token_slots
from engine.decode_engine import DCPDecodeEngine
from engine.model.attention import absorbed_decode, merge_partials
from engine.model.sampler import SamplingParams
from engine.model.tiny import make_tiny
from engine.reference import ReferenceEngine

STEPS = SamplingParams(max_new_tokens=64, stop_token_ids=())
LENGTHS = [70, 3, 45, 1, 130]  # contexts shorter than C, not multiples of C, above index_topk
LATE = 57  # a request that joins while the others decode


def prompts(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (n,), generator=g).tolist() for n in LENGTHS + [LATE]]


def run(engine, ps):
    seqs = [engine.add_request(p, STEPS) for p in ps[:-1]]
    for _ in range(5):
        engine.step()
    seqs.append(engine.add_request(ps[-1], STEPS))
    while engine.has_work:
        engine.step()
    return seqs


# ---- worked examples and the merge itself -----------------------------------------------------
def test_lse_merge_worked_example():
    """Scores 4,2,1,1 (exponentiated); rank 0 holds tokens 0,2, rank 1 tokens 1,3."""
    logits = torch.log(torch.tensor([4.0, 2.0, 1.0, 1.0]))
    values = torch.eye(4)
    parts, lses = [], []
    for toks in ([0, 2], [1, 3]):
        l = logits[toks]
        lses.append(torch.logsumexp(l, 0))
        parts.append(torch.softmax(l, 0) @ values[toks])
    assert torch.allclose(torch.exp(torch.stack(lses)) / 8, torch.tensor([5 / 8, 3 / 8]))
    out, lse = merge_partials(torch.stack(parts), torch.stack(lses))
    assert torch.allclose(out, torch.tensor([0.5, 0.25, 0.125, 0.125]))
    assert math.isclose(float(lse), math.log(8), rel_tol=1e-6)


def test_empty_shard_contributes_zero_not_nan():
    q = torch.randn(1, 2, 8)
    qr = torch.randn(1, 2, 4)
    rows = torch.randn(1, 3, 12)
    q = torch.cat([q, qr], dim=-1)
    out, lse = absorbed_decode(q, rows, torch.tensor([[True, True, True]]), 8, 0.3)
    empty_out, empty_lse = absorbed_decode(q, rows, torch.zeros(1, 3, dtype=torch.bool), 8, 0.3)
    assert torch.isneginf(empty_lse).all() and not torch.isnan(empty_out).any() and (empty_out == 0).all()
    merged, mlse = merge_partials(torch.stack([out, empty_out]), torch.stack([lse, empty_lse]))
    assert torch.equal(merged, out) and torch.equal(mlse, lse)
    none, none_lse = merge_partials(torch.stack([empty_out, empty_out]), torch.stack([empty_lse, empty_lse]))
    assert not torch.isnan(none).any() and torch.isneginf(none_lse).all()


# ---- real groups ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def six_heads(tmp_path_factory):
    return str(make_tiny(tmp_path_factory.mktemp("six") / "glm6", "glm_moe_dsa", num_attention_heads=6,
                         num_key_value_heads=6))


_REFS: dict = {}


def reference(model: str):
    if model not in _REFS:
        _REFS[model] = run(ReferenceEngine(model, record_logits=True), prompts())
    return _REFS[model]


CONFIGS = [  # model, C, exchange, indexer, replicate_q_proj, pipelined (the service's stepping)
    ("tiny", 1, "a2a", "copied", False, True),
    ("tiny", 2, "a2a", "copied", False, False),
    ("tiny", 2, "ag_rs", "split", True, True),
    ("tiny", 4, "a2a", "split", False, False),
    ("tiny-v3", 2, "ag_rs", "copied", False, False),
    ("six", 3, "a2a", "split", False, True),
    ("six", 3, "ag_rs", "copied", True, False),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model,dcp,exchange,indexer,replicate,pipelined", CONFIGS)
def test_dcp_decode_matches_reference(six_heads, model, dcp, exchange, indexer, replicate, pipelined):
    model = six_heads if model == "six" else model
    ref = reference(model)
    with DCPDecodeEngine(model, dcp=dcp, exchange=exchange, indexer=indexer, replicate_q_proj=replicate,
                         record_logits=True, pipelined=pipelined) as eng:
        seqs = run(eng, prompts())
        for ours, theirs in zip(seqs, ref):
            assert ours.output_ids == theirs.output_ids
            assert len(ours.logits) == 64
            for a, b in zip(ours.logits, theirs.logits):
                assert float((a - b).abs().max() / b.abs().max()) < 1e-4
        assert eng.allocator.num_free == eng.allocator.num_pages
        stats = eng.group.call("stats")
        if dcp > 1:
            assert all(s["exchange"] > 0 and s["all_reduce"] > 0 for s in stats)
            assert all((s["q_all_gather"] > 0) != replicate for s in stats)
            assert all((s["index_candidates"] > 0) == (indexer == "split" and model != "tiny-v3") for s in stats)


def test_rows_per_rank_and_capacity_match_the_plan():
    dcp, page = 4, 16
    with DCPDecodeEngine("tiny", dcp=dcp, page_size=page, max_cache_tokens=4096, indexer="copied") as eng:
        cfg = eng.cfg
        n = 1003
        seq = eng.add_request([3 + i % 250 for i in range(n)], SamplingParams(max_new_tokens=1, stop_token_ids=()))
        eng.scheduler._admit()
        slots = token_slots(seq.pages, n, page, dcp)
        counts = [eng.group.call_rank(r, "rows", slots)["rows"].numel() for r in range(dcp)]
        assert sorted(set(counts)) == sorted({n // dcp, -(-n // dcp)}) and sum(counts) == n
        eng.abort(seq)
        assert eng.allocator.num_free == eng.allocator.num_pages
        mem = eng.group.call("memory")
        tokens = eng.scheduler.capacity_tokens
        for indexer in ("copied",):
            plan = plan_capacity(cfg.latent_dim * 4, cfg.num_layers, cfg.index_head_dim * 4, cfg.num_indexer_layers,
                                 dcp, indexer, tokens)
            for m in mem:
                measured = (m["latent_bytes"] + m["index_bytes"]) / tokens
                assert abs(measured / plan.bytes_per_token_per_rank - 1) < 0.01
    # a fixed per-rank budget: tokens that fit ≥ 99% of the formula's
    budget = 64 << 20
    for c in (2, 4):
        for indexer in ("copied", "split"):
            plan = plan_capacity(cfg.latent_dim * 4, cfg.num_layers, cfg.index_head_dim * 4, cfg.num_indexer_layers,
                                 c, indexer, None)
            per_page_rank = page * (cfg.latent_dim * 4 * cfg.num_layers) + (
                page * c if indexer == "copied" else page) * cfg.index_head_dim * 4 * cfg.num_indexer_layers
            pages = budget // per_page_rank
            assert pages * page * c >= 0.99 * budget / plan.bytes_per_token_per_rank


def test_heads_must_divide():
    with pytest.raises(ValueError, match="divide the model's 4 attention heads"):
        DCPDecodeEngine("tiny", dcp=3)


@pytest.mark.timeout(300)
def test_pipelined_steps_hold_the_pages_of_a_request_aborted_mid_step():
    """The service submits the next decode step before it delivers the last one's tokens; a
    request aborted while a step that includes it runs must keep its pages until that step is
    collected (the step still writes its next row), and the other requests' tokens are the
    reference's."""
    ps = prompts()[:3]
    ref = run(ReferenceEngine("tiny"), ps)
    with DCPDecodeEngine("tiny", dcp=2, pipelined=True) as eng:
        seqs = [eng.add_request(p, STEPS) for p in ps]
        while not eng.group.pending or not all(s.output_ids for s in seqs):
            eng.step()
        victim = seqs[1]
        free_before = eng.allocator.num_free
        eng.scheduler.abort(victim)  # between two steps, as a cancelled stream's abort runs
        assert victim.finish_reason == "abort" and victim.pages and eng.allocator.num_free == free_before
        with pytest.raises(RuntimeError, match="submitted and not collected"):
            eng.group.call("stats")  # nothing may reach the ranks between submit and collect
        eng.step()  # collects the step that still wrote the victim's row: now its pages go back
        assert not victim.pages and eng.allocator.num_free > free_before
        while eng.has_work:
            eng.step()
        assert eng.allocator.num_free == eng.allocator.num_pages
    for i in (0, 2):
        assert seqs[i].output_ids == ref[i].output_ids


@pytest.mark.timeout(300)
def test_a_command_between_pipelined_steps_collects_the_step_in_flight_first():
    """A command to the ranks while a step runs (a fork's page copy at commit) first collects
    that step; its tokens are applied at once and delivered by the next step(), none lost."""
    ps = prompts()[:2]
    ref = run(ReferenceEngine("tiny"), ps)
    with DCPDecodeEngine("tiny", dcp=2, pipelined=True) as eng:
        seqs = [eng.add_request(p, STEPS) for p in ps]
        delivered = {s.id: [] for s in seqs}

        def deliver(events):
            for seq, token in events:
                delivered[seq.id].append(token)

        while not eng.group.pending or not all(s.output_ids for s in seqs):
            deliver(eng.step())
        before = [len(s.output_ids) for s in seqs]
        assert len(eng.quiesced("stats")) == 2 and not eng.group.pending
        assert [len(s.output_ids) for s in seqs] == [n + 1 for n in before]
        events = eng.step()
        assert sorted(seq.id for seq, _ in events) == sorted(s.id for s in seqs)
        deliver(events)
        while eng.has_work:
            deliver(eng.step())
    for seq, r in zip(seqs, ref):
        assert seq.output_ids == r.output_ids and delivered[seq.id] == seq.output_ids


def test_slot_sync_sends_each_slot_once_and_rebuilds_the_full_lists():
    """Decode plans carry a request's new slots only; the ranks' end gives back the full lists,
    forgets requests that left, and takes a whole list again when earlier slots changed."""
    from engine.plan import DecodeItem, SlotSync, StepPlan

    def plan(items):
        return StepPlan("decode", [DecodeItem(rid, 7, n - 1, slots, argmax=rid % 2 == 0) for rid, n, slots in items])

    driver, rank = SlotSync(), SlotSync()
    a, b = torch.arange(100, 140), torch.arange(500, 1100)
    for step in range(3):
        full = plan([(1, 30 + step, a[: 30 + step]), (2, 590 + step, b[: 590 + step])])
        wire = driver.wire(full)
        assert [it.slots.numel() for it in wire.items] == ([30, 590] if step == 0 else [1, 1])
        got = rank.expand(wire)
        for x, y in zip(got.items, full.items):
            assert torch.equal(x.slots, y.slots) and (x.req_id, x.position, x.argmax) == (y.req_id, y.position, y.argmax)
    # request 1 leaves; request 2's earlier slots change (a new page table): sent whole again
    moved = torch.arange(2000, 2600)
    wire = driver.wire(plan([(2, 593, moved[:593])]))
    assert wire.items[0].slots_from == 0 and wire.items[0].slots.numel() == 593
    assert torch.equal(rank.expand(wire).items[0].slots, moved[:593]) and set(rank.held) == {2}
    # a rank that has not seen the start of a list refuses the continuation
    with pytest.raises(RuntimeError, match="continues its slots"):
        SlotSync().expand(driver.wire(plan([(2, 594, moved[:594])])))


@pytest.mark.timeout(300)
def test_decode_steps_planned_ahead_give_the_reference_tokens():
    """The pipelined engine plans each decode step before the last one's tokens are known (the
    ranks feed their own argmax: ``FROM_PREVIOUS``), so the ranks never wait for the driver
    between steps. Requests that end at different steps, one that joins mid-run and one that
    samples (its token is drawn by the driver, so no step is planned ahead while it runs) give
    the reference's tokens; steps were planned ahead, and every page comes back."""
    ps = prompts()[:4]
    params = [SamplingParams(max_new_tokens=n, stop_token_ids=()) for n in (5, 17, 40)]
    params.append(SamplingParams(max_new_tokens=12, temperature=0.8, seed=7, stop_token_ids=()))
    ref = [run_alone(ReferenceEngine("tiny"), p, sp) for p, sp in zip(ps, params)]
    with DCPDecodeEngine("tiny", dcp=2, pipelined=True) as eng:
        planned = {"ahead": 0, "after": 0}
        lookahead = eng.scheduler.lookahead_plan

        def counted(step):
            plan = lookahead(step)
            planned["ahead" if plan is not None else "after"] += 1
            return plan

        eng.scheduler.lookahead_plan = counted
        seqs = [eng.add_request(p, sp) for p, sp in zip(ps[:3], params[:3])]
        for _ in range(12):
            eng.step()
        ahead_before = planned["ahead"]
        seqs.append(eng.add_request(ps[3], params[3]))  # samples: the driver draws its tokens
        while eng.has_work:
            eng.step()
        assert eng.allocator.num_free == eng.allocator.num_pages
    assert [s.output_ids for s in seqs] == ref
    assert ahead_before > 0 and planned["ahead"] > ahead_before + 5 and planned["after"] > 5


def run_alone(engine, prompt, params):
    seq = engine.add_request(prompt, params)
    while engine.has_work:
        engine.step()
    return seq.output_ids
