"""FLUX.2 text-to-image on CPU: our pipeline vs diffusers' ``Flux2Pipeline`` stage by stage, and peak memory.

Two configurations of the FLUX.2 architecture, both with random weights saved by diffusers/transformers:

- ``tiny``: the checkpoint shipped in recipes/flux2-tiny/checkpoint at the tiny recipe's defaults (80x48);
- ``medium``: a checkpoint built here with recipes/flux2-tiny/make_checkpoint.py's own code: a transformer at
  hidden 256 (4 heads x 64) with FLUX.2-dev's 1:2 mix of 8 double + 16 single blocks (115 MiB of f32
  weights, the largest model, as in FLUX.2-dev), a VAE with 16-32-64-128 channels, a 10-layer text encoder,
  at 256x256.

Both pipelines get the same prompt, the same initial latents and the same number of steps, on the same number
of threads (torch.set_num_threads = the threads numpy's BLAS uses). Each is run ``--repeats`` times after one
warm-up run (ours with a warm plan cache), the two sides in turns, and the median per stage is printed with the
ratio ours / diffusers (then each turn's ratio, median and range):
text encoder (tokenizer + model), each denoising step (transformer + Euler update) and the VAE decode. Our
times exclude loading the compiled program (printed separately, with the compile time on a cold and a warm
plan cache). The images are compared (PSNR) to show both computed the same thing.

Peak memory is measured in a separate process per run (its maximum resident set, ``ru_maxrss``, after a
first process has filled the plan cache): our pipeline without a budget, then with a budget smaller than the
transformer's weights (``Pipeline(..., budget_bytes=...)``, the transformer's blocks streamed), and diffusers
for reference. The budgeted run's per-step slowdown is printed too.

    python bench/flux2_cpu.py                      # both configurations (a few minutes on 2 cores)
    python bench/flux2_cpu.py --configs tiny       # one of them
    python bench/flux2_cpu.py --workdir /tmp/f2    # keep (and reuse) the medium checkpoint and plan cache
    python bench/flux2_cpu.py --isa avx2           # both sides on an AVX2 path (an AVX2-only server, simulated)

``--isa amx|avx512|avx2`` sets the instruction-set path of both sides in the environment before numpy, OpenBLAS,
numba and PyTorch load (each reads it once): ours through ``LUMINAL_RECIPES_ISA`` (``runtimes/cpu/isa.py``; for
avx2 numba compiles for Haswell), numpy's OpenBLAS through ``OPENBLAS_CORETYPE``, PyTorch through ATen's
dispatch level (``ATEN_CPU_CAPABILITY``) and MKL's and oneDNN's instruction caps (``MKL_ENABLE_INSTRUCTIONS``,
``ONEDNN_MAX_CPU_ISA``; AMX off for avx512). The paths each side took are printed first.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

# --isa: the environment each setting gives both sides (read by the libraries when they load, so set first)
ISA_ENV: dict[str, dict[str, str]] = {
    "amx": {"LUMINAL_RECIPES_ISA": "amx"},
    "avx512": {"LUMINAL_RECIPES_ISA": "avx512", "ATEN_CPU_CAPABILITY": "avx512",
               "MKL_ENABLE_INSTRUCTIONS": "AVX512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"},
    "avx2": {"LUMINAL_RECIPES_ISA": "avx2", "NUMBA_CPU_NAME": "haswell", "OPENBLAS_CORETYPE": "Haswell",
             "ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
}


def _isa_from_argv(argv: list[str]) -> str | None:
    for i, arg in enumerate(argv):
        if arg == "--isa" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--isa="):
            return arg.split("=", 1)[1]
    return None


os.environ.update(ISA_ENV.get(_isa_from_argv(sys.argv[1:]) or "", {}))  # argparse checks the value later

from luminal_recipes.openblas_spin import limit_openblas_spin  # noqa: E402

limit_openblas_spin()  # as the CLI does, before numpy loads OpenBLAS

import numpy as np  # noqa: E402

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
RECIPE = ROOT / "recipes" / "flux2-tiny.yaml"
TINY_CHECKPOINT = ROOT / "recipes" / "flux2-tiny" / "checkpoint"
PROMPT = "a lighthouse on a cliff at dusk, oil painting"
GUIDANCE = 4.0


@dataclass(frozen=True)
class BenchConfig:
    name: str
    width: int
    height: int
    text_encoder_out_layers: tuple[int, int, int]
    steps: int = 4
    max_sequence_length: int = 512
    seed: int = 0
    variant: dict | None = None  # make_checkpoint.Variant fields; None: the shipped tiny checkpoint
    budget_fraction: float = 0.85  # of the transformer's weight bytes, for the bounded-memory run

    def sets(self) -> list[str]:
        layers = ",".join(map(str, self.text_encoder_out_layers))
        return [f"text_encoder_out_layers=[{layers}]", f"seed={self.seed}", f"width={self.width}",
                f"height={self.height}", f"steps={self.steps}",
                f"max_sequence_length={self.max_sequence_length}"]


CONFIGS = {
    "tiny": BenchConfig("tiny", 80, 48, (10, 20, 30)),
    "medium": BenchConfig("medium", 256, 256, (2, 5, 8), variant=dict(
        seed=11, text_hidden=32, text_layers=10, text_heads=4, text_kv_heads=2, text_head_dim=8,
        text_intermediate=96, text_encoder_out_layers=(2, 5, 8),
        num_layers=8, num_single_layers=16, num_attention_heads=4, attention_head_dim=64,
        axes_dims_rope=(16, 16, 16, 16), mlp_ratio=3.0,
        vae_block_out_channels=(16, 32, 64, 128), vae_decoder_block_out_channels=None, vae_layers_per_block=2,
        vae_norm_num_groups=16,
    )),
}


# ---- checkpoints -------------------------------------------------------------------------------------------
def _make_checkpoint_module():
    path = TINY_CHECKPOINT.parent / "make_checkpoint.py"
    spec = importlib.util.spec_from_file_location("flux2_make_checkpoint", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


def checkpoint_for(cfg: BenchConfig, workdir: Path) -> Path:
    """The checkpoint folder of ``cfg``: the shipped tiny one, or one built (once per workdir) by the tiny
    checkpoint's own script with ``cfg.variant`` (its tokenizer copied from the tiny checkpoint)."""
    if cfg.variant is None:
        return TINY_CHECKPOINT
    folder = workdir / f"checkpoint-{cfg.name}"
    stamp = folder / "bench-variant.json"
    wanted = json.dumps(cfg.variant, sort_keys=True)
    if stamp.exists() and stamp.read_text() == wanted:
        return folder
    module = _make_checkpoint_module()
    module.VARIANTS[cfg.name] = module.Variant(**cfg.variant)
    t0 = time.perf_counter()
    module.build(folder, cfg.name, tokenizer_from=TINY_CHECKPOINT)
    stamp.write_text(wanted)
    print(f"built the {cfg.name} checkpoint in {time.perf_counter() - t0:.1f} s: {folder}")
    return folder


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def initial_latents(cfg: BenchConfig) -> np.ndarray:
    from luminal_recipes.tasks.flux2.latents import initial_noise

    return initial_noise(cfg.seed, cfg.height, cfg.width)


