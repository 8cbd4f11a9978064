"""The ``torch.compile`` backend: Dynamo's FX graph, lowered to ATen by AOTAutograd (inference: the core ATen
decompositions, minus the ops the op table translates whole so the op library's compositions are used), then
translated and compiled (``fallback.compile_fx``). Registered as ``backend="luminal"`` through the
``torch_dynamo_backends`` entry point; ``torch_backend(...)`` returns one with options."""

from __future__ import annotations

from ..errors import InputError
from .compiled import Options


def decompositions() -> dict:
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

    def inference(gm: torch.fx.GraphModule, example_inputs):
        ctx = TracingContext.try_get()
        meta = getattr(ctx, "fw_metadata", None) if ctx is not None else None
        static = set(getattr(meta, "static_input_indices", None) or ())
        return compile_fx(gm, static, options)

    def backward(gm, example_inputs):  # training: the backward pass runs in eager PyTorch
        return gm.forward

    return aot_autograd(fw_compiler=inference, inference_compiler=inference, bw_compiler=backward,
                        decompositions=decompositions())


def luminal(gm, example_inputs, options: dict | None = None):
    """The backend registered as ``"luminal"``; ``torch.compile(..., options={"runtime": "cuda", ...})`` passes
    ``torch_backend``'s keyword arguments."""
    return torch_backend(**(options or {}))(gm, example_inputs)
