"""The DCP decode engine: scheduler in the driver, the sharded model on C rank processes.

Prompts reach the decode ranks as KV rows. In this engine (the `cpserve decode` test entry)
the driver prefills with the one-process reference and hands the rows to the ranks; the decode
service receives them from the prefill service through the KV-transfer layer instead.
"""

from __future__ import annotations

import collections
from typing import Callable

import torch

from engine.cache.capacity import pages_in_budget, parse_bytes
from engine.cache.kvformat import KVFormat
from engine.cache.pool import KVPool
from engine.cache.slots import pages_needed
from engine.model.loader import load_model, parse_dtype, resolve_dtype
from engine.model.tiny import resolve_model_dir
from engine.parallel.expert import check_moe_parallel
from engine.parallel.group import WorkerGroup
from engine.plan import SlotSync, StepPlan
from engine.runner import LocalRunner
from engine.reservations import ReservationTable
from engine.scheduler import Engine, Scheduler
from engine.cache.content_key import key_seed
from engine.handoff import KvDestination, layout_fingerprint


class DCPRunner:
    """Decode steps go to the DCP group; extend steps run on the driver's reference and their
    rows are handed to the ranks (rank p mod C keeps token p)."""

    def __init__(self, group, prefill: LocalRunner | None, trace: bool = False):
        self.group, self.prefill, self.trace = group, prefill, trace
        self.sync = SlotSync()  # decode plans carry each request's new slots only
        self.rank_seconds = [0.0] * group.world_size
        self.scores: dict[int, tuple] = {}  # prompt scores of the last extend step (reference prefill)

    def run(self, plan: StepPlan) -> dict[int, torch.Tensor]:
        if not plan.is_decode:
            if self.prefill is None:
                raise ValueError("this decode engine receives prompts as KV only")
            logits = self.prefill.run(plan)
            self.scores = self.prefill.scores
            pool = self.prefill.pool
            slots = torch.cat([it.slots[it.start : it.end] for it in plan.items])
            latent = {l: pool.latent(l)[slots] for l in range(pool.cfg.num_layers)}
            index = {l: pool.index(l)[slots] for l in pool.index_layers}
            self.group.call("load_rows", slots, latent, index)
            return logits
        self.submit(plan)
        return self.collect()

    def submit(self, plan: StepPlan) -> None:
        """Start a decode step on the ranks; ``collect`` returns its logits."""
        if not plan.is_decode:
            raise ValueError("only decode steps are submitted (extend steps run with run())")
        self.group.submit("run", self.sync.wire(plan), self.trace)

    def collect(self) -> dict[int, torch.Tensor | int]:
        """Each request's logits row, or its token where the plan asked for the argmax."""
        out: dict[int, torch.Tensor | int] = {}
        self.scores = {}
        for r, (logits, seconds) in enumerate(self.group.collect()):
            out.update(logits)
            self.rank_seconds[r] += seconds
        return out


