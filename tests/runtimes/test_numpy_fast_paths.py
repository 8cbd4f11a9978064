"""The numpy runtime's fast paths give the reference interpreter's results: the box-wise ``Concat`` and ``Copy``
of zero-padded views (concat/stack, materialised views), and the attention kernels' folded scale and
ones column (here with a non-f32 output, which the kernel tests elsewhere do not cover). Every runtime must give
the same bits on these graphs; only runtimes with numpy's kernels are checked for taking the fast path."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from fused_programs import Fused
from runtime_kinds import runs_numpy_kernels

from luminal_recipes import ops
from luminal_recipes.graph import Graph, run_reference
from luminal_recipes.runtimes.cpu.kernels import elementwise as elementwise_kernels
from luminal_recipes.runtimes.cpu.kernels import layout as layout_kernels
from luminal_recipes.runtimes.cpu.kernels import matmul as matmul_kernels
from luminal_recipes.runtimes.cpu.kernels import norms as norms_kernels
from luminal_recipes.runtimes.program import Program


def _padded_graph() -> tuple[Graph, dict[str, np.ndarray]]:
    g = Graph()
    a, b, c = g.input("a", (2, 3, 5)), g.input("b", (2, 4, 5)), g.input("c", (2, 7, 5))
    g.mark_output("concat", ops.concat([a, b], 1))
    g.mark_output("stack", ops.stack([a, a * 2.0], -1))
    g.mark_output("pad_plus_full", a.pad(1, 1, 3) + c)
    g.mark_output("overlapping_pads", a.pad(1, 0, 4) + b.pad(1, 2, 1))
    g.mark_output("empty_box", a.pad(1, 0, 4).slice(1, 4, 7) + b.slice(1, 0, 3))
    rng = np.random.default_rng(0)
    inputs = {"a": rng.standard_normal((2, 3, 5)).astype(np.float32),
              "b": rng.standard_normal((2, 4, 5)).astype(np.float32),
              "c": rng.standard_normal((2, 7, 5)).astype(np.float32)}
    inputs["a"][0, 0, :2] = -0.0  # the padded sum turns -0.0 into +0.0; so must the fast path
    return g, inputs


def test_padded_adds_match_the_reference_bit_for_bit(runtime, monkeypatch):
    from luminal_recipes.compiler import SearchOptions, compile_graph

    used = []
    fast = layout_kernels.prepare_padded_add
    monkeypatch.setattr(layout_kernels, "prepare_padded_add", lambda ctx: used.append(fast(ctx)) or used[-1])
    g, inputs = _padded_graph()
    want = run_reference(g, inputs)
    program = compile_graph(g, runtime, options=SearchOptions(use_cache=False, time_top=0)).program
    assert program.kernel_counts().get("Concat", 0) >= 4  # the rules find them: concat, stack, pad + full...
    for candidate in (program, Program.from_graph(g)):  # ... and the naive program's plain Adds agree
        got = runtime.run(candidate, inputs)
        for name in want:
            assert np.array_equal(got[name], want[name]), name
            assert np.array_equal(np.signbit(got[name]), np.signbit(want[name])), name
    if runs_numpy_kernels(runtime):
        assert sum(bind is not None for bind in used) >= 4  # the Concat kernels took the box-wise path


def test_concat_and_copy_kernels_take_the_box_wise_paths(runtime, monkeypatch):
    g = Graph()
    a, b = g.input("a", (3, 4)), g.input("b", (3, 6))
    g.mark_output("y", ops.concat([a, b], 1))
    g.mark_output("z", a.pad(1, 2, 1).contiguous())
    f = Fused(g)
    y = f.add("Concat", [b.pad(1, 4, 0), a.pad(1, 0, 6)], (3, 10))
    z = f.add("Copy", [a.pad(1, 2, 1)], (3, 7))
    used = []
    fast = layout_kernels.prepare_padded_add
    monkeypatch.setattr(layout_kernels, "prepare_padded_add", lambda ctx: used.append(fast(ctx)) or used[-1])
    inputs = {"a": np.arange(12, dtype=np.float32).reshape(3, 4), "b": -np.ones((3, 6), np.float32)}
    got = runtime.run(f.program(y=y, z=z), inputs)
    want = run_reference(g, inputs)
    assert np.array_equal(got["y"], want["y"]) and np.array_equal(got["z"], want["z"])
    if runs_numpy_kernels(runtime):
        assert used and used[-1] is not None


@pytest.mark.parametrize("compiled", [True, False], ids=["numba", "numpy"])
@pytest.mark.parametrize("threads", [1, 2])
def test_copy_of_repeated_values_fills_the_repeats_from_the_output(threads, compiled, runtime, monkeypatch):
    """A ``Copy`` of a view that repeats values along its innermost axes (a 2x nearest upsampling, and a repeat
    with a padded axis around it): the copies repeated within the output give the reference's bits. With numba
    the upsampling is one compiled pass (``numba_kernels.upsample2_rows``), without it first entries then repeats."""
    from luminal_recipes.runtimes.cpu import jit
    from luminal_recipes.runtimes.cpu import threads as cpu_threads

    if compiled and not jit.AVAILABLE:
        pytest.skip("numba is not installed (luminal-recipes[jit])")
    monkeypatch.setattr(jit, "AVAILABLE", compiled)
    monkeypatch.setattr(cpu_threads, "THREADS", threads)
    monkeypatch.setattr(cpu_threads, "MIN_PART", 1)
    g = Graph()
    a = g.input("a", (2, 3, 4, 5))
    up = a.expand(3, 2).expand(5, 2)  # [2, 3, 4, 2, 5, 2]: what ops.conv.upsample_nearest2x reshapes
    g.mark_output("up", ops.conv.upsample_nearest2x(a))
    g.mark_output("padded", a.pad(1, 1, 0).expand(4, 3).contiguous())
    f = Fused(g)
    y = f.add("Copy", [up], (2, 3, 4, 2, 5, 2))
    z = f.add("Copy", [a.pad(1, 1, 0).expand(4, 3)], (2, 4, 4, 5, 3))
    calls, upsampled = [], []
    steps, rows = layout_kernels._repeat_steps, layout_kernels._upsampled_rows
    monkeypatch.setattr(layout_kernels, "_repeat_steps", lambda d, s: calls.append(steps(d, s)) or calls[-1])
    monkeypatch.setattr(layout_kernels, "_upsampled_rows", lambda d, s: upsampled.append(rows(d, s)) or upsampled[-1])
    inputs = {"a": np.random.default_rng(2).standard_normal((2, 3, 4, 5)).astype(np.float32)}
    got = runtime.run(f.program(y=y, z=z), inputs)
    want = run_reference(g, inputs)
    assert np.array_equal(got["y"].reshape(want["up"].shape), want["up"])
    assert np.array_equal(got["z"], want["padded"])
    if runs_numpy_kernels(runtime):
        assert calls and all(len(c) > 1 for c in calls)  # first entries, then the repeats
        # compiled: the upsampling (y, 6 axes) in one pass, the padded repeat (z, 5 axes) by steps; else both
        assert any(c[0][0].ndim == 6 for c in calls) != compiled and any(c[0][0].ndim == 5 for c in calls)
        assert [r is not None for r in upsampled] == ([True] if compiled else []), upsampled


@pytest.mark.parametrize("op", ["Attention", "AttentionBlocked"])
def test_attention_with_a_bf16_output(op, compare):
    g = Graph()
    q, k, v = g.input("q", (1, 2, 9, 8)), g.input("k", (1, 2, 13, 8)), g.input("v", (1, 2, 13, 5))
    g.mark_output("y", ops.cast(ops.scaled_dot_product_attention(q, k, v, scale=0.3), "bf16"))
    f = Fused(g)
    block = {"block": 4} if op == "AttentionBlocked" else {}
    y = f.add(op, [q, k, v], (1, 2, 9, 5), "bf16", scale=0.3, **block)
    rng = np.random.default_rng(5)
    inputs = {name: rng.standard_normal(t.shape).astype(np.float32) for name, t in
              (("q", q), ("k", k), ("v", v))}
    got, _ = compare(g, f.program(y=y), inputs, dtype="bf16")
    assert got["y"].dtype == ml_dtypes.bfloat16


@pytest.mark.parametrize("compiled", [True, False], ids=["numba", "numpy"])
def test_kernels_split_over_threads_give_the_same_bits_as_one_thread(compiled, numpy_runtime, monkeypatch):
    """Elementwise tiles, Copy/Concat boxes and the row kernels (norms, softmax, attention; compiled by numba or
    numpy's passes) cut into parts run on worker threads: the same bits as one thread, whatever the part count,
    and the reference's values."""
    from luminal_recipes.compiler import SearchOptions, compile_graph
    from luminal_recipes.runtimes.cpu import jit
    from luminal_recipes.runtimes.cpu import threads as cpu_threads
    from luminal_recipes.runtimes.kernels import expression as expr

    if compiled and not jit.AVAILABLE:
        pytest.skip("numba is not installed (luminal-recipes[jit])")
    monkeypatch.setattr(jit, "AVAILABLE", compiled)

    g, inputs = _padded_graph()
    x = g.input("x", (2, 6, 40))
    g.mark_output("silu", ops.silu(x) * x)
    g.mark_output("softmax", ops.softmax(x, -1))
    g.mark_output("layer_norm", ops.layer_norm(x, None, None, 1e-5))
    g.mark_output("rms_norm", ops.rms_norm(x, None, 1e-6))
    q = x.reshape((2, 6, 4, 10)).transpose(1, 2)
    g.mark_output("attention", ops.scaled_dot_product_attention(q, q * 0.5, q + 1.0))
    inputs["x"] = np.random.default_rng(1).standard_normal((2, 6, 40)).astype(np.float32)
    runtime = numpy_runtime
    program = compile_graph(g, runtime, options=SearchOptions(use_cache=False, time_top=0)).program
    counts = program.kernel_counts()
    assert {"Concat", "Elementwise", "Softmax", "LayerNorm", "RMSNorm"} <= set(counts), counts
    assert counts.get("Attention", 0) + counts.get("AttentionBlocked", 0) == 1, counts
    want = run_reference(g, inputs)
    results = []
    for threads in (1, 2, 3):
        monkeypatch.setattr(cpu_threads, "THREADS", threads)
        monkeypatch.setattr(cpu_threads, "MIN_PART", 1)  # split even these small kernels
        monkeypatch.setattr(elementwise_kernels, "JIT_PART_ELEMS", 1)
        monkeypatch.setattr(expr, "TILE_ELEMS", 16)  # many tiles per Elementwise
        results.append(runtime.run(program, inputs))
    for name in want:
        np.testing.assert_allclose(results[0][name], want[name], rtol=1e-5, atol=1e-5, err_msg=name)
        for other in results[1:]:
            assert np.array_equal(other[name], results[0][name]), name


ELEMENTWISE_EXPRESSIONS = [
    "(Mul (Mul in0 (Recip (Add (Exp (Mul in0 (Const -1.0))) (Const 1.0)))) in1)",  # SwiGLU
    "(Add (Mul (Mul in0 in1) in2) (Mul in3 (Add in1 (Const 1.0))))",  # modulation, RoPE
    "(Add (Sqrt (Mul in0 in0)) (Mod in1 (Const 0.75)))",
    "(Mul (Sin in0) (Exp2 (Log2 (Add (Mul in1 in1) (Const 0.5)))))",
    "in1",
]


@pytest.mark.parametrize("text", ELEMENTWISE_EXPRESSIONS)
def test_compiled_elementwise_gives_numpys_values_on_every_layout(text, numpy_runtime, monkeypatch):
    """The f32 Elementwise kernel compiled by numba (register code over tiles, ``numba_kernels.elementwise_tiles``)
    against numpy's passes on the same Program: operands row-strided, transposed, broadcast, padded, a 5-axis
    output (boxes per leading index), unit axes; split over 1-3 parts with tiles cut inside rows. Bits equal
    except where exp, sin or log2 round differently (numba's and numpy's libraries), and ``inf`` and ``nan`` as
    numpy gives them."""
    from luminal_recipes.runtimes.cpu import jit
    from luminal_recipes.runtimes.cpu import threads as cpu_threads
    from luminal_recipes.runtimes.cpu.kernels import elementwise as elementwise_kernels

    if not jit.AVAILABLE:
        pytest.skip("numba is not installed (luminal-recipes[jit])")
    g = Graph()
    wide = g.input("wide", (3, 1, 6, 2, 40))  # in0: a column slice of a wider tensor (row-strided)
    t = g.input("t", (3, 1, 6, 20, 2))  # in1: transposed last two axes
    s = g.input("s", (3, 1, 1, 1, 20))  # in2: broadcast over two axes
    p = g.input("p", (3, 1, 6, 2, 17))  # in3: zero-padded to 20 (gathered into scratch)
    shape = (3, 1, 6, 2, 20)
    f = Fused(g)
    views = [wide.slice(4, 10, 30), t.transpose(3, 4), s.broadcast_to(shape), p.pad(4, 1, 2)]
    y = f.add("Elementwise", views[: 1 + max(int(i) for i in __import__("re").findall(r"in(\d)", text))],
              shape, expr=text)
    rng = np.random.default_rng(3)
    inputs = {n.name: (rng.standard_normal(n.shape) * 40).astype(np.float32)
              for n in g.nodes if n.op == "Input"}
    inputs["wide"][0, 0, 0, 0, 10:13] = [np.inf, -np.inf, np.nan]
    program = f.program(y=y)
    monkeypatch.setattr(elementwise_kernels, "JIT_TILE", 16)  # tiles of rows, and pieces of one row
    monkeypatch.setattr(elementwise_kernels, "JIT_PART_ELEMS", 1)
    used = []
    real = elementwise_kernels._prepare_compiled_expression
    monkeypatch.setattr(elementwise_kernels, "_prepare_compiled_expression", lambda *a: used.append(1) or real(*a))
    results = {}
    for compiled, threads in ((False, 1), (True, 1), (True, 2), (True, 3)):
        monkeypatch.setattr(jit, "AVAILABLE", compiled)
        monkeypatch.setattr(cpu_threads, "THREADS", threads)
        results[compiled, threads] = runtime_out = numpy_runtime.run(program, inputs)["y"]
        assert runtime_out.shape == shape
    assert len(used) == 3  # the compiled kernel ran where numba was allowed
    want = results[False, 1]
    exact = not any(op in text for op in ("Exp", "Sin", "Log2"))
    for key, got in results.items():
        assert np.array_equal(np.isnan(got), np.isnan(want)), key
        if exact:
            assert np.array_equal(got, want, equal_nan=True), key
        else:
            np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-30, err_msg=str(key))
        if key[0]:  # compiled: the same bits on any part count
            assert np.array_equal(got, results[True, 1], equal_nan=True), key


