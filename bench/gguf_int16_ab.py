"""The integer GGUF decode products (``runtimes/cpu/jit/gguf_q8.py``) against the f32 ones they replace, in one
process on the real SmolLM2-135M Q4_1 file: two models loaded (the first with the integer path switched off), decoded
in turns, medians and the ratio printed (wall clock, and this thread's CPU time, which on a shared machine counts
the cycles spent rather than the time other jobs held the cores), and the greedy ids of both compared.

    python bench/gguf_int16_ab.py 1      # LUMINAL_RECIPES_THREADS=1
    python bench/gguf_int16_ab.py 2 8    # 2 threads, 8 rounds
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

THREADS = sys.argv[1] if len(sys.argv) > 1 else "1"
for var in ("LUMINAL_RECIPES_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):  # as bench/llm_gguf.py's children
    os.environ[var] = THREADS
sys.path.insert(0, str(Path(__file__).resolve().parent))

import llm_gguf  # noqa: E402

from luminal_recipes.runtimes.cpu.jit import gguf_q8  # noqa: E402

TOKENS = 32


def timed(model, ids):
    """(wall, CPU) seconds per decode step and the ids: clocks read as each token arrives, from the first token
    to the last (the prompt left out). At one thread every kernel runs on this thread: its CPU time counts the
    cycles spent on the token, not the time other jobs held the core."""
    stamps = []
    g = model.lm.generate(ids, max_new_tokens=TOKENS,
                          on_token=lambda i, piece: stamps.append((time.perf_counter(), time.thread_time())))
    n = len(stamps) - 1
    return (stamps[-1][0] - stamps[0][0]) / n, (stamps[-1][1] - stamps[0][1]) / n, g.ids


def main() -> None:
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 6
    kinds = gguf_q8.KINDS
    gguf_q8.KINDS = ()  # read when a product is bound (at the first generate): the first model keeps f32 products
    f32 = llm_gguf.Ours(llm_gguf.smollm2(), 1, 256)
    ids = list(f32.lm.encode(llm_gguf.PROMPT))
    f32.lm.eos_ids = []  # decode TOKENS tokens whatever they are (the reply ends after ~8)
    timed(f32, ids)  # binds every kernel (prompt and decode sessions) with the f32 products
    gguf_q8.KINDS = kinds
    integer = llm_gguf.Ours(llm_gguf.smollm2(), 1, 256)
    integer.lm.eos_ids = []
    timed(integer, ids)
    wall = {"f32": [], "int": []}
    cpu = {"f32": [], "int": []}
    outs = {}
    for r in range(rounds):
        order = [("f32", f32), ("int", integer)]
        for name, model in order if r % 2 == 0 else order[::-1]:
            w, c, outs[name] = timed(model, ids)
            wall[name].append(w * 1e3)
            cpu[name].append(c * 1e3)
    for what, d in (("wall", wall), ("CPU", cpu)):
        a, b = statistics.median(d["f32"]), statistics.median(d["int"])
        print(f"threads {os.environ['LUMINAL_RECIPES_THREADS']}, {what}: f32 products {a:.2f} ms/token, integer "
              f"products {b:.2f} ms/token, ratio {b / a:.2f}; load average {os.getloadavg()[0]:.1f}")
    print("greedy ids equal:", outs["f32"] == outs["int"], outs["int"][:12])


if __name__ == "__main__":
    main()
