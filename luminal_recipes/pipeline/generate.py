"""A pipeline run as the CLI does it: check every flag before any work, plan every model stage under the memory
budget (failing before any weight is read if a stage cannot fit), load the pipeline once, run each prompt, write
each declared output by its type (``outputs.py``: image -> PNG, array -> .npy, text -> .txt), and summarise
timings (the whole command and its compile share) and memory (planned and measured, per stage).

A flag for a parameter (``--steps``, ``--seed``...) sets the pipeline parameter of that name and is an error when
the pipeline declares none. What a value may be is the task plug-ins' to say (``plugins.py``): the plug-ins whose
steps the pipeline runs check its parameters (``PARAM_CHECKS``), read the inputs given on the command line (the
prompts, ``--init-latents``: ``INPUTS``) and describe the run in the files it writes (``DESCRIBE``), all before
any work.

The budget is ``--max-memory``, or by default what the runtime's device has (``Runtime.capacity()``; for numpy,
the least of physical memory, the container's limit and ``ulimit -v``, less what is in use:
``luminal_recipes.memory_limits``, which also refuses a ``--max-memory`` beyond those limits). On a device runtime
(cuda) ``--max-host-memory`` bounds the pinned host buffers streamed weights are staged through. ``--compute-dtype``
replaces every model's compute dtype (``recipe.builder.with_compute_dtype``)."""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from .. import memory_limits
from ..errors import PipelineError, RecipeError
from ..recipe.loader import load_recipe
from ..recipe.lora import parse_lora_flag
from ..recipe.params import parse_sets
from ..recipe.schema import PipelineRecipe
from ..recipe.suggest import did_you_mean, one_of
from ..runtimes.profile import KernelProfile, profiling
from ..runtimes.registry import get_runtime
from .driver import Pipeline
from .outputs import (
    DEFAULT_OUTPUT_DIR,
    EXTENSIONS,
    Output,
    check_explicit_output,
    check_output_folder,
    convert,
    output_stem,
    run_text,
    write_numbered,
)
from .outputs import write as write_output
from .plan import check_host_budget
from .plugins import Task, tasks_of
from .provenance import checkpoint_hash, model_name, provenance, weights_source
from .seeds import batch_seeds, parse_seed

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20, "gi": 2**30,
          "gib": 2**30, "ti": 2**40, "tib": 2**40}


