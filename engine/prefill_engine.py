"""The prefill CP engine: the scheduler in the driver process, the model on C rank processes.

The driver holds no weights: it loads the config, owns the page allocator and sends each step
plan to the group. With the all-gather CP attention every rank keeps the same rows, so one
page of ``page_size`` slots numbers them all; with the ring (engine/parallel/ring.py) slots are
numbered as DCP numbers them — a page spans ``page_size · C`` slots, slot s on rank s mod C —
and each rank's pool has 1/C of the rows.
"""

from __future__ import annotations

import logging
import time

from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from engine.cache.kvformat import KVFormat
from engine.cache.slots import pages_needed
from engine.model.config import ModelConfig
from engine.model.loader import parse_dtype, resolve_dtype
from engine.model.tiny import resolve_model_dir
from engine.parallel.expert import check_moe_parallel
from engine.parallel.group import WorkerGroup
from engine.parallel.layout import check_cp_attention, check_ring_mode
from engine.parallel.prefill_cp import CPRunner
from engine.parallel.ring import RingCosts, pick_ring_mode, ring_estimates
from engine.model.sampler import SamplingParams
from engine.scheduler import Engine, Scheduler, Sequence
from engine.cache.content_key import key_seed
from engine.handoff import KvDestination, TransferError, check_fingerprint, layout_fingerprint
from engine.parallel.transfer_plan import plan_transfer, writes_by_rank

STRATEGIES = ("interleave", "zigzag")
logger = logging.getLogger("cpserve.prefill")


@dataclass
class PendingPrefill:
    """A prefill waiting for its forwards and its KV hand-off; `future` gets the Sequence."""

    seq: Sequence
    dest: KvDestination
    before_write: Callable[[], None] | None
    future: Future = field(default_factory=Future)
    # called once every write this request issued has completed or failed (only if a write was
    # cleared: before_write returned); decode frees an aborted reservation's rows only then
    after_write: Callable[[], None] | None = None
    cleared: bool = False  # the rows are claimed (or before_write returned): after_write is owed
    # the write lease's heartbeat, called between steps every renew_every_s while the prompt is
    # computed; if it raises, the request is cancelled and nothing is written
    renew: Callable[[], None] | None = None
    renew_every_s: float = 10.0
    # checked between every two steps: False (the client went away) cancels the request there
    is_active: Callable[[], bool] | None = None
    renewed_at: float = field(default_factory=time.monotonic)
    transfer_stats: list | None = None
    armed: bool = False  # its KV is pushed layer by layer during the forward (overlap)
    queued_at: float = 0.0  # perf_counter when the service put it in the engine
    # perf_counter when its prompt's forwards were done (with layer-wise overlap: when the last
    # forward's compute ended, its pushes still running), and when every rank's KV writes had
    # returned: the service's compute and hand-off stages of TTFT
    computed_at: float = 0.0
    written_at: float = 0.0
    arm_error: Exception | None = None


