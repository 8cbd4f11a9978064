"""The CPU backend's f32 kernels the chains call where it ran numpy or BLAS from Python
(``runtimes/cpu/jit/f32_kernels.py``): a decoding step's products (weights stored as rows, or row by row), larger
products as BLAS chunks called from compiled code, a product's bias, a concatenation's box copies. Each is checked
against float64 numpy (tests/TOLERANCES.md), and a run of them chained (``chain.capture``) must give the bits the
steps give one by one, on one and two threads, in lockstep and on the calling thread alone (``chain.crowded``)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba")

from luminal_recipes.runtimes.cpu import cblas, jit  # noqa: E402
from luminal_recipes.runtimes.cpu import threads as cpu_threads  # noqa: E402

if not jit.AVAILABLE:
    pytest.skip("numba is off (LUMINAL_RECIPES_JIT=0 or LUMINAL_RECIPES_ISA=numpy)", allow_module_level=True)

from luminal_recipes.runtimes.cpu.jit import chain  # noqa: E402
from luminal_recipes.runtimes.cpu.kernels import layout, matmul  # noqa: E402

RNG = np.random.default_rng(7)


def _f32(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def _operands(m: int, k: int, n: int, right_rows: bool):
    """``x [m, k]`` (rows of a wider buffer), ``right [k, n]`` stored as rows of ``w [n, k]`` (a linear layer's
    weight) or row by row, and an output [m, n] inside a wider buffer."""
    x = _f32(m, k + 3)[:, :k]
    right = _f32(n, k).T if right_rows else _f32(k, n)
    out = np.zeros((m, n + 5), np.float32)[:, :n]
    return x, right, out


@pytest.mark.parametrize("right_rows", [True, False])
@pytest.mark.parametrize("m", [1, 3])
def test_few_rows_products_match_numpy(assert_close, monkeypatch, m, right_rows):
    monkeypatch.setattr(cpu_threads, "MIN_PART", 64)  # split over the cores even at this size
    x, right, out = _operands(m, 64, 300, right_rows)
    step = matmul._compiled_product(x, right, out)
    assert step is not None and chain.phases_of(step) is not None, "not a described compiled product"
    step()
    assert_close("matmul", out, x.astype(np.float64) @ right.astype(np.float64))


@pytest.mark.parametrize("m, k, n", [(1, 768, 302), (3, 37, 29), (8, 130, 11)])
def test_rows_product_bits_do_not_depend_on_the_columns_cut(assert_close, m, k, n):
    """``rows_product`` reads its weight ``ROWS`` rows at a time: any cut of the output's columns (parts of one or
    two threads, a chain's finer parts) gives the bits of one call over all of them, and a part writes its own
    columns only."""
    from luminal_recipes.runtimes.cpu.jit import f32_kernels

    x, w = _f32(m, k + 3), _f32(n, k + 1)  # rows of wider buffers
    whole = np.full((m, n + 2), np.nan, np.float32)

    def run(out, lo, hi):
        f32_kernels.rows_product(x.reshape(-1), 0, k + 3, w.reshape(-1), 0, k + 1, out.reshape(-1), 0, n + 2, m, k,
                                 lo, hi)

    run(whole, 0, n)
    assert np.isnan(whole[:, n:]).all()
    assert_close("matmul", whole[:, :n], x[:, :k].astype(np.float64) @ w[:, :k].T.astype(np.float64))
    rows = f32_kernels.ROWS
    for cuts in ([0, 1, n], [0, rows - 1, rows + 1, n], [0, n // 2, n], [*range(0, n, 5), n]):
        cuts = sorted({min(c, n) for c in cuts})
        got = np.full_like(whole, np.nan)
        for lo, hi in zip(cuts, cuts[1:]):
            run(got, lo, hi)
            assert np.isnan(got[:, hi:]).all(), "a part wrote past its columns"
        assert np.array_equal(got, whole, equal_nan=True), f"cut {cuts} changed the bits"


def test_larger_products_are_blas_chunks_on_several_threads(assert_close, monkeypatch):
    if cblas.sgemm() is None:
        pytest.skip("numpy's BLAS is not OpenBLAS: no cblas_sgemm address")
    monkeypatch.setattr(cpu_threads, "THREADS", 2)
    monkeypatch.setattr(matmul, "BLAS_PART_MACS", 1 << 10)
    for m, n, a_t, b_rows in ((40, 24, False, True), (24, 72, True, False), (33, 50, False, False)):
        a = _f32(64, m).T if a_t else _f32(m, 64)
        b = _f32(n, 64).T if b_rows else _f32(64, n)
        out = np.zeros((m, n), np.float32)
        step = matmul._compiled_product(a, b, out)
        assert step is not None and chain.phases_of(step) is not None
        assert any(call.blas for phase in chain.phases_of(step) for call in phase)
        step()
        assert_close("matmul", out, a.astype(np.float64) @ b.astype(np.float64))
    monkeypatch.setattr(cpu_threads, "THREADS", 1)  # one thread: BLAS keeps its own threads, from Python
    assert matmul._compiled_product(_f32(40, 64), _f32(64, 24), np.zeros((40, 24), np.float32)) is None


def test_concatenation_copies_are_exact():
    a, b = _f32(1, 4, 9, 8), _f32(1, 4, 1, 8)
    a[0, 1, 2, 3] = -0.0
    out = np.full((1, 4, 10, 8), np.nan, np.float32)
    step = layout._compiled_copies([(out[:, :, :9], a), (out[:, :, 9:], b)])
    assert step is not None and chain.phases_of(step) is not None
    step()
    want = np.concatenate([a, b], axis=2) + np.float32(0)
    assert np.array_equal(out, want) and not np.signbit(out[0, 1, 2, 3])  # -0.0 + 0 is +0.0, as the padded sum


def test_a_stack_along_a_new_last_axis_is_strided_box_copies(monkeypatch):
    """diffusers' RoPE rotation, ``stack([-x_imag, x_real], -1)``: each piece fills every second element of the
    output, so its rows would be single elements; ``f32_kernels.copy_box`` copies along the strided axis instead
    (described for the chains, exact, on one and two threads)."""
    from luminal_recipes.runtimes.cpu.jit import f32_kernels

    y = _f32(1, 37, 3, 16)
    neg = -y[..., 1::2]
    neg[0, 5, 1, 2] = -0.0
    for threads in (1, 2):
        monkeypatch.setattr(cpu_threads, "THREADS", threads)
        out = np.full((1, 37, 3, 8, 2), np.nan, np.float32)
        step = layout._compiled_copies([(out[..., 0], neg), (out[..., 1], y[..., 0::2])])
        assert step is not None
        assert {call.fn for phase in chain.phases_of(step) for call in phase} == {f32_kernels.copy_box}
        step()
        want = np.stack([neg, y[..., 0::2]], axis=-1) + np.float32(0)
        assert np.array_equal(out, want) and not np.signbit(out[0, 5, 1, 2, 0])


def _program(threads: int):
    """A decode-like run of described steps: products (rows, columns, BLAS chunks), a bias add, a concatenation,
    and the arrays they write."""
    x, w, hidden = _f32(1, 64), _f32(96, 64).T, np.zeros((1, 96), np.float32)
    residual = _f32(1, 96)
    cache, new = _f32(2, 7, 16), _f32(2, 1, 16)
    kv = np.zeros((2, 8, 16), np.float32)
    probs, v, ctx = _f32(2, 8), _f32(8, 16), np.zeros((2, 16), np.float32)
    a, b, big = _f32(48, 64), _f32(64, 40), np.zeros((48, 40), np.float32)
    steps = [matmul._compiled_product(x, w, hidden), matmul._compiled_add(hidden, residual),
             layout._compiled_copies([(kv[:, :7], cache), (kv[:, 7:], new)]),
             matmul._compiled_product(probs, v, ctx)]
    outputs = [hidden, kv, ctx]
    if threads > 1 and cblas.sgemm() is not None:
        steps.append(matmul._compiled_product(a, b, big))
        outputs.append(big)
    assert all(s is not None and chain.phases_of(s) is not None for s in steps)
    return steps, outputs


@pytest.mark.parametrize("crowded", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
def test_chained_kernels_are_bit_identical(monkeypatch, threads, crowded):
    monkeypatch.setattr(cpu_threads, "THREADS", threads)
    monkeypatch.setattr(cpu_threads, "MIN_PART", 64)
    monkeypatch.setattr(matmul, "BLAS_PART_MACS", 1 << 10)
    monkeypatch.setattr(chain, "MIN_SPLIT_PHASES", 1)
    monkeypatch.setattr(chain, "crowded", lambda threads: crowded)  # lockstep, or the calling thread alone
    steps, outputs = _program(threads)
    for step in steps:
        step()
    plain = [o.copy() for o in outputs]
    for o in outputs:
        o.fill(np.nan)
    replay = chain.capture(steps, threads)
    assert replay is not None and replay.chains == 1 and replay.launches == 1  # every step in one chain
    assert replay.lockstep == (threads > 1)
    for _ in range(2):  # a replay resets the BLAS chunks' counter: the second run takes every chunk again
        replay()
        for got, want in zip(outputs, plain):
            assert np.array_equal(got, want), "chained != step by step"
        for o in outputs:
            o.fill(np.nan)
