"""``cpu_threads.claimed``: parts that take tasks in turn."""

from __future__ import annotations

import threading
import time

import pytest

from luminal_recipes.runtimes.cpu import threads as cpu_threads


@pytest.mark.parametrize(("count", "slots"), [(0, 2), (1, 1), (5, 1), (7, 2), (20, 3)])
def test_claimed_runs_every_task_once(count, slots):
    ran = []
    lock = threading.Lock()

    def task(slot, j):
        with lock:
            ran.append((slot, j))

    step = cpu_threads.claimed(count, slots, task)
    for _ in range(3):  # a step runs again from the first task
        ran.clear()
        step()
        assert sorted(j for _, j in ran) == list(range(count))
        assert all(0 <= slot < max(slots, 1) for slot, _ in ran)


def test_claimed_lets_a_fast_part_take_what_a_slow_one_has_not_started():
    """A part held up (here: sleeping in its first task, as a core the OS gives to another job) takes no more
    tasks while the other part runs the rest."""
    taken = {0: 0, 1: 0}

    def task(slot, j):
        taken[slot] += 1
        if slot == 1:
            time.sleep(0.3)

    cpu_threads.claimed(40, 2, task)()
    assert taken[0] + taken[1] == 40 and taken[1] <= 1, taken


def test_claimed_raises_a_tasks_error():
    def task(slot, j):
        if j == 3:
            raise ValueError("task 3")

    with pytest.raises(ValueError, match="task 3"):
        cpu_threads.claimed(8, 2, task)()


def _pools():
    from luminal_recipes.runtimes.cpu import jit

    pools = [cpu_threads._Pool()]
    if jit.AVAILABLE:
        from luminal_recipes.runtimes.cpu.jit import spin

        pools.append(cpu_threads._SpinningPool(spin))
    return pools


@pytest.mark.parametrize("kind", ["blocking", "spinning"])
def test_pool_hands_parts_to_workers_and_wakes_sleeping_ones(kind, monkeypatch):
    """Every part runs exactly once per call, whoever runs it; a worker takes its part while the caller is busy
    with its own (here: the caller's part waits until the worker's has run), also after the worker went to sleep
    (past ``SPIN_S`` without parts); results of many calls in a row and errors reach the caller."""
    pools = _pools()
    if kind == "spinning" and len(pools) == 1:
        pytest.skip("no numba: only the blocking pool")
    monkeypatch.setattr(cpu_threads, "SPIN_S", 1e-3)
    pool = pools[0] if kind == "blocking" else cpu_threads._SpinningPool(pools[1].spin)
    for rounds, nap in ((200, 0.0), (3, 0.02)):  # back to back (spinning workers), then asleep between calls
        for r in range(rounds):
            done = [0, 0, 0]
            ran_by = {}
            started = threading.Event()

            def mine(done=done, started=started):
                assert started.wait(10)  # the workers' parts run while the caller's has not finished
                done[0] += 1

            def theirs(k, done=done, ran_by=ran_by, started=started):
                ran_by[k] = threading.current_thread().name
                done[k] += 1
                if k == 2:
                    started.set()

            pool.run([mine, lambda: theirs(1), lambda: theirs(2)])
            assert done == [1, 1, 1], (r, done)
            assert ran_by[2] != threading.current_thread().name  # (part 1 may be the caller's, once it is done)
            time.sleep(nap)
    with pytest.raises(ValueError, match="part 1"):
        pool.run([lambda: None, lambda: (_ for _ in ()).throw(ValueError("part 1"))])
    done = []
    pool.run([lambda: done.append(0), lambda: done.append(1)])  # still usable after an error
    assert sorted(done) == [0, 1]


def test_blas_for_small_products_runs_blas_on_one_thread():
    """A product below ``SMALL_PRODUCT`` multiply-adds runs BLAS single-threaded (restored after); a large one
    keeps BLAS's threads."""
    controls = cpu_threads._blas_controls()
    if not controls:
        pytest.skip("no BLAS library found by threadpoolctl")
    get, put = controls[0]
    before = get()
    put(2)
    try:
        with cpu_threads.blas_for(cpu_threads.SMALL_PRODUCT - 1):
            assert get() == 1
        assert get() == 2
        with cpu_threads.blas_for(cpu_threads.SMALL_PRODUCT):
            assert get() == 2
    finally:
        put(before)


def _spin_module():
    from luminal_recipes.runtimes.cpu import jit

    if not jit.AVAILABLE:
        pytest.skip("no numba: only the blocking pool")
    from luminal_recipes.runtimes.cpu.jit import spin

    return spin


