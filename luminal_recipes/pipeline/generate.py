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
from dataclasses import dataclass, field
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
    loras: list[str] = field(default_factory=list)  # --lora PATH[:SCALE]


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


def _flag_sets(req: GenerateRequest) -> tuple[list[str], dict[str, str]]:
    """The ``--set`` list the parameter flags add to, and how each flag's value was given (for messages);
    malformed or repeated ``--set`` values, and a flag and a ``--set`` for one parameter, are refused."""
    given = parse_sets(req.sets)
    sets, sources = list(req.sets), {}
    for name, value in req.params.items():
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


def generate(req: GenerateRequest, progress: Callable[[str, int, int], None] | None = None) -> dict:
    started = req.started if req.started is not None else time.perf_counter()
    sets, sources = _flag_sets(req)
    runtime = get_runtime(req.runtime)
    budget = memory_limits.budget(runtime, req.max_memory)  # --max-memory, or what the process may still use
    check_host_budget(runtime, req.max_host_memory)
    doc = load_recipe(req.recipe).doc  # the flags must name declared parameters before they are resolved
    if isinstance(doc, PipelineRecipe):
        for name, value in req.params.items():
            if value is not None and name not in doc.params:
                raise PipelineError(f"{flag(name)}: pipeline '{doc.name}' ({req.recipe}) has no parameter '{name}'"
                                    f"{did_you_mean(name, doc.params)}; its parameters: {one_of(doc.params)}")
    loras = [parse_lora_flag(text) for text in req.loras]
    pipe = Pipeline(req.recipe, weights=req.weights, sets=sets, budget_bytes=budget, compile=req.compile,
                    progress=progress, set_sources=sources, allow_nonfinite=req.allow_nonfinite, runtime=runtime,
                    host_budget_bytes=req.max_host_memory, compute_dtype=req.compute_dtype, loras=loras)
    p = pipe.params
    tasks = tasks_of(pipe.doc)
    declared = _declared_outputs(pipe)
    _check_inputs(pipe, req)
    prompts: list[str | None] = list(req.prompts) if "prompt" in pipe.doc.inputs and req.prompts else [None]
    if req.output is not None and len(prompts) > 1:
        raise PipelineError("--output names one file, but several prompts were given; omit --output to get one "
                            "file per prompt in outputs/")
    if req.output is not None and len(declared) > 1:
        raise PipelineError(f"--output names one file, but pipeline '{pipe.doc.name}' writes {len(declared)} "
                            f"outputs ({', '.join(declared)}); omit --output to get them in outputs/")
    check_params(pipe, tasks)
    for index, prompt in enumerate(prompts):
        if prompt is None:
            continue
        try:
            prompts[index] = _read_input(tasks, "prompt", prompt, p)
        except PipelineError as exc:
            where = f"prompt {index + 1} of {len(prompts)}" if len(prompts) > 1 else "the prompt"
            raise PipelineError(f"{where}: {exc}") from None
    given = {name: path for name, path in req.files.items() if path is not None}
    file_inputs = read_file_inputs(pipe, tasks, given)
    p = pipe.params
    if req.output is not None:
        _check_explicit(req.output, next(iter(declared.values())), req.overwrite)
    else:
        check_output_folder()
    recipe_hash = _recipe_hash(pipe.recipe.files)
    seed = int(p["seed"]) if "seed" in p else None
    # every prompt as its steps will take it (tokenized...), before any work: not the second after the first's file
    pipe.check_runs([_run_inputs(pipe, req, file_inputs, prompt) for prompt in prompts],
                    [f"prompt {k + 1} of {len(prompts)}" if len(prompts) > 1 else "the prompt"
                     if prompt is not None else "" for k, prompt in enumerate(prompts)])
    pipe.check_loras()  # a LoRA that does not fit its model is refused before any planning
    t_prepare = time.perf_counter()
    pipe.prepare()  # every stage compiled and planned under the budget before any weight is read
    compile_seconds = time.perf_counter() - t_prepare  # the compile share of the summary (plan-cache loads too)
    profile = KernelProfile() if req.profile else None
    try:
        runs = _run_prompts(pipe, req, prompts, file_inputs, given, declared, tasks, recipe_hash, seed, profile)
    finally:
        pipe.release()  # what was kept loaded between prompts
    memory = {"budget_bytes": budget, "budget_from": "--max-memory" if req.max_memory is not None else
              "machine memory", "runtime": runtime.name, "device": runtime.device,
              "host_staging_budget_bytes": req.max_host_memory, "compute_dtype": req.compute_dtype,
              "plans": {plan.model: plan.summary() for plan in pipe.prepare()}}
    total = time.perf_counter() - started
    load_seconds = sum(sum(item["compile_seconds"].values()) for item in runs)
    timing = {"total_seconds": round(total, 3), "compile_seconds": round(compile_seconds, 3),
              "compile_share": round(compile_seconds / total, 4) if total > 0 else 0.0,
              "load_seconds": round(load_seconds, 3)}
    summary = {"recipe": pipe.doc.name, "recipe_hash": recipe_hash, "params": dict(pipe.params), "memory": memory,
               "timing": timing, "runs": runs}
    if profile is not None:
        summary["profile"] = profile.to_json()
        if profile.top:  # LUMINAL_RECIPES_PROFILE_TOP: the costliest kernel instances too
            summary["profile_instances"] = profile.instances_json()
    return summary


