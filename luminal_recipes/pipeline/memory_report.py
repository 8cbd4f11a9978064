"""What ``inspect`` prints for a pipeline's memory: the plan of each model stage (``plan.py``) for a ``Pipeline``
(``driver.py``). Its own module so that ``plan.py`` (which the driver and the engine import) never imports the
driver back."""

from __future__ import annotations

from ..runtimes.memory import format_bytes
from ..runtimes.registry import get_planner
from .driver import Pipeline
from .plan import check_host_budget, format_plans, plan_stages


def inspect_memory(recipe, weights, sets, max_memory: int | None, runtime=None, device: str | None = None,
                   max_host_memory: int | None = None, compute_dtype: str | None = None) -> list[str]:
    """What `inspect` prints for a pipeline's memory: the per-stage plans on ``runtime`` (default numpy), from
    the checkpoint's headers when it is local (or given), else from the pipeline's `configs:` folder (shapes
    only: nothing is downloaded). ``recipe`` is the loaded pipeline recipe (``recipe.loader.LoadedRecipe``).
    A runtime whose device is not here (cuda) plans for a described one (``device``; ``registry.get_planner``)."""
    doc = recipe.doc
    source = str(weights) if weights is not None else doc.weights
    local = source is not None and not source.startswith("hf://")
    if not local and doc.configs is None:
        return ["memory plan: the checkpoint is remote and the pipeline has no `configs:` folder; pass "
                "--weights FOLDER to plan memory"]
    runtime = get_planner(runtime, device)
    check_host_budget(runtime, max_host_memory)
    pipeline = Pipeline(recipe.path, weights=weights, sets=sets, budget_bytes=max_memory, runtime=runtime,
                        compute_dtype=compute_dtype)
    plans = plan_stages(pipeline, max_memory, from_checkpoint=local, host_budget=max_host_memory)
    origin = f"checkpoint {pipeline.checkpoint}" if local else \
        f"sizes from {doc.configs}/ (config.json files; no weights read)"
    lines = [f"memory plan per model stage ({origin}):", format_plans(plans, max_memory)]
    if getattr(runtime, "assumed", None):
        lines.append(f"the {runtime.name} runtime {runtime.assumed}")
    if max_memory is None:
        lines.append(f"`run` plans under the {runtime.device} memory of the {runtime.name} runtime by default "
                     f"({format_bytes(runtime.capacity())}); pass --max-memory SIZE to see the plan under a "
                     f"budget")
    return lines
