"""bench/serving.py against running endpoints (--base-url): two servers side by side give every
figure for both, without errors, with ordered percentiles and cpserve's TTFT breakdown; the load
generator's pure parts (percentiles, Poisson arrivals, JSONL datasets, goodput) on their own."""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from http_load import (DatasetError, Result, arrival_times, file_prompts, percentile,  # noqa: E402
                       summarise)

FIGURES = [f"{m}_ms_{s}" for m in ("ttft", "tpot", "itl") for s in ("p50", "p90", "p99", "mean")] + [
    "request_throughput_req_s", "output_throughput_tok_s", "goodput_req_s", "mean_prompt_tokens",
    "mean_output_tokens", "wall_s"]


@pytest.fixture(scope="module")
def servers():
    """A `cpserve up --prefill-cp 1 --decode-dcp 1` cluster and bench/reference_server.py (one
    engine behind the router), started together on 127.0.0.1: their base URLs."""
    from services.up import Child, cluster_args, start_cluster, stop_cluster

    ref = Child("reference", [], quiet=True, command=[
        sys.executable, str(ROOT / "bench" / "reference_server.py"), "--model", "tiny", "--stop-on-stdin-eof"])
    cluster = []
    try:
        cluster = start_cluster(cluster_args(["--model", "tiny", "--prefill-cp", "1", "--decode-dcp", "1"]), 0, None,
                                quiet=True)
        ref.wait_ready()
        yield f"http://{cluster[-1].address}", f"http://{ref.address}"
    finally:
        ref.signal_stop()
        stop_cluster(cluster)
        ref.stop()


