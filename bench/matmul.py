"""Matmul-heavy kernels of the numpy runtime: achieved GFLOP/s over numpy's own large-matmul GFLOP/s, one run.

Each case is a one-kernel Program (``MatMul`` or ``DequantMatMul``) loaded on ``NumpyRuntime`` and timed
after a warm-up. The baseline is ``np.matmul`` of two contiguous square f32 matrices into a preallocated output,
timed in the same process once next to every run of a kernel, so both see the same BLAS, threads, clock and load;
a kernel's ratio is the median over its runs of its GFLOP/s over the baseline's next to it. Target: every ratio
>= 0.9. For context, the last
column is numpy on the kernel's own operands (dense f32 for the dequant cases; numpy's stacked matmul for the
per-head case). Then the medium FLUX.2 transformer step's MatMul shapes (``STEP_SHAPES``): our kernel, ``np.matmul``
and PyTorch's ``mm`` on the same operands and threads, timed in turns of a few calls each (minima per shape; per
step the calls x medians). Then both attention kernels against PyTorch's ``scaled_dot_product_attention`` on the same
operands and threads (when torch is installed), the two timed in turns (each after 40 ms of its own calls):
4 heads x 768 tokens x 64 (the medium pipeline) and ``--attention-heads`` x 4608 tokens (FLUX.2-dev's 4096
image + 512 text) x 128; medians and the ratio of medians and of minima; target ours / torch <= 1.2.

    python bench/matmul.py            # the default sizes (a minute or two on 2 cores)
    python bench/matmul.py --quick    # small sizes, a few seconds
    python bench/matmul.py --step-only  # only the medium step's MatMul shapes vs numpy and torch (seconds)

The BLAS in use and its CPU kernel are printed first; the environment (OPENBLAS_CORETYPE, OPENBLAS_L2_SIZE,
thread counts) is reported as found and never changed here.
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import os
import statistics
import time

from luminal_recipes.openblas_spin import limit_openblas_spin

limit_openblas_spin()  # as the CLI does, before numpy loads OpenBLAS

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

from luminal_recipes.graph import Graph, Node, View, to_dtype  # noqa: E402
from luminal_recipes.runtimes.cpu.backend import NumpyRuntime  # noqa: E402
from luminal_recipes.runtimes.program import Program  # noqa: E402

ENV_KEYS = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OPENBLAS_NUM_THREADS", "OPENBLAS_THREAD_TIMEOUT",
            "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def blas_report() -> list[str]:
    """Which BLAS numpy calls and which CPU kernel it picked: threadpoolctl if installed, else numpy's build
    configuration plus OpenBLAS' own ``get_corename`` when its library exports it."""
    lines = []
    try:
        from threadpoolctl import threadpool_info

        for info in threadpool_info():
            lines.append(f"{info.get('internal_api')} {info.get('version')} "
                         f"kernel={info.get('architecture')} threads={info.get('num_threads')} "
                         f"({info.get('filepath')})")
    except ImportError:
        blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        lines.append(f"{blas.get('name')} {blas.get('version')}: {blas.get('openblas configuration', '')}")
        libs = glob.glob(os.path.join(os.path.dirname(np.__file__), os.pardir, "numpy.libs", "*openblas*"))
        for path in libs:
            lib = ctypes.CDLL(path)
            for prefix, suffix in (("scipy_openblas", "64_"), ("scipy_openblas", ""), ("openblas", "64_"),
                                   ("openblas", "")):
                fn = getattr(lib, f"{prefix}_get_corename{suffix}", None)
                threads = getattr(lib, f"{prefix}_get_num_threads{suffix}", None)
                if fn is not None:
                    fn.restype = ctypes.c_char_p
                    lines.append(f"OpenBLAS kernel in use: {fn().decode()}, threads: "
                                 f"{threads() if threads else '?'} ({os.path.basename(path)})")
                    break
    env = ", ".join(f"{k}={os.environ[k]}" for k in ENV_KEYS if k in os.environ) or "none set"
    lines.append(f"environment: {env}; CPUs visible: {os.cpu_count()}")
    return lines


