"""The recipe schema: pydantic models for the two document kinds, ``kind: model`` and ``kind: pipeline``.

Two sorts of fields hold computed values, and the difference is deliberate:

* value fields (``params`` defaults, a pipeline's ``set``) are YAML values; a string of the form ``${...}`` is
  an expression, any other string is text;
* expression fields (weight and input shapes, ``repeat``, ``when``, ``with``, module ``params``, split
  ``sizes``) are always expressions (``hidden // heads``); ``${...}`` around them is accepted and ignored.

Unknown keys are rejected everywhere, with the closest allowed key suggested.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, field_validator, model_validator
from pydantic_core import PydanticCustomError

from . import regexes
from .suggest import did_you_mean, one_of

Scalar = int | float | bool | str | None
ExprField = int | float | bool | str  # an expression, or a literal number
ValueField = int | float | bool | str | list | None  # a YAML value; "${...}" strings are expressions

IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
DOTTED = re.compile(r"^[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*$")
PARAM_TYPE = re.compile(r"^(int|float|bool|str|list\[(int|float|bool|str)\])(\s*\|\s*None)?$")
INPUT_TYPE = re.compile(r"^(int|float|bool|str|array|list\[(int|float|bool|str|array)\])$")
DTYPES = ("f32", "f16", "bf16", "f8e4m3", "f8e5m2", "f4e2m1", "i32", "u8", "bool")


class Strict(BaseModel):
    """Base of every schema object: unknown keys are errors, with a suggestion; a key an older version read
    (``REMOVED``) is an error saying what to write instead."""

    model_config = ConfigDict(extra="forbid", populate_by_name=False, validate_default=False)
    REMOVED: ClassVar[dict[str, str]] = {}  # key -> why it is gone and what to write instead

    @model_validator(mode="before")
    @classmethod
    def _reject_unknown_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            allowed = [f.alias or name for name, f in cls.model_fields.items()]
            for key in data:
                if key in cls.REMOVED:
                    raise PydanticCustomError(
                        "removed_key", "key '{key}' is no longer read: {why}", {"key": str(key),
                                                                               "why": cls.REMOVED[key]})
                if key not in allowed:
                    raise PydanticCustomError(
                        "unknown_key",
                        "unknown key '{key}'{hint}; allowed keys here: {allowed}",
                        {
                            "key": str(key),
                            "hint": did_you_mean(str(key), allowed),
                            "allowed": one_of(allowed),
                        },
                    )
        return data


def _check_ident(name: str, what: str) -> str:
    if not IDENT.match(name):
        raise ValueError(
            f"{what} '{name}' is not an identifier; use letters, digits and '_' (not first a digit)"
        )
    return name


def _check_dtype(value: str, allow_checkpoint: bool) -> str:
    allowed = list(DTYPES) + (["checkpoint"] if allow_checkpoint else [])
    if value not in allowed:
        raise ValueError(
            f"unknown dtype '{value}'{did_you_mean(value, allowed)}; use one of {', '.join(allowed)}"
        )
    return value


# ---- parameters --------------------------------------------------------------------------------------------
class ParamSpec(Strict):
    """A recipe parameter. Short form ``name: value``; long form ``name: {type, default, doc, choices, min, max,
    positive, finite}``. In a module library (``kind: modules``), an entry without ``default`` declares a parameter
    the including recipe defines: its ``type``, ``choices`` and ranges are checked on the includer's value."""

    type: str | None = Field(
        None,
        description="int, float, bool, str, list[int]..., optionally '| None'; "
        "inferred from the default when absent",
    )
    default: ValueField = Field(None, description="a YAML value, or '${expression}' over config and params")
    doc: str | None = None
    choices: list[Scalar] | None = Field(None, description="allowed values")
    min: ExprField | None = Field(
        None, description="smallest allowed value (of each item, for a list): an expression over params"
    )
    max: ExprField | None = Field(
        None, description="largest allowed value (of each item, for a list): an expression over params"
    )
    positive: bool = Field(False, description="true: the value (each item, for a list) must be > 0")
    finite: bool = Field(
        True, description="false: NaN and infinities are accepted; by default every float value (from config.json, "
        "a default or --set) must be finite"
    )

    @field_validator("type")
    @classmethod
    def _known_type(cls, value: str | None) -> str | None:
        if value is not None and not PARAM_TYPE.match(value.strip()):
            raise ValueError(
                f"unknown parameter type '{value}'; use int, float, bool, str, list[int], "
                f"list[float], list[bool] or list[str], optionally followed by '| None'"
            )
        return value


