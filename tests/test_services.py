"""The prefill and decode gRPC services, in-process on 127.0.0.1 (free ports), driven through
their stubs: Reserve → Prefill(destination) → Generate, exact against the reference engine."""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.decode_engine import DCPDecodeEngine
from engine.model.sampler import InvalidRequest, SamplingParams
from engine.reference import ReferenceEngine
from engine.handoff import KvDestination, RankEndpoint
from services.common.config import ConfigError, DecodeConfig, PrefillConfig, load_config
from services.common.convert import destination_from_proto, destination_to_proto, sampling_from_proto
from services.common.engine_loop import EngineLoop
from services.common.rpc import CHANNEL_OPTIONS, QueueFull, ServiceUnavailable
from services.decode.server import serve_decode
from services.prefill.server import serve_prefill
from services.protos import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from tests.processes import cli_process

RPC_S = 30  # deadline of every call
MAX_NEW = 16
LENGTHS = [45, 2, 70, 1]


def prompts(n=len(LENGTHS), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (LENGTHS[i % len(LENGTHS)] + i // len(LENGTHS),), generator=g).tolist()
            for i in range(n)]


def greedy(max_new_tokens=MAX_NEW, **kw):
    return common_pb2.Sampling(max_new_tokens=max_new_tokens, ignore_eos=True, **kw)


class Client:
    def __init__(self, prefill_port: int, decode_port: int):
        self.ports = (prefill_port, decode_port)
        self.channels = [grpc.insecure_channel(f"127.0.0.1:{p}", options=CHANNEL_OPTIONS)
                         for p in (prefill_port, decode_port)]
        self.prefill = prefill_pb2_grpc.PrefillStub(self.channels[0])
        self.decode = decode_pb2_grpc.DecodeStub(self.channels[1])
        self.health = [health_pb2_grpc.HealthStub(c) for c in self.channels]

    def reserve(self, n, max_new=MAX_NEW):
        return self.decode.Reserve(decode_pb2.ReserveRequest(request_id="t", num_tokens=n, max_new_tokens=max_new),
                                   timeout=RPC_S)

    def prefill_to(self, prompt, dest, sampling=None):
        return self.prefill.Prefill(prefill_pb2.PrefillRequest(request_id="t", prompt_ids=prompt,
                                                               sampling=sampling or greedy(), destination=dest),
                                    timeout=RPC_S)

    def generate(self, dest, prompt, first, sampling=None):
        return self.decode.Generate(decode_pb2.GenerateRequest(
            reservation_id=dest.reservation_id, prompt_ids=prompt, sampling=sampling or greedy(),
            seed=first.seed, first_token=first.first_token), timeout=RPC_S)

    def run(self, prompt, sampling=None):
        """The whole protocol; returns (all generated tokens, the Done event)."""
        sampling = sampling or greedy()
        dest = self.reserve(len(prompt), sampling.max_new_tokens)
        first = self.prefill_to(prompt, dest, sampling)
        tokens, done = [first.first_token], None
        for ev in self.generate(dest, prompt, first, sampling):
            kind = ev.WhichOneof("event")
            assert kind != "error", ev.error.message
            if kind == "token":
                assert ev.token.index == len(tokens)
                tokens.append(ev.token.id)
            else:
                done = ev.done
        return tokens, done

    def status(self):
        return self.decode.Status(common_pb2.StatusRequest(), timeout=RPC_S)

    def wait_rows_free(self, timeout_s=5.0):
        deadline = time.monotonic() + timeout_s
        while True:
            s = self.status()
            if (all(u == 0 for u in s.rows_used) and s.running == 0 and s.reservations == 0) \
                    or time.monotonic() > deadline:
                return s
            time.sleep(0.05)

    def close(self):
        for c in self.channels:
            c.close()


@pytest.fixture(scope="module")
def services():
    pre = dec = None
    try:
        dec = serve_decode(DecodeConfig(dcp=2, port=0, max_cache_tokens=8192, lease_s=5, metrics_port=0))
        pre = serve_prefill(PrefillConfig(cp=2, port=0, max_cache_tokens=8192, metrics_port=0))
        client = Client(pre[1], dec[1])
        client.metrics_urls = [f"http://127.0.0.1:{s[0].metrics_port}/metrics" for s in (pre, dec)]
        yield client
        client.close()
    finally:
        for s in (pre, dec):
            if s is not None:
                s[2]()


@pytest.fixture(scope="module")
def reference():
    return ReferenceEngine("tiny")


def expected(ref, prompt, max_new=MAX_NEW):
    return ref.generate([prompt], SamplingParams(max_new_tokens=max_new, stop_token_ids=()))[0].output_ids


@contextlib.contextmanager
def own_pair(prefill: PrefillConfig, decode: DecodeConfig):
    """A prefill and a decode service of the test's own (started after its environment is set:
    their ranks read $CPSERVE_FAULTS at start), and a client of both; all stopped after."""
    pre = dec = client = None
    try:
        dec = serve_decode(decode)
        pre = serve_prefill(prefill)
        client = Client(pre[1], dec[1])
        yield client
    finally:
        if client is not None:
            client.close()
        for s in (pre, dec):
            if s is not None:
                s[2]()


def code_and_details(call):
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code(), e.value.details()


# ---- the protocol ------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_health_and_status(services):
    for stub in services.health:
        assert stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=RPC_S).status == \
            health_pb2.HealthCheckResponse.SERVING
    assert services.health[1].Check(health_pb2.HealthCheckRequest(service="cpserve.decode.Decode"),
                                    timeout=RPC_S).status == health_pb2.HealthCheckResponse.SERVING
    s = services.status()
    assert s.dcp == 2 and s.model == "tiny" and s.serving and len(s.rows_free) == 2 and s.queue_depth == 0
    p = services.prefill.Status(common_pb2.StatusRequest(), timeout=RPC_S)
    assert p.cp == 2 and p.model == "tiny" and p.serving and p.rows_free > 0 and p.rows_used == 0


