"""What ``luminal-recipe validate`` and ``luminal-recipe inspect`` do, as plain functions for the CLI.

Both raise a LuminalError subclass (RecipeError, CheckpointError...) on the first located problem; the CLI
prints it and exits 2. What needs no checkpoint is always checked (schema, names, expressions, forwards, --set
values). The checkpoint is checked tensor by tensor, with the model built, when ``weights`` is given or when
the recipe names a local one (a model's ``weights.source``, a pipeline's ``weights``); a checkpoint on the
Hugging Face Hub is only downloaded and checked when passed as ``weights``. A ``kind: modules`` library is
checked on its own: its syntax, its modules' references and forwards, and the names it expects from the
recipes that include it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import CheckpointError
from ..files import MAX_JSON_BYTES, read_json
from .builder import (
    BuiltModel,
    build_model,
    checkpoint_folder,
    config_display,
    open_checkpoint,
    read_config,
    with_quantization,
)
from .check import check_library, check_recipe
from .config_fields import config_report
from .loader import LoadedRecipe, inside_tree, load_recipe
from .params import ParamResolver
from .paths import checkpoint_roots, confined, guard_checkpoint
from .safe_eval import is_wrapped
from .schema import ModelRecipe, ModuleLibrary, PipelineRecipe

ALL_KINDS = ("model", "pipeline", "modules")

# (pipeline recipe, weights, sets, budget) -> the lines of its memory plan
MemoryPlanLines = Callable[[LoadedRecipe, "str | Path | None", Any, "int | None"], list[str]]


@dataclass
class ValidationReport:
    path: Path
    kind: str
    name: str
    checks: list[str] = field(default_factory=list)
    models: dict[str, BuiltModel] = field(default_factory=dict)
    details: list[str] = field(default_factory=list)  # shown by `validate --verbose`

    def __str__(self) -> str:
        return self.render()

    def render(self, verbose: bool = False) -> str:
        what = "module library" if self.kind == "modules" else f"{self.kind} recipe"
        lines = [f"{self.path}: valid {what} '{self.name}'"]
        lines += [f"  - {c}" for c in self.checks]
        if verbose:
            lines += [f"  {d}" for d in self.details] or ["  (nothing more to show: pass --weights for config details)"]
        return "\n".join(lines)


def validate(
    path: str | Path, weights: str | Path | None = None, sets: Iterable[str] | Mapping[str, Any] = ()
) -> ValidationReport:
    """Check a recipe of any kind; with ``weights``, or a local checkpoint the recipe names, also build it and
    check the checkpoint against it."""
    recipe = load_recipe(path, allowed=ALL_KINDS)
    if isinstance(recipe.doc, ModuleLibrary):
        return _validate_library(recipe, weights)
    report = ValidationReport(recipe.path, recipe.kind, recipe.doc.name)
    _validate_loaded(recipe, weights, sets, report, label="", own_source=True)
    return report


def _validate_library(recipe: LoadedRecipe, weights: str | Path | None) -> ValidationReport:
    if weights is not None:
        raise recipe.origin("kind").error(
            "a `kind: modules` library has no checkpoint of its own; pass --weights when validating a model "
            "recipe that includes it."
        )
    expected = check_library(recipe)
    report = ValidationReport(recipe.path, "modules", recipe.path.stem)
    includes = f" (includes: {', '.join(p.name for p in recipe.files[1:])})" if len(recipe.files) > 1 else ""
    report.checks.append(
        f"library of {len(recipe.modules)} modules ({', '.join(recipe.modules)}): syntax, module references, "
        f"weights and forwards are valid{includes}"
    )
    if expected:
        report.checks.append(
            f"names it reads without defining them (the including recipe must define them as parameters): "
            f"{', '.join(expected)}"
        )
    if recipe.param_checks:
        report.checks.append(
            f"parameters it declares for the including recipe (their type and ranges are checked on its values): "
            f"{', '.join(sorted(recipe.param_checks))}"
        )
    return report


def _validate_loaded(
    recipe: LoadedRecipe, weights: str | Path | None, sets: Any, report: ValidationReport, label: str,
    own_source: bool, user_weights: bool | None = None, source: str | None = None,
) -> None:
    """``own_source``: without ``weights``, check the checkpoint the recipe names itself when it is local
    (False for a pipeline's models, whose checkpoint is the pipeline's). ``user_weights``: whether ``weights``
    is the user's (--weights; default: whenever given) rather than a folder the recipe names, whose links must
    stay in the recipe's tree."""
    check_recipe(recipe)
    ParamResolver(recipe.params, None, sets).check_static()
    prefix = f"{label}: " if label else ""
    includes = recipe.files[1 + len(recipe.extends):]
    report.checks.append(
        f"{prefix}schema, parameters, expressions and forwards are valid"
        + (f" (extends: {' -> '.join(p.name for p in recipe.extends)})" if recipe.extends else "")
        + (f" (includes: {', '.join(p.name for p in includes)})" if includes else "")
    )
    if isinstance(recipe.doc, PipelineRecipe):
        _validate_pipeline(recipe, weights, sets, report)
        return
    if weights is None and own_source:
        declared = recipe.doc.weights.source
        if declared is None:
            report.checks.append(f"{prefix}checkpoint not checked: the recipe names none (weights.source); pass "
                                 f"--weights FOLDER or --weights hf://ORG/REPO to check one and build the graph")
            return
        if declared.startswith("hf://"):
            report.checks.append(f"{prefix}checkpoint not checked: {declared} is on the Hugging Face Hub and "
                                 f"nothing is downloaded unless asked; pass --weights {declared} (or a local "
                                 f"copy) to check it")
            return
    elif weights is None:
        return  # a pipeline's model: the pipeline reports on its checkpoint
    built = _build_with_weights(recipe, weights, sets, weights is not None if user_weights is None else user_weights,
                                source)
    report.models[label or recipe.doc.name] = built
    report.checks.append(
        f"{prefix}checkpoint {built.checkpoint_root} matches: {len(built.weights)} weights, "
        f"graph of {len(built.graph)} nodes" + ("" if weights is not None else " (the recipe's weights.source)")
    )
    config = read_config(recipe, built.checkpoint_root) if built.checkpoint_root is not None else None
    fields = config_report(recipe, config, config_display(recipe, built.checkpoint_root))
    report.details += [f"{prefix}{line}" if i == 0 else line for i, line in enumerate(fields.lines())]


