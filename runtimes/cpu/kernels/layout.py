"""Layout kernels: ``Copy`` (a strided copy, zeros where the view is padding; upsampling repeats as row
copies) and ``Concat`` (the sum of zero-padded views, computed box by box)."""

from __future__ import annotations

import functools
import math

import numpy as np

from luminal_recipes.graph.view import BoundView

from ...kernels.context import Bind, KernelContext
from ...views import alias, in_bounds, strided
from .. import jit
from .. import threads as cpu_threads
from .common import F32
from .elementwise import _prepare_expression, prepare_binary


def _box(bv: BoundView) -> tuple[tuple[slice, ...], BoundView] | None:
    """Where a (possibly padded) view holds data, one slice per axis, and the unmasked view of just that box;
    None when it holds none."""
    box = [(0, d) if bv.mask is None else (max(lo, 0), min(hi, d)) for (lo, hi), d in
           zip(bv.mask or [(0, d) for d in bv.shape], bv.shape)]
    if any(lo >= hi for lo, hi in box):
        return None
    offset = bv.offset + sum(lo * st for (lo, _), st in zip(box, bv.strides))
    return tuple(slice(lo, hi) for lo, hi in box), BoundView(tuple(hi - lo for lo, hi in box), bv.strides,
                                                            offset, None)


def _disjoint(a: tuple[slice, ...], b: tuple[slice, ...]) -> bool:
    return any(x.stop <= y.start or y.stop <= x.start for x, y in zip(a, b))


def prepare_concat(ctx: KernelContext) -> Bind:
    """``Concat``: the sum of two zero-padded views (how concat and stack are written: ``pad(a) + pad(b)``)."""
    if len(ctx.inputs) != 2 or any(tuple(k.view.shape) != ctx.shape for k in ctx.inputs):
        ctx.fail("expects two inputs viewed at the output shape")
    return prepare_padded_add(ctx) or prepare_binary(ctx, "Add")


def prepare_padded_add(ctx: KernelContext) -> Bind | None:
    """The sum of zero-padded views computed box by box into the output: each operand's data is added where it
    has data, and zeros are written only where neither has any (the generic path would first gather each
    operand, padding included, into scratch). None for the layouts and dtypes it does not handle."""
    edges = [k.view for k in ctx.inputs]
    parts = [_box(bv) for bv in edges]
    native = all(k.dtype == ctx.dtype and k.dtype.kind == "f" for k in ctx.inputs)
    if len(edges) != 2 or all(bv.mask is None for bv in edges) or not native or None in parts:
        return None
    if not all(in_bounds(inner, k.size) for (_, inner), k in zip(parts, ctx.inputs)):
        return None
    (box_a, _), (box_b, _) = parts
    count = [math.prod(sl.stop - sl.start for sl in box) for box, _ in parts]
    # the two boxes tile the output (a concatenation): no zeros to write, and no element sums two values
    tiled = _disjoint(box_a, box_b) and sum(count) == math.prod(ctx.shape)
    zero = ctx.dtype.type(0)

    # an operand with data everywhere goes first and initialises the output (the planner may have put the
    # output in that operand's buffer, never in a padded one's: so both full is left to the generic path)
    order = sorted(range(2), key=lambda i: -count[i])
    first_full = count[order[0]] == math.prod(ctx.shape)
    if count[order[1]] == math.prod(ctx.shape):
        return None

    def bind(out, flats, scratch):
        (dst0, src0), (dst1, src1) = [(out[parts[i][0]], strided(flats[i], parts[i][1])) for i in order]

        def add(d, a, b):
            return lambda: np.add(a, b, out=d)

        # each operand's box in parts per core; 0 + x, as the padded sum has it (-0.0 comes out +0.0)
        if tiled:  # a concatenation: compiled box copies where they apply, so that the chains run them
            described = _compiled_copies([(dst0, src0), (dst1, src1)])
            if described is not None:
                return described
        if tiled or first_full:
            first = cpu_threads.parallel([add(d, s, zero) for d, s in _split_pair(dst0, src0)])
        else:
            first = cpu_threads.parallel([add(d, d, s) for d, s in _split_pair(dst0, src0)])
        if tiled:
            second = cpu_threads.parallel([add(d, s, zero) for d, s in _split_pair(dst1, src1)])
        else:
            second = cpu_threads.parallel([add(d, d, s) for d, s in _split_pair(dst1, src1)])

        def body():
            if not (tiled or first_full):
                out.fill(0)
            first()
            second()

        return body

    return bind


