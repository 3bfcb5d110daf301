"""engine.parallel.transfer_plan: the prefill -> decode transfer plan (pure index math)."""

from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.cache.slots import pages_needed, token_slots
from engine.parallel.layout import layer_owner
from engine.parallel.transfer_plan import Write, plan_bytes, plan_transfer, writes_by_rank


def test_worked_example_cp2_full_copy_to_dcp2():
    writes = plan_transfer(num_tokens=5, prefill_cp=2, layer_split=False, num_layers=4,
                           indexer_layers=[], src_slots=range(5), decode_dcp=2,
                           dst_slots=token_slots([0], 5, 4, 2), decode_index="copied")
    assert writes == [
        Write(0, 0, range(0, 2), (0, 2, 4), 0, 3, "latent"),
        Write(0, 1, range(0, 2), (1, 3), 0, 2, "latent"),
        Write(1, 0, range(2, 4), (0, 2, 4), 0, 3, "latent"),
        Write(1, 1, range(2, 4), (1, 3), 0, 2, "latent"),
    ]
    assert sorted(writes_by_rank(writes)) == [0, 1]
    assert plan_bytes(writes, 576, 132) == 5 * 4 * 576


def test_index_keys_copied_go_everywhere_at_the_group_slot_split_to_the_owner():
    common = dict(num_tokens=4, prefill_cp=2, layer_split=True, num_layers=4,
                  indexer_layers=[1, 2, 3], src_slots=[10, 11, 12, 13], decode_dcp=2,
                  dst_slots=[8, 9, 10, 11], decode_prefix=1)
    index = [w for w in plan_transfer(**common, decode_index="copied") if w.kind == "index"]
    assert index == [
        Write(0, 0, range(1, 2), (11, 12, 13), 9, 3, "index"),
        Write(0, 1, range(1, 2), (11, 12, 13), 9, 3, "index"),
        Write(1, 0, range(2, 4), (11, 12, 13), 9, 3, "index"),
        Write(1, 1, range(2, 4), (11, 12, 13), 9, 3, "index"),
    ]
    index = [w for w in plan_transfer(**common, decode_index="split") if w.kind == "index"]
    assert index == [
        Write(0, 0, range(1, 2), (12,), 5, 1, "index"),
        Write(0, 1, range(1, 2), (11, 13), 4, 2, "index"),
        Write(1, 0, range(2, 4), (12,), 5, 1, "index"),
        Write(1, 1, range(2, 4), (11, 13), 4, 2, "index"),
    ]


def test_fewer_layers_than_prefill_ranks_still_uses_every_rank_with_full_copies():
    writes = plan_transfer(num_tokens=6, prefill_cp=4, layer_split=False, num_layers=2,
                           indexer_layers=[], src_slots=range(6), decode_dcp=1,
                           dst_slots=range(6), decode_index="copied")
    assert [(w.src_rank, w.layers, w.src_rows) for w in writes] == [
        (0, range(0, 1), (0, 1, 2)), (1, range(0, 1), (3, 4, 5)),
        (2, range(1, 2), (0, 1, 2)), (3, range(1, 2), (3, 4, 5))]
    split = plan_transfer(num_tokens=6, prefill_cp=4, layer_split=True, num_layers=2,
                          indexer_layers=[], src_slots=range(6), decode_dcp=1,
                          dst_slots=range(6), decode_index="copied")
    assert sorted(writes_by_rank(split)) == [0, 1]  # ranks 2 and 3 own no layer


@pytest.mark.parametrize("change, message", [
    (dict(src_slots=[0, 1]), "src_slots"),
    (dict(dst_slots=[0, 0, 1]), "distinct"),
    (dict(dst_slots=[0, -1, 2]), "dst_slots"),
    (dict(decode_prefix=4), "decode_prefix"),
    (dict(decode_index="mirrored"), "decode_index"),
    (dict(indexer_layers=[4]), "indexer_layers"),
    (dict(indexer_layers=[1, 1]), "indexer_layers"),
    (dict(prefill_cp=0), "prefill_cp"),
    (dict(decode_dcp=0), "decode_dcp"),
])
def test_bad_input_is_refused_naming_the_argument(change, message):
    args = dict(num_tokens=3, prefill_cp=2, layer_split=False, num_layers=4, indexer_layers=[1],
                src_slots=[0, 1, 2], decode_dcp=2, dst_slots=[0, 1, 2], decode_index="copied")
    with pytest.raises(ValueError, match=message):
        plan_transfer(**{**args, **change})


