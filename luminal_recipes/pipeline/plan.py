"""Memory plans of a pipeline's model stages, before anything is loaded.

For each model stage: its graph is built from shapes (the checkpoint's config.json, or the pipeline's `configs:`
folder when the weights are not local), compiled at the stage's `dims:` under the budget, and planned by the
runtime. When a stage's weights alone exceed the budget, its repeated blocks are streamed: only the weights
outside blocks plus two blocks (the one computing and the one being prefetched) are resident.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import BudgetError, PipelineError
from ..recipe.builder import BuiltModel, build_model
from ..recipe.loader import load_recipe
from ..recipe.schema import PipelineRecipe, StageSpec


@dataclass
class StagePlan:
    stage: str
    model: str
    dims: dict[str, int]
    weight_bytes: int
    block_weight_bytes: int  # the largest single repeated block
    activation_peak: int
    budget: int | None
    streamed: bool
    compile_seconds: float

    @property
    def resident_weight_bytes(self) -> int:
        if not self.streamed:
            return self.weight_bytes
        return self.weight_bytes - self.block_total + 2 * self.block_weight_bytes

    block_total: int = 0  # weights inside all blocks

    @property
    def planned_peak(self) -> int:
        return self.resident_weight_bytes + self.activation_peak


def block_weight_bytes(model: BuiltModel) -> tuple[int, int]:
    """(largest block's weight bytes, all blocks' weight bytes): weights first used inside each graph block."""
    graph = model.graph
    sizes = {name: binding.nbytes for name, binding in model.weights.items()}
    per_block = []
    for rng in graph.blocks.values():
        names = {graph.nodes[i].name for i in rng if graph.nodes[i].op == "Input"
                 and graph.nodes[i].attr("kind") == "weight"}
        per_block.append(sum(sizes.get(n, 0) for n in names))
    leaves = per_block  # nested blocks do not occur in the recipes' builder output (one level of repeat)
    return (max(leaves) if leaves else 0, sum(leaves))


def model_stages(stages: list[StageSpec]):
    for stage in stages:
        if stage.model is not None:
            yield stage
        yield from model_stages(stage.steps)


def plan_stages(pipeline, budget: int | None = None, runtime=None) -> list[StagePlan]:
    """Plans for every model stage of a loaded ``Pipeline`` (driver.Pipeline), in stage order."""
    import time

    from ..compiler.search import compile_graph
    from ..runtimes.numpy_runtime import NumpyRuntime

    runtime = runtime or NumpyRuntime()
    doc: PipelineRecipe = pipeline.doc
    plans = []
    for stage in model_stages(doc.stages):
        if not stage.dims:
            raise PipelineError(f"{pipeline.path}: stage '{stage.name}' has no `dims:`; add the model's dims as "
                                f"expressions so its memory can be planned")
        dims = {k: int(pipeline._eval(v, {}, f"stage '{stage.name}' dims.{k}")) for k, v in stage.dims.items()}
        model = _shape_model(pipeline, stage.model)
        weights = sum(b.nbytes for b in model.weights.values())
        block_max, block_total = block_weight_bytes(model)
        streamed = budget is not None and weights > budget
        t0 = time.perf_counter()
        plan = compile_graph(model.graph, runtime, dims, budget_bytes=None if budget is None else budget
                             + (0 if not streamed else weights))
        memory = runtime.plan(plan.program, dims)
        plans.append(StagePlan(stage.name, stage.model, dims, weights, block_max, memory.activation_peak,
                               budget, streamed, time.perf_counter() - t0, block_total))
    return plans


def check_budget(plans: list[StagePlan], budget: int | None) -> None:
    if budget is None:
        return
    over = [p for p in plans if p.planned_peak > budget]
    if over:
        worst = max(over, key=lambda p: p.planned_peak)
        raise BudgetError(
            f"--max-memory {_gib(budget)} is too small: stage '{worst.stage}' needs {_gib(worst.planned_peak)} "
            f"({_gib(worst.resident_weight_bytes)} of {'streamed ' if worst.streamed else ''}weights + "
            f"{_gib(worst.activation_peak)} of activations). Raise --max-memory to at least "
            f"{_gib(max(p.planned_peak for p in plans))}, or lower --width/--height."
        )


def _shape_model(pipeline, name: str) -> BuiltModel:
    """The model's graph from shapes only: sizes from the local checkpoint's config or the `configs:` folder."""
    recipe = load_recipe(pipeline.path.parent / pipeline.doc.models[name].recipe)
    config = pipeline.configs.get(name) or {}
    if not config:
        raise PipelineError(f"no config for model '{name}': pass --weights, or set `configs:` in the pipeline")
    spec = pipeline.doc.models[name]
    sets = {k: pipeline._eval(v, {}, f"models.{name}.set.{k}") if isinstance(v, str) else v
            for k, v in spec.set.items()}
    return build_model(recipe, config=config, sets=sets)


def format_plans(plans: list[StagePlan]) -> str:
    lines = [f"{'stage':<14}{'weights':>12}{'largest block':>15}{'activations':>13}{'planned peak':>14}  notes"]
    for p in plans:
        note = "weights streamed block by block" if p.streamed else ""
        lines.append(f"{p.stage:<14}{_gib(p.weight_bytes):>12}{_gib(p.block_weight_bytes):>15}"
                     f"{_gib(p.activation_peak):>13}{_gib(p.planned_peak):>14}  {note}")
    budget = plans[0].budget if plans else None
    lines.append(f"budget: {_gib(budget) if budget else 'none'}; the pipeline's peak is the largest stage's "
                 f"({_gib(max((p.planned_peak for p in plans), default=0))}): stages release everything when they end")
    return "\n".join(lines)


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def load_configs(folder: Path, doc: PipelineRecipe) -> dict[str, dict]:
    out = {}
    for name, model in doc.models.items():
        path = folder / (model.weights or "") / "config.json"
        if path.is_file():
            out[name] = json.loads(path.read_text(encoding="utf-8"))
    return out
