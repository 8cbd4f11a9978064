"""Each rule family on its own: the kernel it discovers appears in the cheapest program, the program matches
the reference interpreter, and the rule leaves look-alike patterns that are not its op alone."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from compiler_helpers import cheapest, check_program, graph_values, kernels, search

from luminal_recipes import ops
from luminal_recipes.graph import Graph

SOURCES = {"Input", "Constant", "Iota"}


def compute(program) -> list:
    return [n for n in program.nodes if n.op not in SOURCES]


# ---- clean-up ----------------------------------------------------------------------------------------------
def test_identities_and_copies_disappear(runtime, assert_close):
    g = Graph()
    x = g.input("x", (4, 6))
    t = (x * 1.0 + 0.0).T.contiguous()          # identity ops, then a materialised transpose
    g.mark_output("y", ops.exp2(t))
    program = cheapest(g, runtime)
    (kernel,) = compute(program)
    assert kernel.op == "Exp2" or (kernel.op == "Elementwise" and kernel.attr("expr") == "(Exp2 in0)")
    assert str(kernel.inputs[0][1].strides) == "(1, 6)"  # reads x through the transposed view, no copy
    check_program(g, program, runtime, assert_close)


def test_scalar_constants_fold(runtime, assert_close):
    g = Graph()
    x = g.input("x", (3, 5))
    six = g.constant(2.0).broadcast_to(x.shape) * 3.0   # a full tensor of 2 * 3
    g.mark_output("y", x * six)
    program = cheapest(g, runtime)
    (kernel,) = compute(program)
    assert "(Const 6.0)" in kernel.attr("expr", "") or any(
        n.op == "Constant" and n.attr("value") == 6.0 for n in program.nodes)
    check_program(g, program, runtime, assert_close)


def test_cast_chains(runtime, assert_close):
    g = Graph()
    x = g.input("x", (4, 4), "bf16")
    f = g.input("f", (4, 4))
    round_trip = x.cast("f32").cast("bf16")             # exact: bf16 -> f32 -> bf16
    g.mark_output("y", round_trip + x)
    g.mark_output("z", f.cast("f32") * 2.0)             # a cast to its own dtype
    program = cheapest(g, runtime)
    assert not any(n.op == "Cast" or "Cast" in str(n.attr("expr", "")) for n in program.nodes)
    check_program(g, program, runtime, assert_close)


def test_lossy_cast_chain_is_kept(runtime, assert_close):
    g = Graph()
    x = g.input("x", (4, 4))
    g.mark_output("y", x.cast("bf16").cast("f32"))      # f32 -> bf16 rounds: not an identity
    program = cheapest(g, runtime)
    assert "bf16" in str([(n.op, n.dtype, n.attr("expr")) for n in program.nodes])
    check_program(g, program, runtime, assert_close)


# ---- matmul ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ta,tb", [(False, False), (True, False), (False, True), (True, True)])
def test_matmul_all_transpose_layouts(ta, tb, runtime, assert_close):
    g = Graph()
    a = g.input("a", (5, 3) if ta else (3, 5))
    b = g.input("b", (4, 5) if tb else (5, 4))
    g.mark_output("y", ops.matmul(a.T if ta else a, b.T if tb else b))
    program = cheapest(g, runtime)
    assert [n.op for n in compute(program)] == ["MatMul"]
    check_program(g, program, runtime, assert_close)


def test_batched_matmul_with_broadcast_batch_and_symbolic_rows(runtime, assert_close):
    g = Graph()
    a = g.input("a", (2, 3, "m", 8))
    b = g.input("b", (8, 6))
    g.mark_output("y", ops.matmul(a, b))
    program = cheapest(g, runtime, {"m": 5})
    (mm,) = compute(program)
    assert mm.op == "MatMul" and str(mm.inputs[1][1].strides) == "(0, 0, 6, 1)"
    check_program(g, program, runtime, assert_close, {"m": 5})


def test_matmul_with_bias(runtime, assert_close):
    g = Graph()
    x = g.input("x", (2, 7, 8))
    g.mark_output("y", ops.linear(x, g.weight("w", (6, 8)), g.weight("b", (6,))))
    program = cheapest(g, runtime)
    (mm,) = compute(program)
    assert mm.op == "MatMul" and len(mm.inputs) == 3
    check_program(g, program, runtime, assert_close)


def test_sum_of_a_plain_product_is_not_a_matmul(runtime, assert_close):
    g = Graph()
    x, y = g.input("x", (4, 6)), g.input("y", (4, 6))
    g.mark_output("d", ops.sum(x * y, -1))              # a row-wise dot: nothing is broadcast
    searched = search(g, runtime, candidates=4)
    assert all("MatMul" not in kernels(p) for progs in searched.programs.values() for p in progs)
    check_program(g, searched.assemble(g, lambda p: p[0]), runtime, assert_close)


# ---- elementwise -------------------------------------------------------------------------------------------
def test_chain_of_elementwise_ops_is_one_kernel(runtime, assert_close):
    g = Graph()
    x, y = g.input("x", (3, 17)), g.input("y", (3, 17))
    g.mark_output("z", ops.gelu(ops.tanh(x) * y + ops.sigmoid(y)))
    program = cheapest(g, runtime)
    assert [n.op for n in compute(program)] == ["Elementwise"]
    check_program(g, program, runtime, assert_close, family="elementwise")


def test_fusion_stops_at_a_non_identity_view(runtime, assert_close):
    g = Graph()
    x, y = g.input("x", (4, 6)), g.input("y", (6, 4))
    g.mark_output("z", ops.exp(x).T + y)                # exp(x) is read transposed: it is materialised
    program = cheapest(g, runtime)
    assert len(compute(program)) == 2
    check_program(g, program, runtime, assert_close, family="elementwise")


def test_constant_subexpressions_fold_in_the_rules(runtime, assert_close):
    g = Graph()
    x = g.input("x", (3, 5))
    quarter = ops.recip(ops.sqrt(g.constant(16.0).broadcast_to(x.shape)))  # 1 / sqrt(16), all constant
    g.mark_output("y", ops.exp2(x) * quarter * 2.0)
    program = cheapest(g, runtime)
    (kernel,) = compute(program)
    assert "Recip" not in kernel.attr("expr") and "Sqrt" not in kernel.attr("expr")
    assert "(Const 0.5)" in kernel.attr("expr")
    check_program(g, program, runtime, assert_close, family="elementwise")


def test_all_constant_computations_of_different_shapes_stay_apart(runtime, assert_close):
    # 2 * 3 and sin(2) at two shapes (and 2 * 3 at two dtypes) are each one expression of constants; each
    # Elementwise still writes its own shape and dtype, so no IR e-class may hold two of them, no expression
    # e-class may hold loads of two shapes (an extraction could read one in the other's kernel), and every
    # candidate program, noisy ones included, must match the reference
    from luminal_recipes.compiler.extract import Snapshot
    from luminal_recipes.compiler.lower import lower
    from luminal_recipes.compiler.saturate import saturate, scratch_egraph

    g = Graph()
    x, y, h = g.input("x", (3, 4)), g.input("y", (2, 6, 5)), g.input("h", (3, 4), "f16")
    six = [g.constant(2.0, dt).broadcast_to(shape) * 3.0
           for shape, dt in (((3, 4), "f32"), ((2, 6, 5), "f32"), ((3, 4), "f16"))]
    sin = [ops.sin(g.constant(2.0).broadcast_to(shape)) for shape in ((3, 4), (2, 6, 5))]
    g.mark_output("a", x + six[0] * sin[0])
    g.mark_output("b", y * six[1] + sin[1])
    g.mark_output("c", h + six[2])
    with scratch_egraph() as egraph:
        lower(g, egraph)
        saturate(egraph)
        snap = Snapshot.of(egraph)
    written = {}  # IR class -> (shape, dtype) of the HLIR nodes in it
    for nid, cls in snap.node_class.items():
        node = g.nodes[nid]
        assert written.setdefault(cls, (node.shape, node.dtype)) == (node.shape, node.dtype), \
            f"node {nid} {node.op} {node.shape} {node.dtype} shares an e-class with {written[cls]}"
    for cls, members in enumerate(snap.members):
        loads = {snap.load_view(snap.nodes[i].args[0].cls).shape for i in members if snap.nodes[i].op == "EL"}
        assert snap.sort[cls] != "EX" or len(loads) <= 1, f"expression e-class {cls} loads shapes {loads}"
    searched = search(g, runtime, candidates=12, noise=8.0)
    for i in range(max(len(progs) for progs in searched.programs.values())):
        program = searched.assemble(g, lambda progs, i=i: progs[min(i, len(progs) - 1)])
        check_program(g, program, runtime, assert_close, family="elementwise")


def test_exp2_of_a_scaled_input_becomes_exp(runtime, assert_close):
    from luminal_recipes.runtimes.kernels.expression import ElementwisePlan

    g = Graph()
    x = g.input("x", (4, 8))
    g.mark_output("y", ops.exp(x))  # the op library's exp: Exp2(x * log2(e))
    program = cheapest(g, runtime)
    (kernel,) = compute(program)
    assert kernel.attr("expr") == "(Exp in0)"
    assert [i.fn for i in ElementwisePlan("(Exp in0)", [np.float32], np.float32).instrs] == [np.exp]
    check_program(g, program, runtime, assert_close, family="elementwise")


@pytest.mark.parametrize("scale", [1.0, 1.5, np.log2(np.e), -np.log2(np.e)])
def test_exp2_through_exp_stays_within_a_few_ulps(scale, runtime):
    """Whether the machine's weights pick Exp or Exp2, 2^(x * scale) stays within 1e-5 over f32's whole range
    of 2^z, and the special values come out exactly."""
    from luminal_recipes.compiler import SearchOptions, compile_graph
    from luminal_recipes.graph import run_reference

    z = np.linspace(-125.9, 127.9, 20001)
    xv = np.concatenate([z / scale, [np.inf, -np.inf, np.nan]]).astype(np.float32)
    g = Graph()
    x = g.input("x", (xv.size,))
    g.mark_output("y", ops.exp2(x * float(scale)) if scale != 1.0 else ops.exp2(x))
    program = compile_graph(g, runtime, options=SearchOptions(use_cache=False, time_top=0)).program
    assert "(Exp " in str([n.attrs for n in program.nodes])  # numpy's machine weighs Exp2 above Exp + Mul
    with np.errstate(over="ignore", invalid="ignore"):
        out = runtime.run(program, {"x": xv})["y"]
        want = run_reference(g, {"x": xv}, mode="f64")["y"]
    n = z.size
    assert (np.abs(out[:n] - want[:n]) / want[:n]).max() <= 1e-5
    assert np.array_equal(out[n:], want[n:].astype(np.float32), equal_nan=True)


# ---- softmax and norms -------------------------------------------------------------------------------------
def test_softmax(runtime, assert_close):
    g = Graph()
    x = g.input("x", (2, 3, 9))
    g.mark_output("y", ops.softmax(x.transpose(0, 1), -1))  # through a view
    program = cheapest(g, runtime)
    assert [n.op for n in compute(program)] == ["Softmax"]
    check_program(g, program, runtime, assert_close)


def test_softmax_over_a_leading_axis_stays_primitive(runtime, assert_close):
    g = Graph()
    x = g.input("x", (5, 4))
    g.mark_output("y", ops.softmax(x, 0))
    program = cheapest(g, runtime)
    assert "Softmax" not in kernels(program)
    check_program(g, program, runtime, assert_close)


@pytest.mark.parametrize("norm", ["rms", "layer", "group"])
def test_norms(norm, runtime, assert_close):
    g = Graph()
    if norm == "group":
        x = g.input("x", (2, 6, 3, 3))
        y = ops.group_norm(x, 3, g.weight("w", (6,)), g.weight("b", (6,)), 1e-5)
        want = "GroupNorm"
    else:
        x = g.input("x", (3, 4, 16))
        y = ops.rms_norm(x, g.weight("w", (16,)), 1e-6) if norm == "rms" else ops.layer_norm(
            x, g.weight("w", (16,)), g.weight("b", (16,)), 1e-5)
        want = "RMSNorm" if norm == "rms" else "LayerNorm"
    g.mark_output("y", y)
    program = cheapest(g, runtime)
    node = next(n for n in program.nodes if n.op == want)
    assert node.attr("eps") == (1e-6 if norm == "rms" else 1e-5)
    # the weight (and bias) applied by the norm kernel itself (RMSNormScale, LayerNormAffine, GroupNormAffine:
    # per channel, not per row of the grouped view)
    assert len(compute(program)) == 1 and len(node.inputs) == (2 if norm == "rms" else 3)
    if norm == "group":
        assert node.attr("act") == "" and tuple(node.inputs[0][1].shape) == (2, 3, 18)  # x read as its groups
    check_program(g, program, runtime, assert_close)


# ---- attention ---------------------------------------------------------------------------------------------
def _attention_graph(causal: bool) -> Graph:
    g = Graph()
    q = g.input("q", (1, 4, 5, 8))                      # S = 5 queries
    k = g.input("k", (1, 2, 7, 8))                      # T = 7 keys, grouped (2 kv heads)
    v = g.input("v", (1, 2, 7, 3))                      # Dv = 3
    g.mark_output("o", ops.scaled_dot_product_attention(q, k, v, causal=causal))
    return g


@pytest.mark.parametrize("causal", [False, True])
def test_attention_never_materialises_scores(causal, runtime, assert_close):
    g = _attention_graph(causal)
    searched = search(g, runtime, candidates=8, noise=3.0)
    progs = searched.programs[searched.segments[0].key]
    found = set()
    for program in progs:
        for kind in ("Attention", "AttentionBlocked"):
            if kind in kernels(program):
                found.add(kind)
                node = next(n for n in program.nodes if n.op == kind)
                assert len(node.inputs) == (4 if causal else 3)
                assert node.attr("scale") == pytest.approx(8**-0.5)
                # no (S, T, D) product, no score matrix, no softmax: only the mask bias is (S, T)
                assert not any({5, 7, 8} <= set(n.shape) or {5, 7, 3} <= set(n.shape) for n in program.nodes)
                assert not kernels(program) & {"MatMul", "Softmax", "SumReduce", "MaxReduce"}
        check_program(g, searched.assemble(g, lambda p, program=program: program), runtime, assert_close)
    assert found == {"Attention", "AttentionBlocked"}


# ---- conv --------------------------------------------------------------------------------------------------
def test_conv2d_with_padding_stride_and_bias(runtime, assert_close):
    g = Graph()
    x = g.input("x", (2, 3, 9, 8))
    g.mark_output("y", ops.conv2d(x, g.weight("w", (4, 3, 3, 3)), g.weight("b", (4,)), stride=2, padding=1))
    program = cheapest(g, runtime)
    (conv,) = compute(program)
    assert conv.op == "Conv2d" and conv.attr("stride") == 2 and len(conv.inputs) == 3
    assert tuple(conv.shape) == (2, 4, 5, 4)
    check_program(g, program, runtime, assert_close)


def test_conv2d_without_bias_is_an_output_of_its_own_shape(runtime, assert_close):
    g = Graph()
    x = g.input("x", (2, 3, 9, 8))
    g.mark_output("y", ops.conv2d(x, g.weight("w", (4, 3, 3, 3)), stride=2, padding=1))
    program = cheapest(g, runtime)
    (conv,) = compute(program)  # the rule gives the kernel its [N, O, Ho, Wo] e-class; no shape patch
    assert conv.op == "Conv2d" and tuple(conv.shape) == (2, 4, 5, 4)
    check_program(g, program, runtime, assert_close)


def test_pointwise_conv_is_a_matmul(runtime, assert_close):
    g = Graph()
    x = g.input("x", (1, 6, 4, 4))
    g.mark_output("y", ops.conv2d(x, g.weight("w", (5, 6, 1, 1))))
    program = cheapest(g, runtime)
    assert [n.op for n in compute(program)] == ["MatMul"]
    check_program(g, program, runtime, assert_close)


def test_conv2d_on_symbolic_sizes_is_one_kernel_each(runtime, assert_close):
    """A VAE's convolutions compile once for every image size: 3x3 padded with bias, without bias, and stride 2
    with the encoder's one-sided padding, on symbolic h and w, each become one Conv2d (no padding copy, no
    im2col, no matmul), and match torch at odd sizes."""
    torch = pytest.importorskip("torch")
    g = Graph()
    x = g.input("x", (2, 5, "h", "w"))
    w1, b1, w2, w3, b3 = (g.weight("w1", (4, 5, 3, 3)), g.weight("b1", (4,)), g.weight("w2", (8, 5, 3, 3)),
                          g.weight("w3", (4, 5, 3, 3)), g.weight("b3", (4,)))
    g.mark_output("bias", ops.conv2d(x, w1, b1, padding=1))
    g.mark_output("plain", ops.conv2d(x, w2, padding=1))
    g.mark_output("down", ops.conv2d(x.pad(2, 0, 1).pad(3, 0, 1), w3, b3, stride=2))
    dims = {"h": 9, "w": 7}
    program = cheapest(g, runtime, dims)
    convs = compute(program)
    assert [n.op for n in convs] == ["Conv2d"] * 3
    assert sorted((len(n.inputs), n.attr("stride")) for n in convs) == [(2, 1), (3, 1), (3, 2)]
    inputs, weights = graph_values(g, 0, dims)
    got = runtime.run(program, inputs, weights, dims)
    t = {k: torch.from_numpy(v.astype(np.float64)) for k, v in {**inputs, **weights}.items()}
    F = torch.nn.functional
    want = {"bias": F.conv2d(t["x"], t["w1"], t["b1"], padding=1), "plain": F.conv2d(t["x"], t["w2"], padding=1),
            "down": F.conv2d(F.pad(t["x"], (0, 1, 0, 1)), t["w3"], t["b3"], stride=2)}
    for name, value in want.items():
        assert_close("conv", got[name], value)


def test_group_norm_silu_on_symbolic_sizes(runtime, assert_close):
    """GroupNorm over a symbolic image size (its mean divides by a count, not a constant), its affine transform
    and SiLU are one GroupNorm kernel (act 'silu'); torch's group_norm + silu agree."""
    torch = pytest.importorskip("torch")
    g = Graph()
    x = g.input("x", (2, 6, "h", "w"))
    g.mark_output("y", ops.silu(ops.group_norm(x, 3, g.weight("g", (6,)), g.weight("b", (6,)), 1e-6)))
    dims = {"h": 5, "w": 3}
    program = cheapest(g, runtime, dims)
    (node,) = compute(program)
    assert node.op == "GroupNorm" and node.attr("act") == "silu" and node.attr("eps") == 1e-6
    inputs, weights = graph_values(g, 0, dims)
    got = runtime.run(program, inputs, weights, dims)["y"]
    t = {k: torch.from_numpy(v.astype(np.float64)) for k, v in {**inputs, **weights}.items()}
    want = torch.nn.functional.silu(torch.nn.functional.group_norm(t["x"], 3, t["g"], t["b"], 1e-6))
    assert_close("norm", got, want)


