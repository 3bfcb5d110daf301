"""KV transport: one-sided writes of cache bytes from a prefill rank into a decode rank.

Store / cross / cost
--------------------
- **What one rank stores.** One transfer engine per rank process and the memory regions it has
  registered with it: a decode rank registers its KV pool (the destinations), a prefill rank
  registers a `StagingBuffer` (the source) into which it packs each destination rank's rows.
- **What crosses.** Raw bytes, as (local source address, remote destination address, length)
  ranges, written one-sided: the receiving rank's Python code takes no part; it learns that the
  bytes are there through the control plane (the prefill service's reply). The peer is addressed
  by its session name, ``"host:port"``, carried in the decode service's ``KvDestination``.
- **What it costs.** The KV bytes of the request, once: N tokens × (latent + index bytes per
  token, summed over layers). Measured over loopback TCP on a 2-core CPU machine (the test run of
  ``tests/test_transport.py``): a 64 MiB write of one range ≈ 1.0–1.75 GB/s (best of three,
  varying from run to run with machine load); a single 4 KiB write
  ≈ 45 µs, 1 MiB ≈ 0.55 ms, but 256 ranges of 4 KiB in one batch ≈ 12 ms — each range pays
  ~45 µs, which is why rows are packed into a staging buffer so that a batch has few, large
  ranges. RDMA (``protocol="rdma"``) is the cluster path and is much faster; it needs an RDMA NIC.

The Mooncake engine (measured with mooncake-transfer-engine-non-cuda 0.3.13.post1)
-------------------------------------------------------------------------------------
Ports. Each engine opens two listening TCP ports, both drawn at random from 15000–17000
(``MC_MIN_RPC_PORT`` / ``MC_MAX_RPC_PORT`` narrow the range, for firewalls and pod specs):
the handshake/RPC port, which is the port in `session_name` (``ss -ltnp``: ``0.0.0.0:PORT``),
and the TCP data port (``*:PORT``, IPv4 and IPv6). Both are bound on **all interfaces**
whatever ``host`` says; ``MC_TCP_BIND_ADDRESS`` changes only the address the engine advertises.
Where the machine has no LAN address (a loopback-only network namespace, as the tests use via
``scripts/run-tests.sh``), Mooncake's address discovery has been seen to fail without
``MC_TCP_BIND_ADDRESS``; so `MooncakeTransport` sets it to ``host`` when ``host`` is a loopback
address, unless the caller already set it. (With this version and an explicit ``127.0.0.1``,
initialise and write also worked without it in such a namespace.)

Failure behaviour, and what this module adds so that nothing fails silently:

- Every failure of a write is a negative return code (Mooncake logs the detailed reason to
  stderr); `write_batch` turns it into `TransferError` naming the peer.
- Write outside the peer's registered memory: refused within milliseconds; the whole batch
  reports failure (treat every destination range of that batch as undefined).
- Peer that has exited: fails at once (connection refused); after a few failures each further
  write to it waits ~1 s (reconnect back-off) before failing.
- Peer that is alive but not responding (e.g. stopped): a write on an established connection
  blocks until ``MC_TCP_PROGRESS_TIMEOUT_SEC`` (default 30 s, read at each write) passes with no
  progress; the first contact with such a peer blocks ~60 s in the handshake (not adjustable).
  Even a 4 KiB write blocks there, far below what socket buffers absorb: with this version a
  TCP write completes only when the peer has acknowledged the bytes into its memory, which is
  what lets the decode side read the rows as soon as the prefill reply arrives. (Newer
  Mooncake sources complete a TCP write on the local send; `tests/test_transport.py` checks
  this property so that an upgrade cannot drop it silently.)
  The calls release the GIL, so other threads keep running. Mooncake drops the connection
  itself on timeout; abandoning a write from Python instead would let a late write land in
  rows the peer may have reused, so this module does not put its own watchdog around it.
- Source memory: the TCP engine does not check that source ranges are registered (the write
  succeeds) but RDMA requires it, so `write_batch` checks locally and refuses unregistered
  sources on every protocol.
- ``initialize`` accepts any protocol string and, with ``"rdma"`` but no RDMA device, returns
  success and silently moves bytes over TCP; the constructor therefore accepts only ``"tcp"``
  and ``"rdma"`` and refuses ``"rdma"`` when the engine sees no RDMA device.
- Calling the engine before ``initialize`` crashes the process (segfault); the constructor
  always initialises and every method refuses to run after `close`.
"""

