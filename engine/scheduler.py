"""The scheduler: one request object per request, admission by free cache pages, and step
plans (prefill chunks first, else one decode step for every running request).

It only asks the allocator (``can_allocate``) and orders (``allocate``/``share``/``free``);
where a slot lives is the runner's business. Requests it admits itself (``add``: the reference
and the prefill engine) get pages for prompt + max_new_tokens at admission, so they never run
out of cache. Requests adopted with their prompt already cached (``adopt``: the decode service)
hold the prompt's pages only and get one more page when their next token needs it; when none
is free (idle cached pages of the prefix cache are evicted first: they count as free), the
request that joined the batch last is preempted (``preempted``): its pages are
freed and it ends with finish reason ``"preempted"``, which the decode service reports so that
its router resumes it elsewhere (prompt + the tokens so far prefilled again). The request that
joined first is never preempted for a later one, so the batch always makes progress.
"""

from __future__ import annotations

import functools
import itertools
import time
from dataclasses import dataclass, field

import torch

from engine.cache.prefix import PrefixCache
from engine.cache.slots import PageAllocator, pages_needed, token_slots
from engine.model.config import ModelConfig
from engine.model.sampler import InvalidRequest, SamplingParams, TokenLogprob, process_logits, sample, token_logprob
from engine.plan import FROM_PREVIOUS, ChunkItem, DecodeItem, StepPlan
from engine.runner import merge_scores

MAX_FORKS = 256  # samples of one prompt decoded as forks (the router's n is at most 16)


@dataclass
class Sequence:
    """One request as it flows through an engine."""

    id: int
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    stop_ids: frozenset[int]
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose cache entries are written
    num_cached: int = 0  # prompt tokens found in the prefix cache at admission (decode: at Reserve)
    cache_salt: str = ""  # requests with different salts never share cached pages
    pages: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    arrival: float = field(default_factory=time.perf_counter)
    token_times: list[float] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    keep_pages: bool = False  # finish() leaves the pages to the caller (prefill: until the KV is sent)
    slot_cache: tuple | None = None  # (page list, its length, slots of all its positions): Scheduler.slots
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per output token, when params.logprobs is set
    prompt_scores: list[tuple] = field(default_factory=list)  # score blocks (runner.split_scores), any order
    # a resumed (preempted) generation: output tokens it had generated, prefilled after the prompt
    num_resumed: int = 0
    # prefill: samples of this prompt decoded as forks; fork j samples with seed + j, and its first
    # token is drawn here from the same logits: (token, seed, TokenLogprob or None) of forks 1..
    num_forks: int = 1
    fork_starts: list[tuple] = field(default_factory=list)
    # decode: leading tokens held in pages shared with the other forks of reservation ``group``
    shared_tokens: int = 0
    group: str | None = None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def prefill_ids(self) -> list[int]:
        """The tokens a prefill computes: the prompt, and a resumed generation's earlier output."""
        return self.prompt_ids + self.output_ids[: self.num_resumed] if self.num_resumed else self.prompt_ids

    def prompt_logprobs(self) -> list[TokenLogprob]:
        """Prompt tokens 1.. (the first has no context) scored, in order (params.prompt_logprobs)."""
        if not self.prompt_scores:
            return []
        pos, lp, ids, vals = merge_scores(self.prompt_scores)
        return [TokenLogprob(float(l), tuple(i), tuple(v)) for l, i, v in zip(lp.tolist(), ids.tolist(), vals.tolist())]

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed < len(self.prompt_ids) + self.num_resumed

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


def validate_prompt(prompt_ids: list[int], params: SamplingParams, vocab_size: int, max_positions: int,
                    output_ids: list[int] = ()) -> None:
    """Checks shared by every engine and service front; raises InvalidRequest naming the field.
    ``output_ids``: a resumed generation's tokens so far (fewer than max_new_tokens)."""
    if not prompt_ids:
        raise InvalidRequest("prompt", "must not be empty")
    for name, ids in (("prompt", prompt_ids), ("output_ids", output_ids)):
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequest(name, f"token id {bad[0]!r} is outside the vocabulary [0, {vocab_size})")
    params.validate(vocab_size)
    if len(output_ids) >= params.max_new_tokens:
        raise InvalidRequest("output_ids", f"{len(output_ids)} tokens already generated; max_new_tokens is "
                                           f"{params.max_new_tokens}")
    if len(prompt_ids) + params.max_new_tokens > max_positions:
        raise InvalidRequest(
            "max_new_tokens",
            f"prompt ({len(prompt_ids)} tokens) plus max_new_tokens ({params.max_new_tokens}) exceeds the "
            f"model's {max_positions} positions",
        )


