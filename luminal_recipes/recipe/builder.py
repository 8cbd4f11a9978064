"""Recipe + parameters + checkpoint metadata -> one Graph per model, every weight a named, lazily loaded
tensor.

Nothing is read from the checkpoint but its headers and config.json: each graph weight is bound to a
``load()`` that memory-maps its tensor(s) when a runtime asks. Before the graph is built, the checkpoint is
checked against every weight the recipe declares, and all disagreements are reported at once, each at the YAML
position of the declaration (shape mismatches at the dimension's expression).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from .. import instrument
from ..errors import CheckpointError, LoraError, LuminalError, RecipeError
from ..files import MAX_JSON_BYTES, present, read_json
from ..graph import DType, Graph, Tensor, to_dtype
from ..graph.dtypes import SAFETENSORS_NAMES
from ..graph.symbolic import Expr
from ..ops.linalg import LoraWeight
from .check import check_recipe, default_ops
from .config_fields import check_config
from .instances import Instance, Instantiator, WeightDecl, eval_field, list_item_origin
from .interpreter import CallRecord, Interpreter
from .loader import LoadedRecipe, load_recipe
from .lora import LoraSpec, LoraUpdate
from .mapping import MappedTensor, StoredTensor, map_checkpoint
from .params import ParamResolver, ResolvedParams
from .paths import confined, guard_checkpoint
from .schema import ModelRecipe, QuantizationSpec
from .suggest import did_you_mean

_LIST_LIMIT = 8


@dataclass
class WeightBinding:
    """A graph weight and how to read it; ``load`` is None when the model was built from shapes only."""

    name: str
    shape: tuple[int, ...]
    dtype: DType
    load: Callable[[], np.ndarray] | None
    sources: tuple[str, ...] = ()

    @property
    def nbytes(self) -> int:
        return self.dtype.nbytes(int(np.prod(self.shape, dtype=np.int64)))


@dataclass
class BuiltModel:
    name: str
    recipe: LoadedRecipe
    graph: Graph
    params: ResolvedParams
    root: Instance
    inputs: dict[str, Tensor]
    outputs: list[str]
    weights: dict[str, WeightBinding]
    calls: list[CallRecord] = field(default_factory=list)
    checkpoint_root: Path | None = None

    def load_weight(self, name: str) -> np.ndarray:
        """The array for graph weight ``name`` (read from the memory-mapped checkpoint now)."""
        binding = self.weights[name]
        if binding.load is None:
            raise CheckpointError(
                f"weight '{name}' has no checkpoint (the model was built from shapes only); pass --weights."
            )
        array = np.asarray(binding.load())
        if array.dtype != binding.dtype.np:
            array = array.astype(binding.dtype.np)
        return array

    def weight_bytes_by_dtype(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for binding in self.weights.values():
            out[str(binding.dtype)] = out.get(str(binding.dtype), 0) + binding.nbytes
        return out


# ---- entry points ------------------------------------------------------------------------------------------
def build(
    path: str | Path,
    weights: str | Path | None = None,
    sets: Iterable[str] | Mapping[str, Any] = (),
    ops: Mapping[str, Callable] | None = None,
    compute_dtype: str | None = None,
    patterns: Sequence[str] | None = None,
) -> BuiltModel:
    """Load a model recipe, open its checkpoint and build the graph; ``weights`` overrides the source,
    ``compute_dtype`` the recipe's compute dtype (``with_compute_dtype``); ``patterns``: the files a hub
    checkpoint is fetched with (default ``sources.DEFAULT_PATTERNS``)."""
    recipe = load_recipe(path)
    if not isinstance(recipe.doc, ModelRecipe):
        raise recipe.origin("kind").error(
            "this is a pipeline recipe; build its models one by one (the pipeline driver does that)."
        )
    folder = checkpoint_folder(recipe, weights, patterns)
    if folder is None:
        raise recipe.origin("weights").error(
            "no checkpoint: pass --weights FOLDER|hf://org/repo, or set weights.source in the recipe."
        )
    roots = guard_checkpoint(recipe.origin("weights", "source") if weights is None else None, folder,
                             weights is not None, recipe.tree, recipe.doc.weights.source)
    checkpoint, config, config_file = open_checkpoint(recipe, folder, roots)
    return build_model(recipe, checkpoint=checkpoint, config=config, sets=sets, ops=ops,
                       compute_dtype=compute_dtype, config_file=config_file)


def open_checkpoint(recipe: LoadedRecipe, folder: Path, roots: list[Path] | None = None) -> tuple[Any, dict | None,
                                                                                                 str | None]:
    """``(checkpoint, config, config_file)`` of a resolved checkpoint: a safetensors folder or file with its
    config.json (``config_file`` None: the default name), or a GGUF file, whose metadata is its config
    (``weights/gguf_io.py``)."""
    from ..weights.gguf_io import GgufCheckpoint, is_gguf
    from ..weights.safetensors_io import Checkpoint

    if is_gguf(folder):
        checkpoint = GgufCheckpoint.open(folder)
        return checkpoint, checkpoint.config, f"{folder} (GGUF metadata)"
    return Checkpoint.open(folder), read_config(recipe, folder, roots), None


def checkpoint_folder(recipe: LoadedRecipe, weights: str | Path | None,
                      patterns: Sequence[str] | None = None) -> Path | None:
    """The local folder of the checkpoint: ``weights`` if given, else the recipe's ``weights.source``."""
    from ..weights.sources import parse_source, resolve_source

    source: str | Path | None = weights
    if source is None:
        declared = recipe.doc.weights.source if isinstance(recipe.doc, ModelRecipe) else None
        if declared is None:
            return None
        parsed = parse_source(declared)
        source = declared if not isinstance(parsed, Path) else \
            confined(recipe.origin("weights", "source"), recipe.folder, declared, "this recipe's folder",
                     [recipe.tree or recipe.folder])
    return resolve_source(source) if patterns is None else resolve_source(source, patterns)