class DCPDecodeEngine(Engine):
    def __init__(self, model: str = "tiny", dcp: int = 2, exchange: str = "a2a", indexer: str = "copied",
                 replicate_q_proj: bool = False, dtype: str = "auto", page_size: int = 16,
                 max_cache_tokens: int = 1 << 16, chunk_size: int = 4096, threads_per_rank: int = 1,
                 record_logits: bool = False, trace: bool = False, reference_prefill: bool = True,
                 kv_transport: str | None = None, kv_host: str = "127.0.0.1", lease_s: float = 30.0,
                 write_lease_s: float = 60.0,
                 generation_config: str = "auto", moe_parallel: str = "ep", kv_cache_memory: int | str | None = None,
                 kv_cache_dtype: str = "auto", pipelined: bool = False, lookahead: bool = True,
                 prefix_cache: bool = False):
        from engine.model.config import ModelConfig

        self.model_dir = resolve_model_dir(model)
        self.cfg = ModelConfig.from_dir(self.model_dir, generation_config)
        dtype = resolve_dtype(dtype, self.cfg)
        lm = load_model(self.model_dir, dtype) if reference_prefill else None
        if dcp < 1 or self.cfg.num_heads % dcp:
            raise ValueError(f"dcp: {dcp} must be >= 1 and divide the model's {self.cfg.num_heads} attention heads")
        check_moe_parallel(moe_parallel)
        self.kv_format = KVFormat.for_checkpoint(self.model_dir, self.cfg, kv_cache_dtype, dtype)
        if kv_cache_memory is not None:
            num_pages = pages_in_budget(self.cfg, parse_bytes(kv_cache_memory, "kv_cache_memory"), self.kv_format,
                                        page_size, dcp, indexer)
        else:
            num_pages = pages_needed(max_cache_tokens, page_size, dcp)
        rows_per_rank = num_pages * page_size
        self.group = WorkerGroup(dcp, "engine.parallel.dcp:DecodeRank",
                                 (str(self.model_dir), dtype, rows_per_rank, exchange, indexer, replicate_q_proj,
                                  kv_transport, kv_host, moe_parallel, self.kv_format.kind),
                                 threads_per_rank=threads_per_rank, name="decode")
        prefill = LocalRunner(lm, KVPool(self.cfg, rows_per_rank * dcp, parse_dtype(dtype), fmt=self.kv_format)) \
            if lm else None
        self.group.ready()
        self.fingerprint = layout_fingerprint(self.cfg, dtype, self.kv_format)
        # prefix_cache: a finished request's prompt and output rows stay as cached pages, found
        # again by Reserve (a conversation's next turn is sent its new tokens only)
        super().__init__(Scheduler(self.cfg, num_pages, page_size, chunk_size, dcp, record_logits, prefix_cache,
                                   key_seed(self.fingerprint)),
                         DCPRunner(self.group, prefill, trace))
        self.dcp, self.dtype, self.index_mode, self.page_size = dcp, dtype, indexer, page_size
        self.pipelined = pipelined
        self._stashed: list = []  # events of a step collected early by quiesced(), for the next step()
        # decode steps submitted and not collected, oldest first: at most the one running and,
        # with ``lookahead``, the next (Scheduler.lookahead_plan), queued on the ranks
        self._plans: collections.deque = collections.deque()
        self.lookahead = pipelined and lookahead
        self.reservations = ReservationTable(self.scheduler, lease_s, write_lease_s,
                                             lambda src, dst: self.quiesced("copy_slots", src, dst))
        # Where a pipelined step would block on the ranks, it calls this (if set) with the fds
        # to wait on and whether it still waits: the decode service's loop runs the commands
        # that arrive meanwhile (Reserve, BeginWrite, a new stream) and returns once one of the
        # fds is readable, or no step is in flight any more (a command ran ``quiesced``).
        self.while_ranks_compute: Callable[[list[int], Callable[[], bool]], None] | None = None
        self.endpoints = tuple(self.group.call("endpoint")) if kv_transport else ()

    # ---- the KV hand-off (decode side) ---------------------------------------------------
    def reserve(self, num_tokens: int, max_new_tokens: int, num_forks: int = 1, tokens: list[int] | None = None,
                cache_salt: str = "") -> KvDestination:
        """Reserve rows for a prompt (decoded as ``num_forks`` forks); the returned destination
        tells a prefill group where to write, and from which token on (``prefix``: the leading
        tokens of ``tokens`` whose rows this service still holds from an earlier request)."""
        if not self.endpoints:
            raise ValueError("kv_transport: this decode engine was started without a KV transport")
        r = self.reservations.reserve(num_tokens, max_new_tokens, num_forks, tokens, cache_salt)
        return KvDestination(r.id, self.dcp, self.page_size, self.index_mode, tuple(r.slots.tolist()),
                             r.prefix_tokens, self.endpoints, self.fingerprint, r.expires_at)

    def begin_write(self, reservation_id: str) -> float:
        """Claim or renew the write lease; returns its length in seconds."""
        self.reservations.begin_write(reservation_id)
        return self.reservations.write_timeout_s

    def end_write(self, reservation_id: str) -> bool:
        return self.reservations.end_write(reservation_id)

    def commit(self, reservation_id: str, prompt_ids: list[int], params, seed: int, first_token: int,
               output_ids: list[int] = (), fork: int = 0):
        return self.reservations.commit(reservation_id, prompt_ids, params, seed, first_token, output_ids, fork)

    def abort_reservation(self, reservation_id: str, fork: int | None = None) -> bool:
        return self.reservations.abort(reservation_id, fork)

    def step(self):
        """One engine step. Pipelined (the decode service): collect the decode step in flight,
        apply its tokens, submit the next step at once, and return the events, which the
        caller delivers while the ranks compute. So the ranks wait only for the driver's
        sampling and planning between steps, not for delivery, gRPC or queued commands.
        With ``lookahead`` (the default) they do not wait for those either while every running
        request is plain greedy: the step after the one in flight is planned and submitted
        before the one in flight is collected (``Scheduler.lookahead_plan``; the ranks feed
        their own argmax), so the next forward starts the moment the last one ends.

        The same positions, slots and tokens as unpipelined (a step planned ahead feeds the
        argmax the driver would have applied), so tokens are unchanged. A request that
        finishes or is aborted while a step that includes it runs keeps its pages until every
        step in flight that includes it is collected (``Scheduler.in_flight``): such a step
        still writes its next cache row."""
        self.reservations.expire()
        if not self.pipelined:
            return super().step()
        if self.lookahead and len(self._plans) == 1:
            ahead = self.scheduler.lookahead_plan(self._plans[0])
            if ahead is not None:  # the ranks go on to it without waiting for this driver
                self._submit(ahead)
        self._collect(serve=True)
        events, self._stashed = self._stashed, []
        if self._plans:  # the step planned ahead is running
            return events
        plan = self.scheduler.next_plan()
        if plan is None:
            return events
        if not plan.is_decode:  # prompts prefilled by the reference (test engines): in step
            return events + self.scheduler.apply(self.runner.run(plan), self.runner.scores)
        self._submit(plan)
        return events

    def _submit(self, plan) -> None:
        self.runner.submit(plan)
        self._plans.append(plan)
        self.scheduler.in_flight = frozenset(it.req_id for p in self._plans for it in p.items)

    def _collect(self, serve: bool = False) -> None:
        """Collect the oldest step in flight, if any, and apply its tokens (their events wait
        in ``_stashed`` for the next ``step``). ``serve``: wait in ``while_ranks_compute``
        first (where it is set)."""
        if serve and self._plans and self.while_ranks_compute is not None:
            # commands run here as they do between steps: the plans in flight are planned and
            # their requests held (``in_flight``); a command that needs the ranks (``quiesced``)
            # collects them itself
            self.while_ranks_compute(self.group.answer_fds(), lambda: bool(self._plans))
        if self._plans:
            self._plans.popleft()
            self._stashed += self.scheduler.apply(self.runner.collect())
            self.scheduler.step_collected(frozenset(it.req_id for p in self._plans for it in p.items))

    def quiesced(self, method: str, *args):
        """A command to every rank between steps: the steps in flight (pipelined) are
        collected first, since the ranks take one call at a time."""
        while self._plans:
            self._collect()
        return self.group.call(method, *args)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self.group.pending or bool(self._stashed)

