"""The conformance suite: every kernel of the registry, on every registered runtime (the ``runtime`` fixture runs
this module once per runtime in ``runtimes.registry``), against the reference interpreter, with operands read
through seeded random views (transposed, offset slices, zero-padded masks, broadcast axes) in several dtypes.

Primitives run as naive programs (``Program.from_graph``); each fused kernel is produced by the compiler's own
rules from the op-library graph it replaces (the case fails if the rules no longer find it), so a case checks
the rule, the spec and the implementation together. A kernel added to the registry must add a case here
(``test_every_kernel_has_a_case``).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from luminal_recipes import ops
from luminal_recipes.compiler.search import SearchOptions, search_segment
from luminal_recipes.compiler.segments import assemble, split
from luminal_recipes.graph import DType, Graph, Tensor, gguf_blocks, run_reference
from luminal_recipes.graph.core import binary, dequant, reduce, unary
from luminal_recipes.graph.symbolic import evaluate
from luminal_recipes.runtimes.kernels import PRIMITIVE_KERNELS, REGISTRY
from luminal_recipes.runtimes.program import Program

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/gguf_data.py
import gguf_data  # noqa: E402

VIEWS = ("contiguous", "transposed", "sliced", "padded", "broadcast")
FLOATS = ("f32", "bf16", "f16")


class Case:
    """One graph (the oracle) and the values of its inputs and weights."""

    def __init__(self, rng: np.random.Generator):
        self.g = Graph()
        self.rng = rng
        self.inputs: dict[str, np.ndarray] = {}
        self.weights: dict[str, np.ndarray] = {}
        self.dims: dict[str, int] = {}

    def value(self, shape, dtype: str, low=-3, high=3) -> np.ndarray:
        dt = DType(dtype)
        if dt.is_float:
            return self.rng.standard_normal(shape).astype(np.float32).astype(dt.np)
        if dt == DType.BOOL:
            return self.rng.integers(0, 2, shape).astype(bool)
        return self.rng.integers(low, high, shape).astype(dt.np)

    def operand(self, name: str, shape: tuple[int, ...], dtype: str = "f32", view: str | None = None,
                weight: bool = False, **kw) -> Tensor:
        """An input (or weight) seen at ``shape`` through ``view`` (random when None)."""
        view = view or str(self.rng.choice(VIEWS))
        physical = list(shape)
        if view == "transposed" and len(shape) >= 2:
            physical[-1], physical[-2] = shape[-2], shape[-1]
        elif view == "sliced" and shape:
            physical[0] = shape[0] + 3
        elif view == "padded" and shape and shape[-1] > 2:
            physical[-1] = shape[-1] - 2
        elif view == "broadcast" and shape:
            physical[0] = 1
        else:
            view = "contiguous"
        source = (self.g.weight if weight else self.g.input)(name, tuple(physical), dtype)
        (self.weights if weight else self.inputs)[name] = self.value(tuple(physical), dtype, **kw)
        if view == "transposed":
            return source.transpose(-1, -2)
        if view == "sliced":
            return source.slice(0, 2, 2 + shape[0])
        if view == "padded":
            return source.pad(len(shape) - 1, 1, 1)
        if view == "broadcast":
            return source.broadcast_to(tuple(shape))
        return source

    def output(self, t: Tensor) -> Case:
        self.g.mark_output("out", t)
        return self


# ---- primitives: naive programs over random views and dtypes ----------------------------------------------
def _unary(op: str) -> Callable:
    def build(c: Case) -> Case:
        dtype = str(c.rng.choice(FLOATS))
        x = c.operand("x", (3, 5, 4), dtype)
        if op in ("Log2", "Sqrt"):  # keep the reference and the kernels in their real domain
            c.inputs["x"] = np.abs(c.inputs["x"].astype(np.float32)).astype(c.inputs["x"].dtype) + \
                c.inputs["x"].dtype.type(0.5)
        return c.output(unary(op, x))

    return build


def _binary(op: str) -> Callable:
    def build(c: Case) -> Case:
        dtype = str(c.rng.choice(FLOATS + ("i32",)))
        a = c.operand("a", (4, 6), dtype, low=1, high=9)
        b = c.operand("b", (4, 6), dtype, low=1, high=9)
        return c.output(binary(op, a, b))

    return build


def _reduce(op: str) -> Callable:
    def build(c: Case) -> Case:
        x = c.operand("x", (3, 7, 5), str(c.rng.choice(FLOATS)))
        axis = int(c.rng.integers(0, 3))
        return c.output(reduce(op, x, axis))

    return build


def _iota(c: Case) -> Case:
    c.dims = {"n": 9}
    return c.output(c.g.iota("n") * 2)


def _gather(c: Case) -> Case:
    ids = c.operand("ids", (2, 5), "i32", view="contiguous", low=0, high=7)
    table = c.operand("table", (7, 6), str(c.rng.choice(FLOATS)), weight=True)
    return c.output(ops.embedding(ids, table))


def _scatter(c: Case) -> Case:
    dtype = str(c.rng.choice(FLOATS))
    cache = c.operand("cache", (8, 4), dtype)
    pos = c.g.input("pos", (3,), "i32")
    c.inputs["pos"] = np.array([6, 1, 3], np.int32)
    rows = c.operand("rows", (3, 4), dtype)
    return c.output(ops.write_rows(cache, pos, rows))


def _cast(c: Case) -> Case:
    src = str(c.rng.choice(FLOATS + ("i32",)))
    dst = str(c.rng.choice(("f32", "bf16", "f16", "f8e4m3", "i32", "bool")))
    x = c.operand("x", (5, 6), src)
    return c.output(x.cast(dst))


# ---- fused kernels: the op-library graphs the rules rewrite ------------------------------------------------
def _matmul(c: Case) -> Case:
    dtype = str(c.rng.choice(("f32", "bf16")))
    a = c.operand("a", (2, 5, 9), dtype)
    b = c.operand("b", (9, 6), dtype, view=str(c.rng.choice(("contiguous", "transposed"))))
    bias = c.operand("bias", (6,), dtype, view="contiguous", weight=True)
    return c.output(ops.matmul(a, b.unsqueeze(0).broadcast_to((2, 9, 6))) + bias.broadcast_to((2, 5, 6)))


def _elementwise(c: Case) -> Case:
    dtype = str(c.rng.choice(FLOATS))
    x, y = c.operand("x", (4, 9), dtype), c.operand("y", (4, 9), dtype)
    return c.output(ops.gelu(ops.tanh(x) * y + ops.sigmoid(y)))


NORM_AFFINE = ("vector", "per row")  # a norm's scale (and shift): one vector for every row, or varying with them


def _row_kernel(kind: str) -> Callable:
    def build(c: Case) -> Case:
        dtype = str(c.rng.choice(("f32", "bf16")))
        x = c.operand("x", (3, 6, 17), dtype, view=str(c.rng.choice(("contiguous", "transposed", "sliced"))))
        if kind == "Softmax":
            return c.output(ops.softmax(x, -1))
        # the norm plain and affine (RMSNormScale, LayerNormAffine): the weight [N], or the modulation's scale and
        # shift, the same for every row or varying with them
        affine = NORM_AFFINE[int(c.rng.integers(0, 7)) % len(NORM_AFFINE)]  # the seeds draw both forms
        shape = (17,) if affine == "vector" else (3, 6, 17)
        w = c.operand("w", shape, dtype, view="contiguous", weight=True)
        if kind == "RMSNorm":
            plain = ops.rms_norm(x, None, eps=1e-6)
            scaled = ops.rms_norm(x, w, eps=1e-6) if affine == "vector" else plain * w
        else:
            plain = ops.layer_norm(x, eps=1e-5)
            b = c.operand("b", shape, dtype, view="sliced" if affine == "per row" else "contiguous")
            scaled = ops.modulate(plain, w.broadcast_to(x.shape), b.broadcast_to(x.shape))
        return c.output(ops.concat([plain, scaled], 0))

    return build


def _group_norm(c: Case) -> Case:
    # GroupNormAffine and GroupNormSiLU: two images (two samples, 6 channels in 3 groups), one normed, one normed
    # then SiLU, each with its own per-channel scale and shift
    dtype = str(c.rng.choice(("f32", "bf16")))
    outs = []
    for i, act in enumerate((None, ops.silu)):
        x = c.operand(f"x{i}", (2, 6, 3, 4), dtype, view=str(c.rng.choice(("contiguous", "transposed", "sliced"))))
        w = c.operand(f"w{i}", (6,), dtype, view="contiguous", weight=True)
        b = c.operand(f"b{i}", (6,), dtype, view="contiguous", weight=True)
        y = ops.group_norm(x, 3, w, b, eps=1e-6)
        outs.append(y if act is None else act(y))
    return c.output(ops.concat(outs, 0))


def _rms_norm_rope(c: Case) -> Case:
    # FLUX.2's q/k: the weighted RMSNorm, then the rotation of adjacent pairs by tables in the activations' dtype
    # (f32 on CPU) or wider (f32 tables, bf16 q/k: rotated in f32, rounded once)
    dtype = str(c.rng.choice(("f32", "bf16")))
    tables = str(c.rng.choice(("f32", dtype)))
    x = c.operand("x", (2, 3, 5, 8), dtype, view=str(c.rng.choice(("contiguous", "transposed", "sliced"))))
    w = c.operand("w", (8,), dtype, view="contiguous", weight=True)
    cos, sin = c.operand("cos", (5, 8), tables, view="contiguous"), c.operand("sin", (5, 8), tables, view="sliced")
    return c.output(ops.apply_rope(ops.rms_norm(x, w, eps=1e-6), cos, sin, "pairs"))


def _attention(c: Case) -> Case:
    dtype = str(c.rng.choice(("f32", "bf16")))
    q = c.operand("q", (1, 2, 7, 8), dtype, view="contiguous")
    k = c.operand("k", (1, 2, 11, 8), dtype, view=str(c.rng.choice(("contiguous", "sliced"))))
    v = c.operand("v", (1, 2, 11, 8), dtype, view="contiguous")
    causal = bool(c.rng.integers(0, 2))
    return c.output(ops.scaled_dot_product_attention(q, k, v, causal=causal))


def _conv2d(c: Case) -> Case:
    x = c.operand("x", (1, 3, 7, 6), "f32", view=str(c.rng.choice(("contiguous", "sliced"))))
    w = c.operand("w", (4, 3, 3, 3), "f32", view="contiguous", weight=True)
    bias = c.operand("b", (4,), "f32", view="contiguous", weight=True)
    return c.output(ops.conv2d(x, w, bias, stride=int(c.rng.integers(1, 3)), padding=1))


def _dequant(c: Case) -> Case:
    x = c.operand("x", (3, 32), "f32", view=str(c.rng.choice(("contiguous", "sliced"))))
    if c.rng.integers(0, 2):
        w = c.operand("w", (8, 32), "f8e4m3", view="contiguous", weight=True)
        s = c.operand("s", (8,), "f32", view="contiguous", weight=True)
        return c.output(ops.linear(x, ops.dequant_fp8(w, s)))
    w = c.operand("w", (8, 16), "u8", view="contiguous", weight=True, low=0, high=256)
    s = c.operand("s", (8, 2), "f8e4m3", view="contiguous", weight=True)
    s2 = c.operand("s2", (), "f32", view="contiguous", weight=True)
    c.weights["s"] = np.abs(c.weights["s"].astype(np.float32)).astype(ml_dtypes.float8_e4m3fn)
    return c.output(ops.linear(x, ops.dequant_nvfp4(w, s, s2, 8, 32, "modelopt")))


GGUF_TYPES = tuple(gguf_blocks.QTYPES)


def _gguf_weight(c: Case, name: str, qtype: str, rows: int, blocks: int, view: str) -> Tensor:
    """A packed GGUF weight (``tests/gguf_data.packed``: finite scales) read through ``view``."""
    raw = gguf_data.packed(c.rng, qtype, rows + (3 if view == "sliced" else 0), blocks)
    if view == "broadcast":
        raw = raw[:1]
    w = c.g.weight(name, raw.shape, "u8")
    c.weights[name] = raw
    if view == "sliced":
        return w.slice(0, 2, 2 + rows)
    return w.broadcast_to((rows, raw.shape[1])) if view == "broadcast" else w


def _gguf_dequant(c: Case) -> Case:
    qtype = str(c.rng.choice(GGUF_TYPES))
    w = _gguf_weight(c, "w", qtype, 5, 2, str(c.rng.choice(("contiguous", "sliced", "broadcast"))))
    return c.output(dequant(w, qtype, str(c.rng.choice(FLOATS))))


def _gguf_gather(c: Case) -> Case:
    qtype = str(c.rng.choice(GGUF_TYPES))
    ids = c.operand("ids", (2, 5), "i32", view="contiguous", low=0, high=7)
    table = _gguf_weight(c, "table", qtype, 7, 1, str(c.rng.choice(("contiguous", "sliced"))))
    return c.output(ops.embedding(ids, dequant(table, qtype, str(c.rng.choice(FLOATS)))))


def _gguf_matmul(c: Case) -> Case:
    """x @ dequant(W).T for several types at once (a sum of products), x with one row (decoding) or many."""
    rows = int(c.rng.choice((1, 3, 40)))
    k = 512
    x = c.operand("x", (rows, k), "f32", view=str(c.rng.choice(("contiguous", "transposed", "sliced"))))
    out = None
    for i, qtype in enumerate(c.rng.choice(GGUF_TYPES, 4, replace=False)):
        qtype = str(qtype)
        blocks = k // (32 if gguf_blocks.block_size(qtype) == 1 else gguf_blocks.block_size(qtype))
        y = ops.linear(x, dequant(_gguf_weight(c, f"w{i}", qtype, 6, blocks, "contiguous"), qtype))
        out = y if out is None else out + y
    return c.output(out * (1.0 / 16))


def _scatter_in_place(c: Case) -> Case:
    cache = c.operand("cache", (9, 4), "f32", view="contiguous")
    pos = c.g.input("pos", (2,), "i32")
    c.inputs["pos"] = np.array([8, 2], np.int32)
    rows = c.operand("rows", (2, 4), "f32")
    return c.output(ops.write_rows(cache * 2.0, pos, rows))


def _concat(c: Case) -> Case:
    dtype = str(c.rng.choice(FLOATS))
    axis = int(c.rng.integers(0, 2))
    a = c.operand("a", (4, 5), dtype)
    b = c.operand("b", (4, 5) if axis else (3, 5), dtype)
    return c.output(ops.concat([a, b], axis))


def _copy(c: Case) -> Case:
    x = c.operand("x", (5, 6), str(c.rng.choice(FLOATS)), view=str(c.rng.choice(("transposed", "padded"))))
    return c.output(x.contiguous())


CASES: dict[str, Callable[[Case], Case]] = {
    **{op: _unary(op) for op in ("Log2", "Exp2", "Sin", "Sqrt", "Recip")},
    **{op: _binary(op) for op in ("Add", "Mul", "Mod", "LessThan")},
    "SumReduce": _reduce("SumReduce"), "MaxReduce": _reduce("MaxReduce"),
    "Iota": _iota, "Gather": _gather, "Scatter": _scatter, "Cast": _cast,
    "MatMul": _matmul, "Elementwise": _elementwise,
    "Softmax": _row_kernel("Softmax"), "LayerNorm": _row_kernel("LayerNorm"), "RMSNorm": _row_kernel("RMSNorm"),
    "GroupNorm": _group_norm, "RMSNormRoPE": _rms_norm_rope, "Attention": _attention,
    "AttentionBlocked": _attention, "Conv2d": _conv2d, "DequantMatMul": _dequant,
    "ScatterInPlace": _scatter_in_place, "Concat": _concat, "Copy": _copy,
    "Dequant": _gguf_dequant, "GatherDequant": _gguf_gather, "DequantMatMulGGUF": _gguf_matmul,
}
RIVALS = {"Attention": {"AttentionBlocked"}, "AttentionBlocked": {"Attention"}}
SEEDS = (0, 1, 2)


def test_every_kernel_has_a_case():
    assert set(REGISTRY) - {"Input", "Constant"} <= set(CASES)  # sources are in every case's graph


def program_with(kernel: str, case: Case, runtime) -> Program:
    """The naive program for a primitive; for a fused kernel, the cheapest program the rules give with the
    kernel allowed and its rivals not."""
    if kernel in PRIMITIVE_KERNELS:
        return Program.from_graph(case.g)
    rivals = RIVALS.get(kernel, set())
    allowed = runtime.capabilities() - rivals
    segments = split(case.g)
    found = {s.key: search_segment(s, allowed.__contains__, case.dims, SearchOptions())[0] for s in segments}
    program = assemble(case.g, segments, [found[s.key][0] for s in segments])
    assert kernel in program.kernel_counts(), f"the rules no longer produce {kernel}: {program.kernel_counts()}"
    return program


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("kernel", sorted(CASES))
def test_kernel_matches_the_reference(kernel, seed, runtime, assert_close):
    case = CASES[kernel](Case(np.random.default_rng([seed, sum(map(ord, kernel))])))
    program = program_with(kernel, case, runtime)
    want = run_reference(case.g, case.inputs, case.weights, case.dims)["out"]
    got = runtime.run(program, case.inputs, case.weights, case.dims)["out"]
    node = case.g.nodes[case.g.outputs["out"][0]]
    assert got.dtype == want.dtype and got.shape == want.shape == tuple(
        evaluate(d, case.dims) for d in case.g.outputs["out"][1].shape)
    if node.dtype.is_float:
        family = "xint15" if kernel == "DequantMatMulGGUF" else "runtime"  # x rounded to 15-bit integers per block
        assert_close(family, got, want, str(node.dtype) if node.dtype.bits >= 16 else "f32")
    else:
        assert np.array_equal(got, want), kernel


COMPILED = ("Elementwise", "Softmax", "LayerNorm", "RMSNorm", "GroupNorm", "RMSNormRoPE", "Attention",
            "AttentionBlocked", "DequantMatMul", "Dequant", "GatherDequant", "DequantMatMulGGUF")


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("kernel", COMPILED)
def test_numpy_passes_without_numba_match_the_reference(kernel, seed, numpy_runtime, assert_close, monkeypatch):
    """The kernels numba compiles when installed (runtimes/cpu/jit/numba_kernels.py) keep numpy passes without it
    (or with LUMINAL_RECIPES_JIT=0): those too give the reference's values."""
    from luminal_recipes.runtimes.cpu import jit

    monkeypatch.setattr(jit, "AVAILABLE", False)
    test_kernel_matches_the_reference(kernel, seed, numpy_runtime, assert_close)


