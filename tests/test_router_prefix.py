"""Prefix-cache-aware pairing (services/router/pairing.py, prefix_index.py): the index's
contract, the pick rule, affinity, the health monitor feeding indexes from KvEvents, the request
fields and gRPC fields that carry cache_salt, and a simulated multi-turn workload on fake
caching services. No model, no engine.
"""

from __future__ import annotations

import asyncio
import random
import uuid
from concurrent import futures
from types import SimpleNamespace

import grpc
import pytest

from engine.cache.content_key import BLOCK_TOKENS, KvEventLog, block_keys, key_seed
from services.protos import common_pb2, decode_pb2, kv_pb2, prefill_pb2, prefill_pb2_grpc
from services.router.admission import Admission
from services.router.backend import (BackendError, DecodeClient, DecodeLoad, Done, FirstToken, GrpcDecodeClient,
                                     GrpcPrefillClient, Job, PrefillClient, PrefillLoad, Reservation, Token)
from services.router.dispatch import Dispatcher
from services.router.health import HealthMonitor
from services.router.metrics import RouterMetrics
from services.router.pairing import Cluster, Endpoint, PairingPolicy, pick_cache_aware, rendezvous
from services.router.prefix_index import PrefixIndex, keys_by_seed
from tests.test_router import FakeDecode, FakePrefill, get, post, start_router  # noqa: F401 (a fixture)

pytestmark = pytest.mark.timeout(60)

SEED_P, SEED_D = key_seed({"kind": "prefill-layout"}), key_seed({"kind": "decode-layout"})
STORED, REMOVED = common_pb2.KvEvent.KIND_STORED, common_pb2.KvEvent.KIND_REMOVED


def answer(log: KvEventLog, incarnation: str = "", after: int = 0) -> common_pb2.KvEvents:
    """What a service answers KvEvents with, from its engine's event log."""
    b = log.since(incarnation, after)
    return common_pb2.KvEvents(incarnation=b.incarnation, last=b.last, reset=b.reset, snapshot=b.snapshot,
                               events=[common_pb2.KvEvent(kind=STORED if kind == "stored" else REMOVED,
                                                          block_keys=keys) for kind, keys in b.events],
                               key_seed=log.seed, block_tokens=BLOCK_TOKENS)


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# ---- the index ------------------------------------------------------------------------------------
def test_index_applies_snapshots_and_events_and_counts_leading_blocks():
    tokens = list(range(100))  # 6 full blocks
    keys = block_keys(tokens, SEED_P)
    log = KvEventLog(SEED_P)
    log.stored(keys[:3] + keys[4:5])  # blocks 0-2 and 4
    index = PrefixIndex()
    assert not index.known and index.reused_tokens(keys) == 0
    index.apply(answer(log))  # first answer: a snapshot
    assert index.known and index.key_seed == SEED_P and index.incarnation == log.incarnation
    assert index.reused_tokens(keys) == 3 * BLOCK_TOKENS  # leading blocks only: block 4 follows a gap
    # events continue the index: two holders of a key, one removed, the key stays
    log.stored(keys[:5])
    log.removed(keys[:3])
    index.apply(answer(log, index.incarnation, index.last))
    assert index.reused_tokens(keys) == 5 * BLOCK_TOKENS
    log.removed(keys[2:5])
    got = answer(log, index.incarnation, index.last)
    assert not got.reset
    index.apply(got)
    assert index.reused_tokens(keys) == 2 * BLOCK_TOKENS and index.num_blocks == 3  # blocks 0, 1 and 4
    # a salt changes every key
    assert index.reused_tokens(block_keys(tokens, SEED_P, "tenant-a")) == 0


