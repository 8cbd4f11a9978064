"""Running a kernel's independent parts on every core: numpy's ufuncs and the compiled row kernels
(``numba_kernels``) release the GIL, so parts given to worker threads run in parallel with the caller's.

One pool per process of daemon workers, one fewer than the most parts asked for (the caller runs the first part
itself; kernels cut their work into at most ``THREADS`` parts), started on first use. Plain threads rather than
numba's threading layers: GNU OpenMP's workers spin after each parallel region and starve OpenBLAS' threads on a
machine with as many cores as threads (a 10x slowdown of every BLAS call measured here), and numba's workqueue
layer aborts the process on concurrent launches. A part not yet started by its worker when the caller has
finished its own is run by the caller (on a loaded machine a worker may wait milliseconds for a core). A part's
work is fixed (rows or tiles assigned at bind time), or, with ``claimed``, the parts take independent tasks in
turn, each task computed the same way whoever runs it: results never depend on the schedule. Parts that call BLAS
themselves run under ``blas_single_threaded`` (threadpoolctl): BLAS's own threads, shared by concurrent callers,
would serialise them (measured 2x slower than one single-threaded call per core). Calls from several threads
at once are serialised.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np

Part = Callable[[], None]


def _cpu_count() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


# LUMINAL_RECIPES_THREADS=N caps the parts (1: every kernel on the calling thread, BLAS keeps its own threads)
THREADS = max(1, int(os.environ.get("LUMINAL_RECIPES_THREADS", "0") or 0)) if os.environ.get(
    "LUMINAL_RECIPES_THREADS") else _cpu_count()
MIN_PART = 1 << 16  # elements per part at least: smaller parts are not worth a thread hand-off (20-50 us)
# elements per part at least for the kernels of a chain that runs on every thread in lockstep (``jit/chain.py``,
# ``finer_parts``): there a part costs a spin barrier (~1 us), not a hand-off. Opt-in (default: MIN_PART, the
# kernels' own parts): 8192 measured 1.04x wall, 1.08x CPU on the tiny FLUX.2 forward, 2 quiet threads (docs/torch.md)
CHAIN_MIN_PART = max(1, int(os.environ.get("LUMINAL_RECIPES_CHAIN_MIN_PART", "0") or 0) or MIN_PART)


class _Task:
    """One part handed to a worker: whoever claims it first runs it (the worker, or the caller once its own part
    is done), so a worker the OS has not scheduled yet never holds the caller up."""

    __slots__ = ("part", "claim", "finished", "error")

    def __init__(self, part: Part):
        self.part = part
        self.claim = threading.Lock()
        self.finished = threading.Lock()
        self.finished.acquire()  # released when the part has run
        self.error: BaseException | None = None

    def try_run(self) -> None:
        if not self.claim.acquire(blocking=False):
            return  # claimed by another thread
        try:
            self.part()
        except BaseException as exc:  # handed to the caller, which raises it
            self.error = exc
        finally:
            self.finished.release()

    def wait(self) -> None:
        self.finished.acquire()
        self.finished.release()


class _Pool:
    """Workers that wait for parts on a blocking queue: ``LUMINAL_RECIPES_SPIN_US=0``, or without numba (else
    ``_SpinningPool``)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.inboxes: list[queue.SimpleQueue] = []

    def _grow(self, workers: int) -> None:
        while len(self.inboxes) < workers:
            inbox: queue.SimpleQueue = queue.SimpleQueue()
            name = f"luminal-cpu-{len(self.inboxes) + 1}"
            threading.Thread(target=self._work, args=(inbox,), name=name, daemon=True).start()
            self.inboxes.append(inbox)

    @staticmethod
    def _work(inbox: queue.SimpleQueue) -> None:
        while True:
            inbox.get().try_run()

    def run(self, parts: Sequence[Part]) -> None:
        with self.lock:
            self._grow(len(parts) - 1)
            tasks = [_Task(part) for part in parts[1:]]
            for inbox, task in zip(self.inboxes, tasks):
                inbox.put(task)
            error = None
            try:
                parts[0]()
            except BaseException as exc:
                error = exc
            for task in reversed(tasks):  # the parts no worker has started yet, run here
                task.try_run()
            for task in tasks:
                task.wait()
                error = error or task.error
            if error is not None:
                raise error


