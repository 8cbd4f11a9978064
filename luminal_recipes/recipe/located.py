"""A piece of a recipe together with the YAML file and the path where it was written."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from ..errors import RecipeError
from .safe_eval import ExprError
from .yaml_source import Loc, YamlSource

T = TypeVar("T")


@dataclass(frozen=True)
class Origin:
    """Where something was written: a YAML file and a key path inside it."""

    source: YamlSource
    path: tuple

    def at(self, *sub: Any) -> Origin:
        return Origin(self.source, self.path + tuple(sub))

    def loc(self, *sub: Any, key: bool = False) -> Loc:
        return self.source.loc(self.path + tuple(sub), key=key)

    def locate(self, lineno: int, col: int) -> Loc:
        """A position inside the string value at this path."""
        return self.source.locate(self.path, lineno, col)

    def error(self, message: str, *, key: bool = False) -> RecipeError:
        return RecipeError(f"{self.loc(key=key)}: {message}")

    def expr_error(self, exc: ExprError, context: str = "") -> RecipeError:
        prefix = f"{context}: " if context else ""
        return RecipeError(f"{self.locate(exc.lineno, exc.col)}: {prefix}{exc.message}")

    def value_origin(self, *sub: Any) -> Origin:
        """The origin of a value that may be written short (``k: v``) or long (``k: {default: v}``)."""
        long_form = self.at(*sub)
        return long_form if self.source.has(long_form.path) else self.at(*sub[:-1])


@dataclass(frozen=True)
class Located(Generic[T]):
    value: T
    origin: Origin
