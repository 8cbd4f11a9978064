"""``DequantMatMul`` (FP8, NVFP4) on AMX tiles (``runtimes/cpu/amx/dequant.py``) against numpy's dense f32 product and
against the band path (decode into f32 bands, BLAS per band): GFLOP/s on 1 and 2 threads, and the accuracy
against float64.

Each side runs the numpy runtime's one-kernel program (``bench/matmul.py``'s ``case_dequant``: x an input, the
packed weight and scales bound in place): "ours" with the AMX product, "bands" with it refused (what runs without
AMX or numba); "numpy" is ``np.matmul(x, dense.T)`` on the decoded f32 weight with BLAS on as many threads. The
sides take turns of 3 calls; best and median GFLOP/s, and the median over the turns of numpy's best time over
ours. Default shapes: FLUX.2-dev's text-stream projection (512 x 6144 x 6144), ``bench/matmul.py``'s case,
the medium pipeline's largest, and one row of x (decode-bound: the modulation layers run on one row).

    python bench/amx_dequant.py [--repeats 3] [--threads 1,2] [--shapes 512x6144x6144,...] [--formats fp8,...]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from pathlib import Path

from luminal_recipes.openblas_spin import limit_openblas_spin

limit_openblas_spin()

import numpy as np  # noqa: E402
from threadpoolctl import threadpool_limits  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import matmul as bm  # noqa: E402

from luminal_recipes.graph.dtypes import E2M1_VALUES  # noqa: E402
from luminal_recipes.runtimes.cpu import amx  # noqa: E402
from luminal_recipes.runtimes.cpu import threads as cpu_threads  # noqa: E402
from luminal_recipes.runtimes.cpu.amx import dequant as amx_dequant  # noqa: E402
from luminal_recipes.runtimes.cpu.backend import NumpyRuntime  # noqa: E402

SHAPES = ((512, 6144, 6144), (1024, 2048, 2048), (768, 256, 2304), (1, 6144, 6144))
FORMATS = ("fp8", "nvfp4/modelopt", "nvfp4/comfy")


def decoded(fmt: str, layout: str, weights: dict, n: int, k: int) -> np.ndarray:
    """The f32 weight as ``ops.quant`` decodes it."""
    if fmt == "fp8":
        return weights["w"].astype(np.float32) * weights["s"][:, None]
    codes = weights["w"][:n]
    first, second = (codes & 15, codes >> 4) if layout == "modelopt" else (codes >> 4, codes & 15)
    e2m1 = np.stack([E2M1_VALUES[first], E2M1_VALUES[second]], axis=-1).reshape(n, k)
    scales = weights["ws" if "ws" in weights else "s"].astype(np.float32)
    if layout == "comfy":
        rp, cp = scales.shape
        scales = scales.reshape(rp // 128, cp // 4, 32, 4, 4).transpose(0, 3, 2, 1, 4).reshape(rp, cp)
    return (e2m1 * np.repeat(scales[:n, : k // 16], 16, axis=1)) * weights["s2"]


def turns(calls, repeats: int, block: int = 3) -> list[list[float]]:
    times = [[] for _ in calls]
    for _ in range(repeats):
        for i, call in enumerate(calls):
            call()
            for _ in range(block):
                t = time.perf_counter()
                call()
                times[i].append(time.perf_counter() - t)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3, help="turns of 3 calls per side")
    ap.add_argument("--shapes", default=",".join("x".join(map(str, s)) for s in SHAPES))
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--formats", default=",".join(FORMATS))
    args = ap.parse_args()
    if not amx_dequant.ready():
        raise SystemExit(f"AMX dequant products unavailable: {amx.reason_unavailable() or 'kernel probe failed'}")
    rng = np.random.default_rng(0)
    print("GFLOP/s, best and median of the turns: ours (AMX, 3 tile products) | bands (decode + BLAS) | numpy "
          "(dense f32 weight); ours over numpy and over bands, median of the per-turn ratios of best times; max "
          "|error| vs float64 relative to max |result|, ours and numpy")
    worth_it = amx_dequant.worth_it
    for shape in args.shapes.split(","):
        m, k, n = map(int, shape.split("x"))
        x = rng.standard_normal((m, k)).astype(np.float32)
        for spec in args.formats.split(","):
            fmt, _, layout = spec.partition("/")
            prog, wspec = bm.case_dequant(m, k, n, fmt, layout)
            weights = bm.random_weights(wspec, rng)
            dense = decoded(fmt, layout, weights, n, k).astype(np.float32)
            exact = x.astype(np.float64) @ dense.astype(np.float64).T
            ref = np.empty((m, n), np.float32)
            for threads in map(int, args.threads.split(",")):
                cpu_threads.THREADS = threads
                ours = NumpyRuntime().load(prog, weights)
                amx_dequant.worth_it = lambda *a: False
                bands = NumpyRuntime().load(prog, weights)
                amx_dequant.worth_it = worth_it
                got = ours.run({"x": x})["y"]
                feed = {"x": x}
                sides = [functools.partial(ours.run, feed, copy_outputs=False),
                         functools.partial(bands.run, feed, copy_outputs=False),
                         functools.partial(np.matmul, x, dense.T, out=ref)]
                with threadpool_limits(threads, user_api="blas"):
                    times = turns(sides, args.repeats)
                flops = 2 * m * k * n
                cells = " | ".join(f"{flops / min(t) / 1e9:5.0f} {flops / statistics.median(t) / 1e9:5.0f}"
                                   for t in times)
                over = [statistics.median(min(times[j][r:r + 3]) / min(times[0][r:r + 3])
                                          for r in range(0, len(times[0]), 3)) for j in (2, 1)]
                scale = np.abs(exact).max()
                err = [np.abs(r - exact).max() / scale for r in (got, ref)]
                print(f"{m}x{k}x{n} {spec:15s} t{threads}: {cells}  vs numpy {over[0]:4.2f}x  vs bands "
                      f"{over[1]:4.2f}x  err {err[0]:.1e} {err[1]:.1e}", flush=True)
    print(f"load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