# LUMINAL_RECIPES_SPIN_US=N: how long an idle worker spins for its next part before it sleeps (``_SpinningPool``,
# where numba runs; 0: it sleeps at once, ``_Pool``). A sleeping worker's wake-up costs 20-50 us here (a virtual
# CPU that halts when idle, woken by an interrupt), more than a decoding step's split products take on a core, and
# the kernels between two of them take ~10-100 us (SmolLM2: median gap 14 us, 90th percentile 115 us); a worker
# that spins past them catches the next part at once. Spinning is off while it does not pay (``_SpinningPool``:
# on a machine with more ready threads than cores, always spinning measured up to 2x slower than sleeping).
SPIN_S = max(0.0, float(os.environ.get("LUMINAL_RECIPES_SPIN_US", "300") or 0)) * 1e-6
YIELD_S = 50e-6  # a spinning thread yields its core (sched_yield) this often: a ready thread there runs first
PREEMPTED_S = 200e-6  # a spin held up this long between two reads was descheduled: the core is wanted elsewhere
WAIT_S = 100e-6  # the caller waiting for a started part spins this long, then sleeps until its worker wakes it
BACKOFF_S = (0.1, 3.2)  # spinning off for this long after it did not pay, doubling while it keeps not paying
BACKOFF_SCORE = 3.0  # events (below) that turn spinning off, each weighing less by DECAY per hand-off after it
DECAY = 0.95
CROWD_EVERY_S = 0.01  # how often the machine's ready threads are sampled (``_SpinningPool._decide``)
MAX_WORKERS = 256
_STRIDE = 8  # int64 flags per worker: one cache line each (posted, claimed, done, asleep: jit/spin.py)
ASLEEP = 3  # (jit/spin.py's ASLEEP: importable without numba)
_CALLER = _STRIDE * MAX_WORKERS  # the flag set while the caller sleeps waiting for started parts
_MAIL_SIZE, _JOB_COLUMNS = 16, 22  # a worker's lockstep mailbox and job (``jit/lockstep.py``'s MAIL, JOB_COLUMNS)
_CHAIN_ABORT = 24  # a chain's ABORT flag (``jit/chain.py``)


