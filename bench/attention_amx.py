"""The numpy runtime's Attention kernel with both products on AMX (``runtimes/cpu/amx/attention.py``) against the same
kernel on its BLAS path (q k^T on AMX, p v on BLAS: what runs where ``amx_attention`` does not) and PyTorch's
SDPA, in one process, timed in turns; and the accuracy of each against float64.

    python bench/attention_amx.py [--repeats 20] [--sizes 4x768x64,4x4608x128]
    python bench/attention_amx.py --step [--repeats 10]   # a medium transformer step, attention fused vs not
    python bench/attention_amx.py --baseline /tmp/main_amx_attention.py   # and the fused kernel of another file

``--baseline FILE``: one more side, the fused kernel compiled from FILE (another version of
``runtimes/cpu/amx/attention.py``, e.g. ``git show main:runtimes/cpu/amx/attention.py > FILE``), in the same
turns, with its per-turn ratio to this tree's kernel.

Kernel rows: ``heads x tokens x head_dim`` self-attention (q, k, v bound in place, as in ``bench/matmul.py``),
the sides taking turns as ``matmul.interleaved_seconds`` does (each turn settles for 40 ms first); medians,
minima and the median over the turns of the per-turn ratios. ``--step``: the FLUX.2 transformer of
``bench/flux2_transformer_cpu.py`` (the medium pipeline's 8 double + 16 single blocks, 256 image + 512 text
tokens) compiled once and loaded twice, its Attention kernels prepared fused in one and on the BLAS path in the
other, and PyTorch eager's step, the three in turns.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import numpy as np  # noqa: E402
from matmul import blas_report, case_attention, interleaved_seconds, torch_sdpa  # noqa: E402

from luminal_recipes.runtimes.cpu import amx  # noqa: E402
from luminal_recipes.runtimes.cpu.backend import NumpyRuntime  # noqa: E402


def _fused_off():
    """A context in which ``Attention`` kernels are prepared on their BLAS path."""
    from luminal_recipes.runtimes.cpu.amx import attention as amx_attention

    class Off:
        def __enter__(self):
            self.ready = amx_attention.ready
            amx_attention.ready = lambda: False

        def __exit__(self, *exc):
            amx_attention.ready = self.ready

    return Off()


class _Baseline:
    """A context in which ``Attention`` kernels are prepared with the fused kernel of another
    ``runtimes/cpu/amx/attention.py`` (loaded as a module of the AMX package, so that its relative imports
    resolve)."""

    def __init__(self, path: str):
        import importlib.util

        import luminal_recipes.runtimes.cpu.amx as package

        name = f"{package.__name__}._baseline_attention"
        spec = importlib.util.spec_from_file_location(name, path)
        self.module = importlib.util.module_from_spec(spec)
        sys.modules[name] = self.module
        spec.loader.exec_module(self.module)
        self.package = package

    def __enter__(self):
        self.kept = sys.modules[f"{self.package.__name__}.attention"]
        sys.modules[self.kept.__name__] = self.module
        self.package.attention = self.module

    def __exit__(self, *exc):
        sys.modules[self.kept.__name__] = self.kept
        self.package.attention = self.kept


def _error(ours: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(ours - want).max() / np.abs(want).max())


def kernel_rows(sizes, repeats: int, baseline: str | None) -> None:
    import torch

    from luminal_recipes.runtimes.cpu.amx import attention as amx_attention  # noqa: F401 - loaded before a baseline

    base = _Baseline(baseline) if baseline else None

    print(f"{'Attention (ours fused | ours BLAS path | SDPA)':<34}{'medians ms':>24}{'minima ms':>24}"
          f"{'fused/SDPA':>12}{'BLAS/SDPA':>11}{'fused/BLAS':>11}  error vs float64 (fused, BLAS, SDPA)")
    rng = np.random.default_rng(0)
    for b, s, d in sizes:
        q, k, v = (rng.standard_normal((b, s, d)).astype(np.float32) for _ in range(3))
        weights = {"q": q, "k": k, "v": v}
        fused = NumpyRuntime().load(case_attention(b, s, d, False), weights)
        with _fused_off():
            blas = NumpyRuntime().load(case_attention(b, s, d, False), weights)
        sdpa = torch_sdpa(q, k, v)
        if base:
            with base:
                other = NumpyRuntime().load(case_attention(b, s, d, False), weights)
        exact = torch.nn.functional.scaled_dot_product_attention(
            *(torch.from_numpy(a.astype(np.float64))[None] for a in (q, k, v)))[0].numpy()
        theirs = torch.nn.functional.scaled_dot_product_attention(*(torch.from_numpy(a)[None] for a in (q, k, v)))
        errors = [_error(exe.run()["y"], exact) for exe in (fused, blas)] + [_error(theirs[0].numpy(), exact)]
        calls = [fused.execute, blas.execute, sdpa] + ([other.execute] if base else [])
        times = interleaved_seconds(calls, repeats if s < 2048 else max(3, repeats // 4))
        med = [statistics.median(t) * 1e3 for t in times]
        low = [min(t) * 1e3 for t in times]

        def ratio(i, j, times=times):
            return statistics.median(a / c for a, c in zip(times[i], times[j]))

        print(f"{f'{b} x {s} x {d}':<34}{' / '.join(f'{x:.2f}' for x in med[:3]):>24}"
              f"{' / '.join(f'{x:.2f}' for x in low[:3]):>24}"
              f"{ratio(0, 2):12.2f}{ratio(1, 2):11.2f}{ratio(0, 1):11.2f}  "
              + ", ".join(f"{e:.1e}" for e in errors))
        if base:
            print(f"{'':<34}baseline {statistics.median(times[3]) * 1e3:.2f} ms median, {min(times[3]) * 1e3:.2f} min, "
                  f"error {_error(other.run()['y'], exact):.1e}; fused / baseline per turn {ratio(0, 3):.3f}")


def step_rows(repeats: int, baseline: str | None) -> None:
    import tempfile

    import flux2_transformer_cpu as ft
    import torch

    from luminal_recipes.recipe.builder import build
    from luminal_recipes.runtimes.profile import profiling

    threads = ft.blas_threads(None)
    torch.set_num_threads(threads)
    cfg = ft.TransformerConfig(double=8, single=16)
    with tempfile.TemporaryDirectory(prefix="attention-step-") as tmp:
        folder = Path(tmp) / "transformer"
        reference = ft.save_diffusers_transformer(folder, cfg, 0)
        inputs = ft.step_inputs(cfg, reference.config.axes_dims_rope, reference.config.rope_theta, 1)
        model = build(ft.RECIPE, weights=folder)
        runtime, program, _, dims, _, _ = ft.compile_ours(model, inputs, Path(tmp) / "cache")
        fused = runtime.load(program, model.load_weight, dims)
        other = "baseline" if baseline else "BLAS path"
        if baseline:  # the second side: the baseline's fused kernel instead of the BLAS path
            from luminal_recipes.runtimes.cpu.amx import attention as amx_attention  # noqa: F401 - loaded before the baseline

            with _Baseline(baseline):
                blas = runtime.load(program, model.load_weight, dims)
        else:
            with _fused_off():
                blas = runtime.load(program, model.load_weight, dims)
        theirs = ft.torch_step(reference, cfg, inputs)
        want = theirs()
        errors = [_error(exe.run(inputs)["velocity"], want) for exe in (fused, blas)]
        sides = [lambda: fused.run(inputs, copy_outputs=False), lambda: blas.run(inputs, copy_outputs=False), theirs]
        times = [[], [], []]
        for i in range(repeats + 2):
            for side, record in zip(sides, times):
                t = time.perf_counter()
                side()
                if i >= 2:
                    record.append(time.perf_counter() - t)
        print(f"{cfg.double} double + {cfg.single} single blocks, {cfg.img} + {cfg.txt} tokens, {threads} threads; "
              f"max |ours - torch| / max |torch|: fused {errors[0]:.1e}, {other} {errors[1]:.1e}")
        second = f"ours, attention {other}"
        for name, t in zip(("ours, attention fused", second, "PyTorch eager"), times):
            print(f"  {name:26s} median {statistics.median(t) * 1e3:7.1f} ms  min {min(t) * 1e3:7.1f} ms")
        per_turn = [statistics.median(a / c for a, c in zip(times[i], times[j])) for i, j in ((0, 1), (0, 2), (1, 2))]
        print(f"  per-turn ratio medians: fused / {other} {per_turn[0]:.3f}, fused / torch {per_turn[1]:.3f}, "
              f"{other} / torch {per_turn[2]:.3f}; load {os.getloadavg()[0]:.2f}")
        # the Attention kernels' own time per step (the runtime's per-kernel clock), the two sides in turns
        attention = [[], []]
        for _ in range(repeats):
            for side, record in zip(sides[:2], attention):
                with profiling() as profile:
                    side()
                record.append(sum(sec for (_, kernel), sec in profile.seconds.items() if kernel == "Attention"))
        med, low = ([f(t) * 1e3 for t in attention] for f in (statistics.median, min))
        ratio = statistics.median(a / b for a, b in zip(*attention))
        print(f"  Attention kernels per step: fused median {med[0]:.1f} ms (min {low[0]:.1f}), "
              f"{other} {med[1]:.1f} "
              f"ms (min {low[1]:.1f}); per-turn ratio median {ratio:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--step", action="store_true", help="a medium transformer step instead of the kernel rows")
    ap.add_argument("--repeats", type=int, default=20, help="turns per side (a quarter at >= 2048 tokens)")
    ap.add_argument("--baseline", help="another amx_attention.py whose fused kernel is timed in the same turns")
    ap.add_argument("--sizes", default="4x768x64,4x4608x128", help="heads x tokens x head_dim, comma-separated")
    args = ap.parse_args()
    reason = amx.reason_unavailable()
    if reason:
        raise SystemExit(f"AMX unavailable: {reason}")
    for line in blas_report():
        print(line)
    if args.step:
        return step_rows(args.repeats, args.baseline)
    kernel_rows([tuple(map(int, size.split("x"))) for size in args.sizes.split(",")], args.repeats, args.baseline)


if __name__ == "__main__":
    main()