# ---- our pipeline ------------------------------------------------------------------------------------------
@dataclass
class Timings:
    """Seconds per compared stage for one run: text encoder, each denoising step, VAE, whole run."""

    text: float
    steps: list[float]
    vae: float
    total: float


@contextmanager
def engine_run_times() -> Iterator[dict[str, list[float]]]:
    """Record the seconds of every model execution (``ModelEngine`` run time, per model name) while inside:
    our compute, without the graph building and program loading a stage does around it."""
    from luminal_recipes.pipeline.engine import ModelEngine

    runs: dict[str, list[float]] = {}
    call = ModelEngine.__call__

    def timed(self, inputs):
        out = call(self, inputs)
        runs.setdefault(self.model.name, []).append(self.stats.run_s[-1])
        return out

    ModelEngine.__call__ = timed
    try:
        yield runs
    finally:
        ModelEngine.__call__ = call


def our_timings(report, runs: dict[str, list[float]]) -> tuple[Timings, Timings]:
    """(compute, wall): model executions only (plus the host steps between them), and the stages' wall time,
    which adds everything else the pipeline does between them (graphs, programs and loaded models are kept from
    the warm-up run, as for a second prompt)."""
    stage = report.stage_seconds
    text_model, transformer, vae = (next(n for n in runs if key in n) for key in ("text", "transformer",
                                                                                  "vae"))
    text, vae_s = stage["tokenize"] + runs[text_model][0], stage["unpack"] + runs[vae][0]
    compute = Timings(text, list(runs[transformer]), vae_s, text + sum(runs[transformer]) + vae_s)
    wall = Timings(stage["tokenize"] + stage["text_encoder"], list(report.step_seconds),
                   stage["unpack"] + stage["vae"], sum(stage.values()))
    return compute, wall


