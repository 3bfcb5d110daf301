"""Service configuration: one frozen pydantic model per service, from YAML plus CLI overrides.

A YAML file may hold several sections (``prefill:``, ``decode:``, ``router:``); each service
reads its own. Every parallel degree (``cp``, ``dcp``) is a plain factor of that service's rank
count; no option changes another's meaning. Servers bind 127.0.0.1 unless ``host`` says
otherwise; ``port: 0`` picks a free port (the server reports the one it bound).

Errors are :class:`ConfigError` (a ``ValueError``) whose message names the field, e.g.
``decode.dcp: Input should be greater than or equal to 1``.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class ConfigError(ValueError):
    """A bad configuration value; the message starts with ``section.field``."""


class _InternalPlaneConfig(BaseModel):
    """Credentials of internal gRPC (services/common/security.py): the shared token comes from
    $CPSERVE_INTERNAL_TOKEN or this file; TLS from PEM files (tls_ca: mutual TLS)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    internal_token_file: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None


class _ServiceConfig(_InternalPlaneConfig):
    """Fields every engine-backed service has."""

    model: str = "tiny"
    dtype: Literal["auto", "bf16", "fp16", "fp32"] = "auto"  # auto: the checkpoint's torch_dtype
    # how cache entries are stored (engine/cache/kvformat.py): auto = the compute dtype; fp8 = e4m3 with
    # a per-layer scale (576 bytes a layer at DeepSeek's sizes); fp8_ds_mla = DeepSeek's 656-byte layout.
    # Prefill and decode must agree (checked with the layout fingerprint).
    kv_cache_dtype: Literal["auto", "fp32", "bf16", "fp8", "fp8_ds_mla"] = "auto"
    generation_config: Literal["auto", "none"] = "auto"  # none: generation_config.json's eos ids are not stop ids
    page_size: int = Field(16, ge=1)
    max_cache_tokens: int = Field(1 << 16, ge=1)
    # torch threads in each rank process; None: cores this process may use ÷ the group's ranks
    # (engine/parallel/threads.py; `cpserve up` passes cores ÷ all the ranks it starts)
    threads_per_rank: int | None = Field(None, ge=1)
    # routed experts: ep = partitioned across the group's ranks (each loads only its own),
    # replicate = every rank holds them all (engine/parallel/expert.py); a group of one holds all
    moe_parallel: Literal["ep", "replicate"] = "ep"
    # Keep finished requests' full pages (prefill: the prompt's; decode: the prompt's and the
    # output's) as cached pages, reused by later requests with the same prefix: prefill computes
    # only the new tokens, decode is sent only the new tokens. Idle cached pages are evicted
    # (LRU) whenever rows are needed. --no-prefix-cache turns it off.
    prefix_cache: bool = True
    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, le=65535)  # 0: pick a free port
    kv_protocol: Literal["tcp", "rdma"] = "tcp"
    kv_host: str = "127.0.0.1"  # address the KV transfer engine advertises (it listens on every interface)
    # the ports Mooncake's listeners (two per rank) are drawn from; it cannot bind them to one
    # address, so this range is what a firewall or NetworkPolicy admits (kvtransfer/transport.py)
    kv_port_range: str = "15000-16999"
    # address peers use to reach this service (default: host; for a wildcard host, $POD_IP or
    # this machine's primary address)
    advertise_host: str | None = None
    max_queue: int = Field(64, ge=1)  # requests waiting for the engine; more → RESOURCE_EXHAUSTED
    # a plaintext listener serving only grpc.health.v1 (for probes that cannot speak TLS); 0: a free port
    health_port: int | None = Field(None, ge=0, le=65535)
    # HTTP /metrics of this service (rows per rank, queue depth, step time, KV transfer); 0: a free port
    metrics_port: int | None = Field(None, ge=0, le=65535)

    @field_validator("kv_port_range")
    @classmethod
    def _check_kv_ports(cls, value: str) -> str:
        from kvtransfer.transport import parse_port_range

        parse_port_range(value)
        return value

    @property
    def thread_plan(self):
        """Threads per rank for this service's group (``threads_per_rank``, or cores ÷ ranks)."""
        from engine.parallel.threads import plan_threads

        return plan_threads(self.ranks, self.threads_per_rank)

    @property
    def advertised_host(self) -> str:
        """Where peers dial this service: `advertise_host`, else `host` — never a wildcard: a
        service bound to 0.0.0.0 / :: advertises :func:`primary_address`."""
        host = self.advertise_host or self.host
        if host in WILDCARDS:
            return primary_address(ipv6=host == "::")
        return host


WILDCARDS = ("0.0.0.0", "::", "")


def primary_address(ipv6: bool = False) -> str:
    """A concrete address of this machine that peers can dial: ``$POD_IP`` (Kubernetes' downward
    API) if set, else the source address of the default route (a UDP ``connect`` picks it and
    sends nothing), else loopback (a machine with no route, e.g. a loopback-only namespace)."""
    pod_ip = os.environ.get("POD_IP", "").strip()
    if pod_ip:
        return pod_ip
    family, probe = (socket.AF_INET6, "2001:db8::1") if ipv6 else (socket.AF_INET, "192.0.2.1")  # documentation nets
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((probe, 9))
            found = s.getsockname()[0]
    except OSError:
        found = ""
    if found and found not in WILDCARDS:
        return found
    return "::1" if ipv6 else "127.0.0.1"


