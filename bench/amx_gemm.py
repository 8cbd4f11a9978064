"""The AMX f32 product (``runtimes/cpu/amx/gemm.py``, bf16x3) against numpy's BLAS and PyTorch's ``mm`` on the
medium FLUX.2 step's MatMul shapes: GFLOP/s on 1 and 2 threads, and the accuracy against float64.

Ours on 2 threads is two parts on ``cpu_threads``' workers (each part single-threaded, as the runtime runs it);
numpy and torch on 2 threads use their BLAS's own threads, and "numpy in parts" is ``np.matmul`` on one BLAS thread
per part of ours, on the same pool. The sides take turns of 3 calls; best and median GFLOP/s, and the median over
the turns of the faster numpy's time over ours (load changes within minutes on a shared machine).
The operands are laid out as the step has them: activations ``x [M, K]`` and a weight ``w [N, K]`` used as
``w.T``.

    python bench/amx_gemm.py [--repeats 5] [--threads 1,2] [--shapes 768x256x2304,...] [--a-rows N]
    python bench/amx_gemm.py --step [--double 8 --single 16] [--before]   # a whole transformer step, AMX vs BLAS

``--step``: the FLUX.2 transformer of ``bench/flux2_transformer_cpu.py`` (default: the medium pipeline's 8 double
+ 16 single blocks, 256 image + 512 text tokens) compiled once and loaded twice on the numpy runtime, its
MatMul kernels prepared on AMX in one and on BLAS in the other (the same program, plan and arena otherwise),
then PyTorch eager's step: the three timed in turns (so that load changes hit all alike); medians and minima.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time

from luminal_recipes.openblas_spin import limit_openblas_spin

limit_openblas_spin()

import numpy as np  # noqa: E402
from threadpoolctl import threadpool_limits  # noqa: E402

from luminal_recipes.runtimes.cpu import amx  # noqa: E402

STEP_SHAPES = ((768, 256, 2304), (768, 256, 256), (768, 768, 256), (512, 256, 1536), (512, 256, 256), (256, 256, 1536),
               (512, 768, 256), (256, 256, 256), (256, 768, 256))


def turns(calls, repeats: int, block: int = 3) -> list[list[float]]:
    """Seconds of every call, the sides taking turns of ``block`` calls ``repeats`` times."""
    times = [[] for _ in calls]
    for _ in range(repeats):
        for i, call in enumerate(calls):
            for _ in range(block):
                t = time.perf_counter()
                call()
                times[i].append(time.perf_counter() - t)
    return times


def numpy_in_parts(a, b, out, p):
    """``out = a @ b`` cut as our product is (``p.parts``), each part an ``np.matmul`` on one BLAS thread, the
    parts on our thread pool: how the runtime's attention runs BLAS."""
    from luminal_recipes.runtimes.cpu import threads as cpu_threads

    parts = [functools.partial(np.matmul, a[r0:r1], b[:, c0:c1], out=out[r0:r1, c0:c1]) for r0, r1, c0, c1 in p.parts]

    def run():
        with cpu_threads.blas_single_threaded():
            cpu_threads.run_parts(parts)

    return run


def torch_mm(x, w, out, threads):
    try:
        import torch
    except ImportError:
        return None
    torch.set_num_threads(threads)
    tx, tw, to = torch.from_numpy(x), torch.from_numpy(w), torch.from_numpy(out)
    return lambda: torch.mm(tx, tw.t(), out=to)


