"""The kernel registry: every kernel of the Program vocabulary, one ``KernelSpec`` each, in one place.

Primitives (``primitives.py``, from ``graph.core.PRIMITIVE_OPS``) and fused kernels (``fused.py``). Everything that
needs to know about kernels derives from here: the egglog constructors (``egglog_declarations``, inserted into
``compiler/rules/schema.egg``), extraction (constructor -> kernel and attributes), the cost model, the memory
planner (in-place and aliasing kernels), the documentation (``program.KERNELS``) and the plan cache key
(``fingerprint``). Backends implement kernels by name (``Backend.kernels``) against ``context.KernelContext``.
"""

from __future__ import annotations

import hashlib

from luminal_recipes.errors import LuminalError

from .context import Bind, KernelContext, KernelInput, Prepare, Scratch, Step, aligned
from .fused import FUSED
from .primitives import PRIMITIVES
from .spec import (
    PROBE_DIM,
    Ctor,
    KernelCall,
    KernelSpec,
    Machine,
    Work,
    bind,
    data_elements,
    expression_ops,
    numel,
    touched,
)

REGISTRY: dict[str, KernelSpec] = {}
CONSTRUCTORS: dict[str, tuple[KernelSpec, Ctor]] = {}  # egglog constructor -> its kernel
for _spec in PRIMITIVES + FUSED:
    if _spec.name in REGISTRY:
        raise LuminalError(f"kernel '{_spec.name}' is registered twice")
    REGISTRY[_spec.name] = _spec
    for _name, _ctor in _spec.constructors.items():
        if _name in CONSTRUCTORS:
            raise LuminalError(f"egglog constructor '{_name}' belongs to two kernels")
        CONSTRUCTORS[_name] = (_spec, _ctor)

PRIMITIVE_KERNELS = frozenset(name for name, s in REGISTRY.items() if s.primitive)
SOURCES = ("Input", "Constant", "Iota")  # no kernel step: bound or computed at load
INPLACE_KERNELS = frozenset(name for name, s in REGISTRY.items() if s.elementwise_inplace)
ALIASING_KERNELS = {name: s.writes_into for name, s in REGISTRY.items() if s.writes_into is not None}


def spec(name: str) -> KernelSpec:
    try:
        return REGISTRY[name]
    except KeyError:
        raise LuminalError(f"unknown kernel '{name}'; the registry (runtimes/kernels) has "
                           f"{', '.join(REGISTRY)}") from None


def egglog_declarations() -> str:
    """The e-graph constructors of every kernel, as egglog text."""
    lines = []
    for s in REGISTRY.values():
        for name, ctor in s.constructors.items():
            lines.append(f"{ctor.declaration(name)}  ; -> {s.name}({ctor.signature})")
    return "\n".join(lines) + "\n"


def fingerprint() -> str:
    """A hash of every kernel's contract (names, constructors, operands, attributes, aliasing, versions)."""
    return hashlib.sha256("\n".join(s.fingerprint() for s in REGISTRY.values()).encode()).hexdigest()


__all__ = [
    "ALIASING_KERNELS", "CONSTRUCTORS", "INPLACE_KERNELS", "PRIMITIVE_KERNELS", "PROBE_DIM", "REGISTRY", "SOURCES",
    "Bind", "Ctor", "KernelCall", "KernelContext", "KernelInput", "KernelSpec", "Machine", "Prepare", "Scratch",
    "Step", "Work", "aligned", "bind", "data_elements", "egglog_declarations", "expression_ops", "fingerprint",
    "numel", "spec", "touched",
]
