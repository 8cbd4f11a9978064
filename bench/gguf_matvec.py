"""The fused GGUF matrix-vector kernels alone, out of cache, one thread: the weight bandwidth (bytes of packed
weight per second) of the integer products (``runtimes/cpu/jit/gguf_q8.py``) vs the f32 products they replace
(``gguf_kernels.SPECIALISED``), in turns in one process, beside a memory copy measured in the same run.

Weights: every matrix of the real SmolLM2-135M-Instruct Q4_1 file (Q4_1 layers and the tied Q8_0 embedding as
the LM head, 96 MB: one decoded token's products), and for Q8_0 and the K-quants ~96 MB of [1536, 1536] matrices
of random blocks (valid scales). Each pass runs every matrix of a set once (x of ``--rows`` rows, random), so nothing
is reused from the 32 MiB L3 between passes. ``--rows 8`` etc. measure the small-batch path (GFLOP/s also shown).

    python bench/gguf_matvec.py                 # rows of x = 1, 5 rounds
    python bench/gguf_matvec.py --rows 16 --sets Q4_1
    python bench/gguf_matvec.py --old /tmp/gguf_q8_old.py   # a third side: another gguf_q8 module's matmul_q8
    git show main:runtimes/cpu/jit/gguf_q8.py > /tmp/gguf_q8_main.py    # e.g. before / after a change, one run:
    python bench/gguf_matvec.py --old /tmp/gguf_q8_main.py --sets Q8_0,Q2_K,Q3_K,Q4_K,Q5_K,Q6_K --no-llama
    python bench/gguf_matvec.py --x8 --sets Q4_K,Q6_K --no-llama   # the 8-bit-x option beside the default 15 bits

Side ``tiles`` (sets of Q4_0 / Q4_1 / Q8_0 only, on hosts with AVX512-VNNI): ``gguf_tiles``' products on the
weights repacked into tiles of 16 rows, each matrix repacked in the untimed warm-up run (the runtime repacks once,
at bind time), rows past the last whole tile on ``gguf_q8``'s loops, as the runtime runs them. With ``--old`` the
third side is main's per-row loops (``int`` is this tree's).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("LUMINAL_RECIPES_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from llm_gguf import PROMPT, LlamaCpp, memcpy_gbs, smollm2, weight_bytes  # noqa: E402

from luminal_recipes.graph import gguf_blocks  # noqa: E402
from luminal_recipes.runtimes.cpu.jit import gguf_kernels as gk  # noqa: E402
from luminal_recipes.runtimes.cpu.jit import gguf_q8  # noqa: E402

CLOCK = time.thread_time  # CPU time of this thread (every side computes on it at one thread): on a shared machine
# it counts the cycles spent, not the time other jobs held the core; --wall for wall-clock time
SCALES = {"Q4_0": (0,), "Q4_1": (0, 2), "Q8_0": (0,), "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2),
          "Q6_K": (208,)}  # offsets of the f16 scales


def real_set() -> list[tuple[str, np.ndarray]]:
    import gguf

    out = []
    for t in gguf.GGUFReader(str(smollm2())).tensors:
        if t.tensor_type.name in ("Q4_1", "Q8_0") and len(t.shape) == 2:
            k = int(t.shape[0])
            data = np.asarray(t.data).reshape(int(t.shape[1]), -1)
            assert data.shape[1] == gguf_blocks.row_bytes(t.tensor_type.name, k)
            out.append((t.tensor_type.name, np.ascontiguousarray(data)))
    return out


def random_set(qtype: str, total: int = 96 << 20, n: int = 1536, k: int = 1536) -> list[tuple[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    rb = gguf_blocks.row_bytes(qtype, k)
    _, bs, ts = gguf_blocks.QTYPES[qtype]
    out = []
    for _ in range(max(1, total // (n * rb))):
        raw = rng.integers(0, 256, (n, k // bs, ts), dtype=np.uint8)
        for o in SCALES[qtype]:
            raw[:, :, o], raw[:, :, o + 1] = 0x00, 0x20  # f16 0x2000 = 2**-7
        out.append((qtype, raw.reshape(n, rb)))
    return out


class LlamaSide:
    """llama.cpp decoding the SmolLM2 file itself (``n_threads=1``): its whole token, so its weight bandwidth
    (file bytes / time per token) is a lower bound of its kernels' own."""

    name = "llama.cpp"

    def __init__(self, tokens: int = 16):
        self.llm = LlamaCpp(smollm2(), 1, 256)
        self.ids = self.llm.llm.tokenize(PROMPT.encode())
        self.tokens = tokens
        self.scale = weight_bytes(smollm2())  # seconds per token -> seconds per pass over this many bytes

    def run(self) -> float:
        llm = self.llm.llm
        llm.reset()
        stamps = []
        for _ in llm.generate(self.ids, temp=0.0, top_k=1, reset=True):  # greedy, past any end-of-text token
            stamps.append(CLOCK())
            if len(stamps) > self.tokens:
                break
        return (stamps[-1] - stamps[0]) / (len(stamps) - 1)


class Side:
    def __init__(self, name, rows, mats, fn):
        self.name, self.fn = name, fn
        self.has = getattr(fn, "has", lambda kind: True)
        rng = np.random.default_rng(1)
        self.work = []
        for qtype, w in mats:
            k = w.shape[1] // gguf_blocks.QTYPES[qtype][2] * gguf_blocks.QTYPES[qtype][1]
            x = (rng.standard_normal((rows, k)) * 0.05).astype(np.float32)
            self.work.append((gk.KINDS[qtype], w, x, np.zeros((rows, w.shape[0]), np.float32)))

    def run(self) -> float:
        t0 = CLOCK()
        for kind, w, x, out in self.work:
            self.fn(kind, w, x, out)
        return CLOCK() - t0


