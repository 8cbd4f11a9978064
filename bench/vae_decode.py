"""The FLUX.2 VAE decoder alone, ours vs diffusers' ``AutoencoderKLFlux2.decode``, timed in turns on the same
latents and threads (ours, theirs, ours, ...), so that both see the same load on a shared machine: medians and
minima, their ratios, the largest difference of the images. ``--no-winograd`` adds a third side, ours with the
Winograd ``Conv2d`` path off (the direct / im2col paths that ran before it), ``--python-bands`` one with its bands
run from Python (as before ``numba_kernels.winograd_bands``), in the same turns.

    python bench/flux2_cpu.py --configs medium --workdir /tmp/f2   # makes the medium checkpoint once
    python bench/vae_decode.py --workdir /tmp/f2 [--repeats 7] [--no-winograd] [--python-bands] [--threads 1]

With ``--threads 1`` the clock is the calling thread's CPU time (as in ``conv_layers.py``), else wall time.
The decoder is the medium checkpoint's (channels 16-32-64-128) at 256x256 (latents [1, 128, 16, 16], as the
pipeline hands them over after unpacking), or with ``--config tiny`` the shipped tiny checkpoint's at 80x48; the
compiled program comes from ``--workdir``'s plan cache.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from luminal_recipes.openblas_spin import limit_openblas_spin

limit_openblas_spin()  # as the CLI does, before numpy loads OpenBLAS

import numpy as np  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", required=True, help="flux2_cpu.py's --workdir (holds checkpoint-medium)")
    ap.add_argument("--config", choices=("medium", "tiny"), default="medium",
                    help="tiny: the shipped tiny checkpoint's decoder at the tiny recipe's 80x48")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--no-winograd", action="store_true", help="also time ours without the Winograd Conv2d path")
    ap.add_argument("--python-bands", action="store_true",
                    help="also time ours with Winograd's bands run from Python (as before numpy_jit.winograd_bands)")
    ap.add_argument("--threads", type=int, default=0, help="threads for both sides (default: all)")
    args = ap.parse_args()
    if args.threads and os.environ.get("LUMINAL_RECIPES_THREADS") != str(args.threads):
        os.environ["LUMINAL_RECIPES_THREADS"] = os.environ["OPENBLAS_NUM_THREADS"] = str(args.threads)
        os.execv(sys.executable, [sys.executable, *sys.argv])  # the thread counts are read at import
    root = Path(__file__).resolve().parents[1]
    tiny = args.config == "tiny"
    folder = root / "recipes" / "flux2-tiny" / "checkpoint" if tiny else Path(args.workdir) / "checkpoint-medium"
    if not (folder / "vae").is_dir():
        sys.exit(f"error: {folder / 'vae'} not found: run bench/flux2_cpu.py --configs medium --workdir "
                 f"{args.workdir} first (it makes the checkpoint)")
    os.environ.setdefault("LUMINAL_RECIPES_CACHE", str(Path(args.workdir) / f"plan-cache-{args.config}"))

    import torch
    from diffusers import AutoencoderKLFlux2, Flux2Pipeline

    if args.threads:
        torch.set_num_threads(args.threads)

    from luminal_recipes.pipeline.driver import Pipeline
    from luminal_recipes.pipeline.engine import ModelEngine
    from luminal_recipes.runtimes.cpu.kernels import conv as conv_kernels

    if tiny:  # 80x48: latents [1, 32 * 4, 48 / 16, 80 / 16]
        pipe = Pipeline(root / "recipes" / "flux2-tiny.yaml", weights=folder)
        shape = (1, 128, 3, 5)
    else:
        pipe = Pipeline(root / "recipes" / "flux2.yaml", weights=folder, sets={"text_encoder_out_layers": [2, 5, 8]})
        shape = (1, 128, 16, 16)
    latents = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    sides = {"ours": ModelEngine(pipe.model("vae"))}
    if args.no_winograd:
        bounds = ("WINOGRAD_MIN_CHANNELS", "WINOGRAD_MIN_CHANNELS_COMPILED")
        saved = {name: getattr(conv_kernels, name) for name in bounds}
        for name in bounds:  # read when the kernels are bound (the engine's first run)
            setattr(conv_kernels, name, 1 << 30)
        sides["ours, no Winograd"] = ModelEngine(pipe.model("vae"))
        sides["ours, no Winograd"]({"latents": latents})
        for name, value in saved.items():
            setattr(conv_kernels, name, value)

    if args.python_bands:  # no cblas_sgemm for the compiled band loop: the per-band Python loop, no plane gap
        saved_blas, saved_gap = conv_kernels.cblas, conv_kernels.WINOGRAD_PLANE_GAP
        conv_kernels.cblas = SimpleNamespace(sgemm=lambda: None)
        conv_kernels.WINOGRAD_PLANE_GAP = 0
        sides["ours, Python bands"] = ModelEngine(pipe.model("vae"))
        sides["ours, Python bands"]({"latents": latents})
        conv_kernels.cblas, conv_kernels.WINOGRAD_PLANE_GAP = saved_blas, saved_gap

    vae = AutoencoderKLFlux2.from_pretrained(folder / "vae").eval()
    lat = torch.from_numpy(latents)
    mean = vae.bn.running_mean.view(1, -1, 1, 1)
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)

    def theirs():
        with torch.inference_mode():
            return vae.decode(Flux2Pipeline._unpatchify_latents(lat * std + mean), return_dict=False)[0].numpy()

    calls = {name: (lambda engine=engine: engine({"latents": latents})["image"]) for name, engine in sides.items()}
    calls["diffusers"] = theirs
    images = {name: call() for name, call in calls.items()}  # warm-up (and our first binding)
    times: dict[str, list[float]] = {name: [] for name in calls}
    # one thread: that thread's CPU time (every kernel of both sides runs on it), which the time spent descheduled
    # by other jobs on a shared machine does not inflate; else wall time
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    for _ in range(args.repeats):
        for name, call in calls.items():
            t0 = clock()
            call()
            times[name].append(clock() - t0)
    ref = images["diffusers"]
    print(f"threads: torch {torch.get_num_threads()}; {args.repeats} turns; load {os.getloadavg()[0]:.1f}; "
          f"clock: {clock.__name__}")
    print("side                 | median ms | min ms | median / diffusers | min / diffusers | max |image - diffusers|")
    med_ref, min_ref = statistics.median(times["diffusers"]), min(times["diffusers"])
    worst = 0.0
    for name, ts in times.items():
        diff = float(np.abs(np.asarray(images[name], np.float64) - ref).max())
        worst = max(worst, diff / float(np.abs(ref).max()))
        print(f"{name:<20} | {statistics.median(ts) * 1e3:9.1f} | {min(ts) * 1e3:6.1f} | "
              f"{statistics.median(ts) / med_ref:18.2f} | {min(ts) / min_ref:15.2f} | {diff:.1e}")
    if worst > 1e-4:  # the VAE parity tests' bound (tests/pipeline/test_flux2_parity.py), relative to max |image|
        sys.exit(f"error: an image differs from diffusers' by {worst:.1e} of its largest value, over 1e-4")


if __name__ == "__main__":
    main()