def test_index_drops_everything_of_another_incarnation_and_refuses_what_it_cannot_use():
    clock = Clock()
    keys = block_keys(list(range(64)), SEED_P)
    old = KvEventLog(SEED_P)
    old.stored(keys)
    index = PrefixIndex(clock=clock)
    index.apply(answer(old))
    index.remember(block_keys(list(range(96)), SEED_P), old.incarnation)
    restarted = KvEventLog(SEED_P)  # the service restarted: an empty cache, a new incarnation
    index.apply(answer(restarted, index.incarnation, index.last))
    assert index.incarnation == restarted.incarnation and index.reused_tokens(keys) == 0
    assert index.reused_tokens(block_keys(list(range(96)), SEED_P)) == 0  # its provisional entries went too
    # a remember for the old incarnation (a request that ran before the restart) is ignored
    index.remember(keys, old.incarnation)
    assert index.reused_tokens(keys) == 0
    # events of an incarnation never snapshotted, and blocks of another size: refused, index cleared
    with pytest.raises(ValueError, match="without a snapshot"):
        index.apply(common_pb2.KvEvents(incarnation="other", last=3, key_seed=SEED_P, block_tokens=16))
    assert not index.known and index.incarnation == "" and index.last == 0
    with pytest.raises(ValueError, match="blocks of 32 tokens"):
        index.apply(common_pb2.KvEvents(incarnation="x", reset=True, key_seed=SEED_P, block_tokens=32))
    assert not index.known
    index.apply(answer(restarted))
    index.clear()
    assert not index.known and index.reused_tokens(keys) == 0


def test_provisional_entries_expire_and_yield_to_the_services_own_events():
    clock = Clock()
    log = KvEventLog(SEED_D)
    index = PrefixIndex(provisional_ttl_s=30.0, settle_s=1.0, clock=clock)
    index.remember(block_keys(list(range(32)), SEED_D), "")  # no index yet: nothing can be remembered
    index.apply(answer(log))
    keys = block_keys(list(range(80)), SEED_D)
    index.remember(keys, log.incarnation)
    assert index.reused_tokens(keys) == 80
    clock.now += 29.9
    assert index.reused_tokens(keys) == 80
    clock.now += 0.2
    assert index.reused_tokens(keys) == 0  # expired
    # a poll asked less than settle_s after the guess may predate the service's store: kept ...
    index.remember(keys, log.incarnation)
    clock.now += 0.5
    index.apply(answer(log, index.incarnation, index.last), asked_at=clock.now)
    assert index.reused_tokens(keys) == 80
    # ... one asked later reports what the service really holds (here 2 of the 5 blocks)
    log.stored(keys[:2])
    clock.now += 1.0
    index.apply(answer(log, index.incarnation, index.last), asked_at=clock.now)
    assert index.reused_tokens(keys) == 32


def test_keys_by_seed_hashes_each_distinct_seed_once():
    tokens = list(range(50))
    got = keys_by_seed(tokens, [SEED_P, SEED_D, SEED_P], "s")
    assert got == {SEED_P: block_keys(tokens, SEED_P, "s"), SEED_D: block_keys(tokens, SEED_D, "s")}
    assert len(got[SEED_P]) == 3


# ---- the pick -------------------------------------------------------------------------------------
def endpoints(kind: str, n: int) -> list[Endpoint]:
    return [Endpoint(kind, f"{kind[0]}{i}", healthy=True) for i in range(n)]


def test_the_pair_holding_the_prefix_is_chosen():
    p, d = endpoints("prefill", 2), endpoints("decode", 2)
    policy = PairingPolicy()
    for turn in range(4):
        c = pick_cache_aware(p, d, set(), {"p1": 64, "d0": 96}, "", policy, turn)
        assert (c.prefill.address, c.decode.address, c.reason, c.reused_tokens) == ("p1", "d0", "prefix", 160)
    # more reuse wins over less load, until the service is much busier
    p[1].in_flight, p[0].in_flight = 4, 0
    assert pick_cache_aware(p, d, set(), {"p1": 64}, "", policy).prefill.address == "p1"
    # an excluded pair (tried already) is never chosen: the next best is
    c = pick_cache_aware(p, d, {("p1", "d0")}, {"p1": 64, "d0": 96}, "", policy)
    assert (c.prefill.address, c.decode.address, c.reason, c.reused_tokens) == ("p0", "d0", "prefix", 96)


