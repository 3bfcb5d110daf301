"""bench/router_stall.py: heavy chat prompts render to exactly the asked tokens; the loop-lag
histogram's deltas and bucket figures; the phase order and the gap windows; and the benchmark
in small against the router in front of fake backends (issue: "the router never stalls"): while two clients
send prompts at the context limit back to back, four short streams finish without errors, every
heavy request is refused with context_length_exceeded, and the router's
cpserve_router_event_loop_lag_seconds has no sample over 100 ms."""

from __future__ import annotations

import asyncio
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from http_load import Result, probe  # noqa: E402
from router_stall import (LOOP_LAG, REFUSED_CODE, Histogram, build_heavy, figures_of, gaps_in,  # noqa: E402
                          heavy_messages, light_prompts, local_tokenizer, own_cluster, parse_args, parse_histogram,
                          phase_order, run_phase, warm_up)


# ---- pure parts ----------------------------------------------------------------------------------------
def test_heavy_messages_render_to_exactly_the_tokens_asked():
    tok = local_tokenizer("demo")
    empty = len(tok.apply_chat_template([{"role": "user", "content": ""}]))  # the template's own tokens
    for tokens in (empty, empty + 1, 50, 777, 4096):
        messages = heavy_messages(tok, tokens, seed=tokens)
        assert len(tok.apply_chat_template(messages)) == tokens
        assert [m["role"] for m in messages] == ["user"]
    assert heavy_messages(tok, 300, seed=1) == heavy_messages(tok, 300, seed=1)
    with pytest.raises(RuntimeError, match="template alone"):
        heavy_messages(tok, empty - 1)


def metrics_text(*series: tuple[str, dict[str, float], float]) -> str:
    """/metrics text with another family and the loop-lag histogram: per (labels, cumulative
    buckets by le, sum) one labelled series."""
    lines = ["# TYPE other_total counter", "other_total 3", f"# TYPE {LOOP_LAG} histogram"]
    for labels, buckets, total in series:
        sep = "," if labels else ""
        lines += [f'{LOOP_LAG}_bucket{{{labels}{sep}le="{le}"}} {v}' for le, v in buckets.items()]
        lines += [f"{LOOP_LAG}_sum{{{labels}}} {total}", f"{LOOP_LAG}_count{{{labels}}} {buckets['+Inf']}"]
    return "\n".join(lines) + "\n"


def test_loop_lag_histogram_deltas_and_bucket_figures():
    before = parse_histogram(metrics_text(("", {"0.01": 10, "0.1": 10, "0.5": 10, "+Inf": 10}, 0.02)), LOOP_LAG)
    after = parse_histogram(metrics_text(("", {"0.01": 90, "0.1": 109, "0.5": 110, "+Inf": 110}, 1.02)), LOOP_LAG)
    d = after - before
    assert (d.count, d.sum) == (100, pytest.approx(1.0)) and d.buckets[0.1] == 99 and d.within(0.1) == 99
    f = d.figures()
    assert f == {"samples": 100, "mean_s": pytest.approx(0.01), "p99_s": 0.1, "max_s": 0.5, "over_100ms": 1}
    assert (d + d).count == 200 and (d + d).buckets[0.5] == 200
    summed = parse_histogram(metrics_text(('worker="a"', {"0.1": 2, "+Inf": 3}, 0.5),
                                          ('worker="b"', {"0.1": 1, "+Inf": 1}, 0.0)), LOOP_LAG)
    assert summed.buckets == {0.1: 3, math.inf: 4} and summed.count == 4  # summed over other labels
    assert summed.figures()["max_s"] == math.inf and summed.figures()["over_100ms"] == 1
    assert parse_histogram("# TYPE other_total counter\nother_total 3\n", LOOP_LAG) is None
    assert Histogram().figures()["p99_s"] is None


