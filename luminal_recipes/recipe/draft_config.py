"""``luminal-recipe validate RECIPE --draft-config CLASS``: a first ``config:`` section for a model recipe, drafted
from a transformers config class (``Phi3Config``, ``transformers.Phi3Config`` or a ``model_type`` such as
``phi3``), every field of ``CLASS().to_dict()`` sorted into the three groups (recipes/README.md, "The config
section"):

* ``read``: the fields the recipe's parameters read (``${config.hidden_size}``), as ``check_config_reads`` finds
  them;
* ``ignore``: fields that cannot change a model's output whatever the architecture (metadata, the Python API's
  output switches, dropout, initialisation, generation's token ids), each with its reason;
* ``require``: every other field, with only the class's default allowed: the safe draft (a checkpoint asking for
  anything else is refused, never run). Widen a list to the values the recipe implements, or move a field the
  reference never reads for this model to ``ignore`` with why.

A field the recipe's own ``config:`` section already classifies keeps its rule. The draft is YAML to paste into
the recipe (stdout); the command changes no file.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from typing import Any

from ..errors import InputError
from .config_fields import ABSENT, config_reads, lookup
from .safe_eval import ExprError, is_wrapped, parse, unwrap

# fields that cannot change a model's outputs, by name: (pattern, reason)
IRRELEVANT = [
    (r"transformers_version", "metadata: the transformers version that saved the file"),
    (r"architectures", "metadata: the class names that saved the checkpoint"),
    (r"(torch_)?dtype", "the checkpoint's storage dtype: tensors are read in their own dtypes"),
    (r"return_dict|output_hidden_states|output_attentions|torchscript|use_return_dict",
     "an output switch of transformers' Python API"),
    (r"use_cache", "whether transformers' Python API keeps a KV cache; the recipe's generation has its own"),
    (r"initializer_range|initializer_factor|init_std", "initialisation of untrained weights only"),
    (r"(.*_)?dropout(_prob|_rate)?|(.*_)?pdrop", "dropout is off at inference"),
    (r"(bos|eos|pad|sep|cls|decoder_start)_token_id", "a token id generation and the tokenizer use; not the logits"),
    (r"id2label|label2id|num_labels|problem_type|finetuning_task", "classification-head metadata"),
    (r"chunk_size_feed_forward", "chunking changes memory, not results"),
    (r"tokenizer_class|prefix|task_specific_params", "metadata"),
]


def config_class(name: str):
    """The transformers config class ``name`` names: a class name, ``transformers.NAME``, or a model_type."""
    try:
        import transformers
    except ImportError:
        raise InputError("--draft-config reads a transformers config class: install transformers (`pip install "
                         "transformers`)") from None
    short = name.removeprefix("transformers.")
    cls = getattr(transformers, short, None)
    if isinstance(cls, type) and hasattr(cls, "to_dict") and hasattr(cls, "model_type"):
        return cls
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if short in CONFIG_MAPPING:
        return CONFIG_MAPPING[short]
    known = sorted(CONFIG_MAPPING.keys())
    from .suggest import did_you_mean

    configs = sorted(n for n in dir(transformers) if n.endswith("Config") and n[:1].isupper())
    raise InputError(f"--draft-config {name}: not a transformers config class nor a model_type"
                     f"{did_you_mean(short, configs + known)}; e.g. --draft-config LlamaConfig or --draft-config "
                     f"llama ({len(known)} model types are known to transformers {transformers.__version__})")


def leaves(data: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Every (dotted path, value) of a config dict, nested dicts flattened (an empty dict is a leaf)."""
    for key, value in data.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            yield from leaves(value, path + ".")
        else:
            yield path, value


def params_read(recipe) -> list[str]:
    """The config fields the recipe's parameters read, in the order they are first read."""
    out: list[str] = []
    for located in recipe.params.values():
        default = located.value.default
        if not is_wrapped(default):
            continue
        try:
            tree = parse(unwrap(default))
        except ExprError:
            continue
        out += [path for path, _ in config_reads(tree) if path not in out]
    return out


def _covered(path: str, paths) -> str | None:
    for p in paths:
        if path == p or path.startswith(p + "."):
            return p
    return None


def draft_config(recipe, name: str) -> str:
    """The drafted ``config:`` section (YAML text) for the loaded model recipe ``recipe`` from class ``name``."""
    cls = config_class(name)
    try:
        data = cls().to_dict()
    except Exception as exc:  # noqa: BLE001 - a class whose defaults cannot be built (needs arguments)
        raise InputError(f"--draft-config {name}: {cls.__name__}() cannot be built with its defaults ({exc}); "
                         f"draft from a model_type whose config takes no arguments") from None
    existing = dict(recipe.config_fields or {})
    reads = params_read(recipe)
    read: list[str] = []
    require: dict[str, list] = {}
    ignore: dict[str, str] = {}
    kept: list[str] = []
    for path, value in leaves(data):
        own = _covered(path, existing)
        if own is not None:
            if own not in kept:
                kept.append(own)
            continue
        covering = _covered(path, reads)
        if covering is not None:
            if covering not in read:
                read.append(covering)
            continue
        top = path.split(".")[-1]
        reason = next((why for pattern, why in IRRELEVANT if re.fullmatch(pattern, top)), None)
        if reason is not None:
            ignore[path] = reason
        else:
            require[path] = [value]
    for path in reads:  # read by a parameter but absent from the class's defaults (optional fields): still read
        if _covered(path, existing) is None and path not in read and lookup(data, path) is ABSENT:
            read.append(path)
    for path in kept:
        rule = existing[path]
        if rule.kind == "read":
            read.append(path)
        elif rule.kind == "require":
            require[path] = list(rule.values)
        else:
            ignore[path] = rule.reason
    lines = [f"# drafted by `luminal-recipe validate {recipe.path} --draft-config {name}` from "
             f"{cls.__module__}.{cls.__name__} (model_type {getattr(cls, 'model_type', '')!r}):",
             "# read: what the parameters read; require: the class's default only (widen each list to the values "
             "the",
             "# recipe implements, or move a field the reference never reads to ignore, with why); ignore: "
             "never changes outputs",
             "config:"]
    lines.append("  read: [" + ", ".join(read) + "]" if len(", ".join(read)) < 100 else
                 "  read:\n" + "\n".join(f"    - {p}" for p in read))
    lines.append("  require:" + ("" if require else " {}"))
    lines += [f"    {path}: {_flow(values)}" for path, values in require.items()]
    lines.append("  ignore:" + ("" if ignore else " {}"))
    lines += [f"    {path}: {_flow(reason)}" for path, reason in ignore.items()]
    return "\n".join(lines) + "\n"


def _flow(value: Any) -> str:
    """A YAML flow value (JSON is YAML; strings that YAML would read otherwise are quoted)."""
    if isinstance(value, str):
        plain = re.fullmatch(r"[A-Za-z][\w .,'()/+-]*", value) and value.lower() not in (
            "yes", "no", "on", "off", "true", "false", "null", "none") and ": " not in value and " #" not in value
        return value if plain else json.dumps(value)
    if isinstance(value, float) and value == value and abs(value) != float("inf"):
        text = repr(value)
        return text if "." in text or "e" not in text else text.replace("e", ".0e", 1)  # YAML 1.1 wants the dot
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_flow(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{json.dumps(str(k))}: {_flow(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)
