"""The 16-dim attention kernel (``kernels/attention_small.py``) described for the CPU chains (``jit/chain.py``): its
(head, query block) tasks split into one share per thread, each call declaring what it reads and writes
(``Call.access``) and how much it does (``Call.work``), so that on two threads it runs inside a lockstep chain
(one heavy split phase is enough: ``chain.SPLIT_WORK``), and on a crowded machine it leaves the chain's one-thread
program to run on the kernels' pool as it does outside a chain. Chained, lockstep or crowded, the outputs are the
bits of the steps run one by one, and PyTorch's SDPA values (tests/TOLERANCES.md "attention")."""

from __future__ import annotations

import numpy as np
import pytest
from fused_programs import Fused

from luminal_recipes import ops
from luminal_recipes.graph import Graph
from luminal_recipes.runtimes.cpu import jit
from luminal_recipes.runtimes.cpu import threads as cpu_threads
from luminal_recipes.runtimes.cpu.kernels import attention as numpy_attention

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not jit.AVAILABLE, reason="the compiled kernel and the chains need numba")

from luminal_recipes.runtimes.cpu.jit import chain  # noqa: E402

H, S, D = 3, 70, 16
RUNS = 8  # the chains are recorded at the fifth run


def _program():
    """Two attentions in a row over token-major q, k, v (views of one ``[S, 3, H, D]`` tensor, as FLUX.2's blocks
    read them): the second takes the first's output as its queries, so its calls read what both threads wrote."""
    g = Graph()
    qkv = g.input("qkv", (1, S, 3, H, D))
    q, k, v = (qkv.slice(2, i, i + 1).reshape((1, S, H, D)).permute((0, 2, 1, 3)) for i in range(3))
    y1 = ops.scaled_dot_product_attention(q, k, v, scale=0.3)
    g.mark_output("y", ops.scaled_dot_product_attention(y1, k, v, scale=0.3))
    f = Fused(g)
    a = f.add("Attention", [q, k, v], (1, H, S, D), scale=0.3)
    b = f.add("Attention", [f.edge(a), k, v], (1, H, S, D), scale=0.3)
    return f.program(y=b)


def _torch(x: np.ndarray) -> np.ndarray:
    qkv = torch.from_numpy(x).double()
    q, k, v = (qkv[:, :, i].permute(0, 2, 1, 3) for i in range(3))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    return sdpa(sdpa(q, k, v, scale=0.3), k, v, scale=0.3).numpy()


@pytest.mark.parametrize("crowd", [False, True])
def test_chained_16_dim_attention_is_bit_identical_and_split(numpy_runtime, assert_close, monkeypatch, crowd):
    monkeypatch.setattr(cpu_threads, "THREADS", 2)
    monkeypatch.setattr(numpy_attention, "MIN_ROWS", 1)  # several query blocks per head
    monkeypatch.setattr(chain, "SPLIT_WORK", 1000)  # this small case counts as heavy
    monkeypatch.setattr(chain, "crowded", lambda threads: crowd)
    monkeypatch.setenv(chain.ENV, "1")
    made = []
    init = chain._Chain.__init__

    def recording(self, steps, threads):
        init(self, steps, threads)
        made.append(self)

    monkeypatch.setattr(chain._Chain, "__init__", recording)
    pool_parts = []
    run_parts = cpu_threads.run_parts

    def spy(parts):
        pool_parts.append(len(parts))
        return run_parts(parts)

    monkeypatch.setattr(cpu_threads, "run_parts", spy)
    x = (2 * np.random.default_rng(5).standard_normal((1, S, 3, H, D))).astype(np.float32)
    exe = numpy_runtime.load(_program())
    outs = [np.array(exe.run({"qkv": x})["y"], copy=True) for _ in range(RUNS)]
    assert exe._replay is not None and exe._replay.chains == 1, "the two attentions were not chained"
    (made_chain,) = made
    assert made_chain.threads == 2, "one heavy split phase did not put the chain in lockstep"
    phases = [p for s in made_chain.steps for p in chain.phases_of(s)]
    attention_calls = [c for p in phases for c in p if c.fn.__name__ == "attention16"]
    assert {c.part for c in attention_calls} == {0, 1}, "the tasks are not split over both threads"
    assert all(c.access is not None and c.work > 0 for c in attention_calls)
    for got in outs[1:]:
        assert np.array_equal(got, outs[0]), "chained != step by step"
    assert_close("attention", outs[-1], _torch(x))
    replays = RUNS - exe._capture_after
    if crowd:  # each attention step handed to the pool, as outside a chain; no lockstep run
        assert made_chain.segments is not None and sum(seg[2] is not None for seg in made_chain.segments) == 2
        assert len(pool_parts) >= 2 * RUNS
    else:  # the lockstep chain: one pool hand-off per replay (the chain's), none per attention
        assert len(pool_parts) == 2 * (RUNS - replays)


def test_split_work_decides_lockstep(monkeypatch):
    """Fewer split phases than ``MIN_SPLIT_PHASES`` run the chain on one thread unless one of them is heavy."""
    monkeypatch.setattr(chain, "MIN_SPLIT_PHASES", 8)
    x = np.ones((8, 16), np.float32)
    a, b = np.zeros_like(x), np.zeros_like(x)

    def copies(dst, src, work):
        def step():
            dst[...] = src

        return chain.tag(step, [chain.Call(chain.copy_region, (dst[i::2], dst[i::2], src[i::2], False), i,
                                           access=((src[i::2],), (dst[i::2],)), work=work) for i in range(2)])

    light = chain._Chain([copies(a, x, 10), copies(b, a, 10)], 2)
    heavy = chain._Chain([copies(a, x, 10), copies(b, a, chain.SPLIT_WORK)], 2)
    assert light.ok and heavy.ok
    assert light.threads == 1 and light.segments is None
    assert heavy.threads == 2
    assert [seg[2] for seg in heavy.segments] == [None, 1]
