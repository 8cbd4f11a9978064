"""One CUDA C module per program: the hand-written templates (``kernels/*.cuh``) plus every generated kernel.

The same text compiles two ways: NVRTC for the GPU (``nvrtc.py``) and g++ with ``-DLUMINAL_EMU`` for cuda-emu
(``emu.py``); under ``LUMINAL_EMU`` each kernel also gets an ``emu_<name>(launch, args)`` entry that unpacks its
arguments and runs it through ``emu.h``'s launcher. Both compilers' outputs are cached on disk next to the plan
cache (``compiler.cache.cache_dir()/cuda``), keyed by a hash of the source, the headers, the target and the
compiler's version.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from luminal_recipes import tempfiles
from luminal_recipes.compiler.cache import cache_dir

from .plan import KernelSource

KERNEL_DIR = Path(__file__).resolve().parent / "kernels"
TEMPLATES = ("common.cuh", "rows.cuh", "reduce.cuh", "index.cuh", "attention.cuh", "dequant.cuh", "conv.cuh",
             "gguf.cuh")


def headers_digest() -> str:
    h = hashlib.sha256()
    for path in sorted(KERNEL_DIR.iterdir()):
        if path.suffix in (".cuh", ".h", ".cu"):
            h.update(path.name.encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def module_source(sources: list[KernelSource]) -> str:
    seen: set[str] = set()
    unique = []
    for s in sources:
        if s.name not in seen:
            seen.add(s.name)
            unique.append(s)
    lines = ["#ifndef LUMINAL_EMU_PCH  // cuda-emu may have these in a precompiled header already"]
    lines += [f'#include "{t}"' for t in TEMPLATES if (KERNEL_DIR / t).exists()]
    lines += ["#endif", ""]
    for s in unique:
        lines.append(s.code.strip())
        lines.append("")
    lines.append("#ifdef LUMINAL_EMU")
    for s in unique:
        args = ", ".join(f"*({p}*)a[{i}]" for i, p in enumerate(s.params))
        lines.append(f"static void emu_thread_{s.name}(void* const* a) {{ {s.name}({args}); }}")
        lines.append(f'extern "C" void emu_{s.name}(const EmuLaunch* L, void** a) {{ '
                     f'emu::run(L, &emu_thread_{s.name}, a, {"true" if s.sync else "false"}); }}')
    lines.append("#endif")
    return "\n".join(lines) + "\n"


def template_includes() -> str:
    return "".join(f'#include "{t}"\n' for t in TEMPLATES if (KERNEL_DIR / t).exists())


def cache_root() -> Path:
    return cache_dir() / "cuda"


def cache_key(*parts: str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode())
        h.update(b"\0")
    return h.hexdigest()[:32]


def write_atomic(path: Path, data: bytes) -> None:
    """Write a cache entry so that a concurrent reader sees the whole file or none (through the one temporary
    file pattern, ``luminal_recipes.tempfiles``: removed when interrupted, swept when a killed process left it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tempfiles.write_atomic(path, data, fsync=False)
