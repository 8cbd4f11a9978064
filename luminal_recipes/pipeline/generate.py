"""Text-to-image generation as the CLI runs it: check every flag before any work, plan every model stage under
the memory budget (failing before any weight is read if a stage cannot fit), load the pipeline once, run each
prompt, write each PNG atomically, and summarise timings and memory (planned and measured, per stage).

The budget is ``--max-memory``, or by default what the machine has (``plan.machine_memory``: physical memory
from ``os.sysconf``, or the container's limit when lower)."""

from __future__ import annotations

import hashlib
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import PipelineError
from .driver import Pipeline
from .image_io import default_output_path, generation_text, save_image
from .latents import latent_grid, load_init_latents
from .plan import machine_memory

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


def _check_output(path: Path) -> None:
    """Fail before any work when the output cannot be written (never after minutes of compute)."""
    if path.suffix.lower() != ".png":
        raise PipelineError(f"--output {path}: the file name must end with .png")
    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir() or not os.access(folder, os.W_OK):
        raise PipelineError(f"--output {path}: {folder} is not a writable folder; choose another --output")


def generate(req: GenerateRequest, progress: Callable[[str, int, int], None] | None = None) -> dict:
    if not req.prompts:
        raise PipelineError("no prompt: pass --prompt TEXT (repeatable) or --prompts-file FILE")
    sets = list(req.sets)
    for _flag, name, value in (("--steps", "steps", req.steps), ("--guidance", "guidance", req.guidance),
                              ("--width", "width", req.width), ("--height", "height", req.height),
                              ("--seed", "seed", req.seed)):
        if value is not None:
            sets.append(f"{name}={value}")
    if req.steps is not None and req.steps < 1:
        raise PipelineError(f"--steps {req.steps}: the number of denoising steps must be at least 1")
    if req.output is not None and len(req.prompts) > 1:
        raise PipelineError("--output names one file, but several prompts were given; omit --output to get one "
                            "file per prompt in outputs/")
    budget = req.max_memory if req.max_memory is not None else machine_memory()
    pipe = Pipeline(req.recipe, weights=req.weights, sets=sets, budget_bytes=budget, compile=req.compile,
                    progress=progress)
    p = pipe.params
    if int(p["steps"]) < 1:
        raise PipelineError(f"steps={p['steps']}: the number of denoising steps must be at least 1")
    latent_grid(int(p["height"]), int(p["width"]))
    init = load_init_latents(req.init_latents, int(p["height"]), int(p["width"])) if req.init_latents else None
    recipe_hash = hashlib.sha256(req.recipe.read_bytes()).hexdigest()[:16]
    outputs = [req.output or default_output_path(req.recipe.stem, int(p["seed"]), prompt) for prompt in req.prompts]
    for path in outputs:
        _check_output(Path(path))
    pipe.prepare()  # every stage planned under the budget before any weight is read
    results = []
    for prompt, path in zip(req.prompts, outputs):
        t0 = time.perf_counter()
        report = pipe.run({"prompt": prompt, "init_latents": init})
        image = np.asarray(report.values["image"])
        text = generation_text(prompt=prompt, seed=None if init is not None else int(p["seed"]),
                               steps=int(p["steps"]), guidance=float(p["guidance"]), width=int(p["width"]),
                               height=int(p["height"]), recipe=pipe.doc.name, recipe_hash=recipe_hash,
                               init_latents=str(req.init_latents) if req.init_latents else None)
        written = save_image(path, image, text)
        results.append({
            "path": str(written),
            "prompt": prompt,
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
              "machine memory", "plans": {plan.model: plan.summary() for plan in pipe.prepare()}}
    return {"recipe": pipe.doc.name, "recipe_hash": recipe_hash, "params": dict(p), "memory": memory,
            "images": results}