@pytest.mark.parametrize("text", ELEMENTWISE_EXPRESSIONS)
def test_compiled_elementwise_in_place_and_on_reversed_pairs(text, numpy_runtime, monkeypatch):
    """The compiled Elementwise kernel reads contiguous tiles in place and computes its last operation straight
    into the output: also right when the memory planner makes it write over its own input (in place), and with
    operands that only the register copies can read (RoPE's pairs read reversed, rows of two). Compiled and numpy
    passes agree, on 1-3 parts."""
    from luminal_recipes.runtimes.cpu import jit
    from luminal_recipes.runtimes.cpu import threads as cpu_threads
    from luminal_recipes.runtimes.cpu.kernels import elementwise as elementwise_kernels

    if not jit.AVAILABLE:
        pytest.skip("numba is not installed (luminal-recipes[jit])")
    g = Graph()
    shape = (3, 7, 5, 2)  # pairs innermost, as ops.apply_rope(style="pairs") computes
    x = g.input("x", shape)
    r = g.input("r", shape)
    f = Fused(g)
    first = f.add("Elementwise", [x], shape, expr="(Mul in0 (Const 2.0))")
    scratch = f.edge(first)
    views = [scratch, r.flip(3), (first, scratch[1].flip(3)), r]
    y = f.add("Elementwise", views[: 1 + max(int(i) for i in __import__("re").findall(r"in(\d)", text))], shape,
              expr=text)
    program = f.program(y=y)
    rng = np.random.default_rng(5)
    inputs = {name: (rng.standard_normal(shape) * 3).astype(np.float32) for name in ("x", "r")}
    monkeypatch.setattr(elementwise_kernels, "JIT_TILE", 16)
    monkeypatch.setattr(elementwise_kernels, "JIT_PART_ELEMS", 1)
    results = {}
    for compiled, threads in ((False, 1), (True, 1), (True, 2), (True, 3)):
        monkeypatch.setattr(jit, "AVAILABLE", compiled)
        monkeypatch.setattr(cpu_threads, "THREADS", threads)
        exe = numpy_runtime.load(program, {})
        results[compiled, threads] = exe.run(inputs)["y"]
        if text.count("in2") == 0:  # only the identity read of the first kernel's output: written in place
            assert exe.plan.aliases.get(y) == first, exe.plan.aliases
    want = results[False, 1]
    for key, got in results.items():
        if "Exp" in text or "Sin" in text or "Log2" in text:
            np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-30, err_msg=str(key))
        else:
            assert np.array_equal(got, want, equal_nan=True), key


