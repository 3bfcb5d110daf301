"""Sampling: greedy, or temperature / top-k / top-p with a per-request seed; logit processors
(``logit_bias``, ``min_tokens``, repetition / frequency / presence penalties); log-probabilities.

A draw is a pure function of (logits, params, history, seed, step): the generator is seeded
with ``seed`` and the step index, so the same request gives the same tokens on any engine or
batch composition.

Order of the processors (as vLLM's V1 sampler): the model's logits (fp32) → ``logit_bias``
added → stop ids masked while fewer than ``min_tokens`` tokens are out → penalties → greedy
argmax, or temperature → top-k → top-p → draw. Penalties, per vocabulary entry ``l``:

- ``repetition_penalty`` r (1 = off), for every id in the prompt or the output so far:
  ``l / r`` where ``l > 0``, else ``l * r``;
- ``frequency_penalty`` f and ``presence_penalty`` p (0 = off), over the output so far only:
  ``l - f * count - p * (count > 0)``.

Log-probabilities are of the model's own distribution: ``log_softmax`` of the raw fp32
logits, before any processor or temperature (vLLM's default ``raw_logprobs``). So a logprob
does not depend on how the token was picked, and prompt and generated tokens are scored alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_LOGPROBS = 20  # top-N alternatives per token, at most (OpenAI's top_logprobs limit)


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
    min_tokens: int = 0  # stop ids are masked until this many tokens are out
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    logprobs: int | None = None  # None: none; N: each generated token's logprob and the top N
    prompt_logprobs: int | None = None  # the same for every prompt token but the first (prefill)

    def validate(self, vocab_size: int | None = None) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise InvalidRequest("max_new_tokens", f"must be an integer >= 1, got {self.max_new_tokens!r}")
        if self.temperature < 0:
            raise InvalidRequest("temperature", f"must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidRequest("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequest("top_k", f"must be >= 0 (0 disables), got {self.top_k}")
        if not 0 <= self.min_tokens <= self.max_new_tokens:
            raise InvalidRequest("min_tokens", f"must be in [0, max_new_tokens = {self.max_new_tokens}], "
                                               f"got {self.min_tokens}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise InvalidRequest(name, f"must be in [-2, 2], got {getattr(self, name)}")
        if not 0 < self.repetition_penalty <= 2:
            raise InvalidRequest("repetition_penalty", f"must be in (0, 2], got {self.repetition_penalty}")
        for tok, bias in self.logit_bias:
            if vocab_size is not None and not 0 <= tok < vocab_size:
                raise InvalidRequest("logit_bias", f"token id {tok} is outside the vocabulary [0, {vocab_size})")
            if not -100 <= bias <= 100:
                raise InvalidRequest("logit_bias", f"biases must be in [-100, 100], got {bias} for token {tok}")
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(self, name)
            if n is not None and not 0 <= n <= MAX_LOGPROBS:
                raise InvalidRequest(name, f"must be in [0, {MAX_LOGPROBS}], got {n}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def processed(self) -> bool:
        """Whether any logit processor is on (else the raw logits are sampled as they are)."""
        return bool(self.logit_bias or self.min_tokens or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1)


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability and the N most likely ids at its position (descending)."""

    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


def process_logits(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int], output_ids: list[int],
                   stop_ids: frozenset[int]) -> torch.Tensor:
    """The logits [V] after logit_bias, min_tokens and the penalties (a new fp32 tensor)."""
    out = logits.float().clone()
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long)
        out.index_add_(0, ids, torch.tensor([b for _, b in params.logit_bias], dtype=out.dtype))
    if len(output_ids) < params.min_tokens and stop_ids:
        out[torch.tensor(sorted(stop_ids), dtype=torch.long)] = float("-inf")
    if params.repetition_penalty != 1 and (prompt_ids or output_ids):
        seen = torch.unique(torch.tensor(prompt_ids + output_ids, dtype=torch.long))
        vals = out[seen]
        out[seen] = torch.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
    if (params.frequency_penalty or params.presence_penalty) and output_ids:
        counts = torch.bincount(torch.tensor(output_ids, dtype=torch.long), minlength=out.numel()).to(out.dtype)
        out -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(out.dtype)
    return out


def sample(logits: torch.Tensor, params: SamplingParams, seed: int, step: int) -> int:
    """Pick one token from (already processed) logits [V]."""
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


def token_logprob(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """``token``'s raw log-probability under logits [V], and the ``top`` most likely ids."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    if top <= 0:
        return TokenLogprob(float(lp[token]))
    vals, ids = torch.topk(lp, min(top, lp.numel()))
    return TokenLogprob(float(lp[token]), tuple(ids.tolist()), tuple(vals.tolist()))


def score_block(logits: torch.Tensor, targets: torch.Tensor, top: int) -> tuple[torch.Tensor, ...]:
    """Prompt scoring of logits [n, V] against the next tokens ``targets`` [n]: (logprob [n],
    top ids [n, top], top logprobs [n, top]) — one definition for every engine and rank."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    picked = lp.gather(1, targets.view(-1, 1)).squeeze(1)
    if top <= 0:
        empty = torch.empty(len(targets), 0)
        return picked, empty.long(), empty
    vals, ids = torch.topk(lp, min(top, lp.shape[1]), dim=1)
    return picked, ids, vals
