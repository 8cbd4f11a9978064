"""AMX products inside the CPU chains (``runtimes/cpu/amx/__init__.py`` ``product``, ``gemm.gemm_row_chunks``,
``gemm_col_chunks``, ``gemm_part``): one compiled call per part, described for the chains. A chain of dependent
products gives the steps' own bits, whether it runs in lockstep on two threads (one heavy split phase is enough:
``chain.LOCKSTEP_WORK``) or alone; operands with an inf or a NaN are multiplied one f32 multiply and add at a time
in the chunks or blocks that hold them, so the product is non-finite exactly where numpy's is, the same bits on
every schedule. Skipped where the CPU (or the process) cannot run AMX, or numba is off."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba")

from luminal_recipes.runtimes.cpu import amx, jit  # noqa: E402

if not jit.AVAILABLE:
    pytest.skip("numba is off: no chains", allow_module_level=True)
if not amx.available():
    pytest.skip(f"no AMX here: {amx.reason_unavailable()}", allow_module_level=True)

from luminal_recipes.runtimes.cpu.jit import chain  # noqa: E402

# (m, k, n) with 2 parts: row chunks (fewer columns than rows), column chunks (A packed once), fixed parts
SHAPES = {"rows": (1088, 64, 576), "columns": (96, 64, 2048), "fixed": (1024, 512, 600)}


def _steps(rng, kind: str, threads: int = 2):
    """Three dependent products: ``y1 = x @ w1``, ``y2 = y1[:, :k] @ w2``, ``y3 = y2[:, :k] @ w3`` (plans for
    ``threads`` cores), and the arrays they read and write."""
    m, k, n = SHAPES[kind]
    assert n >= k  # (y[:, :k] is the next product's left operand)
    x = rng.standard_normal((m, k)).astype(np.float32)
    ws = [(rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32) for _ in range(3)]
    outs = [np.full((m, n), np.nan, np.float32) for _ in range(3)]
    plan = amx.plan(m, k, n, threads)
    steps = []
    for i, (w, out) in enumerate(zip(ws, outs)):
        left = x if i == 0 else outs[i - 1][:, :k]
        scratch = [[amx.aligned_empty(s, d) for s, d in plan.scratch_shapes] for _ in plan.parts]
        steps.append(amx.product(plan, left, w, out, scratch))
    return plan, steps, x, ws, outs


@pytest.fixture
def machine_free(monkeypatch):
    monkeypatch.setattr(chain, "crowded", lambda threads: False)


@pytest.mark.parametrize("kind", sorted(SHAPES))
def test_chained_products_give_the_steps_bits_in_lockstep_and_alone(kind, machine_free, monkeypatch):
    rng = np.random.default_rng(len(kind))
    plan, steps, x, ws, outs = _steps(rng, kind)
    assert len(plan.parts) == 2 and bool(plan.row_chunks) == (kind == "rows")
    assert bool(plan.chunks) == (kind == "columns")
    assert all(chain.phases_of(s) is not None for s in steps)
    for step in steps:
        step()
    want = [o.copy() for o in outs]
    exact = x.astype(np.float64) @ ws[0].astype(np.float64)
    np.testing.assert_allclose(want[0], exact, rtol=1e-5, atol=1e-5)  # (tests/TOLERANCES.md, matmul f32)

    replay = chain.capture(steps, 2)  # one split phase per product, far below MIN_SPLIT_PHASES: heavy ones
    assert replay.chains == 1 and replay.lockstep == 1
    for _ in range(3):
        for o in outs:
            o[...] = np.nan
        before = chain.RUNS["lockstep"]
        replay()
        assert chain.RUNS["lockstep"] == before + 1
        assert all(np.array_equal(o, w) for o, w in zip(outs, want))

    monkeypatch.setattr(chain, "LOCKSTEP_WORK", 1 << 62)  # light: the chain's parts one after another, alone
    replay = chain.capture(steps, 2)
    assert replay.chains == 1 and replay.lockstep == 0
    for o in outs:
        o[...] = np.nan
    replay()
    assert all(np.array_equal(o, w) for o, w in zip(outs, want))


@pytest.mark.parametrize("kind", sorted(SHAPES))
@pytest.mark.parametrize("where", ["a", "b"])
def test_non_finite_operands_give_numpys_infinities_and_nans_on_every_schedule(kind, where, machine_free):
    rng = np.random.default_rng(7)
    plan, steps, x, ws, outs = _steps(rng, kind)
    m, k, n = SHAPES[kind]
    if where == "a":
        x[m - 3, 5], x[m // 2, k - 1] = np.inf, np.nan
    else:
        ws[0][3, n - 2], ws[0][k - 1, 1] = -np.inf, np.nan
    with np.errstate(invalid="ignore", over="ignore"):
        want = x @ ws[0]
        steps[0]()
    got = outs[0].copy()
    assert np.array_equal(np.isnan(got), np.isnan(want)) and np.array_equal(np.isinf(got), np.isinf(want))
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-5, atol=1e-5)
    replay = chain.capture(steps[:2], 2)
    assert replay.lockstep == 1
    with np.errstate(invalid="ignore", over="ignore"):
        for run in [replay] * 3 + [steps[0]] * 3:  # chained in lockstep, and the step: whichever part claims
            outs[0][...] = 0  # which chunk, the same bits
            run()
            assert np.array_equal(outs[0], got, equal_nan=True)