class _Unstarted(cpu_threads._SpinningPool):
    """A pool whose workers are never scheduled (their slots exist, their threads do not run): the caller must run
    every part itself. ``start()`` lets them run later. The machine's load is not sampled (``running``)."""

    def __init__(self, spin, spin_s, running=None):
        super().__init__(spin, spin_s)
        self.sample = lambda: running

    def _grow(self, workers):
        while len(self.wakes) < workers:
            self.parts.append(None)
            self.errors.append(None)
            self.wakes.append(__import__("queue").SimpleQueue())

    def start(self):
        for i in range(len(self.wakes)):
            threading.Thread(target=self._work, args=(i,), daemon=True).start()


def test_spinning_pool_never_loses_a_part_of_a_descheduled_worker():
    """Workers that never get a core: every part still runs exactly once (on the caller), the calls return; after
    a few such calls (posted to spinning workers that did not take them) the pool stops spinning; workers that
    start late run no stale part again and take later parts."""
    pool = _Unstarted(_spin_module(), 1e-3)
    ran = []
    for r in range(5):
        pool.run([lambda r=r: ran.append((r, 0)), lambda r=r: ran.append((r, 1)), lambda r=r: ran.append((r, 2))])
    assert sorted(ran) == [(r, k) for r in range(5) for k in range(3)]
    assert pool.spin_ns == 0 and pool.backoffs == 1  # 3 missed hand-offs: spinning did not pay
    pool.start()
    time.sleep(0.05)  # (the workers find nothing to run: the parts posted so far were all claimed)
    assert len(ran) == 15
    pool.backoff_until = 0.0  # back-off over: the next call spins again
    for _ in range(35):
        done = [0, 0]
        pool.run([lambda d=done: d.__setitem__(0, d[0] + 1), lambda d=done: d.__setitem__(1, d[1] + 1)])
        assert done == [1, 1]
    assert pool.spin_ns in (0, pool.base_ns)


def test_spinning_pool_caller_sleeps_until_a_slow_part_finishes():
    """A worker's part that outlasts the caller's spin (``WAIT_S``): the caller sleeps and the worker wakes it;
    its result is there when ``run`` returns, every time (also when the workers sleep between calls)."""
    pool = cpu_threads._SpinningPool(_spin_module(), 200e-6)
    pool.sample = lambda: None
    for nap in (0.0, 0.01):
        for _ in range(3):
            out = []
            started = threading.Event()

            def slow(out=out, started=started):
                started.set()
                time.sleep(0.03)
                out.append("worker")

            pool.run([lambda started=started: started.wait(5), slow])
            assert out == ["worker"]
            time.sleep(nap)


def test_spinning_pool_backs_off_and_recovers(monkeypatch):
    """Preempted spins reported by workers count as events; while backed off workers sleep at once; when the
    back-off ends the pool spins again, and each back-off in a row lasts twice the one before (up to the most)."""
    pool = _Unstarted(_spin_module(), 1e-3)
    clock = [100.0]
    monkeypatch.setattr(cpu_threads.time, "monotonic", lambda: clock[0])
    pool.preempted = 3
    pool.run([lambda: None])  # (one part: no workers posted)
    assert pool.spin_ns == 0 and pool.backoff_until == 100.0 + cpu_threads.BACKOFF_S[0]
    clock[0] += cpu_threads.BACKOFF_S[0]
    pool.run([lambda: None])
    assert pool.spin_ns == pool.base_ns
    pool.preempted += 3
    pool.run([lambda: None])
    assert pool.spin_ns == 0 and pool.backoff_until == clock[0] + 2 * cpu_threads.BACKOFF_S[0]


def test_spinning_pool_off_while_the_machine_is_crowded(monkeypatch):
    """Other threads ready to run (``/proc/loadavg``'s count less the caller and awake workers, averaged) leave
    too few cores: workers sleep at once; spinning resumes once they would fit again; no sample (no such file):
    spinning stays on."""
    assert cpu_threads.ASLEEP == _spin_module().ASLEEP
    samples = []
    pool = _Unstarted(_spin_module(), 1e-3)
    pool.sample = lambda: samples[-1]
    pool.cpus = 2
    clock = [0.0]
    monkeypatch.setattr(cpu_threads.time, "monotonic", lambda: clock[0])

    def call(running):
        samples.append(running)
        clock[0] += cpu_threads.CROWD_EVERY_S
        pool.run([lambda: None])
        return pool.spin_ns

    assert call(2) == pool.base_ns
    assert [call(9) for _ in range(4)] == [0] * 4 and pool.crowdings == 1
    assert all(call(1) == 0 for _ in range(2))  # the average takes a few samples to come down
    assert [call(1) for _ in range(10)][-1] == pool.base_ns and pool.crowdings == 1
    pool.sample = lambda: None
    assert call(0) == pool.base_ns


def _run_child(code: str, env: dict) -> str:
    import os
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