def _validate_pipeline(
    recipe: LoadedRecipe, weights: str | Path | None, sets: Any, report: ValidationReport
) -> None:
    doc = recipe.doc
    assert isinstance(doc, PipelineRecipe)
    root = recipe.folder.resolve()
    folder = None
    if weights is not None:
        from ..weights.sources import resolve_source

        folder = resolve_source(weights)
    elif doc.weights is None:
        report.checks.append("checkpoint not checked: the recipe names none (`weights:`); pass --weights FOLDER "
                             "or --weights hf://ORG/REPO to check one")
    elif doc.weights.startswith("hf://"):
        report.checks.append(f"checkpoint not checked: {doc.weights} is on the Hugging Face Hub and nothing is "
                             f"downloaded unless asked; pass --weights {doc.weights} (or a local copy) to check it")
    elif doc.weights.startswith("python://"):
        from ..weights.sources import resolve_source

        folder = resolve_source(doc.weights)
        report.checks.append(f"checkpoint: {folder} (the recipe's `weights:`, an installed package's folder)")
    else:
        folder = _local_pipeline_checkpoint(recipe)
        report.checks.append(f"checkpoint: {folder} (the recipe's `weights:`)")
    if folder is not None:  # a checkpoint the recipe names: no link under it leads out (checked before reading it)
        guard_checkpoint(recipe.origin("weights") if weights is None else None, Path(folder), weights is not None,
                         recipe.tree, doc.weights)
    for name, model in doc.models.items():
        target = inside_tree(recipe.origin("models", name, "recipe"), recipe.folder, model.recipe, root)
        sub = load_recipe(target, tree_root=root)
        if not isinstance(sub.doc, ModelRecipe):
            raise recipe.origin("models", name, "recipe").error(
                f"'{model.recipe}' is a {sub.kind} recipe; pipeline models must be `kind: model`."
            )
        if model.quantization is not None:  # the pipeline's block replaces the model recipe's
            sub = with_quantization(sub, model.quantization)
        sub_weights = None if folder is None else confined(
            recipe.origin("models", name, "weights"), Path(folder), model.weights or ".", "the checkpoint folder",
            checkpoint_roots(Path(folder), weights is not None, recipe.tree, doc.weights))
        # values written ${...} refer to the pipeline's parameters: the driver evaluates them at run time
        literal = {k: v for k, v in model.set.items() if not is_wrapped(v)}
        _validate_loaded(sub, sub_weights, literal, report, label=name, own_source=False,
                         user_weights=weights is not None, source=doc.weights)