def median_seconds(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def one_kernel(inputs: list[tuple], op: str, shape: tuple, edges, attrs: dict) -> Program:
    """A Program of graph inputs/weights and one kernel node; ``edges(tensors)`` gives the kernel's inputs."""
    g = Graph()
    tensors = {}
    for name, kind, shp, dtype in inputs:
        tensors[name] = (g.input if kind == "input" else g.weight)(name, shp, dtype)
    nodes = list(g.nodes)
    node = Node(len(nodes), op, tuple(edges(tensors)), shape, to_dtype("f32"), tuple(sorted(attrs.items())))
    return Program(nodes + [node], {"y": (node.id, View.contiguous(shape))})


def case_matmul(m: int, k: int, n: int, layout: str):
    """``x [m, k] @ W.T`` with W stored [n, k] (a linear layer), or row-major ``a @ b``."""
    if layout == "linear":
        prog = one_kernel([("x", "input", (m, k), "f32"), ("w", "weight", (n, k), "f32")], "MatMul", (m, n),
                          lambda t: [(t["x"].node, t["x"].view), (t["w"].node, t["w"].T.view)], {})
        return prog, {"w": (n, k)}
    prog = one_kernel([("x", "input", (m, k), "f32"), ("w", "weight", (k, n), "f32")], "MatMul", (m, n),
                      lambda t: [(t["x"].node, t["x"].view), (t["w"].node, t["w"].view)], {})
    return prog, {"w": (k, n)}


def case_heads(b: int, s: int, d: int):
    """Per-head scores ``q [b, s, d] @ k^T [b, d, s]`` (a batched matmul with a transposed operand)."""
    spec = [("q", "input", (b, s, d), "f32"), ("k", "input", (b, s, d), "f32")]
    def edges(t):
        return [(t["q"].node, t["q"].view), (t["k"].node, t["k"].transpose(-1, -2).view)]

    return one_kernel(spec, "MatMul", (b, s, s), edges, {})


def case_dequant(m: int, k: int, n: int, fmt: str, layout: str = ""):
    x = ("x", "input", (m, k), "f32")
    if fmt == "fp8":
        spec = [x, ("w", "weight", (n, k), "f8e4m3"), ("s", "weight", (n,), "f32")]
    else:
        w_shape = (n, k // 2) if layout == "modelopt" else (-(-n // 16) * 16, k // 2)
        s_shape = (n, k // 16) if layout == "modelopt" else (-(-n // 128) * 128, -(-(k // 16) // 4) * 4)
        spec = [x, ("w", "weight", w_shape, "u8"), ("s", "weight", s_shape, "f8e4m3"),
                ("s2", "weight", (), "f32")]
    names = [name for name, *_ in spec]
    attrs = {"format": fmt, "layout": layout, "out_features": n, "in_features": k}
    prog = one_kernel(spec, "DequantMatMul", (m, n), lambda t: [(t[nm].node, t[nm].view) for nm in names],
                      attrs)
    return prog, {name: (shp, dtype) for name, kind, shp, dtype in spec if kind == "weight"}


def case_attention(b: int, s: int, d: int, blocked: bool) -> Program:
    """``softmax(q k^T / sqrt(d)) v`` over ``b`` heads of ``s`` tokens: the ``Attention`` kernel (whole score
    rows) or ``AttentionBlocked`` (keys in blocks of 128, online softmax). q, k and v are bound in place (as
    weights), as a pipeline's kernel reads its producers' buffers: graph inputs would be copied into the arena
    on every run (~0.4 ms of ~4 at 4 x 768 x 64), which SDPA's timing does not include."""
    spec = [(name, "weight", (b, s, d), "f32") for name in ("q", "k", "v")]
    attrs = {"scale": 1.0 / d**0.5, **({"block": 128} if blocked else {})}
    return one_kernel(spec, "AttentionBlocked" if blocked else "Attention", (b, s, d),
                      lambda t: [(t[nm].node, t[nm].view) for nm in ("q", "k", "v")], attrs)


def torch_sdpa(q: np.ndarray, k: np.ndarray, v: np.ndarray):
    """A call of PyTorch's CPU ``scaled_dot_product_attention`` on the same operands and threads (None without
    torch)."""
    torch = _torch_on_numpy_threads()
    if torch is None:
        return None
    tq, tk, tv = (torch.from_numpy(a)[None] for a in (q, k, v))

    def call():
        with torch.inference_mode():
            torch.nn.functional.scaled_dot_product_attention(tq, tk, tv)

    return call


SETTLE_S = 0.04  # each turn runs its call untimed this long (at least once) before the timed call


def interleaved_seconds(calls: list, repeats: int) -> list[list[float]]:
    """Seconds of each call, ``repeats`` times after a warm-up, the calls taking turns (so that both sides of a
    ratio see the same load). Each turn first runs its call untimed for ``SETTLE_S`` (at least once), then
    times one: PyTorch's OpenMP workers (libgomp) spin for a while after each call, so a call of ours timed
    right after SDPA ran on one free core (measured 2026-12-01, 4 x 768 x 64 on 2 cores: ours 15.4 ms median
    right after SDPA, 9.5 ms after 40 ms of its own calls; SDPA 8.3 and 8.0 ms in the same two cases), and each
    side runs as it does in its own pipeline, its threads busy with its own work."""
    for call in calls:
        call()
    times = [[] for _ in calls]
    for _ in range(repeats):
        for call, ts in zip(calls, times):
            t0 = time.perf_counter()
            call()
            while time.perf_counter() - t0 < SETTLE_S:
                call()
            t0 = time.perf_counter()
            call()
            ts.append(time.perf_counter() - t0)
    return times


def _torch_on_numpy_threads():
    """PyTorch set to the threads numpy's BLAS uses, so both sides of a ratio run on the same ones (None without
    torch)."""
    try:
        import torch
    except ImportError:
        return None
    threads = _blas_threads()
    if threads:
        torch.set_num_threads(threads)
    return torch


def _blas_threads() -> int | None:
    for path in glob.glob(os.path.join(os.path.dirname(np.__file__), os.pardir, "numpy.libs", "*openblas*")):
        lib = ctypes.CDLL(path)
        for name in ("scipy_openblas_get_num_threads64_", "scipy_openblas_get_num_threads",
                     "openblas_get_num_threads64_", "openblas_get_num_threads"):
            fn = getattr(lib, name, None)
            if fn is not None:
                return int(fn())
    return None


# The medium pipeline's transformer step (8 + 16 blocks, hidden 256, 256 image + 512 text tokens): its MatMul
# kernels' shapes (M, K, N; every one x [M, K] @ W.T with W stored [N, K]) and how many of each one step runs
# (144 of its 157 calls; the others are GEMVs and smaller products). A single block's output projection, [attention,
# MLP] (768 x 1024) @ W.T, runs as two products (the concatenation is never made): 768 x 256 x 256, then 768 x 768 x
# 256 plus the first as a bias
STEP_SHAPES = ((768, 256, 2304, 16), (768, 256, 256, 16), (768, 768, 256, 16), (512, 256, 1536, 8), (512, 256, 256, 32),
               (256, 256, 1536, 8), (512, 768, 256, 8), (256, 256, 256, 32), (256, 768, 256, 8))


def torch_mm(x: np.ndarray, w: np.ndarray, out: np.ndarray):
    """A call of PyTorch's ``mm`` (its BLAS: MKL on x86) computing ``x @ w.T`` into ``out``, on the threads
    numpy's BLAS uses (None without torch)."""
    torch = _torch_on_numpy_threads()
    if torch is None:
        return None
    tx, tw, to = torch.from_numpy(x), torch.from_numpy(w), torch.from_numpy(out)
    return lambda: torch.mm(tx, tw.t(), out=to)


def blocked_seconds(calls: list, repeats: int, block: int = 4, pause: float = 0.15) -> list[list[float]]:
    """Seconds of each call, ``repeats`` rounds of ``block`` calls of each in turn, after a pause and a first call
    not counted: a library's threads keep spinning for a while after its call (OpenBLAS' ~0.1 s, PyTorch's OpenMP
    ones too) and slow down whatever runs next on their cores (measured: an ``np.matmul`` right after a torch
    ``mm`` 0.32 ms, the same call after another ``np.matmul`` 0.26 ms; a torch ``mm`` after numpy 7 ms median,
    0.34 ms at best)."""
    times = [[] for _ in calls]
    for _ in range(repeats):
        for call, ts in zip(calls, times):
            time.sleep(pause)
            call()
            for _ in range(block):
                t0 = time.perf_counter()
                call()
                ts.append(time.perf_counter() - t0)
    return times


def step_report(repeats: int, rng) -> None:
    """Our MatMul kernel, numpy's ``np.matmul`` and PyTorch's ``mm`` on the medium step's shapes, the three timed
    in turns on the same operands (``blocked_seconds``); per shape the minima, and per step the sum over its calls
    of each side's medians."""
    print(f"{'medium transformer step, MatMul shape (calls)':<46}{'ours ms':>9}{'numpy ms':>9}{'torch ms':>9}"
          f"{'ours/np':>9}{'ours/torch':>11}")
    totals = [0.0, 0.0, 0.0]
    for m, k, n, calls in STEP_SHAPES:
        # x bound like a weight: nothing is copied in per call (an input's copy would be ~10% of these products)
        prog = one_kernel([("x", "weight", (m, k), "f32"), ("w", "weight", (n, k), "f32")], "MatMul", (m, n),
                          lambda t: [(t["x"].node, t["x"].view), (t["w"].node, t["w"].T.view)], {})
        x = rng.standard_normal((m, k)).astype(np.float32)
        w = rng.standard_normal((n, k)).astype(np.float32)
        exe = NumpyRuntime().load(prog, {"x": x, "w": w})
        exe.execute()
        out = np.empty((m, n), np.float32)
        sides = [exe.execute, lambda x=x, w=w, out=out: np.matmul(x, w.T, out=out)]
        theirs = torch_mm(x, w, np.empty((m, n), np.float32))
        times = blocked_seconds(sides + ([theirs] if theirs else []), repeats)
        best = [min(t) * 1e3 for t in times]
        for i, t in enumerate(times):
            totals[i] += calls * statistics.median(t) * 1e3
        torch_cols = f"{best[2]:9.3f}" if theirs else f"{'n/a':>9}"
        ratio = f"{best[0] / best[2]:11.2f}" if theirs else f"{'n/a':>11}"
        label = f"{m} x {k} x {n} ({calls})"
        print(f"{label:<46}{best[0]:9.3f}{best[1]:9.3f}{torch_cols}{best[0] / best[1]:9.2f}{ratio}")
    their_total = f", torch mm {totals[2]:.1f} ms (ours / torch {totals[0] / totals[2]:.2f})" if totals[2] else ""
    print(f"per step (calls x median): ours {totals[0]:.1f} ms, numpy {totals[1]:.1f} ms (ours / numpy "
          f"{totals[0] / totals[1]:.2f}){their_total}")


def attention_rows(sizes: list[tuple[int, int, int]], repeats: int, rng) -> list[tuple[str, list, list | None]]:
    """(label, our seconds, torch SDPA seconds) per repeat for both attention kernels at each (heads, tokens,
    head_dim), the two sides timed in turns."""
    rows = []
    for b, s, d in sizes:
        q, k, v = (rng.standard_normal((b, s, d)).astype(np.float32) for _ in range(3))
        theirs = torch_sdpa(q, k, v)
        for blocked in (False, True):
            exe = NumpyRuntime().load(case_attention(b, s, d, blocked), {"q": q, "k": k, "v": v})
            times = interleaved_seconds([exe.execute] + ([theirs] if theirs else []), repeats)
            name = "AttentionBlocked" if blocked else "Attention"
            rows.append((f"{name} {b} heads x {s} tokens, head_dim {d}", times[0], times[1] if theirs else None))
    return rows


def random_weights(spec: dict, rng) -> dict:
    out = {}
    for name, (shape, dtype) in spec.items():
        if dtype == "u8":
            out[name] = rng.integers(0, 256, shape).astype(np.uint8)
        elif dtype == "f8e4m3":
            out[name] = (rng.random(shape) + 0.5).astype(ml_dtypes.float8_e4m3fn)
        else:
            out[name] = (rng.random(shape) + 0.5).astype(np.float32)
    return out


class Baseline:
    """numpy's own ``np.matmul`` of two ``n x n`` f32 matrices, timed once between two runs of each kernel, so
    that a kernel and the baseline it is divided by see the same load (on a shared machine the load drifts by
    2x within a minute)."""

    def __init__(self, n: int):
        rng = np.random.default_rng(0)
        self.a, self.b = rng.standard_normal((n, n), np.float32), rng.standard_normal((n, n), np.float32)
        self.out = np.empty((n, n), np.float32)
        self.flops = 2 * n**3
        self.seen: list[float] = []

    def gflops(self) -> float:
        t0 = time.perf_counter()
        np.matmul(self.a, self.b, out=self.out)
        self.seen.append(self.flops / (time.perf_counter() - t0) / 1e9)
        return self.seen[-1]


def measure(program: Program, inputs: dict, weights: dict, flops: float, repeats: int,
            base: Baseline) -> tuple[float, float]:
    """(our GFLOP/s, the median over ``repeats`` of our GFLOP/s / the baseline's in the run next to it)."""
    exe = NumpyRuntime().load(program, weights)
    exe.execute(inputs)
    base.gflops()
    ours, ratios = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        exe.execute()
        ours.append(flops / (time.perf_counter() - t0) / 1e9)
        ratios.append(ours[-1] / base.gflops())
    return statistics.median(ours), statistics.median(ratios)


def attention_report(args, rng) -> None:
    """Attention vs PyTorch's SDPA: the medium pipeline's size, and FLUX.2-dev's 4096 image + 512 text tokens."""
    sizes = [(4, 256, 64)] if args.quick else [(4, 768, 64), (args.attention_heads, 4608, 128)]
    print(f"{'attention kernel (ours and SDPA in turns)':<52}{'ours ms':>9}{'SDPA ms':>9}{'ours/SDPA':>11}"
          f"{'of minima':>11}")
    for label, ours, theirs in attention_rows(sizes, args.repeats, rng):
        mine = statistics.median(ours) * 1e3
        if theirs is None:
            print(f"{label:<52}{mine:9.1f}{'n/a':>9}{'n/a':>11}")
            continue
        other = statistics.median(theirs) * 1e3
        print(f"{label:<52}{mine:9.1f}{other:9.1f}{mine / other:11.2f}{min(ours) / min(theirs):11.2f}"
              "  (target <= 1.2)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, a few seconds")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--attention-only", action="store_true", help="only the attention cases")
    parser.add_argument("--step-only", action="store_true",
                        help="only the medium transformer step's MatMul shapes (ours, numpy, torch mm)")
    parser.add_argument("--attention-heads", type=int, default=4,
                        help="heads of the 4608-token attention case (FLUX.2-dev has 48; time grows with it)")
    args = parser.parse_args()
    big, m, k, n = (512, 256, 512, 512) if args.quick else (2048, 1024, 2048, 2048)
    hb, hs, hd = (4, 256, 128) if args.quick else (16, 1024, 128)  # FLUX.2's head size
    rng = np.random.default_rng(0)
    reps = args.repeats

    for line in blas_report():
        print(line)
    if args.attention_only:
        attention_report(args, rng)
        return
    if args.step_only:
        step_report(reps, rng)
        return
    baseline = Baseline(big)

    def randn(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    # (label, ours, numpy on the same operands) in GFLOP/s
    rows = []
    x = randn(m, k)
    for layout in ("row-major", "linear"):
        prog, shapes = case_matmul(m, k, n, layout)
        weights = {name: randn(*shp) for name, shp in shapes.items()}
        right = weights["w"].T if layout == "linear" else weights["w"]
        out = np.empty((m, n), np.float32)
        same = 2 * m * k * n / median_seconds(lambda r=right, o=out: np.matmul(x, r, out=o), reps) / 1e9
        ours, ratio = measure(prog, {"x": x}, weights, 2 * m * k * n, reps, baseline)
        rows.append((f"MatMul {layout} [{m},{k}] x [{k},{n}]", ours, ratio, same))
    q, kk = randn(hb, hs, hd), randn(hb, hs, hd)
    flops = 2 * hb * hs * hs * hd
    out = np.empty((hb, hs, hs), np.float32)
    same = flops / median_seconds(lambda: np.matmul(q, kk.transpose(0, 2, 1), out=out), reps) / 1e9
    ours, ratio = measure(case_heads(hb, hs, hd), {"q": q, "k": kk}, {}, flops, reps, baseline)
    rows.append((f"MatMul per-head q k^T [{hb},{hs},{hd}]", ours, ratio, same))
    dense = randn(n, k)
    out = np.empty((m, n), np.float32)
    same = 2 * m * k * n / median_seconds(lambda: np.matmul(x, dense.T, out=out), reps) / 1e9
    for fmt, layout in (("fp8", ""), ("nvfp4", "modelopt"), ("nvfp4", "comfy")):
        prog, spec = case_dequant(m, k, n, fmt, layout)
        ours, ratio = measure(prog, {"x": x}, random_weights(spec, rng), 2 * m * k * n, reps, baseline)
        rows.append((f"DequantMatMul {fmt} {layout} [{m},{k}] x [{n},{k}]^T".replace("  ", " "), ours, ratio,
                     same))

    seen = baseline.seen
    print(f"numpy large matmul: np.matmul {big}x{big} @ {big}x{big} f32 = {statistics.median(seen):.1f} GFLOP/s "
          f"(median; {min(seen):.1f}-{max(seen):.1f} over the {len(seen)} runs, one next to each run of a kernel)")
    print(f"{'kernel':<52}{'GFLOP/s':>9}{'ratio':>7}{'np same operands':>18}")
    for label, ours, ratio, same in rows:
        print(f"{label:<52}{ours:>9.1f}{ratio:>7.2f}{same:>12.1f} GFLOP/s")
    print("ratio: the median over the runs of a kernel's GFLOP/s / numpy's in the run next to it")
    worst = min(ratio for _, _, ratio, _ in rows)
    print(f"lowest ratio {worst:.2f} (target >= 0.9): {'met' if worst >= 0.9 else 'NOT met'}")

    if not args.quick:
        step_report(reps, rng)
    attention_report(args, rng)


if __name__ == "__main__":
    main()