def _params_short_form(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: (v if isinstance(v, dict) else {"default": v}) for k, v in value.items()}
    return value


# ---- config.json fields -------------------------------------------------------------------------------------
class ConfigFields(Strict):
    """What a model recipe does with each field of its checkpoint's config.json (dotted paths such as
    ``text_config.hidden_act``; a path covers everything below it)."""

    read: list[str] = Field(
        default_factory=list, description="fields the parameters read (sizes, eps, theta...), any value accepted"
    )
    require: dict[str, list[Any]] = Field(
        default_factory=dict,
        description="fields the reference reads whose values this recipe implements: when present, the value "
        "must be one of these (absent: the reference's default, which must be one of them too)",
    )
    ignore: dict[str, str] = Field(
        default_factory=dict,
        description="fields that cannot change the reference's output for this recipe, each with the reason",
    )

    @model_validator(mode="after")
    def _paths(self) -> ConfigFields:
        seen: dict[str, str] = {}
        for group, paths in (("read", self.read), ("require", self.require), ("ignore", self.ignore)):
            for path in paths:
                if not DOTTED.match(path):
                    raise ValueError(f"config field '{path}' must be dotted keys such as 'text_config.hidden_act'")
                if path in seen:
                    raise ValueError(f"config field '{path}' is listed under both `{seen[path]}` and `{group}`")
                seen[path] = group
        for path, values in self.require.items():
            if not values:
                raise ValueError(f"config field '{path}' under `require` needs at least one allowed value")
        return self


# ---- model documents ---------------------------------------------------------------------------------------
class WeightSpec(Strict):
    """A weight of a module. Short form ``name: [dims...]``."""

    shape: list[ExprField] = Field(
        description="one expression per dimension, e.g. [heads * head_dim, hidden]"
    )
    dtype: str = Field("checkpoint", description="expected dtype, or 'checkpoint' to take it from the file")
    when: ExprField | None = Field(
        None, description="the weight exists only when this expression is true (e.g. an optional bias)"
    )
    REMOVED: ClassVar[dict[str, str]] = {
        "doc": "nothing showed a weight's doc; say what the weight is in a YAML comment (# ...) beside it"}

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, value: str) -> str:
        return _check_dtype(value, allow_checkpoint=True)


class StateSpec(Strict):
    """A persistent state of a module (a KV cache): lives in the executable across runs, starts at zero, and is
    written with ``update_cache``. Short form ``name: [dims...]``."""

    shape: list[ExprField] = Field(
        description="one expression per dimension, over params and symbolic `dims` (e.g. [cache, batch, "
        "kv_heads, head_dim])"
    )
    dtype: str = Field("compute", description="its dtype; 'compute' (default) is weights.dtype.compute")
    doc: str | None = None

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, value: str) -> str:
        return value if value == "compute" else _check_dtype(value, allow_checkpoint=False)


class SubmoduleSpec(Strict):
    """A child module instance. Short form ``name: module_name``."""

    module: str = Field(description="name of a module defined under `modules` (here or in an included file)")
    repeat: ExprField | None = Field(
        None,
        description="instantiate N times (checkpoint names get .0, .1, ...); "
        "index in forward with self.name[i]",
    )
    with_: dict[str, ExprField | None] = Field(
        default_factory=dict, alias="with", description="values for the child module's params (expressions)"
    )
    when: ExprField | None = Field(None, description="instantiate only when this expression is true")
    path: str | None = Field(None, description="checkpoint name of the child (default: its key)")

    @field_validator("path")
    @classmethod
    def _path(cls, value: str | None) -> str | None:
        if value is not None and value != "" and not DOTTED.match(value):
            raise ValueError(f"path '{value}' must be dotted names such as 'model.layers' (or '' for none)")
        return value


