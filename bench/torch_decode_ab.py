"""The Qwen3-shaped decode step (bench/torch_backend.py's ``qwen3-decode``) through torch.compile(backend="luminal")
as it is (A) and with ``f32_kernels.rows_product`` replaced by the one-row loop it replaced
(``decode_matvec.one_row_product``) while B is compiled and its chains captured (B), beside inductor, in turns in
one process: wall and process CPU time per step, medians and per-round ratios. Each side compiles its own function
(``torch_flux2_ab.side_function``: Dynamo caches a compiled graph on the code object), and each turn calls its side
once untimed before the timed call. The KV cache is copied before every call, outside the timing.

    python bench/torch_decode_ab.py --threads 1 --rounds 15
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
    os.environ.setdefault("LUMINAL_RECIPES_CACHE", tempfile.mkdtemp(prefix="luminal-decode-ab-"))
    sys.path.insert(0, str(BENCH))
    import torch_backend as tb
    from decode_matvec import one_row_product
    from flux2_transformer_cpu import blas_threads
    from torch_flux2_ab import side_function

    threads = blas_threads(args.threads)
    import torch

    from luminal_recipes.runtimes.cpu.jit import f32_kernels

    torch.set_num_threads(threads)
    model, call, prepare = tb.WORKLOADS["qwen3-decode"](torch)
    sides, outputs = {}, {}
    with torch.no_grad():
        sides["A"] = call(torch.compile(side_function(model, "A"), backend="luminal"))
        for _ in range(7):  # past the chain capture (the fifth run)
            prepare()
            outputs["A"] = sides["A"]()
        saved = f32_kernels.rows_product
        f32_kernels.rows_product = one_row_product
        try:
            sides["B"] = call(torch.compile(side_function(model, "B"), backend="luminal"))
            for _ in range(7):
                prepare()
                outputs["B"] = sides["B"]()
        finally:
            f32_kernels.rows_product = saved
        if not args.no_inductor:
            sides["inductor"] = call(torch.compile(side_function(model, "inductor")))
            for _ in range(7):
                prepare()
                outputs["inductor"] = sides["inductor"]()
        prepare()
        eager = call(model.forward)()
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
    print(f"decode step A/B ({threads} threads, {args.rounds} rounds; B: the one-row rows_product; load average "
          f"{os.getloadavg()[0]:.2f})")
    for k in sides:
        print(f"  {k:9s} wall median {statistics.median(wall[k]) * 1e3:6.1f} ms (min {min(wall[k]) * 1e3:6.1f})  "
              f"cpu median {statistics.median(cpu[k]) * 1e3:6.1f} ms")
    for a, b in (("A", "B"), ("A", "inductor"), ("B", "inductor"))[:1 if args.no_inductor else 3]:
        rw = [x / y for x, y in zip(wall[a], wall[b])]
        rc = [x / y for x, y in zip(cpu[a], cpu[b])]
        print(f"  {a}/{b}: wall {statistics.median(rw):.3f}x (rounds {min(rw):.2f}-{max(rw):.2f})  "
              f"cpu {statistics.median(rc):.3f}x")
    for k in sides:
        print(f"  max |{k} - eager| = {(outputs[k].double() - eager.double()).abs().max().item():.3g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
