"""The CUDA runtimes in the registry and in the generic executable: ``cuda`` and ``cuda-emu`` by name, the paragraph
``--runtime cuda`` prints when CuPy or a GPU is missing, device-resident benchmark runs (``execute``), device
memory given back when a stage ends, and FP4 codes converted as ml_dtypes does."""

from __future__ import annotations

import dataclasses
import re
import shutil
import sys

import ml_dtypes
import numpy as np
import pytest
from typer.testing import CliRunner

from luminal_recipes import ops
from luminal_recipes.cli import app
from luminal_recipes.errors import InputError, LuminalError
from luminal_recipes.graph import Graph, cast
from luminal_recipes.runtimes.cuda import CudaEmuBackend, CudaRuntime
from luminal_recipes.runtimes.program import Program
from luminal_recipes.runtimes.registry import BUILTIN, get_runtime

pytestmark = pytest.mark.skipif(not shutil.which("g++"), reason="cuda-emu needs g++")


def test_registry_has_both_cuda_runtimes():
    assert {"cuda", "cuda-emu"} <= set(BUILTIN)
    emu = get_runtime("cuda-emu")
    assert emu.name == "cuda-emu" and not emu.timed  # the compiler ranks by cost, not by emulated times
    assert emu.capabilities() >= {"MatMul", "Attention", "DequantMatMul", "Conv2d", "ScatterInPlace"}


def _gpu_missing() -> bool:
    try:
        get_runtime("cuda")
    except LuminalError:
        return True
    return False


@pytest.mark.skipif(not _gpu_missing(), reason="a GPU is present")
def test_runtime_cuda_without_a_gpu_is_one_paragraph_and_exit_2():
    result = CliRunner().invoke(app, ["run", "recipes/flux2-tiny.yaml", "--runtime", "cuda", "-p", "x"])
    assert result.exit_code == 2
    message = result.output.strip()
    assert message.startswith("error: runtime 'cuda' cannot start on this machine") and "\n" not in message
    assert "GPU" in message and "Traceback" not in result.output


def test_runtime_cuda_without_cupy_says_how_to_install(monkeypatch):
    from luminal_recipes.runtimes import registry
    from luminal_recipes.runtimes.cuda.backend import CudaUnavailableError

    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy raises ImportError
    monkeypatch.setattr(registry, "_INSTANCES", {})
    with pytest.raises(CudaUnavailableError, match=r"needs CuPy.*pip install -e \"\.\[cuda13\]\""):
        get_runtime("cuda")
    result = CliRunner().invoke(app, ["run", "recipes/flux2-tiny.yaml", "--runtime", "cuda", "-p", "x"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    message = result.output.strip()
    assert message.startswith("error: runtime 'cuda' cannot start on this machine: the cuda runtime needs CuPy")
    assert "\n" not in message and 'pip install -e ".[cuda13]"' in message and "--runtime numpy" in message


def test_a_kernel_that_fails_to_compile_names_itself_and_its_node(monkeypatch):
    """g++ (cuda-emu; NVRTC's case is in test_cuda_nvrtc) rejecting a generated kernel: the error names the kernel
    and the program node it was generated for, as a LuminalError (exit 2 on the command line, no traceback)."""
    from luminal_recipes.runtimes.cuda import backend as backend_module
    from luminal_recipes.runtimes.cuda.emu import EmuCompileError

    real_prepare = backend_module.prepare

    def broken(ctx, options):
        plan = real_prepare(ctx, options)
        plan.sources[:] = [dataclasses.replace(s, code=s.code.replace("out[i] =", "out[i] = undefined_symbol +"))
                           for s in plan.sources]
        return plan

    monkeypatch.setattr(backend_module, "prepare", broken)
    g = Graph()
    x = g.input("x", (16,))
    g.mark_output("y", ops.exp(x) + 1.0)
    program = Program.from_graph(g)
    with pytest.raises(EmuCompileError) as err:
        CudaRuntime(CudaEmuBackend()).load(program)
    message = str(err.value)
    assert "g++ failed to compile the kernel module (kernel " in message and "undefined_symbol" in message
    nodes = [f"{n.op} #{n.id}" for n in program.nodes if n.op not in ("Input", "Constant", "Iota")]
    named = re.search(r"\(kernel (\w+) of ([^)]+)\)", message)
    assert named and named.group(2).split(", ")[0] in nodes, message
    assert isinstance(err.value, LuminalError)


def test_execute_runs_on_staged_inputs_without_transfers():
    g = Graph()
    x, w = g.input("x", (3, 8)), g.weight("w", (8, 8))
    g.mark_output("y", ops.matmul(x * 2.0, w))
    program = Program.from_graph(g)
    rng = np.random.default_rng(0)
    weights = {"w": rng.standard_normal((8, 8)).astype(np.float32)}
    inputs = {"x": rng.standard_normal((3, 8)).astype(np.float32)}
    exe = get_runtime("cuda-emu").load(program, weights)
    want = exe.run(inputs)["y"]
    with pytest.raises(InputError, match="no inputs are staged"):
        exe.execute()
    exe.execute(inputs)
    for _ in range(2):  # the staged values are copied device-side into their slots every time
        exe.execute()
        assert exe.stats.bytes_device == inputs["x"].nbytes
    slot, _ = exe._outputs["y"]  # what the last execute left in the output's slot (nothing is downloaded)
    assert np.array_equal(exe.backend.download(slot).reshape(want.shape), want)


def test_closing_gives_the_device_memory_back():
    runtime = CudaRuntime(CudaEmuBackend())
    g = Graph()
    x, w = g.input("x", (64, 64)), g.weight("w", (64, 64))
    g.mark_output("y", x * w + 1.0)
    before = runtime.backend.memory_held()
    exe = runtime.load(Program.from_graph(g), {"w": np.ones((64, 64), np.float32)})
    exe.run({"x": np.ones((64, 64), np.float32)})
    held = runtime.backend.memory_held() - before
    assert held >= exe.memory.arena_bytes + 64 * 64 * 4  # the arena and the uploaded weight
    exe.close()
    released = runtime.release_memory()
    assert released["held_before_release_bytes"] - before == 0  # nothing the executable held is kept
    with pytest.raises(LuminalError, match="closed"):
        exe.run({"x": np.ones((64, 64), np.float32)})


def test_fp4_codes_convert_as_ml_dtypes():
    """f4e2m1 (one code per byte, as ml_dtypes holds it) to and from f32: every code, ties to even,
    saturation at 6, NaN to -0."""
    f4 = ml_dtypes.float4_e2m1fn
    probes = np.array([0, 0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5, 5.1, 6, 7, 100, np.inf, -np.inf, np.nan, -0.0,
                       -0.25, -1.3, 1e-30, 0.5, 3, 4.5], np.float32)
    codes = np.arange(16, dtype=np.uint8).view(f4)
    g = Graph()
    x, c = g.input("x", probes.shape), g.input("c", (16,), "f4e2m1")
    g.mark_output("to", cast(x, "f4e2m1"))
    g.mark_output("back", cast(c, "f32"))
    got = get_runtime("cuda-emu").run(Program.from_graph(g), {"x": probes, "c": codes})
    assert np.array_equal(got["to"].view(np.uint8), probes.astype(f4).view(np.uint8))
    assert np.array_equal(got["back"], codes.astype(np.float32))
