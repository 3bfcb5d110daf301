"""Ring context parallelism for prefill (``cp_attention: ring``): pass-KV over a sharded cache.

Where the all-gather design (engine/parallel/prefill_cp.py) leaves every rank with every row,
the ring leaves each row on one rank only. Slots are numbered as decode's DCP numbers them
(engine/cache/slots.py): a virtual page spans ``page_size · C`` slots, the token at position
``p`` of a request sits on rank ``p mod C`` at row ``slot // C``, so a rank's pool holds 1/C of
every request (its prefix and every later chunk included) and prefill rank r holds exactly
the rows decode rank r wants when both groups have C ranks. The token layout is ``striped``
(engine/parallel/layout.py): the rank that stores a token is the rank that computes it.

Per attention layer, every rank:

1. computes the entries (and index keys) of its own new tokens and writes them into its own
   rows — nothing crosses for the store;
2. (DSA indexer layers) all-gathers the index keys of the batch's requests — index keys are
   small (``index_head_dim`` values against the latent's ``kv_lora_rank + rope``), and with the
   whole history at hand the top-k is the reference's own, ties broken by position as in
   docs/architecture.md; the selection then applies to each block's rows where they live;
3. attends its queries to its own rows, then C − 1 times passes the block it holds (its rows of
   every request of the batch, stored form) to rank r + 1 and takes rank r − 1's, posting the
   send and receive before attending to the block in hand so that the transfer runs under
   the attention; partials merge with the exact LSE merge (engine/model/attention.py).

A block needs no positions on the wire: every rank knows each request's history length, so the
rows of source rank s for a request of ``kv_len`` keys are positions s, s + C, … < kv_len.

What one rank stores: ⌈N/C⌉ rows (within a page) of every layer for a prompt of N tokens, plus
the ring's in-flight buffers (the block in hand and the one arriving: two blocks of one layer).
What crosses per attention layer: each block goes C − 1 hops, so a rank sends and receives
(C − 1)/C of the batch's history (prefix included) in stored form; on indexer layers also the
all-gather of index keys.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engine.faults import faults
from engine.model.attention import merge_partials, pick_width


HIDDEN_WAIT_S = 1e-4  # a step whose transfer needed less waiting than this after attention counts as hidden


@dataclass(frozen=True)
class RingCosts:
    """What the selector weighs, per attention layer. Bytes in the form that travels:
    ``entry_bytes`` a cache entry as stored (FP8: one byte a value), ``query_bytes`` a query
    (all heads, compute dtype), ``output_bytes`` a query's partial output and LSE (fp32);
    ``index_topk`` (0 without a DSA indexer): a query whose history is longer than it also
    carries its picks, 8 bytes a selected position. Measured constants
    (``PrefillRank.calibrate``, the slowest rank's): ``pair_s`` seconds per query-key pair of
    extend attention, ``row_s`` seconds to expand one latent row into its keys and values,
    ``byte_s`` seconds per byte sent round the ring."""

    entry_bytes: int
    query_bytes: int
    output_bytes: int
    pair_s: float
    row_s: float
    byte_s: float
    index_topk: int = 0


def ring_estimates(new: list[int], cached: list[int], c: int, costs: RingCosts) -> dict[str, float]:
    """Seconds per attention layer on one rank, pass-KV and pass-Q, for a forward of requests
    with ``new`` tokens over ``cached`` prefixes (Meta's rule, arXiv 2411.01783 §3, with MLA's
    forms). Per ring step a rank attends its queries to a block: pairs/C² pairs, and (pass-KV)
    expands the block's K/C rows; the transfer of the next block hides under that work, so only
    what is longer shows:

    - pass-KV moves K/C entries a step (K = Σ(T+P) keys): exposed (C−1)·max(0, K/C·e·β − step);
    - pass-Q moves Q/C queries a step (Q = ΣT), expands only its own K/C rows once, then one
      all-to-all sends (C−1)/C of the partials home, not hidden.

    Pass-KV moves fewer bytes while T·q_bytes > (T+P)·e_bytes, i.e. T/(T+P) > e/q (1/128 for
    absorbed MLA's 576-value entries against 128 heads × 576-value queries in one dtype); past
    that line it can still win where attention hides its transfer, which is why the estimate
    compares times, not bytes."""
    keys = sum(t + p for t, p in zip(new, cached))
    queries = sum(new)
    query_bytes = costs.query_bytes + 8 * pick_width(costs.index_topk, [t + p for t, p in zip(new, cached)])
    pairs = sum(t * p + t * (t + 1) / 2 for t, p in zip(new, cached))
    attend = pairs / (c * c) * costs.pair_s
    expand = keys / c * costs.row_s
    kv_step = attend + expand
    kv_send = keys / c * costs.entry_bytes * costs.byte_s
    pass_kv = c * kv_step + (c - 1) * max(0.0, kv_send - kv_step)
    q_send = queries / c * query_bytes * costs.byte_s
    home = queries / c * (c - 1) / c * costs.output_bytes * costs.byte_s
    pass_q = expand + c * attend + (c - 1) * max(0.0, q_send - attend) + home
    return {"pass_kv": pass_kv, "pass_q": pass_q}


def pick_ring_mode(estimates: dict[str, float]) -> str:
    """The faster of :func:`ring_estimates`' two; a tie goes to pass-KV."""
    return "pass_q" if estimates["pass_q"] < estimates["pass_kv"] else "pass_kv"


class RingKV:
    """KVAccess of a ring CP rank for one forward (see the module docstring).

    ``req_slots[i]``: request i's slots for positions [0, kv_len); ``new_slots``: the slots of
    the batch's new tokens (flattened batch order); ``layout``: who computes which of them."""

    def __init__(self, rank, req_slots: list[torch.Tensor], new_slots: torch.Tensor, layout, mode: str = "pass_kv"):
        self.r, self.layout, self.ring_mode = rank, layout, mode
        c, me = rank.world, rank.rank
        self._route(new_slots, layout)
        self.kv_lens = [int(s.numel()) for s in req_slots]
        # rows this rank holds, request after request: positions me, me + C, ... < kv_len
        self.rows = torch.cat([torch.div(s[me::c], c, rounding_mode="floor") for s in req_slots]) \
            if req_slots else torch.zeros(0, dtype=torch.long)
        # per source rank: each request's row count in its block, and the block's total
        self.counts = [[len(range(src, n, c)) for n in self.kv_lens] for src in range(c)]
        self.totals = [sum(cs) for cs in self.counts]
        self._index: dict[int, torch.Tensor] = {}  # indexer layer -> every request's keys, gathered
        self.on_stored = None
        self._partials: dict[int, tuple] = {}  # pass-Q: source rank -> (out, lse) of its queries here
        # pass-Q: every rank's queries (request, position), in its own order
        self.q_req = [torch.tensor(rl.request_ids, dtype=torch.long) for rl in layout.ranks]
        self.q_pos = [torch.tensor(rl.positions, dtype=torch.long) for rl in layout.ranks]

    def _route(self, new_slots: torch.Tensor, layout) -> None:
        """Where this rank's computed entries go. Striped: nowhere (it stores what it computes).
        Otherwise (zigzag) the token at slot s is stored by rank s mod C: ``send_order`` sorts
        the own entries by that rank (``send_splits`` of them each), and ``recv_rows`` are the
        rows, on this rank, of what each rank sends it (``recv_splits``), in that rank's order."""
        c, me = self.r.world, self.r.rank
        self.routed = layout.strategy != "striped"
        computed = [new_slots[torch.tensor(rl.token_indices, dtype=torch.long)] for rl in layout.ranks]
        if not self.routed:
            if computed[me].numel() and bool((computed[me] % c != me).any()):
                raise AssertionError("ring: a striped rank computes only the tokens it stores")
            self.recv_rows = torch.div(computed[me], c, rounding_mode="floor")
            return
        dest = computed[me] % c
        self.send_order = torch.argsort(dest, stable=True)
        self.send_splits = torch.bincount(dest, minlength=c).tolist()
        mine = [slots[slots % c == me] for slots in computed]  # each rank's tokens stored here, its order
        self.recv_splits = [int(m.numel()) for m in mine]
        self.recv_rows = torch.div(torch.cat(mine), c, rounding_mode="floor")

    # ---- writes --------------------------------------------------------------------------
    def store(self, layer, latent, index_key):
        """Encode the computed entries (once, by the rank that computed them) and write them at
        their rows — here (striped), or on the rank that stores each (zigzag: one uneven
        all-to-all of stored bytes)."""
        faults().after_layer()
        r, pool = self.r, self.r.pool
        own = pool.fmt.encode_latent(layer, latent)
        width = own.shape[1]
        if index_key is not None:
            own = torch.cat([own, pool.fmt.encode_index(index_key)], dim=-1)
        if self.routed:
            got = own.new_empty(self.recv_rows.numel(), own.shape[1])
            r.comm.all_to_all(got, own[self.send_order].contiguous(), self.recv_splits, self.send_splits)
            r.ring_stats["ring_route_bytes"] += (own.shape[0] - self.send_splits[r.rank]) * own.shape[1] * own.element_size()
            own = got
        pool.latent(layer).index_copy_(0, self.recv_rows, own[:, :width])
        if index_key is not None:
            pool.index(layer).index_copy_(0, self.recv_rows, own[:, width:])
        if self.on_stored is not None:
            self.on_stored(layer)  # layer-wise overlap: this rank's rows of the layer are final

    # ---- the DSA index: gathered whole ---------------------------------------------------
    def index_keys(self, layer, req):
        if layer not in self._index:
            self._index = {layer: self._gather_index(layer)}  # one indexer layer at a time
        return self._index[layer][req]

    def _gather_index(self, layer: int) -> list[torch.Tensor]:
        r, c = self.r, self.r.world
        pool = r.pool
        own = pool.index(layer).index_select(0, self.rows)
        width = max(self.totals)
        buf = own.new_zeros(width, own.shape[1])
        buf[: own.shape[0]] = own
        every = own.new_empty(c * width, own.shape[1])
        r.comm.all_gather_single(every, buf)
        r.ring_stats["ring_index_bytes"] += every.numel() * every.element_size()
        out = []
        for i, n in enumerate(self.kv_lens):
            pos = torch.arange(n)
            src = pos % c
            before = torch.tensor([sum(self.counts[s][:i]) for s in range(c)], dtype=torch.long)
            at = src * width + before[src] + pos // c
            out.append(pool.fmt.decode_index(every.index_select(0, at), r.dtype))
        return out

    def latent(self, layer, req):
        raise NotImplementedError("ring CP: attention reads key_blocks, not a whole history")

    # ---- pass-KV -------------------------------------------------------------------------
    def key_blocks(self, layer):
        """The C blocks of this layer's rows, own first, each as it arrives round the ring."""
        r, c, me = self.r, self.r.world, self.r.rank
        cur = r.pool.latent(layer).index_select(0, self.rows)
        for step in range(c):
            src = (me - step) % c
            nxt, works = None, ()
            if step < c - 1:
                nxt = cur.new_empty(self.totals[(src - 1) % c], cur.shape[1])
                works = self._post(cur, src, nxt)
            t0 = time.perf_counter()
            yield _Block(self, layer, cur, src)
            t1 = time.perf_counter()
            self._finish_step(works, t1 - t0, cur.numel() * cur.element_size())
            if nxt is not None:
                cur = nxt

    def _finish_step(self, works: list, attend_s: float, sent: int) -> None:
        """Wait for a step's transfers (they ran while the block was attended) and count: the
        time attended, the time waited past it (exposed), the step as hidden when that wait
        was under 0.1 ms (gloo's send/receive report completion only once waited on)."""
        if not works:
            return
        t0 = time.perf_counter()
        for w in works:
            w.wait()
        waited = time.perf_counter() - t0
        stats = self.r.ring_stats
        stats["ring_steps"] += 1
        stats["ring_hidden_steps"] += int(waited < HIDDEN_WAIT_S)
        stats["ring_attend_s"] += attend_s
        stats["ring_exposed_s"] += waited
        stats["ring_bytes"] += sent

    def _post(self, cur: torch.Tensor, src: int, nxt: torch.Tensor) -> list:
        """Send the block in hand (source ``src``) on to rank + 1 and receive source ``src - 1``
        from rank − 1; an empty block is neither sent nor received (both ends know its size)."""
        r, c, me = self.r, self.r.world, self.r.rank
        works = []
        if nxt.numel():
            works.append(r.comm.irecv(nxt, (me - 1) % c))
        if cur.numel():
            works.append(r.comm.isend(cur, (me + 1) % c))
        return works

    # ---- pass-Q --------------------------------------------------------------------------
    def own_rows(self, layer: int, req: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(request ``req``'s rows on this rank, decoded; their positions)."""
        r, c, me = self.r, self.r.world, self.r.rank
        at, n = sum(self.counts[me][:req]), self.counts[me][req]
        rows = r.pool.latent(layer).index_select(0, self.rows[at : at + n])
        return r.pool.fmt.decode_latent(layer, rows, r.dtype), _positions(me, self.kv_lens[req], c)

    def query_blocks(self, layer: int, q: torch.Tensor, picks: torch.Tensor | None, dv: int):
        """The C ranks' query blocks (own first): ``q`` [n, H, d] this rank's queries, ``picks``
        [n, K] their DSA selections (positions, −1 padded) or None. The model ``put``s each
        block's partials over this rank's rows; ``merge_queries`` sends them home."""
        r, c, me = self.r, self.r.world, self.r.rank
        cur = (q, picks)
        self._partials = {}
        for step in range(c):
            src = (me - step) % c
            nxt, works = None, []
            if step < c - 1:
                n = len(self.q_pos[(src - 1) % c])
                nxt = (q.new_empty(n, *q.shape[1:]), None if picks is None else picks.new_empty(n, picks.shape[1]))
                for mine, theirs in zip(cur, nxt):
                    if theirs is not None and theirs.numel():
                        works.append(r.comm.irecv(theirs, (me - 1) % c))
                    if mine is not None and mine.numel():
                        works.append(r.comm.isend(mine, (me + 1) % c))
            block = _QueryBlock(self, src, cur[0], cur[1], dv)
            t0 = time.perf_counter()
            yield block
            t1 = time.perf_counter()
            self._partials[src] = (block.out, block.lse)
            self._finish_step(works, t1 - t0, sum(t.numel() * t.element_size() for t in cur if t is not None))
            if nxt is not None:
                cur = nxt

    def merge_queries(self, layer: int) -> torch.Tensor:
        """Every rank's partials of this rank's queries (one uneven all-to-all), merged by LSE:
        the output [n, H, dv] of this rank's queries."""
        r, c, me = self.r, self.r.world, self.r.rank
        parts = [self._partials[s] for s in range(c)]
        heads, dv = parts[0][0].shape[1], parts[0][0].shape[2]
        packed = torch.cat([torch.cat([o.float(), l.unsqueeze(-1)], dim=-1).reshape(o.shape[0], -1)
                            for o, l in parts])  # [Σ n_s, H·(dv + 1)]: source s's queries' partials
        n_own = len(self.q_pos[me])
        got = packed.new_empty(c * n_own, packed.shape[1])
        r.comm.all_to_all(got, packed, [n_own] * c, [len(p) for p in self.q_pos])
        r.ring_stats["ring_bytes"] += (packed.shape[0] - n_own) * packed.shape[1] * 4
        got = got.view(c, n_own, heads, dv + 1)
        out, _ = merge_partials(got[..., :dv], got[..., dv])
        return out.to(parts[0][0].dtype)

    def decode_select(self, *a, **k):
        raise NotImplementedError("prefill CP ranks run extend steps only")

    decode_attention = decode_select


class _QueryBlock:
    """One rank's queries visiting this rank (pass-Q), and their partials over its rows."""

    def __init__(self, kv: RingKV, src: int, q: torch.Tensor, picks: torch.Tensor | None, dv: int):
        self.kv, self.src, self.q, self.picks = kv, src, q, picks
        self.out = torch.zeros(q.shape[0], q.shape[1], dv, dtype=q.dtype)
        self.lse = torch.full((q.shape[0], q.shape[1]), float("-inf"))

    def queries(self, req: int):
        """(their indices in the block, queries, positions, picks or None) of request ``req``."""
        at = (self.kv.q_req[self.src] == req).nonzero().squeeze(1)
        return at, self.q[at], self.kv.q_pos[self.src][at], None if self.picks is None else self.picks[at]

    def put(self, at: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
        self.out[at] = out
        self.lse[at] = lse


class _Block:
    """Rows of one source rank for every request of the batch (stored form, request order)."""

    def __init__(self, kv: RingKV, layer: int, data: torch.Tensor, src: int):
        self.kv, self.layer, self.data, self.src = kv, layer, data, src
        counts = kv.counts[src]
        self.starts = [sum(counts[:i]) for i in range(len(counts))]

    def rows(self, req: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(request ``req``'s entries in this block, decoded [n, latent_dim]; their positions)."""
        kv = self.kv
        n, at = kv.counts[self.src][req], self.starts[req]
        latent = kv.r.pool.fmt.decode_latent(self.layer, self.data[at : at + n], kv.r.dtype)
        return latent, _positions(self.src, kv.kv_lens[req], kv.r.world)


def _positions(src: int, kv_len: int, c: int) -> torch.Tensor:
    """Positions rank ``src`` holds of a history of ``kv_len`` keys: src, src + C, … < kv_len."""
    return torch.arange(src, max(src, kv_len), c)
