"""The Elementwise expression language: parsing, typing, casts inside an expression, degenerate cases."""

from __future__ import annotations

import numpy as np
import pytest
from fused_programs import Fused

from luminal_recipes.graph import Graph, cast, run_reference
from luminal_recipes.runtimes.kernels.expression import ElementwisePlan, parse


def test_casts_inside_an_expression_round_like_the_cast_primitive(runtime, rng):
    g = Graph()
    x = g.input("x", (64,))
    narrow = cast(cast(x * 3.0, "f16"), "f32") + 1.0
    as_int = cast(cast(x * 100.0, "i32"), "f32")
    g.mark_output("narrow", narrow)
    g.mark_output("as_int", as_int)
    f = Fused(g)
    a = f.add("Elementwise", [x], (64,), expr="(Add (Cast f32 (Cast f16 (Mul in0 (Const 3.0)))) (Const 1.0))")
    b = f.add("Elementwise", [x], (64,), expr="(Cast f32 (Cast i32 (Mul in0 (Const 100.0))))")
    inputs = {"x": rng.standard_normal(64).astype(np.float32)}
    want = run_reference(g, inputs)
    got = runtime.run(f.program(narrow=a, as_int=b), inputs)
    assert np.array_equal(got["narrow"], want["narrow"]) and np.array_equal(got["as_int"], want["as_int"])


def test_degenerate_expressions(runtime, rng):
    g = Graph()
    x = g.input("x", (2, 3))
    f = Fused(g)
    const = f.add("Elementwise", [], (2, 3), expr="(Const 2.5)")
    folded = f.add("Elementwise", [x], (2, 3), expr="(Mul in0 (Sqrt (Add (Const 2.0) 2)))")
    copy = f.add("Elementwise", [x], (2, 3), "f16", expr="in0")
    xv = rng.standard_normal((2, 3)).astype(np.float32)
    got = runtime.run(f.program(const=const, folded=folded, copy=copy), {"x": xv})
    assert np.array_equal(got["const"], np.full((2, 3), 2.5, np.float32))
    assert np.array_equal(got["folded"], xv * np.float32(2.0))
    assert got["copy"].dtype == np.float16 and np.array_equal(got["copy"], xv.astype(np.float16))


def test_registers_are_reused():
    plan = ElementwisePlan("(Add (Mul in0 (Const 0.25)) (Exp2 (Mul in1 (Const 2.0))))",
                           [np.float32, np.float32], np.float32)
    assert len(plan.instrs) == 4  # evaluated as written (constant folding is the compiler's rules' job)
    assert len(plan.registers) == 2  # in0 * 0.25 and the exp2 chain; the final Add writes the output


def test_a_constant_subexpression_is_evaluated_like_any_other(runtime, rng):
    g = Graph()
    x = g.input("x", (3, 4))
    f = Fused(g)
    y = f.add("Elementwise", [x], (3, 4), expr="(Mul in0 (Recip (Exp (Const 0.0))))")
    xv = rng.standard_normal((3, 4)).astype(np.float32)
    assert np.array_equal(runtime.run(f.program(y=y), {"x": xv})["y"], xv)


@pytest.mark.parametrize(("text", "why"), [
    ("(Add in0)", "unexpected"), ("(Foo in0)", "unknown operator"), ("(Mul in0 in1", "expected '\\)'"),
    ("(Mul in0", "ends early"), ("in0 in1", "trailing"), ("(Const x)", "neither an input"),
])
def test_malformed_expressions_are_rejected(text, why):
    with pytest.raises(ValueError, match=why):
        parse(text)


def test_mixed_operand_types_are_rejected():
    with pytest.raises(ValueError, match="mixes operand types"):
        ElementwisePlan("(Add in0 in1)", [np.float32, np.int32], np.float32)
    with pytest.raises(ValueError, match="reads in2"):
        ElementwisePlan("(Add in0 in2)", [np.float32, np.float32], np.float32)


