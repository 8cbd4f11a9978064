"""What a model recipe does with each field of its checkpoint's config.json, and the checks that hold it to that.

A model recipe's ``config:`` section sorts the fields of config.json into three groups (dotted paths; a path
covers everything below it):

* ``read``: parameters read the field; any value is implemented (sizes, eps, rope theta...);
* ``require``: the reference implementation reads the field and the recipe implements only the listed values;
  a checkpoint whose config holds another value is refused at the recipe line that lists them;
* ``ignore``: the field cannot change the reference's output for this recipe (training-only settings, parts of
  the model the recipe never runs, metadata), each with the reason.

Fields in none of the groups are *unknown*: they are listed by ``luminal-recipe validate --verbose``. Statically,
every config field a parameter expression reads must be declared under ``read`` or ``require``, so the section
cannot silently fall behind the parameters.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import RecipeError
from .located import Origin
from .safe_eval import CONFIG, ExprError, is_wrapped, parse, unwrap
from .schema import ConfigFields

if TYPE_CHECKING:
    from .loader import LoadedRecipe

ABSENT = object()


@dataclass(frozen=True)
class FieldRule:
    """One declared config field: its group, the values it may take (``require``) or why it is irrelevant."""

    path: str
    kind: str  # "read" | "require" | "ignore"
    origin: Origin
    values: tuple = ()
    reason: str = ""


def field_rules(section: ConfigFields, origin: Origin) -> list[FieldRule]:
    """The rules of one file's ``config:`` section, each located at its own YAML line."""
    rules = [FieldRule(path, "read", origin.at("read", i)) for i, path in enumerate(section.read)]
    rules += [
        FieldRule(path, "require", origin.at("require", path), values=tuple(values))
        for path, values in section.require.items()
    ]
    rules += [
        FieldRule(path, "ignore", origin.at("ignore", path), reason=reason) for path, reason in section.ignore.items()
    ]
    return rules


