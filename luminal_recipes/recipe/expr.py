"""The ``forward`` language: a small, Python-shaped statement language checked against a whitelist.

A forward is parsed with ``ast`` and accepted only if every node is one of: assignments (with tuple
unpacking), ``for i in range(...)``, ``if``/``else``, ``return``, ``pass``; names, literals, arithmetic,
comparisons, ``and``/``or``/``not``, ``a if c else b``, tuples and lists, integer subscripts, calls of op-
library functions and of the module's submodules, and attribute chains rooted at ``self`` that name the
module's weights and submodules. Names are checked flow-sensitively (a name must be assigned before it is
read). Every rejection is reported at ``file:line:col`` inside the YAML file and says what to write instead.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from ..errors import RecipeError
from .located import Origin
from .safe_eval import ExprError, LimitError, check_value, parse_python, shorten
from .schema import ModuleSpec
from .suggest import did_you_mean, one_of

SELF = "self"
# Functions of the language itself (the op library supplies the rest); range only as a loop's iterable.
# Views and sources: reshape ... full; numbers or tensors: min ... pow (plain math when no tensor argument).
# fmt: off
BUILTINS = frozenset({
    "range", "reshape", "permute", "transpose", "narrow", "unsqueeze", "squeeze", "expand", "broadcast_to",
    "pad", "merge_dims", "split_dim", "contiguous", "iota", "full", "astype", "shape", "len", "int", "float",
    "min", "max", "abs", "exp", "log", "log2", "sqrt", "sin", "cos", "tanh", "pow",
})
# fmt: on
# Values every forward can read: the compute dtype of the recipe's dtype policy (weights.dtype.compute).
LANGUAGE_NAMES = frozenset({"compute_dtype"})

_ALLOWED_STATEMENTS = (
    "assignments (a = ..., a, b = ...), `for i in range(n):`, `if cond:`/`else:`, `return ...`"
)
_FORBIDDEN: dict[type, str] = {
    ast.Import: "imports are not allowed; call op-library functions by name (linear, rms_norm, ...)",
    ast.ImportFrom: "imports are not allowed; call op-library functions by name (linear, rms_norm, ...)",
    ast.Lambda: "lambdas are not allowed; write a module under `modules:` and call it as self.NAME(...)",
    ast.FunctionDef: "function definitions are not allowed; write a module under `modules:` and call it as "
    "self.NAME(...)",
    ast.AsyncFunctionDef: "function definitions are not allowed; write a module under `modules:`",
    ast.ClassDef: "classes are not allowed; write a module under `modules:`",
    ast.ListComp: "comprehensions are not allowed; use a `for i in range(n):` loop",
    ast.SetComp: "comprehensions are not allowed; use a `for i in range(n):` loop",
    ast.DictComp: "comprehensions are not allowed; use a `for i in range(n):` loop",
    ast.GeneratorExp: "generator expressions are not allowed; use a `for i in range(n):` loop",
    ast.While: "while loops are not allowed; loops have a fixed count: `for i in range(n):`",
    ast.Dict: "dict literals are not allowed; use tuples, lists, or keyword arguments",
    ast.Set: "set literals are not allowed; use tuples or lists",
    ast.JoinedStr: "f-strings are not allowed; use plain string literals",
    ast.Starred: "star-unpacking is not allowed; pass arguments one by one",
    ast.NamedExpr: "':=' is not allowed; use a separate assignment",
    ast.Await: "await is not allowed",
    ast.Yield: "yield is not allowed; use return",
    ast.YieldFrom: "yield is not allowed; use return",
    ast.Global: "global is not allowed; parameters are visible by name in every module",
    ast.Nonlocal: "nonlocal is not allowed",
    ast.Delete: "del is not allowed; just stop using the name",
    ast.Try: "try/except is not allowed; errors in a recipe are reported where they happen",
    ast.Raise: "raise is not allowed",
    ast.With: "with-blocks are not allowed",
    ast.Assert: "assert is not allowed; use parameter `choices:` to restrict values",
    ast.Slice: "slicing with ':' is not allowed; use narrow(x, axis, start, stop); subscripts are integers",
}
BIN_OPS = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow)
UNARY_OPS = (ast.USub, ast.UAdd, ast.Not)


@dataclass
class ForwardScope:
    """What names a module's forward may use."""

    ops: frozenset[str]
    params: frozenset[str]
    inputs: tuple[str, ...]
    options: frozenset[str]
    module: ModuleSpec
    modules: Mapping[str, ModuleSpec]  # every module of the recipe, to follow self.a.b chains