class PrefillConfig(_ServiceConfig):
    cp: int = Field(2, ge=1)
    strategy: Literal["interleave", "zigzag"] = "interleave"
    layer_split: bool = False
    # how the CP ranks attend across the prompt: allgather = every layer's new entries are
    # all-gathered, every rank holds every row; ring = blocks passed round the ring over a cache
    # sharded 1/C per rank, striped by position (no layer split; engine/parallel/ring.py)
    cp_attention: Literal["allgather", "ring"] = "allgather"
    # the ring's mode per forward: pass_kv (cache rows travel), pass_q (queries travel), or auto
    # (the cheaper by the selector's estimate, from constants measured at start-up)
    cp_ring_mode: Literal["auto", "pass_kv", "pass_q"] = "auto"
    # push each layer's KV to decode while later layers compute (the hand-off then adds only
    # the last layer's push to TTFT); --no-overlap: push the whole prompt after its forward
    overlap: bool = True
    chunk_size: int = Field(4096, ge=1)

    @model_validator(mode="after")
    def _check_cp_attention(self) -> "PrefillConfig":
        from engine.parallel.layout import check_cp_attention  # the engine's rule (a torch-free module)

        check_cp_attention(self.cp_attention, self.strategy, self.layer_split)
        return self

    @property
    def ranks(self) -> int:
        return self.cp

    @property
    def engine_kwargs(self) -> dict[str, Any]:
        """Arguments of engine.prefill_engine.CPPrefillEngine."""
        return dict(model=self.model, cp=self.cp, strategy=self.strategy, layer_split=self.layer_split,
                    cp_attention=self.cp_attention, cp_ring_mode=self.cp_ring_mode, overlap=self.overlap,
                    dtype=self.dtype, generation_config=self.generation_config, chunk_size=self.chunk_size,
                    page_size=self.page_size,
                    max_cache_tokens=self.max_cache_tokens, threads_per_rank=self.thread_plan.threads,
                    kv_transport=self.kv_protocol, kv_host=self.kv_host, prefix_cache=self.prefix_cache,
                    moe_parallel=self.moe_parallel, kv_cache_dtype=self.kv_cache_dtype)


class DecodeConfig(_ServiceConfig):
    dcp: int = Field(2, ge=1)
    dcp_comm: Literal["a2a", "ag_rs"] = "a2a"
    indexer: Literal["copied", "split"] = "copied"
    replicate_q_proj: bool = False
    # cache bytes per rank (e.g. 20GiB, 512MiB): the pool gets as many rows as fit; overrides
    # max_cache_tokens (which sizes the pool by tokens)
    kv_cache_memory: str | None = None
    lease_s: float = Field(30.0, gt=0)  # a reservation lapses unless BeginWrite comes within this
    # a write lapses (rows freed) unless the writer renews it (BeginWrite per chunk) within this
    write_lease_s: float = Field(60.0, gt=0)

    @field_validator("kv_cache_memory", mode="before")
    @classmethod
    def _check_kv_cache_memory(cls, value):
        from engine.cache.capacity import parse_bytes

        if value is None:
            return None
        parse_bytes(value, "kv_cache_memory")
        return str(value)

    @property
    def ranks(self) -> int:
        return self.dcp

    @property
    def engine_kwargs(self) -> dict[str, Any]:
        """Arguments of engine.decode_engine.DCPDecodeEngine (prompts arrive as KV only)."""
        return dict(model=self.model, dcp=self.dcp, exchange=self.dcp_comm, indexer=self.indexer,
                    replicate_q_proj=self.replicate_q_proj, dtype=self.dtype,
                    generation_config=self.generation_config, page_size=self.page_size,
                    max_cache_tokens=self.max_cache_tokens, threads_per_rank=self.thread_plan.threads,
                    reference_prefill=False, pipelined=True, kv_transport=self.kv_protocol, kv_host=self.kv_host,
                    lease_s=self.lease_s, write_lease_s=self.write_lease_s, moe_parallel=self.moe_parallel,
                    prefix_cache=self.prefix_cache,
                    kv_cache_memory=self.kv_cache_memory, kv_cache_dtype=self.kv_cache_dtype)


SECTIONS: dict[str, type[_ServiceConfig]] = {"prefill": PrefillConfig, "decode": DecodeConfig}
C = TypeVar("C", bound=_ServiceConfig)


