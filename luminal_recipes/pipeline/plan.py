"""Memory plans of models and pipeline stages, made before any weight is read.

For each model stage the model's graph is built (from the checkpoint's headers, or from shapes alone: the
pipeline's `configs:` folder), compiled at the stage's `dims:`, and its memory planned by the runtime:
weights + constants + activation arena. Under a budget the plan is chosen in this order:

1. the compiler's best program (the unbounded run's) with every weight resident, if it fits;
2. else the same program with the repeated blocks' weights streamed (``runtimes.streaming``): the weights
   outside blocks plus two block slots are resident; same program, so the same bits as the unbounded run;
3. else a program compiled under the budget (a leaner candidate), weights resident, if one fits;
4. else such a program with weights streamed (the compiler is given ``budget + weights - resident weights``,
   as it counts every weight);
5. else the stage cannot fit: ``check_budget`` raises ``BudgetError`` saying what the leanest plan needs.

So a stage whose weights exceed the budget streams its blocks. Budgets are per device: the runtime's
(``Runtime.capacity()``, the default budget) - host RAM for numpy (``machine_memory``: the least of physical
memory, the container's limit and ``ulimit -v``, less what is in use: ``luminal_recipes.memory_limits``), device
memory for a GPU backend. On a device runtime a streamed stage also holds two pinned host staging buffers
(``staging_bytes``, within ``--max-host-memory``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from ..errors import BudgetError, PipelineError
from ..graph.core import Graph
from ..graph.symbolic import evaluate
from ..recipe.builder import BuiltModel, build_model
from ..recipe.loader import load_recipe
from ..recipe.safe_eval import names_in, parse, unwrap
from ..recipe.schema import PipelineRecipe, StageSpec
from ..runtimes.memory import format_bytes, plan_memory
from ..runtimes.program import Program
from ..runtimes.registry import get_runtime
from ..runtimes.streaming import STAGING_BUFFERS, stream_layout


@dataclass
class StagePlan:
    stage: str
    model: str  # the pipeline's model name (the recipe's name outside a pipeline)
    dims: dict[str, int]
    budget: int | None
    weight_bytes: int  # every weight the program reads (packed)
    constant_bytes: int
    activation_peak: int  # the activation arena (activations and kernel scratch, reused by liveness)
    streamed: bool
    resident_weight_bytes: int  # weights held while running: all, or outside blocks + two slots if streamed
    largest_block_bytes: int  # the largest repeated block's weights (the size of a streaming slot)
    blocks: int  # repeated blocks that can stream
    smallest_peak: int  # what the leanest plan the search found needs (streamed when that helps)
    unbounded_peak: int  # the unbounded run's plan: best program, every weight resident
    compile_seconds: float = 0.0
    runtime: str = "numpy"  # the runtime the plan is for, and the device whose memory the budget counts
    device: str = "cpu"
    program: Program | None = field(default=None, repr=False, compare=False)
    stream: dict[str, str] | None = field(default=None, repr=False, compare=False)  # for runtime.load
    state_bytes: int = 0  # states kept across runs (a KV cache), outside the arena
    staging_bytes: int = 0  # pinned host memory staging streamed blocks (device runtimes; within --max-host-memory)
    sized_by: str = field(default="", compare=False)  # the parameters its dims come from, and how they were set

    @property
    def planned_peak(self) -> int:
        return self.resident_weight_bytes + self.constant_bytes + self.state_bytes + self.activation_peak

    @property
    def fits(self) -> bool:
        return self.budget is None or self.planned_peak <= self.budget

    def summary(self) -> dict:
        """The plan's figures as JSON-ready numbers."""
        return {"stage": self.stage, "runtime": self.runtime, "device": self.device, "dims": dict(self.dims),
                "weight_bytes": self.weight_bytes,
                "resident_weight_bytes": self.resident_weight_bytes, "constant_bytes": self.constant_bytes,
                "activation_bytes": self.activation_peak, "state_bytes": self.state_bytes,
                "planned_peak_bytes": self.planned_peak,
                "streamed": self.streamed, "largest_block_bytes": self.largest_block_bytes,
                "staging_bytes": self.staging_bytes, "unbounded_peak_bytes": self.unbounded_peak}


