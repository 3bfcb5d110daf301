"""A conversation pays only for its new tokens: prefill finds the earlier prompts in its prefix
cache, decode keeps each finished turn's prompt and output rows and is sent only the rest —
through the real services (rank groups, gRPC, Mooncake), exact against the reference engine."""

from __future__ import annotations

import pytest
import torch

from engine.model.sampler import SamplingParams
from engine.reference import ReferenceEngine
from services.common.config import DecodeConfig, PrefillConfig
from services.decode.server import serve_decode
from services.prefill.server import serve_prefill
from services.protos import common_pb2
from tests.test_services import Client

MAX_NEW = 8
# Every turn's prompt is 61 mod 64 tokens long and grows by 64 (its answer's 8 + 56 new), so at
# DCP 4 (64-token decode pages) too the previous turn's output crosses a page boundary and its
# rows are found again, not only the prompt's.
FIRST, NEW = 189, 56


def greedy() -> common_pb2.Sampling:
    return common_pb2.Sampling(max_new_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def reference():
    return ReferenceEngine("tiny")


def expected(reference, prompt: list[int]) -> list[int]:
    return reference.generate([prompt], SamplingParams(max_new_tokens=MAX_NEW, stop_token_ids=()))[0].output_ids


class Conversation:
    """Turn k's prompt: turn k-1's prompt, its answer, and NEW tokens."""

    def __init__(self, seed: int, first: int = FIRST, new: int = NEW):
        self.g = torch.Generator().manual_seed(seed)
        self.new = new
        self.prompt = self._tokens(first)

    def _tokens(self, n: int) -> list[int]:
        return torch.randint(3, 300, (n,), generator=self.g).tolist()

    def next(self, answer: list[int]) -> list[int]:
        self.prompt = self.prompt + answer + self._tokens(self.new)
        return self.prompt


def turn(client: Client, prompt: list[int], salt: str = ""):
    """Reserve (with the prompt, for decode's cache), prefill, generate; returns (tokens, the
    prefill response)."""
    from services.protos import decode_pb2, prefill_pb2

    dest = client.decode.Reserve(decode_pb2.ReserveRequest(request_id="c", num_tokens=len(prompt),
                                                           max_new_tokens=MAX_NEW, prompt_ids=prompt,
                                                           cache_salt=salt), timeout=60)
    first = client.prefill.Prefill(prefill_pb2.PrefillRequest(request_id="c", prompt_ids=prompt, sampling=greedy(),
                                                              destination=dest, cache_salt=salt), timeout=60)
    assert first.decode_cached_tokens == dest.prefix_tokens
    tokens = [first.first_token]
    for ev in client.generate(dest, prompt, first, greedy()):
        assert ev.WhichOneof("event") != "error", ev.error.message
        if ev.WhichOneof("event") == "token":
            tokens.append(ev.token.id)
    return tokens, first


def started(prefill: PrefillConfig, decode: DecodeConfig):
    dec = serve_decode(decode)
    try:
        pre = serve_prefill(prefill)
    except BaseException:
        dec[2]()
        raise
    return pre, dec


@pytest.fixture(scope="module", params=["cp2-dcp2", "cp3-split-dcp4"])
def cluster(request):
    if request.param == "cp2-dcp2":
        pcfg, dcfg = PrefillConfig(cp=2, max_cache_tokens=4096), DecodeConfig(dcp=2, max_cache_tokens=4096)
    else:
        pcfg = PrefillConfig(cp=3, layer_split=True, max_cache_tokens=4096)
        dcfg = DecodeConfig(dcp=4, max_cache_tokens=4096)
    pre, dec = started(pcfg, dcfg)
    client = Client(pre[1], dec[1])
    client.span = 16 * dcfg.dcp
    yield client
    client.close()
    pre[2]()
    dec[2]()


def test_five_turns_reuse_both_sides_and_match_the_reference(cluster, reference):
    conv = Conversation(seed=1)
    prompt, answer, per_token = conv.prompt, None, None
    hits_before = cluster.status().prefix_cache_hits
    for k in range(5):
        if k:
            previous = len(prompt)
            prompt = conv.next(answer)
        answer, first = turn(cluster, prompt)
        assert answer == expected(reference, prompt), f"turn {k + 1}"
        if k == 0:
            assert first.cached_tokens == 0 and first.decode_cached_tokens == 0
            per_token = first.transfer_bytes / len(prompt)
            continue
        assert first.cached_tokens >= 0.9 * previous, (k, first.cached_tokens, previous)
        # decode holds the previous prompt and (page-aligned) its answer's rows
        assert first.decode_cached_tokens > previous, (k, first.decode_cached_tokens, previous)
        new_after_previous = len(prompt) - (previous + MAX_NEW)
        assert first.transfer_bytes <= (new_after_previous + cluster.span) * per_token, k
        assert first.transfer_bytes == (len(prompt) - first.decode_cached_tokens) * per_token
    s = cluster.wait_rows_free()  # a sequence in a step still in flight frees its rows when that step is collected
    assert s.prefix_cache_hits - hits_before >= 4 * (FIRST + MAX_NEW)
    assert all(u == 0 for u in s.rows_used) and s.running == 0  # idle cached rows are not "used"
    assert all(c > 0 for c in s.rows_cached)


def test_different_salts_share_nothing(cluster, reference):
    prompt = Conversation(seed=2).prompt
    a, first_a = turn(cluster, prompt, salt="tenant-a")
    b, first_b = turn(cluster, prompt, salt="tenant-b")
    assert first_b.cached_tokens == 0 and first_b.decode_cached_tokens == 0
    again, first_again = turn(cluster, prompt, salt="tenant-a")
    assert first_again.cached_tokens > 0 and first_again.decode_cached_tokens > 0  # the same salt does share
    assert a == b == again == expected(reference, prompt)


@pytest.mark.timeout(300)
def test_a_small_cache_stays_exact_leaks_nothing_and_a_restarted_decode_claims_no_hit(reference):
    """Decode holds 512 tokens (8 pages of 64 at DCP 2... 16 of 32): three interleaved
    conversations do not fit, so cached rows are evicted between their turns. Outputs stay
    exact, hits come where pages survive, and at the end no page is held. Then decode is
    restarted: the next turn is exact and decode claims no hit."""
    pre, dec = started(PrefillConfig(cp=2, max_cache_tokens=1024), DecodeConfig(dcp=2, max_cache_tokens=512))
    client = Client(pre[1], dec[1])
    try:
        convs = [Conversation(seed=10 + i, first=61, new=40) for i in range(3)]
        answers = [None] * 3
        decode_hits = 0
        for k in range(3):
            for i, conv in enumerate(convs):
                prompt = conv.prompt if k == 0 else conv.next(answers[i])
                answers[i], first = turn(client, prompt)
                assert answers[i] == expected(reference, prompt), (k, i)
                decode_hits += first.decode_cached_tokens > 0
        s = client.wait_rows_free()
        assert decode_hits > 0  # some pages survived
        assert all(u == 0 for u in s.rows_used) and s.reservations == 0 and s.running == 0
        assert all(f == s.rows_total[0] for f in s.rows_free)  # every row free or reclaimable
        dec[2]()
        dec = serve_decode(DecodeConfig(dcp=2, max_cache_tokens=512))
        client.close()
        client = Client(pre[1], dec[1])
        prompt = convs[0].next(answers[0])
        tokens, first = turn(client, prompt)
        assert first.decode_cached_tokens == 0 and first.cached_tokens > 0  # prefill still has its pages
        assert tokens == expected(reference, prompt)
    finally:
        client.close()
        pre[2]()
        dec[2]()
