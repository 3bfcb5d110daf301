"""`cpserve serve prefill|decode|router`: run one service until SIGINT/SIGTERM.

Flags are the fields of the service's config model (services/common/config.py), spelled
``--field-name``; each given flag overrides the ``--config`` YAML file's section.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import types
import typing

from services.common.config import DecodeConfig, PrefillConfig, load_config


def _add_config_flags(p: argparse.ArgumentParser, model: type) -> None:
    p.add_argument("--config", help="YAML file with prefill:/decode:/router: sections")
    for name, info in model.model_fields.items():
        flag = "--" + name.replace("_", "-")
        hint = f"(default: {info.default})"
        if info.annotation is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=hint)
        elif typing.get_origin(info.annotation) is typing.Literal:
            p.add_argument(flag, choices=typing.get_args(info.annotation), default=None, help=hint)
        else:
            kind = info.annotation
            if typing.get_origin(kind) in (typing.Union, types.UnionType):  # `X | None`
                kind = next(a for a in typing.get_args(kind) if a is not type(None))
            p.add_argument(flag, type=kind, default=None, help=hint)


def _overrides(args: argparse.Namespace, model: type) -> dict:
    return {name: getattr(args, name) for name in model.model_fields}


SHUTDOWN_GRACE_S = 8.0  # after SIGTERM/SIGINT, a service that has not stopped by then exits hard


def _serve_until_stopped(kind: str, serve, config) -> int:
    """Start the service, print its address, serve until SIGINT/SIGTERM, then stop it.

    A signal during start-up (a model can take minutes to load) exits at once: nothing is
    served yet, and the rank processes die with this one (their parent-death signal). After a
    signal while serving, the shutdown gets SHUTDOWN_GRACE_S seconds, then the process exits
    anyway — a stop never hangs (`cpserve up` relies on it, see services/up.py). After a clean
    shutdown it exits at once (0), without the interpreter's teardown."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stop = threading.Event()
    serving = threading.Event()

    def on_signal(signum, _frame):
        if not serving.is_set():
            os._exit(128 + signum)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    plan = getattr(config, "thread_plan", None)
    if plan is not None:  # on stderr with the other logs: stdout's first line is the address
        logging.getLogger("cpserve.threads").log(logging.WARNING if plan.oversubscribed else logging.INFO,
                                                 "%s: %s", kind, plan.describe())
    _, port, shutdown = serve(config)
    serving.set()
    from services.common.rpc import address

    host = getattr(config, "advertised_host", config.host)  # engine services: never a wildcard
    print(f"serving {kind} on {address(host, port)}", flush=True)
    try:
        stop.wait()
    finally:
        timer = threading.Timer(SHUTDOWN_GRACE_S, lambda: os._exit(1))
        timer.daemon = True
        timer.start()
        shutdown()
        timer.cancel()
    from engine.parallel.group import exit_now

    exit_now(0)  # all is closed: the interpreter's teardown would only add ~0.6 s to every stop


def _start_rank_server() -> None:
    """The process the service's ranks are forked from loads torch while this one does."""
    from engine.parallel.group import start_rank_server

    start_rank_server()


