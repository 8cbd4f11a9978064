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

# numpy dtypes a torch tensor shares its memory as (``Tensor.numpy``), and back
_TORCH = {np.dtype(n): getattr(torch, t) for n, t in (("float32", "float32"), ("float64", "float64"),
          ("float16", "float16"), ("int32", "int32"), ("int64", "int64"), ("int16", "int16"), ("int8", "int8"),
          ("uint8", "uint8"), ("bool", "bool"))}


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
        # worked out once (a call's own Python runs cold after its kernels streamed the weights through the caches,
        # ~5x its warm cost; hundreds of placeholders are weights): each input's position, name, what torch dtype
        # is taken as it is, its graph dtype; each symbolic dim's position and name
        self._inputs = [(i, p.name, _TORCH.get(self.model.inputs[p.name].dtype.np), self.model.inputs[p.name].dtype)
                        for i, p in enumerate(self.placeholders) if p.kind == "input"]
        self._dims = [(i, p.name) for i, p in enumerate(self.placeholders) if p.kind == "dim" and p.name.isidentifier()]
        # each tensor output's shape where no dim of it is symbolic
        self._static_shapes = {spec[1]: tuple(int(d) for d in spec[3]) for spec in translation.outputs
                               if spec[0] == "tensor" and not any(d is None or isinstance(d, torch.SymInt)
                                                                  for d in spec[3])}

    def _engine(self) -> ModelEngine:
        return ModelEngine(self.model, runtime=self.options.runtime, budget_bytes=self.options.max_memory)

    def __call__(self, *args):
        if self.engine is None or self.weights.stale(args):
            if self.engine is not None:
                self.engine.release()
            self.weights.bind(args)
            self.engine = self._engine()
        inputs = {}
        for i, name, torch_dtype, dtype in self._inputs:
            a = args[i]
            if a.dtype is torch_dtype and a.is_cpu and a.is_contiguous():  # a view of the tensor's memory
                inputs[name] = (a.detach() if a.requires_grad else a).numpy()  # (detach: one more op, cold)
            else:
                inputs[name] = to_numpy(a, dtype, f"input {name}")
        dims = {name: int(args[i]) for i, name in self._dims}
        if self.translation.values:
            sizes = self._sizes(args)
            for name, d in self.translation.values.items():
                inputs[name] = np.asarray(evaluate(d, sizes), dtype=np.int32)
        out = self.engine(inputs, dims)
        results = []
        for spec in self.translation.outputs:
            if spec[0] == "tensor":
                _, name, dtype, shape = spec
                array = out[name]
                want = self._static_shapes.get(name) or tuple(
                    array.shape[i] if d is None or isinstance(d, torch.SymInt) else int(d) for i, d in enumerate(shape))
                if type(array) is np.ndarray and _TORCH.get(array.dtype) is dtype and array.shape == want and (
                        flags := array.flags).c_contiguous and flags.writeable:
                    results.append(torch.from_numpy(array))  # what ``to_torch`` gives, without its checks
                else:
                    results.append(to_torch(array, dtype, want))
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