def our_pipeline(cfg: BenchConfig, folder: Path, budget: int | None = None):
    """(pipeline, seconds to plan and compile every stage) for ``cfg`` on ``folder``."""
    from luminal_recipes.pipeline.driver import Pipeline

    pipe = Pipeline(RECIPE, weights=folder, sets=cfg.sets(), budget_bytes=budget)
    t0 = time.perf_counter()
    pipe.prepare()
    return pipe, time.perf_counter() - t0


def run_ours(pipe, cfg: BenchConfig):
    """(run report, model execution seconds per model) of one run of our pipeline; its models stay loaded for the
    next run, as for the prompts of one command (``release()`` after the last)."""
    with engine_run_times() as runs:
        report = pipe.run({"prompt": PROMPT, "init_latents": initial_latents(cfg)}, keep_loaded=True)
    return report, runs


# ---- diffusers ---------------------------------------------------------------------------------------------
def load_diffusers(folder: Path):
    from diffusers import Flux2Pipeline

    pipe = Flux2Pipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run_diffusers(pipe, cfg: BenchConfig) -> tuple[Timings, np.ndarray]:
    """One timed run of ``Flux2Pipeline`` with the same latents; steps are timed from the transformer's
    forward pre-hook to the end-of-step callback (transformer + scheduler step), as ours are."""
    import torch

    marks: dict[str, list[float]] = {"text": [], "step_start": [], "step_end": [], "vae": []}

    def timed(fn, key):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                marks[key].append(time.perf_counter() - t0)
        return wrapper

    def step_end(_pipe, _i, _t, kwargs):
        marks["step_end"].append(time.perf_counter())
        return kwargs

    # one pre-hook time per step: the pipeline calls the transformer once per step (no CFG pass in FLUX.2-dev)
    hook = pipe.transformer.register_forward_pre_hook(
        lambda *_: marks["step_start"].append(time.perf_counter()))
    encode, decode = pipe.encode_prompt, pipe.vae.decode
    pipe.encode_prompt = timed(encode, "text")
    pipe.vae.decode = timed(decode, "vae")
    try:
        t0 = time.perf_counter()
        with torch.inference_mode():
            image = pipe(prompt=PROMPT, height=cfg.height, width=cfg.width, num_inference_steps=cfg.steps,
                         guidance_scale=GUIDANCE, latents=torch.from_numpy(initial_latents(cfg)),
                         max_sequence_length=cfg.max_sequence_length,
                         text_encoder_out_layers=cfg.text_encoder_out_layers, output_type="np",
                         callback_on_step_end=step_end).images[0]
        total = time.perf_counter() - t0
    finally:
        hook.remove()
        pipe.encode_prompt, pipe.vae.decode = encode, decode
    steps = [end - start for start, end in zip(marks["step_start"], marks["step_end"])]
    return Timings(sum(marks["text"]), steps, sum(marks["vae"]), total), image


