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
    file: YamlSource | None = field(default=None, compare=False, repr=False)  # None: the source holding it


# Limits on what a recipe file may be: recipes are small hand-written trees (the largest shipped one is 8 KB).
MAX_FILE_BYTES = 1 << 20  # read no more than this: a 50 MB file would take minutes to parse
MAX_DEPTH = 100  # nesting levels; the composer recurses per level
MAX_ALIASES = 1000  # `*name` references in one file
MAX_EXPANDED_NODES = 100_000  # values after expanding aliases: an alias bomb expands exponentially
MERGE_TAG = "tag:yaml.org,2002:merge"


class YamlLimitError(yaml.MarkedYAMLError):
    """A file beyond the limits above; reported like a syntax error, at the mark where the limit was hit."""


class _MarkingLoader(yaml.SafeLoader):
    """A SafeLoader that bounds nesting depth and alias count while composing; kept as its own class so nothing
    registered on it leaks into yaml.SafeLoader."""

    def __init__(self, stream):
        super().__init__(stream)
        self._depth = 0
        self._aliases = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            self._aliases += 1
            if self._aliases > MAX_ALIASES:
                raise YamlLimitError(None, None, f"more than {MAX_ALIASES} aliases (*name) in one file; write the "
                                     f"values out", self.peek_event().start_mark)
            return super().compose_node(parent, index)
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise YamlLimitError(None, None, f"nested more than {MAX_DEPTH} levels deep",
                                     self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


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
            return Loc(self._file(info).display, info.line + 1, info.col + 1)
        for cut in range(len(path) - 1, -1, -1):
            if path[:cut] in self.values:
                info = self.values[path[:cut]]
                return Loc(self._file(info).display, info.line + 1, info.col + 1)
        return Loc(self.display, 1, 1)

    def _file(self, info: _NodeInfo) -> YamlSource:
        """The file a node was written in: this one, or, in a recipe merged with what it extends, another."""
        return info.file if info.file is not None else self

    def has(self, path: Path_) -> bool:
        return tuple(path) in self.values

    def locate(self, path: Path_, lineno: int, col_offset: int) -> Loc:
        """Map a position in the string value at ``path`` (ast's 1-based lineno, 0-based col) to the file."""
        path = tuple(path)
        info = self.values.get(path)
        if info is None:
            return self.loc(path)
        file = self._file(info)
        if info.style == "|":
            # Content starts on the line after the indicator; leading blank lines are kept in the string.
            first = info.line + lineno
            indent = file._block_indent(info.line)
            return Loc(file.display, first + 1, indent + col_offset + 1)
        if info.style in (None, "'", '"') and lineno == 1:
            quote = 0 if info.style is None else 1
            return Loc(file.display, info.line + 1, info.col + quote + col_offset + 1)
        # Folded or multi-line flow scalars lose their line structure: point at the scalar itself.
        return Loc(file.display, info.line + 1, info.col + 1)

    def _block_indent(self, indicator_line: int) -> int:
        for raw in self.lines[indicator_line + 1 :]:
            if raw.strip():
                return len(raw) - len(raw.lstrip(" "))
        return 0

    def error(self, path: Path_, message: str, *, key: bool = False) -> RecipeError:
        return RecipeError(f"{self.loc(path, key=key)}: {message}")


def merge_sources(base: YamlSource, child: YamlSource, not_inherited: tuple[str, ...] = ()) -> YamlSource:
    """``child`` laid over ``base`` (``extends:``): mappings merge key by key (the base's keys in its order, then
    the child's new ones); any other value the child gives (a list, a scalar, null) replaces the base's whole.
    Top-level keys in ``not_inherited`` are the child's own only. Every node keeps the position of the file that
    wrote it, so errors point into that file."""
    merged = YamlSource(file=child.file, display=child.display, data=None, lines=child.lines)

    def take(source: YamlSource, path: Path_) -> None:
        """The positions of the node at ``path`` and of everything below it, from ``source``."""
        for table, out in ((source.values, merged.values), (source.keys, merged.keys)):
            for where, info in table.items():
                if where[: len(path)] == path:
                    out[where] = _own(info, source)

    def merge(old: Any, new: Any, path: Path_) -> Any:
        if not (isinstance(old, dict) and isinstance(new, dict)):
            take(child, path)
            return new
        merged.values[path] = _own(child.values[path], child)
        if path:
            merged.keys[path] = _own(child.keys[path], child)
        out = {}
        for key, value in old.items():
            if not path and key in not_inherited and key not in new:
                continue
            if key in new:
                out[key] = merge(value, new[key], path + (key,))
            else:
                out[key] = value
                take(base, path + (key,))
        for key, value in new.items():
            if key not in old:
                out[key] = value
                take(child, path + (key,))
        return out

    merged.data = merge(base.data, child.data, ())
    return merged


def _own(info: _NodeInfo, source: YamlSource) -> _NodeInfo:
    return info if info.file is not None else _NodeInfo(info.line, info.col, info.style, source)


def display_name(file: Path) -> str:
    try:
        return str(file.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(file)


def load_yaml(file: Path) -> YamlSource:
    """Parse ``file`` with the safe loader; syntax errors become RecipeError with the line and column."""
    from ..files import read_regular_text

    display = display_name(file)
    try:
        text = read_regular_text(file, "the recipe", MAX_FILE_BYTES, RecipeError)
    except FileNotFoundError:
        raise RecipeError(
            f"{display}: file not found; check the path (recipes are YAML files such as recipes/llama.yaml)."
        ) from None
    except OSError as exc:
        raise RecipeError(
            f"{display}: cannot read the recipe ({exc.strerror or exc}); it must be a readable UTF-8 text file."
        ) from None
    return parse_yaml(text, file, display)


# parsed files by (text, file, display): one command loads a pipeline's recipes several times (the CLI, the
# pipeline, each model's build), and PyYAML's pure-Python parse with positions is ~40 ms a file
_PARSED: dict[tuple[str, str, str], YamlSource] = {}


def parse_yaml(text: str, file: Path, display: str | None = None) -> YamlSource:
    display = display or display_name(file)
    key = (text, str(file), display)
    if key not in _PARSED:
        if len(_PARSED) >= 64:
            _PARSED.clear()
        _PARSED[key] = _parse_yaml(text, file, display)
    cached = _PARSED[key]  # a copy: callers may change what they get (positions are never changed in place)
    return YamlSource(file=cached.file, display=cached.display, data=_copy_data(cached.data),
                      lines=list(cached.lines), values=dict(cached.values), keys=dict(cached.keys))


def _copy_data(value: Any) -> Any:
    """A copy of parsed YAML data: its mappings and lists new, its scalars (immutable) shared."""
    if isinstance(value, dict):
        return {k: _copy_data(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy_data(v) for v in value]
    return value


def _parse_yaml(text: str, file: Path, display: str) -> YamlSource:
    loader = None
    try:
        loader = _MarkingLoader(text)  # the reader rejects unprintable characters (NUL...) here
        node = loader.get_single_node()
        if node is not None:
            _check_tree(node, loader)
        data = loader.construct_document(node) if node is not None else None
    except yaml.reader.ReaderError as exc:
        line = text.count("\n", 0, exc.position) + 1
        col = exc.position - (text.rfind("\n", 0, exc.position) + 1) + 1
        char = exc.character if isinstance(exc.character, int) else ord(exc.character)
        raise RecipeError(
            f"{display}:{line}:{col}: character U+{char:04X} is not allowed in YAML ({exc.reason}); remove it."
        ) from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{display}:{mark.line + 1}:{mark.column + 1}" if mark else display
        problem = exc.problem or "invalid YAML"
        context = f" ({exc.context})" if exc.context else ""
        if isinstance(exc, (YamlLimitError, DuplicateKeyError)):
            raise RecipeError(f"{where}: {problem}{context}.") from None
        raise RecipeError(
            f"{where}: YAML syntax error: {problem}{context}. Fix the YAML at that position "
            f"(check indentation, unbalanced brackets and quotes, and a space after ':')."
        ) from None
    except yaml.YAMLError as exc:
        raise RecipeError(f"{display}: YAML error: {exc}") from None
    finally:
        if loader is not None:
            loader.dispose()
    source = YamlSource(file=file, display=display, data=data, lines=text.splitlines())
    if node is not None:
        _record(node, (), source, set())
    return source


def load_value(text: str) -> Any:
    """One YAML value from a string (a ``--set`` or ``--chat-var`` value, a golden manifest), with the same limits
    as a recipe file (size, depth, aliases, expanded values); yaml.YAMLError (YamlLimitError for a limit, or
    ValueError, for an integer too long to convert) when it is not one."""
    if len(text) > MAX_FILE_BYTES:
        raise YamlLimitError(None, None, f"the text is {len(text)} characters long; YAML values and files are read "
                             f"up to {MAX_FILE_BYTES} characters", None)
    loader = _MarkingLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_tree(node, loader)
        return loader.construct_document(node)
    finally:
        loader.dispose()


class DuplicateKeyError(yaml.MarkedYAMLError):
    """A mapping names a key twice (YAML loaders silently keep the last one)."""


def _check_tree(root: yaml.Node, loader: _MarkingLoader) -> None:
    """Before anything is constructed: no key twice in a mapping, no node that contains itself through an
    alias, and at most MAX_EXPANDED_NODES values once aliases are expanded. Linear: each node is sized once."""
    sizes: dict[int, int] = {}
    active: set[int] = set()

    def size(node: yaml.Node) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in active:
            raise YamlLimitError(None, None, "an alias (*name) refers to a node that contains it; recipes are "
                                 "trees, write the value out", node.start_mark)
        active.add(key)
        total = 1
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, yaml.Node] = {}
            for key_node, value_node in node.value:
                if isinstance(key_node, yaml.ScalarNode) and key_node.tag != MERGE_TAG:
                    name = loader.construct_object(key_node)
                    if name in seen:
                        first = seen[name].start_mark
                        raise DuplicateKeyError(
                            None, None, f"key '{name}' is given twice (first at line {first.line + 1}, column "
                            f"{first.column + 1}); YAML would silently keep only the last one: remove or rename "
                            f"one of them", key_node.start_mark)
                    seen[name] = key_node
                total += size(key_node) + size(value_node)
        elif isinstance(node, yaml.SequenceNode):
            total += sum(size(item) for item in node.value)
        active.discard(key)
        if total > MAX_EXPANDED_NODES:
            raise YamlLimitError(None, None, f"this value expands to more than {MAX_EXPANDED_NODES} values once "
                                 f"its aliases (*name) are expanded; write the values out", node.start_mark)
        sizes[key] = total
        return total

    size(root)


def _record(node: yaml.Node, path: Path_, source: YamlSource, seen: set[int]) -> None:
    """Positions of every path; a node reached again through an alias is recorded at this path but not
    descended into again (errors inside it point at the alias), so this stays linear in the file's size."""
    style = node.style if isinstance(node, yaml.ScalarNode) else None
    source.values[path] = _NodeInfo(node.start_mark.line, node.start_mark.column, style)
    if id(node) in seen:
        return
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                continue
            key = _scalar_key(key_node)
            source.keys[path + (key,)] = _NodeInfo(key_node.start_mark.line, key_node.start_mark.column, None)
            _record(value_node, path + (key,), source, seen)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _record(item, path + (index,), source, seen)


def _scalar_key(node: yaml.ScalarNode) -> Any:
    """The constructed value of a scalar key, so paths match the loaded dicts' keys (``1`` vs ``'1'``)."""
    loader = _MarkingLoader("")
    try:
        return loader.construct_object(node)
    finally:
        loader.dispose()
