"""Run a cpserve cluster (router + N prefill + M decode services) on a Ray cluster.

    ray job submit --working-dir . -- python -m deploy.ray.launch --config deploy/ray/cluster.yaml
    python -m deploy.ray.launch --config deploy/ray/cluster.yaml        # joins a running cluster,
                                                                        # else starts a local one on 127.0.0.1
    handle = launch(config); handle.router_url; handle.shutdown()       # from Python

Placement. Each service gets its own placement group, one bundle per rank ({"CPU":
threads_per_rank}, plus {"GPU": 1} with ``gpu: true``), strategy STRICT_PACK, so all ranks of a
service sit on one node. The router gets a one-bundle group. The *service actor* runs in bundle
0 and starts the service in-process (``serve_prefill`` / ``serve_decode`` / ``serve_router``).

Ranks are not Ray actors. The service's worker group (engine/parallel/group.py) spawns its C
rank processes as children of the service actor, inside the resources the placement group
reserved; their rendezvous store and command pipes stay on the node's loopback, owned by the
service's driver (the actor). This is deliberate: the group's fail-fast rule — any rank that dies
or raises kills the whole group at once, the driver sees it through process sentinels, and ranks
die with their driver (PR_SET_PDEATHSIG + watchdog) — relies on the driver owning the rank
processes. Ranks as separate actors would put Ray's asynchronous actor-death notification and
restarts between the driver and its ranks, and re-implement the group on top of Ray for no gain.
With ``gpu: true`` the bundles 1..C-1 hold a small placeholder actor each that pins one GPU; the
service actor sets CUDA_VISIBLE_DEVICES to the GPUs of all bundles before starting its ranks.

Addresses. A service binds ``ray.host`` when set (tests: 127.0.0.1), else the IP of the node it
landed on; it advertises that address (the node's IP when ``ray.host`` is a wildcard such as
0.0.0.0), and its KV transfer engine uses it too, unless the prefill/decode section sets
``advertise_host`` / ``kv_host``. The router is started last and receives every prefill and
decode address.

No process is left behind: ``shutdown()`` stops each service gracefully (its ranks exit), then
kills the actors and removes the placement groups. If the launching driver dies instead, Ray
kills its (non-detached) actors, and their ranks follow their driver.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
import yaml
from pydantic import BaseModel, ConfigDict, Field
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from services.common.config import (ConfigError, DecodeConfig, PrefillConfig, RouterConfig, build_config,
                                    load_config)

logger = logging.getLogger("cpserve.ray")
_WILDCARDS = ("", "0.0.0.0", "::")


# ---------------------------------------------------------------- configuration


class RaySection(BaseModel):
    """The ``ray:`` section of the cluster YAML."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    prefill_services: int = Field(1, ge=1)  # independent prefill services (each a CP group)
    decode_services: int = Field(1, ge=1)  # independent decode services (each a DCP group)
    gpu: bool = False  # one GPU per rank bundle
    host: str | None = None  # bind address of every service; None: the IP of the node it runs on
    start_timeout_s: float = Field(300.0, gt=0)  # reserving resources + starting each service
    stop_timeout_s: float = Field(30.0, gt=0)


@dataclass(frozen=True)
class LaunchConfig:
    prefill: PrefillConfig
    decode: DecodeConfig
    router: dict[str, Any]  # RouterConfig fields except prefill/decode (filled in by the launcher)
    ray: RaySection