# ---- peak memory in a child process ------------------------------------------------------------------------
def child_main(args) -> int:
    """Run one pipeline once in this (fresh) process and print its figures as one JSON line."""
    from luminal_recipes.errors import LuminalError
    from luminal_recipes.pipeline import peak_rss

    cfg = CONFIGS[args.child_config]
    set_threads(args.threads)
    out: dict = {"side": args.child}
    try:
        if args.child == "ours":
            pipe, prepare_s = our_pipeline(cfg, Path(args.child_folder), args.child_budget)
            report, runs = run_ours(pipe, cfg)
            compute, _ = our_timings(report, runs)
            out.update(prepare_s=prepare_s, steps=compute.steps,
                       streamed={m: v.get("streamed") for m, v in report.memory.items()},
                       planned_peak={m: v.get("planned_peak_bytes") for m, v in report.memory.items()},
                       stage_rss={s: [v.get("rss_at_start_bytes"), v.get("max_rss_bytes")]
                                  for s, v in report.rss.items()},
                       stream={m: v["stream"] for m, v in report.memory.items() if "stream" in v})
        else:
            import torch

            torch.set_num_threads(args.threads)
            t, _ = run_diffusers(load_diffusers(Path(args.child_folder)), cfg)
            out.update(steps=t.steps)
    except LuminalError as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    # The process's high-water mark. Not ru_maxrss: Linux carries the parent's over fork + exec. Our pipeline
    # restarts the mark at each stage (and records each stage's), so take the largest of those too.
    stage_peaks = [v[1] or 0 for v in out.get("stage_rss", {}).values()]
    out["max_rss_bytes"] = max([peak_rss.peak() or 0, *stage_peaks])
    print("CHILD " + json.dumps(out))
    return 0


def measure_in_child(side: str, cfg: BenchConfig, folder: Path, threads: int,
                     budget: int | None = None) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", side, "--child-config", cfg.name,
           "--child-folder", str(folder), "--threads", str(threads)]
    if budget is not None:
        cmd += ["--child-budget", str(budget)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
    for line in done.stdout.splitlines():
        if line.startswith("CHILD "):
            return json.loads(line[len("CHILD "):])
    raise RuntimeError(f"child {' '.join(cmd)} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")


# ---- reporting ---------------------------------------------------------------------------------------------
def set_threads(threads: int | None) -> int:
    sys.path.insert(0, str(BENCH))
    from flux2_transformer_cpu import blas_threads

    return blas_threads(threads)


def mib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.1f} MiB"


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float("inf") if mse == 0 else float(10 * np.log10(255.0**2 / mse))


def median_timings(runs: list[Timings]) -> Timings:
    steps = [statistics.median(r.steps[k] for r in runs) for k in range(len(runs[0].steps))]
    return Timings(statistics.median(r.text for r in runs), steps, statistics.median(r.vae for r in runs),
                   statistics.median(r.total for r in runs))


def print_table(compute: Timings, wall: Timings, theirs: Timings, repeats: int) -> None:
    def row(label: str, a: float, w: float, b: float) -> None:
        print(f"  {label:<20} {a * 1e3:9.1f} {w * 1e3:9.1f} {b * 1e3:10.1f} {a / b:12.2f} {w / b:9.2f}")

    label = f"(median of {repeats} runs)"
    print(f"  {label:<20} {'ours ms':>9} {'ours wall':>9} {'diffusers':>10} {'ours/diffusers':>12} "
          f"{'wall/diff':>9}")
    row("text encoder", compute.text, wall.text, theirs.text)
    for k, (a, w, b) in enumerate(zip(compute.steps, wall.steps, theirs.steps)):
        row(f"denoising step {k + 1}", a, w, b)
    row("per step (median)", *(statistics.median(t.steps) for t in (compute, wall, theirs)))
    row("VAE decode", compute.vae, wall.vae, theirs.vae)
    row("whole run", compute.total, wall.total, theirs.total)


