"""The import graph of luminal_recipes (its own files, read with ``ast``: nothing is imported) has no cycle among
the pipeline's modules, counting imports made inside functions too (a lazy import that closes a cycle is still a
cycle: each module can no longer be read, tested or replaced without the other)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# package-dir of pyproject.toml: compiler/ and runtimes/ import as luminal_recipes.compiler / .runtimes
FOLDERS = {"luminal_recipes": ROOT / "luminal_recipes", "luminal_recipes.compiler": ROOT / "compiler",
           "luminal_recipes.runtimes": ROOT / "runtimes"}


def modules() -> dict[str, Path]:
    found = {}
    for package, folder in FOLDERS.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


def import_graph(top_level_only: bool) -> dict[str, set[str]]:
    """Module -> the package modules it imports (``from X import name`` counts X, and X.name where that is a
    module); ``top_level_only``: only the statements run when the module itself is imported."""
    mods = modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), str(path))
        nodes = tree.body if top_level_only else list(ast.walk(tree))
        if top_level_only:  # statements under if/try at module level run at import too
            nodes = [n for stmt in tree.body for n in ast.walk(stmt)
                     if not isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)]
        deps = set()
        for node in nodes:
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".") if is_package else name.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                targets = [module] + [f"{module}.{alias.name}" for alias in node.names]
            else:
                continue
            deps.update(t for t in targets if t in mods and t != name)
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]], within: str = "") -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), restricted to names under ``within``."""
    nodes = {n for n in graph if n.startswith(within)}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v] & nodes:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_the_pipeline_modules_and_their_imports():
    graph = import_graph(top_level_only=False)
    assert "luminal_recipes.pipeline.plan" in graph["luminal_recipes.pipeline.driver"]
    assert "luminal_recipes.pipeline.driver" in graph["luminal_recipes.pipeline.generate"]
    # a cycle is found when there is one
    assert cycles({"a.x": {"a.y"}, "a.y": {"a.x"}, "a.z": set()}, "a.") == [["a.x", "a.y"]]


def test_no_import_cycle_in_the_pipeline_even_through_lazy_imports():
    assert cycles(import_graph(top_level_only=False), "luminal_recipes.pipeline.") == []

