"""Sampling: greedy, or temperature / top-k / top-p with a per-request seed.

A draw is a pure function of (logits, params, seed, step): the generator is seeded with
``seed`` and the step index, so the same request gives the same tokens on any engine or
batch composition.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class InvalidRequest(ValueError):
    """Bad user input; ``field`` names the offending parameter."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] | None = None  # None: the model's EOS ids; () : never stop early

    def validate(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise InvalidRequest("max_new_tokens", f"must be an integer >= 1, got {self.max_new_tokens!r}")
        if self.temperature < 0:
            raise InvalidRequest("temperature", f"must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidRequest("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequest("top_k", f"must be >= 0 (0 disables), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sample(logits: torch.Tensor, params: SamplingParams, seed: int, step: int) -> int:
    """Pick one token from logits [V]."""
    if params.greedy:
        return int(torch.argmax(logits))
    logits = logits.float() / params.temperature
    if params.top_k and params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1:
        sorted_p, order = torch.sort(probs, descending=True, stable=True)
        keep = torch.cumsum(sorted_p, 0) - sorted_p < params.top_p
        mask = torch.zeros_like(probs, dtype=torch.bool).scatter(0, order, keep)
        probs = torch.where(mask, probs, torch.zeros_like(probs))
        probs = probs / probs.sum()
    gen = torch.Generator().manual_seed((seed * 1_000_003 + step) % (2**63))
    return int(torch.multinomial(probs, 1, generator=gen))