def print_turn_ratios(ours: list[Timings], theirs: list[Timings]) -> None:
    """Ours / diffusers of each turn (the two runs of a turn are next to each other in time): median, range."""
    def spread(label: str, pick) -> str:
        ratios = sorted(pick(a) / pick(b) for a, b in zip(ours, theirs))
        return f"{label} {statistics.median(ratios):.2f} ({ratios[0]:.2f}-{ratios[-1]:.2f})"

    print("  ours/diffusers per turn, median (range): " + ", ".join([
        spread("text encoder", lambda t: t.text), spread("per step", lambda t: statistics.median(t.steps)),
        spread("VAE", lambda t: t.vae), spread("whole run", lambda t: t.total)]))


def bench_config(cfg: BenchConfig, workdir: Path, repeats: int, threads: int, memory: bool) -> None:
    import torch

    from luminal_recipes.image_io import to_uint8

    folder = checkpoint_for(cfg, workdir)
    transformer_bytes = folder_bytes(folder / "transformer")
    print(f"\n== {cfg.name}: {cfg.width}x{cfg.height}, {cfg.steps} steps, {cfg.max_sequence_length} text "
          f"tokens, checkpoint {folder} (transformer weights {mib(transformer_bytes)})")

    cache = workdir / f"plan-cache-{cfg.name}"
    if cache.exists():
        shutil.rmtree(cache)
    os.environ["LUMINAL_RECIPES_CACHE"] = str(cache)
    _, cold_s = our_pipeline(cfg, folder)
    pipe, warm_s = our_pipeline(cfg, folder)
    first, _ = run_ours(pipe, cfg)  # warm-up: reads the tokenizer, loads the models, touches the checkpoint pages
    loads = ", ".join(f"{m} {s:.2f} s" for m, s in first.compile_seconds.items())
    print(f"ours: plan + compile every stage {cold_s:.2f} s (cold plan cache), {warm_s:.2f} s (warm); "
          f"loading compiled programs (first run only): {loads}")
    reference = load_diffusers(folder)
    run_diffusers(reference, cfg)  # warm-up

    # The sides run in turns (ours first in even turns, diffusers first in odd ones), so that a change in the
    # shared host's speed during the benchmark falls on both: each turn gives one ratio.
    computes, walls, their_runs, image = [], [], [], None
    for turn in range(repeats):
        for side in ("ours", "diffusers") if turn % 2 == 0 else ("diffusers", "ours"):
            if side == "ours":
                report, runs = run_ours(pipe, cfg)
                compute, wall = our_timings(report, runs)
                computes.append(compute)
                walls.append(wall)
                image = to_uint8(report.values["image"])
            else:
                t, their_image = run_diffusers(reference, cfg)
                their_runs.append(t)
    pipe.release()
    theirs = median_timings(their_runs)
    del reference
    their_uint8 = (their_image * 255).round().astype(np.uint8)
    print(f"images: PSNR ours vs diffusers {psnr(image, their_uint8):.1f} dB "
          f"(torch {torch.__version__}, {torch.get_num_threads()} threads)")
    print("  ours ms: model execution (+ tokenizer and latent unpacking); ours wall: the stage as the "
          "pipeline runs it (models loaded by the warm-up run, as for a second prompt)")
    print_table(median_timings(computes), median_timings(walls), theirs, repeats)
    print_turn_ratios(computes, their_runs)
    if not memory:
        return

    budget = int(cfg.budget_fraction * transformer_bytes)
    print(f"peak memory: one process per run (plan cache warm), its resident set (with the touched pages of "
          f"the memory-mapped checkpoint); budget {mib(budget)} < transformer weights "
          f"{mib(transformer_bytes)}")
    measure_in_child("ours", cfg, folder, threads, budget)  # compiles the budgeted plans into the cache
    free = measure_in_child("ours", cfg, folder, threads)
    bounded = measure_in_child("ours", cfg, folder, threads, budget)
    ref = measure_in_child("diffusers", cfg, folder, threads)
    print(f"  {'run':<18} {'peak':>10} {'denoise stage: start -> peak':>30} {'transformer plan':>17} "
          f"{'per step':>9}")
    base_step = statistics.median(free["steps"][1:] or free["steps"])
    for label, run in (("ours, no budget", free), ("ours, budget", bounded)):
        if "error" in run:
            print(f"  {label:<18} not available: {run['error']}")
            continue
        start, peak = run["stage_rss"]["denoise"]
        plan = "streamed" if run["streamed"].get("transformer") else "resident"
        step = statistics.median(run["steps"][1:] or run["steps"])
        growth = f"{mib(start)} -> {mib(peak)} (+{mib(peak - start)})"
        plan += " " + mib(run["planned_peak"].get("transformer"))
        peak_all = mib(run["max_rss_bytes"])
        print(f"  {label:<18} {peak_all:>10} {growth:>30} {plan:>17} {step / base_step:8.2f}x")
    print(f"  {'diffusers':<18} {mib(ref['max_rss_bytes']):>10}")
    if "error" not in bounded and bounded["stream"]:
        print(f"  streaming (budgeted run): {bounded['stream']}")