class Scheduler:
    """Requests in, step plans out; sampling and stop rules applied to each step's logits.

    ``group_size`` is the DCP degree C of the slot numbering (1 for one process and for a
    prefill CP group, whose ranks each hold every row); a page then spans page_size·C slots.
    """

    def __init__(self, cfg: ModelConfig, num_pages: int, page_size: int, chunk_size: int, group_size: int = 1,
                 record_logits: bool = False, prefix_cache: bool = False, key_seed: bytes = b""):
        if chunk_size < 1:
            raise ValueError(f"chunk_size: must be >= 1, got {chunk_size}")
        self.cfg, self.page_size, self.chunk_size, self.group_size = cfg, page_size, chunk_size, group_size
        self.record_logits = record_logits
        self.allocator = PageAllocator(num_pages)
        self.prefix = PrefixCache(self.allocator, page_size * group_size, key_seed) if prefix_cache else None
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []  # in the order they joined the batch
        self.preempted: list[Sequence] = []  # ended for want of a page since the caller last took them
        self.by_id: dict[int, Sequence] = {}
        self._ids = itertools.count()
        # ids in a step submitted to ranks and not yet collected (a pipelined engine): their
        # pages are not freed before it is, since that step still writes their next cache row
        self.in_flight: frozenset[int] = frozenset()
        self._held: list[Sequence] = []

    @property
    def capacity_tokens(self) -> int:
        return self.allocator.num_pages * self.page_size * self.group_size

    def _pages_for(self, num_tokens: int) -> int:
        return pages_needed(num_tokens, self.page_size, self.group_size)

    # ---- pages: the allocator's, with idle cached pages counted as free (evicted on demand) ----
    @property
    def num_reclaimable(self) -> int:
        """Free pages plus idle cached pages: what a request can be given now."""
        return self.allocator.num_free + (self.prefix.num_reclaimable if self.prefix is not None else 0)

    def can_take(self, n: int) -> bool:
        return 0 <= n <= self.num_reclaimable

    def take(self, n: int) -> list[int]:
        """``n`` pages, evicting idle cached pages (LRU) as needed (ask ``can_take`` first)."""
        if self.prefix is not None:
            self.prefix.make_free(n)
        return self.allocator.allocate(n)

    def hold_pages(self, pages: list[int]) -> None:
        """One more holder of each page (a cached page: one more request using it)."""
        if self.prefix is not None:
            self.prefix.hold(pages)
        else:
            self.allocator.share(pages)

    def drop_pages(self, pages: list[int]) -> None:
        """``hold_pages``' inverse: nothing is cached."""
        if self.prefix is not None:
            self.prefix.drop(pages)
        else:
            self.allocator.free(pages)

    # ---- requests ------------------------------------------------------------------------
    def add(self, prompt_ids: list[int], params: SamplingParams, output_ids: list[int] = (),
            num_forks: int = 1, cache_salt: str = "") -> Sequence:
        """Queue a request. ``output_ids``: a resumed generation's tokens so far (prefilled after
        the prompt, counted as output by sampling); ``num_forks``: its first token is also drawn
        for forks 1.. (``Sequence.fork_starts``)."""
        validate_prompt(prompt_ids, params, self.cfg.vocab_size, self.cfg.max_position_embeddings, output_ids)
        if not 1 <= num_forks <= MAX_FORKS:
            raise InvalidRequest("num_forks", f"must be in [1, {MAX_FORKS}], got {num_forks}")
        total = len(prompt_ids) + params.max_new_tokens
        if self._pages_for(total) > self.allocator.num_pages:
            raise InvalidRequest("prompt", f"prompt plus max_new_tokens is {total} tokens; the cache holds "
                                           f"{self.capacity_tokens}")
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**31 - 1, ()))
        seq = Sequence(next(self._ids), list(prompt_ids), params, seed, self._stop_ids(params),
                       output_ids=list(output_ids), num_resumed=len(output_ids), num_forks=num_forks,
                       cache_salt=cache_salt)
        self.waiting.append(seq)
        self.by_id[seq.id] = seq
        return seq

    def adopt(self, prompt_ids: list[int], params: SamplingParams, seed: int, pages: list[int],
              first_token: int, output_ids: list[int] = (), group: str | None = None,
              shared_tokens: int = 0, num_cached: int = 0, cache_salt: str = "") -> Sequence:
        """A request whose prompt (and, resumed, its earlier ``output_ids``) is already in the
        cache (KV sent by a prefill service) and whose next token is sampled: it joins the running
        batch at its next decode step. It holds ``pages`` (the caller's holders of them pass to
        it); later pages come as its tokens need them. ``group``/``shared_tokens``: a fork whose
        first ``shared_tokens`` tokens are in pages it shares with the other forks of ``group``.
        ``num_cached``: its leading tokens whose pages came from the prefix cache."""
        seq = Sequence(next(self._ids), list(prompt_ids), params, seed, self._stop_ids(params),
                       output_ids=list(output_ids), num_computed=len(prompt_ids) + len(output_ids),
                       pages=list(pages), shared_tokens=shared_tokens, group=group, num_cached=num_cached,
                       cache_salt=cache_salt)
        self.by_id[seq.id] = seq
        self.running.append(seq)
        self._append(seq, first_token)
        return seq

    def take_preempted(self) -> list[Sequence]:
        """The requests preempted since the last call (finish reason "preempted")."""
        out, self.preempted = self.preempted, []
        return out

    def abort(self, seq: Sequence) -> None:
        if seq in self.waiting:
            self.waiting.remove(seq)
        if not seq.is_finished:
            self.finish(seq, "abort")

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _admit(self) -> None:
        while self.waiting:
            seq = self.waiting[0]
            need = self._pages_for(len(seq.prompt_ids) + seq.params.max_new_tokens)
            if self.prefix is None:
                if not self.allocator.can_allocate(need):
                    break
                seq.pages = self.allocator.allocate(need)
            else:  # a request that scores its prompt computes all of it
                shared = [] if seq.params.prompt_logprobs is not None else \
                    self.prefix.match(seq.prefill_ids, seq.cache_salt)
                fresh = self.prefix.allocate(need - len(shared))
                if fresh is None:
                    self.prefix.drop(shared)
                    break
                seq.pages = shared + fresh
                seq.num_computed = seq.num_cached = len(shared) * self.prefix.tokens_per_page
            self.running.append(self.waiting.pop(0))

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        if not seq.keep_pages:
            self.release(seq)
        if seq in self.running:
            self.running.remove(seq)
        self.by_id.pop(seq.id, None)

    def release(self, seq: Sequence) -> None:
        """Return a request's pages (to the prefix cache where it keeps them); held until the
        step in flight is collected if it is in it (``step_collected``)."""
        if seq.id in self.in_flight:
            self._held.append(seq)
            return
        if seq.pages:
            if self.prefix is None:
                self.allocator.free(seq.pages)
            else:  # pages whose every token's KV is written are kept (decode: output rows too)
                self.prefix.release(seq.pages, seq.all_ids, seq.num_computed, seq.cache_salt)
            seq.pages = []

    def step_collected(self, still_in_flight: frozenset[int] = frozenset()) -> None:
        """A step in flight is done: free the pages of requests that finished meanwhile, except
        those in ``still_in_flight`` (a step planned ahead and still running: they wait for it)."""
        self.in_flight = still_in_flight
        held, self._held = self._held, []
        for seq in held:
            self.release(seq)

    def slots(self, seq: Sequence, n: int) -> torch.Tensor:
        """Group slots of the request's first ``n`` tokens: a view of the slots of every
        position its pages hold, computed once per page table (a decode step asks again for
        one more token each time)."""
        cached = seq.slot_cache
        if cached is None or cached[0] is not seq.pages or cached[1] != len(seq.pages) or cached[2].numel() < n:
            if len(seq.pages) * self.page_size * self.group_size < n:  # too few pages: token_slots says so
                return token_slots(seq.pages, n, self.page_size, self.group_size)
            cached = seq.slot_cache = (seq.pages, len(seq.pages), token_slots(
                seq.pages, len(seq.pages) * self.page_size * self.group_size, self.page_size, self.group_size))
        return cached[2][:n]

    # ---- plans ---------------------------------------------------------------------------
    def next_plan(self) -> StepPlan | None:
        self._admit()
        prefill = [s for s in self.running if s.is_prefilling]
        if prefill:
            return self._extend_plan(prefill)
        if self.running:
            self._grow()
        if self.running:
            return self._decode_plan(list(self.running))
        return None

    def _grow(self) -> None:
        """Every running request gets the pages its next token needs, earliest first; with none
        free, the request that joined last is preempted (see the module docstring)."""
        for seq in list(self.running):
            while not seq.is_finished and self._pages_for(len(seq.all_ids)) > len(seq.pages):
                if self.can_take(1):
                    seq.pages.append(self.take(1)[0])
                else:
                    self.preempt(self.running[-1])

    def preempt(self, seq: Sequence) -> None:
        """End ``seq`` for want of cache: its pages are freed; it goes to ``preempted``."""
        self.finish(seq, "preempted")
        self.preempted.append(seq)

    def _extend_plan(self, seqs: list[Sequence]) -> StepPlan:
        budget, items = self.chunk_size, []
        for seq in seqs:
            if budget == 0:
                break
            ids = seq.prefill_ids
            n = min(len(ids) - seq.num_computed, budget)
            budget -= n
            start = seq.num_computed
            score = seq.params.prompt_logprobs
            items.append(ChunkItem(seq.id, ids[start : start + n], start, self.slots(seq, start + n),
                                   start + n == len(ids), -1 if score is None else score,
                                   tuple(ids[start + 1 : start + n + 1]) if score is not None else ()))
            seq.num_computed = start + n
        return StepPlan("extend", items)

    def _decode_plan(self, seqs: list[Sequence]) -> StepPlan:
        items = []
        for seq in seqs:
            p = len(seq.all_ids) - 1
            params = seq.params  # plain greedy: a runner that can answers with the token (DecodeItem.argmax)
            argmax = params.greedy and not params.processed and params.logprobs is None and not self.record_logits
            items.append(DecodeItem(seq.id, seq.all_ids[-1], p, self.slots(seq, p + 1), argmax=argmax))
            seq.num_computed = p + 1
        return StepPlan("decode", items)

    def lookahead_plan(self, step: StepPlan) -> StepPlan | None:
        """The decode step after ``step`` (submitted, its tokens not yet known), so that the
        ranks start it the moment they finish ``step``: each request of ``step`` goes on at
        the next position with the token the ranks took as its argmax (``FROM_PREVIOUS``); a
        request that joined since goes with its last token. None where the step cannot be
        planned before ``step``'s tokens are applied, and the next plan waits for them as
        before: a running request is not plain greedy (its token is drawn here), has forks, or
        needs a page that is not free (preemption decides then); requests are waiting. A
        request whose ``step`` token is its last (max_new_tokens) is left out; one that stops
        at an EOS there computes one step in vain, and its result is dropped (``apply``).
        The same positions, slots and tokens as planning after ``apply``: tokens unchanged."""
        if self.waiting or not step.is_decode:
            return None
        previous = {it.req_id: it for it in step.items}
        items, pages_needed_now = [], 0
        for seq in self.running:
            it = previous.get(seq.id)
            if seq.num_forks > 1 or (it is not None and not it.argmax):
                return None
            if it is None:  # joined after ``step`` was planned: its last token is known
                p = len(seq.all_ids) - 1
                if seq.num_computed != p:
                    return None
                argmax = seq.params.greedy and not seq.params.processed and seq.params.logprobs is None \
                    and not self.record_logits
                items.append((seq, p, seq.all_ids[-1], argmax))
            else:
                if len(seq.output_ids) + 1 >= seq.params.max_new_tokens:
                    continue  # ``step`` gives its last token
                if seq.num_computed != it.position + 1:
                    return None
                items.append((seq, it.position + 1, FROM_PREVIOUS, True))
            pages_needed_now += max(0, self._pages_for(items[-1][1] + 1) - len(seq.pages))
        if not items or not self.can_take(pages_needed_now):
            return None
        plan = []
        for seq, p, token, argmax in items:
            missing = self._pages_for(p + 1) - len(seq.pages)
            if missing > 0:
                seq.pages += self.take(missing)
            plan.append(DecodeItem(seq.id, token, p, self.slots(seq, p + 1), argmax=argmax))
            seq.num_computed = p + 1
        return StepPlan("decode", plan)

    def apply(self, logits: dict[int, torch.Tensor], scores: dict[int, tuple] | None = None
              ) -> list[tuple[Sequence, int]]:
        """Sample the next token of every request that got logits; finish those that stop.
        ``scores``: the forward's prompt-score blocks by request, kept on the request."""
        for req_id, block in (scores or {}).items():
            seq = self.by_id.get(req_id)
            if seq is not None:
                seq.prompt_scores.append(block)
        events = []
        if self.in_flight:  # a pipelined step: requests aborted while it ran have left
            logits = {rid: row for rid, row in logits.items() if rid in self.by_id}
        seqs = [self.by_id[req_id] for req_id in logits]
        # greedy requests without logit processors: one argmax over their rows together (a
        # runner may have sent the token itself: an int instead of a row)
        plain = [i for i, seq in enumerate(seqs) if seq.params.greedy and not seq.params.processed
                 and not isinstance(logits[seq.id], int)]
        argmax = dict(zip(plain, torch.stack([logits[seqs[i].id] for i in plain]).argmax(dim=1).tolist())) \
            if len(plain) > 1 else {}
        for i, (seq, row) in enumerate(zip(seqs, logits.values())):
            if self.record_logits:
                seq.logits.append(row.clone())
            params = seq.params
            picked = row
            if isinstance(row, int):  # the runner's argmax (plain greedy)
                token = row
            elif i in argmax:
                token = argmax[i]
            else:
                if params.processed:
                    picked = process_logits(row, params, seq.prompt_ids, seq.output_ids, seq.stop_ids)
                token = sample(picked, params, seq.seed, len(seq.output_ids))
            if params.logprobs is not None:
                seq.logprobs.append(token_logprob(row, token, params.logprobs))
            if seq.num_forks > 1:
                seq.fork_starts = [self._fork_start(seq, row, picked, token, j) for j in range(1, seq.num_forks)]
            self._append(seq, token)
            events.append((seq, token))
        return events

    def _fork_start(self, seq: Sequence, row: torch.Tensor, picked: torch.Tensor, token: int, j: int) -> tuple:
        """Fork j's first token, drawn from the same (processed) logits with seed + j."""
        params, seed = seq.params, (seq.seed + j) % 2**63
        if not params.greedy:
            token = sample(picked, params, seed, len(seq.output_ids))
        return token, seed, token_logprob(row, token, params.logprobs) if params.logprobs is not None else None

    def _stop_ids(self, params: SamplingParams) -> frozenset[int]:
        return frozenset(self.cfg.eos_token_ids if params.stop_token_ids is None else params.stop_token_ids)

    def _append(self, seq: Sequence, token: int) -> None:
        seq.output_ids.append(token)
        seq.token_times.append(time.perf_counter())
        if token in seq.stop_ids:
            self.finish(seq, "stop")
        elif len(seq.output_ids) >= seq.params.max_new_tokens:
            self.finish(seq, "length")


