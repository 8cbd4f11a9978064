"""Each chain of a compiled torch model's CPU replay (``runtimes/cpu/jit/chain.py``) run on its own, in turns: on
the calling thread alone, in lockstep handed to ``threads.blocking_pool()`` (a wake-up and two GIL trips per
chain), and in lockstep as compiled jobs of the kernels' spinning pool workers (``jit/lockstep.py``). Medians per
chain; ``--mode`` the pool jobs: ``hot`` runs them back to back after the others' turns (the worker still spinning
from the last one: the hand-off's floor), ``turns`` in the same rotation as the others (the worker may have gone
to sleep meanwhile). Chains are captured with ``--min-split-phases`` and ``--chain-min-part`` (finer parts), and
run in lockstep even on a loaded machine (``LUMINAL_RECIPES_CHAIN_LOCKSTEP=always``). The tiny FLUX.2 forward of
``bench/torch_backend.py`` by default.

    python bench/chain_lockstep.py --min-split-phases 1 --chain-min-part 8192 [--runs 200] [--workload flux2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ["LUMINAL_RECIPES_CHAIN_LOCKSTEP"] = "always"
from luminal_recipes.openblas_spin import limit_openblas_spin  # noqa: E402

limit_openblas_spin()
BENCH = Path(__file__).resolve().parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="flux2")
    parser.add_argument("--min-split-phases", type=int, default=1)
    parser.add_argument("--chain-min-part", type=int, default=8192)
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--mode", choices=("hot", "turns"), default="hot")
    args = parser.parse_args(argv)
    os.environ.setdefault("LUMINAL_RECIPES_CACHE", tempfile.mkdtemp(prefix="luminal-chain-lockstep-"))
    sys.path.insert(0, str(BENCH))
    import torch_backend as tb
    from flux2_transformer_cpu import blas_threads

    threads = blas_threads(2)
    import torch

    from luminal_recipes.runtimes.cpu import threads as cpu_threads
    from luminal_recipes.runtimes.cpu.jit import chain

    torch.set_num_threads(threads)
    chain.MIN_SPLIT_PHASES, cpu_threads.CHAIN_MIN_PART = args.min_split_phases, args.chain_min_part
    made: list = []
    init = chain._Chain.__init__

    def keep(self, steps, n):
        init(self, steps, n)
        made.append(self)

    chain._Chain.__init__ = keep
    model, call, prepare = tb.WORKLOADS[args.workload](torch)
    with torch.no_grad():
        fn = call(torch.compile(model.forward, backend="luminal"))
        for _ in range(7):
            if prepare:
                prepare()
            fn()
    print(f"{args.workload}: {threads} threads, min split phases {args.min_split_phases}, chain min part "
          f"{args.chain_min_part}, pool jobs {args.mode}; load average {os.getloadavg()[0]:.2f}")
    print("  steps  rows barriers |   alone  blocking  pool jobs (us, medians)")
    totals = [0.0, 0.0, 0.0]
    for c in made:
        if not c.ok or c.threads == 1:
            continue
        program = c.layouts[c.threads][0]

        def alone(c=c):
            c.run_fn(0, *c.args[1])

        def blocking(c=c):
            c.flags[:] = 0
            chain._lockstep_pool().run(c.parts)

        def jobs(c=c):
            c.flags[:] = 0
            c._lockstep()

        times: dict = {alone: [], blocking: [], jobs: []}
        with cpu_threads.blas_single_threaded():  # (as ``_Chain.run`` runs a chain of BLAS calls)
            turn = (alone, blocking) if args.mode == "hot" else (alone, blocking, jobs)
            for _ in range(args.runs):
                for f in turn:
                    t0 = time.perf_counter()
                    f()
                    times[f].append(time.perf_counter() - t0)
            for _ in range(args.runs if args.mode == "hot" else 0):
                t0 = time.perf_counter()
                jobs()
                times[jobs].append(time.perf_counter() - t0)
        med = [statistics.median(times[f]) * 1e6 for f in (alone, blocking, jobs)]
        totals = [a + b for a, b in zip(totals, med)]
        print(f"  {len(c.steps):5d} {len(program):5d} {int((program[:, 0] == chain.BARRIER).sum()):8d} | "
              f"{med[0]:7.1f} {med[1]:9.1f} {med[2]:10.1f}")
    print(f"  all lockstep chains: alone {totals[0]:.0f} us, blocking {totals[1]:.0f} us, pool jobs {totals[2]:.0f} us"
          f"; load average {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
