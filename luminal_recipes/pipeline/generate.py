"""A pipeline run as the CLI does it: check every flag before any work, plan every model stage under the memory
budget (failing before any weight is read if a stage cannot fit), load the pipeline once, run each prompt, write
each declared output by its type (``outputs.py``: image -> PNG, array -> .npy, text -> .txt), and summarise
timings (the whole command and its compile share) and memory (planned and measured, per stage).

The parameters the run itself reads (steps, seed, width, height, guidance) are only used when the pipeline
declares them; a flag setting one it does not declare is an error naming the flag.

The budget is ``--max-memory``, or by default what the runtime's device has (``Runtime.capacity()``; for numpy,
physical memory from ``os.sysconf``, or the container's limit when lower)."""

from __future__ import annotations

import hashlib
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import PipelineError, RecipeError
from ..recipe.loader import load_recipe
from ..recipe.params import parse_sets
from ..recipe.schema import PipelineRecipe
from ..recipe.suggest import did_you_mean, one_of
from ..runtimes.registry import get_runtime
from .driver import Pipeline
from .image_io import generation_text
from .latents import PIXELS_PER_TOKEN, check_seed, latent_grid, load_init_latents
from .outputs import (
    DEFAULT_OUTPUT_DIR,
    EXTENSIONS,
    Output,
    check_explicit_output,
    check_output_folder,
    convert,
    output_stem,
    write_numbered,
)
from .outputs import write as write_output
from .scheduler import check_steps
from .tokenize import check_prompt

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20, "gi": 2**30,
          "gib": 2**30, "ti": 2**40, "tib": 2**40}


