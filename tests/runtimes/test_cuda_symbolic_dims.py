"""cuda-emu with symbolic dims: the generated kernels read them from their arguments, so a program loaded for a
bucket is re-bound to every length below it without building a module, and gives the reference's values at each.

Every kernel family is read here through views whose shape, strides, offset or mask depend on the symbolic length
``s`` (transposed, sliced at a symbolic bound, zero-padded, broadcast; rows and row lengths that change), so the
functor structs, launch grids and cuBLAS descriptors all follow the length. Counts come from
``luminal_recipes.instrument``, never timings.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from luminal_recipes import instrument, ops
from luminal_recipes.compiler import SearchOptions, compile_graph
from luminal_recipes.graph import Graph, run_reference
from luminal_recipes.graph.core import reduce
from luminal_recipes.graph.symbolic import evaluate, to_dim
from luminal_recipes.runtimes.cuda import CudaEmuBackend, CudaOptions, CudaRuntime, symdims

pytestmark = pytest.mark.skipif(not __import__("shutil").which("g++"), reason="cuda-emu needs g++")

BUCKET = 16
LENGTHS = (16, 9, 1, 13)  # loaded at the bucket, then re-bound below it (1: a dim that is 1 stays an argument)


@pytest.fixture(scope="module")
def emu() -> CudaRuntime:
    return CudaRuntime(CudaEmuBackend())


@pytest.fixture(scope="module")
def emu_flash() -> CudaRuntime:
    return CudaRuntime(CudaEmuBackend(CudaOptions(max_blocks=64, attention="flash")))


class Sym:
    """A graph with symbolic inputs and weights; their values drawn per length."""

    def __init__(self, seed: int):
        self.g = Graph()
        self.rng = np.random.default_rng(seed)
        self.shapes: dict[str, tuple] = {}
        self.dtypes: dict[str, str] = {}
        self.weight_names: set[str] = set()
        self.ints: dict[str, tuple[int, int]] = {}

    def input(self, name, shape, dtype="f32", weight=False, ints=None):
        self.shapes[name], self.dtypes[name] = tuple(to_dim(d) for d in shape), dtype
        if weight:
            self.weight_names.add(name)
        if ints:
            self.ints[name] = ints
        return (self.g.weight if weight else self.g.input)(name, shape, dtype)

    def values(self, dims):
        inputs, weights = {}, {}
        for name, shape in self.shapes.items():
            shp = tuple(evaluate(d, dims) for d in shape)
            dt = self.dtypes[name]
            if name in self.ints:
                v = self.rng.integers(*self.ints[name], shp).astype(np.int32)
            elif dt == "f8e4m3":
                v = np.abs(self.rng.standard_normal(shp)).astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
            else:
                v = self.rng.standard_normal(shp).astype(np.float32).astype(
                    {"f32": np.float32, "bf16": ml_dtypes.bfloat16, "f16": np.float16}[dt])
            (weights if name in self.weight_names else inputs)[name] = v
        return inputs, weights


def _elementwise(c: Sym):
    x = c.input("x", (6, "s")).transpose(0, 1)  # [s, 6], strides (1, s)
    y = c.input("y", ("s", 4), "bf16").pad(1, 1, 1)  # masked columns
    z = c.input("z", ("s + 3", 6)).slice(0, 2, "s + 2")  # offset rows
    return ops.gelu(ops.tanh(x) * y.cast("f32") + ops.sigmoid(z))


def _softmax(c: Sym):
    x = c.input("x", (2, "s", "s + 1")).slice(2, 1, "s + 1").transpose(1, 2)  # rows and row length both s
    return ops.softmax(x, -1)


def _layer_norm(c: Sym):
    x = c.input("x", (3, "s", 17), "bf16")
    w, b = c.input("w", ("s", 17), "bf16"), c.input("b", ("s + 3", 17), "bf16").slice(0, 3, "s + 3")
    return ops.modulate(ops.layer_norm(x, eps=1e-5), w.broadcast_to(x.shape), b.broadcast_to(x.shape))


def _rms_norm(c: Sym):
    x = c.input("x", (2, "s", 17)).transpose(0, 1)
    return ops.rms_norm(x, c.input("w", (17,), weight=True), eps=1e-6)


def _rms_norm_rope(c: Sym):
    x = c.input("x", (2, 3, "s", 8))
    w = c.input("w", (8,), weight=True)
    cos, sin = c.input("cos", ("s", 8)), c.input("sin", ("s + 2", 8)).slice(0, 2, "s + 2")
    return ops.apply_rope(ops.rms_norm(x, w, eps=1e-6), cos, sin, "pairs")


def _reduce(c: Sym):
    x = c.input("x", (3, 5, "s")).transpose(1, 2)  # [3, s, 5]
    return {"sum_s": reduce("SumReduce", x, 1), "max_s": reduce("MaxReduce", x, 1),
            "sum_last": reduce("SumReduce", x, 2), "max_first": reduce("MaxReduce", x, 0)}


def _gather(c: Sym):
    ids = c.input("ids", ("s",), "i32", ints=(0, 7))
    return ops.embedding(ids, c.input("table", (7, 6), weight=True))


def _matmul(c: Sym):
    a = c.input("a", (2, "s", 9))
    w = c.input("w", (9, 6), weight=True)
    bias = c.input("bias", (6,), weight=True)
    b = c.input("b", (2, "s", 9)).transpose(1, 2)  # [2, 9, s]
    return {"linear": ops.matmul(a, w.unsqueeze(0).broadcast_to((2, 9, 6))) + bias.broadcast_to((2, "s", 6)),
            "batched": ops.matmul(a, b)}


def _attention(c: Sym):
    q = c.input("q", (1, 2, "s", 8))
    k = c.input("k", (1, 2, "s + 2", 8)).slice(2, 2, "s + 2")
    v = c.input("v", (1, 2, "s", 8))
    return ops.scaled_dot_product_attention(q, k, v, causal=True)


def _flash(c: Sym):
    q = c.input("q", (1, 2, "s", 64), "bf16")
    k = c.input("k", (1, 2, "s", 64), "bf16")
    v = c.input("v", (1, 2, "s", 64), "bf16")
    return ops.scaled_dot_product_attention(q, k, v, causal=True)


def _dequant(c: Sym):
    x = c.input("x", ("s", 32))
    w = c.input("w", (8, 32), "f8e4m3", weight=True)
    s = c.input("s_w", (8,), weight=True)
    return ops.linear(x, ops.dequant_fp8(w, s))


def _group_norm(c: Sym):
    x = c.input("x", (2, 6, "s", 4))
    w, b = c.input("w", (6,), weight=True), c.input("b", (6,), weight=True)
    return ops.silu(ops.group_norm(x, 3, w, b, eps=1e-6))


def _copy_concat(c: Sym):
    a = c.input("a", (5, "s")).transpose(0, 1)
    b = c.input("b", (3, 5))
    return ops.concat([a.contiguous(), b], 0)


CASES = {"Elementwise": _elementwise, "Softmax": _softmax, "LayerNorm": _layer_norm, "RMSNorm": _rms_norm,
         "RMSNormRoPE": _rms_norm_rope, "SumReduce": _reduce, "Gather": _gather, "MatMul": _matmul,
         "Attention": _attention, "DequantMatMul": _dequant, "GroupNorm": _group_norm, "Concat": _copy_concat}


def _run(runtime, build, kernel: str, assert_close):
    c = Sym(sum(map(ord, kernel)))
    out = build(c)
    for name, t in (out if isinstance(out, dict) else {"out": out}).items():
        c.g.mark_output(name, t)
    program = compile_graph(c.g, runtime, {"s": BUCKET}, options=SearchOptions(use_cache=False, time_top=0)).program
    weights = c.values({"s": BUCKET})[1]  # bound once: their shapes do not depend on s
    before = instrument.snapshot()
    exe = runtime.load(program, weights, dims={"s": BUCKET})
    loaded = instrument.snapshot()
    for s in LENGTHS:
        inputs = c.values({"s": s})[0]
        got = exe.run(inputs, dims={"s": s})
        want = run_reference(c.g, inputs, weights, {"s": s})
        for name in want:
            assert got[name].shape == want[name].shape and got[name].dtype == want[name].dtype, (kernel, name, s)
            dtype = str(c.g.nodes[c.g.outputs[name][0]].dtype)
            assert_close("runtime", got[name], want[name], dtype if dtype in ("bf16", "f16") else "f32")
    rebinding = instrument.snapshot() - loaded
    assert (loaded - before)[instrument.CUDA_MODULE] <= 1, kernel
    assert rebinding[instrument.CUDA_MODULE] == 0 and rebinding[instrument.CUDA_COMPILE] == 0, kernel
    exe.close()
    return program


@pytest.mark.parametrize("kernel", sorted(CASES))
def test_rebinding_builds_no_module_and_matches_the_reference(kernel, emu, assert_close):
    program = _run(emu, CASES[kernel], kernel, assert_close)
    assert kernel in program.kernel_counts(), (kernel, program.kernel_counts())


def test_flash_attention_rebinds(emu_flash, assert_close):
    program = _run(emu_flash, _flash, "Attention", assert_close)
    assert "Attention" in program.kernel_counts() or "AttentionBlocked" in program.kernel_counts()


def test_symint_prints_its_expression_and_computes_as_its_value():
    s = symdims.kernel_dims({"s": 7, "p": 3})
    n, p = s["s"], s["p"]
    x = (n * 4 + p) // 2 - 1
    assert x == (7 * 4 + 3) // 2 - 1 and isinstance(x, symdims.SymInt)
    assert symdims.plain(f"{x}") == "(((((LRDIM__s * 4) + LRDIM__p) / 2) - 1))"
    assert str(x) == repr(x) == "14" and f"{x:d}" == "14" and int(x) == 14 and type(int(x)) is int
    assert n * 1 is n and n + 0 is n and (n * 0) == 0 and type(n * 0) is int
    assert type(-n // 2) is int  # a floor division C would round differently is baked as its value
    assert values_of(x) == {"s": 7, "p": 3}
    assert symdims.same(n * 4, n * 4) and not symdims.same(n * 4, 28) and symdims.same(3, 3)


def values_of(x):
    return symdims.values_in(x)


def test_lower_adds_dim_arguments_and_struct_members():
    """A symbolic dim read inside a functor struct becomes its member, filled wherever the struct is constructed
    (also inside another struct); the kernel takes every dim it uses, once, after its own parameters."""
    n = symdims.kernel_dims({"n": 5})["n"]
    text = f"""struct LoadX {{
  const float* __restrict__ p;
  LR_DEV float operator()(long long i) const {{ return p[i % {n}]; }}
}};
struct Pair {{
  LoadX a; LoadX b;
  LR_DEV float operator()(long long i) const {{ return a(i) + b(i); }}
}};
extern "C" __global__ void __launch_bounds__(256) kern(float* __restrict__ out, const float* __restrict__ x) {{
  for (long long i = threadIdx.x; i < {n * 3}LL; i += blockDim.x) out[i] = Pair{{LoadX{{x}}, LoadX{{x + {n}}}}}(i);
}}"""
    code, tokens = symdims.lower(text, "kern")
    assert tokens == ["LRDIM__n"]
    assert "long long LRDIM__n;" in code.split("struct Pair")[0]  # LoadX's member
    assert "long long LRDIM__n;" not in code.split("struct Pair")[1].split("extern")[0]  # Pair reads none itself
    assert "kern(float* __restrict__ out, const float* __restrict__ x, long long LRDIM__n)" in code
    assert "Pair{LoadX{x, LRDIM__n}, LoadX{x + (LRDIM__n), LRDIM__n}}(i)" in code
    assert "i < ((long long)((LRDIM__n * 3)))" in code
    assert symdims.OPEN not in code and symdims.CLOSE not in code
