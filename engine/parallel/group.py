"""Worker group: C rank processes in one ``torch.distributed`` group, driven by one driver.

Every parallel service (prefill CP, decode DCP) runs its model on a ``WorkerGroup``. The
*driver* (the process that hosts the gRPC server; in tests, pytest) is not a member of the
process group. It starts C rank processes, hosts their rendezvous store, and sends them
commands over one ``multiprocessing`` pipe per rank::

    driver ──pipe──▶ rank 0 ┐
           ──pipe──▶ rank 1 ├─ one process group (gloo on CPU; NCCL + a gloo control group on GPU)
           ──pipe──▶ ...    ┘

Synchronisation rule (everything collective relies on it):
    every rank receives the same sequence of ``call``\\ s, in the same order, and runs each to
    completion before it reads the next. The collectives inside a method therefore match
    across ranks, as long as the method itself issues the same collectives on every rank.
    ``call`` is serialised by a lock, so concurrent driver threads cannot interleave two
    sequences. ``call_rank`` reaches one rank only, so its methods must not use collectives.
    ``submit`` sends a call without waiting and ``collect`` takes its answers; nothing else is
    sent in between, so the ranks still see one sequence.

Failure rule: any rank that dies or raises fails the whole group. SPMD state cannot be repaired
(its peers may be blocked in a collective that will never complete), so the driver terminates
and then kills every rank — it never waits for them — marks the group dead and raises
``GroupError`` naming the failing rank. Every later call raises ``GroupError`` at once. Ranks
exit by themselves when the driver dies: a watchdog thread in each reads a pipe the driver never
writes to, which ends when the driver's process does, and ``PR_SET_PDEATHSIG`` ties them to the
rank server, which exits with the driver.

Start-up: ranks are forked from a *rank server* (multiprocessing's forkserver, one per driver
process, started on first use or early by ``start_rank_server``) that has imported torch and
the engine once, so a rank starts in milliseconds instead of importing torch afresh (~2 s of
CPU each, and C of them at once on a service's cores). A rank takes the driver's environment
as it is when the group starts, not the server's.

Rendezvous: the driver binds a listening socket to 127.0.0.1 itself and hands its fd to a
master ``TCPStore`` (torch's store would otherwise listen on every interface); ranks connect to
it as clients. ``GLOO_SOCKET_IFNAME=lo`` (unless already set) keeps gloo's own sockets on
loopback too.

The three questions, for the group itself:
    store — each rank holds its worker object (model shard, caches) and nothing else; the
        driver holds one pipe end and the process handle per rank, and the TCPStore.
    cross — per ``call``: the pickled (method, args, kwargs) to each of the C ranks, and one
        pickled result back from each, tensors by value (CPU tensors as raw bytes, see
        _reduce_tensor; no shared memory);
        nothing model-sized should travel this way (tensors between ranks go through the
        process group, KV bytes through the transfer engine).
    cost — one pipe round trip per rank per call (tens of µs for a small step plan) plus
        pickling; a call waits for the slowest rank.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import datetime
import importlib
import io
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.context
import multiprocessing.forkserver
import multiprocessing.util
import os
import pickle
import select
import signal
import socket
import sys
import threading
import time
import traceback
import typing
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

_LOOPBACK = "127.0.0.1"
# A directory: every rank runs its calls under cProfile and writes rank<r>-<pid>.prof there at exit.
PROFILE_ENV = "CPSERVE_RANK_PROFILE"

MAX_SUBMITTED = 2  # calls submitted ahead of collection (a decode step in flight + the next, planned ahead)
_POLL_S = 0.2  # wait granularity: how late a deadline or a concurrent shutdown is noticed
_DEATH_GRACE_S = 0.25  # after an exception report, how long to look for a dead rank to blame
_KILL_GRACE_S = 1.0  # SIGTERM → SIGKILL


def _rebuild_tensor(raw: bytes, dtype, shape: tuple) -> Any:
    import torch

    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)


def _reduce_tensor(obj):
    """Pickle a plain CPU tensor as its raw bytes. torch's own reduction writes each tensor's
    storage as a torch.save archive (a view carries all of it) and reads it back with
    torch.load: a decode step's plan at 2k tokens took 0.28 ms to pickle and unpickle that way,
    0.03 ms this way (bench/decode_dcp.py --quick). Other tensors reduce as torch does."""
    import torch

    if obj.device.type == "cpu" and obj.layout == torch.strided and not obj.requires_grad and not obj.is_quantized:
        flat = obj.contiguous().reshape(-1)
        return _rebuild_tensor, (flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"",
                                 obj.dtype, tuple(obj.shape))
    return obj.__reduce_ex__(pickle.HIGHEST_PROTOCOL)


_DISPATCH: dict | None = None


def _dispatch_table() -> dict:
    """copyreg's table plus torch.Tensor (exact type: subclasses such as Parameter reduce as
    torch does). A table, not ``reducer_override``: that one is a Python call for every object
    pickled, this one a lookup in C."""
    global _DISPATCH
    if _DISPATCH is None:
        import copyreg

        import torch

        _DISPATCH = {**copyreg.dispatch_table, torch.Tensor: _reduce_tensor}
    return _DISPATCH


def dumps(obj: Any) -> bytes:
    """What crosses a group's pipes (read with plain pickle.loads)."""
    buf = io.BytesIO()
    pickler = pickle.Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.dispatch_table = _dispatch_table()
    pickler.dump(obj)
    return buf.getvalue()


