"""Runs a checked ``forward`` on graph tensors: each statement adds nodes to the model's Graph.

Values are graph ``Tensor`` handles, plain numbers and strings, symbolic dims, tuples and lists. Conditions
and loop counts must be plain values (parameters), never tensors, so control flow is fixed at build time and
every instance of a repeated module adds the same nodes in the same order. Errors raised by ops are reported
at the call's position in the YAML file, naming the module instance.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import LuminalError, RecipeError
from ..graph import Graph, Tensor, cast, to_dtype
from .expr import SELF, Forward
from .instances import Instance
from .safe_eval import COMPARE_OPS, arithmetic, check_value, checked_int, checked_pow, out_of_range, shorten

# Functions of the language that compute plain numbers when no argument is a tensor (max(a, b), log(theta)).
NUMERIC: dict[str, Callable] = {
    "min": min,
    "max": max,
    "abs": abs,
    "exp": math.exp,
    "log": math.log,
    "log2": math.log2,
    "sqrt": math.sqrt,
    "sin": math.sin,
    "cos": math.cos,
    "tanh": math.tanh,
    "pow": checked_pow,
}
# Loop bounds: a forward builds a graph, so its loops run over layers and heads, never billions of times.
MAX_LOOP_ITERATIONS = 100_000  # one `for` loop
MAX_TOTAL_ITERATIONS = 1_000_000  # all loops of one model build together


def movement_functions(graph: Graph) -> dict[str, Callable]:
    """Views and sources as functions (the op library holds computation; these only reshape or create)."""
    return {
        "reshape": lambda x, shape: x.reshape(tuple(shape)),
        "permute": lambda x, axes: x.permute(tuple(axes)),
        "transpose": lambda x, a=-2, b=-1: x.transpose(a, b),
        "narrow": lambda x, axis, start, stop: x.slice(axis, start, stop),
        "unsqueeze": lambda x, axis: x.unsqueeze(axis),
        "squeeze": lambda x, axis: x.squeeze(axis),
        "expand": lambda x, axis, size: x.expand(axis, size),
        "broadcast_to": lambda x, shape: x.broadcast_to(tuple(shape)),
        "pad": lambda x, axis, before, after: x.pad(axis, before, after),
        "merge_dims": lambda x, a, b: x.merge_dims(a, b),
        "split_dim": lambda x, axis, sizes: x.split_dim(axis, tuple(sizes)),
        "contiguous": lambda x: x.contiguous(),
        "astype": lambda x, dtype: x if x.dtype == to_dtype(dtype) else cast(x, dtype),
        "iota": lambda n: graph.iota(n),
        "full": lambda shape, value, dtype="f32": graph.constant(value, dtype).broadcast_to(tuple(shape)),
        "shape": lambda x: tuple(x.shape),
        "len": len,
        "int": checked_int,
        "float": float,
    }


class _Return(Exception):
    def __init__(self, value: Any):
        self.value = value


@dataclass
class CallRecord:
    """Nodes one module instance added (for repeated-block checks and inspect)."""

    path: str
    module: str
    start: int
    end: int


class Interpreter:
    def __init__(
        self,
        graph: Graph,
        ops: Mapping[str, Callable],
        weight: Callable[[Instance, str], Tensor],
        compute_dtype: str = "f32",
        per_op: Mapping[str, str] | None = None,
        state: Callable[[Instance, str], Tensor] | None = None,
    ):
        self.graph = graph
        self.state = state  # (instance, local state name) -> graph state tensor
        self.compute_dtype = compute_dtype
        self.per_op = dict(per_op or {})
        self.functions = {**movement_functions(graph), **ops}
        self.weight = weight  # (instance, local weight name) -> graph tensor
        self.calls: list[CallRecord] = []
        self._stack: list[Instance] = []
        self._iterations = 0  # loop iterations run so far (MAX_TOTAL_ITERATIONS)

    # ---- module calls --------------------------------------------------------------------------------------
    def call(
        self,
        instance: Instance,
        args: list[Any],
        kwargs: dict[str, Any],
        site: ast.AST | None = None,
        caller: Forward | None = None,
    ) -> Any:
        spec = instance.spec
        if len(args) != len(spec.inputs):
            message = (
                f"module '{instance.module_name}' takes {len(spec.inputs)} input(s) "
                f"({', '.join(spec.inputs) or 'none'}), got {len(args)}"
            )
            raise caller.error(site, message) if caller and site else RecipeError(message)
        env: dict[str, Any] = {"compute_dtype": self.compute_dtype, **instance.scope}
        env.update(spec.options)
        for name, value in kwargs.items():
            if name not in spec.options:
                message = f"module '{instance.module_name}' has no option '{name}'"
                raise caller.error(site, message) if caller and site else RecipeError(message)
            env[name] = value
        env.update(zip(spec.inputs, args))
        start = len(self.graph.nodes)
        self._stack.append(instance)
        # a repeated layer's nodes form one Graph block: identical blocks share one compiler search
        scope = self.graph.block(instance.path) if instance.repeated else contextlib.nullcontext()
        try:
            with scope:
                self._block(instance.forward.body, env, instance)
        except _Return as ret:
            return ret.value
        finally:
            self._stack.pop()
            self.calls.append(CallRecord(instance.path, instance.module_name, start, len(self.graph.nodes)))
        raise instance.forward.error(instance.forward.body[-1], "forward ended without return")

    # ---- statements ----------------------------------------------------------------------------------------
    def _block(self, body: list[ast.stmt], env: dict[str, Any], inst: Instance) -> None:
        for stmt in body:
            self._statement(stmt, env, inst)

    def _statement(self, stmt: ast.stmt, env: dict[str, Any], inst: Instance) -> None:
        fwd = inst.forward
        if isinstance(stmt, ast.Assign):
            self._assign(stmt.targets[0], self.eval(stmt.value, env, inst), env, inst)
        elif isinstance(stmt, ast.AugAssign):
            left = env[stmt.target.id]
            env[stmt.target.id] = self._binop(
                stmt, type(stmt.op), left, self.eval(stmt.value, env, inst), inst
            )
        elif isinstance(stmt, ast.For):
            bounds = [self.eval(a, env, inst) for a in stmt.iter.args]
            if not all(isinstance(b, int) and not isinstance(b, bool) for b in bounds):
                raise fwd.error(
                    stmt.iter,
                    f"range(...) needs integers known when the graph is built, got "
                    f"{', '.join(repr(b) for b in bounds)}",
                )
            try:
                loop = range(*bounds)
                count = len(loop)
            except (ValueError, OverflowError) as exc:  # range(1, 2, 0); a length beyond sys.maxsize
                raise fwd.error(stmt.iter, f"range{tuple(bounds)}: {exc}") from None
            self._iterations += count
            if count > MAX_LOOP_ITERATIONS or self._iterations > MAX_TOTAL_ITERATIONS:
                raise fwd.error(
                    stmt.iter,
                    f"this loop runs {count} times; a forward's loops run at most {MAX_LOOP_ITERATIONS} times "
                    f"each and {MAX_TOTAL_ITERATIONS} times in all (they build the graph, one step per layer)",
                )
            for i in loop:
                env[stmt.target.id] = i
                self._block(stmt.body, env, inst)
        elif isinstance(stmt, ast.If):
            test = self.eval(stmt.test, env, inst)
            if isinstance(test, Tensor):
                raise fwd.error(
                    stmt.test,
                    "an `if` condition must be a parameter value, not a tensor; for "
                    "elementwise choice use where(cond, a, b)",
                )
            self._block(stmt.body if test else stmt.orelse, env, inst)
        elif isinstance(stmt, ast.Return):
            raise _Return(self.eval(stmt.value, env, inst))

    def _assign(self, target: ast.expr, value: Any, env: dict[str, Any], inst: Instance) -> None:
        if isinstance(target, ast.Name):
            env[target.id] = value
            return
        names = [t.id for t in target.elts]
        if not isinstance(value, (tuple, list)) or len(value) != len(names):
            got = f"{len(value)} values" if isinstance(value, (tuple, list)) else f"one {_kind(value)}"
            raise inst.forward.error(
                target, f"cannot unpack {got} into {len(names)} names ({', '.join(names)})"
            )
        for name, item in zip(names, value):
            env[name] = item

    # ---- expressions ---------------------------------------------------------------------------------------
    def eval(self, node: ast.expr, env: dict[str, Any], inst: Instance) -> Any:
        fwd = inst.forward
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name):
            if node.id in env:
                return env[node.id]
            raise fwd.error(
                node, f"name '{node.id}' has no value here (assigned only in a branch not taken?)"
            )
        if isinstance(node, ast.Tuple):
            return tuple(self.eval(e, env, inst) for e in node.elts)
        if isinstance(node, ast.List):
            return [self.eval(e, env, inst) for e in node.elts]
        if isinstance(node, ast.BinOp):
            return self._binop(
                node, type(node.op), self.eval(node.left, env, inst), self.eval(node.right, env, inst), inst
            )
        if isinstance(node, ast.UnaryOp):
            value = self.eval(node.operand, env, inst)
            if isinstance(node.op, ast.Not):
                if isinstance(value, Tensor):
                    raise fwd.error(node, "`not` applies to parameters; for tensors use logical_not(x)")
                return not value
            return -value if isinstance(node.op, ast.USub) else value
        if isinstance(node, ast.BoolOp):
            value = self._plain(node.values[0], env, inst)
            for item in node.values[1:]:
                if (isinstance(node.op, ast.And) and not value) or (isinstance(node.op, ast.Or) and value):
                    return value
                value = self._plain(item, env, inst)
            return value
        if isinstance(node, ast.Compare):
            left = self._plain(node.left, env, inst)
            for op, right_node in zip(node.ops, node.comparators):
                right = self._plain(right_node, env, inst)
                if not COMPARE_OPS[type(op)](left, right):
                    return False
                left = right
            return True
        if isinstance(node, ast.IfExp):
            test = self._plain(node.test, env, inst)
            return self.eval(node.body if test else node.orelse, env, inst)
        if isinstance(node, ast.Call):
            return self._call(node, env, inst)
        if isinstance(node, (ast.Attribute, ast.Subscript)):
            if _rooted_at_self(node):
                return self._member(node, env, inst)
            base = self.eval(node.value, env, inst)
            index = self.eval(node.slice, env, inst)
            if not isinstance(base, (tuple, list)):
                raise fwd.error(
                    node,
                    f"only tuples and lists can be indexed, not a {_kind(base)}; use narrow() for tensors",
                )
            if isinstance(index, bool) or not isinstance(index, int) or not -len(base) <= index < len(base):
                raise fwd.error(node.slice, f"index {index!r} is not valid for {len(base)} items")
            return base[index]
        raise fwd.error(node, f"'{type(node).__name__}' cannot be evaluated")

    def _plain(self, node: ast.expr, env: dict[str, Any], inst: Instance) -> Any:
        value = self.eval(node, env, inst)
        if isinstance(value, Tensor):
            raise inst.forward.error(
                node,
                "comparisons and and/or/not work on parameters, not tensors; for "
                "tensors use less/greater/equal and logical_and/logical_or",
            )
        return value

    def _binop(self, node: ast.AST, op: type, left: Any, right: Any, inst: Instance) -> Any:
        try:
            return arithmetic(op, left, right)
        except LuminalError as exc:
            raise inst.forward.error(node, f"in {inst.label}: {exc}") from None
        except (TypeError, ZeroDivisionError, ValueError, OverflowError) as exc:
            symbol = {
                ast.Add: "+",
                ast.Sub: "-",
                ast.Mult: "*",
                ast.Div: "/",
                ast.FloorDiv: "//",
                ast.Mod: "%",
                ast.Pow: "**",
            }[op]
            hint = "; for tensors use pow(x, p)" if op is ast.Pow and not isinstance(exc, ValueError) else ""
            why = out_of_range(exc) if isinstance(exc, OverflowError) else shorten(str(exc), 200)
            raise inst.forward.error(
                node, f"cannot compute {_kind(left)} {symbol} {_kind(right)} ({why}){hint}"
            ) from None

    def _call(self, node: ast.Call, env: dict[str, Any], inst: Instance) -> Any:
        fwd = inst.forward
        args = [self.eval(a, env, inst) for a in node.args]
        kwargs = {kw.arg: self.eval(kw.value, env, inst) for kw in node.keywords}
        if isinstance(node.func, ast.Name):
            name = node.func.id
            if name in NUMERIC and not any(isinstance(a, Tensor) for a in [*args, *kwargs.values()]):
                fn = NUMERIC[name]
            elif name in self.functions:
                fn = self.functions[name]
            else:
                raise fwd.error(node.func, f"unknown op '{name}'")
            return self._apply(name, fn, args, kwargs, node, inst)
        target = self._member(node.func, env, inst)
        if not isinstance(target, Instance):
            raise fwd.error(node.func, f"'{ast.unparse(node.func)}' is not a module and cannot be called")
        return self.call(target, args, kwargs, node, fwd)

    def _apply(
        self, name: str, fn: Callable, args: list, kwargs: dict, node: ast.Call, inst: Instance
    ) -> Any:
        fwd = inst.forward
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError):
            signature = None
        if signature is not None:
            try:
                signature.bind(*args, **kwargs)
            except TypeError as exc:
                raise fwd.error(node, f"{name}{signature}: {exc}") from None
        if name in self.per_op:  # the op computes in its own dtype; the model around it in compute_dtype
            return _cast_floats(
                self._apply_unchecked(name, fn, *_cast_floats((args, kwargs), self.per_op[name]), node, inst),
                self.compute_dtype,
            )
        return self._apply_unchecked(name, fn, args, kwargs, node, inst)

    def _apply_unchecked(
        self, name: str, fn: Callable, args: Any, kwargs: Any, node: ast.Call, inst: Instance
    ) -> Any:
        fwd = inst.forward
        try:
            return check_value(fn(*args, **kwargs))
        except RecipeError:
            raise
        except (LuminalError, ValueError, TypeError, AttributeError, IndexError, OverflowError,
                ZeroDivisionError) as exc:
            shown = ", ".join([_kind(a) for a in args] + [f"{k}={_kind(v)}" for k, v in kwargs.items()])
            why = out_of_range(exc) if isinstance(exc, OverflowError) else shorten(str(exc), 300)
            raise fwd.error(node, f"{name}({shown}) failed in {inst.label}: {why}") from None

    def _member(self, node: ast.expr, env: dict[str, Any], inst: Instance) -> Any:
        """self.a.b / self.layers[i] / self.net[0].weight -> a weight tensor, an instance, a list of
        instances, or a _WeightPath on the way to a weight (numeric parts of names are indexed: net[0])."""
        fwd = inst.forward
        if isinstance(node, ast.Name):
            assert node.id == SELF
            return inst
        base = self._member(node.value, env, inst)
        if isinstance(node, ast.Subscript):
            index = self.eval(node.slice, env, inst)
            if isinstance(index, bool) or not isinstance(index, int):
                raise fwd.error(node.slice, f"index {index!r} must be an integer")
            if isinstance(base, _WeightPath):
                return self._weight_or_path(base.child(str(index)), node, fwd)
            if not isinstance(base, list):
                raise fwd.error(node, f"'{ast.unparse(node.value)}' is not a repeated submodule")
            if not -len(base) <= index < len(base):
                raise fwd.error(
                    node.slice,
                    f"index {index} is out of range for {ast.unparse(node.value)} ({len(base)} instances)",
                )
            return base[index]
        assert isinstance(node, ast.Attribute)
        if isinstance(base, list):
            raise fwd.error(node, f"'{ast.unparse(node.value)}' is repeated: index it first")
        if isinstance(base, Tensor):
            raise fwd.error(node, f"'{ast.unparse(node.value)}' is a weight; it has no member '{node.attr}'")
        if isinstance(base, Instance):
            if node.attr in base.children:
                child = base.children[node.attr]
                if child is None:
                    raise fwd.error(
                        node, f"'{ast.unparse(node)}' is not instantiated here (its `when:` is false)"
                    )
                return child
            return self._weight_or_path(_WeightPath(base, node.attr), node, fwd)
        return self._weight_or_path(base.child(node.attr), node, fwd)

    def _weight_or_path(self, path: _WeightPath, node: ast.expr, fwd: Forward) -> Any:
        owner, local = path.owner, path.local
        if local in owner.weights:
            return self.weight(owner, local)
        if local in owner.states and self.state is not None:
            return self.state(owner, local)
        if any(name.startswith(local + ".") for name in owner.spec.weights):
            return path
        why = (
            "its `when:` is false"
            if local in owner.spec.weights
            else f"module '{owner.module_name}' declares no such weight"
        )
        raise fwd.error(node, f"weight '{ast.unparse(node)}' does not exist in {owner.label}: {why}")


@dataclass(frozen=True)
class _WeightPath:
    """A prefix of dotted weight names (self.q_proj before .weight)."""

    owner: Instance
    local: str

    def child(self, name: str) -> _WeightPath:
        return _WeightPath(self.owner, f"{self.local}.{name}")


def _cast_floats(value: Any, dtype: str) -> Any:
    """``value`` with every floating-point tensor inside (tuples, lists, dicts) cast to ``dtype``."""
    target = to_dtype(dtype)
    if isinstance(value, Tensor):
        return cast(value, target) if value.dtype.is_float and value.dtype != target else value
    if isinstance(value, (tuple, list)):
        return type(value)(_cast_floats(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _cast_floats(v, dtype) for k, v in value.items()}
    return value


def _rooted_at_self(node: ast.expr) -> bool:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return isinstance(node, ast.Name) and node.id == SELF


def _kind(value: Any) -> str:
    if isinstance(value, Tensor):
        dims = ", ".join(str(d) for d in value.shape)
        return f"tensor[{dims}] {value.dtype}"
    if isinstance(value, Instance):
        return f"module {value.module_name}"
    return type(value).__name__ if not isinstance(value, (int, float, str)) else shorten(repr(value), 40)
