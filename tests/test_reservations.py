"""Decode rows on demand (engine/scheduler.py) and reservations with forks (engine/reservations.py),
without model or processes: page accounting, preemption order, copy-on-write of a fork's
partial page, per-fork aborts, leases, and no leaked page whatever the order of events."""

from __future__ import annotations

import random
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.cache.slots import pages_needed, token_slots
from engine.handoff import BadReservation, NoCapacity, ReservationError
from engine.model.config import ModelConfig
from engine.model.sampler import SamplingParams
from engine.model.tiny import resolve_model_dir
from engine.reservations import ReservationTable
from engine.scheduler import Scheduler

CFG = ModelConfig.from_dir(resolve_model_dir("tiny"))
PAGE, C = 2, 2  # a virtual page spans 4 slots (2 rows on each of 2 ranks)
SPAN = PAGE * C


def table(num_pages: int, copies: list | None = None) -> ReservationTable:
    sched = Scheduler(CFG, num_pages, PAGE, chunk_size=64, group_size=C)
    return ReservationTable(sched, lease_s=30, write_timeout_s=60,
                            copy_slots=lambda src, dst: (copies if copies is not None else []).append((src, dst)))


def params(max_new: int, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new, stop_token_ids=(), **kw)


def written(t: ReservationTable, num_tokens: int, max_new: int, forks: int = 1):
    r = t.reserve(num_tokens, max_new, forks)
    t.begin_write(r.id)
    t.end_write(r.id)
    return r


def step(sched: Scheduler) -> list:
    """One decode step with constant logits (greedy: token 0 for everyone)."""
    plan = sched.next_plan()
    if plan is None:
        return []
    return sched.apply({it.req_id: torch.zeros(CFG.vocab_size) for it in plan.items})


def test_reserve_takes_the_prompts_pages_and_decode_adds_them_as_tokens_come():
    t = table(16)
    r = written(t, 5, 20)  # 5 tokens: 2 pages of 4, not the 25 tokens' 7
    assert t.scheduler.allocator.num_allocated == 2 and r.slots.numel() == 5
    seq = t.commit(r.id, list(range(5)), params(20), 0, first_token=9)
    assert seq.pages == r.shared + r.tails[:1] and not t.active
    for _ in range(6):
        step(t.scheduler)
        # a page more only when a token needs it: after a step, positions 0 .. len - 2 are stored
        # (the token just sampled is stored by the next step)
        assert len(seq.pages) == pages_needed(len(seq.all_ids) - 1, PAGE, C)
    assert t.scheduler.allocator.num_allocated == len(seq.pages) == 3
    while not seq.is_finished:
        step(t.scheduler)
    assert seq.finish_reason == "length" and t.scheduler.allocator.num_free == 16


def test_when_pages_run_out_the_request_that_joined_last_is_preempted():
    t = table(8)
    a, b, c = (t.commit(written(t, 4, 20).id, [3 + i] * 4, params(20), 0, 9) for i in range(3))  # a page each
    held = t.reserve(3, 5)  # an uncommitted prompt's page: reservations are never preempted
    with pytest.raises(NoCapacity):
        t.reserve(3, 5)  # 1 page + 4 of headroom (3 running + itself) > the 4 free
    order = []
    step(t.scheduler)  # each takes its 2nd page (position 4): 1 free page left
    assert t.scheduler.allocator.num_free == 1 and not t.scheduler.take_preempted()
    while not a.is_finished:
        step(t.scheduler)
        order += t.scheduler.take_preempted()
    assert order == [c, b] and [s.finish_reason for s in (b, c)] == ["preempted"] * 2
    assert a.finish_reason == "length" and len(a.output_ids) == 20  # the first one is never the victim
    assert len(b.output_ids) > len(c.output_ids) > 1 and not b.pages and not c.pages
    t.abort(held.id)
    assert t.scheduler.allocator.num_free == 8


def test_reserve_leaves_a_page_for_each_running_request_and_itself():
    t = table(8)
    t.commit(written(t, 4, 8).id, [3] * 4, params(8), 0, 9)
    t.commit(written(t, 4, 8).id, [3] * 4, params(8), 0, 9)
    assert t.headroom_pages(4) == 3  # two running, one for the new request
    with pytest.raises(NoCapacity):
        t.reserve(13, 2)  # 4 pages + 3 free afterwards: 7 > the 6 free
    assert t.reserve(9, 2)  # 3 pages + 3: fits
    # a prompt that needs the whole cache gets it once the cache is otherwise empty
    assert table(8).reserve(32, 0).tails == [] and table(8).headroom_pages(8) == 0
    with pytest.raises(BadReservation, match="num_tokens"):
        table(8).reserve(30, 3)  # 33 tokens can never fit 32 slots


