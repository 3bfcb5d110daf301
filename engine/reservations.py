"""Decode-side reservations of cache rows for prompts that a prefill service will write.

Life cycle::

    reserved ──begin_write──▶ writing ──end_write──▶ written ──commit──▶ forking ──▶ (running requests)
       │                        │  └──────────────commit───────────────▶    │ every fork committed
       │                        │                                           │ or aborted: gone
       └─abort/lapse: freed     └─abort: aborting (quarantined) ──end_write / lapse──▶ freed

- ``reserve`` takes pages for the prompt only — generation pages come later, one at a time, as
  each request's tokens need them (engine/scheduler.py) — and starts a lease (``lease_s``):
  unless a write begins before it ends, the rows go back. It leaves a page free for each running
  request and for each of its own forks (``headroom_pages``), so that reservations, which hold
  their pages while prefill computes, do not take the pages the running batch grows into.
- ``begin_write`` claims the rows when the prefill group starts the request and, called again,
  is its heartbeat (per chunk, and right before it writes): each call runs the write lease to
  ``write_timeout_s`` from now, so a long prefill keeps its rows while a stalled or dead writer
  loses them. It refuses an unknown, lapsed, aborted or already-written reservation, and the
  writer then writes nothing.
- ``end_write`` is the writer's word that it has stopped writing (all its writes completed or
  failed).
- ``abort`` returns the rows at once unless a writer may still be writing (state ``writing``):
  then the rows are quarantined — kept out of the free pool, so no late write of the aborted
  request can land in rows another request owns — until the writer's ``end_write`` or the
  write lease lapses.
- ``commit`` hands the rows to the scheduler as a running request, one fork at a time (a
  reservation of one fork is gone at its commit, as before forks existed).

Forks (``n`` samples of one prompt, written once by prefill): fork j runs with the prompt's
full pages, shared by every fork (reference-counted by the allocator), and its own copy of the
last, partial page (fork 0 the original, fork j ≥ 1 a page reserved with the prompt and filled
at its commit by copying the prompt's rows of that page: copy-on-write at the fork). A prompt
that fills whole pages needs no copy. Rows: ``ceil(P / span) + (n - 1) · [P mod span ≠ 0]``
pages of span = page_size · C tokens at Reserve, then each fork's generated tokens. Each fork is
committed (or aborted) on its own; the reservation holds the prompt's pages until every fork
is, so the original partial page outlives the copies made from it.

Cached rows (a conversation's earlier turns): with the scheduler's prefix cache, ``reserve``
given the tokens looks them up first. The leading full pages found (verified chains, see
engine/cache/prefix.py) become the reservation's first pages and ``prefix_tokens`` says how many
tokens they hold: the writer sends only the tokens after them, and since a transfer plan never
writes ``[0, prefix_tokens)``, no transfer can write a cached row. The reservation holds one use
of each cached page (a reference, not an allocator hold), given back like any other page. Idle
cached pages are reclaimable: ``reserve``'s free-page check and headroom count them, and they are
evicted (LRU) when pages are taken, so a cached row never blocks admission.

Every transition is logged at debug level with the reservation id.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from engine.model.sampler import SamplingParams
from engine.scheduler import Scheduler, Sequence
from engine.handoff import BadReservation, NoCapacity, ReservationError, new_reservation_id

logger = logging.getLogger("cpserve.reservations")


@dataclass
class Reservation:
    id: str
    num_tokens: int
    num_forks: int
    shared: list[int]  # the prompt's full pages, used by every fork
    tails: list[int | None]  # per fork, its copy of the prompt's last, partial page (None: handed to
    #                          the fork; empty list: the prompt fills whole pages)
    slots: torch.Tensor  # group slot of each prompt token (fork 0's pages)
    state: str  # reserved | writing | written | forking | aborting (then gone: committed | freed)
    deadline: float  # time.monotonic()
    waiting: set[int] = field(default_factory=set)  # forks neither committed nor aborted
    prefix_tokens: int = 0  # leading tokens whose pages came from the prefix cache (never written)
    cache_salt: str = ""
    tokens: list[int] | None = None  # what was reserved, where rows were found for its prefix

    @property
    def prompt_pages(self) -> list[int]:
        """Where the prompt was written (fork 0's pages); held by the reservation to its end."""
        return self.shared + self.tails[:1]

    @property
    def expires_at(self) -> float:
        """The deadline as unix time (what a KvDestination carries across processes)."""
        return time.time() + (self.deadline - time.monotonic())


def _no_copies(src: torch.Tensor, dst: torch.Tensor) -> None:
    raise ValueError("num_forks: this decode engine cannot copy rows between pages")


class ReservationTable:
    """``copy_slots(src, dst)``: copies the cache entries of group slots ``src`` to ``dst`` on
    every rank (a fork's copy of the prompt's partial page), before the next decode step."""

    def __init__(self, scheduler: Scheduler, lease_s: float = 30.0, write_timeout_s: float = 60.0,
                 copy_slots: Callable[[torch.Tensor, torch.Tensor], None] = _no_copies):
        self.scheduler, self.lease_s, self.write_timeout_s = scheduler, lease_s, write_timeout_s
        self.copy_slots = copy_slots
        self.active: dict[str, Reservation] = {}

    @property
    def span(self) -> int:
        """Tokens per virtual page (page_size · C)."""
        return self.scheduler.page_size * self.scheduler.group_size

    def headroom_pages(self, need: int, num_forks: int = 1) -> int:
        """Pages a reservation of ``need`` must leave free: one per running request and one per
        fork of its own, or — for a prompt too long for that — every other page (an otherwise
        idle cache)."""
        return min(len(self.scheduler.running) + num_forks, self.scheduler.allocator.num_pages - need)

    def reserve(self, num_tokens: int, max_new_tokens: int, num_forks: int = 1,
                tokens: list[int] | None = None, cache_salt: str = "") -> Reservation:
        """Pages for ``num_tokens`` tokens; ``tokens`` (the prompt, resumed: + output so far)
        are looked up in the prefix cache, where there is one."""
        self.expire()
        if num_tokens < 1:
            raise BadReservation(f"num_tokens: must be >= 1, got {num_tokens}")
        if num_forks < 1:
            raise BadReservation(f"num_forks: must be >= 1, got {num_forks}")
        sched, alloc = self.scheduler, self.scheduler.allocator
        total = num_tokens + max_new_tokens
        if sched._pages_for(total) > alloc.num_pages:
            raise BadReservation(f"num_tokens: {total} tokens exceed this decode service's "
                                 f"{sched.capacity_tokens}-token cache")
        if tokens is not None and len(tokens) not in (0, num_tokens):
            raise BadReservation(f"prompt_ids: {len(tokens)} tokens, but num_tokens is {num_tokens}")
        full, partial = divmod(num_tokens, self.span)
        need = full + (num_forks if partial else 0)
        if need > alloc.num_pages:
            raise BadReservation(f"num_forks: {num_forks} forks of {num_tokens} tokens need {need} pages; this "
                                 f"decode service has {alloc.num_pages}")
        cached = sched.prefix.match(tokens, cache_salt) if sched.prefix is not None and tokens else []
        fresh = need - len(cached)
        if not sched.can_take(fresh + self.headroom_pages(need, num_forks)):
            sched.drop_pages(cached)
            raise NoCapacity("capacity: no free cache rows now; retry later")
        pages = cached + sched.take(fresh)
        r = Reservation(new_reservation_id(), num_tokens, num_forks, pages[:full], pages[full:],
                        self._slots(pages[:full + 1], num_tokens), "reserved", time.monotonic() + self.lease_s,
                        set(range(num_forks)), len(cached) * self.span, cache_salt, list(tokens) if cached else None)
        self.active[r.id] = r
        return r

    def _slots(self, pages: list[int], num_tokens: int) -> torch.Tensor:
        return self.scheduler.slots(Sequence(0, [], SamplingParams(), 0, frozenset(), pages=pages), num_tokens)

    def _get(self, rid: str, *states: str) -> Reservation:
        self.expire()
        r = self.active.get(rid)
        if r is None:
            raise ReservationError(f"reservation {rid}: unknown or expired")
        if r.state not in states:
            raise ReservationError(f"reservation {rid}: is {r.state}, expected {' or '.join(states)}")
        return r

    def _move(self, r: Reservation, state: str) -> None:
        logger.debug("reservation %s: %s -> %s", r.id, r.state, state)
        r.state = state

    def _free(self, r: Reservation, why: str) -> None:
        """The reservation ends: its holds on the prompt's pages and on the page copies of forks
        that never ran go back (a committed fork holds its own)."""
        del self.active[r.id]
        logger.debug("reservation %s: %s -> freed (%s)", r.id, r.state, why)
        r.state = "freed"
        self.scheduler.drop_pages(r.prompt_pages + [p for p in r.tails[1:] if p is not None])

    def begin_write(self, rid: str) -> Reservation:
        """Claim the rows for writing, or — called again while writing — renew the write lease
        (the writer's heartbeat). Refused for an unknown, lapsed, aborted or finished one: a
        writer that gets a refusal must not write."""
        r = self._get(rid, "reserved", "writing")
        if r.state == "reserved":
            self._move(r, "writing")
        r.deadline = time.monotonic() + self.write_timeout_s
        return r

    def end_write(self, rid: str) -> bool:
        """The writer has stopped writing ``rid``'s rows. Frees them if the reservation was
        aborted meanwhile; False if ``rid`` is unknown (already freed: lapsed)."""
        self.expire()
        r = self.active.get(rid)
        if r is None:
            return False
        if r.state == "aborting":
            self._free(r, "aborted, writer done")
        elif r.state == "writing":
            self._move(r, "written")
            r.deadline = time.monotonic() + self.lease_s  # for Generate to commit it
        return True

    def commit(self, rid: str, prompt_ids: list[int], params: SamplingParams, seed: int, first_token: int,
               output_ids: list[int] = (), fork: int = 0) -> Sequence:
        """Fork ``fork`` of the reservation joins the running batch (a resumed generation:
        ``output_ids``, its tokens before it was preempted, are in the rows after the prompt).
        A fork j ≥ 1 whose prompt ends in a partial page gets its copy of that page now."""
        r = self._get(rid, "writing", "written", "forking")
        if fork not in r.waiting:
            why = "already committed or aborted" if 0 <= fork < r.num_forks else f"not one of its {r.num_forks} forks"
            raise BadReservation(f"fork: {fork} of reservation {rid} is {why}")
        if len(prompt_ids) + len(output_ids) != r.num_tokens:
            raise BadReservation(f"prompt: {len(prompt_ids) + len(output_ids)} tokens, but reservation {rid} "
                                 f"holds {r.num_tokens}")
        if r.tokens is not None and (list(prompt_ids) + list(output_ids))[:r.prefix_tokens] != r.tokens[:r.prefix_tokens]:
            raise BadReservation(f"prompt: differs from the tokens reservation {rid} found cached rows for")
        if fork == 0 or not r.tails:
            pages = r.prompt_pages
            self.scheduler.hold_pages(pages)  # the fork's hold; the reservation keeps its own
        else:
            pages = r.shared + [r.tails[fork]]
            self.scheduler.hold_pages(r.shared)
            r.tails[fork] = None  # the reservation's hold on the copy passes to the fork
            n = len(r.shared) * self.span
            self.copy_slots(r.slots[n:], self._slots(pages, r.num_tokens)[n:])
        r.waiting.discard(fork)
        self._move(r, "forking")
        r.deadline = max(r.deadline, time.monotonic() + self.lease_s)  # for the other forks to commit
        shared = len(r.shared) * self.span if r.num_forks > 1 else 0
        seq = self.scheduler.adopt(prompt_ids, params, seed, pages, first_token, list(output_ids),
                                   r.id if shared else None, shared, r.prefix_tokens, r.cache_salt)
        if not r.waiting:
            self._free(r, "every fork committed or aborted")
        return seq

    def abort(self, rid: str, fork: int | None = None) -> bool:
        """Abort ``rid`` (``fork``: only that fork; the others may still commit). Once no fork is
        left to commit, its rows go back now, or — none committed and a writer may still be
        writing — once the writer has stopped (quarantine)."""
        r = self.active.get(rid)
        if r is None or (fork is not None and fork not in r.waiting):
            return False
        r.waiting -= set(r.waiting) if fork is None else {fork}
        if r.waiting:
            return True
        if r.state == "writing":
            self._move(r, "aborting")  # rows stay allocated until end_write or the write lease lapses
        elif r.state != "aborting":
            self._free(r, "aborted")
        return True

    def expire(self) -> list[str]:
        now = time.monotonic()
        lapsed = [rid for rid, r in self.active.items() if r.deadline < now]
        for rid in lapsed:
            self._free(self.active[rid], "lease lapsed")
        return lapsed