class _SpinningPool:
    """Workers handed their parts through atomic flags (``jit/spin.py``): per worker, the sequence number of the
    part posted, claimed (by the worker, or by the caller when the worker has not started it) and done. A waiting
    worker spins up to ``spin_ns`` without the GIL, yielding its core every ``YIELD_S``, then sleeps on its queue
    (the caller wakes a sleeping worker there), so parts that follow each other closely, as a decoding step's
    products do, are handed over in a microsecond instead of a sleeping thread's wake-up. As ``_Pool``: a part no
    worker has claimed when the caller has finished its own is run by the caller, so a descheduled worker never
    holds the caller up before it has started.

    Adaptive (``_decide``, ``_adapt``): spinning pays only while each spinning worker has a core. It is off while
    other threads ready to run leave too few cores for ours (``/proc/loadavg``), and three events say it has not:
    the caller ran the part of a worker that was spinning, not asleep (it was not on a core when the part was
    posted), a worker's spin was held up ``PREEMPTED_S`` between two reads (descheduled), or the caller waited
    for a started part more than ``WAIT_S`` and longer than its own part took. Past ``BACKOFF_SCORE`` recent
    events, workers sleep at once (``_Pool``'s hand-off) for ``BACKOFF_S[0]`` s, doubling up to ``BACKOFF_S[1]``
    while the events recur, then spin again."""

    def __init__(self, spin, spin_s: float | None = None):
        self.spin = spin
        self.lock = threading.Lock()
        self.flags = np.zeros(_CALLER + _STRIDE, np.int64)
        self.caller_wake: queue.SimpleQueue = queue.SimpleQueue()
        self.asleep = np.zeros(MAX_WORKERS, np.int64)
        self.mine = np.zeros(MAX_WORKERS, np.int64)
        self.sequence = 0
        self.parts: list[Part | None] = []
        self.errors: list[BaseException | None] = []
        self.wakes: list[queue.SimpleQueue] = []
        self.base_ns = int(1e9 * (SPIN_S if spin_s is None else spin_s))
        self.spin_ns = self.base_ns  # what workers spin now: 0 while backed off
        self.score = 0.0
        self.preempted = 0  # incremented by the workers (under the GIL)
        self.preempted_seen = 0
        self.backoff = BACKOFF_S[0]
        self.backoff_until = 0.0
        self.backoffs = 0  # how many times spinning was turned off (for tests and --profile)
        self.last_backoff = float("-inf")
        self.cpus = os.cpu_count() or 1
        self.others: float | None = None  # other threads ready to run on the machine, averaged (``_decide``)
        self.crowded = False
        self.crowdings = 0  # how many times a crowded machine turned spinning off
        self.next_sample = 0.0
        self.sample = _running_threads
        self.wait_ns, self.yield_ns = int(WAIT_S * 1e9), int(YIELD_S * 1e9)
        self.overflow: _Pool | None = None  # the blocking pool, for calls with more parts than MAX_WORKERS + 1
        # per worker, the mailbox and job of the lockstep chains it runs without the GIL (``jit/lockstep.py``)
        self.mails = np.zeros((MAX_WORKERS, _MAIL_SIZE), np.int64)
        self.jobs = np.zeros((MAX_WORKERS, 1, _JOB_COLUMNS), np.int64)

    def _grow(self, workers: int) -> None:
        if workers > MAX_WORKERS:
            raise ValueError(f"{workers} workers: the pool has flags for {MAX_WORKERS}")
        while len(self.wakes) < workers:
            i = len(self.wakes)
            self.parts.append(None)
            self.errors.append(None)
            self.wakes.append(queue.SimpleQueue())
            threading.Thread(target=self._work, args=(i,), name=f"luminal-cpu-{i + 1}", daemon=True).start()

    def _work(self, i: int) -> None:
        spin, flags, wake, base = self.spin, self.flags, self.wakes[i], _STRIDE * i
        yield_ns, preempted_ns = int(YIELD_S * 1e9), int(PREEMPTED_S * 1e9)
        mail, job = self.mails[i], self.jobs[i]
        from .jit import lockstep

        seen = done = 0
        while True:  # (``pool_wait`` also runs the lockstep chains posted here)
            got = lockstep.pool_wait(flags, base, _CALLER, done, seen, self.spin_ns, yield_ns, preempted_ns, mail,
                                     job)
            done, seen, status = 0, got >> 2, got & 3
            if status == spin.WAKE_CALLER:
                self.caller_wake.put(None)
                continue
            if status == spin.MINE:
                try:
                    self.parts[i]()
                except BaseException as exc:  # handed to the caller, which raises it
                    self.errors[i] = exc
                done = seen  # stored by the next wait, first thing
                continue
            if status == spin.PREEMPTED:
                self.preempted += 1
            # nothing for a while (or spinning here does not pay): sleep until the caller wakes this worker
            spin.store(flags, base + spin.ASLEEP, 1)
            if spin.load(flags, base + spin.POSTED) == seen and spin.load(mail, lockstep.JOB_POST) == spin.load(
                    mail, lockstep.JOB_DONE):
                wake.get()  # (a stale wake-up only waits again)
            else:
                spin.store(flags, base + spin.ASLEEP, 0)

    def run(self, parts: Sequence[Part]) -> None:
        if len(parts) - 1 > self.flags.size // _STRIDE - 1:  # more workers than flags (--threads in the hundreds)
            if self.overflow is None:
                self.overflow = _Pool()
            return self.overflow.run(parts)
        spin, flags = self.spin, self.flags
        with self.lock:
            workers = len(parts) - 1
            self._grow(workers)
            self._decide(time.monotonic())
            self.sequence += 1
            seq = self.sequence
            for i in range(workers):
                self.parts[i], self.errors[i] = parts[i + 1], None
            asleep = self.asleep
            if spin.post(flags, _STRIDE, workers, seq, asleep):
                for i in range(workers):
                    if asleep[i]:
                        self.wakes[i].put(None)
            error = None
            start = time.perf_counter()
            try:
                parts[0]()
            except BaseException as exc:
                error = exc
            own = time.perf_counter() - start
            events = 0
            wait_ns, yield_ns = self.wait_ns, self.yield_ns
            done = spin.finish(flags, _STRIDE, workers, seq, self.mine, wait_ns, yield_ns)
            if done < 0:  # parts no worker has started: run here
                for i in reversed(range(workers)):
                    if self.mine[i]:
                        events += not asleep[i]  # its worker was spinning, yet not on a core
                        try:
                            parts[i + 1]()
                        except BaseException as exc:
                            self.errors[i] = exc
                        spin.raise_to(flags, _STRIDE * i + spin.DONE, seq)
                done = spin.wait_done(flags, _STRIDE, workers, seq, wait_ns, yield_ns)
            if not done:
                waited = time.perf_counter()
                while True:  # sleep until the last worker to finish wakes this thread (a stale wake-up: again)
                    spin.store(flags, _CALLER, 1)
                    if spin.wait_done(flags, _STRIDE, workers, seq, 0, 0):
                        spin.store(flags, _CALLER, 0)
                        break
                    self.caller_wake.get()
                if time.perf_counter() - waited > max(own, WAIT_S):  # a started part took twice the caller's
                    events = max(events, 1)  # own: its worker lost its core
            for i in range(workers):
                error = error or self.errors[i]
                self.parts[i] = None
            if self.spin_ns:
                self._adapt(events)
            if error is not None:
                raise error

    def run_chain(self, jobs: Sequence[np.ndarray], own: Callable[[], object], chain_flags: np.ndarray) -> None:
        """A lockstep chain: worker i runs ``jobs[i]`` (``jit/lockstep.py``: compiled, without the GIL) while this
        thread runs ``own`` (thread 0's program); then wait until every worker is done with it. Where ``own``
        raises, the chain's ABORT flag (``chain_flags``) releases the workers from its barriers first."""
        from .jit import lockstep

        spin, flags = self.spin, self.flags
        with self.lock:
            workers = len(jobs)
            self._grow(workers)
            posted = []
            for i, job in enumerate(jobs):
                mail = self.mails[i]
                self.jobs[i][0] = job[0]
                generation = int(mail[lockstep.JOB_POST]) + 1
                spin.store(mail, lockstep.JOB_POST, generation)
                posted.append((mail, generation))
                if spin.load(flags, _STRIDE * i + ASLEEP):
                    spin.store(flags, _STRIDE * i + ASLEEP, 0)
                    self.wakes[i].put(None)
            try:
                own()
            except BaseException:
                spin.store(chain_flags, _CHAIN_ABORT, 1)
                raise
            finally:
                for mail, generation in posted:
                    lockstep.await_done(mail, generation)

    def _decide(self, now: float) -> None:
        """Spin (``spin_ns = base_ns``) unless backed off (``_adapt``) or the machine is crowded: other processes'
        threads ready to run (``others_running``: ``/proc/loadavg``'s running count less this process's, sampled
        every ``CROWD_EVERY_S``, averaged) leave fewer cores than this thread and every worker would spin on."""
        if now >= self.next_sample:
            self.next_sample = now + CROWD_EVERY_S
            running = self.sample()
            if running is not None:
                workers = len(self.wakes)
                awake = sum(1 for i in range(workers) if not self.flags[_STRIDE * i + ASLEEP])
                others = others_running(running, 1 + awake)
                self.others = others if self.others is None else 0.7 * self.others + 0.3 * others
                room = self.cpus - 1 - workers  # cores left over when this thread and every worker run
                if not self.crowded and self.others > room + 0.5:
                    self.crowded = True
                    self.crowdings += 1
                elif self.crowded and self.others <= room + 0.25:
                    self.crowded = False
        spin_ns = 0 if self.crowded or now < self.backoff_until else self.base_ns
        if spin_ns and not self.spin_ns:
            self.preempted_seen = self.preempted  # (counted while not spinning: not this spell's)
        self.spin_ns = spin_ns

    def _adapt(self, events: float) -> None:
        """Turn spinning off for a while after ``BACKOFF_SCORE`` recent events (class docstring)."""
        preempted = self.preempted - self.preempted_seen
        self.preempted_seen += preempted
        self.score = self.score * DECAY + events + preempted
        if self.score < BACKOFF_SCORE:
            return
        now = time.monotonic()
        if now - self.last_backoff > 4 * self.backoff + BACKOFF_S[1]:
            self.backoff = BACKOFF_S[0]  # calm for long: start again from the shortest back-off
        self.spin_ns, self.score = 0, 0.0
        self.backoff_until, self.last_backoff = now + self.backoff, now
        self.backoff = min(2 * self.backoff, BACKOFF_S[1])
        self.backoffs += 1


