"""The sending half of the KV hand-off, run on each prefill rank.

What one rank stores: a registered staging buffer (grown on demand) and one transfer engine.
What crosses: for each write of the plan (engine/parallel/transfer_plan.py), its rows of each layer in its
range, packed contiguously in the staging buffer, then written to the destination rank's pool
with one batched transfer per destination rank.
Cost: one gather per (write, layer) straight into staging (memory bandwidth, no temporary) and one transfer entry per
(write, layer); the plan merges consecutive destination rows, so entries are few and large.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from engine.handoff import KvDestination
from kvtransfer.transport import KVTransferError, MooncakeTransport, StagingBuffer


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

    def push(self, writes, dest: KvDestination, latent_of, index_of, layer: int | None = None) -> dict:
        """Send `writes` (this rank's part of the plan); with `layer`, only that layer's part
        (layer-wise overlap). `latent_of(layer)` / `index_of(layer)` return this rank's
        [rows, width] pool of that layer. Never raises a transfer failure: it is returned, so
        one bad destination cannot kill the prefill group."""
        t0 = time.perf_counter()
        if layer is not None:
            writes = [replace(w, layers=range(layer, layer + 1)) for w in writes if layer in w.layers]
        try:
            total = 0
            for w in writes:
                pool = latent_of(w.layers.start) if w.kind == "latent" else index_of(w.layers.start)
                total += len(w.layers) * w.num_rows * pool.shape[1] * pool.element_size()
            staging = self._staging(total)
            per_peer: dict[str, tuple[list, list, list]] = {}
            offset = 0
            for w in writes:
                ep = dest.ranks[w.dst_rank]
                src_rows = torch.as_tensor(w.src_rows, dtype=torch.long)
                srcs, dsts, lens = per_peer.setdefault(ep.session, ([], [], []))
                for layer in w.layers:
                    pool = latent_of(layer) if w.kind == "latent" else index_of(layer)
                    end = staging.gather(offset, pool, src_rows)
                    nbytes = end - offset
                    srcs.append(staging.ptr + offset)
                    dsts.append(ep.latent_addr(layer, w.dst_row_start) if w.kind == "latent"
                                else ep.index_addr(layer, w.dst_row_start))
                    lens.append(nbytes)
                    offset += nbytes
            for session, (srcs, dsts, lens) in per_peer.items():
                self.transport.write_batch(session, srcs, dsts, lens)
            return {"ok": True, "bytes": offset, "seconds": time.perf_counter() - t0, "writes": sum(
                len(v[0]) for v in per_peer.values())}
        except KVTransferError as e:
            return {"ok": False, "peer": getattr(e, "peer", None), "error": str(e),
                    "seconds": time.perf_counter() - t0}

    @staticmethod
    def merge(results: list[dict]) -> dict:
        """One result for several pushes (e.g. the layers of one request)."""
        failed = [r for r in results if not r["ok"]]
        if failed:
            return failed[0]
        return {"ok": True, "bytes": sum(r["bytes"] for r in results), "writes": sum(r["writes"] for r in results),
                "seconds": sum(r["seconds"] for r in results)}

    def close(self) -> None:
        if self.staging is not None:
            self.staging.close()
        self.transport.close()