class ModuleSpec(Strict):
    """A module: weights, child modules and a forward written in the expression language."""

    doc: str | None = None
    params: dict[str, ExprField | None] = Field(
        default_factory=dict,
        description="module parameters with default expressions (null: must be given "
        "with `with`); visible by name in shapes and forward",
    )
    inputs: list[str] = Field(default_factory=list, description="positional arguments of forward")
    options: dict[str, Scalar] = Field(
        default_factory=dict, description="keyword arguments of forward with their default values"
    )
    weights: dict[str, WeightSpec] = Field(default_factory=dict)
    states: dict[str, StateSpec] = Field(
        default_factory=dict,
        description="persistent states (KV caches), named by the instance path like weights; read as self.NAME",
    )
    submodules: dict[str, SubmoduleSpec] = Field(default_factory=dict)
    forward: str = Field(description="statements of the expression language; must end with `return`")

    @field_validator("weights", "states", mode="before")
    @classmethod
    def _weights_short_form(cls, value: Any) -> Any:
        if isinstance(value, dict):
            return {k: ({"shape": v} if isinstance(v, list) else v) for k, v in value.items()}
        return value

    @field_validator("submodules", mode="before")
    @classmethod
    def _submodules_short_form(cls, value: Any) -> Any:
        if isinstance(value, dict):
            return {k: ({"module": v} if isinstance(v, str) else v) for k, v in value.items()}
        return value

    @field_validator("inputs")
    @classmethod
    def _inputs(cls, value: list[str]) -> list[str]:
        for name in value:
            _check_ident(name, "input")
        return value

    @field_validator("states")
    @classmethod
    def _state_names(cls, value: dict[str, StateSpec]) -> dict[str, StateSpec]:
        for name in value:
            _check_ident(name, "state")
        return value

    @field_validator("weights")
    @classmethod
    def _weight_names(cls, value: dict[str, WeightSpec]) -> dict[str, WeightSpec]:
        for name in value:
            if not DOTTED.match(name) or not IDENT.match(name.split(".")[0]):
                raise ValueError(f"weight name '{name}' must be dotted identifiers such as 'q_proj.weight'")
        return value


class InputSpec(Strict):
    """A graph input of the model (its root module's `inputs`)."""

    shape: list[ExprField] = Field(description="expressions over params and symbolic `dims`")
    dtype: str = "f32"
    doc: str | None = None

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, value: str) -> str:
        return _check_dtype(value, allow_checkpoint=False)


class RenameRule(Strict):
    """Rewrite checkpoint names into recipe names: a prefix swap or a regex substitution."""

    prefix: str | None = Field(None, description="checkpoint names starting with this prefix...")
    regex: str | None = Field(None, description="...or matching this regex (re.sub with `to`)...")
    to: str = Field(description="...get this replacement")

    @model_validator(mode="after")
    def _one_kind(self) -> RenameRule:
        if (self.prefix is None) == (self.regex is None):
            raise ValueError("a rename rule needs exactly one of `prefix` or `regex`, plus `to`")
        if self.regex is not None:
            _check_regex(self.regex)
        return self


class SplitRule(Strict):
    """A fused checkpoint tensor (e.g. packed QKV) split on load into several recipe weights."""

    regex: str = Field(description="matches the fused tensor's (renamed) name; groups usable in `into`")
    into: list[str] = Field(description="recipe names of the parts, with \\1-style group references")
    axis: int = 0
    sizes: list[ExprField] | None = Field(None, description="part sizes along `axis` (default: equal parts)")

    @field_validator("regex")
    @classmethod
    def _regex(cls, value: str) -> str:
        return _check_regex(value)