@pytest.mark.timeout(120)
def test_full_protocol_matches_reference(services, reference):
    free_before = services.status().rows_free
    for prompt in prompts():
        tokens, done = services.run(prompt)
        assert tokens == expected(reference, prompt)
        assert done.finish_reason == decode_pb2.FINISH_REASON_LENGTH and done.num_tokens == MAX_NEW
    s = services.wait_rows_free()
    assert list(s.rows_free) == list(free_before) and all(u == 0 for u in s.rows_used)


@pytest.mark.timeout(60)
def test_each_service_serves_its_own_metrics_with_per_rank_rows(services, reference):
    import httpx

    prompt = prompts()[0]
    assert services.run(prompt)[0] == expected(reference, prompt)
    pre, dec = (httpx.get(u, trust_env=False).text for u in services.metrics_urls)

    def value(text, name, **labels):
        sel = ",".join(f'{k}="{v}"' for k, v in labels.items())
        m = re.search(rf"^{name}{{{sel}}} (\S+)$" if sel else rf"^{name} (\S+)$", text, re.M)
        assert m, f"{name}{labels} missing"
        return float(m.group(1))

    assert value(pre, "cpserve_prefill_kv_transfer_bytes_total") > 0
    assert value(pre, "cpserve_prefill_kv_transfer_seconds_total") > 0
    assert value(pre, "cpserve_prefill_step_seconds_count") >= 1
    assert value(dec, "cpserve_decode_step_seconds_count") >= MAX_NEW - 1
    assert value(dec, "cpserve_decode_serving") == 1 and value(pre, "cpserve_prefill_serving") == 1
    for text, kind in ((pre, "prefill"), (dec, "decode")):
        assert value(text, f"cpserve_{kind}_queue_depth") == 0
        assert value(text, f"cpserve_{kind}_cache_rows_free", rank=1) > 0
    # the finished request's full pages stay cached: counted as filled (and as free: reclaimable)
    before = services.wait_rows_free()
    cached = value(httpx.get(services.metrics_urls[1], trust_env=False).text, "cpserve_decode_cache_rows_cached",
                   rank=0)
    assert cached > 0 and list(before.rows_filled) == [cached, cached] and list(before.rows_cached) == [cached] * 2
    assert value(dec, "cpserve_decode_prefix_cache_queries_total") >= 0
    assert value(pre, "cpserve_prefill_prefix_cache_queries_total") >= len(prompt)
    # each decode rank reports its own rows: 5 reserved tokens are 3 on rank 0, 2 on rank 1
    dest = services.reserve(5, 1)
    try:
        assert [a - b for a, b in zip(services.status().rows_filled, before.rows_filled)] == [3, 2]
        dec = httpx.get(services.metrics_urls[1], trust_env=False).text
        assert (value(dec, "cpserve_decode_cache_rows_filled", rank=0),
                value(dec, "cpserve_decode_cache_rows_filled", rank=1)) == (cached + 3, cached + 2)
    finally:
        services.decode.Abort(decode_pb2.ReservationRef(reservation_id=dest.reservation_id), timeout=RPC_S)


def test_prefill_reports_seed_and_transfer(services):
    prompt = prompts()[0]
    dest = services.reserve(len(prompt))
    assert len(dest.ranks) == dest.dcp == 2 and len(dest.slots) == len(prompt)
    assert dest.decode_address.startswith("127.0.0.1:") and dest.expires_at_unix_s > time.time()
    first = services.prefill_to(prompt, dest, greedy(seed=1234))
    assert first.seed == 1234 and first.transfer_bytes > 0 and first.prefill_ms > 0 and first.transfer_ms >= 0
    # the service's time by stage (the router's TTFT breakdown): each measured, none over the whole
    assert first.queue_ms > 0 and first.compute_ms == first.prefill_ms > 0 and first.handoff_ms > 0
    assert first.queue_ms + first.compute_ms + first.handoff_ms <= first.service_ms
    tokens = [first.first_token] + [ev.token.id for ev in services.generate(dest, prompt, first)
                                    if ev.WhichOneof("event") == "token"]
    assert len(tokens) == MAX_NEW
    services.wait_rows_free()


@pytest.mark.timeout(120)
def test_concurrent_requests_are_exact(services, reference):
    ps = prompts(8, seed=1)
    want = [expected(reference, p) for p in ps]
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda p: services.run(p)[0], ps))
    assert got == want
    s = services.wait_rows_free()
    assert all(u == 0 for u in s.rows_used)