def _merged(dst: np.ndarray, src: np.ndarray) -> list[list[int]] | None:
    """The axes of two f32 arrays of one shape as ``[n, dst stride, src stride]`` (element strides), unit axes
    dropped and neighbours merged where both are one run of memory; None for other dtypes, an empty array, or
    negative or unaligned strides."""
    item = dst.itemsize
    for a in (dst, src):
        if a.dtype != F32 or a.size == 0 or any(st < 0 or st % item for st in a.strides):
            return None
    merged: list[list[int]] = []
    for n, ds, ss in zip(dst.shape, dst.strides, src.strides):
        if n == 1:
            continue
        ds, ss = ds // item, ss // item
        if merged and merged[-1][1] == n * ds and merged[-1][2] == n * ss:
            merged[-1] = [merged[-1][0] * n, ds, ss]
        else:
            merged.append([n, ds, ss])
    return merged


def _rows3(dst: np.ndarray, src: np.ndarray) -> tuple | None:
    """``(dst flat, [n0, n1, n2, d0, d1], src flat, [s0, s1])``: two f32 arrays of one shape as the flat runs they
    span and a box of at most three axes (theirs, merged where both are one run of memory), the last of unit
    stride in both (``f32_kernels.copy_rows``' layout); else None."""
    merged = _merged(dst, src)
    if merged is None:
        return None
    if not merged or merged[-1][1:] != [1, 1]:
        merged.append([1, 1, 1])
    if len(merged) > 3:
        return None
    d_flat, geometry, s_flat, s_strides = _flat_box(dst, src, merged)
    return d_flat, geometry[:5], s_flat, s_strides[:2]


def _box3(dst: np.ndarray, src: np.ndarray) -> tuple | None:
    """``(dst flat, [n0, n1, n2, d0, d1, d2], src flat, [s0, s1, s2])``: ``_rows3``'s box with the innermost axis
    strided in either array (``f32_kernels.copy_box``' layout); else None."""
    merged = _merged(dst, src)
    if not merged or len(merged) > 3:
        return None
    return _flat_box(dst, src, merged)


def _flat_box(dst: np.ndarray, src: np.ndarray, merged: list[list[int]]) -> tuple:
    """``(dst flat, [n0, n1, n2, d0, d1, d2], src flat, [s0, s1, s2])`` of the box ``merged`` (at most three
    axes, padded in front to three)."""
    item = dst.itemsize
    merged = [[1, 0, 0]] * (3 - len(merged)) + merged
    flats = []
    for a, col in ((dst, 1), (src, 2)):
        span = 1 + sum((row[0] - 1) * row[col] for row in merged)
        flats.append(alias(a, (span,), (item,), writeable=a is dst))
    return (flats[0], [row[0] for row in merged] + [row[1] for row in merged], flats[1],
            [row[2] for row in merged])


def _compiled_copies(pairs: list[tuple[np.ndarray, np.ndarray]]):
    """One step copying each ``(dst, src)`` (``dst = src + 0``) by ``f32_kernels.copy_rows`` (``copy_box`` where
    the rows would be single elements: the innermost axis strided), the parts of each
    pair (``_split_pair``) split over the cores and described for the chains; None where numba is off or a pair
    is not f32 rows of the same merged shape."""
    if not jit.AVAILABLE:
        return None
    phases = _copy_calls(pairs)
    return None if phases is None else _Copies(tuple(pairs), phases)


def _copy_calls(pairs) -> tuple | None:
    """Per pair its calls ``(kernel, args, part)``, one per part (``_split_pair``); None where a part has no such
    call."""
    from ..jit import f32_kernels

    phases = []
    for dst, src in pairs:
        calls = []
        for i, (d, s) in enumerate(_split_pair(dst, src)):
            s = s if s.shape == d.shape else np.broadcast_to(s, d.shape)  # (numpy's broadcast_to: ~8 us)
            kernel, rows = f32_kernels.copy_rows, _rows3(d, s)
            box = _box3(d, s) if rows is not None and rows[1][2] == 1 else None
            if box is not None:  # rows of one element (the innermost axis strided): the strided loop instead
                kernel, rows = f32_kernels.copy_box, box
            if rows is None:
                return None
            d_flat, d_geometry, s_flat, s_strides = rows
            calls.append((kernel, (d_flat, np.array(d_geometry, np.int64), s_flat, np.array(s_strides, np.int64)),
                          i))
        phases.append(tuple(calls))
    return tuple(phases)


