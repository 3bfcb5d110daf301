"""Prefill context parallelism (CP): the rank worker and the driver-side runner.

Each forward's new tokens are split across the C ranks by a layout (engine/parallel/layout.py:
interleave or zigzag). Per attention layer, every rank:

1. computes the cache entries (and, on indexer layers, index keys) of its own tokens;
2. all-gathers them over the group (padded to the largest rank's share), restores batch order
   and writes them into its cache — so every rank ends the layer with every new entry;
3. runs the DSA indexer and attention for its own queries only, each reading its request's
   full causal history (cached prefix included). Scoring is therefore done once in total.

Dense MLPs run on each rank's own tokens. MoE layers are expert parallel by default
(``moe_parallel: ep``): each rank holds and loads only its experts, and each token's hidden
row goes to the ranks holding its chosen experts and back (engine/parallel/expert.py).

What one rank stores: without layer split, a full copy of the cache (every layer, every row);
with ``layer_split``, only its contiguous range of layers (the first L mod C ranks take one
extra) plus one scratch layer holding the layer in flight for the requests of the forward.
What crosses per attention layer: an all-gather of T × (entry bytes + index key bytes on
indexer layers) in the cache's stored form (T = the forward's new tokens; each rank encodes its
own entries once, so an FP8 cache gathers bytes, not the compute dtype); with layer split, also
a broadcast of the batch's cached-prefix rows of that layer from its owner.
Cost: the all-gather moves (C−1)/C of T × entry bytes into each rank; attention and indexer
work per rank is that of its own queries (balanced by the layout).

That is the ``allgather`` CP attention, the default. ``cp_attention="ring"`` swaps the
per-forward cache access for engine/parallel/ring.py's (a sharded cache, blocks passed round
the ring); everything else here — the layout, the experts, the hand-off, the logits — serves both.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import torch

from engine.cache.kvformat import KVFormat
from engine.cache.pool import KVPool, resident_bytes, zeroed
from engine.faults import faults
from engine.handoff import kv_backend
from engine.model.attention import extend_attention
from engine.model.batch import ForwardBatch, RequestView
from engine.model.loader import load_model, parse_dtype
from engine.parallel.expert import prefill_dispatch
from engine.parallel.layout import check_cp_attention, layer_owner, layer_owner_ranges, split_batch
from engine.parallel.ring import RingKV
from engine.parallel.shard import WeightShard, weights_held
from engine.plan import StepPlan
from engine.runner import batch_inputs, merge_scores, score_request, split_scores


class ScratchLayer:
    """One layer's worth of rows (latent + index key, stored form), addressed by slot: the layer in flight."""

    def __init__(self, cfg, num_rows: int, fmt: KVFormat):
        self.latent_rows = zeroed((num_rows, fmt.entry_width), fmt.storage_dtype)
        self.index_rows = zeroed((num_rows, fmt.index_width), fmt.storage_dtype) if cfg.has_indexer else None

    @property
    def nbytes(self) -> int:
        n = self.latent_rows.numel() * self.latent_rows.element_size()
        return n + (self.index_rows.numel() * self.index_rows.element_size() if self.index_rows is not None else 0)