class CPPrefillEngine(Engine):
    def __init__(self, model: str = "tiny", cp: int = 2, strategy: str = "interleave", layer_split: bool = False,
                 dtype: str = "auto", chunk_size: int = 4096, page_size: int = 16, max_cache_tokens: int = 1 << 16,
                 threads_per_rank: int = 1, record_logits: bool = False, trace: bool = False, prefix_cache: bool = False,
                 kv_transport: str | None = None, kv_host: str = "127.0.0.1", overlap: bool = False,
                 generation_config: str = "auto", moe_parallel: str = "ep", kv_cache_dtype: str = "auto",
                 cp_attention: str = "allgather", cp_ring_mode: str = "auto"):
        if cp < 1:
            raise ValueError(f"cp: must be >= 1, got {cp}")
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy: {strategy!r} is not one of {', '.join(STRATEGIES)}")
        if layer_split and strategy != "interleave":
            raise ValueError("layer_split: supported with --strategy interleave only")
        self.model_dir = resolve_model_dir(model)
        self.cfg = ModelConfig.from_dir(self.model_dir, generation_config)
        dtype = resolve_dtype(dtype, self.cfg)
        self.cp, self.strategy, self.layer_split = cp, strategy, layer_split
        self.cp_attention = check_cp_attention(cp_attention, strategy, layer_split)
        self.sharded = cp_attention == "ring" and cp > 1
        self.cp_ring_mode = check_ring_mode(cp_ring_mode)
        shards = cp if self.sharded else 1  # the slot numbering's group size
        num_pages = pages_needed(max_cache_tokens, page_size, shards)
        self.kv_format = KVFormat.for_checkpoint(self.model_dir, self.cfg, kv_cache_dtype, dtype)
        self.group = WorkerGroup(cp, "engine.parallel.prefill_cp:PrefillRank",
                                 (str(self.model_dir), dtype, strategy, layer_split, num_pages * page_size,
                                  kv_transport, kv_host, check_moe_parallel(moe_parallel), self.kv_format.kind,
                                  cp_attention),
                                 threads_per_rank=threads_per_rank, name="prefill")
        self.group.ready()
        self.fingerprint = layout_fingerprint(self.cfg, dtype, self.kv_format)
        logger.info("prefill CP: %d ranks, %s attention, %s queries, cache %s%s", cp, cp_attention,
                    "striped" if self.sharded and strategy == "interleave" else strategy,
                    "striped by position (1/C a rank)" if self.sharded else "whole on every rank",
                    ", layer split" if layer_split else "")
        super().__init__(Scheduler(self.cfg, num_pages, page_size, chunk_size, shards, record_logits, prefix_cache,
                                   key_seed(self.fingerprint)),
                         CPRunner(self.group, trace, self._ring_mode if self.sharded else None))
        self.dtype = dtype
        self.ring_costs = self.measure_ring_costs() if self.sharded and self.cp_ring_mode == "auto" else None
        self.pending: list[PendingPrefill] = []
        self.overlap = overlap
        if overlap:
            self.runner.arm = self._arm

    def _ring_mode(self, plan) -> str:
        """pass_kv or pass_q for this forward: as configured, or (auto) the selector's pick."""
        if self.cp_ring_mode != "auto":
            return self.cp_ring_mode
        new = [len(it.token_ids) for it in plan.items]
        cached = [it.start for it in plan.items]
        est = ring_estimates(new, cached, self.cp, self.ring_costs)
        mode = pick_ring_mode(est)
        logger.debug("ring: %s for %d new over %d cached tokens (estimates per layer: pass_kv %.3g s, "
                     "pass_q %.3g s)", mode, sum(new), sum(cached), est["pass_kv"], est["pass_q"])
        return mode

    def measure_ring_costs(self) -> RingCosts:
        """The selector's byte counts (stored entry, travelling query and partial) and the slowest
        rank's measured constants (every rank runs ``PrefillRank.calibrate`` at once)."""
        cfg, fmt = self.cfg, self.kv_format
        measured = self.group.call("calibrate")
        worst = {k: max(m[k] for m in measured) for k in measured[0]}
        itemsize = torch.empty(0, dtype=parse_dtype(self.dtype)).element_size()
        entry = fmt.entry_width * torch.empty(0, dtype=fmt.storage_dtype).element_size()
        costs = RingCosts(entry_bytes=entry, query_bytes=cfg.num_heads * cfg.qk_head_dim * itemsize,
                          output_bytes=cfg.num_heads * (cfg.v_head_dim + 1) * 4,
                          index_topk=cfg.index_topk if cfg.has_indexer else 0, **worst)
        logger.info("ring selector: %s", costs)
        return costs

    # ---- the KV hand-off (prefill side) --------------------------------------------------
    def submit_prefill(self, prompt_ids: list[int], params: SamplingParams, dest: KvDestination,
                       before_write: Callable[[], None] | None = None,
                       after_write: Callable[[], None] | None = None, output_ids: list[int] = (),
                       num_forks: int = 1, cache_salt: str = "") -> "PendingPrefill":
        """Queue a prefill whose KV goes to `dest`. The layout is checked here, before any
        compute. Requests submitted together are prefilled in the same forwards (batched);
        `finish_ready()` after each `step()` hands off the ones whose prompt is done.
        ``output_ids``: a resumed generation's tokens so far, prefilled (and sent) after the
        prompt; the token sampled is the next one. ``num_forks``: forks 1.. get a first token
        too (``Sequence.fork_starts``)."""
        check_fingerprint(self.fingerprint, dest.fingerprint)
        dest.validate_for(len(prompt_ids) + len(output_ids))
        step = len(output_ids) + 1  # only the next token is sampled here
        seq = self.scheduler.add(prompt_ids, replace(params, max_new_tokens=step,
                                                     min_tokens=min(params.min_tokens, step)), output_ids, num_forks,
                                  cache_salt)
        seq.keep_pages = True
        pending = PendingPrefill(seq, dest, before_write, after_write=after_write)
        self.pending.append(pending)
        return pending

    def finish_ready(self) -> list["PendingPrefill"]:
        """Send the KV of every pending request whose first token is sampled; resolve its future
        (the Sequence, or the error: TransferError naming the peer, a refused BeginWrite…).
        Its prefill rows are released either way."""
        done = [p for p in self.pending if p.seq.is_finished]
        for p in done:
            self.pending.remove(p)
            try:
                self._hand_off(p)
                p.future.set_result(p.seq)
            except Exception as e:  # noqa: BLE001 — delivered to the request's caller
                p.future.set_exception(e)
            finally:
                self.scheduler.release(p.seq)
                self._writes_done(p)
        return done

    def _writes_done(self, p: "PendingPrefill") -> None:
        """Every push for ``p`` has returned (the rank calls are synchronous): say so to decode."""
        if p.cleared and p.after_write is not None:
            p.cleared = False
            try:
                p.after_write()
            except Exception:  # noqa: BLE001 — best effort; decode's write lease is the backstop
                logger.warning("after_write of %s failed", p.dest.reservation_id, exc_info=True)

    def cancel_pending(self, pending: "PendingPrefill", reason: str = "abort",
                       error: Exception | None = None) -> None:
        if pending in self.pending:
            self.pending.remove(pending)
            self.scheduler.abort(pending.seq)
            self.scheduler.release(pending.seq)
            self._writes_done(pending)
            pending.future.set_exception(error or RuntimeError(f"prefill cancelled: {reason}"))

    def renew_leases(self) -> None:
        """Between steps: cancel every pending prefill whose client went away, and renew the
        write lease of every one that is due. One whose renewal is refused (decode aborted it,
        or its lease lapsed) is cancelled at once too: its compute stops here, between chunks,
        and nothing of it is written."""
        now = time.monotonic()
        for p in list(self.pending):
            if p.is_active is not None and not p.is_active():
                self.cancel_pending(p, "the client went away")
                continue
            if p.renew is None or now - p.renewed_at < p.renew_every_s:
                continue
            try:
                p.renew()
                p.renewed_at = time.monotonic()
            except Exception as e:  # noqa: BLE001 — delivered to the request's caller
                self.cancel_pending(p, error=e)

    def _plan(self, p: "PendingPrefill", src_slots: list[int]) -> dict:
        n, dest = len(p.seq.prefill_ids), p.dest
        return writes_by_rank(plan_transfer(
            num_tokens=n, prefill_cp=self.cp, layer_split=self.layer_split, num_layers=self.cfg.num_layers,
            indexer_layers=list(self.cfg.indexer_layer_ids), src_slots=src_slots, decode_dcp=dest.dcp,
            dst_slots=list(dest.slots[:n]), decode_index=dest.index_mode, decode_prefix=dest.prefix,
            sharded=self.sharded))

    def _arm(self, plan) -> dict:
        """Layer-wise overlap: before the forward that completes a prompt, clear the write with
        decode (`before_write`) and hand the ranks its transfer plan; each rank then pushes
        every layer as soon as the layer is stored."""
        by_id = {p.seq.id: p for p in self.pending}
        armed = {}
        for it in plan.items:
            p = by_id.get(it.req_id)
            if p is None or not it.wants_logits:
                continue
            try:
                if p.before_write is not None:
                    p.before_write()
                p.cleared = True
                armed[it.req_id] = (self._plan(p, it.slots.tolist()), p.dest)
                p.armed = True
            except Exception as e:  # noqa: BLE001 — reported by finish_ready
                p.arm_error = e
        return armed

    def _hand_off(self, p: "PendingPrefill") -> None:
        if p.arm_error is not None:
            raise p.arm_error
        if p.armed:
            results = self.runner.push_results.pop(p.seq.id, [])
            returned = self.runner.returned_at
            if not results:
                raise TransferError(p.dest.reservation_id, "no prefill rank reported its layer-wise push")
            # the pushes went on after the forward: the slowest rank's tail is hand-off time
            p.computed_at = returned - max(r.get("tail_seconds", 0.0) for r in results)
        else:
            p.computed_at = time.perf_counter()
            if p.before_write is not None:
                p.before_write()
            p.cleared = True
            n = len(p.seq.prefill_ids)
            results = self.group.call("push", self._plan(p, self.scheduler.slots(p.seq, n).tolist()), p.dest)
        p.transfer_stats = self.transfer_stats = results
        p.written_at = time.perf_counter()
        for r in results:
            if not r["ok"]:
                raise TransferError(r.get("peer") or "decode", r["error"])

    def prefill_to(self, prompt_ids: list[int], params: SamplingParams, dest: KvDestination,
                   before_write: Callable[[], None] | None = None,
                   after_write: Callable[[], None] | None = None) -> Sequence:
        """Prefill one prompt, sample its first token and write its cache into `dest`'s rows
        (see submit_prefill); raises what the hand-off raised."""
        pending = self.submit_prefill(prompt_ids, params, dest, before_write, after_write)
        while not pending.future.done():
            self.step()
            self.finish_ready()
        return pending.future.result()

