"""The Qwen3-shaped decode step (bench/torch_backend.py's ``qwen3-decode``) through torch.compile(backend="luminal")
with its KV-cache inputs read in place and its outputs written into fresh memory (``runtimes/direct_io.py``: A) and
with the same executable copying every input into the arena and every output out of it (its ``DirectIO`` taken
away: B), beside inductor, in turns in one process: one compiled program for A and B, so the difference is the
copies alone. Wall and process CPU time per step, medians and per-round ratios; each turn calls its side once
untimed before the timed call. The KV cache is copied before every call, outside the timing. A and B's outputs
are compared bit for bit.

    python bench/torch_direct_io_ab.py --threads 1 --rounds 15
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from luminal_recipes.openblas_spin import limit_openblas_spin

limit_openblas_spin()
BENCH = Path(__file__).resolve().parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--no-inductor", action="store_true")
    args = parser.parse_args(argv)
    os.environ.setdefault("LUMINAL_RECIPES_CACHE", tempfile.mkdtemp(prefix="luminal-direct-io-ab-"))
    sys.path.insert(0, str(BENCH))
    import torch_backend as tb
    from flux2_transformer_cpu import blas_threads
    from torch_flux2_ab import side_function

    threads = blas_threads(args.threads)
    import torch

    from luminal_recipes.torch_backend import compiled

    torch.set_num_threads(threads)
    model, call, prepare = tb.WORKLOADS["qwen3-decode"](torch)
    graphs = []
    original = compiled.CompiledGraph.__call__

    def spy(self, *a):
        if self not in graphs:
            graphs.append(self)
        return original(self, *a)

    compiled.CompiledGraph.__call__ = spy
    with torch.no_grad():
        ours = call(torch.compile(side_function(model, "ours"), backend="luminal"))
        for _ in range(7):  # past the chain capture (the fifth run)
            prepare()
            ours()
        exe = next(iter(graphs[-1].engine._executables.values()))
        direct = exe._direct
        if direct is None:
            print("no direct I/O for this program (LUMINAL_RECIPES_DIRECT_IO=0, or nothing relocatable)")
            return 1
        print(f"direct I/O: {len(direct.inputs)} inputs read in place, {len(direct.names)} outputs written fresh")
        for name, why in sorted(direct.refused.items()):
            print(f"  copied: {name} ({why})")

        def side(on: bool):
            def run():
                exe._direct = direct if on else None
                return ours()
            return run

        sides = {"A": side(True), "B": side(False)}
        if not args.no_inductor:
            sides["inductor"] = call(torch.compile(side_function(model, "inductor")))
            for _ in range(7):
                prepare()
                sides["inductor"]()
        outputs = {}
        for k in ("A", "B"):
            prepare()
            outputs[k] = sides[k]()
        wall = {k: [] for k in sides}
        cpu = {k: [] for k in sides}
        for _ in range(args.rounds):
            for k, fn in sides.items():
                prepare()
                fn()
                prepare()
                c0, t0 = time.process_time(), time.perf_counter()
                fn()
                wall[k].append(time.perf_counter() - t0)
                cpu[k].append(time.process_time() - c0)
        exe._direct = direct
    print(f"decode step A/B ({threads} threads, {args.rounds} rounds; A: direct I/O, B: copies; load average "
          f"{os.getloadavg()[0]:.2f})")
    for k in sides:
        print(f"  {k:9s} wall median {statistics.median(wall[k]) * 1e3:6.1f} ms (min {min(wall[k]) * 1e3:6.1f})  "
              f"cpu median {statistics.median(cpu[k]) * 1e3:6.1f} ms")
    for a, b in (("A", "B"), ("A", "inductor"), ("B", "inductor"))[:1 if args.no_inductor else 3]:
        rw = [x / y for x, y in zip(wall[a], wall[b])]
        rc = [x / y for x, y in zip(cpu[a], cpu[b])]
        print(f"  {a}/{b}: wall {statistics.median(rw):.3f}x (rounds {min(rw):.2f}-{max(rw):.2f})  "
              f"cpu {statistics.median(rc):.3f}x")
    print(f"  A and B bit-identical: {torch.equal(outputs['A'], outputs['B'])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
