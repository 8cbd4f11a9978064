"""Static checks of a loaded recipe: everything that can be verified without config.json or weights.

Names in every expression field, every forward (syntax whitelist, names, ops, self.member chains, submodule
arity), the wiring between the model's inputs and its root module, and a pipeline's stages and value flow.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from .config_fields import check_config_reads
from .expr import ForwardScope, check_forward, parse_forward
from .instances import check_field_names, list_item_origin
from .loader import LoadedRecipe
from .located import Origin
from .safe_eval import (
    CONFIG,
    FUNCTIONS,
    MODEL_INDEX,
    YAML_CONSTANTS,
    ExprError,
    is_wrapped,
    names_in,
    parse,
    unwrap,
)
from .schema import ModelRecipe, ModuleLibrary, PipelineRecipe, StageSpec
from .suggest import did_you_mean, one_of


def default_ops() -> Mapping[str, Callable]:
    """The op library's registry (``luminal_recipes.ops.REGISTRY``)."""
    from ..ops import REGISTRY

    return REGISTRY


def check_recipe(recipe: LoadedRecipe, ops: Mapping[str, Callable] | None = None) -> None:
    """Raise RecipeError at the first problem a static reading of the recipe finds."""
    if isinstance(recipe.doc, PipelineRecipe):
        check_pipeline(recipe)
        return
    ops = default_ops() if ops is None else ops
    doc = recipe.doc
    assert isinstance(doc, ModelRecipe)
    if doc.lora_names:  # each names a model recipe inside this one's folder tree
        from .loader import load_recipe
        from .lora import conventions

        conventions(recipe, load_recipe)
    global_params = set(recipe.params)
    root = recipe.modules[doc.root].value
    for name in root.inputs:
        if name not in doc.inputs:
            origin = recipe.modules[doc.root].origin.at("inputs")
            raise origin.error(
                f"root module '{doc.root}' takes input '{name}' but the recipe's `inputs:` does "
                f"not declare it{did_you_mean(name, doc.inputs)}; declare its shape and dtype "
                f"under `inputs:`."
            )
    for name in doc.inputs:
        if name not in root.inputs:
            raise recipe.origin("inputs", name).error(
                f"input '{name}' is not an input of the root module '{doc.root}' (its inputs: "
                f"{one_of(root.inputs)}); remove it or add it to the root module's `inputs:`.",
                key=True,
            )
        origin = recipe.origin("inputs", name)
        for index, expr in enumerate(doc.inputs[name].shape):
            check_field_names(
                expr,
                list_item_origin(origin, "shape", index),
                global_params | set(doc.dims),
                f"shape of input '{name}'",
            )
    for index, rule in enumerate(doc.weights.split):
        for i, size in enumerate(rule.sizes or []):
            check_field_names(
                size, recipe.origin("weights", "split", index, "sizes", i), global_params, "split size"
            )
    for module_name, located in recipe.modules.items():  # dims are visible by name in modules (symbolic sizes)
        _check_module(recipe, module_name, located.value, located.origin, ops, global_params | set(doc.dims))
    _check_generation(recipe, global_params)
    check_config_reads(recipe)


def _check_generation(recipe: LoadedRecipe, params: set[str]) -> None:
    doc = recipe.doc
    if doc.generation is None:
        return
    check_field_names(doc.generation.context, recipe.origin("generation", "context"), params, "generation.context")


