"""The per-forward context handed to the model: which tokens this rank computes, and where
their keys live.

A forward is either *extend* (prefill chunks: several new tokens per request, each query
reading its request's cached prefix plus the new tokens up to itself) or *decode* (one new
token per request). ``RequestView.q_index`` indexes this rank's own tokens; on one process
(or a DCP rank) that is every token of the batch, on a prefill CP rank only the ones the
layout gave it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from engine.model.experts import LOCAL_EXPERTS, ExpertDispatch


@dataclass(frozen=True)
class RequestView:
    q_index: torch.Tensor  # [n] indices into this forward's own tokens, ascending position
    q_pos: torch.Tensor  # [n] their positions
    kv_len: int  # keys visible to the request's last query after this forward


class KVAccess(Protocol):
    """Where the model writes new cache entries and reads keys from (see engine/cache)."""

    def store(self, layer: int, latent: torch.Tensor, index_key: torch.Tensor | None) -> None: ...

    def latent(self, layer: int, req: int) -> torch.Tensor: ...

    def index_keys(self, layer: int, req: int) -> torch.Tensor: ...

    def decode_select(self, layer: int, iq: torch.Tensor, iw: torch.Tensor, k: int, indexer) -> list: ...

    def decode_attention(self, layer: int, q: torch.Tensor, sel, scale: float) -> torch.Tensor: ...


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] own tokens
    positions: torch.Tensor  # [T]
    requests: list[RequestView]
    kv: KVAccess
    logit_index: torch.Tensor  # own-token indices whose logits the caller wants
    is_decode: bool = False
    all_reduce: Callable[[torch.Tensor], torch.Tensor] = field(default=_identity)
    trace: dict | None = None  # when set, attention records its DSA selections here (tests)
    moe: ExpertDispatch = field(default=LOCAL_EXPERTS)  # who runs the routed experts (engine/parallel/expert.py)
    # prompt scoring (echo / prompt logprobs): own-token indices, the next token of each, top-N;
    # the forward leaves (logprob [n], top ids [n, N], top logprobs [n, N]) in ``scores``
    score_index: torch.Tensor | None = None
    score_targets: torch.Tensor | None = None
    score_top: int = 0
    scores: tuple | None = None