def test_a_much_busier_service_is_passed_over_for_cache_reasons():
    p, d = endpoints("prefill", 2), endpoints("decode", 2)
    policy = PairingPolicy(balance_abs=4, balance_rel=1.5)
    p[1].in_flight = 5  # 5 > 0 + 4 and 5 > 1.5 × 0
    c = pick_cache_aware(p, d, set(), {"p1": 640}, "", policy)
    assert c.prefill.address == "p0" and c.reason == "balance" and c.reused_tokens == 0
    p[0].in_flight = 3  # 5 is not > 3 + 4: the prefix decides again
    assert pick_cache_aware(p, d, set(), {"p1": 640}, "", policy).prefill.address == "p1"
    p[0].in_flight, p[1].in_flight = 10, 0
    p[1].queue_depth = 15  # the load a service reports counts too: 15 > 10 + 4, but not > 1.5 × 10
    assert pick_cache_aware(p, d, set(), {"p1": 640}, "", policy).prefill.address == "p1"
    p[1].queue_depth = 16  # 16 > 14 and 16 > 15
    c = pick_cache_aware(p, d, set(), {"p1": 640, "d1": 32}, "", policy)
    assert (c.prefill.address, c.decode.address, c.reason, c.reused_tokens) == ("p0", "d1", "balance", 32)
    # load mode: today's policy exactly (least load), whatever is cached
    cluster = Cluster(["p0", "p1"], ["d0"], PairingPolicy(mode="load"))
    for e in cluster.endpoints:
        e.healthy = True
    cluster.prefills[0].in_flight = 1
    assert cluster.pick(set(), {SEED_P: [1, 2]}).prefill.address == "p1"


def test_a_small_shared_prefix_does_not_pull_every_new_conversation_to_one_service():
    """A system prompt cached on p1 only, 512 of a new conversation's 8,704 tokens: under the
    cache threshold, so new conversations spread round-robin; a later turn of a conversation,
    mostly cached on p0, follows its cache."""
    p, d = endpoints("prefill", 2), endpoints("decode", 2)
    policy = PairingPolicy()  # cache_threshold 0.25
    firsts = [pick_cache_aware(p, d, set(), {"p1": 512}, "", policy, turn, num_tokens=8704) for turn in range(8)]
    assert sorted(c.prefill.address for c in firsts).count("p0") == 4
    assert {c.reason for c in firsts} == {"load"}
    later = pick_cache_aware(p, d, set(), {"p1": 512, "p0": 8192}, "", policy, 1, num_tokens=8900)
    assert (later.prefill.address, later.reason) == ("p0", "prefix")
    assert pick_cache_aware(p, d, set(), {"p1": 512}, "", PairingPolicy(cache_threshold=0), 1,
                            num_tokens=8704).prefill.address == "p1"


def test_affinity_keeps_a_conversation_on_the_same_services_until_reuse_is_known():
    p, d = endpoints("prefill", 3), endpoints("decode", 3)
    policy = PairingPolicy()
    chosen = {}
    for key in (f"conversation-{i}" for i in range(60)):
        picks = {(c.prefill.address, c.decode.address, c.reason)
                 for turn in range(5) for c in [pick_cache_aware(p, d, set(), {}, key, policy, turn)]}
        assert len(picks) == 1  # whatever the round-robin turn
        (pa, da, reason), = picks
        assert reason == "affinity" and pa == rendezvous(key, ["p0", "p1", "p2"])
        chosen[key] = (pa, da)
    assert {pa for pa, _ in chosen.values()} == {"p0", "p1", "p2"}  # conversations spread over the services
    assert {da for _, da in chosen.values()} == {"d0", "d1", "d2"}
    # the same in another router (the order of the addresses does not matter)
    assert all(pick_cache_aware(p[::-1], d[::-1], set(), {}, k, policy).prefill.address == v[0]
               for k, v in chosen.items())
    # a service leaving moves only the conversations it had
    p[2].healthy = False
    moved = {k for k, v in chosen.items() if pick_cache_aware(p, d, set(), {}, k, policy).prefill.address != v[0]}
    assert moved == {k for k, v in chosen.items() if v[0] == "p2"}
    p[2].healthy = True
    # expected reuse comes first; a much busier favoured service loses its preference
    key = "conversation-0"
    fav = chosen[key][0]
    other = next(e for e in p if e.address != fav)
    assert pick_cache_aware(p, d, set(), {other.address: 16}, key, policy).prefill.address == other.address
    next(e for e in p if e.address == fav).in_flight = 9
    assert pick_cache_aware(p, d, set(), {}, key, policy).prefill.address != fav
    # no reuse and no affinity: load decides
    assert pick_cache_aware(p, d, set(), {}, "", policy).reason == "load"


