"""bench/multiturn.py: conversations grow by exactly the answer and the tool output; the figures
from per-request records (TTFT percentiles and ratios, cache and KV figures, unknowns as None,
mismatches); reusable vs reused tokens per turn and each service's share of the paired requests
from a router's /metrics (`--pairings`); a whole run against a fake OpenAI server with a
page-granular prefix cache that honours cache_salt (the JSON last line); and one `--quick --json`
run against a started tiny cluster. Also bench/serving.py's `--reuse on,off` (issue 40 too): prompts with no shared
page-aligned prefix, a level's own prompts, and a quick run whose requests find nothing cached."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from http_load import Prompt, Result  # noqa: E402
from multiturn import (KINDS, NO_REUSE, OwnClusters, Sent, build_conversations, figures, mismatches,  # noqa: E402
                       pairing_counter_figures, parse_args, parse_pairing_counters, reusable_tokens, reuse_figures,
                       throughput, turn_rows)


# ---- conversations ---------------------------------------------------------------------------------
def test_conversations_share_the_system_prompt_and_are_seeded():
    convs = build_conversations(3, 32, 100, 20, 4, vocab=50, seed=1)
    assert [c.index for c in convs] == [0, 1, 2] and all(c.turns == 4 for c in convs)
    assert len({c.system for c in convs}) == 1 and len(convs[0].system) == 32
    assert len({c.first for c in convs}) == 3  # each its own first context
    for c in convs:
        assert len(c.first) == 100 and [len(t) for t in c.tools] == [20, 20, 20]
        assert all(3 <= i < 50 for i in (*c.system, *c.first, *(i for t in c.tools for i in t)))
    assert convs == build_conversations(3, 32, 100, 20, 4, vocab=50, seed=1)
    assert convs != build_conversations(3, 32, 100, 20, 4, vocab=50, seed=2)
    assert build_conversations(1, 0, 8, 4, 1, vocab=50, seed=0)[0].tools == ()


def test_each_turn_appends_the_answer_and_the_tool_output():
    (c,) = build_conversations(1, 16, 40, 10, 4, vocab=300, seed=0)
    answers = [[1000 + k, 2000 + k] for k in range(3)]
    assert c.prompt(0, []) == [*c.system, *c.first] and c.new_tokens(0, []) == list(c.first)
    for t in range(1, 4):
        before, now, new = c.prompt(t - 1, answers), c.prompt(t, answers), c.new_tokens(t, answers)
        assert now == before + new  # the previous prompt is a prefix: everything before is reusable
        assert new == [*answers[t - 1], *c.tools[t - 1]]
        assert len(now) == 16 + 40 + t * (2 + 10)
    assert c.prompt(2, answers[:2]) == c.prompt(2, answers)  # a turn needs only the earlier answers


# ---- figures from records ----------------------------------------------------------------------------
def sent(target, conv, turn, kind, ttft, ids=(5, 6), cached=None, rid=None, prompt=100, new=10, error=None, key=None,
         dur=1.0):
    r = Result(0, start=0.0, end=dur, ttft_ms=ttft, output_tokens=len(ids), prompt_tokens=prompt, ids=list(ids),
               error=error, response_id=rid, cached_tokens=cached)
    return Sent(target, conv, turn, kind, prompt, new, key if key is not None else hash((conv, turn)), r)


def test_turn_figures_from_fake_records():
    runs = [sent("a", c, 1, "on", 10.0 * (c + 1), cached=80, rid=f"on{c}") for c in range(2)]
    runs += [sent("a", c, 1, "cold", 100.0 + c, rid=f"cold{c}") for c in range(2)]
    runs += [sent("a", c, 1, "ideal", 8.0, prompt=10) for c in range(2)]
    runs += [sent("a", 0, 0, "on", 50.0, rid="x", error="HTTP 500")]
    records = {"a": {"on0": {"ttft_ms": 9.0, "stages_ms": {"parse": 1.0, "prefill_compute": 6.0},
                             "decode_cached_tokens": 90, "transfer_bytes": 1000},
                     "on1": {"ttft_ms": 19.0, "stages_ms": {"parse": 3.0, "prefill_compute": 14.0}},  # older router
                     "cold0": {"transfer_bytes": 9000}, "cold1": {"transfer_bytes": 11000}}}
    rows = turn_rows(runs, records, ["a"], 2)
    first, second = rows
    assert (first["turn"], first["conversations"], first["errors"]) == (0, 0, 1)
    assert math.isnan(first["on_ttft_ms_p50"]) and first["cached_tokens"] is None and first["hit_rate"] is None
    r = second
    assert (r["conversations"], r["errors"], r["prompt_tokens"], r["new_tokens"]) == (2, 0, 100, 10)
    assert r["on_ttft_ms_p50"] == 15.0 and r["on_ttft_ms_p99"] == pytest.approx(19.9)
    assert r["cold_ttft_ms_p50"] == 100.5 and r["ideal_ttft_ms_p50"] == 8.0
    assert r["on_over_cold"] == pytest.approx(15 / 100.5) and r["on_over_ideal"] == pytest.approx(15 / 8)
    assert r["stages_ms"] == {"parse": 2.0, "prefill_compute": 10.0} and r["router_ttft_ms"] == 14.0
    assert r["cached_tokens"] == 80 and r["hit_rate"] == 0.8
    # decode_cached_tokens and transfer_bytes: known for one request only, the other's unknown
    assert r["decode_cached_tokens"] == 90 and r["decode_hit_rate"] == 0.9
    assert r["transfer_bytes"] == 1000 and r["cold_transfer_bytes"] == 10000


def test_cached_tokens_fall_back_to_the_router_record_and_unknown_stays_none():
    runs = [sent("a", 0, 0, "on", 5.0, rid="r0"), sent("a", 1, 0, "on", 5.0, rid="r1")]
    row = turn_rows(runs, {"a": {"r0": {"cached_tokens": 32}}}, ["a"], 1)[0]
    assert row["cached_tokens"] == 32 and row["hit_rate"] == 0.32  # r1 unknown: not counted as 0
    row = turn_rows(runs, {}, ["a"], 1)[0]
    assert row["cached_tokens"] is None and row["decode_cached_tokens"] is None and row["transfer_bytes"] is None
    assert row["stages_ms"] == {} and row["router_ttft_ms"] is None


def test_mismatches_compare_equal_prompts_only():
    runs = [sent("a", 0, 0, "on", 1, ids=(1, 2, 3)), sent("a", 0, 0, "cold", 1, ids=(1, 2, 3)),
            sent("a", 0, 1, "on", 1, ids=(1, 2, 3)), sent("a", 0, 1, "cold", 1, ids=(1, 9, 3)),
            sent("a", 0, 2, "on", 1), sent("a", 0, 2, "cold", 1, error="HTTP 500"),
            # the twin: equal prompt at turn 0 (compared, equal), another prompt at turn 1 (not compared)
            sent("a off", 0, 0, "on", 1, ids=(1, 2, 3)), sent("a off", 0, 1, "on", 1, ids=(7,), key=-1)]
    out = mismatches(runs, {"a": "a off"})
    assert (out["compared"], out["mismatches"]) == (2, 1)
    assert (out["compared_vs_no_reuse"], out["mismatches_vs_no_reuse"]) == (1, 0)
    assert out["examples"] == ["a conversation 0 turn 1: on vs cold, first differs at output 1"]


def test_throughput_and_the_json_figures():
    runs = [sent("a", c, t, k, 10.0, dur=0.5, prompt=200) for c in range(2) for t in range(3) for k in KINDS]
    runs.append(sent("a", 2, 0, "on", 1.0, error="HTTP 400: cache_salt"))
    rows = throughput(runs, ["a"])
    assert [(r["kind"], r["requests"], r["errors"]) for r in rows] == [("on", 7, 1), ("cold", 6, 0), ("ideal", 6, 0)]
    assert rows[1]["busy_s"] == 3.0 and rows[1]["prompt_tok_s"] == 400.0 and rows[1]["output_tok_s"] == 4.0
    out = figures(runs, {}, ["a"], {}, 3, wall_s=10.0)
    assert (out["requests"], out["errors"], out["error_messages"]) == (19, 1, ["HTTP 400: cache_salt"])
    assert out["output_tok_s"] == pytest.approx(36 / 10) and out["salted_cached_nonzero"] == 0
    assert out["summary"]["a"]["requests"] == 12  # turns 1 and 2
    json.dumps(out)  # every figure serialises


def test_salted_requests_that_report_cached_tokens_are_counted():
    runs = [sent("a", 0, 0, "cold", 1, cached=16), sent("a", 0, 0, "ideal", 1, cached=0),
            sent("a", 0, 0, "on", 1, cached=64)]
    assert figures(runs, {}, ["a"], {}, 1, 1.0)["salted_cached_nonzero"] == 1


def test_usage_errors():
    args = parse_args(["--quick", "--base-url", "http://x"])
    assert (args.first_len, args.turns, args.output_len, args.shapes) == (1024, 3, 8, [])
    args = parse_args(["--quick", "--turns", "5"])
    assert (args.model, args.shapes, args.turns) == ("tiny", [(1, 1)], 5)
    assert (parse_args([]).model, parse_args([]).shapes) == ("demo", [])
    for argv in (["--base-url", "http://x", "--compare-off"], ["--base-url", "http://x", "--clusters", "1+1"],
                 ["--turns", "0"], ["--clusters", "2x2"], ["--api-key", "k"], ["--vocab-size", "3"]):
        with pytest.raises(SystemExit):
            parse_args(argv)


# ---- reuse across turns and pairing over services (--pairings) ---------------------------------------------
def test_reusable_tokens_examples():
    # prefill: the previous prompt's whole pages; decode: also the answer's KV but its last token's
    assert reusable_tokens(100, 8, 150) == (96, 96)  # 100 // 16 * 16; 107 // 16 * 16
    assert reusable_tokens(96, 8, 150) == (96, 96)  # decode: 103 -> 96
    assert reusable_tokens(96, 17, 150) == (96, 112)  # decode: 112 tokens held, two pages past prefill's
    assert reusable_tokens(32, 1, 33) == (32, 32)  # decode holds the prompt alone (the answer's one token unfed)
    assert reusable_tokens(32, 8, 32) == (16, 16)  # never the prompt's last token: capped at (32 - 1) // 16 pages
    assert reusable_tokens(10, 3, 20) == (0, 0)  # less than a page


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 5000), st.integers(1, 300), st.integers(0, 3000))
def test_reusable_tokens_properties(prev_prompt, prev_output, growth):
    prompt = prev_prompt + prev_output + growth  # the next turn extends the previous prompt and its answer
    prefill, decode = reusable_tokens(prev_prompt, prev_output, prompt)
    for v in (prefill, decode):
        assert v % 16 == 0 and 0 <= v <= prompt - 1  # whole pages, never the last token
    assert prefill <= prev_prompt and decode <= prev_prompt + prev_output - 1  # only what the last turn left
    assert prefill <= decode  # decode held everything prefill did, and the answer
    assert prev_prompt - prefill < 16  # and lost less than a page of the previous prompt
    assert min(prev_prompt + prev_output - 1, prompt - 1) - decode < 16


def test_reuse_figures_over_later_turns():
    ids = tuple(range(8))  # 8-token answers
    runs = [sent("a", 0, 0, "on", 1, ids=ids, prompt=100, rid="a00"),
            sent("a", 0, 1, "on", 1, ids=ids, prompt=140, cached=96, rid="a01"),  # reusable 96 / 96
            sent("a", 0, 2, "on", 1, ids=ids, prompt=180, cached=64, rid="a02"),  # 128 / 144 (147 -> 144)
            sent("a", 0, 1, "cold", 1, prompt=140, cached=0),  # not an "on" request: not counted
            sent("a", 1, 0, "on", 1, ids=ids, prompt=100),
            sent("a", 1, 1, "on", 1, ids=ids, prompt=140, error="HTTP 500"),  # failed: neither it nor turn 2
            sent("a", 1, 2, "on", 1, ids=ids, prompt=180, cached=128),
            sent("b", 0, 1, "on", 1, ids=ids, prompt=140, cached=96)]  # another target (and no turn 0)
    records = {"a": {"a01": {"decode_cached_tokens": 96}, "a02": {"decode_cached_tokens": 144}}}
    f = reuse_figures(runs, records, "a")
    assert f["requests"] == 2
    assert f["prefill"] == {"reusable_tokens": 96 + 128, "reused_tokens": 96 + 64, "requests_reporting": 2,
                            "reused_over_reusable": pytest.approx(160 / 224)}
    assert f["decode"] == {"reusable_tokens": 96 + 144, "reused_tokens": 240, "requests_reporting": 2,
                           "reused_over_reusable": 1.0}
    # decode reuse known for one request only: reusable over that one; none known: None
    f = reuse_figures(runs, {"a": {"a02": {"decode_cached_tokens": 100}}}, "a")
    assert (f["decode"]["reusable_tokens"], f["decode"]["reused_tokens"], f["decode"]["requests_reporting"]) == \
        (144, 100, 1)
    f = reuse_figures(runs, {}, "a")
    assert f["decode"] == {"reusable_tokens": 240, "reused_tokens": None, "requests_reporting": 0,
                           "reused_over_reusable": None}
    assert reuse_figures(runs, {}, "b")["requests"] == 0 and reuse_figures(runs, {}, "b")["prefill"][
        "reused_over_reusable"] is None


def router_metrics_text(paired: dict[tuple[str, str], int], decisions: dict[str, int]) -> str:
    """The /metrics text of a real router's metrics object after these pairings."""
    from services.router.metrics import RouterMetrics

    m = RouterMetrics("m")
    for (kind, service), n in paired.items():
        m.paired.labels(kind, service).inc(n)
    for reason, n in decisions.items():
        m.pairing_decisions.labels(reason).inc(n)
    return m.render().decode()


