"""Collectives of one rank group, with a shared-memory path for small CPU messages.

Every rank of a :class:`~engine.parallel.group.WorkerGroup` is a process on the same host, and a
decode step sends a handful of small messages per layer (the DCP exchange, the tensor-parallel
and MoE all-reduces: kilobytes at batch 1, a few hundred KB at batch 32). Through gloo over
loopback each cost about 1 ms of waiting on a 2-core machine (its worker thread, TCP,
wake-ups), most of a DCP step; through shared memory 0.10–0.15 ms inside a decode step, most of
it waiting for the later rank (``bench/decode_dcp.py``, docs/benchmarks.md). The operation itself
(both ranks arriving together) is 14–30 µs for 1 KiB: a handful of tensor ops, since at batch 1
their Python overhead, not the bytes, is the cost (``bench/decode_dcp.py --quick`` prints it).
:class:`Comm` runs them through a shared-memory segment:

- one segment per group, created by rank 0 under ``/dev/shm`` and unlinked as soon as every
  rank has mapped it (nothing is left behind, even after a SIGKILL);
- per rank a sequence counter on its own cache line and two data slots of ``slot_bytes``
  (double-buffered by the sequence's parity: the writer of operation s + 2 has waited for
  every rank to arrive at s + 1, so they have all finished reading s);
- an operation: copy this rank's tensor into its slot, publish the sequence number, wait until
  every rank has published it, read the others' slots.

Each rank then reduces in rank order 0, 1, …, C − 1 (in fp32), so every rank gets the same bits.
Messages larger than a slot, non-CPU tensors, non-x86 hosts (whose memory order would need
fences that Python cannot issue) and a segment that cannot be made (no /dev/shm) go through
the process group as before. All ranks take the same path for one operation: it depends on
the sizes, which are equal on every rank for these collectives.

Waiting spins briefly, then yields the core, then sleeps in 50 µs steps (a rank group may share
its cores with other work), and gives up after the group's collective timeout.
"""

from __future__ import annotations

import logging
import os
import platform
import time

import torch
import torch.distributed as dist

logger = logging.getLogger("cpserve.engine")

SLOT_BYTES = 2 << 20  # per rank and buffer; larger messages go through the process group
_LINE = 64  # bytes between two ranks' counters (one cache line each)
_SPIN, _YIELD_S, _SLEEP_S = 2000, 0.005, 50e-6
SHM_DIR = "/dev/shm"


def shm_supported(device: torch.device) -> bool:
    return device.type == "cpu" and platform.machine().lower() in ("x86_64", "amd64") and os.path.isdir(SHM_DIR)