def test_forks_share_the_prompts_full_pages_and_copy_its_partial_one():
    copies: list = []
    t = table(16, copies)
    r = written(t, 9, 6, forks=3)  # 2 full pages (8 tokens) shared + 1 partial page per fork
    assert len(r.shared) == 2 and len(r.tails) == 3 and t.scheduler.allocator.num_allocated == 5
    seqs = [t.commit(r.id, list(range(9)), params(6), 7 + j, 9, fork=j) for j in (0, 2, 1)]
    assert not t.active  # every fork committed: the reservation's holds are gone
    assert [s.pages[:2] for s in seqs] == [r.shared] * 3 and len({s.pages[2] for s in seqs}) == 3
    assert all(t.scheduler.allocator.holders(p) == 3 for p in r.shared)
    # fork 2 and 1 got their copy of the prompt's 9th token (position 8), same position in their page
    assert len(copies) == 2
    for (src, dst), seq in zip(copies, seqs[1:]):
        assert src.tolist() == r.slots[8:].tolist()
        assert dst.tolist() == token_slots(seq.pages, 9, PAGE, C)[8:].tolist()
    for seq in seqs:
        t.scheduler.finish(seq, "abort")
    assert t.scheduler.allocator.num_free == 16


def test_forks_of_a_prompt_filling_whole_pages_copy_nothing():
    copies: list = []
    t = table(16, copies)
    r = written(t, 8, 6, forks=2)
    assert r.tails == [] and t.scheduler.allocator.num_allocated == 2
    a, b = (t.commit(r.id, list(range(8)), params(6), 1, 9, fork=j) for j in (0, 1))
    assert a.pages == b.pages == r.shared and not copies
    step(t.scheduler)  # the first generated token needs a page of its own, each
    assert a.pages[:2] == b.pages[:2] and a.pages[2] != b.pages[2]
    for seq in (a, b):
        t.scheduler.finish(seq, "stop")
    assert t.scheduler.allocator.num_free == 16


def test_a_fork_aborted_or_committed_twice_is_refused_and_the_rest_still_commit():
    t = table(16)
    r = written(t, 9, 6, forks=3)
    assert t.abort(r.id, fork=0)  # fork 0 (whose page the others copy) goes first: its page stays
    assert not t.abort(r.id, fork=0)
    with pytest.raises(BadReservation, match="already committed or aborted"):
        t.commit(r.id, list(range(9)), params(6), 1, 9, fork=0)
    with pytest.raises(BadReservation, match="not one of its 3 forks"):
        t.commit(r.id, list(range(9)), params(6), 1, 9, fork=5)
    one = t.commit(r.id, list(range(9)), params(6), 1, 9, fork=1)
    assert r.id in t.active and t.scheduler.allocator.holders(r.tails[0]) == 1  # kept for fork 2's copy
    assert t.abort(r.id)  # the rest of it: fork 2
    assert not t.active and t.scheduler.allocator.num_allocated == 3  # fork 1's pages only
    t.scheduler.finish(one, "stop")
    assert t.scheduler.allocator.num_free == 16


def test_a_lapsed_lease_frees_the_forks_that_never_committed_not_the_running_ones():
    t = table(16)
    r = written(t, 9, 6, forks=2)
    seq = t.commit(r.id, list(range(9)), params(6), 1, 9, fork=0)
    r.deadline = time.monotonic() - 1
    assert t.expire() == [r.id]
    assert t.scheduler.allocator.num_allocated == 3 and seq.pages  # fork 0 keeps its three
    with pytest.raises(ReservationError, match="unknown or expired"):
        t.commit(r.id, list(range(9)), params(6), 1, 9, fork=1)
    t.scheduler.finish(seq, "stop")
    assert t.scheduler.allocator.num_free == 16


def test_aborting_every_fork_while_writing_quarantines_until_the_writer_stops():
    t = table(16)
    r = t.reserve(9, 6, 2)
    t.begin_write(r.id)
    assert t.abort(r.id, fork=1) and r.state == "writing"  # one fork left: nothing happens yet
    assert t.abort(r.id, fork=0) and r.state == "aborting"
    assert t.scheduler.allocator.num_free == 16 - 4
    assert t.end_write(r.id) and t.scheduler.allocator.num_free == 16


def test_a_resumed_generation_commits_with_its_earlier_output():
    t = table(16)
    r = written(t, 7, 10)  # 5 prompt tokens + 2 generated before a preemption
    seq = t.commit(r.id, [3] * 5, params(10), 4, first_token=11, output_ids=[8, 9])
    assert seq.output_ids == [8, 9, 11] and seq.num_computed == 7
    with pytest.raises(BadReservation, match="7"):
        t.commit(written(t, 7, 10).id, [3] * 5, params(10), 4, 11)  # 5 tokens for a 7-token reservation


