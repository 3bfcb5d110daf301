"""Decode context parallelism (DCP): each request's KV cache is split across the C ranks.

Token p of a request lives on rank p mod C (engine/cache/slots.py). Attention heads are split
into C slices, so the DCP group is also the tensor-parallel group of the rest of the layer:

1. Queries for all heads reach every rank: an all-gather of the head slices (absorbed query
   latent + rotary part), or ``replicate_q_proj`` — every rank keeps the full query projection
   and skips that all-gather.
2. Each rank runs absorbed-MLA attention for all heads over the rows it owns (only the selected
   ones on DSA layers) → a partial output and an LSE per head (base e).
3. Exchange: ``a2a`` — one all-to-all of outputs + LSEs, each rank merges its head slice
   locally; ``ag_rs`` — all-gather of the LSEs, each rank rescales its partials, then a
   reduce-scatter sums them into head slices. Either way each rank ends with its head slice over
   the whole cache — what plain TP would hold — and ``W_UV``, ``o_proj`` (row-parallel) and the
   dense MLP / shared experts (column- then row-parallel) run as in TP, with one all-reduce
   after each. Routed experts are expert parallel (``moe_parallel: ep``, the default): each
   rank holds its own experts, applies them to every token routed to them and one all-reduce
   sums the partial outputs (engine/parallel/expert.py). Each rank reads only its slices of
   the weights from the files (engine/parallel/shard.py).

DSA index: ``copied`` — every rank keeps every index key and computes the same top-k, then
attends over the selected rows it owns; ``split`` — each rank keeps the index keys of its own
tokens, takes a local top-k of (score, position), all-gathers the candidates and takes the
exact global top-k (a token of the global top-k is in its owner's local top-k under the same
total order: score, then position).

What one rank stores: ~1/C of the latent rows (+ all index keys when copied, 1/C when split), in
the cache's stored form (``kv_cache_dtype``: fp32, bf16, or FP8 bytes — engine/cache/kvformat.py),
1/C of the heads' projection and MLP weights, ~1/C of the routed experts. What crosses per layer and step (B requests, H
heads, r = kv_lora_rank, dr = rope dim): the query all-gather B·H·(r+dr) values (unless
replicated); the exchange B·H·(r+1) values (a2a) or B·H LSEs + B·H·r values reduce-scattered
(ag_rs); on split-index layers B·C·k (score, position) candidates; two all-reduces of B·hidden.
Cost: attention reads N/C rows per rank instead of N.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from engine.cache.gather import RowGatherer, fused_decode_attention
from engine.cache.kvformat import KVFormat
from engine.cache.pool import resident_bytes, zeroed
from engine.faults import faults
from engine.handoff import RankEndpoint, kv_backend
from engine.kernels import dcp_pack
from engine.model.attention import merge_partials, topk_mask, topk_select
from engine.model.batch import ForwardBatch, RequestView
from engine.model.loader import load_model, parse_dtype
from engine.parallel.expert import decode_dispatch
from engine.parallel.shard import WeightShard, weights_held
from engine.plan import FROM_PREVIOUS, SlotSync, StepPlan
from engine.runner import batch_inputs

EXCHANGES = ("a2a", "ag_rs")
INDEXERS = ("copied", "split")


# ---- cache access of one DCP rank ------------------------------------------------------------
class PendingSelection:
    """A split-index selection: per request, the positions to attend to (None = all), known
    once every rank's candidates are gathered. Indexable like the list it stands for."""

    def __init__(self, cand: torch.Tensor, take_all: list[bool], k: int):
        self.cand, self.take_all, self.k = cand, take_all, k
        self.positions: list | None = None

    @property
    def resolved(self) -> bool:
        return self.positions is not None

    def resolve(self, gathered: torch.Tensor) -> None:
        """gathered [C, B, k, 2]: the exact global top-k under (score desc, position asc)."""
        out = []
        for b, take_all in enumerate(self.take_all):
            if take_all:
                out.append(None)
                continue
            c = gathered[:, b].reshape(-1, 2)
            c = c[c[:, 1] >= 0]
            order = torch.argsort(c[:, 1])
            s, p = c[order, 0], c[order, 1].long()
            keep = topk_mask(s[None], self.k, torch.ones(1, s.numel(), dtype=torch.bool))[0]
            out.append(p[keep])
        self.positions = out

    def __getitem__(self, b: int):
        if self.positions is None:
            raise RuntimeError("split-index selection used before its candidates were gathered")
        return self.positions[b]