def _local_pipeline_checkpoint(recipe: LoadedRecipe) -> Path:
    """The local checkpoint folder a pipeline's `weights:` names (relative to the recipe)."""
    doc = recipe.doc
    assert isinstance(doc, PipelineRecipe) and doc.weights is not None
    folder = confined(recipe.origin("weights"), recipe.folder, doc.weights, "this recipe's folder",
                      [recipe.tree or recipe.folder])
    if not folder.is_dir():
        raise recipe.origin("weights").error(
            f"the checkpoint folder '{doc.weights}' does not exist (looked for {folder}); fix `weights:` or pass "
            f"--weights FOLDER."
        )
    return folder


def _build_with_weights(recipe: LoadedRecipe, weights: str | Path | None, sets: Any,
                        user_weights: bool | None = None, source: str | None = None) -> BuiltModel:
    """``source``: where the checkpoint came from when not the recipe's own weights.source (a pipeline's)."""
    folder = checkpoint_folder(recipe, weights)
    if folder is None:
        raise recipe.origin("weights").error("no checkpoint: pass --weights or set weights.source.")
    user_given = weights is not None if user_weights is None else user_weights
    roots = guard_checkpoint(recipe.origin("weights", "source") if weights is None else None, folder, user_given,
                             recipe.tree, source if source is not None else recipe.doc.weights.source)
    checkpoint, config, config_file = open_checkpoint(recipe, folder, roots)
    return build_model(recipe, checkpoint=checkpoint, config=config, sets=sets, config_file=config_file)


def inspect(
    path: str | Path,
    weights: str | Path | None = None,
    sets: Iterable[str] | Mapping[str, Any] = (),
    config: str | Path | Mapping[str, Any] | None = None,
    max_memory: int | None = None,
    memory_plan: MemoryPlanLines | None = None,
) -> str:
    """A printable summary: resolved parameters, modules, weights by dtype, graph size.

    Without ``weights``, a ``config`` (config.json path or mapping) gives the sizes; the graph is built from
    shapes alone; with neither, only what the recipe says without sizes is shown. For a pipeline, also the
    memory plan of every model stage under ``max_memory`` bytes (None: unbounded), as the ``memory_plan``
    callable prints it (``pipeline.memory_report.inspect_memory``: planning needs the compiler and a runtime, which a
    recipe does not know).
    """
    recipe = load_recipe(path, allowed=ALL_KINDS)
    if isinstance(recipe.doc, ModuleLibrary):
        return _library_summary(recipe)
    if isinstance(recipe.doc, PipelineRecipe):
        return _inspect_pipeline(recipe, weights, sets, max_memory, memory_plan)
    check_recipe(recipe)
    if weights is not None or (config is None and _local_source(recipe)):
        return summary(_build_with_weights(recipe, weights, sets))
    if config is None:
        ParamResolver(recipe.params, None, sets).check_static()
        return _static_summary(recipe) + "\n(pass --weights, or a config, for sizes, weights and graph)"
    data = _read_config_arg(Path(config)) if isinstance(config, (str, Path)) else config
    return summary(build_model(recipe, config=data, sets=sets))


def _read_config_arg(path: Path) -> dict:
    """``inspect --config FILE``: a config.json object, or a CheckpointError naming the file."""
    try:
        data = read_json(path, "--config", MAX_JSON_BYTES, CheckpointError, where=f"--config {path}",
                         fix="pass a model's config.json")
    except FileNotFoundError:
        raise CheckpointError(f"--config {path}: file not found.") from None
    except OSError as exc:
        raise CheckpointError(f"--config {path}: not a readable JSON file ({exc}).") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"--config {path}: expected a JSON object (a model's config.json).")
    return data


def _local_source(recipe: LoadedRecipe) -> bool:
    source = recipe.doc.weights.source if isinstance(recipe.doc, ModelRecipe) else None
    return bool(source) and not source.startswith("hf://") and (recipe.folder / source).exists()


def _about(doc: str | None) -> list[str]:
    """A recipe's `doc:` under its title line."""
    return [f"  {doc}"] if doc else []


