"""Prefix reuse: a request whose prefix is cached prefills (and splits) only its new tokens."""

from __future__ import annotations

import random

import pytest
import torch

from engine.cache.prefix import PrefixCache
from engine.cache.slots import PageAllocator
from engine.model.sampler import SamplingParams
from engine.prefill_engine import CPPrefillEngine
from engine.reference import ReferenceEngine

FIRST = SamplingParams(max_new_tokens=1, stop_token_ids=())


@pytest.mark.parametrize("colliding", [False, True])
def test_pages_are_conserved_and_shared_only_for_equal_prefixes(colliding, monkeypatch):
    """Random requests over a 2-letter alphabet (many equal prefixes). `held` is what each page's
    rows were computed from (the whole prefix up to its end); a shared page must hold exactly
    the prompt's prefix. With every key colliding (one hash for all), hits still need equal
    tokens and parents, so nothing wrong is ever reused."""
    import engine.cache.prefix as prefix

    if colliding:
        monkeypatch.setattr(prefix, "hash", lambda key: 7, raising=False)  # the module's keys collide
    alloc = PageAllocator(20)
    cache = PrefixCache(alloc, 4)
    rng = random.Random(0)
    live = []
    held: dict[int, tuple[int, ...]] = {}
    hits = 0
    for step in range(600):
        if live and rng.random() < 0.5:
            pages, prompt = live.pop(rng.randrange(len(live)))
            cache.release(pages, prompt, prompt_done=rng.random() < 0.8)
        else:
            prompt = [rng.choice([1, 2]) for _ in range(rng.randint(1, 14))]
            shared = cache.match(prompt)
            fresh = cache.allocate(4 - len(shared))
            if fresh is None:
                cache.release(shared, prompt, prompt_done=False)
                continue
            assert len(shared) <= (len(prompt) - 1) // 4
            for i, page in enumerate(shared):
                assert held[page] == tuple(prompt[:4 * (i + 1)])  # the rows are this prompt's prefix
            for i, page in enumerate(fresh, start=len(shared)):
                held[page] = tuple(prompt[:4 * (i + 1)])
            hits += len(shared)
            live.append((shared + fresh, prompt))
        in_use = {p for pages, _ in live for p in pages}
        idle = set(cache.idle)
        assert not (idle & in_use)
        assert alloc.num_free + len(idle) + len(in_use) == 20
    for pages, prompt in live:
        cache.release(pages, prompt, prompt_done=True)
    cache.clear()
    assert alloc.num_free == 20
    assert hits > 0, hits  # reuse really happened


def test_colliding_keys_with_different_tokens_are_not_reused(monkeypatch):
    """Two prompts whose page keys collide by construction but whose tokens differ: no reuse."""
    import engine.cache.prefix as prefix

    monkeypatch.setattr(prefix, "hash", lambda key: 0, raising=False)  # every key collides
    alloc = PageAllocator(8)
    cache = PrefixCache(alloc, 4)
    a, b = [5, 6, 7, 8, 9], [1, 2, 3, 4, 9]
    pages = cache.match(a) + cache.allocate(2)
    cache.release(pages, a, prompt_done=True)
    assert cache.num_cached_pages == 1
    assert cache.match(b) == []  # same key, other tokens
    assert len(cache.match(a)) == 1  # the equal prompt still hits


@pytest.mark.timeout(300)
@pytest.mark.parametrize("cp,strategy,layer_split", [(2, "zigzag", False), (3, "interleave", True)])
def test_cp_prefill_with_cached_prefix_matches_reference(cp, strategy, layer_split):
    g = torch.Generator().manual_seed(11)
    shared = torch.randint(3, 300, (100,), generator=g).tolist()
    a = shared + torch.randint(3, 300, (7,), generator=g).tolist()
    b = shared + torch.randint(3, 300, (21,), generator=g).tolist()
    c = torch.randint(3, 300, (5,), generator=g).tolist()
    ref = ReferenceEngine("tiny", record_logits=True)
    expected = [ref.generate([p], FIRST)[0] for p in (a, b, c)]
    with CPPrefillEngine("tiny", cp=cp, strategy=strategy, layer_split=layer_split, record_logits=True,
                         prefix_cache=True) as eng:
        first = eng.generate([a], FIRST)[0]
        second, third = eng.generate([b, c], FIRST)
        assert first.num_cached == 0 and second.num_cached == 96 and third.num_cached == 0
        for ours, theirs in zip((first, second, third), expected):
            assert ours.output_ids == theirs.output_ids
            assert float((ours.logits[0] - theirs.logits[0]).abs().max() / theirs.logits[0].abs().max()) < 1e-5
        eng.scheduler.prefix.clear()
        assert eng.allocator.num_free == eng.allocator.num_pages