@pytest.mark.timeout(60)
def test_stop_at_eos_and_first_token_stop(services, reference):
    prompt = prompts()[2]
    want = expected(reference, prompt)
    # the reference's 3rd token as a stop id: the stream ends there with STOP
    sampling = greedy(stop_token_ids=[want[2]])
    tokens, done = services.run(prompt, sampling)
    assert tokens == want[: want.index(want[2]) + 1] and done.finish_reason == decode_pb2.FINISH_REASON_STOP
    # max_new_tokens 1: prefill's token is the whole answer; Generate only says Done
    tokens, done = services.run(prompt, greedy(max_new_tokens=1))
    assert tokens == want[:1] and done.num_tokens == 1
    services.wait_rows_free()


def stream_tokens(call) -> tuple[list[int], object]:
    """A Generate stream's token ids (checking their indices run on) and its Done."""
    ids, done = [], None
    for ev in call:
        kind = ev.WhichOneof("event")
        assert kind != "error", ev.error.message
        if kind == "token":
            ids.append((ev.token.index, ev.token.id))
        else:
            done = ev.done
    return ids, done


def test_two_steps_of_one_sequence_delivered_together_keep_their_indices():
    """A step collected early (a command needed the ranks: a fork's commit copies its prompt's
    partial page) is delivered with the next one, so one delivery can hold two tokens of the
    same sequence: each event carries its own index and logprob, and a finished sequence gets
    its Done after its last token, not before it."""
    from types import SimpleNamespace

    from engine.model.sampler import TokenLogprob
    from services.decode.server import DecodeService

    seq = SimpleNamespace(id=7, output_ids=[5, 6, 7, 8], logprobs=[TokenLogprob(-0.5), TokenLogprob(-1.5),
                                                                     TokenLogprob(-2.5)],
                          params=SimpleNamespace(logprobs=0), is_finished=True, finish_reason="length")
    events = queue.SimpleQueue()
    engine = SimpleNamespace(step=lambda: [(seq, 7), (seq, 8)],
                             scheduler=SimpleNamespace(take_preempted=lambda: []))
    service = SimpleNamespace(_streams={7: (seq, events)})
    DecodeService._step(service, engine)
    got = [events.get_nowait() for _ in range(events.qsize())]
    assert [e.WhichOneof("event") for e in got] == ["token", "token", "done"]
    assert [(e.token.id, e.token.index) for e in got[:2]] == [(7, 2), (8, 3)]
    assert [e.token.logprob.logprob for e in got[:2]] == [-1.5, -2.5]
    assert got[2].done.num_tokens == 4 and service._streams == {}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sampling", [dict(temperature=0.8, top_k=40, seed=11, frequency_penalty=0.5),
                                      dict(temperature=0.0)])
def test_forks_share_one_prefill_and_the_prompts_rows(services, reference, sampling):
    """n = 3 samples of a 45-token prompt: one Reserve (the prompt's full page once, its partial
    page once per fork), one Prefill (fork j's first token with seed + j), one Generate per fork;
    each fork equals the reference run with seed + j; every row comes back."""
    full = list(services.wait_rows_free().rows_free)
    prompt, n = prompts()[0], 3  # 45 tokens: one 32-token page (DCP 2 x 16) + 13 in a partial one
    s = greedy(max_new_tokens=8, **sampling)
    dest = services.decode.Reserve(decode_pb2.ReserveRequest(request_id="t", num_tokens=len(prompt),
                                                             max_new_tokens=8, num_forks=n), timeout=RPC_S)
    assert list(services.status().rows_used) == [(1 + n) * 16] * 2  # rows per rank: 1 shared page + 3 partial
    first = services.prefill.Prefill(prefill_pb2.PrefillRequest(request_id="t", prompt_ids=prompt, sampling=s,
                                                                destination=dest, num_forks=n), timeout=RPC_S)
    starts = [(first.first_token, first.seed)] + [(f.token, f.seed) for f in first.forks]
    base = sampling.get("seed", first.seed)
    assert [seed for _, seed in starts] == [base + j for j in range(n)]

    def fork(j: int):
        token, seed = starts[j]
        call = services.decode.Generate(decode_pb2.GenerateRequest(
            reservation_id=dest.reservation_id, prompt_ids=prompt, sampling=s, seed=seed, first_token=token,
            fork=j), timeout=RPC_S)
        ids, done = stream_tokens(call)
        assert [i for i, _ in ids] == list(range(1, 8)) and done.num_tokens == 8
        return [token] + [t for _, t in ids]

    with ThreadPoolExecutor(n) as pool:
        got = list(pool.map(fork, range(n)))
    params = SamplingParams(max_new_tokens=8, stop_token_ids=(), **{k: v for k, v in sampling.items() if k != "seed"})
    want = [reference.generate([prompt], SamplingParams(**{**params.__dict__, "seed": base + j}))[0].output_ids
            for j in range(n)]
    assert got == want
    if sampling["temperature"]:
        assert len({tuple(g) for g in got}) > 1
    s_after = services.wait_rows_free()
    assert list(s_after.rows_free) == full and s_after.reservations == 0


