"""YAML loaded with the safe loader, remembering where every node came from.

Every later error (schema, parameter, expression, shape) must name ``file:line:col`` inside the YAML file, so
the loader keeps, for each path of keys/indices into the document, the position of the value node and of its
key. Expression strings (``forward`` bodies, shape expressions) carry positions of their own:
``YamlSource.locate`` maps a line/column inside such a string back to the file, through ``|`` block scalars
and one-line strings.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..errors import RecipeError

Path_ = tuple  # a path of mapping keys (str) and sequence indices (int) into the document


@dataclass(frozen=True)
class Loc:
    """A 1-based position in a file."""

    file: str
    line: int
    col: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}"


@dataclass(frozen=True)
class _NodeInfo:
    line: int  # 0-based, as yaml marks are
    col: int
    style: str | None  # scalar style: None (plain), "'", '"', '|', '>'


class _MarkingLoader(yaml.SafeLoader):
    """A SafeLoader; kept as its own class so nothing registered on it leaks into yaml.SafeLoader."""


# YAML 1.1 reads 1e-6 (no dot) as text; recipes mean a float, as YAML 1.2 does.
_MarkingLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


@dataclass
class YamlSource:
    """One YAML file: its data, its text, and the position of every node."""

    file: Path
    display: str  # how errors name the file (relative to the working directory when possible)
    data: Any
    lines: list[str]
    values: dict[Path_, _NodeInfo] = field(default_factory=dict)
    keys: dict[Path_, _NodeInfo] = field(default_factory=dict)

    # ---- positions -----------------------------------------------------------------------------------------
    def loc(self, path: Path_ = (), *, key: bool = False) -> Loc:
        """Position of the node at ``path`` (its key with ``key=True``), or of its nearest known ancestor."""
        table = self.keys if key else self.values
        path = tuple(path)
        if path in table:
            info = table[path]
            return Loc(self.display, info.line + 1, info.col + 1)
        for cut in range(len(path) - 1, -1, -1):
            if path[:cut] in self.values:
                info = self.values[path[:cut]]
                return Loc(self.display, info.line + 1, info.col + 1)
        return Loc(self.display, 1, 1)

    def has(self, path: Path_) -> bool:
        return tuple(path) in self.values

    def locate(self, path: Path_, lineno: int, col_offset: int) -> Loc:
        """Map a position in the string value at ``path`` (ast's 1-based lineno, 0-based col) to the file."""
        path = tuple(path)
        info = self.values.get(path)
        if info is None:
            return self.loc(path)
        if info.style == "|":
            # Content starts on the line after the indicator; leading blank lines are kept in the string.
            first = info.line + lineno
            indent = self._block_indent(info.line)
            return Loc(self.display, first + 1, indent + col_offset + 1)
        if info.style in (None, "'", '"') and lineno == 1:
            quote = 0 if info.style is None else 1
            return Loc(self.display, info.line + 1, info.col + quote + col_offset + 1)
        # Folded or multi-line flow scalars lose their line structure: point at the scalar itself.
        return Loc(self.display, info.line + 1, info.col + 1)

    def _block_indent(self, indicator_line: int) -> int:
        for raw in self.lines[indicator_line + 1 :]:
            if raw.strip():
                return len(raw) - len(raw.lstrip(" "))
        return 0

    def error(self, path: Path_, message: str, *, key: bool = False) -> RecipeError:
        return RecipeError(f"{self.loc(path, key=key)}: {message}")


def display_name(file: Path) -> str:
    try:
        return str(file.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(file)


def load_yaml(file: Path) -> YamlSource:
    """Parse ``file`` with the safe loader; syntax errors become RecipeError with the line and column."""
    display = display_name(file)
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RecipeError(
            f"{display}: file not found; check the path (recipes are YAML files such as recipes/llama.yaml)."
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise RecipeError(
            f"{display}: cannot read the recipe ({exc}); it must be a UTF-8 text file."
        ) from None
    return parse_yaml(text, file, display)


def parse_yaml(text: str, file: Path, display: str | None = None) -> YamlSource:
    display = display or display_name(file)
    loader = _MarkingLoader(text)
    try:
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{display}:{mark.line + 1}:{mark.column + 1}" if mark else display
        problem = exc.problem or "invalid YAML"
        context = f" ({exc.context})" if exc.context else ""
        raise RecipeError(
            f"{where}: YAML syntax error: {problem}{context}. Fix the YAML at that position "
            f"(check indentation, unbalanced brackets and quotes, and a space after ':')."
        ) from None
    except yaml.YAMLError as exc:
        raise RecipeError(f"{display}: YAML error: {exc}") from None
    finally:
        loader.dispose()
    source = YamlSource(file=file, display=display, data=data, lines=text.splitlines())
    if node is not None:
        _record(node, (), source, set())
    return source


def _record(node: yaml.Node, path: Path_, source: YamlSource, active: set[int]) -> None:
    style = node.style if isinstance(node, yaml.ScalarNode) else None
    source.values[path] = _NodeInfo(node.start_mark.line, node.start_mark.column, style)
    if id(node) in active:  # a recursive alias: positions below it are already recorded
        return
    active.add(id(node))
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                continue
            key = _scalar_key(key_node)
            source.keys[path + (key,)] = _NodeInfo(key_node.start_mark.line, key_node.start_mark.column, None)
            _record(value_node, path + (key,), source, active)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _record(item, path + (index,), source, active)
    active.discard(id(node))


def _scalar_key(node: yaml.ScalarNode) -> Any:
    """The constructed value of a scalar key, so paths match the loaded dicts' keys (``1`` vs ``'1'``)."""
    loader = _MarkingLoader("")
    try:
        return loader.construct_object(node)
    finally:
        loader.dispose()