def _describe(section: str, err: ValidationError) -> str:
    parts = []
    for e in err.errors():
        where = ".".join(str(x) for x in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")  # our validators' messages stand alone
        head, sep, rest = msg.partition(": ")
        if not where and sep and head.isidentifier():  # a check across fields names the one to change
            where, msg = head, rest
        parts.append(f"{section}.{where}: {msg}" if where else f"{section}: {msg}")
    return "; ".join(parts)


def build_config(cls: type[C], section: str, values: dict[str, Any]) -> C:
    try:
        return cls.model_validate(values)
    except ValidationError as e:
        raise ConfigError(_describe(section, e)) from None


def load_config(section: str, path: str | Path | None = None, overrides: dict[str, Any] | None = None):
    """The ``section`` ("prefill" | "decode") config: the YAML file's section (if a file is
    given), then ``overrides`` (entries whose value is None are ignored, so argparse defaults
    of None mean "not given")."""
    if section not in SECTIONS:
        raise ConfigError(f"section: {section!r} is not one of {', '.join(SECTIONS)}")
    values: dict[str, Any] = {}
    if path is not None:
        try:
            doc = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise ConfigError(f"config: cannot read {path}: {e}") from None
        if not isinstance(doc, dict):
            raise ConfigError(f"config: {path} must hold a mapping of sections (prefill:, decode:, router:)")
        body = doc.get(section) or {}
        if not isinstance(body, dict):
            raise ConfigError(f"{section}: must be a mapping, got {type(body).__name__}")
        values.update(body)
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    return build_config(SECTIONS[section], section, values)


class RouterConfig(_InternalPlaneConfig):
    """The router (services/router): which services it pairs, and its two fronts.

    ``port``/``grpc_port`` 0 pick a free port (the handle reports the bound one); ``grpc_port:
    null`` turns the gRPC front off. The router loads ``model``'s config and tokenizer to
    validate and tokenize requests; it never loads weights."""

    prefill: tuple[str, ...] = Field(min_length=1)  # host:port of each prefill service
    decode: tuple[str, ...] = Field(min_length=1)  # host:port of each decode service
    model: str = "tiny"
    served_model_name: str | None = None  # the name clients send as "model" (default: ``model``)
    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, le=65535)  # HTTP (OpenAI API, /health, /metrics)
    grpc_port: int | None = Field(0, ge=0, le=65535)
    api_key: str | None = Field(None, repr=False)  # set: clients must send "Authorization: Bearer <key>"
    api_key_file: str | None = None  # the api key from a file (or $CPSERVE_API_KEY), not a flag that shows in ps
    max_retries: int = Field(2, ge=0)  # other pairs tried after a failure before the first token
    request_timeout_s: float = Field(600.0, gt=0)  # a whole request, arrival to last token
    rpc_timeout_s: float = Field(5.0, gt=0)  # health, Status and Abort calls
    health_interval_s: float = Field(2.0, gt=0)  # health and Status polling of every service
    # for requests without max_tokens; None (the default): up to the context limit, as vLLM
    default_max_tokens: int | None = Field(None, ge=1)
    # decode rows: a request finding none waits in the router's queue (at most max_waiting
    # requests, each at most max_wait_s), then 429 / RESOURCE_EXHAUSTED
    max_waiting: int = Field(256, ge=0)
    max_wait_s: float = Field(30.0, ge=0)
    tokenizer: str | None = None  # tokenizer directory (default: the checkpoint's)
    trust_remote_code: bool = False  # run code a tokenizer ships (auto_map in tokenizer_config.json)
    chat_template: str | None = None  # a Jinja file replacing the tokenizer's chat template
    # auto: generation_config.json's eos ids stop, its temperature/top_p/top_k are request defaults
    generation_config: Literal["auto", "none"] = "auto"
    # prompt + max_tokens limit (default: the config's max_position_embeddings, capped by the cache)
    max_model_len: int | None = Field(None, ge=1)
    # the largest request body (HTTP 413 above it, checked from Content-Length before reading) and
    # gRPC message; None: 1 MiB + 64 bytes per token of max_model_len (services/router/intake.py)
    max_request_bytes: int | None = Field(None, ge=1024)
    request_read_timeout_s: float = Field(30.0, gt=0)  # a body not whole this long after arrival: 408
    # parsing, tokenization and large responses run in threads: small bodies (<= 16 KiB) in a lane
    # of their own, larger ones in parse_workers threads (None: half the CPUs, 1 to 4 — they
    # compete with the loop and the engine ranks for cores), at most max_large_requests of them
    # running or waiting (more: 503 + Retry-After)
    parse_workers: int | None = Field(None, ge=1)
    max_large_requests: int = Field(16, ge=1)
    # which (prefill, decode) pair takes a request (services/router/pairing.py): cache_aware =
    # the most KV expected to be reused on both sides, unless that service is much busier than
    # the least loaded of its kind (load > min + balance_abs and > balance_rel x min); load =
    # least outstanding work only
    pairing: Literal["cache_aware", "load"] = "cache_aware"
    balance_abs: int = Field(4, ge=0)
    balance_rel: float = Field(1.5, ge=1.0)
    # ... and a service's cached prefix counts only if it covers this fraction of the request
    cache_threshold: float = Field(0.25, ge=0.0, le=1.0)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model


SECTIONS["router"] = RouterConfig  # type: ignore[assignment]  (not an engine-backed service)