def readable(fds: list[int], timeout_s: float | None) -> set[int]:
    """Which of ``fds`` are readable or hung up within ``timeout_s`` (None: no limit): one
    poll(2). (What multiprocessing.connection.wait does, without the selector object it builds
    each call: a decode step's collect is one or two of these.)"""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    return {fd for fd, _ in poller.poll(None if timeout_s is None else timeout_s * 1e3)}


class GroupError(RuntimeError):
    """The worker group failed (or was shut down); it is dead and every later call raises.

    ``rank`` is the failing rank, or ``None`` when no single rank is to blame (shut down,
    start-up timeout). The message names the rank and what happened, e.g.
    "rank 1 exited with signal SIGKILL" or "rank 2 raised ValueError: ..." plus its traceback.
    """

    def __init__(self, message: str, rank: int | None = None):
        super().__init__(message)
        self.rank = rank
        self.reason = message


@dataclass(frozen=True)
class RankContext:
    """What a worker learns about its place in the group; passed as the first constructor argument.

    ``group`` is the default process group (NCCL on GPU, gloo on CPU); ``cpu_group`` is a gloo
    group for control messages and CPU tensors (the same group as ``group`` on CPU).
    """

    rank: int
    world_size: int
    device: Any  # torch.device
    group: Any  # torch.distributed.ProcessGroup
    cpu_group: Any
    comm: Any = None  # engine.parallel.comm.Comm over ``group``: small CPU messages through shared memory


# ---------------------------------------------------------------- rank side


