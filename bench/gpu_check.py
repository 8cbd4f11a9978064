#!/usr/bin/env python3
"""The one prepared GPU check of the cuda runtime (issue 10): everything measured in one run on one GPU, written
as one JSON and a log.

    python3 bench/gpu_check.py             # on the GPU machine (< 8 minutes on one H200)
    python bench/gpu_check.py --dry-run    # here: the whole script on the CPU through cuda-emu, at tiny sizes

Sections, each in its own try/except (one failure never loses the rest), under one time guard (a section is
skipped, and recorded as skipped, when the time left is below its estimate):

  environment        device, driver/runtime/NVRTC versions, CuPy's configuration
  ceilings           bf16 GEMM TFLOP/s at 8192^3 through torch and through our cuBLAS path; device copy GB/s
  kernels            every kernel of the registry on the device vs torch (max rel. error per kernel)
  transformer        FLUX.2-dev transformer at 1024x1024 computing in bf16 (--compute-dtype bf16), seeded random bf16
                     weights made on the GPU and shared with diffusers' Flux2Transformer2DModel through DLPack:
                     s/step (median of 5 after 3 warm-ups) replayed as a CUDA graph and kernel by kernel (same bits?),
                     TFLOP/s vs 283 TFLOP/step, peak device memory, speed ratio and output rel. error vs diffusers
  dequant            FP8 and NVFP4 DequantMatMul TFLOP/s on FLUX.2's four GEMM shapes at M = 4608 (bf16 MatMul too);
                     fp8 twice: weights decoded to bf16 for cuBLAS, and FP8 x FP8 through cuBLASLt (e4m3 activations,
                     LUMINAL_FP8_GEMM=cublaslt; libcublasLt from the nvidia-cublas wheel torch brings), with the ratio
  streamed           the same transformer step under a 24 GiB budget (blocks staged through 4 GiB of pinned host
                     memory on a copy stream), bit-identical to the resident step; device memory released after
  tiny_pipeline      recipes/flux2-tiny.yaml on our runtime: PSNR vs the numpy runtime's golden image, and each
                     stage's device memory when it ends, before and after the release
  vae                VAE decode of a 1024x1024 image (random full-size weights): time, peak device memory
  text_encoder       Mistral-3 text encoder, 512 tokens, random full-size weights: time, peak device memory
  rebinding          the tiny text encoder loaded for a 512-token bucket, re-bound to 8 lengths within it: seconds per
                     re-binding and per run, CUDA modules built / NVRTC compiles while re-binding (expected: none)
  fp8_pipeline       the tiny FLUX.2 pipeline with an FP8 transformer in bf16: cuBLASLt FP8 x FP8 vs weights decoded to
                     bf16, PSNR of each against the f32 image (diffusers' weight-only result), FP8 GEMMs bound

The GPU machine has no egglog, pydantic, diffusers and no network: carry the wheels bench/gpu_wheels.sh makes
(`.whl/`); this script installs them into a private folder first. The repository is not pip-installed there:
``luminal_recipes.compiler``/``.runtimes`` (top-level folders mapped by setuptools) are mapped by a small import
finder here. Results go to ``$OUT`` (default ``outputs/gpu_check/``): ``gpu_check.json`` and ``gpu_check.log``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.abc
import importlib.util
import io
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHEELS = Path(os.environ.get("LUMINAL_GPU_WHEELS", ROOT / ".whl"))  # what bench/gpu_wheels.sh made
FULL_STEP_TFLOP = 283.0  # FLUX.2-dev transformer, one step at 1024x1024 (4096 image + 512 text tokens)
WEIGHT_GAIN = float(os.environ.get("LUMINAL_WEIGHT_GAIN", "0.3"))  # random weights: N(0, (gain^2 / fan_in))


# ---- bootstrap: carried wheels, the repository's package mapping, CUDA headers ---------------------------------
class RepoPackages(importlib.abc.MetaPathFinder):
    """``luminal_recipes.compiler`` and ``luminal_recipes.runtimes`` from the top-level folders (as setuptools'
    package-dir maps them), for a checkout that is not pip-installed."""

    MAP = {"luminal_recipes.compiler": ROOT / "compiler", "luminal_recipes.runtimes": ROOT / "runtimes"}

    def find_spec(self, name, path=None, target=None):
        folder = self.MAP.get(name)
        if folder is None:
            return None
        return importlib.util.spec_from_file_location(name, folder / "__init__.py",
                                                      submodule_search_locations=[str(folder)])


def install_wheels(site: Path, log) -> None:
    """Install ``.whl/*.whl`` into ``site`` (once) and put it first on sys.path, when egglog is missing."""
    wheels = sorted(WHEELS.glob("*.whl"))
    if importlib.util.find_spec("egglog") is not None and importlib.util.find_spec("pydantic") is not None:
        return
    if not wheels:
        raise SystemExit("egglog/pydantic are missing and no wheels were carried: run bench/gpu_wheels.sh on a "
                         "networked machine and carry .whl/ with the repository")
    marker = site / ".luminal-wheels"
    names = "\n".join(w.name for w in wheels)
    if not (marker.exists() and marker.read_text() == names):
        t0 = time.perf_counter()
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
               "--target", str(site), *map(str, wheels)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:  # no pip: a wheel is a zip of its installed files
            log(f"pip install failed ({proc.stderr.strip()[-300:]}); unzipping the wheels instead")
            for w in wheels:
                with zipfile.ZipFile(w) as z:
                    z.extractall(site)
        marker.write_text(names)
        log(f"installed {len(wheels)} carried wheels into {site} in {time.perf_counter() - t0:.1f} s")
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()


def cuda_headers(site: Path, log) -> None:
    """NVRTC needs cuda_bf16.h/cuda_fp8.h and crt/: use the installed nvidia wheels' headers, else the carried
    ``.whl/cuda-headers/*.whl``."""
    from luminal_recipes.runtimes.cuda import nvrtc

    try:
        log(f"CUDA headers: {nvrtc.cuda_include_dir()}")
        return
    except nvrtc.NvrtcError as e:
        log(f"no CUDA headers installed ({e}); using the carried ones")
    folder = site / "cuda-include"
    for w in sorted((WHEELS / "cuda-headers").glob("*.whl")):
        with zipfile.ZipFile(w) as z:
            for name in z.namelist():
                if "/include/" in name and not name.endswith("/"):
                    target = folder / name.split("/include/", 1)[1]
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(z.read(name))
    os.environ["LUMINAL_CUDA_INCLUDE"] = str(folder)
    nvrtc.cuda_include_dir.cache_clear()
    log(f"CUDA headers: {nvrtc.cuda_include_dir()}")


def bootstrap(dry: bool, log) -> None:
    site = Path(os.environ.get("LUMINAL_GPU_SITE", "/tmp/luminal-site"))
    site.mkdir(parents=True, exist_ok=True)
    install_wheels(site, log)
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    if importlib.util.find_spec("luminal_recipes") is None or _unmapped():
        sys.meta_path.insert(0, RepoPackages())
    os.environ.setdefault("LUMINAL_RECIPES_CACHE", str(site / "cache"))
    if not dry:
        cuda_headers(site, log)


def _unmapped() -> bool:
    try:
        return importlib.util.find_spec("luminal_recipes.compiler") is None
    except ModuleNotFoundError:
        return True


# ---- the run: log, time guard, sections ------------------------------------------------------------------------
class Log:
    def __init__(self, path: Path):
        self.file = path.open("w", encoding="utf-8")
        self.t0 = time.perf_counter()

    def __call__(self, *parts) -> None:
        line = f"[{time.perf_counter() - self.t0:7.1f}s] " + " ".join(str(p) for p in parts)
        print(line, flush=True)
        self.file.write(line + "\n")
        self.file.flush()


class Check:
    """What every section gets: the mode, sizes, our runtime, torch's device, a log and shared state."""

    def __init__(self, args, log: Log):
        self.dry = args.dry_run
        self.log = log
        self.deadline = time.perf_counter() + args.time_limit
        self.store: dict = {}
        import numpy as np
        import torch

        self.np, self.torch = np, torch
        self.dev = torch.device("cpu" if self.dry else "cuda")
        self.runtime = make_runtime(self.dry)
        self.warmup, self.reps = (1, 2) if self.dry else (3, 5)

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def sync(self) -> None:
        if not self.dry:
            self.torch.cuda.synchronize()
            import cupy

            cupy.cuda.get_current_stream().synchronize()

    def timed(self, fn, warmup: int | None = None, reps: int | None = None) -> list[float]:
        for _ in range(self.warmup if warmup is None else warmup):
            fn()
        self.sync()
        out = []
        for _ in range(self.reps if reps is None else reps):
            t0 = time.perf_counter()
            fn()
            self.sync()
            out.append(time.perf_counter() - t0)
        return out

    def free(self) -> None:
        gc.collect()
        if not self.dry:
            import cupy

            self.torch.cuda.synchronize()
            cupy.get_default_memory_pool().free_all_blocks()
            cupy.get_default_pinned_memory_pool().free_all_blocks()
            self.torch.cuda.empty_cache()

    def device_used(self) -> int | None:
        if self.dry:
            return None
        import cupy

        free, total = cupy.cuda.runtime.memGetInfo()
        return int(total - free)


def make_runtime(dry: bool):
    """Our runtime by name from the runtime registry: ``cuda``, or ``cuda-emu`` in a dry run."""
    from luminal_recipes.runtimes.registry import get_runtime

    return get_runtime("cuda-emu" if dry else "cuda")


def step_times(c: Check, exe, inputs: dict, warmup: int | None = None, reps: int | None = None) -> list[float]:
    """Seconds per run of the loaded program without host transfers: ``inputs`` staged on the device once,
    copied device-side into the slots the plan reuses before each run (``Executable.execute``)."""
    exe.execute(inputs)
    return c.timed(exe.execute, warmup, reps)


@contextlib.contextmanager
def options(runtime, **changes):
    """Temporarily change the backend's ``CudaOptions`` (attention path, chunk budgets)."""
    opts = runtime.backend.options
    old = {k: getattr(opts, k) for k in changes}
    for k, v in changes.items():
        setattr(opts, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(opts, k, v)


SECTIONS: list[tuple[str, float, object]] = []  # (name, estimated seconds on the GPU, function)


def section(name: str, estimate_s: float):
    def register(fn):
        SECTIONS.append((name, estimate_s, fn))
        return fn

    return register


def rel_err(ours, ref) -> dict:
    np = __import__("numpy")
    a, b = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    scale = float(np.abs(b).max()) or 1.0
    norm = float(np.linalg.norm(b)) or 1.0
    return {"max_rel": float(np.abs(a - b).max() / scale), "norm_rel": float(np.linalg.norm(a - b) / norm),
            "finite": bool(np.isfinite(a).all())}


# ---- sections ---------------------------------------------------------------------------------------------------
@section("environment", 5)
def environment(c: Check) -> dict:
    import numpy as np
    import torch

    out = {"python": sys.version.split()[0], "platform": platform.platform(), "numpy": np.__version__,
           "torch": torch.__version__, "runtime": c.runtime.name, "device": c.runtime.device}
    if c.dry:
        out["gxx"] = subprocess.run(["g++", "--version"], capture_output=True, text=True).stdout.splitlines()[0]
        return out
    import cupy

    from luminal_recipes.runtimes.cuda import nvrtc

    props = cupy.cuda.runtime.getDeviceProperties(0)
    out.update(cupy=cupy.__version__, cuda_runtime=cupy.cuda.runtime.runtimeGetVersion(),
               cuda_driver=cupy.cuda.runtime.driverGetVersion(), nvrtc=nvrtc.version(),
               cuda_include=str(nvrtc.cuda_include_dir()),
               gpu=props["name"].decode() if isinstance(props["name"], bytes) else props["name"],
               capability=f"{props['major']}.{props['minor']}", sms=props["multiProcessorCount"],
               memory_bytes=int(props["totalGlobalMem"]), torch_cuda=torch.version.cuda)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        cupy.show_config()
    out["cupy_config"] = buf.getvalue()
    out["cublaslt"] = lt_library(c)
    return out


def matmul_program(m: int, n: int, k: int, dtype: str = "bf16"):
    """y [m, n] = x [m, k] @ w [n, k]^T: one MatMul kernel reading the weight transposed in place."""
    from luminal_recipes.graph import Graph

    g = Graph()
    x, w = g.input("x", (m, k), dtype), g.input("w", (n, k), dtype)
    f = fused()(g)
    return f.program(y=f.add("MatMul", [x, w.T], (m, n), dtype))


@section("ceilings", 25)
def ceilings(c: Check) -> dict:
    import ml_dtypes
    import numpy as np
    import torch

    n = 256 if c.dry else 8192
    out = {"gemm_size": n}
    a = torch.randn(n, n, device=c.dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=c.dev, dtype=torch.bfloat16)
    t = c.timed(lambda: a @ b, 3, 10 if not c.dry else 3)
    out["torch_bf16_tflops"] = 2 * n**3 / statistics.median(t) / 1e12
    # ours: the MatMul kernel (cuBLAS gemmStridedBatchedEx, bf16 in, f32 compute) through the runtime
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, n), dtype=np.float32).astype(ml_dtypes.bfloat16)
    w = rng.standard_normal((n, n), dtype=np.float32).astype(ml_dtypes.bfloat16)
    exe = c.runtime.load(matmul_program(n, n, n), None, {})
    y = exe.run({"x": x, "w": w})["y"]
    t = step_times(c, exe, {"x": x, "w": w}, 3, 10 if not c.dry else 3)
    out["ours_bf16_tflops"] = 2 * n**3 / statistics.median(t) / 1e12
    ref = (torch.from_numpy(x.astype(np.float32)).to(c.dev) @ torch.from_numpy(w.astype(np.float32)).to(c.dev).T)
    out["ours_vs_torch_f32"] = rel_err(y.astype(np.float32), ref.cpu().numpy())
    out["ours_over_torch"] = out["ours_bf16_tflops"] / out["torch_bf16_tflops"]
    exe = a = b = None
    c.free()
    nbytes = (64 << 20) if c.dry else (2 << 30)
    if c.dry:
        src, dst = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
        t = c.timed(lambda: np.copyto(dst, src), 1, 3)
    else:
        import cupy

        src, dst = cupy.ones(nbytes, cupy.uint8), cupy.zeros(nbytes, cupy.uint8)
        t = c.timed(lambda: cupy.copyto(dst, src), 3, 10)
    out["copy_bytes"] = nbytes
    out["copy_gb_s"] = nbytes / statistics.median(t) / 1e9  # bytes copied per second (reads + writes: twice)
    return out


# ---- every kernel vs torch --------------------------------------------------------------------------------------
def fused():
    spec = importlib.util.spec_from_file_location("fused_programs", ROOT / "tests" / "runtimes" / "fused_programs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.Fused


SILU = "(Mul in0 (Recip (Add (Const 1.0) (Exp2 (Mul in0 (Const -1.4426950408889634))))))"


def kernel_cases(dry: bool):
    """(name, options, build) with build() -> (program, inputs, weights, torch reference fn, output dtype)."""
    import ml_dtypes
    import numpy as np
    import torch

    from luminal_recipes.graph import Graph

    Fused = fused()
    rng = np.random.default_rng(0)
    bf = ml_dtypes.bfloat16
    R, C = (48, 96) if dry else (4608, 3072)

    def rnd(*shape, dtype=np.float32, scale=1.0):
        return (rng.standard_normal(shape, dtype=np.float32) * scale).astype(dtype)

    def elementwise():
        g = Graph()
        x = g.input("x", (R, C), "bf16")
        f = Fused(g)
        y = f.add("Elementwise", [x], (R, C), "bf16", expr=SILU)
        return f.program(y=y), {"x": rnd(R, C, dtype=bf)}, None, lambda t: {"y": torch.nn.functional.silu(t["x"])}

    def cast():
        g = Graph()
        x = g.input("x", (R, C))
        f = Fused(g)
        y = f.add("Cast", [x], (R, C), "bf16")
        return f.program(y=y), {"x": rnd(R, C)}, None, lambda t: {"y": t["x"].to(torch.bfloat16).float()}

    def reductions():
        g = Graph()
        x = g.input("x", (R, C))
        f = Fused(g)
        s = f.add("SumReduce", [x], (R,), axis=1)
        m = f.add("MaxReduce", [x.T], (C,), axis=1)
        return f.program(s=s, m=m), {"x": rnd(R, C)}, None, \
            lambda t: {"s": t["x"].sum(1), "m": t["x"].amax(0)}

    def rows(op, n):
        def build():
            r = max(R // 4, 4)
            g = Graph()
            x = g.input("x", (r, n), "bf16")
            f = Fused(g)
            attrs = {} if op == "Softmax" else {"eps": 1e-6}
            y = f.add(op, [x], (r, n), "bf16", **attrs)

            def ref(t):
                v = t["x"]
                if op == "Softmax":
                    return {"y": torch.softmax(v, -1)}
                if op == "LayerNorm":
                    return {"y": torch.nn.functional.layer_norm(v, (n,), eps=1e-6)}
                return {"y": v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6)}

            return f.program(y=y), {"x": rnd(r, n, dtype=bf, scale=3.0)}, None, ref
        return build

    def gather():
        v, d, k = (50, 32, 8) if dry else (131072, 5120, 512)
        g = Graph()
        ids = g.input("ids", (1, k), "i32")
        table = g.weight("table", (v, d), "bf16")
        f = Fused(g)
        y = f.add("Gather", [table, ids], (1, k, d), "bf16")
        idx = rng.integers(0, v, (1, k)).astype(np.int32)
        return f.program(y=y), {"ids": idx}, {"table": rnd(v, d, dtype=bf)}, \
            lambda t: {"y": t["table"][t["ids"].long()]}

    def scatter():
        rows_, d, k = (20, 16, 5) if dry else (4096, 1024, 512)
        g = Graph()
        dest = g.input("dest", (rows_, d))
        pos = g.input("pos", (k,), "i32")
        src = g.input("src", (k, d))
        f = Fused(g)
        y = f.add("Scatter", [dest, pos, src], (rows_, d))
        p = rng.permutation(rows_)[:k].astype(np.int32)

        def ref(t):
            out = t["dest"].clone()
            out[t["pos"].long()] = t["src"]
            return {"y": out}

        return f.program(y=y), {"dest": rnd(rows_, d), "pos": p, "src": rnd(k, d)}, None, ref

    def matmul():
        m, n, k = (40, 24, 56) if dry else (4608, 3072, 3072)
        g = Graph()
        x = g.input("x", (1, m, k), "bf16")
        w = g.weight("w", (n, k), "bf16")
        f = Fused(g)
        y = f.add("MatMul", [x, w.T.unsqueeze(0)], (1, m, n), "bf16")
        return f.program(y=y), {"x": rnd(1, m, k, dtype=bf)}, {"w": rnd(n, k, dtype=bf, scale=k**-0.5)}, \
            lambda t: {"y": t["x"] @ t["w"].T}

    def attention(mode):
        def build():
            b, h, s, d = (1, 2, 40, 64) if dry else (1, 8, 2048, 128)
            g = Graph()
            q, k, v = (g.input(nm, (b, h, s, d), "bf16") for nm in "qkv")
            bias = g.input("bias", (b, 1, s, s), "bf16")
            bb = bias.broadcast_to((b, h, s, s))
            f = Fused(g)
            scale = d ** -0.5
            y = f.add("Attention", [q, k, v, bb], (b, h, s, d), "bf16", scale=scale)
            ins = {nm: rnd(b, h, s, d, dtype=bf) for nm in "qkv"}
            ins["bias"] = rnd(b, 1, s, s, dtype=bf)

            def ref(t):
                p = torch.softmax(t["q"] @ t["k"].transpose(-1, -2) * scale + t["bias"], -1)
                return {"y": p @ t["v"]}

            return f.program(y=y), ins, None, ref
        return build

    def conv(kernel):
        def build():
            n, ch, hw = (1, 8, 10) if dry else (1, 256, 128)
            g = Graph()
            x = g.input("x", (n, ch, hw, hw), "bf16")
            w = g.weight("w", (ch, ch, kernel, kernel), "bf16")
            pad = kernel // 2
            xp = x.pad(2, pad, pad).pad(3, pad, pad) if pad else x
            f = Fused(g)
            y = f.add("Conv2d", [xp, w], (n, ch, hw, hw), "bf16", stride=1)
            return f.program(y=y), {"x": rnd(n, ch, hw, hw, dtype=bf)}, \
                {"w": rnd(ch, ch, kernel, kernel, dtype=bf, scale=(ch * kernel * kernel) ** -0.5)}, \
                lambda t: {"y": torch.nn.functional.conv2d(t["x"], t["w"], padding=pad)}
        return build

    def group_norm():  # the VAE's GroupNorm (32 groups) + SiLU, x read in place as its [N, G, n] rows
        n, ch, hw = (1, 64, 6) if dry else (1, 512, 128)
        g = Graph()
        x = g.input("x", (n, ch, hw, hw), "bf16")
        w, b = g.weight("w", (ch,)), g.weight("b", (ch,))
        scale = w.reshape((1, ch, 1, 1)).broadcast_to((n, ch, hw, hw))
        shift = b.reshape((1, ch, 1, 1)).broadcast_to((n, ch, hw, hw))
        f = Fused(g)
        y = f.add("GroupNorm", [x.reshape((n, 32, ch // 32 * hw * hw)), scale, shift], (n, ch, hw, hw), "bf16",
                  eps=1e-6, act="silu")
        return f.program(y=y), {"x": rnd(n, ch, hw, hw, dtype=bf, scale=3.0)}, \
            {"w": rnd(ch), "b": rnd(ch)}, \
            lambda t: {"y": torch.nn.functional.silu(torch.nn.functional.group_norm(
                t["x"].float(), 32, t["w"].float(), t["b"].float(), 1e-6))}

    def rms_norm_rope():  # FLUX.2's q/k: RMSNorm with its weight, then the rotation of pairs by f32 tables
        h, s, d = (2, 48, 16) if dry else (48, 4608, 128)
        g = Graph()
        q = g.input("q", (1, h, s, d), "bf16")
        w, cos, sin = g.weight("w", (d,)), g.input("cos", (s, d)), g.input("sin", (s, d))
        pairs = (1, h, s, d // 2, 2)
        f = Fused(g)
        y = f.add("RMSNormRoPE", [q, w.broadcast_to(q.shape), cos.broadcast_to(q.shape).reshape(pairs),
                                  sin.broadcast_to(q.shape).reshape(pairs)], pairs, "bf16", eps=1e-6)
        angles = rng.random((s, d // 2)) * 6

        def reference(t):
            y = torch.nn.functional.rms_norm(t["q"].float(), (d,), t["w"].float(), 1e-6)
            re, im = y.reshape(1, h, s, d // 2, 2).unbind(-1)
            swapped = torch.stack([-im, re], -1).reshape(1, h, s, d)
            return {"y": (y * t["cos"] + swapped * t["sin"]).reshape(pairs)}

        return f.program(y=y), {"q": rnd(1, h, s, d, dtype=bf, scale=3.0),
                                "cos": np.repeat(np.cos(angles), 2, -1).astype(np.float32),
                                "sin": np.repeat(np.sin(angles), 2, -1).astype(np.float32)}, {"w": rnd(d)}, reference

    def dequant(fmt):
        def build():
            m, n, k = (24, 40, 64) if dry else (1024, 3072, 3072)
            g = Graph()
            x = g.input("x", (m, k), "bf16")
            if fmt in ("fp8", "fp8-lt"):
                w, s = g.weight("w", (n, k), "f8e4m3"), g.weight("s", ())
                f = Fused(g)
                y = f.add("DequantMatMul", [x, w, s], (m, n), "bf16", format="fp8", layout="", out_features=n,
                          in_features=k)
                weights = {"w": rnd(n, k, scale=4.0).astype(ml_dtypes.float8_e4m3fn),
                           "s": np.asarray(0.01, np.float32)}
                dense = weights["w"].astype(np.float32) * weights["s"]
            else:
                w, s, s2 = g.weight("w", (n, k // 2), "u8"), g.weight("s", (n, k // 16), "f8e4m3"), g.weight("s2", ())
                f = Fused(g)
                y = f.add("DequantMatMul", [x, w, s, s2], (m, n), "bf16", format="nvfp4", layout="modelopt",
                          out_features=n, in_features=k)
                weights = {"w": rng.integers(0, 256, (n, k // 2)).astype(np.uint8),
                           "s": (rng.random((n, k // 16)) + 0.5).astype(ml_dtypes.float8_e4m3fn),
                           "s2": np.asarray(0.01, np.float32)}
                e2m1 = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
                codes = np.stack([weights["w"] & 15, weights["w"] >> 4], -1).reshape(n, k)  # element 0: low nibble
                dense = e2m1[codes] * np.repeat(weights["s"].astype(np.float32), 16, 1) * weights["s2"]

            def ref(t, dense=dense):
                x = t["x"]
                if fmt == "fp8-lt":  # FP8 x FP8: x in e4m3 with a per-tensor scale from its amax (as nodes.py)
                    amax = x.abs().max()
                    xq = (x * (448.0 / amax)).to(torch.float8_e4m3fn).float()
                    return {"y": (xq @ t["w"].T) * ((amax / 448.0) * t["s"])}
                return {"y": x @ torch.from_numpy(dense).to(x.device).T}

            return f.program(y=y), {"x": rnd(m, k, dtype=bf)}, weights, ref
        return build

    def concat():
        c1, c2 = C // 3, C - C // 3
        g = Graph()
        a, b = g.input("a", (R, c1), "bf16"), g.input("b", (R, c2), "bf16")
        f = Fused(g)
        y = f.add("Concat", [a.pad(1, 0, c2), b.pad(1, c1, 0)], (R, C), "bf16")
        return f.program(y=y), {"a": rnd(R, c1, dtype=bf), "b": rnd(R, c2, dtype=bf)}, None, \
            lambda t: {"y": torch.cat([t["a"], t["b"]], 1)}

    return [
        ("Elementwise silu bf16", {}, elementwise), ("Cast f32->bf16", {}, cast),
        ("SumReduce/MaxReduce f32", {}, reductions), ("Softmax bf16", {}, rows("Softmax", 64 if dry else 4608)),
        ("LayerNorm bf16", {}, rows("LayerNorm", 96 if dry else 3072)),
        ("RMSNorm bf16", {}, rows("RMSNorm", 64 if dry else 128)), ("Gather bf16", {}, gather),
        ("Scatter f32", {}, scatter), ("MatMul bf16 (linear)", {}, matmul),
        ("Attention bf16 chunked", {"attention": "chunked"}, attention("chunked")),
        ("Attention bf16 flash", {"attention": "flash"}, attention("flash")),
        ("Conv2d 3x3 bf16", {}, conv(3)), ("Conv2d 1x1 bf16", {}, conv(1)),
        ("GroupNorm + SiLU bf16", {}, group_norm),
        ("RMSNormRoPE bf16", {}, rms_norm_rope),
        ("DequantMatMul fp8", {"fp8_gemm": "dequant"}, dequant("fp8")),
        ("DequantMatMul fp8 cuBLASLt", {"fp8_gemm": "cublaslt"}, dequant("fp8-lt")),
        ("DequantMatMul nvfp4", {}, dequant("nvfp4")),
        ("Concat bf16", {}, concat),
    ]


@section("kernels", 45)
def kernels(c: Check) -> dict:
    import numpy as np
    import torch

    results = {}
    for name, opts, build in kernel_cases(c.dry):
        try:
            program, inputs, weights, ref = build()
            with options(c.runtime, **opts):
                exe = c.runtime.load(program, weights, {})
                got = exe.run(inputs)
                t = step_times(c, exe, inputs, 1, 3)
            tensors = {k: torch.from_numpy(np.asarray(v).astype(np.float32 if np.asarray(v).dtype.kind in "fV"
                                                                  or "float" in str(np.asarray(v).dtype)
                                                                  else np.int64)).to(c.dev)
                       for k, v in {**inputs, **(weights or {})}.items()}
            want = ref(tensors)
            errs = {k: rel_err(np.asarray(got[k]).astype(np.float32), want[k].float().cpu().numpy())
                    for k in want}
            worst = max(e["max_rel"] for e in errs.values())
            results[name] = {"max_rel_err": worst, "ok": worst <= 2e-2 and all(e["finite"] for e in errs.values()),
                             "seconds": statistics.median(t)}
            c.log(f"  {name:28s} max rel err {worst:.2e}  {statistics.median(t) * 1e3:8.3f} ms")
        except Exception as exc:  # one kernel failing must not hide the others
            results[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-2000:]}
            c.log(f"  {name:28s} ERROR {type(exc).__name__}: {exc}")
        finally:
            exe = None
            c.free()
    return {"kernels": results, "all_ok": all(r.get("ok") for r in results.values())}


# ---- FLUX.2 models: graphs from recipes, random weights made on the device ----------------------------------
def model_config(c: Check, component: str) -> dict:
    folder = ROOT / "recipes" / ("flux2-tiny/checkpoint" if c.dry else "flux2-dev-configs") / component
    return json.loads((folder / "config.json").read_text())


def build(c: Check, recipe: str, component: str, compute: str, sets=None):
    """The model from its recipe and config, computing in ``compute`` (``--compute-dtype``: bf16 on the GPU runs
    tensor-core GEMMs and holds half the activation bytes)."""
    from luminal_recipes.recipe.builder import build_model
    from luminal_recipes.recipe.loader import load_recipe

    return build_model(load_recipe(ROOT / "recipes" / recipe), config=model_config(c, component), sets=sets or {},
                       compute_dtype=compute)


def compile_for(c: Check, model, dims: dict):
    from luminal_recipes.compiler.search import SearchOptions, compile_graph

    t0 = time.perf_counter()
    result = compile_graph(model.graph, c.runtime, dims, options=SearchOptions(time_top=0))
    return result.program, time.perf_counter() - t0


def device_weights(c: Check, graph, seed: int) -> dict:
    """Seeded random weights made where they run (torch tensors on the GPU; CPU in a dry run): 2-D+ ~ N(0, 1/fan_in),
    1-D (norm scales, biases) ~ 1 + N(0, 0.1^2)... in the weight's own dtype (bf16 for these checkpoints)."""
    import torch

    gen = torch.Generator(device=c.dev).manual_seed(seed)
    out = {}
    for node in graph.nodes:
        if node.op != "Input" or node.attr("kind") != "weight":
            continue
        shape = tuple(int(d) for d in node.shape)
        tdt = {"bf16": torch.bfloat16, "f32": torch.float32, "f16": torch.float16}[str(node.dtype)]
        t = torch.randn(shape, generator=gen, device=c.dev, dtype=tdt)
        if len(shape) >= 2:
            t.mul_(WEIGHT_GAIN / math.sqrt(math.prod(shape[1:])))
        elif "running_var" in node.name:
            t.abs_().add_(0.5)
        else:
            t.mul_(0.1).add_(1.0)
        out[node.name] = t
    return out


def ours(c: Check, tensors: dict) -> dict:
    """The same memory as our runtime's weights: DeviceTensors (GPU) or numpy views (CPU)."""
    import ml_dtypes
    import torch

    if not c.dry:
        from luminal_recipes.runtimes.cuda.device import from_torch

        return {k: from_torch(t) for k, t in tensors.items()}
    out = {}
    for k, t in tensors.items():
        out[k] = t.view(torch.int16).numpy().view(ml_dtypes.bfloat16) if t.dtype == torch.bfloat16 else t.numpy()
    return out


def program_flops(program, dims: dict) -> float:
    """2 x multiply-adds of the program's GEMM-like kernels (MatMul, DequantMatMul, Attention, Conv2d)."""
    from luminal_recipes.runtimes.binding import declared_shape

    by_id = {n.id: n for n in program.nodes}
    live = {src for _, (src, _) in program.outputs.items()}
    for n in reversed(program.nodes):  # only nodes the outputs depend on
        if n.id in live:
            live.update(src for src, _ in n.inputs)
    total = 0.0
    for n in program.nodes:
        if n.id not in live:
            continue
        out = declared_shape(n, dims)
        shapes = [v.bind(dims).shape for _, v in n.inputs]
        if n.op == "MatMul":
            total += 2 * math.prod(out) * shapes[0][-1]
        elif n.op == "DequantMatMul":
            total += 2 * math.prod(out) * int(n.attr("in_features"))
        elif n.op in ("Attention", "AttentionBlocked"):
            s, dv = out[-2:]
            t, d = shapes[1][-2:]
            total += 2 * math.prod(out[:-2]) * s * t * (d + dv)
        elif n.op == "Conv2d":
            total += 2 * math.prod(out) * math.prod(shapes[1][1:])
    del by_id
    return total


def transformer_inputs(c: Check, cfg: dict, img_hw: tuple[int, int], txt: int) -> dict:
    import ml_dtypes
    import numpy as np

    from luminal_recipes.tasks.flux2.latents import latent_ids, text_ids
    from luminal_recipes.tasks.flux2.steps import rope_tables

    h, w = img_hw
    rng = np.random.default_rng(1)
    ids = np.concatenate([text_ids(txt), latent_ids(h, w)]).astype(np.float64)
    rope = rope_tables(None, ids, list(cfg["axes_dims_rope"]), cfg["rope_theta"])
    bf = ml_dtypes.bfloat16
    return {"hidden_states": rng.standard_normal((1, h * w, cfg["in_channels"]), dtype=np.float32).astype(bf),
            "encoder_hidden_states": rng.standard_normal((1, txt, cfg["joint_attention_dim"]),
                                                         dtype=np.float32).astype(bf),
            "timestep": np.asarray([0.73], bf), "guidance": np.asarray([4.0], bf),
            "rope_cos": rope["cos"], "rope_sin": rope["sin"]}  # f32 tables (the recipe declares them f32)


@section("transformer", 150)
def transformer(c: Check) -> dict:
    import numpy as np
    import torch

    from luminal_recipes.tasks.flux2.latents import latent_ids, text_ids

    cfg = model_config(c, "transformer")
    hw, txt = ((4, 4), 8) if c.dry else ((64, 64), 512)  # 1024x1024: 64 x 64 latent tokens, 512 text tokens
    dims = {"batch": 1, "img": hw[0] * hw[1], "txt": txt}
    model = build(c, "flux2-transformer.yaml", "transformer", "bf16")
    program, compile_s = compile_for(c, model, dims)
    flops = program_flops(program, dims)
    c.log(f"  compiled in {compile_s:.1f} s; {flops / 1e12:.1f} TFLOP per step (program's GEMMs + attention)")
    t0 = time.perf_counter()
    tensors = device_weights(c, model.graph, seed=0)
    c.sync()
    gen_s = time.perf_counter() - t0
    weight_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    inputs = as_declared(model, transformer_inputs(c, cfg, hw, txt))
    used0 = c.device_used()
    exe = c.runtime.load(program, ours(c, tensors), dims)
    y = exe.run(inputs)["velocity"]  # the first run goes kernel by kernel; the next ones replay a CUDA graph
    steps = step_times(c, exe, inputs)
    replayed = exe.run(inputs)["velocity"]
    used1 = c.device_used()
    s_step = statistics.median(steps)
    out = {"dims": dims, "compile_s": compile_s, "weight_gen_s": gen_s, "weight_bytes": weight_bytes,
           "program_tflop_per_step": flops / 1e12, "s_per_step": s_step, "steps_s": steps,
           "tflops": (FULL_STEP_TFLOP * 1e12 if not c.dry else flops) / s_step / 1e12,
           "arena_bytes": exe.memory.arena_bytes, "kernels": sum(program.kernel_counts().values()),
           "device_bytes_ours": None if used1 is None else weight_bytes + used1 - used0,
           "cuda_graph": exe.replaying, "graph_bit_identical": bool(np.array_equal(
               replayed.view(np.uint16), y.view(np.uint16)))}
    c.log(f"  ours: {s_step:.3f} s/step, {out['tflops']:.1f} TFLOP/s (CUDA graph: {out['cuda_graph']}, same bits "
          f"as kernel by kernel: {out['graph_bit_identical']})")
    del exe
    c.free()
    if c.runtime.backend.graphs:  # the same step kernel by kernel: what the graph saves
        with options(c.runtime, graphs=False):
            eager = c.runtime.load(program, ours(c, tensors), dims)
            eager.run(inputs)
            out["eager_s_per_step"] = statistics.median(step_times(c, eager, inputs, 1, 3))
        c.log(f"  kernel by kernel: {out['eager_s_per_step']:.3f} s/step")
        del eager
        c.free()
    c.store["transformer"] = {"model": model, "program": program, "dims": dims, "inputs": inputs, "velocity": y,
                              "tensors": tensors}
    # diffusers on the very same weights (assigned, not copied)
    from diffusers import Flux2Transformer2DModel

    with torch.device("meta"):
        ref = Flux2Transformer2DModel(**{k: v for k, v in cfg.items() if not k.startswith("_")})
    ref.load_state_dict(tensors, strict=True, assign=True)
    ref.eval()

    def bf(name):
        return torch.from_numpy(inputs[name].astype(np.float32)).to(c.dev, torch.bfloat16)

    args = dict(hidden_states=bf("hidden_states"), encoder_hidden_states=bf("encoder_hidden_states"),
                timestep=bf("timestep"), guidance=bf("guidance"),
                img_ids=torch.tensor(latent_ids(*hw), dtype=torch.float32, device=c.dev),
                txt_ids=torch.tensor(text_ids(txt), dtype=torch.float32, device=c.dev), return_dict=False)
    if not c.dry:
        torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        want = ref(**args)[0]
        ref_steps = c.timed(lambda: ref(**args))
    out["diffusers_s_per_step"] = statistics.median(ref_steps)
    out["diffusers_peak_bytes"] = None if c.dry else int(torch.cuda.max_memory_allocated())
    out["speed_ratio_ours_over_diffusers"] = s_step / out["diffusers_s_per_step"]
    out["vs_diffusers"] = rel_err(y.astype(np.float32), want.float().cpu().numpy())
    c.log(f"  diffusers: {out['diffusers_s_per_step']:.3f} s/step; ours/diffusers "
          f"{out['speed_ratio_ours_over_diffusers']:.2f}; rel err {out['vs_diffusers']['norm_rel']:.2e} (norm), "
          f"{out['vs_diffusers']['max_rel']:.2e} (max)")
    ref = want = None
    c.free()
    return out


@section("dequant", 40)
def dequant(c: Check) -> dict:
    """FP8 / NVFP4 DequantMatMul (and bf16 MatMul) at FLUX.2's GEMM shapes, M = 4608, weights made on the device."""
    import ml_dtypes
    import numpy as np

    Fused = fused()
    from luminal_recipes.graph import Graph

    m = 64 if c.dry else 4608
    shapes = [(6144, 6144), (36864, 6144), (6144, 18432), (55296, 6144)]  # (N, K): attn, ff in, ff out, single
    if c.dry:
        shapes = [(n // 64, k // 64) for n, k in shapes]
    rows = []
    for n, k in shapes:
        for fmt in ("bf16", "fp8", "fp8-lt", "nvfp4"):
            g = Graph()
            x = g.input("x", (m, k), "bf16")
            if fmt == "bf16":
                w = g.weight("w", (n, k), "bf16")
                f = Fused(g)
                y = f.add("MatMul", [x, w.T], (m, n), "bf16")
                specs = {"w": ((n, k), "bf16")}
            elif fmt in ("fp8", "fp8-lt"):
                w, s = g.weight("w", (n, k), "f8e4m3"), g.weight("s", ())
                f = Fused(g)
                y = f.add("DequantMatMul", [x, w, s], (m, n), "bf16", format="fp8", layout="", out_features=n,
                          in_features=k)
                specs = {"w": ((n, k), "f8e4m3"), "s": ((), "f32")}
            else:
                w, s, s2 = g.weight("w", (n, k // 2), "u8"), g.weight("s", (n, k // 16), "f8e4m3"), g.weight("s2", ())
                f = Fused(g)
                y = f.add("DequantMatMul", [x, w, s, s2], (m, n), "bf16", format="nvfp4", layout="modelopt",
                          out_features=n, in_features=k)
                specs = {"w": ((n, k // 2), "u8"), "s": ((n, k // 16), "f8e4m3"), "s2": ((), "f32")}
            weights = random_bits(c, specs)
            xs = np.random.default_rng(0).standard_normal((m, k), dtype=np.float32).astype(ml_dtypes.bfloat16)
            try:
                program = f.program(y=y)
                with options(c.runtime, fp8_gemm="cublaslt" if fmt == "fp8-lt" else "dequant"):
                    path = fp8_path(c, program) if fmt.startswith("fp8") else fmt
                    exe = c.runtime.load(program, weights, {})
                    t = statistics.median(step_times(c, exe, {"x": xs}, 1 if c.dry else 2, 2 if c.dry else 5))
                rows.append({"n": n, "k": k, "m": m, "format": fmt, "path": path, "seconds": t,
                             "tflops": 2 * m * n * k / t / 1e12})
                c.log(f"  {fmt:6s} M={m} N={n} K={k}: {rows[-1]['tflops']:.1f} TFLOP/s ({path})")
            except Exception as exc:
                rows.append({"n": n, "k": k, "m": m, "format": fmt, "error": f"{type(exc).__name__}: {exc}"})
                c.log(f"  {fmt:6s} M={m} N={n} K={k}: ERROR {exc}")
            finally:
                exe = None
                c.free()
    speedups = {}
    for n, k in shapes:
        by = {r["format"]: r for r in rows if (r["n"], r["k"]) == (n, k) and "tflops" in r}
        if "fp8" in by and "fp8-lt" in by:
            speedups[f"{n}x{k}"] = by["fp8-lt"]["tflops"] / by["fp8"]["tflops"]
    c.log(f"  cuBLASLt FP8 over the bf16-dequant path (TFLOP/s ratio per N x K): "
          f"{ {key: round(v, 2) for key, v in speedups.items()} }")
    return {"shapes": rows, "fp8_cublaslt_over_dequant": speedups,
            "fp8_cublaslt_library": lt_library(c)}


def lt_library(c: Check) -> dict | str:
    """The libcublasLt the cuda runtime loaded (path, version), or why it could not."""
    if c.dry:
        return "cuda-emu: the numpy model of the cublasLtMatmul descriptor"
    try:
        lt = c.runtime.backend.lt_handle()
        return {"path": lt.path, "version": lt.version}
    except Exception as exc:  # noqa: BLE001 - reported, the dequant path runs instead
        return f"unavailable: {type(exc).__name__}: {exc}"


def fp8_path(c: Check, program) -> str:
    """Which path the runtime takes for the program's fp8 DequantMatMul at the current options: "cublaslt"
    (an FP8 GEMM step in its plan) or "dequant" (weights decoded to bf16; a notice says why when cuBLASLt was
    asked for)."""
    from luminal_recipes.runtimes.cuda.plan import LtGemm

    prepared = c.runtime.prepare(program, {})
    lt = any(isinstance(s, LtGemm) for bind, _ in prepared.values() for s in getattr(bind, "plan", bind).steps)
    return "cublaslt" if lt else "dequant"


def random_bits(c: Check, specs: dict) -> dict:
    """Weights of the given shapes/dtypes with random bits made on the device (finite values: fp8 exponents
    kept below the top, bf16 from N(0, 1) f32 truncated), as numpy arrays in a dry run."""
    import ml_dtypes
    import numpy as np

    from luminal_recipes.graph import to_dtype

    out = {}
    if c.dry:
        rng = np.random.default_rng(0)
        for name, (shape, dt) in specs.items():
            if dt == "bf16":
                out[name] = (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(ml_dtypes.bfloat16)
            elif dt == "f32":
                out[name] = np.asarray(0.01, np.float32).reshape(shape)
            else:
                bits = rng.integers(0, 256, shape).astype(np.uint8)
                out[name] = (bits & 0x77).view(ml_dtypes.float8_e4m3fn) if dt == "f8e4m3" else bits
        return out
    import cupy

    from luminal_recipes.runtimes.cuda.device import DeviceTensor

    rng = cupy.random.default_rng(0)
    for name, (shape, dt) in specs.items():
        if dt == "bf16":
            f = rng.standard_normal(shape, dtype=cupy.float32) * 0.02
            out[name] = DeviceTensor((f.view(cupy.uint32) >> 16).astype(cupy.uint16), to_dtype("bf16").np)
        elif dt == "f32":
            out[name] = cupy.full(shape, 0.01, cupy.float32)
        else:
            bits = rng.integers(0, 256, shape, dtype=cupy.int32).astype(cupy.uint8)
            out[name] = DeviceTensor(bits & 0x77, to_dtype("f8e4m3").np) if dt == "f8e4m3" else bits
    return out


@section("streamed", 90)
def streamed(c: Check) -> dict:
    """The transformer step under a 24 GiB device budget: weights streamed from (pinned) host memory."""
    import numpy as np
    import torch

    from luminal_recipes.compiler.extract import signature
    from luminal_recipes.pipeline.plan import plan_model

    st = c.store.get("transformer")
    if st is None:
        raise RuntimeError("needs the transformer section's model and weights")
    import ml_dtypes

    t0 = time.perf_counter()
    host = {k: t.view(torch.int16).cpu().numpy().view(ml_dtypes.bfloat16) for k, t in st["tensors"].items()}
    st["tensors"].clear()
    c.free()
    copy_s = time.perf_counter() - t0
    budget = 24 << 30
    if c.dry:  # the tiny transformer: a budget one byte below its resident plan, so its blocks stream
        budget = plan_model(st["model"], st["dims"], None, c.runtime, stage="transformer").planned_peak - 1
    plan = plan_model(st["model"], st["dims"], budget, c.runtime, stage="transformer")
    if not plan.streamed or not plan.fits:
        raise RuntimeError(f"the plan under {budget} bytes does not stream within the budget: {plan.summary()}")
    out = {"budget_bytes": budget, "host_copy_s": copy_s, "streamed": plan.streamed,
           "planned_peak_bytes": plan.planned_peak, "resident_weight_bytes": plan.resident_weight_bytes,
           "same_program": signature(plan.program) == signature(st["program"])}
    used0 = c.device_used()
    staging = (64 << 10) if c.dry else 4 << 30  # dry: blocks in several pieces
    exe = c.runtime.load(plan.program, host, st["dims"], stream=plan.stream, staging_bytes=staging)
    try:
        y = exe.run(st["inputs"])["velocity"]
        steps = c.timed(lambda: exe.run(st["inputs"]), 1, 2 if c.dry else 3)
        used1 = c.device_used()
        stats = exe.streamer.stats
    finally:
        exe.close()
    released = c.runtime.release_memory()
    out.update(s_per_step=statistics.median(steps), steps_s=steps,
               device_bytes=None if used1 is None else used1 - used0,
               bit_identical=bool(np.array_equal(y.view(np.uint16), st["velocity"].view(np.uint16))),
               staging_bytes=stats.staging_bytes, loads=stats.loads, uploads=stats.uploads,
               bytes_copied=stats.bytes_copied, load_s=stats.load_seconds, wait_s=stats.wait_seconds,
               device_memory_release=released)
    c.log(f"  streamed under {budget / 2**30:.2f} GiB: {out['s_per_step']:.3f} s/step, bit-identical: "
          f"{out['bit_identical']}; {stats.loads} block loads in {stats.uploads} uploads through "
          f"{stats.staging_bytes / 2**20:.0f} MiB pinned, loader {stats.load_seconds:.1f} s, waited "
          f"{stats.wait_seconds:.1f} s; device memory after release: {released}")
    return out


@section("tiny_pipeline", 60)
def tiny_pipeline(c: Check) -> dict:
    """recipes/flux2-tiny.yaml end to end on our runtime vs the numpy runtime's golden image."""
    from luminal_recipes.image_io import read_png, to_uint8
    from luminal_recipes.pipeline.driver import Pipeline
    from luminal_recipes.pipeline.golden import load_manifest, psnr
    from luminal_recipes.tasks.flux2.latents import initial_noise

    recipe, cases = load_manifest(ROOT / "tests" / "golden" / "goldens.yaml")
    case = next(k for k in cases if k.file.name.startswith("city"))  # 64x64, 2 steps
    p = case.params
    sets = [f"{k}={v}" for k, v in p.items()]
    pipe = Pipeline(recipe, sets=sets, runtime=c.runtime)
    t0 = time.perf_counter()
    report = pipe.run({"prompt": case.prompt, "init_latents": initial_noise(p["seed"], p["height"], p["width"])})
    seconds = time.perf_counter() - t0
    image = to_uint8(report.values["image"])
    golden, _ = read_png(case.file)
    value = psnr(image, golden)
    device = {stage: m.get("device_memory") for stage, m in report.memory.items()}
    c.log(f"  {case.file.name}: PSNR {value:.1f} dB vs the numpy golden ({seconds:.1f} s); device memory per "
          f"stage: {device}")
    return {"case": case.file.name, "psnr_db": value, "ok": value >= 40.0, "seconds": seconds,
            "stage_seconds": report.stage_seconds, "device_memory": device}


def as_declared(model, inputs: dict) -> dict:
    """Inputs converted to the dtypes the model declares (recipes declare f32 inputs whatever the compute)."""
    return {k: v.astype(model.inputs[k].dtype.np) for k, v in inputs.items()}


def stage_run(c: Check, recipe: str, component: str, dims: dict, inputs: dict, sets=None) -> dict:
    model = build(c, recipe, component, "bf16", sets)
    inputs = as_declared(model, inputs)
    program, compile_s = compile_for(c, model, dims)
    tensors = device_weights(c, model.graph, seed=0)
    weight_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    used0 = c.device_used()
    exe = c.runtime.load(program, ours(c, tensors), dims)
    out_name = next(iter(program.outputs))
    y = exe.run(inputs)[out_name]
    t = step_times(c, exe, inputs, 1, 1 if c.dry else 3)
    used1 = c.device_used()
    out = {"dims": dims, "compile_s": compile_s, "weight_bytes": weight_bytes, "seconds": statistics.median(t),
           "arena_bytes": exe.memory.arena_bytes, "planned_peak_bytes": exe.memory.planned_peak,
           "device_bytes": None if used1 is None else weight_bytes + used1 - used0,
           "output_finite": bool(__import__("numpy").isfinite(y.astype("float32")).all())}
    del exe, tensors
    c.free()
    return out


@section("vae", 40)
def vae(c: Check) -> dict:
    import ml_dtypes
    import numpy as np

    cfg = model_config(c, "vae")
    h = w = 4 if c.dry else 64  # latent grid of a 1024x1024 image
    ch = 4 * cfg.get("latent_channels", 32)
    x = np.random.default_rng(0).standard_normal((1, ch, h, w), dtype=np.float32).astype(ml_dtypes.bfloat16)
    out = stage_run(c, "flux2-vae-decoder.yaml", "vae", {"batch": 1, "h": h, "w": w}, {"latents": x})
    c.log(f"  VAE decode {16 * h}x{16 * w}: {out['seconds']:.3f} s, device {out['device_bytes']}")
    return out


@section("text_encoder", 70)
def text_encoder(c: Check) -> dict:
    import numpy as np

    cfg = model_config(c, "text_encoder")
    vocab = cfg.get("text_config", cfg)["vocab_size"]
    seq = 16 if c.dry else 512
    tokens = np.random.default_rng(0).integers(0, vocab, (1, seq)).astype(np.int32)
    mask = np.ones((1, seq), np.int32)
    out = stage_run(c, "mistral3-text-encoder.yaml", "text_encoder", {"batch": 1, "seq": seq},
                    {"tokens": tokens, "attention_mask": mask}, sets={"out_layers": [10, 20, 30]})
    c.log(f"  text encoder {seq} tokens: {out['seconds']:.3f} s, device {out['device_bytes']}")
    return out


@section("rebinding", 40)
def rebinding(c: Check) -> dict:
    """One executable of the tiny Mistral-3 text encoder loaded for a 512-token bucket, re-bound to prompt lengths
    within it: seconds per re-binding and per run at each length, and the CUDA modules built and NVRTC compiles
    (``luminal_recipes.instrument``: none after loading, whatever the lengths; the kernels read the length from
    their arguments)."""
    import numpy as np

    from luminal_recipes import instrument

    folder = ROOT / "recipes" / "flux2-tiny" / "checkpoint" / "text_encoder"
    cfg = json.loads((folder / "config.json").read_text())
    vocab = cfg.get("text_config", cfg)["vocab_size"]
    bucket, lengths = (16, [5, 9, 13, 16, 1]) if c.dry else (512, [37, 64, 100, 200, 333, 500, 512, 1])
    from luminal_recipes.recipe.builder import build_model
    from luminal_recipes.recipe.loader import load_recipe

    model = build_model(load_recipe(ROOT / "recipes" / "mistral3-text-encoder.yaml"), config=cfg,
                        sets={"out_layers": [1, 2]}, compute_dtype="bf16")
    dims = {"batch": 1, "seq": bucket}
    program, compile_s = compile_for(c, model, dims)
    tensors = device_weights(c, model.graph, seed=0)
    before = instrument.snapshot()
    t0 = time.perf_counter()
    exe = c.runtime.load(program, ours(c, tensors), dims)
    load_s = time.perf_counter() - t0
    loaded = instrument.snapshot()
    rng = np.random.default_rng(0)
    rows = []
    try:
        for n in lengths:
            inputs = as_declared(model, {"tokens": rng.integers(0, vocab, (1, n)).astype(np.int32),
                                         "attention_mask": np.ones((1, n), np.int32)})
            t0 = time.perf_counter()
            exe.bind({"seq": n})
            bind_s = time.perf_counter() - t0
            run = c.timed(lambda inputs=inputs: exe.run(inputs), 1, 1 if c.dry else 3)
            rows.append({"seq": n, "bind_s": bind_s, "run_s": statistics.median(run)})
    finally:
        exe.close()
    after = instrument.snapshot()
    out = {"bucket": bucket, "compile_s": compile_s, "load_s": load_s, "lengths": rows,
           "modules_at_load": (loaded - before)[instrument.CUDA_MODULE],
           "compiles_at_load": (loaded - before)[instrument.CUDA_COMPILE],
           "modules_rebinding": (after - loaded)[instrument.CUDA_MODULE],
           "compiles_rebinding": (after - loaded)[instrument.CUDA_COMPILE]}
    out["ok"] = out["modules_rebinding"] == 0 and out["compiles_rebinding"] == 0
    binds = ", ".join(f"{r['bind_s'] * 1e3:.1f}" for r in rows)
    runs = ", ".join(f"{r['run_s'] * 1e3:.2f}" for r in rows)
    c.log(f"  re-binding a {bucket}-token bucket to {lengths}: bind {binds} ms, run {runs} ms; modules built while "
          f"re-binding: {out['modules_rebinding']}, compiles: {out['compiles_rebinding']} (at load: "
          f"{out['modules_at_load']})")
    del tensors
    c.free()
    return out


@section("fp8_pipeline", 60)
def fp8_pipeline(c: Check) -> dict:
    """The tiny FLUX.2 pipeline with an FP8 transformer (recipes/flux2-fp8.yaml, made here by the quantize tool),
    computing in bf16: FP8 x FP8 through cuBLASLt (e4m3 activations) vs weights decoded to bf16, each as PSNR
    against our f32 numpy image of the same FP8 checkpoint (= diffusers on its dequantized weights, bit for bit on
    this checkpoint), and how many FP8 GEMMs were bound on each path."""
    import tempfile

    from luminal_recipes.image_io import to_uint8
    from luminal_recipes.pipeline.driver import Pipeline
    from luminal_recipes.pipeline.golden import psnr
    from luminal_recipes.recipe.loader import load_recipe
    from luminal_recipes.tasks.flux2.latents import initial_noise
    from luminal_recipes.weights.quantize import quantize_checkpoint

    w, h, steps = (32, 32, 2) if c.dry else (80, 48, 3)
    sets = [f"steps={steps}", f"width={w}", f"height={h}", "seed=0", "max_sequence_length=64"]
    prompt, latents = "a red fox in the snow", initial_noise(0, h, w)
    recipe = ROOT / "recipes" / "flux2-fp8.yaml"
    tiny = ROOT / "recipes" / "flux2-tiny" / "checkpoint"
    exclude = load_recipe(recipe).doc.models["transformer"].quantization.exclude
    backend = c.runtime.backend
    with tempfile.TemporaryDirectory(prefix="luminal-fp8-") as tmp:
        folder = Path(tmp) / "checkpoint"
        folder.mkdir()
        for item in tiny.iterdir():
            if item.name != "transformer":
                (folder / item.name).symlink_to(item)
        quantize_checkpoint(tiny / "transformer", folder / "transformer", "fp8", exclude=exclude)
        images = {"f32 numpy": to_uint8(Pipeline(recipe, weights=folder, sets=sets, compile=False).run(
            {"prompt": prompt, "init_latents": latents}).values["image"])}
        bound = {}
        original = backend.lt_gemm
        for mode in ("dequant", "cublaslt"):
            count = [0]

            def counted(*args, count=count):
                count[0] += 1
                return original(*args)

            backend.lt_gemm = counted
            try:
                with options(c.runtime, fp8_gemm=mode):
                    pipe = Pipeline(recipe, weights=folder, sets=sets, runtime=c.runtime, compute_dtype="bf16")
                    images[f"bf16 {mode}"] = to_uint8(pipe.run({"prompt": prompt, "init_latents": latents})
                                                      .values["image"])
            finally:
                del backend.lt_gemm
            bound[mode] = count[0]
            pipe = None
            c.free()
    out = {"size": [w, h, steps], "fp8_gemms_bound": bound,
           "psnr_db": {"bf16 dequant vs f32": float(psnr(images["bf16 dequant"], images["f32 numpy"])),
                       "bf16 cublaslt vs f32": float(psnr(images["bf16 cublaslt"], images["f32 numpy"])),
                       "bf16 cublaslt vs bf16 dequant": float(psnr(images["bf16 cublaslt"], images["bf16 dequant"]))}}
    out["ok"] = bound["cublaslt"] > 0 and bound["dequant"] == 0 and min(out["psnr_db"].values()) >= 40.0
    c.log(f"  FP8 GEMMs bound {bound}; PSNR {({k: round(v, 1) for k, v in out['psnr_db'].items()})}")
    return out


# ---- main ---------------------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="run everything on the CPU through cuda-emu, tiny sizes")
    p.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "outputs" / "gpu_check"))
    p.add_argument("--time-limit", type=float, default=None, help="seconds for the whole run (GPU 450, dry 1500)")
    p.add_argument("--only", default="", help="comma-separated sections to run (default: all)")
    args = p.parse_args(argv)
    args.time_limit = args.time_limit or (1500.0 if args.dry_run else 450.0)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    log = Log(out_dir / "gpu_check.log")
    log(f"gpu_check {'(dry run: cuda-emu, tiny sizes)' if args.dry_run else ''} -> {out_dir}")
    result = {"dry_run": args.dry_run, "started": time.strftime("%Y-%m-%d %H:%M:%S"), "sections": {}}
    json_path = out_dir / "gpu_check.json"

    def save():
        tmp = json_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=2, default=str))
        tmp.replace(json_path)

    try:
        bootstrap(args.dry_run, log)
        check = Check(args, log)
    except BaseException as exc:
        result["bootstrap_error"] = traceback.format_exc()
        log(f"bootstrap failed: {exc}")
        save()
        return 1
    only = {s for s in args.only.split(",") if s}
    scale = 1.0 if not args.dry_run else 3.0  # cuda-emu is slower than the GPU: estimates in CPU seconds
    for name, estimate, fn in SECTIONS:
        if only and name not in only:
            continue
        entry: dict = {}
        if check.left() < estimate * scale * 0.5:
            entry = {"status": "skipped", "reason": f"{check.left():.0f} s left, estimate {estimate * scale:.0f} s"}
            log(f"{name}: skipped ({entry['reason']})")
        else:
            log(f"{name} ...")
            t0 = time.perf_counter()
            try:
                entry = {"status": "ok", **fn(check)}
            except BaseException as exc:  # recorded, then on to the next section
                if isinstance(exc, KeyboardInterrupt):
                    raise
                entry = {"status": "error", "error": f"{type(exc).__name__}: {exc}",
                         "traceback": traceback.format_exc()[-4000:]}
                log(f"{name}: ERROR {type(exc).__name__}: {exc}")
            entry["section_s"] = time.perf_counter() - t0
            log(f"{name}: {entry['status']} in {entry['section_s']:.1f} s")
            with contextlib.suppress(Exception):
                check.free()
        result["sections"][name] = entry
        save()
    result["total_s"] = time.perf_counter() - log.t0
    save()
    statuses = {k: v["status"] for k, v in result["sections"].items()}
    log(f"done in {result['total_s']:.1f} s: {statuses}")
    failed = [k for k, v in statuses.items() if v == "error"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