class CPKV:
    """KVAccess of a prefill CP rank for one forward (see the module docstring)."""

    def __init__(self, rank: "PrefillRank", layout, new_slots: torch.Tensor, req_slots: list[torch.Tensor],
                 prefix_slots: torch.Tensor):
        self.r, self.layout, self.new_slots, self.req_slots = rank, layout, new_slots, req_slots
        self.prefix_slots = prefix_slots
        self.order = torch.tensor(layout.gather_order(), dtype=torch.long)
        self.on_stored = None
        self.width = layout.max_tokens_per_rank

    def _all_gather(self, own: torch.Tensor) -> torch.Tensor:
        """Own rows [T_own, W] → every new row [T, W] in batch order."""
        r = self.r
        if r.world == 1:
            return own
        buf = own.new_zeros(self.width, own.shape[1])
        buf[: own.shape[0]] = own
        out = own.new_empty(r.world * self.width, own.shape[1])
        r.comm.all_gather_single(out, buf)
        r.gathered_bytes += out.numel() * out.element_size()
        return out[self.order]

    def store(self, layer, latent, index_key):
        """Own entries are encoded (quantized once, by the rank that computed them) and their
        stored bytes all-gathered: an FP8 cache moves 1 byte a value, not the compute dtype's."""
        faults().after_layer()
        r, fmt = self.r, self.r.pool.fmt
        own = fmt.encode_latent(layer, latent)
        if index_key is not None:
            own = torch.cat([own, fmt.encode_index(index_key)], dim=-1)
        full = self._all_gather(own)
        lat, idx = full[:, : fmt.entry_width], (full[:, fmt.entry_width :] if index_key is not None else None)
        if r.pool.holds(layer):
            r.pool.latent(layer)[self.new_slots] = lat
            if idx is not None:
                r.pool.index(layer)[self.new_slots] = idx
            if self.on_stored is not None:
                self.on_stored(layer)  # layer-wise overlap: this layer's rows are final now
        if r.scratch is None:
            return
        self._fill_prefix(layer, index_key is not None)
        r.scratch.latent_rows[self.new_slots] = lat
        if idx is not None:
            r.scratch.index_rows[self.new_slots] = idx

    def _fill_prefix(self, layer: int, has_index: bool) -> None:
        """Layer split: the owner broadcasts the batch's cached-prefix rows of this layer."""
        r, n, fmt = self.r, self.prefix_slots.numel(), self.r.pool.fmt
        if n == 0:
            return
        width = fmt.entry_width + (fmt.index_width if has_index else 0)
        owner = layer_owner(layer, r.cfg.num_layers, r.world)
        if r.rank == owner:
            parts = [r.pool.latent(layer).index_select(0, self.prefix_slots)]
            if has_index:
                parts.append(r.pool.index(layer).index_select(0, self.prefix_slots))
            buf = torch.cat(parts, dim=-1).contiguous()
        else:
            buf = torch.empty(n, width, dtype=fmt.storage_dtype)
        if r.world > 1:
            r.comm.broadcast(buf, owner)
        r.scratch.latent_rows[self.prefix_slots] = buf[:, : fmt.entry_width]
        if has_index:
            r.scratch.index_rows[self.prefix_slots] = buf[:, fmt.entry_width :]

    def _source(self, layer):
        r = self.r
        if r.scratch is not None:
            return r.scratch.latent_rows, r.scratch.index_rows
        return r.pool.latent(layer), (r.pool.index(layer) if layer in r.pool.index_layers else None)

    def latent(self, layer, req):
        rows = self._source(layer)[0].index_select(0, self.req_slots[req])
        return self.r.pool.fmt.decode_latent(layer, rows, self.r.dtype)

    def index_keys(self, layer, req):
        return self.r.pool.fmt.decode_index(self._source(layer)[1].index_select(0, self.req_slots[req]), self.r.dtype)

    def decode_select(self, *a, **k):
        raise NotImplementedError("prefill CP ranks run extend steps only")

    decode_attention = decode_select


RING_STATS = ("ring_steps", "ring_hidden_steps", "ring_attend_s", "ring_exposed_s", "ring_bytes", "ring_index_bytes",
              "ring_route_bytes")