@dataclass
class Forward:
    """A checked forward: its statements and where they were written."""

    body: list[ast.stmt]
    origin: Origin
    text: str = field(repr=False)

    def error(self, node: ast.AST, message: str) -> RecipeError:
        loc = self.origin.locate(getattr(node, "lineno", 1), getattr(node, "col_offset", 0))
        return RecipeError(f"{loc}: {message}")


def parse_forward(text: str, origin: Origin) -> Forward:
    """Parse a forward body and reject every construct outside the language."""
    try:
        tree = parse_python(text, "exec")
    except ExprError as exc:
        raise RecipeError(f"{origin.locate(exc.lineno, exc.col)}: {exc.message}") from None
    except SyntaxError as exc:
        loc = origin.locate(exc.lineno or 1, max((exc.offset or 1) - 1, 0))
        raise RecipeError(
            f"{loc}: syntax error in forward: {exc.msg}. The forward is Python-like: {_ALLOWED_STATEMENTS}."
        ) from None
    forward = Forward(tree.body, origin, text)
    _Whitelist(forward).visit(tree)
    if not tree.body or not isinstance(tree.body[-1], ast.Return):
        last = tree.body[-1] if tree.body else tree
        raise forward.error(
            last, "a forward must end with `return VALUE` (or `return a, b` for several outputs)"
        )
    return forward


