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

import torch

from engine.faults import faults


class RingKV:
    """KVAccess of a ring CP rank for one forward (see the module docstring).

    ``req_slots[i]``: request i's slots for positions [0, kv_len); ``new_slots``: the slots of
    this rank's own new tokens, in own-token order."""

    def __init__(self, rank, req_slots: list[torch.Tensor], new_slots: torch.Tensor):
        self.r = rank
        c, me = rank.world, rank.rank
        if new_slots.numel() and bool((new_slots % c != me).any()):
            raise AssertionError("ring: a rank computes only the tokens it stores (striped layout)")
        self.new_rows = torch.div(new_slots, c, rounding_mode="floor")
        self.kv_lens = [int(s.numel()) for s in req_slots]
        # rows this rank holds, request after request: positions me, me + C, ... < kv_len
        self.rows = torch.cat([torch.div(s[me::c], c, rounding_mode="floor") for s in req_slots]) \
            if req_slots else torch.zeros(0, dtype=torch.long)
        # per source rank: each request's row count in its block, and the block's total
        self.counts = [[len(range(src, n, c)) for n in self.kv_lens] for src in range(c)]
        self.totals = [sum(cs) for cs in self.counts]
        self._index: dict[int, torch.Tensor] = {}  # indexer layer -> every request's keys, gathered
        self.on_stored = None

    # ---- writes --------------------------------------------------------------------------
    def store(self, layer, latent, index_key):
        faults().after_layer()
        pool = self.r.pool
        pool.latent(layer).index_copy_(0, self.new_rows, pool.fmt.encode_latent(layer, latent))
        if index_key is not None:
            pool.index(layer).index_copy_(0, self.new_rows, pool.fmt.encode_index(index_key))
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
        stats = r.ring_stats
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
            if works:
                ready = all(w.is_completed() for w in works)
                for w in works:
                    w.wait()
                stats["ring_steps"] += 1
                stats["ring_hidden_steps"] += int(ready)  # the transfer was done when attention was
                stats["ring_attend_s"] += t1 - t0
                stats["ring_exposed_s"] += time.perf_counter() - t1  # waited for it past attention
                stats["ring_bytes"] += cur.numel() * cur.element_size()
            if nxt is not None:
                cur = nxt

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

    def decode_select(self, *a, **k):
        raise NotImplementedError("prefill CP ranks run extend steps only")

    decode_attention = decode_select


class _Block:
    """Rows of one source rank for every request of the batch (stored form, request order)."""

    def __init__(self, kv: RingKV, layer: int, data: torch.Tensor, src: int):
        self.kv, self.layer, self.data, self.src = kv, layer, data, src
        counts = kv.counts[src]
        self.starts = [sum(counts[:i]) for i in range(len(counts))]

    def rows(self, req: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(request ``req``'s entries in this block, decoded [n, latent_dim]; their positions)."""
        kv, c = self.kv, self.kv.r.world
        n, at = kv.counts[self.src][req], self.starts[req]
        latent = kv.r.pool.fmt.decode_latent(self.layer, self.data[at : at + n], kv.r.dtype)
        return latent, torch.arange(self.src, max(self.src, kv.kv_lens[req]), c)