def test_pairing_counters_from_a_routers_metrics():
    text = router_metrics_text({("prefill", "h:1"): 3, ("prefill", "h:2"): 0, ("decode", "h:3"): 3},
                               {"prefix": 2, "load": 1})
    got = parse_pairing_counters(text)
    assert got == {"paired": {"prefill": {"h:1": 3.0, "h:2": 0.0}, "decode": {"h:3": 3.0}},
                   "decisions": {"prefix": 2.0, "affinity": 0.0, "load": 1.0, "balance": 0.0}}
    hand = """# HELP cpserve_service_paired_requests_total x
# TYPE cpserve_service_paired_requests_total counter
cpserve_service_paired_requests_total{kind="prefill",service="a:1"} 5.0
cpserve_service_paired_requests_created{kind="prefill",service="a:1"} 1.7e+09
"""
    assert parse_pairing_counters(hand) == {"paired": {"prefill": {"a:1": 5.0}}, "decisions": {}}
    assert parse_pairing_counters("vllm:num_requests_running 0.0\n") is None  # not cpserve: no figures
    assert parse_pairing_counters("<html>not found</html>") is None


def test_shares_and_decisions_are_the_runs_differences():
    before = parse_pairing_counters(router_metrics_text({("prefill", "p:1"): 1, ("decode", "d:1"): 1},
                                                        {"load": 1}))  # the warm-up
    after = parse_pairing_counters(router_metrics_text(
        {("prefill", "p:1"): 7, ("prefill", "p:2"): 4, ("decode", "d:1"): 6, ("decode", "d:2"): 5},
        {"load": 3, "prefix": 6, "balance": 2}))
    f = pairing_counter_figures(before, after)
    assert f["paired_requests"] == {"prefill": {"p:1": 6, "p:2": 4}, "decode": {"d:1": 5, "d:2": 5}}
    assert f["shares"] == {"prefill": {"p:1": 0.6, "p:2": 0.4}, "decode": {"d:1": 0.5, "d:2": 0.5}}
    assert (f["prefill_share_min"], f["prefill_share_max"], f["decode_share_min"], f["decode_share_max"]) == \
        (0.4, 0.6, 0.5, 0.5)
    assert f["decisions"] == {"affinity": 0, "balance": 2, "load": 2, "prefix": 6}
    idle = pairing_counter_figures(after, after)  # nothing paired during the run: no shares
    assert idle["shares"] == {"prefill": {}, "decode": {}} and idle["prefill_share_min"] is None
    unknown = pairing_counter_figures(None, after)
    assert all(v is None for v in unknown.values())
    # in the figures: per target, with the pairing policy; a target without counters has None
    runs = [sent("a", 0, 0, "on", 1), sent("a", 0, 1, "on", 1, cached=96, prompt=120)]
    out = figures(runs, {}, ["a", "b"], {}, 2, 1.0, {"a": "load"}, {"a": (before, after)})
    assert out["pairing"]["a"]["pairing"] == "load" and out["pairing"]["a"]["prefill_share_max"] == 0.6
    assert out["pairing"]["a"]["prefill"]["reused_tokens"] == 96 and out["pairing"]["a"]["requests"] == 1
    assert out["pairing"]["b"]["pairing"] is None and out["pairing"]["b"]["decisions"] is None
    json.dumps(out)


