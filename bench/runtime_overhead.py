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
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", default="tiny", help="comma-separated: tiny, medium")
    parser.add_argument("--workdir", type=Path, default=None, help="keeps the medium checkpoint and plan caches")
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args(argv)
    workdir = args.workdir or Path(bench.tempfile.mkdtemp(prefix="runtime-overhead-"))
    for name in args.configs.split(","):
        measure(bench.CONFIGS[name], workdir, args.runs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