# ---- static check: parameters read only declared fields -------------------------------------------------------
def config_reads(tree: ast.expr) -> Iterator[tuple[str, ast.AST]]:
    """The config fields an expression reads, as dotted paths with the node that reads each:
    ``config.a.b`` -> ``a.b``, ``config['a']`` -> ``a``, ``config.a.get('b.c', d)`` -> ``a.b.c``,
    ``config.a[0]`` -> ``a``."""
    getters = {
        id(node.func)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and id(node.func) in getters:
            base = _config_path(node.func.value)
            if base is not None and node.args and isinstance(node.args[0], ast.Constant):
                key = node.args[0].value
                if isinstance(key, str):
                    yield ".".join(p for p in (base, key) if p), node
        elif isinstance(node, (ast.Attribute, ast.Subscript)) and id(node) not in getters:
            path = _config_path(node)
            if path and not _is_extended(node, tree):
                yield path, node


def _config_path(node: ast.AST) -> str | None:
    """``config.a.b`` / ``config['a']`` -> 'a.b' / 'a'; the bare name ``config`` -> ''; anything else None."""
    if isinstance(node, ast.Name):
        return "" if node.id == CONFIG else None
    if isinstance(node, ast.Attribute):
        base = _config_path(node.value)
        return None if base is None else ".".join(p for p in (base, node.attr) if p)
    if isinstance(node, ast.Subscript):
        base = _config_path(node.value)
        key = node.slice
        if base is None:
            return None
        if isinstance(key, ast.Constant) and isinstance(key.value, str):
            return ".".join(p for p in (base, key.value) if p)
        return base or None  # config.list[0]: the list field itself
    return None


def _is_extended(node: ast.AST, tree: ast.AST) -> bool:
    """Whether ``node`` is only the stem of a longer config path (``config.a`` inside ``config.a.b``)."""
    for parent in ast.walk(tree):
        if isinstance(parent, (ast.Attribute, ast.Subscript)) and parent.value is node:
            if isinstance(parent, ast.Subscript) and not (
                isinstance(parent.slice, ast.Constant) and isinstance(parent.slice.value, str)
            ):
                continue  # config.a[0] reads the field a
            return True
    return False


def _covering(rules: Mapping[str, FieldRule], path: str) -> FieldRule | None:
    """The declared rule for ``path`` or the nearest enclosing path."""
    parts = path.split(".")
    for end in range(len(parts), 0, -1):
        rule = rules.get(".".join(parts[:end]))
        if rule is not None:
            return rule
    return None


def check_config_reads(recipe: LoadedRecipe) -> None:
    """Every config field a parameter reads is declared under ``config.read`` or ``config.require``."""
    rules = recipe.config_fields
    if rules is None:
        return
    for name, located in recipe.params.items():
        default = located.value.default
        if not is_wrapped(default):
            continue
        origin = located.origin.value_origin("default")
        try:
            tree = parse(unwrap(default))
        except ExprError:
            continue  # reported with its position by the parameter checks
        for path, node in config_reads(tree):
            rule = _covering(rules, path)
            if rule is not None and rule.kind != "ignore":
                continue
            if rule is None:
                message = (
                    f"parameter '{name}' reads config field '{path}', which the recipe's `config:` section does "
                    f"not declare; add it to `config.read` (any value) or `config.require` (the values "
                    f"implemented)"
                )
            else:
                message = (
                    f"parameter '{name}' reads config field '{path}', declared irrelevant at "
                    f"{rule.origin.loc(key=True)} ({rule.reason}); move it to `config.read` or `config.require`"
                )
            raise RecipeError(f"{origin.locate(node.lineno, node.col_offset)}: {message}.")


# ---- against a checkpoint's config.json ----------------------------------------------------------------------
def lookup(config: Any, path: str) -> Any:
    """The value at a dotted path of config.json, or ``ABSENT``."""
    data = config
    for part in path.split("."):
        if not isinstance(data, Mapping) or part not in data:
            return ABSENT
        data = data[part]
    return data


def same_value(a: Any, b: Any) -> bool:
    """JSON equality that keeps booleans apart from numbers (``true`` is not ``1``), ints equal to floats."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def check_config(recipe: LoadedRecipe, config: Mapping[str, Any] | None, config_file: str) -> None:
    """Refuse a config.json holding, in a ``require`` field, a value the recipe does not implement (all such
    fields at once, each at its recipe line)."""
    rules = recipe.config_fields
    if rules is None or config is None:
        return
    problems = []
    for rule in rules.values():
        if rule.kind != "require":
            continue
        value = lookup(config, rule.path)
        if value is ABSENT or any(same_value(value, allowed) for allowed in rule.values):
            continue
        implemented = ", ".join(_json(v) for v in rule.values)
        problems.append(
            f"{rule.origin.loc()}: {config_file}: '{rule.path}' is {_json(value)}; this recipe implements "
            f"{'only ' if len(rule.values) == 1 else 'one of '}{implemented}"
        )
    if problems:
        raise RecipeError(
            f"{config_file} asks for what recipe {recipe.source.display} does not implement "
            f"({len(problems)} field{'s' * (len(problems) != 1)}); the reference would compute something else, "
            f"so this checkpoint is refused:\n" + "\n".join(f"  - {p}" for p in problems)
            + "\nUse a recipe that implements these values, or a checkpoint of the architecture this recipe describes."
        )


@dataclass
class ConfigReport:
    """How a config.json meets a recipe's ``config:`` section (printed by ``validate --verbose``)."""

    config_file: str
    declared: bool  # the recipe has a `config:` section
    read: list[str] = field(default_factory=list)
    required: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        if not self.declared:
            head = [f"{self.config_file}: the recipe has no `config:` section; no field is checked"]
        else:
            head = [
                f"{self.config_file}: {len(self.read)} field(s) read, {len(self.required)} required value(s) "
                f"met, {len(self.ignored)} ignored as irrelevant, {len(self.unknown)} unknown"
            ]
        if self.required:
            head.append("    required: " + ", ".join(self.required))
        if self.unknown:
            head.append(
                "    unknown to the recipe (neither read, required nor ignored; check that the reference does not "
                "read them): " + ", ".join(self.unknown)
            )
        return head


def config_report(recipe: LoadedRecipe, config: Mapping[str, Any] | None, config_file: str) -> ConfigReport:
    rules = recipe.config_fields
    report = ConfigReport(config_file, rules is not None)
    if config is None:
        return report
    rules = rules or {}
    groups = {"read": report.read, "require": report.required, "ignore": report.ignored}
    for path, value in _leaves(config, rules):
        rule = _covering(rules, path)
        if rule is None:
            if not any(p.startswith(path + ".") for p in rules):  # a null parent of declared fields is known
                report.unknown.append(f"{path}={_json(value)}")
        elif rule.kind == "require":
            report.required.append(f"{path}={_json(value)}")
        else:
            groups[rule.kind].append(path)
    return report


def _leaves(data: Mapping[str, Any], rules: Mapping[str, FieldRule], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Dotted paths of config.json: a mapping is entered unless its own path is declared."""
    for key, value in data.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and value and path not in rules:
            yield from _leaves(value, rules, path + ".")
        else:
            yield path, value


def _json(value: Any) -> str:
    import json

    try:
        text = json.dumps(value, sort_keys=True)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 200 else text[:197] + "..."
