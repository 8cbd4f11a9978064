"""cuda-emu: the CUDA runtime's generated CUDA C, compiled by g++ and run on the CPU, against the reference
interpreter (``graph.reference``) and ml_dtypes.

Every kernel here is the text NVRTC compiles for the GPU (``test_cuda_nvrtc.py``); only ``kernels/emu.h`` differs.
Narrow-float conversions are checked bit for bit against ml_dtypes (NaN payloads aside: CUDA returns its canonical
NaN); kernels against the reference through tests/TOLERANCES.md.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from fused_programs import Fused

from luminal_recipes import ops
from luminal_recipes.errors import InputError
from luminal_recipes.graph import Graph, View, cast, run_reference
from luminal_recipes.runtimes.cuda import CudaEmuBackend, CudaOptions, CudaRuntime
from luminal_recipes.runtimes.program import Program

pytestmark = pytest.mark.skipif(not __import__("shutil").which("g++"), reason="cuda-emu needs g++")


@pytest.fixture(scope="module")
def emu() -> CudaRuntime:
    return CudaRuntime(CudaEmuBackend())


@pytest.fixture
def check(emu, assert_close):
    def run(graph: Graph, program: Program, inputs=None, weights=None, dims=None, family="runtime", dtype="f32"):
        want = run_reference(graph, inputs, weights, dims)
        got = emu.run(program, inputs, weights, dims)
        for name in want:
            assert got[name].dtype == want[name].dtype, name
            assert_close(family, got[name], want[name], dtype)
        return got, want

    return run


def randn(rng, *shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


NARROW = {"bf16": ml_dtypes.bfloat16, "f16": np.float16, "f8e4m3": ml_dtypes.float8_e4m3fn,
          "f8e5m2": ml_dtypes.float8_e5m2}


def _f32_probes(rng) -> np.ndarray:
    """f32 values that exercise rounding to every narrow format: random bit patterns over all exponents, every
    exact midpoint between neighbouring narrow values (ties to even), overflow edges, subnormals, zeros, inf."""
    vals = [rng.integers(0, 2**32, 20000, dtype=np.uint64).astype(np.uint32).view(np.float32)]
    for dt in NARROW.values():
        bits = np.arange(2 ** (8 * np.dtype(dt).itemsize), dtype=np.uint32)
        codes = bits.astype(np.uint16 if np.dtype(dt).itemsize == 2 else np.uint8).view(dt).astype(np.float64)
        codes = np.sort(codes[np.isfinite(codes)])
        mids = (codes[1:] + codes[:-1]) / 2
        vals += [codes.astype(np.float32), mids.astype(np.float32),
                 np.nextafter(mids.astype(np.float32), np.float32(np.inf)),
                 np.nextafter(mids.astype(np.float32), np.float32(-np.inf))]
    vals.append(np.array([0.0, -0.0, np.inf, -np.inf, 448.0, 464.0, 465.0, 480.0, 57344.0, 61440.0, 65504.0,
                          65520.0, 1e-45, -1e-45, 3.4e38], np.float32))
    return np.concatenate(vals)


def test_narrow_float_conversions_match_ml_dtypes_bit_for_bit(emu, rng):
    """f32 -> bf16/f16/f8e4m3/f8e5m2 (round to nearest even, e4m3 overflow to NaN) and every narrow code back
    to f32, through Cast kernels (the device's conversion intrinsics on the GPU)."""
    x = _f32_probes(rng)
    g = Graph()
    xin = g.input("x", (x.size,))
    codes_in = {name: g.input(f"c_{name}", (2 ** (8 * np.dtype(dt).itemsize),), name) for name, dt in NARROW.items()}
    for name in NARROW:
        g.mark_output(f"to_{name}", cast(xin, name))
        g.mark_output(f"from_{name}", cast(codes_in[name], "f32"))
    inputs = {"x": x}
    for name, dt in NARROW.items():
        size = np.dtype(dt).itemsize
        inputs[f"c_{name}"] = np.arange(2 ** (8 * size), dtype=np.uint32).astype(f"u{size}").view(dt)
    got = emu.run(Program.from_graph(g), inputs)
    for name, dt in NARROW.items():
        with np.errstate(over="ignore"):
            want = x.astype(dt)
        out = got[f"to_{name}"]
        nan = np.isnan(want.astype(np.float32))
        assert np.array_equal(np.isnan(out.astype(np.float32)), nan), name
        u = f"u{np.dtype(dt).itemsize}"
        bad = np.flatnonzero(out[~nan].view(u) != want[~nan].view(u))
        assert bad.size == 0, f"{name}: {x[~nan][bad[:5]]} -> {out[~nan][bad[:5]]}, ml_dtypes {want[~nan][bad[:5]]}"
        back = got[f"from_{name}"]
        ref = inputs[f"c_{name}"].astype(np.float32)
        assert np.array_equal(np.isnan(back), np.isnan(ref)), name
        assert np.array_equal(back[~np.isnan(ref)].view(np.uint32), ref[~np.isnan(ref)].view(np.uint32)), name


# ---- Elementwise ------------------------------------------------------------------------------------------------
def test_elementwise_chain_with_broadcast_and_padded_inputs(check, rng):
    g = Graph()
    x0 = g.input("x", (5, 6))
    b = g.input("b", (8,))
    x = x0.pad(1, 1, 1)
    bb = b.broadcast_to((5, 8))
    g.mark_output("y", x * ops.sigmoid(x + bb))
    f = Fused(g)
    e = ("(Mul in0 (Recip (Add (Exp2 (Mul (Mul (Add in0 in1) (Const -1.0)) (Const 1.4426950408889634))) "
         "(Const 1.0))))")
    y = f.add("Elementwise", [x, bb], (5, 8), expr=e)
    check(g, f.program(y=y), {"x": randn(rng, 5, 6), "b": randn(rng, 8)}, family="elementwise")


def test_elementwise_vector_path_scalar_tail_and_strided_reads(check, rng):
    """1027 contiguous elements (vector loop + scalar tail), a uniform scalar operand, and a transposed read
    (the index path); bf16 output rounds once from f32."""
    g = Graph()
    a, s = g.input("a", (1027,)), g.input("s", ())
    t0 = g.input("t", (13, 79))
    f = Fused(g)
    sb = s.broadcast_to((1027,))
    g.mark_output("y", cast(ops.exp(a) * sb, "bf16"))
    y = f.add("Elementwise", [a, sb], (1027,), "bf16", expr="(Mul (Exp2 (Mul in0 (Const 1.4426950408889634))) in1)")
    g.mark_output("z", t0.T + 1.0)
    z = f.add("Elementwise", [t0.T], (79, 13), expr="(Add in0 (Const 1.0))")
    inputs = {"a": randn(rng, 1027), "s": np.asarray(0.5, np.float32), "t": randn(rng, 13, 79)}
    want = run_reference(g, inputs)
    got = CudaRuntime(CudaEmuBackend()).run(f.program(y=y, z=z), inputs)
    exact = (np.exp(inputs["a"].astype(np.float64)) * 0.5).astype(ml_dtypes.bfloat16)
    assert np.abs(got["y"].astype(np.float32) - exact.astype(np.float32)).max() <= \
        np.abs(exact.astype(np.float32)).max() * 2**-8
    assert np.array_equal(got["z"], want["z"])


def test_elementwise_casts_comparisons_and_integers(emu, rng):
    g = Graph()
    x = g.input("x", (4, 7))
    i = g.input("i", (9,), "i32")
    f = Fused(g)
    relu = f.add("Elementwise", [x], (4, 7), expr="(Mul in0 (Cast f32 (LessThan (Const 0.0) in0)))")
    pos = f.add("Elementwise", [x], (4, 7), "bool", expr="(LessThan (Const 0.0) in0)")
    ints = f.add("Elementwise", [i], (9,), "i32", expr="(Mod (Add (Mul in0 (Const 3)) (Const 16777217)) (Const 7))")
    trunc = f.add("Elementwise", [x], (4, 7), "i32", expr="(Cast i32 (Mul in0 (Const 10.0)))")
    ins = {"x": randn(rng, 4, 7), "i": rng.integers(-1000, 1000, 9).astype(np.int32)}
    got = emu.run(f.program(relu=relu, pos=pos, ints=ints, trunc=trunc), ins)
    assert np.array_equal(got["relu"], ins["x"] * (ins["x"] > 0))
    assert got["pos"].dtype == np.bool_ and np.array_equal(got["pos"], ins["x"] > 0)
    assert got["ints"].dtype == np.int32 and np.array_equal(got["ints"], np.fmod(ins["i"] * 3 + 16777217, 7))
    assert np.array_equal(got["trunc"], np.trunc(ins["x"] * np.float32(10)).astype(np.int32))


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_primitive_program_in_low_precision(dtype, check, rng):
    """The naive program of an op-library graph (every primitive its own kernel) in f16/bf16."""
    g = Graph()
    x = g.input("x", (6, 16), dtype)
    g.mark_output("y", ops.gelu(x) * ops.softmax(x, -1) + ops.rms_norm(x, eps=1e-6))
    npd = NARROW[dtype]
    check(g, Program.from_graph(g), {"x": randn(rng, 6, 16, dtype=npd)}, dtype=dtype)


# ---- Softmax and norms ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("view", ["contiguous", "transposed"])
def test_row_kernels(view, check, rng):
    """Softmax, LayerNorm, RMSNorm over registers (n <= 8 * block) and re-read rows (n = 1100), plain and
    transposed views, in one module."""
    g = Graph()
    f_nodes = {}
    f = None
    inputs = {}
    outs = {}
    for n in (33, 1100):
        x0 = g.input(f"x{n}", (2, n, 9) if view == "transposed" else (2, 9, n))
        x = x0.transpose(1, 2) if view == "transposed" else x0
        inputs[f"x{n}"] = 3 * randn(rng, *x0.shape)
        g.mark_output(f"softmax{n}", ops.softmax(x, -1))
        g.mark_output(f"layernorm{n}", ops.layer_norm(x, eps=1e-5))
        g.mark_output(f"rmsnorm{n}", ops.rms_norm(x, eps=1e-6))
        f_nodes[n] = x
    f = Fused(g)
    for n, x in f_nodes.items():
        outs[f"softmax{n}"] = f.add("Softmax", [x], (2, 9, n))
        outs[f"layernorm{n}"] = f.add("LayerNorm", [x], (2, 9, n), eps=1e-5)
        outs[f"rmsnorm{n}"] = f.add("RMSNorm", [x], (2, 9, n), eps=1e-6)
    check(g, f.program(**outs), inputs)


def test_group_norm_is_layer_norm_on_the_grouped_view(check, rng):
    g = Graph()
    x = g.input("x", (2, 8, 3, 5))
    g.mark_output("y", ops.group_norm(x, 4, eps=1e-5))
    f = Fused(g)
    y = f.add("LayerNorm", [x.reshape(2, 4, 30)], (2, 4, 30), eps=1e-5)
    program = f.program()
    program.outputs["y"] = (y, View.contiguous((2, 4, 30)).reshape((2, 8, 3, 5)))
    check(g, program, {"x": randn(rng, 2, 8, 3, 5)})


def test_softmax_bf16(check, rng):
    g = Graph()
    x = g.input("x", (4, 40), "bf16")
    g.mark_output("y", ops.softmax(x, -1))
    f = Fused(g)
    y = f.add("Softmax", [x], (4, 40), "bf16")
    check(g, f.program(y=y), {"x": randn(rng, 4, 40, dtype=ml_dtypes.bfloat16)}, dtype="bf16")


# ---- reductions, gather, scatter ----------------------------------------------------------------------------------
def test_reductions_over_every_axis_with_padding(check, rng):
    """SumReduce/MaxReduce over each axis of a padded, permuted view (warp-per-output and thread-per-output
    kernels), plus an integer sum that wraps as numpy's."""
    g = Graph()
    x0 = g.input("x", (5, 40, 3))
    x = x0.pad(0, 1, 2).permute(2, 0, 1)  # [3, 8, 40], zeros in rows 0, 6, 7 of axis 1
    i = g.input("i", (4, 50), "i32")
    for axis in range(3):
        g.mark_output(f"sum{axis}", ops.sum(x, axis))
        g.mark_output(f"max{axis}", ops.max(x, axis))
    g.mark_output("isum", ops.sum(i, 1))
    inputs = {"x": randn(rng, 5, 40, 3), "i": rng.integers(-2**30, 2**30, (4, 50)).astype(np.int32)}
    got, want = check(g, Program.from_graph(g), inputs)
    assert np.array_equal(got["isum"], want["isum"])


def test_gather_embedding_and_out_of_range_index(emu, rng):
    g = Graph()
    ids = g.input("ids", (2, 3), "i32")
    table = g.weight("table", (7, 5), "bf16")
    g.mark_output("y", ops.embedding(ids, table))
    weights = {"table": randn(rng, 7, 5, dtype=ml_dtypes.bfloat16)}
    exe = emu.load(Program.from_graph(g), weights)
    ids_ok = np.array([[0, 6, 2], [3, 3, 1]], np.int32)
    assert np.array_equal(exe.run({"ids": ids_ok})["y"], weights["table"][ids_ok])
    with pytest.raises(InputError, match=r"out of range \[0, 7\)"):
        exe.run({"ids": np.array([[0, 7, 1], [0, 0, 0]], np.int32)})


def test_scatter_and_scatter_in_place(emu, rng):
    g = Graph()
    cache = g.input("cache", (10, 4))
    pos = g.input("pos", (3,), "i32")
    rows = g.input("rows", (3, 4))
    doubled = cache * 2.0
    f = Fused(g)
    y = f.add("ScatterInPlace", [doubled, pos, rows], (10, 4))
    z = f.add("Scatter", [cache, pos, rows], (10, 4))
    program = f.program(y=y, z=z)
    exe = emu.load(program)
    assert exe.plan.aliases.get(y) == doubled.node  # the copy of the destination is skipped
    ins = {"cache": randn(rng, 10, 4), "pos": np.array([7, 0, 3], np.int32), "rows": randn(rng, 3, 4)}
    out = exe.run(ins)
    want = ins["cache"] * 2
    want[ins["pos"]] = ins["rows"]
    assert np.array_equal(out["y"], want)
    want = ins["cache"].copy()
    want[ins["pos"]] = ins["rows"]
    assert np.array_equal(out["z"], want)


# ---- MatMul (cuBLAS descriptors run by their numpy model) --------------------------------------------------------
def test_matmul_layouts_batches_bias_and_dtypes(check, rng):
    """All four transpose layouts, a linear layer over a batch (one GEMM, weight broadcast by stride 0), batched
    heads with a broadcast batch axis, a padded operand (copied into scratch) and a bias, in one program."""
    g = Graph()
    f_ops = []
    m, k, n = 7, 17, 5
    inputs = {}
    for ta in (False, True):
        for tb in (False, True):
            a = g.input(f"a{ta}{tb}", (k, m) if ta else (m, k))
            b = g.input(f"b{ta}{tb}", (n, k) if tb else (k, n))
            av, bv = (a.T if ta else a), (b.T if tb else b)
            g.mark_output(f"y{ta}{tb}", ops.matmul(av, bv))
            f_ops.append((f"y{ta}{tb}", "MatMul", [av, bv], (m, n), {}))
            inputs[f"a{ta}{tb}"], inputs[f"b{ta}{tb}"] = randn(rng, *a.shape), randn(rng, *b.shape)
    x = g.input("x", (2, 3, 24))
    w = g.input("w", (12, 24))
    bias = g.input("bias", (12,))
    g.mark_output("lin", ops.linear(x, w, bias))
    wv = w.T.unsqueeze(0).broadcast_to((2, 24, 12))
    f_ops.append(("lin", "MatMul", [x, wv, bias.broadcast_to((2, 3, 12))], (2, 3, 12), {}))
    q = g.input("q", (2, 3, 4, 9))
    kk = g.input("kk", (2, 1, 9, 6))
    kv = kk.broadcast_to((2, 3, 9, 6))
    g.mark_output("heads", ops.matmul(q, kv))
    f_ops.append(("heads", "MatMul", [q, kv], (2, 3, 4, 6), {}))
    p0 = g.input("p", (5, 6))
    p = p0.pad(1, 0, 3)  # [5, 9], zero columns: not readable in place
    r = g.input("r", (9, 4))
    g.mark_output("padded", ops.matmul(p, r))
    f_ops.append(("padded", "MatMul", [p, r], (5, 4), {}))
    inputs.update(x=randn(rng, 2, 3, 24), w=randn(rng, 12, 24), bias=randn(rng, 12), q=randn(rng, 2, 3, 4, 9),
                  kk=randn(rng, 2, 1, 9, 6), p=randn(rng, 5, 6), r=randn(rng, 9, 4))
    f = Fused(g)
    outs = {name: f.add(op, args, shape, **attrs) for name, op, args, shape, attrs in f_ops}
    check(g, f.program(**outs), inputs)


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_matmul_low_precision_accumulates_in_f32(dtype, emu, rng):
    g = Graph()
    a = g.input("a", (6, 32), dtype)
    b = g.input("b", (32, 5), dtype)
    bias = g.input("bias", (5,), dtype)
    f = Fused(g)
    y = f.add("MatMul", [a, b], (6, 5), dtype)
    z = f.add("MatMul", [a, b, bias.broadcast_to((6, 5))], (6, 5), dtype)
    npd = NARROW[dtype]
    ins = {"a": randn(rng, 6, 32, dtype=npd), "b": randn(rng, 32, 5, dtype=npd), "bias": randn(rng, 5, dtype=npd)}
    got = emu.run(f.program(y=y, z=z), ins)
    prod = ins["a"].astype(np.float32) @ ins["b"].astype(np.float32)
    assert np.array_equal(got["y"], prod.astype(npd))  # f32 accumulation, one rounding at the end
    assert np.array_equal(got["z"], (prod + ins["bias"].astype(np.float32)).astype(npd))


# ---- Attention ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["chunked", "flash"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_attention_grouped_query_heads(mode, with_bias, assert_close):
    """GQA heads sharing kv by stride-0 views, an optional masking bias; the chunked path with chunks of 3 heads
    (several GEMM batches and a last, shorter one)."""
    from test_fused_kernels import _attention_case, _grouped_output

    g = Graph()
    views, grouped, merged, inputs = _attention_case(g, with_bias)
    f = Fused(g)
    y = f.add("AttentionBlocked", views, grouped, scale=0.3, block=4)
    options = CudaOptions(max_blocks=64, attention=mode, score_budget=3 * 5 * 11)
    got = CudaRuntime(CudaEmuBackend(options)).run(_grouped_output(f, y, grouped, merged), inputs)
    assert_close("runtime", got["y"], run_reference(g, inputs)["y"], "f32")


# ---- DequantMatMul --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("scale_shape", "fp8", "k"), [((), "f8e4m3", 48), ((20, 1), "f8e5m2", 47)])
def test_dequant_matmul_fp8(scale_shape, fp8, k, check, rng):
    n = 20
    g = Graph()
    x = g.input("x", (2, 3, k))
    w8 = g.weight("w", (n, k), fp8)
    s = g.weight("s", scale_shape)
    g.mark_output("y", ops.linear(x, ops.dequant_fp8(w8, s)))
    f = Fused(g)
    y = f.add("DequantMatMul", [x, w8, s], (2, 3, n), format="fp8", layout="", out_features=n, in_features=k)
    weights = {"w": randn(rng, n, k).astype(w8.dtype.np), "s": (rng.random(scale_shape) + 0.5).astype(np.float32)}
    check(g, f.program(y=y), {"x": randn(rng, 2, 3, k)}, weights)


@pytest.mark.parametrize("layout", ["modelopt", "comfy"])
def test_dequant_matmul_nvfp4_in_bands(layout, assert_close, rng):
    n, k = 200, 32
    if layout == "modelopt":
        w_shape, s_shape = (n, k // 2), (n, k // 16)
    else:
        w_shape, s_shape = (208, k // 2), (256, 4)
    g = Graph()
    x = g.input("x", (3, k))
    wq = g.weight("w", w_shape, "u8")
    ws = g.weight("ws", s_shape, "f8e4m3")
    ws2 = g.weight("ws2", ())
    g.mark_output("y", ops.linear(x, ops.dequant_nvfp4(wq, ws, ws2, n, k, layout)))
    f = Fused(g)
    y = f.add("DequantMatMul", [x, wq, ws, ws2], (3, n), format="nvfp4", layout=layout, out_features=n,
              in_features=k)
    weights = {"w": rng.integers(0, 256, w_shape).astype(np.uint8),
               "ws": (rng.random(s_shape) * 4 + 0.25).astype(ml_dtypes.float8_e4m3fn),
               "ws2": np.asarray(0.37, np.float32)}
    inputs = {"x": randn(rng, 3, k)}
    runtime = CudaRuntime(CudaEmuBackend(CudaOptions(max_blocks=64, dequant_band=48 * k)))  # 5 bands, last short
    exe = runtime.load(f.program(y=y), weights)
    assert 0 < exe.plan.scratch_bytes[y] <= 48 * k * 4 + 64  # one band of the dense weight, never all of it
    assert_close("runtime", exe.run(inputs)["y"], run_reference(g, inputs, weights)["y"], "f32")


# ---- Conv2d ---------------------------------------------------------------------------------------------------------
def test_conv2d_padded_strided_with_bias_in_tiles(check, rng):
    """3x3 padded, strided 3x3 with bias, 1x1 with bias and 2x2 stride 2, im2col tiles of a few output rows."""
    n, c, h, w, o = 2, 3, 9, 8, 4
    g = Graph()
    x = g.input("x", (n, c, h, w))
    f_ops, weights = [], {}
    for i, (kernel, stride, padding, bias) in enumerate([(3, 1, 1, False), (3, 2, 1, True), (1, 1, 0, True),
                                                         (2, 2, 0, False)]):
        wt = g.weight(f"w{i}", (o, c, kernel, kernel))
        b = g.weight(f"b{i}", (o,)) if bias else None
        g.mark_output(f"y{i}", ops.conv2d(x, wt, b, stride=stride, padding=padding))
        xp = x.pad(2, padding, padding).pad(3, padding, padding) if padding else x
        ho, wo = (h + 2 * padding - kernel) // stride + 1, (w + 2 * padding - kernel) // stride + 1
        operands = [xp, wt] + ([b.reshape(1, o, 1, 1).broadcast_to((n, o, ho, wo))] if bias else [])
        f_ops.append((f"y{i}", operands, (n, o, ho, wo), stride))
        weights[f"w{i}"] = randn(rng, o, c, kernel, kernel)
        if bias:
            weights[f"b{i}"] = randn(rng, o)
    f = Fused(g)
    outs = {name: f.add("Conv2d", operands, shape, stride=stride) for name, operands, shape, stride in f_ops}
    inputs = {"x": randn(rng, n, c, h, w)}
    want = run_reference(g, inputs, weights)
    got = CudaRuntime(CudaEmuBackend(CudaOptions(max_blocks=64, conv_cols=60))).run(f.program(**outs), inputs,
                                                                                     weights)
    for name in want:
        assert np.abs(got[name] - want[name]).max() <= 1e-5 * (1 + np.abs(want[name]).max()), name


def test_flash_attention_several_key_tiles_and_query_blocks(assert_close, rng):
    """S = 20 (two query blocks of 16), T = 70 (three key tiles, the last partial), the first key tile fully
    masked by a finite bias (the running max starts finite: no NaN), bf16 output."""
    b, h, s, t, d = 1, 2, 20, 70, 64
    g = Graph()
    q, k, v = g.input("q", (b, h, s, d)), g.input("k", (b, h, t, d)), g.input("v", (b, h, t, d))
    bias = g.input("bias", (b, 1, s, t))
    g.mark_output("y", cast(ops.scaled_dot_product_attention(q, k, v, mask=bias.broadcast_to((b, h, s, t)),
                                                             scale=0.25), "bf16"))
    f = Fused(g)
    y = f.add("AttentionBlocked", [q, k, v, bias.broadcast_to((b, h, s, t))], (b, h, s, d), "bf16", scale=0.25,
              block=32)
    mask = np.zeros((b, 1, s, t), np.float32)
    mask[..., :32] = np.finfo(np.float32).min
    inputs = {"q": randn(rng, b, h, s, d), "k": randn(rng, b, h, t, d), "v": randn(rng, b, h, t, d), "bias": mask}
    got = CudaRuntime(CudaEmuBackend(CudaOptions(max_blocks=64, attention="flash"))).run(f.program(y=y), inputs)
    assert np.isfinite(got["y"].astype(np.float32)).all()
    assert_close("runtime", got["y"], run_reference(g, inputs)["y"], "bf16")


# ---- performance paths: attention choice, 1x1 convolution --------------------------------------------------------
def _bound(shape, dtype):
    from luminal_recipes.runtimes.cuda.codegen import Operand

    return Operand(View.contiguous(shape).bind({}), int(np.prod(shape)), np.dtype(dtype))


def test_attention_path_rule_picks_tensor_core_gemms_at_flux2_sizes():
    """'auto': FLUX.2-dev's joint attention (48 heads x 4608 tokens, head dim 128, bf16) takes the chunked
    cuBLAS path (tensor cores), a short sequence the flash kernel; explicit choices and head dims flash does not
    support are honoured."""
    from luminal_recipes.runtimes.cuda.nodes import attention_path

    bf = ml_dtypes.bfloat16
    flux = [_bound((1, 48, 4608, 128), bf)] * 3
    short = [_bound((1, 4, 64, 128), bf)] * 3
    auto = CudaOptions()
    assert attention_path(auto, flux, (1, 48, 4608, 128)) == "chunked"
    assert attention_path(auto, short, (1, 4, 64, 128)) == "flash"
    assert attention_path(CudaOptions(attention="flash"), flux, (1, 48, 4608, 128)) == "flash"
    assert attention_path(CudaOptions(attention="chunked"), short, (1, 4, 64, 128)) == "chunked"
    small_head = [_bound((1, 4, 64, 32), bf)] * 3
    assert attention_path(CudaOptions(attention="flash"), small_head, (1, 4, 64, 32)) == "chunked"


def test_conv1x1_is_one_batched_gemm_without_im2col(check, rng):
    """A 1x1 stride-1 convolution reads x in place as [C, H*W] per image: one GEMM over the batch, no im2col."""
    from luminal_recipes.runtimes.cuda.backend import prepare_program
    from luminal_recipes.runtimes.cuda.plan import Gemm

    n, c, h, w, o = 2, 6, 5, 7, 4
    g = Graph()
    x = g.input("x", (n, c, h, w))
    wt = g.weight("w", (o, c, 1, 1))
    b = g.weight("b", (o,))
    g.mark_output("y", ops.conv2d(x, wt, b))
    f = Fused(g)
    y = f.add("Conv2d", [x, wt, b.reshape(1, o, 1, 1).broadcast_to((n, o, h, w))], (n, o, h, w), stride=1)
    program = f.program(y=y)
    (plan, _), = [v for k, v in prepare_program(program, {}, CudaOptions()).items() if k == y]
    assert not any(s.name.startswith("im2col") for s in plan.sources)
    gemms = [s for s in plan.steps if isinstance(s, Gemm)]
    assert len(gemms) == 1 and gemms[0].desc.batch == n
    check(g, program, {"x": randn(rng, n, c, h, w)}, {"w": randn(rng, o, c, 1, 1), "b": randn(rng, o)})


# ---- re-binding: a decode loop -------------------------------------------------------------------------------------
def test_decode_loop_rebinds_one_module_for_every_length(emu):
    """The kernels read the symbolic length from their arguments: the re-bound executable builds one module for
    every length (g++ runs once, with an empty cache), a second pass builds nothing; each step moves only its
    inputs and output and agrees with the reference threading the state by hand."""
    from test_decode_loop import D, decode_graph

    from luminal_recipes import instrument
    from luminal_recipes.compiler import SearchOptions, compile_graph

    steps = 6
    g = decode_graph(32)
    program = compile_graph(g, emu, {"n": steps}, options=SearchOptions(use_cache=False, time_top=0)).program
    assert "ScatterInPlace" in program.kernel_counts()
    before = instrument.snapshot()
    exe = emu.load(program, dims={"n": steps})
    rng = np.random.default_rng(0)
    state = np.zeros((32, D), np.float32)
    for _ in range(2):
        exe.set_state("cache")
        state[...] = 0
        for t in range(steps):
            inputs = {"pos": np.array([t], np.int32), "row": rng.standard_normal((1, D)).astype(np.float32),
                      "q": rng.standard_normal((1, D)).astype(np.float32)}
            y = exe.run(inputs, dims={"n": t + 1})["y"]
            want = run_reference(g, {**inputs, "cache": state}, dims={"n": t + 1})
            state = want["cache"]
            np.testing.assert_allclose(y, want["y"], rtol=1e-5, atol=1e-5)
            assert (exe.stats.bytes_in, exe.stats.bytes_out, exe.stats.bytes_device) == (4 + 2 * D * 4, D * 4, 0)
    built = instrument.snapshot() - before
    assert built[instrument.CUDA_MODULE] == 1 and built[instrument.CUDA_COMPILE] <= 1
    assert np.array_equal(exe.state("cache"), state) and exe.stats.arena_allocations == 0
