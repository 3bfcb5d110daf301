"""deploy/ray/launch.py on a local, loopback-only Ray: router + prefill (CP 2) + decode (DCP 2) as
Ray actors in their placement groups; one completion equals the reference engine's; shutdown
leaves no actor, no reserved resource and no rank process behind."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import httpx
import pytest

from engine.model.sampler import SamplingParams
from engine.reference import ReferenceEngine

ray = pytest.importorskip("ray")
from deploy.ray.launch import cpus_needed, launch, load_launch_config  # noqa: E402  (needs ray)
from services.common.config import ConfigError  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROMPT = [5, 6, 7, 8]


# ---- /proc helpers ------------------------------------------------------------------------------
def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _ppid(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def _pids() -> list[int]:
    return [int(d) for d in os.listdir("/proc") if d.isdigit()]


def _descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for pid in _pids():
        children.setdefault(_ppid(pid), []).append(pid)
    out, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.add(child)
            todo.append(child)
    return out


def _under_ray_worker(pid: int) -> bool:
    pid = _ppid(pid)
    while pid > 1:
        cmd = _cmdline(pid)
        if cmd.startswith("ray::") or "default_worker.py" in cmd:
            return True
        pid = _ppid(pid)
    return False


def _service_processes() -> set[int]:
    """cpserve processes and their rank servers and ranks (forkserver) whose ancestor is a Ray worker (wherever they are)."""
    return {pid for pid in _pids() if pid != os.getpid() and ("cpserve" in _cmdline(pid) or "forkserver" in
                                                               _cmdline(pid)) and _under_ray_worker(pid)}


def _listening_addresses(pids: set[int]) -> set[str]:
    """host:port of every listening TCP socket held by ``pids``."""
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
        except OSError:
            continue
    found = set()
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] != "0A" or f[9] not in inodes:  # 0A: LISTEN
                continue
            hex_ip, hex_port = f[1].split(":")
            raw = bytes.fromhex(hex_ip)
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # per-word little endian
            ip = ".".join(map(str, raw)) if width == 8 else (
                ".".join(map(str, raw[12:])) if raw[:12] == bytes(10) + b"\xff\xff" else raw.hex())
            found.add(f"{ip}:{int(hex_port, 16)}")
    return found


def _loopback(addr: str) -> bool:
    host = addr.rsplit(":", 1)[0]
    return host == "127.0.0.1" or host == "0" * 31 + "1"  # ::1


def _mooncake_wildcard(addr: str) -> bool:
    """Mooncake's handshake and data ports: every interface, 15000-17000 (kvtransfer/transport.py)."""
    host, port = addr.rsplit(":", 1)
    return host in ("0.0.0.0", "0" * 32) and 15000 <= int(port) <= 17000


# ---- configuration (no Ray needed) ---------------------------------------------------------------
def test_example_config_and_errors():
    config = load_launch_config(ROOT / "deploy/ray/cluster.yaml", decode_services=3)
    assert (config.ray.prefill_services, config.ray.decode_services, config.prefill.cp) == (1, 3, 2)
    assert cpus_needed(config) == 1 + 2 + 3 * 2
    with pytest.raises(ConfigError, match="router: prefill/decode"):
        load_launch_config({"router": {"prefill": ["127.0.0.1:1"]}})
    with pytest.raises(ConfigError, match="ray.prefill_services"):
        load_launch_config({"ray": {"prefill_services": 0}})
    with pytest.raises(ConfigError, match="unknown sections"):
        load_launch_config({"prefil": {}})


# ---- the cluster ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def local_ray():
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # run-tests.sh sets it too
    cwd = os.getcwd()
    os.chdir(ROOT)  # Ray puts the driver's cwd on the workers' sys.path: deploy/ must be importable
    try:
        ray.init(num_cpus=8, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    finally:
        os.chdir(cwd)
    yield
    ray.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_launch_generate_shutdown(local_ray):
    total = ray.cluster_resources()
    expected = ReferenceEngine("tiny").generate([PROMPT], SamplingParams(max_new_tokens=8, stop_token_ids=()))
    t0 = time.perf_counter()
    config = load_launch_config({"prefill": {"cp": 2}, "decode": {"dcp": 2}, "router": {"port": 0},
                                 "ray": {"host": "127.0.0.1", "start_timeout_s": 120, "stop_timeout_s": 20}})
    cluster = launch(config)
    try:
        started = time.perf_counter() - t0
        assert cluster.router_url.startswith("http://127.0.0.1:")
        assert len(cluster.prefill) == len(cluster.decode) == 1
        # Every reservation is in place: 1 (router) + 2 (prefill) + 2 (decode) CPUs.
        assert ray.available_resources().get("CPU", 0) == total["CPU"] - 5

        ranks = _service_processes()
        assert len(ranks) >= 4, f"expected 2 prefill + 2 decode rank processes under Ray workers, got {ranks}"
        # Ray (GCS, raylet, workers), the service actors and the router: loopback only. The rank
        # processes too, except Mooncake's transfer-engine ports, which it binds on every interface
        # by design (PLATFORM.md); inside run-tests.sh's namespace there is no other interface.
        ray_side = _listening_addresses(_descendants(os.getpid()) - ranks)
        assert ray_side and all(_loopback(a) for a in ray_side), f"not on loopback: {sorted(ray_side)}"
        rank_side = _listening_addresses(ranks)
        odd = sorted(a for a in rank_side if not (_loopback(a) or _mooncake_wildcard(a)))
        assert not odd, f"rank sockets neither loopback nor Mooncake's: {odd}"
        if os.environ.get("CPSERVE_NETNS") == "1":
            assert [name for _, name in socket.if_nameindex()] == ["lo"]

        t1 = time.perf_counter()
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        with httpx.Client(trust_env=False, timeout=120) as client:
            r = client.post(f"{cluster.router_url}/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == expected[0].output_ids
        served = time.perf_counter() - t1
    finally:
        actors = [s.actor for s in cluster.services]
        t2 = time.perf_counter()
        cluster.shutdown()
        stopped = time.perf_counter() - t2

    for actor in actors:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.ping.remote(), timeout=10)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        left = {p for p in ranks if _cmdline(p)} | _service_processes()
        free = ray.available_resources()
        if not left and free.get("CPU") == total["CPU"] and not any("_group_" in k for k in free):
            break
        time.sleep(0.2)
    assert not left, {p: _cmdline(p) for p in left}
    assert free.get("CPU") == total["CPU"] and not any("_group_" in k for k in free), free
    print(f"\nray: launch {started:.1f} s, completion {served:.1f} s, shutdown {stopped:.1f} s, "
          f"all {time.perf_counter() - t0:.1f} s")