def _check_module(
    recipe: LoadedRecipe,
    module_name: str,
    spec,
    origin: Origin,
    ops: Mapping[str, Callable],
    global_params: set[str],
) -> None:
    scope = global_params.copy()  # a library's open scope stays open (see ``check_library``)
    for name, default in spec.params.items():
        if default is not None:
            check_field_names(
                default, origin.at("params", name), scope, f"parameter '{name}' of module '{module_name}'"
            )
        scope.add(name)
    for local, wspec in spec.weights.items():
        w_origin = origin.at("weights", local)
        for index, expr in enumerate(wspec.shape):
            check_field_names(
                expr, list_item_origin(w_origin, "shape", index), scope, f"shape of weight '{local}'"
            )
        if wspec.when is not None:
            check_field_names(wspec.when, w_origin.at("when"), scope, "when")
    for local, sspec in spec.states.items():
        st_origin = origin.at("states", local)
        for index, expr in enumerate(sspec.shape):
            check_field_names(expr, list_item_origin(st_origin, "shape", index), scope, f"shape of state '{local}'")
    for sub_name, sub in spec.submodules.items():
        s_origin = origin.at("submodules", sub_name)
        child = recipe.modules[sub.module].value
        if sub.when is not None:
            check_field_names(sub.when, s_origin.at("when"), scope, "when")
        if sub.repeat is not None:
            check_field_names(sub.repeat, s_origin.at("repeat"), scope, f"repeat of '{sub_name}'")
        with_scope = scope | ({"index"} if sub.repeat is not None else set())
        for key, expr in sub.with_.items():
            if key not in child.params:
                raise s_origin.at("with", key).error(
                    f"module '{sub.module}' has no parameter '{key}'{did_you_mean(key, child.params)}; its "
                    f"parameters are: {one_of(child.params)}.",
                    key=True,
                )
            check_field_names(expr, s_origin.at("with", key), with_scope, f"with: {key}")
        for key, default in child.params.items():
            if default is None and key not in sub.with_:
                raise s_origin.error(
                    f"module '{sub.module}' needs parameter '{key}' (no default); add "
                    f"`with: {{{key}: ...}}` here.",
                    key=True,
                )
    clash = set(spec.states) & (set(spec.submodules) | {w.split(".")[0] for w in spec.weights})
    if clash:
        name = sorted(clash)[0]
        raise origin.at("states", name).error(
            f"'{name}' is both a state and a weight or submodule of module '{module_name}'; rename one.", key=True
        )
    overlap = set(spec.submodules) & {w.split(".")[0] for w in spec.weights}
    if overlap:
        name = sorted(overlap)[0]
        raise origin.at("submodules", name).error(
            f"'{name}' is both a submodule and a weight prefix of module '{module_name}'; rename one.",
            key=True,
        )
    forward = parse_forward(spec.forward, origin.at("forward"))
    check_forward(
        forward,
        ForwardScope(
            ops=frozenset(ops),
            params=scope,
            inputs=tuple(spec.inputs),
            options=frozenset(spec.options),
            module=spec,
            modules={name: m.value for name, m in recipe.modules.items()},
        ),
    )


# ---- module libraries -------------------------------------------------------------------------------------
class _OpenScope(set):
    """The names a library's modules may read: its own parameters, and any other name, which is recorded in
    ``external`` (a library reads parameters that the recipe including it defines)."""

    def __init__(self, names=(), external: set[str] | None = None):
        super().__init__(names)
        self.external: set[str] = set() if external is None else external

    def __contains__(self, name: object) -> bool:
        if not set.__contains__(self, name):
            self.external.add(str(name))
        return True

    def copy(self) -> _OpenScope:
        return _OpenScope(self, self.external)

    def __or__(self, other) -> _OpenScope:
        return _OpenScope(set(self) | set(other), self.external)


def check_library(recipe: LoadedRecipe, ops: Mapping[str, Callable] | None = None) -> list[str]:
    """Check a `kind: modules` library on its own: every module's weights, submodules and forward (syntax,
    whitelist, ops, self.member chains, arity). Returns the names it reads without defining them, which the
    including recipe must define as parameters."""
    assert isinstance(recipe.doc, ModuleLibrary)
    ops = default_ops() if ops is None else ops
    scope = _OpenScope(recipe.params)
    for name, located in recipe.params.items():
        default = located.value.default
        if is_wrapped(default):  # other strings are text, not expressions
            check_field_names(default, located.origin.value_origin("default"), scope, f"parameter '{name}'")
    for module_name, located in recipe.modules.items():
        _check_module(recipe, module_name, located.value, located.origin, ops, scope)
    check_config_reads(recipe)
    return sorted(scope.external - set(FUNCTIONS) - set(ops) - {CONFIG, *YAML_CONSTANTS})


# ---- pipelines ---------------------------------------------------------------------------------------------
def check_pipeline(recipe: LoadedRecipe) -> None:
    """Stages name known models, and every value a stage reads exists when the stage runs."""
    doc = recipe.doc
    assert isinstance(doc, PipelineRecipe)
    known = set(doc.params) | set(doc.inputs)
    _check_stages(recipe, doc, doc.stages, ("stages",), known)
    for out_name, output in doc.outputs.items():
        origin = recipe.origin("outputs", out_name)
        origin = origin.at("value") if origin.source.has(origin.path + ("value",)) else origin
        _check_reference(origin, output.value, known, f"output '{out_name}'")


