"""LoRA files: the safetensors key formats in use, read into one form (layer name, down/up tensors, scale).

A LoRA adds ``scale * up @ down`` to a linear weight ``[out, in]`` (``down``: ``[rank, in]``, PEFT's ``lora_A``;
``up``: ``[out, rank]``, ``lora_B``). The files spell it in several ways, detected from the keys as diffusers'
``Flux2LoraLoaderMixin.lora_state_dict`` detects them:

========================  ==============================================  =========================================
format                    keys                                            layer names / scale
========================  ==============================================  =========================================
diffusers                 ``transformer.<layer>.lora_A.weight``, ``B``     diffusers' module names; alpha and rank
                                                                          from the ``lora_adapter_metadata`` header
                                                                          (PEFT ``LoraConfig``: ``lora_alpha / r``,
                                                                          ``alpha_pattern``/``rank_pattern``,
                                                                          rsLoRA), else 1
PEFT                      ``base_model.model.<layer>.lora_A.weight``       likewise (PEFT's ``save_pretrained``);
                                                                          alpha and rank from the
                                                                          ``adapter_config.json`` beside the file
fal / ai-toolkit (BFL)    ``diffusion_model.<layer>.lora_A.weight`` (or    Black Forest Labs' module names
                          ``lora_down``/``lora_up``)                       (``double_blocks.0.img_attn.qkv``) or
                                                                          diffusers' expanded ones (its legacy
                                                                          alias ``sformer_blocks.``)
ComfyUI / kohya           ``lora_unet_<layer with _ for .>.lora_down``,    BFL's names (``lora_transformer_``:
                          ``.lora_up``, ``.alpha``                         diffusers'), dots written as ``_``;
                                                                          ``alpha / rank``
========================  ==============================================  =========================================

Any format may carry ``<layer>.alpha`` (scale ``alpha / rank``, as kohya and ComfyUI read it). The file is
untrusted: its JSON (header, metadata, ``adapter_config.json``) is read by ``files.parse_json`` (bounded depth, no
NaN), every ``LoraConfig`` value is checked (``r`` a positive integer, ``lora_alpha`` a finite number), the
matrices must be floating point, and ``rank_pattern``/``alpha_pattern`` keys are matched with PEFT's meaning by
a linear-time automaton (``lora_patterns.py``), never by backtracking. A PEFT
``save_pretrained`` folder keeps its ``LoraConfig`` in ``adapter_config.json``: it is read as PEFT's
``PeftModel.from_pretrained`` reads it (diffusers' ``load_lora_weights`` does not read it and applies scale 1,
which differs from PEFT's whenever ``lora_alpha != r``). Which layer of
which model a name means is the model recipe's business (``recipe/lora.py``). What this module cannot honour is
refused with the file named: DoRA (``dora_scale``, ``lora_magnitude_vector``), LoRA biases, LoKr/LoHa, full
weights (``diff``), and ``LoraConfig`` settings that change the result (``use_dora``, ``lora_bias``...).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import CheckpointError, LoraError
from ..files import MAX_JSON_BYTES, not_regular, parse_json, read_json
from .lora_patterns import compile_patterns, first_match
from .safetensors_io import Checkpoint

METADATA_KEY = "lora_adapter_metadata"  # diffusers' LORA_ADAPTER_METADATA_KEY: a PEFT LoraConfig as JSON
PREFIXES = {  # key prefix -> format name
    "transformer.": "diffusers",
    "base_model.model.": "PEFT",
    "diffusion_model.": "fal/ai-toolkit",
}
KOHYA_PREFIXES = ("lora_unet_", "lora_transformer_")  # ComfyUI's keys: BFL's names, or diffusers' (SimpleTuner)
PEFT_CONFIG = "adapter_config.json"  # PEFT's save_pretrained writes the LoraConfig beside adapter_model.safetensors
# LoraConfig settings that change what the adapter computes, refused when set (others: training-only, metadata)
UNSUPPORTED_CONFIG = ("use_dora", "lora_bias", "fan_in_fan_out", "use_qalora", "layer_replication",
                      "modules_to_save", "trainable_token_indices", "alora_invocation_tokens")
MATRIX_DTYPES = ("F32", "F16", "BF16", "F64")  # LoRA down/up matrices: floating point, as PEFT trains them
ALPHA_DTYPES = (*MATRIX_DTYPES, "I8", "I16", "I32", "I64", "U8", "U16", "U32", "U64")
_PAIR = re.compile(r"^(?P<layer>.+)\.(?P<kind>lora_A|lora_B|lora_down|lora_up)\.weight$")
_ALPHA = re.compile(r"^(?P<layer>.+)\.alpha$")
_NOT_LORA = [  # what else a file may hold, and why it is refused
    (re.compile(r".*(dora_scale|lora_magnitude_vector).*"), "DoRA (weight-decomposed LoRA) is not supported"),
    (re.compile(r".*\.lora_[AB]\.bias$|.*\.lora_(up|down)\.bias$"), "LoRA biases are not supported"),
    (re.compile(r".*\.(lokr_|hada_).*"), "LoKr/LoHa adapters are not supported, only LoRA"),
    (re.compile(r".*\.diff(_b)?$"), "full weight differences (.diff) are not supported, only LoRA"),
]


@dataclass(frozen=True)
class LoraLayer:
    """One adapted layer of a LoRA file."""

    key: str  # the layer as the file spells it, prefix included (for messages)
    name: str  # the layer's name: dotted, or for kohya the underscored form after ``lora_unet_``
    down: str  # the file's tensor names of down ([rank, in]) and up ([out, rank])
    up: str
    rank: int
    scale: float  # alpha / rank (rsLoRA: alpha / sqrt(rank)); 1 when the file gives no alpha
    underscored: bool = False  # kohya: the name's dots are written as underscores


@dataclass
class LoraFile:
    path: Path
    format: str
    layers: list[LoraLayer]
    checkpoint: Checkpoint

    def shape(self, tensor: str) -> tuple[int, ...]:
        return tuple(self.checkpoint.tensors[tensor].shape)


def read_lora(path: str | Path, where: str) -> LoraFile:
    """Open a LoRA ``.safetensors`` file (header only: tensors are mapped, never read, until used) and read its
    layers; ``where`` names it in errors (``--lora style.safetensors``, a recipe line)."""
    path = Path(path)
    if not path.exists():
        raise LoraError(f"{where}: file not found")
    if path.suffix != ".safetensors":
        raise LoraError(f"{where}: a LoRA is a .safetensors file; {path.name} is not one")
    kind = not_regular(path)
    if kind is not None:
        raise LoraError(f"{where}: a LoRA is a .safetensors file, but {path} is {kind}")
    try:
        checkpoint = Checkpoint.open(path)
    except CheckpointError as exc:
        raise LoraError(f"{where}: {exc}") from None
    names = list(checkpoint.tensors)
    refused = [(name, why) for name in names for pattern, why in _NOT_LORA if pattern.fullmatch(name)]
    if refused:
        raise LoraError(f"{where}: {refused[0][1]} ('{refused[0][0]}' and {len(refused) - 1} more such keys)"
                        if len(refused) > 1 else f"{where}: {refused[0][1]} ('{refused[0][0]}')")
    pairs: dict[str, dict[str, str]] = {}
    alphas: dict[str, str] = {}
    other = []
    for name in names:
        if (m := _PAIR.match(name)) is not None:
            kind = {"lora_A": "down", "lora_down": "down", "lora_B": "up", "lora_up": "up"}[m["kind"]]
            pairs.setdefault(m["layer"], {})[kind] = name
        elif (m := _ALPHA.match(name)) is not None:
            alphas[m["layer"]] = name
        else:
            other.append(name)
    if other:
        raise LoraError(f"{where}: {len(other)} key(s) are not LoRA weights (<layer>.lora_A/lora_B/lora_down/"
                        f"lora_up.weight or <layer>.alpha): {_some(other)}; is it a LoRA file?")
    if not pairs:
        raise LoraError(f"{where}: the file holds no LoRA weights")
    lonely = [layer for layer, p in pairs.items() if set(p) != {"down", "up"}]
    lonely += [name for layer, name in alphas.items() if layer not in pairs]
    if lonely:
        raise LoraError(f"{where}: incomplete LoRA layers (a down without its up, or the reverse, or an alpha "
                        f"without either): {_some(lonely)}")
    # kohya files name the text encoders' layers lora_te*_ (none of a FLUX.2 transformer's): listed as unmatched
    kohya = all(layer.startswith((*KOHYA_PREFIXES, "lora_te")) for layer in pairs) and \
        any(layer.startswith(KOHYA_PREFIXES) for layer in pairs)
    fmt = "ComfyUI/kohya" if kohya else _format(pairs, where)
    config = _metadata_config(checkpoint, where)
    if config is None and fmt == "PEFT" and os.path.lexists(path.parent / PEFT_CONFIG):
        config = _peft_config(path.parent / PEFT_CONFIG, where)
    layers = []
    for layer, p in pairs.items():
        for tensor in (p["down"], p["up"]):
            dtype = checkpoint.tensors[tensor].dtype
            if dtype not in MATRIX_DTYPES:
                raise LoraError(f"{where}: tensor '{tensor}' is {dtype}; LoRA matrices are floating point "
                                f"({', '.join(MATRIX_DTYPES)})")
        down, up = checkpoint.tensors[p["down"]].shape, checkpoint.tensors[p["up"]].shape
        if len(down) != 2 or len(up) != 2 or down[0] != up[1]:
            raise LoraError(f"{where}: layer '{layer}': down {list(down)} and up {list(up)} are not a rank-r pair "
                            f"[r, in] and [out, r]; only LoRAs of linear layers are supported")
        rank = int(down[0])
        if rank < 1:
            raise LoraError(f"{where}: layer '{layer}' has rank 0 (down {list(down)}, up {list(up)}); a LoRA "
                            f"layer has rank 1 or more")
        name = _strip_kohya(layer) if kohya else _strip_prefix(layer)
        scale = _scale(checkpoint, alphas.get(layer), rank, config, name, where)
        layers.append(LoraLayer(layer, name, p["down"], p["up"], rank, scale, underscored=kohya))
    return LoraFile(path, fmt, layers, checkpoint)


def _strip_prefix(layer: str) -> str:
    for prefix, fmt in PREFIXES.items():
        if layer.startswith(prefix):
            layer = layer[len(prefix):]
            if fmt == "fal/ai-toolkit" and layer.startswith("sformer_blocks."):  # as diffusers' converter reads it
                layer = "tran" + layer
            return layer
    return layer


def _strip_kohya(layer: str) -> str:
    return next((layer[len(p):] for p in KOHYA_PREFIXES if layer.startswith(p)), layer)


def _format(pairs: dict[str, dict[str, str]], where: str) -> str:
    found = {next((fmt for prefix, fmt in PREFIXES.items() if layer.startswith(prefix)), "bare") for layer in pairs}
    if len(found) > 1:
        raise LoraError(f"{where}: the keys mix formats ({', '.join(sorted(found))}); one file holds one format")
    return found.pop()


@dataclass(frozen=True)
class PeftConfig:
    """The ``LoraConfig`` settings that decide a layer's scale, each checked (type, range) where it was read."""

    r: int | None  # None: the file's own rank
    alpha: float | None  # None: r (scale 1)
    rslora: bool
    rank_patterns: list  # [(PeftPattern, rank)] in the file's order
    alpha_patterns: list  # [(PeftPattern, alpha)]


