"""A decoding product's parts in a lockstep chain taking their chunks from atomic counters
(``f32_kernels.claimed_product``): whoever computes a chunk, in whatever order, the output is the bits of one
``rows_product`` / ``cols_product`` call over every column; a part whose partner has not started computes every
chunk itself; the last part leaves the counters at zero for the next run, and a chain that stops midway zeroes
them (``chain._Chain._stopped``), so its next run is right again."""

from __future__ import annotations

import threading

import numpy as np
import pytest

pytest.importorskip("numba")

from luminal_recipes.runtimes.cpu import jit  # noqa: E402
from luminal_recipes.runtimes.cpu import threads as cpu_threads  # noqa: E402

if not jit.AVAILABLE:
    pytest.skip("numba is off (LUMINAL_RECIPES_JIT=0 or LUMINAL_RECIPES_ISA=numpy)", allow_module_level=True)

from luminal_recipes.runtimes.cpu.jit import chain, f32_kernels  # noqa: E402
from luminal_recipes.runtimes.cpu.kernels import matmul  # noqa: E402

RNG = np.random.default_rng(11)


def _case(kernel_id: int, m: int, k: int, n: int):
    """``x`` [m, k] and the right operand (``w`` [n, k] as rows for ``rows_product``, [k, n] row by row for
    ``cols_product``) in wider buffers, and the one-call result over all ``n`` columns."""
    x = RNG.standard_normal((m, k + 3)).astype(np.float32)
    w = RNG.standard_normal((n, k + 1) if kernel_id == 0 else (k, n + 1)).astype(np.float32)
    ws = w.shape[1]
    whole = np.full((m, n + 2), np.nan, np.float32)
    kernel = f32_kernels.rows_product if kernel_id == 0 else f32_kernels.cols_product
    kernel(x.reshape(-1), 0, k + 3, w.reshape(-1), 0, ws, whole.reshape(-1), 0, n + 2, m, k, 0, n)
    counters = f32_kernels.claim_counters(2)

    def part(out: np.ndarray, p: int, parts: int = 2, chunk: int = f32_kernels.ROWS) -> None:
        f32_kernels.claimed_product(kernel_id, x.reshape(-1), 0, k + 3, w.reshape(-1), 0, ws, out.reshape(-1), 0,
                                    n + 2, m, k, n, chunk, counters, p, parts)

    return whole, counters, part


@pytest.mark.parametrize("kernel_id", [0, 1])
@pytest.mark.parametrize("m, k, n", [(1, 768, 302), (3, 37, 29), (8, 130, 11), (2, 64, 1000)])
def test_claimed_parts_give_the_bits_of_one_call_whoever_runs_them(kernel_id, m, k, n):
    whole, counters, part = _case(kernel_id, m, k, n)
    for order in ([0, 1], [1, 0], "threads"):
        for chunk in (f32_kernels.ROWS, 3 * f32_kernels.ROWS):
            got = np.full_like(whole, np.nan)
            if order == "threads":  # both parts at once (the kernel releases the GIL)
                workers = [threading.Thread(target=part, args=(got, p, 2, chunk)) for p in (0, 1)]
                for w in workers:
                    w.start()
                for w in workers:
                    w.join()
            else:
                for p in order:
                    part(got, p, 2, chunk)
            assert np.array_equal(got, whole, equal_nan=True), f"order {order}, chunk {chunk}: other bits"
            assert not counters.any(), "the last part left its counters set"


def test_a_part_whose_partner_has_not_started_computes_every_chunk():
    """Part 1 runs first and alone: it takes its own run of chunks, then part 0's; part 0 then finds none left."""
    whole, counters, part = _case(0, 1, 96, 400)
    got = np.full_like(whole, np.nan)
    part(got, 1)
    assert np.array_equal(got, whole, equal_nan=True), "part 1 did not take part 0's chunks"
    assert counters.any(), "counters zeroed before the other part ran"
    got.fill(np.nan)  # part 0 must write nothing now
    part(got, 0)
    assert np.isnan(got).all() and not counters.any()


def _chained_product(monkeypatch):
    """A 2-thread lockstep chain of a decode-sized product (its parts claimed) and a checked row scatter after
    it; the made chain, the steps' outputs, the scatter's index and the product's counters."""
    monkeypatch.setattr(cpu_threads, "THREADS", 2)
    monkeypatch.setattr(cpu_threads, "MIN_PART", 64)
    monkeypatch.setattr(chain, "MIN_SPLIT_PHASES", 1)
    monkeypatch.setattr(chain, "crowded", lambda threads: False)
    made = []
    init = chain._Chain.__init__

    def recording(self, steps, threads, *rest):
        init(self, steps, threads, *rest)
        made.append(self)

    monkeypatch.setattr(chain._Chain, "__init__", recording)
    x = RNG.standard_normal((1, 256)).astype(np.float32)
    w = RNG.standard_normal((600, 256)).astype(np.float32)
    out = np.zeros((1, 600), np.float32)
    product = matmul._compiled_product(x, w.T, out)
    table = np.zeros((16, 600), np.float32)
    idx = np.array([3], np.int64)

    def scatter():
        if not 0 <= idx[0] < table.shape[0]:
            raise IndexError(f"row {idx[0]} outside the table of {table.shape[0]} (step 'scatter')")
        table[idx] = out

    scatter_step = chain.tag(scatter, [chain.Call(chain.scatter_rows, (table, idx, out, table.shape[0]), None,
                                                  checked=True, access=((idx, out), (table,)))])
    replay = chain.capture([product, scatter_step], 2)
    assert replay is not None and made and made[0].threads == 2
    assert len(made[0].claims) == 1, "the product's parts are not claimed in the lockstep chain"
    return replay, out, table, idx, made[0].claims[0], x, w


def test_a_lockstep_chain_gives_the_products_bits_and_zeroes_counters_left_by_a_stopped_run(monkeypatch):
    replay, out, table, idx, counters, x, w = _chained_product(monkeypatch)
    want = np.zeros_like(out)
    f32_kernels.rows_product(x.reshape(-1), 0, 256, w.reshape(-1), 0, 256, want.reshape(-1), 0, 600, 1, 256, 0, 600)
    for _ in range(3):
        out.fill(np.nan)
        replay()
        assert np.array_equal(out, want) and np.array_equal(table[3], want[0])
        assert not counters.any()
    counters[0] = 10**6  # as a run that stopped after one part's claims would leave them: every chunk "taken"
    counters[-8] = 1
    idx[0] = 99
    with pytest.raises(IndexError, match="row 99"):
        replay()
    assert not counters.any(), "a stopped run left the product's counters set"
    idx[0] = 5
    out.fill(np.nan)
    replay()
    assert np.array_equal(out, want) and np.array_equal(table[5], want[0])