def test_norm_cases_draw_every_affine_form():
    """The seeds give the norm kernels with a scale (and shift) vector for every row, and varying per row (each
    case also has the plain norm)."""
    for kernel in ("LayerNorm", "RMSNorm"):
        forms = set()
        for seed in SEEDS:
            case = CASES[kernel](Case(np.random.default_rng([seed, sum(map(ord, kernel))])))
            (w,) = [n for n in case.g.nodes if n.op == "Input" and n.name == "w"]
            forms.add("vector" if w.shape == (17,) else "per row")
        assert forms == set(NORM_AFFINE), (kernel, forms)


def test_cases_draw_every_view_and_dtype():
    """The seeds above exercise each view kind and several dtypes (so the suite is not accidentally narrow)."""
    seen_views, seen_dtypes = set(), set()
    for kernel in CASES:
        for seed in SEEDS:
            case = CASES[kernel](Case(np.random.default_rng([seed, sum(map(ord, kernel))])))
            for n in case.g.nodes:
                seen_dtypes.add(str(n.dtype))
            for n in case.g.nodes:
                for _, v in n.inputs:
                    if v.mask is not None:
                        seen_views.add("padded")
                    if any(s == 0 and d != 1 for d, s in zip(v.shape, v.strides)):
                        seen_views.add("broadcast")
                    if not isinstance(v.offset, int) or v.offset:
                        seen_views.add("sliced")
                    if len(v.strides) >= 2 and v.strides[-1] != 1 and math.prod(v.shape):
                        seen_views.add("transposed")
    assert {"padded", "broadcast", "sliced", "transposed"} <= seen_views
    assert {"f32", "bf16", "f16", "i32", "bool"} <= seen_dtypes


