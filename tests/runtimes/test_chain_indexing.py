"""``Gather`` and a copying ``Scatter`` of a few rows as compiled calls inside the CPU backend's chains
(``chain.gather_rows``; ``copy_region`` then ``scatter_rows``): a decoding step with a static KV cache (the graph
torch hands over for ``index_copy``, which returns the new cache) and RoPE's table lookups no longer cut its chain
at every layer. Replayed, the outputs are numpy's; an index out of range still raises the kernel's located error
after the chains are recorded, and the next run replays again."""

from __future__ import annotations

import numpy as np
import pytest
from fused_programs import Fused

from luminal_recipes.errors import InputError
from luminal_recipes.graph import Graph
from luminal_recipes.runtimes.cpu import jit
from luminal_recipes.runtimes.cpu import threads as cpu_threads

if not jit.AVAILABLE:
    pytest.skip("numba is off: no chains", allow_module_level=True)

from luminal_recipes.runtimes.cpu.jit import chain  # noqa: E402


def _program():
    g = Graph()
    ids = g.input("ids", (1,), "i32")
    cache = g.input("cache", (8, 4))
    pos = g.input("pos", (1,), "i32")
    table = g.weight("table", (6, 4))
    f = Fused(g)
    rows = f.add("Gather", [table, ids], (1, 4))
    y = f.add("Scatter", [cache, pos, f.edge(rows)], (8, 4))  # a copy of the cache with one row replaced
    z = f.add("Add", [f.edge(y), f.edge(y)], (8, 4))
    return f.program(y=y, z=z, rows=rows), {"table": np.arange(24, dtype=np.float32).reshape(6, 4)}


@pytest.mark.parametrize("threads", [1, 2])
def test_gather_and_copying_scatter_replay_in_chains(numpy_runtime, monkeypatch, threads, rng):
    monkeypatch.setattr(cpu_threads, "THREADS", threads)
    monkeypatch.setenv(chain.ENV, "1")
    program, weights = _program()
    exe = numpy_runtime.load(program, weights)
    cache = rng.standard_normal((8, 4)).astype(np.float32)
    for step in range(8):
        ins = {"ids": np.array([5 - step % 6], np.int32), "cache": cache,
               "pos": np.array([step], np.int32)}
        out = exe.run(ins)
        rows = weights["table"][ins["ids"]]
        want = cache.copy()
        want[step] = rows[0]
        assert np.array_equal(out["rows"], rows) and np.array_equal(out["y"], want)
        assert np.array_equal(out["z"], want + want)
    assert exe.replaying and exe._replay.chains >= 1
    assert exe._replay.launches < len(exe._steps)  # the Gather and the Scatter run inside a chain
    with pytest.raises(InputError, match="Gather .*out of range"):
        exe.run({**ins, "ids": np.array([6], np.int32)})
    with pytest.raises(InputError, match="Scatter .*out of range"):
        exe.run({**ins, "pos": np.array([8], np.int32)})
    out = exe.run({**ins, "pos": np.array([2], np.int32)})  # replays again after the errors
    want = cache.copy()
    want[2] = weights["table"][ins["ids"][0]]
    assert np.array_equal(out["y"], want)
