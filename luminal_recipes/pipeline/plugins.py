"""Task plug-ins: the host steps a pipeline recipe runs with ``run: STEP``, found in ``luminal_recipes/tasks/``.

Every package ``luminal_recipes/tasks/<task>/`` is a plug-in; nothing lists them. Its ``__init__`` defines:

``STEPS``         step name -> ``step(ctx: StepContext, **inputs) -> dict`` of named results. The stage's
                  ``inputs`` expressions give the keyword arguments; its ``outputs`` map the results. A task that
                  runs its models itself rather than as pipeline stages (text generation) may define none.
``PARAM_CHECKS``  parameter name -> ``check(value, given)``: refuses a bad value of the pipeline parameter of
                  that name (``given`` says where the value came from: ``--steps 0``, ``--set steps=0``,
                  ``steps=0 (the recipe's default)``) with a ``LuminalError``.
``INPUTS``        input name -> ``read(value, params) -> value``: turns what ``run`` was given for the pipeline
                  input of that name (a prompt's text, a file's path) into the value the pipeline receives,
                  refusing a bad one; ``params`` are the pipeline's resolved parameters.
``DERIVE``        input name -> ``derive(value, params, set_by) -> {parameter: (value, origin)}``: parameter values
                  that follow from that input (as ``INPUTS`` read it), e.g. the output size from the first
                  reference image, as diffusers does. ``set_by`` names the parameters the user set (flag or
                  ``--set``) and how; a derived value never replaces one of them (the plug-in may refuse the
                  pair). ``origin`` says where the value came from, for messages. The inputs with a ``DERIVE``
                  entry are read first, then the parameters derived, then the other inputs read with them; all
                  before the parameter checks and the memory plans.
``DESCRIBE``      ``describe(params, given) -> {key: text}``: what an output file records about a run besides
                  the prompt and the recipe (``given``: the inputs ``run`` was given, as given).
``PREPARE``       ``prepare(ctx)``: called once before any model is planned, to load and check what the steps
                  will read (a tokenizer, a scheduler config), so a bad file fails before any work.
``CHECKS``        step name -> ``check(ctx, **inputs)``: refuses, without doing the step's work, the arguments
                  the step would refuse (a prompt the tokenizer cannot tokenize). The driver
                  (``Pipeline.check_runs``) calls it for every stage running that step whose inputs follow from
                  the pipeline's inputs and parameters alone, for every run's inputs (every prompt), before any
                  model is planned or weight read: a bad second prompt is refused before the first one's output.

The checks, readers and description of a plug-in apply to a pipeline that runs at least one of its steps, before
any work. Step names are one namespace: two plug-ins defining the same step is an error naming both.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, TypeVar

from ..errors import PipelineError, PluginError
from ..recipe.schema import PipelineRecipe, StageSpec
from ..recipe.suggest import did_you_mean

T = TypeVar("T")
TASKS_PACKAGE = "luminal_recipes.tasks"


class StepContext:
    """What a step may read besides its arguments: the checkpoint folder, the pipeline recipe (its ``tokenizer``
    and ``scheduler`` sections, whose paths the driver has checked to lie inside the checkpoint), and objects
    the pipeline's steps share (a tokenizer, a schedule), made once per pipeline by ``shared``. ``where(*path)``
    names a place in the recipe for messages (``flux2.yaml:26:14: scheduler.options``). A step reads checkpoint
    files with ``luminal_recipes.files`` (``open_regular``, ``read_regular_text``): a checkpoint the recipe names is
    fenced there, so no file read under it leads out through a symbolic link."""

    def __init__(self, checkpoint: Path, recipe: PipelineRecipe, origin: Callable[..., Any] | None = None):
        self.checkpoint = checkpoint
        self.recipe = recipe
        self._origin = origin  # LoadedRecipe.origin: key path -> Origin
        self._shared: dict[str, Any] = {}

    def where(self, *path: Any) -> str:
        dotted = ".".join(map(str, path))
        return f"{self._origin(*path).loc()}: {dotted}" if self._origin is not None else dotted

    def shared(self, key: str, make: Callable[[], T]) -> T:
        """The object stored under ``key`` (a plug-in prefixes its keys with its name), made on first use."""
        if key not in self._shared:
            self._shared[key] = make()
        return self._shared[key]


@dataclass(frozen=True)
class Task:
    """One plug-in package, as ``discover`` reads it."""

    name: str
    steps: Mapping[str, Callable[..., dict]]
    param_checks: Mapping[str, Callable[[Any, str], None]] = field(default_factory=dict)
    inputs: Mapping[str, Callable[[Any, Mapping[str, Any]], Any]] = field(default_factory=dict)
    describe: Callable[[Mapping[str, Any], Mapping[str, Any]], dict[str, str]] | None = None
    prepare: Callable[[StepContext], None] | None = None
    derive: Mapping[str, Callable[[Any, Mapping[str, Any], Mapping[str, str]], dict[str, tuple[Any, str]]]] = \
        field(default_factory=dict)
    checks: Mapping[str, Callable[..., None]] = field(default_factory=dict)


def _read(name: str, module) -> Task:
    tables = {table: getattr(module, table, {}) for table in ("STEPS", "PARAM_CHECKS", "INPUTS", "DERIVE", "CHECKS")}
    for table, entries in tables.items():
        if not isinstance(entries, Mapping) or not all(isinstance(k, str) and callable(v) for k, v in entries.items()):
            raise PluginError(f"task plug-in '{name}': {table} must map names to functions")
    hooks = {hook: getattr(module, hook, None) for hook in ("DESCRIBE", "PREPARE")}
    for hook, function in hooks.items():
        if function is not None and not callable(function):
            raise PluginError(f"task plug-in '{name}': {hook} must be a function")
    unknown = sorted(set(tables["CHECKS"]) - set(tables["STEPS"]))
    if unknown:
        raise PluginError(f"task plug-in '{name}': CHECKS names step(s) it does not define: {', '.join(unknown)}")
    return Task(name, dict(tables["STEPS"]), dict(tables["PARAM_CHECKS"]), dict(tables["INPUTS"]),
                hooks["DESCRIBE"], hooks["PREPARE"], dict(tables["DERIVE"]), dict(tables["CHECKS"]))


def build_registry(tasks: list[Task]) -> dict[str, Task]:
    """Step name -> the plug-in defining it; a step defined by two plug-ins is an error naming both."""
    owners: dict[str, Task] = {}
    for task in tasks:
        for step in task.steps:
            if step in owners:
                raise PluginError(f"step '{step}' is defined by two task plug-ins, '{owners[step].name}' and "
                                  f"'{task.name}'; step names are one namespace: rename one of them")
            owners[step] = task
    return owners


@cache
def discover() -> tuple[Task, ...]:
    """Every plug-in package under ``luminal_recipes/tasks/``, in name order."""
    package = importlib.import_module(TASKS_PACKAGE)
    found = []
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        if info.ispkg and not info.name.startswith("_"):
            found.append(_read(info.name, importlib.import_module(f"{TASKS_PACKAGE}.{info.name}")))
    return tuple(found)


@cache
def registry() -> dict[str, Task]:
    """Step name -> its plug-in, over every discovered plug-in."""
    return build_registry(list(discover()))


def steps() -> dict[str, Callable[..., dict]]:
    """Step name -> step function."""
    return {name: task.steps[name] for name, task in registry().items()}


def run_steps(stages: list[StageSpec], at: tuple = ("stages",)) -> Iterator[tuple[tuple, StageSpec]]:
    """Every ``run:`` stage, loops included, with its key path in the recipe (for located errors)."""
    for index, stage in enumerate(stages):
        if stage.run is not None:
            yield at + (index,), stage
        yield from run_steps(stage.steps, at + (index, "steps"))


def check_steps_known(recipe) -> None:
    """Every ``run:`` stage of a loaded pipeline recipe names a step some plug-in defines, and gives it only
    inputs the step takes (a step's ``renamed_inputs`` says how to write an input it no longer takes); a located
    error otherwise."""
    known = registry()
    for at, stage in run_steps(recipe.doc.stages):
        if stage.run not in known:
            raise recipe.origin(*at, "run").error(
                f"stage '{stage.name}' runs unknown step '{stage.run}'{did_you_mean(stage.run, known)}; the "
                f"steps of the task plug-ins are {', '.join(sorted(known))}")
        fn = known[stage.run].steps[stage.run]
        try:
            params = list(inspect.signature(fn).parameters.values())[1:]  # after the StepContext
        except (TypeError, ValueError):  # a builtin or C function: nothing to check against
            continue
        if any(p.kind is p.VAR_KEYWORD for p in params):
            continue
        names = [p.name for p in params]
        for key in stage.inputs:
            if key in names:
                continue
            renamed = getattr(fn, "renamed_inputs", {}).get(key)
            raise recipe.origin(*at, "inputs", key).error(
                f"stage '{stage.name}': step '{stage.run}' takes no input '{key}'"
                + (f"; {renamed}" if renamed else f"{did_you_mean(key, names)}; its inputs are {', '.join(names)}"),
                key=True)


def tasks_of(doc: PipelineRecipe) -> list[Task]:
    """The plug-ins whose steps the pipeline runs, in the order it first runs them."""
    known = registry()
    used: dict[str, Task] = {}
    for _, stage in run_steps(doc.stages):
        task = known.get(stage.run)
        if task is None:
            raise PipelineError(f"stage '{stage.name}': unknown step '{stage.run}'")
        used.setdefault(task.name, task)
    return list(used.values())