def f32_product(f16):
    def fn(kind, w, x, out):
        xs = np.zeros((x.shape[0], x.shape[1] // gk.LAYOUT[kind][0]), np.float32)
        gk._sums(x, xs, gk.LAYOUT[kind][0])
        gk.SPECIALISED[kind](w, x, xs, out, 0, w.shape[0], kind, f16)
    return fn


def int_product(module, f16, call="quant_product"):
    def fn(kind, w, x, out):
        m, k = x.shape
        xq = np.empty((m, 2 * k), np.int8) if module.QMAX < 32767 else np.empty((m, k), np.int16)  # older: int16
        xd, xs = np.empty((m, k // 32), np.float32), np.empty((m, k // 32), np.float32)
        if hasattr(module, call):  # the runtime's call: x rounded in the type's order, then the product
            getattr(module, call)(x, xq, xd, xs, np.empty((m, k // 16), np.float32), w, out, 0, w.shape[0], kind, f16)
            return
        module.quantize(x, xq, xd, xs)
        module.matmul_q8(w, xq, xd, xs, out, 0, w.shape[0], kind, f16)
    fn.has = lambda kind: kind in module.KINDS
    return fn


def tile_product(f16):
    """The tiled products (``gguf_tiles``: Q4_0, Q4_1, Q8_0 on AVX512-VNNI): each matrix repacked into tiles of 16
    rows on its first call (the untimed warm-up run; the runtime repacks once at bind time), rows past the last
    whole tile on gguf_q8's loops, as the runtime does."""
    from luminal_recipes.runtimes.cpu.jit import gguf_tiles

    repacked = {}

    def fn(kind, w, x, out):
        tiles = repacked.get(id(w))
        if tiles is None:
            tiles = repacked[id(w)] = gguf_tiles.repack(w, kind)
        m, k = x.shape
        xq = np.empty((m, 2 * k), np.int8)
        xd, xs = np.empty((m, k // 32), np.float32), np.empty((m, k // 32), np.float32)
        nt = w.shape[0] // gguf_tiles.TILE
        gguf_tiles.quant_tiles(x, xq, xd, xs, tiles, w, out, 0, nt, nt * gguf_tiles.TILE, kind, f16)
    fn.has = lambda kind: gguf_tiles.AVAILABLE and kind in gguf_tiles.KINDS
    return fn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--sets", default="SmolLM2,Q8_0,Q4_K,Q6_K,Q5_K,Q3_K,Q2_K")
    ap.add_argument("--no-llama", action="store_true", help="leave llama.cpp out of the SmolLM2 set")
    ap.add_argument("--old", help="a file holding an older gguf_q8 module (quantize, matmul_q8): a third side")
    ap.add_argument("--wall", action="store_true", help="wall-clock time instead of this thread's CPU time")
    ap.add_argument("--x8", action="store_true", help="a side with the K-quants' x rounded to 8 bits "
                    "(gguf_q8.quant_product_x8, LUMINAL_RECIPES_GGUF_X_BITS=8)")
    args = ap.parse_args()
    global CLOCK
    if args.wall:
        CLOCK = time.perf_counter
    f16 = gk.f16_table()
    sides = [("f32", f32_product(f16)), ("int", int_product(gguf_q8, f16, "quant_product15"))]
    sides.append(("tiles", tile_product(f16)))  # where the host has it and the set is all Q4_0 / Q4_1 / Q8_0
    if args.x8:
        sides.append(("int-x8", int_product(gguf_q8, f16, "quant_product_x8")))
    if args.old:  # imported as a module of the package beside gguf_q8 (its relative imports; numba's cache)
        name = f"{gguf_q8.__package__}.{Path(args.old).stem}"
        spec = importlib.util.spec_from_file_location(name, args.old)
        old = importlib.util.module_from_spec(spec)
        sys.modules[name] = old
        spec.loader.exec_module(old)
        sides.append(("old", int_product(old, f16)))
    print(f"memcpy {memcpy_gbs():.1f} GB/s (wall clock); rows of x {args.rows}; one thread; "
          f"{'wall-clock' if args.wall else 'CPU'} time; load {os.getloadavg()[0]:.1f}")
    for name in args.sets.split(","):
        mats = real_set() if name == "SmolLM2" else random_set(name)
        nbytes = sum(w.nbytes for _, w in mats)
        flops = 2 * args.rows * sum(w.shape[0] * (w.shape[1] // gguf_blocks.QTYPES[q][2] * gguf_blocks.QTYPES[q][1])
                                    for q, w in mats)
        runs = [Side(s, args.rows, mats, fn) for s, fn in sides]
        runs = [r for r in runs if all(r.has(kind) for kind, *_ in r.work)]  # an older module without the type
        if name == "SmolLM2" and args.rows == 1 and not args.no_llama:
            try:
                runs.append(LlamaSide())
            except ImportError as exc:
                print(f"note: llama.cpp left out: {exc}")
        for r in runs:
            r.run()  # compile, warm
        times = {r.name: [] for r in runs}
        for _ in range(args.rounds):
            for r in runs:
                times[r.name].append(r.run())
        base = statistics.median(times["f32"])
        line = [f"{name:8s} {nbytes / 1e6:5.1f} MB"]
        for r in runs:
            t = statistics.median(times[r.name])
            if isinstance(r, LlamaSide):  # per token of the whole file: scaled to this set's bytes
                t *= nbytes / r.scale
            line.append(f"{r.name} {t * 1e3:6.2f} ms {nbytes / t / 1e9:5.2f} GB/s {flops / t / 1e9:6.1f} GFLOP/s "
                        f"({t / base:.2f}x)")
        print(" | ".join(line), f"| load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
