"""Recipe parameters: defaults, ``${...}`` expressions over config.json and other parameters, typed overrides.

A parameter is resolved lazily on first use, so parameters may reference each other in any order; a reference
cycle is reported with its path. Types are declared (``type: list[int]``) or inferred from the resolved
default, and every value, including each ``--set name=value`` override, is checked against its type.
"""

from __future__ import annotations

import ast
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from ..errors import RecipeError
from .located import Located, Origin
from .safe_eval import (
    CONFIG,
    FUNCTIONS,
    YAML_CONSTANTS,
    ConfigView,
    ExprError,
    check_value,
    evaluate,
    is_wrapped,
    names_in,
    parse,
    shorten,
    unwrap,
)
from .schema import PARAM_TYPE, ParamSpec
from .suggest import did_you_mean, one_of
from .yaml_source import load_value

_SET = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*=(.*)$", re.DOTALL)
_NONE_WORDS = {"none", "null", "~", ""}


@dataclass(frozen=True)
class ParamType:
    """int, float, bool, str or list[...] thereof, possibly optional (``| None``); ``any`` when unknown."""

    base: str  # int | float | bool | str | list | any
    item: str | None = None
    optional: bool = False

    @staticmethod
    def parse(text: str) -> ParamType:
        match = PARAM_TYPE.match(text.strip())
        if not match:
            raise ValueError(text)
        base = match.group(1)
        optional = match.group(3) is not None
        if base.startswith("list["):
            return ParamType("list", match.group(2), optional)
        return ParamType(base, None, optional)

    @staticmethod
    def infer(value: Any) -> ParamType:
        if value is None:
            return ParamType("any")
        for name, kind in (("bool", bool), ("int", int), ("float", float), ("str", str)):
            if isinstance(value, kind):
                return ParamType(name)
        if isinstance(value, (list, tuple)):
            items = {ParamType.infer(v).base for v in value}
            if items == {"int", "float"}:
                items = {"float"}
            return ParamType("list", items.pop() if len(items) == 1 else None)
        return ParamType("any")

    def __str__(self) -> str:
        text = f"list[{self.item}]" if self.base == "list" and self.item else self.base
        return text + (" | None" if self.optional else "")

    def check(self, value: Any) -> Any:
        """``value`` converted to this type (int -> float), or ValueError saying what was expected."""
        if value is None:
            if self.optional or self.base == "any":
                return None
            raise ValueError(f"expected {self}, got None")
        if self.base == "any":
            return value
        if self.base == "list":
            if not isinstance(value, (list, tuple)):
                raise ValueError(f"expected {self}, got {shorten(repr(value), 60)} ({type(value).__name__})")
            item = ParamType(self.item or "any")
            return [item.check(v) for v in value]
        return _check_scalar(self.base, value)


def _check_scalar(base: str, value: Any) -> Any:
    if base == "bool":
        if isinstance(value, bool):
            return value
    elif base == "int":
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif base == "float":
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif base == "str" and isinstance(value, str):
        return value
    raise ValueError(f"expected {base}, got {shorten(repr(value), 60)} ({type(value).__name__})")


@dataclass
class ResolvedParams:
    """Parameter values after defaults, config references and overrides."""

    values: dict[str, Any]
    types: dict[str, ParamType]
    origins: dict[str, str]  # "default" | "config" | "--set"
    docs: dict[str, str] = field(default_factory=dict)
    set_by: dict[str, str] = field(default_factory=dict)  # overridden name -> how ("--set steps=4", "--steps 4")

    def overrides_note(self) -> str:
        """A sentence naming the overrides the user gave (on the command line, or through a pipeline's `set:`
        from a --set), for errors a build raises with them in effect; "" without any."""
        given = [how for how in self.set_by.values() if how.startswith("--") or "(from --" in how]
        return f" (This build overrides {', '.join(given)}; check those values.)" if given else ""

    def __getitem__(self, name: str) -> Any:
        return self.values[name]


def parse_sets(sets: Iterable[str] | Mapping[str, Any] | None) -> dict[str, tuple[Any, bool]]:
    """``--set name=value`` strings (or a mapping of typed values) -> {name: (value, value_is_raw_text)}."""
    if not sets:
        return {}
    if isinstance(sets, Mapping):
        return {str(k): (v, False) for k, v in sets.items()}
    out: dict[str, tuple[Any, bool]] = {}
    for item in sets:
        match = _SET.match(item)
        if not match:
            raise RecipeError(
                f"--set {shorten(repr(item))}: expected name=value, e.g. --set layers=2 or --set "
                f"out_layers=[10,20,30]."
            )
        name, value = match.group(1), match.group(2).strip()
        if name in out:
            raise RecipeError(f"--set {name} is given twice ({shorten(out[name][0], 40)!r} and "
                              f"{shorten(value, 40)!r}); give each parameter once.")
        out[name] = (value, True)
    return out