@pytest.mark.parametrize("heads_first", [True, False])
@pytest.mark.parametrize("kind", ["RMSNorm", "LayerNorm", "Softmax", "RMSNorm weighted", "LayerNorm affine"])
def test_compiled_row_kernels_read_per_head_rows_in_place(kind, heads_first, numpy_runtime, monkeypatch):
    """A row kernel on per-head rows of a fused q/k/v projection ([H, S, D] with heads D apart and tokens 3HD
    apart: no single row stride) reads them in place, one [S, D] block per head, rows dealt out over the cores,
    with a norm's scale and shift vectors (FLUX.2's q/k RMSNorm weight) applied in the same pass: numpy's passes
    (which gather the view into scratch first) and the reference agree. Token-major ([1, S, H, D], diffusers'
    layout) is read as the same per-head blocks."""
    from luminal_recipes.runtimes.cpu import jit
    from luminal_recipes.runtimes.cpu import threads as cpu_threads
    from luminal_recipes.runtimes.cpu.kernels import norms as norms_kernels

    if not jit.AVAILABLE:
        pytest.skip("numba is not installed (luminal-recipes[jit])")
    g = Graph()
    qkv = g.input("qkv", (1, 37, 3 * 4 * 8))
    q = qkv.slice(2, 32, 64).reshape((1, 37, 4, 8))  # k's heads: [1, 37, 4, 8]
    if heads_first:
        q = q.transpose(1, 2)  # [1, 4, 37, 8]
    w = g.input("w", (8,))
    b = g.input("b", (8,))
    fn = {"RMSNorm": lambda t: ops.rms_norm(t, None, 1e-6), "LayerNorm": lambda t: ops.layer_norm(t, None, None, 1e-5),
          "Softmax": lambda t: ops.softmax(t, -1), "RMSNorm weighted": lambda t: ops.rms_norm(t, w, 1e-6),
          "LayerNorm affine": lambda t: ops.layer_norm(t, None, None, 1e-5) * w.broadcast_to(t.shape)
          + b.broadcast_to(t.shape)}[kind]
    f = Fused(g)
    op = kind.split()[0]
    attrs = {} if op == "Softmax" else {"eps": 1e-6 if op == "RMSNorm" else 1e-5}
    affine = [w.broadcast_to(q.shape), b.broadcast_to(q.shape)][: {"weighted": 1, "affine": 2}.get(kind.split()[-1], 0)]
    y = f.add(op, [q, *affine], tuple(q.shape), **attrs)
    g.mark_output("y", fn(q))
    rng = np.random.default_rng(4)
    inputs = {"qkv": rng.standard_normal((1, 37, 96)).astype(np.float32) * 3,
              "w": rng.standard_normal(8).astype(np.float32), "b": rng.standard_normal(8).astype(np.float32)}
    used = []
    real = norms_kernels._prepare_compiled_blocks
    monkeypatch.setattr(norms_kernels, "_prepare_compiled_blocks", lambda *a: used.append(1) or real(*a))
    monkeypatch.setattr(cpu_threads, "MIN_PART", 1)
    results = []
    for compiled, threads in ((True, 1), (True, 2), (True, 3), (False, 1)):
        monkeypatch.setattr(jit, "AVAILABLE", compiled)
        monkeypatch.setattr(cpu_threads, "THREADS", threads)
        results.append(numpy_runtime.run(f.program(y=y), inputs)["y"])
    assert len(used) == 3
    want = run_reference(g, inputs)["y"]
    for got in results:
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6)
    assert np.array_equal(results[0], results[1]) and np.array_equal(results[0], results[2])


