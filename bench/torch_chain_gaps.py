"""Where a compiled torch model's CPU replay spends its time: each chain (``runtimes/cpu/jit/chain.py``) and each
step left outside the chains, timed inside the replay itself (wall and thread CPU per item, summed over rounds),
so the steps that run on one thread while the chains use every core are found by cost. The tiny FLUX.2 forward of
``bench/torch_backend.py`` by default.

    python bench/torch_chain_gaps.py --threads 2 --rounds 20 [--workload flux2] [--top 20]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from luminal_recipes.openblas_spin import limit_openblas_spin

limit_openblas_spin()
BENCH = Path(__file__).resolve().parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--workload", default="flux2")
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args(argv)
    os.environ.setdefault("LUMINAL_RECIPES_CACHE", tempfile.mkdtemp(prefix="luminal-chain-gaps-"))
    sys.path.insert(0, str(BENCH))
    import torch_backend as tb
    from flux2_transformer_cpu import blas_threads

    threads = blas_threads(args.threads)
    import torch

    from luminal_recipes.runtimes import executable
    from luminal_recipes.runtimes.cpu.jit import chain

    torch.set_num_threads(threads)
    labels: dict[int, str] = {}
    original = executable.Executable._capture

    def capture(self):  # each step's kernel name, for the table
        for step, label in zip(self._steps, self._labels):
            labels[id(step)] = label
        return original(self)

    executable.Executable._capture = capture
    seconds = defaultdict(float)
    cpu = defaultdict(float)
    count = defaultdict(int)
    original_capture = chain.capture

    def timed_capture(steps, n, buffers=None):
        replay = original_capture(steps, n, buffers)
        if replay is None:
            return None
        timed_items = []
        for step in steps:  # steps outside the chains (chains are timed through _Chain.run below)
            if chain.phases_of(step) is None:
                name = f"outside: {labels.get(id(step), '(write-back)')}"

                def wrapped(step=step, name=name):
                    c0, t0 = time.thread_time(), time.perf_counter()
                    step()
                    seconds[name] += time.perf_counter() - t0
                    cpu[name] += time.thread_time() - c0
                    count[name] += 1

                timed_items.append((step, wrapped))
        return replay, dict((id(s), w) for s, w in timed_items)

    chain.capture = lambda steps, n, buffers=None: _install(timed_capture(steps, n, buffers), steps, n, buffers)

    def _install(got, steps, n, buffers=None):
        if got is None:
            return None
        _, wrappers = got
        # rebuild the replay with the wrapped steps (the same chains as capture makes)
        wrapped_steps = [wrappers.get(id(s), s) for s in steps]
        for w, s in zip(wrapped_steps, steps):
            if w is not s:
                w.__dict__.update(getattr(s, "__dict__", {}))
        return original_capture(wrapped_steps, n, buffers)

    run = chain._Chain.run

    def chain_run(self):
        name = f"chain of {len(self.steps)} steps ({'lockstep' if self.threads > 1 else 'alone'})"
        c0, t0 = time.process_time(), time.perf_counter()  # (process CPU: a lockstep chain's threads too)
        run(self)
        seconds[name] += time.perf_counter() - t0
        cpu[name] += time.process_time() - c0
        count[name] += 1

    chain._Chain.run = chain_run
    model, call, prepare = tb.WORKLOADS[args.workload](torch)
    with torch.no_grad():
        fn = call(torch.compile(model.forward, backend="luminal"))
        for _ in range(8):
            if prepare:
                prepare()
            fn()
        seconds.clear(), cpu.clear(), count.clear()
        t0 = time.perf_counter()
        for _ in range(args.rounds):
            if prepare:
                prepare()
            fn()
        total = (time.perf_counter() - t0) / args.rounds
    rows = sorted(seconds, key=seconds.get, reverse=True)
    grouped = defaultdict(lambda: [0.0, 0.0, 0])
    for name in rows:
        g = grouped[name if name.startswith("chain") else name]
        g[0] += seconds[name]
        g[1] += cpu.get(name, 0.0)
        g[2] += count[name]
    print(f"{args.workload}: {threads} threads, {args.rounds} rounds, forward {total * 1e3:.2f} ms wall; "
          f"chain runs {chain.RUNS}; load average {os.getloadavg()[0]:.2f}")
    outside = sum(v[0] for k, v in grouped.items() if k.startswith("outside")) / args.rounds
    inside = sum(v[0] for k, v in grouped.items() if k.startswith("chain")) / args.rounds
    print(f"  chains {inside * 1e3:.2f} ms, outside {outside * 1e3:.2f} ms a forward")
    for name in sorted(grouped, key=lambda k: grouped[k][0], reverse=True)[:args.top]:
        s, c, n = grouped[name]
        print(f"  {s / args.rounds * 1e3:8.3f} ms wall {c / args.rounds * 1e3:8.3f} ms cpu  "
              f"{n // args.rounds:3d}x  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