_LOADAVG: list[int] = []  # /proc/loadavg, kept open (pread: ~2 us a sample)


def _running_threads() -> int | None:
    """Threads ready to run on the machine now (``/proc/loadavg``'s 4th field, ours included); None where there
    is no such file."""
    try:
        if not _LOADAVG:
            _LOADAVG.append(os.open("/proc/loadavg", os.O_RDONLY))
        return int(os.pread(_LOADAVG[0], 128, 0).split()[3].split(b"/")[0])
    except (OSError, IndexError, ValueError):
        return None


# this process's threads: ``/proc/self/task`` kept open, and per thread id its ``stat`` kept open (``_TASKS``)
_TASK_DIR: list[int] = []
_TASKS: dict[str, int] = {}
_TASKS_LISTED = [-1]  # the thread count (``/proc/self/task``'s link count) when the threads were last listed
_TASKS_LOCK = threading.Lock()  # (the chains and the pool may sample from different threads)
# at most this many threads' files stay open: a process of more threads has them opened and closed at each sample
# (its file descriptors are its own code's too)
KEPT_TASKS = 64


def _list_tasks() -> None:
    """Open ``stat`` of each thread not open yet; close those of threads gone."""
    tids = os.listdir("/proc/self/task")
    for tid in _TASKS.keys() - set(tids):
        os.close(_TASKS.pop(tid))
    for tid in tids:
        if tid not in _TASKS:
            try:
                _TASKS[tid] = os.open(f"/proc/self/task/{tid}/stat", os.O_RDONLY)
            except OSError:
                continue  # (ended since the listing)


