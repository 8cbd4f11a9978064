"""Runs one built model: binds its symbolic dims from the inputs, compiles once per dims, executes on a runtime.

A ``ModelEngine`` is what a pipeline stage holds while it runs; ``release()`` drops the compiled program, the
loaded executable (its activation arena) and the checkpoint mappings, so at most one large model is resident.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from ..errors import InputError
from ..graph.symbolic import Expr, evaluate, shape_str
from ..recipe.builder import BuiltModel


@dataclass
class StageStats:
    compile_s: float = 0.0
    run_s: list[float] = field(default_factory=list)
    planned_peak: int | None = None
    weight_bytes: int | None = None
    arena_bytes: int | None = None
    search: str | None = None


def infer_dims(model: BuiltModel, inputs: Mapping[str, np.ndarray]) -> dict[str, int]:
    """Bind each symbolic dim from the first input axis that is exactly that symbol, then check every shape."""
    dims: dict[str, int] = {}
    for name, tensor in model.inputs.items():
        if name not in inputs:
            raise InputError(f"model '{model.name}' needs input '{name}' {shape_str(tensor.shape)}; the stage "
                             f"does not provide it")
        array = inputs[name]
        if array.ndim != len(tensor.shape):
            raise InputError(f"model '{model.name}' input '{name}' has shape {array.shape}, expected "
                             f"{shape_str(tensor.shape)}")
        for d, n in zip(tensor.shape, array.shape):
            if isinstance(d, Expr) and len(d.terms) == 1 and d.terms[0][1] == 1 and len(d.terms[0][0]) == 1 \
                    and isinstance(d.terms[0][0][0], str):
                dims.setdefault(d.terms[0][0][0], int(n))
    for name, tensor in model.inputs.items():
        want = tuple(evaluate(d, dims) for d in tensor.shape)
        if tuple(inputs[name].shape) != want:
            raise InputError(f"model '{model.name}' input '{name}' has shape {inputs[name].shape}, expected "
                             f"{shape_str(tensor.shape)} = {want}")
    return dims


class ModelEngine:
    """Compile-and-run for one model of a pipeline."""

    def __init__(self, model: BuiltModel, runtime=None, budget_bytes: int | None = None, compile: bool = True):
        from ..runtimes.numpy_runtime import NumpyRuntime

        self.model = model
        self.runtime = runtime or NumpyRuntime()
        self.budget_bytes = budget_bytes
        self.compile = compile
        self.stats = StageStats()
        self._executables: dict[tuple, object] = {}

    def _weights(self):
        return self.model.load_weight

    def executable(self, dims: dict[str, int], inputs: Mapping[str, np.ndarray]):
        key = tuple(sorted(dims.items()))
        if key not in self._executables:
            t0 = time.perf_counter()
            if self.compile:
                from ..compiler.search import compile_graph

                plan = compile_graph(self.model.graph, self.runtime, dims, budget_bytes=self.budget_bytes,
                                     inputs=dict(inputs), weights=self._weights())
                program = plan.program
                self.stats.search = str(getattr(plan, "report", ""))
            else:
                from ..runtimes.program import Program

                program = Program.from_graph(self.model.graph)
            exe = self.runtime.load(program, self._weights(), dims)
            self.stats.compile_s += time.perf_counter() - t0
            mem = exe.memory
            self.stats.planned_peak = mem.planned_peak
            self.stats.weight_bytes = mem.weight_bytes
            self.stats.arena_bytes = mem.arena_bytes
            self._executables[key] = exe
        return self._executables[key]

    def __call__(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        inputs = {k: np.ascontiguousarray(v) for k, v in inputs.items()}
        dims = infer_dims(self.model, inputs)
        exe = self.executable(dims, inputs)
        t0 = time.perf_counter()
        out = exe.run(inputs)
        self.stats.run_s.append(time.perf_counter() - t0)
        return {k: np.array(v, copy=True) for k, v in out.items()}

    def release(self) -> None:
        self._executables.clear()
