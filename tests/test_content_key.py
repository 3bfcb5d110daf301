"""Content keys (engine/cache/content_key.py): the same tokens give the same keys in any process and
for any page size; a key names the whole prefix; salts and layouts separate; the event log
answers a reader that fell behind with a snapshot."""

from __future__ import annotations

import subprocess
import sys

from engine.cache.content_key import BLOCK_TOKENS, KvEventLog, block_keys, key_seed, salted
from engine.cache.prefix import PrefixCache
from engine.cache.slots import PageAllocator

SEED = key_seed({"model": "m", "dtype": "fp32", "kv_cache_dtype": "fp32"})


def test_keys_depend_on_tokens_and_seed_only_and_chain_the_prefix():
    tokens = list(range(100, 100 + 5 * BLOCK_TOKENS + 3))
    keys = block_keys(tokens, SEED)
    assert len(keys) == 5  # the partial block has none
    assert keys == block_keys(tokens[: 5 * BLOCK_TOKENS], SEED) == block_keys(tokens + [1, 2], SEED)[:5]
    assert block_keys(tokens, SEED, num_blocks=2) == keys[:2]
    changed = list(tokens)
    changed[3] += 1  # a change in block 0 changes every later key: a key names the whole prefix
    assert all(a != b for a, b in zip(block_keys(changed, SEED), keys))
    other_layout = key_seed({"model": "m", "dtype": "bf16", "kv_cache_dtype": "bf16"})
    assert not set(block_keys(tokens, other_layout)) & set(keys)
    assert not set(block_keys(tokens, SEED, "tenant")) & set(keys)
    assert salted(SEED, "") == SEED and salted(SEED, "a") != salted(SEED, "b")
    assert all(0 <= k < 2**64 for k in keys)


def test_another_process_computes_the_same_keys():
    code = ("from engine.cache.content_key import block_keys, key_seed; "
            "print(block_keys(list(range(100, 180)), key_seed({'model': 'm', 'dtype': 'fp32', "
            "'kv_cache_dtype': 'fp32'}), 'x'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123", "PATH": ""}, cwd=".").stdout
    assert out.strip() == str(block_keys(list(range(100, 180)), SEED, "x"))


def test_prefill_and_decode_pages_report_the_same_blocks():
    """A 16-token prefill page and a 64-token decode page (DCP 4) of the same tokens report the
    same block keys: the router's index does not care which service holds them."""
    tokens = list(range(3, 3 + 128 + 5))
    reported = []
    for tokens_per_page in (16, 64):
        cache = PrefixCache(PageAllocator(16), tokens_per_page, SEED)
        n = -(-len(tokens) // tokens_per_page)
        cache.release(cache.allocate(n), tokens, len(tokens))
        reported.append(set(cache.events.since("", 0).snapshot))
    assert reported[0] == reported[1] == set(block_keys(tokens, SEED))


def test_event_log_continues_a_reader_or_resets_it():
    log = KvEventLog(SEED, max_events=3)
    first = log.since("", 0)
    assert first.reset and first.snapshot == () and first.incarnation == log.incarnation
    log.stored([1, 2])
    log.stored([2, 3])  # two pages share block 2
    batch = log.since(log.incarnation, first.last)
    assert not batch.reset and batch.events == (("stored", (1, 2)), ("stored", (2, 3)))
    log.removed([1, 2])
    assert set(log.since("", 0).snapshot) == {2, 3}  # block 2 still held by the other page
    log.stored([2, 4])
    assert sorted(log.since("", 0).snapshot) == [2, 2, 3, 4]  # as often as pages hold it
    log.removed([2, 4])
    log.removed([2, 3])
    log.stored([9])
    behind = log.since(log.incarnation, batch.last)  # its next events were dropped (3 kept)
    assert behind.reset and set(behind.snapshot) == {9}
    assert not log.since(log.incarnation, log.since("", 0).last).events
    restarted = KvEventLog(SEED)
    assert restarted.since(log.incarnation, 5).reset  # another incarnation: start over
