"""Symbolic dimensions.

A dimension is either a plain ``int`` or an ``Expr``: an integer polynomial over named symbols (``s``, ``p``) whose
atoms may also be floor-divisions and remainders by constants (``s // 2``). Expressions are kept in a canonical
form (a map from monomials to integer coefficients), so ``s + p`` and ``p + s`` compare and hash equal, and an
expression with no symbols left collapses back to ``int``. Values are bound at run time with ``evaluate``.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Mapping

from ..errors import ShapeError, UnboundDimError

# An atom is a symbol name, or ("//" | "%", Expr key, divisor) for a non-polynomial term.
Atom = str | tuple
Monomial = tuple  # sorted tuple of atoms (with repetition for powers); () is the constant term


def _atom_sort_key(atom: Atom) -> str:
    return repr(atom)


class Expr:
    """An immutable symbolic integer expression in canonical polynomial form."""

    __slots__ = ("_terms", "_hash")

    def __init__(self, terms: Mapping[Monomial, int]):
        self._terms = tuple(sorted(((m, c) for m, c in terms.items() if c != 0), key=lambda mc: repr(mc[0])))
        self._hash = hash(self._terms)

    # ---- construction ----------------------------------------------------------------------------------------
    @staticmethod
    def symbol(name: str) -> Expr:
        if not name.isidentifier():
            raise ShapeError(f"'{name}' is not a valid symbolic dimension name; use an identifier such as 's'.")
        return Expr({(name,): 1})

    @staticmethod
    def const(value: int) -> Expr:
        return Expr({(): int(value)})

    # ---- queries ---------------------------------------------------------------------------------------------
    @property
    def terms(self) -> tuple:
        return self._terms

    def free_symbols(self) -> set[str]:
        out: set[str] = set()
        for mono, _ in self._terms:
            for atom in mono:
                if isinstance(atom, str):
                    out.add(atom)
                else:
                    out |= Expr(dict(atom[1])).free_symbols()
        return out

    def constant_value(self) -> int | None:
        if not self._terms:
            return 0
        if len(self._terms) == 1 and self._terms[0][0] == ():
            return self._terms[0][1]
        return None

    def evaluate(self, bindings: Mapping[str, int]) -> int:
        total = 0
        for mono, coeff in self._terms:
            value = coeff
            for atom in mono:
                value *= _eval_atom(atom, bindings)
            total += value
        return total

    def substitute(self, bindings: Mapping[str, Dim]) -> Dim:
        out: Dim = 0
        for mono, coeff in self._terms:
            value: Dim = coeff
            for atom in mono:
                if isinstance(atom, str):
                    value = mul(value, bindings.get(atom, Expr.symbol(atom)))
                else:
                    inner = Expr(dict(atom[1])).substitute(bindings)
                    value = mul(value, floordiv(inner, atom[2]) if atom[0] == "//" else mod(inner, atom[2]))
            out = add(out, value)
        return out

    # ---- arithmetic (returns Dim: collapses to int when constant) ----------------------------------------------
    def __add__(self, other: Dim) -> Dim:
        return add(self, other)

    __radd__ = __add__

    def __sub__(self, other: Dim) -> Dim:
        return add(self, mul(other, -1))

    def __rsub__(self, other: Dim) -> Dim:
        return add(other, mul(self, -1))

    def __mul__(self, other: Dim) -> Dim:
        return mul(self, other)

    __rmul__ = __mul__

    def __floordiv__(self, other: int) -> Dim:
        return floordiv(self, other)

    def __mod__(self, other: int) -> Dim:
        return mod(self, other)

    def __neg__(self) -> Dim:
        return mul(self, -1)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, int):
            return self.constant_value() == other
        return isinstance(other, Expr) and self._terms == other._terms

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return f"Expr({self})"

    def __str__(self) -> str:
        if not self._terms:
            return "0"
        parts = []
        for mono, coeff in self._terms:
            # a // or % atom multiplied by anything needs its own parentheses: "2*(s // 2)", not "2*s // 2"
            alone = len(mono) == 1 and coeff == 1
            factors = [_atom_str(a) if alone or isinstance(a, str) else f"({_atom_str(a)})" for a in mono]
            if not factors:
                parts.append(str(coeff))
            elif coeff == 1:
                parts.append("*".join(factors))
            elif coeff == -1:
                parts.append("-" + "*".join(factors))
            else:
                parts.append(f"{coeff}*" + "*".join(factors))
        text = " + ".join(parts)
        return text.replace("+ -", "- ")


Dim = int | Expr


def _atom_str(atom: Atom) -> str:
    if isinstance(atom, str):
        return atom
    inner = str(Expr(dict(atom[1])))
    if not inner.isidentifier():
        inner = f"({inner})"
    return f"{inner} {atom[0]} {atom[2]}"


def _eval_atom(atom: Atom, bindings: Mapping[str, int]) -> int:
    if isinstance(atom, str):
        if atom not in bindings:
            raise UnboundDimError(
                f"symbolic dimension '{atom}' has no value at run time; pass it in the dims mapping, "
                f"e.g. dims={{'{atom}': 16}}."
            )
        value = bindings[atom]
        # an int (or an int subclass such as the CUDA backend's SymInt, which must survive) as it is
        return value if isinstance(value, int) and not isinstance(value, bool) else int(value)
    inner = Expr(dict(atom[1])).evaluate(bindings)
    return inner // atom[2] if atom[0] == "//" else inner % atom[2]


def _as_terms(x: Dim) -> dict:
    if isinstance(x, Expr):
        return dict(x.terms)
    if isinstance(x, bool) or not isinstance(x, int):
        raise ShapeError(f"dimension {x!r} must be an int or a symbolic expression, not {type(x).__name__}")
    return {(): x} if x else {}


def normalize(terms: Mapping[Monomial, int]) -> Dim:
    e = Expr(terms)
    c = e.constant_value()
    return e if c is None else c


def add(a: Dim, b: Dim) -> Dim:
    if isinstance(a, int) and isinstance(b, int):
        return a + b
    terms = _as_terms(a)
    for mono, coeff in _as_terms(b).items():
        terms[mono] = terms.get(mono, 0) + coeff
    return normalize(terms)


def mul(a: Dim, b: Dim) -> Dim:
    if isinstance(a, int) and isinstance(b, int):
        return a * b
    out: dict = {}
    for ma, ca in _as_terms(a).items():
        for mb, cb in _as_terms(b).items():
            mono = tuple(sorted(ma + mb, key=_atom_sort_key))
            out[mono] = out.get(mono, 0) + ca * cb
    return normalize(out)


def floordiv(a: Dim, d: int) -> Dim:
    if isinstance(d, Expr):
        dc = d.constant_value()
        if dc is None:
            raise ShapeError(f"cannot divide dimension {a} by symbolic {d}; divisors must be constants")
        d = dc
    if d <= 0:
        raise ShapeError(f"dimension divisor must be positive, got {d}")
    if isinstance(a, int):
        return a // d
    terms = _as_terms(a)
    if all(c % d == 0 for c in terms.values()):
        return normalize({m: c // d for m, c in terms.items()})
    return normalize({(("//", tuple(sorted(terms.items(), key=repr)), d),): 1})


def mod(a: Dim, d: int) -> Dim:
    if isinstance(d, Expr):
        dc = d.constant_value()
        if dc is None:
            raise ShapeError(f"cannot take dimension {a} modulo symbolic {d}; divisors must be constants")
        d = dc
    if d <= 0:
        raise ShapeError(f"dimension modulus must be positive, got {d}")
    if isinstance(a, int):
        return a % d
    terms = _as_terms(a)
    if all(c % d == 0 for c in terms.values()):
        return 0
    return normalize({(("%", tuple(sorted(terms.items(), key=repr)), d),): 1})


def to_dim(x: Dim | str) -> Dim:
    """Turn an int, an ``Expr`` or a string such as ``"s + p"`` into a canonical dimension."""
    if isinstance(x, Expr):
        c = x.constant_value()
        return x if c is None else c
    if isinstance(x, bool):
        raise ShapeError(f"dimension {x!r} must be an int or a symbolic expression")
    if isinstance(x, int):
        return x
    if hasattr(x, "__index__"):  # numpy integers
        return int(x)
    if isinstance(x, str):
        return parse_dim(x)
    raise ShapeError(f"dimension {x!r} must be an int, a symbol name or an expression such as 's + p'")


@functools.lru_cache(maxsize=1 << 14)
def parse_dim(text: str) -> Dim:
    """Parse ``"2*s + p"``, ``"s // 2"`` etc. Only names, integers and + - * // % are accepted. Kept: a
    program read from the plan cache parses the same few texts thousands of times (dims are immutable)."""
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as exc:
        raise ShapeError(f"cannot parse dimension expression '{text}': {exc.msg}") from None

    def walk(node: ast.AST) -> Dim:
        if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.Name):
            return Expr.symbol(node.id)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return mul(walk(node.operand), -1)
        if isinstance(node, ast.BinOp):
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Add):
                return add(left, right)
            if isinstance(node.op, ast.Sub):
                return add(left, mul(right, -1))
            if isinstance(node.op, ast.Mult):
                return mul(left, right)
            if isinstance(node.op, ast.FloorDiv):
                return floordiv(left, right)
            if isinstance(node.op, ast.Mod):
                return mod(left, right)
        raise ShapeError(
            f"unsupported syntax in dimension expression '{text}'; use names, integers and + - * // %"
        )

    return walk(tree.body)


def evaluate(d: Dim, bindings: Mapping[str, int]) -> int:
    return d if isinstance(d, int) else d.evaluate(bindings)


def dims_equal(a: Dim, b: Dim) -> bool:
    return to_dim(a) == to_dim(b)


def shape_str(shape: tuple) -> str:
    return "(" + ", ".join(str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"


def prod(dims) -> Dim:
    out: Dim = 1
    for d in dims:
        out = mul(out, d)
    return out


def free_symbols(dims) -> set[str]:
    out: set[str] = set()
    for d in dims:
        if isinstance(d, Expr):
            out |= d.free_symbols()
    return out
