"""The pipeline driver: runs a ``kind: pipeline`` recipe's stages in order.

Values live in one environment (parameters, pipeline inputs, stage outputs). A stage either runs a host step of
a task plug-in (``run:``; the plug-ins in ``luminal_recipes/tasks/``, found by ``plugins.py``), runs a model
(``model:``: built from its recipe and the checkpoint subfolder, compiled once), or loops (``loop:``) over its
``steps``. Before the first stage runs, every model stage is planned under the memory budget (``plan.py``): a
budget no plan meets fails then, before any weight is read, and stages whose weights do not fit stream them block
by block. What is expensive and does not depend on the inputs is made once per ``Pipeline``: each model's graph
(built to plan, then run), its compiled program (the plan), and its loaded executable (weights bound, arena
allocated) for as long as it is needed: a model inside a loop is loaded once for the whole loop; after its stage,
a model is released (executable, arena and checkpoint maps; the graph and program stay) unless more runs follow
(``run(..., keep_loaded=True)``) and every stage's plan fits the budget at once, so a second prompt builds,
compiles and loads nothing. Each top-level stage's resident-memory peak is measured (``peak_rss``). Stage
``inputs`` are expressions over the environment; ``outputs`` name where results go. The driver owns nothing
numerical beyond what a recipe names.
"""

from __future__ import annotations

import ast
import contextlib
import json
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .. import heap
from ..errors import LuminalError, PipelineError, RecipeError
from ..files import MAX_JSON_BYTES, fence, present, read_json
from ..nonfinite import nonfinite_counts
from ..recipe.builder import BuiltModel, build_model, read_config
from ..recipe.loader import LoadedRecipe, load_recipe
from ..recipe.lora import LoraSpec
from ..recipe.params import ParamResolver
from ..recipe.paths import checkpoint_roots, confined, guard_checkpoint, is_local
from ..recipe.safe_eval import MODEL_INDEX, ExprError, evaluate, is_wrapped, names_in, parse, unwrap, wrap_config
from ..recipe.schema import PipelineRecipe, StageSpec
from ..runtimes.registry import get_runtime
from . import peak_rss
from .engine import ModelEngine
from .plan import StagePlan, check_budget, model_stages, plan_stages
from .plugins import StepContext, check_steps_known, steps, tasks_of


@dataclass
class RunReport:
    values: dict[str, Any]
    stage_seconds: dict[str, float] = field(default_factory=dict)
    step_seconds: list[float] = field(default_factory=list)
    planned_peak: dict[str, int] = field(default_factory=dict)
    weight_bytes: dict[str, int] = field(default_factory=dict)
    compile_seconds: dict[str, float] = field(default_factory=dict)
    memory: dict[str, dict] = field(default_factory=dict)  # model stage -> planned and measured figures
    rss: dict[str, dict] = field(default_factory=dict)  # top-level stage -> resident set at start and peak