def _check_stages(
    recipe: LoadedRecipe, doc: PipelineRecipe, stages: list[StageSpec], path: tuple, known: set[str]
) -> None:
    for index, stage in enumerate(stages):
        origin = recipe.origin(*path, index)
        if stage.model is not None and stage.model not in doc.models:
            raise origin.at("model").error(
                f"stage '{stage.name}' runs unknown model '{stage.model}'"
                f"{did_you_mean(stage.model, doc.models)}; models: "
                f"{one_of(doc.models)}."
            )
        if stage.when is not None:  # decided before the run: parameters and configs only
            _check_reference(origin.at("when"), stage.when, set(doc.params), f"stage '{stage.name}' when",
                             before_run=True)
        for arg, value in stage.inputs.items():
            _check_reference(origin.at("inputs", arg), value, known, f"stage '{stage.name}' input '{arg}'")
        if stage.loop is not None:
            _check_reference(origin.at("loop", "over"), stage.loop.over, known, "loop")
            _check_carry(origin, stage, known)
            _check_stages(recipe, doc, stage.steps, path + (index, "steps"), known | {stage.loop.var})
            _check_collect(origin, stage)
            known |= _writes(stage.steps) | set(stage.loop.collect.values())
        known |= set(stage.outputs.values())


def _writes(stages: list[StageSpec]) -> set[str]:
    """The values the stages (loop bodies included) write."""
    return {v for s in stages for v in [*s.outputs.values(), *_writes(s.steps)]}


def _reads(stage: StageSpec) -> set[str]:
    """The value names a stage (a loop: its count and its body) reads."""
    texts = [*stage.inputs.values(), *stage.dims.values(), *([stage.loop.over] if stage.loop else [])]
    names = {n.id for text in texts if isinstance(text, str) for n in names_in(parse(unwrap(text)))}
    for sub in stage.steps:
        names |= _reads(sub)
    return names


def _check_carry(origin: Origin, loop: StageSpec, known: set[str]) -> None:
    """``loop.carry`` lists exactly the values the body reads from the previous iteration: each is made before
    the loop and rewritten by the body, and a value the body reads before rewriting it is carried."""
    carry, written = loop.loop.carry, _writes(loop.steps)
    for k, name in enumerate(carry):
        at = list_item_origin(origin.at("loop"), "carry", k)
        if name not in known:
            raise at.error(f"loop '{loop.name}' carries '{name}', which has no value before the loop starts; a "
                           f"carried value is made before the loop and rewritten by its body"
                           f"{did_you_mean(name, known)}")
        if name not in written:
            raise at.error(f"loop '{loop.name}' carries '{name}', but no stage of its body rewrites it; remove it "
                           f"from carry")
    seen: set[str] = set()
    for index, stage in enumerate(loop.steps):
        # values made before the loop (others are the stage checks' "not defined before this point")
        late = sorted((_reads(stage) & written & known) - seen - set(carry) - {loop.loop.var})
        if late:
            writer = next(s.name for s in loop.steps[index:] if late[0] in _writes([s]))
            when = "and then rewrites it" if writer == stage.name else f"before stage '{writer}' rewrites it"
            raise origin.at("steps", index).error(
                f"stage '{stage.name}' of loop '{loop.name}' reads '{late[0]}' {when}, so each iteration reads the "
                f"previous one's value: add it to the loop's carry (carry: [{', '.join([*carry, late[0]])}])")
        seen |= _writes([stage])


def _check_collect(origin: Origin, loop: StageSpec) -> None:
    """Each value ``loop.collect`` gathers is one its body writes."""
    written = _writes(loop.steps)
    for name in loop.loop.collect:
        if name not in written:
            raise origin.at("loop", "collect", name).error(
                f"loop '{loop.name}' collects '{name}', which no stage of its body writes"
                f"{did_you_mean(name, written)}", key=True)


def _check_reference(origin: Origin, value: object, known: set[str], what: str, before_run: bool = False) -> None:
    """A stage's value expression (evaluated by the driver with the safe evaluator): names must exist.
    ``before_run``: a `when:`, which may read only parameters and configs (it is decided before the run)."""
    if not isinstance(value, str):
        return
    try:
        tree = parse(unwrap(value))
    except ExprError as exc:
        raise origin.expr_error(exc, what) from None
    for node in names_in(tree):
        if node.id not in known and node.id not in FUNCTIONS and node.id not in (CONFIG, MODEL_INDEX,
                                                                                  *YAML_CONSTANTS):
            available = (f"a stage's `when:` is decided before the run, so it reads parameters "
                         f"({one_of(known, 30)}), config.COMPONENT.KEY and model_index.KEY, never stage values or "
                         f"inputs") if before_run else \
                f"values available: {one_of(known, 30)} (and config.COMPONENT.KEY, model_index.KEY)"
            raise origin.expr_error(
                ExprError(
                    f"'{node.id}' is not defined before this point{did_you_mean(node.id, known)}; {available}",
                    node.lineno,
                    node.col_offset,
                ),
                what,
            )
