"""A safe evaluator for value expressions (parameter defaults, shapes, ``repeat``, ``when``, ``with``).

Expressions are parsed with ``ast`` and walked node by node; only literals, names, arithmetic, comparisons,
boolean logic, ``a if c else b``, lists/tuples, constant subscripts, ``config.key.sub[0]`` lookups and a
handful of pure functions are accepted. Nothing reaches ``eval``. Names resolve through a callback so
parameters can be resolved lazily (and cycles detected) by the caller.
"""

from __future__ import annotations

import ast
import operator
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..text.printf import printf_numbers
from .suggest import did_you_mean, one_of

_WRAPPED = re.compile(r"^\s*\$\{(.*)\}\s*$", re.DOTALL)

BIN_OPS: dict[type, Callable] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
UNARY_OPS: dict[type, Callable] = {ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Not: operator.not_}
COMPARE_OPS: dict[type, Callable] = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
    ast.Is: operator.is_,
    ast.IsNot: operator.is_not,
    ast.In: lambda a, b: a in b,
    ast.NotIn: lambda a, b: a not in b,
}
CONFIG = "config"
MODEL_INDEX = "model_index"  # in stage expressions: the checkpoint's model_index.json (diffusers' pipeline config)
YAML_CONSTANTS = {"true": True, "false": False, "null": None}  # YAML spellings inside ${...}

# What an expression may compute (here and in forwards): recipes need sizes, counts and short lists, so anything
# larger is a mistake or an attack: ``2**10**10`` would compute for hours, ``'a' * 10**10`` take 10 GB, and a
# 200,000-term sum overflow the parser's and the evaluator's stacks. Limits are checked before computing.
MAX_INT_BITS = 64  # |integer| < 2**64
MAX_SEQUENCE = 100_000  # items of a list or tuple, characters of a string
MAX_DEPTH = 100  # nesting of an expression's (or a forward's) syntax tree
ECHO_CHARS = 80  # the most of a value or an expression an error message quotes


class LimitError(ValueError):
    """A value beyond the limits above (a ValueError, so every evaluator reports it at its expression)."""


def shorten(text: str, limit: int = ECHO_CHARS) -> str:
    """``text``, cut to about ``limit`` characters for an error message (a 5 KB literal is not echoed)."""
    return text if len(text) <= limit else f"{text[: limit - 25]}... ({len(text)} characters)"


def value_size(value: Any, limit: int = MAX_SEQUENCE) -> int:
    """How much a value holds: a string its characters; a list or tuple every item at every depth (a string item
    its characters), so ``[[0] * 99999] * 99999``, one list repeated, counts the 10**10 items that ``str()`` or
    ``sum()`` of it would have to build. Stops counting soon after ``limit`` (the result is then > limit)."""
    if isinstance(value, str):
        return len(value)
    if not isinstance(value, (list, tuple)):
        return 1
    total, stack = 0, [value]
    while stack:
        for item in stack.pop():
            total += len(item) if isinstance(item, str) and item else 1
            if isinstance(item, (list, tuple)) and item:
                stack.append(item)
            if total > limit:
                return total
    return total


def text_size(value: Any, limit: int = MAX_SEQUENCE) -> int:
    """About how many characters ``str(value)`` has (repr of the items of a list), counted without building it;
    stops soon after ``limit``."""
    total, stack = 0, [(value, False)]
    while stack and total <= limit:
        item, nested = stack.pop()
        if isinstance(item, str):
            total += len(item) + (2 if nested else 0)
        elif isinstance(item, bool) or item is None:
            total += 5
        elif isinstance(item, int):
            total += item.bit_length() * 30103 // 100000 + 2
        elif isinstance(item, (list, tuple)):
            total += 2 + 2 * len(item)
            stack.extend((x, True) for x in item)
        else:
            total += 25  # a float, a tensor's or a config's short repr
    return total


