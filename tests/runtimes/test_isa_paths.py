"""Each instruction-set path of the CPU backend (``runtimes/cpu/isa.py``: AMX, AVX-512, AVX2, plain numpy) is
chosen from what the CPU reports, can be forced below it with ``LUMINAL_RECIPES_ISA``, and computes the
conformance suite's programs within the tolerance policy of the reference and of the CPU's own path.

The CPU's own path runs the whole conformance suite in this process; every path below it runs here in a process
of its own (numba fixes its target when it first compiles; OpenBLAS picks its kernels when loaded), on the same
compiled programs, and reports what numba and OpenBLAS actually target."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from isa_child import pack, unpack
from test_conformance import CASES, Case, program_with

from luminal_recipes.graph import run_reference
from luminal_recipes.runtimes.cpu import isa

HERE = Path(__file__).resolve().parent
SPR = frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "amx_tile", "amx_bf16"})


# ---- selection, from flags and settings (no subprocess) ------------------------------------------------------
@pytest.fixture
def cpu(monkeypatch):
    """Pretend the CPU reports the given flags, with no ISA setting in the environment."""
    for name in (isa.ENV, "LUMINAL_RECIPES_AMX", "LUMINAL_RECIPES_JIT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(isa, "_numba_installed", lambda: True)

    def set_flags(flags):
        monkeypatch.setattr(isa, "cpu_flags", lambda: frozenset(flags))

    return set_flags


@pytest.mark.parametrize(("flags", "want"), [
    (SPR, "amx"), (SPR - {"amx_tile"}, "avx512"), (SPR - {"avx512bw", "amx_tile", "amx_bf16"}, "avx2"),
    ({"avx2", "fma"}, "avx2"), ({"avx2"}, "native"), (set(), "native"),
])
def test_the_path_follows_the_cpu_flags(cpu, flags, want):
    cpu(flags)
    assert isa.detected() == want == isa.check() == isa.selected()


def test_settings_force_a_path_at_or_below_the_cpus(cpu, monkeypatch):
    cpu(SPR)
    for value in isa.FORCIBLE:
        monkeypatch.setenv(isa.ENV, value)
        assert isa.check() == value
        assert (isa.why_not("amx") is None) == (value == "amx")
    monkeypatch.delenv(isa.ENV)
    monkeypatch.setenv("LUMINAL_RECIPES_AMX", "0")  # the older switch: the CPU's path without AMX
    assert isa.check() == "avx512" and isa.why_not("amx") == "LUMINAL_RECIPES_AMX=0"
    monkeypatch.setenv("LUMINAL_RECIPES_JIT", "0")
    assert isa.check() == "numpy"
    cpu({"avx2", "fma"})
    monkeypatch.delenv("LUMINAL_RECIPES_JIT")
    assert isa.check() == "avx2"  # AMX off on a CPU without it: nothing to take away


def test_a_path_above_the_cpus_or_unknown_is_refused_with_the_fix(cpu, monkeypatch):
    cpu({"avx2", "fma"})
    monkeypatch.setenv(isa.ENV, "avx512")
    with pytest.raises(isa.IsaError, match=r"LUMINAL_RECIPES_ISA=avx512: this CPU reports the 'avx2' path at most "
                                           r"\(/proc/cpuinfo lacks avx512bw, avx512dq, avx512f, avx512vl\).*"
                                           r"LUMINAL_RECIPES_ISA=avx2 or a path below it \(numpy, avx2\)"):
        isa.check()
    assert isa.selected() == "avx2"  # what modules see while importing; the runtime raises (check)
    monkeypatch.setenv(isa.ENV, "sse9")
    with pytest.raises(isa.IsaError, match="not a CPU path; use one of numpy, avx2, avx512, amx"):
        isa.check()


def test_without_numba_only_numpy_runs(cpu, monkeypatch):
    cpu(SPR)
    monkeypatch.setattr(isa, "_numba_installed", lambda: False)
    assert isa.check() == "numpy" and isa.why_not("avx2").startswith("numba is not installed")


def test_forced_avx2_points_numba_at_haswell_only_above_avx2(cpu, monkeypatch):
    cpu(SPR)
    assert isa.numba_target() is None
    monkeypatch.setenv(isa.ENV, "avx2")
    name, features = isa.numba_target()
    assert name == "haswell" and "+avx2" in features and "avx512" not in features
    cpu({"avx2", "fma"})
    assert isa.numba_target() is None  # the CPU's own target is AVX2 already


# ---- the conformance programs on every path this CPU runs ----------------------------------------------------
SEED = 0


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """Every conformance case (seed 0) compiled once, its reference output, and the file the children read."""
    from luminal_recipes.runtimes.cpu.backend import NumpyRuntime

    runtime = NumpyRuntime()
    cases, arrays = [], {}
    for i, kernel in enumerate(sorted(CASES)):
        case = CASES[kernel](Case(np.random.default_rng([SEED, sum(map(ord, kernel))])))
        program = program_with(kernel, case, runtime)
        want = run_reference(case.g, case.inputs, case.weights, case.dims)["out"]
        got = runtime.run(program, case.inputs, case.weights, case.dims)["out"]
        node = case.g.nodes[case.g.outputs["out"][0]]
        cases.append((kernel, node.dtype, want, got))
        arrays[f"program_{i}"] = json.dumps(program.to_json())
        arrays[f"dims_{i}"] = json.dumps(case.dims)
        arrays.update({f"input_{i}_{k}": v for k, v in case.inputs.items()})
        arrays.update({f"weight_{i}_{k}": v for k, v in case.weights.items()})
    path = tmp_path_factory.mktemp("isa") / "cases.npz"
    np.savez(path, count=len(cases), **pack(arrays))
    return path, cases


def _forced_paths() -> list[str]:
    cpu = isa.detected()
    return [p for p in isa.FORCIBLE if isa.LEVELS.index(p) < isa.LEVELS.index(cpu)]


def _env(path: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("LUMINAL_RECIPES_AMX", "LUMINAL_RECIPES_JIT", "NUMBA_CPU_NAME", "NUMBA_CPU_FEATURES")}
    env[isa.ENV] = path
    if path == "avx2":
        env["OPENBLAS_CORETYPE"] = "Haswell"  # numpy's OpenBLAS as on an AVX2-only CPU (read when it loads)
    return env


@pytest.mark.skipif(not _forced_paths(), reason=f"the CPU reports the '{isa.detected()}' path: none below to force")
@pytest.mark.parametrize("path", _forced_paths() or ["none"])
def test_a_forced_path_runs_the_conformance_programs_within_tolerance(path, compiled, assert_close, tmp_path):
    cases_file, cases = compiled
    out_file = tmp_path / "out.npz"
    done = subprocess.run([sys.executable, str(HERE / "isa_child.py"), str(cases_file), str(out_file)],
                          env=_env(path), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    result = unpack(np.load(out_file))
    taken = json.loads(str(result["path"]))
    # the path was taken, as numba and OpenBLAS report it
    assert taken["selected"] == path
    assert taken["jit"] == (path != "numpy") and taken["amx"] == (path == "amx")
    if path == "avx2":
        assert taken["numba"] == {"cpu": "haswell", "avx512": False}
        if taken["blas"] is not None:
            assert taken["blas"].lower() == "haswell"
    same = 0
    for i, (kernel, dtype, want, own) in enumerate(cases):
        got = result[f"out_{i}"]
        assert got.dtype == want.dtype and got.shape == want.shape, kernel
        if dtype.is_float:
            # GGUF products round x to 15-bit integers on the compiled paths, not on numpy's (as test_conformance)
            family = "xint15" if kernel == "DequantMatMulGGUF" else "runtime"
            assert_close(family, got, want, str(dtype) if dtype.bits >= 16 else "f32")  # the reference's
            assert_close(family, got, own, str(dtype) if dtype.bits >= 16 else "f32")  # the CPU's own path's
        else:
            assert np.array_equal(got, want), kernel
        same += bool(np.array_equal(got, own, equal_nan=dtype.is_float))
    print(f"{path} ({taken}): {same}/{len(cases)} outputs bit-identical to the CPU's own path ({isa.detected()})")
