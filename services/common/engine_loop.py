"""The one thread that owns an engine.

Engines are not thread-safe, so each service runs exactly one :class:`EngineLoop`; gRPC handler
threads never touch the engine, they hand it commands (``fn(engine)``) and wait on futures.

Synchronisation rule: everything that reads or writes the engine — and any state the service
keeps beside it (the decode service's open streams) — runs on the loop thread. Handlers see
only futures, per-request queues and :attr:`snapshot` (replaced whole, never mutated).

Between commands the loop calls ``tick(engine)`` while ``has_work(engine)`` is true (the decode
service's step + deliver). When idle it checks every ``idle_s`` that the rank group is alive
and calls ``idle(engine)`` (e.g. expire reservations). A tick that would block on its ranks
may call :meth:`EngineLoop.serve_until` instead (the decode engine's ``while_ranks_compute``):
the commands that arrive while the ranks compute run at once, on this same thread, rather than
at the end of the step.

Failure: a ``GroupError`` from a command or a tick means the rank group is dead. The loop then
fails every queued command with ``ServiceUnavailable``, calls ``on_failure(message)`` once (health
→ NOT_SERVING, open streams end), and refuses every later call.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

from engine.parallel.group import GroupError, readable
from services.common.rpc import QueueFull, ServiceUnavailable

logger = logging.getLogger("cpserve.services")

Command = Callable[[Any], Any]
SNAPSHOT_S = 0.02  # how stale the snapshot may get while the engine runs with no command


class EngineLoop:
    def __init__(self, engine, name: str, max_queue: int, *, on_failure: Callable[[str], None],
                 has_work: Callable[[Any], bool] = lambda e: False, tick: Callable[[Any], None] = lambda e: None,
                 idle: Callable[[Any], None] = lambda e: None, snapshot: Callable[[Any], Any] = lambda e: None,
                 on_stop: Callable[[Any, str], None] = lambda e, message: None, idle_s: float = 0.25):
        self.engine, self.name, self.max_queue = engine, name, max_queue
        self._on_failure, self._has_work, self._tick, self._idle = on_failure, has_work, tick, idle
        self._make_snapshot, self._idle_s, self._on_stop = snapshot, idle_s, on_stop
        self._commands: queue.Queue[tuple[Command, Future | None, bool] | None] = queue.Queue()
        # rung after each put: serve_until waits on it beside the ranks' pipes
        self._bell = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._lock = threading.Lock()
        self._queued_admissions = 0
        self.failure: str | None = None
        self._stopping = False
        self._closed = False  # set (under _lock) when the thread ends; nothing queued after is run
        self.snapshot = snapshot(engine)
        self._snapshot_at = time.monotonic()
        self.observe_tick: Callable[[float], None] | None = None  # e.g. a step-time histogram
        self._thread = threading.Thread(target=self._run, name=f"{name}-engine", daemon=True)
        self._thread.start()

    # ---- handler side ---------------------------------------------------------------------
    @property
    def queue_depth(self) -> int:
        """Admitted commands (new work) waiting for the engine."""
        return self._queued_admissions

    def submit(self, fn: Command, admit: bool = False) -> Future:
        """Queue ``fn(engine)``; its result or exception arrives on the future. ``admit`` marks new
        work, which the bound (``max_queue``) applies to; control commands are never refused."""
        fut: Future = Future()
        with self._lock:
            self._check_usable()
            if admit:
                if self._queued_admissions >= self.max_queue:
                    raise QueueFull(f"{self.name}: {self._queued_admissions} requests queued (max_queue "
                                    f"{self.max_queue}); retry later")
                self._queued_admissions += 1
            self._put((fn, fut, admit))
        return fut

    def call(self, fn: Command, admit: bool = False, timeout_s: float | None = None) -> Any:
        return self.submit(fn, admit).result(timeout_s)

    def post(self, fn: Command) -> None:
        """Fire and forget (e.g. abort a cancelled stream); dropped when the loop is not running."""
        with self._lock:
            if not self._closed and not self._stopping:
                self._put((fn, None, False))

    def stop(self, timeout_s: float = 10.0) -> None:
        """Finish the command in flight, fail the queued ones, stop the thread. Idempotent."""
        self._stopping = True
        with self._lock:
            self._put(None)
        self._thread.join(timeout_s)

    def _put(self, item) -> None:
        """Queue ``item`` and ring the bell (under ``_lock``: the bell is closed with it)."""
        self._commands.put(item)
        if not self._closed:
            os.eventfd_write(self._bell, 1)

    def join(self, timeout_s: float | None = None) -> None:
        """Wait for the loop thread to end (after a stop or a failure)."""
        self._thread.join(timeout_s)

    def _check_usable(self) -> None:
        if self.failure is not None:
            raise ServiceUnavailable(f"{self.name} service is not serving: {self.failure}")
        if self._stopping or self._closed:
            raise ServiceUnavailable(f"{self.name} service is stopping")

    # ---- loop thread ----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping:
                busy = self._has_work(self.engine)
                self._run_commands(block=not busy)
                if self._stopping:
                    break
                if self._has_work(self.engine):
                    t0 = time.perf_counter()
                    self._tick(self.engine)
                    if self.observe_tick is not None:
                        self.observe_tick(time.perf_counter() - t0)
                    # between commands a running engine refreshes it every SNAPSHOT_S (a decode
                    # step is a few ms; the snapshot's walk over the batch is not free), and at once
                    # when the work runs out
                    if time.monotonic() - self._snapshot_at < SNAPSHOT_S and self._has_work(self.engine):
                        continue
                self._refresh()
        except GroupError as e:
            self._fail(str(e).splitlines()[0])
        except BaseException as e:  # the engine's state is unknown now: stop serving
            logger.exception("%s engine loop failed", self.name)
            self._fail(f"engine error: {type(e).__name__}: {e}")
        finally:
            with self._lock:
                self._closed = True
                os.close(self._bell)
            self._drain(self.failure or f"{self.name} service is stopping")
            try:
                self._on_stop(self.engine, self.failure or f"{self.name} service is stopping")
            except Exception:
                logger.exception("%s: on_stop hook failed", self.name)

    def serve_until(self, fds: list[int], waiting: Callable[[], bool] = lambda: True) -> None:
        """On the loop thread, inside a tick: run the commands that arrive until one of ``fds``
        is readable (the ranks have answered, or one died) or ``waiting()`` turns false (a
        command collected the answers itself), then return. Stopping returns at once (the tick
        then finishes the step in flight)."""
        if threading.current_thread() is not self._thread:
            raise RuntimeError(f"{self.name}: serve_until runs on the engine thread only")
        while not self._stopping and waiting():
            ready = readable([*fds, self._bell], None)
            if self._bell in ready:
                try:
                    os.eventfd_read(self._bell)
                except BlockingIOError:
                    pass
                self._run_commands(block=False)
            if ready - {self._bell}:
                return

    def _run_commands(self, block: bool) -> None:
        try:
            item = self._commands.get(timeout=self._idle_s) if block else self._commands.get_nowait()
        except queue.Empty:
            if block:
                self._check_alive()
                self._idle(self.engine)
            return
        while item is not None:
            self._execute(*item)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return

    def _execute(self, fn: Command, fut: Future | None, admit: bool) -> None:
        if admit:
            with self._lock:
                self._queued_admissions -= 1
        if fut is not None and not fut.set_running_or_notify_cancel():
            return
        try:
            result = fn(self.engine)
        except GroupError as e:
            if fut is not None:
                fut.set_exception(e)
            raise
        except BaseException as e:
            self._refresh()
            if fut is None:
                logger.exception("%s: command failed", self.name)
            else:
                fut.set_exception(e)
            return
        self._refresh()  # before the caller hears back: a Status sent after Reserve's reply sees it
        if fut is not None:
            fut.set_result(result)

    def _refresh(self) -> None:
        self.snapshot = self._make_snapshot(self.engine)
        self._snapshot_at = time.monotonic()

    def _check_alive(self) -> None:
        group = getattr(self.engine, "group", None)
        if group is not None and not self._stopping and not group.alive:
            group.call("memory")  # raises GroupError naming the dead rank

    def _fail(self, message: str) -> None:
        self.failure = message
        logger.error("%s service stops serving: %s", self.name, message)
        try:
            self._on_failure(message)
        except Exception:
            logger.exception("%s: on_failure hook failed", self.name)

    def _drain(self, message: str) -> None:
        """Fail everything still queued; later submits are refused by _check_usable."""
        while True:
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                fn, fut, admit = item
                if admit:
                    with self._lock:
                        self._queued_admissions -= 1
                if fut is not None and fut.set_running_or_notify_cancel():
                    fut.set_exception(ServiceUnavailable(message))