class PrefillRank:
    """Worker of one prefill CP rank (constructed in the rank process by WorkerGroup)."""

    def __init__(self, ctx, model_dir: str, dtype: str, strategy: str, layer_split: bool, num_rows: int,
                 kv_transport: str | None = None, kv_host: str = "127.0.0.1", moe_parallel: str = "ep",
                 kv_cache_dtype: str = "auto", cp_attention: str = "allgather"):
        check_cp_attention(cp_attention, strategy, layer_split)
        if layer_split and strategy != "interleave":
            raise ValueError("layer_split: supported with the interleave strategy only")
        self.cp_attention = cp_attention
        # ring: rows sharded by the DCP numbering; interleave means striped by position (each rank
        # computes the tokens it stores), zigzag computes its blocks and sends each entry home
        self.token_layout = "striped" if cp_attention == "ring" and strategy == "interleave" else strategy
        self.ring_stats = dict.fromkeys(RING_STATS, 0)
        self.rank, self.world, self.comm = ctx.rank, ctx.world_size, ctx.comm
        self.strategy, self.dtype = strategy, parse_dtype(dtype)
        self.shard = WeightShard(self.rank, self.world, tp=False, moe_parallel=moe_parallel)
        self.lm = load_model(model_dir, dtype, shard=self.shard)
        self.cfg = self.lm.cfg
        self.moe = prefill_dispatch(moe_parallel, self.comm, self.rank, self.world, self.cfg.n_routed_experts)
        layers = layer_owner_ranges(self.cfg.num_layers, self.world)[self.rank] if layer_split else None
        fmt = KVFormat.for_checkpoint(model_dir, self.cfg, kv_cache_dtype, self.dtype)
        self.pool = KVPool(self.cfg, num_rows, self.dtype, layers=layers, fmt=fmt)
        self.scratch = ScratchLayer(self.cfg, num_rows, fmt) if layer_split else None
        self.trace: dict | None = None
        self.gathered_bytes = 0
        self.sender = None
        self.pusher: ThreadPoolExecutor | None = None  # one thread: layer pushes go in order
        if kv_transport is not None:
            self.sender = kv_backend().sender(kv_host, kv_transport)

    def push(self, writes_by_rank: dict, dest) -> dict:
        """Send this rank's writes of a transfer plan to the decode ranks (see kvtransfer/push.py)."""
        mine = writes_by_rank.get(self.rank, [])
        if self.sender is None:
            raise ValueError("kv_transport: this prefill group was started without a KV transport")
        return self.sender.push(mine, dest, self.pool.latent, self.pool.index)

    def close(self) -> None:
        """Runs as the rank process ends (engine/parallel/group.py)."""
        if self.pusher is not None:
            self.pusher.shutdown(wait=True)
        if self.sender is not None:
            self.sender.close(at_exit=True)

    def run(self, plan: StepPlan, trace: bool = False, armed: dict | None = None, ring_mode: str | None = None):
        """One extend forward over this rank's share of the plan's new tokens.

        ``armed`` ({req_id: (writes_by_rank, destination)}, layer-wise overlap): for those
        requests — whose prompt this forward completes — each layer's KV is pushed from a
        background thread as soon as the layer is stored, while later layers compute.
        Returns ({req_id: logits} for requests whose last prompt token this rank owns, seconds,
        {req_id: push result} for armed requests). ``ring_mode``: pass_kv or pass_q, the
        driver's choice for this forward (the ring only; every rank gets the same).
        """
        t0 = time.perf_counter()
        ids, pos, new_slots, counts, kv_lens = batch_inputs(plan)
        starts = [it.start for it in plan.items]
        layout = split_batch(counts, starts, self.world, self.token_layout)
        mine = layout.ranks[self.rank]
        own = torch.tensor(mine.token_indices, dtype=torch.long)
        req_of = torch.tensor(mine.request_ids, dtype=torch.long)
        views = []
        for i, kv_len in enumerate(kv_lens):
            local = (req_of == i).nonzero().squeeze(1)
            views.append(RequestView(local, pos[own[local]], kv_len))
        ends = torch.cumsum(torch.tensor(counts), 0) - 1
        logit_local, logit_req = [], []
        for i, it in enumerate(plan.items):
            hit = (own == ends[i]).nonzero()
            if it.wants_logits and hit.numel():
                logit_local.append(int(hit[0, 0]))
                logit_req.append(it.req_id)
        req_slots = [it.slots[: it.end] for it in plan.items]
        if self.cp_attention == "ring":
            kv = RingKV(self, req_slots, torch.cat(new_slots), layout, ring_mode or "pass_kv")
        else:
            prefix = [it.slots[: it.start] for it in plan.items]
            kv = CPKV(self, layout, torch.cat(new_slots), req_slots, torch.cat(prefix))
        self.trace = {} if trace else None
        futures: dict[int, list] = {}
        if armed:
            kv.on_stored = lambda layer: self._push_layer(armed, layer, futures)
        batch = ForwardBatch(ids[own], pos[own], views, kv, torch.tensor(logit_local, dtype=torch.long),
                             trace=self.trace, moe=self.moe)
        scoring = score_request(plan, own)  # prompt logprobs of this rank's own tokens
        if scoring is not None:
            batch.score_index, batch.score_targets, batch.score_top = scoring.index, scoring.targets, scoring.top
        logits = self.lm(batch)
        computed = time.perf_counter()
        pushed = {rid: self.sender.merge([f.result() for f in fs]) for rid, fs in futures.items()}
        for result in pushed.values():  # how long the pushes ran on after the compute
            result["tail_seconds"] = time.perf_counter() - computed
        scores = split_scores(scoring, batch.scores)
        return {rid: logits[j] for j, rid in enumerate(logit_req)}, time.perf_counter() - t0, pushed, scores

    def _push_layer(self, armed: dict, layer: int, futures: dict) -> None:
        if self.pusher is None:
            self.pusher = ThreadPoolExecutor(1, thread_name_prefix="kv-push")
        for rid, (writes_by_rank, dest) in armed.items():
            mine = writes_by_rank.get(self.rank, [])
            if any(layer in w.layers for w in mine):
                futures.setdefault(rid, []).append(self.pusher.submit(
                    self.sender.push, mine, dest, self.pool.latent, self.pool.index, layer))

    def calibrate(self) -> dict:
        """The ring selector's measured constants on this rank (every rank at once: the ring's
        sends run while the others compute, as in a forward): seconds per latent row expanded,
        per query-key pair attended (layer 0's attention, this rank's dtype and threads), and
        per byte sent to the next rank. Each the best of three."""
        cfg, att = self.cfg, self.lm.model.layers[0].self_attn
        heads, rows, queries = cfg.num_heads, 1024, 128
        g = torch.Generator().manual_seed(self.rank)
        latent = torch.randn(rows, cfg.latent_dim, generator=g).to(self.dtype)
        row_s = _best_of_three(lambda: att._expand(latent, heads)) / rows
        k, v = att._expand(latent, heads)
        q = torch.randn(queries, heads, cfg.qk_head_dim, generator=g).to(self.dtype)
        mask = torch.ones(queries, rows, dtype=torch.bool)
        pair_s = _best_of_three(lambda: extend_attention(q, k, v, mask, att.scale, return_lse=True)) / (queries * rows)
        buf = torch.zeros(1 << 20)
        got = torch.empty_like(buf)
        nxt, prv = (self.rank + 1) % self.world, (self.rank - 1) % self.world
        byte_s = _best_of_three(lambda: self.comm.sendrecv(buf, nxt, got, prv)) / (buf.numel() * 4)
        return {"row_s": row_s, "pair_s": pair_s, "byte_s": byte_s}

    # ---- inspection (call_rank: no collectives) -----------------------------------------
    def dump(self, slots: torch.Tensor) -> dict:
        """Cache rows at `slots` of every persistent layer: {"latent": {layer: rows}, "index": {...}};
        ring: of the slots this rank holds ({"held": their indices in ``slots``} too)."""
        held = None
        if self.cp_attention == "ring":
            held = (slots % self.world == self.rank).nonzero().squeeze(1)
            slots = torch.div(slots[held], self.world, rounding_mode="floor")
        return {"latent": {l: self.pool.latent(l)[slots].clone() for l in self.pool.layers},
                "index": {l: self.pool.index(l)[slots].clone() for l in self.pool.index_layers}, "held": held}

    def last_trace(self) -> dict | None:
        return self.trace

    def cache_bytes(self) -> dict:
        """Capacity (``persistent``, ``scratch``: bytes reserved; ``rows``: rows per layer) and
        ``resident``: the pool's bytes in memory now (written rows, by whole OS pages)."""
        resident = resident_bytes(self.pool.latent_pool) + (
            resident_bytes(self.pool.index_pool) if self.pool.index_layers else 0)
        return {"persistent": self.pool.nbytes, "scratch": self.scratch.nbytes if self.scratch else 0,
                "layers": list(self.pool.layers), "bytes_per_layer": self.pool.nbytes // max(len(self.pool.layers), 1),
                "rows": self.pool.num_rows, "resident": resident}

    def stats(self) -> dict:
        return {"gathered_bytes": self.gathered_bytes, "expert_bytes": getattr(self.moe, "bytes_sent", 0),
                **self.ring_stats}

    def weights(self) -> dict:
        return weights_held(self.lm, self.shard)


