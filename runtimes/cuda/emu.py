"""cuda-emu's compiler and launcher: a program's CUDA C module built by g++ into a shared object, kernels launched
through ctypes on numpy buffers (test-only; see ``kernels/emu.h`` for what runs how).

``compile_emu(source)`` returns an ``EmuModule`` (cached on disk by source hash, headers, g++ version and flags);
``EmuModule.launcher(kernel, params, grid, block, args)`` returns the zero-argument call that runs one launch,
with its argument block built once. ``sanitize="address"`` builds with AddressSanitizer (the process must have
libasan preloaded: ``asan_env()`` gives the environment for a subprocess).
"""

from __future__ import annotations

import ctypes
import functools
import shutil
import subprocess
import tempfile
from pathlib import Path

from luminal_recipes import instrument, tempfiles
from luminal_recipes.errors import LuminalError

from .module import KERNEL_DIR, cache_key, cache_root, headers_digest, template_includes

FLAGS = ("-O2", "-std=c++20", "-ffp-contract=off", "-fno-fast-math", "-shared", "-fPIC", "-pthread",
         "-DLUMINAL_EMU", "-w")
SANITIZE = {"address": ("-fsanitize=address", "-fno-omit-frame-pointer", "-O1", "-g"),
            "thread": ("-fsanitize=thread", "-O1", "-g")}


class EmuCompileError(LuminalError):
    """g++ rejected a module (the message names the kernel when the error is inside one)."""


class EmuLaunch(ctypes.Structure):
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3)]


_CTYPES = {"int": ctypes.c_int, "unsigned": ctypes.c_uint, "long long": ctypes.c_longlong, "float": ctypes.c_float}


@functools.lru_cache(maxsize=1)
def gxx() -> str:
    path = shutil.which("g++")
    if path is None:
        raise EmuCompileError("cuda-emu needs g++ (with C++20 <barrier>); install it, e.g. apt-get install g++")
    return path


@functools.lru_cache(maxsize=1)
def gxx_version() -> str:
    return subprocess.run([gxx(), "--version"], capture_output=True, text=True, check=True).stdout.splitlines()[0]


def precompiled_header(flags: tuple[str, ...]) -> list[str]:
    """``-include`` options for a precompiled header of every template (cuts a module's g++ time ~4x), built
    once per headers/flags/compiler; [] when g++ cannot make one."""
    key = cache_key(headers_digest(), gxx_version(), " ".join(flags))
    folder = cache_root() / "emu" / f"pch-{key}"
    header = folder / "lr_emu_pch.h"
    gch = folder / "lr_emu_pch.h.gch"
    if not gch.exists():
        folder.mkdir(parents=True, exist_ok=True)
        header.write_text(template_includes() + "#define LUMINAL_EMU_PCH 1\n")
        tmp = tempfiles.temp_path(gch)  # the one temporary-file pattern: removed if interrupted, else swept
        tempfiles.sweep_once(folder)
        pch_flags = [f for f in flags if f != "-shared"]
        try:
            proc = subprocess.run([gxx(), *pch_flags, f"-I{KERNEL_DIR}", "-x", "c++-header", str(header), "-o",
                                   str(tmp)], capture_output=True, text=True)
            if proc.returncode != 0:
                return []
            tmp.replace(gch)
        finally:
            tmp.unlink(missing_ok=True)
    return ["-include", str(header)]


def compile_emu(source: str, sanitize: str | None = None, kernel_of_line=None) -> EmuModule:
    flags = FLAGS + SANITIZE.get(sanitize or "", ())
    key = cache_key(source, headers_digest(), gxx_version(), " ".join(flags))
    so = cache_root() / "emu" / f"{key}{'-' + sanitize if sanitize else ''}.so"
    if not so.exists():
        so.parent.mkdir(parents=True, exist_ok=True)
        pch = precompiled_header(flags)
        with tempfile.TemporaryDirectory(prefix="luminal-emu-") as tmp:
            src = Path(tmp) / "module.cpp"
            src.write_text(source)
            out = Path(tmp) / "module.so"
            instrument.count(instrument.CUDA_COMPILE)
            proc = subprocess.run([gxx(), *flags, *pch, f"-I{KERNEL_DIR}", str(src), "-o", str(out)],
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                raise EmuCompileError(_describe(proc.stderr, kernel_of_line))
            tempfiles.write_atomic(so, out.read_bytes(), fsync=False)
    return EmuModule(so)


def _describe(log: str, kernel_of_line) -> str:
    lines = [ln for ln in log.splitlines() if "error" in ln][:5] or log.splitlines()[:5]
    where = ""
    if kernel_of_line is not None:
        for ln in lines:
            parts = ln.split(":")
            if len(parts) > 2 and parts[1].isdigit():
                where = kernel_of_line(int(parts[1]))
                if where:
                    break
    return f"cuda-emu: g++ failed to compile the kernel module{' (' + where + ')' if where else ''}:\n" + \
        "\n".join(lines)


class EmuModule:
    def __init__(self, path: Path):
        self.path = path
        self.lib = ctypes.CDLL(str(path))

    def launcher(self, kernel: str, params: tuple[str, ...], grid, block, args: list):
        """The call running ``kernel`` once over ``grid`` x ``block`` with ``args`` (ints for pointers, numbers
        otherwise); argument storage is built here, once."""
        fn = getattr(self.lib, f"emu_{kernel}")
        fn.argtypes = [ctypes.POINTER(EmuLaunch), ctypes.c_void_p]
        fn.restype = None
        values = []
        for p, v in zip(params, args, strict=True):
            if p.endswith("*"):
                values.append(ctypes.c_void_p(int(v)))
            else:
                values.append(_CTYPES[p.replace("const ", "").strip()](v))
        argv = (ctypes.c_void_p * max(1, len(values)))(*[ctypes.addressof(v) for v in values])
        launch = EmuLaunch((ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*block))
        ref = ctypes.byref(launch)

        def call(fn=fn, ref=ref, argv=argv, keep=(values, launch)):
            fn(ref, argv)

        return call


def asan_env() -> dict[str, str]:
    """Environment for a Python subprocess that loads AddressSanitizer-built modules."""
    lib = subprocess.run([gxx(), "-print-file-name=libasan.so"], capture_output=True, text=True, check=True).stdout
    return {"LD_PRELOAD": lib.strip(), "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1"}
