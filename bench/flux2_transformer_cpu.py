"""CPU speed of one FLUX.2 transformer step: our compiled program on the numpy runtime vs PyTorch eager.

A FLUX.2-architecture transformer (diffusers ``Flux2Transformer2DModel``; default: hidden 256 = 4 heads x
64, 2 double + 4 single blocks, joint_attention_dim 384, in_channels 128, MLP ratio 3) is created by diffusers
from a seeded random initialisation and saved with ``save_pretrained``; ours is built from
recipes/flux2-transformer.yaml on that same folder. Both run the same inputs (256 image + 512 text tokens, as
the pipeline pads every prompt; ``--txt 64`` for short ones)
with the same number of threads (torch.set_num_threads = the threads numpy's BLAS uses). The script checks
that the outputs agree, then prints the median step time of each (after warm-up, the two sides alternating),
the ratio ours / PyTorch (target <= 1.0, goal <= 0.7), and our compile time with a cold and a warm plan
cache.

    python bench/flux2_transformer_cpu.py               # default sizes (about a minute on 2 cores)
    python bench/flux2_transformer_cpu.py --profile 25  # also cProfile our step: the 25 costliest functions

The BLAS library, its CPU kernel and thread count are printed first (see bench/README.md for the environment).
"""

from __future__ import annotations

import argparse
import cProfile
import ctypes
import glob
import os
import pstats
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from luminal_recipes.openblas_spin import limit_openblas_spin

limit_openblas_spin()  # as the CLI does, before numpy loads OpenBLAS

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from matmul import blas_report  # noqa: E402  (same folder: the BLAS/environment report of every benchmark)

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "flux2-transformer.yaml"


@dataclass(frozen=True)
class TransformerConfig:
    heads: int = 4
    head_dim: int = 64
    double: int = 2
    single: int = 4
    joint_dim: int = 384
    in_channels: int = 128
    mlp_ratio: float = 3.0
    img: int = 256  # image tokens (a 16 x 16 latent grid)
    txt: int = 512  # as FLUX.2 pads every prompt (max_sequence_length)

    @property
    def hidden(self) -> int:
        return self.heads * self.head_dim

    @property
    def grid(self) -> tuple[int, int]:
        h = int(round(self.img**0.5))
        while self.img % h:
            h -= 1
        return h, self.img // h


def _openblas(function: str):
    """``function`` (e.g. ``get_num_threads``) of the OpenBLAS numpy links, under whichever symbol prefix and
    suffix its build uses; None when numpy's BLAS is not a bundled OpenBLAS."""
    for path in glob.glob(os.path.join(os.path.dirname(np.__file__), os.pardir, "numpy.libs", "*openblas*")):
        lib = ctypes.CDLL(path)
        for prefix in ("scipy_openblas", "openblas"):
            for suffix in ("64_", ""):
                fn = getattr(lib, f"{prefix}_{function}{suffix}", None)
                if fn is not None:
                    return fn
    return None


def blas_threads(wanted: int | None = None) -> int:
    """Set numpy's BLAS threads and our kernels' (``runtimes.cpu_threads``) to ``wanted`` (if given) and return
    the count BLAS uses (the CPU count when OpenBLAS cannot be asked)."""
    if wanted is not None:
        setter = _openblas("set_num_threads")
        if setter is None:
            raise SystemExit("--threads: cannot set the BLAS thread count of this numpy build; set "
                             "OPENBLAS_NUM_THREADS / OMP_NUM_THREADS instead")
        setter(int(wanted))
        from luminal_recipes.runtimes.cpu import threads as cpu_threads

        os.environ["LUMINAL_RECIPES_THREADS"] = str(int(wanted))  # child processes too
        cpu_threads.THREADS = int(wanted)
    getter = _openblas("get_num_threads")
    return int(getter()) if getter is not None else os.cpu_count() or 1


