"""Every fused kernel of the numpy runtime against the reference interpreter on the primitive graph it
replaces.

Each test builds the op-library graph (the oracle, run by ``run_reference``) and, in the same node list, the
fused kernel node the compiler would emit, reading the same inputs through the same kind of views (transposed,
padded, broadcast, grouped-query). Tile sizes are shrunk with ``monkeypatch`` where a test must cross tile
boundaries.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from fused_programs import Fused

from luminal_recipes import ops
from luminal_recipes.errors import InputError
from luminal_recipes.graph import Graph, View, cast, run_reference
from luminal_recipes.runtimes.cpu.backend import NumpyBackend
from luminal_recipes.runtimes.cpu.kernels import attention as numpy_attention
from luminal_recipes.runtimes.cpu.kernels import conv as conv_kernels
from luminal_recipes.runtimes.cpu.kernels import dequant as numpy_dequant
from luminal_recipes.runtimes.cpu.kernels import norms as norms_kernels
from luminal_recipes.runtimes.kernels import expression as expr_module


def randn(rng, *shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


# ---- MatMul ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("ta", "tb"), [(False, False), (True, False), (False, True), (True, True)])
def test_matmul_all_transpose_layouts(ta, tb, compare, rng):
    m, k, n = 7, 17, 5
    g = Graph()
    a = g.input("a", (k, m) if ta else (m, k))
    b = g.input("b", (n, k) if tb else (k, n))
    av, bv = (a.T if ta else a), (b.T if tb else b)
    g.mark_output("y", ops.matmul(av, bv))
    f = Fused(g)
    y = f.add("MatMul", [av, bv], (m, n))
    inputs = {"a": randn(rng, *a.shape), "b": randn(rng, *b.shape)}
    compare(g, f.program(y=y), inputs)


def test_matmul_linear_over_batch_with_bias_and_symbolic_rows(compare, rng):
    """A linear layer: x [B, s, K] @ W.T broadcast over the batch, plus a broadcast bias; one GEMM of B*s
    rows."""
    g = Graph()
    x = g.input("x", (2, "s", 24))
    w = g.weight("w", (12, 24))
    bias = g.weight("bias", (12,))
    g.mark_output("y", ops.linear(x, w, bias))
    f = Fused(g)
    shape = (2, x.shape[1], 12)
    wv = w.T.unsqueeze(0).broadcast_to((2, 24, 12))  # as ops.matmul broadcasts it: stride 0 over the batch
    y = f.add("MatMul", [x, wv, bias.broadcast_to(shape)], shape)
    weights = {"w": randn(rng, 12, 24), "bias": randn(rng, 12)}
    for s in (1, 5):
        compare(g, f.program(y=y), {"x": randn(rng, 2, s, 24)}, weights, {"s": s})


def test_batched_matmul_with_broadcast_batch_axes(compare, rng):
    """a [B, H, M, K] @ b [B, 1->H, K, N]: b is shared across heads by a stride-0 axis (no copy)."""
    g = Graph()
    a = g.input("a", (2, 3, 4, 9))
    b = g.input("b", (2, 1, 9, 6))
    bv = b.broadcast_to((2, 3, 9, 6))
    g.mark_output("y", ops.matmul(a, bv))
    f = Fused(g)
    y = f.add("MatMul", [a, bv], (2, 3, 4, 6))
    compare(g, f.program(y=y), {"a": randn(rng, 2, 3, 4, 9), "b": randn(rng, 2, 1, 9, 6)})


def test_matmul_bf16_operands_accumulate_in_f32(compare, rng):
    g = Graph()
    a = g.input("a", (6, 32), "bf16")
    b = g.input("b", (32, 5), "bf16")
    g.mark_output("y", ops.matmul(a, b))
    f = Fused(g)
    y = f.add("MatMul", [a, b], (6, 5), "bf16")
    bf16 = ml_dtypes.bfloat16
    inputs = {"a": randn(rng, 6, 32, dtype=bf16), "b": randn(rng, 32, 5, dtype=bf16)}
    got, _ = compare(g, f.program(y=y), inputs, dtype="bf16")
    exact = (inputs["a"].astype(np.float32) @ inputs["b"].astype(np.float32)).astype(ml_dtypes.bfloat16)
    assert np.array_equal(got["y"], exact)  # f32 accumulation, one rounding at the end


# ---- Elementwise -------------------------------------------------------------------------------------------
def test_elementwise_chain_with_broadcast_and_padded_inputs(compare, rng):
    """x * sigmoid(x + b) with b broadcast over rows and x read through a zero-padded view."""
    g = Graph()
    x0 = g.input("x", (5, 6))
    b = g.input("b", (8,))
    x = x0.pad(1, 1, 1)  # [5, 8], zeros in columns 0 and 7
    bb = b.broadcast_to((5, 8))
    g.mark_output("y", x * ops.sigmoid(x + bb))
    f = Fused(g)
    # sigmoid(z) = 1 / (1 + 2^(-z log2 e)), written as the compiler's fused expression
    e = ("(Mul in0 (Recip (Add (Exp2 (Mul (Mul (Add in0 in1) (Const -1.0)) (Const 1.4426950408889634))) "
         "(Const 1.0))))")
    y = f.add("Elementwise", [x, bb], (5, 8), expr=e)
    compare(g, f.program(y=y), {"x": randn(rng, 5, 6), "b": randn(rng, 8)})


def test_elementwise_casts_and_comparisons(compare, rng):
    """relu as x * f32(0 < x), and a bool output."""
    g = Graph()
    x = g.input("x", (4, 7))
    zero = g.constant(0.0).broadcast_to((4, 7))
    g.mark_output("relu", x * cast(zero < x, "f32"))
    g.mark_output("pos", zero < x)
    f = Fused(g)
    relu = f.add("Elementwise", [x], (4, 7), expr="(Mul in0 (Cast f32 (LessThan (Const 0.0) in0)))")
    pos = f.add("Elementwise", [x], (4, 7), "bool", expr="(LessThan (Const 0.0) in0)")
    got, want = compare(g, f.program(relu=relu, pos=pos), {"x": randn(rng, 4, 7)}, names=["relu"])
    assert got["pos"].dtype == np.bool_ and np.array_equal(got["pos"], want["pos"])


def test_elementwise_integer_arithmetic_stays_exact(runtime, rng):
    g = Graph()
    i = g.input("i", (9,), "i32")
    f = Fused(g)
    e = "(Mod (Add (Mul in0 (Const 3)) (Const 16777217)) (Const 7))"
    y = f.add("Elementwise", [i], (9,), "i32", expr=e)
    vals = rng.integers(-1000, 1000, 9).astype(np.int32)
    got = runtime.run(f.program(y=y), {"i": vals})["y"]
    assert got.dtype == np.int32
    assert np.array_equal(got, np.fmod(vals * 3 + 16777217, 7))  # 16777217 is not an f32: ints stay ints


def test_elementwise_rounds_once_into_a_narrow_output(runtime, rng):
    g = Graph()
    a, b = g.input("a", (3, 50)), g.input("b", (3, 50))
    f = Fused(g)
    y = f.add("Elementwise", [a, b], (3, 50), "bf16", expr="(Add (Mul in0 in1) (Const 1.0))")
    ins = {"a": randn(rng, 3, 50), "b": randn(rng, 3, 50)}
    got = runtime.run(f.program(y=y), ins)["y"]
    assert np.array_equal(got, (ins["a"] * ins["b"] + np.float32(1)).astype(ml_dtypes.bfloat16))


def test_elementwise_tiles_cover_every_element(compare, rng, monkeypatch):
    monkeypatch.setattr(expr_module, "TILE_ELEMS", 50)
    g = Graph()
    x = g.input("x", (3, 7, 11))
    xt = x.permute(2, 0, 1)  # a strided read: [11, 3, 7]
    g.mark_output("y", ops.exp(xt) * xt)
    f = Fused(g)
    y = f.add("Elementwise", [xt], (11, 3, 7), expr="(Mul (Exp2 (Mul in0 (Const 1.4426950408889634))) in0)")
    compare(g, f.program(y=y), {"x": randn(rng, 3, 7, 11)})


def test_elementwise_rejects_a_malformed_expression(runtime):
    g = Graph()
    x = g.input("x", (3,))
    f = Fused(g)
    y = f.add("Elementwise", [x], (3,), expr="(Frobnicate in0)")
    with pytest.raises(ValueError, match="Frobnicate"):
        runtime.load(f.program(y=y))


# ---- Softmax and norms -------------------------------------------------------------------------------------
@pytest.mark.parametrize("view", ["contiguous", "transposed"])
@pytest.mark.parametrize("kernel", ["Softmax", "LayerNorm", "RMSNorm"])
def test_row_kernels(kernel, view, compare, rng, monkeypatch):
    monkeypatch.setattr(norms_kernels, "ROW_TILE", 100)  # several row tiles
    g = Graph()
    x0 = g.input("x", (2, 33, 9) if view == "transposed" else (2, 9, 33))
    x = x0.transpose(1, 2) if view == "transposed" else x0  # [2, 9, 33]
    ref = {"Softmax": lambda t: ops.softmax(t, -1), "LayerNorm": lambda t: ops.layer_norm(t, eps=1e-5),
           "RMSNorm": lambda t: ops.rms_norm(t, eps=1e-6)}[kernel]
    g.mark_output("y", ref(x))
    f = Fused(g)
    attrs = {} if kernel == "Softmax" else {"eps": 1e-5 if kernel == "LayerNorm" else 1e-6}
    y = f.add(kernel, [x], (2, 9, 33), **attrs)
    compare(g, f.program(y=y), {"x": 3 * randn(rng, *x0.shape)})


def test_group_norm_is_layer_norm_on_the_grouped_view(compare, rng):
    g = Graph()
    x = g.input("x", (2, 8, 3, 5))
    g.mark_output("y", ops.group_norm(x, 4, eps=1e-5))
    f = Fused(g)
    grouped = x.reshape(2, 4, 30)
    y = f.add("LayerNorm", [grouped], (2, 4, 30), eps=1e-5)
    program = f.program()
    program.outputs["y"] = (y, View.contiguous((2, 4, 30)).reshape((2, 8, 3, 5)))
    compare(g, program, {"x": randn(rng, 2, 8, 3, 5)})


def test_softmax_bf16_input_and_output(compare, rng):
    g = Graph()
    x = g.input("x", (4, 40), "bf16")
    g.mark_output("y", ops.softmax(x, -1))
    f = Fused(g)
    y = f.add("Softmax", [x], (4, 40), "bf16")
    compare(g, f.program(y=y), {"x": randn(rng, 4, 40, dtype=ml_dtypes.bfloat16)}, dtype="bf16")


# ---- Attention ---------------------------------------------------------------------------------------------
def _attention_case(g: Graph, with_bias: bool, s: int = 5, b: int = 2):
    h, hkv, t, d, dv = 4, 2, 11, 8, 8
    q = g.input("q", (b, h, s, d))
    k = g.input("k", (b, hkv, t, d))
    v = g.input("v", (b, hkv, t, dv))
    bias = g.input("bias", (b, 1, s, t)) if with_bias else None
    g.mark_output("y", ops.scaled_dot_product_attention(q, k, v, mask=bias, scale=0.3))
    rep = h // hkv
    views = [q.split_dim(1, (hkv, rep)),  # grouped-query heads share their kv head by stride-0 views
             k.unsqueeze(2).broadcast_to((b, hkv, rep, t, d)),
             v.unsqueeze(2).broadcast_to((b, hkv, rep, t, dv))]
    if with_bias:
        views.append(bias.unsqueeze(1).broadcast_to((b, hkv, rep, s, t)))
    inputs = {"q": np.random.default_rng(0).standard_normal((b, h, s, d)).astype(np.float32),
              "k": np.random.default_rng(1).standard_normal((b, hkv, t, d)).astype(np.float32),
              "v": np.random.default_rng(2).standard_normal((b, hkv, t, dv)).astype(np.float32)}
    if with_bias:
        mask = np.random.default_rng(3).random((b, 1, s, t)) < 0.3
        mask[..., 0] = False  # every query may attend somewhere
        inputs["bias"] = np.where(mask, np.finfo(np.float32).min, 0.0).astype(np.float32)
    return views, (b, hkv, rep, s, dv), (b, h, s, dv), inputs


def _grouped_output(f: Fused, node: int, grouped, merged):
    program = f.program()
    program.outputs["y"] = (node, View.contiguous(grouped).reshape(merged))
    return program


@pytest.mark.parametrize("with_bias", [False, True])
def test_attention(with_bias, compare, monkeypatch):
    monkeypatch.setattr(numpy_attention, "ATTENTION_TILE", 22)  # query blocks of 2 rows
    g = Graph()
    views, grouped, merged, inputs = _attention_case(g, with_bias)
    f = Fused(g)
    y = f.add("Attention", views, grouped, scale=0.3)
    compare(g, _grouped_output(f, y, grouped, merged), inputs)


def runs_numpy_attention(runtime) -> bool:
    """The runtime runs the numpy attention kernels (whose own paths these tests check besides the values)."""
    return getattr(getattr(runtime, "backend", None), "kernels", {}).get("Attention") is \
        NumpyBackend.kernels["Attention"]


@pytest.mark.parametrize("with_bias", [False, True])
def test_attention_decoding_one_query_row(with_bias, compare, runtime, monkeypatch):
    """One query per head (a decoding step): the numpy kernel stacks the heads of a kv head into one block of
    rows (with numba: every group in one compiled call, ``attention_rows``); the reference's values."""
    from luminal_recipes.runtimes.cpu import jit

    stacked = []
    find = numpy_attention._shared_kv_rows

    def spy(*a, **kw):
        stacked.append((kw.get("flat", False), find(*a, **kw)))
        return stacked[-1][1]

    monkeypatch.setattr(numpy_attention, "_shared_kv_rows", spy)
    g = Graph()
    views, grouped, merged, inputs = _attention_case(g, with_bias, s=1)
    f = Fused(g)
    y = f.add("Attention", views, grouped, scale=0.3)
    compare(g, _grouped_output(f, y, grouped, merged), inputs)
    if runs_numpy_attention(runtime):
        assert stacked
        flat, found = stacked[-1]
        # the bias [b, 1, s, t] read per (batch, kv head) does not merge those two axes into one: per group then
        assert flat == (jit.AVAILABLE and not with_bias)
        if flat:  # q [groups, rows, d]: 2 kv heads of 2 queries, batch 2
            assert found[0].shape == (4, 2, 8) and found[3] is None
        else:
            assert [q.shape[0] for q, *_ in found] == [2] * 4