def check_value(value: Any) -> Any:
    """``value`` if it is within the limits; LimitError otherwise."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise LimitError(f"the integer has {value.bit_length()} bits; expressions compute with integers of at "
                         f"most {MAX_INT_BITS} bits")
    if isinstance(value, (str, list, tuple)):
        size = value_size(value)
        if size > MAX_SEQUENCE:
            what = "characters" if isinstance(value, str) else "items (nested lists' items included)"
            raise LimitError(f"the result has {'at least ' if size > len(value) else ''}{size} {what}; "
                             f"expressions build at most {MAX_SEQUENCE}")
    if isinstance(value, complex):
        raise LimitError("the result is a complex number (a negative number to a fractional power?)")
    return value


def _limit(size: int, what: str) -> LimitError:
    return LimitError(f"{what} would make at least {size} items or characters; expressions build lists and "
                      f"strings of at most {MAX_SEQUENCE}")


def _plain_int(x: Any) -> bool:
    return isinstance(x, int)  # bool included: True ** n is small anyway


def checked_pow(base: Any, exponent: Any, *modulus: Any) -> Any:
    """``pow(base, exponent)`` refusing, before computing, an integer result beyond MAX_INT_BITS."""
    plain = not modulus and _plain_int(base) and _plain_int(exponent) and exponent > 0 and abs(base) > 1
    if plain and (abs(base).bit_length() - 1) * exponent > MAX_INT_BITS:
        raise LimitError(f"{shorten(repr(base), 30)} ** {shorten(repr(exponent), 30)} has more than "
                         f"{MAX_INT_BITS} bits; expressions compute with integers of at most {MAX_INT_BITS} bits")
    return check_value(pow(base, exponent, *modulus))


def checked_int(value: Any, *base: Any) -> int:
    """``int(value)``, refusing a string of digits too long to fit MAX_INT_BITS before converting it."""
    if isinstance(value, str) and len(value.strip().lstrip("+-").replace("_", "")) > MAX_INT_BITS // 3 + 2:
        raise LimitError(f"int() of a {len(value)}-character string: integers have at most {MAX_INT_BITS} bits")
    return check_value(int(value, *base))


def checked_str(value: Any) -> str:
    """``str(value)``, refusing before building it a text beyond MAX_SEQUENCE characters."""
    size = text_size(value)
    if size > MAX_SEQUENCE:
        raise _limit(size, "str() of this value")
    return check_value(str(value))


def checked_sum(items: Any, start: Any = 0) -> Any:
    """``sum(items, start)``: lists or tuples added up are sized from the operands before they are joined (and
    joined in one pass, not in the quadratic steps of ``sum``); numbers are added as ``sum`` adds them."""
    items = list(items)
    if isinstance(start, (list, tuple)) or any(isinstance(x, (list, tuple, str)) for x in items):
        size = value_size(start)
        for item in items:
            size += value_size(item, MAX_SEQUENCE - size)
            if size > MAX_SEQUENCE:
                raise _limit(size, "sum() of these lists")
        kind = type(start)
        if kind in (list, tuple) and all(type(x) is kind for x in items):
            return kind(x for part in (start, *items) for x in part)
    return check_value(sum(items, start))


def checked_round(number: Any, *ndigits: Any) -> Any:
    """``round(number, ndigits)``; an integer rounded to more digits than it has is 0 (Python would first compute
    10 ** -ndigits, for hours when ndigits is -2**62)."""
    if ndigits and _plain_int(number) and _plain_int(ndigits[0]) and ndigits[0] < -(number.bit_length() // 3 + 2):
        return 0
    return check_value(round(number, *ndigits))




def checked_format(template: str, args: Any) -> str:
    """``template % args``, sized from the field widths and precisions (``%0999999999d``, ``%*d``) and the
    arguments' text before formatting."""
    values = list(args.values()) if isinstance(args, dict) else list(args) if isinstance(args, tuple) else [args]
    size = len(template) + sum(text_size(v) for v in values)
    starred = [v for v in values if _plain_int(v)]
    for number in printf_numbers(template):  # linear, nested %(keys) as Python reads them
        if number == "*":
            size += max((abs(v) for v in starred), default=0)
        else:
            size += int(number) if len(number) < 10 else MAX_SEQUENCE + 1
        if size > MAX_SEQUENCE:
            raise _limit(size, f"{shorten(repr(template), 40)} % ...")
    if size > MAX_SEQUENCE:
        raise _limit(size, f"{shorten(repr(template), 40)} % ...")
    return check_value(template % args)