def test_fork_j_draws_its_first_token_with_seed_plus_j():
    """The prefill scheduler samples forks 1.. from the prompt's logits with seed + j: the same
    token a request of its own with that seed draws."""
    logits = torch.randn(CFG.vocab_size, generator=torch.Generator().manual_seed(0)) * 0.1
    p = params(4, temperature=1.0, seed=5, logprobs=2)

    def first(seed: int, forks: int = 1):
        sched = Scheduler(CFG, 8, 16, 64)
        seq = sched.add([3, 4, 5], SamplingParams(**{**p.__dict__, "seed": seed}), num_forks=forks)
        sched.apply({it.req_id: logits for it in sched.next_plan().items})
        return seq

    seq = first(5, forks=4)
    alone = [first(5 + j) for j in range(1, 4)]
    assert [(tok, seed) for tok, seed, _ in seq.fork_starts] == [(s.output_ids[0], 5 + j) for j, s in
                                                                 enumerate(alone, 1)]
    assert [lp for _, _, lp in seq.fork_starts] == [s.logprobs[0] for s in alone]
    assert len({tok for tok, _, _ in seq.fork_starts} | {seq.output_ids[0]}) > 1  # they do differ


events = st.lists(st.tuples(st.sampled_from(["reserve", "commit", "abort", "step", "cancel"]),
                            st.integers(1, 30), st.integers(1, 4)), max_size=80)


@settings(max_examples=60, deadline=None)
@given(num_pages=st.integers(4, 24), ops=events, seed=st.integers(0, 1000))
def test_no_page_leaks_and_no_two_requests_share_a_written_row(num_pages, ops, seed):
    """Random reserves (with forks), commits, aborts, decode steps and cancellations: pages held
    always equal what the live requests and reservations hold; running requests never write the
    same slot (forks share only the prompt's full pages, which nobody writes); every page
    comes back at the end."""
    rng = random.Random(seed)
    t = table(num_pages)
    sched, alloc = t.scheduler, t.scheduler.allocator
    for op, n, forks in ops:
        if op == "reserve":
            try:
                written(t, n, rng.randint(1, 40), forks)
            except (NoCapacity, BadReservation):
                pass
        elif op in ("commit", "abort") and t.active:
            r = rng.choice(list(t.active.values()))
            fork = rng.choice(sorted(r.waiting))
            if op == "commit":
                t.commit(r.id, [3] * r.num_tokens, params(40), 0, 9, fork=fork)
            else:
                t.abort(r.id, fork if rng.random() < 0.7 else None)
        elif op == "step":
            for _ in range(n):
                step(sched)
            sched.take_preempted()
        elif op == "cancel" and sched.running:
            sched.abort(rng.choice(sched.running))
        holders: dict[int, int] = {}
        for pages in [s.pages for s in sched.running] + [r.prompt_pages + [p for p in r.tails[1:] if p is not None]
                                                          for r in t.active.values()]:
            for p in pages:
                holders[p] = holders.get(p, 0) + 1
        assert holders == {p: alloc.holders(p) for p in holders} and alloc.num_allocated == len(holders)
        written_slots = [set(token_slots(s.pages, len(s.all_ids) - 1, PAGE, C)[s.shared_tokens:].tolist())
                         for s in sched.running]
        assert sum(map(len, written_slots)) == len(set().union(*written_slots))
    for r in list(t.active.values()):
        t.abort(r.id)
    for s in list(sched.running):
        sched.abort(s)
    assert alloc.num_free == num_pages


# ---- cached rows: a finished request's prompt and output pages, found again by Reserve ---------
CPAGE = 8  # with C = 2 a virtual page spans 16 tokens: one content-key block


def cached_table(num_pages: int) -> ReservationTable:
    sched = Scheduler(CFG, num_pages, CPAGE, chunk_size=64, group_size=C, prefix_cache=True)
    return ReservationTable(sched, lease_s=30, write_timeout_s=60, copy_slots=lambda src, dst: None)


def run_to_end(t: ReservationTable, tokens: list[int], max_new: int, salt: str = ""):
    r = t.reserve(len(tokens), max_new, tokens=tokens, cache_salt=salt)
    t.begin_write(r.id)
    t.end_write(r.id)
    seq = t.commit(r.id, tokens, params(max_new), 0, first_token=5)
    while not seq.is_finished:
        step(t.scheduler)
    return r, seq