class _Whitelist(ast.NodeVisitor):
    """Rejects any node type outside the language, with the alternative to use."""

    def __init__(self, forward: Forward):
        self.forward = forward
        self._placed: list[ast.AST] = []  # the nodes being visited that have a source position

    def visit(self, node: ast.AST) -> None:
        placed = hasattr(node, "lineno")
        if placed:
            self._placed.append(node)
        try:
            super().visit(node)
        finally:
            if placed:
                self._placed.pop()

    def fail(self, node: ast.AST, message: str) -> RecipeError:
        # operators (`in`, `is`...) have no position of their own: report the expression that holds them
        where = node if hasattr(node, "lineno") or not self._placed else self._placed[-1]
        return self.forward.error(where, message)

    def generic_visit(self, node: ast.AST) -> None:
        allowed = (
            ast.Module,
            ast.Assign,
            ast.AugAssign,
            ast.For,
            ast.If,
            ast.Return,
            ast.Pass,
            ast.Name,
            ast.Constant,
            ast.BinOp,
            ast.UnaryOp,
            ast.BoolOp,
            ast.Compare,
            ast.IfExp,
            ast.Call,
            ast.keyword,
            ast.Attribute,
            ast.Subscript,
            ast.Tuple,
            ast.List,
            ast.Load,
            ast.Store,
            ast.And,
            ast.Or,
            ast.Eq,
            ast.NotEq,
            ast.Lt,
            ast.LtE,
            ast.Gt,
            ast.GtE,
            ast.Is,
            ast.IsNot,
            *BIN_OPS,
            *UNARY_OPS,
        )
        if type(node) in _FORBIDDEN:
            raise self.fail(node, _FORBIDDEN[type(node)])
        if not isinstance(node, allowed):
            what = type(node).__name__
            if isinstance(node, ast.stmt):
                raise self.fail(
                    node,
                    f"'{what}' statements are not part of the forward language; use {_ALLOWED_STATEMENTS}",
                )
            if isinstance(node, (ast.In, ast.NotIn)):
                raise self.fail(node, "'in' is not allowed; compare with == or use a parameter")
            raise self.fail(
                node,
                f"'{what}' is not part of the forward language; use names, numbers, "
                f"arithmetic (+ - * / // % **), comparisons, tuples, calls and self.NAME",
            )
        super().generic_visit(node)

    def visit_Expr(self, node: ast.Expr) -> None:
        raise self.fail(
            node,
            "an expression on its own does nothing (ops have no side effects); assign it: "
            "`y = ...`, or return it",
        )

    def visit_Constant(self, node: ast.Constant) -> None:
        if not isinstance(node.value, (int, float, bool, str, type(None))):
            raise self.fail(
                node, f"literal {shorten(repr(node.value))} is not allowed; use numbers, strings, True/False/None"
            )
        try:
            check_value(node.value)
        except LimitError as exc:
            raise self.fail(node, f"literal {shorten(repr(node.value))}: {exc}") from None

    def visit_Name(self, node: ast.Name) -> None:
        if node.id.startswith("__"):
            raise self.fail(node, f"'{node.id}': names starting with '__' are not allowed")

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if node.attr.startswith("_"):
            raise self.fail(
                node,
                f"'.{node.attr}': attributes starting with '_' are not allowed; self.NAME "
                f"names a weight or submodule",
            )
        root = node.value
        while isinstance(root, (ast.Attribute, ast.Subscript)):
            root = root.value
        if not (isinstance(root, ast.Name) and root.id == SELF):
            raise self.fail(
                node,
                f"attribute access '.{node.attr}' is only allowed on self (weights and "
                f"submodules: self.q_proj.weight, self.mlp(x), self.layers[i](x)); for a "
                f"tensor's size use shape(x)[axis]",
            )
        self.generic_visit(node)

    def visit_For(self, node: ast.For) -> None:
        if not isinstance(node.target, ast.Name):
            raise self.fail(node.target, "a loop variable must be one name: `for i in range(n):`")
        iterable = node.iter
        if not (
            isinstance(iterable, ast.Call)
            and isinstance(iterable.func, ast.Name)
            and iterable.func.id == "range"
            and not iterable.keywords
            and 1 <= len(iterable.args) <= 3
        ):
            raise self.fail(
                iterable,
                "loops run over a count: `for i in range(n):` (index repeated submodules "
                "with self.layers[i])",
            )
        if node.orelse:
            raise self.fail(node.orelse[0], "for ... else is not allowed")
        self.generic_visit(node)

    def visit_Assign(self, node: ast.Assign) -> None:
        if len(node.targets) != 1:
            raise self.fail(node, "chained assignment a = b = ... is not allowed; assign one target")
        self._check_target(node.targets[0])
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        if not isinstance(node.target, ast.Name):
            raise self.fail(node.target, "augmented assignment needs a plain name: `h += x`")
        self.generic_visit(node)

    def _check_target(self, target: ast.expr) -> None:
        if isinstance(target, ast.Name):
            return
        if isinstance(target, (ast.Tuple, ast.List)):
            for element in target.elts:
                if not isinstance(element, ast.Name):
                    raise self.fail(element, "tuple unpacking assigns names only: `q, k = split(...)`")
            return
        raise self.fail(
            target,
            "only names can be assigned (`y = ...` or `a, b = ...`); weights and "
            "submodules cannot be reassigned",
        )

    def visit_Subscript(self, node: ast.Subscript) -> None:
        if isinstance(node.slice, ast.Tuple):
            raise self.fail(
                node.slice,
                "multi-axis indexing is not allowed; subscripts take one integer "
                "(tuples, lists and repeated submodules)",
            )
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if not isinstance(func, (ast.Name, ast.Attribute, ast.Subscript)):
            raise self.fail(
                func,
                "only op names and submodules can be called: linear(x, w), self.mlp(x), self.layers[i](x)",
            )
        for kw in node.keywords:
            if kw.arg is None:
                raise self.fail(kw.value, "'**' unpacking is not allowed; pass keyword arguments one by one")
        self.generic_visit(node)


# ---- name and member checks --------------------------------------------------------------------------------
class _Member:
    """What self.a.b... refers to while checking: a module instance, a weight namespace or a weight."""

    def __init__(
        self,
        kind: str,
        module: ModuleSpec | None = None,
        prefix: str = "",
        repeated: bool = False,
        module_name: str = "",
    ):
        self.kind = kind  # "module" | "namespace" | "weight" | "repeated"
        self.module = module
        self.prefix = prefix
        self.repeated = repeated
        self.module_name = module_name


def check_forward(forward: Forward, scope: ForwardScope) -> None:
    """Check names, calls and self.member chains of a parsed forward (no graph is built)."""
    _NameCheck(forward, scope).run()


