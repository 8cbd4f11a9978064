"""Symbolic dims in generated CUDA C: kernels read them from arguments, so one module serves every length.

The CUDA backends prepare a node with its views bound to ``SymInt``s (``kernel_dims``) where a program has
symbolic dims: an ``int`` (its value at the dims being bound, so every decision the generator makes - which path,
which launch grid, which cuBLAS descriptor - is made as before) that also carries a C expression over the dims
it came from. Formatted into kernel text (``f"{n}"``) it prints that expression between markers instead of the
number; anything else (``str``, ``int``, arithmetic the expression cannot follow, e.g. ``bit_length`` or a
floor division of a negative value) gives a plain int, which is baked in as before. Dims that are fixed stay
plain ints: a fixed-size kernel's text is what it was.

``lower(source)`` (run by ``nodes.prepare`` on every kernel of a node) turns the markers into C: each symbolic
dim ``n`` becomes one ``long long LRDIM__n`` kernel argument (appended to the kernel's parameters; ``Launch``
args get the values), and every functor struct of the kernel text whose body reads one gets a member of the same
name, filled where it is constructed (``LoadX{x}`` -> ``LoadX{x, LRDIM__n}``). Because the text then depends
only on which expressions were used, not on their values, re-binding within a size bucket produces the same
module text and compiles nothing (``backend._ModuleBuilder`` keeps modules by text).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

OPEN, CLOSE = "\x01", "\x02"  # around a symbolic expression in kernel text, until ``lower`` replaces them
PREFIX = "LRDIM__"


def c_name(dim: str) -> str:
    """The C identifier of dim ``dim`` (an identifier already; non-ASCII letters are spelled out)."""
    if dim.isascii():
        return PREFIX + dim
    return PREFIX + "".join(c if c.isascii() and (c.isalnum() or c == "_") else f"_u{ord(c):x}_" for c in dim)


class SymInt(int):
    """An int that remembers its C expression over symbolic dims (see the module docstring)."""

    def __new__(cls, value: int, expr: str, syms: frozenset):
        obj = super().__new__(cls, value)
        obj.expr = expr  # C text, every operand parenthesised
        obj.syms = syms  # frozenset of (dim name, value)
        return obj

    def __format__(self, spec: str) -> str:
        if spec:
            return format(int(self), spec)
        return f"{OPEN}{self.expr}{CLOSE}"

    def __repr__(self) -> str:
        return int.__repr__(self)

    __str__ = __repr__

    # arithmetic that C follows exactly (dims are non-negative: / and % only for non-negative operands)
    def _binary(self, other, op: str, value: int, reflected: bool = False):
        if not isinstance(other, int) or isinstance(other, bool):
            return value
        if isinstance(other, SymInt):
            a, b, syms = self.expr, other.expr, self.syms | other.syms
        else:
            a, b, syms = self.expr, str(int(other)), self.syms
        if reflected:
            a, b = b, a
        return SymInt(value, f"({a} {op} {b})", syms)

    def __add__(self, other):
        if not isinstance(other, int):
            return NotImplemented
        if type(other) is int and other == 0:
            return self
        return self._binary(other, "+", int(self) + int(other))

    def __radd__(self, other):
        if not isinstance(other, int):
            return NotImplemented
        if type(other) is int and other == 0:
            return self
        return self._binary(other, "+", int(other) + int(self), True)

    def __sub__(self, other):
        if not isinstance(other, int):
            return NotImplemented
        if type(other) is int and other == 0:
            return self
        return self._binary(other, "-", int(self) - int(other))

    def __rsub__(self, other):
        if not isinstance(other, int):
            return NotImplemented
        return self._binary(other, "-", int(other) - int(self), True)

    def __mul__(self, other):
        if not isinstance(other, int):
            return NotImplemented
        if type(other) is int and other in (0, 1):
            return self if other == 1 else 0
        return self._binary(other, "*", int(self) * int(other))

    def __rmul__(self, other):
        if not isinstance(other, int):
            return NotImplemented
        if type(other) is int and other in (0, 1):
            return self if other == 1 else 0
        return self._binary(other, "*", int(other) * int(self), True)

    def __floordiv__(self, other):
        if not isinstance(other, int):
            return NotImplemented
        value = int(self) // int(other)
        if type(other) is int and other == 1:
            return self
        return self._binary(other, "/", value) if int(self) >= 0 and int(other) > 0 else value

    def __rfloordiv__(self, other):
        if not isinstance(other, int):
            return NotImplemented
        value = int(other) // int(self)
        return self._binary(other, "/", value, True) if int(other) >= 0 and int(self) > 0 else value

    def __mod__(self, other):
        if not isinstance(other, int):
            return NotImplemented
        value = int(self) % int(other)
        return self._binary(other, "%", value) if int(self) >= 0 and int(other) > 0 else value

    def __rmod__(self, other):
        if not isinstance(other, int):
            return NotImplemented
        value = int(other) % int(self)
        return self._binary(other, "%", value, True) if int(other) >= 0 and int(self) > 0 else value

    def __neg__(self):
        return SymInt(-int(self), f"(-{self.expr})", self.syms)

    def __pos__(self):
        return self

    def __reduce__(self):  # pickled / copied as the plain number
        return (int, (int(self),))


def is_sym(x) -> bool:
    return isinstance(x, SymInt)


def kernel_dims(dims: Mapping[str, int]) -> dict[str, int]:
    """``dims`` with every value a ``SymInt`` of its own dim (what kernels are prepared with)."""
    return {name: SymInt(int(v), c_name(name), frozenset({(name, int(v))})) for name, v in dims.items()}


def same(a, b) -> bool:
    """Equal now and for every value of the dims (the same expression, or the same plain int)."""
    if isinstance(a, SymInt) or isinstance(b, SymInt):
        return isinstance(a, SymInt) and isinstance(b, SymInt) and a.expr == b.expr and int(a) == int(b)
    return a == b


def values_in(*things) -> dict[str, int]:
    """dim name -> value of every SymInt in ``things`` (nested tuples, lists, objects with a view)."""
    out: dict[str, int] = {}

    def walk(x) -> None:
        if isinstance(x, SymInt):
            out.update(x.syms)
        elif isinstance(x, (tuple, list)):
            for y in x:
                walk(y)
        elif hasattr(x, "view"):
            walk((x.view.shape, x.view.strides, x.view.offset, x.view.mask, getattr(x, "size", 0)))

    walk(things)
    return out


_SPAN = re.compile(OPEN + "([^" + OPEN + CLOSE + "]*)" + CLOSE + r"(ULL|LL|ll|u|U|f)?")
_CAST = {None: "", "LL": "(long long)", "ll": "(long long)", "ULL": "(unsigned long long)", "u": "(unsigned)",
         "U": "(unsigned)", "f": "(float)"}
_TOKEN = re.compile(PREFIX + r"\w+")
_STRUCT = re.compile(r"\bstruct (\w+) \{")


def _span_c(m: re.Match) -> str:
    cast = _CAST[m.group(2)]
    return f"({cast}({m.group(1)}))" if cast else f"({m.group(1)})"


def plain(text: str) -> str:
    """``text`` with its symbolic expressions spelled as C (for messages)."""
    return _SPAN.sub(_span_c, text)


def _close(text: str, at: int, open_: str = "{", close: str = "}") -> int:
    """Index of the bracket closing the one at ``at``."""
    depth = 0
    for i in range(at, len(text)):
        c = text[i]
        if c == open_:
            depth += 1
        elif c == close:
            depth -= 1
            if depth == 0:
                return i
    raise ValueError(f"unbalanced {open_}{close} in generated kernel text")


def _fill(text: str, struct: str, tokens: list[str]) -> str:
    """Every construction ``struct{...}`` in ``text`` gets ``tokens`` appended to its initialisers."""
    pat = re.compile(r"\b" + re.escape(struct) + r"\{")
    out, pos = [], 0
    while True:
        m = pat.search(text, pos)
        if m is None:
            out.append(text[pos:])
            return "".join(out)
        brace = m.end() - 1
        end = _close(text, brace)
        inner = text[brace + 1: end]
        out.append(text[pos: brace + 1])
        out.append(inner + (", " if inner.strip() else "") + ", ".join(tokens) + "}")
        pos = end + 1


def lower(code: str, kernel: str) -> tuple[str, list[str]]:
    """``code`` (one kernel's text, with markers) as C, and the dim tokens appended to ``kernel``'s parameters."""
    code = _SPAN.sub(_span_c, code)
    if PREFIX not in code:
        return code, []
    pos = 0
    while True:  # functor structs, in order of definition (a struct only constructs those defined before it)
        m = _STRUCT.search(code, pos)
        if m is None:
            break
        name, brace = m.group(1), m.end() - 1
        end = _close(code, brace)
        tokens = sorted(set(_TOKEN.findall(code[brace:end])))
        if tokens:
            members = " ".join(f"long long {t};" for t in tokens)
            code = code[:end] + f"  {members}\n" + code[end:]
            end += len(members) + 3
            code = code[: end + 1] + _fill(code[end + 1:], name, tokens)
        pos = end + 1
    m = re.compile(r"\b" + re.escape(kernel) + r"\(").search(code, max(code.find("__global__"), 0))
    if m is None or "__global__" not in code:
        raise ValueError(f"kernel {kernel} has no __global__ entry in its text")
    start = m.end() - 1
    end = _close(code, start, "(", ")")
    body_end = _close(code, code.index("{", end))
    tokens = sorted(set(_TOKEN.findall(code[end:body_end])))
    if tokens:
        sig = code[start + 1: end]
        extra = ", ".join(f"long long {t}" for t in tokens)
        code = code[: start + 1] + sig + (", " if sig.strip() else "") + extra + code[end:]
    return code, tokens


def dim_of(token: str, dims: Mapping[str, int]) -> int:
    for name, value in dims.items():
        if c_name(name) == token:
            return value
    raise KeyError(token)