def test_pairing_policy_from_the_router_config():
    from services.common.config import RouterConfig

    assert PairingPolicy.of(RouterConfig(prefill=("p",), decode=("d",))) == PairingPolicy()
    got = PairingPolicy.of(RouterConfig(prefill=("p",), decode=("d",), pairing="load", balance_abs=2, balance_rel=3))
    assert got == PairingPolicy("load", 2, 3.0)
    for bad, field in (({"mode": "fast"}, "pairing"), ({"balance_abs": -1}, "balance_abs"),
                       ({"balance_rel": 0.5}, "balance_rel")):
        with pytest.raises(ValueError, match=field):
            PairingPolicy(**bad)


# ---- the health monitor feeds the indexes ----------------------------------------------------------
class IndexedPrefill(FakePrefill):
    """A fake prefill whose cache reports its events (``kv_events``); ``fail_events``: the call fails."""

    def __init__(self, address: str, seed: bytes = SEED_P):
        super().__init__(address)
        self.log = KvEventLog(seed)
        self.fail_events: BackendError | None = None

    async def kv_events(self, incarnation, after, timeout):
        if self.fail_events:
            raise self.fail_events
        return answer(self.log, incarnation, after)


def run(coro):
    return asyncio.run(coro)


def monitor_of(prefills, decodes, policy: PairingPolicy | None = None) -> HealthMonitor:
    cluster = Cluster([c.address for c in prefills], [c.address for c in decodes], policy)
    return HealthMonitor(cluster, {c.address: c for c in prefills}, {c.address: c for c in decodes},
                         RouterMetrics(), interval_s=30, rpc_timeout_s=1)


def test_a_restarted_service_loses_its_hits_at_the_next_poll():
    keys = block_keys(list(range(64)), SEED_P)
    svc = IndexedPrefill("p0")
    monitor = monitor_of([svc], [FakeDecode("d0")])
    index = monitor.cluster.prefills[0].index
    run(monitor.poll_once())
    assert index.known and index.reused_tokens(keys) == 0
    svc.log.stored(keys)
    run(monitor.poll_once())
    assert index.reused_tokens(keys) == 64
    svc.log = KvEventLog(SEED_P)  # restarted
    run(monitor.poll_once())
    assert index.incarnation == svc.log.incarnation and index.reused_tokens(keys) == 0
    # an unhealthy service, or a failed poll, keeps no index
    svc.log.stored(keys)
    run(monitor.poll_once())
    assert index.reused_tokens(keys) == 64
    svc.healthy = False
    run(monitor.poll_once())
    assert not monitor.cluster.prefills[0].healthy and not index.known and index.reused_tokens(keys) == 0
    svc.healthy = True
    run(monitor.poll_once())
    assert index.reused_tokens(keys) == 64
    svc.fail_events = BackendError(grpc.StatusCode.UNAVAILABLE, "down", "p0")
    run(monitor.poll_once())
    assert monitor.cluster.prefills[0].healthy and not index.known  # a failed KvEvents is no failed service
    # the decode fake has no kv_events (the base class: None): healthy, no index
    assert monitor.cluster.decodes[0].healthy and not monitor.cluster.decodes[0].index.known
    # load mode asks for nothing
    svc.fail_events = None
    load = monitor_of([svc], [FakeDecode("d0")], PairingPolicy(mode="load"))
    run(load.poll_once())
    assert not load.cluster.prefills[0].index.known


class EventsPrefillService(prefill_pb2_grpc.PrefillServicer):
    """Health and Status; KvEvents only when ``log`` is set (else the servicer's UNIMPLEMENTED)."""

    def __init__(self, log: KvEventLog | None):
        self.log = log

    def Status(self, request, context):
        return prefill_pb2.ServiceStatus(cp=1, serving=True)


