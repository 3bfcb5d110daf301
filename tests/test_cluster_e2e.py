"""The disaggregated cluster end to end, as `cpserve up` runs it (each service its own process),
driven with the official `openai` client: outputs equal `cpserve reference`, concurrency,
faults, metrics."""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
import signal
import threading
import time

import grpc
import httpx
import openai
import pytest
from unittest import mock
import torch

from engine.model.sampler import SamplingParams
from engine.reference import ReferenceEngine
from services.up import cluster_args as up_args
from services.up import start_cluster, stop_cluster

pytestmark = pytest.mark.slow
MAX_TOKENS = 12
LENGTHS = [1, 7, 100, 2000]


def cluster_args(**kw) -> argparse.Namespace:
    base = vars(up_args(["--model", "tiny", "--prefill-cp", "2", "--cp-strategy", "interleave",
                         "--decode-dcp", "2", "--indexer", "copied", "--dcp-comm", "a2a"]))
    unknown = set(kw) - set(base)
    assert not unknown, f"not options of cpserve up: {sorted(unknown)}"
    return argparse.Namespace(**{**base, **kw})


def prompts(vocab=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in LENGTHS]


_REF: dict[str, ReferenceEngine] = {}


def reference(model: str, ids: list[int], n: int = MAX_TOKENS) -> list[int]:
    if model not in _REF:
        _REF[model] = ReferenceEngine(model)
    return _REF[model].generate([ids], SamplingParams(max_new_tokens=n, stop_token_ids=()))[0].output_ids


def client_for(children) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{children[-1].address}/v1", api_key="none", max_retries=0,
                         http_client=httpx.Client(trust_env=False, timeout=300))


EXTRA = {"ignore_eos": True, "return_token_ids": True}


def completion_ids(client, model, prompt, stream):
    if not stream:
        r = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, extra_body=EXTRA)
        return r.choices[0].token_ids
    ids = []
    for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                           stream=True, extra_body=EXTRA):
        ids += getattr(chunk.choices[0], "token_ids", None) or [] if chunk.choices else []
    return ids


def ref_seq(model: str, ids: list[int], **kw):
    if model not in _REF:
        _REF[model] = ReferenceEngine(model)
    return _REF[model].generate([ids], SamplingParams(**{"max_new_tokens": MAX_TOKENS, "stop_token_ids": (), **kw}))[0]


def streamed_choices(stream) -> dict[int, dict]:
    """A stream's chunks gathered per choice: token ids, text, logprob entries."""
    out: dict[int, dict] = {}
    for chunk in stream:
        for c in chunk.choices:
            d = out.setdefault(c.index, {"ids": [], "text": "", "lp": [], "finish": None})
            d["ids"] += getattr(c, "token_ids", None) or []
            d["text"] += (c.text if hasattr(c, "text") else (c.delta.content or ""))
            if c.logprobs is not None:
                d["lp"] += c.logprobs.content if hasattr(c.logprobs, "content") else c.logprobs.token_logprobs
            d["finish"] = c.finish_reason or d["finish"]
    return out


