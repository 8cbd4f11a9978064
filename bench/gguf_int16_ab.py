"""The integer GGUF decode products (``runtimes/cpu/jit/gguf_q8.py``) against the f32 ones they replace, in one
process on the real SmolLM2-135M Q4_1 file: two models loaded (the first with the integer path switched off), decoded
in turns, medians and the ratio printed, and the greedy ids of both compared.

    python bench/gguf_int16_ab.py 1      # LUMINAL_RECIPES_THREADS=1
    python bench/gguf_int16_ab.py 2
"""

from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

os.environ["LUMINAL_RECIPES_THREADS"] = sys.argv[1] if len(sys.argv) > 1 else "1"
sys.path.insert(0, str(Path(__file__).resolve().parent))

import llm_gguf  # noqa: E402

from luminal_recipes.runtimes.cpu.jit import gguf_q8  # noqa: E402


def main() -> None:
    kinds = gguf_q8.KINDS
    gguf_q8.KINDS = ()  # read when a product is bound: the first model keeps the f32 products
    f32 = llm_gguf.Ours(llm_gguf.smollm2(), 1, 256)
    gguf_q8.KINDS = kinds
    integer = llm_gguf.Ours(llm_gguf.smollm2(), 1, 256)
    ids = list(f32.lm.encode(llm_gguf.PROMPT))
    f32.decode(ids, 4)
    integer.decode(ids, 4)
    ra, rb = [], []
    for _ in range(4):
        ra.append(f32.decode(ids, 32)[0])
        rb.append(integer.decode(ids, 32)[0])
    a, b = statistics.median(ra) * 1e3, statistics.median(rb) * 1e3
    print(f"threads {os.environ['LUMINAL_RECIPES_THREADS']}: f32 products {a:.2f} ms/token, integer products "
          f"{b:.2f} ms/token, ratio {b / a:.2f}; load average {os.getloadavg()[0]:.1f}")
    print("greedy ids equal:", f32.decode(ids, 16)[1] == integer.decode(ids, 16)[1])


if __name__ == "__main__":
    main()