class StackRule(Strict):
    """Per-expert (or per-layer) checkpoint tensors stacked into one recipe weight along a new axis."""

    regex: str = Field(
        description="matches each part; must have a named group (?P<index>...) giving its position"
    )
    into: str = Field(description="recipe name of the stacked weight, with \\1-style group references")
    axis: int = 0

    @field_validator("regex")
    @classmethod
    def _regex(cls, value: str) -> str:
        _check_regex(value)
        if "(?P<index>" not in value:
            raise ValueError(
                "a stack regex needs a named group (?P<index>\\d+) for the position of each part"
            )
        return value


class TransposeRule(Strict):
    """Recipe weights stored transposed on disk."""

    regex: str = Field(description="matches recipe weight names")
    axes: list[int] | None = Field(None, description="permutation (default: reverse the axes)")

    @field_validator("regex")
    @classmethod
    def _regex(cls, value: str) -> str:
        return _check_regex(value)


def _check_regex(value: str) -> str:
    try:
        regexes.compile_pattern(value)  # the engine the rules run on (recipe/regexes.py)
    except regexes.ERRORS as exc:
        raise ValueError(f"invalid regular expression '{value}': {exc}") from None
    return value


class DtypePolicy(Strict):
    storage: Literal["keep", "compute"] = Field(
        "keep",
        description="keep: weights stay in their checkpoint dtype (bf16/fp8/fp4 packed) until used; "
        "compute: cast on load",
    )
    compute: str = Field("f32", description="dtype the ops compute in")
    assume: str | None = Field(
        None,
        description="dtype of weights declared `checkpoint` when the model is built from shapes only "
        "(inspect without weights); default: the compute dtype",
    )
    per_op: dict[str, str] = Field(
        default_factory=dict,
        description="compute dtype per op (e.g. {attention: f32, linear: bf16}): float tensor arguments are "
        "cast to it and float results back to `compute`",
    )
    accept: list[str] = Field(
        default_factory=lambda: ["f32", "f16", "bf16"],
        description="dtypes a weight declared `dtype: checkpoint` may have in the checkpoint; any other is "
        "refused (a float tensor relabelled as integers must not run). Weights of other dtypes declare them.",
    )

    @field_validator("accept")
    @classmethod
    def _accept(cls, value: list[str]) -> list[str]:
        for dtype in value:
            _check_dtype(dtype, allow_checkpoint=False)
        return value

    @field_validator("compute", "assume")
    @classmethod
    def _compute(cls, value: str | None) -> str | None:
        return value if value is None else _check_dtype(value, allow_checkpoint=False)

    @field_validator("per_op")
    @classmethod
    def _per_op(cls, value: dict[str, str]) -> dict[str, str]:
        for dtype in value.values():
            _check_dtype(dtype, allow_checkpoint=False)
        return value


class QuantizationSpec(Strict):
    format: Literal["fp8", "nvfp4", "gguf"]
    layout: Literal["modelopt", "comfy"] | None = Field(
        None,
        description="nvfp4 only: modelopt (element 0 in the low nibble, row-major scales) or comfy "
        "(high nibble first, 128x4 swizzled scales)",
    )
    scale: Literal["per_tensor", "per_channel"] = Field(
        "per_tensor", description="fp8 weight scale granularity"
    )
    modules: list[str] = Field(
        default_factory=lambda: ["*"],
        description="glob patterns over recipe weight owners (e.g. 'layers.*.mlp.*')",
    )
    exclude: list[str] = Field(default_factory=list, description="glob patterns kept in full precision")
    architecture: str | None = Field(
        None, description="gguf only: the GGUF file's general.architecture this model reads (another is refused)")
    type: str | None = Field(
        None, description="gguf only: the block type (e.g. Q4_K) the matched weights are planned in when the model "
        "is built from shapes (inspect without the file); with the file, each tensor keeps the type it is stored in")

    @model_validator(mode="after")
    def _layout(self) -> QuantizationSpec:
        if self.format == "gguf":
            from ..graph.gguf_blocks import QTYPES

            planned = [t for t in QTYPES if t not in ("F32", "F16", "BF16")]
            if self.architecture is None or self.type not in planned:
                raise ValueError(
                    "gguf quantization must state `architecture:` (the file's general.architecture) and `type:`, "
                    f"the block type planned without the file (one of {', '.join(planned)})")
            if self.layout is not None:
                raise ValueError("`layout` applies to nvfp4 only; remove it for gguf")
            return self
        if self.architecture is not None or self.type is not None:
            raise ValueError("`architecture` and `type` apply to format gguf only")
        if self.format == "nvfp4" and self.layout is None:
            raise ValueError(
                "nvfp4 quantization must state `layout: modelopt` or `layout: comfy` (nibble order "
                "and scale swizzle differ; guessing wrong produces garbage images)"
            )
        if self.format == "fp8" and self.layout is not None:
            raise ValueError("`layout` applies to nvfp4 only; remove it for fp8")
        return self


