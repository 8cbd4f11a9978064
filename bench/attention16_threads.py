"""The 16-dim attention kernel alone (``jit/attention_small.py``) on the tiny FLUX.2 transformer's shape (4 heads x
1088 tokens, token-major views of a fused projection), on 1 and 2 threads, in turns in one process, as
``kernels/attention_small.py`` runs it (a Python call of ``attention16`` per (head, block of query rows) task,
taken in turn by the parts, ``threads.claimed``) with 3 blocks a head (what the plan makes for this shape) and
17 (64-row tasks). Beside them, whether the machine gave this process two cores: two compiled busy loops on two
threads against one (a ratio near 1.0: two cores; near 2.0: other jobs hold one - each shell session is its own
scheduling group, so ``nice`` elsewhere does not hand the core back).

    python bench/attention16_threads.py --rounds 80
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time

import numpy as np

from luminal_recipes.runtimes.cpu import jit
from luminal_recipes.runtimes.cpu import threads as cpu_threads

H, S, D = 4, 1088, 16


def two_cores() -> float:
    """Two threads' busy loops over one's, wall time (1.0: two free cores)."""
    import numba

    @numba.njit(nogil=True)
    def busy(n):
        s = 0.0
        for i in range(n):
            s += (i * 1.0) ** 0.5
        return s

    busy(10)
    t0 = time.perf_counter()
    busy(10_000_000)
    one = time.perf_counter() - t0
    workers = [threading.Thread(target=busy, args=(10_000_000,)) for _ in range(2)]
    t0 = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return (time.perf_counter() - t0) / one


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=60)
    args = parser.parse_args(argv)
    jit.kernels()
    from luminal_recipes.runtimes.cpu.jit import attention_small as kernels

    rng = np.random.default_rng(0)
    qkv = rng.standard_normal((S, 3, H, D)).astype(np.float32)
    q, k, v = (qkv[:, i].transpose(1, 0, 2) for i in range(3))
    scale = np.float32(0.25)

    def aligned(shape):  # on a cache line, as the runtime's scratch (kernels/context.py ALIGNMENT): numpy's own
        # arrays may start 16 bytes into one, which splits every 64-byte load of the keys and values (~10% slower)
        n = int(np.prod(shape))
        raw = np.zeros(n + 16, np.float32)
        first = (-(raw.ctypes.data % 64) // 4) % 16
        return raw[first:first + n].reshape(shape)

    def scratch(slots):
        return [[aligned(shape) for shape in ((D, S), (S, D), (4, S), (4, D))] for _ in range(slots)]

    def claimed(slots, blocks):  # attention_small.prepare's tasks: 3 blocks a head here (12 tasks of ~363 rows)
        out = np.zeros((H, S, D), np.float32)
        bounds = [S * i // blocks for i in range(blocks + 1)]
        tasks = [(h, bounds[b], bounds[b + 1]) for h in range(H) for b in range(blocks)]
        bufs, held = scratch(slots), [-1] * slots

        def task(slot, j):
            h, first, end = tasks[j]
            kernels.attention16(q, k, v, out, h, first, end, held[slot] != h, scale, *bufs[slot])
            held[slot] = h

        step = cpu_threads.claimed(len(tasks), slots, task)

        def run():
            held[:] = [-1] * slots
            step()

        return run, out

    cpu_threads.THREADS = max(2, cpu_threads.THREADS)
    sides = {f"{blocks} blocks, {n} thread{'s' * (n > 1)}": claimed(n, blocks) for blocks in (3, 17) for n in (1, 2)}
    for run, _ in sides.values():
        for _ in range(5):
            run()
    first = next(iter(sides.values()))[1]
    assert all(np.array_equal(first, out) for _, out in sides.values())  # the same bits on every schedule
    wall = {name: [] for name in sides}
    cores = two_cores()
    for _ in range(args.rounds):
        for name, (run, _) in sides.items():
            t0 = time.perf_counter()
            run()
            wall[name].append(time.perf_counter() - t0)
    cores = (cores + two_cores()) / 2
    print(f"attention 4 x 1088 x 16, {args.rounds} rounds; load average {os.getloadavg()[0]:.2f}; two threads' "
          f"busy loops {cores:.2f}x one's (1.0: two free cores)")
    for name, w in wall.items():
        print(f"  {name:22s} wall median {statistics.median(w) * 1e3:6.2f} ms (min {min(w) * 1e3:6.2f})")
    for a, b in (("3 blocks, 2 threads", "3 blocks, 1 thread"), ("17 blocks, 2 threads", "17 blocks, 1 thread"),
                 ("17 blocks, 2 threads", "3 blocks, 2 threads")):
        r = [x / y for x, y in zip(wall[a], wall[b])]
        print(f"  {a} / {b}: {statistics.median(r):.3f}x (rounds {min(r):.2f}-{max(r):.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