# ---- dequantise -> matmul ----------------------------------------------------------------------------------
@pytest.mark.parametrize("scale_shape", [(), (1,), (12,), (12, 1)])
def test_fp8_dequant_matmul(scale_shape, runtime, assert_close):
    g = Graph()
    x = g.input("x", (2, 5, 32))
    w = g.weight("w", (12, 32), "f8e4m3")
    s = g.weight("s", scale_shape)
    g.mark_output("y", ops.linear(x, ops.dequant_fp8(w, s)))
    program = cheapest(g, runtime)
    (node,) = compute(program)
    assert node.op == "DequantMatMul" and node.attr("format") == "fp8"
    assert (node.attr("out_features"), node.attr("in_features")) == (12, 32)
    assert [program.nodes[src].attr("name") for src, _ in node.inputs[1:]] == ["w", "s"]
    check_program(g, program, runtime, assert_close)


@pytest.mark.parametrize("layout,n,k", [("modelopt", 8, 64), ("comfy", 8, 32), ("comfy", 200, 160)])
def test_nvfp4_dequant_matmul_keeps_weights_packed(layout, n, k, runtime, assert_close):
    g = Graph()
    x = g.input("x", (3, k))
    if layout == "modelopt":
        w, s = g.weight("w", (n, k // 2), "u8"), g.weight("s", (n, k // 16), "f8e4m3")
    else:  # padded to 16 x 16, scales in 128 x 4 tiles
        w = g.weight("w", (-(-n // 16) * 16, -(-k // 16) * 8), "u8")
        s = g.weight("s", (-(-n // 128) * 128, -(-(k // 16) // 4) * 4), "f8e4m3")
    g.mark_output("y", ops.linear(x, ops.dequant_nvfp4(w, s, g.weight("s2", ()), n, k, layout)))
    program = cheapest(g, runtime)
    (node,) = compute(program)
    assert node.op == "DequantMatMul" and node.attr("format") == "nvfp4" and node.attr("layout") == layout
    assert [program.nodes[src].attr("name") for src, _ in node.inputs[1:]] == ["w", "s", "s2"]
    check_program(g, program, runtime, assert_close)


def test_the_e2m1_rule_matches_the_one_e2m1_table():
    from luminal_recipes.compiler.lower import values_text
    from luminal_recipes.compiler.rules import rule_text
    from luminal_recipes.graph.dtypes import E2M1_VALUES

    # lowering shows small constants' values to the rules; the dequant rule's literal is that table's text
    assert f'(ConstArr i "{values_text(E2M1_VALUES)}")' in rule_text("dequant")
    assert values_text(E2M1_VALUES.astype(ml_dtypes.bfloat16)) == values_text(E2M1_VALUES)  # a bf16 table too
    assert values_text(np.abs(E2M1_VALUES)) != values_text(E2M1_VALUES)  # -0.0 is not 0.0


# ---- gather and scatter ------------------------------------------------------------------------------------
def test_embedding_gathers_rows_before_casting(runtime, assert_close):
    g = Graph()
    ids = g.input("ids", (2, 3), "i32")
    table = g.weight("table", (50, 8), "bf16")
    g.mark_output("y", ops.embedding(ids, table.cast("f32")))
    program = cheapest(g, runtime)
    gather = next(n for n in program.nodes if n.op == "Gather")
    assert str(program.nodes[gather.inputs[0][0]].attr("name")) == "table" and str(gather.dtype) == "bf16"
    assert tuple(gather.shape) == (2, 3, 8)  # only the picked rows exist in f32, never the whole table
    check_program(g, program, runtime, assert_close, family="index")


def test_scatter_in_place_only_when_nothing_else_reads_the_destination(runtime, assert_close):
    g = Graph()
    cache = g.input("cache", (10, 4))
    pos = g.input("pos", (2,), "i32")
    rows = g.input("rows", (2, 4))
    g.mark_output("y", ops.write_rows(cache * 1.5, pos, rows))
    program = cheapest(g, runtime)
    assert "ScatterInPlace" in kernels(program)
    check_program(g, program, runtime, assert_close)

    g2 = Graph()
    cache = g2.input("cache", (10, 4))
    scaled = cache * 1.5
    g2.mark_output("y", ops.write_rows(scaled, g2.input("pos", (2,), "i32"), g2.input("rows", (2, 4))))
    g2.mark_output("old", scaled)                       # the destination is read again
    searched = search(g2, runtime, candidates=6)
    assert all("ScatterInPlace" not in kernels(p) for progs in searched.programs.values() for p in progs)
    check_program(g2, searched.assemble(g2, lambda p: p[0]), runtime, assert_close)


def test_positions_are_unique_rows(runtime):
    """Guard for the scatter tests: the seeded positions are distinct (duplicates are order-dependent)."""
    from compiler_helpers import graph_values

    g = Graph()
    g.input("pos", (2,), "i32")
    inputs, _ = graph_values(g)
    assert len(np.unique(inputs["pos"])) == 2