def median_time(fn, repeats: int, warmup: int = 1) -> tuple[float, list[float]]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def save_diffusers_transformer(folder: Path, cfg: TransformerConfig, seed: int):
    """A seeded random ``Flux2Transformer2DModel`` saved by diffusers; returns the model (f32, eval mode)."""
    import torch
    from diffusers import Flux2Transformer2DModel

    torch.manual_seed(seed)
    quarter = cfg.head_dim // 4
    model = Flux2Transformer2DModel(
        patch_size=1, in_channels=cfg.in_channels, num_layers=cfg.double, num_single_layers=cfg.single,
        attention_head_dim=cfg.head_dim, num_attention_heads=cfg.heads, joint_attention_dim=cfg.joint_dim,
        timestep_guidance_channels=256, mlp_ratio=cfg.mlp_ratio,
        axes_dims_rope=(quarter, quarter, quarter, cfg.head_dim - 3 * quarter), rope_theta=2000, eps=1e-6,
        guidance_embeds=True,
    ).to(torch.float32).eval()
    model.save_pretrained(folder)
    return model


def step_inputs(cfg: TransformerConfig, axes_dims, theta: float, seed: int) -> dict[str, np.ndarray]:
    """One denoising step's transformer inputs, as the pipeline makes them (rope tables in f64, then f32)."""
    from luminal_recipes.tasks.flux2.latents import latent_ids, text_ids
    from luminal_recipes.tasks.flux2.steps import rope_tables

    rng = np.random.default_rng(seed)
    h, w = cfg.grid
    ids = np.concatenate([text_ids(cfg.txt), latent_ids(h, w)]).astype(np.float64)
    rope = rope_tables(None, ids, list(axes_dims), theta)
    return {
        "hidden_states": rng.standard_normal((1, cfg.img, cfg.in_channels)).astype(np.float32),
        "encoder_hidden_states": rng.standard_normal((1, cfg.txt, cfg.joint_dim)).astype(np.float32),
        "timestep": np.float32([0.73]),
        "guidance": np.float32([4.0]),
        "rope_cos": rope["cos"].astype(np.float32),
        "rope_sin": rope["sin"].astype(np.float32),
    }


def torch_step(model, cfg: TransformerConfig, inputs: dict[str, np.ndarray]):
    """A no-argument callable running diffusers' forward once on ``inputs``; returns the velocity (numpy)."""
    import torch

    from luminal_recipes.tasks.flux2.latents import latent_ids, text_ids

    h, w = cfg.grid
    args = dict(
        hidden_states=torch.from_numpy(inputs["hidden_states"]),
        encoder_hidden_states=torch.from_numpy(inputs["encoder_hidden_states"]),
        timestep=torch.from_numpy(inputs["timestep"]), guidance=torch.from_numpy(inputs["guidance"]),
        img_ids=torch.tensor(latent_ids(h, w)).float(), txt_ids=torch.tensor(text_ids(cfg.txt)).float(),
        return_dict=False,
    )

    def run():
        with torch.inference_mode():
            return model(**args)[0].numpy()

    return run


def compile_ours(model, inputs: dict[str, np.ndarray], cache: Path):
    """Compile the built graph with an empty plan cache, then again (warm, a cache hit)."""
    from luminal_recipes.compiler.search import compile_graph
    from luminal_recipes.pipeline.engine import infer_dims
    from luminal_recipes.runtimes.cpu.backend import NumpyRuntime

    os.environ["LUMINAL_RECIPES_CACHE"] = str(cache)
    dims = infer_dims(model, inputs)
    runtime = NumpyRuntime()
    t0 = time.perf_counter()
    cold = compile_graph(model.graph, runtime, dims, inputs=inputs, weights=model.load_weight)
    cold_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    warm = compile_graph(model.graph, runtime, dims, inputs=inputs, weights=model.load_weight)
    warm_s = time.perf_counter() - t0
    if warm.report.get("cache") != "hit":
        print(f"warning: the second compile did not hit the plan cache ({warm.report.get('cache')})")
    return runtime, cold.program, cold.report, dims, cold_s, warm_s


def kernel_summary(program) -> str:
    counts = sorted(program.kernel_counts().items(), key=lambda kv: -kv[1])
    return ", ".join(f"{op} {n}" for op, n in counts)


