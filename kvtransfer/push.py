"""The sending half of the KV hand-off, run on each prefill rank.

What one rank stores: a registered staging buffer (grown on demand) and one transfer engine.
What crosses: for each write of the plan (engine/parallel/transfer_plan.py), its rows of each layer in its
range, packed contiguously in the staging buffer, then written to the destination rank's pool
with one stream of batched transfers per destination rank: a large push is cut into a few
batches, each submitted once packed, so packing the next overlaps the wire (Mooncake's
asynchronous write; no thread of ours).
Cost: one gather per (write, layer) straight into staging (memory bandwidth, no temporary) and one transfer entry per
(write, layer); the plan merges consecutive destination rows, so entries are few and large.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from engine.handoff import KvDestination
from kvtransfer.transport import KVTransferError, MooncakeTransport, StagingBuffer, WriteStream

# A large push goes to each peer in about FLUSHES_PER_PEER asynchronous batches of at least
# FLUSH_BYTES, so the wire carries one batch while the next packs; a push under twice
# FLUSH_BYTES to a peer is one synchronous write (Mooncake logs a line per asynchronous batch).
FLUSH_BYTES = 4 << 20
FLUSHES_PER_PEER = 8


class KVSender:
    def __init__(self, host: str = "127.0.0.1", protocol: str = "tcp"):
        self.transport = MooncakeTransport(host, protocol)
        self.staging: StagingBuffer | None = None

    def _staging(self, nbytes: int) -> StagingBuffer:
        if self.staging is None or self.staging.nbytes < nbytes:
            if self.staging is not None:
                self.staging.close()
            self.staging = StagingBuffer(self.transport, max(nbytes, 1 << 20))
        return self.staging

    def prepare(self, nbytes: int) -> None:
        """Grow the staging buffer to ``nbytes`` now (registering memory takes time; a caller
        that knows its largest push can pay for it before the first)."""
        self._staging(nbytes)

    def push(self, writes, dest: KvDestination, latent_of, index_of, layer: int | None = None) -> dict:
        """Send `writes` (this rank's part of the plan); with `layer`, only that layer's part
        (layer-wise overlap). `latent_of(layer)` / `index_of(layer)` return this rank's
        [rows, width] pool of that layer. Never raises a transfer failure: it is returned, so
        one bad destination cannot kill the prefill group. Returns once no byte of this push
        is in flight (landed or failed), so the staging buffer and the rows are free again."""
        t0 = time.perf_counter()
        if layer is not None:
            writes = [replace(w, layers=range(layer, layer + 1)) for w in writes if layer in w.layers]
        streams: dict[str, WriteStream] = {}
        packing = 0.0
        try:
            total, per_peer = 0, {}
            for w in writes:
                pool = latent_of(w.layers.start) if w.kind == "latent" else index_of(w.layers.start)
                nbytes = len(w.layers) * w.num_rows * pool.shape[1] * pool.element_size()
                total += nbytes
                session = dest.ranks[w.dst_rank].session
                per_peer[session] = per_peer.get(session, 0) + nbytes
            staging = self._staging(total)
            for session, nbytes in per_peer.items():
                # Small pushes go in one synchronous write; large ones in a few batches each,
                # the first on the wire while the next packs.
                streams[session] = self.transport.stream(
                    session, None if nbytes < 2 * FLUSH_BYTES else max(FLUSH_BYTES, nbytes // FLUSHES_PER_PEER))
            offset = 0
            for w in writes:
                ep = dest.ranks[w.dst_rank]
                stream = streams[ep.session]
                if stream.failed:
                    continue  # that peer's write has failed: no point packing for it
                t = time.perf_counter()
                src_rows = torch.as_tensor(w.src_rows, dtype=torch.long)
                for layer in w.layers:
                    pool = latent_of(layer) if w.kind == "latent" else index_of(layer)
                    end = staging.gather(offset, pool, src_rows)
                    packing += time.perf_counter() - t
                    stream.add(staging.ptr + offset, ep.latent_addr(layer, w.dst_row_start) if w.kind == "latent"
                               else ep.index_addr(layer, w.dst_row_start), end - offset)
                    offset = end
                    t = time.perf_counter()
            error = None
            for stream in streams.values():  # every stream is finished, even after one fails
                try:
                    stream.finish()
                except KVTransferError as e:
                    error = error or e
            if error is not None:
                raise error
            return {"ok": True, "bytes": offset, "seconds": time.perf_counter() - t0, "pack_seconds": packing,
                    "writes": sum(s.ranges for s in streams.values())}
        except KVTransferError as e:
            return {"ok": False, "peer": getattr(e, "peer", None), "error": str(e),
                    "seconds": time.perf_counter() - t0}
        finally:  # nothing of this push may still be in flight when it returns (staging reuse, fencing)
            for stream in streams.values():
                stream.abort()

    @staticmethod
    def merge(results: list[dict]) -> dict:
        """One result for several pushes (e.g. the layers of one request)."""
        failed = [r for r in results if not r["ok"]]
        if failed:
            return failed[0]
        return {"ok": True, "bytes": sum(r["bytes"] for r in results), "writes": sum(r["writes"] for r in results),
                "seconds": sum(r["seconds"] for r in results)}

    def close(self, at_exit: bool = False) -> None:
        if self.staging is not None:
            self.staging.close()
        self.transport.close(at_exit=at_exit)