def machine_memory() -> int:
    """The numpy runtime's default budget: what the process may use (``luminal_recipes.memory_limits``)."""
    from ..runtimes.cpu.backend import host_memory

    return host_memory()


def weight_blocks(graph: Graph) -> dict[str, str]:
    """Weight name -> the innermost repeated block (``Graph.blocks``) whose nodes include its input node."""
    out: dict[str, str] = {}
    for name, rng in sorted(graph.blocks.items(), key=lambda item: len(item[1]), reverse=True):
        for i in rng:  # smaller (inner) blocks come later and overwrite
            node = graph.nodes[i]
            if node.op == "Input" and node.attr("kind") == "weight":
                out[node.name] = name
    return out


def plan_model(model: BuiltModel, dims: Mapping[str, int], budget: int | None, runtime=None,
               compile: bool = True, stage: str | None = None, inputs=None, weights=None,
               host_budget: int | None = None) -> StagePlan:
    """The plan of one model at ``dims`` under ``budget`` (see the module docstring for the order tried) on
    ``runtime`` (a name or a Runtime; default numpy); ``host_budget`` bounds a device runtime's pinned staging
    of streamed blocks. ``inputs``/``weights`` only serve the compiler's timing of candidates."""
    runtime = get_runtime(runtime)
    dims = dict(dims)
    blocks = weight_blocks(model.graph)
    t0 = time.perf_counter()

    def compiled(limit: int | None) -> tuple[Program, dict | None, list[dict]]:
        """A program and, when searched, the search's figures for it and for every candidate."""
        if not compile:
            return Program.from_graph(model.graph), None, []
        from ..compiler.search import compile_graph

        result = compile_graph(model.graph, runtime, dims, budget_bytes=limit, inputs=inputs, weights=weights)
        return result.program, result.report.get("chosen"), result.report.get("candidates", [])

    def assess(found: tuple[Program, dict | None, list[dict]], streamed: bool) -> StagePlan:
        program, row, _ = found
        if id(program) not in figures:
            if row is not None and row.get("peak") is not None:  # the search planned it with the runtime
                memory = plan_memory(program, dims)  # order, residency and sizes for the stream layout
                sizes = row["weight_bytes"], \
                    row["peak"] - row["weight_bytes"] - row["activation_peak"] - memory.state_bytes, \
                    row["activation_peak"], memory.state_bytes
            else:
                memory = runtime.plan(program, dims)
                sizes = memory.weight_bytes, memory.constant_bytes, memory.activation_peak, memory.state_bytes
            figures[id(program)] = sizes, stream_layout(program, memory, dims, blocks)
        (weight_bytes, constant_bytes, activations, states), layout = figures[id(program)]
        held = layout.resident_weight_bytes if streamed else weight_bytes
        return StagePlan(stage or model.name, model.name, dims, budget, weight_bytes, constant_bytes,
                         activations, streamed, held, layout.largest_block_bytes, len(layout.blocks), 0, 0,
                         time.perf_counter() - t0, runtime.name, runtime.device, program,
                         blocks if streamed else None, states)

    figures: dict[int, tuple] = {}  # id(program) -> (sizes, stream layout): planning is not free
    best = compiled(None)
    candidates = best[2]
    resident, streamed = assess(best, False), assess(best, True)
    # the leanest candidate's constants + activations (the chosen program's when the search had no others)
    leanest = min([r["peak"] - r["weight_bytes"] for r in candidates if r.get("peak") is not None]
                  + [resident.constant_bytes + resident.state_bytes + resident.activation_peak])
    least_weights = min(resident.weight_bytes, streamed.resident_weight_bytes)
    if budget is None or resident.planned_peak <= budget:
        choice = resident
    elif streamed.planned_peak <= budget or not compile or streamed.resident_weight_bytes + leanest > budget:
        choice = streamed  # fits with the best program, or nothing fits (``fits`` is False)
    elif resident.weight_bytes + leanest <= budget:
        choice = assess(compiled(budget), False)
    else:
        choice = assess(compiled(budget + resident.weight_bytes - streamed.resident_weight_bytes), True)
    choice.smallest_peak = min(least_weights + leanest, choice.planned_peak)
    choice.unbounded_peak = resident.planned_peak
    if choice.streamed and not getattr(getattr(runtime, "backend", None), "host_arrays", True):
        from ..runtimes.streaming import staging_buffer_bytes

        layout = figures[id(choice.program)][1]
        try:
            choice.staging_bytes = STAGING_BUFFERS * staging_buffer_bytes(layout, host_budget)
        except BudgetError as exc:  # say which stage streams (and so needs the staging)
            raise BudgetError(f"stage '{choice.stage}' streams its weights under --max-memory: {exc}") from None
    return choice