@pytest.mark.timeout(60)
def test_a_fork_released_before_it_commits_leaves_the_others_running(services, reference):
    full = list(services.wait_rows_free().rows_free)
    prompt = prompts()[2]
    dest = services.decode.Reserve(decode_pb2.ReserveRequest(request_id="t", num_tokens=len(prompt),
                                                             max_new_tokens=MAX_NEW, num_forks=2), timeout=RPC_S)
    first = services.prefill.Prefill(prefill_pb2.PrefillRequest(request_id="t", prompt_ids=prompt, sampling=greedy(),
                                                                destination=dest, num_forks=2), timeout=RPC_S)
    ref0 = decode_pb2.ReservationRef(reservation_id=dest.reservation_id, fork=0)
    assert services.decode.Abort(ref0, timeout=RPC_S).freed and not services.decode.Abort(ref0, timeout=RPC_S).freed
    assert services.status().reservations == 1  # fork 1 may still commit
    ids, _ = stream_tokens(services.decode.Generate(decode_pb2.GenerateRequest(
        reservation_id=dest.reservation_id, prompt_ids=prompt, sampling=greedy(), seed=first.forks[0].seed,
        first_token=first.forks[0].token, fork=1), timeout=RPC_S))
    assert [first.forks[0].token] + [t for _, t in ids] == expected(reference, prompt)
    code, details = code_and_details(lambda: list(services.generate(dest, prompt, first)))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "unknown" in details  # every fork is done
    s = services.wait_rows_free()
    assert list(s.rows_free) == full and s.reservations == 0


@pytest.mark.timeout(60)
def test_a_preempted_generation_resumes_on_a_new_reservation_with_the_same_tokens(services, reference):
    """The resume protocol: prompt + the k tokens so far reserved, prefilled (output_ids) and
    continued (Generate output_ids): the tokens are the uninterrupted run's, seeds, step-indexed
    draws and output-only penalties included."""
    prompt, k = prompts()[2], 5
    kw = dict(temperature=0.7, seed=3, presence_penalty=0.8, min_tokens=8)
    want = reference.generate([prompt], SamplingParams(max_new_tokens=MAX_NEW, stop_token_ids=(), **kw))[0].output_ids
    s = greedy(**kw)
    dest = services.reserve(len(prompt) + k, MAX_NEW - k)
    first = services.prefill.Prefill(prefill_pb2.PrefillRequest(request_id="t", prompt_ids=prompt, sampling=s,
                                                                destination=dest, output_ids=want[:k]), timeout=RPC_S)
    assert first.first_token == want[k] and first.seed == 3
    ids, done = stream_tokens(services.decode.Generate(decode_pb2.GenerateRequest(
        reservation_id=dest.reservation_id, prompt_ids=prompt, sampling=s, seed=first.seed,
        first_token=first.first_token, output_ids=want[:k]), timeout=RPC_S))
    assert ids == list(enumerate(want[k + 1:], k + 1)) and done.num_tokens == MAX_NEW
    services.wait_rows_free()


# ---- errors --------------------------------------------------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize("case,field", [
    ("empty prompt", "prompt"), ("token id >= vocab", "prompt"), ("max_new_tokens 0", "max_new_tokens"),
    ("fingerprint", "dtype"), ("no destination", "destination"), ("index mode", "destination.index_mode"),
    ("output id >= vocab", "output_ids"), ("output as long as max_new_tokens", "output_ids"),
    ("forks of a resumed generation", "num_forks"), ("too many forks", "num_forks"),
])
def test_bad_prefill_input_is_invalid_argument(services, case, field):
    prompt = prompts()[0][:10]
    dest = services.reserve(len(prompt))
    request = prefill_pb2.PrefillRequest(request_id="bad", prompt_ids=prompt, sampling=greedy(), destination=dest)
    if case == "empty prompt":
        del request.prompt_ids[:]
    elif case == "token id >= vocab":
        request.prompt_ids[3] = 320
    elif case == "max_new_tokens 0":
        request.sampling.max_new_tokens = 0
    elif case == "fingerprint":  # as a bf16 decode service would describe its rows
        request.destination.fingerprint.dtype = "bf16"
    elif case == "no destination":
        request.ClearField("destination")
    elif case == "index mode":
        request.destination.index_mode = 0
    elif case == "output id >= vocab":
        request.output_ids[:] = [5, 320]
    elif case == "output as long as max_new_tokens":
        request.output_ids[:] = [5] * MAX_NEW
    elif case == "forks of a resumed generation":
        request.output_ids[:], request.num_forks = [5], 2
    elif case == "too many forks":
        request.num_forks = 100_000
    t0 = time.monotonic()
    code, details = code_and_details(lambda: services.prefill.Prefill(request, timeout=RPC_S))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and field in details and time.monotonic() - t0 < 5
    assert "Traceback" not in details
    assert services.decode.Abort(decode_pb2.ReservationRef(reservation_id=dest.reservation_id), timeout=RPC_S).freed
    services.wait_rows_free()


