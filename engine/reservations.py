"""Decode-side reservations of cache rows for prompts that a prefill service will write.

Life cycle::

    reserved ──begin_write──▶ writing ──end_write──▶ written ──commit──▶ (a running request)
       │                        │  └──────────────commit───────────────▶
       └─abort/lapse: freed     └─abort: aborting (quarantined) ──end_write / lapse──▶ freed

- ``reserve`` takes pages for prompt + max_new_tokens from the decode scheduler's allocator and
  starts a lease (``lease_s``): unless a write begins before it ends, the rows go back.
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
- ``commit`` hands the rows to the scheduler as a running request.

Every transition is logged at debug level with the reservation id.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from engine.model.sampler import SamplingParams
from engine.scheduler import Scheduler, Sequence
from engine.handoff import BadReservation, NoCapacity, ReservationError, new_reservation_id

logger = logging.getLogger("cpserve.reservations")


@dataclass
class Reservation:
    id: str
    num_tokens: int
    pages: list[int]
    slots: torch.Tensor
    state: str  # reserved | writing | written | aborting (then gone: committed | freed)
    deadline: float  # time.monotonic()

    @property
    def expires_at(self) -> float:
        """The deadline as unix time (what a KvDestination carries across processes)."""
        return time.time() + (self.deadline - time.monotonic())


class ReservationTable:
    def __init__(self, scheduler: Scheduler, lease_s: float = 30.0, write_timeout_s: float = 60.0):
        self.scheduler, self.lease_s, self.write_timeout_s = scheduler, lease_s, write_timeout_s
        self.active: dict[str, Reservation] = {}

    def reserve(self, num_tokens: int, max_new_tokens: int) -> Reservation:
        self.expire()
        if num_tokens < 1:
            raise BadReservation(f"num_tokens: must be >= 1, got {num_tokens}")
        total = num_tokens + max_new_tokens
        need = self.scheduler._pages_for(total)
        if need > self.scheduler.allocator.num_pages:
            raise BadReservation(f"num_tokens: {total} tokens exceed this decode service's "
                                 f"{self.scheduler.capacity_tokens}-token cache")
        if not self.scheduler.allocator.can_allocate(need):
            raise NoCapacity("capacity: no free cache rows now; retry later")
        pages = self.scheduler.allocator.allocate(need)
        r = Reservation(new_reservation_id(), num_tokens, pages,
                        self.scheduler.slots(Sequence(0, [], SamplingParams(), 0, frozenset(), pages=pages), num_tokens),
                        "reserved", time.monotonic() + self.lease_s)
        self.active[r.id] = r
        return r

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
        del self.active[r.id]
        logger.debug("reservation %s: %s -> freed (%s)", r.id, r.state, why)
        r.state = "freed"
        self.scheduler.allocator.free(r.pages)

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

    def commit(self, rid: str, prompt_ids: list[int], params: SamplingParams, seed: int,
               first_token: int) -> Sequence:
        r = self._get(rid, "writing", "written")
        if len(prompt_ids) != r.num_tokens:
            raise BadReservation(f"prompt: {len(prompt_ids)} tokens, but reservation {rid} holds {r.num_tokens}")
        del self.active[rid]
        self._move(r, "committed")
        return self.scheduler.adopt(prompt_ids, params, seed, r.pages, first_token)

    def abort(self, rid: str) -> bool:
        """Abort ``rid``: its rows go back now, or once its writer has stopped (quarantine)."""
        r = self.active.get(rid)
        if r is None:
            return False
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
