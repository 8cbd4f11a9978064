"""Checkpoint names -> recipe names: prefix/regex renames, fused tensors split, per-expert tensors stacked,
transposes.

The rules of a recipe's ``weights`` section apply in this order, each to the names the step before produced:
``rename`` (in the order written), ``split``, ``stack``, then ``transpose`` (matched against final recipe
names). The result maps every recipe name to a :class:`MappedTensor`: its shape and dtype as it will be seen,
the checkpoint tensors it comes from, and a ``load()`` that reads them (memory-mapped) only when called.
A split rule that matches a quantized weight (one stored with a ``weight_scale``) splits its scales with it
(``split_quantized.py``), in the format and layout of the section's ``quantization`` block.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from ..errors import CheckpointError, RecipeError
from . import regexes
from .schema import WeightsSection
from .split_quantized import quantized_companions, split_quantized


@dataclass(frozen=True)
class StoredTensor:
    """What the mapping needs to know of a checkpoint tensor."""

    shape: tuple[int, ...]
    dtype: str  # safetensors spelling (F32, BF16, U8, F8_E4M3...)


@dataclass
class MappedTensor:
    name: str
    shape: tuple[int, ...]
    dtype: str
    sources: tuple[str, ...]  # checkpoint names it is read from
    load: Callable[[], np.ndarray]
    rows: tuple[int, int] | None = None  # a split part: rows [start, stop) of its one source (a packed GGUF part)

    @property
    def via(self) -> str:
        return ", ".join(self.sources)


Loader = Callable[[str], np.ndarray]


def rename(name: str, section: WeightsSection) -> str:
    for rule in section.rename:
        if rule.prefix is not None:
            if name.startswith(rule.prefix):
                name = rule.to + name[len(rule.prefix) :]
        else:
            name = _substitute(rule.regex, rule.to, name)
    return name


def _expand(match: regexes.Match, template: str, what: str) -> str:
    try:
        return match.expand(template)
    except regexes.ERRORS as exc:
        raise RecipeError(
            f"weights.{what}: the name template '{template}' does not fit the regex "
            f"'{match.re.pattern}' ({exc}); refer only to groups the regex has (\\1, \\2...)."
        ) from None


def _substitute(pattern: str, replacement: str, name: str) -> str:
    try:
        return regexes.sub(pattern, replacement, name)
    except regexes.ERRORS as exc:
        raise RecipeError(
            f"weights.rename: the replacement '{replacement}' does not fit the regex '{pattern}' "
            f"({exc}); refer only to groups the regex has (\\1, \\2...)."
        ) from None


def map_checkpoint(
    stored: Mapping[str, StoredTensor],
    section: WeightsSection,
    load: Loader,
    split_sizes: Callable[[int, Any], list[int]] | None = None,
) -> dict[str, MappedTensor]:
    """Apply the section's rules to every stored tensor. ``split_sizes(rule_index, rule)`` evaluates sizes."""
    current: dict[str, MappedTensor] = {}
    for stored_name, info in stored.items():
        if any(regexes.fullmatch(p, stored_name) for p in section.ignore):
            continue
        name = rename(stored_name, section)
        if name in current:
            raise CheckpointError(
                f"the rename rules map both '{current[name].via}' and '{stored_name}' to "
                f"'{name}'; make the rules more specific."
            )
        current[name] = MappedTensor(
            name, tuple(info.shape), info.dtype, (stored_name,), _reader(load, stored_name)
        )
    current = _apply_splits(current, section, split_sizes)
    current = _apply_stacks(current, section)
    return _apply_transposes(current, section)


def _reader(load: Loader, name: str) -> Callable[[], np.ndarray]:
    return lambda: load(name)


def _apply_splits(
    tensors: dict[str, MappedTensor],
    section: WeightsSection,
    split_sizes: Callable[[int, Any], list[int]] | None,
) -> dict[str, MappedTensor]:
    if not section.split:
        return tensors
    matches: dict[str, tuple[int, Any, regexes.Match]] = {}
    for name in tensors:
        for index, rule in enumerate(section.split):
            match = regexes.fullmatch(rule.regex, name)
            if match is not None:
                matches[name] = (index, rule, match)
                break
    # a fused quantized weight carries its scales along: they are split with it, never on their own
    scales = {name: quantized_companions(name, tensors) for name in matches}
    taken = {c.name for companions in scales.values() for c in companions.values()}
    out = {name: t for name, t in tensors.items() if name not in matches and name not in taken}
    for name, (index, rule, match) in matches.items():
        if name in taken:
            continue
        tensor = tensors[name]
        axis = rule.axis % len(tensor.shape) if tensor.shape else 0
        parts = [_expand(match, template, "split") for template in rule.into]
        sizes_for = partial(_part_sizes, name, tensor, rule, index, split_sizes)  # (total[, padded_to])
        if scales[name]:
            out.update(split_quantized(tensor, scales[name], parts, axis, sizes_for, section.quantization))
            continue
        sizes = sizes_for(tensor.shape[axis] if tensor.shape else 0)
        start = 0
        for part, size in zip(parts, sizes):
            shape = tensor.shape[:axis] + (size,) + tensor.shape[axis + 1 :]
            rows = (start, start + size) if axis == 0 and len(tensor.sources) == 1 and tensor.rows is None else None
            out[part] = MappedTensor(
                part, shape, tensor.dtype, tensor.sources, _slicer(tensor.load, axis, start, start + size), rows
            )
            start += size
    return out