def profile_step(step, top: int) -> None:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(5):
        step()
    profiler.disable()
    print(f"\ncProfile of 5 of our steps, {top} costliest functions by own time:")
    stats = pstats.Stats(profiler, stream=sys.stdout)
    stats.sort_stats("tottime").print_stats(top)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=15, help="timed steps per side (median; default 15)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--double", type=int, default=2, help="double-stream blocks")
    parser.add_argument("--single", type=int, default=4, help="single-stream blocks")
    parser.add_argument("--img", type=int, default=256, help="image tokens")
    parser.add_argument("--txt", type=int, default=512,
                        help="text tokens (default 512: the pipeline pads every prompt to 512; 64: the old default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None,
                        help="threads for both sides (default: numpy's BLAS threads, normally the CPU count)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="cProfile our step and print the N costliest functions")
    args = parser.parse_args(argv)
    cfg = TransformerConfig(heads=args.heads, head_dim=args.head_dim, double=args.double, single=args.single,
                            img=args.img, txt=args.txt)

    import torch

    from luminal_recipes.recipe.builder import build

    threads = blas_threads(args.threads)
    torch.set_num_threads(threads)
    for line in blas_report():
        print(line)
    print(f"threads: numpy BLAS {threads}, torch {torch.get_num_threads()} (torch {torch.__version__}, "
          f"{torch.backends.cpu.get_cpu_capability()})")
    print(f"config: hidden {cfg.hidden} ({cfg.heads} heads x {cfg.head_dim}), {cfg.double} double + "
          f"{cfg.single} single blocks, joint_attention_dim {cfg.joint_dim}, in_channels {cfg.in_channels}, "
          f"{cfg.img} image + {cfg.txt} text tokens")

    with tempfile.TemporaryDirectory(prefix="flux2-bench-") as tmp:
        folder = Path(tmp) / "transformer"
        reference = save_diffusers_transformer(folder, cfg, args.seed)
        rc = reference.config
        inputs = step_inputs(cfg, rc.axes_dims_rope, rc.rope_theta, args.seed + 1)
        model = build(RECIPE, weights=folder)
        runtime, program, report, dims, cold_s, warm_s = compile_ours(model, inputs, Path(tmp) / "cache")
        print(f"compile: cold {cold_s:.2f} s, warm (plan cache hit) {warm_s:.3f} s; chosen by "
              f"{report['chosen'].get('selected_by')}, {len(program.nodes)} nodes: {kernel_summary(program)}")
        t0 = time.perf_counter()
        exe = runtime.load(program, model.load_weight, dims)
        print(f"load: {time.perf_counter() - t0:.2f} s; arena {exe.memory.arena_bytes / 2**20:.1f} MiB, "
              f"weights {exe.memory.weight_bytes / 2**20:.1f} MiB")

        ours = exe.run(inputs)["velocity"]
        theirs = torch_step(reference, cfg, inputs)
        want = theirs()
        err = float(np.abs(ours - want).max() / np.abs(want).max())
        verdict = "ok" if err <= 1e-4 else "TOO LARGE"
        print(f"agreement: max |ours - torch| / max |torch| = {err:.2e} ({verdict})")
        if not np.array_equal(ours, exe.run(inputs)["velocity"]):
            print("warning: two runs of our program gave different bits")

        def our_step():
            exe.run(inputs, copy_outputs=False)

        # interleave the two sides so that background load hits both alike
        ours_t, theirs_t = [], []
        for _ in range(args.warmup):
            our_step()
            theirs()
        for _ in range(args.repeats):
            ours_t.append(median_time(our_step, 1, 0)[0])
            theirs_t.append(median_time(theirs, 1, 0)[0])
        ours_s, theirs_s = statistics.median(ours_t), statistics.median(theirs_t)
        print(f"step: ours {ours_s * 1e3:.1f} ms (min {min(ours_t) * 1e3:.1f}), PyTorch eager "
              f"{theirs_s * 1e3:.1f} ms (min {min(theirs_t) * 1e3:.1f}); median of {args.repeats} after "
              f"{args.warmup} warm-up")
        print(f"ratio ours / PyTorch: {ours_s / theirs_s:.3f} (target <= 1.0, goal <= 0.7); load average "
              f"{os.getloadavg()[0]:.2f} (1 min) at the end")
        if args.profile:
            profile_step(our_step, args.profile)
    return 0 if err <= 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