@pytest.mark.parametrize(("fmt", "layout"), [("fp8", ""), ("nvfp4", "modelopt"), ("nvfp4", "comfy")])
def test_dequant_matmul_compiled_decoding_gives_the_numpy_bits(fmt, layout, numpy_runtime, monkeypatch):
    """``DequantMatMul`` decoded by numba's row passes (f8e4m3 scales read as bytes through their 256 values)
    gives the bits of numpy's passes (ml_dtypes' casts and table lookups), over several bands."""
    from luminal_recipes.runtimes.cpu import jit
    from luminal_recipes.runtimes.cpu.kernels import dequant as numpy_dequant

    if not jit.AVAILABLE:
        pytest.skip("numba is not installed (luminal-recipes[jit])")
    n, k = 200, 64
    rng = np.random.default_rng(3)
    g = Graph()
    x = g.input("x", (3, k))
    if fmt == "fp8":
        w_shape, s_shape = (n, k), (n,)
        wq, ws = g.weight("w", w_shape, "f8e4m3"), g.weight("ws", s_shape)
        operands = [x, wq, ws]
        weights = {"w": rng.standard_normal(w_shape).astype(ml_dtypes.float8_e4m3fn),
                   "ws": (rng.random(s_shape) + 0.5).astype(np.float32)}
    else:
        w_shape, s_shape = ((n, k // 2), (n, k // 16)) if layout == "modelopt" else ((208, k // 2), (256, 4))
        wq, ws, ws2 = g.weight("w", w_shape, "u8"), g.weight("ws", s_shape, "f8e4m3"), g.weight("ws2", ())
        operands = [x, wq, ws, ws2]
        weights = {"w": rng.integers(0, 256, w_shape).astype(np.uint8),
                   "ws": (rng.random(s_shape) * 4 + 0.25).astype(ml_dtypes.float8_e4m3fn),
                   "ws2": np.asarray(0.37, np.float32)}
        weights["ws"].view(np.uint8)[0, :2] = (0x00, 0x01)  # a zero and a subnormal scale
    f = Fused(g)
    y = f.add("DequantMatMul", operands, (3, n), format=fmt, layout=layout, out_features=n, in_features=k)
    monkeypatch.setattr(numpy_dequant, "DEQUANT_TILE", 128 * k)  # two bands (comfy: 128-row bands)
    inputs = {"x": rng.standard_normal((3, k)).astype(np.float32)}
    results = []
    for compiled in (True, False):
        monkeypatch.setattr(jit, "AVAILABLE", compiled)
        results.append(numpy_runtime.run(f.program(y=y), inputs, weights)["y"])
    assert np.array_equal(results[0], results[1])


@pytest.mark.parametrize("layout", ["in place", "gathered", "scale per sample"])
@pytest.mark.parametrize("act", ["", "silu"])
def test_group_norm_kernel_matches_torch(layout, act, numpy_runtime, monkeypatch):
    """The GroupNorm kernel (two samples of 12 channels in 4 groups, an odd image size): x read in place as its
    [N, G, n] rows, or (rows 4 elements apart) gathered into scratch first, the compiled pass per group on 1 or 2
    cores and numpy's passes agree with torch's group_norm (+ silu) in float64; a scale that varies per sample
    (not one value per channel, bf16) takes numpy's passes, which read it in place."""
    torch = pytest.importorskip("torch")
    from luminal_recipes.runtimes.cpu import jit
    from luminal_recipes.runtimes.cpu import threads as cpu_threads

    g = Graph()
    x = g.input("x", (2, 12, 5, 7) if layout != "gathered" else (2, 105, 4))
    rows = x.reshape((2, 4, 105)) if layout != "gathered" else x.transpose(1, 2)  # [N, G, n]
    if layout == "scale per sample":  # and in bf16
        w = g.input("w", (2, 12), "bf16")
        scale = w.reshape((2, 12, 1, 1)).broadcast_to((2, 12, 5, 7))
    else:
        w = g.input("w", (12,))
        scale = w.reshape((1, 12, 1, 1)).broadcast_to((2, 12, 5, 7))
    b = g.input("b", (12,))
    shift = b.reshape((1, 12, 1, 1)).broadcast_to((2, 12, 5, 7))
    f = Fused(g)
    y = f.add("GroupNorm", [rows, scale, shift], (2, 12, 5, 7), eps=1e-6, act=act)
    rng = np.random.default_rng(5)
    inputs = {"x": (rng.standard_normal(x.shape) * 3 + 1).astype(np.float32),
              "w": rng.standard_normal(w.shape).astype(np.float32), "b": rng.standard_normal(12).astype(np.float32)}
    if layout == "scale per sample":
        inputs["w"] = inputs["w"].astype(ml_dtypes.bfloat16)
    t = {k: torch.from_numpy(v.astype(np.float64)) for k, v in inputs.items()}
    tx = t["x"] if layout != "gathered" else t["x"].transpose(1, 2).reshape(2, 12, 5, 7)
    if layout == "scale per sample":
        want = torch.nn.functional.group_norm(tx, 4, None, None, 1e-6) * t["w"].reshape(2, 12, 1, 1) + \
            t["b"].reshape(1, 12, 1, 1)
    else:
        want = torch.nn.functional.group_norm(tx, 4, t["w"], t["b"], 1e-6)
    want = (torch.nn.functional.silu(want) if act else want).numpy()
    used = []
    real = jit.kernels("image").group_norm_rows
    fake = type("K", (), {"group_norm_rows": staticmethod(lambda *a: used.append(1) or real(*a))})
    monkeypatch.setattr(jit, "kernels", lambda family="core": fake)
    monkeypatch.setattr(cpu_threads, "MIN_PART", 1)
    results = []
    for compiled, threads in ((True, 1), (True, 2), (False, 1)):
        monkeypatch.setattr(jit, "AVAILABLE", compiled)
        monkeypatch.setattr(cpu_threads, "THREADS", threads)
        results.append(numpy_runtime.run(f.program(y=y), inputs)["y"])
    assert bool(used) == (layout != "scale per sample")  # the compiled pass ran (per channel vectors only)
    if layout == "scale per sample":  # numpy's passes read the broadcast scale and shift in place, not copied out
        (_, scratch), = [v for nid, v in numpy_runtime.prepare(f.program(y=y)).items() if nid == y]
        assert scratch.nbytes < 2 * 4 * (2 * 12 * 5 * 7), scratch.nbytes  # one work tensor and the statistics
    for got in results:
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert np.array_equal(results[0], results[1])  # the same bits on any number of cores


@pytest.mark.parametrize(("m", "k", "n"), [(16, 32, 700), (300, 64, 40), (5, 3, 7)])
def test_blas_matmul_chunks_match_the_reference(m, k, n, numpy_runtime, monkeypatch):
    """A MatMul on BLAS (AMX refused) cut into chunks of columns (few rows: a VAE's 1x1 convolution) or of
    rows, taken in turn by the cores, each a single-threaded BLAS call: the reference's values, and the same
    values on one and two threads; a small product is one call."""
    from luminal_recipes.runtimes.cpu import amx
    from luminal_recipes.runtimes.cpu import threads as cpu_threads

    rng = np.random.default_rng(m + n)
    g = Graph()
    w, x = g.weight("w", (m, k)), g.input("x", (k, n))
    g.mark_output("y", ops.matmul(w, x))
    f = Fused(g)
    y = f.add("MatMul", [w, x], (m, n))
    inputs, weights = {"x": rng.standard_normal((k, n)).astype(np.float32)}, {
        "w": rng.standard_normal((m, k)).astype(np.float32)}
    monkeypatch.setattr(amx, "worth_it", lambda *args, **kwargs: False)
    monkeypatch.setattr(matmul_kernels, "BLAS_PART_MACS", 1 if m * n > 100 else 1 << 30)
    claimed = []
    real = cpu_threads.claimed
    monkeypatch.setattr(cpu_threads, "claimed", lambda count, *a: claimed.append(count) or real(count, *a))
    real_sgemm = matmul_kernels._sgemm_product

    def sgemm(*args):  # on several threads, the same chunks as compiled BLAS calls (jit/f32_kernels.py)
        step = real_sgemm(*args)
        if step is not None:
            claimed.append(len(step.chain[1][0].args[1]))  # the chunks the cores take in turn
        return step

    monkeypatch.setattr(matmul_kernels, "_sgemm_product", sgemm)
    results = []
    for threads in (1, 2):
        monkeypatch.setattr(cpu_threads, "THREADS", threads)
        results.append(numpy_runtime.run(f.program(y=y), inputs, weights)["y"])
    want = run_reference(g, {**inputs, **weights})["y"]
    for got in results:
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert claimed == ([] if m * n <= 100 else [8])  # two threads: four chunks per core


@pytest.mark.parametrize("layout", ["fused projection", "gathered"])
def test_rms_norm_rope_kernel_matches_torch_and_diffusers(layout, numpy_runtime, monkeypatch):
    """RMSNormRoPE (FLUX.2's q/k: RMSNorm with its weight, then the rotation of adjacent pairs) agrees with
    torch's rms_norm and diffusers' ``apply_rotary_emb`` (FLUX's real, interleaved form) in float64: the compiled
    pass reading k's per-head rows out of a fused q/k/v projection in place (1-3 cores, the same bits), and numpy's
    passes (numba missing, or x transposed: its rows not contiguous)."""
    torch = pytest.importorskip("torch")
    embeddings = pytest.importorskip("diffusers.models.embeddings")
    from luminal_recipes.runtimes.cpu import jit
    from luminal_recipes.runtimes.cpu import threads as cpu_threads

    g = Graph()
    if layout == "fused projection":
        qkv = g.input("qkv", (1, 37, 3 * 4 * 8))
        k = qkv.slice(2, 32, 64).reshape((1, 37, 4, 8)).transpose(1, 2)  # [1, 4, 37, 8]
    else:
        qkv = g.input("qkv", (1, 4, 8, 37))
        k = qkv.transpose(2, 3)
    w, cos, sin = g.input("w", (8,)), g.input("cos", (37, 8)), g.input("sin", (37, 8))
    pairs = (1, 4, 37, 4, 2)
    f = Fused(g)
    y = f.add("RMSNormRoPE", [k, w.broadcast_to(k.shape), cos.broadcast_to(k.shape).reshape(pairs),
                              sin.broadcast_to(k.shape).reshape(pairs)], pairs, eps=1e-6)
    rng = np.random.default_rng(6)
    angles = rng.random((37, 4)) * 6
    inputs = {"qkv": rng.standard_normal(qkv.shape).astype(np.float32) * 3,
              "w": rng.standard_normal(8).astype(np.float32),
              "cos": np.repeat(np.cos(angles), 2, -1).astype(np.float32),
              "sin": np.repeat(np.sin(angles), 2, -1).astype(np.float32)}
    t = {name: torch.from_numpy(v.astype(np.float64)) for name, v in inputs.items()}
    tk = t["qkv"][..., 32:64].reshape(1, 37, 4, 8).transpose(1, 2) if layout == "fused projection" else \
        t["qkv"].transpose(2, 3)
    normed = torch.nn.functional.rms_norm(tk, (8,), t["w"], 1e-6)
    want = embeddings.apply_rotary_emb(normed, (t["cos"], t["sin"]), use_real=True, use_real_unbind_dim=-1)
    want = want.numpy().reshape(pairs)
    used = []
    real = norms_kernels._prepare_compiled_rope
    monkeypatch.setattr(norms_kernels, "_prepare_compiled_rope", lambda *a: used.append(1) or real(*a))
    monkeypatch.setattr(cpu_threads, "MIN_PART", 1)
    results, numba = [], jit.AVAILABLE
    for compiled, threads in ((True, 1), (True, 2), (True, 3), (False, 1)):
        monkeypatch.setattr(jit, "AVAILABLE", compiled and numba)
        monkeypatch.setattr(cpu_threads, "THREADS", threads)
        results.append(numpy_runtime.run(f.program(y=y), inputs)["y"])
    assert len(used) == (3 if layout == "fused projection" and numba else 0)
    for got in results:
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert np.array_equal(results[0], results[1]) and np.array_equal(results[0], results[2])