class Comm:
    """all_reduce / all_gather_single / all_to_all_single / reduce_scatter_single with the
    semantics of torch.distributed's (sum; equal splits), on ``group``."""

    def __init__(self, rank: int, world: int, group, device: torch.device, name: str, timeout_s: float = 300.0,
                 slot_bytes: int = SLOT_BYTES):
        self.rank, self.world, self.group, self.timeout_s = rank, world, group, timeout_s
        self.slot_bytes = slot_bytes
        self.seq = 0
        self.shm_ops = self.group_ops = 0  # how many of each ran (tests, diagnostics)
        self._data = self._flags = None
        if world > 1 and shm_supported(device):
            try:
                self._map(name)
            except OSError as e:
                logger.warning("shared-memory collectives unavailable (%s); using the process group", e)

    @property
    def uses_shm(self) -> bool:
        return self._data is not None

    def _map(self, name: str) -> None:
        path = os.path.join(SHM_DIR, name)
        flag_bytes = self.world * _LINE
        size = flag_bytes + 2 * self.world * self.slot_bytes
        ok = torch.zeros(1, dtype=torch.int64)
        if self.rank == 0:
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
                try:
                    os.ftruncate(fd, size)
                finally:
                    os.close(fd)
                ok[0] = 1
            except OSError as e:
                logger.warning("shared-memory collectives: cannot create %s: %s", path, e)
        dist.broadcast(ok, 0, group=self.group)
        buf = None
        if ok.item():
            try:
                buf = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
            except (OSError, RuntimeError) as e:
                logger.warning("shared-memory collectives: cannot map %s: %s", path, e)
        mapped = torch.tensor([int(buf is not None)], dtype=torch.int64)
        dist.all_reduce(mapped, group=self.group)  # every rank mapped it (or none uses it)
        if self.rank == 0 and ok.item():
            os.unlink(path)  # mapped where needed: nothing left in /dev/shm from here on
        if mapped.item() != self.world:
            return
        self._flags = buf[:flag_bytes].view(torch.int64).numpy()  # rank r's counter: [r * _LINE // 8]
        self._data = buf[flag_bytes:].view(2, self.world, self.slot_bytes)
        # per buffer: every rank's slot [C, slot_bytes] and this rank's own (fewer tensor ops
        # per collective: at batch 1 a decode step's collectives are mostly Python overhead)
        self._slots = (self._data[0], self._data[1])
        self._own = (self._data[0, self.rank], self._data[1, self.rank])

    # ---- the shared-memory exchange ---------------------------------------------------------
    def _fits(self, x: torch.Tensor) -> bool:
        return self._data is not None and x.device.type == "cpu" and x.numel() * x.element_size() <= self.slot_bytes

    def _publish(self, x: torch.Tensor) -> torch.Tensor:
        """Write ``x`` into this rank's slot, wait for every rank's; their bytes, as one
        [C, nbytes] uint8 view of the segment (row r: rank r's ``x``), valid until the next
        operation but one."""
        self.seq += 1
        self.shm_ops += 1
        raw = _bytes(x)
        nbytes = raw.numel()
        parity = self.seq % 2
        self._own[parity][:nbytes].copy_(raw)
        flags, seq = self._flags, self.seq
        flags[self.rank * _LINE // 8] = seq  # x86 keeps stores in order: the data is visible first
        for peer in range(self.world):
            if peer != self.rank:
                self._wait(peer, seq)
        return self._slots[parity][:, :nbytes]

    def _wait(self, peer: int, seq: int) -> None:
        flags, at = self._flags, peer * _LINE // 8
        spins = 0
        while flags[at] < seq:
            spins += 1
            if spins < _SPIN:
                continue
            if spins == _SPIN:
                start = time.monotonic()
            waited = time.monotonic() - start
            if waited > self.timeout_s:
                raise RuntimeError(f"collective: rank {peer} did not arrive within {self.timeout_s:g} s")
            if waited < _YIELD_S:
                os.sched_yield()
            else:
                time.sleep(_SLEEP_S)

    @staticmethod
    def _sum(parts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Sum of the rows of ``parts`` [C, n] (bytes of ``dtype``) in row order, in fp32."""
        parts = parts.view(dtype) if parts.dtype != dtype else parts
        acc = parts[0].to(torch.float32, copy=True)
        for r in range(1, parts.shape[0]):
            acc += parts[r]
        return acc if dtype == torch.float32 else acc.to(dtype)

    # ---- the collectives --------------------------------------------------------------------
    def _via_group(self, x: torch.Tensor, collective, *args) -> bool:
        """Run ``collective(*args)`` on the process group when ``x`` does not fit a slot."""
        if self._fits(x):
            return False
        self.group_ops += 1
        collective(*args, group=self.group)
        return True

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place (and returned)."""
        if not self._via_group(x, dist.all_reduce, x):
            parts = self._publish(x).view(x.dtype)
            if x.dtype == torch.float32 and x.is_contiguous():  # summed straight into x, rank order
                flat = torch.add(parts[0], parts[1], out=x.view(-1))
                for r in range(2, self.world):
                    flat += parts[r]
            else:
                x.copy_(self._sum(parts, x.dtype).view(x.shape))
        return x

    def all_gather_single(self, out: torch.Tensor, x: torch.Tensor) -> None:
        """``out`` [C * n, ...] = every rank's ``x`` [n, ...], in rank order."""
        if not self._via_group(x, dist.all_gather_single, out, x):
            _out_bytes(out).view(self.world, -1).copy_(self._publish(x))

    def all_to_all_single(self, out: torch.Tensor, x: torch.Tensor) -> None:
        """Equal splits: chunk j of ``x`` goes to rank j; ``out``'s chunk i came from rank i."""
        if not self._via_group(x, dist.all_to_all_single, out, x):
            got = self._publish(x)
            if got.numel():
                _out_bytes(out).view(self.world, -1).copy_(got.view(self.world, self.world, -1)[:, self.rank])

    def reduce_scatter_single(self, out: torch.Tensor, x: torch.Tensor) -> None:
        """``out`` = the sum over ranks of chunk ``rank`` of their ``x`` [C * n, ...]."""
        if not self._via_group(x, dist.reduce_scatter_single, out, x):
            got = self._publish(x)
            if got.numel():
                mine = got.view(self.world, self.world, -1)[:, self.rank]
                out.copy_(self._sum(mine, out.dtype).view(out.shape))


def _bytes(x: torch.Tensor) -> torch.Tensor:
    """The bytes of contiguous ``x``, as a flat uint8 view (a copy if ``x`` is not contiguous)."""
    return x.contiguous().view(-1).view(torch.uint8)


def _out_bytes(out: torch.Tensor) -> torch.Tensor:
    """The bytes of an output tensor, as a flat uint8 view (it must be contiguous: written in place)."""
    return out.view(-1).view(torch.uint8)