from __future__ import annotations

import abc
import bisect
import collections
import ipaddress
import json
import os
import threading

import torch

from engine.faults import faults
from engine.handoff import KVTransferError, TransferError

__all__ = [
    "KVTransferError",
    "TransferError",
    "TransportUnavailableError",
    "KVTransport",
    "MooncakeTransport",
    "StagingBuffer",
    "WriteStream",
]

PROTOCOLS = ("tcp", "rdma")

_INSTALL_HINT = (
    "the Mooncake transfer engine is not importable ({error}). Install it with "
    "`pip install mooncake-transfer-engine-non-cuda==0.3.13.post1` (the plain "
    "`mooncake-transfer-engine` wheel needs CUDA) and the Debian RDMA libraries it loads: "
    "`apt-get install libibverbs1 libnl-3-200 libnl-route-3-200` (`make sysdeps` does both)"
)


MAX_RANGES_PER_BATCH = 1024
# Ranges in flight to one peer at once (Mooncake's TCP queue holds ~2048; see `WriteStream`).
MAX_OUTSTANDING_RANGES = 1536


class TransportUnavailableError(KVTransferError):
    """The transport's library cannot be imported on this machine."""


class KVTransport(abc.ABC):
    """Moves bytes from this process's registered memory into a peer's registered memory.

    Contract: a peer can write into a region only after this side `register`-ed it, and only
    until it is `unregister`-ed; `write_batch` returns once every range has landed in the
    peer's memory, or raises `TransferError`. One transport per rank process; its methods
    may be called from several threads, but a region must not be unregistered (nor the
    transport closed) while a write from or into it is in flight.
    """

    @property
    @abc.abstractmethod
    def session_name(self) -> str:
        """What a peer passes as ``peer_session`` to write into this engine's memory."""

    @abc.abstractmethod
    def register(self, ptr: int, nbytes: int) -> None:
        """Make ``[ptr, ptr + nbytes)`` readable by local writes and writable by peers."""

    @abc.abstractmethod
    def unregister(self, ptr: int) -> None:
        """Withdraw the region that `register` was given at ``ptr`` (no-op once closed)."""

    @abc.abstractmethod
    def write_batch(
        self,
        peer_session: str,
        src_ptrs: list[int],
        dst_ptrs: list[int],
        lengths: list[int],
    ) -> None:
        """Copy ``lengths[i]`` bytes from local ``src_ptrs[i]`` to the peer's ``dst_ptrs[i]``."""

    @abc.abstractmethod
    def close(self, at_exit: bool = False) -> None:
        """Unregister everything and stop listening. Idempotent. ``at_exit``: the process ends
        right after, without the interpreter's teardown (a rank process, engine/parallel/group.py),
        so listeners may be left for the OS to close."""

    def __enter__(self) -> KVTransport:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


# Mooncake refuses ranges inside the kernel's default ephemeral block and silently falls back to
# 15000–17000; we refuse them loudly instead.
_EPHEMERAL = (32768, 60999)
PORT_RANGE_ENV = ("MC_MIN_RPC_PORT", "MC_MAX_RPC_PORT")


def parse_port_range(spec: str) -> tuple[int, int]:
    """``"LO-HI"`` → (lo, hi): the ports every Mooncake engine of this process draws its two
    listeners from. ValueError (naming ``kv_port_range``) unless 1024 <= lo < hi <= 65535 and
    the range avoids 32768–60999, which Mooncake would ignore."""
    lo_s, sep, hi_s = spec.partition("-")
    try:
        lo, hi = int(lo_s), int(hi_s)
    except ValueError:
        lo = hi = -1
    if not sep or not 1024 <= lo < hi <= 65535:
        raise ValueError(f"kv_port_range: {spec!r} is not LO-HI with 1024 <= LO < HI <= 65535 (each engine "
                         "takes two ports)")
    if lo <= _EPHEMERAL[1] and hi >= _EPHEMERAL[0]:
        raise ValueError(f"kv_port_range: {spec!r} overlaps {_EPHEMERAL[0]}-{_EPHEMERAL[1]}, which Mooncake "
                         "refuses (it would fall back to 15000-17000)")
    return lo, hi


