"""LoRA files mapped onto a model recipe's weights, then merged into them at load or added in the graph.

A LoRA layer (``weights/lora.py`` reads every key format into one form) names a linear layer in some convention:
this recipe's own weight names (diffusers' names for the FLUX.2 transformer), or another convention the recipe
lists under ``lora_names`` (``bfl: flux2-transformer-bfl.yaml``), meaning: map the name as that recipe's
``weights.rename``/``split`` rules map its checkpoint names (the same machinery, ``mapping.py``). A split rule
splits the update with the weight: along axis 0 the up matrix's rows (the down matrix is shared, as diffusers
shares ``lora_A`` over Q, K and V), along axis 1 the down matrix's columns. A kohya name (dots written as ``_``)
is compared with the recipe's names written that way, and read by the other conventions' rules with each of their
dots matching ``.`` or ``_`` (as ComfyUI keys kohya names: the model's names with ``_`` for ``.``).

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

import fnmatch
import math
import numbers
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import LoraError
from ..weights.lora import LoraFile, LoraLayer, read_lora
from . import regexes
from .instances import WeightDecl, eval_field
from .mapping import rename
from .schema import ModelRecipe, WeightsSection

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
              params: Mapping[str, Any], quantized: set[str], model: str,
              refused: Mapping[str, str] | None = None) -> dict[str, list[LoraUpdate]]:
    """Weight name -> its updates, for every LoRA of ``specs``; a located error if any layer of a file does not
    fit (naming the layers), if a file fits nothing (another model's LoRA?), or if an update cannot be applied as
    asked (a quantized weight cannot be merged); ``refused``: weight glob -> why the model refuses LoRA updates of
    it (its recipe's ``lora_refused``)."""
    updates: dict[str, list[LoraUpdate]] = {}
    underscored = _underscored_index(weights)
    for spec in specs:
        if spec.mode not in ("auto", "merge", "graph"):
            raise LoraError(f"{spec.where}: mode '{spec.mode}' is not one of auto, merge, graph")
        if isinstance(spec.scale, bool) or not isinstance(spec.scale, numbers.Real) \
                or not math.isfinite(spec.scale):
            raise LoraError(f"{spec.where}: scale {spec.scale!r} is not a finite number")
        file = read_lora(spec.path, spec.where)
        unmatched, misfits, misfit_layers = [], [], set()
        for layer in file.layers:
            found = _targets(layer, names, weights, params, underscored)
            if not found:
                unmatched.append(layer.key)
                continue
            fused = _fused_misfit(layer, file, found, weights)
            if fused:
                misfits.append(fused)
                misfit_layers.add(layer.key)
                continue
            for target, rows, cols in found:
                update = LoraUpdate(spec, file, layer, spec.scale * layer.scale, rows, cols)
                problem = _misfit(update, weights[target]) or next(
                    (why for glob, why in (refused or {}).items() if fnmatch.fnmatchcase(target, glob)), None)
                if problem:
                    misfits.append(f"'{layer.key}' -> '{target}': {problem}")
                    misfit_layers.add(layer.key)
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
            bad = len(unmatched) + len(misfit_layers)
            other = "; none fits: is it a LoRA for another model (another size of it)?" \
                if bad == len(file.layers) else ""
            lines = [f"{spec.where}: {bad} of its {len(file.layers)} layers ({file.format} format) do not fit "
                     f"model '{model}'; a partly applied LoRA is not the LoRA, so none is applied{other}:"]
            if unmatched:
                lines.append(f"  - {len(unmatched)} name no linear weight of the model: {_some(unmatched)}")
            lines += [f"  - {m}" for m in misfits[:12]]
            if len(misfits) > 12:
                lines.append(f"  - and {len(misfits) - 12} more of another shape")
            raise LoraError("\n".join(lines))
    return updates


def _targets(layer: LoraLayer, names: list[Convention], weights: Mapping[str, WeightDecl],
             params: Mapping[str, Any], underscored: Mapping[str, list[str]]) -> list[tuple[str, slice, slice]]:
    """``[(weight, up rows, down columns)]`` the layer maps onto, or [] (no convention names a weight with it):
    the first convention, in the recipe's order, that maps it."""
    for convention in names:
        targets = _map_name(layer, convention, weights, params, underscored)
        if targets:
            return targets
    return []


def _map_name(layer: LoraLayer, convention: Convention, weights: Mapping[str, WeightDecl],
              params: Mapping[str, Any], underscored: Mapping[str, list[str]]) -> list[tuple[str, slice, slice]]:
    whole = slice(None)
    if convention.section is None:
        if layer.underscored:  # the recipe's linear weights, their dots written as "_"
            found = underscored.get(layer.name, [])
            if len(found) > 1:
                raise LoraError(f"LoRA layer '{layer.key}' can be read as several layers of the model "
                                f"({', '.join(sorted(found))}); rename it in the file")
            return [(found[0], whole, whole)] if found else []
        target = f"{layer.name}.weight"
        return [(target, whole, whole)] if _linear(weights.get(target)) else []
    section = convention.section
    if layer.underscored:
        target = _rename_underscored(f"{layer.name}_weight", section)
    else:
        target = rename(f"{layer.name}.weight", section)
    if _linear(weights.get(target)):
        return [(target, whole, whole)]
    for rule in section.split:
        match = regexes.fullmatch(rule.regex, target)
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


def _underscored_index(weights: Mapping[str, WeightDecl]) -> dict[str, list[str]]:
    """Each linear weight's name as a kohya file writes it (no ``.weight``, ``_`` for ``.``) -> the weights."""
    index: dict[str, list[str]] = {}
    for name, decl in weights.items():
        if _linear(decl):
            index.setdefault(name[: -len(".weight")].replace(".", "_"), []).append(name)
    return index


def _rename_underscored(name: str, section: WeightsSection) -> str:
    """A kohya name (the convention's name with every "." written as "_") through the convention's rename rules,
    each dot of a rule (a prefix's ".", a regex's escaped ``\\.``) matching "." or "_": the rules' own order and
    replacements, so the result is the recipe's dotted weight name when the rules name the layer."""
    for rule in section.rename:
        if rule.prefix is not None:
            match = regexes.match("[._]".join(re.escape(part) for part in rule.prefix.split(".")), name)
            if match is not None:
                name = rule.to + name[match.end():]
        else:
            name = regexes.sub(rule.regex.replace("\\.", "[._]"), rule.to, name)
    return name


def _linear(decl: WeightDecl | None) -> bool:
    return decl is not None and decl.name.endswith(".weight") and len(decl.shape) == 2


def _fused_misfit(layer: LoraLayer, file: LoraFile, found: list[tuple[str, slice, slice]],
                  weights: Mapping[str, WeightDecl]) -> str | None:
    """A fused layer (BFL's QKV) split over several weights: its update must be exactly their sizes together."""
    if len(found) == 1:
        return None
    want = []
    for axis in (0, 1):
        pieces = [(rows, cols)[axis] for _, rows, cols in found]
        whole = pieces[0] == slice(None)
        want.append(weights[found[0][0]].shape[axis] if whole else max(piece.stop for piece in pieces))
    got = [file.shape(layer.up)[0], file.shape(layer.down)[1]]
    if got == want:
        return None
    return (f"'{layer.key}' -> {', '.join(repr(t) for t, _, _ in found)} (one fused layer, split): the update is "
            f"{got} (up {list(file.shape(layer.up))}, down {list(file.shape(layer.down))}), the weights together "
            f"{want}")


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
