"""Prefill CP layouts (engine/parallel/layout.py) and `cpserve layout`."""

import argparse
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.parallel.layout import (
    STRATEGIES,
    layer_owner,
    layer_owner_ranges,
    split_batch,
)
from engine.parallel.layout_cli import build_parser_layout, run_layout


def owned(layout):
    return [list(r.token_indices) for r in layout.ranks]


def pairs(layout):
    return [r.pairs for r in layout.ranks]


# --- worked examples (DESIGN.md §7) ------------------------------------------------------------


def test_zigzag_worked_example():
    layout = split_batch([16], [0], 4, "zigzag")
    assert owned(layout) == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]


def test_interleave_does_not_restart_per_request():
    layout = split_batch([5, 3], [0, 0], 4, "interleave")
    assert owned(layout)[0] == [0, 4]
    assert owned(layout)[1] == [1, 5]
    # flattened 5 is the first new token of the second request, at position 0
    assert layout.ranks[1].request_ids == (0, 1)
    assert layout.ranks[1].positions == (1, 0)


@pytest.mark.parametrize(
    "strategy, expected",
    [
        ("contiguous", [10, 26, 42, 58]),
        ("zigzag", [34, 34, 34, 34]),
        ("interleave", [28, 32, 36, 40]),
    ],
)
def test_pairs_worked_example(strategy, expected):
    assert pairs(split_batch([16], [0], 4, strategy)) == expected


def test_pairs_include_cached_prefix():
    layout = split_batch([4], [4], 2, "contiguous")
    assert pairs(layout) == [5 + 6, 7 + 8]
    assert layout.ranks[0].positions == (4, 5)
    assert [b.kv_end for r in layout.ranks for b in r.blocks] == [6, 8]


def test_zigzag_remainder_goes_to_early_blocks():
    # 10 tokens, C=2: blocks of 3,3,2,2 -> rank 0 gets blocks 0 and 3, rank 1 blocks 1 and 2
    layout = split_batch([10], [0], 2, "zigzag")
    assert owned(layout) == [[0, 1, 2, 8, 9], [3, 4, 5, 6, 7]]
    assert layout.max_tokens_per_rank == 5


def test_blocks_split_at_request_boundary():
    layout = split_batch([3, 3], [2, 0], 1, "contiguous")
    blocks = layout.ranks[0].blocks
    assert [(b.request, b.token_start, b.token_end, b.kv_end) for b in blocks] == [
        (0, 0, 3, 5),
        (1, 3, 6, 3),
    ]


def test_gather_order_with_padding():
    layout = split_batch([5], [0], 2, "interleave")  # rank 0: 0,2,4; rank 1: 1,3 + 1 pad
    assert layout.gather_order() == [0, 3, 1, 4, 2]


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(new_lengths=[4], cached_lengths=[0], cp=0, strategy="zigzag"), "cp"),
        (dict(new_lengths=[-1], cached_lengths=[0], cp=2, strategy="zigzag"), "new_lengths"),
        (dict(new_lengths=[1], cached_lengths=[-3], cp=2, strategy="zigzag"), "cached_lengths"),
        (dict(new_lengths=[1, 2], cached_lengths=[0], cp=2, strategy="zigzag"), "cached_lengths"),
        (dict(new_lengths=[1], cached_lengths=[0], cp=2, strategy="ring"), "strategy"),
    ],
)
def test_bad_input_names_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        split_batch(**kwargs)


# --- properties -------------------------------------------------------------------------------

batches = st.integers(1, 5).flatmap(
    lambda n: st.tuples(
        st.lists(st.integers(0, 200), min_size=n, max_size=n),
        st.lists(st.integers(0, 100), min_size=n, max_size=n),
    )
)


@settings(max_examples=150, deadline=None)
@given(batch=batches, cp=st.integers(1, 8), strategy=st.sampled_from(STRATEGIES))
def test_layout_properties(batch, cp, strategy):
    new, cached = batch
    layout = split_batch(new, cached, cp, strategy)
    expected_request = [r for r, n in enumerate(new) for _ in range(n)]
    expected_position = [c + j for n, c in zip(new, cached) for j in range(n)]

    # every new token owned by exactly one rank
    all_owned = sorted(t for r in layout.ranks for t in r.token_indices)
    assert all_owned == list(range(sum(new)))
    for rank in layout.ranks:
        assert list(rank.token_indices) == sorted(set(rank.token_indices))
        # positions and requests preserved
        assert list(rank.positions) == [expected_position[t] for t in rank.token_indices]
        assert list(rank.request_ids) == [expected_request[t] for t in rank.token_indices]
        # blocks cover exactly the owned tokens, stay in one request, and are maximal
        covered = [t for b in rank.blocks for t in range(b.token_start, b.token_end)]
        assert covered == list(rank.token_indices)
        for b in rank.blocks:
            assert {expected_request[t] for t in range(b.token_start, b.token_end)} == {b.request}
            assert b.kv_end == expected_position[b.token_end - 1] + 1
        for left, right in zip(rank.blocks, rank.blocks[1:]):
            assert left.token_end != right.token_start or left.request != right.request
        assert rank.pairs == sum(expected_position[t] + 1 for t in rank.token_indices)

    # gather_order restores batch order from padded per-rank buffers
    width = layout.max_tokens_per_rank
    gathered = []
    for rank in layout.ranks:
        gathered += list(rank.token_indices) + [None] * (width - rank.num_tokens)
    assert [gathered[i] for i in layout.gather_order()] == list(range(sum(new)))


