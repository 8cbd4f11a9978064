"""NVRTC compilation of a program's CUDA C module (``cupy.cuda.nvrtc``), cached on disk.

Include paths: this package's ``kernels/`` and the CUDA headers shipped by the ``nvidia-cuda-runtime`` /
``nvidia-cuda-crt`` wheels (``cuda_bf16.h``, ``cuda_fp8.h``), so no system CUDA is needed. The cache key is the
source, the headers, the target architecture, the NVRTC version and the options. A compile error names the kernel
and the program node it was generated for. ``--fmad=false``: no contraction of a*b+c, so the device rounds as
cuda-emu and the numpy runtime do (kernels that want FMA call ``fmaf``).
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

from luminal_recipes import instrument
from luminal_recipes.errors import LuminalError

from .module import KERNEL_DIR, cache_key, cache_root, headers_digest, write_atomic

OPTIONS = ("-std=c++17", "--fmad=false", "-default-device")


class NvrtcError(LuminalError):
    """NVRTC rejected a module (the message names the kernel and its node when the error is inside one)."""


def nvrtc():
    try:
        from cupy.cuda import nvrtc as lib
    except ImportError as e:
        raise NvrtcError(f"NVRTC is not available ({e}); install the CUDA extra: pip install -e '.[cuda13]'") \
            from None
    return lib


@functools.lru_cache(maxsize=1)
def cuda_include_dir() -> Path:
    """The include folder of the nvidia-cuda-runtime/-crt wheels (cuda_bf16.h, cuda_fp8.h, crt/...), or
    ``$LUMINAL_CUDA_INCLUDE`` when set (bench/gpu_check.py points it at headers it carries)."""
    override = os.environ.get("LUMINAL_CUDA_INCLUDE")
    if override:
        folder = Path(override)
        if (folder / "cuda_bf16.h").exists() and (folder / "crt").exists():
            return folder
        raise NvrtcError(f"LUMINAL_CUDA_INCLUDE={override} has no cuda_bf16.h and crt/; point it at a CUDA "
                         "include folder or unset it")
    try:
        import nvidia
    except ImportError:
        raise NvrtcError("the CUDA headers wheels are missing; pip install nvidia-cuda-runtime nvidia-cuda-crt "
                         "(part of the cuda13 / test extras)") from None
    for root in nvidia.__path__:
        for candidate in sorted(Path(root).glob("*/include")) + [Path(root) / "cuda_runtime" / "include"]:
            if (candidate / "cuda_bf16.h").exists() and (candidate / "crt").exists():
                return candidate
    raise NvrtcError("cuda_bf16.h and crt/ were not found in the nvidia wheels; pip install nvidia-cuda-runtime "
                     "nvidia-cuda-crt")


def version() -> str:
    major, minor = nvrtc().getVersion()
    return f"{major}.{minor}"


def compile_module(source: str, arch: str, extra: tuple[str, ...] = (), describe=None,
                   kind: str = "cubin") -> tuple[bytes, str]:
    """``(cubin or ptx bytes, compiler log)`` for ``arch`` (e.g. "sm_90"), from the cache when possible."""
    lib = nvrtc()
    options = (f"-arch={arch}", *OPTIONS, *extra, f"-I{KERNEL_DIR}", f"-I{cuda_include_dir()}")
    key = cache_key(source, headers_digest(), arch, version(), " ".join(options[:-2]), kind)
    path = cache_root() / "nvrtc" / f"{key}.{kind}"
    log_path = path.with_suffix(".log")
    if path.exists() and log_path.exists():
        return path.read_bytes(), log_path.read_text()
    instrument.count(instrument.CUDA_COMPILE)
    prog = lib.createProgram(source, "module.cu", [], [])
    try:
        try:
            lib.compileProgram(prog, list(options))
        except Exception:
            log = lib.getProgramLog(prog)
            raise NvrtcError(_describe(log, arch, describe)) from None
        log = lib.getProgramLog(prog)
        # CuPy's getCUBIN drops the binary's last byte (a NUL terminator); restore it for cuobjdump and the driver
        data = lib.getCUBIN(prog) + b"\0" if kind == "cubin" else lib.getPTX(prog).encode()
    finally:
        lib.destroyProgram(prog)
    write_atomic(path, data)
    write_atomic(log_path, log.encode())
    return data, log


def compile_cubin(source: str, arch: str, describe=None) -> bytes:
    return compile_module(source, arch, describe=describe)[0]


def _describe(log: str, arch: str, describe) -> str:
    errors = [ln for ln in log.splitlines() if "error" in ln][:5] or log.splitlines()[:5]
    where = ""
    if describe is not None:
        for ln in errors:
            m = re.search(r"\((\d+)\)", ln)
            if m:
                where = describe(int(m.group(1)))
                if where:
                    break
    return f"NVRTC ({arch}) failed to compile the kernel module{' in ' + where if where else ''}:\n" + \
        "\n".join(errors)


def resource_usage(log: str) -> dict[str, dict[str, int]]:
    """Per kernel, from an ``-Xptxas=-v`` log: registers, spill stores/loads (bytes), stack frame (bytes)."""
    out: dict[str, dict[str, int]] = {}
    current = None
    for line in log.splitlines():
        m = re.search(r"Function properties for (\S+)", line) or re.search(r"Compiling entry function '(\S+)'", line)
        if m:
            current = m.group(1)
            out.setdefault(current, {})
            continue
        if current is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            out[current].update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            out[current]["registers"] = int(m.group(1))
    return out