class WithEvents(EventsPrefillService):
    def KvEvents(self, request, context):
        return answer(self.log, request.incarnation, request.after)


@pytest.fixture
def grpc_prefills():
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    log = KvEventLog(SEED_P)
    servers, addresses = [], []
    for servicer in (EventsPrefillService(None), WithEvents(log)):
        server = grpc.server(futures.ThreadPoolExecutor(4))
        prefill_pb2_grpc.add_PrefillServicer_to_server(servicer, server)
        h = health.HealthServicer()
        h.set("", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(h, server)
        addresses.append(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
        server.start()
        servers.append(server)
    yield addresses, log
    for server in servers:
        server.stop(0)


def test_kv_events_unimplemented_is_no_index_and_no_failure(grpc_prefills):
    (old, new), log = grpc_prefills
    keys = block_keys(list(range(40)), SEED_P)
    log.stored(keys)

    async def main():
        clients = [GrpcPrefillClient(old), GrpcPrefillClient(new)]
        try:
            assert await clients[0].kv_events("", 0, 5) is None
            got = await clients[1].kv_events("", 0, 5)
            assert got.reset and set(got.snapshot) == set(keys) and got.key_seed == SEED_P
            monitor = HealthMonitor(Cluster([old, new], []), {c.address: c for c in clients}, {}, RouterMetrics(),
                                    interval_s=30, rpc_timeout_s=5)
            await monitor.poll_once()
            unimplemented, indexed = monitor.cluster.prefills
            assert unimplemented.healthy and not unimplemented.index.known
            assert indexed.healthy and indexed.index.reused_tokens(keys) == 32
        finally:
            for c in clients:
                await c.close()

    run(main())


# ---- what the gRPC clients send and read -----------------------------------------------------------
class Recorder:
    def __init__(self, reply):
        self.reply, self.requests = reply, []

    async def __call__(self, request, timeout=None):
        self.requests.append(request)
        return self.reply


def test_reserve_and_prefill_carry_the_tokens_and_the_salt():
    sampling = common_pb2.Sampling(max_new_tokens=9)
    job = Job("r1", (5, 6, 7), sampling, output_ids=(8, 9), cache_salt="tenant-a", affinity="conv")

    async def main():
        decode, prefill = GrpcDecodeClient("127.0.0.1:9"), GrpcPrefillClient("127.0.0.1:9")  # never connected
        try:
            decode.stub = SimpleNamespace(Reserve=Recorder(kv_pb2.KvDestination(reservation_id="res")))
            reservation = await decode.reserve(job, 5)
            prefill.stub = SimpleNamespace(Prefill=Recorder(prefill_pb2.PrefillResponse(
                first_token=11, seed=3, cached_tokens=16, decode_cached_tokens=32, transfer_bytes=777)))
            first = await prefill.prefill(job, reservation.destination, 5)
            return decode.stub.Reserve.requests[0], prefill.stub.Prefill.requests[0], first
        finally:
            await decode.close()
            await prefill.close()

    reserve, prefill_req, first = run(main())
    assert list(reserve.prompt_ids) == [5, 6, 7, 8, 9] and reserve.num_tokens == 5
    assert reserve.cache_salt == "tenant-a" and reserve.max_new_tokens == 7
    assert prefill_req.cache_salt == "tenant-a" and list(prefill_req.output_ids) == [8, 9]
    assert (first.cached_tokens, first.decode_cached_tokens, first.transfer_bytes) == (16, 32, 777)
    # a resumed generation keeps its salt and affinity
    resumed = Dispatcher._resumed(job, 42, [8, 9, 10])
    assert (resumed.cache_salt, resumed.affinity, resumed.output_ids) == ("tenant-a", "conv", (8, 9, 10))


# ---- the HTTP fields, the per-request figures ------------------------------------------------------
class DecodeCachedPrefill(FakePrefill):
    async def prefill(self, job, destination, timeout):
        first = await super().prefill(job, destination, timeout)
        return FirstToken(first.token, first.seed, transfer_bytes=4096, cached_tokens=16, decode_cached_tokens=32,
                          forks=first.forks)


def test_http_cache_salt_and_affinity_reach_the_job_and_figures_reach_debug_ttft(start_router):
    prefill = DecodeCachedPrefill()
    h = start_router(prefills=[prefill])
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert post(h, "/v1/completions", {"prompt": "x", "max_tokens": 2, "cache_salt": "s1",
                                       "prompt_cache_key": "conv-1", "user": "u"}).status_code == 200
    assert post(h, "/v1/chat/completions", {**chat, "user": "u2"}).status_code == 200
    assert post(h, "/v1/chat/completions", {**chat, "cache_salt": ""}).status_code == 200
    assert [(j.cache_salt, j.affinity) for j in prefill.jobs] == [("s1", "conv-1"), ("", "u2"), ("", "")]
    for body, param in (({"cache_salt": 5}, "cache_salt"), ({"cache_salt": "x" * 257}, "cache_salt"),
                        ({"prompt_cache_key": ["k"]}, "prompt_cache_key"), ({"user": 7}, "user")):
        for path, base in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", chat)):
            err = post(h, path, {**base, **body})
            assert err.status_code == 400 and err.json()["error"]["param"] == param, (body, err.text)
    entries = get(h, "/debug/ttft").json()["requests"]
    assert len(entries) == 3
    assert all((e["cached_tokens"], e["decode_cached_tokens"], e["transfer_bytes"]) == (16, 32, 4096)
               for e in entries)
    text = get(h, "/metrics").text
    assert "cpserve_router_decode_cached_tokens_total 96.0" in text
    # the fakes keep no index, so no reuse is expected: two requests had an affinity, one none
    assert 'cpserve_router_pairing_decisions_total{reason="affinity"} 2.0' in text
    assert 'cpserve_router_pairing_decisions_total{reason="load"} 1.0' in text
    assert 'cpserve_router_pairing_decisions_total{reason="prefix"} 0.0' in text


# ---- a multi-turn workload on caching fakes -------------------------------------------------------
def leading(keys: list[int], held: set[int]) -> int:
    n = 0
    while n < len(keys) and keys[n] in held:
        n += 1
    return n


def answer_of(job: Job) -> list[int]:
    """The fake model's answer: 20–39 tokens, a function of the prompt."""
    rng = random.Random(hash(job.prompt_ids))
    return [rng.randrange(3, 1000) for _ in range(min(job.sampling.max_new_tokens, 20 + len(job.prompt_ids) % 20))]


class CachingPrefill(PrefillClient):
    """Caches every prompt's full blocks, reports them in KvEvents, reuses what it holds."""

    def __init__(self, address: str):
        self.address, self.log, self.held, self.served = address, KvEventLog(SEED_P), set(), 0

    async def prefill(self, job, destination, timeout):
        keys = block_keys(job.prompt_ids + job.output_ids, SEED_P, job.cache_salt)
        hit = leading(keys, self.held)
        self.log.stored([k for k in keys if k not in self.held])
        self.held.update(keys)
        self.served += 1
        await asyncio.sleep(0.001)
        sent = job.num_tokens - destination["prefix_tokens"]
        return FirstToken(answer_of(job)[len(job.output_ids)], 1234, cached_tokens=hit * BLOCK_TOKENS,
                          decode_cached_tokens=destination["prefix_tokens"], transfer_bytes=sent * 100)

    async def status(self, timeout):
        return PrefillLoad(0)

    async def check_health(self, timeout):
        return True

    async def kv_events(self, incarnation, after, timeout):
        return answer(self.log, incarnation, after)


class CachingDecode(DecodeClient):
    """Caches a finished request's prompt + output rows (all but the last token's)."""

    def __init__(self, address: str):
        self.address, self.log, self.held, self.served = address, KvEventLog(SEED_D), set(), 0
        self.prompts: dict[str, Job] = {}

    async def reserve(self, job, timeout):
        keys = block_keys(job.prompt_ids + job.output_ids, SEED_D, job.cache_salt)
        rid = uuid.uuid4().hex
        self.served += 1
        return Reservation(rid, {"reservation": rid, "prefix_tokens": leading(keys, self.held) * BLOCK_TOKENS})

    async def generate(self, job, reservation, start, timeout, fork=0):
        ids = answer_of(job)
        for i in range(1, len(ids)):
            await asyncio.sleep(0.0005)
            yield Token(ids[i], i)
        keys = block_keys(job.prompt_ids + tuple(ids[:-1]), SEED_D, job.cache_salt)
        self.log.stored([k for k in keys if k not in self.held])
        self.held.update(keys)
        yield Done("length", len(ids))

    async def abort(self, reservation, timeout, fork=None):
        pass

    async def status(self, timeout):
        return DecodeLoad((0,), (4096,), 0)

    async def check_health(self, timeout):
        return True

    async def kv_events(self, incarnation, after, timeout):
        return answer(self.log, incarnation, after)


@pytest.mark.parametrize("poll_s", [0.02, None])
def test_simulated_conversations_stay_with_their_caches_and_the_load_stays_spread(poll_s):
    """8 conversations × 5 turns, run concurrently; each turn's prompt is the last prompt + its
    answer + a new message. Reusable: the previous turn's prompt blocks on a prefill, its prompt
    + answer (less the last token) on a decode. The router gets ≥ 90 % of it while each prefill
    serves 30–70 % of the requests — with the services' events polled often, and with no poll
    after the first (the router's provisional entries alone)."""
    prefills, decodes = [CachingPrefill("p0"), CachingPrefill("p1")], [CachingDecode("d0"), CachingDecode("d1")]
    rng = random.Random(7)
    totals = {"prefill": [0, 0], "decode": [0, 0]}  # [reused, reusable]

    async def conversation(dispatcher: Dispatcher, c: int) -> None:
        prompt: tuple[int, ...] = tuple(rng.randrange(3, 1000) for _ in range(rng.randrange(50, 100)))
        previous = None
        for turn in range(5):
            job = Job(f"c{c}-t{turn}", prompt, common_pb2.Sampling(max_new_tokens=64))
            outputs, first = [], None
            async for event in dispatcher.generate(job):
                if isinstance(event, Token):
                    first = first or event
                    outputs.append(event.id)
            if previous is not None:
                prompt_rows, decode_rows = len(previous[0]), len(previous[0]) + len(previous[1]) - 1
                for kind, reused, held in (("prefill", first.cached_tokens, prompt_rows),
                                           ("decode", first.decode_cached_tokens, decode_rows)):
                    totals[kind][0] += reused
                    totals[kind][1] += held // BLOCK_TOKENS * BLOCK_TOKENS
            previous = (prompt, outputs)
            prompt = prompt + tuple(outputs) + tuple(rng.randrange(3, 1000) for _ in range(rng.randrange(20, 60)))
            await asyncio.sleep(rng.random() * 0.01)

    async def main() -> RouterMetrics:
        monitor = monitor_of(prefills, decodes)
        metrics = monitor.metrics
        dispatcher = Dispatcher(monitor.cluster, {c.address: c for c in prefills}, {c.address: c for c in decodes},
                                metrics, max_retries=2, request_timeout_s=30, rpc_timeout_s=1,
                                admission=Admission(16, 5.0))
        await monitor.poll_once()
        monitor.interval_s = poll_s or 3600
        polling = asyncio.create_task(monitor.run())
        try:
            await asyncio.gather(*(conversation(dispatcher, c) for c in range(8)))
        finally:
            polling.cancel()
            await dispatcher.drain()
        return metrics

    metrics = run(main())
    served = [p.served for p in prefills]
    assert sum(served) == 40 and all(0.3 <= n / 40 <= 0.7 for n in served), served
    assert all(0.3 <= d.served / 40 <= 0.7 for d in decodes), [d.served for d in decodes]
    for kind, (reused, reusable) in totals.items():
        assert reusable > 0 and reused >= 0.9 * reusable, (kind, reused, reusable)
    decisions = {r: metrics.registry.get_sample_value("cpserve_router_pairing_decisions_total", {"reason": r})
                 for r in ("prefix", "affinity", "load", "balance")}
    assert decisions["prefix"] >= 0.9 * 32 and sum(decisions.values()) == 40, decisions
    assert metrics.registry.get_sample_value("cpserve_router_decode_cached_tokens_total") == totals["decode"][0]