def use_port_range(spec: str) -> None:
    """Confine the Mooncake engines this process and its children create to ``spec``'s ports.
    Mooncake reads the range once per process, so call it before the first engine (the rank
    processes a service spawns inherit it)."""
    lo, hi = parse_port_range(spec)
    os.environ[PORT_RANGE_ENV[0]], os.environ[PORT_RANGE_ENV[1]] = str(lo), str(hi)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


_ENDING_WITH_PROCESS: list = []  # engines closed with at_exit=True (see MooncakeTransport.close)


class MooncakeTransport(KVTransport):
    """`KVTransport` on Mooncake's TransferEngine with peer-to-peer handshake (no metadata
    server): a peer is found from its session name alone. See the module docstring for the
    ports it opens and how it fails."""

    def __init__(self, host: str = "127.0.0.1", protocol: str = "tcp", device_name: str = ""):
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:
            raise TransportUnavailableError(_INSTALL_HINT.format(error=exc)) from exc
        if _is_loopback(host):
            os.environ.setdefault("MC_TCP_BIND_ADDRESS", host)

        engine = TransferEngine()
        rc = engine.initialize(host, "P2PHANDSHAKE", protocol, device_name)
        if rc != 0:
            raise TransferError(
                host, f"initialize({protocol!r}, device {device_name!r}) returned {rc}")
        port = engine.get_rpc_port()
        if port <= 0:
            raise TransferError(host, f"engine has no handshake port (got {port})")
        if protocol == "rdma" and not _has_rdma_device(engine):
            del engine  # so the traceback does not keep its listeners open
            raise TransferError(
                host, "protocol 'rdma' requested but the engine found no RDMA device "
                "(it would silently fall back to TCP)")

        self._engine = engine
        self._session = f"{host}:{port}"
        self._lock = threading.Lock()
        self._starts: list[int] = []  # sorted start addresses of registered regions
        self._sizes: dict[int, int] = {}  # start address -> size in bytes

    @property
    def session_name(self) -> str:
        return self._session

    def register(self, ptr: int, nbytes: int) -> None:
        if nbytes <= 0:
            raise ValueError(f"nbytes must be positive, got {nbytes}")
        with self._lock:
            rc = self._open_engine().register_memory(ptr, nbytes)
            if rc != 0:
                raise TransferError(
                    self._session,
                    f"register_memory({ptr:#x}, {nbytes}) returned {rc} "
                    "(overlaps a registered region, or cannot be registered)")
            bisect.insort(self._starts, ptr)
            self._sizes[ptr] = nbytes

    def unregister(self, ptr: int) -> None:
        with self._lock:
            if self._engine is None:
                return  # close() has already unregistered everything
            if ptr not in self._sizes:
                raise TransferError(self._session, f"unregister({ptr:#x}): no region starts there")
            rc = self._engine.unregister_memory(ptr)
            self._starts.remove(ptr)
            del self._sizes[ptr]
            if rc != 0:
                raise TransferError(self._session, f"unregister_memory({ptr:#x}) returned {rc}")

    def write_batch(
        self,
        peer_session: str,
        src_ptrs: list[int],
        dst_ptrs: list[int],
        lengths: list[int],
    ) -> None:
        if not len(src_ptrs) == len(dst_ptrs) == len(lengths):
            raise ValueError(
                f"src_ptrs, dst_ptrs and lengths differ in length: "
                f"{len(src_ptrs)}, {len(dst_ptrs)}, {len(lengths)}")
        self._open_engine()
        if not lengths:
            return
        stream = self.stream(peer_session)  # never flushes early: one synchronous write
        for src, length in zip(src_ptrs, lengths):  # all checked before any is written
            stream.check(src, length)
        for src, dst, length in zip(src_ptrs, dst_ptrs, lengths):
            stream.queue(src, dst, length)
        stream.finish()

    def stream(self, peer_session: str, flush_bytes: int | None = None) -> WriteStream:
        """Ranges to ``peer_session`` that go on the wire while the caller adds more (see
        `WriteStream`); ``flush_bytes=None``: nothing goes before `WriteStream.finish`."""
        return WriteStream(self, peer_session, flush_bytes)

    def _write_sync(self, peer_session: str, srcs: list[int], dsts: list[int], lens: list[int]) -> None:
        engine = self._open_engine()
        # Mooncake's TCP transport refuses (rc -1) batches over ~2048 ranges to one peer
        # (MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER), so long batches go in slices.
        for i in range(0, len(lens), MAX_RANGES_PER_BATCH):
            part = slice(i, i + MAX_RANGES_PER_BATCH)
            rc = engine.batch_transfer_sync_write(peer_session, srcs[part], dsts[part], lens[part])
            if rc < 0:
                raise _write_error(peer_session, lens[part], rc)

    def close(self, at_exit: bool = False) -> None:
        with self._lock:
            engine, self._engine = self._engine, None
            if engine is None:
                return
            for ptr in self._starts:
                engine.unregister_memory(ptr)
            self._starts.clear()
            self._sizes.clear()
        # Dropping the last reference stops the engine's listeners (takes about a second).
        # Methods never hold the engine in a local across a raise, so no traceback keeps it.
        # A process about to exit keeps it instead: the exit closes its sockets at once.
        if at_exit:
            _ENDING_WITH_PROCESS.append(engine)
        del engine

    def _open_engine(self):
        if self._engine is None:
            raise TransferError(self._session, "transport is closed")
        return self._engine

    def _is_registered(self, ptr: int, nbytes: int) -> bool:
        i = bisect.bisect_right(self._starts, ptr) - 1
        if i < 0:
            return False
        start = self._starts[i]
        return ptr + nbytes <= start + self._sizes[start]


