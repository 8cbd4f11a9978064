"""A chain run in lockstep cuts its kernels' work finer than the kernels do as steps (``threads.CHAIN_MIN_PART``,
``chain.finer``): the element-wise passes, copies, row norms and few-row products are described again at capture
with more parts, which the chain's threads share without a hand-off per kernel. The parts are independent, so the
chained results are bit for bit those of the steps run one by one; a kernel as a step keeps its own parts."""

from __future__ import annotations

import numpy as np
import pytest
from chain_checks import assert_replays_as_steps, run_steps  # tests/runtimes/chain_checks.py

pytest.importorskip("numba")

from luminal_recipes.runtimes.cpu import jit  # noqa: E402
from luminal_recipes.runtimes.cpu import threads as cpu_threads  # noqa: E402

if not jit.AVAILABLE:
    pytest.skip("numba is off (LUMINAL_RECIPES_JIT=0 or LUMINAL_RECIPES_ISA=numpy)", allow_module_level=True)

from luminal_recipes.runtimes.cpu.jit import chain  # noqa: E402
from luminal_recipes.runtimes.cpu.kernels import layout, matmul  # noqa: E402

RNG = np.random.default_rng(11)


def _f32(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def _parts(phases) -> list[int]:
    return [len({c.part for c in phase}) for phase in phases]


def _program():
    """Norm rows, a few-row product over columns, a bias, a concatenation's copies: each one part as a step at
    the default part size (its whole is below ``2 * MIN_PART``)."""
    x = _f32(24, 96)
    normed = np.zeros_like(x)
    scale, shift = _f32(96), _f32(96)
    w, hidden = _f32(200, 96).T, np.zeros((3, 200), np.float32)
    bias = _f32(200)
    a, b = _f32(2, 40, 33), _f32(2, 8, 33)
    cat = np.zeros((2, 48, 33), np.float32)
    kernels = jit.kernels()
    steps = [jit.by_rows(kernels.rms_norm_rows, [x, normed], scale, shift, True, np.float32(1 / 96),
                         np.float32(1e-6)),
             matmul._compiled_product(normed[:3], w, hidden), matmul._compiled_add(hidden, bias),
             layout._compiled_copies([(cat[:, :40], a), (cat[:, 40:], b)])]
    assert all(s is not None and chain.phases_of(s) is not None for s in steps)
    return steps, [normed, hidden, cat]


@pytest.mark.parametrize("crowded", [False, True])
def test_a_lockstep_chain_resplits_its_kernels_bit_identically(monkeypatch, crowded):
    monkeypatch.setattr(cpu_threads, "THREADS", 2)
    monkeypatch.setattr(cpu_threads, "CHAIN_MIN_PART", 64)
    monkeypatch.setattr(chain, "MIN_SPLIT_PHASES", 3)
    monkeypatch.setattr(chain, "crowded", lambda threads: crowded)  # lockstep, or the calling thread alone
    steps, outputs = _program()
    own = [chain.phases_of(s) for s in steps]
    assert all(n == 1 for phases in own for n in _parts(phases)), "the kernels split as steps already"
    assert chain._split_phases(own, 2) < chain.MIN_SPLIT_PHASES  # on their own parts: no lockstep
    fine = [chain.finer(s, 64) for s in steps]
    assert chain._split_phases(fine, 2) >= chain.MIN_SPLIT_PHASES
    plain = run_steps(steps, outputs)
    replay = chain.capture(steps, 2)
    assert replay is not None and replay.chains == 1 and replay.lockstep == 1
    assert_replays_as_steps(replay, outputs, plain, 2, "chained on finer parts")
    assert [_parts(chain.phases_of(s)) for s in steps] == [_parts(p) for p in own]  # steps keep their parts
    for step in steps:  # and still give those bits from Python
        step()
    for got, want in zip(outputs, plain):
        assert np.array_equal(got, want)


def test_a_chain_that_stays_on_one_thread_keeps_the_kernels_parts(monkeypatch):
    """Too few split phases even on finer parts: the chain runs on the calling thread with the steps' own
    parts (a decoding step's small kernels stay whole)."""
    monkeypatch.setattr(cpu_threads, "THREADS", 2)
    monkeypatch.setattr(cpu_threads, "CHAIN_MIN_PART", 64)
    monkeypatch.setattr(chain, "MIN_SPLIT_PHASES", 100)
    steps, _ = _program()
    got = chain._Chain(steps, 2)
    assert got.ok and got.threads == 1
    own_calls = sum(len(phase) for s in steps for phase in chain.phases_of(s))
    assert len(got.keep) == own_calls


def test_finer_parts_never_coarsen_and_are_local_to_the_thread(monkeypatch):
    monkeypatch.setattr(cpu_threads, "THREADS", 2)
    whole = 4 * cpu_threads.MIN_PART
    assert cpu_threads.part_count(8, 3 * 4096) == 1
    with cpu_threads.finer_parts(4096):
        assert cpu_threads.part_count(8, 3 * 4096) == 2
        assert cpu_threads.min_part(1 << 10) == 1 << 10  # below the finer size already: kept
        seen = []
        import threading

        t = threading.Thread(target=lambda: seen.append(cpu_threads.part_count(8, 3 * 4096)))
        t.start()
        t.join()
        assert seen == [1]  # another thread's kernels keep their own parts
    assert cpu_threads.part_count(8, whole) == 2 and cpu_threads.min_part() == cpu_threads.MIN_PART


def _coarse_copy(dst: np.ndarray, src: np.ndarray, own_minimum: int):
    """``dst = src`` in parts of at least ``own_minimum`` elements (a minimum of its own above ``MIN_PART``, as
    the compiled element-wise passes have, ``elementwise.JIT_PART_ELEMS``), described again under
    ``finer_parts``."""
    def describe():
        count = max(1, min(cpu_threads.THREADS, dst.size // cpu_threads.min_part(own_minimum)))
        bounds = [dst.shape[0] * i // count for i in range(count + 1)]
        return [chain.Call(chain.copy_region, (dst[lo:hi], dst[lo:hi], src[lo:hi], False), i)
                for i, (lo, hi) in enumerate(zip(bounds, bounds[1:]))]

    def step():
        dst[...] = src

    return chain.tag(step, describe(), redescribe=lambda: [describe()])


def test_a_kernel_with_a_larger_own_minimum_is_cut_again_at_the_default_chain_part(monkeypatch):
    """At the default ``CHAIN_MIN_PART`` (= ``MIN_PART``) a kernel whose own parts are larger (a SiLU gate of 200k
    elements: one part of ``JIT_PART_ELEMS`` = 2^18 as a step) is described again with ``MIN_PART``-sized parts
    for a lockstep chain, bit for bit the step's result."""
    monkeypatch.setattr(cpu_threads, "THREADS", 2)
    monkeypatch.setattr(chain, "crowded", lambda threads: False)
    monkeypatch.setattr(chain, "MIN_SPLIT_PHASES", 1)
    rows = 3 * cpu_threads.MIN_PART // 64  # 3 * MIN_PART elements: one part at 4 * MIN_PART, two at MIN_PART
    srcs = [_f32(rows, 64) for _ in range(2)]
    dsts = [np.full_like(s, np.nan) for s in srcs]
    steps = [_coarse_copy(d, s, 4 * cpu_threads.MIN_PART) for d, s in zip(dsts, srcs)]
    assert all(_parts(chain.phases_of(s)) == [1] for s in steps)
    assert cpu_threads.CHAIN_MIN_PART == cpu_threads.MIN_PART
    assert all(_parts(chain.finer(s, cpu_threads.CHAIN_MIN_PART)) == [2] for s in steps)
    replay = chain.capture(steps, 2)
    assert replay.lockstep == 1
    replay()
    assert all(np.array_equal(d, s) for d, s in zip(dsts, srcs))


def test_a_compiled_torch_model_chains_finer_parts_bit_identically(monkeypatch, tmp_path):
    """End to end: an f32 block through the torch backend (element-wise passes, layer and RMS norms, products,
    a concatenation) on two threads, its chains captured on finer parts, against the same model with chains
    off."""
    torch = pytest.importorskip("torch")
    monkeypatch.setenv("LUMINAL_RECIPES_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_threads, "THREADS", 2)
    monkeypatch.setattr(cpu_threads, "CHAIN_MIN_PART", 256)
    monkeypatch.setattr(chain, "ADAPTIVE", False)  # lockstep even on a loaded machine

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.LayerNorm(64)
            self.rms = torch.nn.RMSNorm(64, eps=1e-6)
            self.up = torch.nn.Linear(64, 64)

        def forward(self, x):
            h = torch.nn.functional.gelu(self.norm(x), approximate="tanh") * 1.5 + x
            r = self.rms(h) * torch.sigmoid(h)
            g = torch.cat([r, h], -1)[..., 32:96] * 0.5 - r
            return self.up(self.norm(g)[:, :3]), torch.nn.functional.silu(self.rms(g + h) * 2.0)

    torch.manual_seed(0)
    model = Block().eval()
    x = torch.randn(1, 512, 64)
    replays = []
    capture = chain.capture

    def recording(steps, threads, *rest):
        got = capture(steps, threads, *rest)
        replays.append(got)
        return got

    monkeypatch.setattr(chain, "capture", recording)

    def run(chained: bool):
        monkeypatch.setenv(chain.ENV, "1" if chained else "0")
        torch._dynamo.reset()
        fn = torch.compile(lambda x: model(x), backend="luminal")
        with torch.no_grad():
            outs = [tuple(t.clone() for t in fn(x)) for _ in range(8)]  # chains recorded on a later run
        return outs

    chained = run(True)
    lockstep = sum(r.lockstep for r in replays if r is not None)
    plain = run(False)
    assert lockstep >= 1, "no chain ran on both threads"
    for a, b in zip(chained, plain):
        for u, v in zip(a, b):
            assert torch.equal(u, v), "chained on finer parts != step by step"