def run_bench(tmp_path, *argv: str) -> dict:
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "serving.py"), "--json", "--out", str(tmp_path), *argv],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_two_endpoints_side_by_side(servers, tmp_path):
    a, b = servers
    out = run_bench(tmp_path, "--quick", "--base-url", a, "--base-url", b, "--concurrency", "1,4",
                    "--slo-ttft", "60000", "--slo-tpot", "60000")
    names = [t["name"] for t in out["targets"]]
    assert [t["url"] for t in out["targets"]] == [a, b]
    assert all(t["is_cpserve"] and t["model"] == "tiny" for t in out["targets"])
    assert sorted((r["target"], r["level"]) for r in out["results"]) == sorted(
        (n, lv) for n in names for lv in ("c=1", "c=4"))
    for r in out["results"]:
        where = f"{r['target']} {r['level']}"
        assert r["errors"] == 0 and r["not_started"] == 0 and r["completed"] == r["requests"] >= 4, where
        assert r["error_messages"] == [], where
        for k in FIGURES:
            assert math.isfinite(r[k]) and r[k] > 0, (where, k, r[k])
        for m in ("ttft", "tpot", "itl"):
            assert r[f"{m}_ms_p50"] <= r[f"{m}_ms_p90"] <= r[f"{m}_ms_p99"], (where, m)
        assert r["mean_output_tokens"] == 12  # ignore_eos: exactly --output-len (12 with --quick)
        assert 32 <= r["mean_prompt_tokens"] <= 256  # the servers' usage of --input-len 32,256 id prompts
        assert r["goodput_req_s"] == pytest.approx(r["request_throughput_req_s"])  # every request meets 60 s
        # one token per chunk: the mean gap is the per-request token time, averaged over tokens
        assert r["itl_ms_mean"] == pytest.approx(r["tpot_ms_mean"], rel=0.05), where
        # the router's TTFT breakdown over this level: its stages add up to its TTFT, which the
        # client's (request sent -> chunk received) contains
        stages = dict(r["ttft_stages_ms"])
        router_ttft = stages.pop("ttft")
        assert {"parse", "reserve", "prefill_compute", "kv_transfer", "detokenize"} <= set(stages), where
        assert sum(stages.values()) == pytest.approx(router_ttft, rel=1e-3), where
        assert 0 < router_ttft <= r["ttft_ms_mean"] + 0.5, where
        # and per request: every completed request has its record, and TTFT <= its bound counts
        b = r["ttft_bound"]
        assert b["requests_checked"] == r["completed"] and 0 <= b["within_bound"] <= b["requests_checked"], where
    cluster_c1 = next(r for r in out["results"] if r["target"] == names[0] and r["level"] == "c=1")
    assert cluster_c1["ttft_stages_ms"]["prefill_compute"] > 0  # the cluster's prefill service reports its stages
    assert [(r["target"], r["level"]) for r in out["ratios_over_baseline"]] == [(names[1], "c=1"), (names[1], "c=4")]
    assert (tmp_path / "serving.png").stat().st_size > 0


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_one_request_at_a_time_interleaves_the_targets(servers):
    """c=1: prompt i goes to every target (and every offline engine) before prompt i + 1, the
    order rotating with i, never two requests at once; each target's wall time is its own
    requests' time."""
    import argparse

    from http_load import RequestOptions, Target, probe, random_ids
    from serving import OfflineEngine, interleaved

    class Offline(OfflineEngine):  # what the round runs on an engine, with its time
        def __init__(self):
            self.calls = []

        def single(self, index, prompt):
            t0 = time.perf_counter()
            time.sleep(0.01)
            self.calls.append((index, t0, time.perf_counter()))

    targets = [Target("a", servers[0]), Target("b", servers[1])]
    for t in targets:
        probe(t, "tiny")
    offline = Offline()
    prompts = random_ids(5, (8, 16), 3, 300, seed=0)
    args = argparse.Namespace(level_timeout=60)
    got = interleaved(args, targets, prompts, 5, RequestOptions(), {1: offline}, lambda: None)
    spans = sorted([(r.start, r.end, name, r.index) for name, (rs, _, _) in got.items() for r in rs]
                   + [(a, b, "offline", i) for i, a, b in offline.calls])
    assert [(name, i) for _, _, name, i in spans] == [
        ("a", 0), ("b", 0), ("offline", 0), ("b", 1), ("offline", 1), ("a", 1), ("offline", 2), ("a", 2), ("b", 2),
        ("a", 3), ("b", 3), ("offline", 3), ("b", 4), ("offline", 4), ("a", 4)]
    assert all(end <= nxt for (_, end, _, _), (nxt, _, _, _) in zip(spans, spans[1:]))  # one at a time
    for name, (rs, _, wall) in got.items():
        assert all(r.error is None for r in rs) and [r.index for r in rs] == list(range(5))
        assert wall == pytest.approx(sum(r.end - r.start for r in rs))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_levels_in_flight_run_in_rounds_on_every_target(servers):
    """c>1 with --rounds 3: 7 requests as rounds of 3, 2, 2; each round runs on every target
    before the next round starts (the order rotating), the same prompts on each; results keep
    the level's request indices and each target's wall time is the sum of its rounds."""
    import argparse

    from http_load import Level, RequestOptions, Target, probe, random_ids
    from serving import rounds

    class Bar:
        def update(self, n):
            pass

        def set_postfix_str(self, s):
            pass

    targets = [Target("a", servers[0]), Target("b", servers[1])]
    for t in targets:
        probe(t, "tiny")
    prompts = random_ids(7, (8, 16), 3, 300, seed=1)
    args = argparse.Namespace(level_timeout=60, rounds=3, seed=0)
    got = rounds(args, targets, prompts, 7, Level(concurrency=3), RequestOptions(), 1, Bar())
    spans = {}  # (target, round) -> (first start, last end)
    for name, (rs, _, wall) in got.items():
        assert all(r.error is None for r in rs) and sorted(r.index for r in rs) == list(range(7))
        assert all(r.prompt_tokens == len(prompts[r.index].token_ids) for r in rs)
        for rnd, members in enumerate(((0, 1, 2), (3, 4), (5, 6))):
            mine = [r for r in rs if r.index in members]
            spans[name, rnd] = (min(r.start for r in mine), max(r.end for r in mine))
        assert wall < max(r.end for r in rs) - min(r.start for r in rs)  # not the time the other target ran
    order = [key for key, _ in sorted(spans.items(), key=lambda kv: kv[1][0])]
    assert order == [("b", 0), ("a", 0), ("a", 1), ("b", 1), ("b", 2), ("a", 2)]
    assert all(spans[a][1] <= spans[b][0] for a, b in zip(order, order[1:]))  # never two targets at once


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_chat_jsonl_poisson(servers, tmp_path):
    _, ref = servers
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps(x) for x in [
        {"prompt": "Context parallelism splits long prompts.", "max_tokens": 5},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], "max_tokens": 3},
        {"prompt": "A third one", "max_tokens": 7}]) + "\n\n")
    out = run_bench(tmp_path, "--base-url", ref, "--endpoint", "chat", "--dataset", str(data), "--request-rate",
                    "20", "--num-prompts", "6", "--slo-ttft", "0.001")
    (r,) = out["results"]
    assert (r["level"], r["request_rate"], r["concurrency"]) == ("20 req/s", 20, None)
    assert r["errors"] == 0 and r["completed"] == 6
    assert r["mean_output_tokens"] == 5  # the lines' max_tokens, cycled: (5 + 3 + 7) x 2 / 6
    assert r["goodput_req_s"] == 0 < r["request_throughput_req_s"]  # no request meets a 1 us TTFT
    assert r["ttft_ms_p50"] <= r["ttft_ms_p90"] <= r["ttft_ms_p99"]


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_unreachable_or_bad_input_is_a_message(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": 5}\n')
    closed = ["--base-url", "http://127.0.0.1:9"]  # nothing listens on the discard port
    for argv, needle in [([*closed, "--concurrency", "1"], "cannot reach"),
                         ([*closed, "--concurrency", "1,x"], "--concurrency"),
                         (["--request-rate", "2"], "--request-rate needs --base-url"),
                         ([*closed, "--dataset", str(tmp_path / "none.jsonl")], "--dataset"),
                         ([*closed, "--dataset", str(bad)], "bad.jsonl:2: prompt must be")]:
        proc = subprocess.run([sys.executable, str(ROOT / "bench" / "serving.py"), *argv], cwd=ROOT,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode != 0 and needle in proc.stderr and "Traceback" not in proc.stderr, (argv, proc.stderr)


def test_percentile_interpolates():
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.5
    assert percentile([1.0, 2.0], 99) == pytest.approx(1.99)
    assert percentile([7.0], 90) == 7.0
    assert math.isnan(percentile([], 50))


def test_poisson_arrivals_are_seeded_and_at_the_rate():
    times = arrival_times(4000, 8.0, seed=1)
    assert times == arrival_times(4000, 8.0, seed=1) != arrival_times(4000, 8.0, seed=2)
    assert times[0] == 0 and all(b >= a for a, b in zip(times, times[1:]))
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert statistics.mean(gaps) == pytest.approx(1 / 8, rel=0.05)
    assert statistics.stdev(gaps) == pytest.approx(1 / 8, rel=0.08)  # exponential: sd = mean


def test_jsonl_dataset(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "hi"}\n\n{"prompt": [5, 6], "max_tokens": 3}\n')
    got = file_prompts(str(path), 3, 9, chat=False)
    assert [(p.payload, p.output_len) for p in got] == [({"prompt": "hi"}, 9), ({"prompt": [5, 6]}, 3),
                                                        ({"prompt": "hi"}, 9)]
    chat_path = tmp_path / "c.jsonl"
    chat_path.write_text('{"prompt": "hi"}')
    assert file_prompts(str(chat_path), 1, 9, chat=True)[0].payload == {"messages": [{"role": "user", "content": "hi"}]}
    for text, chat_mode, needle in [('{"messages": [{"role": "user", "content": "x"}]}', False, ":1: 'messages' needs"),
                                    ('{"prompt": "x"}\n{"prompt": [1, 2]}', True, ":2: prompt must be"),
                                    ('{"prompt": "x", "max_tokens": 0}', False, ":1: max_tokens"),
                                    ('{"prompt": "x"}\nnot json', False, ":2: not JSON"),
                                    ('{"text": "x"}', False, ":1: needs an object"), ("\n", False, "no prompts")]:
        path.write_text(text)
        with pytest.raises(DatasetError, match=needle):
            file_prompts(str(path), 1, 9, chat=chat_mode)


def test_goodput_counts_requests_meeting_every_slo():
    def done(i, ttft, tpot):
        return Result(i, start=0.0, end=2.0, ttft_ms=ttft, tpot_ms=tpot, itl_ms=[tpot], output_tokens=2)

    results = [done(0, 10, 5), done(1, 30, 5), done(2, 10, 50), Result(3, start=0.0, end=1.0, error="HTTP 500")]
    s = summarise(results, 5, 0.0, slo_ttft_ms=20, slo_tpot_ms=20)
    assert (s["completed"], s["errors"], s["not_started"]) == (3, 1, 1)
    assert s["goodput_req_s"] == 0.5 and s["request_throughput_req_s"] == 1.5  # 1 and 3 requests in 2 s
    assert s["output_throughput_tok_s"] == 3.0
    assert summarise(results, 5, 0.0, None, None)["goodput_req_s"] == 1.5
    assert s["ttft_ms_p50"] == 10 and s["tpot_ms_p99"] == pytest.approx(49.1)


def test_per_request_ttft_bound_uses_each_requests_own_breakdown():
    """Issue 15: TTFT <= 1.2 x (prefill queue + own prefill compute) + 20 ms, request by request."""
    from http_load import ttft_bound_check

    def rec(queue, compute):
        return {"stages_ms": {"prefill_queue": queue, "prefill_compute": compute, "kv_transfer": 9.0}}

    results = [Result(0, ttft_ms=100.0, response_id="a"), Result(1, ttft_ms=400.0, response_id="b"),
               Result(2, ttft_ms=50.0, response_id="c"), Result(3, ttft_ms=10.0, response_id="d", error="HTTP 500")]
    records = {"a": rec(0.0, 70.0), "b": rec(200.0, 100.0), "d": rec(0.0, 1.0)}  # c: no record
    out = ttft_bound_check(results, records)
    # a: bound 1.2 * 70 + 20 = 104 >= 100; b: 1.2 * 300 + 20 = 380 < 400 (20 ms over)
    assert (out["requests_checked"], out["within_bound"]) == (2, 1)
    assert out["worst_over_bound_ms"] == pytest.approx(20.0)


def test_stage_scrape_takes_one_ttft_and_sums_over_labels(monkeypatch):
    """The breakdown reads the router's stage histogram whatever other labels it carries
    (model_name), and counts TTFT once when it is exported under both its names."""
    import http_load

    text = "\n".join([
        "# TYPE cpserve_router_ttft_seconds histogram", "cpserve_router_ttft_seconds_sum 0.5",
        "cpserve_router_ttft_seconds_count 2",
        "# TYPE cpserve:time_to_first_token_seconds histogram",
        'cpserve:time_to_first_token_seconds_sum{model_name="m"} 0.5',
        'cpserve:time_to_first_token_seconds_count{model_name="m"} 2',
        "# TYPE cpserve_router_ttft_stage_seconds histogram",
        *(f'cpserve_router_ttft_stage_seconds_{k}{{stage="{st}",model_name="{m}"}} {v}'
          for st, m, s, c in [("parse", "a", 0.1, 1), ("parse", "b", 0.05, 1), ("reserve", "a", 0.35, 2)]
          for k, v in (("sum", s), ("count", c)))]) + "\n"
    monkeypatch.setattr(http_load.httpx, "get", lambda *a, **k: type("R", (), {"text": text})())
    sums = http_load.ttft_stage_sums(http_load.Target("t", "http://127.0.0.1:9"))
    assert list(sums) == ["parse", "reserve", "ttft"]
    assert sums["parse"] == pytest.approx((0.15, 2)) and sums["ttft"] == (0.5, 2)
    means = http_load.stage_means_ms({"parse": (0.05, 1)}, sums)
    assert means["parse"] == pytest.approx(100.0) and means["ttft"] == pytest.approx(250.0)
