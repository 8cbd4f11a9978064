"""A second compile of the same Dynamo graph skips AOTAutograd: its translation is read from disk.

After a ``torch._dynamo.reset()`` or in a new process, Dynamo traces the model again (its own cost, the same for
every backend), then hands the backend the same FX graph. AOTAutograd's lowering of that graph to ATen (tracing
it again with fake tensors, functionalization, decompositions: 1.5-2.5 s for a 12-layer decoder) is what inductor
skips on a warm start (its AOTAutograd cache); this module skips it for luminal. The translated HLIR graph (the
input of the plan cache) is stored under a key of the Dynamo graph, and a hit builds the ``CompiledGraph`` from
it directly; the plan cache then supplies the program, so a warm start searches nothing and traces nothing twice.

Key: the Dynamo graph's generated code, each placeholder's source and static marking, each example input's
type, dtype, shape (symbolic sizes by their expression), strides and ``requires_grad``, grad, inference and
autocast modes, the shape environment's state (guards, replacements, the symbols' ranges), the backend's
options, and the versions of torch and this package with a hash of the translator's own source files
(``torch_backend/*.py``, ``ops/*.py``, the graph serialiser) - so editing the op table invalidates every entry.

Only what AOTAutograd passes through unchanged is stored, checked on the compile that stores it: inference
(no autograd graph), no parameters left on the module (Dynamo lifts them as inputs), no ``get_attr`` or
``call_module`` nodes (constants and higher-order subgraphs are not in the code), the ATen graph's placeholders
one-to-one with Dynamo's inputs (same shapes and dtypes: no deduplicated or lifted arguments), no input
mutated, every output a fresh tensor (no alias of an input or of another output), no effect tokens, the whole
graph translated (no fallback), and no guard added to the shape environment while lowering and translating
(guards AOTAutograd would add on a hit are then none). Anything else compiles as before, uncached.

Entries are JSON with an HMAC under the plan cache's user key (``compiler.cache``), in ``<plan cache>/torch/``;
an entry that fails its check is a miss (a warning, then recompiled and replaced), never code to run.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from functools import lru_cache
from pathlib import Path

import torch

from .. import instrument, tempfiles
from ..graph import Tensor
from ..graph.serialize import from_json, to_json
from ..graph.symbolic import to_dim
from ..graph.view import View
from .translate import Placeholder, Translation

FORMAT = "luminal-recipes/torch-translation"
VERSION = 1
MAX_ENTRY_BYTES = 64 << 20
HIT = "torch_translation_hit"    # instrument counters: a translation read from disk (AOTAutograd skipped)
STORE = "torch_translation_store"  # a translation written


def folder() -> Path:
    from ..compiler.cache import cache_dir

    return cache_dir() / "torch"


def enabled() -> bool:
    return os.environ.get("LUMINAL_TORCH_TRANSLATION_CACHE", "1") not in ("0", "")


@lru_cache(maxsize=1)
def _source_hash() -> str:
    """The translator's own code: every file of torch_backend/ and ops/, and the graph serialiser."""
    root = Path(__file__).resolve().parent.parent
    files = sorted(root.joinpath("torch_backend").glob("*.py")) + sorted(root.joinpath("ops").glob("*.py")) + \
        [root / "graph" / "serialize.py", root / "graph" / "core.py"]
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("luminal-recipes")
    except metadata.PackageNotFoundError:
        return "unknown"


def _size(d) -> str:
    return f"sym:{d.node.expr}" if isinstance(d, torch.SymInt) else str(int(d))


def _describe(value) -> list:
    if isinstance(value, torch.SymInt):
        return ["symint", str(value.node.expr)]
    if isinstance(value, torch.Tensor):
        if type(value).__name__ not in ("FakeTensor", "Tensor", "Parameter") or value.is_sparse:
            return None
        return ["tensor", str(value.dtype), str(value.device.type), [_size(d) for d in value.shape],
                [_size(d) for d in value.stride()], bool(value.requires_grad)]
    if isinstance(value, (int, float, bool)):
        return ["const", type(value).__name__, repr(value)]
    return None