@settings(max_examples=60, deadline=None)
@given(
    multiples=st.lists(st.integers(0, 12), min_size=1, max_size=5),
    cp=st.integers(1, 8),
)
def test_zigzag_balances_pairs_without_prefix(multiples, cp):
    new = [m * 2 * cp for m in multiples]
    layout = split_batch(new, [0] * len(new), cp, "zigzag")
    assert len(set(pairs(layout))) == 1


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_interleave_imbalance_vanishes_with_length(cp):
    ratios = []
    for n in (1024, 8192, 65536):
        p = pairs(split_batch([n], [0], cp, "interleave"))
        ratios.append(max(p) / min(p))
    assert ratios[0] > ratios[1] > ratios[2]
    assert ratios[2] <= 1.001


@settings(max_examples=100, deadline=None)
@given(num_layers=st.integers(0, 100), cp=st.integers(1, 16))
def test_layer_owner_ranges_partition_layers(num_layers, cp):
    ranges = layer_owner_ranges(num_layers, cp)
    assert len(ranges) == cp
    assert [layer for r in ranges for layer in r] == list(range(num_layers))
    sizes = [len(r) for r in ranges]
    assert sizes == sorted(sizes, reverse=True) and max(sizes) - min(sizes) <= 1
    for rank, r in enumerate(ranges):
        assert all(layer_owner(layer, num_layers, cp) == rank for layer in r)


def test_layer_owner_ranges_extra_layers_go_first():
    assert layer_owner_ranges(10, 4) == [range(0, 3), range(3, 6), range(6, 8), range(8, 10)]
    with pytest.raises(ValueError, match="layer"):
        layer_owner(10, 10, 4)


# --- `cpserve layout` ------------------------------------------------------------------------


def parse(argv):
    parser = argparse.ArgumentParser(prog="cpserve")
    build_parser_layout(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def test_cli_json_worked_example(capsys):
    args = parse(["layout", "--strategy", "zigzag", "--cp", "4", "--lengths", "16", "--json"])
    assert run_layout(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out == {
        "ranks": [
            {"rank": 0, "tokens": [0, 1, 14, 15], "pairs": 34},
            {"rank": 1, "tokens": [2, 3, 12, 13], "pairs": 34},
            {"rank": 2, "tokens": [4, 5, 10, 11], "pairs": 34},
            {"rank": 3, "tokens": [6, 7, 8, 9], "pairs": 34},
        ]
    }


def test_cli_json_with_cached(capsys):
    argv = ["--strategy", "contiguous", "--cp", "2", "--lengths", "4", "--cached", "4", "--json"]
    args = parse(["layout", *argv])
    run_layout(args)
    out = json.loads(capsys.readouterr().out)
    assert [r["pairs"] for r in out["ranks"]] == [11, 15]


def test_cli_table(capsys):
    args = parse(["layout", "--strategy", "interleave", "--cp", "4", "--lengths", "5,3"])
    assert args.func is run_layout
    run_layout(args)
    out = capsys.readouterr().out
    assert "interleave" in out and "0,4" in out and "1,5" in out


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--strategy", "zigzag", "--cp", "2", "--lengths", "5,x"], "--lengths"),
        (["--strategy", "zigzag", "--cp", "0", "--lengths", "5"], "--cp"),
        (["--strategy", "zigzag", "--cp", "two", "--lengths", "5"], "--cp"),
        (["--strategy", "ring", "--cp", "2", "--lengths", "5"], "--strategy"),
        (["--strategy", "zigzag", "--cp", "2", "--lengths", "5,3", "--cached", "1"], "--cached"),
    ],
)
def test_cli_bad_input_names_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as excinfo:
        run_layout(parse(["layout", *argv]))
    assert excinfo.value.code == 2
    assert flag in capsys.readouterr().err