class Engine:
    """A scheduler driving a runner: ``runner.run(plan) -> {req_id: logits}``, and after each
    run ``runner.scores``, that forward's prompt-score blocks by request (empty unless a request
    asked for prompt logprobs).

    Engines on a worker group (``self.group``) close it on ``close()`` / leaving a ``with``."""

    def __init__(self, scheduler: Scheduler, runner):
        self.scheduler, self.runner = scheduler, runner

    @functools.cached_property
    def tokenizer(self):
        """The checkpoint's tokenizer, loaded on first use (engines work on ids; services never
        load it, so a tokenizer that needs --trust-remote-code does not stop them)."""
        from engine.model.tokenizer import load_tokenizer

        return load_tokenizer(self.model_dir)

    @property
    def allocator(self) -> PageAllocator:
        return self.scheduler.allocator

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def add_request(self, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        return self.scheduler.add(prompt_ids, params)

    def abort(self, seq: Sequence) -> None:
        self.scheduler.abort(seq)

    def step(self) -> list[tuple[Sequence, int]]:
        plan = self.scheduler.next_plan()
        if plan is None:
            return []
        logits = self.runner.run(plan)
        return self.scheduler.apply(logits, self.runner.scores)

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[Sequence]:
        """Run requests to completion (all admitted together, batched)."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        seqs = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        while self.has_work:
            self.step()
        return seqs

    def close(self) -> None:
        group = getattr(self, "group", None)
        if group is not None:
            group.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