class _NameCheck:
    def __init__(self, forward: Forward, scope: ForwardScope):
        self.forward = forward
        self.scope = scope
        self.callables = set(scope.ops) | BUILTINS

    def fail(self, node: ast.AST, message: str) -> RecipeError:
        return self.forward.error(node, message)

    def run(self) -> None:
        defined = set(self.scope.inputs) | set(self.scope.options) | LANGUAGE_NAMES
        self.block(self.forward.body, defined)

    # statements return the names defined after them, or None when the block always returns
    def block(self, body: Iterable[ast.stmt], defined: set[str]) -> set[str] | None:
        current: set[str] | None = set(defined)
        for stmt in body:
            if current is None:
                raise self.fail(stmt, "unreachable statement after return; remove it")
            current = self.statement(stmt, current)
        return current

    def statement(self, stmt: ast.stmt, defined: set[str]) -> set[str] | None:
        if isinstance(stmt, ast.Assign):
            self.expr(stmt.value, defined)
            return defined | self.targets(stmt.targets[0])
        if isinstance(stmt, ast.AugAssign):
            self.expr(
                ast.Name(id=stmt.target.id, ctx=ast.Load(), lineno=stmt.lineno, col_offset=stmt.col_offset),
                defined,
            )
            self.expr(stmt.value, defined)
            return defined
        if isinstance(stmt, ast.For):
            for arg in stmt.iter.args:
                self.expr(arg, defined)
            loop_var = self.targets(stmt.target)
            after = self.block(stmt.body, defined | loop_var)
            return defined | loop_var | (after or set())
        if isinstance(stmt, ast.If):
            self.expr(stmt.test, defined)
            then = self.block(stmt.body, defined)
            other = self.block(stmt.orelse, defined)
            if then is None and other is None:
                return None
            if then is None or other is None:
                return other if then is None else then
            return then & other
        if isinstance(stmt, ast.Return):
            if stmt.value is None:
                raise self.fail(stmt, "return needs a value: `return y` or `return a, b`")
            self.expr(stmt.value, defined)
            return None
        return defined  # pass

    def targets(self, target: ast.expr) -> set[str]:
        names = [target] if isinstance(target, ast.Name) else list(target.elts)
        out = set()
        for name in names:
            if name.id == SELF:
                raise self.fail(name, "'self' cannot be assigned")
            out.add(name.id)
        return out

    # expressions
    def expr(self, node: ast.expr, defined: set[str]) -> None:
        if isinstance(node, ast.Name):
            self.name(node, defined)
        elif isinstance(node, ast.Call):
            self.call(node, defined)
        elif isinstance(node, (ast.Attribute, ast.Subscript)) and _rooted_at_self(node):
            member = self.member(node, defined)
            if member.kind in ("module", "repeated"):
                raise self.fail(
                    node, f"'{ast.unparse(node)}' is a submodule; call it: {ast.unparse(node)}(...)"
                )
            if member.kind == "namespace":
                names = sorted(w for w in member.module.weights if w.startswith(member.prefix))
                raise self.fail(
                    node,
                    f"'{ast.unparse(node)}' is a group of weights ({', '.join(names)}); "
                    f"use one of them, e.g. self.{names[0]}",
                )
        else:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.expr):
                    self.expr(child, defined)

    def name(self, node: ast.Name, defined: set[str]) -> None:
        if node.id == SELF:
            raise self.fail(node, "'self' on its own is not a value; use self.WEIGHT or self.SUBMODULE(...)")
        if node.id in defined or node.id in self.scope.params:
            return
        if node.id in self.callables:
            raise self.fail(node, f"'{node.id}' is a function; call it: {node.id}(...)")
        known = sorted(defined | set(self.scope.params))
        raise self.fail(
            node,
            f"undefined name '{node.id}'{did_you_mean(node.id, known)}; names available here: "
            f"{one_of(known, 30)}. Assign it before use, or declare it as a parameter, an "
            f"input or an option of the module.",
        )

    def call(self, node: ast.Call, defined: set[str]) -> None:
        for arg in node.args:
            self.expr(arg, defined)
        for kw in node.keywords:
            self.expr(kw.value, defined)
        func = node.func
        if isinstance(func, ast.Name):
            if func.id == "range":
                raise self.fail(func, "range(...) is only allowed as a loop: `for i in range(n):`")
            if func.id not in self.callables:
                raise self.fail(
                    func,
                    f"unknown op '{func.id}'{did_you_mean(func.id, self.callables)}; "
                    f"ops include {one_of(self.scope.ops, 20)} (all listed in recipes/README.md); "
                    f"submodules are called as self.NAME(...)",
                )
            return
        if not _rooted_at_self(func):
            raise self.fail(func, "only op names and submodules can be called: linear(x, w), self.mlp(x)")
        member = self.member(func, defined)
        if member.kind == "repeated":
            raise self.fail(
                func, f"'{ast.unparse(func)}' is repeated; call one instance: {ast.unparse(func)}[i](...)"
            )
        if member.kind != "module":
            raise self.fail(
                func,
                f"'{ast.unparse(func)}' is a weight, not a module; pass it to an op, "
                f"e.g. linear(x, {ast.unparse(func)})",
            )
        child = member.module
        if len(node.args) != len(child.inputs):
            raise self.fail(
                node,
                f"module '{member.module_name}' takes {len(child.inputs)} positional "
                f"input(s) ({', '.join(child.inputs) or 'none'}), got {len(node.args)}",
            )
        for kw in node.keywords:
            if kw.arg not in child.options:
                raise self.fail(
                    kw,
                    f"module '{member.module_name}' has no option '{kw.arg}'"
                    f"{did_you_mean(kw.arg, child.options)}; its options are: "
                    f"{one_of(child.options)} (declare it under `options:`)",
                )

    def member(self, node: ast.expr, defined: set[str]) -> _Member:
        """Resolve a chain such as self.q_proj.weight or self.layers[i].mlp."""
        if isinstance(node, ast.Name):
            return _Member("module", self.scope.module, module_name="self")
        if isinstance(node, ast.Subscript):
            self.expr(node.slice, defined)
            base = self.member(node.value, defined)
            if base.kind == "namespace":  # a numeric part of a dotted weight name: self.net[0].weight
                if not (isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, int)):
                    raise self.fail(
                        node.slice,
                        "a numeric part of a weight name is written as a constant: self.net[0].weight",
                    )
                return self._weight_member(base, str(node.slice.value), node)
            if base.kind != "repeated":
                raise self.fail(
                    node,
                    f"'{ast.unparse(node.value)}' is not a repeated submodule; only "
                    f"submodules with `repeat:` are indexed",
                )
            return _Member("module", base.module, module_name=base.module_name)
        assert isinstance(node, ast.Attribute)
        base = self.member(node.value, defined)
        if base.kind == "repeated":
            raise self.fail(
                node,
                f"'{ast.unparse(node.value)}' is repeated; index it first: "
                f"{ast.unparse(node.value)}[i].{node.attr}",
            )
        if base.kind == "weight":
            raise self.fail(node, f"'{ast.unparse(node.value)}' is a weight; it has no member '{node.attr}'")
        module = base.module
        assert module is not None
        if base.kind == "module" and node.attr in module.submodules:
            sub = module.submodules[node.attr]
            child = self.scope.modules.get(sub.module)
            if child is None:  # reported by the recipe check with the submodule's own position
                raise self.fail(node, f"submodule '{node.attr}' uses unknown module '{sub.module}'")
            kind = "module" if sub.repeat is None else "repeated"
            return _Member(kind, child, module_name=sub.module)
        return self._weight_member(base, node.attr, node)

    def _weight_member(self, base: _Member, attr: str, node: ast.expr) -> _Member:
        module = base.module
        assert module is not None
        prefix = f"{base.prefix}{attr}"
        if prefix in module.weights or (not base.prefix and prefix in module.states):
            return _Member("weight", module, prefix=prefix)
        if any(w.startswith(prefix + ".") for w in module.weights):
            return _Member("namespace", module, prefix=prefix + ".")
        members = set(module.submodules) | (set() if base.prefix else set(module.states)) | {
            w[len(base.prefix) :].split(".")[0] for w in module.weights if w.startswith(base.prefix)
        }
        owner = "self" if base.module is self.scope.module and not base.prefix else ast.unparse(node.value)
        raise self.fail(
            node,
            f"'{owner}' has no weight or submodule '{attr}'"
            f"{did_you_mean(attr, members)}; it has: {one_of(members)}. Declare "
            f"weights under `weights:` and child modules under `submodules:`.",
        )


def _rooted_at_self(node: ast.expr) -> bool:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return isinstance(node, ast.Name) and node.id == SELF
