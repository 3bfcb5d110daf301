"""`cpserve serve prefill|decode`: run one service until SIGINT/SIGTERM.

Flags are the fields of the service's config model (services/common/config.py), spelled
``--field-name``; each given flag overrides the ``--config`` YAML file's section.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
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
            p.add_argument(flag, type=info.annotation, default=None, help=hint)


def _overrides(args: argparse.Namespace, model: type) -> dict:
    return {name: getattr(args, name) for name in model.model_fields}


def _serve_until_stopped(kind: str, serve, config) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    _, port, shutdown = serve(config)
    from services.common.rpc import address

    print(f"serving {kind} on {address(config.host, port)}", flush=True)
    try:
        stop.wait()
    finally:
        shutdown()
    return 0


def run_serve_prefill(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> int:
    from services.prefill.server import serve_prefill

    return _serve_until_stopped("prefill", serve_prefill, load_config("prefill", args.config,
                                                                        _overrides(args, PrefillConfig)))


def run_serve_decode(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> int:
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
    p = subparsers.add_parser("serve", help="run one service (prefill or decode) until stopped")
    sub = p.add_subparsers(dest="service", required=True)
    build_parser_serve_prefill(sub)
    build_parser_serve_decode(sub)
    return p