class DCPKV:
    """KVAccess of a DCP rank for one decode step (see the module docstring)."""

    def __init__(self, r: "DecodeRank", new_slots: torch.Tensor, req_slots: list[torch.Tensor]):
        self.r, self.new_slots, self.req_slots = r, new_slots, req_slots
        self.own_positions = [torch.arange(r.rank, max(s.numel(), r.rank), r.world) for s in req_slots]
        mine = new_slots % r.world == r.rank  # the step's tokens this rank stores (p mod C)
        self._mine = None if bool(mine.all()) else mine.nonzero().squeeze(1)
        self._own_new_rows = (new_slots if self._mine is None else new_slots[self._mine]) // r.world
        self._own_rows: list[torch.Tensor] | None = None  # per request, its rows here (every layer's)

    def store(self, layer, latent, index_key):
        """Entries of the step's tokens: the latent only on its owner rank p mod C."""
        r, fmt = self.r, self.r.fmt
        own = latent if self._mine is None else latent.index_select(0, self._mine)
        r.latent[layer].index_copy_(0, self._own_new_rows, fmt.encode_latent(layer, own))
        if index_key is not None:
            if r.indexer == "copied":
                r.index[layer].index_copy_(0, self.new_slots, fmt.encode_index(index_key))
            else:
                own = index_key if self._mine is None else index_key.index_select(0, self._mine)
                r.index[layer].index_copy_(0, self._own_new_rows, fmt.encode_index(own))

    def latent(self, layer, req):
        raise NotImplementedError("DCP ranks run decode steps only; prompts arrive as KV")

    index_keys = latent

    def _own_positions(self, req: int) -> torch.Tensor:
        """Positions of request `req` stored on this rank (p ≡ rank mod C); computed once a step."""
        return self.own_positions[req]

    def decode_select(self, layer, iq, iw, k, indexer):
        """Positions each request attends to (None = all): the same list on every rank."""
        r = self.r
        if r.indexer == "copied":
            out = []
            for b, slots in enumerate(self.req_slots):
                if slots.numel() <= k:
                    out.append(None)
                    continue
                keys = r.fmt.decode_index(r.index[layer].index_select(0, slots), r.dtype)
                out.append(topk_select(indexer.scores(iq[b : b + 1], iw[b : b + 1], keys)[0], k))
            return out
        return self._split_select(layer, iq, iw, k, indexer)

    def _split_select(self, layer, iq, iw, k, indexer):
        """Local top-k candidates; the global top-k is taken once they are all-gathered.

        Without ``replicate_q_proj`` the candidates ride on the query all-gather of the same
        layer (one collective fewer per indexer layer): the selection stays pending until
        ``decode_attention`` gathers both. With it, they take an all-gather of their own.
        """
        r = self.r
        # (fp32 score, position) pairs: 8 bytes a candidate; positions < 2^24 are exact in fp32.
        cand = torch.full((len(self.req_slots), k, 2), float("-inf"), dtype=torch.float32)
        cand[..., 1] = -1
        for b, slots in enumerate(self.req_slots):
            if slots.numel() <= k:
                continue
            pos = self._own_positions(b)
            if pos.numel() == 0:
                continue
            rows = slots[pos] // r.world
            keys = r.fmt.decode_index(r.index[layer].index_select(0, rows), r.dtype)
            scores = indexer.scores(iq[b : b + 1], iw[b : b + 1], keys)[0]
            keep = topk_select(scores, k)
            cand[b, : keep.numel(), 0] = scores[keep].float()
            cand[b, : keep.numel(), 1] = pos[keep].float()
        r.bytes_sent["index_candidates"] += cand.numel() * cand.element_size()
        pending = PendingSelection(cand, [slots.numel() <= k for slots in self.req_slots], k)
        if not r.replicate_q_proj and r.world > 1:
            return pending
        gathered = torch.empty(r.world * cand.shape[0], *cand.shape[1:], dtype=cand.dtype)
        r.comm.all_gather_single(gathered, cand)
        pending.resolve(gathered.view(r.world, *cand.shape))
        return pending

    def _gather_heads(self, x: torch.Tensor, extra: torch.Tensor | None = None):
        """[B, H/C, d] head slices → [B, H, d] on every rank; `extra` [B, ...] rides along and
        comes back as [C, B, ...]."""
        r = self.r
        b = x.shape[0]
        packed = x.reshape(b, -1) if extra is None else torch.cat([x.reshape(b, -1), extra.reshape(b, -1)], dim=1)
        out = torch.empty(r.world * b, packed.shape[1], dtype=packed.dtype)
        r.comm.all_gather_single(out, packed.contiguous())
        out = out.view(r.world, b, -1)
        r.bytes_sent["q_all_gather"] += x.numel() * x.element_size()
        q = out[..., : x[0].numel()].reshape(r.world, *x.shape).permute(1, 0, 2, 3).reshape(b, -1, x.shape[2])
        rest = None if extra is None else out[..., x[0].numel() :].reshape(r.world, *extra.shape)
        return q, rest

    def decode_attention(self, layer, q, sel, scale):
        r = self.r
        heads = r.cfg.num_heads
        if q.shape[1] != heads:
            ride = sel.cand if isinstance(sel, PendingSelection) and not sel.resolved else None
            q, cands = self._gather_heads(q, ride)
            if ride is not None:
                sel.resolve(cands)
        if self._own_rows is None:  # the same tensors every layer: RowGatherer checks their runs once
            self._own_rows = [slots[self._own_positions(b)] // r.world for b, slots in enumerate(self.req_slots)]
        rows = []
        for b, slots in enumerate(self.req_slots):
            if sel is not None and sel[b] is not None:
                rows.append(slots[sel[b][sel[b] % r.world == r.rank]] // r.world)
            else:
                rows.append(self._own_rows[b])
        out, lse = r.gather.attend(r.latent[layer], rows, q, r.cfg.kv_lora_rank, scale, return_lse=r.world > 1,
                                   layer=layer)
        if r.world == 1:
            return out
        return self._exchange(out, lse)

    def _exchange(self, out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
        """Partial [B, H, r] + lse [B, H] over own rows → merged [B, H/C, r] for own heads."""
        r = self.r
        b, h, d = out.shape
        per = h // r.world
        if r.exchange == "a2a":
            pack = dcp_pack()
            if pack is not None:  # the layout below in one C call instead of five tensor ops
                o, l = out.float().contiguous(), lse.float().contiguous()
                send = torch.empty(r.world, b, per, d + 1)
                pack(o.data_ptr(), l.data_ptr(), b, h, d, r.world, send.data_ptr())
            else:
                packed = torch.cat([out.float(), lse.unsqueeze(-1)], dim=-1)  # [B, H, r+1]
                send = packed.view(b, r.world, per, d + 1).permute(1, 0, 2, 3).contiguous()
            recv = torch.empty_like(send)
            r.comm.all_to_all_single(recv, send)
            r.bytes_sent["exchange"] += send.numel() * send.element_size() * (r.world - 1) // r.world
            merged, _ = merge_partials(recv[..., :d], recv[..., d])
            return merged.to(out.dtype)
        lses = torch.empty(r.world * b, h, dtype=lse.dtype)
        r.comm.all_gather_single(lses, lse.contiguous())
        lses = lses.view(r.world, b, h)
        total = torch.logsumexp(lses, dim=0)
        scale = torch.exp(lse - torch.where(torch.isneginf(total), torch.zeros_like(total), total))
        scale = torch.where(torch.isneginf(lse), torch.zeros_like(scale), scale)
        scaled = (out.float() * scale.unsqueeze(-1)).view(b, r.world, per, d).permute(1, 0, 2, 3).contiguous()
        mine = torch.empty(b, per, d, dtype=scaled.dtype)
        r.comm.reduce_scatter_single(mine, scaled.view(r.world * b, per, d))
        r.bytes_sent["exchange"] += lse.numel() * lse.element_size() + scaled.numel() * scaled.element_size() * (
            r.world - 1) // r.world
        return mine.to(out.dtype)


class DecodeRank:
    """Worker of one DCP decode rank (constructed in the rank process by WorkerGroup)."""

    def __init__(self, ctx, model_dir: str, dtype: str, num_rows: int, exchange: str = "a2a",
                 indexer: str = "copied", replicate_q_proj: bool = False, kv_transport: str | None = None,
                 kv_host: str = "127.0.0.1", moe_parallel: str = "ep", kv_cache_dtype: str = "auto"):
        if exchange not in EXCHANGES:
            raise ValueError(f"dcp_comm: {exchange!r} is not one of {', '.join(EXCHANGES)}")
        if indexer not in INDEXERS:
            raise ValueError(f"indexer: {indexer!r} is not one of {', '.join(INDEXERS)}")
        self.rank, self.world, self.group, self.comm = ctx.rank, ctx.world_size, ctx.group, ctx.comm
        self.exchange, self.indexer, self.dtype = exchange, indexer, parse_dtype(dtype)
        self.replicate_q_proj = replicate_q_proj
        self.shard = WeightShard(self.rank, self.world, tp=True, moe_parallel=moe_parallel,
                                 replicate_q_proj=replicate_q_proj)
        self.lm = load_model(model_dir, dtype, shard=self.shard)
        self.cfg = self.lm.cfg
        if indexer == "split" and self.cfg.max_position_embeddings >= 1 << 24:
            raise ValueError("indexer: split index candidates carry positions as fp32 (exact below 2^24)")
        self.moe = decode_dispatch(moe_parallel, self.comm, self.world)
        cfg = self.cfg
        self.num_rows = num_rows
        fmt = self.fmt = KVFormat.for_checkpoint(model_dir, cfg, kv_cache_dtype, self.dtype)
        self.latent = zeroed((cfg.num_layers, num_rows, fmt.entry_width), fmt.storage_dtype)
        index_rows = num_rows * self.world if indexer == "copied" else num_rows
        self.index = {l: zeroed((index_rows, fmt.index_width), fmt.storage_dtype) for l in cfg.indexer_layer_ids}
        self.bytes_sent = {"q_all_gather": 0, "exchange": 0, "index_candidates": 0, "all_reduce": 0}
        self.trace: dict | None = None
        self.slots = SlotSync()  # each running request's slots, sent once (engine/plan.py)
        self.last_tokens: dict[int, int] = {}  # the last step's argmax per request (FROM_PREVIOUS)
        self.gather = RowGatherer(fused_decode_attention(fmt, self.dtype, "cpu"), fmt)
        self.transport = None
        if kv_transport is not None:
            self.transport = kv_backend().receiver(kv_host, kv_transport)
            self.transport.register(self.latent.data_ptr(), self.latent.numel() * self.latent.element_size())
            for t in self.index.values():
                self.transport.register(t.data_ptr(), t.numel() * t.element_size())

    def endpoint(self):
        """Where this rank's pools are, for a KvDestination (the prefill side writes there)."""
        if self.transport is None:
            raise ValueError("kv_transport: this decode group was started without a KV transport")
        any_index = next(iter(self.index.values()), None)
        return RankEndpoint(
            session=self.transport.session_name, latent_ptr=self.latent.data_ptr(), rows=self.num_rows,
            latent_row_bytes=self.fmt.entry_bytes,
            index_ptrs={l: t.data_ptr() for l, t in self.index.items()},
            index_rows=any_index.shape[0] if any_index is not None else 0,
            index_row_bytes=self.fmt.index_bytes)

    def close(self) -> None:
        """Runs as the rank process ends (engine/parallel/group.py)."""
        if self.transport is not None:
            self.transport.close(at_exit=True)

    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            self.comm.all_reduce(x)
            self.bytes_sent["all_reduce"] += x.numel() * x.element_size()
        return x

    def load_rows(self, slots: torch.Tensor, latent: dict, index: dict) -> None:
        """Receive prompt entries computed elsewhere, already in this group's stored form (test
        entry; the service receives them through Mooncake)."""
        mine = slots % self.world == self.rank
        for layer, rows in latent.items():
            self.latent[layer][slots[mine] // self.world] = rows[mine]
        for layer, rows in index.items():
            if self.indexer == "copied":
                self.index[layer][slots] = rows
            else:
                self.index[layer][slots[mine] // self.world] = rows[mine]

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the entries of group slots ``src`` to ``dst`` (a fork's copy of its prompt's
        partial page). Both hold the same positions, so each pair is on one rank (p mod C)."""
        mine = src % self.world == self.rank
        s, d = src[mine] // self.world, dst[mine] // self.world
        self.latent[:, d] = self.latent[:, s]
        for layer, keys in self.index.items():
            if self.indexer == "copied":
                keys[dst] = keys[src]
            else:
                keys[d] = keys[s]

    def run(self, plan: StepPlan, trace: bool = False) -> tuple[dict[int, torch.Tensor], float]:
        if not plan.is_decode:
            raise ValueError("DCP ranks run decode steps only")
        t0 = time.perf_counter()
        plan = self.slots.expand(plan)
        if any(it.token_id == FROM_PREVIOUS for it in plan.items):  # a step planned ahead (DCPDecodeEngine)
            plan = StepPlan(plan.kind, [replace(it, token_id=self.last_tokens[it.req_id])
                                        if it.token_id == FROM_PREVIOUS else it for it in plan.items])
        ids, pos, new_slots, _, kv_lens = batch_inputs(plan)
        views = [RequestView(torch.tensor([b]), pos[b : b + 1], kv) for b, kv in enumerate(kv_lens)]
        kv = DCPKV(self, torch.cat(new_slots), [it.slots for it in plan.items])
        self.trace = {} if trace else None
        batch = ForwardBatch(ids, pos, views, kv, torch.arange(len(plan.items)), is_decode=True,
                             all_reduce=self._all_reduce, trace=self.trace, moe=self.moe)
        logits = self.lm(batch)
        result = {}
        # every rank takes the argmax of its logits (the same on every rank: each computes the
        # whole model on the same merged attention), so that a step planned ahead can feed it
        greedy = [b for b, it in enumerate(plan.items) if it.argmax]
        tokens = dict(zip(greedy, logits[greedy].argmax(dim=1).tolist())) if greedy else {}
        self.last_tokens = {plan.items[b].req_id: t for b, t in tokens.items()}
        if self.rank == 0:
            result = {it.req_id: tokens[b] if b in tokens else logits[b] for b, it in enumerate(plan.items)}
        faults().after_decode_step()
        return result, time.perf_counter() - t0

    # ---- inspection (call_rank: no collectives) -----------------------------------------
    def rows(self, slots: torch.Tensor) -> dict:
        """This rank's latent rows of the given group slots it owns: {layer: rows}."""
        mine = slots[slots % self.world == self.rank] // self.world
        return {"rows": mine, "latent": self.latent[:, mine].clone()}

    def memory(self) -> dict:
        """Pool bytes reserved, and resident so far (the pools' pages are touched as rows are written)."""
        latent = self.latent.numel() * self.latent.element_size()
        index = sum(t.numel() * t.element_size() for t in self.index.values())
        resident = sum(resident_bytes(t) for t in (self.latent, *self.index.values()))
        return {"latent_bytes": latent, "index_bytes": index, "num_rows": self.num_rows, "resident_bytes": resident}

    def stats(self) -> dict:
        return dict(self.bytes_sent, experts=getattr(self.moe, "bytes_sent", 0))

    def weights(self) -> dict:
        return weights_held(self.lm, self.shard)

    def last_trace(self):
        return self.trace