def _set_parent_death_signal() -> None:
    """Ask Linux to SIGKILL this process when its parent (the rank server, which exits with the
    driver) exits."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    except OSError:
        return
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def _watch_driver(lifeline: multiprocessing.connection.Connection) -> None:
    """Exit when the driver is gone, even while the main thread is blocked in a collective: the
    driver holds the other end of ``lifeline`` and never writes to it, so a read returns only
    when that end closes (the driver exited, however it ended)."""
    try:
        lifeline.recv_bytes()
    except (EOFError, OSError):
        pass
    os._exit(1)


def _resolve(worker_cls: type | str) -> type:
    if not isinstance(worker_cls, str):
        return worker_cls
    module_name, sep, qualname = worker_cls.partition(":")
    if not sep:
        module_name, _, qualname = worker_cls.rpartition(".")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _error_message(exc: BaseException) -> tuple[str, str, str]:
    return (type(exc).__name__, str(exc), traceback.format_exc())


def _init_distributed(rank: int, world_size: int, port: int, device: str, store_timeout_s: float,
                      collective_timeout_s: float, driver_pid: int) -> RankContext:
    import torch
    import torch.distributed as dist

    store = dist.TCPStore(_LOOPBACK, port, is_master=False,
                          timeout=datetime.timedelta(seconds=store_timeout_s))
    timeout = datetime.timedelta(seconds=collective_timeout_s)
    if device == "cuda":
        num_devices = torch.cuda.device_count()
        if num_devices == 0:
            raise RuntimeError("device='cuda' but torch sees no CUDA device")
        torch_device = torch.device("cuda", rank % num_devices)
        torch.cuda.set_device(torch_device)
        dist.init_process_group("nccl", store=store, rank=rank, world_size=world_size,
                                timeout=timeout, device_id=torch_device)
        cpu_group = dist.new_group(backend="gloo", timeout=timeout)
    else:
        torch_device = torch.device("cpu")
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=timeout)
        cpu_group = dist.group.WORLD
    from engine.parallel.comm import Comm

    comm = Comm(rank, world_size, dist.group.WORLD, torch_device, f"cpserve-{driver_pid}-{port}", collective_timeout_s)
    return RankContext(rank, world_size, torch_device, dist.group.WORLD, cpu_group, comm)


def _rank_main(rank: int, world_size: int, port: int, conn: multiprocessing.connection.Connection,
               lifeline: multiprocessing.connection.Connection, environ: dict[str, str],
               worker_cls: type | str, worker_args: tuple, worker_kwargs: dict, device: str,
               threads_per_rank: int, store_timeout_s: float, collective_timeout_s: float,
               driver_pid: int) -> None:
    """Entry point of one rank process. Messages: ("call", method, args, kwargs) | ("exit",).

    Forked by the rank server (:func:`start_rank_server`), so it starts with the server's
    environment: ``environ`` is the driver's, as it was when the group started."""
    _set_parent_death_signal()
    threading.Thread(target=_watch_driver, args=(lifeline,), daemon=True, name="driver-watchdog").start()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle
    os.environ.clear()
    os.environ.update(environ)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        import torch

        torch.set_num_threads(threads_per_rank)
        ctx = _init_distributed(rank, world_size, port, device, store_timeout_s,
                                collective_timeout_s, driver_pid)
        worker = _resolve(worker_cls)(ctx, *worker_args, **worker_kwargs)
    except BaseException as exc:  # noqa: BLE001 — every failure must reach the driver
        conn.send(("error", *_error_message(exc)))
        return
    conn.send(("ready", {"pid": os.getpid(), "device": str(ctx.device)}))
    profile_dir = os.environ.get(PROFILE_ENV)
    if profile_dir:  # a debugging aid: the rank's calls under cProfile, written when it exits
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    try:
        _serve_calls(conn, worker)
    finally:
        if profile_dir:
            profiler.disable()
            profiler.dump_stats(os.path.join(profile_dir, f"rank{rank}-{os.getpid()}.prof"))
    close = getattr(worker, "close", None)
    if callable(close):
        close()
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    # Everything is closed: leave without the interpreter's teardown (module and thread
    # finalisation, ~0.5 s here with torch loaded), which every group stop would wait for.
    # The shared-memory segment is already unlinked (engine/parallel/comm.py); the OS closes
    # the sockets, including those of a transfer engine closed with at_exit=True.
    exit_now(0)