def _metadata_config(checkpoint: Checkpoint, where: str) -> PeftConfig | None:
    """The PEFT ``LoraConfig`` diffusers saves in the header (keys maybe prefixed ``transformer.``), or None."""
    raw = checkpoint.metadata.get(METADATA_KEY)
    if not raw:
        return None
    what = f"{where}: its {METADATA_KEY} header"
    return _checked_config(parse_json(raw, what, LoraError, fix="save the LoRA again"), what)


def _peft_config(path: Path, where: str) -> PeftConfig:
    """PEFT's ``adapter_config.json`` beside the file."""
    what = f"{where}: {path}"
    try:
        data = read_json(path, "a PEFT adapter_config.json", MAX_JSON_BYTES, LoraError, where=what,
                         fix="save the LoRA again")
    except OSError as exc:
        raise LoraError(f"{what}: cannot read it ({exc.strerror or exc})") from None
    return _checked_config(data, what)


def _checked_config(data: object, what: str) -> PeftConfig:
    if not isinstance(data, dict):
        raise LoraError(f"{what} is not a JSON object")
    config = {key.removeprefix("transformer."): value for key, value in data.items()}  # a pipeline's save
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoraError(f"{what} says peft_type {_clipped(repr(peft_type))}; only LoRA adapters are supported")
    bad = [key for key in UNSUPPORTED_CONFIG if config.get(key)]
    if bad:
        settings = ", ".join(f"{k}={_clipped(repr(config[k]))}" for k in bad)
        raise LoraError(f"{what} sets {settings}, which this tool does not implement (plain LoRA only)")
    rslora = config.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise LoraError(f"{what}: use_rslora is {_shown(rslora)}; it must be true or false")
    r = _rank(config["r"], f"{what}: r") if "r" in config else None
    alpha = _alpha(config["lora_alpha"], f"{what}: lora_alpha") if "lora_alpha" in config else None
    patterns = {}
    for field, check in (("rank_pattern", _rank), ("alpha_pattern", _alpha)):
        table = config.get(field) or {}
        if not isinstance(table, dict):
            raise LoraError(f"{what}: {field} is {_shown(table)}; it must be an object of module name (or "
                            f"regular expression) -> value")
        compiled = compile_patterns(table, f"{what}: {field}", LoraError)
        patterns[field] = [(key, check(value, f"{what}: {field}[{key.key!r}]")) for key, value in compiled]
    return PeftConfig(r, alpha, rslora, patterns["rank_pattern"], patterns["alpha_pattern"])


