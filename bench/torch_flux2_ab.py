"""The tiny FLUX.2 forward (bench/torch_backend.py's ``flux2``; ``--workload qwen3-decode``: its decode step)
through torch.compile(backend="luminal") with this branch's CPU changes (A) and with them patched out (B), beside
inductor, in turns in one process (process CPU time and wall time per call, medians and per-round ratios; both
sides run the plans the first one's search chose). The changes, each switched off by a monkeypatch before B is
compiled (B's kernels are prepared under it):

- ``concat``: a stack along a new last axis copied along its strided axis (``layout._box3``, ``copy_box``);
- ``cse``: a repeated subexpression of an Elementwise computed once (``expression._repeated``);
- ``attn16``: the compiled attention over 16-dim heads (``attention_small.applies``);
- ``amxchain``: the AMX products described for the chains (``amx.CHAINED``; else each a Python step between
  them);
- ``tasks``: a lockstep chain's single-thread calls spread over its threads (``chain.TASKS``; else on thread 0).

``--min-part N`` prepares side A's kernels with ``threads.MIN_PART = N`` (finer parts for the chains' two threads).
``--min-split-phases-a N`` captures side A's chains with ``chain.MIN_SPLIT_PHASES = N``; ``--blocking-b`` hands
side B's lockstep chains to ``threads.blocking_pool()`` instead of the pool workers' compiled jobs
(``jit/lockstep.py``). ``--chain-min-part N`` captures side B's chains with ``threads.CHAIN_MIN_PART = N`` (A: the
default, or ``--chain-min-part-a``); ``--chain-min-part 65536`` (= ``MIN_PART``) gives B the kernels' own parts in
its chains, as before chains re-cut them (``chain.finer``). ``--off ''`` patches nothing else out of B.
``--attn16-b FILE`` gives side B the 16-dim attention kernels of another ``jit/attention_small.py`` (e.g. ``git show
main:runtimes/cpu/jit/attention_small.py > /tmp/a.py``; ``bench/attention16_ab.py`` loads it).

Each turn calls its side once untimed before the timed call (``--untimed``): inductor's OpenMP threads spin on
after its call (libgomp) and would take a core from the side timed next (``bench/torch_backend.py``).

Each side compiles its own function: Dynamo caches compiled graphs on the code object, so two compiles of
``model.forward`` itself (even after ``torch._dynamo.reset()``) would both run the graph compiled last.

    python bench/torch_flux2_ab.py --threads 1 --rounds 21 [--off concat,cse,attn16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from luminal_recipes.openblas_spin import limit_openblas_spin

limit_openblas_spin()
BENCH = Path(__file__).resolve().parent


def side_function(model, name: str):
    def side(*args, **kwargs):
        return model.forward(*args, **kwargs)

    side.__code__ = side.__code__.replace(co_name=f"side_{name}")  # a code object of its own
    return side


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="flux2", choices=("flux2", "qwen3-decode"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--off", default="concat,cse,attn16", help="the changes patched out of side B")
    parser.add_argument("--attn16-b", default="", help="side B's jit/attention_small.py (another version's file)")
    parser.add_argument("--min-part", type=int, default=None,
                        help="side A's kernels prepared with this threads.MIN_PART (elements a part at least)")
    parser.add_argument("--chain-min-part", type=int, default=None,
                        help="side B's chains captured with this threads.CHAIN_MIN_PART")
    parser.add_argument("--chain-min-part-a", type=int, default=None,
                        help="side A's chains captured with this threads.CHAIN_MIN_PART")
    parser.add_argument("--min-split-phases-a", type=int, default=None,
                        help="side A's chains captured with this chain.MIN_SPLIT_PHASES (lockstep from N split phases)")
    parser.add_argument("--blocking-b", action="store_true",
                        help="side B's lockstep chains handed to threads.blocking_pool() (not the pool workers' "
                             "compiled jobs, jit/lockstep.py)")
    parser.add_argument("--no-inductor", action="store_true",
                        help="A and B only: inductor's OpenMP threads spin on after its turn, and chains that sample "
                             "the machine's load (chain.crowded) then run alone")
    parser.add_argument("--untimed", type=int, default=1,
                        help="calls of a side before its timed call in each turn (torch_backend.UNTIMED_CALLS)")
    args = parser.parse_args(argv)
    os.environ.setdefault("LUMINAL_RECIPES_CACHE", tempfile.mkdtemp(prefix="luminal-flux2-ab-"))
    sys.path.insert(0, str(BENCH))
    import torch_backend as tb
    from flux2_transformer_cpu import blas_threads

    threads = blas_threads(args.threads)
    import torch

    from luminal_recipes.runtimes.cpu import amx
    from luminal_recipes.runtimes.cpu.jit import chain
    from luminal_recipes.runtimes.cpu.kernels import attention_small, layout
    from luminal_recipes.runtimes.kernels import expression

    torch.set_num_threads(threads)
    patches = {"concat": (layout, "_box3", lambda *a, **k: None),
               "cse": (expression, "_repeated", lambda *a, **k: {}),
               "attn16": (attention_small, "applies", lambda *a, **k: False),
               "amxchain": (amx, "CHAINED", False),
               "tasks": (chain, "TASKS", False)}
    off = [name for name in args.off.split(",") if name]
    if args.attn16_b:
        from attention16_ab import load_module

        base = load_module(args.attn16_b)
        patches["attn16b"] = (attention_small, "_kernels", lambda: base)
        off.append("attn16b")
    model, call, prepare = tb.WORKLOADS[args.workload](torch)
    if prepare is not None:  # (the decode step: a fresh copy of the cache before each call, outside the timing)
        timed_call = call

        def call(fn):
            inner = timed_call(fn)

            def run():
                prepare()
                return inner()
            run.timed = inner
            return run
    sides, outputs = {}, {}
    from luminal_recipes.runtimes.cpu import threads as cpu_threads

    with torch.no_grad():
        sides["A"] = call(torch.compile(side_function(model, "A"), backend="luminal"))
        default_part, default_chain_part = cpu_threads.MIN_PART, cpu_threads.CHAIN_MIN_PART
        default_split, default_hand_off = chain.MIN_SPLIT_PHASES, chain.LOCKSTEP_WORKERS
        if args.min_part is not None or args.chain_min_part_a is not None or args.min_split_phases_a is not None:
            cpu_threads.MIN_PART = args.min_part or default_part  # A's kernels prepared (and chains captured)
            cpu_threads.CHAIN_MIN_PART = args.chain_min_part_a or default_chain_part  # under them
            if args.min_split_phases_a is not None:
                chain.MIN_SPLIT_PHASES = args.min_split_phases_a
            for _ in range(7):
                outputs["A"] = sides["A"]()
            cpu_threads.MIN_PART, cpu_threads.CHAIN_MIN_PART = default_part, default_chain_part
            chain.MIN_SPLIT_PHASES = default_split
        saved = {name: getattr(patches[name][0], patches[name][1]) for name in off}
        for name in off:
            setattr(patches[name][0], patches[name][1], patches[name][2])
        if args.chain_min_part is not None:
            cpu_threads.CHAIN_MIN_PART = args.chain_min_part
        if args.blocking_b:
            chain.LOCKSTEP_WORKERS = False  # (read by each chain at its capture)
        sides["B"] = call(torch.compile(side_function(model, "B"), backend="luminal"))
        for _ in range(7):  # B's kernels are prepared (and its chains captured) while the patches hold
            outputs["B"] = sides["B"]()
        chain.LOCKSTEP_WORKERS = default_hand_off
        for name in off:
            setattr(patches[name][0], patches[name][1], saved[name])
        cpu_threads.CHAIN_MIN_PART = default_chain_part
        if not args.no_inductor:
            sides["inductor"] = call(torch.compile(side_function(model, "inductor")))
        for side in sides:
            for _ in range(7):
                outputs[side] = sides[side]()
        eager = call(model.forward)()
        wall = {k: [] for k in sides}
        cpu = {k: [] for k in sides}
        for _ in range(args.rounds):
            for k, fn in sides.items():
                for _ in range(args.untimed):  # (torch_backend.UNTIMED_CALLS)
                    fn()
                if prepare is not None:
                    prepare()
                timed = getattr(fn, "timed", fn)
                c0, t0 = time.process_time(), time.perf_counter()
                timed()
                wall[k].append(time.perf_counter() - t0)
                cpu[k].append(time.process_time() - c0)

    print(f"{args.workload} A/B ({threads} threads, {args.rounds} rounds; B without: {', '.join(off)}; B's chain part "
          f"{args.chain_min_part or default_chain_part}; load average {os.getloadavg()[0]:.2f}; chain runs "
          f"{chain.RUNS})")
    for k in sides:
        print(f"  {k:9s} wall median {statistics.median(wall[k]) * 1e3:6.1f} ms (min {min(wall[k]) * 1e3:6.1f})  "
              f"cpu median {statistics.median(cpu[k]) * 1e3:6.1f} ms (min {min(cpu[k]) * 1e3:6.1f})")
    for a, b in (("A", "B"), ("A", "inductor"), ("B", "inductor"))[:1 if args.no_inductor else 3]:
        rc = [x / y for x, y in zip(cpu[a], cpu[b])]
        rw = [x / y for x, y in zip(wall[a], wall[b])]
        print(f"  {a}/{b}: cpu {statistics.median(rc):.3f}x (rounds {min(rc):.2f}-{max(rc):.2f})  "
              f"wall {statistics.median(rw):.3f}x (rounds {min(rw):.2f}-{max(rw):.2f})")
    print(f"  max |A - B| = {(outputs['A'].double() - outputs['B'].double()).abs().max().item():.3g}")
    for k in sides:
        print(f"  max |{k} - eager| = {(outputs[k].double() - eager.double()).abs().max().item():.3g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
