"""Which instruction-set path the CPU backend's kernels take: the one place that reads what the CPU reports.

The paths, from the most capable down (each CPU runs the paths at or below the one it reports):

- ``amx``: f32 MatMul, attention and DequantMatMul products on the AMX tiles (``amx/``: Intel Sapphire Rapids
  and later; the CPU reports ``amx_tile`` and ``amx_bf16``), the numba kernels compiled for this CPU;
- ``avx512``: the numba kernels compiled for this CPU, which has AVX-512 (``avx512f``, ``avx512bw``,
  ``avx512vl``, ``avx512dq``: Skylake-SP and later, AMD Zen 4 and later); products on BLAS;
- ``avx2``: the numba kernels compiled for Haswell (AVX2 and FMA, 256-bit vectors, no AVX-512 instruction);
  products on BLAS;
- ``native``: what a CPU without AVX2 and FMA (or not x86) reports: the numba kernels compiled for it as it is;
- ``numpy``: no compiled kernel, numpy's passes only (numba is not installed, or it is forced).

``LUMINAL_RECIPES_ISA`` (``amx``, ``avx512``, ``avx2`` or ``numpy``) forces a path at or below the CPU's own,
for comparisons and to simulate a smaller CPU; a path above it is refused (its instructions would kill the
process). ``LUMINAL_RECIPES_AMX=0`` is the same as ``LUMINAL_RECIPES_ISA=avx512`` (on a CPU below, nothing),
``LUMINAL_RECIPES_JIT=0`` as ``numpy``. Forcing ``avx2`` sets numba's target (``NUMBA_CPU_NAME=haswell`` with
Haswell's feature list in ``NUMBA_CPU_FEATURES``: the CPU name alone keeps the host's features, AVX-512
included) when ``runtimes.cpu`` is imported, before numba compiles anything; numba's disk cache keeps each
target's code apart. What is decided when a process starts is not ours to change: numpy's OpenBLAS picks its
kernels on load (``OPENBLAS_CORETYPE=Haswell`` before the process starts makes it use AVX2's), PyTorch its own
(``ATEN_CPU_CAPABILITY=avx2``, ``MKL_ENABLE_INSTRUCTIONS=AVX2``); ``bench/flux2_cpu.py --isa`` sets all of them.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys

from luminal_recipes.errors import LuminalError

LEVELS = ("numpy", "native", "avx2", "avx512", "amx")  # each runs everything the ones before it run
FORCIBLE = ("numpy", "avx2", "avx512", "amx")
ENV = "LUMINAL_RECIPES_ISA"
AVX512 = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"})
AVX2 = frozenset({"avx2", "fma"})
AMX = frozenset({"amx_tile", "amx_bf16"})
# numba's target for a forced AVX2 path: LLVM's Haswell with exactly its features (no AVX-512, no AMX)
HASWELL = "haswell"
HASWELL_FEATURES = ("+64bit,+avx,+avx2,+bmi,+bmi2,+cmov,+crc32,+cx16,+cx8,+f16c,+fma,+fsgsbase,+fxsr,+invpcid,"
                    "+lzcnt,+mmx,+movbe,+pclmul,+popcnt,+rdrnd,+sahf,+sse,+sse2,+sse3,+sse4.1,+sse4.2,+ssse3,"
                    "+xsave,+xsaveopt")


class IsaError(LuminalError):
    """``LUMINAL_RECIPES_ISA`` names no path, or one this CPU cannot run."""


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux reports them (``/proc/cpuinfo``; empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def detected(flags: frozenset[str] | None = None) -> str:
    """The most capable path the CPU reports (numba aside)."""
    flags = cpu_flags() if flags is None else flags
    if AVX512.issubset(flags):
        return "amx" if AMX.issubset(flags) else "avx512"
    return "avx2" if AVX2.issubset(flags) else "native"


def _numba_installed() -> bool:
    return importlib.util.find_spec("numba") is not None


def _asked() -> tuple[str, str] | None:
    """(the path asked for, by which setting), or None."""
    value = os.environ.get(ENV, "").strip().lower()
    if value:
        return value, f"{ENV}={value}"
    if os.environ.get("LUMINAL_RECIPES_JIT", "1") == "0":
        return "numpy", "LUMINAL_RECIPES_JIT=0"
    if os.environ.get("LUMINAL_RECIPES_AMX", "1") == "0":
        return "avx512", "LUMINAL_RECIPES_AMX=0"
    return None


def check() -> str:
    """The path the kernels take in this process; ``IsaError`` where ``LUMINAL_RECIPES_ISA`` is not one of
    ``FORCIBLE`` or asks for more than the CPU reports."""
    cpu = detected()
    asked = _asked()
    if asked is None:
        level = cpu
    else:
        value, setting = asked
        if value not in FORCIBLE:
            raise IsaError(f"{setting}: not a CPU path; use one of {', '.join(FORCIBLE)} (at most '{cpu}', what "
                           f"this CPU reports), or unset {ENV} to take the CPU's own.")
        if setting.startswith("LUMINAL_RECIPES_AMX"):
            value = min(value, cpu, key=LEVELS.index)  # AMX off: the CPU's own path without it
        if LEVELS.index(value) > LEVELS.index(cpu):
            below = [p for p in FORCIBLE if LEVELS.index(p) <= LEVELS.index(cpu)]
            raise IsaError(f"{setting}: this CPU reports the '{cpu}' path at most (/proc/cpuinfo lacks "
                           f"{', '.join(sorted(_missing(value)))}); its instructions would stop the process. Use "
                           f"{ENV}={below[-1]} or a path below it ({', '.join(below)}), or unset it.")
        level = value
    if level != "numpy" and not _numba_installed():
        return "numpy"
    return level


def _missing(level: str) -> frozenset[str]:
    need = {"amx": AMX | AVX512, "avx512": AVX512, "avx2": AVX2}.get(level, frozenset())
    return need - cpu_flags()


def selected() -> str:
    """``check()``, or the CPU's own path (without numba: ``numpy``) where the setting is refused: the error is
    raised where a runtime is made (``NumpyBackend``), never while a module imports."""
    try:
        return check()
    except IsaError:
        return detected() if _numba_installed() else "numpy"


def at_least(level: str) -> bool:
    return LEVELS.index(selected()) >= LEVELS.index(level)


def why_not(level: str) -> str | None:
    """None where the selected path includes ``level``, else why not (for skip messages and logs)."""
    if at_least(level):
        return None
    asked = _asked()
    if asked is not None and asked[0] in FORCIBLE and LEVELS.index(asked[0]) < LEVELS.index(level):
        return asked[1]
    cpu = detected()
    if LEVELS.index(cpu) < LEVELS.index(level):
        return f"the CPU reports the '{cpu}' path at most (missing: {', '.join(sorted(_missing(level)))})"
    return "numba is not installed (pip install luminal-recipes[jit])"


def numba_target() -> tuple[str, str] | None:
    """(CPU name, feature list) numba must compile for, where the selected path is below the CPU's own vector
    width (a forced ``avx2`` on an AVX-512 CPU), else None (numba's own choice: this CPU)."""
    if selected() == "avx2" and detected() in ("avx512", "amx"):
        return HASWELL, HASWELL_FEATURES
    return None


def configure_numba() -> None:
    """Point numba at the selected path's target (``numba_target``) before it compiles anything: numba reads
    its target from its configuration when it first compiles (later changes are ignored)."""
    target = numba_target()
    if target is None:
        return
    name, features = target
    os.environ["NUMBA_CPU_NAME"], os.environ["NUMBA_CPU_FEATURES"] = name, features
    config = sys.modules.get("numba.core.config")
    if config is not None:  # numba imported already: its configuration was read from the environment then
        config.CPU_NAME, config.CPU_FEATURES = name, features


def numba_codegen_target() -> tuple[str, str]:
    """(CPU name, feature list) numba's code generator actually compiles for in this process (imports numba)."""
    from numba.core.registry import cpu_target

    codegen = cpu_target.target_context.codegen()
    _, name, features = codegen.magic_tuple()
    return name, features


configure_numba()  # on import: ``runtimes/cpu/__init__.py`` imports this module before any kernel