def _rank(value: object, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise LoraError(f"{what} is {_shown(value)}; a LoRA rank is a positive integer")
    return value


def _alpha(value: object, what: str) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:
            number = math.inf
        if math.isfinite(number):
            return number
    raise LoraError(f"{what} is {_shown(value)}; a LoRA alpha is a finite number")


def _scale(checkpoint: Checkpoint, alpha_key: str | None, rank: int, config: PeftConfig | None, name: str,
           where: str) -> float:
    if alpha_key is not None:
        info = checkpoint.tensors[alpha_key]
        if info.dtype not in ALPHA_DTYPES:
            raise LoraError(f"{where}: '{alpha_key}' is {info.dtype}; an alpha is one number of a float or "
                            f"integer dtype")
        alpha = checkpoint.load(alpha_key)
        if alpha.size != 1:
            raise LoraError(f"{where}: '{alpha_key}' holds {alpha.size} values; an alpha is one number")
        value = float(alpha.reshape(()))
        if not math.isfinite(value):
            raise LoraError(f"{where}: '{alpha_key}' is {value}; an alpha is a finite number")
        return value / rank
    if config is None:
        return 1.0
    r = first_match(config.rank_patterns, name)  # PEFT's get_pattern_key, then rank_pattern.get(key, r)
    if r is None:
        r = rank if config.r is None else config.r
    alpha = first_match(config.alpha_patterns, name)
    if alpha is None:
        alpha = r if config.alpha is None else config.alpha
    if r != rank:
        raise LoraError(f"{where}: layer '{name}' has rank {rank}, but its LoraConfig says r={_shown(r)}")
    scale = alpha / (math.sqrt(r) if config.rslora else r)
    if not math.isfinite(scale):
        raise LoraError(f"{where}: layer '{name}': lora_alpha {alpha} / r {r} is not a finite scale")
    return scale


def _shown(value: object) -> str:
    """A config value as JSON writes it (``null``, ``"abc"``, ``[8]``), shortened."""
    try:
        return _clipped(json.dumps(value))
    except (TypeError, ValueError):
        return _clipped(repr(value))


def _clipped(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _some(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(f"'{n}'" for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