_UNSET = object()


class _Copies:
    """``_compiled_copies``' step: each pair's calls, its parts in parallel, described for the chains only when a
    chain asks (``chain``, ``rechain``: ``jit/chain.py``'s ``tag`` attributes). A concatenation of a cache that
    grows a row a step is bound again at every length (``Executable._in_place``), and such a binding runs its
    steps one by one, never recorded: its description made at binding time (Calls, closures) was ~25 more
    objects the garbage collector tracks per concatenation, kept as long as the binding is (docs/torch.md)."""

    __slots__ = ("pairs", "phases", "parallel", "_chain")

    def __init__(self, pairs: tuple, phases: tuple):
        self.pairs, self.phases, self._chain = pairs, phases, _UNSET
        self.parallel = tuple(None if len(calls) == 1 else cpu_threads.parallel(
            [functools.partial(kernel, *args) for kernel, args, _ in calls]) for calls in phases)

    def __call__(self) -> None:
        for calls, parallel in zip(self.phases, self.parallel):
            if parallel is None:
                kernel, args, _ = calls[0]
                kernel(*args)
            else:
                parallel()

    @property
    def chain(self) -> tuple | None:
        if self._chain is _UNSET:
            from ..jit.chain import chainable

            phases = _as_calls(self.phases)
            self._chain = phases if phases and chainable(phases) else None
        return self._chain

    def rechain(self) -> list:  # a copy is exact whatever its cut: described again for a chain's finer parts
        return _as_calls(_copy_calls(self.pairs) or ())


def _as_calls(phases) -> tuple:
    from ..jit.chain import Call

    # (a copy reads its source's flat span and writes its destination's)
    return tuple(tuple(Call(fn, args, part, access=((args[2],), (args[0],))) for fn, args, part in calls)
                 for calls in phases if calls)


def _complement(box: tuple[slice, ...], shape: tuple[int, ...]) -> list[tuple[slice, ...]]:
    """Disjoint boxes covering ``shape`` outside ``box``: per axis, the parts before and after the box's range
    (within the box on earlier axes, whole on later ones)."""
    out = []
    for axis, (sl, d) in enumerate(zip(box, shape)):
        for part in (slice(0, sl.start), slice(sl.stop, d)):
            if part.start < part.stop:
                out.append(box[:axis] + (part,) + tuple(slice(0, e) for e in shape[axis + 1 :]))
    return out


# elements up to which a Copy is described for the chains (a decoding step's: ~10^3); a larger one costs more
# than the Python call a chain saves, and numpy's copy is the faster there
CHAINED_COPY = 1 << 16


def prepare_copy(ctx: KernelContext) -> Bind:
    """``Copy``: one strided copy of the data into the output (no tiling: there are no temporaries to keep in
    cache) and zeros written where the view is padding, instead of gathering the padded operand into scratch
    and copying that; a view that reads past its buffer is gathered (the reference reads zeros there)."""
    if len(ctx.inputs) != 1 or tuple(ctx.inputs[0].view.shape) != ctx.shape:
        ctx.fail("expects one input viewed at the output shape")
    k = ctx.inputs[0]
    part = _box(k.view)
    if k.dtype != ctx.dtype or (part is not None and not in_bounds(part[1], k.size)):
        return _prepare_expression(ctx, "in0")

    def bind(out, flats, scratch):
        if part is None:  # all padding
            return lambda: out.fill(0)
        box, inner = part
        src, dst = strided(flats[0], inner), out[box]
        zeros = [out[b] for b in _complement(box, ctx.shape)]

        def copy(d, s):
            steps = _repeat_steps(d, s)
            if len(steps) == 1:
                return lambda: np.copyto(d, s)

            def run():
                for d_step, s_step in steps:
                    np.copyto(d_step, s_step)
            return run

        rows = _upsampled_rows(dst, src) if jit.AVAILABLE and not zeros else None
        if rows is not None:  # a 2x nearest-neighbour upsampling: one compiled pass, its rows split over the cores
            kernel, (src_rows, dst_rows) = jit.kernels("image").upsample2_rows, rows
            copies = cpu_threads.parallel([
                lambda part=part: kernel(src_rows, dst_rows, part.start, part.stop)
                for part in cpu_threads.split(src_rows.shape[0], 4 * src_rows.shape[1])])
        else:
            pairs = _split_pair(dst, src)
            copies = cpu_threads.parallel([copy(d, s) for d, s in pairs])
            if (jit.AVAILABLE and not zeros and dst.size <= CHAINED_COPY
                    and all(len(_repeat_steps(d, s)) == 1 for d, s in pairs)):
                # the same copies as compiled calls (exact: any dtype, -0.0 kept), described for the chains: a
                # decoding step's attention output (heads to rows) no longer cuts its chain in two
                from ..jit.chain import Call, copy_region, tag

                def describe():  # (again for a chain's finer parts: ``chain.finer``)
                    return [[Call(copy_region, (d, d, s, False), i, access=((s,), (d,)))
                             for i, (d, s) in enumerate(_split_pair(dst, src))]]

                return tag(copies, *describe(), redescribe=describe)

        def body():
            for z in zeros:
                z.fill(0)
            copies()

        return body

    return bind


