"""Graph breaks: the parts of an FX graph the op table cannot translate run in eager PyTorch.

``compile_fx`` first translates the whole graph. When a node is refused (an op not in the table, or arguments its
entry does not handle), that node is marked unsupported and the graph is split with PyTorch's
``CapabilityBasedPartitioner``: every maximal part of supported nodes becomes one luminal-compiled submodule, the
refused nodes stay ATen calls run by PyTorch between them. A part whose translation refuses another node is split
again, until every part translates. Each refused op is named once in a ``LuminalFallbackWarning``; with
``LUMINAL_TORCH_STRICT=1`` calling the compiled model raises
``UnsupportedTorchOp`` (a ``LuminalError``) naming the first one instead. Never a wrong result: what is not
translated is computed by PyTorch itself.
"""

from __future__ import annotations

import operator
import os
import warnings

import torch
import torch.fx
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
from torch.fx.passes.operator_support import OperatorSupport

from .compiled import CompiledGraph, Options
from .optable import OPS
from .translate import _DTYPES, F64_RUNTIMES, Unsupported, UnsupportedTorchOp, f64_refusal, translate


class LuminalFallbackWarning(UserWarning):
    """Part of a torch graph runs in eager PyTorch: an ATen op the luminal backend does not translate."""


def strict() -> bool:
    return os.environ.get("LUMINAL_TORCH_STRICT", "") not in ("", "0")


def _refuse(exc: Unsupported) -> None:
    message = (f"luminal torch backend: {exc.op} is not translated{' (' + exc.why + ')' if exc.why else ''}")
    if strict():
        raise UnsupportedTorchOp(f"{message}; LUMINAL_TORCH_STRICT=1 forbids falling back to eager PyTorch. Add "
                                 f"the op to luminal_recipes/torch_backend/optable.py (docs/torch.md, 'Adding an "
                                 f"op') or unset LUMINAL_TORCH_STRICT to run that part in eager PyTorch")
    warnings.warn(f"{message}; that part of the graph runs in eager PyTorch", LuminalFallbackWarning, stacklevel=2)


def _foreign(value) -> bool:
    values = value if isinstance(value, (list, tuple)) else [value]
    return any(isinstance(v, torch.Tensor) and v.dtype not in _DTYPES for v in values)


class _Support(OperatorSupport):
    def __init__(self, refused: set[str], f64: bool):
        super().__init__()
        self.refused = refused
        self.f64 = f64

    def is_node_supported(self, submodules, node: torch.fx.Node) -> bool:
        if node.op != "call_function" or node.name in self.refused:
            return False
        if node.target is operator.getitem:
            return isinstance(node.args[0], torch.fx.Node) and self.is_node_supported(submodules, node.args[0])
        val = node.meta.get("val")
        if isinstance(val, torch.SymInt):
            return True
        # a value of a dtype the graph has no form for (float64 where the runtime has no f64, or read by an entry
        # that computes in f32) is neither made nor read by a luminal part
        values = [val] + [a.meta.get("val") for a in node.all_input_nodes]
        if any(_foreign(v) for v in values) or f64_refusal(node, self.f64):
            return False
        return node.target in OPS


def _copy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A new GraphModule over a copy of ``gm``'s graph (the partitioner rewrites the module it is given)."""
    graph = torch.fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    return torch.fx.GraphModule(gm, graph)


class _Eager(torch.nn.Module):
    def __init__(self, compiled: CompiledGraph):
        super().__init__()
        self.compiled = compiled

    def forward(self, *args):
        out = self.compiled(*args)
        return out[0] if self.compiled.translation.single else tuple(out)


def compile_fx(gm: torch.fx.GraphModule, static: set[int], options: Options):
    """A callable ``f(*args) -> list`` computing ``gm``: one luminal program, or luminal parts and eager ones."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():  # constants (get_attr) are read as the real tensors they are
        try:
            return _compile_fx(gm, static, options)
        except UnsupportedTorchOp as refused:
            error = refused
            # raised when the compiled function is called, so it reaches the caller as itself (Dynamo wraps an
            # error raised while compiling into a BackendCompilerFailed)
            def refuse(*args):
                raise error
            return refuse


def _compile_fx(gm: torch.fx.GraphModule, static: set[int], options: Options):
    from .translate import to_dtype

    compute = to_dtype(torch.bfloat16 if options.compute_dtype == "bf16" else torch.float16) \
        if options.compute_dtype in ("bf16", "f16") else None
    f64 = options.runtime in F64_RUNTIMES
    try:
        return CompiledGraph(translate(gm, static, compute, f64), options)
    except Unsupported as exc:
        first = exc
    refused: set[str] = set()
    named: set[str] = set()
    exc = first
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    static_names = {placeholders[i].name for i in static}
    for _ in range(len(gm.graph.nodes) + 1):
        node = getattr(exc, "node", None)
        if exc.op not in named:
            named.add(exc.op)
            _refuse(exc)
        if node is None or node in refused:
            break  # nothing left to split on: the whole graph runs in eager PyTorch
        refused.add(node)
        parted = CapabilityBasedPartitioner(_copy(gm), _Support(refused, f64), allows_single_node_partition=True)
        split = parted.fuse_partitions(parted.propose_partitions())
        try:
            for sub in list(split.graph.nodes):
                if sub.op != "call_module":
                    continue
                module = getattr(split, sub.target)
                sub_static = {i for i, a in enumerate(sub.args)
                              if isinstance(a, torch.fx.Node) and a.name in static_names}
                compiled = CompiledGraph(translate(module, sub_static, compute, f64), options, name=sub.target)
                setattr(split, sub.target, _Eager(compiled))
        except Unsupported as again:
            exc = again
            continue
        split.recompile()
        return lambda *args: list(split(*args))
    return lambda *args: list(gm(*args))
