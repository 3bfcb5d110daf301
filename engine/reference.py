"""The one-process reference engine: no parallelism, the ground truth for every layout.

Batched prefill of mixed-length requests, chunked prefill (``chunk_size`` new tokens per
forward), continuous-batching decode (requests join and leave every step), greedy and seeded
sampling, stop tokens and ``max_new_tokens``. Cache rows for prompt + max_new_tokens are
reserved when a request is admitted, so a running request never runs out of cache.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import torch

from engine.cache.local import LocalKV
from engine.cache.pool import KVPool
from engine.cache.slots import PageAllocator, pages_needed, token_slots
from engine.model.batch import ForwardBatch, RequestView
from engine.model.loader import load_model, parse_dtype
from engine.model.sampler import InvalidRequest, SamplingParams, sample
from engine.model.tiny import resolve_model_dir
from engine.model.tokenizer import load_tokenizer


@dataclass
class Sequence:
    """One request as it flows through the engine."""

    id: int
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    stop_ids: frozenset[int]
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose cache entries are written
    pages: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    arrival: float = field(default_factory=time.perf_counter)
    token_times: list[float] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed < len(self.prompt_ids)

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def ttft_ms(self) -> float:
        return (self.token_times[0] - self.arrival) * 1e3 if self.token_times else float("nan")

    @property
    def tpot_ms(self) -> float:
        t = self.token_times
        return (t[-1] - t[0]) * 1e3 / (len(t) - 1) if len(t) > 1 else float("nan")


def validate_prompt(prompt_ids: list[int], params: SamplingParams, vocab_size: int, max_positions: int) -> None:
    """Checks shared by every engine and service front; raises InvalidRequest naming the field."""
    if not prompt_ids:
        raise InvalidRequest("prompt", "must not be empty")
    bad = [t for t in prompt_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequest("prompt", f"token id {bad[0]!r} is outside the vocabulary [0, {vocab_size})")
    params.validate()
    if len(prompt_ids) + params.max_new_tokens > max_positions:
        raise InvalidRequest(
            "max_new_tokens",
            f"prompt ({len(prompt_ids)} tokens) plus max_new_tokens ({params.max_new_tokens}) exceeds the "
            f"model's {max_positions} positions",
        )


class ReferenceEngine:
    def __init__(self, model: str = "tiny", dtype: str = "fp32", chunk_size: int = 4096, page_size: int = 16,
                 max_cache_tokens: int = 1 << 17, record_logits: bool = False):
        if chunk_size < 1:
            raise ValueError(f"chunk_size: must be >= 1, got {chunk_size}")
        self.model_dir = resolve_model_dir(model)
        self.lm = load_model(self.model_dir, dtype)
        self.cfg = self.lm.cfg
        self.tokenizer = load_tokenizer(self.model_dir)
        self.chunk_size, self.page_size, self.record_logits = chunk_size, page_size, record_logits
        num_pages = pages_needed(max_cache_tokens, page_size, 1)
        self.pool = KVPool(self.cfg, num_pages * page_size, parse_dtype(dtype))
        self.allocator = PageAllocator(num_pages)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self._ids = itertools.count()

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        validate_prompt(prompt_ids, params, self.cfg.vocab_size, self.cfg.max_position_embeddings)
        need = pages_needed(len(prompt_ids) + params.max_new_tokens, self.page_size, 1)
        if need > self.allocator.num_pages:
            raise InvalidRequest("prompt", f"prompt plus max_new_tokens needs {need * self.page_size} cache tokens; "
                                           f"this engine holds {self.allocator.num_pages * self.page_size}")
        stop = self.cfg.eos_token_ids if params.stop_token_ids is None else params.stop_token_ids
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**31 - 1, ()))
        seq = Sequence(next(self._ids), list(prompt_ids), params, seed, frozenset(stop))
        self.waiting.append(seq)
        return seq

    def abort(self, seq: Sequence) -> None:
        if seq in self.waiting:
            self.waiting.remove(seq)
        self._finish(seq, "abort")

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _admit(self) -> None:
        while self.waiting:
            seq = self.waiting[0]
            need = pages_needed(len(seq.prompt_ids) + seq.params.max_new_tokens, self.page_size, 1)
            if not self.allocator.can_allocate(need):
                break
            seq.pages = self.allocator.allocate(need)
            self.running.append(self.waiting.pop(0))

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        if seq.pages:
            self.allocator.free(seq.pages)
            seq.pages = []
        if seq in self.running:
            self.running.remove(seq)

    def _slots(self, seq: Sequence, n: int) -> torch.Tensor:
        return token_slots(seq.pages, n, self.page_size, 1)

    # ---- steps ---------------------------------------------------------------------------
    def step(self) -> list[tuple[Sequence, int]]:
        """One forward: a prefill chunk if any prompt is unfinished, else one decode step."""
        self._admit()
        prefill = [s for s in self.running if s.is_prefilling]
        return self._prefill_step(prefill) if prefill else self._decode_step(list(self.running))

    def _prefill_step(self, seqs: list[Sequence]) -> list[tuple[Sequence, int]]:
        budget = self.chunk_size
        ids, pos, new_rows, views, req_rows, done, last = [], [], [], [], [], [], []
        for seq in seqs:
            if budget == 0:
                break
            n = min(len(seq.prompt_ids) - seq.num_computed, budget)
            budget -= n
            start, end = seq.num_computed, seq.num_computed + n
            slots = self._slots(seq, end)
            base = len(ids)
            ids += seq.prompt_ids[start:end]
            pos += range(start, end)
            new_rows.append(slots[start:end])
            views.append(RequestView(torch.arange(base, base + n), torch.arange(start, end), end))
            req_rows.append(slots)
            seq.num_computed = end
            if end == len(seq.prompt_ids):
                done.append(seq)
                last.append(base + n - 1)
        kv = LocalKV(self.pool, torch.cat(new_rows), req_rows)
        batch = ForwardBatch(torch.tensor(ids), torch.tensor(pos), views, kv, torch.tensor(last, dtype=torch.long))
        logits = self.lm(batch)
        return [self._emit(seq, logits[i]) for i, seq in enumerate(done)]

    def _decode_step(self, seqs: list[Sequence]) -> list[tuple[Sequence, int]]:
        if not seqs:
            return []
        ids, pos, new_rows, views, req_rows = [], [], [], [], []
        for b, seq in enumerate(seqs):
            p = len(seq.all_ids) - 1
            slots = self._slots(seq, p + 1)
            ids.append(seq.all_ids[-1])
            pos.append(p)
            new_rows.append(slots[p:])
            views.append(RequestView(torch.tensor([b]), torch.tensor([p]), p + 1))
            req_rows.append(slots)
            seq.num_computed = p + 1
        kv = LocalKV(self.pool, torch.cat(new_rows), req_rows)
        batch = ForwardBatch(torch.tensor(ids), torch.tensor(pos), views, kv, torch.arange(len(seqs)), is_decode=True)
        logits = self.lm(batch)
        return [self._emit(seq, logits[b]) for b, seq in enumerate(seqs)]

    def _emit(self, seq: Sequence, logits: torch.Tensor) -> tuple[Sequence, int]:
        if self.record_logits:
            seq.logits.append(logits.clone())
        token = sample(logits, seq.params, seq.seed, len(seq.output_ids))
        seq.output_ids.append(token)
        seq.token_times.append(time.perf_counter())
        if token in seq.stop_ids:
            self._finish(seq, "stop")
        elif len(seq.output_ids) >= seq.params.max_new_tokens:
            self._finish(seq, "length")
        return seq, token

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[Sequence]:
        """Run requests to completion (all admitted together, batched)."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        seqs = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        while self.has_work:
            self.step()
        return seqs