def check_sampling_outputs(client, model: str) -> None:
    """logprobs, echo, n, prompt lists, penalties through the OpenAI client, streaming and not,
    against the reference engine: prompt logprobs within 1e-5, generated ones within 1e-4."""
    (p,) = [x for x in prompts(seed=3) if len(x) == 100]
    ref = ref_seq(model, p, max_new_tokens=3, logprobs=3, prompt_logprobs=3)
    r = client.completions.create(model=model, prompt=p, max_tokens=3, temperature=0, logprobs=3, echo=True,
                                  extra_body=EXTRA)
    lp = r.choices[0].logprobs
    assert r.choices[0].token_ids == ref.output_ids
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(p) + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # the first prompt token: no context
    prompt_ref = ref.prompt_logprobs()
    assert max(abs(a - b.logprob) for a, b in zip(lp.token_logprobs[1:len(p)], prompt_ref)) < 1e-5
    assert max(abs(a - b.logprob) for a, b in zip(lp.token_logprobs[len(p):], ref.logprobs)) < 1e-4
    for top, entry in zip(lp.top_logprobs[1:], prompt_ref + ref.logprobs):  # the top 3 and the token itself,
        allowed = [*entry.top_logprobs, entry.logprob]  # keyed by text (two ids may share one: fewer keys)
        assert max(top.values()) == pytest.approx(entry.top_logprobs[0], abs=1e-4)
        assert all(min(abs(v - a) for a in allowed) < 1e-4 for v in top.values())
    streamed = streamed_choices(client.completions.create(model=model, prompt=p, max_tokens=3, temperature=0,
                                                          logprobs=3, echo=True, stream=True, extra_body=EXTRA))
    assert streamed[0]["ids"] == ref.output_ids
    assert streamed[0]["lp"][0] is None and streamed[0]["lp"][1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-6)

    # chat: logprobs + top_logprobs
    msgs = [{"role": "user", "content": "What is context parallelism?"}]
    r = client.chat.completions.create(model=model, messages=msgs, max_tokens=5, temperature=0, logprobs=True,
                                       top_logprobs=2, extra_body=EXTRA)
    prompt_ids = r.model_extra.get("prompt_token_ids") or r.prompt_token_ids
    ref = ref_seq(model, prompt_ids, max_new_tokens=5, logprobs=2)
    content = r.choices[0].logprobs.content
    assert r.choices[0].token_ids == ref.output_ids and len(content) == 5
    assert max(abs(c.logprob - e.logprob) for c, e in zip(content, ref.logprobs)) < 1e-4
    assert all(len(c.top_logprobs) == 2 for c in content)
    streamed = streamed_choices(client.chat.completions.create(
        model=model, messages=msgs, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2, stream=True,
        extra_body=EXTRA))
    assert [c.logprob for c in streamed[0]["lp"]] == pytest.approx([c.logprob for c in content], abs=1e-6)

    # n samples of a list of prompts: choice i·n + j is prompt i with seed + j, reproducibly
    two = [p[:30], p[40:47]]
    kw = dict(model=model, prompt=two, n=2, max_tokens=6, temperature=0.5, seed=17, extra_body=EXTRA)
    r = client.completions.create(**kw)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for c in r.choices:
        i, j = divmod(c.index, 2)
        assert c.token_ids == ref_seq(model, two[i], max_new_tokens=6, temperature=0.5, seed=17 + j).output_ids
    assert r.usage.prompt_tokens == 37 and r.usage.completion_tokens == 24
    streamed = streamed_choices(client.completions.create(stream=True, **kw))
    assert {k: v["ids"] for k, v in streamed.items()} == {c.index: c.token_ids for c in r.choices}

    # penalties, bias, min_tokens
    plain = ref_seq(model, p[:50], max_new_tokens=8).output_ids
    pen = dict(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.25, min_tokens=3)
    bias = {plain[1]: -3.0}
    r = client.completions.create(model=model, prompt=p[:50], max_tokens=8, temperature=0, logit_bias=bias,
                                  frequency_penalty=0.5, presence_penalty=0.25,
                                  extra_body={**EXTRA, "repetition_penalty": 1.3, "min_tokens": 3, "ignore_eos": False,
                                              "stop_token_ids": [plain[0]]})
    expect = ref_seq(model, p[:50], max_new_tokens=8, logit_bias=tuple(bias.items()),
                     stop_token_ids=(plain[0], *_REF[model].cfg.eos_token_ids), **pen).output_ids
    assert r.choices[0].token_ids == expect and expect != plain[: len(expect)]


