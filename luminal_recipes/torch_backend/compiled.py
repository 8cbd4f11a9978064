"""One translated graph as a callable: it binds the module's parameters as weights, feeds the inputs and symbolic
dims of each call to a ``ModelEngine`` (the same planner, search, plan cache, size buckets and re-binding the
recipes use), and hands the outputs back as torch tensors."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ..graph import Graph, Tensor
from ..graph.symbolic import Expr, evaluate
from ..pipeline.engine import ModelEngine
from .params import WeightBinding, to_numpy, to_torch
from .translate import Translation


@dataclass
class Options:
    runtime: str | None = None          # numpy (default), cuda, cuda-emu
    max_memory: int | None = None       # the memory budget in bytes (None: the runtime's capacity)
    compute_dtype: str | None = None    # f32 tensors computed in f16 or bf16


@dataclass
class TorchModel:
    """What ``ModelEngine`` needs of a model: its graph, its inputs by name, and a weight loader."""

    name: str
    graph: Graph
    inputs: dict[str, Tensor]
    load_weight: object
    outputs: list[str] = field(default_factory=list)


class CompiledGraph:
    """Call with the FX graph's placeholders' values (in order); returns its outputs (a list)."""

    def __init__(self, translation: Translation, options: Options, name: str = "torch"):
        self.translation = translation
        self.placeholders = translation.placeholders
        weights = {i: p.name for i, p in enumerate(self.placeholders) if p.kind == "weight"}
        dtypes = {n.name: n.dtype for n in translation.graph.inputs()}
        self.weights = WeightBinding(weights, dtypes)
        self.model = TorchModel(name, translation.graph, translation.inputs, self.weights.load,
                                list(translation.graph.outputs))
        self.options = options
        self.engine: ModelEngine | None = None

    def _engine(self) -> ModelEngine:
        return ModelEngine(self.model, runtime=self.options.runtime, budget_bytes=self.options.max_memory)

    def __call__(self, *args):
        if self.engine is None or self.weights.stale(args):
            if self.engine is not None:
                self.engine.release()
            self.weights.bind(args)
            self.engine = self._engine()
        inputs, dims = {}, {}
        for p, a in zip(self.placeholders, args):
            if p.kind == "input":
                inputs[p.name] = to_numpy(a, self.model.inputs[p.name].dtype, f"input {p.name}")
            elif p.kind == "dim" and p.name.isidentifier():
                dims[p.name] = int(a)
        if self.translation.values:
            sizes = self._sizes(args)
            for name, d in self.translation.values.items():
                inputs[name] = np.asarray(evaluate(d, sizes), dtype=np.int32)
        out = self.engine(inputs, dims)
        results = []
        for spec in self.translation.outputs:
            if spec[0] == "tensor":
                _, name, dtype, shape = spec
                want = tuple(out[name].shape[i] if d is None or isinstance(d, torch.SymInt) else int(d)
                             for i, d in enumerate(shape))
                results.append(to_torch(out[name], dtype, want))
            elif spec[0] == "arg":
                results.append(args[spec[1]])
            elif spec[0] == "dim":
                results.append(evaluate(spec[1], self.engine._dims | dims))
            else:
                results.append(None)
        return results

    def _sizes(self, args) -> dict[str, int]:
        """Dynamo's size symbols bound by this call's arguments: its SymInts and its tensors' sizes."""
        sizes: dict[str, int] = {}
        for p, a in zip(self.placeholders, args):
            if p.kind == "dim" and p.name.isidentifier():
                sizes[p.name] = int(a)
            elif isinstance(a, torch.Tensor):
                for d, n in zip(p.shape, a.shape):
                    if isinstance(d, Expr) and str(d).isidentifier():
                        sizes.setdefault(str(d), int(n))
        return sizes

    def release(self) -> None:
        if self.engine is not None:
            self.engine.release()
            self.engine = None