FUNCTIONS: dict[str, Callable] = {
    "min": min,
    "max": max,
    "abs": abs,
    "int": checked_int,
    "float": float,
    "bool": bool,
    "str": checked_str,
    "len": len,
    "round": checked_round,
    "sum": checked_sum,
    "list": list,
    "tuple": tuple,
}


def arithmetic(op: type, left: Any, right: Any) -> Any:
    """``left <op> right`` (``op`` an ast operator class) within the limits: powers and repetitions
    (``'a' * n``, ``[0] * n``) are bounded before they are computed, every plain result after."""
    if op is ast.Pow:
        return checked_pow(left, right)
    if op is ast.Mult:
        for seq, count in ((left, right), (right, left)):
            if isinstance(seq, (str, list, tuple)) and _plain_int(count) and count > 0:
                size = value_size(seq)
                if size * count > MAX_SEQUENCE:
                    raise LimitError(f"{shorten(repr(count), 30)} repetitions of {size} item(s) make more than "
                                     f"{MAX_SEQUENCE}; expressions build lists and strings of at most "
                                     f"{MAX_SEQUENCE}")
    if op is ast.Add and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
        size = value_size(left) + value_size(right)
        if size > MAX_SEQUENCE:
            raise _limit(size, "this sum of lists or strings")
    if op is ast.Mod and isinstance(left, str):
        return checked_format(left, right)
    return check_value(BIN_OPS[op](left, right))


def out_of_range(exc: ArithmeticError) -> str:
    """An OverflowError in words (Python says "(34, 'Numerical result out of range')")."""
    return f"the result is out of range for a float ({exc.args[-1] if exc.args else exc})"


def too_deep(tree: ast.AST, limit: int = MAX_DEPTH) -> ast.AST | None:
    """The first node nested more than ``limit`` levels deep (or its nearest ancestor with a position), or
    None. Iterative, so it works on trees too deep for recursion."""
    stack: list[tuple[ast.AST, int, ast.AST]] = [(tree, 0, tree)]
    while stack:
        node, depth, placed = stack.pop()
        placed = node if hasattr(node, "lineno") else placed
        if depth > limit:
            return placed
        stack.extend((child, depth + 1, placed) for child in ast.iter_child_nodes(node))
    return None


def parse_python(code: str, mode: str) -> ast.AST:
    """``ast.parse`` that reports a tree too deep for Python's parser, or deeper than MAX_DEPTH, as ExprError
    (SyntaxError passes through for the caller to phrase)."""
    deep = (f"the expression is nested more than {MAX_DEPTH} levels deep (a very long chain of operators or "
            f"brackets); split it into several steps")
    try:
        tree = ast.parse(code, mode=mode)
    except (RecursionError, MemoryError):
        raise ExprError(deep) from None
    node = too_deep(tree)
    if node is not None:
        raise ExprError(deep, getattr(node, "lineno", 1), getattr(node, "col_offset", 0))
    return tree


class ExprError(Exception):
    """An error at ``lineno``/``col`` (ast conventions) inside an expression string; callers add the file."""

    def __init__(self, message: str, lineno: int = 1, col: int = 0):
        super().__init__(message)
        self.message = message
        self.lineno = lineno
        self.col = col


@dataclass(frozen=True)
class ExprText:
    """An expression string with the column where it starts inside the YAML scalar (after ``${``)."""

    code: str
    offset: int


def unwrap(text: str) -> ExprText:
    """Strip an optional ``${...}`` wrapper, remembering how far the expression is shifted."""
    match = _WRAPPED.match(text)
    if match:
        return ExprText(match.group(1), match.start(1))
    return ExprText(text, 0)


def is_wrapped(value: Any) -> bool:
    return isinstance(value, str) and _WRAPPED.match(value) is not None


