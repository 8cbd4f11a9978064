"""The 16-dim attention kernel (``jit/attention_small.py``) against another version of itself and PyTorch's CPU
flash kernel, on the tiny FLUX.2 transformer's shape (4 heads x 1088 tokens, token-major views of one fused
projection), 1 thread, in turns in one process: a call of each side per round, medians and per-round ratios.

The other version is a file (``--base``, e.g. ``git show main:runtimes/cpu/jit/attention_small.py > /tmp/a.py``)
loaded as a sibling module of the package's, so that its relative imports resolve; without it only this tree's
kernel and PyTorch's run. The kernels run as ``kernels/attention_small.py`` does: 3 blocks of query rows a head,
scratch on cache lines. Outputs are checked against float64 SDPA.

    python bench/attention16_ab.py --rounds 40 --base /tmp/a.py
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import tempfile
import time

import numpy as np

from luminal_recipes.runtimes.cpu import jit

H, S, D = 4, 1088, 16


def load_module(path: str):
    """``path`` (another attention_small.py) as a sibling module of the package's, numba's cache off."""
    import luminal_recipes.runtimes.cpu.jit as package

    name = f"{package.__name__}.attention_small_base"
    copy = os.path.join(tempfile.mkdtemp(), "attention_small_base.py")  # not cached: numba's cache of a module
    with open(path) as src, open(copy, "w") as dst:  # loaded from a file cannot find it again
        dst.write(src.read().replace("cache=True", "cache=False"))
    spec = importlib.util.spec_from_file_location(name, copy)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def aligned(shape):
    """On a cache line, as the runtime's scratch (numpy's own arrays may start 16 bytes into one)."""
    n = int(np.prod(shape))
    raw = np.zeros(n + 16, np.float32)
    first = (-(raw.ctypes.data % 64) // 4) % 16
    return raw[first:first + n].reshape(shape)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--base", default="", help="another attention_small.py to compare (loaded in this process)")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    jit.kernels()
    from luminal_recipes.runtimes.cpu.jit import attention_small

    rng = np.random.default_rng(0)
    qkv = (2 * rng.standard_normal((S, 3, H, D))).astype(np.float32)
    q, k, v = (qkv[:, i].transpose(1, 0, 2) for i in range(3))
    scale = np.float32(0.25)

    def side(module):
        out = np.zeros((H, S, D), np.float32)
        bufs = [aligned(shape) for shape in ((D, S), (S, D), (4, S), (4, D))]
        bounds = [S * i // 3 for i in range(4)]

        def run():
            for h in range(H):
                for b in range(3):
                    module.attention16(q, k, v, out, h, bounds[b], bounds[b + 1], b == 0, scale, *bufs)
            return out

        return run

    tq, tk, tv = (torch.from_numpy(qkv[:, i]).permute(1, 0, 2)[None] for i in range(3))

    def flash():
        return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, scale=float(scale))

    sides = {"this tree": side(attention_small), "torch flash": flash}
    if args.base:
        sides["base"] = side(load_module(args.base))
    exact = torch.nn.functional.scaled_dot_product_attention(tq.double(), tk.double(), tv.double(),
                                                             scale=float(scale))[0].numpy()
    for name, run in sides.items():
        for _ in range(3):
            got = np.asarray(run()).reshape(H, S, D)
        print(f"  {name:12s} max |out - float64 SDPA| {np.abs(got - exact).max():.2e}")
    wall = {name: [] for name in sides}
    for _ in range(args.rounds):
        for name, run in sides.items():
            t0 = time.perf_counter()
            run()
            wall[name].append(time.perf_counter() - t0)
    print(f"attention {H} x {S} x {D}, 1 thread, {args.rounds} rounds in turns; load average "
          f"{os.getloadavg()[0]:.2f}")
    for name, w in wall.items():
        print(f"  {name:12s} median {statistics.median(w) * 1e3:6.3f} ms (min {min(w) * 1e3:6.3f})")
    for other in [n for n in sides if n != "this tree"]:
        r = [a / b for a, b in zip(wall["this tree"], wall[other])]
        print(f"  this tree / {other}: {statistics.median(r):.3f}x (rounds {min(r):.2f}-{max(r):.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