def test_attention_decoding_with_a_mask_in_one_compiled_call(compare, runtime, monkeypatch):
    """Decoding one sequence with a key mask (as the KV cache's causal mask): every kv head's queries in one
    compiled call where numba is installed; the reference's values."""
    from luminal_recipes.runtimes.cpu import jit

    calls = []
    step = numpy_attention._rows_step
    monkeypatch.setattr(numpy_attention, "_rows_step", lambda *a: calls.append(step(*a)) or calls[-1])
    g = Graph()
    views, grouped, merged, inputs = _attention_case(g, True, s=1, b=1)
    f = Fused(g)
    y = f.add("Attention", views, grouped, scale=0.3)
    compare(g, _grouped_output(f, y, grouped, merged), inputs)
    if runs_numpy_attention(runtime) and jit.AVAILABLE:
        assert calls and calls[-1] is not None


@pytest.mark.parametrize("with_bias", [False, True])
def test_decoding_attention_cut_over_threads_in_a_chain_gives_the_whole_calls_bits(with_bias, monkeypatch):
    """Decoding's attention in one compiled call (``_rows_step``), in a chain run in lockstep cut over the threads
    by query rows (``rechain``), each part with its own scratch row: the same bits as the whole call, and f64
    softmax attention's values."""
    from luminal_recipes.runtimes.cpu import jit
    from luminal_recipes.runtimes.cpu import threads as cpu_threads

    if not jit.AVAILABLE:
        pytest.skip("numba is not installed")
    monkeypatch.setattr(cpu_threads, "THREADS", 3)
    rng = np.random.default_rng(5)
    groups, rows, t, d = 3, 3, 40, 16
    q, k, v = (rng.standard_normal(shape).astype(np.float32) for shape in ((groups, rows, d), (groups, t, d),
                                                                           (groups, t, d)))
    bias = np.where(rng.random((groups, rows, t)) < 0.3, -np.inf, 0).astype(np.float32) if with_bias else None
    qs, sc = np.zeros((groups * rows, d), np.float32), np.zeros((groups * rows, t), np.float32)
    whole, parted = np.zeros((groups, rows, d), np.float32), np.zeros((groups, rows, d), np.float32)
    step = numpy_attention._rows_step([q, k, v, bias, whole], np.float32(0.3), qs, sc)
    step()
    again = numpy_attention._rows_step([q, k, v, bias, parted], np.float32(0.3), qs, sc)
    (phase,) = again.rechain()
    assert [c.part for c in phase] == [0, 1, 2] and len({id(c.args[9]) for c in phase}) == 3  # own sc rows
    for call in reversed(phase):  # any order: the parts are independent
        call.fn(*call.args)
    assert np.array_equal(parted, whole)
    scores = np.einsum("grd,gtd->grt", q.astype(np.float64) * 0.3, k) + (0 if bias is None else bias)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    want = np.einsum("grt,gtd->grd", p / p.sum(-1, keepdims=True), v)
    assert np.abs(whole - want).max() < 1e-5