def _own_running_threads() -> int | None:
    """This process's threads ready to run now (state R in ``/proc/self/task/*/stat``); None where there is no
    such folder. Sampled each ``CROWD_EVERY_S`` by the chains and the pool, its Python cold (a decode step's
    kernels streamed the weights through the caches): the files stay open and are read again (``pread``, ~1 us a
    thread; opening, reading and closing each took ~20 us cold), listed again only when the thread count
    (``/proc/self/task``'s link count: 2 + threads) changed or a thread's file has gone."""
    with _TASKS_LOCK:
        try:
            if not _TASK_DIR:
                _TASK_DIR.append(os.open("/proc/self/task", os.O_RDONLY | os.O_DIRECTORY))
            links = os.fstat(_TASK_DIR[0]).st_nlink
            if links - 2 > KEPT_TASKS:
                _close_tasks()
                return _count_afresh()
            if links != _TASKS_LISTED[0]:
                _list_tasks()
                _TASKS_LISTED[0] = links
        except OSError:
            return None
        count = 0
        for fd in _TASKS.values():
            try:
                stat = os.pread(fd, 512, 0)
            except OSError:  # the thread has ended: list again at the next sample
                stat = b""
            if not stat:
                _TASKS_LISTED[0] = -1
                continue
            count += _running(stat)
        return count


def _running(stat: bytes) -> bool:
    """Whether a thread's ``stat`` says it is ready to run (state R, after its name in parentheses, which may
    hold spaces)."""
    end = stat.rfind(b")")
    return stat[end + 2:end + 3] == b"R"


def _count_afresh() -> int:
    """``_own_running_threads`` with each thread's file opened, read and closed."""
    count = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            fd = os.open(f"/proc/self/task/{tid}/stat", os.O_RDONLY)
        except OSError:
            continue  # (ended since the listing)
        try:
            stat = os.read(fd, 512)
        except OSError:
            continue
        finally:
            os.close(fd)
        count += _running(stat)
    return count


def _close_tasks() -> None:
    for fd in _TASKS.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    _TASKS.clear()
    _TASKS_LISTED[0] = -1


def _forget_tasks() -> None:
    """Close the threads' files (a forked child's are its parent's threads)."""
    global _TASKS_LOCK
    _TASKS_LOCK = threading.Lock()
    _close_tasks()
    for fd in _TASK_DIR:
        with contextlib.suppress(OSError):
            os.close(fd)
    _TASK_DIR.clear()


def others_running(running: int, ours: int) -> int:
    """Threads ready to run that belong to other processes: ``running`` (``_running_threads``) less this
    process's. ``ours``: those of this process known to be running (the caller, the awake workers); the rest of
    this process's (``/proc/self/task``) are read only when ``running`` exceeds it. Why this process's own other
    threads are not others: they are a library's workers that share our calls' timeline - PyTorch's OpenMP
    threads spin 2-7 ms after each of its ops, then sleep - and stepping aside for them (a chain on one thread,
    workers asleep) cost whole calls: the averaged count stayed above the threshold while every sample followed
    a PyTorch op (a Qwen3 decode step with its cache copied before each call: 6 of 15 chains alone, 23.8 vs
    20.7 ms median)."""
    if running <= ours:
        return 0
    own = _own_running_threads()
    return max(0, running - max(ours, own or 0))


