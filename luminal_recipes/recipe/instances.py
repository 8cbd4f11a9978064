"""The module instance tree: every module of a recipe instantiated with its parameters, weights and children.

Instantiation evaluates the expression fields (module ``params``, ``with``, ``when``, ``repeat``, weight
shapes) and names every weight by its checkpoint path (``model.layers.3.self_attn.q_proj.weight``). Forwards
are parsed once per module and shared by all instances, so repeated layers run the same statements.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import RecipeError
from .expr import Forward, parse_forward
from .loader import LoadedRecipe
from .located import Origin
from .safe_eval import FUNCTIONS, ExprError, evaluate, names_in, parse, unwrap
from .schema import ModuleSpec
from .suggest import did_you_mean, one_of


def eval_field(value: Any, origin: Origin, names: Mapping[str, Any], what: str) -> Any:
    """Evaluate an expression field (``hidden // heads``) against ``names``; literals pass through."""
    if not isinstance(value, str):
        return value

    def resolve(name: str, node: Any) -> Any:
        if name in names:
            return names[name]
        raise ExprError(
            f"undefined name '{name}'{did_you_mean(name, names)}; names available here: {one_of(names, 30)}",
            node.lineno,
            node.col_offset,
        )

    try:
        return evaluate(parse(unwrap(value)), resolve)
    except ExprError as exc:
        raise origin.expr_error(exc, what) from None


def check_field_names(value: Any, origin: Origin, known: set[str], what: str) -> None:
    """Static check of an expression field: it parses and uses only ``known`` names (no values needed)."""
    if not isinstance(value, str):
        return
    try:
        tree = parse(unwrap(value))
    except ExprError as exc:
        raise origin.expr_error(exc, what) from None
    for ref in names_in(tree):
        if ref.id not in known and ref.id not in FUNCTIONS:
            raise origin.expr_error(
                ExprError(
                    f"undefined name '{ref.id}'{did_you_mean(ref.id, known)}; names "
                    f"available here: {one_of(known, 30)}",
                    ref.lineno,
                    ref.col_offset,
                ),
                what,
            )


def list_item_origin(origin: Origin, field_name: str, index: int) -> Origin:
    """Origin of item ``index`` of a list written short (``w: [a, b]``) or long (``w: {shape: [a, b]}``)."""
    long_form = origin.at(field_name, index)
    return long_form if origin.source.has(long_form.path) else origin.at(index)


@dataclass
class WeightDecl:
    name: str  # full checkpoint-style name
    local: str  # name inside its module (q_proj.weight)
    shape: tuple[int, ...]
    dtype: str  # a graph dtype name, or "checkpoint"
    origin: Origin  # the weight's declaration
    shape_origins: tuple[Origin, ...]


@dataclass
class StateDecl:
    name: str  # full name, by the instance path (model.layers.3.self_attn.k_cache)
    local: str
    shape: tuple  # ints and symbolic dims
    dtype: str  # a graph dtype name, or "compute"
    origin: Origin


@dataclass
class Instance:
    module_name: str
    spec: ModuleSpec
    origin: Origin
    path: str  # checkpoint prefix; "" for the root
    scope: dict[str, Any]  # parameter values visible in this instance
    forward: Forward
    weights: dict[str, WeightDecl] = field(default_factory=dict)
    states: dict[str, StateDecl] = field(default_factory=dict)
    children: dict[str, Instance | list[Instance] | None] = field(default_factory=dict)
    repeated: bool = False  # one of a `repeat:` list: its calls are marked as graph blocks (searched once)

    @property
    def label(self) -> str:
        return f"{self.path or '<root>'} ({self.module_name})"

    def walk(self):
        yield self
        for child in self.children.values():
            for item in child if isinstance(child, list) else ([child] if child else []):
                yield from item.walk()


def join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name


MAX_INSTANCES = 100_000  # module instances in one model (FLUX.2-dev has about a thousand)


class Instantiator:
    def __init__(self, recipe: LoadedRecipe, params: Mapping[str, Any], dims: Mapping[str, Any] | None = None):
        self.recipe = recipe
        # the recipe's symbolic dims are visible everywhere by name (state shapes, forwards), params win
        self.params = {**(dims or {}), **params}
        self.forwards: dict[str, Forward] = {}
        self.count = 0  # instances made so far

    def forward(self, module_name: str) -> Forward:
        if module_name not in self.forwards:
            located = self.recipe.modules[module_name]
            self.forwards[module_name] = parse_forward(located.value.forward, located.origin.at("forward"))
        return self.forwards[module_name]

    def root(self) -> Instance:
        return self.instantiate(self.recipe.root, "", {}, self.recipe.origin("root"))

    def instantiate(
        self, module_name: str, path: str, given: dict[str, tuple[Any, Origin]], ref: Origin
    ) -> Instance:
        located = self.recipe.modules[module_name]
        spec, origin = located.value, located.origin
        self.count += 1
        if self.count > MAX_INSTANCES:
            raise ref.error(f"the model has more than {MAX_INSTANCES} module instances; check the `repeat:` counts.")
        scope = dict(self.params)
        for name, (_, where) in given.items():
            if name not in spec.params:
                raise where.error(
                    f"module '{module_name}' has no parameter '{name}'"
                    f"{did_you_mean(name, spec.params)}; its parameters are: {one_of(spec.params)} "
                    f"(declare it under the module's `params:`).",
                    key=True,
                )
        for name, default in spec.params.items():
            if name in given:
                scope[name] = given[name][0]
            elif default is None:
                raise ref.error(
                    f"module '{module_name}' needs parameter '{name}' (it has no default); give it "
                    f"with `with: {{{name}: ...}}` where the module is used."
                )
            else:
                scope[name] = eval_field(
                    default, origin.at("params", name), scope, f"parameter '{name}' of module '{module_name}'"
                )
        instance = Instance(module_name, spec, origin, path, scope, self.forward(module_name))
        for local, wspec in spec.weights.items():
            w_origin = origin.at("weights", local)
            if wspec.when is not None and not self._flag(wspec.when, w_origin.value_origin("when"), scope):
                continue
            dims, dim_origins = [], []
            for index, expr in enumerate(wspec.shape):
                d_origin = list_item_origin(w_origin, "shape", index)
                value = eval_field(expr, d_origin, scope, f"shape of weight '{local}'")
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise d_origin.error(
                        f"shape of weight '{local}': dimension {index} is {value!r}; weight "
                        f"dimensions must be non-negative integers (use // for division)."
                    )
                dims.append(value)
                dim_origins.append(d_origin)
            name = join(path, local)
            instance.weights[local] = WeightDecl(
                name, local, tuple(dims), wspec.dtype, w_origin, tuple(dim_origins)
            )
        for local, sspec in spec.states.items():
            st_origin = origin.at("states", local)
            shape = []
            for index, expr in enumerate(sspec.shape):
                d_origin = list_item_origin(st_origin, "shape", index)
                value = eval_field(expr, d_origin, scope, f"shape of state '{local}'")
                if isinstance(value, bool) or not (isinstance(value, int) and value >= 0 or _is_dim(value)):
                    raise d_origin.error(
                        f"shape of state '{local}': dimension {index} is {value!r}; use non-negative integers, "
                        f"parameters or `dims`."
                    )
                shape.append(value)
            instance.states[local] = StateDecl(join(path, local), local, tuple(shape), sspec.dtype, st_origin)
        for sub_name, sub in spec.submodules.items():
            s_origin = origin.at("submodules", sub_name)
            if sub.when is not None and not self._flag(sub.when, s_origin.value_origin("when"), scope):
                instance.children[sub_name] = None
                continue
            child_path = join(path, sub.path if sub.path is not None else sub_name)
            if sub.repeat is None:
                given_child = self._with(sub.with_, s_origin, scope)
                instance.children[sub_name] = self.instantiate(sub.module, child_path, given_child, s_origin)
                continue
            count = eval_field(sub.repeat, s_origin.at("repeat"), scope, f"repeat of '{sub_name}'")
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                raise s_origin.at("repeat").error(
                    f"repeat of '{sub_name}' is {count!r}; it must be a non-negative integer."
                )
            if self.count + count > MAX_INSTANCES:
                raise s_origin.at("repeat").error(
                    f"repeat of '{sub_name}' is {count}: the model would have more than {MAX_INSTANCES} module "
                    f"instances; check the value (a layer count from config.json?)."
                )
            layers = []
            for index in range(count):
                given_child = self._with(sub.with_, s_origin, {**scope, "index": index})
                layer = self.instantiate(sub.module, join(child_path, str(index)), given_child, s_origin)
                layer.repeated = True
                layers.append(layer)
            instance.children[sub_name] = layers
        return instance

    def _with(
        self, values: dict[str, Any], origin: Origin, scope: dict[str, Any]
    ) -> dict[str, tuple[Any, Origin]]:
        out = {}
        for name, expr in values.items():
            where = origin.at("with", name)
            out[name] = (eval_field(expr, where, scope, f"with: {name}"), where)
        return out

    @staticmethod
    def _flag(expr: Any, origin: Origin, scope: Mapping[str, Any]) -> bool:
        value = eval_field(expr, origin, scope, "when")
        if not isinstance(value, (bool, int)) and value is not None:
            raise origin.error(f"`when` must be true or false, got {value!r}")
        return bool(value)


def _is_dim(value: Any) -> bool:
    from ..graph.symbolic import Expr

    return isinstance(value, Expr)


def instance_error(instance: Instance, message: str) -> RecipeError:
    return instance.origin.error(f"in {instance.label}: {message}", key=True)
