"""KV hand-off from a real prefill CP group to a real DCP decode group through Mooncake (TCP on
127.0.0.1), and its failure paths."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from engine.cache.slots import token_slots
from engine.decode_engine import DCPDecodeEngine
from engine.model.sampler import SamplingParams
from engine.model.tiny import make_tiny
from engine.prefill_engine import CPPrefillEngine
from engine.reference import ReferenceEngine
from engine.handoff import LayoutMismatch, ReservationError
from kvtransfer.transport import TransferError

PARAMS = SamplingParams(max_new_tokens=16, stop_token_ids=())
LENGTHS = [45, 2, 70, 1]


def prompts(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (n,), generator=g).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def six_heads(tmp_path_factory):
    return str(make_tiny(tmp_path_factory.mktemp("six") / "glm6", "glm_moe_dsa", num_attention_heads=6,
                         num_key_value_heads=6))


def hand_off(pre, dec, prompt, params=PARAMS):
    dest = dec.reserve(len(prompt), params.max_new_tokens)
    seq = pre.prefill_to(prompt, params, dest, before_write=lambda: dec.begin_write(dest.reservation_id),
                         after_write=lambda: dec.end_write(dest.reservation_id))
    return dest, dec.commit(dest.reservation_id, prompt, params, seq.seed, seq.output_ids[0])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model,layer_split,dcp,indexer", [
    ("tiny", False, 1, "copied"), ("tiny", True, 2, "split"), ("six", False, 3, "copied"), ("six", True, 3, "split"),
])
def test_prefill_cp_hands_kv_to_decode_dcp(six_heads, model, layer_split, dcp, indexer):
    model = six_heads if model == "six" else model
    ref = ReferenceEngine(model, record_logits=True)
    ps = prompts()
    expected = [ref.generate([p], PARAMS)[0] for p in ps]
    with CPPrefillEngine(model, cp=2, strategy="interleave", layer_split=layer_split, kv_transport="tcp") as pre, \
         DCPDecodeEngine(model, dcp=dcp, indexer=indexer, kv_transport="tcp", reference_prefill=False) as dec:
        handed = [hand_off(pre, dec, p) for p in ps]
        # every decode rank holds, for the tokens it owns, the reference's cache entries
        for (dest, seq), p in zip(handed, ps):
            ref_seq = ref.add_request(p, SamplingParams(max_new_tokens=1, stop_token_ids=()))
            ref.scheduler._admit()
            ref_slots = token_slots(ref_seq.pages, len(p), ref.scheduler.page_size, 1)
            while ref.has_work:
                ref.step()
            slots = torch.tensor(dest.slots)
            for r in range(dcp):
                got = dec.group.call_rank(r, "rows", slots)
                owned = torch.arange(r, max(len(p), r), dcp)
                want = torch.stack([ref.pool.latent(l)[ref_slots[owned]] for l in range(ref.cfg.num_layers)])
                assert got["latent"].shape == want.shape
                if owned.numel():
                    assert float((got["latent"] - want).abs().max()) <= 1e-5 * float(want.abs().max())
        assert pre.allocator.num_free == pre.allocator.num_pages
        assert all(r["ok"] and r["bytes"] > 0 for r in pre.transfer_stats)  # every prefill rank sent
        while dec.has_work:
            dec.step()
        for (_, seq), exp in zip(handed, expected):
            assert seq.output_ids == exp.output_ids
        assert dec.allocator.num_free == dec.allocator.num_pages


@pytest.fixture(scope="module")
def pair():
    with CPPrefillEngine("tiny", cp=2, kv_transport="tcp") as pre, \
         DCPDecodeEngine("tiny", dcp=2, kv_transport="tcp", reference_prefill=False, lease_s=0.5) as dec:
        yield pre, dec


def assert_all_free(pre, dec):
    assert pre.allocator.num_free == pre.allocator.num_pages
    dec.reservations.expire()
    assert dec.allocator.num_free == dec.allocator.num_pages and not dec.reservations.active


@pytest.mark.timeout(120)
def test_fingerprint_mismatch_is_refused_before_compute(pair):
    pre, dec = pair
    dest = dec.reserve(10, 4)
    bad = dataclasses.replace(dest, fingerprint={**dest.fingerprint, "dtype": "bf16"})
    steps_before = pre.runner.rank_seconds[:]
    t0 = time.monotonic()
    with pytest.raises(LayoutMismatch, match="dtype"):
        pre.prefill_to(prompts()[0][:10], PARAMS, bad)
    assert time.monotonic() - t0 < 5 and pre.runner.rank_seconds == steps_before
    assert dec.abort_reservation(dest.reservation_id)
    assert_all_free(pre, dec)


@pytest.mark.timeout(120)
def test_write_after_expiry_is_refused(pair):
    pre, dec = pair
    p = prompts()[0]
    dest = dec.reserve(len(p), 4)
    time.sleep(0.8)
    t0 = time.monotonic()
    with pytest.raises(ReservationError, match="unknown or expired"):
        pre.prefill_to(p, PARAMS, dest, before_write=lambda: dec.begin_write(dest.reservation_id))
    assert time.monotonic() - t0 < 5
    with pytest.raises(ReservationError):
        dec.commit(dest.reservation_id, p, PARAMS, 0, 5)
    assert_all_free(pre, dec)


@pytest.mark.timeout(120)
def test_transfer_error_mid_request_frees_everything(pair):
    pre, dec = pair
    p = prompts()[2]
    dest = dec.reserve(len(p), 4)
    bogus = dataclasses.replace(dest.ranks[1], latent_ptr=dest.ranks[1].latent_ptr + (1 << 40))
    bad = dataclasses.replace(dest, ranks=(dest.ranks[0], bogus))
    dec.begin_write(dest.reservation_id)  # at once: this fixture's lease is short
    t0 = time.monotonic()
    with pytest.raises(TransferError) as e:
        pre.prefill_to(p, PARAMS, bad, before_write=lambda: None,  # cleared above
                       after_write=lambda: dec.end_write(dest.reservation_id))
    assert time.monotonic() - t0 < 5 and bogus.session in str(e.value)
    assert dec.abort_reservation(dest.reservation_id)  # the writer said it stopped: freed at once
    assert_all_free(pre, dec)


@pytest.mark.timeout(180)
def test_decode_peer_gone_before_the_write():
    with CPPrefillEngine("tiny", cp=2, kv_transport="tcp") as pre:
        dec = DCPDecodeEngine("tiny", dcp=2, kv_transport="tcp", reference_prefill=False)
        p = prompts()[0]
        dest = dec.reserve(len(p), 4)
        dec.close()
        t0 = time.monotonic()
        with pytest.raises(TransferError):
            pre.prefill_to(p, PARAMS, dest)
        assert time.monotonic() - t0 < 5
        assert pre.allocator.num_free == pre.allocator.num_pages


@pytest.mark.timeout(120)
def test_concurrent_prefills_share_forwards_and_hand_off_exactly(pair):
    pre, dec = pair
    ps = prompts(seed=3)
    dests = [dec.reserve(len(p), PARAMS.max_new_tokens) for p in ps]
    for d in dests:
        dec.begin_write(d.reservation_id)  # at once: this fixture's lease is short
    pending = [pre.submit_prefill(p, PARAMS, d) for p, d in zip(ps, dests)]
    pre.step()  # one forward holds every queued prompt
    assert all(p.seq.is_finished for p in pending)
    assert len(pre.finish_ready()) == len(ps)
    seqs = [dec.commit(d.reservation_id, p, PARAMS, pp.seq.seed, pp.future.result().output_ids[0])
            for p, d, pp in zip(ps, dests, pending)]
    while dec.has_work:
        dec.step()
    ref = ReferenceEngine("tiny")
    assert [s.output_ids for s in seqs] == [ref.generate([p], PARAMS)[0].output_ids for p in ps]
    assert_all_free(pre, dec)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layer_split", [False, True])
def test_layer_wise_overlap_hands_off_exactly(layer_split):
    ps = prompts(seed=4)
    ref = ReferenceEngine("tiny")
    expected = [ref.generate([p], PARAMS)[0].output_ids for p in ps]
    with CPPrefillEngine("tiny", cp=2, layer_split=layer_split, kv_transport="tcp", overlap=True,
                         chunk_size=32) as pre, \
         DCPDecodeEngine("tiny", dcp=2, indexer="split", kv_transport="tcp", reference_prefill=False) as dec:
        handed = [hand_off(pre, dec, p) for p in ps]
        stats = pre.transfer_stats
        assert stats and all(r["ok"] and r["bytes"] > 0 for r in stats)
        while dec.has_work:
            dec.step()
        assert [seq.output_ids for _, seq in handed] == expected
        assert pre.allocator.num_free == pre.allocator.num_pages and not pre.runner.push_results
        # a refused BeginWrite before the overlapped forward: nothing is sent, everything freed
        dest = dec.reserve(len(ps[0]), 4)
        dec.abort_reservation(dest.reservation_id)
        with pytest.raises(ReservationError):
            pre.prefill_to(ps[0], PARAMS, dest, before_write=lambda: dec.begin_write(dest.reservation_id))
        assert pre.allocator.num_free == pre.allocator.num_pages
        assert dec.allocator.num_free == dec.allocator.num_pages


@pytest.mark.timeout(300)
@pytest.mark.parametrize("overlap", [True])  # (without overlap: tests/test_lifecycle_stress.py)
def test_abort_while_writing_quarantines_the_rows_until_the_writer_stops(overlap):
    """The router's abort arrives while prefill writes (after BeginWrite): decode must not hand
    those rows to another request before the writer says it has stopped (EndWrite), or the
    late writes land in the other request's rows. Here the cache holds one request, so the next
    reservation is refused until then; afterwards it gets the rows and decodes exactly."""
    from engine.handoff import NoCapacity

    g = torch.Generator().manual_seed(9)
    a, b = (torch.randint(3, 300, (60,), generator=g).tolist() for _ in range(2))
    params = SamplingParams(max_new_tokens=4, stop_token_ids=())
    expected = ReferenceEngine("tiny").generate([b], params)[0].output_ids
    with CPPrefillEngine("tiny", cp=2, kv_transport="tcp", overlap=overlap, chunk_size=32) as pre, \
         DCPDecodeEngine("tiny", dcp=2, kv_transport="tcp", reference_prefill=False, max_cache_tokens=96) as dec:
        dest_a = dec.reserve(len(a), params.max_new_tokens)
        seen = {}

        def before_write():
            dec.begin_write(dest_a.reservation_id)
            assert dec.abort_reservation(dest_a.reservation_id)  # the client went away
            try:
                dest_b = dec.reserve(len(b), params.max_new_tokens)
            except NoCapacity:
                seen["refused"] = True
            else:
                seen["overlap"] = set(dest_b.slots) & set(dest_a.slots)
                dec.abort_reservation(dest_b.reservation_id)

        pre.prefill_to(a, params, dest_a, before_write=before_write,
                       after_write=lambda: seen.setdefault("freed", dec.end_write(dest_a.reservation_id)))
        assert seen.get("refused") or not seen.get("overlap"), seen  # never a's rows while a writes
        assert seen["freed"] and dec.allocator.num_free == dec.allocator.num_pages  # EndWrite freed them
        _, seq = hand_off(pre, dec, b, params)
        while dec.has_work:
            dec.step()
        assert seq.output_ids == expected
        assert dec.allocator.num_free == dec.allocator.num_pages and not dec.reservations.active


@pytest.mark.timeout(300)
def test_write_lease_is_renewed_per_chunk_and_a_stalled_writer_is_cut_off():
    """The rows are claimed when prefill starts and the lease is renewed between chunks: a
    prefill that takes longer than the lease keeps its rows and hands off exactly. A writer
    that stops renewing loses them: its next renewal is refused, its compute stops, nothing
    is written and every row is free again."""
    g = torch.Generator().manual_seed(12)
    p = torch.randint(3, 300, (320,), generator=g).tolist()
    params = SamplingParams(max_new_tokens=4, stop_token_ids=())
    expected = ReferenceEngine("tiny").generate([p], params)[0].output_ids
    with CPPrefillEngine("tiny", cp=2, kv_transport="tcp", chunk_size=32) as pre, \
         DCPDecodeEngine("tiny", dcp=2, kv_transport="tcp", reference_prefill=False, lease_s=0.5,
                         write_lease_s=1.0) as dec:
        def start(dest):
            rid = dest.reservation_id
            dec.begin_write(rid)  # claimed as the group starts the request
            pending = pre.submit_prefill(p, params, dest, before_write=lambda: dec.begin_write(rid),
                                         after_write=lambda: dec.end_write(rid))
            pending.cleared, pending.renew, pending.renew_every_s = True, lambda: dec.begin_write(rid), 0.2
            return pending

        dest = dec.reserve(len(p), params.max_new_tokens)
        pending = start(dest)
        t0 = time.monotonic()
        while not pending.future.done():
            pre.renew_leases()
            if pre.has_work:
                pre.step()
            time.sleep(0.15)  # a slow prefill: ten chunks take well over the 1 s lease
            pre.finish_ready()
        assert time.monotonic() - t0 > 1.5
        seq = dec.commit(dest.reservation_id, p, params, pending.seq.seed, pending.future.result().output_ids[0])
        while dec.has_work:
            dec.step()
        assert seq.output_ids == expected

        dest = dec.reserve(len(p), params.max_new_tokens)
        pending = start(dest)
        pre.step()  # one chunk, then the writer stalls past its lease
        time.sleep(1.3)
        pre.renew_leases()
        with pytest.raises(ReservationError, match="unknown or expired"):
            pending.future.result(timeout=1)
        assert not pre.has_work and pre.allocator.num_free == pre.allocator.num_pages
        assert_all_free(pre, dec)