def parse(text: ExprText) -> ast.expr:
    code = text.code.lstrip(" \t")
    offset = text.offset + len(text.code) - len(code)
    try:
        tree = parse_python(code.rstrip(), "eval")
    except ExprError as exc:
        raise ExprError(exc.message, exc.lineno, exc.col + (offset if exc.lineno == 1 else 0)) from None
    except SyntaxError as exc:
        raise ExprError(
            f"invalid expression '{shorten(text.code.strip())}': {exc.msg}",
            exc.lineno or 1,
            (exc.offset or 1) - 1 + (offset if (exc.lineno or 1) == 1 else 0),
        ) from None
    _shift(tree, offset)
    return tree.body


def _shift(tree: ast.AST, offset: int) -> None:
    if offset:
        for node in ast.walk(tree):
            if hasattr(node, "col_offset") and getattr(node, "lineno", 1) == 1:
                node.col_offset += offset


class ConfigView:
    """The checkpoint's config.json as seen by expressions: ``config.text_config.hidden_size``."""

    def __init__(self, data: Mapping[str, Any], file: str = "config.json", prefix: str = CONFIG):
        self.data = data
        self.file = file
        self.prefix = prefix

    def lookup(self, key: str, node: ast.AST) -> Any:
        if key not in self.data:
            raise ExprError(
                f"{self.file} has no key '{self.prefix}.{key}'{did_you_mean(key, self.data)}; "
                f"its keys are: {one_of(self.data)}. Use config.get('{key}', default) for optional "
                f"keys.",
                node.lineno,
                node.col_offset,
            )
        return wrap_config(self.data[key], self.file, f"{self.prefix}.{key}")

    # a mapping of config.json reads like a dict: `list(config.per_layer_config)` its keys, `len(...)`, `'k' in ...`
    def __iter__(self):
        return iter(list(self.data))

    def __len__(self) -> int:
        return len(self.data)

    def __contains__(self, key: object) -> bool:
        return key in self.data


def wrap_config(value: Any, file: str, prefix: str) -> Any:
    return ConfigView(value, file, prefix) if isinstance(value, Mapping) else value


NameResolver = Callable[[str, ast.Name], Any]


def evaluate(node: ast.expr, resolve: NameResolver) -> Any:
    """Evaluate a parsed expression; ``resolve(name, node)`` supplies names (raising ExprError if unknown)."""
    return _Evaluator(resolve).eval(node)


def names_in(node: ast.expr) -> list[ast.Name]:
    """Free names an expression reads (``config`` included)."""
    return [n for n in ast.walk(node) if isinstance(n, ast.Name)]