class Pipeline:
    """A loaded pipeline recipe bound to a checkpoint folder."""

    def __init__(self, path: str | Path, weights: str | Path | None = None, sets: Iterable[str] | Mapping = (),
                 budget_bytes: int | None = None, compile: bool = True,
                 progress: Callable[[str, int, int], None] | None = None,
                 set_sources: Mapping[str, str] | None = None, allow_nonfinite: bool = False, runtime=None,
                 host_budget_bytes: int | None = None, compute_dtype: str | None = None,
                 loras: Iterable[tuple[str | Path, float]] = ()):
        self.recipe: LoadedRecipe = load_recipe(path)
        if not isinstance(self.recipe.doc, PipelineRecipe):
            raise RecipeError(f"{path}: this is a model recipe; `run` needs a pipeline recipe (kind: pipeline)")
        self.doc: PipelineRecipe = self.recipe.doc
        self.path = Path(path)
        # set_sources: how a value was given when not by --set (e.g. {"steps": "--steps 4"}), for messages
        check_steps_known(self.recipe)  # every `run:` names a step of a task plug-in
        self._sets, self._set_sources = sets, dict(set_sources or {})
        self._resolver = ParamResolver(self.recipe.params, None, sets, override_origins=set_sources)
        self.resolved = self._resolver.resolve_all()
        self.params = self.resolved.values
        self.allow_nonfinite = allow_nonfinite  # else a non-finite stage output stops the run, naming the stage
        self._weights_arg = weights
        self._checkpoint: Path | None = None
        self.budget_bytes = budget_bytes  # bytes of the runtime's device memory (None: unbounded)
        self.host_budget_bytes = host_budget_bytes  # a device runtime's pinned staging (None: its default)
        self.compute_dtype = compute_dtype  # every model's compute dtype (None: each recipe's own)
        self.runtime = get_runtime(runtime)  # a name or a Runtime (default numpy)
        self.compile = compile
        self.progress = progress
        self._configs: dict[str, dict] | None = None
        self._model_index: dict | None = None
        self._skipped: dict[str, str] = {}  # value -> the stage that would have made it and did not run
        self._context: StepContext | None = None
        self._models: dict[str, BuiltModel] = {}  # built graphs, kept for the Pipeline's life
        self._index_tables: dict[str, dict[str, list[tuple[str, int]]]] = {}  # model -> index_tables(its graph)
        self._recipes: dict[str, LoadedRecipe] = {}  # model recipes, loaded once
        self._checkpoints: dict = {}  # model name -> its open Checkpoint (maps dropped when the model is released)
        self._engines: dict[str, ModelEngine] = {}  # loaded models kept between stages or runs
        self._parsed: dict[str, ast.expr] = {}  # expression text -> its tree: a loop evaluates the same ones each step
        self.plans: list[StagePlan] | None = None
        self._lora_flags = [(Path(path), float(scale)) for path, scale in loras]  # --lora PATH[:SCALE]
        self._loras: dict[str, list[LoraSpec]] | None = None
        self._run_params: Mapping[str, Any] | None = None  # this run's parameter values (run(..., params=...))
        # called after each iteration of a loop that carries values: (stage, iteration, total, first carried value)
        self.on_loop_step: Callable[[str, int, int, Any], None] | None = None

    def derive(self, values: Mapping[str, tuple[Any, str]]) -> None:
        """Resolve the parameters again with ``values`` (parameter -> (value, where it came from), a task
        plug-in's ``DERIVE``) set beside what the user set; before any plan is made."""
        if not values:
            return
        if self.plans is not None:
            raise PipelineError("parameters cannot be derived from the inputs after the stages were planned")
        clash = sorted(set(values) & set(self._resolver.overrides))
        if clash:
            raise PipelineError(f"{values[clash[0]][1]} sets parameter '{clash[0]}', which "
                                f"{self._resolver.set_by[clash[0]]} sets too; give it once")
        if isinstance(self._sets, Mapping):
            sets: Any = {**self._sets, **{name: value for name, (value, _) in values.items()}}
        else:
            sets = [*self._sets, *(f"{name}={json.dumps(value)}" for name, (value, _) in values.items())]
        sources = {**self._set_sources, **{name: origin for name, (_, origin) in values.items()}}
        self._sets, self._set_sources = sets, sources
        self._resolver = ParamResolver(self.recipe.params, None, sets, override_origins=sources)
        self.resolved = self._resolver.resolve_all()
        self.params = self.resolved.values
        self._models.clear()  # a model's `set:` may read a derived parameter

    def plan_params(self) -> set[str]:
        """The parameters the models and memory plans depend on (``plan_params``); a run may give the others new
        values (``run(..., params=...)``: another seed, step count or guidance) with nothing rebuilt, recompiled
        or reloaded."""
        return plan_params(self.doc) & set(self.params)

    def run_values(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """Every parameter's value with ``params`` (name -> value) set for one run, resolved and checked as
        ``--set`` values are (types, choices, ranges; derived defaults follow them)."""
        unknown = [name for name in params if name not in self.recipe.params]
        if unknown:
            from ..recipe.suggest import did_you_mean, one_of

            raise PipelineError(f"parameter '{unknown[0]}': pipeline '{self.doc.name}' has no such parameter"
                                f"{did_you_mean(unknown[0], self.recipe.params)}; its parameters: "
                                f"{one_of(self.recipe.params)}")
        if isinstance(self._sets, Mapping):
            sets: Any = {**self._sets, **params}
        else:
            kept = [s for s in self._sets if s.split("=", 1)[0].strip() not in params]
            sets = [*kept, *(f"{name}={json.dumps(value)}" for name, value in params.items())]
        sources = {k: v for k, v in self._set_sources.items() if k not in params}
        sources.update({name: f"{name}={value!r}" for name, value in params.items()})
        return dict(ParamResolver(self.recipe.params, None, sets, override_origins=sources).resolve_all().values)

    def set_strings(self) -> list[str]:
        """The parameters set (by the user, or derived from the inputs) as ``--set name=value`` strings."""
        if isinstance(self._sets, Mapping):
            return [f"{name}={json.dumps(value)}" for name, value in self._sets.items()]
        return list(self._sets)

    @property
    def checkpoint(self) -> Path:
        """The checkpoint folder (resolved, and downloaded for hf:// sources, on first use)."""
        if self._checkpoint is None:
            self._checkpoint = self._checkpoint_folder(self._weights_arg)
        return self._checkpoint

    @property
    def context(self) -> StepContext:
        """What steps read besides their arguments; the checkpoint files the recipe names for them (the
        tokenizer folder, the scheduler config) are checked to lie inside the checkpoint first."""
        if self._context is None:
            tok, sched = self.doc.tokenizer, self.doc.scheduler
            if tok is not None:
                self._inside_checkpoint(("tokenizer", "path"), tok.path)
            if sched is not None and sched.config is not None:
                self._inside_checkpoint(("scheduler", "config"), sched.config)
            self._context = StepContext(self.checkpoint, self.doc, self.recipe.origin)
        return self._context

    def _inside_checkpoint(self, where: tuple, relative: str) -> Path:
        """``checkpoint / relative``, refused at the recipe line ``where`` if it leads out of the checkpoint."""
        return confined(self.recipe.origin(*where), self.checkpoint, relative, "the checkpoint folder",
                        self._checkpoint_roots)

    @property
    def _checkpoint_roots(self) -> list[Path] | None:
        return checkpoint_roots(self.checkpoint, self._weights_arg is not None, self.recipe.tree, self.doc.weights)

    @property
    def configs(self) -> dict[str, dict]:
        """Each model's config.json: from the checkpoint when it is at hand, else from the `configs:` folder."""
        if self._configs is None:
            source = self._weights_arg if self._weights_arg is not None else self.doc.weights
            local = source is not None and not str(source).startswith("hf://")
            if local or self.doc.configs is None:
                self._configs = {name: self._model_config(name) for name in self.doc.models}
            else:
                folder = self._configs_folder()
                self._configs = {name: _read_json(folder / (m.weights or "") / "config.json")
                                 for name, m in self.doc.models.items()}
        return self._configs

    @property
    def model_index(self) -> dict:
        """The checkpoint's model_index.json (diffusers' pipeline config: its class, components and options
        such as Flux2KleinPipeline's is_distilled), from the checkpoint when it is at hand, else from the
        `configs:` folder; {} when there is none."""
        if self._model_index is None:
            source = self._weights_arg if self._weights_arg is not None else self.doc.weights
            local = source is not None and not str(source).startswith("hf://")
            if local or self.doc.configs is None:
                path = self.checkpoint / "model_index.json"
            else:
                path = self._configs_folder() / "model_index.json"
            self._model_index = _read_json(path) if present(path) else {}
            if not isinstance(self._model_index, dict):
                raise PipelineError(f"{path}: expected a JSON object.")
        return self._model_index

    def _configs_folder(self) -> Path:
        """The recipe's `configs:` folder, inside its tree, fenced as a checkpoint the recipe names is (no file read
        under it leads out through a link)."""
        tree = self.recipe.tree or self.path.parent
        origin = self.recipe.origin("configs")
        folder = confined(origin, self.path.parent, self.doc.configs, "this recipe's folder", [tree])
        fence(folder, [tree], f"{origin.loc()}: the configs folder the recipe names", "the recipe's folder tree")
        return folder

    def runs(self, stage: StageSpec) -> bool:
        """Whether the stage runs: its `when:` (parameters, configs and model_index.json only) is true."""
        if stage.when is None:
            return True
        value = self._eval(stage.when, {}, f"stage '{stage.name}' when")
        if not isinstance(value, bool | np.bool_):
            raise PipelineError(f"{self.path}: stage '{stage.name}' when: {stage.when} is {value!r}, not true or "
                                f"false; write a comparison or a boolean parameter")
        return bool(value)

    # ---- set-up --------------------------------------------------------------------------------------------
    def _checkpoint_folder(self, weights) -> Path:
        source = str(weights) if weights is not None else self.doc.weights
        if source is None:
            raise PipelineError(f"{self.path}: no checkpoint; pass --weights FOLDER or set `weights:` in the recipe")
        from ..weights.sources import resolve_source

        if is_local(source) and weights is None:  # the recipe's own: inside its folder tree
            source = str(confined(self.recipe.origin("weights"), self.path.parent, source, "this recipe's folder",
                                  [self.recipe.tree or self.path.parent]).resolve())
        patterns = ("*.json", "*.safetensors", "*.jinja", "*.model", "*.txt")
        folder = Path(resolve_source(source, patterns=patterns))
        # every file read from it stays inside (a checkpoint the recipe names), checked now and as it is opened
        guard_checkpoint(self.recipe.origin("weights") if weights is None else None, folder, weights is not None,
                         self.recipe.tree, self.doc.weights)
        missing = [m.weights for m in self.doc.models.values() if m.weights and not (folder / m.weights).is_dir()]
        if missing:
            raise PipelineError(
                f"checkpoint {folder} has no {', '.join(missing)} folder(s); a {self.doc.name} checkpoint needs "
                f"{', '.join(m.weights for m in self.doc.models.values() if m.weights)}"
            )
        return folder

    def _model_folder(self, name: str) -> Path:
        sub = self.doc.models[name].weights
        return self._inside_checkpoint(("models", name, "weights"), sub) if sub else self.checkpoint

    def _model_recipe(self, name: str) -> LoadedRecipe:
        if name not in self._recipes:
            self._recipes[name] = load_recipe(self.path.parent / self.doc.models[name].recipe)
        return self._recipes[name]

    def _model_config(self, name: str) -> dict:
        return read_config(self._model_recipe(name), self._model_folder(name), self._checkpoint_roots) or {}

    def model(self, name: str) -> BuiltModel:
        """Build (once) the graph of model ``name`` against its checkpoint subfolder."""
        if name not in self._models:
            spec = self.doc.models[name]
            recipe = self._model_recipe(name)
            folder = self._model_folder(name)
            sets, origins = self.model_sets(name)
            # `quantization:` on the pipeline's model entry replaces the model recipe's own block
            self._checkpoints[name] = checkpoint = self._open_model_checkpoint(name, folder)
            self._models[name] = build_model(recipe, checkpoint=checkpoint,
                                             config=read_config(recipe, folder, self._checkpoint_roots), sets=sets,
                                             quantization=spec.quantization, set_origins=origins,
                                             compute_dtype=self.compute_dtype, loras=self.loras.get(name, []))
        return self._models[name]

    def _open_model_checkpoint(self, name: str, folder: Path) -> Any:
        """The checkpoint of model ``name``'s folder: its safetensors, or the one GGUF file of a folder holding no
        safetensors (a FLUX.2 transformer in city96's ComfyUI-GGUF layout, with the config.json beside it)."""
        from ..weights.gguf_io import GgufCheckpoint, is_gguf
        from ..weights.safetensors_io import Checkpoint
        from ..weights.sources import local_gguf

        found = local_gguf(folder)
        spec = self.doc.models[name]
        if is_gguf(found):
            checkpoint = GgufCheckpoint.open(found)
        else:
            checkpoint = Checkpoint.open(folder)
        if spec.quantization is not None and spec.quantization.format == "gguf":
            from ..recipe.gguf_packed import check_gguf_source

            where = f"{self.recipe.origin('models', name, 'quantization').loc()}: models.{name}.quantization"
            check_gguf_source(spec.quantization, checkpoint, where)
        return checkpoint

    def check_loras(self) -> None:
        """Read every LoRA file and map it onto its model's weights (no graph built, no weight read): a file that
        does not fit is refused before anything is planned or compiled."""
        from ..recipe.builder import map_model_loras

        for name, specs in self.loras.items():
            sets, _ = self.model_sets(name)
            map_model_loras(self._model_recipe(name), specs, config=self.configs.get(name) or {}, sets=sets,
                            quantization=self.doc.models[name].quantization)

    @property
    def loras(self) -> dict[str, list[LoraSpec]]:
        """Model name -> the LoRA files applied to it: the recipe's ``loras:``, then ``--lora`` flags. A LoRA goes
        to the model its entry names, else to the one model whose recipe declares ``lora_names``."""
        if self._loras is None:
            accepting = [name for name in self.doc.models if self._model_recipe(name).doc.lora_names is not None]
            out: dict[str, list[LoraSpec]] = {}

            def target(given: str | None, where: str) -> str:
                if given is not None:
                    if given not in self.doc.models:
                        raise PipelineError(f"{where}: the pipeline has no model '{given}'; its models: "
                                            f"{', '.join(self.doc.models)}")
                    return given
                if len(accepting) != 1:
                    raise PipelineError(
                        f"{where}: LoRAs apply to the model whose recipe declares `lora_names`; this pipeline has "
                        f"{len(accepting)} ({', '.join(accepting) or 'none'})" + ("; name one with `model:`"
                                                                                  if accepting else ""))
                return accepting[0]

            for index, entry in enumerate(self.doc.loras):
                origin = self.recipe.origin("loras", index)
                where = f"{origin.loc()}: loras[{index}]"
                path = confined(origin.at("path"), self.path.parent, entry.path, "this recipe's folder",
                                [self.recipe.tree or self.path.parent])
                out.setdefault(target(entry.model, where), []).append(
                    LoraSpec(path, entry.scale, f"{where} ({entry.path})", entry.mode))
            for path, scale in self._lora_flags:
                where = f"--lora {path}"
                out.setdefault(target(None, where), []).append(LoraSpec(path, scale, where))
            self._loras = out
        return self._loras

    def model_sets(self, name: str) -> tuple[dict[str, Any], dict[str, str]]:
        """The values of model ``name``'s ``set:`` (evaluated over the pipeline's parameters), and where each
        was written: the pipeline recipe's line, and the flag or ``--set`` it follows, for errors."""
        sets, origins = {}, {}
        for key, text in self.doc.models[name].set.items():
            # a value as written (`pooling: mean`), or `${...}` over the pipeline's parameters, as validate reads it
            wrapped = isinstance(text, str) and is_wrapped(text)
            sets[key] = self._eval(text, {}, f"models.{name}.set.{key}") if wrapped else text
            where = f"{self.recipe.origin('models', name, 'set', key).loc()}: models.{name}.set.{key}"
            names = {n.id for n in names_in(parse(unwrap(text)))} if wrapped else set()
            for ref in sorted(names & set(self._resolver.overrides)):
                where += f" (from {self._resolver.set_by[ref]})"
            origins[key] = where
        return sets, origins

    # ---- expressions ----------------------------------------------------------------------------------------
    def _eval(self, text: Any, env: Mapping[str, Any], where: str) -> Any:
        if not isinstance(text, str):
            return text
        node = self._parsed.get(text)
        if node is None:
            try:
                node = parse(unwrap(text))
            except ExprError as exc:
                raise PipelineError(f"{self.path}: {where}: {exc.message}") from None
            self._parsed[text] = node

        def resolve(name: str, at: ast.Name) -> Any:
            if name in env:
                return env[name]
            params = self._run_params if self._run_params is not None else self.params
            if name in params:
                return params[name]
            if name == "config":
                return wrap_config(self.configs, "model configs", "config")
            if name == MODEL_INDEX:
                return wrap_config(self.model_index, "model_index.json", MODEL_INDEX)
            if name in self._skipped:
                raise ExprError(f"'{name}' has no value: stage '{self._skipped[name]}', which makes it, did not run "
                                f"(its `when:` was false)", at.lineno, at.col_offset)
            raise ExprError(f"unknown name '{name}' (known: {', '.join(sorted({*env, *self.params}))})",
                            at.lineno, at.col_offset)

        try:
            return evaluate(node, resolve)
        except ExprError as exc:
            raise PipelineError(f"{self.path}: {where}: {exc.message}") from None

    # ---- checking every run's inputs -----------------------------------------------------------------------
    def check_runs(self, runs: Sequence[Mapping[str, Any]], labels: Sequence[str] | None = None) -> None:
        """Refuse, before any work, inputs a step would refuse: for each run's ``inputs`` (one per prompt;
        ``labels`` name them in messages, e.g. "prompt 2 of 3"), every stage whose step has a check (a plug-in's
        ``CHECKS``), whose `when:` holds and whose inputs follow from the pipeline's inputs and parameters alone
        (not from what an earlier stage makes, nor a loop's variable) is checked with the arguments it will get."""
        checks = {step: check for task in tasks_of(self.doc) for step, check in task.checks.items()}
        if not checks:
            return
        made = set(_made(self.doc.stages))
        for number, inputs in enumerate(runs):
            label = labels[number] if labels is not None else \
                (f"run {number + 1} of {len(runs)}" if len(runs) > 1 else "")
            env = {name: None for name in self.doc.inputs}
            env.update(inputs)
            for at, stage in _checked_stages(self.doc.stages, self.runs):
                check = checks.get(stage.run)
                if check is None or not all(self._reads_only(text, made) for text in stage.inputs.values()):
                    continue
                args = {k: self._eval(v, env, f"stage '{stage.name}' inputs.{k}") for k, v in stage.inputs.items()}
                try:
                    check(self.context, **args)
                except LuminalError as exc:
                    where = f"{label}: " if label else ""
                    where += f"{self.recipe.origin(*at).loc()}: stage '{stage.name}' (step {stage.run}"
                    where += "".join(f"; {source}" for source in self._set_sources_of(stage)) + ")"
                    try:
                        error = type(exc)(f"{where}: {exc}")
                    except TypeError:
                        error = PipelineError(f"{where}: {exc}")
                    raise error from None
                except TypeError as exc:
                    raise PipelineError(f"{self.path}: stage '{stage.name}': step '{stage.run}' {exc}") from None

    def _set_sources_of(self, stage: StageSpec) -> list[str]:
        """How the parameters a stage's inputs read were set by the user ("max_length from --set ..."), for
        messages."""
        out = []
        for key, text in stage.inputs.items():
            if not isinstance(text, str):
                continue
            try:
                names = {name.id for name in names_in(parse(unwrap(text)))}
            except ExprError:
                continue
            out += [f"{key} from {self.resolved.set_by[name]}" for name in sorted(names)
                    if self.resolved.set_by.get(name)]
        return out

    def _reads_only(self, text: Any, made: set[str]) -> bool:
        """Whether an input expression reads nothing a stage makes (only inputs, parameters and configs)."""
        if not isinstance(text, str):
            return True
        try:
            node = parse(unwrap(text))
        except ExprError:
            return False  # the run reports it where it is evaluated
        return not any(name.id in made for name in names_in(node))

    # ---- planning -----------------------------------------------------------------------------------------
    def prepare(self) -> list[StagePlan]:
        """Plan every model stage under the budget (compiling each once) and check that all fit, before any
        weight is read; raises ``BudgetError`` otherwise. ``run`` calls it first."""
        if self.plans is None:
            context = self.context  # the tokenizer and scheduler paths are checked before any work
            for task in tasks_of(self.doc):  # and what the steps will read is loaded and checked
                if task.prepare is not None:
                    task.prepare(context)
            plans = plan_stages(self, self.budget_bytes, self.runtime, compile=self.compile, from_checkpoint=True,
                                progress=self.progress, host_budget=self.host_budget_bytes)
            # the graphs built from headers to plan are the ones the stages run: kept
            check_budget(plans, self.budget_bytes)
            self.plans = plans
        return self.plans

    # ---- running ------------------------------------------------------------------------------------------
    def run(self, inputs: Mapping[str, Any], keep_loaded: bool = False,
            params: Mapping[str, Any] | None = None) -> RunReport:
        """Run the stages on ``inputs``. ``keep_loaded``: more runs follow, so keep each model loaded after its
        stage when every stage's plan fits the budget at once (else each is released after its stage, as in a
        single run). ``release()`` drops what is kept. ``params``: parameter values for this run only (a seed of a
        batch...); one the plans depend on (``plan_params``) must keep its value."""
        if params:
            values = self.run_values(params)
            changed = sorted(n for n in self.plan_params() if values.get(n) != self.params.get(n))
            if changed:
                raise PipelineError(f"parameter '{changed[0]}' = {values.get(changed[0])!r} for one run: the models "
                                    f"or memory plans depend on it (now {self.params.get(changed[0])!r}); set it "
                                    f"when the pipeline is made (--{changed[0].replace('_', '-')} / --set)")
            self._run_params = values
        try:
            return self._run(inputs, keep_loaded)
        finally:
            self._run_params = None

    def _run(self, inputs: Mapping[str, Any], keep_loaded: bool) -> RunReport:
        for name, spec in self.doc.inputs.items():
            if name not in inputs and not spec.optional:
                raise self.recipe.origin("inputs", name).error(
                    f"pipeline '{self.doc.name}' needs input '{name}' ({spec.type}); none was given", key=True)
            if inputs.get(name) is not None and not _is_of_type(inputs[name], spec.type):
                raise self.recipe.origin("inputs", name).error(
                    f"pipeline '{self.doc.name}' input '{name}' is declared {spec.type}, but was given "
                    f"{type(inputs[name]).__name__}", key=True)
            if name in inputs and inputs[name] is None and not spec.optional:
                raise self.recipe.origin("inputs", name).error(
                    f"pipeline '{self.doc.name}' input '{name}' ({spec.type}) is not optional; it was given null",
                    key=True)
        self.prepare()
        env: dict[str, Any] = {name: None for name in self.doc.inputs}
        env.update(inputs)
        report = RunReport(env)
        fit = self._fit_together()
        for index, stage in enumerate(self.doc.stages):
            if not self.runs(stage):  # its `when:` is false: nothing to do, measure or report
                self._stage(stage, env, set(), report)
                continue
            t0 = time.perf_counter()
            measured = peak_rss.reset()
            start = peak_rss.current()
            if self.progress and stage.loop is None:
                self.progress(stage.name, 0, 1)
            before = {name: engine.stats.compile_s for name, engine in self._engines.items()}
            used: set[str] = set()
            self._stage(stage, env, used, report)
            # a model used again (by a later stage, or by the next run) stays loaded if all fit together
            later = set(self.doc.models) if keep_loaded else \
                {s.model for top in self.doc.stages[index + 1:] if self.runs(top) for s in model_stages([top])}
            self._end_stage(used, before, report, peak_rss.peak() if measured else None,
                            keep=later if fit else set())
            if self.progress and stage.loop is None:
                self.progress(stage.name, 1, 1)
            report.stage_seconds[stage.name] = time.perf_counter() - t0
            # a stage's peak is at least what it started with: Linux's RSS counters are cached per thread (synced
            # every 64 faults), so VmRSS read at the start can exceed the high-water mark read at the end
            report.rss[stage.name] = {"rss_at_start_bytes": start, "max_rss_bytes": max(peak_rss.peak(), start or 0),
                                      "per_stage": measured}
        return report

    def output_value(self, name: str, env: Mapping[str, Any]) -> Any:
        """The value of the pipeline's declared output ``name`` after a run (its ``value`` expression)."""
        return self._eval(self.doc.outputs[name].value, env, f"outputs.{name}")

    def _fit_together(self) -> bool:
        """Whether every model stage's plan fits the budget at once (then models may stay loaded)."""
        return self.budget_bytes is None or sum(p.planned_peak for p in self.plans or ()) <= self.budget_bytes

    def _end_stage(self, used: set[str], before: Mapping[str, float], report: RunReport, max_rss: int | None,
                   keep: set[str]) -> None:
        """Record the figures of the models a top-level stage ran; release those not in ``keep``."""
        for name in sorted(used):
            engine = self._engines[name]
            if engine.stats.planned_peak is not None:
                report.planned_peak[name] = engine.stats.planned_peak
                report.weight_bytes[name] = engine.stats.weight_bytes or 0
            # this run's compiling, planning and loading: 0 for a model kept loaded from an earlier run
            report.compile_seconds[name] = report.compile_seconds.get(name, 0.0) + \
                engine.stats.compile_s - before.get(name, 0.0)
            if name not in keep:
                self._release_model(name)  # its streaming figures are final once released
            report.memory[name] = dict(engine.stats.memory(), max_rss_bytes=max_rss)

    def _release_model(self, name: str) -> None:
        engine = self._engines.pop(name, None)
        if engine is not None:
            engine.release()
        checkpoint = self._checkpoints.get(name)
        if checkpoint is not None:
            checkpoint.close()  # drop its file maps: one model resident at a time (mapped again when loaded)
        heap.trim()  # what the model's run freed (arenas below malloc's mmap threshold, host steps' arrays)

    def release(self) -> None:
        """Release every model kept loaded (executables, arenas, file maps); built graphs and plans stay."""
        for name in list(self._engines):
            self._release_model(name)

    def _stage(self, stage: StageSpec, env: dict, used: set[str], report: RunReport, loop: str = "") -> None:
        where = f"stage '{stage.name}'"
        if not self.runs(stage):
            for target in [*stage.outputs.values(), *_written(stage.steps)]:
                if target not in env:
                    self._skipped[target] = stage.name
            if stage.loop is not None:  # a loop that does not run collects nothing
                env.update({target: [] for target in stage.loop.collect.values()})
            return
        if stage.loop is not None:
            over = self._eval(stage.loop.over, env, f"{where} loop.over")
            items = range(int(over)) if isinstance(over, (int, np.integer)) else list(over)
            total = len(items)
            collected: dict[str, list] = {name: [] for name in stage.loop.collect}
            if self.progress:  # the loop's start: its rate is measured from here
                self.progress(stage.name, 0, total)
            for k, item in enumerate(items):
                env[stage.loop.var] = item
                t0 = time.perf_counter()
                for sub in stage.steps:
                    self._stage(sub, env, used, report, f"{loop}{stage.name} iteration {k + 1} of {total}, ")
                for name, values in collected.items():
                    values.append(env[name])
                report.step_seconds.append(time.perf_counter() - t0)
                if self.progress:
                    self.progress(stage.name, k + 1, total)
                if self.on_loop_step is not None and stage.loop.carry:
                    self.on_loop_step(stage.name, k + 1, total, env.get(stage.loop.carry[0]))
            env.update({stage.loop.collect[name]: values for name, values in collected.items()})
            return
        args = {k: self._eval(v, env, f"{where} inputs.{k}") for k, v in stage.inputs.items()}
        if stage.run is not None:
            try:
                with np.errstate(over="ignore", invalid="ignore", divide="ignore"):  # checked below, by stage
                    result = steps()[stage.run](self.context, **args)
            except TypeError as exc:
                raise PipelineError(f"{self.path}: {where}: step '{stage.run}' {exc}") from None
        else:
            if stage.model not in self.doc.models:
                raise PipelineError(f"{self.path}: {where}: unknown model '{stage.model}'")
            if stage.model not in self._engines:
                plans = [p for p in self.plans or () if p.model == stage.model]
                self._engines[stage.model] = ModelEngine(self.model(stage.model), self.runtime,
                                                         budget_bytes=self.budget_bytes, compile=self.compile,
                                                         plans=plans, host_budget_bytes=self.host_budget_bytes)
            used.add(stage.model)
            arrays = {k: np.asarray(v, dtype=np.float32) if np.asarray(v).dtype == np.float64 else np.asarray(v)
                      for k, v in args.items()}
            if stage.model not in self._index_tables:
                self._index_tables[stage.model] = index_tables(self.model(stage.model).graph)
            _check_indices(self._index_tables[stage.model], arrays, f"{self.path}: {where} ({loop}model "
                           f"{stage.model})", {k: stage.inputs.get(k) for k in arrays})
            with np.errstate(over="ignore", invalid="ignore", divide="ignore"):  # checked below, by stage
                result = self._engines[stage.model](arrays)
        for key, target in stage.outputs.items():
            if key not in result:
                raise PipelineError(f"{self.path}: {where}: the step has no output '{key}' "
                                    f"(it returns {', '.join(result)})")
            if not self.allow_nonfinite:
                action = f"model {stage.model}" if stage.model else f"step {stage.run}"
                _check_finite(result[key], f"{where} ({loop}{action}) output '{key}'")
            env[target] = result[key]


def plan_params(doc: PipelineRecipe) -> set[str]:
    """The names a pipeline's models and memory plans depend on: those a model's ``set:``, a model stage's ``dims``
    or a stage's ``when:`` read (parameters among them, and other names)."""
    found: set[str] = set()

    def names(text: Any) -> None:
        if isinstance(text, str):
            with contextlib.suppress(ExprError):  # reported where it is evaluated
                found.update(n.id for n in names_in(parse(unwrap(text))))

    for spec in doc.models.values():
        for text in spec.set.values():
            if isinstance(text, str) and is_wrapped(text):
                names(text)

    def walk(stages: Sequence[StageSpec]) -> None:
        for stage in stages:
            names(stage.when)
            for text in stage.dims.values():
                names(text)
            walk(stage.steps)

    walk(doc.stages)
    return found


def _made(stages: list[StageSpec]) -> list[str]:
    """The values stages make while running: their outputs, loop variables and what loops collect."""
    out = []
    for stage in stages:
        out += list(stage.outputs.values())
        if stage.loop is not None:
            out += [stage.loop.var, *stage.loop.collect.values()]
        out += _made(stage.steps)
    return out


def _checked_stages(stages: list[StageSpec], runs: Callable[[StageSpec], bool],
                    at: tuple = ("stages",)) -> list[tuple[tuple, StageSpec]]:
    """The ``run:`` stages (loop bodies included) under stages whose `when:` holds, with their key paths."""
    out = []
    for index, stage in enumerate(stages):
        if not runs(stage):
            continue
        if stage.run is not None:
            out.append((at + (index,), stage))
        out += _checked_stages(stage.steps, runs, at + (index, "steps"))
    return out


def _written(stages: list[StageSpec]) -> list[str]:
    """The values the stages (loop bodies included) write."""
    return [v for s in stages for v in [*s.outputs.values(), *_written(s.steps)]]


def _is_of_type(value: Any, declared: str) -> bool:
    """Whether ``value`` is of a pipeline input's declared type (``PipelineInput.type``)."""
    if declared.startswith("list["):
        return isinstance(value, list | tuple) and all(_is_of_type(v, declared[5:-1]) for v in value)
    checks = {
        "str": lambda v: isinstance(v, str),
        "bool": lambda v: isinstance(v, bool | np.bool_),
        "int": lambda v: isinstance(v, int | np.integer) and not isinstance(v, bool),
        "float": lambda v: isinstance(v, int | float | np.integer | np.floating) and not isinstance(v, bool),
        "array": lambda v: isinstance(v, np.ndarray),
    }
    return checks[declared](value)


def index_tables(graph) -> dict[str, list[tuple[str, int]]]:
    """Model input name -> the weights whose rows it indexes (``Gather`` with the input, through casts, as its
    indices and a weight, through casts, as its table): ``[(weight name, rows)]``."""
    nodes = graph.nodes

    def source(node_id: int):
        node = nodes[node_id]
        while node.op == "Cast" and node.inputs:
            node = nodes[node.inputs[0][0]]
        return node

    out: dict[str, list[tuple[str, int]]] = {}
    for node in nodes:
        if node.op != "Gather" or len(node.inputs) != 2:
            continue
        table, index = source(node.inputs[0][0]), source(node.inputs[1][0])
        if table.op == "Input" and index.op == "Input" and index.attr("kind") == "input" and table.shape \
                and isinstance(table.shape[0], int):
            out.setdefault(index.attr("name"), []).append((table.attr("name"), int(table.shape[0])))
    return out


def _check_indices(tables: Mapping[str, list[tuple[str, int]]], arrays: Mapping[str, Any], where: str,
                   sources: Mapping[str, Any]) -> None:
    """Every id a model input feeds to an embedding-like lookup (``tables``: ``index_tables`` of its graph) indexes
    a row of its weight (token ids from a tokenizer larger than the model's vocabulary, say): checked before the
    model runs, naming the input, where its value came from, the id and the weight with its size."""
    for name, uses in tables.items():
        value = arrays.get(name)
        if not isinstance(value, np.ndarray) or value.size == 0 or value.dtype.kind not in "iu":
            continue
        lo, hi = int(value.min()), int(value.max())
        for weight, rows in uses:
            if lo < 0 or hi >= rows:
                bad = lo if lo < 0 else hi
                position = tuple(int(i) for i in np.argwhere(value == bad)[0])
                came = f" (from {sources[name]})" if sources.get(name) else ""
                raise PipelineError(
                    f"{where}: input '{name}'{came} holds id {bad} at {list(position)}, beyond the {rows} rows of the "
                    f"weight {weight} (ids 0..{rows - 1}): the tokenizer (or the step producing the ids) does not "
                    f"match this checkpoint's model; use the tokenizer saved with these weights.")


def _check_finite(value: Any, what: str) -> None:
    """Stop with an error naming the stage when a floating-point output holds NaN or infinity."""
    counts = nonfinite_counts(value)
    if counts is None:
        return
    nan, inf = counts
    raise PipelineError(
        f"{what} holds non-finite values ({nan} NaN, {inf} infinite of {value.size}); the outputs would be "
        f"garbage. Check the checkpoint's weights and the parameters (flags, --set ...), or pass --allow-nonfinite "
        f"to write them anyway."
    )


def _read_json(path: Path) -> dict:
    try:
        return read_json(path, "a config.json for planning", MAX_JSON_BYTES, PipelineError)
    except FileNotFoundError:
        raise PipelineError(f"{path}: no config.json for planning; add it to the pipeline's `configs:` folder") \
            from None
    except OSError as exc:
        raise PipelineError(f"{path}: cannot read it as JSON ({exc}).") from None
