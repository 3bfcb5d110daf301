"""kvtransfer.transport: real Mooncake engines in two processes talking over 127.0.0.1."""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time

import pytest
import torch

from kvtransfer.transport import (
    KVTransferError,
    KVTransport,
    MooncakeTransport,
    StagingBuffer,
    TransferError,
    TransportUnavailableError,
)

try:
    import mooncake.engine  # noqa: F401
    _MOONCAKE_ERROR = ""
except ImportError as exc:  # only a missing or unloadable package skips; CI installs it
    _MOONCAKE_ERROR = str(exc)

needs_mooncake = pytest.mark.skipif(
    bool(_MOONCAKE_ERROR),
    reason=f"mooncake.engine does not import ({_MOONCAKE_ERROR}); run `make setup`")

pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20


# ---------------------------------------------------------------- peer process

def _peer_main(conn, nbytes: int) -> None:
    """A decode-side stand-in: registers a zeroed buffer and answers digest requests."""
    transport = MooncakeTransport("127.0.0.1")
    buffer = StagingBuffer(transport, nbytes)
    buffer.tensor.zero_()
    conn.send((transport.session_name, buffer.ptr))
    while (command := conn.recv()) != "exit":
        assert command == "digest", command
        conn.send(hashlib.sha256(buffer.tensor.numpy()).hexdigest())
    buffer.close()
    transport.close()


class Peer:
    """A spawned process holding a registered buffer of ``nbytes`` at ``ptr``."""

    def __init__(self, nbytes: int):
        ctx = multiprocessing.get_context("spawn")
        self.nbytes = nbytes
        self._conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(target=_peer_main, args=(child_conn, nbytes), daemon=True)
        self.process.start()
        child_conn.close()
        self.session, self.ptr = self._request(None)

    def digest(self) -> str:
        return self._request("digest")

    def stop(self) -> None:
        self._conn.send("exit")
        self.process.join(15)
        assert self.process.exitcode == 0, f"peer exited with {self.process.exitcode}"

    def kill(self) -> None:
        if self.process.is_alive():
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(15)

    def _request(self, command):
        if command is not None:
            self._conn.send(command)
        if not self._conn.poll(30):
            raise TimeoutError(f"peer gave no answer to {command!r} within 30 s")
        return self._conn.recv()


@pytest.fixture
def peer_factory():
    peers: list[Peer] = []

    def make(nbytes: int) -> Peer:
        peers.append(Peer(nbytes))
        return peers[-1]

    yield make
    for peer in peers:
        peer.kill()


@pytest.fixture(scope="module")
def transport():
    if _MOONCAKE_ERROR:
        pytest.skip(f"mooncake.engine does not import ({_MOONCAKE_ERROR})")
    with MooncakeTransport("127.0.0.1") as t:
        yield t


@pytest.fixture(scope="module")
def source(transport):
    """64 MiB of random bytes registered with the parent's transport."""
    with StagingBuffer(transport, 64 * MiB) as buffer:
        generator = torch.Generator().manual_seed(0)
        buffer.tensor.copy_(torch.randint(0, 256, (buffer.nbytes,), dtype=torch.uint8,
                                          generator=generator))
        yield buffer


def _digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.numpy()).hexdigest()


