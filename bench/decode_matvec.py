"""A decode step's f32 matrix-vector products alone: ``f32_kernels.rows_product`` (12 weight rows at once) against
the one-row loop it replaced and PyTorch's ``torch.mm`` (MKL), in turns, on the weights of bench/torch_backend.py's
~100M Qwen3-shaped decoder (12 layers of q, k, v, o, gate, up, down and the 32000-row head: ~400 MB of f32 a step).

The weights are allocated by torch, as a model's are: 4 KiB pages (``transparent_hugepage`` is ``madvise`` on
most systems and torch does not ask for huge pages), where a core's hardware prefetcher stops at each page's end.
Each round runs every side over all the weights once (one thread, or ``--threads 2`` for our kernels: the output
rows cut in two parts at a multiple of ``ROWS``, each part on a thread, as the CPU runtime's parts run; torch's
threads set to the same count). Printed: median and min ms a step and the weights' GB/s per side.

    python bench/decode_matvec.py [--rounds 11] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time

from luminal_recipes.openblas_spin import limit_openblas_spin

limit_openblas_spin()

import numba  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from luminal_recipes.runtimes.cpu.jit import f32_kernels  # noqa: E402

LAYER = [(768, 768), (768, 256), (768, 256), (768, 768), (768, 2048), (768, 2048), (2048, 768)]  # (k, n)
SHAPES = [s for _ in range(12) for s in LAYER] + [(768, 32000)]


@numba.njit(fastmath={"reassoc", "contract"}, nogil=True, error_model="numpy")
def one_row_product(x, x0, xs, w, w0, ws, out, o0, os_, m, k, n0, n1):
    """The loop ``rows_product`` was until 2026-12-04: one weight row at a time."""
    for n in range(n0, n1):
        wa = w0 + n * ws
        wn = w[wa:wa + k]
        for i in range(m):
            xa = x0 + i * xs
            xm = x[xa:xa + k]
            s = np.float32(0.0)
            for j in range(k):
                s += xm[j] * wn[j]
            out[o0 + i * os_ + n] = s


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    threads = args.threads
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    weights = [torch.randn(n, k) for k, n in SHAPES]
    total = sum(k * n * 4 for k, n in SHAPES)
    rng = np.random.default_rng(0)
    xs = {k: rng.standard_normal((1, k), dtype=np.float32) for k in (768, 2048)}
    outs = [np.zeros((1, n), np.float32) for _, n in SHAPES]
    rows = f32_kernels.ROWS

    def ours(kernel):
        calls = [(xs[k].reshape(-1), w.numpy().reshape(-1), o.reshape(-1), k, n)
                 for (k, n), w, o in zip(SHAPES, weights, outs)]

        def part(t):
            for x, w, o, k, n in calls:
                lo = n * t // threads // rows * rows
                hi = n if t + 1 == threads else n * (t + 1) // threads // rows * rows
                kernel(x, 0, k, w, 0, k, o, 0, n, 1, k, lo, hi)

        def step():
            others = [threading.Thread(target=part, args=(t,)) for t in range(1, threads)]
            for th in others:
                th.start()
            part(0)
            for th in others:
                th.join()

        return step

    txs = {k: torch.from_numpy(v) for k, v in xs.items()}
    touts = [torch.from_numpy(o) for o in outs]

    def torch_mm():
        for (k, _), w, o in zip(SHAPES, weights, touts):
            torch.mm(txs[k], w.t(), out=o)

    sides = {"rows_product": ours(f32_kernels.rows_product), "one row": ours(one_row_product), "torch.mm": torch_mm}
    refs = [xs[k].astype(np.float64) @ w.numpy().T.astype(np.float64) for (k, _), w in zip(SHAPES, weights)]
    for name, step in sides.items():  # compiled, and checked against float64
        step()
        err = max(float(np.abs(o - r).max() / np.abs(r).max()) for o, r in zip(outs, refs))
        assert err < 1e-5, f"{name}: relative error {err:.2e}"
    times = {name: [] for name in sides}
    for _ in range(args.rounds):
        for name, step in sides.items():
            step()  # untimed: after torch.mm its OpenMP threads spin on for milliseconds (libgomp), taking a core
            # from the side timed next (at 2 threads rows_product measured 18.4 vs 15.0 ms right after torch.mm)
            t0 = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t0)
    print(f"decode step's products, {total / 1e6:.0f} MB of f32 weights, {threads} thread(s), {args.rounds} rounds, "
          f"load average {os.getloadavg()[0]:.2f}")
    for name, v in times.items():
        t = statistics.median(v)
        print(f"  {name:13s} {t * 1e3:7.2f} ms (min {min(v) * 1e3:7.2f})  {total / t / 1e9:5.1f} GB/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