@pytest.mark.parametrize("kept", [64, 0])
def test_own_running_threads_read_from_proc(monkeypatch, kept):
    """``/proc/self/task``: a thread hashing a large buffer (without the GIL) is ready to run, a thread waiting on
    an event is not; ``others_running`` leaves them out of the machine's count and reads them only when it has to.
    The same with the threads' files kept open (``KEPT_TASKS``) or, past that many threads, read afresh (none
    left open)."""
    import hashlib
    import os

    if not os.path.isdir("/proc/self/task"):
        pytest.skip("no /proc/self/task")
    monkeypatch.setattr(cpu_threads, "KEPT_TASKS", kept)
    stop, idle = threading.Event(), threading.Event()
    data = bytes(1 << 24)

    def hashing():
        while not stop.is_set():
            hashlib.sha256(data).digest()

    def samples():
        seen = []
        for _ in range(40):
            seen.append(cpu_threads._own_running_threads())
            time.sleep(0.002)
        return seen

    waiters = [threading.Thread(target=idle.wait) for _ in range(3)]
    busy = threading.Thread(target=hashing)
    for thread in waiters:
        thread.start()
    try:
        assert min(samples()) == 1  # this thread; never the three waiting
        busy.start()
        assert max(samples()) >= 2  # and the hashing one
        assert bool(cpu_threads._TASKS) == (kept > 0)
    finally:
        stop.set()
        idle.set()
        for thread in (*waiters, busy):
            if thread.is_alive():
                thread.join()


def test_own_running_threads_keep_their_files_open(monkeypatch):
    """Sampled every ``CROWD_EVERY_S`` in a decode step's cold Python: while the threads stay the same a sample opens
    no file and lists nothing (each thread's ``stat`` is read again where it was kept open); a thread started
    since is listed and counted at once, one that ended is dropped, and the count is a fresh listing's."""
    import os

    if not os.path.isdir("/proc/self/task"):
        pytest.skip("no /proc/self/task")
    cpu_threads._own_running_threads()  # (this process's threads listed)
    opened, listed = [], []
    real_open, real_listdir = os.open, os.listdir
    monkeypatch.setattr(os, "open", lambda path, *a, **k: opened.append(path) or real_open(path, *a, **k))
    monkeypatch.setattr(os, "listdir", lambda path: listed.append(path) or real_listdir(path))
    for _ in range(5):
        assert cpu_threads._own_running_threads() >= 1  # (this thread)
    assert not opened and not listed
    stop = threading.Event()
    data = bytes(1 << 24)

    def hashing():  # ready to run all the time (hashlib lets go of the GIL)
        import hashlib

        while not stop.is_set():
            hashlib.sha256(data).digest()

    busy = threading.Thread(target=hashing)
    busy.start()
    try:
        seen = []
        for _ in range(40):
            seen.append(cpu_threads._own_running_threads())
            time.sleep(0.002)
        assert max(seen) >= 2  # this thread and the new one
        assert listed and f"/proc/self/task/{busy.native_id}/stat" in opened
    finally:
        stop.set()
        busy.join()
    tid = str(busy.native_id)
    for _ in range(500):  # (the joined thread leaves the listing moments after)
        if tid not in real_listdir("/proc/self/task"):
            break
        time.sleep(0.001)
    cpu_threads._own_running_threads()
    assert tid not in cpu_threads._TASKS and sorted(cpu_threads._TASKS) == sorted(real_listdir("/proc/self/task"))


def test_own_running_threads_in_a_forked_child():
    """A forked child has one thread: its samples count its own, not the files of its parent's threads (those it
    inherited are closed at the fork)."""
    import os

    if not os.path.isdir("/proc/self/task") or not hasattr(os, "fork"):
        pytest.skip("no /proc/self/task or fork")
    stop = threading.Event()
    data = bytes(1 << 24)

    def hashing():
        import hashlib

        while not stop.is_set():
            hashlib.sha256(data).digest()

    busy = [threading.Thread(target=hashing) for _ in range(2)]
    for thread in busy:
        thread.start()
    try:
        assert max(cpu_threads._own_running_threads() for _ in range(20)) >= 2  # (their files open here)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: one thread
            try:
                inherited = len(cpu_threads._TASKS)  # (closed at the fork)
                counts = [cpu_threads._own_running_threads() for _ in range(20)]
                os.write(write, bytes([inherited, max(counts), len(cpu_threads._TASKS)]))
            finally:
                os._exit(0)
        os.close(write)
        got = os.read(read, 3)
        os.close(read)
        os.waitpid(pid, 0)
    finally:
        stop.set()
        for thread in busy:
            thread.join()
    assert list(got) == [0, 1, 1]