def config_display(recipe: LoadedRecipe, folder: str | Path | None) -> str:
    """How errors name the recipe's config file: its path in the checkpoint folder when there is one."""
    assert isinstance(recipe.doc, ModelRecipe)
    name = recipe.doc.weights.config or "config.json"
    if folder is not None and str(folder).lower().endswith(".gguf"):
        return f"{folder} (GGUF metadata)"
    return str(Path(folder) / name) if folder is not None else name


def read_config(recipe: LoadedRecipe, folder: Path, roots: list[Path] | None = None) -> dict | None:
    """The checkpoint's config file (``weights.config``), or None without one. ``roots``: where links may lead
    (``paths.checkpoint_roots``; None for a folder the user named)."""
    assert isinstance(recipe.doc, ModelRecipe)
    from ..weights.gguf_io import GgufCheckpoint, is_gguf

    if is_gguf(folder):  # a GGUF file's metadata is its config
        return GgufCheckpoint.open(folder).config
    name = recipe.doc.weights.config
    if name is None:
        return None
    path = confined(recipe.origin("weights", "config"), Path(folder), name, "the checkpoint folder", roots)
    if not present(path):
        return None
    try:
        data = read_json(path, "the model's config", MAX_JSON_BYTES, CheckpointError,
                         fix="download or write it again")
    except OSError as exc:
        raise CheckpointError(f"cannot read {path} ({exc.strerror or exc}).") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object (the model's configuration).")
    return data


def resolve_params(
    recipe: LoadedRecipe,
    config: Mapping[str, Any] | None,
    sets: Iterable[str] | Mapping[str, Any] = (),
    set_origins: Mapping[str, str] | None = None,
    config_file: str | None = None,
) -> ResolvedParams:
    """The parameters' values: defaults, config.json reads and overrides, each checked against its type, its
    ranges (``min``/``max``/``positive``, the declarations of included libraries too) and finiteness."""
    if config_file is None:
        config_file = recipe.doc.weights.config if isinstance(recipe.doc, ModelRecipe) else "config.json"
    return ParamResolver(recipe.params, config, sets, config_file or "config.json", set_origins,
                         checks=recipe.param_checks).resolve_all()


def build_model(
    recipe: LoadedRecipe,
    *,
    checkpoint: Any = None,
    config: Mapping[str, Any] | None = None,
    sets: Iterable[str] | Mapping[str, Any] = (),
    ops: Mapping[str, Callable] | None = None,
    quantization: QuantizationSpec | None = None,
    set_origins: Mapping[str, str] | None = None,
    config_file: str | None = None,
    compute_dtype: str | None = None,
    loras: Sequence[LoraSpec] = (),
) -> BuiltModel:
    """Build the graph of a loaded model recipe. Without ``checkpoint`` weights are shapes only (inspect).
    ``compute_dtype`` (``--compute-dtype``) replaces the recipe's ``weights.dtype.compute`` (``with_compute_dtype``).

    ``quantization`` replaces the recipe's ``weights.quantization``: a pipeline runs one model recipe over
    checkpoints stored in different formats (``models.NAME.quantization`` in a pipeline recipe).
    ``set_origins`` names where each of ``sets`` was written (a pipeline's ``models.NAME.set``), for errors;
    ``config_file`` names ``config`` in errors (default: the checkpoint's config file). ``loras`` are LoRA files
    applied to the weights (``recipe/lora.py``: merged at load, or added in the graph beside ``linear``).
    """
    if quantization is not None:
        recipe = with_quantization(recipe, quantization)
    if compute_dtype is not None:
        recipe = with_compute_dtype(recipe, compute_dtype)
    doc = recipe.doc
    assert isinstance(doc, ModelRecipe)
    ops = default_ops() if ops is None else ops
    check_recipe(recipe, ops)
    # a config.json asking for something the recipe does not implement is refused before anything is built
    config_file = config_file or config_display(recipe, getattr(checkpoint, "root", None))
    check_config(recipe, config, config_file)
    params = resolve_params(recipe, config, sets, set_origins, config_file)
    instrument.count(instrument.GRAPH_BUILD)
    try:
        return _build(recipe, checkpoint, params, ops, loras)
    except LuminalError as exc:  # an error located in the recipe may come from a value the user set: say so
        note = params.overrides_note()
        if not note:
            raise
        raise type(exc)(f"{exc}{note}") from None


def _build(recipe: LoadedRecipe, checkpoint: Any, params: ResolvedParams, ops: Mapping[str, Callable],
           loras: Sequence[LoraSpec] = ()) -> BuiltModel:
    doc = recipe.doc
    assert isinstance(doc, ModelRecipe)
    root = Instantiator(recipe, params.values, {d: Expr.symbol(d) for d in doc.dims}).root()
    decls = [w for inst in root.walk() for w in inst.weights.values()]
    quant = doc.weights.quantization
    if quant is not None and quant.format == "gguf" and checkpoint is not None:
        from .gguf_packed import check_gguf_source

        check_gguf_source(quant, checkpoint, recipe.origin("weights", "quantization").loc())
    quantized = _quantized_names(decls, quant, checkpoint is not None)
    mapped: dict[str, MappedTensor] | None = None
    if checkpoint is not None:
        mapped = _map(recipe, checkpoint, params)
        _check_against_checkpoint(recipe, decls, quantized, mapped, checkpoint)
    updates = _map_loras(recipe, decls, quantized, params, loras) if loras else {}
    graph = Graph()
    factory = _WeightFactory(graph, doc, mapped, quantized, updates, checkpoint)
    policy = doc.weights.dtype
    states: dict[str, Tensor] = {}
    interpreter = Interpreter(graph, ops, factory.tensor, policy.compute, policy.per_op,
                              state=lambda inst, local: _state_tensor(graph, states, inst, local, policy.compute))
    inputs = _graph_inputs(recipe, root, params, graph)
    result = interpreter.call(root, list(inputs.values()), {})
    factory.check_lora_use({d.name: d for d in decls})
    outputs = _mark_outputs(recipe, graph, result)
    return BuiltModel(
        doc.name,
        recipe,
        graph,
        params,
        root,
        inputs,
        outputs,
        factory.bindings,
        interpreter.calls,
        getattr(checkpoint, "root", None),
    )


def _state_tensor(graph: Graph, made: dict[str, Tensor], instance: Instance, local: str, compute: str) -> Tensor:
    """The graph state of ``instance``'s state ``local`` (its value before this run; made on first use)."""
    decl = instance.states[local]
    if decl.name not in made:
        made[decl.name] = graph.state(decl.name, decl.shape, compute if decl.dtype == "compute" else decl.dtype)
    return made[decl.name]


COMPUTE_DTYPES = ("f32", "bf16", "f16")


def with_compute_dtype(recipe: LoadedRecipe, dtype: str) -> LoadedRecipe:
    """The same loaded recipe computing in ``dtype``: its dtype policy's ``compute``, and its float inputs that
    declare no dtype (the forwards compute in their inputs' dtype; the pipeline converts the values it passes in).
    An input whose dtype the recipe writes (FLUX.2's f32 rotary tables) and per-op dtypes
    (``weights.dtype.per_op``) stay as the recipe chose them."""
    if dtype not in COMPUTE_DTYPES:
        raise RecipeError(f"--compute-dtype {dtype}: the compute dtype must be one of {', '.join(COMPUTE_DTYPES)}")
    doc = recipe.doc
    assert isinstance(doc, ModelRecipe)
    policy = doc.weights.dtype.model_copy(update={"compute": dtype})
    inputs = {name: spec.model_copy(update={"dtype": dtype})
              if spec.dtype == "f32" and "dtype" not in spec.model_fields_set else spec
              for name, spec in doc.inputs.items()}
    weights = doc.weights.model_copy(update={"dtype": policy})
    return replace(recipe, doc=doc.model_copy(update={"weights": weights, "inputs": inputs}))


def map_model_loras(recipe: LoadedRecipe, loras: Sequence[LoraSpec], *, config: Mapping[str, Any] | None = None,
                    sets: Iterable[str] | Mapping[str, Any] = (), quantization: QuantizationSpec | None = None
                    ) -> dict[str, list[LoraUpdate]]:
    """Weight name -> the LoRA updates ``build_model(..., loras=loras)`` applies to it (each with its file's layer,
    the rows/columns of a split weight it covers, and its scale): the key mapping alone, no graph built and no
    weight read; the same located errors."""
    if quantization is not None:
        recipe = with_quantization(recipe, quantization)
    doc = recipe.doc
    assert isinstance(doc, ModelRecipe)
    params = resolve_params(recipe, config, sets)
    root = Instantiator(recipe, params.values, {d: Expr.symbol(d) for d in doc.dims}).root()
    decls = [w for inst in root.walk() for w in inst.weights.values()]
    quantized = _quantized_names(decls, doc.weights.quantization, True)
    return _map_loras(recipe, decls, quantized, params, loras)


def _map_loras(recipe: LoadedRecipe, decls: list[WeightDecl], quantized: set[str], params: ResolvedParams,
               loras: Sequence[LoraSpec]) -> dict[str, list[LoraUpdate]]:
    from .lora import conventions, map_loras

    return map_loras(loras, {d.name: d for d in decls}, conventions(recipe, load_recipe), params.values, quantized,
                     recipe.doc.name, recipe.doc.lora_refused)


def with_quantization(recipe: LoadedRecipe, quantization: QuantizationSpec) -> LoadedRecipe:
    """The same loaded recipe with its ``weights.quantization`` block replaced."""
    doc = recipe.doc
    assert isinstance(doc, ModelRecipe)
    weights = doc.weights.model_copy(update={"quantization": quantization})
    return replace(recipe, doc=doc.model_copy(update={"weights": weights}))


# ---- inputs and outputs ------------------------------------------------------------------------------------
def _graph_inputs(
    recipe: LoadedRecipe, root: Instance, params: ResolvedParams, graph: Graph
) -> dict[str, Tensor]:
    doc = recipe.doc
    assert isinstance(doc, ModelRecipe)
    names = {**params.values, **{d: Expr.symbol(d) for d in doc.dims}}
    out = {}
    for name in root.spec.inputs:
        spec = doc.inputs[name]
        origin = recipe.origin("inputs", name)
        shape = []
        for index, expr in enumerate(spec.shape):
            value = eval_field(
                expr, list_item_origin(origin, "shape", index), names, f"shape of input '{name}'"
            )
            if isinstance(value, bool) or not isinstance(value, (int, Expr)):
                raise list_item_origin(origin, "shape", index).error(
                    f"input '{name}': dimension {index} is {value!r}; use integers, parameters or `dims`"
                )
            shape.append(value)
        out[name] = graph.input(name, tuple(shape), spec.dtype)
    return out


def _mark_outputs(recipe: LoadedRecipe, graph: Graph, result: Any) -> list[str]:
    doc = recipe.doc
    assert isinstance(doc, ModelRecipe)
    values = list(result) if isinstance(result, (tuple, list)) else [result]
    names = doc.outputs or (["output"] if len(values) == 1 else [f"output{i}" for i in range(len(values))])
    root_forward = recipe.modules[doc.root].origin.at("forward")
    if len(names) != len(values):
        raise root_forward.error(
            f"the root module returns {len(values)} value(s) but `outputs:` names "
            f"{len(names)} ({', '.join(names)}); make them agree."
        )
    for name, value in zip(names, values):
        if not isinstance(value, Tensor):
            raise root_forward.error(
                f"output '{name}' is a {type(value).__name__}, not a tensor; return tensors "
                f"from the root module."
            )
        graph.mark_output(name, value)
    return names


# ---- weights -----------------------------------------------------------------------------------------------
def _owner(name: str) -> str:
    return name[: -len(".weight")] if name.endswith(".weight") else name


def _quantized_names(decls: list[WeightDecl], quant: QuantizationSpec | None, with_checkpoint: bool) -> set[str]:
    """The weights the quantization block covers. GGUF: none when the file is read (each tensor is kept in the type
    it is stored in, ``gguf_packed.py``); from shapes only, those ``type`` blocks fit (as ComfyUI-GGUF's quantizer
    keeps a matrix whose rows are no whole number of blocks in F16)."""
    if quant is None:
        return set()
    if quant.format == "gguf":
        if with_checkpoint:
            return set()
        from ..graph.gguf_blocks import block_size

        return {d.name for d in decls if _is_quantized(d, quant) and d.shape[1] % block_size(quant.type) == 0}
    return {d.name for d in decls if _is_quantized(d, quant)}


def _is_quantized(decl: WeightDecl, quant: QuantizationSpec) -> bool:
    if not decl.name.endswith(".weight") or len(decl.shape) != 2:
        return False
    owner = _owner(decl.name)
    hit = any(fnmatch.fnmatchcase(owner, p) for p in quant.modules)
    return hit and not any(fnmatch.fnmatchcase(owner, p) for p in quant.exclude)


def _graph_dtype(name: str) -> DType | None:
    return SAFETENSORS_NAMES.get(name)


class _WeightFactory:
    """Creates each graph weight on first use; a quantized weight becomes its packed tensors + dequantize."""

    def __init__(
        self, graph: Graph, doc: ModelRecipe, mapped: dict[str, MappedTensor] | None, quantized: set[str],
        updates: Mapping[str, list[LoraUpdate]] | None = None, checkpoint: Any = None,
    ):
        self.graph = graph
        self.checkpoint = checkpoint
        self.policy = doc.weights.dtype
        self.quant = doc.weights.quantization
        self.mapped = mapped
        self.quantized = quantized
        self.updates = dict(updates or {})  # weight name -> its LoRA updates
        self.cache: dict[str, Tensor] = {}
        self.bindings: dict[str, WeightBinding] = {}
        self.lora_weights: dict[str, LoraWeight] = {}

    def tensor(self, instance: Instance, local: str) -> Tensor:
        decl = instance.weights[local]
        if decl.name not in self.cache:
            if decl.name in self.quantized:
                self.cache[decl.name] = self._dequantized(decl)
            else:
                self.cache[decl.name] = self._dense(decl)
            if decl.name in self.updates:
                self.cache[decl.name] = self._adapted(decl, self.cache[decl.name])
            return self.cache[decl.name]
        from .gguf_packed import per_use

        return per_use(self.cache[decl.name])

    def _adapted(self, decl: WeightDecl, base: Tensor) -> Tensor:
        """The weight with its LoRA updates: merged into its loader (dense weights, mode auto or merge), and/or
        as a ``LoraWeight`` whose ``linear`` adds them in the graph (quantized weights, or mode graph)."""
        from .lora import merged

        updates = self.updates[decl.name]
        in_graph = [u for u in updates if u.spec.mode == "graph" or
                    (u.spec.mode == "auto" and decl.name in self.quantized)]
        into_weight = [u for u in updates if u not in in_graph]
        binding = self.bindings[decl.name]
        if into_weight and binding.load is not None:
            binding.load = merged(binding.load, into_weight)
        if not in_graph:
            return base
        pairs = []
        for k, update in enumerate(in_graph):
            (down_shape, up_shape) = update.shapes()
            down = self._lora_source(f"{decl.name}.lora{k}.down", down_shape, update, update.down)
            up = self._lora_source(f"{decl.name}.lora{k}.up", up_shape, update, update.up)
            pairs.append((down, up, update.scale))
        self.lora_weights[decl.name] = LoraWeight(base, pairs)
        return self.lora_weights[decl.name]

    def _lora_source(self, name: str, shape: tuple[int, ...], update: LoraUpdate,
                     load: Callable[[], np.ndarray]) -> Tensor:
        stored = update.file.checkpoint.tensors[update.layer.down if name.endswith(".down") else update.layer.up]
        dtype = _graph_dtype(stored.dtype)
        if dtype is None or not dtype.is_float:
            raise LoraError(f"{update.spec.where}: '{stored.name}' is {stored.dtype}; LoRA weights are F32, F16 "
                            f"or BF16")
        self.bindings[name] = WeightBinding(name, tuple(shape), dtype, load, (f"{update.file.path}:{stored.name}",))
        return self.graph.weight(name, shape, dtype)

    def check_lora_use(self, decls: Mapping[str, WeightDecl]) -> None:
        """Every weight with LoRA updates in the graph went only into ``linear`` (which adds them): any other use
        would drop them silently."""
        for name, weight in self.lora_weights.items():
            allowed = {i for used in weight.applied for i in used}
            users = [node.op for node in self.graph.nodes
                     if node.id not in allowed and any(src == weight.node for src, _ in node.inputs)]
            if users or not weight.applied:
                how = f"in {users[0]} (not through linear)" if users else "by no linear"
                raise decls[name].origin.error(
                    f"weight '{name}' has LoRA updates to add in the graph, but the forward uses it {how}; a "
                    f"low-rank update is added only beside linear(x, weight). Merge it instead (mode: merge), "
                    f"which needs the weight unquantized")

    def _source(self, name: str, shape: tuple[int, ...], dtype: DType) -> Tensor:
        stored = self.mapped.get(name) if self.mapped is not None else None
        load = None
        if stored is not None:
            shape = stored.shape
            load = stored.load
        self.bindings[name] = WeightBinding(name, tuple(shape), dtype, load, stored.sources if stored else ())
        return self.graph.weight(name, shape, dtype)

    def _dense(self, decl: WeightDecl) -> Tensor:
        compute = to_dtype(self.policy.compute)
        if self.mapped is not None and decl.dtype == "checkpoint" and decl.name not in self.updates:
            from .gguf_packed import packed_weight  # a GGUF tensor kept packed, decoded in the graph

            def bind(name, shape, dtype, load, sources):
                self.bindings[name] = WeightBinding(name, tuple(shape), dtype, load, sources)

            packed = packed_weight(self.graph, self.checkpoint, self.mapped.get(decl.name), decl.name,
                                   str(compute), bind)
            if packed is not None:
                return packed
        if decl.dtype != "checkpoint":
            dtype = to_dtype(decl.dtype)
        elif self.mapped is not None and decl.name in self.mapped:
            dtype = _graph_dtype(self.mapped[decl.name].dtype) or compute
        else:
            dtype = to_dtype(self.policy.assume) if self.policy.assume else compute
        if self.policy.storage == "compute" and dtype.is_float:
            dtype = compute
        return self._source(decl.name, decl.shape, dtype)

    def _dequantized(self, decl: WeightDecl) -> Tensor:
        from ..ops import dequant_fp8, dequant_nvfp4
        from ..weights.formats import nvfp4_layout

        assert self.quant is not None
        owner = _owner(decl.name)
        n, k = decl.shape
        compute = self.policy.compute
        if self.quant.format == "gguf":  # planned from shapes only: `type` blocks decoded in the graph
            from ..graph import dequant, gguf_blocks

            packed = self._source(decl.name, (n, gguf_blocks.row_bytes(self.quant.type, k)), DType.U8)
            return dequant(packed, self.quant.type, to_dtype(compute))
        if self.quant.format == "fp8":
            weight = self._source(decl.name, (n, k), DType.F8E4M3)
            scale_shape = () if self.quant.scale == "per_tensor" else (n,)
            scale = self._source(f"{owner}.weight_scale", scale_shape, DType.F32)
            return dequant_fp8(weight, scale, compute)
        layout = nvfp4_layout(self.quant.layout or "modelopt")
        weight = self._source(decl.name, layout.weight_shape(n, k), DType.U8)
        scale = self._source(f"{owner}.weight_scale", layout.scale_shape(n, k), DType.F8E4M3)
        scale_2 = self._source(f"{owner}.weight_scale_2", (), DType.F32)
        return dequant_nvfp4(weight, scale, scale_2, n, k, layout.name, compute)


# ---- checkpoint checks -------------------------------------------------------------------------------------
def _map(recipe: LoadedRecipe, checkpoint: Any, params: ResolvedParams) -> dict[str, MappedTensor]:
    doc = recipe.doc
    assert isinstance(doc, ModelRecipe)
    stored = {name: StoredTensor(tuple(info.shape), info.dtype) for name, info in checkpoint.tensors.items()}

    def split_sizes(index: int, rule: Any) -> list[int]:
        origin = recipe.origin("weights", "split", index, "sizes")
        return [eval_field(s, origin.at(i), params.values, "split size") for i, s in enumerate(rule.sizes)]

    return map_checkpoint(stored, doc.weights, checkpoint.load, split_sizes)


def _check_against_checkpoint(
    recipe: LoadedRecipe,
    decls: list[WeightDecl],
    quantized: set[str],
    mapped: dict[str, MappedTensor],
    checkpoint: Any,
) -> None:
    """Every declared weight present with the declared shape and dtype; nothing left over. All at once."""
    from ..weights.check import ExpectedTensor, QuantSpec, check_checkpoint, safetensors_dtype

    doc = recipe.doc
    assert isinstance(doc, ModelRecipe)
    grouped: dict[tuple, list[str]] = {}  # (problem text, location) -> instance names
    used: set[str] = set()
    for decl in decls:
        if decl.name in quantized:
            continue
        tensor = mapped.get(decl.name)
        if tensor is None:
            hint = did_you_mean(decl.name, mapped)
            grouped.setdefault(
                (
                    str(decl.origin.loc(key=True)),
                    f"weight '{decl.local}' is missing from the checkpoint{{names}}{hint}",
                ),
                [],
            ).append(decl.name)
            continue
        used.add(decl.name)
        problem = _shape_problem(decl, tensor)
        if problem:
            grouped.setdefault(problem, []).append(decl.name)
        stored_dtype = tensor.dtype
        companion = mapped.get(f"{_owner(decl.name)}.weight_scale")
        if companion is not None and stored_dtype in ("U8", "F8_E4M3"):
            grouped.setdefault(
                (
                    str(decl.origin.loc(key=True)),
                    f"weight '{decl.local}' is quantized in the "
                    f"checkpoint ({stored_dtype} with a weight_scale){{names}} but the recipe has no "
                    f"quantization block covering it; add `weights.quantization`",
                ),
                [],
            ).append(decl.name)
            used.add(companion.name)
        elif decl.dtype != "checkpoint" and safetensors_dtype(decl.dtype) != stored_dtype:
            grouped.setdefault(
                (
                    str(decl.origin.loc(key=True)),
                    f"weight '{decl.local}' is {stored_dtype} in the "
                    f"checkpoint{{names}}, the recipe expects {decl.dtype}",
                ),
                [],
            ).append(decl.name)
        elif _graph_dtype(stored_dtype) is None:
            grouped.setdefault(
                (
                    str(decl.origin.loc(key=True)),
                    f"weight '{decl.local}' is {stored_dtype}"
                    f"{{names}}, which the graph cannot hold; set `weights.dtype.storage: compute`",
                ),
                [],
            ).append(decl.name)
        elif decl.dtype == "checkpoint" and str(_graph_dtype(stored_dtype)) not in doc.weights.dtype.accept:
            accepted = ", ".join(doc.weights.dtype.accept)
            grouped.setdefault(
                (
                    str(decl.origin.loc(key=True)),
                    f"weight '{decl.local}' is {stored_dtype} in the checkpoint{{names}}, but the recipe takes "
                    f"its dtype from the checkpoint and accepts only {accepted} (weights.dtype.accept); a "
                    f"relabelled or wrong tensor must not run. Declare `dtype: "
                    f"{_graph_dtype(stored_dtype)}` on the weight if the file is right",
                ),
                [],
            ).append(decl.name)
    lines = [f"{loc}: {text.format(names=_names(names))}" for (loc, text), names in grouped.items()]
    quant = doc.weights.quantization
    expected = {}
    if quant is not None and quant.format != "gguf":  # a GGUF file's tensors are checked as stored, by shape
        spec = QuantSpec(quant.format, quant.layout if quant.format == "nvfp4" else quant.scale)
        expected = {d.name: ExpectedTensor(d.shape, None, spec) for d in decls if d.name in quantized}
        for name in expected:
            used.update(
                n
                for n in (
                    name,
                    *(f"{_owner(name)}.{s}" for s in ("weight_scale", "weight_scale_2", "input_scale")),
                )
                if n in mapped
            )
    try:
        check_checkpoint(expected, _MappedView(checkpoint, mapped), ignore_unexpected=["*"])
    except CheckpointError as exc:
        lines += [line.strip()[2:] for line in str(exc).splitlines() if line.strip().startswith("- ")]
    unexpected = sorted(n for n in mapped if n not in used)
    if unexpected and doc.weights.unused == "error":
        shown = ", ".join(f"'{n}'" for n in unexpected[:_LIST_LIMIT])
        more = f" and {len(unexpected) - _LIST_LIMIT} more" if len(unexpected) > _LIST_LIMIT else ""
        lines.append(
            f"{len(unexpected)} checkpoint tensor(s) no weight of the recipe uses: {shown}{more} (map "
            f"them with weights.rename rules, or list them under weights.ignore)"
        )
    if lines:
        where = getattr(checkpoint, "root", "the checkpoint")
        raise CheckpointError(
            f"checkpoint {where} does not match recipe {recipe.source.display} "
            f"({len(lines)} problem{'s' * (len(lines) != 1)}):\n"
            + "\n".join(f"  - {line}" for line in lines)
            + "\nFix the recipe's shapes or weights section, or point --weights at the "
            "checkpoint this recipe describes."
        )


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return f" ({shown})"


def _shape_problem(decl: WeightDecl, tensor: MappedTensor) -> tuple[str, str] | None:
    if tuple(tensor.shape) == tuple(decl.shape):
        return None
    origin = decl.origin
    if len(tensor.shape) == len(decl.shape):
        axis = next(i for i, (a, b) in enumerate(zip(decl.shape, tensor.shape)) if a != b)
        origin = decl.shape_origins[axis]
        spec_value = origin.source.data
        for key in origin.path:
            spec_value = spec_value[key]
        detail = f"dimension {axis} ('{spec_value}') evaluates to {decl.shape[axis]}"
    else:
        detail = f"the recipe declares {len(decl.shape)} dimensions"
    return (
        str(origin.loc()),
        f"shape of weight '{decl.local}' does not agree with the checkpoint{{names}}: "
        f"recipe {list(decl.shape)}, checkpoint {list(tensor.shape)}; {detail}",
    )


class _MappedView:
    """The checkpoint seen through the recipe's name mapping, for the weights package's quant checks."""

    def __init__(self, checkpoint: Any, mapped: dict[str, MappedTensor]):
        from ..weights.safetensors_io import TensorInfo

        self.root = checkpoint.root
        self.tensors = {}
        for name, tensor in mapped.items():
            first = checkpoint.tensors[tensor.sources[0]]
            self.tensors[name] = TensorInfo(
                name, tuple(tensor.shape), tensor.dtype, first.file, first.start, first.end
            )
        self.names = sorted(self.tensors)
        self.quantization_metadata = checkpoint.quantization_metadata

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def __getitem__(self, name: str) -> Any:
        return self.tensors[name]