@pytest.mark.timeout(120)
def test_a_bad_router_flag_fails_the_cluster_start_naming_the_field():
    """The router starts alongside the engine services and checks its flags while they load: a
    bad one ends the start, naming the field, and leaves no process behind."""
    import subprocess

    seen: list = []
    real = subprocess.Popen

    def record(*a, **kw):
        seen.append(real(*a, **kw))
        return seen[-1]

    with mock.patch.object(subprocess, "Popen", record):
        with pytest.raises(RuntimeError, match="router service did not start") as info:
            start_cluster(cluster_args(max_model_len=10**9), 0, None, quiet=True)
    assert "max_model_len" in str(info.value)
    assert [c.args[4] for c in seen] == ["prefill", "decode", "router"]
    assert all(c.poll() is not None for c in seen), "a service outlived the failed start"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("model,kw", [
    # (the default layout, tiny + interleave + a2a + copied index, is the module cluster's below)
    ("tiny", dict(layer_split=True, indexer="split", dcp_comm="ag_rs", overlap=False)),
    ("tiny-v3", dict(cp_strategy="zigzag")),
])
def test_openai_client_outputs_equal_the_reference(model, kw):
    children = start_cluster(cluster_args(model=model, **kw), 0, None, quiet=True)
    # KV pushed after the forward (--no-overlap) or layer by layer during it (the default)
    assert ("--no-overlap" in children[0].proc.args) == (kw.get("overlap") is False)
    try:
        client = client_for(children)
        for i, p in enumerate(prompts()):
            expected = reference(model, p)
            assert completion_ids(client, model, p, stream=bool(i % 2)) == expected, len(p)
        # chat, streaming and not: the router renders messages; compare on its prompt ids
        msgs = [{"role": "user", "content": "Say something about context parallelism."}]
        r = client.chat.completions.create(model=model, messages=msgs, max_tokens=MAX_TOKENS, temperature=0,
                                           extra_body=EXTRA)
        prompt_ids = r.model_extra.get("prompt_token_ids") or r.prompt_token_ids
        assert r.choices[0].token_ids == reference(model, prompt_ids)
        streamed = []
        for chunk in client.chat.completions.create(model=model, messages=msgs, max_tokens=MAX_TOKENS, temperature=0,
                                                    stream=True, extra_body=EXTRA):
            if chunk.choices:
                streamed += getattr(chunk.choices[0], "token_ids", None) or []
        assert streamed == r.choices[0].token_ids
        check_sampling_outputs(client, model)
    finally:
        stop_cluster(children)


def rows_used(children) -> float:
    text = httpx.get(f"http://{children[-1].address}/metrics", trust_env=False).text
    return sum(float(v) for v in re.findall(r"^cpserve_decode_cache_rows_used\{[^}]*\} (\S+)", text, re.M))


def wait_for(cond, timeout_s=15.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.25)
    return False


@pytest.fixture(scope="module")
def cluster():
    children = start_cluster(cluster_args(), 0, None, quiet=True)
    yield children
    stop_cluster(children)


@pytest.mark.timeout(300)
def test_default_layout_outputs_equal_the_reference(cluster):
    client = client_for(cluster)
    for i, p in enumerate(prompts()):
        assert completion_ids(client, "tiny", p, stream=bool(i % 2)) == reference("tiny", p), len(p)
    check_sampling_outputs(client, "tiny")