class WeightsSection(Strict):
    source: str | None = Field(
        None,
        description="hf://org/repo[@revision][/subfolder] or a local folder "
        "(relative to the recipe); --weights overrides it",
    )
    config: str | None = Field("config.json", description="the checkpoint's config file, read as `config`")
    rename: list[RenameRule] = Field(default_factory=list)
    split: list[SplitRule] = Field(default_factory=list)
    stack: list[StackRule] = Field(default_factory=list)
    transpose: list[TransposeRule] = Field(default_factory=list)
    ignore: list[str] = Field(
        default_factory=list, description="regexes of checkpoint tensors the recipe does not use"
    )
    unused: Literal["error", "ignore"] = Field(
        "error",
        description="checkpoint tensors no recipe weight uses: an error, or allowed (e.g. a text encoder "
        "that runs only its first layers)",
    )
    dtype: DtypePolicy = Field(default_factory=DtypePolicy)
    quantization: QuantizationSpec | None = None


class GenerationSpec(Strict):
    """Marks a decoder as a language model that `run` generates text with (recipes/README.md, "Language
    models"): the inputs `tokens`/`positions`, the output `logits` and the dims `seq ctx cache keep` are fixed
    names."""

    context: ExprField = Field(
        description="the longest sequence (prompt + generated tokens) the model takes, an expression over params "
        "(e.g. max_positions, a param read from config.max_position_embeddings)"
    )


class AcceptsSpec(Strict):
    """The checkpoints a recipe is chosen for when `luminal-recipe run --weights W` (or
    ``Pipeline.from_pretrained(W)``) is given no recipe: what the checkpoint's own files say it is. Read from this
    recipe file only (a recipe that `extends:` another states its own, or is never chosen this way)."""

    model_index: list[str] = Field(
        default_factory=list, description="diffusers pipeline classes: model_index.json `_class_name`")
    architectures: list[str] = Field(
        default_factory=list, description="transformers model classes: config.json `architectures`")
    model_types: list[str] = Field(
        default_factory=list, description="config.json `model_type` values (used when no architecture matches)")
    gguf: list[str] = Field(
        default_factory=list, description="GGUF `general.architecture` values (a single .gguf file)")


