"""Decode-side reservations of cache rows for prompts that a prefill service will write.

Life cycle: reserved → writing → committed, or aborted / expired. Every path returns the rows.

- ``reserve`` takes pages for prompt + max_new_tokens from the decode scheduler's allocator and
  starts a lease (``lease_s``): unless a write begins before it ends, the rows go back.
- ``begin_write`` is the prefill side's last check before it writes: it refuses an unknown,
  expired or already-used reservation, and otherwise extends the lease to ``write_timeout_s``
  (a prefill that dies mid-write does not hold rows forever).
- ``commit`` hands the rows to the scheduler as a running request; ``abort`` returns them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engine.model.sampler import SamplingParams
from engine.scheduler import Scheduler, Sequence
from kvtransfer.handoff import BadReservation, NoCapacity, ReservationError, new_reservation_id


@dataclass
class Reservation:
    id: str
    num_tokens: int
    pages: list[int]
    slots: torch.Tensor
    state: str  # reserved | writing | committed | aborted | expired
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

    def begin_write(self, rid: str) -> Reservation:
        r = self._get(rid, "reserved")
        r.state, r.deadline = "writing", time.monotonic() + self.write_timeout_s
        return r

    def commit(self, rid: str, prompt_ids: list[int], params: SamplingParams, seed: int,
               first_token: int) -> Sequence:
        r = self._get(rid, "writing")
        if len(prompt_ids) != r.num_tokens:
            raise BadReservation(f"prompt: {len(prompt_ids)} tokens, but reservation {rid} holds {r.num_tokens}")
        del self.active[rid]
        r.state = "committed"
        return self.scheduler.adopt(prompt_ids, params, seed, r.pages, first_token)

    def abort(self, rid: str) -> bool:
        r = self.active.pop(rid, None)
        if r is None:
            return False
        r.state = "aborted"
        self.scheduler.allocator.free(r.pages)
        return True

    def expire(self) -> list[str]:
        now = time.monotonic()
        lapsed = [rid for rid, r in self.active.items() if r.deadline < now]
        for rid in lapsed:
            r = self.active.pop(rid)
            r.state = "expired"
            self.scheduler.allocator.free(r.pages)
        return lapsed