def test_nothing_to_send_gives_an_empty_plan():
    assert plan_transfer(num_tokens=3, prefill_cp=2, layer_split=False, num_layers=4,
                         indexer_layers=[1], src_slots=[0, 1, 2], decode_dcp=2,
                         dst_slots=[0, 1, 2], decode_index="copied", decode_prefix=3) == []


@st.composite
def transfers(draw):
    cp = draw(st.integers(1, 4))
    dcp = draw(st.integers(1, 4))
    num_layers = draw(st.integers(1, 7))
    indexer = draw(st.sets(st.integers(0, num_layers - 1)))
    n = draw(st.integers(0, 40))
    prefix = draw(st.integers(0, n))
    src_pages = draw(st.permutations(range(n)))  # prefill page size 1: one row per page
    page_size = draw(st.integers(1, 8))
    spare = draw(st.integers(0, 3))
    dst_pages = draw(st.permutations(range(pages_needed(n, page_size, dcp) + spare)))
    return dict(
        num_tokens=n, prefill_cp=cp, layer_split=draw(st.booleans()), num_layers=num_layers,
        indexer_layers=sorted(indexer), src_slots=token_slots(src_pages, n, 1, 1),
        decode_dcp=dcp, dst_slots=token_slots(dst_pages, n, page_size, dcp),
        decode_index=draw(st.sampled_from(["copied", "split"])), decode_prefix=prefix,
    )