def isa_report(asked: str | None) -> str:
    """The paths both sides take, as the libraries report them (not as we asked)."""
    import torch

    from luminal_recipes.runtimes.cpu import isa, jit

    ours = isa.check()  # refuses a path this CPU cannot run, with the ones it can
    numba = "no numba kernels"
    if jit.AVAILABLE:
        jit.kernels()
        name, features = isa.numba_codegen_target()
        numba = f"numba target {name}{' with AVX-512' if '+avx512f' in features.split(',') else ''}"
    env = ", ".join(f"{k}={v}" for k, v in ISA_ENV.get(asked or "", {}).items()) or "none"
    return (f"isa: --isa {asked or '(not set)'}; the CPU reports '{isa.detected()}'; ours '{ours}' ({numba}); "
            f"torch {torch.backends.cpu.get_cpu_capability()}; environment set: {env}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default="tiny,medium", help="comma-separated: tiny, medium")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per side after a warm-up (median)")
    parser.add_argument("--threads", type=int, default=None,
                        help="threads for both sides (default: numpy's BLAS threads, normally the CPU count)")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where the medium checkpoint and plan caches go (default: a temporary folder)")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory processes")
    parser.add_argument("--isa", choices=tuple(ISA_ENV),
                        help="the instruction-set path of both sides (default: each library's own choice)")
    parser.add_argument("--child", choices=("ours", "diffusers"), help=argparse.SUPPRESS)
    parser.add_argument("--child-config", help=argparse.SUPPRESS)
    parser.add_argument("--child-folder", help=argparse.SUPPRESS)
    parser.add_argument("--child-budget", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child_main(args)

    import torch
    from matmul import blas_report  # noqa: E402  (bench/ is on sys.path once set_threads ran)

    threads = set_threads(args.threads)
    torch.set_num_threads(threads)
    for line in blas_report():
        print(line)
    print(f"threads: numpy BLAS {threads}, torch {torch.get_num_threads()}")
    print(isa_report(args.isa))
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        parser.error(f"unknown configuration(s) {', '.join(unknown)}; choose from {', '.join(CONFIGS)}")
    with tempfile.TemporaryDirectory(prefix="flux2-cpu-bench-") as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        for name in names:
            bench_config(CONFIGS[name], workdir, args.repeats, threads, not args.no_memory)
    return 0


if __name__ == "__main__":
    sys.exit(main())