def check_host_budget(runtime, max_host_memory: int | None) -> None:
    """``--max-host-memory`` bounds a device runtime's pinned staging; on a runtime whose device memory is host
    memory (numpy, ``host_arrays``) it means nothing, so it is refused rather than ignored."""
    if max_host_memory is not None and getattr(getattr(runtime, "backend", None), "host_arrays", True):
        raise PipelineError(f"--max-host-memory: the {runtime.name} runtime's device memory is host memory "
                            f"(--max-memory); --max-host-memory bounds the pinned staging of a GPU runtime "
                            f"(--runtime cuda)")


def model_stages(stages: list[StageSpec]) -> Iterator[StageSpec]:
    for _, stage in model_stages_at(stages):
        yield stage


def model_stages_at(stages: list[StageSpec], at: tuple = ("stages",)) -> Iterator[tuple[tuple, StageSpec]]:
    """Model stages with their key paths in the recipe (``("stages", 6, "steps", 1)``), for located errors."""
    for index, stage in enumerate(stages):
        if stage.model is not None:
            yield at + (index,), stage
        yield from model_stages_at(stage.steps, at + (index, "steps"))


def _running_model_stages(pipeline, stages: list[StageSpec], at: tuple = ("stages",)):
    """The model stages that will run (their `when:`, and their loops', true), with their key paths."""
    runs = getattr(pipeline, "runs", None)
    for index, stage in enumerate(stages):
        if runs is not None and not runs(stage):
            continue
        if stage.model is not None:
            yield at + (index,), stage
        yield from _running_model_stages(pipeline, stage.steps, at + (index, "steps"))


MAX_DIM = 1 << 24  # a symbolic dim (tokens, latent rows...): 16M tokens is far beyond any model's context


def stage_dims(pipeline, at: tuple, stage: StageSpec) -> dict[str, int]:
    """The stage's ``dims:`` evaluated; each a whole number in [1, MAX_DIM], else an error at its recipe line
    that names the flags or --set values it was computed from."""
    dims = {}
    for name, text in stage.dims.items():
        value = pipeline._eval(text, {}, f"stage '{stage.name}' dims.{name}")
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_DIM:
            used = names_in(parse(unwrap(text))) if isinstance(text, str) else []
            given = sorted({pipeline.resolved.set_by[n.id] for n in used if pipeline.resolved.set_by.get(n.id)})
            origin = pipeline.recipe.origin(*at, "dims", name)
            raise origin.error(
                f"stage '{stage.name}': dim {name} = {text} is {value!r}"
                + (f" with {', '.join(given)}" if given else "")
                + f"; a model's dims must be whole numbers from 1 to {MAX_DIM}. Choose other values."
            )
        dims[name] = value
    return dims