def test_internal_rpcs_need_the_token_cpserve_up_made(cluster):
    """`cpserve up` closes its internal plane with a fresh token: a direct Reserve without it is
    refused, with it (from the children's environment) it works."""
    from services.common.security import TOKEN_ENV, InternalPlane
    from services.protos import decode_pb2, decode_pb2_grpc

    token = cluster[1].env[TOKEN_ENV]
    assert len(token) >= 32 and token not in "".join(c for child in cluster for c in child.lines)
    req = decode_pb2.ReserveRequest(request_id="t", num_tokens=4, max_new_tokens=1)
    with InternalPlane().channel(cluster[1].address) as ch:
        with pytest.raises(grpc.RpcError) as e:
            decode_pb2_grpc.DecodeStub(ch).Reserve(req, timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with InternalPlane(token=token).channel(cluster[1].address) as ch:
        ref = decode_pb2_grpc.DecodeStub(ch).Reserve(req, timeout=10)
        decode_pb2_grpc.DecodeStub(ch).Abort(decode_pb2.ReservationRef(reservation_id=ref.reservation_id), timeout=10)


def _listeners() -> dict[int, tuple[str, int]]:
    """Every listening TCP socket of this network namespace: inode → (address, port)."""
    out = {}
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] != "0A":  # LISTEN
                    continue
                addr_hex, port_hex = cols[1].split(":")
                raw = bytes.fromhex(addr_hex)
                # the kernel prints each 32-bit word in host (little-endian) order
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                ip = ipaddress.ip_address(raw)
                ip = getattr(ip, "ipv4_mapped", None) or ip  # ::ffff:127.0.0.1 is 127.0.0.1
                out[int(cols[9])] = (str(ip), int(port_hex, 16))
    return out


def _tree(pid: int) -> set[int]:
    """``pid`` and all its descendants."""
    children: dict[int, list[int]] = {}
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/stat") as f:
                    children.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(p))
            except (FileNotFoundError, ProcessLookupError):
                pass
    out, todo = set(), [pid]
    while todo:
        out.add(q := todo.pop())
        todo += children.get(q, [])
    return out


def _sockets(pid: int) -> set[int]:
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    except (FileNotFoundError, PermissionError):
        pass
    return inodes


@pytest.mark.skipif(os.environ.get("CPSERVE_NETNS") != "1", reason="reads the sockets of a private network namespace")
def test_no_cluster_process_listens_on_a_wildcard_but_mooncake_in_its_port_range(cluster):
    """Every listener of the default cluster binds 127.0.0.1, except Mooncake's two per rank,
    which bind every interface whatever they are told (kvtransfer/transport.py): those must lie
    in the configured kv_port_range."""
    lo, hi = 15000, 16999  # the default kv_port_range
    listening = _listeners()
    seen, wild = 0, []
    for child in cluster:
        for pid in _tree(child.proc.pid):
            for inode in _sockets(pid) & set(listening):
                host, port = listening[inode]
                seen += 1
                if host not in ("127.0.0.1", "::1"):
                    wild.append((child.kind, pid, host, port))
    assert seen >= 3 + 8, seen  # 3 services' gRPC/HTTP ports at least, and 2 Mooncake listeners x 4 ranks
    assert len(wild) == 8, wild  # exactly Mooncake's: 2 per rank
    assert all(lo <= port <= hi for *_, port in wild), wild


@pytest.mark.timeout(600)
def test_64_concurrent_streams_are_exact(cluster):
    client = client_for(cluster)
    g = torch.Generator().manual_seed(5)
    ps = [torch.randint(3, 300, (int(n),), generator=g).tolist() for n in torch.randint(1, 300, (64,), generator=g)]
    expected = [reference("tiny", p) for p in ps]
    got: list = [None] * len(ps)

    def worker(i):
        got[i] = completion_ids(client, "tiny", ps[i], stream=True)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(ps))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(500)
    assert got == expected
    # metrics: histograms and per-rank cache gauges
    text = httpx.get(f"http://{cluster[-1].address}/metrics", trust_env=False).text
    assert re.search(r"^cpserve_router_ttft_seconds_count (\d+)", text, re.M)
    assert float(re.search(r"^cpserve_router_ttft_seconds_count (\S+)", text, re.M).group(1)) >= 64
    assert "cpserve_router_tpot_seconds_bucket" in text and "cpserve_router_e2e_seconds_bucket" in text
    assert len(re.findall(r'^cpserve_decode_cache_rows_free\{[^}]*rank="\d+"', text, re.M)) == 2
    assert wait_for(lambda: rows_used(cluster) == 0)