def parse_size(text: str | None, flag: str = "--max-memory") -> int | None:
    """``"24GiB"`` -> bytes (``GB`` is 10^9, ``GiB`` 2^30); ``None`` stays None. Errors name ``flag``."""
    if text is None:
        return None
    m = _SIZE.match(str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise PipelineError(f"{flag} {text!r}: expected a size such as 24GiB, 16GB or 800MiB")
    value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value <= 0:
        raise PipelineError(f"{flag} {text!r}: the budget must be positive")
    return value


@dataclass
class GenerateRequest:
    recipe: Path
    prompts: list[str]
    # pipeline parameters given by flags of their own name (--steps 4: {"steps": 4}); None: the flag was not given
    params: dict[str, Any] = field(default_factory=dict)
    # pipeline inputs `run` reads from files (--init-latents x.npy: {"init_latents": Path("x.npy")}; a repeatable
    # flag gives a list: --image a.png --image b.png: {"images": [Path("a.png"), Path("b.png")]}); None: not given
    files: dict[str, Path | list[Path] | None] = field(default_factory=dict)
    output: Path | None = None
    weights: str | None = None
    sets: list[str] = field(default_factory=list)
    max_memory: int | None = None  # bytes; None: what the machine has
    compile: bool = True
    overwrite: bool = False  # an existing --output may be replaced
    allow_nonfinite: bool = False  # write the outputs even when a stage output holds NaN or infinity
    started: float | None = None  # time.perf_counter() when the command started (default: when generate does)
    runtime: str = "numpy"  # the runtime (device) to run on; the budget is its device's memory
    max_host_memory: int | None = None  # bytes of pinned host staging for streamed weights (device runtimes)
    compute_dtype: str | None = None  # every model's compute dtype (None: each recipe's weights.dtype.compute)
    profile: bool = False  # time every kernel call; the summary gets "profile" (seconds per model and kernel)
    loras: list = field(default_factory=list)  # --lora PATH[:SCALE] (or (path, scale) pairs)
    num_images: int = 1  # images per prompt, seeds seed, seed + 1, ... (seeds.py)
    random_default_seed: bool = False  # an omitted seed is drawn (or $LUMINAL_RECIPES_SEED): the CLI's default
    command: str | None = None  # the command (or Python call) recorded in the outputs


# inputs whose flag is not their name: a repeatable flag in the singular (--image) fills a list input (images)
FLAGS = {"images": "--image"}


def flag(name: str) -> str:
    """The command-line flag of a parameter or input: ``init_latents`` -> ``--init-latents``."""
    return FLAGS.get(name) or "--" + name.replace("_", "-")


def _declared_outputs(pipe: Pipeline) -> dict[str, Output]:
    recipe = pipe.recipe
    if not pipe.doc.outputs:
        raise RecipeError(f"{recipe.path}: pipeline '{pipe.doc.name}' declares no `outputs:`, so `run` has nothing "
                          f"to write; add e.g. `outputs: {{image: {{value: image, type: image}}}}`")
    return {name: Output(name, spec.type, str(recipe.origin("outputs", name).loc(key=True)))
            for name, spec in pipe.doc.outputs.items()}


def _check_inputs(pipe: Pipeline, req: GenerateRequest) -> None:
    """Every input the pipeline needs is one `run` provides, and every input given is one it takes."""
    inputs = pipe.doc.inputs
    provided = {"prompt": "--prompt", **{name: flag(name) for name in req.files}}
    for name, spec in inputs.items():
        if name not in provided and not spec.optional:
            raise pipe.recipe.origin("inputs", name).error(
                f"pipeline input '{name}' ({spec.type}) is required, but `luminal-recipe run` only provides "
                f"{', '.join(f'{k} ({f})' for k, f in provided.items())}; make it optional or derive it "
                f"from a parameter (--set)", key=True)
    if req.prompts and "prompt" not in inputs:
        raise PipelineError(f"--prompt: pipeline '{pipe.doc.name}' ({req.recipe}) takes no `prompt` input; "
                            f"run it without --prompt/--prompts-file")
    if not req.prompts and "prompt" in inputs and not inputs["prompt"].optional:
        raise PipelineError("no prompt: pass --prompt TEXT (repeatable) or --prompts-file FILE")
    for name, path in req.files.items():
        if path is not None and name not in inputs:
            raise PipelineError(f"{flag(name)}: pipeline '{pipe.doc.name}' ({req.recipe}) takes no `{name}` input")


MAX_INLINE_ELEMENTS = 65536  # arrays up to this size (an embedding) are also given in --json, as nested lists


def _inline(kind: str, value) -> dict:
    """What --json shows of an output besides its file: a text's text, a small array's shape and values."""
    if kind == "text":
        return {"text": value}
    if kind == "array" and np.size(value) <= MAX_INLINE_ELEMENTS:
        array = np.asarray(value)
        return {"shape": list(array.shape), "dtype": str(array.dtype), "values": array.tolist()}
    return {}


def _check_explicit(path: Path, only: Output, overwrite: bool) -> None:
    """``--output`` for the pipeline's one output: an extension its type is written with, and the checks of
    ``outputs.check_explicit_output`` (an existing file needs ``overwrite``)."""
    kinds = [only.type] if only.type else ["array", "text"]  # undeclared: known once the value exists
    suffix = path.suffix.lower()
    if suffix not in (EXTENSIONS[k] for k in kinds):
        raise PipelineError(f"--output {path}: output '{only.name}' is written as "
                            f"{' or '.join(EXTENSIONS[k] for k in kinds)}; use that extension")
    check_explicit_output(path, next(k for k in kinds if EXTENSIONS[k] == suffix), overwrite)


def _flag_sets(req: GenerateRequest, params: Mapping[str, Any] | None = None) -> tuple[list[str], dict[str, str]]:
    """The ``--set`` list the parameter flags add to, and how each flag's value was given (for messages);
    malformed or repeated ``--set`` values, and a flag and a ``--set`` for one parameter, are refused."""
    given = parse_sets(req.sets)
    sets, sources = list(req.sets), {}
    for name, value in (req.params if params is None else params).items():
        if value is None:
            continue
        if name in given:
            raise PipelineError(f"{flag(name)} {value} and --set {name}={given[name][0]} both set '{name}'; give "
                                f"it once.")
        sets.append(f"{name}={value}")
        sources[name] = f"{flag(name)} {value}"
    return sets, sources


def _read_input(tasks: list[Task], name: str, value: Any, params: Mapping[str, Any]) -> Any:
    """``value`` as the plug-ins that read input ``name`` make it (each in turn; none: as given)."""
    readers = [task.inputs[name] for task in tasks if name in task.inputs]
    if not readers and (isinstance(value, Path) or isinstance(value, list) and any(isinstance(v, Path)
                                                                                  for v in value)):
        raise PipelineError(f"{flag(name)}: no task plug-in of this pipeline reads input '{name}' from a file")
    for read in readers:
        value = read(value, params)
    return value


@dataclass
class RunResult:
    """One run of a pipeline: its outputs by name (``(type, value)``: an image is still the decoded array), what
    the output files record (``text``: PNG text chunks), the seed, the parameters and the driver's report."""

    prompt: str | None
    seed: int | None
    values: dict[str, tuple[str, Any]]
    text: dict[str, str]
    params: dict[str, Any]
    report: Any
    seconds: float


class PipelineSession:
    """A pipeline recipe made ready to run, the one path `luminal-recipe run` and the Python API
    (``luminal_recipes.Pipeline``) share: every flag checked, the pipeline built with its parameters, LoRAs and
    file inputs (the parameters derived from them), the prompts read and checked by the plug-ins before any work,
    every stage planned (``prepare``), then any number of runs (``run``: one prompt and seed each; the models stay
    loaded between them when they fit the budget together); ``release`` drops what is kept."""

    def __init__(self, req: GenerateRequest, progress: Callable[[str, int, int], None] | None = None):
        self.req = req
        self.runtime = get_runtime(req.runtime)
        self.budget = memory_limits.budget(self.runtime, req.max_memory)  # --max-memory, or what is free
        check_host_budget(self.runtime, req.max_host_memory)
        doc = load_recipe(req.recipe).doc  # the flags must name declared parameters before they are resolved
        params = dict(req.params)
        if isinstance(doc, PipelineRecipe):
            for name, value in params.items():
                if value is not None and name not in doc.params:
                    raise PipelineError(f"{flag(name)}: pipeline '{doc.name}' ({req.recipe}) has no parameter "
                                        f"'{name}'{did_you_mean(name, doc.params)}; its parameters: "
                                        f"{one_of(doc.params)}")
            if req.num_images != 1 and "seed" not in doc.params:
                raise PipelineError(f"--num-images {req.num_images}: pipeline '{doc.name}' ({req.recipe}) has no "
                                    f"seed parameter, so its runs would all be the same; run it once")
        # the seeds of the batch: --seed (or `random`), else --set seed=..., else the default (drawn when the
        # request says so, else the recipe's); the first is the pipeline's own value, the others given per run
        self.seeds: list[int | None] | None = None
        if isinstance(doc, PipelineRecipe) and "seed" in doc.params:
            given = params.get("seed")
            if given is None and req.random_default_seed and "seed" not in parse_sets(req.sets):
                given = parse_seed(None)
            if given is not None:
                self.seeds = list(batch_seeds(given, req.num_images))
                params["seed"] = self.seeds[0]
        sets, sources = _flag_sets(req, params)
        loras = [parse_lora_flag(text) if isinstance(text, str) else text for text in req.loras]
        self.pipe = pipe = Pipeline(req.recipe, weights=req.weights, sets=sets, budget_bytes=self.budget,
                                    compile=req.compile, progress=progress, set_sources=sources,
                                    allow_nonfinite=req.allow_nonfinite, runtime=self.runtime,
                                    host_budget_bytes=req.max_host_memory, compute_dtype=req.compute_dtype,
                                    loras=loras)
        self.tasks = tasks_of(pipe.doc)
        self.declared = _declared_outputs(pipe)
        _check_inputs(pipe, req)
        check_params(pipe, self.tasks)
        if self.seeds is None:  # the recipe's seed (or --set seed=...): the batch counts from it
            value = pipe.params.get("seed")
            self.seeds = list(batch_seeds(value, req.num_images)) \
                if isinstance(value, int) and not isinstance(value, bool) else [None]
        self.given = {name: value for name, value in req.files.items() if value is not None}
        self.file_inputs = read_file_inputs(pipe, self.tasks, self.given)
        self.recipe_hash = _recipe_hash(pipe.recipe.files)
        self.compile_seconds = 0.0
        self._provenance: dict[str, str] | None = None

    def read_prompts(self, prompts: list[str]) -> list[str | None]:
        """The prompts as the plug-ins read them (checked), ``[None]`` for a pipeline without a prompt input;
        every prompt as its steps will take it (tokenized...) is checked before any work."""
        pipe = self.pipe
        _check_inputs(pipe, replace(self.req, prompts=list(prompts)))
        read: list[str | None] = list(prompts) if "prompt" in pipe.doc.inputs and prompts else [None]
        for index, prompt in enumerate(read):
            if prompt is None:
                continue
            try:
                read[index] = _read_input(self.tasks, "prompt", prompt, pipe.params)
            except PipelineError as exc:
                where = f"prompt {index + 1} of {len(read)}" if len(read) > 1 else "the prompt"
                raise PipelineError(f"{where}: {exc}") from None
        pipe.check_runs([self.inputs(prompt) for prompt in read],
                        [f"prompt {k + 1} of {len(read)}" if len(read) > 1 else "the prompt"
                         if prompt is not None else "" for k, prompt in enumerate(read)])
        return read

    def inputs(self, prompt: str | None) -> dict:
        return _run_inputs(self.pipe, self.req, self.file_inputs, prompt)

    def prepare(self) -> None:
        """LoRAs mapped, every stage compiled and planned under the budget, before any weight is read."""
        if self.pipe.plans is None:
            self.pipe.check_loras()  # a LoRA that does not fit its model is refused before any planning
            t0 = time.perf_counter()
            self.pipe.prepare()
            self.compile_seconds = time.perf_counter() - t0  # the compile share of the summary (cache loads too)

    @property
    def applied_loras(self) -> list[str]:
        return [f"{spec.path}:{spec.scale:g} ({model})" for model, specs in self.pipe.loras.items() for spec in specs]

    def provenance(self) -> dict[str, str]:
        """What every output of this session records besides its prompt and settings (``provenance.py``)."""
        if self._provenance is None:
            pipe, req = self.pipe, self.req
            folder = pipe.checkpoint
            source = weights_source(req.weights if req.weights is not None else pipe.doc.weights, folder)
            images = self.given.get("images") or []
            self._provenance = {"weights": source, "weights_hash": checkpoint_hash(folder), "runtime":
                                self.runtime.name, "device": self.runtime.device,
                                "compute_dtype": req.compute_dtype, "loras": self.applied_loras, "images":
                                list(images), "command": req.command,
                                # A1111's Model: the recipe for its own checkpoint, else the folder or repository
                                "model": pipe.doc.name if req.weights is None else model_name(source)}
        return self._provenance

    def run(self, prompt: str | None, seed: int | None = None, keep_loaded: bool = False,
            profile: KernelProfile | None = None, params: Mapping[str, Any] | None = None) -> RunResult:
        """One run: ``prompt`` (read by ``read_prompts``) with ``seed`` (None: the pipeline's own) and ``params``
        for this run only (parameters the plans do not depend on: steps, guidance...)."""
        self.prepare()
        pipe = self.pipe
        t0 = time.perf_counter()
        params = {k: v for k, v in (params or {}).items() if v is not None and v != pipe.params.get(k)}
        if seed is not None and seed != pipe.params.get("seed"):
            params["seed"] = seed
        run_params = pipe.run_values(params) if params else dict(pipe.params)
        for name in params:  # checked as the plug-ins check the flags
            for task in self.tasks:
                if name in task.param_checks:
                    task.param_checks[name](run_params[name], f"{flag(name)} {run_params[name]}")
        params = params or None
        if profile is not None:
            with profiling(profile):
                report = pipe.run(self.inputs(prompt), keep_loaded=keep_loaded, params=params)
        else:
            report = pipe.run(self.inputs(prompt), keep_loaded=keep_loaded, params=params)
        values = {name: convert(out, pipe.output_value(name, report.values)) for name, out in self.declared.items()}
        settings: dict[str, str] = {}
        for task in self.tasks:
            if task.describe is not None:
                settings.update(task.describe(run_params, dict(self.given, prompt=prompt)))
        known = self.provenance()
        text = run_text(prompt, pipe.doc.name, self.recipe_hash, settings)
        text.update(provenance(prompt=prompt, settings=settings, **known))
        seed_used = int(run_params["seed"]) if "seed" in run_params else None
        return RunResult(prompt, seed_used, values, text, run_params, report, time.perf_counter() - t0)

    def release(self) -> None:
        self.pipe.release()  # what was kept loaded between runs

    def memory(self) -> dict:
        req, runtime = self.req, self.runtime
        return {"budget_bytes": self.budget, "budget_from": "--max-memory" if req.max_memory is not None else
                "machine memory", "runtime": runtime.name, "device": runtime.device,
                "host_staging_budget_bytes": req.max_host_memory, "compute_dtype": req.compute_dtype,
                "plans": {plan.model: plan.summary() for plan in self.pipe.prepare()}}


def generate(req: GenerateRequest, progress: Callable[[str, int, int], None] | None = None) -> dict:
    """`luminal-recipe run` for a pipeline: every prompt times every seed of the batch, each output written to
    ``--output`` or a new numbered file in outputs/; returns the summary ``--json`` prints."""
    started = req.started if req.started is not None else time.perf_counter()
    session = PipelineSession(req, progress)
    pipe = session.pipe
    prompts = session.read_prompts(list(req.prompts))
    runs_wanted = len(prompts) * len(session.seeds)
    if req.output is not None and runs_wanted > 1:
        several = "several prompts were given" if len(prompts) > 1 else f"--num-images {len(session.seeds)} was given"
        raise PipelineError(f"--output names one file, but {several}; omit --output to get one file per image "
                            f"in outputs/")
    if req.output is not None and len(session.declared) > 1:
        raise PipelineError(f"--output names one file, but pipeline '{pipe.doc.name}' writes "
                            f"{len(session.declared)} outputs ({', '.join(session.declared)}); omit --output to get "
                            f"them in outputs/")
    if req.output is not None:
        _check_explicit(req.output, next(iter(session.declared.values())), req.overwrite)
    else:
        check_output_folder()
    session.prepare()  # every stage compiled and planned under the budget before any weight is read
    profile = KernelProfile() if req.profile else None
    runs = []
    try:
        done = 0
        for prompt in prompts:
            for seed in session.seeds:
                done += 1
                result = session.run(prompt, seed, keep_loaded=done < runs_wanted, profile=profile)
                runs.append(_write_run(session, result))
    finally:
        session.release()  # what was kept loaded between prompts
    total = time.perf_counter() - started
    load_seconds = sum(sum(item["compile_seconds"].values()) for item in runs)
    compile_seconds = session.compile_seconds
    timing = {"total_seconds": round(total, 3), "compile_seconds": round(compile_seconds, 3),
              "compile_share": round(compile_seconds / total, 4) if total > 0 else 0.0,
              "load_seconds": round(load_seconds, 3)}
    summary = {"recipe": pipe.doc.name, "recipe_hash": session.recipe_hash, "params": dict(pipe.params),
               "memory": session.memory(), "timing": timing, "runs": runs}
    if profile is not None:
        summary["profile"] = profile.to_json()
        if profile.top:  # LUMINAL_RECIPES_PROFILE_TOP: the costliest kernel instances too
            summary["profile_instances"] = profile.instances_json()
    return summary


def _write_run(session: PipelineSession, result: RunResult) -> dict:
    """Write one run's outputs (``--output``, or new numbered files in outputs/); its summary entry."""
    req = session.req
    values, report = result.values, result.report
    if req.output is not None:
        ((name, (kind, value)),) = values.items()
        if EXTENSIONS[kind] != req.output.suffix.lower():  # an undeclared type, known from the value
            raise PipelineError(f"--output {req.output}: output '{name}' is {kind}, written as "
                                f"{EXTENSIONS[kind]}; use that extension (or declare its `type:`)")
        paths = {name: write_output(req.output, kind, value, result.text, overwrite=req.overwrite)}
    else:
        several = len(session.declared) > 1
        stems = {name: output_stem(req.recipe.stem, result.seed, result.prompt, name if several else None)
                 for name in session.declared}
        paths = write_numbered(DEFAULT_OUTPUT_DIR, stems, values, result.text)
    outputs = {name: {"type": kind, "path": str(paths[name])} | _inline(kind, value)
               for name, (kind, value) in values.items()}
    return {
        "prompt": result.prompt,
        "seed": result.seed,
        "path": str(next(iter(paths.values()))),
        "outputs": outputs,
        "seconds": round(result.seconds, 3),
        "stage_seconds": {k: round(v, 3) for k, v in report.stage_seconds.items()},
        "step_seconds": [round(s, 4) for s in report.step_seconds],
        "compile_seconds": {k: round(v, 3) for k, v in report.compile_seconds.items()},
        "planned_peak_bytes": report.planned_peak,
        "weight_bytes": report.weight_bytes,
        "memory": report.memory,
        "rss": report.rss,
    }


def _run_inputs(pipe: Pipeline, req: GenerateRequest, file_inputs: Mapping[str, Any], prompt: str | None) -> dict:
    """The pipeline inputs of the run for ``prompt``."""
    inputs = {name: file_inputs.get(name) for name in req.files if name in pipe.doc.inputs}
    if prompt is not None:
        inputs["prompt"] = prompt
    return inputs


def check_params(pipe: Pipeline, tasks: list[Task]) -> None:
    """Every parameter the pipeline's plug-ins check, however it was given."""
    p = pipe.params
    for task in tasks:
        for name, check in task.param_checks.items():
            if name in p:
                check(p[name], pipe.resolved.set_by.get(name) or f"{name}={p[name]!r} (the recipe's default)")


def read_file_inputs(pipe: Pipeline, tasks: list[Task], given: Mapping[str, Any]) -> dict[str, Any]:
    """The inputs given as files, read by the plug-ins. Those some plug-in derives parameters from (``DERIVE``:
    the output size from the first reference image...) are read first; the derived values are set on ``pipe``
    and checked; then the other inputs are read with them (a reader may check a file against them)."""
    deriving = [name for name in given if any(name in task.derive for task in tasks)]
    inputs = {name: _read_input(tasks, name, given[name], pipe.params) for name in deriving}
    derived: dict[str, tuple[Any, str]] = {}
    for name in deriving:
        for task in tasks:
            if name in task.derive:
                derived.update(task.derive[name](inputs[name], pipe.params, dict(pipe.resolved.set_by)))
    if derived:
        pipe.derive(derived)
        check_params(pipe, tasks)
    inputs.update({name: _read_input(tasks, name, value, pipe.params) for name, value in given.items()
                   if name not in inputs})
    return {name: inputs[name] for name in given}


def derived_sets(recipe: Path, weights: str | None, sets: list[str], files: Mapping[str, Any]) -> list[str]:
    """``sets`` and the ``--set`` values of the parameters the pipeline's plug-ins derive from ``files`` (the
    inputs `run` would read from them), so `inspect --image a.png` shows the parameters and memory plans of
    `run --image a.png`."""
    pipe = Pipeline(recipe, weights=weights, sets=sets)
    tasks = tasks_of(pipe.doc)
    given = {name: value for name, value in files.items() if value}
    for name in given:
        if name not in pipe.doc.inputs:
            raise PipelineError(f"{flag(name)}: pipeline '{pipe.doc.name}' ({recipe}) takes no `{name}` input")
    read_file_inputs(pipe, tasks, given)
    return pipe.set_strings()


def _recipe_hash(files: list[Path]) -> str:
    """The first 16 hex digits of a SHA-256 over the pipeline recipe file and every file it extends."""
    digest = hashlib.sha256()
    for path in files:
        digest.update(Path(path).read_bytes())
    return digest.hexdigest()[:16]