def _param_doc(recipe: LoadedRecipe, name: str) -> str:
    doc = recipe.params[name].value.doc if name in recipe.params else None
    return f"  # {' '.join(doc.split())}" if doc else ""


def summary(model: BuiltModel) -> str:
    recipe = model.recipe
    lines = [f"model '{model.name}' ({recipe.source.display})", *_about(recipe.doc.doc)]
    if model.checkpoint_root:
        lines.append(f"checkpoint: {model.checkpoint_root}")
    lines.append("parameters:")
    for name, value in model.params.values.items():
        origin = model.params.origins[name]
        lines.append(f"  {name:<22} = {value!r:<14} {str(model.params.types[name]):<10} ({origin})"
                     + _param_doc(recipe, name))
    lines.append("modules (instances, graph nodes each instance adds, constants aside):")
    per_module: dict[str, list[int]] = {}
    for call in model.calls:  # scalar constants are shared between instances: count the other nodes
        nodes = model.graph.nodes[call.start : call.end]
        per_module.setdefault(call.module, []).append(sum(1 for n in nodes if n.op != "Constant"))
    counts = Counter(inst.module_name for inst in model.root.walk())
    for name in recipe.modules:
        nodes = per_module.get(name, [])
        size = (
            f"{min(nodes)}"
            if nodes and min(nodes) == max(nodes)
            else (f"{min(nodes)}-{max(nodes)}" if nodes else "-")
        )
        doc = recipe.modules[name].value.doc
        lines.append(f"  {name:<22} x{counts.get(name, 0):<4} {size} nodes"
                     + (f"  # {' '.join(doc.split())}" if doc else ""))
    by_dtype = model.weight_bytes_by_dtype()
    count_by_dtype = Counter(str(b.dtype) for b in model.weights.values())
    total = sum(by_dtype.values())
    lines.append(f"weights: {len(model.weights)} tensors, {_bytes(total)}")
    for dtype, nbytes in sorted(by_dtype.items()):
        lines.append(f"  {dtype:<8} {count_by_dtype[dtype]:>6} tensors  {_bytes(nbytes)}")
    graph = model.graph
    ops = Counter(node.op for node in graph.nodes)
    lines.append(f"graph: {len(graph)} nodes ({', '.join(f'{op} {n}' for op, n in ops.most_common())})")
    inputs = ", ".join(f"{n} {list(map(str, t.shape))} {t.dtype}" for n, t in model.inputs.items())
    lines.append(f"inputs: {inputs}; outputs: {', '.join(model.outputs)}")
    lines += _input_docs(recipe)
    states = graph.inputs("state")
    if states:
        shapes = sorted({f"{list(map(str, n.shape))} {n.dtype}" for n in states})
        lines.append(f"states: {len(states)} ({', '.join(shapes)}), kept across runs (a KV cache)")
    return "\n".join(lines)


def _input_docs(recipe: LoadedRecipe) -> list[str]:
    """One line per input that has a `doc:`."""
    return [f"  {name}: {' '.join(spec.doc.split())}" for name, spec in recipe.doc.inputs.items() if spec.doc]


def _static_summary(recipe: LoadedRecipe) -> str:
    doc = recipe.doc
    assert isinstance(doc, ModelRecipe)
    lines = [f"model '{doc.name}' ({recipe.source.display})", *_about(doc.doc), "parameters (unresolved):"]
    for name, located in recipe.params.items():
        lines.append(f"  {name:<22} = {located.value.default!r}" + _param_doc(recipe, name))
    lines.append(f"modules: {', '.join(recipe.modules)} (root: {doc.root})")
    if doc.inputs:
        lines.append(f"inputs: {', '.join(doc.inputs)}")
        lines += _input_docs(recipe)
    return "\n".join(lines)


def _library_summary(recipe: LoadedRecipe) -> str:
    expected = check_library(recipe)
    lines = [f"module library '{recipe.path.stem}' ({recipe.source.display}): shared modules for `include:`",
             *_about(recipe.doc.doc)]
    if recipe.params:
        lines.append("parameters (unresolved):")
        lines += [f"  {name:<22} = {located.value.default!r}" + _param_doc(recipe, name)
                  for name, located in recipe.params.items()]
    lines.append("modules:")
    for name, located in recipe.modules.items():
        spec = located.value
        subs = ", ".join(f"{k}: {v.module}" for k, v in spec.submodules.items())
        lines.append(f"  {name:<22} inputs ({', '.join(spec.inputs)}), {len(spec.weights)} weights"
                     + (f", submodules {subs}" if subs else ""))
        if spec.doc:
            lines.append(f"  {'':<22} {' '.join(spec.doc.split())}")
    if expected:
        lines.append(f"expects from the including recipe: {', '.join(expected)}")
    return "\n".join(lines)