def _run_prompts(pipe: Pipeline, req: GenerateRequest, prompts: list[str | None], file_inputs: dict, given: dict,
                 declared: dict[str, Output], tasks: list[Task], recipe_hash: str, seed: int | None,
                 profile: KernelProfile | None) -> list[dict]:
    """Run the pipeline once per prompt and write its outputs; models stay loaded from one prompt to the next
    (when they fit the budget together), so only the first prompt loads them. ``profile`` times every kernel."""
    p = pipe.params
    runs = []
    for index, prompt in enumerate(prompts):
        t0 = time.perf_counter()
        inputs = _run_inputs(pipe, req, file_inputs, prompt)
        keep = index + 1 < len(prompts)  # more prompts follow: models stay loaded (when they fit together)
        if profile is not None:
            with profiling(profile):
                report = pipe.run(inputs, keep_loaded=keep)
        else:
            report = pipe.run(inputs, keep_loaded=keep)
        values = {name: convert(out, pipe.output_value(name, report.values)) for name, out in declared.items()}
        settings = {}
        for task in tasks:
            if task.describe is not None:
                settings.update(task.describe(p, dict(given, prompt=prompt)))
        applied = [f"{spec.path}:{spec.scale:g} ({model})" for model, specs in pipe.loras.items() for spec in specs]
        if applied:
            settings["loras"] = ", ".join(applied)
        text = run_text(prompt, pipe.doc.name, recipe_hash, settings)
        if req.output is not None:
            ((name, (kind, value)),) = values.items()
            if EXTENSIONS[kind] != req.output.suffix.lower():  # an undeclared type, known from the value
                raise PipelineError(f"--output {req.output}: output '{name}' is {kind}, written as "
                                    f"{EXTENSIONS[kind]}; use that extension (or declare its `type:`)")
            paths = {name: write_output(req.output, kind, value, text, overwrite=req.overwrite)}
        else:
            several = len(declared) > 1
            stems = {name: output_stem(req.recipe.stem, seed, prompt, name if several else None)
                     for name in declared}
            paths = write_numbered(DEFAULT_OUTPUT_DIR, stems, values, text)
        outputs = {name: {"type": kind, "path": str(paths[name])} | _inline(kind, value)
                   for name, (kind, value) in values.items()}
        runs.append({
            "prompt": prompt,
            "path": str(next(iter(paths.values()))),
            "outputs": outputs,
            "seconds": round(time.perf_counter() - t0, 3),
            "stage_seconds": {k: round(v, 3) for k, v in report.stage_seconds.items()},
            "step_seconds": [round(s, 4) for s in report.step_seconds],
            "compile_seconds": {k: round(v, 3) for k, v in report.compile_seconds.items()},
            "planned_peak_bytes": report.planned_peak,
            "weight_bytes": report.weight_bytes,
            "memory": report.memory,
            "rss": report.rss,
        })
    return runs


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
