"""The KV hand-off contract between a prefill group and a decode group.

The decode side reserves rows and describes them in a :class:`KvDestination`: per decode rank
its transfer-engine session and the addresses of its registered pools, the group slot of every
token of the request, the index placement, and a fingerprint of the model and cache layout.
The prefill side checks the fingerprint *before computing anything* — a mismatch is refused
with the name of the differing field — then writes each (token, layer) entry straight into the
reserved rows (engine/parallel/prefill_cp.py `push`, plan in engine/parallel/transfer_plan.py).

Reservation ids are random 128-bit values (32 hex digits).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import secrets
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from engine.cache.kvformat import KVFormat
from engine.model.config import ModelConfig


class KVTransferError(Exception):
    """Base of every error raised by the KV-transfer layer."""


class TransferError(KVTransferError):
    """A transport operation failed; ``peer`` is the session it concerned, ``reason`` why."""

    def __init__(self, peer: str, reason: str):
        super().__init__(f"KV transfer with {peer} failed: {reason}")
        self.peer = peer
        self.reason = reason


class LayoutMismatch(ValueError):
    """Prefill and decode disagree on the model or cache layout; ``field`` names the difference."""

    def __init__(self, field: str, prefill_value, decode_value):
        super().__init__(f"KV layout mismatch on {field}: prefill has {prefill_value!r}, decode has {decode_value!r}")
        self.field = field


class ReservationError(ValueError):
    """A reservation is unknown, expired or in the wrong state; the message says which."""


class NoCapacity(ReservationError):
    """No free cache rows for the reservation now (it would fit later: retry)."""


class BadReservation(ReservationError):
    """The reservation request itself is wrong: it can never fit the cache, or the prompt's
    length is not the reserved one (the message names the field)."""


def new_reservation_id() -> str:
    return secrets.token_hex(16)


def model_hash(cfg: ModelConfig) -> str:
    fields = cfg.fingerprint_fields()
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:16]


def layout_fingerprint(cfg: ModelConfig, dtype: str, kv_format: KVFormat) -> dict:
    """What both sides must agree on to exchange cache rows byte for byte: the model, the
    compute dtype, and how entries are stored (``kv_format``: kind, bytes per entry and index
    key, fp8 scales — rounded to float32, as they travel). The cache dtype comes before the
    sizes it implies, so a mismatch names it."""
    return {
        "model": model_hash(cfg),
        "dtype": dtype,
        "kv_cache_dtype": kv_format.kind,
        "kv_entry_bytes": kv_format.entry_bytes,
        "kv_index_bytes": kv_format.index_bytes,
        "kv_scales": [float(torch.tensor(s, dtype=torch.float32)) for s in kv_format.scales],
        "latent_dim": cfg.latent_dim,
        "index_head_dim": cfg.index_head_dim,
        "num_layers": cfg.num_layers,
        "indexer_layers": list(cfg.indexer_layer_ids),
    }


def check_fingerprint(prefill: dict, decode: dict) -> None:
    for key in prefill:
        if prefill[key] != decode.get(key):
            raise LayoutMismatch(key, prefill[key], decode.get(key))


@dataclass(frozen=True)
class RankEndpoint:
    """One decode rank: where its pools are, as the transfer engine addresses them."""

    session: str
    latent_ptr: int  # pool [num_layers, rows, latent_row_bytes], contiguous (the stored form)
    rows: int
    latent_row_bytes: int
    index_ptrs: dict[int, int] = field(default_factory=dict)  # indexer layer → pool [index_rows, index_row_bytes]
    index_rows: int = 0
    index_row_bytes: int = 0

    def latent_addr(self, layer: int, row: int) -> int:
        return self.latent_ptr + (layer * self.rows + row) * self.latent_row_bytes

    def index_addr(self, layer: int, row: int) -> int:
        return self.index_ptrs[layer] + row * self.index_row_bytes


@dataclass(frozen=True)
class KvDestination:
    reservation_id: str
    dcp: int
    page_size: int
    index_mode: str  # "copied" | "split"
    slots: tuple[int, ...]  # decode group slot of tokens 0..N-1
    prefix: int  # tokens already on decode (not sent)
    ranks: tuple[RankEndpoint, ...]
    fingerprint: dict
    expires_at: float  # unix time: the reservation lapses unless a write has begun by then

    def validate_for(self, num_tokens: int) -> None:
        if len(self.ranks) != self.dcp:
            raise LayoutMismatch("dcp", self.dcp, len(self.ranks))
        if len(self.slots) < num_tokens:
            raise ReservationError(f"reservation {self.reservation_id} holds {len(self.slots)} tokens; "
                                   f"the prompt has {num_tokens}")
        if not 0 <= self.prefix <= num_tokens:
            raise ReservationError(f"reservation {self.reservation_id}: prefix_tokens {self.prefix} is outside "
                                   f"[0, {num_tokens}]")


# ---- the transfer backend ------------------------------------------------------------------
# The engine's ranks move KV through these two small interfaces and never import an
# implementation: the backend is a module named by string, loaded in the rank process, with
# ``sender(host, protocol) -> KVSender`` and ``receiver(host, protocol) -> KVReceiver``.
# kvtransfer/backend.py implements them on Mooncake's TransferEngine.
DEFAULT_BACKEND = "kvtransfer.backend"


class KVSender(Protocol):
    """Prefill side: writes a rank's part of a transfer plan into a destination's rows."""

    def push(self, writes, dest: "KvDestination", latent_of: Callable, index_of: Callable,
             layer: int | None = None) -> dict:
        """{"ok": True, "bytes", "seconds", "writes"} or {"ok": False, "peer", "error", "seconds"};
        never raises a transfer failure."""

    def merge(self, results: list[dict]) -> dict:
        """One result for several pushes of one request."""

    def close(self, at_exit: bool = False) -> None:
        """Release everything; ``at_exit``: the rank process ends right after (it exits without
        the interpreter's teardown), so what the OS reclaims at exit may be left to it."""


class KVReceiver(Protocol):
    """Decode side: memory that peers may write into, and the session name they address."""

    session_name: str

    def register(self, ptr: int, nbytes: int) -> None: ...

    def close(self, at_exit: bool = False) -> None: ...  # as KVSender.close


def kv_backend(spec: str = DEFAULT_BACKEND):
    """The backend module ``spec`` (see above)."""
    return importlib.import_module(spec)
