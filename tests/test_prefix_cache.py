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


def _colliding_keys(tokens, seed, salt="", num_blocks=None, block_tokens=16):
    """Every block's key the same: lookups must still compare tokens and parents."""
    n = len(tokens) // block_tokens if num_blocks is None else min(num_blocks, len(tokens) // block_tokens)
    return [7] * max(n, 0)


@pytest.mark.parametrize("colliding", [False, True])
def test_pages_are_conserved_and_shared_only_for_equal_prefixes(colliding, monkeypatch):
    """Random requests over a 2-letter alphabet (many equal prefixes), two salts, uses taken and
    given back with hold/drop as decode's reservations do. `held` is what each page's rows were
    computed from (salt and the whole prefix up to its end); a shared page must hold exactly the
    prompt's prefix under the same salt. With every key colliding, hits still need equal tokens
    and parents, so nothing wrong is ever reused. The event log's blocks are always exactly
    those of the cached pages."""
    import engine.cache.prefix as prefix

    if colliding:
        monkeypatch.setattr(prefix, "block_keys", _colliding_keys)
    alloc = PageAllocator(20)
    cache = PrefixCache(alloc, 4, block_tokens=2)
    rng = random.Random(0)
    live = []
    held: dict[int, tuple] = {}
    hits = 0
    for step in range(800):
        if live and rng.random() < 0.5:
            pages, prompt, salt = live.pop(rng.randrange(len(live)))
            if rng.random() < 0.1:
                cache.drop(pages)  # e.g. a reservation that lapsed: nothing new cached
            else:
                cache.release(pages, prompt, rng.choice([0, len(prompt) // 2, len(prompt)]), salt)
        else:
            prompt = [rng.choice([1, 2]) for _ in range(rng.randint(1, 14))]
            salt = rng.choice(["", "tenant-b"])
            shared = cache.match(prompt, salt)
            fresh = cache.allocate(4 - len(shared))
            if fresh is None:
                cache.drop(shared)
                continue
            assert len(shared) <= (len(prompt) - 1) // 4
            for i, page in enumerate(shared):
                assert held[page] == (salt, tuple(prompt[:4 * (i + 1)]))  # this prompt's prefix, same salt
            for i, page in enumerate(fresh, start=len(shared)):
                held[page] = (salt, tuple(prompt[:4 * (i + 1)]))
            hits += len(shared)
            live.append((shared + fresh, prompt, salt))
        in_use = {p for pages, _, _ in live for p in pages}
        idle = set(cache.idle)
        assert not (idle & in_use)
        assert alloc.num_free + len(idle) + len(in_use) == 20
        assert cache.num_reclaimable == len(idle)
        cached_keys = {k for _, _, keys, _ in cache.entry.values() for k in keys}
        assert set(cache.events.since("", 0).snapshot) == cached_keys
    for pages, prompt, salt in live:
        cache.release(pages, prompt, len(prompt), salt)
    cache.clear()
    assert alloc.num_free == 20
    assert cache.events.num_blocks == 0
    assert hits > 0, hits  # reuse really happened


def test_colliding_keys_with_different_tokens_are_not_reused(monkeypatch):
    """Two prompts whose page keys collide by construction but whose tokens differ: no reuse."""
    import engine.cache.prefix as prefix

    monkeypatch.setattr(prefix, "block_keys", _colliding_keys)
    alloc = PageAllocator(8)
    cache = PrefixCache(alloc, 4, block_tokens=4)
    a, b = [5, 6, 7, 8, 9], [1, 2, 3, 4, 9]
    pages = cache.match(a) + cache.allocate(2)
    cache.release(pages, a, len(a))
    assert cache.num_cached_pages == 1
    assert cache.match(b) == []  # same key, other tokens
    assert len(cache.match(a)) == 1  # the equal prompt still hits


def test_salts_never_share_and_lookups_are_counted():
    alloc = PageAllocator(8)
    cache = PrefixCache(alloc, 16)
    prompt = list(range(3, 40))  # two full pages and a partial one
    pages = cache.allocate(3)
    cache.release(pages, prompt, len(prompt), salt="a")
    assert cache.num_cached_pages == 2
    assert cache.match(prompt, salt="b") == []  # another tenant: nothing
    assert cache.match(prompt) == []  # no salt is a salt of its own
    got = cache.match(prompt, salt="a")
    assert len(got) == 2
    assert (cache.queries, cache.hits) == (3 * len(prompt), 32)
    cache.drop(got)


def test_pages_still_held_by_another_request_are_not_cached():
    """Forks share pages through the allocator: a page is cached only by its last holder."""
    alloc = PageAllocator(4)
    cache = PrefixCache(alloc, 16)
    tokens = list(range(3, 35))
    pages = alloc.allocate(2)
    alloc.share(pages)  # a second fork holds them too
    cache.release(pages, tokens, len(tokens))
    assert cache.num_cached_pages == 0 and alloc.num_free == 2
    cache.release(pages, tokens, len(tokens))
    assert cache.num_cached_pages == 2 and alloc.num_free == 2


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