def _best_of_three(fn) -> float:
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


class CPRunner:
    """Driver side: sends each plan to every rank and merges their logits.

    ``arm(plan)`` (set by the engine) returns the layer-wise pushes to start during this plan's
    forward; their per-rank results land in ``push_results[req_id]``, and ``returned_at`` is
    when the ranks' answers to the last forward were in (perf_counter). ``choose(plan)`` (the
    ring) picks pass_kv or pass_q for each forward; ``modes`` counts the choices."""

    def __init__(self, group, trace: bool = False, choose=None):
        self.group, self.trace, self.choose = group, trace, choose
        self.modes: dict[str, int] = {}
        self.rank_seconds = [0.0] * group.world_size
        self.arm = None
        self.push_results: dict[int, list[dict]] = {}
        self.returned_at = 0.0
        self.scores: dict[int, tuple] = {}  # the last forward's prompt scores by request

    def run(self, plan: StepPlan) -> dict[int, torch.Tensor]:
        if plan.is_decode:
            raise ValueError("prefill CP runs extend steps only (set max_new_tokens=1 for prefill)")
        armed = self.arm(plan) if self.arm is not None else None
        merged: dict[int, torch.Tensor] = {}
        blocks: dict[int, list] = {}
        mode = self.choose(plan) if self.choose is not None else None
        if mode is not None:
            self.modes[mode] = self.modes.get(mode, 0) + 1
        answers = self.group.call("run", plan, self.trace, armed or None, mode)
        self.returned_at = time.perf_counter()
        for r, (logits, seconds, pushed, scores) in enumerate(answers):
            merged.update(logits)
            for rid, block in scores.items():
                blocks.setdefault(rid, []).append(block)
            self.rank_seconds[r] += seconds
            for rid, result in pushed.items():
                self.push_results.setdefault(rid, []).append(result)
        self.scores = {rid: merge_scores(b) for rid, b in blocks.items()}  # gathered in prompt order
        return {it.req_id: merged[it.req_id] for it in plan.items if it.req_id in merged}