def test_a_finished_turn_is_found_again_with_its_output_and_never_rewritten():
    t = cached_table(16)
    turn1 = list(range(3, 43))  # 40 tokens
    r1, seq1 = run_to_end(t, turn1, 12)
    assert r1.prefix_tokens == 0
    # prompt + every output token but the last has its KV: 40 + 11 = 51 tokens → 3 full pages kept
    assert t.scheduler.prefix.num_cached_pages == 3
    turn2 = seq1.all_ids + list(range(100, 120))
    r2 = t.reserve(len(turn2), 8, tokens=turn2)
    assert r2.prefix_tokens == 48  # the prompt's and the answer's rows, page-aligned
    assert r2.shared[:3] == list(t.scheduler.prefix.entry)[:3] or set(r2.shared[:3]) <= set(t.scheduler.prefix.entry)
    t.begin_write(r2.id)
    t.end_write(r2.id)
    with pytest.raises(BadReservation, match="prompt"):  # a Generate with other tokens than reserved
        t.commit(r2.id, [7] * len(turn2), params(8), 0, first_token=5)
    seq2 = t.commit(r2.id, turn2, params(8), 0, first_token=5)
    cached_slots = set(token_slots(seq2.pages, 48, CPAGE, C).tolist())
    while not seq2.is_finished:
        plan = t.scheduler.next_plan()
        assert not {int(s) for it in plan.items for s in it.slots[it.position:it.position + 1]} & cached_slots
        t.scheduler.apply({it.req_id: torch.zeros(CFG.vocab_size) for it in plan.items})
    assert t.reserve(len(turn2), 8, tokens=turn2, cache_salt="other").prefix_tokens == 0  # salts never share


def test_idle_cached_pages_never_block_a_reservation_or_force_a_preemption():
    t = cached_table(8)
    run_to_end(t, list(range(3, 3 + 16 * 5)), 4)  # leaves 5 idle cached pages
    assert t.scheduler.prefix.num_reclaimable == 5
    r = t.reserve(16 * 6, 4, tokens=list(range(500, 500 + 16 * 6)))  # needs 6 of 8 pages + headroom
    t.begin_write(r.id)
    t.end_write(r.id)
    seq = t.commit(r.id, list(range(500, 500 + 16 * 6)), params(30), 0, first_token=5)
    for _ in range(29):
        step(t.scheduler)
    assert not t.scheduler.take_preempted() and seq.is_finished


@settings(max_examples=60, deadline=None)
@given(num_pages=st.integers(6, 20), ops=events, seed=st.integers(0, 1000))
def test_cached_pages_are_conserved_and_never_written(num_pages, ops, seed):
    """The page property test above with the prefix cache on and conversations that grow (so
    reservations hit): every allocator hold is a live request's, a reservation's, or the cache's
    one; a cached page's references are exactly the live holders using it; no running request
    writes a slot of a cached page; everything comes back at the end."""
    rng = random.Random(seed)
    t = cached_table(num_pages)
    sched, alloc, cache = t.scheduler, t.scheduler.allocator, t.scheduler.prefix
    history: list[list[int]] = [[]]  # finished requests' tokens: later prompts continue them
    live = []
    for op, n, forks in ops:
        history += [s.all_ids for s in live if s.is_finished]
        live = [s for s in live if not s.is_finished]
        if op == "reserve":
            base = rng.choice(history)
            tokens = base + [rng.randint(3, 6) for _ in range(n)]
            try:
                r = t.reserve(len(tokens), 40, forks, tokens=tokens, cache_salt=rng.choice(["", "s"]))
                t.begin_write(r.id)
                t.end_write(r.id)
                r.tokens = r.tokens or tokens
            except (NoCapacity, BadReservation):
                pass
        elif op in ("commit", "abort") and t.active:
            r = rng.choice(list(t.active.values()))
            fork = rng.choice(sorted(r.waiting))
            if op == "commit":
                live.append(t.commit(r.id, r.tokens, params(rng.randint(1, 40)), 0, 9, fork=fork))
            else:
                t.abort(r.id, fork if rng.random() < 0.7 else None)
        elif op == "step":
            for _ in range(n):
                step(sched)
            sched.take_preempted()
        elif op == "cancel" and sched.running:
            sched.abort(rng.choice(sched.running))
        uses: dict[int, int] = {}
        for pages in [s.pages for s in sched.running] + [r.prompt_pages + [p for p in r.tails[1:] if p is not None]
                                                         for r in t.active.values()]:
            for p in pages:
                uses[p] = uses.get(p, 0) + 1
        for p in set(uses) | set(cache.refs):
            if p in cache.refs:
                assert cache.refs[p] == uses.get(p, 0) and alloc.holders(p) == 1
            else:
                assert alloc.holders(p) == uses[p]
        assert alloc.num_allocated == len(set(uses) | set(cache.refs))
        cached_slots = set(token_slots(list(cache.entry), len(cache.entry) * CPAGE * C, CPAGE, C).tolist())
        for s in sched.running:
            mine = set(token_slots(s.pages, len(s.all_ids) - 1, CPAGE, C)[max(s.shared_tokens, s.num_cached):].tolist())
            assert not mine & cached_slots
    for r in list(t.active.values()):
        t.abort(r.id)
    for s in list(sched.running):
        sched.abort(s)
    cache.clear()
    assert alloc.num_free == num_pages