def exit_now(code: int) -> typing.NoReturn:
    """End this process now, without the interpreter's teardown (module and thread finalisation:
    ~0.5 s with torch loaded), once everything that matters is closed: runs what a
    multiprocessing process runs as it ends, flushes logging and stdio, then ``os._exit``."""
    # what a multiprocessing child runs as it ends (finalisers: e.g. unlinking a semaphore
    # tqdm made, which the resource tracker would otherwise report as leaked), then the flushes
    multiprocessing.util._exit_function()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _serve_calls(conn: multiprocessing.connection.Connection, worker) -> None:
    """Run the driver's calls on ``worker`` until it says exit or closes the pipe."""
    while True:
        try:
            message = conn.recv()
        except EOFError:  # the driver closed the pipe (or died)
            break
        except BaseException as exc:  # noqa: BLE001 — e.g. an argument that cannot be unpickled
            conn.send(("error", *_error_message(exc)))
            continue
        if message[0] == "exit":
            break
        _, method, args, kwargs = message
        try:
            result = getattr(worker, method)(*args, **kwargs)
            conn.send_bytes(dumps(("ok", result)))
        except BaseException as exc:  # noqa: BLE001
            conn.send(("error", *_error_message(exc)))


# ---------------------------------------------------------------- driver side


def _describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "is gone"
    if exitcode < 0:
        try:
            return f"exited with signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"exited with signal {-exitcode}"
    return f"exited with code {exitcode}"


# Modules the rank server imports once; every rank forked from it starts with them loaded.
_RANK_PRELOAD = ["torch", "torch.distributed", "engine.parallel.group", "engine.parallel.comm",
                 "engine.parallel.dcp", "engine.parallel.prefill_cp"]


def _rank_context() -> multiprocessing.context.BaseContext:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_RANK_PRELOAD)
    return ctx


def start_rank_server() -> None:
    """Start this process's rank server now, if it is not running: the process every rank of
    every group of this driver is forked from (multiprocessing's forkserver), with torch and
    the engine imported once. A rank then starts in milliseconds instead of importing torch
    in a fresh interpreter (~2 s of CPU each). It returns at once; the server loads in the
    background, so a service calls it first thing and does its own start-up meanwhile.

    The server is a single-threaded process that never runs a torch operation, so forking it is
    safe (CUDA included: it is never initialised there). It exits when this process does."""
    _rank_context()
    multiprocessing.forkserver.ensure_running()


class _Ranks:
    """The driver's handles on the rank processes. Owned by a WorkerGroup, but kept separate so
    that the exit/GC finaliser can stop the processes without keeping the group alive."""

    def __init__(self) -> None:
        self.processes: list[multiprocessing.process.BaseProcess] = []
        self.conns: list[multiprocessing.connection.Connection] = []
        self.store: Any = None
        self.lifeline: multiprocessing.connection.Connection | None = None  # never written: see _watch_driver
        self._stop_lock = threading.RLock()  # a failing call and shutdown() may race

    def stop(self, timeout_s: float = 0.0) -> None:
        """Ask every rank to exit, wait up to ``timeout_s``, then SIGTERM, then SIGKILL."""
        with self._stop_lock:
            self._stop(timeout_s)

    def _stop(self, timeout_s: float) -> None:
        for conn, process in zip(self.conns, self.processes):
            if process.exitcode is None and timeout_s > 0:
                try:
                    conn.send(("exit",))
                except (OSError, ValueError):
                    pass
        self._join_all(timeout_s)
        for process in self.processes:
            if process.exitcode is None:
                process.terminate()
        self._join_all(_KILL_GRACE_S)
        for process in self.processes:
            if process.exitcode is None:
                process.kill()
        self._join_all(_KILL_GRACE_S)
        for conn in self.conns:
            conn.close()
        if self.lifeline is not None:
            self.lifeline.close()
        self.store = None  # the master store's server stops with it

    def _join_all(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))