def test_decoding_attention_skips_a_kv_caches_unfilled_rows_with_the_same_bits():
    """Decoding's compiled attention (``attention_rows``) leaves the keys a row masks at either end unread (a KV
    cache's rows past the decoded position; a sliding window's first keys): rows there holding NaN do not reach
    the output, which has the bits of the call that reads every key (``keep`` = inf: no row may skip), and f64
    softmax attention's values. A row whose keys are all masked still takes its softmax over all of them."""
    from luminal_recipes.runtimes.cpu import jit

    if not jit.AVAILABLE:
        pytest.skip("numba is not installed")
    kernel = jit.kernels().attention_rows
    rng = np.random.default_rng(7)
    groups, rows, t, d = 2, 3, 48, 16
    q = rng.standard_normal((groups, rows, d)).astype(np.float32)
    k, v = (rng.standard_normal((groups, t, d)).astype(np.float32) for _ in range(2))
    bias = np.zeros((groups, rows, t), np.float32)
    filled = [(3, 29), (0, 41), (5, 48), (0, 0), (2, 17), (0, 48)]  # per query row, the keys it sees
    for u, (lo, hi) in enumerate(filled):
        g, r = divmod(u, rows)
        bias[g, r, :lo] = np.float32(-3.4e38) if u % 2 else -np.inf
        bias[g, r, hi:] = -np.inf if u % 2 else np.float32(-3.4e38)
    bias[0, 0, 10] = -np.inf  # a masked key inside the span: computed as before (weight 0)
    bias[1, 0] = np.float32(-3.4e38)  # fully masked (finite): the softmax of its equal scores, the mean of v

    def run(k, v, keep):
        out = np.zeros((groups, rows, d), np.float32)
        geometry = np.array([groups, rows, t, d, d, rows * d, d, t * d, d, t * d, d, rows * t, t, rows * d, d, 0,
                             groups * rows], np.int64)
        kernel(q.reshape(-1), k.reshape(-1), v.reshape(-1), bias.reshape(-1), out.reshape(-1), geometry, True,
               np.float32(0.3), np.zeros(d, np.float32), np.zeros(t, np.float32), np.float32(-1e37), keep)
        return out

    whole = run(k, v, np.float32(np.inf))
    k_nan, v_nan = k.copy(), v.copy()
    for u, (lo, hi) in enumerate(filled):
        if hi > lo:  # rows with a key to see: what lies outside their span is never read
            g = u // rows
            k_nan[g, :min(x for x, y in filled[g * rows:(g + 1) * rows] if y > x)] = np.nan
            k_nan[g, max(y for x, y in filled[g * rows:(g + 1) * rows] if y > x):] = np.nan
    v_nan[np.isnan(k_nan)] = np.nan
    skipped = run(k_nan, v_nan, np.float32(-1e36))
    assert np.array_equal(run(k, v, np.float32(-1e36)), whole)
    seen = [u for u, (lo, hi) in enumerate(filled) if hi > lo]
    assert np.array_equal(skipped.reshape(-1, d)[seen], whole.reshape(-1, d)[seen])
    scores = np.einsum("grd,gtd->grt", q.astype(np.float64) * 0.3, k) + bias.astype(np.float64)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    want = np.einsum("grt,gtd->grd", p / p.sum(-1, keepdims=True), v)
    assert np.abs(whole - want).reshape(-1, d)[seen].max() < 1e-5
    assert np.abs(whole[1, 0] - v[1].astype(np.float64).mean(0)).max() < 1e-5