@pytest.mark.parametrize("dtype", FLOATS)
def test_elementwise_reads_reversed_views(dtype, runtime, assert_close):
    """Views with a negative stride (``flip``): FLUX.2's RoPE reads each (x0, x1) pair reversed from x itself
    (ops.apply_rope, style "pairs"); also a reversed axis of a zero-padded view. Every runtime reads them in place
    (the numpy kernels through negative strides, the CUDA code through signed index arithmetic)."""
    c = Case(np.random.default_rng([sum(map(ord, dtype)), 7]))
    x = c.operand("x", (2, 5, 8), dtype, view="contiguous")
    cos, sin = c.operand("cos", (5, 8), "f32", view="contiguous"), c.operand("sin", (5, 8), "f32", view="contiguous")
    y = c.operand("y", (2, 5, 8), dtype, view="padded")
    rope = ops.apply_rope(x, cos, sin, style="pairs")
    c.output(rope * y.flip(1).flip(2))
    program = program_with("Elementwise", c, runtime)
    assert not {"Concat", "Copy"} & set(program.kernel_counts()), program.kernel_counts()
    want = run_reference(c.g, c.inputs, c.weights, c.dims)["out"]
    got = runtime.run(program, c.inputs, c.weights, c.dims)["out"]
    assert_close("runtime", got, want, dtype)


