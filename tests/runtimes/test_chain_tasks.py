"""Independent single-thread calls of a lockstep chain spread over its threads (``chain._assign_run``): two branches
that share no memory one of them writes run one on each thread between the same barriers, a phase of several
calls (a norm's heads) is shared out, and the replays stay bit for bit the steps run one by one - in lockstep,
alone on a crowded machine, and with ``chain.TASKS`` off. A checked call refusing its input on the second thread
still raises its step's own error."""

from __future__ import annotations

import numpy as np
import pytest
from chain_checks import assert_replays_as_steps, run_steps  # tests/runtimes/chain_checks.py

pytest.importorskip("numba")

from luminal_recipes.runtimes.cpu import jit  # noqa: E402

if not jit.AVAILABLE:
    pytest.skip("numba is off (LUMINAL_RECIPES_JIT=0 or LUMINAL_RECIPES_ISA=numpy): no chains", allow_module_level=True)

from luminal_recipes.runtimes.cpu.jit import chain  # noqa: E402

RNG = np.random.default_rng(5)


def _split_copy(dst: np.ndarray, src: np.ndarray):
    """``dst = src`` in two parts (row halves, thread 0 and 1), with their access."""
    h = dst.shape[0] // 2
    pairs = [(dst[:h], src[:h]), (dst[h:], src[h:])]

    def step():
        for d, s in pairs:
            d[...] = s

    return chain.tag(step, [chain.Call(chain.copy_region, (d, d, s, False), i, access=((s,), (d,)))
                            for i, (d, s) in enumerate(pairs)])


def _whole_copy(dst: np.ndarray, src: np.ndarray, part=None):
    """``dst = src`` as one call (a single-part kernel: thread 0 unless spread)."""

    def step():
        dst[...] = src

    return chain.tag(step, [chain.Call(chain.copy_region, (dst, dst, src, False), part, access=((src,), (dst,)))])


def _recording(monkeypatch) -> list:
    made = []
    init = chain._Chain.__init__

    def recording(self, steps, threads, *rest):
        init(self, steps, threads, *rest)
        made.append(self)

    monkeypatch.setattr(chain._Chain, "__init__", recording)
    return made


def _threads_of_rows(made_chain) -> list[int]:
    program, _ = made_chain.layouts[made_chain.threads]
    return [int(t) for op, t, *_ in program if op != chain.BARRIER]


def _branches():
    """A split step, then two dependent pairs of whole copies (branch a from its output, branch b from y),
    interleaved in program order, then a split copy of each branch's result."""
    x, y = (RNG.standard_normal((256, 64)).astype(np.float32) for _ in range(2))
    x2, a1, a2, b1, b2, d, e = (np.zeros((256, 64), np.float32) for _ in range(7))
    steps = [_split_copy(x2, x), _whole_copy(a1, x2), _whole_copy(b1, y), _whole_copy(a2, a1),
             _whole_copy(b2, b1), _split_copy(d, a2), _split_copy(e, b2)]
    return steps, (x2, a1, a2, b1, b2, d, e)


@pytest.mark.parametrize("tasks", [True, False])
@pytest.mark.parametrize("crowded", [False, True])
def test_independent_branches_run_one_on_each_thread(monkeypatch, tasks, crowded):
    monkeypatch.setattr(chain, "MIN_SPLIT_PHASES", 1)
    monkeypatch.setattr(chain, "TASKS", tasks)
    monkeypatch.setattr(chain, "crowded", lambda threads: crowded)
    made = _recording(monkeypatch)
    steps, outputs = _branches()
    plain = run_steps(steps, outputs)
    replay = chain.capture(steps, 2)
    assert replay is not None and replay.chains == 1 and replay.lockstep == 1
    rows = _threads_of_rows(made[0])  # x2 (2 parts), a1, b1, a2, b2, d (2), e (2)
    branch_a, branch_b = (rows[2], rows[4]), (rows[3], rows[5])
    if tasks:
        assert len(set(branch_a)) == 1 and len(set(branch_b)) == 1 and set(branch_a) != set(branch_b)
    else:
        assert branch_a == branch_b == (0, 0)
    # a barrier after the split step (a1 reads both halves of x2), none between the branches, one before the
    # split copies (they read what one thread wrote from both), the end
    program, _ = made[0].layouts[2]
    assert int((program[:, 0] == chain.BARRIER).sum()) == 3
    assert_replays_as_steps(replay, outputs, plain, 3)


def test_a_phase_of_several_calls_is_shared_out(monkeypatch):
    """One step's whole calls on disjoint blocks (a norm over its heads, each head one call) in one phase: spread
    over both threads when they write ``SPREAD_BYTES`` or more; fewer bytes stay on thread 0."""
    monkeypatch.setattr(chain, "MIN_SPLIT_PHASES", 1)
    monkeypatch.setattr(chain, "crowded", lambda threads: False)
    made = _recording(monkeypatch)
    for rows, spread in ((64, True), (8, False)):
        x = RNG.standard_normal((rows, 4, 128)).astype(np.float32)
        x2, out = np.zeros_like(x), np.zeros_like(x)
        heads = [(out[:, h], x2[:, h]) for h in range(4)]  # strided views: their extents overlap

        def step(heads=heads):
            for d, s in heads:
                d[...] = s

        heads_step = chain.tag(step, [chain.Call(chain.copy_region, (d, d, s, False), None, access=((s,), (d,)))
                                      for d, s in heads])
        steps = [_split_copy(x2.reshape(rows, -1), x.reshape(rows, -1)), heads_step]
        replay = chain.capture(steps, 2)
        threads = _threads_of_rows(made[-1])[2:]
        assert (set(threads) == {0, 1}) == spread and (out.nbytes >= chain.SPREAD_BYTES) == spread
        replay()
        assert np.array_equal(out, x)


