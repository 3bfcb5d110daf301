"""Step plans: what one forward computes, as plain data the driver sends to every rank.

A plan is either an *extend* step (prefill chunks) or a *decode* step (one token per
request). It names cache slots, not rows: each runner maps slots to its own rows (one
process: row = slot; DCP: rank = slot % C, row = slot // C).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
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


# A DecodeItem's token_id when the step was planned before the previous one was collected
# (DCPDecodeEngine's lookahead): each rank feeds the token it took as that request's argmax in
# the previous step (all ranks take the same), so the step starts with no round trip.
FROM_PREVIOUS = -1


@dataclass(frozen=True)
class DecodeItem:
    """The token at `position` of one request; slots cover positions [0, position].

    On the wire to decode ranks (``SlotSync``) ``slots`` holds only positions
    [slots_from, position]: the ranks keep the earlier ones from previous steps.
    ``argmax``: the ranks answer with the greedy token instead of the logits row.
    """

    req_id: int
    token_id: int
    position: int
    slots: torch.Tensor
    slots_from: int = 0
    argmax: bool = False


@dataclass(frozen=True)
class StepPlan:
    kind: str  # "extend" | "decode"
    items: list

    @property
    def is_decode(self) -> bool:
        return self.kind == "decode"

    def __reduce__(self):
        """A decode plan pickles as two byte strings — six int64 fields per item, then every
        item's slots — instead of an object per field: the driver sends one to every rank each
        step, and pickling the dataclasses took 14 µs + 9 µs to read back at batch 1 and
        216 + 167 µs at batch 32 (10 + 6 and 64 + 69 µs this way, through the group's pickler;
        several times more on a core the ranks keep busy)."""
        if not self.is_decode or not all(type(it) is DecodeItem for it in self.items):
            return StepPlan, (self.kind, self.items)
        head = [(it.req_id, it.token_id, it.position, it.slots_from, int(it.argmax), it.slots.numel())
                for it in self.items]
        slots = torch.cat([it.slots.reshape(-1).long() for it in self.items]) if self.items else \
            torch.empty(0, dtype=torch.long)
        return _decode_plan, (np.array(head, dtype=np.int64).tobytes(), slots.numpy().tobytes())


def _decode_plan(head: bytes, slots: bytes) -> StepPlan:
    fields = np.frombuffer(head, dtype=np.int64).reshape(-1, 6).tolist()
    every = torch.frombuffer(bytearray(slots), dtype=torch.long) if slots else torch.empty(0, dtype=torch.long)
    items, k = [], 0
    for req_id, token_id, position, slots_from, argmax, n in fields:
        items.append(DecodeItem(req_id, token_id, position, every[k : k + n], slots_from, bool(argmax)))
        k += n
    return StepPlan("decode", items)


class SlotSync:
    """The two ends of a decode plan's slot lists, so that a step sends each request's new
    slots only, not its whole history (a 32k-token request: 256 KB of slots a step, per rank).

    The driver's end (``wire``) remembers how many slots it sent per request; the rank's end
    (``expand``) keeps each request's slots in a growing buffer and gives the plan back its
    full lists. Both forget a request at the first plan it is not in. If a request's earlier
    slots changed (a new page table), the driver sends them whole again.
    """

    def __init__(self):
        self.sent: dict[int, tuple[int, int]] = {}  # driver: req_id -> (count sent, last slot sent)
        self.held: dict[int, tuple[torch.Tensor, int]] = {}  # rank: req_id -> (buffer, count held)

    def wire(self, plan: StepPlan) -> StepPlan:
        items, sent = [], {}
        for it in plan.items:
            n = it.slots.numel()
            k, last = self.sent.get(it.req_id, (0, -1))
            if k > n or (k and int(it.slots[k - 1]) != last):
                k = 0
            items.append(DecodeItem(it.req_id, it.token_id, it.position, it.slots[k:], k, it.argmax))
            sent[it.req_id] = (n, int(it.slots[n - 1]) if n else -1)
        self.sent = sent
        return StepPlan(plan.kind, items)

    def expand(self, plan: StepPlan) -> StepPlan:
        items, held = [], {}
        for it in plan.items:
            buf, k = self.held.get(it.req_id, (None, 0))
            if it.slots_from == 0:
                buf, k = None, 0
            elif buf is None or it.slots_from != k:
                raise RuntimeError(f"request {it.req_id}: the plan continues its slots at {it.slots_from}, "
                                   f"this rank holds {k}")
            n = k + it.slots.numel()
            if buf is None or buf.numel() < n:
                grown = torch.empty(max(n, 2 * k, 256), dtype=torch.long)
                if buf is not None:
                    grown[:k] = buf[:k]
                buf = grown
            buf[k:n] = it.slots
            held[it.req_id] = (buf, n)
            items.append(DecodeItem(it.req_id, it.token_id, it.position, buf[:n], 0, it.argmax))
        self.held = held
        return StepPlan(plan.kind, items)