@pytest.mark.timeout(60)
def test_bad_decode_input_is_invalid_argument(services):
    for n, max_new, field in [(5, 0, "max_new_tokens"), (0, 4, "num_tokens"), (5, 200_000, "max_new_tokens")]:
        code, details = code_and_details(lambda: services.reserve(n, max_new))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and field in details
    code, details = code_and_details(lambda: services.reserve(20_000, 4))  # more than the 8192-token cache
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "num_tokens" in details
    for forks in (100_000, 256):  # more than any reservation may fork; more partial pages than the cache has
        code, details = code_and_details(lambda: services.decode.Reserve(decode_pb2.ReserveRequest(
            request_id="t", num_tokens=45, max_new_tokens=4, num_forks=forks), timeout=RPC_S))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "num_forks" in details
    prompt = prompts()[1]
    dest = services.reserve(len(prompt))
    first = prefill_pb2.PrefillResponse(first_token=400, seed=1)
    code, details = code_and_details(lambda: list(services.generate(dest, prompt, first)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "first_token" in details

    def generate(outputs: list[int], fork: int):
        return list(services.decode.Generate(decode_pb2.GenerateRequest(
            reservation_id=dest.reservation_id, prompt_ids=prompt[:len(prompt) - len(outputs)], sampling=greedy(),
            seed=1, first_token=5, output_ids=outputs, fork=fork), timeout=RPC_S))

    code, details = code_and_details(lambda: generate([320], 0))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "output_ids" in details
    # Generate before any write: the reservation is not being written
    first = prefill_pb2.PrefillResponse(first_token=5, seed=1)
    code, details = code_and_details(lambda: list(services.generate(dest, prompt, first)))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and dest.reservation_id in details
    ref = decode_pb2.ReservationRef(reservation_id=dest.reservation_id)
    services.decode.BeginWrite(ref, timeout=RPC_S)
    services.decode.EndWrite(ref, timeout=RPC_S)
    code, details = code_and_details(lambda: generate([], 3))  # a one-fork reservation has no fork 3
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "fork" in details
    services.decode.Abort(decode_pb2.ReservationRef(reservation_id=dest.reservation_id), timeout=RPC_S)
    services.wait_rows_free()


@pytest.mark.timeout(60)
def test_aborted_reservation_is_refused_by_begin_write(services):
    prompt = prompts()[0]
    dest = services.reserve(len(prompt))
    assert services.decode.Abort(decode_pb2.ReservationRef(reservation_id=dest.reservation_id), timeout=RPC_S).freed
    code, details = code_and_details(lambda: services.prefill_to(prompt, dest))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "unknown or expired" in details
    assert services.prefill.Status(common_pb2.StatusRequest(), timeout=RPC_S).rows_used == 0


@pytest.mark.timeout(60)
def test_abort_frees_rows(services):
    full = list(services.wait_rows_free().rows_free)
    dest = services.reserve(100, 50)
    s = services.status()
    # the prompt's rows only (generation pages come as tokens do): 100 tokens = 4 pages of 32 over 2 ranks
    assert s.reservations == 1 and list(s.rows_used) == [64, 64]
    assert [f + u for f, u in zip(s.rows_free, s.rows_used)] == full
    ref = decode_pb2.ReservationRef(reservation_id=dest.reservation_id)
    assert services.decode.Abort(ref, timeout=RPC_S).freed
    assert not services.decode.Abort(ref, timeout=RPC_S).freed
    s = services.status()
    assert list(s.rows_free) == full and s.reservations == 0


@pytest.mark.timeout(60)
def test_abort_while_writing_waits_for_end_write(services):
    """After BeginWrite the writer may still be writing: Abort quarantines the rows (not free,
    not reservable) until the writer's EndWrite; EndWrite of an unknown reservation is a no-op."""
    full = list(services.wait_rows_free().rows_free)
    dest = services.reserve(100, 50)
    ref = decode_pb2.ReservationRef(reservation_id=dest.reservation_id)
    services.decode.BeginWrite(ref, timeout=RPC_S)
    assert services.decode.Abort(ref, timeout=RPC_S).freed
    s = services.status()
    assert s.reservations == 1 and list(s.rows_free) != full  # quarantined, not back in the pool
    code, _ = code_and_details(lambda: services.decode.BeginWrite(ref, timeout=RPC_S))
    assert code == grpc.StatusCode.FAILED_PRECONDITION  # no new write into an aborted reservation
    assert services.decode.EndWrite(ref, timeout=RPC_S).found
    s = services.status()
    assert list(s.rows_free) == full and s.reservations == 0
    assert not services.decode.EndWrite(ref, timeout=RPC_S).found


@pytest.mark.timeout(120)
def test_decode_answers_reserve_while_its_ranks_compute_a_step(monkeypatch, reference):
    """Reserve (and BeginWrite, EndWrite, a new stream) run while the ranks compute, not at the
    step's end: with every decode step made 0.6 s long, a Reserve sent just after a token
    arrives (a step has just started) is answered long before that step ends."""
    delay = 0.6
    monkeypatch.setenv("CPSERVE_FAULTS", f"decode_step_delay_s={delay}")  # the ranks take it at start
    with own_pair(PrefillConfig(cp=1, port=0, max_cache_tokens=2048),
                  DecodeConfig(dcp=1, port=0, max_cache_tokens=2048, lease_s=30)) as client:
        prompt, sampling = prompts()[0], greedy(6)
        dest = client.reserve(len(prompt), 6)
        first = client.prefill_to(prompt, dest, sampling)
        tokens, waits = [first.first_token], []
        for ev in client.generate(dest, prompt, first, sampling):
            if ev.WhichOneof("event") != "token":
                continue
            tokens.append(ev.token.id)
            if len(waits) < 3:
                t0 = time.perf_counter()
                other = client.reserve(8, 4)
                waits.append(time.perf_counter() - t0)
                ref = decode_pb2.ReservationRef(reservation_id=other.reservation_id)
                assert client.decode.Abort(ref, timeout=RPC_S).freed
        assert tokens == expected(reference, prompt, 6)
        assert sorted(waits)[1] < delay / 2, f"Reserve waited {waits} s with {delay} s decode steps"
        assert client.wait_rows_free().reservations == 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("overlap", [True, False])
def test_prefill_stages_split_compute_from_hand_off(monkeypatch, reference, overlap):
    """The TTFT breakdown's compute and hand-off stages: with every prefill layer made 50 ms
    long, compute is at least the layers' time and the hand-off is not (with layer-wise overlap
    the pushes run during the forward: only their tail after it is hand-off time)."""
    delay = 0.05
    monkeypatch.setenv("CPSERVE_FAULTS", f"layer_delay_s={delay}")  # the ranks take it at start
    with own_pair(PrefillConfig(cp=1, port=0, max_cache_tokens=2048, overlap=overlap),
                  DecodeConfig(dcp=1, port=0, max_cache_tokens=2048)) as client:
        layers = reference.cfg.num_layers
        prompt, sampling = prompts()[0], greedy(4)
        dest = client.reserve(len(prompt), 4)
        first = client.prefill_to(prompt, dest, sampling)
        assert first.compute_ms >= 0.9 * layers * delay * 1e3, (first.compute_ms, layers)
        assert 0 < first.handoff_ms < first.compute_ms / 4, (first.handoff_ms, first.compute_ms)
        tokens = [first.first_token] + [ev.token.id for ev in client.generate(dest, prompt, first, sampling)
                                        if ev.WhichOneof("event") == "token"]
        assert tokens == expected(reference, prompt, 4)
        assert client.wait_rows_free().reservations == 0


@pytest.mark.timeout(60)
def test_full_cache_is_resource_exhausted(services):
    held = services.reserve(4100, 100)  # the prompt's 129 of the 256 pages (32 tokens each at dcp 2)
    try:
        code, details = code_and_details(lambda: services.reserve(4100, 100))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "capacity" in details
    finally:
        services.decode.Abort(decode_pb2.ReservationRef(reservation_id=held.reservation_id), timeout=RPC_S)
    services.wait_rows_free()


@pytest.mark.timeout(60)
def test_cancelled_stream_frees_rows(services):
    full = list(services.wait_rows_free().rows_free)
    prompt = prompts()[0]
    sampling = greedy(max_new_tokens=4000)
    dest = services.reserve(len(prompt), sampling.max_new_tokens)
    first = services.prefill_to(prompt, dest, sampling)
    call = services.generate(dest, prompt, first, sampling)
    for i, ev in zip(range(3), call):
        assert ev.WhichOneof("event") == "token"
    assert services.status().running == 1
    call.cancel()
    s = services.wait_rows_free()
    assert list(s.rows_free) == full and s.running == 0


# ---- a rank dies -------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_rank_death_ends_streams_and_health(services):
    config = DecodeConfig(dcp=2, port=0, max_cache_tokens=8192)
    engine = DCPDecodeEngine(**config.engine_kwargs)
    server, port, shutdown = serve_decode(config, engine)
    client = Client(0, port)
    try:
        prompt = prompts()[0]
        sampling = greedy(max_new_tokens=4000)
        dest = client.reserve(len(prompt), sampling.max_new_tokens)
        first = services.prefill_to(prompt, dest, sampling)  # the shared prefill writes to this decode
        call = client.generate(dest, prompt, first, sampling)
        assert next(call).WhichOneof("event") == "token"
        t0 = time.monotonic()
        os.kill(engine.group.pids[1], signal.SIGKILL)
        last = None
        for ev in call:
            last = ev
        assert last.WhichOneof("event") == "error" and last.error.code == decode_pb2.ERROR_CODE_UNAVAILABLE
        assert "rank 1" in last.error.message and time.monotonic() - t0 < 10
        code, details = code_and_details(lambda: client.reserve(5))
        assert code == grpc.StatusCode.UNAVAILABLE and "Traceback" not in details
        assert client.health[1].Check(health_pb2.HealthCheckRequest(service=""), timeout=RPC_S).status == \
            health_pb2.HealthCheckResponse.NOT_SERVING
        assert not client.status().serving
    finally:
        client.close()
        shutdown()



# ---- pieces without a rank group -----------------------------------------------------------
def test_sampling_stop_rule():
    eos = (1,)
    assert sampling_from_proto(common_pb2.Sampling(max_new_tokens=3), eos).stop_token_ids is None
    assert sampling_from_proto(common_pb2.Sampling(max_new_tokens=3, ignore_eos=True), eos).stop_token_ids == ()
    assert sampling_from_proto(common_pb2.Sampling(max_new_tokens=3, stop_token_ids=[7, 8]), eos).stop_token_ids \
        == (7, 8, 1)
    p = sampling_from_proto(common_pb2.Sampling(max_new_tokens=3, stop_token_ids=[7], ignore_eos=True, seed=5,
                                                temperature=0.5, top_k=4), eos)
    assert (p.stop_token_ids, p.seed, p.temperature, p.top_k, p.top_p) == ((7,), 5, 0.5, 4, 1.0)
    assert sampling_from_proto(common_pb2.Sampling(max_new_tokens=3, top_p=0.5), eos).top_p == 0.5
    assert sampling_from_proto(common_pb2.Sampling(max_new_tokens=3), eos).seed is None


def test_destination_round_trip():
    fp = {"model": "abc", "dtype": "fp32", "kv_cache_dtype": "fp8", "kv_entry_bytes": 48, "kv_index_bytes": 36,
          "kv_scales": [0.5, 1.0, 2.0, 0.125], "latent_dim": 48, "index_head_dim": 32, "num_layers": 4,
          "indexer_layers": [0, 2]}
    ranks = tuple(RankEndpoint(f"127.0.0.1:{1000 + r}", 1 << 40, 512, 192, {0: 7 << 30, 2: 9 << 30}, 512, 128)
                  for r in range(2))
    dest = KvDestination("ab" * 16, 2, 16, "split", (0, 1, 2, 3, 34), 0, ranks, fp, 1.7e9)
    msg = destination_to_proto(dest, "127.0.0.1:5000")
    assert msg.decode_address == "127.0.0.1:5000"
    assert destination_from_proto(msg) == dest
    bad = type(msg)()
    bad.CopyFrom(msg)
    del bad.ranks[1]
    with pytest.raises(InvalidRequest, match="destination.ranks"):
        destination_from_proto(bad)
    bad.CopyFrom(msg)
    bad.ClearField("fingerprint")
    with pytest.raises(InvalidRequest, match="destination.fingerprint"):
        destination_from_proto(bad)


def test_config_yaml_sections_overrides_and_errors(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"prefill": {"cp": 4, "port": 7000}, "decode": {"dcp": 3, "indexer": "split"},
                                    "router": {"anything": 1}}))
    p = load_config("prefill", path, {"port": 0, "strategy": None})
    assert (p.cp, p.port, p.strategy, p.host) == (4, 0, "interleave", "127.0.0.1")
    d = load_config("decode", path)
    assert (d.dcp, d.indexer) == (3, "split") and d.engine_kwargs["exchange"] == "a2a"
    with pytest.raises(Exception):
        d.dcp = 2  # frozen
    for section, values, field in [("decode", {"dcp": 0}, "decode.dcp"),
                                   ("prefill", {"strategy": "x"}, "prefill.strategy"),
                                   ("prefill", {"bogus": 1}, "prefill.bogus"),
                                   ("decode", {"port": 70000}, "decode.port")]:
        with pytest.raises(ConfigError, match=field):
            load_config(section, None, values)