def test_a_refusal_on_the_second_thread_raises_its_steps_error(monkeypatch):
    """Branch b's checked row scatter gets an index out of range while it runs on thread 1: the chain stops at
    its next barrier and that step runs on its own, raising its own error."""
    monkeypatch.setattr(chain, "MIN_SPLIT_PHASES", 1)
    monkeypatch.setattr(chain, "crowded", lambda threads: False)
    made = _recording(monkeypatch)
    x = RNG.standard_normal((256, 64)).astype(np.float32)
    x2, a1, a2 = (np.zeros((256, 64), np.float32) for _ in range(3))
    table = np.zeros((16, 64), np.float32)
    idx = np.array([3], np.int64)
    src = np.ones((1, 64), np.float32)

    class Located(IndexError):
        pass

    def scatter():
        if not 0 <= idx[0] < table.shape[0]:
            raise Located(f"row {idx[0]} outside the table of {table.shape[0]} (step 'scatter')")
        table[idx] = src

    scatter_step = chain.tag(scatter, [chain.Call(chain.scatter_rows, (table, idx, src, table.shape[0]), None,
                                                  checked=True, access=((idx, src), (table,)))])
    big = np.zeros((256, 64), np.float32)
    steps = [_split_copy(x2, x), _whole_copy(a1, x2), scatter_step, _whole_copy(a2, a1),
             _whole_copy(big, x), _split_copy(np.zeros_like(x), a2)]
    replay = chain.capture(steps, 2)
    rows = _threads_of_rows(made[0])
    assert rows[3] != rows[2], "the scatter did not move to the other thread"
    replay()
    assert table[3, 0] == 1.0
    idx[0] = 99
    with pytest.raises(Located, match="row 99"):
        replay()


def test_branches_that_reuse_each_others_bytes_are_pulled_apart(monkeypatch, tmp_path):
    """End to end through the torch backend: a layer norm split over both threads, then two branches (q and k:
    an RMS norm, a rotation's stack and its sum each) whose temporaries the memory planner packs into each other's
    bytes, so as planned the second branch waits for the first. The chain moves such a temporary to private memory
    (``rename``) and runs the branches one on each thread; every output is bit for bit the steps' one by one, in
    lockstep and alone on a crowded machine."""
    torch = pytest.importorskip("torch")
    from luminal_recipes.runtimes.cpu import threads as cpu_threads

    monkeypatch.setenv("LUMINAL_RECIPES_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_threads, "THREADS", 2)
    monkeypatch.setattr(chain, "MIN_SPLIT_PHASES", 1)

    class Branches(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.LayerNorm(128)
            self.q_norm = torch.nn.RMSNorm(64, eps=1e-6)
            self.k_norm = torch.nn.RMSNorm(64, eps=1e-6)

        @staticmethod
        def rotate(x, cos, sin):
            pairs = x.unflatten(-1, (-1, 2))
            turned = torch.stack([-pairs[..., 1], pairs[..., 0]], -1).flatten(-2)
            return x * cos + turned * sin

        def forward(self, x, cos, sin):
            h = self.norm(x) * 1.5
            q, k = h[..., :64], h[..., 64:]
            return (self.rotate(self.q_norm(q) * 0.5, cos, sin) + 1.0,
                    self.rotate(self.k_norm(k) * 2.0, cos, sin) - 1.0)

    torch.manual_seed(0)
    model = Branches().eval()
    x, cos, sin = torch.randn(1, 1024, 128), torch.randn(1024, 64), torch.randn(1024, 64)
    made = _recording(monkeypatch)

    def run(chained: bool, crowded: bool = False):
        monkeypatch.setenv(chain.ENV, "1" if chained else "0")
        monkeypatch.setattr(chain, "crowded", lambda threads: crowded)
        torch._dynamo.reset()
        fn = torch.compile(lambda *a: model(*a), backend="luminal")
        with torch.no_grad():
            return [tuple(t.clone() for t in fn(x, cos, sin)) for _ in range(8)]  # chains recorded on a later run

    lockstep = run(True)
    moved = [c for c in made if c.threads == 2 and c.private]
    assert moved, "no temporary moved to private memory"
    assert any(1 in set(_threads_of_rows(c)[2:]) for c in moved), "the branches did not spread"
    alone = run(True, crowded=True)
    plain = run(False)
    for a, b, c in zip(lockstep, alone, plain):
        for u, v, w in zip(a, b, c):
            assert torch.equal(u, w), "lockstep chain != step by step"
            assert torch.equal(v, w), "chain alone != step by step"
