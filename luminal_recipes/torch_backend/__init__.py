"""``torch.compile(model, backend="luminal")``: PyTorch models on luminal's compiler and runtimes.

``registration`` is the ``torch_dynamo_backends`` entry point (``backend.luminal``); calling this package,
``luminal_recipes.torch_backend(runtime=..., max_memory=..., compute_dtype=...)``, returns a backend with
options. Modules: ``backend`` (AOTAutograd lowering, options), ``translate`` (FX -> HLIR), ``optable`` (the ATen op
table), ``params`` (parameters as weights, tensors across the boundary), ``compiled`` (a translated graph run by a
``ModelEngine``), ``fallback`` (graph breaks to eager PyTorch, ``LUMINAL_TORCH_STRICT``). See docs/torch.md.
"""

from __future__ import annotations

import sys
import types

from .backend import luminal, torch_backend


class _CallableModule(types.ModuleType):
    """Lets ``luminal_recipes.torch_backend(...)`` be called like the function it names."""

    def __call__(self, runtime=None, max_memory=None, compute_dtype=None):
        return torch_backend(runtime=runtime, max_memory=max_memory, compute_dtype=compute_dtype)


sys.modules[__name__].__class__ = _CallableModule

__all__ = ["luminal", "torch_backend"]