def step_ab(args) -> None:
    """One transformer step with the MatMuls on AMX, on BLAS, and PyTorch's, timed in turns."""
    import sys
    import tempfile
    from pathlib import Path

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import flux2_transformer_cpu as ft

    from luminal_recipes.recipe.builder import build
    from luminal_recipes.runtimes.cpu.kernels import matmul as matmul_kernels
    from luminal_recipes.runtimes.profile import profiling

    threads = ft.blas_threads(None)
    torch.set_num_threads(threads)
    cfg = ft.TransformerConfig(double=args.double, single=args.single)
    with tempfile.TemporaryDirectory(prefix="amx-step-") as tmp:
        folder = Path(tmp) / "transformer"
        reference = ft.save_diffusers_transformer(folder, cfg, 0)
        inputs = ft.step_inputs(cfg, reference.config.axes_dims_rope, reference.config.rope_theta, 1)
        model = build(ft.RECIPE, weights=folder)
        runtime, program, _, dims, _, _ = ft.compile_ours(model, inputs, Path(tmp) / "cache")
        exes = {"ours, MatMul on AMX": runtime.load(program, model.load_weight, dims)}
        worth_it = amx.worth_it
        amx.worth_it = lambda *a, **kw: False
        exes["ours, MatMul on BLAS"] = runtime.load(program, model.load_weight, dims)
        amx.worth_it = worth_it
        if args.before:  # the kernels are chosen when a program is loaded: main's choices of 2026-12-01 14:50
            saved = amx.B_WHOLE_BYTES, amx.MIN_SIDE, matmul_kernels._blas_product
            amx.B_WHOLE_BYTES, amx.MIN_SIDE = 0, 16
            matmul_kernels._blas_product = lambda a, b, out: functools.partial(np.matmul, a, b, out=out)
            exes["ours, before (14:50)"] = runtime.load(program, model.load_weight, dims)
            amx.B_WHOLE_BYTES, amx.MIN_SIDE, matmul_kernels._blas_product = saved
        theirs = ft.torch_step(reference, cfg, inputs)
        want = theirs()
        errs = [float(np.abs(exe.run(inputs)["velocity"] - want).max() / np.abs(want).max()) for exe in exes.values()]
        sides = [functools.partial(exe.run, inputs, copy_outputs=False) for exe in exes.values()] + [theirs]
        times = [[] for _ in sides]
        matmul = [[] for _ in exes]
        for i in range(args.repeats + 2):
            for j, (side, record) in enumerate(zip(sides, times)):
                with profiling() as kernels:
                    t = time.perf_counter()
                    side()
                    dt = time.perf_counter() - t
                if i >= 2:
                    record.append(dt)
                    if j < len(exes):
                        matmul[j].append(sum(s for (_, k), s in kernels.seconds.items() if k == "MatMul"))
        print(f"{cfg.double} double + {cfg.single} single blocks, {cfg.img} + {cfg.txt} tokens, {threads} threads; "
              "max |ours - torch| / max |torch|: " + ", ".join(f"{e:.1e}" for e in errs))
        for j, (name, t) in enumerate(zip([*exes, "PyTorch eager"], times)):
            kernel = (f"  (MatMul kernels median {statistics.median(matmul[j]) * 1e3:6.1f} ms, min "
                      f"{min(matmul[j]) * 1e3:6.1f})") if j < len(exes) else ""
            print(f"  {name:22s} median {statistics.median(t) * 1e3:7.1f} ms  min {min(t) * 1e3:7.1f} ms{kernel}")
        med = [statistics.median(t) for t in times]
        before = (f", before / torch {med[2] / med[-1]:.3f}, AMX / before {med[0] / med[2]:.3f} (minima "
                  f"{min(times[0]) / min(times[2]):.3f})") if args.before else ""
        print(f"  AMX / BLAS {med[0] / med[1]:.3f} (minima {min(times[0]) / min(times[1]):.3f}); "
              f"AMX / torch {med[0] / med[-1]:.3f}, BLAS / torch {med[1] / med[-1]:.3f}{before}; "
              f"load {os.getloadavg()[0]:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--step", action="store_true", help="time a whole transformer step, AMX vs BLAS vs torch")
    ap.add_argument("--before", action="store_true",
                    help="--step: also the MatMuls chosen as main did at 14:50 (fixed halves of rows, AMX from 16 "
                         "rows, OpenBLAS's own threads), with this version's kernels")
    ap.add_argument("--double", type=int, default=8)
    ap.add_argument("--single", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5, help="turns of 3 calls per side (--step: steps per side)")
    ap.add_argument("--shapes", default=",".join("x".join(map(str, s)) for s in STEP_SHAPES))
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--a-rows", type=int, default=0, help="override the rows of A packed at a time")
    args = ap.parse_args()
    reason = amx.reason_unavailable()
    if reason:
        raise SystemExit(f"AMX unavailable: {reason}")
    if args.step:
        return step_ab(args)
    rng = np.random.default_rng(0)
    print("GFLOP/s, best and median of the turns: ours (AMX bf16x3) | numpy (BLAS's threads) | numpy in parts "
          "(BLAS on one thread per part, our thread pool) | torch mm; ours over the faster numpy, median of the "
          "per-turn ratios; max |error| vs float64 relative to max |result|, ours and numpy")
    for shape in args.shapes.split(","):
        m, k, n = map(int, shape.split("x"))
        x = rng.standard_normal((m, k)).astype(np.float32)
        w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
        exact = x.astype(np.float64) @ w.T.astype(np.float64)
        for threads in map(int, args.threads.split(",")):
            p = amx.plan(m, k, n, threads)
            if args.a_rows:
                p = amx.Plan(p.m, p.k, p.n, p.parts, args.a_rows, p.kc)
            scratch = [[amx.aligned_empty(s, d) for s, d in p.scratch_shapes] for _ in p.parts]
            ours = amx.aligned_empty((m, n), np.float32)
            ref, split = np.empty((m, n), np.float32), np.empty((m, n), np.float32)
            sides = {"ours": amx.product(p, x, w.T, ours, scratch),
                     "numpy": functools.partial(np.matmul, x, w.T, out=ref)}
            if threads > 1:
                sides["numpy in parts"] = numpy_in_parts(x, w.T, split, p)
            theirs = torch_mm(x, w, np.empty((m, n), np.float32), threads)
            if theirs:
                sides["torch"] = theirs
            with threadpool_limits(threads, user_api="blas"):
                times = turns(list(sides.values()), args.repeats)
            flops = 2 * m * k * n
            cells = " | ".join(f"{flops / min(t) / 1e9:5.0f} {flops / statistics.median(t) / 1e9:5.0f}" for t in times)
            numpys = [times[i] for i, name in enumerate(sides) if name.startswith("numpy")]
            ratios = [min(min(t[r:r + 3]) for t in numpys) / min(times[0][r:r + 3])
                      for r in range(0, len(times[0]), 3)]
            scale = np.abs(exact).max()
            err = [np.abs(r - exact).max() / scale for r in (ours, ref)]
            print(f"{m}x{k}x{n} t{threads}: {cells}  {statistics.median(ratios):5.2f}x  "
                  f"err {err[0]:.1e} {err[1]:.1e}", flush=True)
    print(f"load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