def check_io_fits(model: BuiltModel, dims: Mapping[str, int], budget: int | None, stage: str,
                  sized_by: Iterable[str] = ()) -> None:
    """Before compiling: the model's inputs and outputs alone at ``dims`` must fit the budget (any plan holds
    them), so an absurd size fails here, in arithmetic, rather than inside the planner's allocations.
    ``sized_by``: the parameters the dims are computed from, for the message."""
    if budget is None:
        return
    parts = [(f"input '{name}'", tensor.shape, tensor.dtype) for name, tensor in model.inputs.items()]
    for name, (node, view) in model.graph.outputs.items():
        parts.append((f"output '{name}'", view.shape, model.graph.nodes[node].dtype))
    sized = [(what, tuple(evaluate(d, dims) for d in shape), dtype) for what, shape, dtype in parts]
    total = sum(dtype.nbytes(math.prod(shape)) for _, shape, dtype in sized)
    if total > budget:
        largest = max(sized, key=lambda item: item[2].nbytes(math.prod(item[1])))
        raise BudgetError(
            f"stage '{stage}' at {_dims(dims)} needs {_gib(total)} for its inputs and outputs alone (the largest, "
            f"{largest[0]}, is {largest[1]} {largest[2]}), more than the memory budget of {_gib(budget)}; choose "
            f"smaller sizes ({', '.join(sized_by) or 'the parameters its dims come from'}) or raise --max-memory."
        )


def plan_stages(pipeline, budget: int | None = None, runtime=None, compile: bool = True,
                from_checkpoint: bool | None = None, progress=None, host_budget: int | None = None
                ) -> list[StagePlan]:
    """Plans for every model stage of a ``driver.Pipeline``, in stage order (a model used by several stages
    with the same dims is planned once) on ``runtime`` (default: the pipeline's). ``from_checkpoint``: build
    each model against its checkpoint
    (headers only; the default when the checkpoint is a local folder) rather than from shapes alone.
    ``progress(name, done, total)`` is told after each stage is planned."""
    doc: PipelineRecipe = pipeline.doc
    runtime = get_runtime(runtime if runtime is not None else getattr(pipeline, "runtime", None))
    if from_checkpoint is None:
        source = pipeline._weights_arg if pipeline._weights_arg is not None else doc.weights
        from_checkpoint = source is not None and not str(source).startswith("hf://")
    plans: list[StagePlan] = []
    done: dict[tuple, StagePlan] = {}
    stages = []
    for at, stage in _running_model_stages(pipeline, doc.stages):  # sizes checked before any is compiled
        if not stage.dims:
            raise PipelineError(f"{pipeline.path}: stage '{stage.name}' has no `dims:`; add the model's dims "
                                f"as expressions so its memory can be planned")
        stages.append((stage, stage_dims(pipeline, at, stage)))
    models = {}
    for stage, dims in stages:
        if stage.model not in models:
            models[stage.model] = pipeline.model(stage.model) if from_checkpoint else \
                _shape_model(pipeline, stage.model)
        check_io_fits(models[stage.model], dims, budget, stage.name, _sized_by(stage, pipeline))
    if progress:
        progress("memory plan", 0, len(stages))
    for k, (stage, dims) in enumerate(stages):
        key = (stage.model, tuple(sorted(dims.items())))
        if key not in done:
            done[key] = plan_model(models[stage.model], dims, budget, runtime, compile, stage.name,
                                   host_budget=host_budget)
            done[key].model = stage.model  # the pipeline's name for it
            done[key].sized_by = ", ".join(_sized_by(stage, pipeline))
            plans.append(done[key])
        if progress:
            progress("memory plan", k + 1, len(stages))
    return plans


