"""Zero-copy views: how an op reads its operand's buffer.

A ``View`` maps a logical index ``(i0, i1, ...)`` of ``shape`` to the flat element ``offset + sum(i_k * strides_k)``
of the producer's contiguous output. ``mask`` (one ``[lo, hi)`` range per dim, or ``None`` when every index is valid)
marks padding: reads outside the valid range yield 0 and never touch memory. Movement ops (permute, slice, pad,
expand, flip (a negative stride), reshape by merging/splitting dims) compose into a new ``View`` without copying;
a reshape that strides cannot express returns ``None`` and the caller materialises a contiguous copy first.

Views live on graph edges, so compiler rules see layouts (e.g. a transposed matmul operand is a permuted view).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from ..errors import ShapeError, SliceError
from .symbolic import Dim, Expr, add, dims_equal, evaluate, mul, shape_str, to_dim

# Probe values for symbols when ordering products during reshape (equality is always checked symbolically).
_PROBE = 1_000_003


def _probe(d: Dim) -> int:
    return d if isinstance(d, int) else d.evaluate({s: _PROBE + i for i, s in enumerate(sorted(d.free_symbols()))})


def row_major_strides(shape: tuple[Dim, ...]) -> tuple[Dim, ...]:
    strides: list[Dim] = []
    acc: Dim = 1
    for d in reversed(shape):
        strides.append(acc)
        acc = mul(acc, d)
    return tuple(reversed(strides))


@dataclass(frozen=True)
class View:
    shape: tuple[Dim, ...]
    strides: tuple[Dim, ...]
    offset: Dim = 0
    mask: tuple[tuple[Dim, Dim], ...] | None = None

    @staticmethod
    def contiguous(shape) -> View:
        shape = tuple(to_dim(d) for d in shape)
        for d in shape:
            if isinstance(d, int) and d < 0:
                raise ShapeError(f"shape {shape_str(shape)} has a negative dimension")
        return View(shape, row_major_strides(shape))

    # ---- queries ---------------------------------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    def is_contiguous(self) -> bool:
        return (
            self.mask is None
            and dims_equal(self.offset, 0)
            and all(
                dims_equal(s, r) or dims_equal(d, 1)
                for s, r, d in zip(self.strides, row_major_strides(self.shape), self.shape)
            )
        )

    def has_broadcast(self) -> bool:
        return any(dims_equal(s, 0) and not dims_equal(d, 1) for s, d in zip(self.strides, self.shape))

    def _dim_mask(self, axis: int) -> tuple[Dim, Dim]:
        return (0, self.shape[axis]) if self.mask is None else self.mask[axis]

    def _mask_trivial(self, axis: int) -> bool:
        lo, hi = self._dim_mask(axis)
        return dims_equal(lo, 0) and dims_equal(hi, self.shape[axis])

    def _with_mask(self, mask: list[tuple[Dim, Dim]], shape: tuple[Dim, ...]) -> tuple | None:
        if all(dims_equal(lo, 0) and dims_equal(hi, d) for (lo, hi), d in zip(mask, shape)):
            return None
        return tuple(mask)

    def _axis(self, axis: int, op: str) -> int:
        n = self.ndim
        if not -n <= axis < max(n, 1):
            raise ShapeError(f"{op}: axis {axis} is out of range for a tensor of shape {shape_str(self.shape)}")
        return axis % n if n else 0

    # ---- movement --------------------------------------------------------------------------------------------
    def permute(self, axes) -> View:
        axes = tuple(a % self.ndim if self.ndim else a for a in axes)
        if sorted(axes) != list(range(self.ndim)):
            raise ShapeError(
                f"permute: axes {axes} are not a permutation of 0..{self.ndim - 1} "
                f"for shape {shape_str(self.shape)}"
            )
        mask = None if self.mask is None else tuple(self.mask[a] for a in axes)
        return View(tuple(self.shape[a] for a in axes), tuple(self.strides[a] for a in axes), self.offset, mask)

    def slice(self, axis: int, start: Dim, stop: Dim, step: int = 1) -> View:
        axis = self._axis(axis, "slice")
        start, stop, size = to_dim(start), to_dim(stop), self.shape[axis]
        if step < 1:
            raise SliceError(f"slice: step must be >= 1, got {step} (axis {axis} of shape "
                             f"{shape_str(self.shape)}); for reverse order use flip(axis)")
        concrete = all(isinstance(x, int) for x in (start, stop, size))
        if concrete and not (0 <= start <= stop <= size):
            raise SliceError(
                f"slice: [{start}:{stop}] on axis {axis} is out of range for shape {shape_str(self.shape)}; "
                f"bounds must satisfy 0 <= start <= stop <= {size}"
            )
        if step != 1 and not self._mask_trivial(axis):
            raise SliceError("slice: a step other than 1 on a padded axis is not supported; slice before padding")
        length = add(stop, mul(start, -1))
        if step != 1:
            if not isinstance(length, int):
                raise SliceError("slice: a step other than 1 needs concrete bounds")
            length = (length + step - 1) // step
        shape = self.shape[:axis] + (length,) + self.shape[axis + 1 :]
        strides = self.strides[:axis] + (mul(self.strides[axis], step),) + self.strides[axis + 1 :]
        offset = add(self.offset, mul(start, self.strides[axis]))
        mask = None
        if self.mask is not None:
            lo, hi = self.mask[axis]
            m = list(self.mask)
            lo, hi = add(lo, mul(start, -1)), add(hi, mul(start, -1))
            # clip the valid range to the new extent: a later pad would otherwise re-validate the cut-off part
            if isinstance(lo, int) and lo < 0:
                lo = 0
            if isinstance(hi, int) and isinstance(length, int):
                hi = min(hi, length)
            m[axis] = (lo, max(hi, lo) if isinstance(hi, int) and isinstance(lo, int) else hi)
            mask = self._with_mask(m, shape)
        return View(shape, strides, offset, mask)

    def flip(self, axis: int) -> View:
        """Reverse one axis: index ``i`` reads what ``d - 1 - i`` read (a negative stride, no copy)."""
        axis = self._axis(axis, "flip")
        d, s = self.shape[axis], self.strides[axis]
        strides = self.strides[:axis] + (mul(s, -1),) + self.strides[axis + 1 :]
        offset = add(self.offset, mul(add(d, -1), s))
        mask = None
        if self.mask is not None:
            m = list(self.mask)
            lo, hi = m[axis]
            m[axis] = (add(d, mul(hi, -1)), add(d, mul(lo, -1)))
            mask = tuple(m)
        return View(self.shape, strides, offset, mask)

    def pad(self, axis: int, before: Dim, after: Dim) -> View:
        axis = self._axis(axis, "pad")
        before, after = to_dim(before), to_dim(after)
        if any(isinstance(x, int) and x < 0 for x in (before, after)):
            raise ShapeError(f"pad: amounts must be >= 0, got ({before}, {after}); use slice to crop")
        m = [self._dim_mask(i) for i in range(self.ndim)]
        lo, hi = m[axis]
        m[axis] = (add(lo, before), add(hi, before))
        shape = self.shape[:axis] + (add(add(self.shape[axis], before), after),) + self.shape[axis + 1 :]
        offset = add(self.offset, mul(mul(before, self.strides[axis]), -1))
        return View(shape, self.strides, offset, self._with_mask(m, shape))

    def expand(self, axis: int, size: Dim) -> View:
        """Insert a new broadcast axis (stride 0) of ``size`` before position ``axis``."""
        if not 0 <= axis <= self.ndim:
            raise ShapeError(f"expand: axis {axis} is out of range 0..{self.ndim} for shape {shape_str(self.shape)}")
        size = to_dim(size)
        mask = None
        if self.mask is not None:
            mask = self.mask[:axis] + ((0, size),) + self.mask[axis:]
        return View(self.shape[:axis] + (size,) + self.shape[axis:], self.strides[:axis] + (0,) + self.strides[axis:],
                    self.offset, mask)

    def broadcast_dim(self, axis: int, size: Dim) -> View:
        """Stretch a size-1 axis to ``size`` (stride 0)."""
        axis = self._axis(axis, "broadcast")
        if not dims_equal(self.shape[axis], 1):
            raise ShapeError(
                f"broadcast: axis {axis} of shape {shape_str(self.shape)} has size {self.shape[axis]}, "
                f"only size-1 axes can be broadcast to {size}"
            )
        size = to_dim(size)
        mask = None
        if self.mask is not None:
            m = list(self.mask)
            m[axis] = (0, size) if self._mask_trivial(axis) else (0, 0)
            mask = tuple(m)
        return View(self.shape[:axis] + (size,) + self.shape[axis + 1 :],
                    self.strides[:axis] + (0,) + self.strides[axis + 1 :], self.offset, mask)

    def reshape(self, new_shape) -> View | None:
        """Reshape without copying, or ``None`` when the strides cannot express it (caller copies first)."""
        new_shape = tuple(to_dim(d) for d in new_shape)
        if any(dims_equal(d, 0) for d in new_shape):
            # no element is ever read, so any strides do; the grouping below cannot pair up zero-size axes
            return View.contiguous(new_shape)
        old = [(d, s, i) for i, (d, s) in enumerate(zip(self.shape, self.strides)) if not dims_equal(d, 1)]
        new_idx = [i for i, d in enumerate(new_shape) if not dims_equal(d, 1)]
        # masked size-1 axes would be dropped, losing their padding
        for i, d in enumerate(self.shape):
            if dims_equal(d, 1) and not self._mask_trivial(i):
                return None
        new_strides: list[Dim] = [0] * len(new_shape)
        new_mask: list[tuple[Dim, Dim]] = [(0, d) for d in new_shape]
        oi = ni = 0
        while oi < len(old) or ni < len(new_idx):
            if oi >= len(old) or ni >= len(new_idx):
                return None
            og, ng = [old[oi]], [new_idx[ni]]
            po, pn = old[oi][0], new_shape[new_idx[ni]]
            oi, ni = oi + 1, ni + 1
            while not dims_equal(po, pn):
                if _probe(po) < _probe(pn):
                    if oi >= len(old):
                        return None
                    og.append(old[oi])
                    po = mul(po, old[oi][0])
                    oi += 1
                else:
                    if ni >= len(new_idx):
                        return None
                    ng.append(new_idx[ni])
                    pn = mul(pn, new_shape[new_idx[ni]])
                    ni += 1
            # the old axes of a group must be one contiguous run in memory
            for (_, sa, _), (db, sb, _) in zip(og, og[1:]):
                if not dims_equal(sa, mul(sb, db)):
                    return None
            if len(og) == 1 and len(ng) == 1:
                new_mask[ng[0]] = self._dim_mask(og[0][2])
            elif not all(self._mask_trivial(i) for _, _, i in og):
                return None
            stride = og[-1][1]
            for j in reversed(ng):
                new_strides[j] = stride
                stride = mul(stride, new_shape[j])
        return View(new_shape, tuple(new_strides), self.offset, self._with_mask(new_mask, new_shape))

    # ---- evaluation (reference interpreter) -----------------------------------------------------------------
    def bind(self, dims) -> BoundView:
        return BoundView(
            tuple(evaluate(d, dims) for d in self.shape),
            tuple(evaluate(s, dims) for s in self.strides),
            evaluate(self.offset, dims),
            None if self.mask is None else tuple((evaluate(lo, dims), evaluate(hi, dims)) for lo, hi in self.mask),
        )

    def __str__(self) -> str:
        return _view_text(self)

    def to_json(self) -> dict:
        out = {"shape": [str(d) for d in self.shape], "strides": [str(s) for s in self.strides]}
        if not dims_equal(self.offset, 0):
            out["offset"] = str(self.offset)
        if self.mask is not None:
            out["mask"] = [[str(lo), str(hi)] for lo, hi in self.mask]
        return out

    @staticmethod
    def from_json(data: dict) -> View:
        mask = data.get("mask")
        return View(
            tuple(to_dim(d) for d in data["shape"]),
            tuple(to_dim(s) for s in data["strides"]),
            to_dim(data.get("offset", "0")),
            None if mask is None else tuple((to_dim(lo), to_dim(hi)) for lo, hi in mask),
        )


@dataclass(frozen=True)
class BoundView:
    """A view with every dimension bound to an integer; reads numpy buffers."""

    shape: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int
    mask: tuple[tuple[int, int], ...] | None

    def gather(self, flat: np.ndarray) -> np.ndarray:
        """Read this view out of a contiguous 1-D buffer, as a new contiguous array."""
        if 0 in self.shape:
            return np.zeros(self.shape, dtype=flat.dtype)
        if self.mask is None:
            last = self.offset + sum((d - 1) * s for d, s in zip(self.shape, self.strides) if s > 0)
            first = self.offset + sum((d - 1) * s for d, s in zip(self.shape, self.strides) if s < 0)
            if first >= 0 and last < flat.size:
                item = flat.itemsize
                base = flat[self.offset :] if self.offset else flat
                return np.lib.stride_tricks.as_strided(
                    base, self.shape, tuple(s * item for s in self.strides), writeable=False
                ).copy()
        index = np.full(self.shape, self.offset, dtype=np.int64)
        valid = np.ones(self.shape, dtype=bool)
        for axis, (d, s) in enumerate(zip(self.shape, self.strides)):
            shape = [1] * len(self.shape)
            shape[axis] = d
            ar = np.arange(d, dtype=np.int64).reshape(shape)
            index += ar * s
            if self.mask is not None:
                lo, hi = self.mask[axis]
                valid &= (ar >= lo) & (ar < hi)
        valid &= (index >= 0) & (index < flat.size)
        out = np.zeros(self.shape, dtype=flat.dtype)
        out[valid] = flat[index[valid]]
        return out


__all__ = ["View", "BoundView", "row_major_strides", "Expr"]


@functools.lru_cache(maxsize=1 << 16)
def _view_text(view: View) -> str:
    """A view's text, kept: hashing a graph (the plan cache key), cutting it into segments and comparing candidates
    print the same few views thousands of times (views are immutable)."""
    text = f"{shape_str(view.shape)}:{shape_str(view.strides)}"
    if not dims_equal(view.offset, 0):
        text += f"+{view.offset}"
    if view.mask is not None:
        text += " mask[" + ", ".join(f"{lo}:{hi}" for lo, hi in view.mask) + "]"
    return text
