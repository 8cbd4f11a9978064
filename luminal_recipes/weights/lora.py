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

Any format may carry ``<layer>.alpha`` (scale ``alpha / rank``, as kohya and ComfyUI read it). A PEFT
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
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import CheckpointError, LoraError
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
    if config is None and fmt == "PEFT" and (path.parent / PEFT_CONFIG).is_file():
        config = _peft_config(path.parent / PEFT_CONFIG, where)
    layers = []
    for layer, p in pairs.items():
        down, up = checkpoint.tensors[p["down"]].shape, checkpoint.tensors[p["up"]].shape
        if len(down) != 2 or len(up) != 2 or down[0] != up[1]:
            raise LoraError(f"{where}: layer '{layer}': down {list(down)} and up {list(up)} are not a rank-r pair "
                            f"[r, in] and [out, r]; only LoRAs of linear layers are supported")
        rank = int(down[0])
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


def _metadata_config(checkpoint: Checkpoint, where: str) -> dict | None:
    """The PEFT ``LoraConfig`` diffusers saves in the header (keys maybe prefixed ``transformer.``), or None."""
    raw = checkpoint.metadata.get(METADATA_KEY)
    if not raw:
        return None
    return _checked_config(raw, f"{where}: its {METADATA_KEY} header")


def _peft_config(path: Path, where: str) -> dict:
    """PEFT's ``adapter_config.json`` beside the file."""
    from ..files import MAX_JSON_BYTES, read_regular_text

    return _checked_config(read_regular_text(path, "a PEFT adapter_config.json", MAX_JSON_BYTES, LoraError),
                           f"{where}: {path}")


def _checked_config(raw: str, what: str) -> dict:
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise LoraError(f"{what} is not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise LoraError(f"{what} is not a JSON object")
    config = {key.removeprefix("transformer."): value for key, value in data.items()}  # a pipeline's save
    if config.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"{what} says peft_type {config['peft_type']!r}; only LoRA adapters are supported")
    bad = [key for key in UNSUPPORTED_CONFIG if config.get(key)]
    if bad:
        raise LoraError(f"{what} sets {', '.join(f'{k}={config[k]!r}' for k in bad)}, which this tool does not "
                        f"implement (plain LoRA only)")
    return config


def _pattern(patterns: dict, name: str):
    """PEFT's ``get_pattern_key``: the first key ``k`` with ``re.match(rf"(.*\\.)?({k})$", name)``."""
    for key in patterns or {}:
        if re.match(rf"(.*\.)?({key})$", name):
            return patterns[key]
    return None


def _scale(checkpoint: Checkpoint, alpha_key: str | None, rank: int, config: dict | None, name: str,
           where: str) -> float:
    if alpha_key is not None:
        alpha = checkpoint.load(alpha_key)
        if alpha.size != 1:
            raise LoraError(f"{where}: '{alpha_key}' holds {alpha.size} values; an alpha is one number")
        return float(alpha.reshape(())) / rank
    if config is None:
        return 1.0
    r = _pattern(config.get("rank_pattern"), name) or config.get("r", rank)
    alpha = _pattern(config.get("alpha_pattern"), name) or config.get("lora_alpha", r)
    if int(r) != rank:
        raise LoraError(f"{where}: layer '{name}' has rank {rank}, but its LoraConfig says r={r}")
    return float(alpha) / (math.sqrt(r) if config.get("use_rslora") else r)


def _some(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(f"'{n}'" for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