def _new_pool():
    """The spinning pool where asked for (``SPIN_S`` > 0) and numba runs (``jit.AVAILABLE``), else the blocking
    one."""
    from . import jit

    if SPIN_S > 0 and jit.AVAILABLE:
        try:
            from .jit import spin

            flags = np.zeros(_STRIDE + 1, np.int64)  # compiled (or loaded) and linked here, not in a worker:
            spin.finish(flags, _STRIDE, 0, 1, np.zeros(1, np.int64), 0, 0)
            from .jit import lockstep

            # the workers' wait (``_SpinningPool._work``), with libc's clock_gettime and sched_yield by name
            lockstep.pool_wait(flags, 0, _STRIDE, 0, 0, 0, 0, 1, np.zeros(_MAIL_SIZE, np.int64),
                               np.zeros((1, _JOB_COLUMNS), np.int64))
        except Exception:  # numba importable but unusable, or a platform without those: the blocking pool
            return _Pool()
        return _SpinningPool(spin)
    return _Pool()


_POOL: _Pool | _SpinningPool | None = None
_POOL_LOCK = threading.Lock()
_BLOCKING: _Pool | None = None


def blocking_pool() -> _Pool:
    """A blocking pool of its own (one wake-up per ``run``, workers never spin), apart from the kernels' shared
    pool: for callers whose parts are long (a lockstep chain, ``jit/chain.py``), where the shared pool's adaptive
    hand-off measured 2-3x slower."""
    global _BLOCKING
    with _POOL_LOCK:
        if _BLOCKING is None:
            _BLOCKING = _Pool()
        return _BLOCKING


def _forget_pool() -> None:
    global _POOL, _POOL_LOCK, _BLOCKING
    _POOL, _POOL_LOCK, _BLOCKING = None, threading.Lock(), None  # a forked child has none of the parent's workers
    _forget_tasks()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def shared_pool() -> _Pool | _SpinningPool:
    """The kernels' pool (started on first use)."""
    global _POOL
    if _POOL is None:
        with _POOL_LOCK:
            if _POOL is None:
                _POOL = _new_pool()
    return _POOL


def run_parts(parts: Sequence[Part]) -> None:
    """Run independent parts, the first on this thread, the others on workers, and wait for all."""
    if len(parts) <= 1:
        for part in parts:
            part()
        return
    (_POOL or shared_pool()).run(parts)


_FINER = threading.local()  # ``finer_parts``' size, on the thread that set it


class finer_parts:  # noqa: N801 - used as a function: ``with finer_parts(n):``
    """``with finer_parts(n):`` kernels cut their work into parts of at least ``n`` elements inside (where that
    is below their own minimum: ``min_part``), on this thread only. For re-describing a kernel's parts when a
    chain that runs in lockstep is captured (``jit.described``'s ``redescribe``): the kernel as a step keeps its
    own parts."""

    __slots__ = ("size", "before")

    def __init__(self, size: int):
        self.size = size

    def __enter__(self) -> None:
        self.before = getattr(_FINER, "size", None)
        _FINER.size = self.size

    def __exit__(self, *exc) -> None:
        _FINER.size = self.before


def min_part(default: int | None = None) -> int:
    """Elements a part holds at least: ``default`` (``MIN_PART`` when None), or less inside ``finer_parts``."""
    size = MIN_PART if default is None else default
    finer = getattr(_FINER, "size", None)
    return size if finer is None else min(size, finer)


