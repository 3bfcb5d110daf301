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


def test_pages_are_conserved_and_shared_only_for_equal_prefixes():
    alloc = PageAllocator(20)
    cache = PrefixCache(alloc, 4)
    rng = random.Random(0)
    live = []
    for step in range(300):
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
            live.append((shared + fresh, prompt))
        in_use = {p for pages, _ in live for p in pages}
        idle = set(cache.idle)
        assert not (idle & in_use)
        assert alloc.num_free + len(idle) + len(in_use) == 20
    for pages, prompt in live:
        cache.release(pages, prompt, prompt_done=True)
    cache.clear()
    assert alloc.num_free == 20


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