def test_elementwise_reads_reversed_views_without_numba(numpy_runtime, assert_close, monkeypatch):
    from luminal_recipes.runtimes.cpu import jit

    monkeypatch.setattr(jit, "AVAILABLE", False)
    test_elementwise_reads_reversed_views("f32", numpy_runtime, assert_close)


def test_product_over_a_concatenation_runs_as_two_products(runtime, assert_close):
    """``concat([a, b], -1) @ W`` as the rules give it (matmul.egg: two products, the second adding the first's
    result as its bias, the weight read in two row ranges): no Concat, the reference's values on every runtime."""
    c = Case(np.random.default_rng(8))
    a = c.operand("a", (2, 24, 40), "f32", view="contiguous")
    b = c.operand("b", (2, 24, 56), "f32", view="sliced")
    w = c.operand("w", (24, 96), "f32", view="contiguous", weight=True)
    c.output(ops.linear(ops.concat([a, b], -1), w))
    program = program_with("MatMul", c, runtime)
    counts = program.kernel_counts()
    assert "Concat" not in counts and counts["MatMul"] == 2, counts
    want = run_reference(c.g, c.inputs, c.weights, c.dims)["out"]
    got = runtime.run(program, c.inputs, c.weights, c.dims)["out"]
    assert_close("runtime", got, want, "f32")