def check_budget(plans: list[StagePlan], budget: int | None) -> None:
    """Raise ``BudgetError`` unless every stage's plan fits ``budget``."""
    over = [p for p in plans if not p.fits]
    if budget is None or not over:
        return
    needed = max(p.smallest_peak for p in plans)
    lines = []
    for p in over:
        weights = "weights outside blocks + two streamed blocks" if p.streamed else "weights"
        lines.append(f"stage '{p.stage}' needs at least {_gib(p.smallest_peak)} "
                     f"({_gib(p.resident_weight_bytes)} of {weights} + "
                     f"{_gib(p.smallest_peak - p.resident_weight_bytes)} of activations and constants at "
                     f"{_dims(p.dims)}{f', sized by {p.sized_by}' if p.sized_by else ''})")
    raise BudgetError(
        f"--max-memory {_gib(budget)} is too small even with weights streamed block by block: "
        + "; ".join(lines) + f". Raise --max-memory to at least {_gib(needed)}, or shrink the activations "
        f"(smaller values of the parameters the stages' dims come from, with their flags or --set)."
    )


def format_plans(plans: list[StagePlan], budget: int | None) -> str:
    """The per-stage plan table `inspect` prints: sizes, the unbounded run's peak, and the plan under
    ``budget`` (weights held, planned peak, whether blocks stream), and the device the budget is for."""
    width = max([14, *(len(p.stage) + 2 for p in plans)])
    lines = [f"{'stage':<{width}}{'weights':>11}{'activations':>13}{'unbounded peak':>16}{'held weights':>14}"
             f"{'planned peak':>14}  plan under the budget"]
    for p in plans:
        note = f"weights streamed block by block ({p.blocks} blocks, largest {_gib(p.largest_block_bytes)})" \
            if p.streamed else "weights resident"
        if p.staging_bytes:
            note += f", staged through {_gib(p.staging_bytes)} of pinned host memory"
        if not p.fits:
            note += f"; DOES NOT FIT (needs at least {_gib(p.smallest_peak)})"
        lines.append(f"{p.stage:<{width}}{_gib(p.weight_bytes):>11}{_gib(p.activation_peak):>13}"
                     f"{_gib(p.unbounded_peak):>16}{_gib(p.resident_weight_bytes):>14}{_gib(p.planned_peak):>14}"
                     f"  {note}")
    lines.append("dims: " + "; ".join(f"{p.stage} {_dims(p.dims)}" for p in plans))
    peak = max((p.planned_peak for p in plans), default=0)
    where = f"{plans[0].device} memory ({plans[0].runtime} runtime)" if plans else "memory"
    lines.append(f"budget: {_gib(budget) if budget else 'none (every weight resident)'} of {where}; the "
                 f"pipeline's peak is its largest stage's, {_gib(peak)}: each stage releases everything when it "
                 f"ends")
    return "\n".join(lines)


def _sized_by(stage: StageSpec, pipeline) -> list[str]:
    """The pipeline parameters the stage's ``dims:`` expressions read, sorted, each with how it was set when the
    user or an input set it (``reference_tokens = 48 from --image``)."""
    names = {n.id for text in stage.dims.values() if isinstance(text, str) for n in names_in(parse(unwrap(text)))}
    set_by = pipeline.resolved.set_by if hasattr(pipeline, "resolved") else {}
    return [f"{name} = {pipeline.params[name]!r} from {set_by[name]}" if name in set_by else name
            for name in sorted(names & set(pipeline.params))]


def _shape_model(pipeline, name: str) -> BuiltModel:
    """The model's graph from shapes only: sizes from the checkpoint's config or the `configs:` folder."""
    recipe = load_recipe(pipeline.path.parent / pipeline.doc.models[name].recipe)
    config = pipeline.configs.get(name) or {}
    if not config:
        raise PipelineError(f"no config for model '{name}': pass --weights, or set `configs:` in the "
                            f"pipeline")
    spec = pipeline.doc.models[name]
    sets, origins = pipeline.model_sets(name)
    return build_model(recipe, config=config, sets=sets, quantization=spec.quantization, set_origins=origins,
                       config_file=f"config.json of model '{name}'",
                       compute_dtype=getattr(pipeline, "compute_dtype", None), loras=pipeline.loras.get(name, []))


def _gib(n: int | None) -> str:
    return "-" if n is None else format_bytes(n)


def _dims(dims: Mapping[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in dims.items())