def run_serve_prefill(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> int:
    _start_rank_server()
    from services.prefill.server import serve_prefill

    return _serve_until_stopped("prefill", serve_prefill, load_config("prefill", args.config,
                                                                        _overrides(args, PrefillConfig)))


def run_serve_decode(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> int:
    _start_rank_server()
    from services.decode.server import serve_decode

    return _serve_until_stopped("decode", serve_decode, load_config("decode", args.config,
                                                                      _overrides(args, DecodeConfig)))


def build_parser_serve_prefill(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("prefill", help="the prefill gRPC service (a CP rank group)")
    _add_config_flags(p, PrefillConfig)
    p.set_defaults(handler=run_serve_prefill, cmd_parser=p)
    return p


def build_parser_serve_decode(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("decode", help="the decode gRPC service (a DCP rank group)")
    _add_config_flags(p, DecodeConfig)
    p.set_defaults(handler=run_serve_decode, cmd_parser=p)
    return p


def build_parser_serve(subparsers) -> argparse.ArgumentParser:
    """The `serve` group: `cpserve serve prefill ...`, `cpserve serve decode ...`."""
    p = subparsers.add_parser("serve", help="run one service (prefill, decode or router) until stopped")
    sub = p.add_subparsers(dest="service", required=True)
    build_parser_serve_prefill(sub)
    build_parser_serve_decode(sub)
    build_parser_serve_router(sub)
    return p


# ---- router ------------------------------------------------------------------------------------
def _addresses(values: list[str] | None) -> tuple[str, ...] | None:
    """Repeated and/or comma-separated host:port lists."""
    if not values:
        return None
    return tuple(a.strip() for v in values for a in v.split(",") if a.strip())


def run_serve_router(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> int:
    from services.common.config import ConfigError, RouterConfig
    from services.router.server import load_model_files, serve_router

    overrides = {name: getattr(args, name, None) for name in RouterConfig.model_fields}
    overrides.update(prefill=_addresses(args.prefill), decode=_addresses(args.decode))
    files = None
    if args.backends_from_stdin:
        if overrides["prefill"] or overrides["decode"]:
            raise ConfigError("--backends-from-stdin: the addresses come from stdin; drop --prefill/--decode")
        # everything but the addresses is checked, and the model files loaded, before they come
        files = load_model_files(load_config("router", args.config, {**overrides, "prefill": ("?",),
                                                                       "decode": ("?",)}))
        overrides.update(_backends_from_stdin())
    config = load_config("router", args.config, overrides)
    if args.no_grpc:
        config = config.model_copy(update={"grpc_port": None})

    def serve(cfg):
        handle = serve_router(cfg, model_files=files)
        return handle, handle.http_port, handle.shutdown

    return _serve_until_stopped("router", serve, config)


def _backends_from_stdin() -> dict[str, tuple[str, ...]]:
    """``{"prefill": [host:port, ...], "decode": [...]}``, one JSON line on stdin."""
    from services.common.config import ConfigError

    line = sys.stdin.readline()
    if not line:
        raise ConfigError("--backends-from-stdin: stdin closed before the service addresses came")
    try:
        got = json.loads(line)
        out = {kind: tuple(str(a) for a in got[kind]) for kind in ("prefill", "decode")}
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"--backends-from-stdin: expected one JSON line "
                          f'{{"prefill": [host:port, ...], "decode": [...]}}, got {line.strip()[:200]!r} ({e})') from None
    return out


def tokenizer_from_args(args: argparse.Namespace):
    """The tokenizer --model / --tokenizer / --trust-remote-code name (loaded once per command)."""
    if getattr(args, "_tokenizer", None) is None:
        from engine.model.tokenizer import load_tokenizer

        args._tokenizer = load_tokenizer(args.model or "tiny", getattr(args, "tokenizer", None),
                                         bool(getattr(args, "trust_remote_code", False)))
    return args._tokenizer


def print_generation(args, tokenizer, output_ids: list[int], ttft_ms: float, tpot_ms: float, extra: dict | None = None):
    result = {"output_ids": output_ids, "text": tokenizer.decode(output_ids),
              "ttft_ms": round(ttft_ms, 3), "tpot_ms": None if tpot_ms != tpot_ms else round(tpot_ms, 3)}
    if args.json:
        print(json.dumps({**result, **(extra or {})}))
    else:
        print(f"output ids : {output_ids}")
        print(f"text       : {result['text']!r}")
        print(f"TTFT       : {ttft_ms:.1f} ms   TPOT: {tpot_ms:.2f} ms/token")
        for k, v in (extra or {}).items():
            print(f"{k:<11}: {v}")


def add_internal_plane_args(p: argparse.ArgumentParser) -> None:
    """Credentials of internal gRPC (services/common/security.py); the router's and `cpserve up`'s
    (the prefill and decode commands get the same flags from their config's fields)."""
    p.add_argument("--internal-token-file", default=None,
                   help="file holding the shared token of internal RPCs (or set $CPSERVE_INTERNAL_TOKEN)")
    p.add_argument("--tls-cert", default=None, help="PEM certificate: internal gRPC over TLS")
    p.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    p.add_argument("--tls-ca", default=None, help="PEM CA: verify peers with it; servers then require client "
                                                  "certificates (mutual TLS)")


def add_tokenizer_args(p: argparse.ArgumentParser) -> None:
    """--tokenizer and --trust-remote-code (the router, `cpserve up` and the one-process commands)."""
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the checkpoint's)")
    p.add_argument("--trust-remote-code", action="store_true", default=None,
                   help="run the Python code a tokenizer ships (auto_map in tokenizer_config.json; e.g. Kimi-K2's)")


def add_model_serving_args(p: argparse.ArgumentParser) -> None:
    """The router's tokenizer, chat template, generation config and length flags (also `cpserve up`'s)."""
    add_tokenizer_args(p)
    p.add_argument("--chat-template", default=None, help="Jinja file replacing the tokenizer's chat template")
    p.add_argument("--generation-config", choices=["auto", "none"], default=None,
                   help="auto (default): generation_config.json's eos ids stop and its temperature/top_p/top_k are "
                        "request defaults; none: ignore the file")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="prompt + max_tokens limit (default: the config's max_position_embeddings, capped by the "
                        "decode cache)")
    p.add_argument("--max-request-bytes", type=int, default=None,
                   help="the largest request body (HTTP 413, answered from Content-Length before the body is read) "
                        "and gRPC message; default 1 MiB + 64 bytes per token of the max model length (3 MiB for "
                        "32k tokens, 9 MiB for 128k)")
    p.add_argument("--request-read-timeout-s", type=float, default=None,
                   help="a request body not whole this many seconds after the request arrived is answered 408 (30)")


def build_parser_serve_router(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("router", help="the router: OpenAI-compatible HTTP and gRPC front, pairs prefill "
                                             "with decode services")
    p.add_argument("--config", help="YAML file with prefill:/decode:/router: sections")
    p.add_argument("--prefill", action="append", help="prefill service host:port (repeat, or comma-separate)")
    p.add_argument("--decode", action="append", help="decode service host:port (repeat, or comma-separate)")
    p.add_argument("--backends-from-stdin", action="store_true",
                   help='load the model files, then read the addresses as one JSON line {"prefill": [...], '
                        '"decode": [...]} from stdin (how `cpserve up` starts the router while the engine '
                        "services load)")
    p.add_argument("--model", default=None, help="checkpoint directory or 'tiny' (default): tokenizer and limits")
    p.add_argument("--served-model-name", default=None, help="the model name clients use (default: --model)")
    p.add_argument("--host", default=None, help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="HTTP port (default 0: a free one)")
    p.add_argument("--grpc-port", type=int, default=None, help="gRPC port (default 0: a free one)")
    p.add_argument("--no-grpc", action="store_true", help="no gRPC front")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' (better: $CPSERVE_API_KEY or --api-key-file, which "
                        "do not show in ps)")
    p.add_argument("--api-key-file", default=None, help="file holding the API key")
    add_internal_plane_args(p)
    p.add_argument("--max-retries", type=int, default=None, help="other pairs tried before the first token (2)")
    p.add_argument("--request-timeout-s", type=float, default=None, help="per request (600)")
    p.add_argument("--rpc-timeout-s", type=float, default=None, help="health/Status/Abort calls (5)")
    p.add_argument("--health-interval-s", type=float, default=None, help="service polling period (2)")
    p.add_argument("--default-max-tokens", type=int, default=None,
                   help="when a request has no max_tokens (default: up to the context limit)")
    p.add_argument("--max-waiting", type=int, default=None,
                   help="requests that may wait for decode rows before a 429 (256)")
    p.add_argument("--max-wait-s", type=float, default=None, help="how long a request waits for decode rows (30)")
    p.add_argument("--parse-workers", type=int, default=None,
                   help="threads parsing and tokenizing bodies over 16 KiB (default half the CPUs, 1 to 4; smaller "
                        "bodies have a lane of their own)")
    p.add_argument("--max-large-requests", type=int, default=None,
                   help="bodies over 16 KiB being parsed or waiting for a thread before a 503 (16)")
    p.add_argument("--pairing", choices=["cache_aware", "load"], default=None,
                   help="which pair takes a request: cache_aware (default): where its prefix is cached, unless "
                        "much busier; load: least outstanding work only")
    p.add_argument("--balance-abs", type=int, default=None,
                   help="cache_aware: a service whose load exceeds the least by more than this (4) and ...")
    p.add_argument("--balance-rel", type=float, default=None,
                   help="... more than this many times (1.5) is passed over for cache reasons")
    p.add_argument("--cache-threshold", type=float, default=None,
                   help="cache_aware: a cached prefix counts only if it covers this fraction of the prompt (0.25)")
    add_model_serving_args(p)
    p.set_defaults(handler=run_serve_router, cmd_parser=p)
    return p