def _write_error(peer_session: str, lens: list[int], rc: int) -> TransferError:
    return TransferError(
        peer_session,
        f"write of {len(lens)} range(s), {sum(lens)} bytes, returned {rc}: the peer is unreachable, gone or "
        "not responding, or a destination range lies outside its registered memory (Mooncake's log names which)")


class WriteStream:
    """Ranges to one peer that go on the wire while the caller is still adding (packing) more.

    `add` queues a range; once ``flush_bytes`` have queued they are submitted as an asynchronous
    batch (Mooncake's ``batch_transfer_async_write``) and `add` returns at once, so the next
    rows pack while these move. `finish` submits the rest and returns when every range has
    landed, or raises `TransferError` once every submitted batch has ended (landed or failed):
    the caller may reuse its source memory after `finish` or `abort`, never before.
    A stream that never flushed writes synchronously in `finish` (as `write_batch` does).

    At most ``MAX_OUTSTANDING_RANGES`` ranges are in flight to the peer: Mooncake's TCP
    transport rejects more than ~2048 queued transfers to one peer, and a rejected batch
    stalls the next ~30 s of writes to it. A batch that fails stops further submissions; the
    rest of the stream's ranges are dropped (the whole write has failed anyway).

    Injected faults (engine/faults.py) are decided once per stream, as they were once per
    batch: such a stream writes the first half of every batch it would send, then fails.
    """

    def __init__(self, transport: MooncakeTransport, peer_session: str, flush_bytes: int | None):
        self.transport, self.peer = transport, peer_session
        self.flush_bytes = flush_bytes
        self.ranges = 0
        self._pending: tuple[list[int], list[int], list[int]] = ([], [], [])
        self._pending_bytes = 0
        self._inflight: collections.deque[tuple[int, list[int]]] = collections.deque()
        self._outstanding = 0
        self._submitted = False
        self._error: TransferError | None = None
        self._injected = faults().write_fails()
        self._written = 0

    @property
    def failed(self) -> bool:
        return self._error is not None

    def check(self, src: int, length: int) -> None:
        if length <= 0:
            raise ValueError(f"every length must be positive, got {length}")
        with self.transport._lock:
            if not self.transport._is_registered(src, length):
                raise TransferError(
                    self.peer, f"source range [{src:#x}, +{length}) is not inside memory registered "
                               f"with this engine ({self.transport.session_name})")

    def add(self, src: int, dst: int, length: int) -> None:
        """Queue one range (its source checked first); may submit what is queued."""
        self.check(src, length)
        self.queue(src, dst, length)

    def queue(self, src: int, dst: int, length: int) -> None:
        """`add` without the source check (the caller has checked)."""
        self.ranges += 1
        if self._error is not None:
            return
        srcs, dsts, lens = self._pending
        srcs.append(src)
        dsts.append(dst)
        lens.append(length)
        self._pending_bytes += length
        if self.flush_bytes is not None and self._pending_bytes >= self.flush_bytes:
            self._submit()

    def _take(self) -> tuple[list[int], list[int], list[int]]:
        srcs, dsts, lens = self._pending
        self._pending, self._pending_bytes = ([], [], []), 0
        if self._injected:  # half of every batch lands, then the stream fails
            half = len(lens) // 2
            srcs, dsts, lens = srcs[:half], dsts[:half], lens[:half]
        self._written += len(lens)
        return srcs, dsts, lens

    def _submit(self) -> None:
        srcs, dsts, lens = self._take()
        engine = self.transport._open_engine()
        self._submitted = True
        for i in range(0, len(lens), MAX_RANGES_PER_BATCH):
            part = slice(i, i + MAX_RANGES_PER_BATCH)
            n = len(lens[part])
            while self._inflight and self._outstanding + n > MAX_OUTSTANDING_RANGES:
                self._wait_oldest()
            if self._error is not None:
                return
            batch = engine.batch_transfer_async_write(self.peer, srcs[part], dsts[part], lens[part])
            if batch <= 0:  # the submission itself failed (peer unknown, queue full)
                self._error = _write_error(self.peer, lens[part], batch)
                return
            self._inflight.append((batch, lens[part]))
            self._outstanding += n

    def _wait_oldest(self) -> None:
        batch, lens = self._inflight.popleft()
        self._outstanding -= len(lens)
        rc = self.transport._open_engine().get_batch_transfer_status([batch])
        if rc < 0 and self._error is None:
            self._error = _write_error(self.peer, lens, rc)

    def finish(self) -> None:
        """Write what is queued and wait for every batch; raises the stream's first failure."""
        try:
            if self._error is None and self._pending[2]:
                if self._submitted:
                    self._submit()
                else:
                    self.transport._write_sync(self.peer, *self._take())
        finally:
            self.abort()
        if self._error is not None:
            raise self._error
        if self._injected:
            raise TransferError(self.peer, f"injected write failure ({self.ranges} ranges, {self._written} written)")

    def abort(self) -> None:
        """Wait until no batch of this stream is in flight (their failures are kept, not raised)."""
        while self._inflight:
            self._wait_oldest()