@pytest.mark.timeout(300)
def test_client_disconnect_frees_rows(cluster):
    url = f"http://{cluster[-1].address}/v1/completions"
    body = {"model": "tiny", "prompt": [5] * 50, "max_tokens": 3000, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.Client(trust_env=False, timeout=60) as c:
        with c.stream("POST", url, json=body) as resp:
            lines = resp.iter_lines()
            for _ in range(6):
                next(lines)
            # the request really holds decode rows (3,000 tokens to go) before the client leaves
            assert wait_for(lambda: rows_used(cluster) > 0, 10)
    assert wait_for(lambda: rows_used(cluster) == 0, 20)
    # the cluster keeps serving
    assert completion_ids(client_for(cluster), "tiny", [9, 8, 7], stream=False) == reference("tiny", [9, 8, 7])


def rank_pids(service_pid: int) -> list[int]:
    """The service's rank processes: forked by its rank server (a forkserver, the service's child)."""
    servers = [p for p in _descendants(service_pid) if "forkserver" in _cmdline(p)
               and _ppid(p) == service_pid]
    return sorted(p for p in _descendants(service_pid) if _ppid(p) in servers)


def _ppid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return 0


def health_of(address: str) -> int:
    """The service's grpc.health.v1 status (exempt from the internal token)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address, options=(("grpc.enable_http_proxy", 0),)) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status


@pytest.mark.timeout(300)
@pytest.mark.parametrize("victim", ["decode", "prefill"])
def test_a_dead_rank_fails_its_request_fast_then_the_group_rebuilds_itself(cluster, victim):
    """kill -9 of one rank mid-request: the request ends with an error within 5 s, the service
    reports NOT_SERVING, rebuilds its rank group and reports SERVING within 60 s, and the next
    request is exact — nothing restarted by hand."""
    from grpc_health.v1 import health_pb2

    client = client_for(cluster)
    service = cluster[0 if victim == "prefill" else 1]
    result: dict = {}

    def request() -> None:
        try:
            if victim == "decode":  # mid-stream: 3,000 tokens to go
                stream = client.completions.create(model="tiny", prompt=[5] * 40, max_tokens=3000, temperature=0,
                                                   stream=True, extra_body=EXTRA)
                result["first"] = next(iter(stream))
                for _ in stream:
                    pass
            else:  # mid-prefill: a 4,000-token prompt
                result["first"] = True
                completion_ids(client, "tiny", prompts()[3] * 2, stream=False)
            result["ended"] = "finished"
        except openai.APIError as e:
            result["ended"] = e
        result["t"] = time.monotonic()

    t = threading.Thread(target=request, daemon=True)
    t.start()
    assert wait_for(lambda: "first" in result, 30)
    time.sleep(0.3)
    victim_pid = rank_pids(service.proc.pid)[-1]
    os.kill(victim_pid, signal.SIGKILL)
    t0 = time.monotonic()
    t.join(30)
    assert isinstance(result.get("ended"), openai.APIError), result
    assert result["t"] - t0 < 5, f"the request ended {result['t'] - t0:.1f} s after the kill"
    statuses = []
    deadline = t0 + 60
    while time.monotonic() < deadline:
        statuses.append(health_of(service.address))
        if health_pb2.HealthCheckResponse.NOT_SERVING in statuses and statuses[-1] == \
                health_pb2.HealthCheckResponse.SERVING:
            break
        time.sleep(0.1)
    assert health_pb2.HealthCheckResponse.NOT_SERVING in statuses, "never reported NOT_SERVING"
    assert statuses[-1] == health_pb2.HealthCheckResponse.SERVING, f"not serving {time.monotonic() - t0:.0f} s later"
    assert victim_pid not in rank_pids(service.proc.pid) and len(rank_pids(service.proc.pid)) == 2
    # the router polls health and pairs with the rebuilt service again: the next request is exact
    p = prompts()[2]
    def all_healthy() -> bool:
        body = httpx.get(f"http://{cluster[-1].address}/health", trust_env=False).json()
        return all(e["healthy"] for e in body["prefill"] + body["decode"])

    assert wait_for(all_healthy, 15)
    assert completion_ids(client, "tiny", p, stream=True) == reference("tiny", p)


@pytest.mark.timeout(300)
def test_killing_the_prefill_service_mid_request_frees_decode_rows(tmp_path):
    """Killed while it writes, the prefill group never sends EndWrite: the aborted reservation
    stays quarantined (a late write may still land) until its write lease lapses, then its rows
    come back. (Killed before its BeginWrite, the rows come back at the abort.) A 4 s lease
    here instead of the default 60 s."""
    config = tmp_path / "c.yaml"
    config.write_text("decode:\n  write_lease_s: 4\n")
    children = start_cluster(cluster_args(config=str(config)), 0, None, quiet=True)
    try:
        client = client_for(children)
        result: dict = {}

        def long_request():
            try:
                result["ids"] = completion_ids(client, "tiny", prompts()[3] * 2, stream=False)
            except openai.APIError as e:
                result["error"] = e

        t = threading.Thread(target=long_request)
        t.start()
        time.sleep(0.5)
        os.killpg(children[0].proc.pid, signal.SIGKILL)
        t.join(60)
        assert "error" in result and result["error"].status_code in (502, 503)
        assert wait_for(lambda: rows_used(children) == 0, 20)
    finally:
        stop_cluster(children)


def test_cpserve_up_sends_a_demo_request_then_serves_until_interrupted(tmp_path):
    """`make up` runs `cpserve up`: it starts the three services on the trained demo model,
    prints a chat turn and a pass-key answer made through the whole cluster (the reference
    engine's tokens, and whether the key is right), serves, and stops every process on Ctrl-C."""
    import subprocess
    import sys
    from pathlib import Path

    from cpserve.demo_text import is_right
    from services.up import DEMO_CHAT, demo_passkey

    cpserve = Path(sys.executable).with_name("cpserve")
    proc = subprocess.Popen([str(cpserve), "up", "--port", "0", "--served-model-name", "demo-served",
                             "--dtype", "auto"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line.rstrip())
            if line.startswith("Ctrl-C stops every service."):
                break
        out = "\n".join(lines)
        assert lines and lines[-1].startswith("Ctrl-C stops"), out
        assert '"model": "demo-served"' in out, out  # the demo (which succeeded) and the hint use the served name
        router = re.search(r"router  : http://(\S+)/v1", out).group(1)
        assert httpx.get(f"http://{router}/health", trust_env=False, timeout=10).status_code == 200
        # (the services' own start-up lines, prefixed "[prefill] " etc., may interleave)
        assert re.search(r"^\[(prefill|decode)\] ", out, re.M), out
        answers = re.findall(r"^\s+-> (.*)$", out, re.M)
        timings = re.findall(r"^\s+(\d+) tokens, TTFT ([\d.]+) ms, TPOT ([\d.]+) ms", out, re.M)
        assert len(answers) == 2 and len(timings) == 2, out
        ref = ReferenceEngine("demo")
        tok = ref.tokenizer
        chat = ref.generate([tok.apply_chat_template([{"role": "user", "content": DEMO_CHAT}])],
                            SamplingParams(max_new_tokens=160))[0].output_ids
        task = demo_passkey(tok)
        key = ref.generate([tok.apply_chat_template([{"role": "user", "content": task.prompt}])],
                           SamplingParams(max_new_tokens=16))[0].output_ids
        assert answers[0] == repr(tok.decode(chat)) and int(timings[0][0]) == len(chat)
        verdict = "right" if is_right(task, tok.decode(key)) else "WRONG"
        assert answers[1] == f"{tok.decode(key)!r} ({verdict})" and int(timings[1][0]) == len(key)
        assert f"pass key {task.value} hidden at 40% of a" in out
        assert all(float(t[1]) > 0 and float(t[2]) > 0 for t in timings)
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0 and "stopped." in rest, rest
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_prefix_cache_reuses_prompt_pages_and_keeps_outputs_exact():
    """Reuse is on by default: a prompt sharing a prefix with an earlier one computes only its new
    tokens (usage.prompt_tokens_details.cached_tokens says how many it reused, whole 16-token
    pages), and every output still equals the reference engine's."""
    g = torch.Generator().manual_seed(11)
    a = torch.randint(3, 300, (150,), generator=g).tolist()
    b = a[:130] + torch.randint(3, 300, (40,), generator=g).tolist()
    children = start_cluster(cluster_args(), 0, None, quiet=True)
    try:
        client = client_for(children)
        cached = []
        for prompt in (a, b, a):
            r = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                          extra_body=EXTRA)
            assert r.choices[0].token_ids == reference("tiny", prompt)
            cached.append(r.usage.prompt_tokens_details.cached_tokens)
        # b shares 130 tokens with a: 8 whole pages; a again: all its 9 whole pages (at least
        # one prompt token is always computed, for the first token's logits).
        assert cached == [0, 128, 144]
        metrics = httpx.get(f"http://{children[-1].address}/metrics", trust_env=False, timeout=10).text
        assert re.search(r"^cpserve_prefix_cached_tokens_total 272\.0$", metrics, re.M), metrics
    finally:
        stop_cluster(children)


def test_stream_completion_reports_failures_as_runtime_errors():
    """What `cpserve up`'s demo and `cpserve generate` see when the router is not there or the
    stream fails: one RuntimeError saying what happened, never a traceback from httpx or a
    KeyError on an error event."""
    import json as json_
    import socket
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from services.up import stream_completion

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(RuntimeError, match="request to the router"):
        stream_completion(dead, {"model": "tiny", "prompt": "x"})

    class ErrorAfterFirstToken(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            first = {"choices": [{"index": 0, "text": "a", "token_ids": [100]}]}
            for event in (first, {"error": {"message": "decode rank 1 died"}}):
                self.wfile.write(f"data: {json_.dumps(event)}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), ErrorAfterFirstToken)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        with pytest.raises(RuntimeError, match="decode rank 1 died"):
            stream_completion(f"127.0.0.1:{server.server_port}", {"model": "tiny", "prompt": "x"})
    finally:
        server.shutdown()


def _descendants(pid: int) -> set[int]:
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        try:
            kids = open(f"/proc/{p}/task/{p}/children").read().split()
        except OSError:
            continue
        for k in map(int, kids):
            if k not in out:
                out.add(k)
                todo.append(k)
    return out


def _cmdline(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/cmdline").read().replace("\0", " ")[:120]
    except OSError:
        return "?"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.timeout(300)
def test_sigkill_of_cpserve_up_leaves_no_cluster_process():
    """`kill -9` of `cpserve up`: every service and rank process it started is gone within 10 s
    (the services get SIGTERM from their parent-death signal, their ranks follow)."""
    import subprocess
    import sys

    up = subprocess.Popen([sys.executable, "-m", "cpserve.cli", "up", "--no-demo", "--port", "0"],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    cluster: set[int] = set()
    try:
        for line in up.stdout:
            if "Ctrl-C stops every service" in line:
                break
        else:
            pytest.fail("cpserve up exited before it was ready")
        cluster = _descendants(up.pid)
        assert len(cluster) >= 9, cluster  # 3 services, 2 rank servers, 2 prefill ranks, 2 decode ranks
        up.kill()
        up.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_alive(p) for p in cluster):
            time.sleep(0.2)
        left = [p for p in cluster if _alive(p)]
        print(f"cluster gone {10 - (deadline - time.monotonic()):.1f} s after kill -9")
        assert not left, f"still alive 10 s after kill -9 of cpserve up: {[_cmdline(p) for p in left]}"
    finally:
        if up.poll() is None:
            up.kill()
        for p in cluster:  # whatever survived a failure must not outlive the test
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
