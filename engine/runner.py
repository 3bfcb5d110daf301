"""Runners turn a step plan into one model forward on this process.

`LocalRunner` is the one-process reference: it holds every cache row (row = slot).
"""

from __future__ import annotations

import torch

from engine.cache.local import LocalKV
from engine.cache.pool import KVPool
from engine.model.batch import ForwardBatch, RequestView
from engine.plan import StepPlan


def batch_inputs(plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], list[int], list[int]]:
    """(token ids, positions, new-token slots per item, token count per item, kv_len per item), batch order."""
    if plan.is_decode:
        ids = torch.tensor([it.token_id for it in plan.items], dtype=torch.long)
        pos = torch.tensor([it.position for it in plan.items], dtype=torch.long)
        new_slots = [it.slots[it.position :] for it in plan.items]
        return ids, pos, new_slots, [1] * len(plan.items), [it.position + 1 for it in plan.items]
    ids = torch.tensor([t for it in plan.items for t in it.token_ids], dtype=torch.long)
    pos = torch.cat([torch.arange(it.start, it.end) for it in plan.items])
    new_slots = [it.slots[it.start : it.end] for it in plan.items]
    return ids, pos, new_slots, [len(it.token_ids) for it in plan.items], [it.end for it in plan.items]


def logit_items(plan: StepPlan) -> list[int]:
    """Indices of the plan items whose last token's logits the scheduler needs."""
    return [i for i, it in enumerate(plan.items) if plan.is_decode or it.wants_logits]


class LocalRunner:
    """Every row on this process. What crosses: nothing.

    ``device``: where the model, the cache and the forward live. The forward runs under
    ``torch.device(device)``, so the tensors it makes land there; the scheduler's slot lists
    are moved in, the logits moved out (sampling stays on the host).
    """

    def __init__(self, lm, pool: KVPool, trace: bool = False, device: str | torch.device = "cpu"):
        self.lm, self.pool = lm, pool
        self.trace: dict | None = {} if trace else None
        self.device = torch.device(device)

    def run(self, plan: StepPlan) -> dict[int, torch.Tensor]:
        if self.device.type == "cpu":
            return self._run(plan)
        with torch.device(self.device):
            return {k: v.cpu() for k, v in self._run(plan).items()}

    def _run(self, plan: StepPlan) -> dict[int, torch.Tensor]:
        ids, pos, new_slots, counts, kv_lens = batch_inputs(plan)
        views, start = [], 0
        for n, kv_len, p in zip(counts, kv_lens, pos.split(counts)):
            views.append(RequestView(torch.arange(start, start + n), p, kv_len))
            start += n
        ends = torch.cumsum(torch.tensor(counts), 0) - 1
        want = logit_items(plan)
        dev = self.device
        kv = LocalKV(self.pool, torch.cat(new_slots).to(dev), [it.slots.to(dev) for it in plan.items])
        batch = ForwardBatch(ids, pos, views, kv, ends[want], is_decode=plan.is_decode, trace=self.trace)
        logits = self.lm(batch)
        return {plan.items[i].req_id: logits[j] for j, i in enumerate(want)}