@pytest.mark.parametrize("with_bias", [False, True])
def test_attention_split_over_cores(with_bias, compare, runtime, monkeypatch):
    """Query blocks shared out over several threads, BLAS single-threaded inside: the reference's values."""
    from luminal_recipes.runtimes.cpu import threads as cpu_threads

    monkeypatch.setattr(cpu_threads, "THREADS", 3)
    monkeypatch.setattr(cpu_threads, "MIN_PART", 1)
    monkeypatch.setattr(numpy_attention, "ATTENTION_TILE", 22)  # query blocks of 2 rows
    monkeypatch.setattr(numpy_attention, "BLOCKED_ROWS", 2)
    shares = []
    run = cpu_threads.run_parts
    monkeypatch.setattr(cpu_threads, "run_parts", lambda parts: shares.append(len(parts)) or run(parts))
    g = Graph()
    views, grouped, merged, inputs = _attention_case(g, with_bias)
    f = Fused(g)
    for op, attrs in (("Attention", {}), ("AttentionBlocked", {"block": 4})):
        y = f.add(op, views, grouped, scale=0.3, **attrs)
        compare(g, _grouped_output(f, y, grouped, merged), inputs)
    if runs_numpy_attention(runtime):
        assert shares and set(shares) == {3}, shares


@pytest.mark.parametrize("op", ["Attention", "AttentionBlocked"])
def test_attention_query_blocks_give_the_same_bits_on_any_thread_count(op, numpy_runtime, assert_close, monkeypatch):
    """Heads cut into query blocks (``MIN_TASKS`` tasks at least) that the cores take in turn
    (``cpu_threads.claimed``): the reference's values, and the same bits on 1-3 threads (the blocks, whose
    row counts BLAS's bits depend on, do not depend on the thread count)."""
    from luminal_recipes.runtimes.cpu import threads as cpu_threads

    monkeypatch.setattr(cpu_threads, "MIN_PART", 1)
    monkeypatch.setattr(numpy_attention, "MIN_ROWS", 1)
    g = Graph()
    views, grouped, merged, inputs = _attention_case(g, True, s=7)
    f = Fused(g)
    y = f.add(op, views, grouped, scale=0.3, **({"block": 4} if op == "AttentionBlocked" else {}))
    program = _grouped_output(f, y, grouped, merged)
    plans, parts = [], []
    real_plan, real_claimed = numpy_attention._Plan, cpu_threads.claimed
    monkeypatch.setattr(numpy_attention, "_Plan", lambda *a: plans.append(real_plan(*a)) or plans[-1])
    monkeypatch.setattr(cpu_threads, "claimed", lambda n, slots, task: parts.append(slots) or real_claimed(
        n, slots, task))
    results = []
    for threads in (1, 2, 3):
        monkeypatch.setattr(cpu_threads, "THREADS", threads)
        results.append(numpy_runtime.run(program, inputs)["y"])
    assert_close("runtime", results[0], run_reference(g, inputs)["y"], "f32")
    assert [len(p.slices) for p in plans] == [2, 2, 2]  # 8 heads of 7 rows: 2 blocks each (3 and 4 rows)
    assert parts == [1, 2, 3]
    assert np.array_equal(results[0], results[1]) and np.array_equal(results[0], results[2])