def _from_text(text: str, kind: ParamType) -> Any:
    """Interpret the text of a --set value in the light of the parameter's type."""
    if kind.optional and text.lower() in _NONE_WORDS:
        return None
    if kind.base == "str":
        loaded = _yaml_scalar(text)
        return loaded if isinstance(loaded, str) else text
    loaded = _yaml_scalar(text)
    if kind.base == "list" and isinstance(loaded, str) and "," in loaded:
        loaded = [_yaml_scalar(part.strip()) for part in loaded.split(",")]
    elif kind.base == "list" and not isinstance(loaded, list) and loaded is not None:
        loaded = [loaded]
    return loaded


def _yaml_scalar(text: str) -> Any:
    try:
        value = load_value(text) if text else ""  # the recipe loader's limits (depth, aliases)
    except (yaml.YAMLError, ValueError):  # ValueError: an integer of more than 4300 digits
        return text
    if isinstance(value, str):  # YAML 1.1 reads 1e-6 (no dot) as text
        try:
            return float(value)
        except ValueError:
            return value
    return value


class ParamResolver:
    """Resolves the parameters of one recipe against a config (or none, for static checks)."""

    def __init__(
        self,
        params: Mapping[str, Located[ParamSpec]],
        config: Mapping[str, Any] | None,
        overrides: Iterable[str] | Mapping[str, Any] | None = None,
        config_file: str = "config.json",
        override_origins: Mapping[str, str] | None = None,
        checks: Mapping[str, Iterable[Located[ParamSpec]]] | None = None,
    ):
        self.params = dict(params)
        # declarations of the same parameters by included module libraries (LoadedRecipe.param_checks): their
        # type, choices and ranges hold too
        self.checks = {name: list(specs) for name, specs in (checks or {}).items() if name in self.params}
        # where each override was written, when it did not come from the command line (a pipeline's `set:`, or
        # a flag such as "--steps 4")
        self.override_origins = dict(override_origins or {})
        self.config = ConfigView(config, config_file) if config is not None else None
        self.config_file = config_file
        self.values: dict[str, Any] = {}
        self.types: dict[str, ParamType] = {}
        self.origins: dict[str, str] = {}
        self._active: list[str] = []
        self.overrides = parse_sets(overrides)
        self.set_by = {name: self.override_origins.get(name) or
                       f"--set {name}={shorten(raw if is_text else repr(raw), 40)}"
                       for name, (raw, is_text) in self.overrides.items()}
        for name in self.overrides:
            if name not in self.params:
                raise RecipeError(
                    f"--set {name}=...: unknown parameter '{name}'{did_you_mean(name, self.params)};"
                    f" this recipe's parameters are: {one_of(self.params, 40)}."
                )

    # ---- static checks (no config needed) ------------------------------------------------------------------
    def check_static(self) -> None:
        """Parse every default expression and check the names it uses; type-check literals and overrides."""
        for name, located in self.params.items():
            spec, origin = located.value, located.origin
            declared = self._declared_type(name)
            if is_wrapped(spec.default):
                tree = self._parse(name)
                for ref in names_in(tree):
                    if not self._known_name(ref.id):
                        raise self._default_origin(name).expr_error(
                            ExprError(self._unknown_name(ref.id), ref.lineno, ref.col_offset),
                            f"parameter '{name}'",
                        )
            elif declared is not None and name not in self.overrides:
                self._typed(name, spec.default, declared, origin)
            for key in ("min", "max"):
                text = getattr(spec, key)
                if isinstance(text, str):
                    try:
                        tree = parse(unwrap(text))
                    except ExprError as exc:
                        raise origin.at(key).expr_error(exc, f"`{key}` of parameter '{name}'") from None
                    for ref in names_in(tree):
                        if not self._known_name(ref.id):
                            raise origin.at(key).expr_error(
                                ExprError(self._unknown_name(ref.id), ref.lineno, ref.col_offset),
                                f"`{key}` of parameter '{name}'",
                            )
            if name in self.overrides:
                self._override(
                    name, declared or ParamType.infer(None if is_wrapped(spec.default) else spec.default)
                )

    # ---- resolution ----------------------------------------------------------------------------------------
    def resolve_all(self) -> ResolvedParams:
        for name in self.params:
            self.get(name)
        docs = {n: p.value.doc for n, p in self.params.items() if p.value.doc}
        return ResolvedParams(dict(self.values), dict(self.types), dict(self.origins), docs, dict(self.set_by))

    def get(self, name: str) -> Any:
        if name in self.values:
            return self.values[name]
        if name in self._active:
            cycle = " -> ".join(self._active[self._active.index(name) :] + [name])
            raise self._default_origin(name).error(
                f"parameters reference each other in a cycle: {cycle}; give one of them a literal value."
            )
        self._active.append(name)
        try:
            spec = self.params[name].value
            declared = self._declared_type(name)
            if name in self.overrides:
                kind = declared or ParamType.infer(self._default_value(name, spec))
                value = self._override(name, kind)
                origin = "--set"
            else:
                value = self._default_value(name, spec)
                kind = declared or ParamType.infer(value)
                origin = "config" if is_wrapped(spec.default) and CONFIG in spec.default else "default"
                value = self._typed(name, value, kind, self._default_origin(name),
                                    f" ({self._source(name, origin)})" if origin == "config" else "")
            self._check_finite(name, value, origin)
            self._check_bounds(name, value, self.params[name], origin)
            for declared_at in self.checks.get(name, ()):
                self._check_declared(name, value, declared_at, origin)
                self._check_bounds(name, value, declared_at, origin)
            self.values[name], self.types[name], self.origins[name] = value, kind, origin
            return value
        finally:
            self._active.pop()

    def _default_value(self, name: str, spec: ParamSpec) -> Any:
        if not is_wrapped(spec.default):
            return spec.default
        tree = self._parse(name)
        try:
            value = evaluate(tree, self._resolve_name)
        except ExprError as exc:
            raise self._default_origin(name).expr_error(exc, f"parameter '{name}'") from None
        return value.data if isinstance(value, ConfigView) else value

    def _resolve_name(self, ref: str, node: ast.Name) -> Any:
        if ref == CONFIG:
            if self.config is None:
                raise ExprError(
                    f"this recipe reads {self.config_file} but no checkpoint was given; pass "
                    f"--weights or set weights.source",
                    node.lineno,
                    node.col_offset,
                )
            return self.config
        if ref in self.params:
            return self.get(ref)
        raise ExprError(self._unknown_name(ref), node.lineno, node.col_offset)

    def _known_name(self, ref: str) -> bool:
        return ref == CONFIG or ref in self.params or ref in FUNCTIONS or ref in YAML_CONSTANTS

    def _unknown_name(self, ref: str) -> str:
        known = list(self.params) + [CONFIG]
        return (
            f"undefined name '{ref}'{did_you_mean(ref, known)}; a parameter expression can use other "
            f"parameters ({one_of(self.params)}), config.KEY and the functions {one_of(FUNCTIONS)}"
        )

    # ---- finiteness, bounds (`min:` / `max:` / `positive:`) ---------------------------------------------------
    def _source(self, name: str, origin: str) -> str:
        """Where a value came from, for messages: the override, config.json, or the recipe's default."""
        if name in self.overrides:
            return self.set_by[name]
        if origin == "config":
            return f"read from {self.config_file} by {shorten(str(self.params[name].value.default), 80)}"
        return "the recipe's default"

    def _check_finite(self, name: str, value: Any, origin: str) -> None:
        """Every float of ``value`` is finite, unless the parameter (and every declaration of it) says
        ``finite: false``."""
        specs = [self.params[name], *self.checks.get(name, ())]
        if all(not located.value.finite for located in specs):
            return
        items = value if isinstance(value, (list, tuple)) else [value]
        bad = next((v for v in items if isinstance(v, float) and not math.isfinite(v)), None)
        if bad is None:
            return
        what = f"holds {bad!r}" if isinstance(value, (list, tuple)) else f"is {bad!r}"
        message = (
            f"parameter '{name}' {what} ({self._source(name, origin)}), not a finite number: NaN and infinities "
            f"make every output NaN or garbage."
            + (f" Fix {self.config_file} (a corrupt or hand-edited config?), or override the value with "
               f"--set {name}=VALUE." if origin == "config" else "")
        )
        if name in self.overrides:
            raise RecipeError(f"{self.set_by[name]}: {message}")
        raise self._default_origin(name).error(message)

    def _check_declared(self, name: str, value: Any, declared_at: Located[ParamSpec], origin: str) -> None:
        """The type and choices a module library's declaration of ``name`` gives."""
        spec = declared_at.value
        problem = None
        if spec.type:
            try:
                ParamType.parse(spec.type).check(value)
            except ValueError as exc:
                problem = str(exc)
        if problem is None and spec.choices is not None and value not in spec.choices:
            problem = f"{value!r} is not one of {spec.choices}"
        if problem is None:
            return
        message = (f"parameter '{name}' ({self._source(name, origin)}) does not meet its declaration at "
                   f"{declared_at.origin.loc(key=True)}: {problem}.")
        if name in self.overrides:
            raise RecipeError(f"{self.set_by[name]}: {message}")
        raise self._default_origin(name).error(message)

    def _check_bounds(self, name: str, value: Any, located: Located[ParamSpec] | None = None,
                      origin: str = "default") -> None:
        """Each number of ``value`` (the value, or every item of a list) lies within the min/max (and is > 0
        with ``positive``) of ``located`` (default: the parameter's own definition)."""
        located = located or self.params[name]
        spec = located.value
        items = value if isinstance(value, (list, tuple)) else [value]
        numbers = [v for v in items if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if spec.positive:
            for item in numbers:
                if not item > 0:
                    self._bound_error(name, value, item, "positive", "true", 0, located, origin)
        for key, outside in (("min", lambda v, b: v < b), ("max", lambda v, b: v > b)):
            text = getattr(spec, key)
            if text is None:
                continue
            bound = self._bound(name, key, text, located)
            for item in numbers:
                if outside(item, bound):
                    self._bound_error(name, value, item, key, text, bound, located, origin)

    def _bound(self, name: str, key: str, text: Any, located: Located[ParamSpec] | None = None) -> Any:
        origin = (located or self.params[name]).origin.at(key)
        if not isinstance(text, str):
            bound = text
        else:
            try:
                bound = evaluate(parse(unwrap(text)), self._resolve_name)
            except ExprError as exc:
                raise origin.expr_error(exc, f"`{key}` of parameter '{name}'") from None
        if isinstance(bound, bool) or not isinstance(bound, (int, float)):
            raise origin.error(f"`{key}` of parameter '{name}' must be a number, got {bound!r}")
        return bound

    def _bound_error(self, name: str, value: Any, item: Any, key: str, text: Any, bound: Any,
                     located: Located[ParamSpec] | None = None, origin: str = "default") -> None:
        located = located or self.params[name]
        spec = located.value
        bound_loc = located.origin.loc(key)
        formula = f" ({key}: {text})" if isinstance(text, str) and str(text).strip() != str(bound) else ""
        what = f"item {item!r} of {value!r}" if isinstance(value, (list, tuple)) else f"{value!r}"
        side = {"min": "below its minimum", "max": "above its maximum", "positive": "not greater than"}[key]
        doc = f" {name}: {spec.doc or self.params[name].value.doc}." if spec.doc or self.params[name].value.doc \
            else ""
        source = f" ({self._source(name, origin)})" if origin == "config" else ""
        message = (
            f"parameter '{name}' is out of range: {what}{source} is {side} {bound!r}{formula}, declared at "
            f"{bound_loc}.{doc}"
            + (f" Fix {self.config_file}, or override the value with --set {name}=VALUE." if origin == "config"
               else "")
        )
        if name in self.overrides:
            raise RecipeError(f"{self.set_by[name]}: {message}")
        raise self._default_origin(name).error(message)

    # ---- helpers -------------------------------------------------------------------------------------------
    def _parse(self, name: str) -> ast.expr:
        spec = self.params[name].value
        try:
            return parse(unwrap(spec.default))
        except ExprError as exc:
            raise self._default_origin(name).expr_error(exc, f"parameter '{name}'") from None

    def _default_origin(self, name: str) -> Origin:
        return self.params[name].origin.value_origin("default")

    def _declared_type(self, name: str) -> ParamType | None:
        spec = self.params[name].value
        return ParamType.parse(spec.type) if spec.type else None

    def _typed(self, name: str, value: Any, kind: ParamType, origin: Origin, source: str = "") -> Any:
        spec = self.params[name].value
        try:
            value = kind.check(value)
        except ValueError as exc:
            fix = (f"Fix {self.config_file}, or override the value with --set {name}=VALUE." if source else
                   "Change the value or its `type:`.")
            raise origin.error(f"parameter '{name}'{source} has the wrong type: {exc}. {fix}") from None
        if spec.choices is not None and value not in spec.choices:
            raise origin.error(f"parameter '{name}' is {value!r}, not one of its choices {spec.choices}")
        return value

    def _override(self, name: str, kind: ParamType) -> Any:
        raw, is_text = self.overrides[name]
        value = _from_text(raw, kind) if is_text else raw
        spec = self.params[name].value
        given = self.set_by[name]
        try:
            value = kind.check(value)
            for item in value if isinstance(value, list) else [value]:
                check_value(item)
                if isinstance(item, float) and not math.isfinite(item):
                    raise ValueError(f"{item} is not a finite number")
            check_value(value)
        except ValueError as exc:
            raise RecipeError(
                f"{given}: parameter '{name}' is {kind} ({shorten(str(exc), 120)}); declared at "
                f"{self._default_origin(name).loc()}."
            ) from None
        if spec.choices is not None and value not in spec.choices:
            raise RecipeError(f"{given}: must be one of {spec.choices}.")
        return value
