"""engine.parallel.ring's selector: pass-KV or pass-Q per forward from its sizes (pure)."""

import pytest

from engine.parallel.layout import check_ring_mode
from engine.parallel.ring import RingCosts, ring_estimates

# an absorbed-MLA-sized case: a 576-value entry (fp32) against 128 heads × 576-value queries,
# with constants of the order this machine measures (PrefillRank.calibrate)
MLA = RingCosts(entry_bytes=576 * 4, query_bytes=128 * 576 * 4, output_bytes=128 * 513 * 4,
                pair_s=2e-8, row_s=2e-5, byte_s=3e-9)


def pick(new, cached, c=2, costs=MLA):
    est = ring_estimates(new, cached, c, costs)
    return "pass_q" if est["pass_q"] < est["pass_kv"] else "pass_kv"


def test_full_prefill_passes_kv_and_a_short_turn_over_a_long_prefix_passes_q():
    assert pick([16384], [0]) == "pass_kv"
    assert pick([64], [131072]) == "pass_q"


def test_the_choice_flips_once_as_the_new_share_grows():
    """Over T/(T+P) at a fixed history the estimates cross once: pass-Q below, pass-KV above."""
    total = 65536
    picks = [pick([t], [total - t], c=4) for t in (16, 64, 256, 1024, 4096, 16384, 65536)]
    first_kv = picks.index("pass_kv")
    assert picks[:first_kv] == ["pass_q"] * first_kv and set(picks[first_kv:]) == {"pass_kv"}
    assert 0 < first_kv < len(picks)


def test_hidden_transfers_cost_nothing_and_free_bandwidth_makes_the_work_decide():
    """With sends free, pass-KV costs C − 1 more block expansions than pass-Q: pass-Q wins; with
    expansion free too, the two are equal (ties go to pass-KV)."""
    free = RingCosts(**{**MLA.__dict__, "byte_s": 0.0})
    est = ring_estimates([4096], [4096], 4, free)
    assert est["pass_q"] < est["pass_kv"]
    assert est["pass_kv"] - est["pass_q"] == pytest.approx(3 * 8192 / 4 * MLA.row_s)
    both = RingCosts(**{**free.__dict__, "row_s": 0.0})
    est = ring_estimates([4096], [4096], 4, both)
    assert est["pass_q"] == pytest.approx(est["pass_kv"])


def test_mode_names_are_checked():
    assert check_ring_mode("auto") == "auto"
    with pytest.raises(ValueError, match="cp_ring_mode"):
        check_ring_mode("pass_x")


def test_cp_attention_is_checked_against_the_layout():
    from engine.parallel.layout import check_cp_attention
    assert check_cp_attention("ring", "zigzag", False) == "ring"
    with pytest.raises(ValueError, match="layer_split"):
        check_cp_attention("ring", "interleave", True)
    with pytest.raises(ValueError, match="cp_attention"):
        check_cp_attention("rings", "interleave", False)
