"""Runners turn a step plan into one model forward on this process.

`LocalRunner` is the one-process reference: it holds every cache row (row = slot).
"""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass(frozen=True)
class ScoreRequest:
    """Which of a forward's own tokens are scored, and how the results split back by request."""

    index: torch.Tensor  # [n] own-token indices
    targets: torch.Tensor  # [n] the next prompt token of each
    top: int  # the largest top-N asked for in the batch
    segments: list[tuple[int, torch.Tensor, int]]  # (req_id, scored token positions, its top-N), in order


def score_request(plan: StepPlan, own: torch.Tensor) -> ScoreRequest | None:
    """The scoring this forward owes for the plan's items with ``score >= 0``. ``own``: the
    indices (into the plan's flat token order) of the tokens this process computes."""
    if plan.is_decode:
        return None
    index, targets, segments, start = [], [], [], 0
    for it in plan.items:
        n = len(it.targets)
        if it.score >= 0 and n:
            hit = ((own >= start) & (own < start + n)).nonzero().squeeze(1)
            if hit.numel():
                rel = own[hit] - start
                index.append(hit)
                targets.append(torch.tensor(it.targets, dtype=torch.long)[rel])
                segments.append((it.req_id, it.start + rel + 1, it.score))  # the scored token's position
        start += len(it.token_ids)
    if not index:
        return None
    return ScoreRequest(torch.cat(index), torch.cat(targets), max(s[2] for s in segments), segments)


def split_scores(req: ScoreRequest | None, scores: tuple | None) -> dict[int, tuple[torch.Tensor, ...]]:
    """{req_id: (positions, logprobs, top ids, top logprobs)} from a forward's ``batch.scores``."""
    if req is None or scores is None:
        return {}
    out, at = {}, 0
    lp, ids, vals = scores
    for rid, positions, top in req.segments:
        n = positions.numel()
        out[rid] = (positions, lp[at : at + n], ids[at : at + n, :top], vals[at : at + n, :top])
        at += n
    return out


def merge_scores(blocks: list[tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
    """Score blocks of one request (from several chunks or CP ranks) in position order."""
    cat = [torch.cat(parts) for parts in zip(*blocks)]
    order = torch.argsort(cat[0])
    return tuple(t[order] for t in cat)


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
        self.scores: dict[int, tuple] = {}  # the last forward's prompt scores by request

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
        scoring = score_request(plan, torch.arange(len(ids)))
        batch = ForwardBatch(ids, pos, views, kv, ends[want], is_decode=plan.is_decode, trace=self.trace)
        if scoring is not None:
            batch.score_index, batch.score_targets = scoring.index.to(dev), scoring.targets.to(dev)
            batch.score_top = scoring.top
        logits = self.lm(batch)
        self.scores = {rid: tuple(t.cpu() for t in block) for rid, block in split_scores(scoring, batch.scores).items()}
        return {plan.items[i].req_id: logits[j] for j, i in enumerate(want)}
