"""LoRA files mapped onto a model recipe's weights, then merged into them at load or added in the graph.

A LoRA layer (``weights/lora.py`` reads every key format into one form) names a linear layer in some convention:
this recipe's own weight names (diffusers' names for the FLUX.2 transformer), or another convention the recipe
lists under ``lora_names`` (``bfl: flux2-transformer-bfl.yaml``), meaning: map the name as that recipe's
``weights.rename``/``split`` rules map its checkpoint names (the same machinery, ``mapping.py``). A split rule
splits the update with the weight: along axis 0 the up matrix's rows (the down matrix is shared, as diffusers
shares ``lora_A`` over Q, K and V), along axis 1 the down matrix's columns. A kohya name (dots written as ``_``)
is tried with each ``_`` as ``.`` or ``_``; exactly one reading must name a weight.

Every layer must land on a 2-D weight of matching shape: a layer that matches nothing, or matches with another
shape, is an error listing them all, with the file named (a LoRA for another model fails here, never silently).

Two ways to apply an update ``scale * alpha / rank * up @ down`` (``LoraSpec.mode``):

* **merge** (default for dense weights): the weight's loader adds it when the weight is read, in float32, row
  block by row block, and stores the sum in the weight's own dtype; the memory-mapped weight is never copied
  whole besides the result, so no two full copies of a large weight are held at once;
* **graph** (default for quantized weights, whose packed FP8/NVFP4 form stays as stored): ``down`` and ``up``
  become graph weights and ``linear(x, w)`` adds ``(x @ down.T) @ up.T * scale`` beside its matmul
  (``ops.linalg.LoraWeight``). The build fails if the forward uses such a weight in any other op.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import LoraError
from ..weights.lora import LoraFile, LoraLayer, read_lora
from .instances import WeightDecl, eval_field
from .mapping import rename
from .schema import ModelRecipe, WeightsSection

MAX_UNDERSCORES = 16  # a kohya name is tried with each "_" as "." or "_": 2**16 readings at most
MERGE_BLOCK_BYTES = 64 << 20  # float32 rows merged at a time


@dataclass(frozen=True)
class LoraSpec:
    """A LoRA file to apply to one model."""

    path: Path
    scale: float = 1.0
    where: str = ""  # how it was given, for errors: "--lora style.safetensors", "flux2-x.yaml:12:5: loras[0]"
    mode: str = "auto"  # auto | merge | graph

    def __post_init__(self) -> None:
        if not self.where:
            object.__setattr__(self, "where", f"LoRA {self.path}")


@dataclass
class LoraUpdate:
    """One low-rank update of one weight: ``scale * up[rows] @ down[:, cols]``."""

    spec: LoraSpec
    file: LoraFile
    layer: LoraLayer
    scale: float  # the user's scale times the layer's alpha / rank
    rows: slice = field(default_factory=lambda: slice(None))
    cols: slice = field(default_factory=lambda: slice(None))

    def down(self) -> np.ndarray:
        return self.file.checkpoint.load(self.layer.down)[:, self.cols]

    def up(self) -> np.ndarray:
        return self.file.checkpoint.load(self.layer.up)[self.rows]

    def shapes(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """``(down, up)`` shapes after slicing."""
        down, up = self.file.shape(self.layer.down), self.file.shape(self.layer.up)
        cols = range(down[1])[self.cols]
        rows = range(up[0])[self.rows]
        return (down[0], len(cols)), (len(rows), up[1])


@dataclass
class Convention:
    label: str  # "this recipe's names" or the lora_names key
    section: WeightsSection | None  # None: the names are the recipe's own
    origin: Any  # where the convention is declared, for split-size errors


def conventions(recipe, load_recipe: Callable[[Path], Any]) -> list[Convention]:
    """The naming conventions a model recipe accepts: its own names, then its ``lora_names`` in order."""
    doc = recipe.doc
    assert isinstance(doc, ModelRecipe)
    out = [Convention("this recipe's own weight names", None, None)]
    for label, relative in (doc.lora_names or {}).items():
        origin = recipe.origin("lora_names", label)
        from .paths import confined

        path = confined(origin, recipe.folder, relative, "this recipe's folder", [recipe.tree or recipe.folder])
        other = load_recipe(path)
        if not isinstance(other.doc, ModelRecipe):
            raise origin.error(f"lora_names.{label}: '{relative}' is not a model recipe; name one whose weights "
                               f"section maps the {label} names onto this recipe's")
        out.append(Convention(label, other.doc.weights, origin))
    return out


def map_loras(specs: Sequence[LoraSpec], weights: Mapping[str, WeightDecl], names: list[Convention],
              params: Mapping[str, Any], quantized: set[str], model: str) -> dict[str, list[LoraUpdate]]:
    """Weight name -> its updates, for every LoRA of ``specs``; a located error if any layer of a file does not
    fit (naming the layers), if a file fits nothing (another model's LoRA?), or if an update cannot be applied as
    asked (a quantized weight cannot be merged)."""
    updates: dict[str, list[LoraUpdate]] = {}
    for spec in specs:
        if spec.mode not in ("auto", "merge", "graph"):
            raise LoraError(f"{spec.where}: mode '{spec.mode}' is not one of auto, merge, graph")
        file = read_lora(spec.path, spec.where)
        unmatched, misfits = [], []
        for layer in file.layers:
            found = _targets(layer, names, weights, params)
            if not found:
                unmatched.append(layer.key)
                continue
            for target, rows, cols in found:
                update = LoraUpdate(spec, file, layer, spec.scale * layer.scale, rows, cols)
                problem = _misfit(update, weights[target])
                if problem:
                    misfits.append(f"'{layer.key}' -> '{target}': {problem}")
                elif spec.mode == "merge" and target in quantized:
                    raise LoraError(f"{spec.where}: mode merge cannot add '{layer.key}' into '{target}', which is "
                                    f"stored quantized; use mode graph (or auto)")
                else:
                    updates.setdefault(target, []).append(update)
        if len(unmatched) == len(file.layers):
            raise LoraError(
                f"{spec.where}: none of its {len(file.layers)} layers ({file.format} format, e.g. "
                f"{_some(unmatched, 3)}) names a linear weight of model '{model}' (in "
                f"{', '.join(c.label for c in names)}); is it a LoRA for another model?")
        if unmatched or misfits:
            lines = [f"{spec.where}: {len(unmatched) + len(misfits)} of its {len(file.layers)} layers "
                     f"({file.format} format) do not fit model '{model}'; a partly applied LoRA is not the LoRA, "
                     f"so none is applied:"]
            if unmatched:
                lines.append(f"  - {len(unmatched)} name no linear weight of the model: {_some(unmatched)}")
            lines += [f"  - {m}" for m in misfits[:12]]
            if len(misfits) > 12:
                lines.append(f"  - and {len(misfits) - 12} more of another shape")
            raise LoraError("\n".join(lines))
    return updates


def _targets(layer: LoraLayer, names: list[Convention], weights: Mapping[str, WeightDecl],
             params: Mapping[str, Any]) -> list[tuple[str, slice, slice]]:
    """``[(weight, up rows, down columns)]`` the layer maps onto, or [] (no reading names a weight)."""
    readings = _readings(layer.name) if layer.underscored else [layer.name]
    matches: dict[str, list[tuple[str, slice, slice]]] = {}
    for reading in readings:
        for convention in names:
            targets = _map_name(reading, convention, weights, params)
            if targets:
                matches[reading] = targets
                break
    distinct = {tuple((t, str(r), str(c)) for t, r, c in targets) for targets in matches.values()}
    if len(distinct) > 1:
        raise LoraError(f"LoRA layer '{layer.key}' can be read as several layers of the model "
                        f"({', '.join(sorted(matches))}); rename it in the file")
    return next(iter(matches.values()), [])


def _readings(name: str) -> list[str]:
    """Each way to read a kohya name's underscores as dots or underscores."""
    parts = name.split("_")
    if len(parts) - 1 > MAX_UNDERSCORES:
        raise LoraError(f"LoRA layer 'lora_unet_{name}' has {len(parts) - 1} underscores; at most "
                        f"{MAX_UNDERSCORES} are tried as dots")
    out = []
    for seps in itertools.product((".", "_"), repeat=len(parts) - 1):
        out.append(parts[0] + "".join(sep + part for sep, part in zip(seps, parts[1:])))
    return out


def _map_name(name: str, convention: Convention, weights: Mapping[str, WeightDecl],
              params: Mapping[str, Any]) -> list[tuple[str, slice, slice]]:
    whole = slice(None)
    if convention.section is None:
        target = f"{name}.weight"
        return [(target, whole, whole)] if _linear(weights.get(target)) else []
    section = convention.section
    target = rename(f"{name}.weight", section)
    if _linear(weights.get(target)):
        return [(target, whole, whole)]
    for rule in section.split:
        match = re.fullmatch(rule.regex, target)
        if match is None:
            continue
        parts = [match.expand(template) for template in rule.into]
        if not all(_linear(weights.get(p)) for p in parts):
            return []
        axis = rule.axis % 2
        if rule.sizes is None:
            sizes = [weights[p].shape[axis] for p in parts]
        else:
            sizes = [int(eval_field(s, convention.origin, params, "split size")) for s in rule.sizes]
        out, start = [], 0
        for part, size in zip(parts, sizes):
            piece = slice(start, start + size)
            out.append((part, piece, whole) if axis == 0 else (part, whole, piece))
            start += size
        return out
    return []


def _linear(decl: WeightDecl | None) -> bool:
    return decl is not None and decl.name.endswith(".weight") and len(decl.shape) == 2


def _misfit(update: LoraUpdate, decl: WeightDecl) -> str | None:
    (rank, cols), (rows, rank_up) = update.shapes()
    out, inp = decl.shape
    if (rows, cols) != (out, inp):
        return f"the update is [{rows}, {cols}] (up {list(update.file.shape(update.layer.up))}, down " \
               f"{list(update.file.shape(update.layer.down))}), the weight [{out}, {inp}]"
    return None


def merged(load: Callable[[], np.ndarray], updates: Sequence[LoraUpdate]) -> Callable[[], np.ndarray]:
    """A loader of the weight with the updates added: float32 sums, block of rows by block of rows, stored in the
    weight's dtype (the memory-mapped weight is read, never copied whole besides the result)."""

    def read() -> np.ndarray:
        base = load()
        out = np.empty(base.shape, dtype=base.dtype)
        pairs = [(np.float32(u.scale), u.up().astype(np.float32), u.down().astype(np.float32)) for u in updates]
        step = max(1, MERGE_BLOCK_BYTES // max(1, 4 * base.shape[1]))
        for r0 in range(0, base.shape[0], step):
            block = base[r0 : r0 + step].astype(np.float32)
            for scale, up, down in pairs:
                block += scale * (up[r0 : r0 + step] @ down)
            out[r0 : r0 + step] = block.astype(base.dtype)
        return out

    return read


def parse_lora_flag(text: str) -> tuple[Path, float]:
    """``--lora PATH[:SCALE]``: the path and the scale (1.0 when none is given)."""
    path, _, scale = text.rpartition(":")
    if path and scale:
        try:
            return Path(path), float(scale)
        except ValueError:
            pass
    return Path(text), 1.0


def _some(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(f"'{n}'" for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
