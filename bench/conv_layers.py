"""The medium VAE decoder's 3x3 convolutions one by one: the numpy runtime's ``Conv2d`` kernel against torch's
``conv2d`` on the same operands and threads, the two timed in turns (the fastest of the repeats, ms and GFLOP/s:
the machine is shared), per layer shape and in total over the decoder's 33 layers (each shape times its count).

    python bench/conv_layers.py                 # both cores
    python bench/conv_layers.py --threads 1     # one core: LUMINAL_RECIPES_THREADS=1 and BLAS/torch on one thread

With one thread both sides run on the calling thread, and the clock is that thread's CPU time
(``time.thread_time``), which time spent descheduled by other jobs on a shared machine does not inflate.

The layer list is the `flux2_cpu.py` medium checkpoint's decoder at 256x256 (channels 16-32-64-128, latent 32x32):
(in channels, out channels, side, count).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

LAYERS = [(32, 128, 32, 1), (128, 128, 32, 10), (128, 128, 64, 1), (128, 64, 64, 1), (64, 64, 64, 5),
          (64, 64, 128, 1), (64, 32, 128, 1), (32, 32, 128, 5), (32, 32, 256, 1), (32, 16, 256, 1),
          (16, 16, 256, 5), (16, 3, 256, 1)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=0, help="1: one core for both sides (default: all)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--only", default="", help="comma-separated 'cin-cout-side' to time, e.g. 16-16-256")
    args = ap.parse_args()
    if args.threads and os.environ.get("LUMINAL_RECIPES_THREADS") != str(args.threads):
        os.environ["LUMINAL_RECIPES_THREADS"] = str(args.threads)
        os.environ["OPENBLAS_NUM_THREADS"] = str(args.threads)
        os.execv(sys.executable, [sys.executable, *sys.argv])  # the thread counts are read at import

    import numpy as np
    import torch
    import torch.nn.functional as F

    from luminal_recipes.graph import Graph, Node, View, to_dtype
    from luminal_recipes.runtimes.cpu.backend import NumpyRuntime
    from luminal_recipes.runtimes.program import Program

    if args.threads:
        torch.set_num_threads(args.threads)
    runtime = NumpyRuntime()
    rng = np.random.default_rng(0)
    only = {tuple(int(v) for v in s.split("-")) for s in args.only.split(",") if s}
    total_ours = total_torch = worst = 0.0
    print(f"threads: ours {os.environ.get('LUMINAL_RECIPES_THREADS', 'all')}, torch {torch.get_num_threads()}")
    print("cin -> cout @ side (count) | ours ms | torch ms | ours GFLOP/s | torch GFLOP/s | ours/torch")
    for c, o, side, count in LAYERS:
        if only and (c, o, side) not in only:
            continue
        g = Graph()
        x, w, b = g.input("x", (1, c, side, side)), g.weight("w", (o, c, 3, 3)), g.weight("b", (o,))
        xp = x.pad(2, 1, 1).pad(3, 1, 1)
        bias = b.reshape(1, o, 1, 1).broadcast_to((1, o, side, side))
        nodes = list(g.nodes)
        edges = tuple((t.node, t.view) for t in (xp, w, bias))
        nodes.append(Node(len(nodes), "Conv2d", edges, (1, o, side, side), to_dtype("f32"), (("stride", 1),)))
        program = Program(nodes, {"y": (len(nodes) - 1, View.contiguous((1, o, side, side)))})
        xv = rng.standard_normal((1, c, side, side)).astype(np.float32)
        wv = (rng.standard_normal((o, c, 3, 3)) / np.sqrt(9 * c)).astype(np.float32)
        bv = rng.standard_normal(o).astype(np.float32)
        exe = runtime.load(program, {"w": wv, "b": bv})
        tx, tw, tb = (torch.from_numpy(v) for v in (xv, wv, bv))
        got = exe.run({"x": xv}, copy_outputs=False)["y"]
        want = F.conv2d(tx, tw, tb, padding=1).numpy()
        err = float(np.abs(got - want).max() / np.abs(want).max())
        worst = max(worst, err)
        clock = time.thread_time if args.threads == 1 else time.perf_counter
        ours, ref = [], []
        with torch.inference_mode():
            for _ in range(2):  # warm-up: torch's primitives are made on first use
                exe.execute({"x": xv})
                F.conv2d(tx, tw, tb, padding=1)
            for _ in range(args.repeats):
                t0 = clock()
                exe.execute({"x": xv})
                ours.append(clock() - t0)
                t0 = clock()
                F.conv2d(tx, tw, tb, padding=1)
                ref.append(clock() - t0)
        exe.close()
        mo, mr = min(ours) * 1e3, min(ref) * 1e3
        flops = 2.0 * 9 * c * o * side * side
        total_ours += mo * count
        total_torch += mr * count
        print(f"{c:3d} -> {o:3d} @ {side:3d} ({count:2d}) | {mo:7.2f} | {mr:7.2f} | {flops / mo / 1e6:6.1f} | "
              f"{flops / mr / 1e6:6.1f} | {mo / mr:5.2f}  (rel. err {err:.1e})")
    print(f"total over the decoder's layers: ours {total_ours:.1f} ms, torch {total_torch:.1f} ms, "
          f"ratio {total_ours / max(total_torch, 1e-9):.2f}; load {os.getloadavg()[0]:.1f}")
    if worst > 1e-5:  # tests/TOLERANCES.md, family conv (f32)
        sys.exit(f"error: a convolution differs from torch's by {worst:.1e} (normwise), over the 1e-5 tolerance")


if __name__ == "__main__":
    main()