def _expected_entries(args) -> dict[tuple, int]:
    """(dst_rank, kind, layer, dst_row) -> src_row for every entry that must be written."""
    dcp, src, dst = args["decode_dcp"], args["src_slots"].tolist(), args["dst_slots"].tolist()
    expected = {}
    for p in range(args["decode_prefix"], args["num_tokens"]):
        assert dst[p] % dcp == p % dcp  # the slot numbering puts token p on rank p mod C
        for layer in range(args["num_layers"]):
            expected[(p % dcp, "latent", layer, dst[p] // dcp)] = src[p]
        for layer in args["indexer_layers"]:
            if args["decode_index"] == "copied":
                for d in range(dcp):
                    expected[(d, "index", layer, dst[p])] = src[p]
            else:
                expected[(p % dcp, "index", layer, dst[p] // dcp)] = src[p]
    return expected


@settings(max_examples=300, deadline=None)
@given(args=transfers())
def test_every_entry_lands_once_at_its_reserved_row(args):
    writes = plan_transfer(**args)

    written = Counter()
    entries = {}
    for w in writes:
        assert w.num_rows == len(w.src_rows) >= 1 and len(w.layers) >= 1
        assert w.kind in ("latent", "index")
        if w.kind == "index":
            assert set(w.layers) <= set(args["indexer_layers"])
        for layer in w.layers:
            for i, src_row in enumerate(w.src_rows):
                key = (w.dst_rank, w.kind, layer, w.dst_row_start + i)
                written[key] += 1
                entries[key] = src_row
    assert max(written.values(), default=1) == 1, "two writes overlap at the destination"
    assert entries == _expected_entries(args)  # exactly once, right rank/row/source, no prefix

    per_layer = {"latent": args["num_layers"], "index": len(args["indexer_layers"])}
    copies = args["decode_dcp"] if args["decode_index"] == "copied" else 1
    sent = args["num_tokens"] - args["decode_prefix"]
    assert plan_bytes(writes, 3, 5) == sent * (per_layer["latent"] * 3
                                               + per_layer["index"] * 5 * copies)


@settings(max_examples=300, deadline=None)
@given(args=transfers())
def test_senders_and_runs(args):
    writes = plan_transfer(**args)
    cp, num_layers = args["prefill_cp"], args["num_layers"]
    sent = args["num_tokens"] - args["decode_prefix"]

    senders = {w.src_rank for w in writes}
    assert senders <= set(range(cp))
    if args["layer_split"]:
        assert all(layer_owner(l, num_layers, cp) == w.src_rank for w in writes for l in w.layers)
    elif sent and (num_layers >= cp or sent >= cp):
        assert senders == set(range(cp)), "with full copies every prefill rank sends"

    by_rank = writes_by_rank(writes)
    assert set(by_rank) == senders
    assert sorted(map(id, sum(by_rank.values(), []))) == sorted(map(id, writes))

    # Runs are maximal: within one (src, dst, layers, kind) stream, consecutive writes are not
    # adjacent at the destination.
    streams: dict[tuple, list[Write]] = {}
    for w in writes:
        streams.setdefault((w.src_rank, w.dst_rank, w.layers, w.kind), []).append(w)
    for stream in streams.values():
        for a, b in zip(stream, stream[1:]):
            assert b.dst_row_start != a.dst_row_start + a.num_rows


def test_contiguous_pages_give_one_run_per_destination():
    n, dcp = 1000, 4
    writes = plan_transfer(num_tokens=n, prefill_cp=2, layer_split=True, num_layers=6,
                           indexer_layers=[0, 1, 4], src_slots=torch.randperm(n),
                           decode_dcp=dcp, dst_slots=token_slots(range(8), n, 32, dcp),
                           decode_index="copied")
    latent = [w for w in writes if w.kind == "latent"]
    assert len(latent) == 2 * dcp and {w.num_rows for w in latent} == {n // dcp}
    index = [w for w in writes if w.kind == "index"]
    assert [(w.src_rank, w.layers) for w in index[::dcp]] == [(0, range(0, 2)), (1, range(4, 5))]
    assert {w.num_rows for w in index} == {n}


@pytest.mark.parametrize("cp,dcp,prefix", [(2, 2, 0), (2, 2, 7), (3, 4, 0), (3, 4, 5), (4, 2, 3)])
def test_sharded_prefill_sends_each_row_once_from_the_rank_that_holds_it(cp, dcp, prefix):
    """The ring's cache: token p on prefill rank slot % Cp at row slot // Cp, every layer; each
    row leaves that rank once, to decode rank dst % Cd; with Cp == Cd rank r writes to rank r."""
    n, layers, indexer = 45, 3, [1, 2]
    src = token_slots([3, 0, 5], n, 16, cp)  # pages out of order, as an allocator hands them out
    dst = token_slots([2, 6, 1], n, 16, dcp)
    for mode in ("copied", "split"):
        writes = plan_transfer(num_tokens=n, prefill_cp=cp, layer_split=False, num_layers=layers,
                               indexer_layers=indexer, src_slots=src, decode_dcp=dcp, dst_slots=dst,
                               decode_index=mode, decode_prefix=prefix, sharded=True)
        latent = Counter()
        index = Counter()
        for w in writes:
            for src_row, dst_row in zip(w.src_rows, w.dst_rows):
                for layer in w.layers:
                    (latent if w.kind == "latent" else index)[(w.src_rank, src_row, w.dst_rank, dst_row, layer)] += 1
        want = Counter()
        for p in range(prefix, n):
            s, d = int(src[p]), int(dst[p])
            for layer in range(layers):
                want[(s % cp, s // cp, d % dcp, d // dcp, layer)] += 1
        assert latent == want
        if cp == dcp:
            assert all(w.src_rank == w.dst_rank for w in writes if w.kind == "latent")
        want_index = Counter()
        for p in range(prefix, n):
            s, d = int(src[p]), int(dst[p])
            targets = [(d % dcp, d // dcp)] if mode == "split" else [(r, d) for r in range(dcp)]
            for rank, row in targets:
                for layer in indexer:
                    want_index[(s % cp, s // cp, rank, row, layer)] += 1
        assert index == want_index
        assert plan_bytes(writes, 10, 0) == (n - prefix) * layers * 10  # latent: rows × bytes per row
    with pytest.raises(ValueError, match="layer_split"):
        plan_transfer(num_tokens=n, prefill_cp=cp, layer_split=True, num_layers=layers, indexer_layers=[],
                      src_slots=src, decode_dcp=dcp, dst_slots=dst, decode_index="copied", sharded=True)