def traced_inputs(gm: torch.fx.GraphModule, example_inputs) -> list:
    """Dynamo's placeholders as it traced them (fake tensors with symbolic sizes, SymInts): the example inputs
    themselves are the call's real values."""
    placeholders = gm.graph.find_nodes(op="placeholder")
    return [node.meta.get("example_value", value) for node, value in zip(placeholders, example_inputs)]


def graph_key(gm: torch.fx.GraphModule, example_inputs, options) -> str | None:
    """The key of ``gm`` as Dynamo hands it over, or None when the graph is not one this cache takes."""
    if any(n.op in ("get_attr", "call_module") for n in gm.graph.nodes):
        return None
    if next(iter(gm.parameters()), None) is not None or next(iter(gm.buffers()), None) is not None:
        return None
    placeholders = gm.graph.find_nodes(op="placeholder")
    if len(placeholders) != len(example_inputs):
        return None
    inputs = []
    for node, value in zip(placeholders, traced_inputs(gm, example_inputs)):
        described = _describe(value)
        if described is None:
            return None
        source = getattr(node, "_dynamo_source", None)
        static = getattr(value, "_dynamo_static_input_type", None)
        tensor_dict = node.meta.get("tensor_dict") or {}
        inputs.append([node.name, str(source.name if source is not None else None), str(static),
                       sorted(f"{k}={v}" for k, v in tensor_dict.items() if k.startswith("_dynamo")), described])
    parts = {
        "code": gm.code,
        "inputs": inputs,
        "grad": [torch.is_grad_enabled(), torch.is_inference_mode_enabled()],
        "autocast": [str(torch.get_autocast_dtype(d)) if torch.is_autocast_enabled(d) else None
                     for d in ("cpu", "cuda")],
        # the symbols' ranges and the guards so far: lowering may decide by a range without adding a guard
        "shape_env": shape_state(example_inputs),
        "options": [options.runtime, options.max_memory, options.compute_dtype],
        "versions": [torch.__version__, _version(), _source_hash()],
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def shape_state(example_inputs):
    """What lowering may add to the shape environment (guards, replacements, ranges): compared before and after
    the compile that stores an entry."""
    from torch._guards import detect_fake_mode

    mode = detect_fake_mode(example_inputs)
    env = getattr(mode, "shape_env", None)
    if env is None:
        return None
    return (len(env.guards), sorted((str(k), str(v)) for k, v in env.replacements.items()),
            sorted((str(k), str(v)) for k, v in env.var_to_range.items()),
            sum(len(v) for v in env.deferred_runtime_asserts.values()))


def passes_through(aten_gm: torch.fx.GraphModule, example_inputs, meta) -> bool:
    """AOTAutograd's runtime wrappers hand the inputs to the ATen graph and its outputs back unchanged."""
    from torch._functorch._aot_autograd.schemas import OutputType

    if meta is None:
        return False
    placeholders = aten_gm.graph.find_nodes(op="placeholder")
    if len(placeholders) != len(example_inputs):
        return False
    for node, value in zip(placeholders, example_inputs):  # ``example_inputs``: ``traced_inputs``
        val = node.meta.get("val")
        if isinstance(value, torch.Tensor) != isinstance(val, torch.Tensor):
            return False
        if isinstance(value, torch.SymInt) and (not isinstance(val, torch.SymInt) or _size(val) != _size(value)):
            return False
        if isinstance(value, torch.Tensor) and (val.dtype != value.dtype or
                                                [_size(d) for d in val.shape] != [_size(d) for d in value.shape]):
            return False
    if any(getattr(i, "mutates_data", False) or getattr(i, "mutates_metadata", False) for i in meta.input_info):
        return False
    if any(o.output_type != OutputType.non_alias for o in meta.output_info):
        return False
    return not (getattr(meta, "num_intermediate_bases", 0) or getattr(meta, "tokens", None)
                or getattr(meta, "is_rng_op_functionalized", False))


# ---- entries ---------------------------------------------------------------------------------------------------
def _to_entry(t: Translation) -> dict:
    outputs = []
    for spec in t.outputs:
        if spec[0] == "tensor":
            _, name, dtype, shape = spec
            outputs.append(["tensor", name, str(dtype).removeprefix("torch."),
                            [None if isinstance(d, torch.SymInt) else int(d) for d in shape]])
        elif spec[0] == "dim":
            outputs.append(["dim", str(spec[1])])
        else:
            outputs.append(list(spec))
    return {
        "graph": to_json(t.graph),
        "blocks": {name: [r.start, r.stop] for name, r in t.graph.blocks.items()},
        "placeholders": [[p.kind, p.name, None if p.torch_dtype is None else str(p.torch_dtype).removeprefix(
            "torch."), [str(d) for d in p.shape]] for p in t.placeholders],
        "outputs": outputs,
        "ops": t.ops,
        "single": t.single,
        "values": {name: str(d) for name, d in t.values.items()},
    }


def _dtype(name: str) -> torch.dtype:
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown torch dtype {name!r}")
    return value


def _from_entry(data: dict) -> Translation:
    graph = from_json(data["graph"])
    graph.blocks = {str(name): range(int(a), int(b)) for name, (a, b) in data["blocks"].items()}
    placeholders = [Placeholder(kind, name, None if dt is None else _dtype(dt), tuple(to_dim(d) for d in shape))
                    for kind, name, dt, shape in data["placeholders"]]
    by_name = {n.name: n for n in graph.inputs()}
    inputs = {}
    for p in placeholders:
        if p.kind not in ("input", "weight", "dim"):
            raise ValueError(f"placeholder kind {p.kind!r}")
        if p.kind == "input":
            node = by_name[p.name]
            inputs[p.name] = Tensor(graph, node.id, View.contiguous(node.shape), node.dtype)
    outputs = []
    for spec in data["outputs"]:
        if spec[0] == "tensor":
            _, name, dtype, shape = spec
            if name not in graph.outputs:
                raise ValueError(f"output {name!r} is not in the graph")
            outputs.append(("tensor", name, _dtype(dtype), tuple(None if d is None else int(d)
                                                                 for d in shape)))
        elif spec[0] == "dim":
            outputs.append(("dim", to_dim(spec[1])))
        elif spec[0] == "arg":
            outputs.append(("arg", int(spec[1])))
        elif spec[0] == "none":
            outputs.append(("none",))
        else:
            raise ValueError(f"output kind {spec[0]!r}")
    values = {str(name): to_dim(d) for name, d in data.get("values", {}).items()}
    for name in values:
        node = by_name[name]
        inputs[name] = Tensor(graph, node.id, View.contiguous(node.shape), node.dtype)
    return Translation(graph, placeholders, outputs, inputs, dict(data["ops"]), bool(data["single"]), values)


def _secret() -> bytes | None:
    from ..compiler.cache import _usable_key

    return _usable_key(folder())


def load(key: str) -> Translation | None:
    from ..compiler.cache import read_signed

    path = folder() / f"{key}.json"
    try:
        info = os.stat(path)
    except OSError:
        return None
    secret = _secret()
    if secret is None:
        return None
    try:  # the plan cache's checks (``compiler.cache.read_signed``), then this entry's own content
        data = read_signed(path, info, MAX_ENTRY_BYTES, secret, FORMAT, VERSION, "torch translation entry")
        translation = _from_entry(data["translation"])
    except Exception as exc:  # an entry that cannot be trusted is recompiled, never used
        reason = " ".join(str(exc).split())[:300]
        warnings.warn(f"torch translation cache entry {path} is unreadable or untrusted ({type(exc).__name__}: "
                      f"{reason}); ignoring it and compiling again (the new entry replaces it)", stacklevel=2)
        return None
    instrument.count(HIT)
    return translation


def store(key: str, translation: Translation) -> Path | None:
    from ..compiler.cache import signed

    secret = _secret()
    if secret is None:
        return None
    text = signed({"format": FORMAT, "version": VERSION, "translation": _to_entry(translation)}, secret)
    path = folder() / f"{key}.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tempfiles.write_atomic(path, text.encode())
    except OSError as exc:  # the plan cache warns about an unusable folder; this one stays quiet
        warnings.warn(f"cannot write the torch translation cache entry {path} ({exc.strerror or exc}); the next "
                      f"compile of this graph lowers it again", stacklevel=2)
        return None
    instrument.count(STORE)
    return path