def _part_sizes(
    name: str,
    tensor: MappedTensor,
    rule: Any,
    index: int,
    split_sizes: Callable[[int, Any], list[int]] | None,
    total: int,
    padded_to: int = 1,
) -> list[int]:
    """Sizes of the parts along the split axis: the rule's ``sizes``, or ``total`` in equal parts.

    ``padded_to``: the stored axis may hold the parts' sum rounded up to this multiple (zero padding).
    """
    if rule.sizes is None:
        if total % len(rule.into):
            raise CheckpointError(
                f"'{name}' ({list(tensor.shape)}) cannot be split into "
                f"{len(rule.into)} equal parts along axis {rule.axis}; give "
                f"`sizes:` in the split rule."
            )
        return [total // len(rule.into)] * len(rule.into)
    sizes = split_sizes(index, rule) if split_sizes else [int(s) for s in rule.sizes]
    if -(-sum(sizes) // padded_to) * padded_to != total or len(sizes) != len(rule.into):
        raise CheckpointError(
            f"split rule for '{name}': sizes {sizes} do not add up to its "
            f"{total} rows along axis {rule.axis} (shape {list(tensor.shape)})."
        )
    return sizes


def _slicer(load: Callable[[], np.ndarray], axis: int, start: int, stop: int) -> Callable[[], np.ndarray]:
    def read() -> np.ndarray:
        array = load()
        index = [slice(None)] * array.ndim
        index[axis] = slice(start, stop)
        return array[tuple(index)]

    return read


def _apply_stacks(tensors: dict[str, MappedTensor], section: WeightsSection) -> dict[str, MappedTensor]:
    if not section.stack:
        return tensors
    out: dict[str, MappedTensor] = {}
    groups: dict[str, dict[int, MappedTensor]] = {}
    axes: dict[str, int] = {}
    for name, tensor in tensors.items():
        for rule in section.stack:
            match = regexes.fullmatch(rule.regex, name)
            if match is not None:
                target = _expand(match, rule.into, "stack")
                groups.setdefault(target, {})[int(match.group("index"))] = tensor
                axes[target] = rule.axis
                break
        else:
            out[name] = tensor
    for target, parts in groups.items():
        count = len(parts)
        if sorted(parts) != list(range(count)):
            raise CheckpointError(
                f"stacking '{target}': the parts have indices {sorted(parts)}, expected "
                f"0..{count - 1} without gaps; check the stack rule's (?P<index>) group."
            )
        ordered = [parts[i] for i in range(count)]
        first = ordered[0]
        odd = [p.via for p in ordered if p.shape != first.shape or p.dtype != first.dtype]
        if odd:
            raise CheckpointError(
                f"stacking '{target}': parts differ in shape or dtype from '{first.via}' "
                f"({list(first.shape)} {first.dtype}): {', '.join(odd)}."
            )
        axis = axes[target] % (len(first.shape) + 1)
        shape = first.shape[:axis] + (count,) + first.shape[axis:]
        loads = [p.load for p in ordered]
        out[target] = MappedTensor(
            target,
            shape,
            first.dtype,
            tuple(s for p in ordered for s in p.sources),
            lambda loads=loads, axis=axis: np.stack([f() for f in loads], axis=axis),
        )
    return out


def _apply_transposes(tensors: dict[str, MappedTensor], section: WeightsSection) -> dict[str, MappedTensor]:
    if not section.transpose:
        return tensors
    for name, tensor in list(tensors.items()):
        for rule in section.transpose:
            if regexes.fullmatch(rule.regex, name):
                axes = tuple(rule.axes) if rule.axes else tuple(reversed(range(len(tensor.shape))))
                if sorted(axes) != list(range(len(tensor.shape))):
                    raise CheckpointError(
                        f"transpose rule '{rule.regex}': axes {list(axes)} are not a "
                        f"permutation of the {len(tensor.shape)} axes of '{name}'."
                    )
                shape = tuple(tensor.shape[a] for a in axes)
                load = tensor.load
                tensors[name] = MappedTensor(
                    name,
                    shape,
                    tensor.dtype,
                    tensor.sources,
                    lambda load=load, axes=axes: np.transpose(load(), axes),
                )
                break
    return tensors