def _has_rdma_device(engine) -> bool:
    """True if the engine's topology lists at least one RDMA NIC (HCA)."""
    topology = json.loads(engine.get_local_topology())
    return any(hcas for entry in topology.values() for hcas in entry)


class StagingBuffer:
    """A reusable CPU byte buffer registered with a transport, the source of `write_batch`.

    Callers pack the rows bound for one destination rank into consecutive bytes (`pack`, or
    write into `view`) and then write the packed run with one range. Pinned (page-locked) when
    a CUDA device exists, so device-to-host copies into it are fast; pageable otherwise. The
    buffer is not synchronised: one writer packs and sends at a time.
    """

    def __init__(self, transport: KVTransport, nbytes: int):
        if nbytes <= 0:
            raise ValueError(f"nbytes must be positive, got {nbytes}")
        self.tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=_can_pin())
        self._transport: KVTransport | None = transport
        transport.register(self.ptr, nbytes)

    @property
    def ptr(self) -> int:
        return self.tensor.data_ptr()

    @property
    def nbytes(self) -> int:
        return self.tensor.numel()

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        """The bytes ``[offset, offset + nbytes)`` as a uint8 tensor sharing this memory."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.nbytes:
            raise IndexError(
                f"range [{offset}, {offset + nbytes}) outside the {self.nbytes}-byte buffer")
        return self.tensor[offset:offset + nbytes]

    def pack(self, offset: int, src: torch.Tensor) -> int:
        """Copy ``src``'s bytes to ``offset``; returns the offset just past them."""
        flat = src.detach().contiguous().reshape(-1).view(torch.uint8)
        self.view(offset, flat.numel()).copy_(flat)
        return offset + flat.numel()

    def gather(self, offset: int, pool: torch.Tensor, rows: torch.Tensor) -> int:
        """Copy rows ``rows`` of the 2-D ``pool`` to ``offset``, one after another, in one pass
        (no temporary); returns the offset just past them."""
        nbytes = rows.numel() * pool.shape[1] * pool.element_size()
        if offset % pool.element_size():  # not aligned for the pool's type: through a temporary
            return self.pack(offset, pool.index_select(0, rows))
        out = self.view(offset, nbytes).view(pool.dtype).view(rows.numel(), pool.shape[1])
        torch.index_select(pool, 0, rows, out=out)
        return offset + nbytes

    def close(self) -> None:
        """Unregister the buffer. Idempotent."""
        transport, self._transport = self._transport, None
        if transport is not None:
            transport.unregister(self.ptr)

    def __enter__(self) -> StagingBuffer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _can_pin() -> bool:
    return torch.cuda.is_available()