def _inspect_pipeline(recipe: LoadedRecipe, weights: str | Path | None, sets: Any,
                      max_memory: int | None = None, memory_plan: MemoryPlanLines | None = None) -> str:
    report = validate(recipe.path, weights, sets)
    doc = recipe.doc
    assert isinstance(doc, PipelineRecipe)
    params = ParamResolver(recipe.params, None, sets).resolve_all().values
    based = f", extends {' -> '.join(p.name for p in recipe.extends)}" if recipe.extends else ""
    lines = [f"pipeline '{doc.name}' ({recipe.source.display}{based})", *_about(doc.doc), "parameters:"]
    lines += [f"  {name:<22} = {value!r}" + _param_doc(recipe, name) for name, value in params.items()]
    lines.append("inputs:")
    lines += [f"  {name:<22} {spec.type}{' (optional)' if spec.optional else ''}"
              + (f"  # {' '.join(spec.doc.split())}" if spec.doc else "") for name, spec in doc.inputs.items()]
    lines.append("stages:")
    lines += _stage_lines(doc.stages, params, "  ")
    for name, model in report.models.items():
        lines += ["", f"[{name}]", summary(model)]
    if not report.models:
        lines.append("(pass --weights for per-model weights and graph sizes)")
    if memory_plan is not None:
        lines += ["", *memory_plan(recipe, weights, sets, max_memory)]
    return "\n".join(lines)


def _stage_lines(stages: list, params: Mapping[str, Any], indent: str) -> list[str]:
    """One line per stage; a loop says how many times it runs (from the parameters, when they decide it) and
    lists the stages of its body below it."""
    lines = []
    for stage in stages:
        if stage.when is not None and _holds(stage.when, params) is False:
            lines.append(f"{indent}{stage.name}: not run (when {stage.when}: false)")
            continue
        when = f" (only when {stage.when})" if stage.when is not None else ""
        if stage.model:
            lines.append(f"{indent}{stage.name}: model {stage.model}{when}")
        elif stage.run:
            lines.append(f"{indent}{stage.name}: run {stage.run}{when}")
        else:
            count = _loop_count(stage.loop.over, params)
            lines.append(f"{indent}{stage.name}: loop over {stage.loop.over}{when}: {count}, each running "
                         f"{len(stage.steps)} stage{'s' if len(stage.steps) != 1 else ''}:")
            lines += _stage_lines(stage.steps, params, indent + "  ")
    return lines


def _holds(when: Any, params: Mapping[str, Any]) -> bool | None:
    """A stage's ``when:`` decided by the parameters alone; None when it reads a config or model_index.json
    (decided when the pipeline runs, from its checkpoint)."""
    from .safe_eval import evaluate, names_in, parse, unwrap

    if not isinstance(when, str):
        return bool(when)
    tree = parse(unwrap(when))
    if any(n.id not in params for n in names_in(tree)):
        return None
    return bool(evaluate(tree, lambda name, node: params[name]))


def _loop_count(over: Any, params: Mapping[str, Any]) -> str:
    """``"4 iterations (steps = 4)"``, or when the count depends on values made at run time, says so."""
    from ..errors import LuminalError
    from .safe_eval import ExprError, evaluate, names_in, parse, unwrap

    try:
        tree = parse(unwrap(over)) if isinstance(over, str) else None
        if tree is not None and any(n.id not in params for n in names_in(tree)):
            return "iterations known when it runs (it loops over a value made at run time)"

        def resolve(name: str, node: Any) -> Any:
            return params[name]

        value = evaluate(tree, resolve) if tree is not None else over
        count = int(value) if isinstance(value, (int, float)) else len(value)
    except (ExprError, LuminalError, TypeError, ValueError):
        return "iterations known when it runs"
    shown = f" ({over} = {value})" if isinstance(over, str) and str(value) != over else ""
    return f"{count} iteration{'s' if count != 1 else ''}{shown}"


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return f"{n} B"
