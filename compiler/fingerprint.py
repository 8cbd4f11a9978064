"""What a compiled plan depends on besides the graph, as hashes for the plan cache key: the rule texts
(``rules.fingerprint``), the kernel registry's contracts (``runtimes.kernels.fingerprint``: names, constructors,
operands, attributes, aliasing, per-spec versions) and the runtime's kernel implementations (the source of its
package: a kernel's speed decides which candidate the search measures fastest). Editing a rule file or a kernel
therefore never reuses a stale plan.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
from pathlib import Path

from luminal_recipes import runtimes
from luminal_recipes.runtimes.kernels import fingerprint as registry_fingerprint

from . import rules


def implementation_sources(runtime) -> list[Path]:
    """The source files of a runtime's kernels: the runtimes package (numpy's kernels, the executable, the memory
    planner) and, for a backend defined elsewhere, its own module's folder."""
    roots = {Path(runtimes.__file__).parent}
    backend = getattr(runtime, "backend", runtime)
    if backend is not None:
        with contextlib.suppress(TypeError, OSError):  # a class without a source file adds nothing
            roots.add(Path(inspect.getfile(type(backend))).parent)
    files: set[Path] = set()
    for root in roots:
        files.update(p for p in root.rglob("*") if p.suffix in (".py", ".cu", ".cuh", ".h") and p.is_file())
    return sorted(files)


def source_fingerprint(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for path in paths:
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def plan_fingerprints(runtime, families=None) -> dict[str, str]:
    return {
        "rules": rules.fingerprint(families),
        "kernels": registry_fingerprint(),
        "implementation": source_fingerprint(implementation_sources(runtime)),
    }
