"""Runtimes by name (``--runtime numpy``): a backend makes itself available by adding one line to ``BUILTIN``
(``name: "module:factory"``, imported only when asked for) or by calling ``register_runtime``. The conformance
suite (``tests/runtimes``) runs on every runtime listed here that can start on this machine.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from luminal_recipes.errors import LuminalError

BUILTIN: dict[str, str] = {
    "numpy": "luminal_recipes.runtimes.cpu.backend:NumpyRuntime",
    "cuda": "luminal_recipes.runtimes.cuda.backend:cuda_runtime",
    "cuda-emu": "luminal_recipes.runtimes.cuda.backend:cuda_emu_runtime",
}
# runtimes that can plan (``inspect``) without their device: name -> factory(device description name or None)
PLANNERS: dict[str, str] = {
    "cuda": "luminal_recipes.runtimes.cuda.backend:planning_runtime",
}
_FACTORIES: dict[str, Callable[[], object]] = {}
_INSTANCES: dict[str, object] = {}
DEFAULT = "numpy"


class UnknownRuntimeError(LuminalError):
    """A runtime name that no backend registered."""


def register_runtime(name: str, factory: Callable[[], object]) -> None:
    """Make ``factory()`` (a ``Runtime``) available as ``name``."""
    _FACTORIES[name] = factory
    _INSTANCES.pop(name, None)


def runtime_names() -> list[str]:
    return sorted({*BUILTIN, *_FACTORIES})


def _factory(name: str) -> Callable[[], object]:
    if name in _FACTORIES:
        return _FACTORIES[name]
    if name not in BUILTIN:
        raise UnknownRuntimeError(f"unknown runtime '{name}'; available runtimes: {', '.join(runtime_names())} "
                                  f"(pass one with --runtime)")
    module, _, attr = BUILTIN[name].partition(":")
    return getattr(importlib.import_module(module), attr)


def get_runtime(runtime=None):
    """The runtime named ``runtime`` (default ``numpy``; one instance per name), or ``runtime`` itself when it
    already is one. A runtime that cannot start here (a missing package, no device) raises a ``LuminalError``
    saying why."""
    if runtime is not None and not isinstance(runtime, str):
        return runtime
    name = runtime or DEFAULT
    if name not in _INSTANCES:
        factory = _factory(name)
        try:
            _INSTANCES[name] = factory()
        except LuminalError as exc:  # says itself what is missing (e.g. the cuda runtime without CuPy or a GPU)
            raise type(exc)(f"runtime '{name}' cannot start on this machine: {exc}") from None
        except (ImportError, OSError, RuntimeError) as exc:
            raise LuminalError(f"runtime '{name}' cannot start on this machine: {type(exc).__name__}: {exc}") \
                from None
    return _INSTANCES[name]


def get_planner(runtime=None, device: str | None = None):
    """A runtime to plan with (``inspect``): the runtime itself when it starts here, else, for a runtime that can
    plan without its device (``PLANNERS``: cuda), one for a described device (``device``, or its default) that
    compiles and plans but cannot run. ``device`` names a described GPU (cuda only)."""
    if runtime is not None and not isinstance(runtime, str):
        return runtime
    name = runtime or DEFAULT
    if name in PLANNERS:
        module, _, attr = PLANNERS[name].partition(":")
        return getattr(importlib.import_module(module), attr)(device)
    if device is not None:
        raise LuminalError(f"--device {device}: only the {', '.join(PLANNERS)} runtime plans for a described device; "
                           f"the {name} runtime plans for this machine")
    return get_runtime(name)


def available_runtimes() -> dict[str, str | None]:
    """Every registered runtime -> None if it starts here, else why not."""
    out: dict[str, str | None] = {}
    for name in runtime_names():
        try:
            get_runtime(name)
            out[name] = None
        except LuminalError as exc:
            out[name] = str(exc)
    return out
