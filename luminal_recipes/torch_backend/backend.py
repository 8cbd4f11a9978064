"""The ``torch.compile`` backend: Dynamo's FX graph, lowered to ATen by AOTAutograd (inference: the core ATen
decompositions, minus the ops the op table translates whole so the op library's compositions are used), then
translated and compiled (``fallback.compile_fx``). Registered as ``backend="luminal"`` through the
``torch_dynamo_backends`` entry point; ``torch_backend(...)`` returns one with options."""

from __future__ import annotations

import functools

from ..errors import InputError
from . import translation_cache
from .compiled import CompiledGraph, Options


def decompositions() -> dict:
    return dict(_decompositions())


@functools.lru_cache(maxsize=1)
def _decompositions() -> dict:
    """PyTorch's core ATen decompositions minus ``KEEP`` (built once: ~0.1 s, on every compile before)."""
    from torch._decomp import core_aten_decompositions

    from .optable import KEEP

    table = dict(core_aten_decompositions())
    for keep in KEEP:
        table.pop(keep, None)
    return table


def _parse_memory(value) -> int | None:
    if value is None or isinstance(value, int):
        return value
    from ..pipeline.generate import parse_size

    return parse_size(str(value), "max_memory")


def torch_backend(runtime: str | None = None, max_memory: int | str | None = None,
                  compute_dtype: str | None = None):
    """A ``torch.compile`` backend running on luminal's ``runtime`` (``numpy``, ``cuda``, ``cuda-emu``) within
    ``max_memory`` (bytes, or a size such as ``"8GiB"``), computing f32 tensors in ``compute_dtype`` (``f16``,
    ``bf16``) when given: ``torch.compile(model, backend=luminal_recipes.torch_backend(runtime="cuda"))``."""
    import torch
    from torch._dynamo.backends.common import aot_autograd
    from torch._guards import TracingContext

    from .fallback import compile_fx

    if compute_dtype not in (None, "f32", "f16", "bf16"):
        raise InputError(f"torch_backend: compute_dtype must be 'f32', 'f16' or 'bf16', got {compute_dtype!r}")
    if runtime is not None:
        from ..runtimes.registry import runtime_names

        if runtime not in runtime_names():
            raise InputError(f"torch_backend: unknown runtime {runtime!r}; available: {', '.join(runtime_names())}")
    options = Options(runtime, _parse_memory(max_memory), None if compute_dtype == "f32" else compute_dtype)

    record: dict = {}  # what the compile in progress lowered (read by ``backend`` to store its translation)

    def inference(gm: torch.fx.GraphModule, example_inputs, training: bool = False):
        ctx = TracingContext.try_get()
        meta = getattr(ctx, "fw_metadata", None) if ctx is not None else None
        static = set(getattr(meta, "static_input_indices", None) or ())
        # an input the graph mutates (a static KV cache, updated in place) is read afresh at each call, never
        # bound once as a weight: its new value is a graph output that AOTAutograd copies back into it
        static -= {i for i, info in enumerate(getattr(meta, "input_info", None) or ())
                   if getattr(info, "mutates_data", False) or getattr(info, "mutates_metadata", False)}
        compiled = compile_fx(gm, static, options)
        record.update(aten=gm, meta=meta, compiled=compiled, training=training)
        return compiled

    def backward(gm, example_inputs):  # training: the backward pass runs in eager PyTorch
        return gm.forward

    lower = aot_autograd(fw_compiler=functools.partial(inference, training=True), inference_compiler=inference,
                         bw_compiler=backward, decompositions=decompositions)  # built when AOTAutograd runs

    def backend(gm: torch.fx.GraphModule, example_inputs):
        """AOTAutograd's lowering and the translation, or both read from the translation cache (a Dynamo graph
        compiled before: ``translation_cache``)."""
        key = translation_cache.graph_key(gm, example_inputs, options) if translation_cache.enabled() else None
        if key is not None:
            cached = translation_cache.load(key)
            if cached is not None:
                return torch._dynamo.disable(CompiledGraph(cached, options), reason="luminal compiled graph")
        before = translation_cache.shape_state(example_inputs) if key is not None else None
        record.clear()
        try:
            compiled = lower(gm, example_inputs)
            done = dict(record)
        finally:
            record.clear()
        if key is not None and isinstance(done.get("compiled"), CompiledGraph) and not done["training"] \
                and translation_cache.passes_through(done["aten"], translation_cache.traced_inputs(gm, example_inputs),
                                                     done["meta"]) \
                and translation_cache.shape_state(example_inputs) == before:
            translation_cache.store(key, done["compiled"].translation)
        return compiled

    return backend


def luminal(gm, example_inputs, options: dict | None = None):
    """The backend registered as ``"luminal"``; ``torch.compile(..., options={"runtime": "cuda", ...})`` passes
    ``torch_backend``'s keyword arguments."""
    return torch_backend(**(options or {}))(gm, example_inputs)