class WorkerGroup:
    """C rank processes running ``worker_cls(ctx, *worker_args, **worker_kwargs)`` in SPMD.

    The constructor starts the processes and returns; ``ready()`` (called by ``call``,
    ``call_rank`` and ``__enter__``) waits until every rank has built its worker. ``worker_cls``
    is a class importable by its module path (the ranks import it by name) or a
    ``"package.module:Class"`` string. A worker may define ``close()``; it runs on clean shutdown.
    """

    def __init__(self, world_size: int, worker_cls: type | str, worker_args: tuple = (),
                 worker_kwargs: dict | None = None, *, device: str = "cpu",
                 threads_per_rank: int = 1, start_timeout_s: float = 60,
                 collective_timeout_s: float = 300, name: str = "group"):
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
        if threads_per_rank < 1:
            raise ValueError(f"threads_per_rank must be >= 1, got {threads_per_rank!r}")
        self.world_size = world_size
        self.name = name
        self.device = device
        self._start_timeout_s = start_timeout_s
        self._lock = threading.RLock()
        self._ready = False
        self._pending: collections.deque[str] = collections.deque()  # submitted, uncollected calls, oldest first
        self._failure: GroupError | None = None
        self._closed = False
        self._ranks = _Ranks()
        # Runs on garbage collection and at interpreter exit, before multiprocessing joins
        # its children (exitpriority >= 0 finalisers run first), so no rank outlives the driver.
        self._finalizer = multiprocessing.util.Finalize(self, self._ranks.stop, exitpriority=100)
        try:
            self._start(worker_cls, worker_args, dict(worker_kwargs or {}), threads_per_rank,
                        collective_timeout_s)
        except BaseException:
            self._finalizer()
            raise

    def _start(self, worker_cls: type | str, worker_args: tuple, worker_kwargs: dict,
               threads_per_rank: int, collective_timeout_s: float) -> None:
        import torch.distributed as dist

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.bind((_LOOPBACK, 0))
            sock.listen(128)
            self.store_port: int = sock.getsockname()[1]
            self._ranks.store = dist.TCPStore(
                _LOOPBACK, self.store_port, None, True,
                datetime.timedelta(seconds=self._start_timeout_s),
                wait_for_workers=False, master_listen_fd=sock.detach())
        finally:
            sock.close()
        mp = _rank_context()
        # the ranks' watchdogs read their end until this one closes: when this process exits
        lifeline, self._ranks.lifeline = mp.Pipe(duplex=False)
        environ = dict(os.environ)
        for rank in range(self.world_size):
            driver_conn, rank_conn = mp.Pipe(duplex=True)
            process = mp.Process(
                target=_rank_main, name=f"{self.name}-rank{rank}", daemon=False,
                args=(rank, self.world_size, self.store_port, rank_conn, lifeline, environ, worker_cls,
                      worker_args, worker_kwargs, self.device, threads_per_rank, self._start_timeout_s,
                      collective_timeout_s, os.getpid()))
            process.start()
            rank_conn.close()
            self._ranks.processes.append(process)
            self._ranks.conns.append(driver_conn)
        lifeline.close()

    # ------------------------------------------------------------ public API

    @property
    def alive(self) -> bool:
        """True until the group fails or is shut down (and while every rank process runs)."""
        return (not self._closed and self._failure is None
                and all(p.exitcode is None for p in self._ranks.processes))

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._ranks.processes]

    def ready(self, timeout_s: float | None = None) -> None:
        """Wait until every rank has constructed its worker; GroupError if any failed."""
        with self._lock:
            self._check_usable()
            if self._ready:
                return
            timeout_s = self._start_timeout_s if timeout_s is None else timeout_s
            infos = self._collect(range(self.world_size), deadline=time.monotonic() + timeout_s,
                                  what="start-up", expected="ready")
            self._ready = True
        layout = ", ".join(f"rank {r}: pid {info['pid']} on {info['device']}"
                           for r, info in enumerate(infos))
        logger.info("worker group %r ready: world_size=%d backend=%s store=%s:%d; %s", self.name,
                    self.world_size, "nccl+gloo" if self.device == "cuda" else "gloo",
                    _LOOPBACK, self.store_port, layout)

    def call(self, method: str, *args: Any, **kwargs: Any) -> list:
        """Run ``method(*args, **kwargs)`` on every rank (SPMD); return the results in rank order.

        Arguments are pickled once, before anything is sent: an argument that cannot be
        pickled raises here and leaves the group healthy.
        """
        with self._lock:
            self.ready()
            self._check_no_pending()
            return self._run(range(self.world_size), method, args, kwargs, f"call {method!r}")

    def submit(self, method: str, *args: Any, **kwargs: Any) -> None:
        """Send ``method`` to every rank like ``call``, without waiting: ``collect()`` returns
        the answers. The driver works while the ranks compute (a decode step's bookkeeping and
        delivery overlap the next forward). Up to ``MAX_SUBMITTED`` calls may be submitted
        (a rank takes the next from its pipe as soon as it has answered the last: a decode
        step planned ahead starts without a round trip); ``collect`` returns the oldest's
        answers. ``call`` and ``call_rank`` refuse to run until every one is collected (the
        ranks answer in order)."""
        with self._lock:
            self.ready()
            if len(self._pending) >= MAX_SUBMITTED:
                raise RuntimeError(f"worker group {self.name!r}: {len(self._pending)} calls submitted and not collected")
            message = dumps(("call", method, args, kwargs))
            what = f"call {method!r}"
            with self._interruptible(what):
                for rank in range(self.world_size):
                    self._send(rank, message)
            self._pending.append(what)

    def collect(self) -> list:
        """The answers of the submitted call, in rank order (GroupError as ``call`` raises it)."""
        with self._lock:
            if not self._pending:
                raise RuntimeError(f"worker group {self.name!r}: collect() without a submitted call")
            what = self._pending.popleft()
            with self._interruptible(what):
                return self._collect(range(self.world_size), deadline=None, what=what)

    @property
    def pending(self) -> bool:
        """A submitted call's answers are still to be collected."""
        return bool(self._pending)

    def answer_fds(self) -> list[int]:
        """What ``collect`` waits on: every rank's pipe and process sentinel. Once one of them
        is readable, the oldest submitted call has answers (the ranks of a step end together,
        in its last collective) or a rank has died (``collect`` says which)."""
        return [conn.fileno() for conn in self._ranks.conns] + [p.sentinel for p in self._ranks.processes]

    def call_rank(self, rank: int, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run ``method`` on one rank only; the method must not use collectives."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}")
        with self._lock:
            self.ready()
            self._check_no_pending()
            return self._run([rank], method, args, kwargs, f"call_rank({rank}, {method!r})")[0]

    def shutdown(self, timeout_s: float = 10) -> None:
        """Ask the ranks to exit, wait up to ``timeout_s``, then terminate/kill. Idempotent.

        A call in flight in another thread is not waited for: its ranks are killed and it
        raises GroupError.
        """
        if self._closed:
            return
        self._closed = True
        self._finalizer.cancel()
        graceful = self._failure is None and self._lock.acquire(timeout=2 * _POLL_S)
        try:
            self._ranks.stop(timeout_s if graceful else 0.0)
        finally:
            if graceful:
                self._lock.release()
        logger.info("worker group %r shut down", self.name)

    def __enter__(self) -> WorkerGroup:
        self.ready()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.shutdown()

    # ------------------------------------------------------------ internals

    def _check_usable(self) -> None:
        if self._failure is not None:
            raise GroupError(f"worker group {self.name!r} is dead: {self._failure.reason}",
                             self._failure.rank)
        if self._closed:
            raise GroupError(f"worker group {self.name!r} was shut down")

    def _check_no_pending(self) -> None:
        if self._pending:
            raise RuntimeError(f"worker group {self.name!r}: {self._pending[0]} was submitted and not collected")

    @contextlib.contextmanager
    def _interruptible(self, what: str):
        try:
            yield
        except GroupError:
            raise
        except BaseException as exc:
            # e.g. KeyboardInterrupt mid-call: answers still on their way would be taken for
            # the next call's, so the group cannot be used again.
            self._abort(None, f"{what} interrupted by {type(exc).__name__}")
            raise

    def _run(self, ranks: Any, method: str, args: tuple, kwargs: dict, what: str) -> list:
        # Plain pickle (tensors by value): ForkingPickler would share tensor storage through
        # one-shot file descriptors, which breaks when the same bytes go to several ranks.
        message = dumps(("call", method, args, kwargs))
        with self._interruptible(what):
            for rank in ranks:
                self._send(rank, message)
            return self._collect(ranks, deadline=None, what=what)

    def _send(self, rank: int, message: bytes) -> None:
        try:
            self._ranks.conns[rank].send_bytes(message)
        except (OSError, ValueError) as exc:
            process = self._ranks.processes[rank]
            process.join(_KILL_GRACE_S)
            if process.exitcode is not None:
                self._fail(rank, f"rank {rank} {_describe_exit(process.exitcode)}")
            self._fail(rank, f"sending to rank {rank} failed: {exc!r}")

    def _collect(self, ranks: Any, deadline: float | None, what: str,
                 expected: str = "ok") -> list:
        """Wait for one message from each of ``ranks`` while watching every rank process."""
        pending = list(ranks)
        results: dict[int, Any] = {}
        processes, conns = self._ranks.processes, self._ranks.conns
        sentinels = {p.sentinel: rank for rank, p in enumerate(processes)}
        while pending:
            if deadline is not None and time.monotonic() > deadline:
                self._fail(None, f"{what} timed out; ranks {pending} did not answer")
            try:
                if self._closed:
                    raise ValueError("closed")
                fds = {conns[r].fileno(): r for r in pending}
                ready = readable([*fds, *sentinels], _POLL_S)
                answered = {fds[fd] for fd in ready if fd in fds}
            except (OSError, ValueError):  # shutdown() closed the pipes under us
                self._fail(None, f"worker group {self.name!r} was shut down during {what}")
            for rank in list(pending):  # messages first: a rank that reports then exits
                if rank in answered:
                    try:
                        kind, *payload = conns[rank].recv()
                    except (EOFError, OSError):
                        continue  # the sentinel reports the death below
                    if kind == "error":
                        self._fail_after_exception(rank, *payload)
                    if kind != expected:
                        self._fail(rank, f"rank {rank} sent {kind!r} during {what}")
                    results[rank] = payload[0]
                    pending.remove(rank)
            for sentinel, rank in sentinels.items():
                if sentinel in ready:
                    processes[rank].join(_KILL_GRACE_S)
                    self._fail(rank, f"rank {rank} {_describe_exit(processes[rank].exitcode)} "
                                     f"during {what}")
        return [results[r] for r in ranks]

    def _fail_after_exception(self, rank: int, exc_type: str, text: str, tb: str) -> None:
        """Blame a dead rank over one that merely saw its peer vanish (e.g. gloo's
        'Connection closed by peer' on the survivors of a SIGKILL)."""
        # the reporter itself may exit right after reporting (a constructor that raised): only
        # another rank's death is blamed instead
        others = [(r, p) for r, p in enumerate(self._ranks.processes) if r != rank]
        if others and multiprocessing.connection.wait([p.sentinel for _, p in others], timeout=_DEATH_GRACE_S):
            for dead, process in others:
                process.join(0.05)
                if process.exitcode is not None:
                    self._fail(dead, f"rank {dead} {_describe_exit(process.exitcode)} "
                                     f"(rank {rank} then raised {exc_type}: {text})")
        self._fail(rank, f"rank {rank} raised {exc_type}: {text}\n{tb}")

    def _fail(self, rank: int | None, message: str) -> None:
        """Kill every rank, mark the group dead, raise GroupError. Never returns."""
        raise self._abort(rank, message)

    def _abort(self, rank: int | None, message: str) -> GroupError:
        """Kill every rank and mark the group dead; return the error that says why."""
        error = GroupError(f"worker group {self.name!r}: {message}", rank)
        if self._failure is None and not self._closed:
            self._failure = error
            logger.error("%s; stopping all %d ranks", error, self.world_size)
        self._finalizer.cancel()
        self._ranks.stop(0.0)
        return error
