"""Device graphs in the generic executable (``backend.graphs``/``capture``; CUDA graphs on the GPU, exercised by
bench/gpu_check.py): recorded at the second run of a binding and replayed after, with the same results; a re-binding
records again; steps a backend refuses to record, and streamed weights, run one by one after a one-line notice.

Here a recording backend stands in for the GPU: the cuda-emu backend whose ``capture`` keeps the steps (deferring
index checks to after each replay, as the CUDA backend does) and replays them."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from luminal_recipes import ops
from luminal_recipes.errors import InputError
from luminal_recipes.graph import Graph
from luminal_recipes.runtimes.backend import GraphCaptureError
from luminal_recipes.runtimes.cuda import CudaEmuBackend, CudaRuntime
from luminal_recipes.runtimes.program import Program

pytestmark = pytest.mark.skipif(not shutil.which("g++"), reason="cuda-emu needs g++")


class RecordingBackend(CudaEmuBackend):
    """cuda-emu with "graphs": capture keeps the steps; a replay runs them with index checks deferred."""

    graphs = True

    def __init__(self, refuse: str | None = None):
        super().__init__()
        self.refuse, self.captures, self.replays, self.deferred = refuse, 0, 0, 0

    def capture(self, steps):
        if self.refuse:
            raise GraphCaptureError(self.refuse)
        self.captures += 1
        recorded = list(steps)

        def replay():  # on a GPU: launch the graph, then the index checks its recording deferred
            self.replays += 1
            checks = []
            self.deferred_checks = checks
            try:
                for step in recorded:
                    step()
            finally:
                self.deferred_checks = None
            self.deferred += len(checks)
            for check in checks:
                check()

        return replay


def _embedding_program():
    g = Graph()
    ids = g.input("ids", ("n",), "i32")
    table = g.weight("table", (7, 5))
    g.mark_output("y", ops.embedding(ids, table) * 2.0)
    return Program.from_graph(g), {"table": np.arange(35, dtype=np.float32).reshape(7, 5)}


def test_the_second_run_records_and_later_runs_replay_the_same_results(capfd):
    backend = RecordingBackend()
    program, weights = _embedding_program()
    exe = CudaRuntime(backend).load(program, weights, {"n": 4})
    ids = np.array([0, 6, 2, 3], np.int32)
    want = weights["table"][ids] * 2
    first = exe.run({"ids": ids})["y"]
    assert not exe.replaying and backend.captures == 0  # the first run warms up, kernel by kernel
    for _ in range(3):
        assert np.array_equal(exe.run({"ids": ids})["y"], want)
    assert exe.replaying and backend.captures == 1 and backend.replays == 3
    assert backend.deferred == 3  # the Gather's index check ran after each replay, not inside it
    assert np.array_equal(first, want)
    with pytest.raises(InputError, match=r"out of range \[0, 7\)"):  # a deferred index check still fires
        exe.run({"ids": np.array([0, 7, 1, 1], np.int32)})
    exe.run({"ids": ids[:2]}, dims={"n": 2})  # a re-binding: kernel by kernel again, then a new recording
    assert not exe.replaying
    assert np.array_equal(exe.run({"ids": ids[:2]}, dims={"n": 2})["y"], want[:2])
    assert exe.replaying and backend.captures == 2
    exe.execute({"ids": ids[:2]})  # benchmark runs replay too
    assert backend.replays == 6
    assert "not as one device graph" not in capfd.readouterr().err


def test_steps_that_cannot_be_recorded_run_one_by_one_after_one_notice(capfd):
    backend = RecordingBackend(refuse="cudaErrorStreamCaptureUnsupported")
    program, weights = _embedding_program()
    exe = CudaRuntime(backend).load(program, weights, {"n": 3})
    ids = np.array([1, 2, 3], np.int32)
    for _ in range(3):
        assert np.array_equal(exe.run({"ids": ids})["y"], weights["table"][ids] * 2)
    assert not exe.replaying
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "kernel by kernel, not as one device graph: cudaErrorStreamCaptureUnsupported" in err[0]


def test_streamed_weights_are_never_recorded(capfd):
    backend = RecordingBackend()
    g = Graph()
    x = g.input("x", (2, 8))
    h = x
    for i in range(3):
        with g.block(f"layer{i}"):
            h = ops.linear(h, g.weight(f"w{i}", (8, 8)))
    g.mark_output("y", h)
    weights = {f"w{i}": np.eye(8, dtype=np.float32) * (i + 1) for i in range(3)}
    exe = CudaRuntime(backend).load(Program.from_graph(g), weights, stream={f"w{i}": f"layer{i}" for i in range(3)})
    x0 = np.ones((2, 8), np.float32)
    for _ in range(3):
        assert np.array_equal(exe.run({"x": x0})["y"], x0 * 6)
    exe.close()
    assert backend.captures == 0 and "weights are streamed" in capfd.readouterr().err