@pytest.mark.parametrize("block", [1, 4, 11, 64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_attention_blocked_online_softmax(block, with_bias, compare):
    g = Graph()
    views, grouped, merged, inputs = _attention_case(g, with_bias)
    f = Fused(g)
    y = f.add("AttentionBlocked", views, grouped, scale=0.3, block=block)
    compare(g, _grouped_output(f, y, grouped, merged), inputs)


def test_attention_blocked_with_a_fully_masked_key_block(compare):
    """Queries that see nothing in the first key block must not turn into NaN (running max starts finite)."""
    g = Graph()
    views, grouped, merged, inputs = _attention_case(g, True)
    inputs["bias"][...] = 0.0
    inputs["bias"][..., :4] = np.finfo(np.float32).min
    f = Fused(g)
    y = f.add("AttentionBlocked", views, grouped, scale=0.3, block=4)
    got, _ = compare(g, _grouped_output(f, y, grouped, merged), inputs)
    assert np.isfinite(got["y"]).all()


# ---- Conv2d ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("kernel", "stride", "padding", "bias"),
                         [(3, 1, 1, False), (3, 2, 1, True), (1, 1, 0, True), (2, 2, 0, False)])
def test_conv2d(kernel, stride, padding, bias, compare, rng, monkeypatch):
    monkeypatch.setattr(conv_kernels, "CONV_TILE", 60)  # a few output rows per im2col tile
    n, c, h, w, o = 2, 3, 9, 8, 4
    g = Graph()
    x = g.input("x", (n, c, h, w))
    wt = g.weight("w", (o, c, kernel, kernel))
    b = g.weight("b", (o,)) if bias else None
    g.mark_output("y", ops.conv2d(x, wt, b, stride=stride, padding=padding))
    f = Fused(g)
    xp = x.pad(2, padding, padding).pad(3, padding, padding) if padding else x
    ho = (h + 2 * padding - kernel) // stride + 1
    wo = (w + 2 * padding - kernel) // stride + 1
    operands = [xp, wt] + ([b.reshape(1, o, 1, 1).broadcast_to((n, o, ho, wo))] if bias else [])
    y = f.add("Conv2d", operands, (n, o, ho, wo), stride=stride)
    weights = {"w": randn(rng, o, c, kernel, kernel)} | ({"b": randn(rng, o)} if bias else {})
    compare(g, f.program(y=y), {"x": randn(rng, n, c, h, w)}, weights)


# ---- DequantMatMul -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(("scale_shape", "fp8", "k"),
                         [((), "f8e4m3", 48), ((1,), "f8e4m3", 48), ((20,), "f8e4m3", 48),
                          ((20, 1), "f8e5m2", 48), ((20,), "f8e5m2", 47)])  # odd K: no byte pairs
