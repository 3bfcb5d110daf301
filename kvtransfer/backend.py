"""The engine's KV-transfer backend (engine/handoff.py: ``KVSender``, ``KVReceiver``) on
Mooncake's TransferEngine: prefill ranks push with kvtransfer/push.py, decode ranks register
their pools with kvtransfer/transport.py. The engine loads this module by name in each rank
process (``engine.handoff.kv_backend``), so it never imports kvtransfer/."""

from __future__ import annotations

from kvtransfer.push import KVSender
from kvtransfer.transport import MooncakeTransport


def sender(host: str, protocol: str) -> KVSender:
    return KVSender(host, protocol)


def receiver(host: str, protocol: str) -> MooncakeTransport:
    return MooncakeTransport(host, protocol)