def parse_size(text: str | None) -> int | None:
    """``"24GiB"`` -> bytes (``GB`` is 10^9, ``GiB`` 2^30); ``None`` stays None."""
    if text is None:
        return None
    m = _SIZE.match(str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise PipelineError(f"--max-memory {text!r}: expected a size such as 24GiB, 16GB or 800MiB")
    value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value <= 0:
        raise PipelineError(f"--max-memory {text!r}: the budget must be positive")
    return value


@dataclass
class GenerateRequest:
    recipe: Path
    prompts: list[str]
    seed: int | None = None
    steps: int | None = None
    guidance: float | None = None
    width: int | None = None
    height: int | None = None
    init_latents: Path | None = None
    output: Path | None = None
    weights: str | None = None
    sets: list[str] = field(default_factory=list)
    max_memory: int | None = None  # bytes; None: what the machine has
    compile: bool = True
    overwrite: bool = False  # an existing --output may be replaced
    allow_nonfinite: bool = False  # write the outputs even when a stage output holds NaN or infinity
    started: float | None = None  # time.perf_counter() when the command started (default: when generate does)
    runtime: str = "numpy"  # the runtime (device) to run on; the budget is its device's memory


# the flags `run` maps onto pipeline parameters of the same name; each needs the parameter declared
PARAM_FLAGS = ("steps", "guidance", "width", "height", "seed")
# the pipeline inputs `run` can provide, and the flag that provides each
RUN_INPUTS = {"prompt": "--prompt", "init_latents": "--init-latents"}


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
    for name, spec in inputs.items():
        if name not in RUN_INPUTS and not spec.optional:
            raise pipe.recipe.origin("inputs", name).error(
                f"pipeline input '{name}' ({spec.type}) is required, but `luminal-recipe run` only provides "
                f"{', '.join(f'{k} ({flag})' for k, flag in RUN_INPUTS.items())}; make it optional or derive it "
                f"from a parameter (--set)", key=True)
    if req.prompts and "prompt" not in inputs:
        raise PipelineError(f"--prompt: pipeline '{pipe.doc.name}' ({req.recipe}) takes no `prompt` input; "
                            f"run it without --prompt/--prompts-file")
    if not req.prompts and "prompt" in inputs and not inputs["prompt"].optional:
        raise PipelineError("no prompt: pass --prompt TEXT (repeatable) or --prompts-file FILE")
    if req.init_latents is not None and "init_latents" not in inputs:
        raise PipelineError(f"--init-latents: pipeline '{pipe.doc.name}' ({req.recipe}) takes no `init_latents` "
                            f"input")


def _check_explicit(path: Path, only: Output, overwrite: bool) -> None:
    """``--output`` for the pipeline's one output: an extension its type is written with, and the checks of
    ``outputs.check_explicit_output`` (an existing file needs ``overwrite``)."""
    kinds = [only.type] if only.type else ["array", "text"]  # undeclared: known once the value exists
    suffix = path.suffix.lower()
    if suffix not in (EXTENSIONS[k] for k in kinds):
        raise PipelineError(f"--output {path}: output '{only.name}' is written as "
                            f"{' or '.join(EXTENSIONS[k] for k in kinds)}; use that extension")
    check_explicit_output(path, next(k for k in kinds if EXTENSIONS[k] == suffix), overwrite)


def _check_arguments(req: GenerateRequest) -> tuple[list[str], dict[str, str]]:
    """Every flag, --set and prompt checked before anything is loaded; the ``--set`` list the flags add to,
    and how each flag's value was given (for messages)."""
    for index, prompt in enumerate(req.prompts):
        try:
            check_prompt(prompt)
        except PipelineError as exc:
            where = f"prompt {index + 1} of {len(req.prompts)}" if len(req.prompts) > 1 else "the prompt"
            raise PipelineError(f"{where}: {exc}") from None
    if req.steps is not None:
        check_steps(req.steps, f"--steps {req.steps}")
    if req.guidance is not None and not math.isfinite(req.guidance):
        raise PipelineError(f"--guidance {req.guidance}: the guidance scale must be a finite number, e.g. 4.0")
    if req.seed is not None:
        check_seed(req.seed, f"--seed {req.seed}")
    if req.width is not None or req.height is not None:
        latent_grid(req.height if req.height is not None else PIXELS_PER_TOKEN,
                    req.width if req.width is not None else PIXELS_PER_TOKEN)
    given = parse_sets(req.sets)  # malformed or repeated --set refused here
    sets, sources = list(req.sets), {}
    for name in PARAM_FLAGS:
        value = getattr(req, name)
        if value is None:
            continue
        if name in given:
            raise PipelineError(f"--{name} {value} and --set {name}={given[name][0]} both set '{name}'; give it "
                                f"once.")
        sets.append(f"{name}={value}")
        sources[name] = f"--{name} {value}"
    return sets, sources


def generate(req: GenerateRequest, progress: Callable[[str, int, int], None] | None = None) -> dict:
    started = req.started if req.started is not None else time.perf_counter()
    sets, sources = _check_arguments(req)
    given = {"steps": req.steps, "guidance": req.guidance, "width": req.width, "height": req.height,
             "seed": req.seed}
    runtime = get_runtime(req.runtime)
    budget = req.max_memory if req.max_memory is not None else runtime.capacity()
    doc = load_recipe(req.recipe).doc  # the flags must name declared parameters before they are resolved
    if isinstance(doc, PipelineRecipe):
        for name in PARAM_FLAGS:
            if given[name] is not None and name not in doc.params:
                raise PipelineError(f"--{name}: pipeline '{doc.name}' ({req.recipe}) has no parameter '{name}'"
                                    f"{did_you_mean(name, doc.params)}; its parameters: {one_of(doc.params)}")
    pipe = Pipeline(req.recipe, weights=req.weights, sets=sets, budget_bytes=budget, compile=req.compile,
                    progress=progress, set_sources=sources, allow_nonfinite=req.allow_nonfinite, runtime=runtime)
    p = pipe.params
    declared = _declared_outputs(pipe)
    _check_inputs(pipe, req)
    prompts: list[str | None] = list(req.prompts) if "prompt" in pipe.doc.inputs and req.prompts else [None]
    if req.output is not None and len(prompts) > 1:
        raise PipelineError("--output names one file, but several prompts were given; omit --output to get one "
                            "file per prompt in outputs/")
    if req.output is not None and len(declared) > 1:
        raise PipelineError(f"--output names one file, but pipeline '{pipe.doc.name}' writes {len(declared)} "
                            f"outputs ({', '.join(declared)}); omit --output to get them in outputs/")
    for name, check in (("steps", check_steps), ("seed", check_seed)):
        if name in p:
            check(p[name], pipe.resolved.set_by.get(name) or f"{name}={p[name]!r} (the recipe's default)")
    if isinstance(p.get("guidance"), float) and not math.isfinite(p["guidance"]):
        raise PipelineError(f"guidance={p['guidance']}: the guidance scale must be a finite number")
    if "height" in p and "width" in p:
        latent_grid(int(p["height"]), int(p["width"]))
    init = None
    if req.init_latents is not None:
        if "height" not in p or "width" not in p:
            raise PipelineError(f"--init-latents: pipeline '{pipe.doc.name}' has no width/height parameters to "
                                f"check the latents' shape against")
        init = load_init_latents(req.init_latents, int(p["height"]), int(p["width"]))
    if req.output is not None:
        _check_explicit(req.output, next(iter(declared.values())), req.overwrite)
    else:
        check_output_folder()
    recipe_hash = hashlib.sha256(req.recipe.read_bytes()).hexdigest()[:16]
    seed = int(p["seed"]) if "seed" in p else None
    t_prepare = time.perf_counter()
    pipe.prepare()  # every stage compiled and planned under the budget before any weight is read
    compile_seconds = time.perf_counter() - t_prepare  # the compile share of the summary (plan-cache loads too)
    runs = []
    for prompt in prompts:
        t0 = time.perf_counter()
        inputs = {"init_latents": init} if "init_latents" in pipe.doc.inputs else {}
        if prompt is not None:
            inputs["prompt"] = prompt
        report = pipe.run(inputs)
        values = {name: convert(out, pipe.output_value(name, report.values)) for name, out in declared.items()}
        meta = {k: p[k] for k in ("steps", "guidance", "width", "height") if k in p}
        if seed is not None:
            meta["seed"] = None if init is not None else seed
        text = generation_text(prompt=prompt, recipe=pipe.doc.name, recipe_hash=recipe_hash,
                               init_latents=str(req.init_latents) if req.init_latents else None, **meta)
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
        outputs = {name: {"type": kind, "path": str(paths[name])} | ({"text": value} if kind == "text" else {})
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
    memory = {"budget_bytes": budget, "budget_from": "--max-memory" if req.max_memory is not None else
              "machine memory", "runtime": runtime.name, "device": runtime.device,
              "plans": {plan.model: plan.summary() for plan in pipe.prepare()}}
    total = time.perf_counter() - started
    timing = {"total_seconds": round(total, 3), "compile_seconds": round(compile_seconds, 3),
              "compile_share": round(compile_seconds / total, 4) if total > 0 else 0.0}
    return {"recipe": pipe.doc.name, "recipe_hash": recipe_hash, "params": dict(p), "memory": memory,
            "timing": timing, "runs": runs}