def load_launch_config(source: str | Path | dict | None = None, **ray_overrides: Any) -> LaunchConfig:
    """A LaunchConfig from a YAML file (or an already-parsed dict) with ``prefill:``, ``decode:``,
    ``router:`` and ``ray:`` sections; ``ray_overrides`` that are not None replace ``ray:`` fields."""
    if isinstance(source, (str, Path)):
        try:
            doc = yaml.safe_load(Path(source).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise ConfigError(f"config: cannot read {source}: {e}") from None
    else:
        doc = dict(source or {})
    if not isinstance(doc, dict):
        raise ConfigError("config: must be a mapping of sections (prefill:, decode:, router:, ray:)")
    unknown = set(doc) - {"prefill", "decode", "router", "ray"}
    if unknown:
        raise ConfigError(f"config: unknown sections {sorted(unknown)}")
    router = dict(doc.get("router") or {})
    if {"prefill", "decode"} & set(router):
        raise ConfigError("router: prefill/decode addresses are filled in by the launcher; remove them")
    build_config(RouterConfig, "router", {**router, "prefill": ["-"], "decode": ["-"]})  # validate early
    section = {**(doc.get("ray") or {}), **{k: v for k, v in ray_overrides.items() if v is not None}}
    return LaunchConfig(prefill=_section("prefill", doc), decode=_section("decode", doc), router=router,
                        ray=build_config(RaySection, "ray", section))


def _section(name: str, doc: dict):
    body = doc.get(name) or {}
    if not isinstance(body, dict):
        raise ConfigError(f"{name}: must be a mapping, got {type(body).__name__}")
    # on Ray the placement group reserves threads_per_rank CPUs a rank: the count must be
    # explicit (not the cores of whichever node the actor lands on ÷ ranks); default 1
    return load_config(name, None, {"threads_per_rank": 1, **body})


# ---------------------------------------------------------------- actors


@ray.remote(num_cpus=0)
class _GpuSlot:
    """Holds one GPU of a service's placement group (bundles 1..C-1) and says which one."""

    def gpu_ids(self) -> list[str]:
        return [str(i) for i in ray.get_runtime_context().get_accelerator_ids().get("GPU", [])]


@ray.remote(max_restarts=0)
class ServiceActor:
    """One cpserve service (router, prefill or decode), started in this actor's process."""

    def __init__(self, kind: str):
        self.kind = kind
        self._stop = None
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    def start(self, config: Any, host: str | None, extra_gpu_ids: list[str] | None = None) -> str:
        """Start the service; return the address it serves on (``host:port``)."""
        from services.common.rpc import address

        node_ip = ray.util.get_node_ip_address()
        host = host or node_ip
        advertised = node_ip if host in _WILDCARDS else host
        if extra_gpu_ids is not None:  # this actor's own GPU first: rank 0 uses it
            own = [str(i) for i in ray.get_runtime_context().get_accelerator_ids().get("GPU", [])]
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(own + extra_gpu_ids)
        if self.kind == "router":
            from services.router.server import serve_router

            handle = serve_router(config.model_copy(update={"host": host}))
            port, self._stop = handle.http_port, handle.shutdown
        else:
            from services.decode.server import serve_decode
            from services.prefill.server import serve_prefill

            update = {"host": host}
            for name in ("advertise_host", "kv_host"):  # unless the config names them
                if name not in config.model_fields_set:
                    update[name] = advertised
            config = config.model_copy(update=update)
            advertised = config.advertised_host
            serve = serve_prefill if self.kind == "prefill" else serve_decode
            _, port, self._stop = serve(config)
        logger.info("serving %s on %s", self.kind, address(advertised, port))
        return address(advertised, port)

    def ping(self) -> int:
        return os.getpid()

    def stop(self) -> None:
        """Stop the service (its rank processes exit); idempotent."""
        stop, self._stop = self._stop, None
        if stop is not None:
            stop()


# ---------------------------------------------------------------- launching


@dataclass
class _Service:
    name: str
    actor: Any
    pg: Any
    slots: list = field(default_factory=list)


@dataclass
class RayCluster:
    """What ``launch`` returns: the router URL, the service addresses, and ``shutdown()``."""

    config: LaunchConfig
    router_url: str = ""
    prefill: list[str] = field(default_factory=list)
    decode: list[str] = field(default_factory=list)
    services: list[_Service] = field(default_factory=list)

    def alive(self, timeout_s: float = 10.0) -> bool:
        try:
            ray.get([s.actor.ping.remote() for s in self.services], timeout=timeout_s)
            return True
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
            return False

    def shutdown(self) -> None:
        """Stop every service (router first), kill the actors, remove the placement groups."""
        services, self.services = list(reversed(self.services)), []
        timeout_s = self.config.ray.stop_timeout_s
        for batch in ([s for s in services if s.name == "router"], [s for s in services if s.name != "router"]):
            stops = {s.name: s.actor.stop.remote() for s in batch}
            for name, ref in stops.items():
                try:
                    ray.get(ref, timeout=timeout_s)
                except Exception as e:  # noqa: BLE001 — a dead or stuck actor is killed below
                    logger.warning("stopping %s: %s", name, e)
        for s in services:
            for actor in [s.actor, *s.slots]:
                ray.kill(actor, no_restart=True)
        deadline = time.monotonic() + timeout_s
        for s in services:  # wait until Ray has processed the kills
            while time.monotonic() < deadline:
                try:
                    ray.get(s.actor.ping.remote(), timeout=1.0)
                except ray.exceptions.GetTimeoutError:
                    continue
                except ray.exceptions.RayActorError:
                    break
                time.sleep(0.1)
            remove_placement_group(s.pg)


def _bundles(kind: str, config: LaunchConfig) -> list[dict[str, float]]:
    if kind == "router":
        return [{"CPU": 1.0}]
    service = config.prefill if kind == "prefill" else config.decode
    ranks = service.cp if kind == "prefill" else service.dcp
    bundle = {"CPU": float(service.threads_per_rank or 1)}
    if config.ray.gpu:
        bundle["GPU"] = 1.0
    return [dict(bundle) for _ in range(ranks)]


def _place(cluster: RayCluster, kind: str, name: str) -> _Service:
    """Reserve the service's placement group and create its actor in bundle 0."""
    config = cluster.config
    bundles = _bundles(kind, config)
    pg = placement_group(bundles, strategy="STRICT_PACK", name=f"cpserve-{name}")
    try:
        ray.get(pg.ready(), timeout=config.ray.start_timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        raise RuntimeError(f"cannot reserve {len(bundles)} x {bundles[0]} on one node for {name} within "
                           f"{config.ray.start_timeout_s:g} s; available: {ray.available_resources()}") from None

    def in_bundle(i: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)

    gpu = bundles[0].get("GPU", 0.0)
    actor = ServiceActor.options(num_cpus=bundles[0]["CPU"], num_gpus=gpu,
                                 scheduling_strategy=in_bundle(0)).remote(kind)
    slots = [_GpuSlot.options(num_gpus=1, scheduling_strategy=in_bundle(i)).remote()
             for i in range(1, len(bundles))] if gpu else []
    service = _Service(name, actor, pg, slots)
    cluster.services.append(service)
    return service


def _start(cluster: RayCluster, services: list[tuple[_Service, Any]]) -> list[str]:
    """Start services in parallel; their addresses, in order."""
    host = cluster.config.ray.host
    refs = []
    for service, cfg in services:
        extra = None
        if cluster.config.ray.gpu and service.name != "router":
            ids = ray.get([s.gpu_ids.remote() for s in service.slots], timeout=cluster.config.ray.start_timeout_s)
            extra = [g for slot in ids for g in slot]
        refs.append(service.actor.start.remote(cfg, host, extra))
    return ray.get(refs, timeout=cluster.config.ray.start_timeout_s)


def launch(config: LaunchConfig | str | Path | dict) -> RayCluster:
    """Start N prefill, M decode services and the router on the connected Ray cluster (first
    ``connect()`` if this process is not connected). On failure everything started is torn down."""
    if not isinstance(config, LaunchConfig):
        config = load_launch_config(config)
    if not ray.is_initialized():
        connect(num_cpus=cpus_needed(config))
    cluster = RayCluster(config)
    try:
        engines = [(_place(cluster, "prefill", f"prefill-{i}"), config.prefill)
                   for i in range(config.ray.prefill_services)]
        engines += [(_place(cluster, "decode", f"decode-{i}"), config.decode)
                    for i in range(config.ray.decode_services)]
        addresses = _start(cluster, engines)
        cluster.prefill = addresses[:config.ray.prefill_services]
        cluster.decode = addresses[config.ray.prefill_services:]
        router_config = build_config(RouterConfig, "router", {
            "model": config.prefill.model, **config.router, "prefill": cluster.prefill, "decode": cluster.decode})
        (address,) = _start(cluster, [(_place(cluster, "router", "router"), router_config)])
        cluster.router_url = f"http://{address}"
        return cluster
    except BaseException:
        cluster.shutdown()
        raise


def connect(address: str | None = None, num_cpus: float | None = None) -> None:
    """Join a Ray cluster: ``address``, else $RAY_ADDRESS / a cluster running on this machine
    (``address="auto"``); if there is none, start a local one bound to 127.0.0.1 with at least
    ``num_cpus`` logical CPUs."""
    if address or os.environ.get("RAY_ADDRESS"):
        ray.init(address=address or os.environ["RAY_ADDRESS"])
        return
    try:
        ray.init(address="auto")
        return
    except ConnectionError:
        pass
    # Keep Ray on loopback: the env var for the GCS, raylet and workers started below, the
    # constant for this process (Ray read the variable at import; else it probes for a LAN route).
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray._private.ray_constants.ENABLE_RAY_CLUSTER = False
    ray.init(include_dashboard=False, _node_ip_address="127.0.0.1",
             num_cpus=max(os.cpu_count() or 1, int(num_cpus or 0)))


def cpus_needed(config: LaunchConfig) -> float:
    """Logical CPUs that every placement group of ``config`` reserves together."""
    r = config.ray
    return (sum(b["CPU"] for b in _bundles("router", config))
            + r.prefill_services * sum(b["CPU"] for b in _bundles("prefill", config))
            + r.decode_services * sum(b["CPU"] for b in _bundles("decode", config)))


# ---------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m deploy.ray.launch", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", help="YAML with prefill:, decode:, router: and ray: sections")
    p.add_argument("--address", default=None, help="Ray cluster address (default: $RAY_ADDRESS, 'auto', else local)")
    p.add_argument("--prefill-services", type=int, default=None)
    p.add_argument("--decode-services", type=int, default=None)
    p.add_argument("--gpu", action=argparse.BooleanOptionalAction, default=None, help="one GPU per rank")
    p.add_argument("--host", default=None, help="bind address of every service (default: the node's IP)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = load_launch_config(args.config, prefill_services=args.prefill_services,
                                    decode_services=args.decode_services, gpu=args.gpu, host=args.host)
    except ConfigError as e:
        p.error(str(e))
    connect(args.address, num_cpus=cpus_needed(config))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    t0 = time.perf_counter()
    cluster = launch(config)
    try:
        print(f"cluster ready in {time.perf_counter() - t0:.1f} s", flush=True)
        for name, addr in [*(("prefill", a) for a in cluster.prefill), *(("decode", a) for a in cluster.decode)]:
            print(f"  {name:8s}: {addr} (gRPC)")
        print(f"  router  : {cluster.router_url}/v1  (OpenAI API; /health, /metrics)", flush=True)
        while not stop.wait(5.0):
            if not cluster.alive():
                print("error: a service actor died; stopping", file=sys.stderr)
                return 1
        return 0
    finally:
        cluster.shutdown()
        print("stopped.", flush=True)


if __name__ == "__main__":
    sys.exit(main())