def part_count(items: int, elements: int) -> int:
    """How many parts ``items`` independent pieces of work, ``elements`` elements in all, are worth: at most
    ``THREADS`` and ``items``, at least ``MIN_PART`` elements each (so 1 for a whole below ``2 * MIN_PART``;
    ``finer_parts`` inside a chain's capture)."""
    return max(1, min(THREADS, items, elements // min_part()))


def split(n: int, elements_per_item: int = 1) -> list[slice]:
    """``range(n)`` cut into at most ``THREADS`` contiguous, near-equal parts (one part when the whole is
    smaller than ``MIN_PART`` elements per extra thread)."""
    parts = part_count(n, n * elements_per_item)
    bounds = [n * i // parts for i in range(parts + 1)]
    return [slice(bounds[i], bounds[i + 1]) for i in range(parts)]


def parallel(parts: Sequence[Part]) -> Part:
    """One step that runs ``parts`` (at most ``THREADS``) in parallel."""
    parts = list(parts)
    if len(parts) == 1:
        return parts[0]
    return lambda: run_parts(parts)


def claimed(count: int, slots: int, task: Callable[[int, int], None]) -> Part:
    """One step that runs ``task(slot, j)`` once for every ``j`` in ``range(count)``, on ``slots`` parts (at most
    ``THREADS``; ``slot`` names the part, e.g. its scratch) that each take the next task no part has taken yet,
    until none is left. Unlike fixed shares, a core that the OS gives less time (on a shared machine one core
    often runs at half speed) simply runs fewer tasks. For tasks whose result does not depend on the part that
    runs them (each writes its own output, the scratch only holds intermediates), so results still never depend
    on the schedule."""
    if slots <= 1:
        def serial():
            for j in range(count):
                task(0, j)

        return serial

    def part(taken: Iterator[int], slot: int) -> None:
        for j in taken:
            if j >= count:
                return
            task(slot, j)

    def step():
        taken = itertools.count()  # next() is atomic under the GIL: each task goes to exactly one part
        run_parts([functools.partial(part, taken, slot) for slot in range(slots)])

    return step


_BLAS: list | None = None  # per loaded BLAS library: (get, set) of its thread count, found on first use (a scan)


def _blas_controls() -> list[tuple[Callable[[], int], Callable[[int], object]]]:
    """(get threads, set threads) of each BLAS library loaded in the process (threadpoolctl finds them). For
    OpenBLAS on its own threads, its C functions themselves: threadpoolctl's methods cost ~1 us a call in Python
    (symbol look-up, a check of which Python thread controls the library), and kernels switch per call."""
    global _BLAS
    if _BLAS is None:
        from threadpoolctl import ThreadpoolController

        controls = []
        for lib in ThreadpoolController().select(user_api="blas").lib_controllers:
            get = put = None
            if lib.internal_api == "openblas" and getattr(lib, "threading_layer", None) == "pthreads":
                try:  # threadpoolctl's own symbol look-up (prefixed, suffixed names of numpy's OpenBLAS)
                    get = lib._get_symbol("openblas_get_num_threads")
                    put = lib._get_symbol("openblas_set_num_threads")
                except AttributeError:
                    get = put = None
            if get is None or put is None:
                get, put = lib.get_num_threads, lib.set_num_threads
            controls.append((get, put))
        _BLAS = controls
    return _BLAS


class blas_single_threaded:  # noqa: N801 - used as a function: ``with blas_single_threaded():``
    """BLAS on one thread per call while inside, restored on leaving. For kernels that call BLAS from their parts,
    one per core, and for small BLAS calls: on a shared machine a multi-threaded call waits for its descheduled
    helper thread (a 768 x 64 x 768 product measured 24x slower with two OpenBLAS threads than with one under
    load). Process-wide: kernels run one at a time. A library already on one thread is left alone."""

    __slots__ = ("before",)

    def __enter__(self) -> None:
        controls = _blas_controls()
        self.before = before = [get() for get, _ in controls]
        for (_, put), n in zip(controls, before):
            if n != 1:
                put(1)

    def __exit__(self, *exc) -> None:
        for (_, put), n in zip(_BLAS, self.before):
            if n != 1:
                put(n)


# multiply-adds below which a BLAS product runs on the calling thread alone (``blas_for``): a 14-token prompt's
# quantized products (14 x 576 x 192 .. 1536) took 8 ms each with two OpenBLAS threads on a loaded machine, waiting
# for the helper thread, against ~0.1 ms on one; a 64-token prompt's first token took 6.6 s at 2 threads with
# 2^24 here, 0.34 s with 2^27 (1 thread: 0.30 s). Larger products (long prompts) keep BLAS's threads.
SMALL_PRODUCT = 1 << 27


class _Nothing:
    __slots__ = ()

    def __enter__(self) -> None:
        pass

    def __exit__(self, *exc) -> None:
        pass


def blas_for(multiply_adds: int) -> blas_single_threaded | _Nothing:
    """``with blas_for(n):`` BLAS single-threaded inside when a product of ``n`` multiply-adds is too small to
    pay for waking BLAS's threads (``SMALL_PRODUCT``); otherwise BLAS keeps its threads."""
    return blas_single_threaded() if multiply_adds < SMALL_PRODUCT else _Nothing()
