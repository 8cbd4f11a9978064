"""ModelEngine serves exact lengths from size buckets: one plan and one load per bucket, a re-binding (no
reload, no allocation) for each new length inside it, results equal to the reference at every length."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from luminal_recipes import ops
from luminal_recipes.graph import Graph, run_reference
from luminal_recipes.pipeline.engine import ModelEngine, bucket_dims


def small_model():
    g = Graph()
    x = g.input("x", ("s", 8))
    h = ops.softmax(ops.linear(x, g.weight("w", (12, 8))), -1)
    g.mark_output("y", ops.linear(h, g.weight("w2", (8, 12))) + x)
    rng = np.random.default_rng(0)
    weights = {"w": rng.standard_normal((12, 8)).astype(np.float32),
               "w2": rng.standard_normal((8, 12)).astype(np.float32)}
    model = SimpleNamespace(name="small", graph=g, inputs={"x": g.tensor("x")}, load_weight=weights.__getitem__)
    return model, weights


def test_bucket_dims():
    assert bucket_dims({"s": 5, "t": 1, "u": 64}) == {"s": 8, "t": 1, "u": 64}
    assert bucket_dims({"s": 5, "t": 300}, {"t": [128, 512]}) == {"s": 8, "t": 512}
    assert bucket_dims({"t": 600}, {"t": [128, 512]}) == {"t": 1024}


def test_one_load_per_bucket_and_rebinding_within_it(assert_close):
    model, weights = small_model()
    engine = ModelEngine(model)
    rng = np.random.default_rng(1)
    for s in (5, 7, 3, 8, 9, 16, 2):
        x = rng.standard_normal((s, 8)).astype(np.float32)
        got = engine({"x": x})["y"]
        assert_close("runtime", got, run_reference(model.graph, {"x": x}, weights, {"s": s})["y"])
    assert engine.stats.loads == 2  # buckets 8 and 16
    assert engine.stats.rebinds >= 5
    for exe in engine._executables.values():
        assert exe.stats.arena_allocations == 0  # every length fitted the arena loaded for its bucket
    engine.release()