def test_others_running_leaves_this_process_out(monkeypatch):
    reads = []
    monkeypatch.setattr(cpu_threads, "_own_running_threads", lambda: reads.append(1) or 3)
    assert cpu_threads.others_running(2, 2) == 0 and not reads  # no more than ours: /proc not read
    assert cpu_threads.others_running(5, 1) == 2 and len(reads) == 1  # 5 ready, 3 of them this process's
    assert cpu_threads.others_running(5, 4) == 1  # at least the ones known to run
    monkeypatch.setattr(cpu_threads, "_own_running_threads", lambda: None)  # no /proc/self/task
    assert cpu_threads.others_running(5, 1) == 4


@pytest.mark.parametrize(("spin_us", "expected"), [("0", "_Pool"), (None, "_SpinningPool"), ("50", "_SpinningPool")])
def test_pool_chosen_by_environment(spin_us, expected):
    """``LUMINAL_RECIPES_SPIN_US=0``: workers sleep between parts (``_Pool``); unset or N: the spinning pool where
    numba runs. Either way ``run_parts`` runs every part once, results in order, also ``claimed`` tasks."""
    code = (
        "from luminal_recipes.runtimes.cpu import threads as t, jit\n"
        "out = [0] * 4\n"
        "for r in range(50):\n"
        "    t.run_parts([lambda i=i: out.__setitem__(i, out[i] + 1) for i in range(4)])\n"
        "got = []\n"
        "t.claimed(30, 3, lambda slot, j: got.append(j))()\n"
        "assert out == [50] * 4 and sorted(got) == list(range(30)), (out, got)\n"
        "print(type(t._POOL).__name__, jit.AVAILABLE)\n")
    env = {"LUMINAL_RECIPES_THREADS": "4"}
    if spin_us is not None:
        env["LUMINAL_RECIPES_SPIN_US"] = spin_us
    name, available = _run_child(code, env).split()
    assert name == (expected if available == "True" else "_Pool")


def test_pool_after_fork():
    """A forked child has none of its parent's worker threads: its first ``run_parts`` starts its own pool (the
    parent's, spinning or asleep, is not used) and runs every part."""
    code = (
        "import os, signal\n"
        "from luminal_recipes.runtimes.cpu import threads as t\n"
        "out = []\n"
        "t.run_parts([lambda: out.append(0), lambda: out.append(1)])\n"
        "parent_pool = t._POOL\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    signal.alarm(30)\n"
        "    got = []\n"
        "    for r in range(20):\n"
        "        t.run_parts([lambda: got.append(0), lambda: got.append(1)])\n"
        "    os._exit(0 if sorted(got) == [0] * 20 + [1] * 20 and t._POOL is not parent_pool else 3)\n"
        "_, status = os.waitpid(pid, 0)\n"
        "t.run_parts([lambda: out.append(0), lambda: out.append(1)])\n"
        "print(os.waitstatus_to_exitcode(status), sorted(out))\n")
    assert _run_child(code, {"LUMINAL_RECIPES_THREADS": "2"}) == "0 [0, 0, 1, 1]"


def test_spinning_pool_after_an_interrupted_wait():
    """The caller interrupted while it sleeps waiting for a worker (Ctrl-C): the pool stays usable; the worker's
    part, finished late, changes nothing of the calls after it, which run every part once."""
    pool = cpu_threads._SpinningPool(_spin_module(), 200e-6)
    pool.sample = lambda: None
    started, release = threading.Event(), threading.Event()
    real = pool.caller_wake

    class Interrupting:
        raised = False

        def get(self):
            if not Interrupting.raised:
                Interrupting.raised = True
                raise KeyboardInterrupt
            return real.get()

        def put(self, item):
            real.put(item)

    pool.caller_wake = Interrupting()

    def slow():
        started.set()
        assert release.wait(10)

    with pytest.raises(KeyboardInterrupt):
        pool.run([lambda: started.wait(10), slow])
    out = []
    pool.run([lambda: out.append(0), lambda: (release.set(), out.append(1))])  # the worker is still busy
    for _ in range(50):
        pool.run([lambda: out.append(0), lambda: out.append(1)])
    assert sorted(out) == [0] * 51 + [1] * 51


def test_spinning_pool_more_parts_than_it_has_flags_for(monkeypatch):
    """More parts than ``MAX_WORKERS + 1`` (``--threads`` in the hundreds): the call goes to a blocking pool,
    every part still runs once."""
    monkeypatch.setattr(cpu_threads, "MAX_WORKERS", 2)
    monkeypatch.setattr(cpu_threads, "_CALLER", 2 * cpu_threads._STRIDE)
    pool = cpu_threads._SpinningPool(_spin_module(), 1e-4)
    pool.sample = lambda: None
    for n in (2, 3, 6):
        out = [0] * n
        pool.run([lambda i=i, out=out: out.__setitem__(i, out[i] + 1) for i in range(n)])
        assert out == [1] * n
    assert isinstance(pool.overflow, cpu_threads._Pool) and len(pool.wakes) == 2