def test_engine_loop_bounds_its_queue_and_fails_cleanly():
    release = threading.Event()
    failures = []
    loop = EngineLoop(object(), "test", 2, on_failure=failures.append)
    try:
        blocker = loop.submit(lambda e: release.wait(10), admit=True)
        time.sleep(0.1)  # the loop thread is now inside the blocker
        queued = [loop.submit(lambda e: 1, admit=True) for _ in range(2)]
        assert loop.queue_depth == 2
        with pytest.raises(QueueFull, match="max_queue"):
            loop.submit(lambda e: 1, admit=True)
        control = loop.submit(lambda e: 2)  # control commands are never refused
        release.set()
        assert blocker.result(5) and [f.result(5) for f in queued] == [1, 1] and control.result(5) == 2
        with pytest.raises(ZeroDivisionError):  # a command's error goes to its caller only
            loop.call(lambda e: 1 / 0, timeout_s=5)
        assert loop.call(lambda e: 3, timeout_s=5) == 3 and not failures
    finally:
        release.set()
        loop.stop()
    with pytest.raises(ServiceUnavailable):
        loop.submit(lambda e: 1)


def test_engine_loop_serves_commands_while_a_tick_waits_on_its_ranks():
    """A tick that would block on its ranks calls serve_until(fds): commands submitted
    meanwhile run at once on the loop thread, and the tick goes on once an fd is readable."""
    r, w = os.pipe()
    events = []

    def tick(e):
        events.append("wait")
        loop.serve_until([r], lambda: e["in_flight"])
        if e["in_flight"]:
            os.read(r, 1)
        events.append("answered")
        e["work"] = False

    engine = {"work": False, "in_flight": True}
    loop = EngineLoop(engine, "test", 4, on_failure=lambda m: None, has_work=lambda e: e["work"], tick=tick)
    try:
        loop.call(lambda e: e.update(work=True))  # the next tick waits in serve_until
        deadline = time.monotonic() + 5
        while events != ["wait"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert events == ["wait"]
        threads = []
        assert loop.call(lambda e: threads.append(threading.current_thread()) or "ran", timeout_s=5) == "ran"
        assert events == ["wait"] and threads == [loop._thread]  # inside the tick, on the loop thread
        os.write(w, b"x")
        deadline = time.monotonic() + 5
        while len(events) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert events == ["wait", "answered"] and loop.call(lambda e: e["work"], timeout_s=5) is False
        # a command that collects the answers itself (the decode engine's ``quiesced``) ends the wait
        events.clear()
        loop.call(lambda e: e.update(work=True))
        deadline = time.monotonic() + 5
        while events != ["wait"] and time.monotonic() < deadline:
            time.sleep(0.01)
        loop.call(lambda e: e.update(in_flight=False), timeout_s=5)
        deadline = time.monotonic() + 5
        while len(events) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert events == ["wait", "answered"]
        with pytest.raises(RuntimeError, match="engine thread"):
            loop.serve_until([r])
    finally:
        loop.stop()
        os.close(r)
        os.close(w)


def test_engine_loop_snapshot_is_fresh_when_a_caller_hears_back():
    """A handler answers as soon as its command's future resolves, and the client's next call
    (Status after Reserve) reads the snapshot: it must already show that command's effect."""
    engine = {"n": 0}
    seen = []
    loop = EngineLoop(engine, "test", 4, on_failure=lambda m: None, snapshot=lambda e: e["n"])
    try:
        def bump(e):
            e["n"] += 1
            return e["n"]

        def fail(e):
            e["n"] += 1
            raise ValueError("after a change")

        for fn in (bump, bump, fail):
            fut = loop.submit(fn)
            # runs on the loop thread the moment the result is set, as the handler's wake-up would
            fut.add_done_callback(lambda f: seen.append(loop.snapshot))
            fut.exception(5)
        assert seen == [1, 2, 3]
    finally:
        loop.stop()


@pytest.mark.timeout(90)
def test_cli_serve_decode_prints_its_address_and_stops_on_sigterm(tmp_path):
    from engine.parallel.threads import usable_cores

    argv = ["serve", "decode", "--dcp", "2", "--port", "0", "--max-cache-tokens", "1024"]
    with (tmp_path / "stderr").open("w") as log, cli_process(argv, stdout=subprocess.PIPE, stderr=log) as proc:
        line = proc.stdout.readline()
        assert line.startswith("serving decode on 127.0.0.1:"), line
        port = int(line.rsplit(":", 1)[1])
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS) as ch:
            s = decode_pb2_grpc.DecodeStub(ch).Status(common_pb2.StatusRequest(), timeout=RPC_S)
            assert s.dcp == 2 and s.serving
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    # it says how many threads each rank got: usable cores ÷ its 2 ranks
    threads = max(1, usable_cores() // 2)
    assert f"decode: 2 rank(s) × {threads} thread(s) per rank on {usable_cores()} usable core(s) (picked" in \
        (tmp_path / "stderr").read_text()


def test_status_codes_come_from_exception_types_not_messages():
    """A reservation error's code follows its class: a message that merely starts with
    "capacity" or "prompt:" does not change it."""
    from engine.handoff import BadReservation, NoCapacity, ReservationError
    from services.common.rpc import status_of

    assert status_of(NoCapacity("no rows"))[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert status_of(BadReservation("too long"))[0] == grpc.StatusCode.INVALID_ARGUMENT
    for wording in ("capacity: looks like a capacity error", "prompt: looks like a bad prompt", "expired"):
        assert status_of(ReservationError(wording))[0] == grpc.StatusCode.FAILED_PRECONDITION


def test_wildcard_host_advertises_a_concrete_address(monkeypatch):
    """--host 0.0.0.0 binds every interface but never advertises the wildcard: $POD_IP, else the
    default route's source address, else loopback; --advertise-host wins over both."""
    import ipaddress

    from services.common.config import WILDCARDS, load_config

    cfg = load_config("decode", None, {"host": "0.0.0.0"})
    monkeypatch.setenv("POD_IP", "10.1.2.3")
    assert cfg.advertised_host == "10.1.2.3"
    monkeypatch.delenv("POD_IP")
    found = cfg.advertised_host
    assert found not in WILDCARDS and not ipaddress.ip_address(found).is_unspecified
    assert load_config("decode", None, {"host": "::"}).advertised_host not in WILDCARDS
    assert load_config("prefill", None, {"host": "0.0.0.0", "advertise_host": "p-0"}).advertised_host == "p-0"
    assert load_config("prefill").advertised_host == "127.0.0.1"  # the default binds loopback only


@pytest.mark.parametrize("spec,why", [("40000-40010", "overlaps 32768-60999"), ("900-2000", "1024 <= LO"),
                                      ("16000-16000", "LO < HI"), ("16000", "LO-HI"), ("a-b", "LO-HI")])
def test_kv_port_range_is_checked_where_mooncake_would_ignore_it(spec, why):
    with pytest.raises(ConfigError, match=f"decode.kv_port_range: .*{re.escape(why)}"):
        load_config("decode", None, {"kv_port_range": spec})
    assert load_config("prefill", None, {"kv_port_range": "20000-20099"}).kv_port_range == "20000-20099"


def _router_from_stdin(extra: list[str] = ()):
    return cli_process(["serve", "router", "--port", "0", "--no-grpc", "--backends-from-stdin", *extra],
                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.mark.timeout(120)
def test_router_takes_its_service_addresses_from_stdin_once_its_model_files_are_loaded(services, reference):
    """`cpserve up` starts the router with the engines; it learns their addresses on stdin."""
    from services.up import stream_completion

    with _router_from_stdin() as proc:
        time.sleep(0.5)
        assert proc.poll() is None  # waiting for the addresses, serving nothing yet
        proc.stdin.write('{"prefill": ["127.0.0.1:%d"], "decode": ["127.0.0.1:%d"]}\n' % services.ports)
        proc.stdin.flush()
        line = proc.stdout.readline()
        assert line.startswith("serving router on 127.0.0.1:"), line + proc.stderr.read()
        ids, _, _ = stream_completion(line.split()[-1], {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": MAX_NEW,
                                                         "temperature": 0, "ignore_eos": True})
        assert ids == expected(reference, [5, 6, 7])  # through the services it was told of
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stdin, extra, message", [
    ("not json\n", [], "--backends-from-stdin: expected one JSON line"),
    ("", [], "--backends-from-stdin: stdin closed before the service addresses came"),
    # a bad flag is reported before any address comes (stdin is never read)
    (None, ["--max-model-len", "999999999"], "max_model_len"),
])
def test_router_from_stdin_reports_bad_input_by_name(stdin, extra, message):
    with _router_from_stdin(extra) as proc:
        if stdin is not None:
            proc.stdin.write(stdin)
            proc.stdin.close()
        assert proc.wait(30) != 0
        err = proc.stderr.read()
        assert message in err and "Traceback" not in err, err