def _upsampled_rows(dst: np.ndarray, src: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """``(src as [R, W], dst as [2R, 2W])`` where ``src`` is an f32 ``[..., H, 2, W, 2]`` view repeating each
    value along both 2-axes (stride 0; W with unit stride, H and the axes before it one run of rows) and ``dst``
    is contiguous: a 2x nearest-neighbour upsampling, ``numba_kernels.upsample2_rows``'s layout; else None."""
    if src.dtype != F32 or src.ndim < 4 or not dst.flags.c_contiguous:
        return None
    (h, two_h, w, two_w), (sh, zh, sw, zw) = src.shape[-4:], src.strides[-4:]
    if (two_h, two_w, zh, zw, sw) != (2, 2, 0, 0, 4) and not (w == 1 and (two_h, two_w, zh, zw) == (2, 2, 0, 0)):
        return None
    expected, rows = sh * h, h
    for d, stride in zip(reversed(src.shape[:-4]), reversed(src.strides[:-4])):
        if d != 1 and stride != expected:
            return None
        expected, rows = expected * d, rows * d
    src_rows = alias(src, (rows, w), (sh, 4), writeable=False)
    return src_rows, dst.reshape(2 * rows, 2 * w)


def _repeat_steps(dst: np.ndarray, src: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """``np.copyto(dst, src)`` as copies to make in order, for a source that repeats its values along its innermost
    axis (stride 0, as a nearest-neighbour upsampling reads its input): numpy would run its inner loop over the
    repeats (two elements for a 2x upsampling, 2.5x slower than the steps here). Instead the first entry of
    every repeated axis is copied from ``src``, then repeated within ``dst``, innermost axis first (each copy's
    inner loop runs along a whole row). Any other pair is one copy."""
    axes = [a for a in range(src.ndim) if src.shape[a] > 1]
    repeated = [a for a in axes if src.strides[a] == 0]
    if not axes or axes[-1] not in repeated:
        return [(dst, src)]
    first = [slice(None)] * src.ndim
    for a in repeated:
        first[a] = slice(0, 1)
    steps = [(dst[tuple(first)], src[tuple(first)])]
    for a in reversed(repeated):  # fill axis a from its first entry, the axes inside it already whole
        rest, head = list(first), list(first)
        rest[a], head[a] = slice(1, None), slice(0, 1)
        steps.append((dst[tuple(rest)], dst[tuple(head)]))
        first[a] = slice(None)
    return steps


def _split_pair(dst: np.ndarray, src: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """``(dst, src)`` of the same shape cut along their first axis that has at least two entries into one pair of
    views per core (disjoint parts of ``dst``), or the whole pair when it is small."""
    axis = next((a for a, d in enumerate(dst.shape) if d >= 2), None)
    if axis is None:
        return [(dst, src)]
    index = (slice(None),) * axis
    parts = cpu_threads.split(dst.shape[axis], dst.size // dst.shape[axis])
    return [(dst[index + (sl,)], src[index + (sl,)]) for sl in parts]