def test_dequant_matmul_fp8(scale_shape, fp8, k, compare, rng, monkeypatch):
    monkeypatch.setattr(numpy_dequant, "DEQUANT_TILE", 16 * k)  # bands of 16 output rows
    n = 20
    g = Graph()
    x = g.input("x", (2, 3, k))
    w8 = g.weight("w", (n, k), fp8)
    s = g.weight("s", scale_shape)
    g.mark_output("y", ops.linear(x, ops.dequant_fp8(w8, s)))
    f = Fused(g)
    y = f.add("DequantMatMul", [x, w8, s], (2, 3, n), format="fp8", layout="", out_features=n, in_features=k)
    weights = {"w": randn(rng, n, k).astype(w8.dtype.np),
               "s": (rng.random(scale_shape) + 0.5).astype(np.float32)}
    compare(g, f.program(y=y), {"x": randn(rng, 2, 3, k)}, weights)


@pytest.mark.parametrize("layout", ["modelopt", "comfy"])
def test_dequant_matmul_nvfp4(layout, compare, rng, monkeypatch):
    monkeypatch.setattr(numpy_dequant, "DEQUANT_TILE", 16 * 32)  # several bands (comfy: 128-row bands)
    n, k = 200, 32
    if layout == "modelopt":
        w_shape, s_shape = (n, k // 2), (n, k // 16)
    else:
        w_shape, s_shape = (208, k // 2), (256, 4)  # rows padded to 16 / 128, K/16 padded to 4
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
    compare(g, f.program(y=y), {"x": randn(rng, 3, k)}, weights)


def test_dequant_matmul_never_materialises_the_dense_weight(runtime, monkeypatch):
    """The scratch of the kernel holds one band of the decoded weight, not all of it."""
    n, k = 512, 64
    g = Graph()
    x = g.input("x", (4, k))
    wq, ws = g.weight("w", (n, k // 2), "u8"), g.weight("ws", (n, k // 16), "f8e4m3")
    ws2 = g.weight("ws2", ())
    f = Fused(g)
    y = f.add("DequantMatMul", [x, wq, ws, ws2], (4, n), format="nvfp4", layout="modelopt", out_features=n,
              in_features=k)
    monkeypatch.setattr(numpy_dequant, "DEQUANT_TILE", 64 * k)
    if hasattr(runtime.backend, "options"):  # the CUDA backends decode bands of ``dequant_band`` elements
        monkeypatch.setattr(runtime.backend.options, "dequant_band", 64 * k)
    plan = runtime.plan(f.program(y=y))
    dense_f32 = n * k * 4
    assert 0 < plan.scratch_bytes[y] < dense_f32 / 2


# ---- Gather / Scatter --------------------------------------------------------------------------------------
def test_scatter_in_place_aliases_its_destination(runtime, rng):
    g = Graph()
    cache = g.input("cache", (10, 4))
    pos = g.input("pos", (3,), "i32")
    rows = g.input("rows", (3, 4))
    doubled = cache * 2.0  # the destination is a fresh activation that dies at the scatter
    f = Fused(g)
    y = f.add("ScatterInPlace", [doubled, pos, rows], (10, 4))
    program = f.program(y=y)
    ins = {"cache": randn(rng, 10, 4), "pos": np.array([7, 0, 3], np.int32), "rows": randn(rng, 3, 4)}
    exe = runtime.load(program)
    assert exe.plan.aliases.get(y) == doubled.node
    want = ins["cache"] * 2
    want[ins["pos"]] = ins["rows"]
    assert np.array_equal(exe.run(ins)["y"], want)


def test_scatter_in_place_copies_when_the_destination_is_read_later(runtime, rng):
    g = Graph()
    cache = g.input("cache", (6, 2))
    pos = g.input("pos", (1,), "i32")
    rows = g.input("rows", (1, 2))
    doubled = cache * 2.0
    f = Fused(g)
    y = f.add("ScatterInPlace", [doubled, pos, rows], (6, 2))
    later = f.add("Add", [doubled, doubled], (6, 2))  # reads the destination after the scatter
    exe = runtime.load(f.program(y=y, later=later))
    assert y not in exe.plan.aliases and any("ScatterInPlace" in note for note in exe.plan.notes)
    ins = {"cache": randn(rng, 6, 2), "pos": np.array([4], np.int32), "rows": randn(rng, 1, 2)}
    out = exe.run(ins)
    assert np.array_equal(out["later"], ins["cache"] * 4)
    assert np.array_equal(out["y"][4], ins["rows"][0])


def test_scatter_in_place_of_one_row_from_a_strided_view_and_out_of_range(runtime, rng):
    """A decoding step's scatter (one row, read through a transposed view) writes that row in place; an index
    past the destination is refused, naming the kernel."""
    g = Graph()
    cache = g.input("cache", (6, 2, 3))
    pos = g.input("pos", (1,), "i32")
    rows = g.input("rows", (1, 3, 2))
    doubled = cache * 2.0
    f = Fused(g)
    y = f.add("ScatterInPlace", [doubled, pos, rows.transpose(1, 2)], (6, 2, 3))
    exe = runtime.load(f.program(y=y))
    ins = {"cache": randn(rng, 6, 2, 3), "pos": np.array([4], np.int32), "rows": randn(rng, 1, 3, 2)}
    want = ins["cache"] * 2
    want[4] = ins["rows"][0].T
    assert np.array_equal(exe.run(ins)["y"], want)
    with pytest.raises(InputError, match="ScatterInPlace .*out of range"):
        exe.run({**ins, "pos": np.array([6], np.int32)})


def test_gather_rejects_out_of_range_indices(runtime):
    from luminal_recipes.errors import InputError

    g = Graph()
    ids = g.input("ids", (3,), "i32")
    table = g.weight("table", (5, 2))
    g.mark_output("y", ops.embedding(ids, table))
    from luminal_recipes.runtimes.program import Program

    exe = runtime.load(Program.from_graph(g), {"table": np.zeros((5, 2), np.float32)})
    with pytest.raises(InputError, match=r"out of range \[0, 5\)"):
        exe.run({"ids": np.array([0, 5, 1], np.int32)})


def test_kernel_vocabulary_is_fully_implemented(runtime):
    from luminal_recipes.runtimes.program import KERNELS

    assert runtime.capabilities() == set(KERNELS)
