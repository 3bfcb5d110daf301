"""Collectives and point-to-point messages of one rank group, with a shared-memory path for
small CPU messages.

Every collective and point-to-point call of a rank's code goes through :class:`Comm` (the
prefill CP all-gather and layer-split broadcast, the expert all-to-alls, the DCP exchange, a
ring's sends and receives), so what runs underneath can change here alone;
tests/test_comm_seam.py fails on a ``torch.distributed`` collective called anywhere else.

Every rank of a :class:`~engine.parallel.group.WorkerGroup` is a process on the same host, and a
decode step sends a handful of small messages per layer (the DCP exchange, the tensor-parallel
and MoE all-reduces: kilobytes at batch 1, a few hundred KB at batch 32). Through gloo over
loopback each cost about 1 ms of waiting on a 2-core machine (its worker thread, TCP,
wake-ups), most of a DCP step; through shared memory 0.10–0.15 ms inside a decode step, most of
it waiting for the later rank (``bench/decode_dcp.py``, docs/benchmarks.md). The operation itself
(both ranks arriving together) is 6–11 µs for 1 KiB: at batch 1 its tensor ops' dispatch, not
the bytes, is the cost, so each rank keeps its slot views per message shape and an operation is
one copy in, the flag, and one copy (or sum) out (``bench/decode_dcp.py --quick`` prints it).
:class:`Comm` runs them through a shared-memory segment:

- one segment per group, created by rank 0 under ``/dev/shm`` and unlinked as soon as every
  rank has mapped it (nothing is left behind, even after a SIGKILL);
- per rank a sequence counter on its own cache line and two data slots of ``slot_bytes``
  (double-buffered by the sequence's parity: the writer of operation s + 2 has waited for
  every rank to arrive at s + 1, so they have all finished reading s);
- an operation: copy this rank's tensor into its slot, publish the sequence number, wait until
  every rank has published it, read the others' slots.

Each rank then reduces in rank order 0, 1, …, C − 1 (in fp32), so every rank gets the same bits;
a broadcast is the same exchange in which only the source writes its slot.
Messages larger than a slot, non-CPU tensors, non-x86 hosts (whose memory order would need
fences that Python cannot issue) and a segment that cannot be made (no /dev/shm) go through
the process group as before. All ranks take the same path for one operation: it depends on
the sizes, which are equal on every rank for these collectives. The uneven all-to-all and the
point-to-point messages always use the process group: a rank knows only its own splits (the
ranks could not agree on a path without one more exchange), and a send has no "every rank".

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
_STRIDE = _LINE // 8  # the same, in int64 counters
_SPIN, _YIELD_S, _SLEEP_S = 2000, 0.005, 50e-6
SHM_DIR = "/dev/shm"
_MAX_VIEWS = 4096  # cached slot views (Comm._views)


def shm_supported(device: torch.device) -> bool:
    return device.type == "cpu" and platform.machine().lower() in ("x86_64", "amd64") and os.path.isdir(SHM_DIR)


class Comm:
    """all_reduce / all_gather_single / all_to_all_single / reduce_scatter_single / broadcast,
    the uneven all_to_all and isend / irecv with the semantics of torch.distributed's (sum;
    ranks are ``group``'s), on ``group``; sendrecv is one step of a ring.

    ``shm_ops`` / ``group_ops`` count the operations each path ran (a send or a receive is one
    group operation); ``p2p_bytes`` the bytes this rank has sent with isend."""

    def __init__(self, rank: int, world: int, group, device: torch.device, name: str, timeout_s: float = 300.0,
                 slot_bytes: int = SLOT_BYTES):
        self.rank, self.world, self.group, self.timeout_s = rank, world, group, timeout_s
        self.slot_bytes = slot_bytes
        self.seq = 0
        self.shm_ops = self.group_ops = 0  # how many of each ran (tests, diagnostics)
        self.p2p_bytes = 0
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
        self._slots = (self._data[0], self._data[1])  # per buffer: every rank's slot [C, slot_bytes]
        self._cache: dict = {}  # _views, per (buffer, dtype, numel)

    # ---- the shared-memory exchange ---------------------------------------------------------
    def _fits(self, x: torch.Tensor) -> bool:
        return self._data is not None and x.device.type == "cpu" and x.numel() * x.element_size() <= self.slot_bytes

    def _views(self, parity: int, dtype: torch.dtype, numel: int) -> tuple:
        """(this rank's slot, every rank's slots [C, numel], each rank's slot) of buffer
        ``parity`` as ``numel`` elements of ``dtype``: made once per message shape, since at
        batch 1 a collective's cost is its tensor ops, not its bytes."""
        key = (parity, dtype, numel)
        views = self._cache.get(key)
        if views is None:
            if len(self._cache) >= _MAX_VIEWS:  # many batch sizes over a long run: start afresh
                self._cache.clear()
            nbytes = numel * torch.empty(0, dtype=dtype).element_size()
            every = self._slots[parity][:, :nbytes].view(dtype)
            views = self._cache[key] = (every[self.rank], every, tuple(every[r] for r in range(self.world)))
        return views

    def _publish(self, x: torch.Tensor, write: bool = True) -> tuple:
        """Write ``x`` into this rank's slot (unless ``write`` is false: the slot is left as it
        is, only the arrival is published), wait for every rank's; the slots as ``_views``
        gives them (row r: rank r's ``x``), valid until the next operation but one."""
        self.seq += 1
        self.shm_ops += 1
        seq = self.seq
        views = self._views(seq % 2, x.dtype, x.numel())
        if write:
            views[0].copy_(x.reshape(-1))
        flags = self._flags
        flags[self.rank * _STRIDE] = seq  # x86 keeps stores in order: the data is visible first
        for peer in range(self.world):
            if peer != self.rank and flags[peer * _STRIDE] < seq:
                self._wait(peer, seq)
        return views

    def _wait(self, peer: int, seq: int) -> None:
        flags, at = self._flags, peer * _STRIDE
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
    def _sum(parts: tuple, out: torch.Tensor) -> None:
        """``out`` (flat) = the sum of ``parts`` (flat), in rank order: floating point in fp32,
        integers in their own type."""
        if out.dtype == torch.float32 or not out.dtype.is_floating_point:  # summed straight into out
            torch.add(parts[0], parts[1], out=out)
            for part in parts[2:]:
                out += part
            return
        acc = parts[0].to(torch.float32, copy=True)
        for part in parts[1:]:
            acc += part
        out.copy_(acc)

    # ---- the collectives --------------------------------------------------------------------
    def _via_group(self, x: torch.Tensor, collective, *args, **kwargs) -> bool:
        """Run ``collective(*args, **kwargs)`` on the process group when ``x`` does not fit a slot."""
        if self._fits(x):
            return False
        self.group_ops += 1
        collective(*args, group=self.group, **kwargs)
        return True

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place (and returned)."""
        if not self._via_group(x, dist.all_reduce, x):
            if x.is_contiguous():
                self._sum(self._publish(x)[2], x.view(-1))
            else:
                flat = torch.empty(x.numel(), dtype=x.dtype)
                self._sum(self._publish(x)[2], flat)
                x.copy_(flat.view(x.shape))
        return x

    def all_gather_single(self, out: torch.Tensor, x: torch.Tensor) -> None:
        """``out`` [C * n, ...] = every rank's ``x`` [n, ...], in rank order."""
        if not self._via_group(x, dist.all_gather_single, out, x):
            out.view(self.world, -1).copy_(self._publish(x)[1])

    def all_to_all_single(self, out: torch.Tensor, x: torch.Tensor) -> None:
        """Equal splits: chunk j of ``x`` goes to rank j; ``out``'s chunk i came from rank i."""
        if not self._via_group(x, dist.all_to_all_single, out, x):
            every = self._publish(x)[1]
            if x.numel():
                out.view(self.world, -1).copy_(every.view(self.world, self.world, -1)[:, self.rank])

    def reduce_scatter_single(self, out: torch.Tensor, x: torch.Tensor) -> None:
        """``out`` = the sum over ranks of chunk ``rank`` of their ``x`` [C * n, ...]."""
        if not self._via_group(x, dist.reduce_scatter_single, out, x):
            every = self._publish(x)[1]
            if x.numel():
                self._sum(tuple(every.view(self.world, self.world, -1)[:, self.rank]), out.view(-1))

    def broadcast(self, x: torch.Tensor, src: int) -> torch.Tensor:
        """``x`` = rank ``src``'s ``x`` on every rank, in place (and returned)."""
        if not self._via_group(x, dist.broadcast, x, group_src=src):
            views = self._publish(x, write=self.rank == src)
            if self.rank != src:
                x.copy_(views[2][src].view(x.shape))
        return x

    def all_to_all(self, out: torch.Tensor, x: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> None:
        """Uneven splits, as torch.distributed.all_to_all_single's output_split_sizes /
        input_split_sizes: the ``in_splits[j]`` rows of ``x`` after the first
        ``sum(in_splits[:j])`` go to rank j; ``out``'s ``out_splits[i]`` rows (in the same
        order) came from rank i. Always through the process group (see the module docstring)."""
        self.group_ops += 1
        dist.all_to_all_single(out, x, out_splits, in_splits, group=self.group)

    # ---- point to point (the process group) -------------------------------------------------
    def isend(self, x: torch.Tensor, dst: int):
        """Start sending ``x`` to rank ``dst``; the returned handle's ``wait()`` returns once
        ``x`` may be changed again."""
        self.group_ops += 1
        self.p2p_bytes += x.numel() * x.element_size()
        return dist.isend(x, group=self.group, group_dst=dst)

    def irecv(self, out: torch.Tensor, src: int):
        """Start receiving rank ``src``'s message into ``out``; it is there once the returned
        handle's ``wait()`` returns."""
        self.group_ops += 1
        return dist.irecv(out, group=self.group, group_src=src)

    def sendrecv(self, x: torch.Tensor, dst: int, out: torch.Tensor, src: int) -> None:
        """One ring step: send ``x`` to ``dst`` and receive ``src``'s into ``out``. Both are
        posted before either is waited on, so every rank may call it at once (each sending to
        rank + 1 and receiving from rank − 1) without a deadlock. A ring of one copies."""
        if dst == self.rank and src == self.rank:
            out.copy_(x)
            return
        works = [self.irecv(out, src), self.isend(x, dst)]
        for work in works:
            work.wait()