def test_pairings_option():
    args = parse_args(["--quick", "--pairings", "cache_aware,load", "--clusters", "1+1,2+1", "--compare-off",
                       "--up-args=--prefill-services 2 --decode-services 2"])
    assert args.pairings == ["cache_aware", "load"]
    own = OwnClusters(args)  # parses each cluster's `cpserve up` flags; starts nothing
    first, other = "cluster 1+1 pairing=cache_aware", "cluster 1+1 pairing=load"
    assert list(own.argv) == [first, first + NO_REUSE, other, "cluster 2+1 pairing=cache_aware",
                              "cluster 2+1 pairing=cache_aware" + NO_REUSE, "cluster 2+1 pairing=load"]
    assert own.argv[other][-2:] == ["--pairing", "load"] and "--prefill-services" in own.argv[other]
    assert own.spaces[other].pairing == "load" and own.spaces[first].pairing == "cache_aware"
    assert own.spaces[first + NO_REUSE].prefix_cache is False and own.spaces[other].prefill_services == 2
    # policies compared: every cluster gets "on" requests only (the routers' counts are the conversations')
    assert own.kinds[first] == own.kinds[other] == own.kinds[first + NO_REUSE] == ("on",)
    assert own.twins == {first: first + NO_REUSE, "cluster 2+1 pairing=cache_aware":
                         "cluster 2+1 pairing=cache_aware" + NO_REUSE}
    assert own.pairing[other] == "load" and own.pairing[first + NO_REUSE] == "cache_aware"
    plain = OwnClusters(parse_args(["--quick"]))  # without --pairings: as before
    assert list(plain.argv) == ["cluster 1+1"] and plain.pairing == {"cluster 1+1": None}
    assert "--pairing" not in plain.argv["cluster 1+1"] and plain.kinds == {"cluster 1+1": KINDS}
    assert parse_args(["--pairings", "load"]).pairings == ["load"] and parse_args([]).pairings == []
    assert list(OwnClusters(parse_args(["--pairings", "load"])).argv) == ["cluster pairing=load"]
    for argv in (["--base-url", "http://x", "--pairings", "load"], ["--pairings", "cache_aware,cache_aware"],
                 ["--pairings", "round_robin"], ["--pairings", ""], ["--pairings", "load", "--up-args=--pairing load"],
                 ["--pairings", "load", "--up-args=--pairing=load"]):
        with pytest.raises(SystemExit):
            parse_args(argv)


