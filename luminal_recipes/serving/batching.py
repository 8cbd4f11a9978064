"""The work queue between the HTTP handlers (asyncio) and the model (one worker thread).

Interface (what a caller - a route, or later ``generate(list)`` - uses)::

    scheduler = Scheduler(max_queue=64, metrics=...)
    scheduler.start()
    model = scheduler.call(load)        # a function run on the worker thread, waited for (no event loop needed)
    handle = scheduler.submit(job)      # QueueFull when max_queue requests already wait (the caller answers 429)
    async for piece in handle:          # what the job emits (text pieces), as it emits them
        ...
    result = handle.result              # the job's return value once the iteration ended (or its error raised)
    handle.cancel()                     # a waiting job never starts; a running one stops at its next emit/check
    scheduler.stop()                    # no new job; the queued and running ones finish; the worker ends

A job is ``job(handle) -> result``, run on the worker thread: it calls ``handle.emit(x)`` to stream and
``handle.cancelled()`` to learn that its client left (``backends.Cancelled`` ends it). Jobs run one at a time, in
submission order (FIFO): a pipeline run, an embedding, a language model's reply.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

from .backends import Cancelled


class QueueFull(Exception):
    """``max_queue`` requests already wait."""


class Closed(Exception):
    """The scheduler is stopping (SIGTERM): no new work."""


_DONE = object()


class Handle:
    """One submitted job, seen from the event loop that submitted it."""

    def __init__(self, job: Callable[[Handle], Any], loop: asyncio.AbstractEventLoop | None):
        self.job = job
        self._loop = loop
        self._events: asyncio.Queue | None = asyncio.Queue() if loop is not None else None
        self._cancel = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None
        self.submitted = time.perf_counter()
        self.started: float | None = None
        self.first_emit: float | None = None
        self.finished: float | None = None

    # ---- worker side ----------------------------------------------------------------------------------------
    def emit(self, item: Any) -> None:
        if self.first_emit is None:
            self.first_emit = time.perf_counter()
        self._loop.call_soon_threadsafe(self._events.put_nowait, item)

    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def _finish(self, result: Any = None, error: BaseException | None = None) -> None:
        self.result, self.error, self.finished = result, error, time.perf_counter()
        if self._loop is None:  # a call(): its future has the result
            return
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
            self._loop.call_soon_threadsafe(self._events.put_nowait, _DONE)

    # ---- caller side ----------------------------------------------------------------------------------------
    def cancel(self) -> None:
        self._cancel.set()

    def __aiter__(self):
        return self._iterate()

    async def _iterate(self):
        while True:
            item = await self._events.get()
            if item is _DONE:
                break
            yield item
        if self.error is not None:
            raise self.error

    async def wait(self) -> Any:
        """The result, once the job ended (its emitted items dropped)."""
        async for _ in self:
            pass
        return self.result


class Scheduler:
    """A FIFO of jobs run one at a time on one worker thread; at most ``max_queue`` waiting."""

    def __init__(self, max_queue: int, metrics=None, name: str = "model"):
        self.max_queue = max_queue
        self.metrics = metrics
        self.name = name
        self._waiting: collections.deque[Handle] = collections.deque()
        self._cond = threading.Condition()
        self._closing = False
        self._running: Handle | None = None
        self._thread = threading.Thread(target=self._work, name=f"luminal-serve-{name}", daemon=True)

    def start(self) -> None:
        if not self._thread.is_alive():
            self._thread.start()

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn()`` on the worker thread and wait for it (from a thread without an event loop): the model is
        loaded and compiled there, as egglog's e-graphs and some runtimes must stay on the thread that made them."""
        import concurrent.futures

        done: concurrent.futures.Future = concurrent.futures.Future()

        def job(_handle):
            try:
                done.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - raised again in the caller
                done.set_exception(exc)

        with self._cond:
            self._waiting.append(Handle(job, None))
            self._cond.notify()
        self.start()
        return done.result()

    @property
    def depth(self) -> int:
        """Jobs waiting (not the running one)."""
        with self._cond:
            return len(self._waiting)

    @property
    def busy(self) -> int:
        with self._cond:
            return len(self._waiting) + (self._running is not None)

    def submit(self, job: Callable[[Handle], Any]) -> Handle:
        handle = Handle(job, asyncio.get_running_loop())
        with self._cond:
            if self._closing:
                raise Closed
            if len(self._waiting) >= self.max_queue:
                raise QueueFull
            self._waiting.append(handle)
            self._report()
            self._cond.notify()
        return handle

    def stop(self, timeout: float | None = None) -> None:
        """No new jobs; the worker ends once the queued and running ones are done."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _report(self) -> None:
        if self.metrics is not None:
            self.metrics.queue_depth.set(len(self._waiting))

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._closing:
                    self._cond.wait()
                if not self._waiting:
                    return  # closing and drained
                handle = self._waiting.popleft()
                self._running = handle
                self._report()
            try:
                if handle.cancelled():
                    handle._finish(error=Cancelled())
                    continue
                handle.started = time.perf_counter()
                try:
                    result = handle.job(handle)
                except BaseException as exc:  # noqa: BLE001 - handed to the waiting request, which answers it
                    handle._finish(error=exc)
                else:
                    handle._finish(result)
            finally:
                with self._cond:
                    self._running = None
