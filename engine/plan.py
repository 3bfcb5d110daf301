"""Step plans: what one forward computes, as plain data the driver sends to every rank.

A plan is either an *extend* step (prefill chunks) or a *decode* step (one token per
request). It names cache slots, not rows: each runner maps slots to its own rows (one
process: row = slot; DCP: rank = slot % C, row = slot // C).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ChunkItem:
    """New tokens [start, start + len(token_ids)) of one request; slots cover positions [0, end)."""

    req_id: int
    token_ids: list[int]
    start: int
    slots: torch.Tensor
    wants_logits: bool  # this chunk completes the prompt
    # prompt scoring (echo / prompt logprobs): -1 none, else the top-N to keep; ``targets`` are
    # the prompt's next tokens prompt[start + 1 : end + 1] (one fewer in the prompt's last chunk)
    score: int = -1
    targets: tuple[int, ...] = ()

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


@dataclass(frozen=True)
class DecodeItem:
    """The token at `position` of one request; slots cover positions [0, position]."""

    req_id: int
    token_id: int
    position: int
    slots: torch.Tensor


@dataclass(frozen=True)
class StepPlan:
    kind: str  # "extend" | "decode"
    items: list

    @property
    def is_decode(self) -> bool:
        return self.kind == "decode"