class _Evaluator:
    def __init__(self, resolve: NameResolver):
        self.resolve = resolve

    def fail(self, node: ast.AST, message: str) -> ExprError:
        return ExprError(message, getattr(node, "lineno", 1), getattr(node, "col_offset", 0))

    def eval(self, node: ast.AST) -> Any:
        method = getattr(self, "_" + type(node).__name__, None)
        if method is None:
            raise self.fail(
                node,
                f"'{_describe(node)}' is not allowed in a value expression; use literals, "
                f"parameter names, config.key, arithmetic (+ - * / // % **), comparisons, "
                f"and/or/not, 'a if cond else b', lists and min/max/int/float/len",
            )
        try:
            return method(node)
        except ExprError:
            raise
        except OverflowError as exc:
            raise self.fail(node, f"cannot evaluate '{shorten(ast.unparse(node))}': {out_of_range(exc)}") from None
        except (TypeError, ValueError, ZeroDivisionError, IndexError, KeyError) as exc:
            raise self.fail(node, f"cannot evaluate '{shorten(ast.unparse(node))}': {shorten(str(exc), 200)}") \
                from None

    def _Constant(self, node: ast.Constant) -> Any:
        if not isinstance(node.value, (int, float, bool, str, type(None))):
            raise self.fail(node, f"literal {node.value!r} is not allowed; use numbers, strings, true/false")
        return check_value(node.value)

    def _Name(self, node: ast.Name) -> Any:
        if node.id.startswith("__"):
            raise self.fail(node, f"name '{node.id}' is not allowed (dunder names are reserved)")
        if node.id in YAML_CONSTANTS:
            return YAML_CONSTANTS[node.id]
        return self.resolve(node.id, node)

    def _Attribute(self, node: ast.Attribute) -> Any:
        base = self.eval(node.value)
        if not isinstance(base, ConfigView) or node.attr.startswith("_"):
            raise self.fail(
                node,
                f"attribute access '.{node.attr}' is only allowed on config "
                f"(config.hidden_size, config.text_config.num_layers)",
            )
        return base.lookup(node.attr, node)

    def _Subscript(self, node: ast.Subscript) -> Any:
        base = self.eval(node.value)
        index = self.eval(node.slice)
        if isinstance(base, ConfigView):
            if not isinstance(index, str):
                raise self.fail(node, "config mappings are indexed by key strings: config['key']")
            return base.lookup(index, node)
        if isinstance(index, bool) or not isinstance(index, int):
            raise self.fail(node, "lists are indexed by integers, e.g. layers[0]")
        return base[index]

    def _Slice(self, node: ast.Slice) -> Any:
        parts = [None if p is None else self.eval(p) for p in (node.lower, node.upper, node.step)]
        return slice(*parts)

    def _BinOp(self, node: ast.BinOp) -> Any:
        op = BIN_OPS.get(type(node.op))
        if op is None:
            raise self.fail(node, "only + - * / // % ** are allowed")
        return arithmetic(type(node.op), self.eval(node.left), self.eval(node.right))

    def _UnaryOp(self, node: ast.UnaryOp) -> Any:
        op = UNARY_OPS.get(type(node.op))
        if op is None:
            raise self.fail(node, "only unary - + and not are allowed")
        return op(self.eval(node.operand))

    def _BoolOp(self, node: ast.BoolOp) -> Any:
        value = self.eval(node.values[0])
        for item in node.values[1:]:
            if isinstance(node.op, ast.And) and not value:
                return value
            if isinstance(node.op, ast.Or) and value:
                return value
            value = self.eval(item)
        return value

    def _Compare(self, node: ast.Compare) -> Any:
        left = self.eval(node.left)
        for op, right_node in zip(node.ops, node.comparators):
            right = self.eval(right_node)
            if not COMPARE_OPS[type(op)](left, right):
                return False
            left = right
        return True

    def _IfExp(self, node: ast.IfExp) -> Any:
        return self.eval(node.body) if self.eval(node.test) else self.eval(node.orelse)

    # a list built of values (parameters) that are lists is sized too: [a, a] holds a's items twice, so a chain of
    # parameters each [previous, previous] would otherwise double to 2**n items for the next walk over it
    def _List(self, node: ast.List) -> Any:
        return check_value([self.eval(e) for e in node.elts])

    def _Tuple(self, node: ast.Tuple) -> Any:
        return check_value(tuple(self.eval(e) for e in node.elts))

    def _Call(self, node: ast.Call) -> Any:
        if node.keywords or any(isinstance(a, ast.Starred) for a in node.args):
            raise self.fail(node, "functions take positional arguments only here")
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr == "get":
            base = self.eval(func.value)
            if isinstance(base, ConfigView):
                if len(node.args) not in (1, 2):
                    raise self.fail(node, "use config.get('key') or config.get('key', default)")
                key = self.eval(node.args[0])
                if not isinstance(key, str):
                    raise self.fail(
                        node, "config.get takes a key string: config.get('rope_parameters.rope_theta')"
                    )
                data: Any = base.data
                for part in key.split("."):  # dotted keys reach into nested objects
                    if not isinstance(data, Mapping) or part not in data:
                        return self.eval(node.args[1]) if len(node.args) == 2 else None
                    data = data[part]
                return wrap_config(data, base.file, f"{base.prefix}.{key}")
        if isinstance(func, ast.Name) and func.id in FUNCTIONS:
            return check_value(FUNCTIONS[func.id](*[self.eval(a) for a in node.args]))
        raise self.fail(
            node,
            f"'{ast.unparse(func)}' cannot be called in a value expression; the functions "
            f"are {one_of(FUNCTIONS)} and config.get(key, default)",
        )


def _describe(node: ast.AST) -> str:
    try:
        return ast.unparse(node)
    except Exception:  # noqa: BLE001 - only used to phrase an error
        return type(node).__name__