class ModelRecipe(Strict):
    kind: Literal["model"]
    name: str
    doc: str | None = None
    include: list[str] = Field(
        default_factory=list,
        description="YAML files (inside this recipe's folder) whose modules are merged in",
    )
    params: dict[str, ParamSpec] = Field(default_factory=dict)
    dims: list[str] = Field(default_factory=list, description="symbolic dimensions bound at run time")
    inputs: dict[str, InputSpec] = Field(default_factory=dict)
    outputs: list[str] = Field(default_factory=list, description="names of the root forward's return values")
    root: str | None = Field(None, description="module whose forward is the model's")
    modules: dict[str, ModuleSpec] = Field(default_factory=dict)
    weights: WeightsSection = Field(default_factory=WeightsSection)
    config: ConfigFields | None = Field(
        None, description="what the recipe does with each field of config.json: read, require values, ignore"
    )
    generation: GenerationSpec | None = Field(
        None, description="present on a language model: `run` generates text with it"
    )
    accepts: AcceptsSpec | None = Field(
        None, description="the checkpoints this recipe is chosen for when `run`/`from_pretrained` get weights and "
        "no recipe (model_index.json class, config.json architectures/model_type, GGUF architecture)"
    )
    lora_names: dict[str, str] | None = Field(
        None,
        description="LoRA files are applied to this model (a pipeline's `loras:` and `--lora` go to the models "
        "that declare this): naming convention -> a model recipe (relative path) whose weights.rename/split rules "
        "map a LoRA layer named that way onto this recipe's weight names; this recipe's own names always apply",
    )
    lora_refused: dict[str, str] = Field(
        default_factory=dict,
        description="weight name (a glob) -> why a LoRA update of it cannot be applied as diffusers applies it (a "
        "weight stored in another layout than diffusers'); a LoRA adapting such a weight is refused with the reason",
    )

    @field_validator("params", mode="before")
    @classmethod
    def _params_short(cls, value: Any) -> Any:
        return _params_short_form(value)

    @field_validator("dims")
    @classmethod
    def _dims(cls, value: list[str]) -> list[str]:
        for name in value:
            _check_ident(name, "dim")
        return value

    @field_validator("outputs")
    @classmethod
    def _outputs(cls, value: list[str]) -> list[str]:
        for name in value:
            _check_ident(name, "output")
        return value

    @field_validator("params", "modules", "inputs")
    @classmethod
    def _names(cls, value: dict[str, Any]) -> dict[str, Any]:
        for name in value:
            _check_ident(name, "name")
        return value


class ModuleLibrary(Strict):
    """An included file: shared modules (and parameters) only."""

    kind: Literal["modules"]
    doc: str | None = None
    include: list[str] = Field(default_factory=list)
    params: dict[str, ParamSpec] = Field(default_factory=dict)
    modules: dict[str, ModuleSpec] = Field(default_factory=dict)
    config: ConfigFields | None = Field(
        None, description="config.json fields the shared modules' parameters read (merged into the including recipe)"
    )

    @field_validator("params", mode="before")
    @classmethod
    def _params_short(cls, value: Any) -> Any:
        return _params_short_form(value)


# ---- pipeline documents ------------------------------------------------------------------------------------
class PipelineModel(Strict):
    recipe: str = Field(description="path of a `kind: model` recipe, relative to this file")
    weights: str | None = Field(None, description="subfolder of the pipeline's checkpoint holding this model")
    set: dict[str, ValueField] = Field(default_factory=dict, description="parameter values for that recipe")
    quantization: QuantizationSpec | None = Field(
        None,
        description="replaces the model recipe's `weights.quantization` (e.g. the same transformer recipe "
        "over an FP8 or NVFP4 checkpoint)",
    )


class PipelineLora(Strict):
    """A LoRA the pipeline applies (``--lora PATH[:SCALE]`` adds more)."""

    path: str = Field(description="a LoRA .safetensors file, relative to this recipe (inside its folder tree)")
    scale: float = Field(1.0, description="its strength: the update is scale * alpha / rank * up @ down")
    model: str | None = Field(None, description="the model it adapts (default: the one whose recipe declares "
                              "`lora_names`)")
    mode: Literal["auto", "merge", "graph"] = Field(
        "auto", description="merge: added into the weights when they are loaded; graph: x @ down.T @ up.T * scale "
        "computed beside the layer's matmul; auto: merge for dense weights, graph for quantized ones (FP8, NVFP4 "
        "keep their packed form)")