def _stop_process(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP ``pid`` and return once every one of its threads is stopped.

    ``kill`` only queues the signal: on a loaded machine the peer's transfer thread can still
    run (and acknowledge a write) for a moment after it returns, so a test that writes right
    away would race the stop.
    """
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:  # the thread exited meanwhile
                continue
        if states and all(state == "T" for state in states):
            return
        time.sleep(0.01)
    raise TimeoutError(f"process {pid} did not stop within {timeout} s")


def _call_with_deadline(fn, seconds: float):
    """Run ``fn`` in a thread; fail if it is still blocked after ``seconds``.

    Returns (exception or None, elapsed seconds). A blocked call is left behind in its daemon
    thread: there is no way to cancel a call inside Mooncake.
    """
    outcome: dict[str, BaseException] = {}

    def target():
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            outcome["error"] = exc

    start = time.monotonic()
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        pytest.fail(f"call still blocked after {seconds} s")
    return outcome.get("error"), time.monotonic() - start


# ---------------------------------------------------------------- writes that land

@needs_mooncake
def test_batch_of_ranges_lands_exactly(transport, source, peer_factory):
    peer = peer_factory(4 * MiB)
    # (src offset, dst offset, length): unaligned, adjacent, and one touching the end.
    ranges = [(0, 0, 4096), (12_345, 4096, 100_000), (7, 2 * MiB + 3, 1),
              (5 * MiB, 4 * MiB - 65_536, 65_536), (1_000_001, 3 * MiB, 777_777)]
    transport.write_batch(peer.session,
                          [source.ptr + s for s, _, _ in ranges],
                          [peer.ptr + d for _, d, _ in ranges],
                          [n for _, _, n in ranges])

    expected = torch.zeros(peer.nbytes, dtype=torch.uint8)
    for s, d, n in ranges:
        expected[d:d + n] = source.tensor[s:s + n]
    assert peer.digest() == _digest(expected)


@needs_mooncake
def test_64mib_write_lands_and_reports_throughput(transport, source, peer_factory, record_property):
    peer = peer_factory(source.nbytes)
    seconds = []
    for _ in range(3):
        start = time.perf_counter()
        transport.write_batch(peer.session, [source.ptr], [peer.ptr], [source.nbytes])
        seconds.append(time.perf_counter() - start)
    assert peer.digest() == _digest(source.tensor)
    gbps = source.nbytes / min(seconds) / 1e9
    record_property("loopback_gbps_64mib", round(gbps, 2))
    print(f"64 MiB loopback write: best {gbps:.2f} GB/s over {len(seconds)} tries")


# ---------------------------------------------------------------- writes that must fail loudly

@needs_mooncake
def test_write_outside_peer_memory_raises(transport, source, peer_factory):
    peer = peer_factory(MiB)
    for dst, length in [(peer.ptr + peer.nbytes - 10, 100), (peer.ptr + 16 * MiB, 4096)]:
        with pytest.raises(TransferError) as info:
            transport.write_batch(peer.session, [source.ptr], [dst], [length])
        assert info.value.peer == peer.session
        assert peer.session in str(info.value)
    # The failed writes leave the connection usable.
    transport.write_batch(peer.session, [source.ptr], [peer.ptr], [peer.nbytes])
    assert peer.digest() == _digest(source.tensor[:peer.nbytes])


@needs_mooncake
def test_write_to_exited_peer_raises_within_5s(transport, source, peer_factory):
    peer = peer_factory(MiB)
    transport.write_batch(peer.session, [source.ptr], [peer.ptr], [4096])  # connection is up
    peer.stop()
    for _ in range(3):  # the first failure, and the retries that meet Mooncake's back-off
        error, elapsed = _call_with_deadline(
            lambda: transport.write_batch(peer.session, [source.ptr], [peer.ptr], [4096]), 5)
        assert isinstance(error, TransferError), error
        assert error.peer == peer.session and peer.session in str(error)
        assert elapsed < 5


@needs_mooncake
def test_write_to_stopped_peer_fails_after_progress_timeout(transport, source, peer_factory,
                                                            monkeypatch):
    """A peer that is alive but silent (SIGSTOP) blocks a write until Mooncake's progress
    timeout, which it reads at each write; it then fails like any other write.

    The write is 4 KiB, far less than the socket buffers hold: it blocks only because the
    engine waits for the peer to acknowledge that the bytes are in its memory. That wait is the
    `KVTransport` contract the decode side relies on (it reads the rows as soon as the prefill
    reply comes); an engine version that completed writes on the local send would fail here.
    """
    monkeypatch.setenv("MC_TCP_PROGRESS_TIMEOUT_SEC", "2")
    peer = peer_factory(MiB)
    transport.write_batch(peer.session, [source.ptr], [peer.ptr], [4096])
    _stop_process(peer.process.pid)
    error, elapsed = _call_with_deadline(
        lambda: transport.write_batch(peer.session, [source.ptr], [peer.ptr], [4096]), 20)
    assert isinstance(error, TransferError), error
    assert error.peer == peer.session
    assert elapsed >= 1.5


@needs_mooncake
def test_write_to_unknown_peer_raises(transport, source):
    with socket.socket() as s:  # a port on which nothing listens
        s.bind(("127.0.0.1", 0))
        session = f"127.0.0.1:{s.getsockname()[1]}"
    error, _ = _call_with_deadline(
        lambda: transport.write_batch(session, [source.ptr], [0x10000], [4096]), 5)
    assert isinstance(error, TransferError) and error.peer == session


@needs_mooncake
def test_unregistered_source_is_refused_before_sending(transport, source):
    loose = torch.zeros(4096, dtype=torch.uint8)
    with pytest.raises(TransferError, match="not inside memory registered") as info:
        transport.write_batch("127.0.0.1:1", [loose.data_ptr()], [0x10000], [4096])
    assert info.value.peer == "127.0.0.1:1"
    with pytest.raises(TransferError, match="not inside memory registered"):  # runs past the end
        transport.write_batch("127.0.0.1:1", [source.ptr + source.nbytes - 8], [0x10000], [16])


@needs_mooncake
def test_bad_arguments_are_refused(transport, source):
    with pytest.raises(ValueError, match="differ in length"):
        transport.write_batch("127.0.0.1:1", [source.ptr], [0x10000, 0x20000], [8])
    with pytest.raises(ValueError, match="positive"):
        transport.write_batch("127.0.0.1:1", [source.ptr], [0x10000], [0])
    transport.write_batch("127.0.0.1:1", [], [], [])  # an empty batch is a no-op
    with pytest.raises(TransferError, match="register_memory"):  # overlaps the source buffer
        transport.register(source.ptr + 64, 64)
    with pytest.raises(TransferError, match="no region starts there"):
        transport.unregister(source.ptr + 64)


@needs_mooncake
def test_closed_transport_refuses_work():
    t = MooncakeTransport("127.0.0.1")
    assert t.session_name.startswith("127.0.0.1:")
    buffer = StagingBuffer(t, 4096)
    t.close()
    t.close()
    buffer.close()  # after close every region is already unregistered
    with pytest.raises(TransferError, match="closed"):
        t.write_batch("127.0.0.1:1", [buffer.ptr], [0x10000], [8])
    with pytest.raises(TransferError, match="closed"):
        t.register(buffer.ptr, 4096)


@needs_mooncake
@pytest.mark.skipif(os.path.exists("/sys/class/infiniband"), reason="this machine has RDMA devices")
def test_rdma_without_device_is_refused():
    with pytest.raises(TransferError, match="no RDMA device"):
        MooncakeTransport("127.0.0.1", protocol="rdma")


def test_unknown_protocol_is_refused():
    with pytest.raises(ValueError, match="protocol"):
        MooncakeTransport("127.0.0.1", protocol="udp")


def test_missing_mooncake_names_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)  # makes the import fail
    with pytest.raises(TransportUnavailableError) as info:
        MooncakeTransport()
    assert isinstance(info.value, KVTransferError)
    for needed in ("mooncake-transfer-engine-non-cuda", "libibverbs1", "libnl-3-200",
                   "libnl-route-3-200"):
        assert needed in str(info.value)


# ---------------------------------------------------------------- staging buffer

class _RecordingTransport(KVTransport):
    def __init__(self):
        self.regions: dict[int, int] = {}

    @property
    def session_name(self) -> str:
        return "recording"

    def register(self, ptr, nbytes):
        self.regions[ptr] = nbytes

    def unregister(self, ptr):
        del self.regions[ptr]

    def write_batch(self, peer_session, src_ptrs, dst_ptrs, lengths):
        raise NotImplementedError

    def close(self):
        self.regions.clear()


def test_staging_buffer_registers_packs_and_unregisters():
    t = _RecordingTransport()
    with StagingBuffer(t, 64) as buffer:
        assert t.regions == {buffer.ptr: 64}
        rows = torch.arange(6, dtype=torch.float32).reshape(2, 3)
        end = buffer.pack(8, rows)
        assert end == 8 + rows.numel() * 4
        assert torch.equal(buffer.view(8, end - 8).view(torch.float32).reshape(2, 3), rows)
        assert buffer.view(8, 4).data_ptr() == buffer.ptr + 8
        with pytest.raises(IndexError):
            buffer.view(60, 8)
        with pytest.raises(IndexError):
            buffer.pack(48, rows)
    assert t.regions == {}
    buffer.close()  # idempotent


def test_staging_buffer_gathers_rows_in_order_at_any_offset():
    """``gather`` writes pool[rows] straight into the buffer, aligned or not for the pool's type."""
    t = _RecordingTransport()
    pool = torch.randn(10, 3)
    rows = torch.tensor([7, 2, 2, 9])
    with StagingBuffer(t, 128) as buffer:
        for offset in (8, 5):  # float32-aligned, then not
            end = buffer.gather(offset, pool, rows)
            assert end == offset + 4 * 3 * 4
            got = buffer.view(offset, end - offset).clone().view(torch.float32).reshape(4, 3)
            assert torch.equal(got, pool[rows])
        fp8 = torch.randint(0, 255, (6, 5), dtype=torch.uint8)
        end = buffer.gather(3, fp8, torch.tensor([5, 0]))
        assert end == 13 and torch.equal(buffer.view(3, 10).reshape(2, 5), fp8[[5, 0]])
        with pytest.raises(IndexError):
            buffer.gather(120, pool, rows)


def _digest_after(ranges, peer, source) -> str:
    """The digest of the peer's zeroed buffer once every (source offset, peer offset, length)
    range has been copied into it, in order."""
    expected = torch.zeros(peer.nbytes, dtype=torch.uint8)
    for s_, d, k in ranges:
        expected[d:d + k] = source.tensor[s_:s_ + k]
    return _digest(expected)


@needs_mooncake
def test_a_batch_longer_than_mooncakes_per_peer_queue_lands_exactly(transport, source, peer_factory):
    """Mooncake's TCP transport refuses one batch of more than ~2048 ranges to a peer; the
    transport slices it (MAX_RANGES_PER_BATCH)."""
    peer = peer_factory(1 * MiB)
    n = 3000  # > 2048, < 1 MiB / 256
    ranges = [(i * 997 % (60 * MiB), i * 256, 200) for i in range(n)]
    transport.write_batch(peer.session, [source.ptr + s for s, _, _ in ranges],
                          [peer.ptr + d for _, d, _ in ranges], [k for _, _, k in ranges])
    assert peer.digest() == _digest_after(ranges, peer, source)


@needs_mooncake
def test_a_stream_lands_every_range_while_more_are_added(transport, source, peer_factory):
    """`WriteStream` submits batches as ranges are added (more ranges in all than Mooncake's
    per-peer queue holds, so it must wait for old batches before submitting new ones) and
    `finish` returns once all have landed."""
    from kvtransfer.transport import MAX_OUTSTANDING_RANGES

    peer = peer_factory(1 * MiB)
    n = 2 * MAX_OUTSTANDING_RANGES + 700
    ranges = [(i * 991 % (60 * MiB), i * 256, 200) for i in range(n)]
    stream = transport.stream(peer.session, flush_bytes=300 * 200)
    for s_, d, k in ranges:
        stream.add(source.ptr + s_, peer.ptr + d, k)
    stream.finish()
    assert stream.ranges == n
    assert peer.digest() == _digest_after(ranges, peer, source)


@needs_mooncake
def test_a_stream_with_a_failed_batch_raises_once_nothing_is_in_flight(transport, source, peer_factory):
    """A batch outside the peer's memory fails; the stream stops submitting, waits for what
    it had sent and raises, naming the peer."""
    peer = peer_factory(1 * MiB)
    stream = transport.stream(peer.session, flush_bytes=4096)
    for i in range(4):
        stream.add(source.ptr + i * 4096, peer.ptr + i * 4096, 4096)
    stream.add(source.ptr, peer.ptr + 2 * MiB, 4096)  # past the peer's buffer
    for i in range(4):
        stream.add(source.ptr + i * 4096, peer.ptr + i * 4096, 4096)
    with pytest.raises(TransferError) as info:
        stream.finish()
    assert peer.session in str(info.value)
    assert not stream._inflight and stream.failed