# ---- a whole run against a fake server ------------------------------------------------------------------
class FakeServer(ThreadingHTTPServer):
    """/v1/completions streaming token ids, a deterministic function of the prompt, and a
    prefix cache of 16-token pages keyed by (salt, prefix) that reports cached tokens;
    /debug/ttft with the records a cpserve router keeps."""

    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), FakeHandler)
        self.pages: set = set()
        self.records: list[dict] = []
        self.paired = {("prefill", "p:1"): 0, ("prefill", "p:2"): 0, ("decode", "d:1"): 0}
        self.lock = threading.Lock()


class FakeHandler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def _json(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/v1/models":
            self._json({"data": [{"id": "fake", "owned_by": "cpserve"}]})
        elif self.path == "/debug/ttft":
            with self.server.lock:
                self._json({"requests": list(self.server.records)})
        elif self.path == "/metrics":
            with self.server.lock:
                text = router_metrics_text(self.server.paired, {"load": sum(self.server.paired.values()) // 2})
            data = text.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        else:
            self.send_error(404)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        ids, salt, n = body["prompt"], body.get("cache_salt", ""), body["max_tokens"]
        pages = [(salt, tuple(ids[:end])) for end in range(16, len(ids) + 1, 16)]
        with self.server.lock:
            cached = 16 * next((i for i, p in enumerate(pages) if p not in self.server.pages), len(pages))
            self.server.pages.update(pages)
            rid = f"cmpl-{len(self.server.records)}"
            self.server.records.append({"id": rid, "ttft_ms": 1.0, "stages_ms": {"parse": 0.5, "prefill_compute": 0.5},
                                        "cached_tokens": cached, "transfer_bytes": 10 * (len(ids) - cached)})
            self.server.paired["prefill", "p:1" if len(self.server.records) % 2 else "p:2"] += 1
            self.server.paired["decode", "d:1"] += 1
        out = [3 + (sum(ids) + k) % 200 for k in range(n)]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for tok in out:
            chunk = {"id": rid, "choices": [{"index": 0, "text": "x", "token_ids": [tok]}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        usage = {"prompt_tokens": len(ids), "completion_tokens": n, "prompt_tokens_details": {"cached_tokens": cached}}
        self.wfile.write(f"data: {json.dumps({'id': rid, 'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())


@pytest.fixture
def fake_server():
    server = FakeServer()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def run_bench(tmp_path, *argv: str, timeout: float = 120) -> dict:
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "multiturn.py"), "--json", "--out", str(tmp_path),
                           *argv], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(60)
def test_a_run_against_a_fake_server(fake_server, tmp_path):
    out = run_bench(tmp_path, "--base-url", fake_server, "--system-len", "32", "--first-len", "64", "--growth", "24",
                    "--output-len", "8", "--turns", "3", "--conversations", "3", "--concurrency", "2")
    assert out["mode"] == "base_url" and out["targets"][0]["model"] == "fake" and out["targets"][0]["is_cpserve"]
    assert (out["requests"], out["errors"], out["mismatches"], out["compared"]) == (27, 0, 0, 9)
    assert out["salted_cached_nonzero"] == 0  # fresh salts hit nothing
    rows = {r["turn"]: r for r in out["turns"]}
    assert [rows[t]["prompt_tokens"] for t in range(3)] == [96, 128, 160]
    assert [rows[t]["new_tokens"] for t in range(3)] == [64, 32, 32]
    assert rows[0]["cached_tokens"] == 32  # the system prompt, cached by the warm-up
    assert rows[1]["cached_tokens"] == 96 and rows[2]["cached_tokens"] == 128  # the whole previous prompt
    assert rows[2]["hit_rate"] == 0.8 and rows[2]["transfer_bytes"] == 320 and rows[2]["cold_transfer_bytes"] == 1600
    assert rows[2]["stages_ms"] == {"parse": 0.5, "prefill_compute": 0.5} and rows[2]["decode_cached_tokens"] is None
    for r in out["turns"]:
        assert r["conversations"] == 3 and r["errors"] == 0
        for k in KINDS:
            assert 0 < r[f"{k}_ttft_ms_p50"] <= r[f"{k}_ttft_ms_p99"]
    assert [(r["kind"], r["requests"]) for r in out["throughput"]] == [("on", 9), ("cold", 9), ("ideal", 9)]
    # turns 1 and 2 of 3 conversations: the whole previous prompt was reusable (96 + 128) and reused
    (name,) = out["pairing"]
    f = out["pairing"][name]
    assert f["pairing"] is None and f["requests"] == 6
    assert f["prefill"]["reusable_tokens"] == 3 * (96 + 128) and f["prefill"]["reused_over_reusable"] == 1.0
    assert f["decode"]["reused_tokens"] is None  # the fake says nothing of decode
    # the run's 27 requests (not the warm-up), alternating between two prefill services
    assert sum(f["paired_requests"]["prefill"].values()) == 27 and f["paired_requests"]["decode"] == {"d:1": 27}
    assert f["prefill_share_min"] == pytest.approx(13 / 27) and f["prefill_share_max"] == pytest.approx(14 / 27)
    assert f["decode_share_min"] == f["decode_share_max"] == 1.0 and f["decisions"]["load"] >= 13
    assert (tmp_path / "multiturn.png").stat().st_size > 0


# ---- against a cluster ----------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_quick_run_against_a_started_cluster(tmp_path):
    """`--quick --json`: a tiny 1 + 1 cluster with KV reuse on; the later turns find the
    conversation's previous prompt cached, cold prompts (fresh salts) find nothing, and reuse
    does not change a greedy answer."""
    out = run_bench(tmp_path, "--quick", timeout=110)
    assert out["mode"] == "own" and out["targets"][0]["name"] == "cluster 1+1"
    assert out["errors"] == 0 and out["mismatches"] == 0 and out["compared"] == 3
    assert out["salted_cached_nonzero"] == 0
    rows = {r["turn"]: r for r in out["turns"]}
    for t in (1, 2):
        # everything before the turn's new tokens is cached, to the page
        assert rows[t]["cached_tokens"] >= (rows[t]["prompt_tokens"] - rows[t]["new_tokens"]) // 16 * 16 - 16
        assert rows[t]["on_over_cold"] < 1
    assert out["summary"]["cluster 1+1"]["hit_rate"] > 0.5
    assert (tmp_path / "multiturn.png").stat().st_size > 0


# ---- bench/serving.py --reuse ---------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(3, 5), min_size=0, max_size=40), max_size=30), st.integers(0, 3))
def test_distinct_first_pages(prompts, seed):
    """No two prompts of a page or more share their first page (so no page-aligned prefix at
    all); only a repeated first page is drawn again; lengths, tails and short prompts stay."""
    from serving import PAGE_TOKENS, distinct_first_pages

    given_prompts = [Prompt({"prompt": ids, "extra": i}, 7) for i, ids in enumerate(prompts)]
    out = distinct_first_pages(given_prompts, vocab=6, seed=seed)
    firsts = [tuple(p.token_ids[:PAGE_TOKENS]) for p in out if len(p.token_ids) >= PAGE_TOKENS]
    assert len(firsts) == len(set(firsts))
    seen = set()
    for before, after in zip(given_prompts, out):
        a, b = before.token_ids, after.token_ids
        assert len(a) == len(b) and a[PAGE_TOKENS:] == b[PAGE_TOKENS:] and all(3 <= t < 6 for t in b)
        assert after.payload["extra"] == before.payload["extra"] and after.output_len == 7
        if len(a) < PAGE_TOKENS or tuple(a[:PAGE_TOKENS]) not in seen:
            assert a == b  # a first page not seen before is kept
        seen.add(tuple(b[:PAGE_TOKENS]))
    assert out == distinct_first_pages(given_prompts, vocab=6, seed=seed)


def test_reuse_option_and_each_levels_own_prompts(monkeypatch):
    import argparse

    import serving
    from http_load import Level

    p = argparse.ArgumentParser()
    assert serving.parse_reuse(p, None) is None
    assert serving.parse_reuse(p, "on,off") == [True, False] and serving.parse_reuse(p, "off") == [False]
    for bad in ("on,on", "yes", ""):
        with pytest.raises(SystemExit):
            serving.parse_reuse(p, bad)
    args = argparse.Namespace(reuse=None, levels=[Level(concurrency=1), Level(concurrency=4)], num_prompts=None,
                              quick=True, dataset="data.jsonl")
    prompts = list(range(9))
    assert serving.level_prompts(args, prompts, 1) is prompts  # a dataset's prompts: the same for every level
    args.dataset = "random"  # random prompts, with or without --reuse: per level max(4, c) with --quick, 4 each
    assert [serving.level_prompts(args, prompts, i) for i in (0, 1)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    monkeypatch.setattr(sys, "argv", ["serving.py", "--base-url", "http://x", "--reuse", "on,off"])
    with pytest.raises(SystemExit):
        serving.parse_args()