@pytest.mark.parametrize("text", [
    "(Mul (Mul in0 (Recip (Add (Exp (Mul in0 (Const -1.0))) (Const 1.0)))) in1)",  # SwiGLU
    "(Mul (Add (Mul in0 in1) in1) (Recip (Add (Exp (Mul (Add (Mul in0 in1) in1) (Const -1.0))) (Const 1.0))))",
    "(Recip (Add (Exp (Mul in0 (Const 2.5))) (Const 0.5)))",
])
def test_logistic_instruction_gives_the_bits_of_its_four_operations(text, monkeypatch):
    """The compiled Elementwise kernel evaluates Recip(Add(Exp(Mul(x, b)), c)) (the sigmoid of SiLU, SwiGLU and the
    VAE's GroupNorm + SiLU) as one instruction, one pass over a tile instead of four: the same operations in the
    same order, so the same bits as the four instructions."""
    from luminal_recipes.runtimes.cpu import jit
    from luminal_recipes.runtimes.cpu.kernels.elementwise import JIT_TILE, _compiled_boxes
    from luminal_recipes.runtimes.kernels import expression as expr

    if not jit.AVAILABLE:
        pytest.skip("numba is not installed (luminal-recipes[jit])")
    rng = np.random.default_rng(6)
    inputs = [(rng.standard_normal((5, 300)) * 30).astype(np.float32) for _ in range(2)]
    inputs[0][0, :4] = [np.inf, -np.inf, np.nan, 0.0]
    monkeypatch.setattr(expr, "_code_of", expr._code_of.__wrapped__)  # not memoized: what it calls is patched below
    fused = expr.ElementwiseCode.of(text, [np.float32] * 2, np.float32)
    monkeypatch.setattr(expr, "_logistic", lambda e: None)
    plain = expr.ElementwiseCode.of(text, [np.float32] * 2, np.float32)
    assert expr.OPCODE["Logistic"] in fused.code[:, 0] and expr.OPCODE["Logistic"] not in plain.code[:, 0]
    assert len(fused.code) == len(plain.code) - 3
    outs = []
    for code in (fused, plain):
        out = np.empty((5, 300), np.float32)
        regs = np.zeros((code.registers, JIT_TILE), np.float32)
        for part in _compiled_boxes(out, inputs, 1):
            for table, shape in part:
                jit.kernels().elementwise_tiles(code.code, code.consts, table, shape, regs)
        outs.append(out)
    assert np.array_equal(outs[0], outs[1], equal_nan=True)


def test_a_repeated_subexpression_is_computed_once(monkeypatch):
    """FLUX.2's float64 RoPE cos tables arrive as 1 - 2 sin(x/2) sin(x/2) with the sine written twice (f64 sin
    is ~14 ns an element on numpy's path), SiLU's x * sigmoid(x) reads x twice: the numpy plan computes a repeated
    subexpression once and the compiled code loads a repeated input once, with the bits of evaluating it as
    written."""
    from luminal_recipes.runtimes.cpu import jit
    from luminal_recipes.runtimes.cpu.kernels.elementwise import JIT_TILE, _compiled_boxes
    from luminal_recipes.runtimes.kernels import expression as expr

    rng = np.random.default_rng(3)
    cos = ("(Cast f32 (Add (Const 1.0) (Mul (Mul (Sin (Mul (Mul (Cast f64 in0) in1) (Const 0.5))) "
           "(Sin (Mul (Mul (Cast f64 in0) in1) (Const 0.5)))) (Const -2.0))))")
    x, freq = rng.standard_normal((300, 2)).astype(np.float32) * 40, rng.random((300, 2))

    def plan_output(plan):
        out = np.empty((300, 2), np.float32)
        plan.bind(out, [x, freq], [np.empty(plan.tile_elems(out.shape), d) for d in plan.registers])()
        return out, sum(i.fn is np.sin for i in plan.instrs)

    once = plan_output(ElementwisePlan(cos, [np.float32, np.float64], np.float32))
    silu = "(Mul (Mul in0 (Recip (Add (Exp (Mul in0 (Const -1.0))) (Const 1.0)))) in1)"
    monkeypatch.setattr(expr, "_code_of", expr._code_of.__wrapped__)  # not memoized: what it calls is patched below
    code_once = expr.ElementwiseCode.of(silu, [np.float32] * 2, np.float32)
    monkeypatch.setattr(expr, "_repeated", lambda tree, leaves=False: {})
    twice = plan_output(ElementwisePlan(cos, [np.float32, np.float64], np.float32))
    code_twice = expr.ElementwiseCode.of(silu, [np.float32] * 2, np.float32)
    assert (once[1], twice[1]) == (1, 2) and np.array_equal(once[0], twice[0])
    loads = [int((c.code[:, 0] == expr.OPCODE["Load"]).sum()) for c in (code_once, code_twice)]
    assert loads == [2, 3]
    if not jit.AVAILABLE:
        return
    inputs = [(rng.standard_normal((7, 300)) * 10).astype(np.float32)[:, ::2] for _ in range(2)]
    outs = []
    for code in (code_once, code_twice):
        out = np.empty((7, 150), np.float32)
        regs = np.zeros((code.registers, JIT_TILE), np.float32)
        for part in _compiled_boxes(out, inputs, 1):
            for table, shape in part:
                jit.kernels().elementwise_tiles(code.code, code.consts, table, shape, regs)
        outs.append(out)
    assert np.array_equal(outs[0], outs[1])