def test_rounds_alternate_the_order_and_gaps_count_in_their_window():
    assert phase_order(3) == [(0, "alone"), (0, "loaded"), (1, "loaded"), (1, "alone"), (2, "alone"), (2, "loaded")]
    # chunks at 10.1, 10.3, 10.6, 11.0 s: gaps of 200, 300, 400 ms ending at 10.3, 10.6, 11.0
    r = Result(0, start=10.0, ttft_ms=100.0, itl_ms=[200.0, 300.0, 400.0])
    assert gaps_in([r], 10.2, 10.7) == [200.0, 300.0]
    assert gaps_in([r, Result(1, start=10.0, ttft_ms=1.0, itl_ms=[5.0], error="HTTP 500")], 0, 99) == [200.0, 300.0,
                                                                                                          400.0]


def test_usage_errors():
    args = parse_args(["--quick"])
    assert (args.model, args.up_args, args.phase_s, args.rounds, args.output_len) == (
        "tiny", "--prefill-cp 1 --decode-dcp 1", 5.0, 2, 16)
    args = parse_args([])
    assert (args.model, args.up_args, args.heavy_kind, args.streams, args.heavy_clients, args.phase_s) == (
        "demo", "", "refused", 4, 2, 20.0)
    assert parse_args(["--quick", "--base-url", "http://x"]).up_args == ""
    for argv in (["--base-url", "http://x", "--up-args", "--pairing load"], ["--tokenizer", "demo"], ["--streams", "0"],
                 ["--phase-s", "0"], ["--heavy-kind", "huge"], ["--api-key", "k"]):
        with pytest.raises(SystemExit):
            parse_args(argv)


# ---- against a router ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster():
    """The router (tiny model's tokenizer and chat template) in front of tests/test_router.py's
    fake prefill and decode backends (a token every 10 ms): the router's own work is what this
    measures, and no engine ranks share the cores with it."""
    from http_load import Target
    from services.common.config import RouterConfig
    from services.router.server import serve_router
    from tests.test_router import FakeDecode, FakePrefill

    h = serve_router(RouterConfig(prefill=("p0",), decode=("d0",), model="tiny", health_interval_s=30.0),
                     [FakePrefill()], [FakeDecode(capacity=65536, delay_s=0.01)])
    try:
        target = Target("router", h.url)
        probe(target, None)
        yield target
    finally:
        h.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_streams_keep_flowing_while_prompts_at_the_limit_are_parsed(cluster):
    """One loaded phase (3 s) of bench/router_stall.py: 4 short streams and 2 clients sending
    chat prompts of exactly max_model_len tokens back to back. The router's event-loop lag
    histogram must exist and hold no sample over 100 ms over the phase."""
    args = parse_args(["--base-url", cluster.url, "--quick", "--phase-s", "3", "--rounds", "1"])
    heavy = build_heavy(local_tokenizer("tiny"), cluster, "refused")
    assert heavy.tokens == heavy.limit > 0  # exactly at the limit (and /tokenize agreed)
    light = light_prompts(args)
    warm_up(cluster, heavy, light, args)
    phase = asyncio.run(run_phase(cluster, light, heavy, args.heavy_clients, args.phase_s, args.timeout, 0, "loaded"))
    f = figures_of([phase], heavy.expected)
    assert f["light_errors"] == 0, f["light_error_messages"]
    assert f["light_requests"] >= args.streams and f["gaps"] > 0
    assert f["heavy_requests"] >= args.heavy_clients
    assert f["heavy_statuses"] == {f"400 {REFUSED_CODE}": f["heavy_requests"]}
    lag = phase.lag
    assert lag is not None, (f"the router's /metrics has no {LOOP_LAG} histogram: it must export the event loop's "
                             "lag (the off-loop parsing change)")
    assert lag.count > 0, "the loop-lag probe took no sample during the phase"
    over = lag.count - lag.within(0.1)
    assert over == 0, (f"{over:g} of {lag.count:g} loop-lag samples over 100 ms while prompts at the limit were "
                       f"parsed; cumulative buckets {lag.buckets}")