class TokenizerSpec(Strict):
    path: str = Field("tokenizer", description="tokenizer folder inside the checkpoint (tokenizer.json)")
    chat_template: str | None = Field(
        None,
        description="replaces the checkpoint's chat template: a Jinja template (rendered as transformers' "
        "apply_chat_template does), or the name of one of the checkpoint's named templates",
    )
    system: str | None = Field(
        None, description="replaces the pipeline's system message (diffusers' Flux2Pipeline.system_message)"
    )
    conversation: Literal["flux2", "user"] = Field(
        "flux2",
        description="the messages a prompt becomes: flux2 = diffusers' Flux2Pipeline (a system message, then the "
        "prompt without [IMG], each one text content block); user = Flux2KleinPipeline (one user message whose "
        "content is the prompt)",
    )
    generation_prompt: bool = Field(
        False, description="render the template's generation prompt (apply_chat_template's add_generation_prompt)"
    )
    template_args: dict[str, ValueField] = Field(
        default_factory=dict,
        description="more variables for the chat template, as apply_chat_template's extra keyword arguments "
        "(Flux2KleinPipeline passes enable_thinking: false)",
    )
    add_special_tokens: bool | None = Field(
        None,
        description="whether tokenizing the rendered text adds the tokenizer's special tokens: true as "
        "tokenizer(text) does (Flux2KleinPipeline); default: as Flux2Pipeline's apply_chat_template does (a "
        "processor adds them unless the text starts with the BOS token, a tokenizer does not)",
    )

    @model_validator(mode="after")
    def _system_needs_one(self) -> TokenizerSpec:
        if self.system is not None and self.conversation != "flux2":
            raise ValueError(f"`system` replaces Flux2Pipeline's system message; conversation "
                             f"'{self.conversation}' has none (a single user message): remove `system`")
        return self


class SchedulerSpec(Strict):
    """The checkpoint's scheduler, as the pipeline's schedule and step steps (``run: schedule``...) read it."""

    config: str | None = Field(None, description="its config file inside the checkpoint (scheduler_config.json)")
    options: dict[str, ValueField] = Field(
        default_factory=dict,
        description="values that replace the config file's (as diffusers' Scheduler.from_config(config, "
        "**options)), e.g. {shift: 3.0}; each must be an option the scheduler reads",
    )
    REMOVED: ClassVar[dict[str, str]] = {
        "name": "the scheduler is what the pipeline's steps implement (schedule, euler_step: flow-match Euler) "
        "and the checkpoint's scheduler config names its class (_class_name, checked); delete the key"}


class PipelineInput(Strict):
    type: str = Field(description="what the pipeline is given: str, int, float, bool, array (a numpy array) or "
                      "list[str|int|float|bool|array]; checked when it runs")
    doc: str | None = None
    optional: bool = Field(False, description="the input may be left out (its value is then null)")

    @field_validator("type")
    @classmethod
    def _known_type(cls, value: str) -> str:
        if not INPUT_TYPE.match(value.strip()):
            raise ValueError(
                f"unknown input type '{value}'; use str, int, float, bool, array, list[str], list[int], "
                f"list[float], list[bool] or list[array]"
            )
        return value.strip()


OUTPUT_TYPES = ("image", "array", "text")


class PipelineOutput(Strict):
    """A result `luminal-recipe run` writes. Short form ``name: value`` (type from the value: text for a
    string, else array)."""

    value: str = Field(description="a value name (or an expression over the values) holding the result")
    type: Literal["image", "array", "text"] | None = Field(
        None,
        description="image: a decoded picture (1, 3, H, W) in [-1, 1], written as PNG as diffusers "
        "post-processes it; array: written as .npy; text: printed and written as .txt; "
        "default: text for a string, array otherwise",
    )


class LoopSpec(Strict):
    over: ExprField = Field(description="a value name (e.g. timesteps) or a count expression (e.g. steps)")
    var: str = Field("i", description="loop variable visible to the loop's steps")
    carry: list[str] = Field(
        default_factory=list,
        description="values each iteration reads from the one before (made before the loop, rewritten by a stage "
        "of its body); a body that reads a value before rewriting it must declare it here",
    )
    collect: dict[str, str] = Field(
        default_factory=dict,
        description="value of the body -> list name: after the loop, the list holds that value as each iteration "
        "left it, in order (empty when the loop runs no iteration, or not at all: `when`)",
    )

    @field_validator("var")
    @classmethod
    def _var(cls, value: str) -> str:
        return _check_ident(value, "loop variable")


