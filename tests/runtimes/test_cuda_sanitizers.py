"""cuda-emu under AddressSanitizer: the generated kernels of a subset of every kernel family run with ASan
(g++ -fsanitize=address, libasan preloaded into a child Python), so a read or write outside a buffer aborts the
run with a report. Inputs are weights (each its own allocation, red zones around it) and the arena is sized
exactly, so out-of-bounds accesses past any operand are caught. A deliberately out-of-bounds kernel proves the
set-up catches them.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not shutil.which("g++"), reason="cuda-emu needs g++")

HERE = Path(__file__).resolve().parent


def _asan_env():
    import os

    from luminal_recipes.runtimes.cuda.emu import asan_env

    env = asan_env()
    if not Path(env["LD_PRELOAD"]).is_file():
        pytest.skip("g++ has no libasan.so")
    return {**os.environ, **env}


def _run(script: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                          env=_asan_env(), cwd=HERE, timeout=600)


KERNELS = """
import ml_dtypes, numpy as np
from fused_programs import Fused
from luminal_recipes import ops
from luminal_recipes.graph import Graph, run_reference
from luminal_recipes.runtimes.cuda import CudaEmuBackend, CudaOptions, CudaRuntime

rng = np.random.default_rng(0)
g = Graph()
x = g.weight("x", (5, 33))
big = g.weight("big", (3, 1100))
img = g.weight("img", (1, 3, 6, 7))
cw = g.weight("cw", (4, 3, 3, 3))
table = g.weight("table", (9, 5), "bf16")
ids = g.weight("ids", (4,), "i32")
q, k, v = (g.weight(n, (1, 2, 20, 64)) for n in "qkv")
bias = g.weight("bias", (1, 1, 20, 20))
wq, ws, ws2 = g.weight("wq", (48, 16), "u8"), g.weight("ws", (128, 4), "f8e4m3"), g.weight("ws2", ())
xin = g.weight("xin", (3, 32))
x8, w8, s8 = g.weight("x8", (3, 32), "bf16"), g.weight("w8", (16, 32), "f8e4m3"), g.weight("s8", ())
f = Fused(g)
xp = x.pad(1, 2, 3)  # [5, 38], masked columns never read
outs = {
    "ew": f.add("Elementwise", [xp, xp], (5, 38), expr="(Add (Mul in0 in1) (Const 1.0))"),
    "softmax": f.add("Softmax", [x], (5, 33)), "layernorm": f.add("LayerNorm", [big], (3, 1100), eps=1e-5),
    "rms": f.add("RMSNorm", [big.T.T], (3, 1100), eps=1e-6),
    "sum": f.add("SumReduce", [xp.T], (38,), axis=1), "max": f.add("MaxReduce", [big], (3,), axis=1),
    "gather": f.add("Gather", [table, ids], (4, 5), "bf16"),
    "conv": f.add("Conv2d", [img.pad(2, 1, 1).pad(3, 1, 1), cw], (1, 4, 6, 7), stride=1),
    "conv_s2": f.add("Conv2d", [img, cw], (1, 4, 2, 3), stride=2),
    "mm": f.add("MatMul", [x.T, x], (33, 33)),
    "nvfp4": f.add("DequantMatMul", [xin, wq, ws, ws2], (3, 40), format="nvfp4", layout="comfy",
                   out_features=40, in_features=32),
    # chunked run: through cuBLASLt's FP8 path (the e4m3 activation quantizers), flash run: weights decoded
    "fp8": f.add("DequantMatMul", [x8, w8, s8], (3, 16), "bf16", format="fp8", layout="", out_features=16,
                 in_features=32),
}
for mode in ("flash", "chunked"):
    outs["attn_" + mode] = f.add("Attention", [q, k, v, bias.broadcast_to((1, 2, 20, 20))], (1, 2, 20, 64),
                                 scale=0.125)
weights = {"x": rng.standard_normal((5, 33), np.float32), "big": rng.standard_normal((3, 1100), np.float32),
           "img": rng.standard_normal((1, 3, 6, 7), np.float32), "cw": rng.standard_normal((4, 3, 3, 3), np.float32),
           "table": rng.standard_normal((9, 5), np.float32).astype(ml_dtypes.bfloat16),
           "ids": np.array([8, 0, 3, 3], np.int32), "bias": rng.standard_normal((1, 1, 20, 20), np.float32),
           "wq": rng.integers(0, 256, (48, 16)).astype(np.uint8),
           "ws": (rng.random((128, 4)) + 0.5).astype(ml_dtypes.float8_e4m3fn), "ws2": np.asarray(0.5, np.float32),
           "xin": rng.standard_normal((3, 32), np.float32),
           "x8": rng.standard_normal((3, 32), np.float32).astype(ml_dtypes.bfloat16),
           "w8": rng.standard_normal((16, 32), np.float32).astype(ml_dtypes.float8_e4m3fn),
           "s8": np.asarray(0.25, np.float32)}
for n in "qkv":
    weights[n] = rng.standard_normal((1, 2, 20, 64), np.float32)
program = f.program(**outs)
for mode in ("flash", "chunked"):
    fp8 = "cublaslt" if mode == "chunked" else "dequant"
    rt = CudaRuntime(CudaEmuBackend(CudaOptions(max_blocks=8, attention=mode, conv_cols=40, fp8_gemm=fp8),
                                    sanitize="address"))
    got = rt.run(program, {}, weights)
    assert all(np.isfinite(np.asarray(a, np.float32)).all() for a in got.values())
print("clean")
"""


def test_kernels_run_clean_under_address_sanitizer():
    proc = _run(KERNELS)
    assert proc.returncode == 0 and "clean" in proc.stdout, proc.stderr[-4000:]


def test_address_sanitizer_catches_an_out_of_bounds_write():
    """The same machinery (a module built with -fsanitize=address, an exactly sized buffer) reports a kernel that
    writes one element past its output."""
    proc = _run("""
        import numpy as np
        from luminal_recipes.runtimes.cuda.emu import compile_emu
        from luminal_recipes.runtimes.cuda.module import module_source
        from luminal_recipes.runtimes.cuda.plan import KernelSource

        code = 'extern "C" __global__ void oob(float* out, int n) { int i = threadIdx.x; if (i <= n) out[i] = 1.0f; }'
        module = compile_emu(module_source([KernelSource("oob", ("float*", "int"), code, False)]), "address")
        buf = np.zeros(32, np.float32)
        module.launcher("oob", ("float*", "int"), (1, 1, 1), (64, 1, 1), [buf.ctypes.data, 32])()
        print("not caught")
    """)
    assert proc.returncode != 0 and "heap-buffer-overflow" in proc.stderr, (proc.stdout, proc.stderr[-2000:])
