"""The work queue between the HTTP handlers (asyncio) and the model (one worker thread).

Interface (what a caller - a route - uses)::

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


def _put_all(items) -> None:
    for handle, piece in items:
        handle._events.put_nowait(piece)


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

    async def batches(self):
        """As iterating, but each item a list of what was emitted since the last (one wake-up, one write)."""
        while True:
            items = [await self._events.get()]
            while not self._events.empty():
                items.append(self._events.get_nowait())
            done = items[-1] is _DONE
            items = [item for item in items if item is not _DONE]
            if items:
                yield items
            if done:
                break
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


class TextBatcher(Scheduler):
    """Continuous batching of a language model's replies (``tasks/generation/batched.py``): up to ``slots``
    sequences decoded together, one step of the batched program for all of them; a waiting request's prompt is
    run (its prefill) between two decode steps, into a free slot of the KV cache, and a reply that ends frees its
    slot at once. ``submit_text(job)`` returns a ``Handle`` as ``submit`` does (its items: text pieces; its result:
    a ``backends.TextResult``); ``call`` runs a function on the worker thread (loading). ``engine`` (a
    ``BatchedDecoder``) and ``lm`` (its ``LanguageModel``: tokenizer, EOS ids, checks) are set once loaded."""

    def __init__(self, max_queue: int, slots: int, metrics=None, name: str = "text"):
        super().__init__(max_queue, metrics, name)
        self.slots = slots
        self.engine = None
        self.lm = None
        self._pending: list[tuple[Handle, str]] = []  # (request, text piece) of the current step

    def submit_text(self, job) -> Handle:
        return self.submit(job)

    def _work(self) -> None:
        from ..tasks.generation.batched import Reply, Slots
        from .backends import TextResult

        slots: Slots | None = None  # the slot/step loop, once the engine is loaded
        owners: dict[int, Handle] = {}  # slot -> the request of its reply
        while True:
            admitted: list[Handle] = []
            with self._cond:
                while not self._waiting and not owners and not self._closing:
                    self._cond.wait()
                if self._closing and not self._waiting and not owners:
                    return
                room = len(slots.free) if slots is not None else 0
                while self._waiting and (room or self._waiting[0]._loop is None):
                    handle = self._waiting.popleft()
                    room -= handle._loop is not None
                    admitted.append(handle)
                self._report()
            for handle in admitted:
                if handle._loop is None:  # a call(): loading, on this thread
                    handle.job(handle)
                    if slots is None and self.engine is not None:
                        slots = Slots(self.engine)
                    continue
                self._admit(handle, slots, owners, Reply, TextResult)
                self._deliver()
            if owners:
                self._decode(slots, owners, TextResult)
                self._deliver()
            if self.metrics is not None:
                self.metrics.running.set(len(owners))

    def _deliver(self) -> None:
        """The text pieces of a step, handed to their requests with one wake-up of each event loop (a wake-up
        per piece costs more than the step itself at a few ms per step)."""
        if not self._pending:
            return
        by_loop: dict = {}
        for handle, piece in self._pending:
            if handle.first_emit is None:
                handle.first_emit = time.perf_counter()
            by_loop.setdefault(handle._loop, []).append((handle, piece))
        self._pending = []
        for loop, items in by_loop.items():
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits
                loop.call_soon_threadsafe(_put_all, items)

    def _admit(self, handle: Handle, slots, owners: dict, reply_cls, result_cls) -> None:
        job = handle.job
        if handle.cancelled():
            handle._finish(error=Cancelled())
            return
        lm = self.lm
        reply = reply_cls(job.ids, job.max_tokens, job.settings, job.stop, set(lm.eos_ids), lm.tokenizer.decode,
                          lambda piece: self._pending.append((handle, piece)))
        try:
            handle.started = time.perf_counter()
            done = slots.admit(reply)
        except BaseException as exc:  # noqa: BLE001 - answered to its request
            handle._finish(error=exc)
            return
        self._count(handle, reply)
        if done:
            self._done(handle, reply, result_cls)
        else:
            owners[reply.slot] = handle

    def _decode(self, slots, owners: dict, result_cls) -> None:
        for slot, handle in list(owners.items()):
            if handle.cancelled():
                slots.drop(slot)
                del owners[slot]
                handle._finish(error=Cancelled())
        if not owners:
            return
        try:
            ended = {reply.slot: reply for reply in slots.decode()}
        except BaseException as exc:  # noqa: BLE001 - every reply of the step gets the error
            for handle in owners.values():
                handle._finish(error=exc)
            owners.clear()
            return
        for slot, handle in list(owners.items()):
            reply = ended.get(slot) or slots.active[slot]
            self._count(handle, reply)
            if slot in ended:
                del owners[slot]
                self._done(handle, reply, result_cls)

    def _count(self, handle: Handle, reply) -> None:
        if len(reply.out) == 1:
            handle.first_token = reply.first_token_at
        if self.metrics is not None:
            self.metrics.tokens(1)

    def _done(self, handle: Handle, reply, result_cls) -> None:
        self._deliver()  # its last pieces before its end
        handle._finish(result_cls(len(reply.ids), list(reply.out), reply.text,
                                  "length" if reply.finish == "length" else "stop"))