class StageSpec(Strict):
    name: str
    model: str | None = Field(None, description="a key of `models` to run")
    run: str | None = Field(None, description="a host step of a task plug-in (luminal_recipes/tasks/): tokenize, "
                            "euler_step, full, ...")
    loop: LoopSpec | None = None
    steps: list[StageSpec] = Field(default_factory=list, description="the loop body")
    inputs: dict[str, ExprField] = Field(
        default_factory=dict, description="argument -> expression (a value name, arithmetic, a literal)"
    )
    outputs: dict[str, str] = Field(default_factory=dict, description="result -> value name")
    when: ExprField | None = Field(
        None,
        description="run the stage (a loop: with its body) only when this expression is true; it may read the "
        "pipeline's parameters, config.MODEL.KEY and model_index.KEY (the checkpoint's model_index.json), so it is "
        "decided before the run and memory is planned only for the stages that will run. A value it would have "
        "written has no value after it, but a loop's `collect` lists, which are then empty",
    )
    dims: dict[str, ExprField] = Field(
        default_factory=dict, description="model stages: the model's symbolic dims as expressions over the "
        "pipeline's params (e.g. img: (height // 16) * (width // 16)), so memory is planned before anything runs")

    @model_validator(mode="after")
    def _one_action(self) -> StageSpec:
        actions = [a for a in (self.model, self.run) if a is not None] + (["loop"] if self.loop else [])
        if len(actions) != 1:
            raise ValueError(
                "a stage does exactly one thing: `model: NAME`, `run: STEP`, or `loop:` with `steps`"
            )
        if self.loop is not None and not self.steps:
            raise ValueError("a loop stage needs `steps:` (the stages run on each iteration)")
        if self.steps and self.loop is None:
            raise ValueError("`steps:` belongs to a loop stage; add `loop: {over: ..., var: ...}`")
        return self


class PipelineRecipe(Strict):
    kind: Literal["pipeline"]
    name: str
    doc: str | None = None
    extends: str | None = Field(
        None,
        description="another pipeline recipe in this folder that this one builds on: its keys (but `accepts`) "
        "apply unless this file gives them (mappings merge key by key; a list, such as `stages`, or any other value "
        "is replaced whole)",
    )
    params: dict[str, ParamSpec] = Field(default_factory=dict)
    weights: str | None = Field(
        None, description="hf://org/repo[@rev] or local folder holding all components"
    )
    configs: str | None = Field(
        None, description="folder (relative to this file) with each component's config.json, for planning "
        "memory without the weights (luminal-recipe inspect)"
    )
    models: dict[str, PipelineModel]
    tokenizer: TokenizerSpec | None = None
    scheduler: SchedulerSpec | None = None
    inputs: dict[str, PipelineInput] = Field(default_factory=dict)
    loras: list[PipelineLora] = Field(default_factory=list, description="LoRA files applied to the models")
    stages: list[StageSpec]
    outputs: dict[str, PipelineOutput] = Field(
        default_factory=dict,
        description="what `run` writes: name -> {value, type} (or name -> value, see PipelineOutput)",
    )
    accepts: AcceptsSpec | None = Field(
        None, description="the checkpoints this recipe is chosen for when `run`/`from_pretrained` get weights and "
        "no recipe (model_index.json class, config.json architectures/model_type, GGUF architecture)"
    )

    @field_validator("params", mode="before")
    @classmethod
    def _params_short(cls, value: Any) -> Any:
        return _params_short_form(value)

    @field_validator("outputs", mode="before")
    @classmethod
    def _outputs_short(cls, value: Any) -> Any:
        if isinstance(value, dict):
            return {k: ({"value": v} if isinstance(v, str) else v) for k, v in value.items()}
        return value

    @field_validator("outputs")
    @classmethod
    def _output_names(cls, value: dict[str, PipelineOutput]) -> dict[str, PipelineOutput]:
        for name in value:
            _check_ident(name, "output")
        return value


RecipeDocument = Annotated[ModelRecipe | PipelineRecipe, Field(discriminator="kind")]
DOCUMENT_KINDS = {"model": ModelRecipe, "pipeline": PipelineRecipe, "modules": ModuleLibrary}


def json_schema() -> dict:
    """JSON Schema of recipe files for editors: ``luminal-recipe schema > recipe.schema.json``."""
    schema = TypeAdapter(RecipeDocument).json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "luminal-recipes recipe"
    return schema
