"""The ATen op table: each entry translates one ATen overload into HLIR ops, reusing ``luminal_recipes.ops`` (so a
matmul, a norm, a softmax or an attention is the same composition of primitives a recipe builds, and the same
egglog rules find its fused kernels).

An entry is ``fn(cx, *args, **kwargs)``: ``cx`` is the ``translate.Context`` (graph, the node's output shape and
dtype from its ``meta["val"]``), ``args`` are the node's arguments with FX nodes replaced by their translations
(``Tensor``s, dims, Python scalars). It returns a ``Tensor`` (or a tuple for multi-output ops; ``None`` for an
output it does not compute) or raises ``Unsupported`` for arguments it does not handle: that part of the model
then runs in eager PyTorch. ``docs/torch.md`` lists the table; adding an op is one function here.
"""

from __future__ import annotations

import math

import torch

from .. import ops
from ..graph import DType, Tensor, cast, gather, scatter
from ..graph import symbolic as sym
from ..graph.symbolic import dims_equal
from .translate import Unsupported, as_dim

aten = torch.ops.aten
OPS: dict = {}


def op(*overloads):
    def register(fn):
        for o in overloads:
            OPS[o] = fn
        return fn
    return register


# ---- helpers ---------------------------------------------------------------------------------------------------
def _to(x: Tensor, dtype: DType) -> Tensor:
    return x if x.dtype == dtype else cast(x, dtype)


def _lift(cx, x, dtype: DType, shape) -> Tensor:
    """A tensor or Python scalar in ``dtype``, broadcast to ``shape``."""
    if isinstance(x, Tensor):
        # broadcast, then cast: the cast reads the operand through the broadcast view and its result is read
        # whole, so it fuses into the op's element-wise kernel (a cast then broadcast is a separate step: the
        # rules fuse only a producer read whole). Its work is at most the op's own, one element each
        return _to(x.broadcast_to(shape), dtype)
    if isinstance(x, bool):
        x = int(x)
    if isinstance(x, sym.Expr):  # a SymInt operand: the size's value, fed with each call
        return _to(cx.dim_value(x), dtype).broadcast_to(shape)
    if not isinstance(x, (int, float)):
        raise Unsupported(str(cx.node.target), f"operand {x!r} is not a tensor or a number")
    if not dtype.is_float and isinstance(x, float) and not float(x).is_integer():
        raise Unsupported(str(cx.node.target), f"float {x} with an integer tensor")
    return cx.g.constant(x, dtype).broadcast_to(shape)


_KIND = {DType.BOOL: 0, DType.I32: 1, DType.U8: 1}


def _kind(dtype: DType) -> int:
    return _KIND.get(dtype, 2)


def _category(dt: torch.dtype) -> int:
    return 0 if dt == torch.bool else 2 if dt.is_floating_point else 1


def _promoted(cx, a, b) -> DType:
    """torch's type promotion for two operands (tensors, scalars), in HLIR dtypes."""
    va = cx.node.args[0].meta.get("val") if hasattr(cx.node.args[0], "meta") else None
    vb = cx.node.args[1].meta.get("val") if len(cx.node.args) > 1 and hasattr(cx.node.args[1], "meta") else None
    if isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor):
        if (va.dim() == 0) == (vb.dim() == 0):
            return cx.dtype(torch.promote_types(va.dtype, vb.dtype))
        shaped, zero = (va, vb) if vb.dim() == 0 else (vb, va)  # a 0-dim tensor counts only by its category
        return cx.dtype(zero.dtype if _category(zero.dtype) > _category(shaped.dtype) else shaped.dtype)
    t, s = (a, b) if isinstance(a, Tensor) else (b, a)
    if isinstance(s, float) and not t.dtype.is_float:
        return cx.compute or DType.F32
    return t.dtype


def _binary(fn, promote: bool = False):
    def entry(cx, a, b, **kw):
        shape = cx.out_shape()
        dtype = _promoted(cx, a, b) if promote else cx.out_dtype()
        return fn(_lift(cx, a, dtype, shape), _lift(cx, b, dtype, shape))
    return entry


def _unary(fn, needs_float: bool = True):
    def entry(cx, x, *rest):
        if rest:
            raise Unsupported(str(cx.node.target), "extra arguments")
        dtype = cx.out_dtype()
        return fn(_to(x, dtype))
    return entry


def _axes(x: Tensor, dims) -> list[int]:
    if dims is None or dims == []:
        return list(range(x.ndim))
    dims = [dims] if isinstance(dims, int) else list(dims)
    return sorted({d % max(x.ndim, 1) for d in dims})


# ---- elementwise -----------------------------------------------------------------------------------------------
@op(aten.add.Tensor, aten.add.Scalar)
def add(cx, a, b, alpha=1):
    shape, dtype = cx.out_shape(), cx.out_dtype()
    b = _lift(cx, b, dtype, shape)
    if alpha != 1:
        b = b * alpha
    return _lift(cx, a, dtype, shape) + b


@op(aten.sub.Tensor, aten.sub.Scalar)
def sub(cx, a, b, alpha=1):
    shape, dtype = cx.out_shape(), cx.out_dtype()
    b = _lift(cx, b, dtype, shape)
    if alpha != 1:
        b = b * alpha
    return _lift(cx, a, dtype, shape) - b


@op(aten.rsub.Scalar, aten.rsub.Tensor)
def rsub(cx, a, b, alpha=1):
    shape, dtype = cx.out_shape(), cx.out_dtype()
    a = _lift(cx, a, dtype, shape)
    if alpha != 1:
        a = a * alpha
    return _lift(cx, b, dtype, shape) - a


OPS[aten.mul.Tensor] = OPS[aten.mul.Scalar] = _binary(lambda a, b: a * b)


@op(aten.div.Tensor, aten.div.Scalar, aten.div.Tensor_mode, aten.div.Scalar_mode)
def div(cx, a, b, rounding_mode=None):
    if rounding_mode is not None:
        raise Unsupported(str(cx.node.target), f"rounding_mode={rounding_mode!r}")
    shape, dtype = cx.out_shape(), cx.out_dtype()
    if not dtype.is_float:
        raise Unsupported(str(cx.node.target), "integer division")
    if not isinstance(b, Tensor):
        return _lift(cx, a, dtype, shape) * (1.0 / float(b))
    return _lift(cx, a, dtype, shape) / _lift(cx, b, dtype, shape)


for _o, _f in [(aten.neg.default, lambda x: -x), (aten.reciprocal.default, ops.recip), (aten.sqrt.default, ops.sqrt),
               (aten.rsqrt.default, ops.rsqrt), (aten.exp.default, ops.exp), (aten.exp2.default, ops.exp2),
               (aten.log.default, ops.log), (aten.log2.default, ops.log2), (aten.sin.default, ops.sin),
               (aten.cos.default, ops.cos), (aten.tanh.default, ops.tanh), (aten.sigmoid.default, ops.sigmoid),
               (aten.silu.default, ops.silu), (aten.relu.default, ops.relu), (aten.erf.default, ops.erf),
               (aten.abs.default, ops.abs), (aten.sign.default, ops.sign)]:
    OPS[_o] = _unary(_f)


@op(aten.gelu.default)
def gelu(cx, x, approximate="none"):
    return ops.gelu(_to(x, cx.out_dtype()), approximate)


@op(aten.pow.Tensor_Scalar)
def pow_(cx, x, p):
    x = _to(x, cx.out_dtype())
    if isinstance(p, (int, float)) and float(p) == 0.5:
        return ops.sqrt(x)
    if isinstance(p, (int, float)) and float(p) == -0.5:
        return ops.rsqrt(x)
    if isinstance(p, (int, float)) and float(p).is_integer() and 0 <= p <= 8:
        return ops.pow(x, float(p))
    if isinstance(p, (int, float)) and float(p).is_integer() and -8 <= p < 0:
        return ops.recip(ops.pow(x, float(-p)))
    raise Unsupported("aten.pow.Tensor_Scalar", f"exponent {p!r} (small integers and +-0.5 are translated)")


@op(aten.pow.Scalar)
def pow_scalar(cx, base, x):
    if not isinstance(base, (int, float)) or base <= 0:
        raise Unsupported("aten.pow.Scalar", f"base {base!r}")
    return ops.exp2(_to(x, cx.out_dtype()) * math.log2(base))


@op(aten.leaky_relu.default)
def leaky_relu(cx, x, slope=0.01):
    x = _to(x, cx.out_dtype())
    return ops.where(x > x.graph.constant(0.0, x.dtype).broadcast_to(x.shape), x, x * slope)


@op(aten.hardtanh.default)
def hardtanh(cx, x, lo=-1.0, hi=1.0):  # ReLU6 (MobileNets) is hardtanh(0, 6)
    return ops.clamp(_to(x, cx.out_dtype()), lo, hi)


@op(aten.clamp.Tensor)
def clamp_tensor(cx, x, lo=None, hi=None):
    shape, dtype = cx.out_shape(), cx.out_dtype()
    x = _lift(cx, x, dtype, shape)
    if lo is not None:
        x = ops.maximum(x, _lift(cx, lo, dtype, shape))
    if hi is not None:
        x = ops.minimum(x, _lift(cx, hi, dtype, shape))
    return x


@op(aten.clamp.default, aten.clamp_min.default, aten.clamp_max.default)
def clamp(cx, x, lo=None, hi=None):
    name = str(cx.node.target)
    if name.startswith("aten.clamp_max"):
        lo, hi = None, lo
    for v in (lo, hi):
        if v is not None and not isinstance(v, (int, float)):
            raise Unsupported(name, "tensor bounds")
    return ops.clamp(_to(x, cx.out_dtype()), lo, hi)


@op(aten.maximum.default)
def maximum(cx, a, b):
    shape, dtype = cx.out_shape(), cx.out_dtype()
    return ops.maximum(_lift(cx, a, dtype, shape), _lift(cx, b, dtype, shape))


@op(aten.minimum.default)
def minimum(cx, a, b):
    shape, dtype = cx.out_shape(), cx.out_dtype()
    return ops.minimum(_lift(cx, a, dtype, shape), _lift(cx, b, dtype, shape))


@op(aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar)
def where(cx, cond, a, b):
    shape, dtype = cx.out_shape(), cx.out_dtype()
    return ops.where(_to(cond, DType.BOOL).broadcast_to(shape), _lift(cx, a, dtype, shape),
                     _lift(cx, b, dtype, shape))


@op(aten.masked_fill.Scalar, aten.masked_fill.Tensor)
def masked_fill(cx, x, mask, value):
    shape, dtype = cx.out_shape(), cx.out_dtype()
    return ops.where(_to(mask, DType.BOOL).broadcast_to(shape), _lift(cx, value, dtype, shape), _to(x, dtype))


def _isnan(x: Tensor) -> Tensor:
    """NaN is the one value neither below +inf nor above -inf (every comparison with it is false)."""
    inf = x.graph.constant(math.inf, x.dtype).broadcast_to(x.shape)
    return ops.logical_and(ops.logical_not(x < inf), ops.logical_not(-inf < x))


def _ordered(a: Tensor, b: Tensor) -> Tensor:
    return ops.logical_not(ops.logical_or(_isnan(a), _isnan(b)))


# The op library composes <=, >=, == and != from "<" alone (``not b < a``...), which reads NaN as equal to
# everything: torch's NaN <= x, NaN >= x and NaN == x are false (and NaN != x true), so float comparisons also
# ask that neither operand is NaN (``nan_to_num``, ``x != x`` and masks built from ``==`` depend on it).
def _le(a, b):
    return ops.logical_and(ops.less_equal(a, b), _ordered(a, b)) if a.dtype.is_float else ops.less_equal(a, b)


def _eq(a, b):
    return ops.logical_and(ops.equal(a, b), _ordered(a, b)) if a.dtype.is_float else ops.equal(a, b)


def _compare(fn):
    def entry(cx, a, b):
        shape = cx.out_shape()
        dtype = _promoted(cx, a, b)
        if dtype == DType.BOOL:
            dtype = DType.I32
        return fn(_lift(cx, a, dtype, shape), _lift(cx, b, dtype, shape))
    return entry


for _name, _f in [("lt", ops.less), ("le", _le), ("gt", ops.greater), ("ge", lambda a, b: _le(b, a)),
                  ("eq", _eq), ("ne", lambda a, b: ops.logical_not(_eq(a, b)))]:
    OPS[getattr(aten, _name).Tensor] = OPS[getattr(aten, _name).Scalar] = _compare(_f)


@op(aten.isnan.default)
def isnan(cx, x):
    return _isnan(x) if x.dtype.is_float else cx.g.constant(0, DType.BOOL).broadcast_to(cx.out_shape())


@op(aten.logical_not.default, aten.bitwise_not.default)
def logical_not(cx, x):
    if str(cx.node.target).startswith("aten.bitwise") and x.dtype != DType.BOOL:
        raise Unsupported("aten.bitwise_not.default", "integer operand")
    return ops.logical_not(_to(x, DType.BOOL))


@op(aten.logical_xor.default, aten.bitwise_xor.Tensor)
def logical_xor(cx, a, b):
    name = str(cx.node.target)
    if name.startswith("aten.bitwise") and (a.dtype != DType.BOOL or b.dtype != DType.BOOL):
        raise Unsupported(name, "integer operands")
    shape = cx.out_shape()
    return ops.not_equal(_to(a, DType.BOOL).broadcast_to(shape), _to(b, DType.BOOL).broadcast_to(shape))


@op(aten.logical_and.default, aten.bitwise_and.Tensor, aten.logical_or.default, aten.bitwise_or.Tensor)
def logical_binary(cx, a, b):
    name = str(cx.node.target)
    if name.startswith("aten.bitwise") and (a.dtype != DType.BOOL or b.dtype != DType.BOOL):
        raise Unsupported(name, "integer operands")
    shape = cx.out_shape()
    a, b = _to(a, DType.BOOL).broadcast_to(shape), _to(b, DType.BOOL).broadcast_to(shape)
    return ops.logical_and(a, b) if "and" in name else ops.logical_or(a, b)


@op(aten._to_copy.default)
def to_copy(cx, x, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False, memory_format=None):
    if device is not None and torch.device(device).type != "cpu":
        raise Unsupported("aten._to_copy.default", f"device {device}")
    return _to(x, cx.out_dtype())


@op(torch.ops.prims.convert_element_type.default)
def convert_element_type(cx, x, dtype):
    return _to(x, cx.out_dtype())


@op(aten.clone.default, aten.alias.default, aten.lift_fresh_copy.default, aten.detach.default)
def identity(cx, x, **kw):
    return x


# ---- creation --------------------------------------------------------------------------------------------------
def _check_device(cx, device):
    if device is not None and torch.device(device).type != "cpu":
        raise Unsupported(str(cx.node.target), f"device {device}")


@op(aten.full.default)
def full(cx, size, value, dtype=None, layout=None, device=None, pin_memory=None):
    _check_device(cx, device)
    return cx.g.constant(value, cx.out_dtype()).broadcast_to(cx.out_shape())


@op(aten.full_like.default)
def full_like(cx, x, value, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return cx.g.constant(value, cx.out_dtype()).broadcast_to(cx.out_shape())


@op(aten.empty_permuted.default, aten.empty.memory_format)
def empty(cx, size, *args, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    """Uninitialised memory may hold anything: zeros (``empty_like(x).fill_(v)`` then overwrites them)."""
    _check_device(cx, device)
    return cx.g.constant(0, cx.out_dtype()).broadcast_to(cx.out_shape())


@op(aten.scalar_tensor.default)
def scalar_tensor(cx, value, dtype=None, layout=None, device=None, pin_memory=None):
    return cx.g.constant(value, cx.out_dtype())


@op(aten.arange.start_step, aten.arange.start, aten.arange.default)
def arange(cx, *args, dtype=None, layout=None, device=None, pin_memory=None):
    _check_device(cx, device)
    start, step = (0, 1) if len(args) == 1 else (args[0], args[2] if len(args) > 2 else 1)
    for v in (start, step):
        if not isinstance(v, (int, float)):
            raise Unsupported(str(cx.node.target), "symbolic start or step")
    (n,) = cx.out_shape()
    out_dtype = cx.out_dtype()
    idx = cx.g.iota(n)
    if out_dtype.is_float:
        idx = cast(idx, out_dtype)
    elif out_dtype != DType.I32:
        raise Unsupported(str(cx.node.target), f"dtype {out_dtype}")
    if step != 1:
        idx = idx * step
    if start != 0:
        idx = idx + start
    return idx


# ---- movement --------------------------------------------------------------------------------------------------
@op(aten.view.default, aten._unsafe_view.default, aten.reshape.default)
def view(cx, x, size):
    return x.reshape(cx.out_shape())


@op(aten.permute.default)
def permute(cx, x, dims):
    return x.permute([d % x.ndim for d in dims])


@op(aten.transpose.int)
def transpose(cx, x, a, b):
    return x.transpose(a, b)


@op(aten.t.default)
def t(cx, x):
    return x if x.ndim < 2 else x.transpose(0, 1)


@op(aten.unsqueeze.default)
def unsqueeze(cx, x, dim):
    return x.unsqueeze(dim % (x.ndim + 1))


@op(aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default)
def squeeze(cx, x, dims=None):
    return x.reshape(cx.out_shape())


@op(aten.expand.default)
def expand(cx, x, size, implicit=False):
    return x.broadcast_to(cx.out_shape())


@op(aten.slice.Tensor)
def slice_(cx, x, dim=0, start=None, end=None, step=1):
    """The output's own length (from its meta) fixes the stop: torch clamps ``end`` to the axis."""
    dim = dim % x.ndim
    size = x.shape[dim]
    start = 0 if start is None else as_dim(start)
    n = cx.out_shape()[dim]
    if dims_equal(n, 0):
        raise Unsupported("aten.slice.Tensor", "an empty slice")
    if isinstance(start, int) and start < 0:
        if isinstance(size, int):
            start = max(start + size, 0)
        else:  # torch clamps ``size + start`` at 0 (a KV cache's ``keys[-window:]`` shorter than the window)
            start = _clamped_start(size, end, n, step)
    stop = sym.add(sym.add(start, sym.mul(sym.add(n, -1), step)), 1)
    return x.slice(dim, start, stop, step)


def _clamped_start(size, end, n, step):
    """Where a slice with a negative start begins on a symbolic axis: ``max(size + start, 0)``, which the graph's
    dims cannot say, read back from the output's length ``n`` (Dynamo's meta has the clamp, under its guards) and
    the stop: ``stop - n`` for a unit step."""
    if step != 1:
        raise Unsupported("aten.slice.Tensor", "a negative start and a step on a symbolic axis")
    if end is None or (isinstance(end, int) and end >= 2**62):  # to the end (torch's INT64_MAX sentinel)
        stop = size
    elif isinstance(end, int) and end < 0:
        stop = sym.add(size, end)
    else:  # a stop that may lie past the axis: min(end, size) is not a dim either
        raise Unsupported("aten.slice.Tensor", "a negative start and a non-negative stop on a symbolic axis")
    return sym.add(stop, sym.mul(n, -1))


@op(aten.select.int)
def select(cx, x, dim, index):
    dim = dim % x.ndim
    if isinstance(index, int) and index < 0:
        index = sym.add(x.shape[dim], index)
    return x.slice(dim, index, sym.add(index, 1)).reshape(cx.out_shape())


@op(aten.cat.default)
def cat(cx, tensors, dim=0):
    dtype = cx.out_dtype()
    shape = cx.out_shape()
    dim = dim % len(shape)
    parts = [_to(t, dtype) for t in tensors if not (t.ndim == 1 and dims_equal(t.shape[0], 0) and len(shape) > 1)]
    parts = [t for t in parts if not dims_equal(t.shape[dim], 0)]
    return ops.concat(parts, dim)


@op(aten.split.Tensor, aten.split_with_sizes.default)
def split(cx, x, sizes, dim=0):
    dim = dim % x.ndim
    return tuple(ops.split(x, [as_dim(v.shape[dim]) for v in cx.val()], dim))


@op(aten.unbind.int)
def unbind(cx, x, dim=0):
    dim = dim % x.ndim
    return tuple(x.slice(dim, i, i + 1).squeeze(dim) for i in range(int(x.shape[dim])))


@op(aten.constant_pad_nd.default)
def constant_pad_nd(cx, x, pad, value=0):
    if value != 0:
        raise Unsupported("aten.constant_pad_nd.default", f"fill value {value} (zero padding is translated)")
    for i in range(len(pad) // 2):
        before, after = pad[2 * i], pad[2 * i + 1]
        if (isinstance(before, int) and before < 0) or (isinstance(after, int) and after < 0):
            raise Unsupported("aten.constant_pad_nd.default", "negative padding")
        x = x.pad(x.ndim - 1 - i, before, after)
    return x


@op(aten.repeat.default)
def repeat(cx, x, reps):
    lead = len(reps) - x.ndim
    for _ in range(lead):
        x = x.unsqueeze(0)
    for axis in range(len(reps) - 1, -1, -1):
        r = reps[axis]
        if r != 1:
            x = x.expand(axis, r).merge_dims(axis, axis + 1)
    return x.reshape(cx.out_shape())


@op(aten.flip.default)
def flip(cx, x, dims):
    for d in dims:
        x = x.flip(d % x.ndim)
    return x


# ---- reductions ------------------------------------------------------------------------------------------------
@op(aten.sum.dim_IntList, aten.sum.default)
def sum_(cx, x, dims=None, keepdim=False, dtype=None):
    out = cx.out_dtype()
    return ops.sum(_to(x, out), _axes(x, dims), keepdim)


@op(aten.mean.dim, aten.mean.default)
def mean(cx, x, dims=None, keepdim=False, dtype=None):
    return ops.mean(_to(x, cx.out_dtype()), _axes(x, dims), keepdim)


@op(aten.amax.default)
def amax(cx, x, dims=(), keepdim=False):
    return ops.max(x, _axes(x, dims), keepdim)


@op(aten.amin.default)
def amin(cx, x, dims=(), keepdim=False):
    return ops.min(x, _axes(x, dims), keepdim)


@op(aten.linalg_vector_norm.default)
def vector_norm(cx, x, ord=2, dim=None, keepdim=False, dtype=None):
    """``(sum |x|^ord)^(1/ord)`` for ord 1 and 2 (``F.normalize``, ``x.norm(dim=...)``), the max for inf."""
    x = _to(x, cx.out_dtype())
    axes = _axes(x, dim)
    if ord == 2:
        return ops.sqrt(ops.sum(x * x, axes, keepdim))
    if ord == 1:
        return ops.sum(ops.abs(x), axes, keepdim)
    if ord == math.inf:
        return ops.max(ops.abs(x), axes, keepdim)
    raise Unsupported("aten.linalg_vector_norm.default", f"ord={ord} (1, 2 and inf are translated)")


@op(aten.var.correction)
def var(cx, x, dims=None, correction=None, keepdim=False):
    c = 1 if correction is None else correction
    return ops.var(_to(x, cx.out_dtype()), _axes(x, dims), keepdim, int(c))


@op(aten.any.dim, aten.any.dims, aten.any.default)
def any_(cx, x, dims=None, keepdim=False):
    out = ops.max(_to(x, DType.I32), _axes(x, dims), keepdim)
    return _to(out, DType.BOOL).reshape(cx.out_shape())


@op(aten.all.dim, aten.all.dims, aten.all.default)
def all_(cx, x, dims=None, keepdim=False):
    out = ops.min(_to(x, DType.I32), _axes(x, dims), keepdim)
    return _to(out, DType.BOOL).reshape(cx.out_shape())


def _argmax(x: Tensor, dim: int) -> Tensor:
    """torch's argmax: the first maximum, where a NaN counts as the maximum (the first NaN wins). ``ops.argmax``
    matches the maximum by equality, which no element meets when the maximum is NaN."""
    if not x.dtype.is_float:
        return ops.argmax(_to(x, DType.I32), dim)
    nan = _isnan(x)
    first_nan = ops.argmax(_to(nan, DType.I32), dim)
    clean = ops.argmax(ops.where(nan, -math.inf, x), dim)
    return ops.where(_to(ops.max(_to(nan, DType.I32), [dim % x.ndim]), DType.BOOL), first_nan, clean)


@op(aten.argmax.default, aten.argmin.default)
def argmax(cx, x, dim=None, keepdim=False):
    name = str(cx.node.target)
    if dim is None:
        x, dim = x.reshape(-1) if all(isinstance(d, int) for d in x.shape) else None, 0
        if x is None:
            raise Unsupported(name, "flattened argmax of a symbolic shape")
    if "argmin" in name:
        x = -x if x.dtype.is_float else -_to(x, DType.I32)  # the first minimum (NaN first, as torch)
    return _argmax(x, dim).reshape(cx.out_shape())


@op(aten.max.dim, aten.min.dim)
def max_dim(cx, x, dim, keepdim=False):
    """``(values, indices)`` along ``dim``: the maximum (NaN if any, as torch) and the first index holding it."""
    low = "min" in str(cx.node.target)
    y = x if x.dtype.is_float else _to(x, DType.I32)  # bool and u8 reduce as i32
    y = -y if low else y
    values = ops.max(y, [dim % x.ndim], keepdim)
    values = _to(-values if low else values, x.dtype)
    return values.reshape(cx.out_shape(0)), _argmax(y, dim).reshape(cx.out_shape(1))


@op(aten.cumsum.default)
def cumsum(cx, x, dim, dtype=None):
    """A prefix sum in log2(n) steps (Hillis-Steele: add the sum so far shifted by 1, 2, 4... positions, zeros
    shifted in): exact on integers (transformers' packed-sequence check runs ``cumsum`` over position ids); on floats
    each output is a sum of its prefix in another order than torch's sequential one (log2(n) roundings deep)."""
    x = _to(x, cx.out_dtype())
    if x.ndim == 0:
        return x
    dim = dim % x.ndim
    n = x.shape[dim]
    if not isinstance(n, int):
        raise Unsupported("aten.cumsum.default", "a symbolic length (the number of steps depends on it)")
    k = 1
    while k < n:
        x = x + x.slice(dim, 0, n - k).pad(dim, k, 0)
        k *= 2
    return x


# ---- linear algebra --------------------------------------------------------------------------------------------
@op(aten.mm.default, aten.bmm.default)
def mm(cx, a, b):
    return ops.matmul(a, b)


@op(aten.addmm.default)
def addmm(cx, bias, a, b, beta=1, alpha=1):
    out = ops.matmul(a, b)
    if alpha != 1:
        out = out * alpha
    bias = _to(bias, out.dtype).broadcast_to(out.shape)
    return out + (bias if beta == 1 else bias * beta)


@op(aten.baddbmm.default)
def baddbmm(cx, bias, a, b, beta=1, alpha=1):
    return addmm(cx, bias, a, b, beta, alpha)


# ---- neural-network layers -------------------------------------------------------------------------------------
@op(aten._softmax.default, aten.softmax.int)
def softmax(cx, x, dim, half_to_float=False, dtype=None):
    return ops.softmax(_to(x, cx.out_dtype()), dim)


@op(aten._log_softmax.default, aten.log_softmax.int)
def log_softmax(cx, x, dim, half_to_float=False, dtype=None):
    return ops.log_softmax(_to(x, cx.out_dtype()), dim)


@op(aten.native_layer_norm.default)
def native_layer_norm(cx, x, normalized_shape, weight, bias, eps):
    return ops.layer_norm(x, weight, bias, eps, axes=len(normalized_shape)), None, None


@op(aten.rms_norm.default, aten._fused_rms_norm.default)
def rms_norm(cx, x, normalized_shape, weight=None, eps=None):
    if len(normalized_shape) != 1:
        raise Unsupported(str(cx.node.target), "normalisation over several axes")
    if eps is None:
        eps = float(torch.finfo(cx.val()[0].dtype if isinstance(cx.val(), tuple) else cx.val().dtype).eps)
    out = ops.rms_norm(x, weight, eps)
    return (out, None) if str(cx.node.target).startswith("aten._fused") else out


@op(aten.native_group_norm.default)
def native_group_norm(cx, x, weight, bias, n, c, hw, groups, eps):
    return ops.group_norm(x, groups, weight, bias, eps), None, None


@op(aten._native_batch_norm_legit_no_training.default)
def batch_norm(cx, x, weight, bias, running_mean, running_var, momentum, eps):
    c = x.shape[1]
    per_channel = (1, c) + (1,) * (x.ndim - 2)
    inv = ops.rsqrt(_to(running_var, x.dtype) + eps)
    scale = inv if weight is None else inv * _to(weight, x.dtype)
    y = (x - _to(running_mean, x.dtype).reshape(per_channel).broadcast_to(x.shape)) \
        * scale.reshape(per_channel).broadcast_to(x.shape)
    if bias is not None:
        y = y + _to(bias, x.dtype).reshape(per_channel).broadcast_to(x.shape)
    return y, None, None


@op(aten.convolution.default)
def convolution(cx, x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    if transposed or x.ndim not in (3, 4):
        raise Unsupported("aten.convolution.default", f"{'transposed ' if transposed else ''}rank {x.ndim} (1-D "
                          f"and 2-D, not transposed, are translated)")
    if x.ndim == 3:  # a 1-D convolution is a 2-D one over a height of 1 (Whisper's and Wav2Vec2's front ends)
        out = convolution(cx, x.unsqueeze(2), weight.unsqueeze(2), bias, (1, stride[0]), (0, padding[0]),
                          (1, dilation[0]), False, (0, 0), groups)
        return out.squeeze(2)
    if groups == 1 and all(d == 1 for d in dilation):
        return ops.conv2d(x, weight, bias, tuple(stride), tuple(padding))
    return _grouped_conv2d(x, weight, bias, tuple(stride), tuple(padding), tuple(dilation), groups)


def _grouped_conv2d(x, weight, bias, stride, padding, dilation, groups) -> Tensor:
    """Grouped and dilated convolutions (depthwise ones in MobileNets, Wav2Vec2's positional one): the windows
    as one strided view ``[N, G, C/G, kh, kw, Ho, Wo]`` (dilation is the kernel axes' stride), a batched matmul per
    group with the weight ``[G, O/G, C/G * kh * kw]``."""
    from ..graph import View

    n, c, h, w = x.shape
    o, cg, kh, kw = weight.shape
    (sh, sw), (ph, pw), (dh, dw) = stride, padding, dilation
    if not all(isinstance(d, int) for d in (c, h, w)):  # a symbolic batch is fine
        raise Unsupported("aten.convolution.default", "a grouped or dilated convolution of a symbolic size")
    if ph or pw:
        x = x.pad(2, ph, ph).pad(3, pw, pw)
    x = x.contiguous()
    hp, wp = h + 2 * ph, w + 2 * pw
    ho, wo = (hp - dh * (kh - 1) - 1) // sh + 1, (wp - dw * (kw - 1) - 1) // sw + 1
    st = x.view.strides
    view = View((n, groups, cg, kh, kw, ho, wo),
                (st[0], st[1] * cg, st[1], st[2] * dh, st[3] * dw, st[2] * sh, st[3] * sw), x.view.offset)
    cols = x._with_view(view).contiguous().reshape(n, groups, cg * kh * kw, ho * wo)
    w2 = _to(weight, x.dtype).reshape(groups, o // groups, cg * kh * kw).unsqueeze(0)
    out = ops.matmul(w2.broadcast_to((n, groups, o // groups, cg * kh * kw)), cols).reshape(n, o, ho, wo)
    if bias is not None:
        out = out + _to(bias, x.dtype).reshape(1, o, 1, 1).broadcast_to(out.shape)
    return out


@op(aten.max_pool2d_with_indices.default)
def max_pool2d(cx, x, kernel, stride=(), padding=0, dilation=1, ceil_mode=False):
    kh, kw = (kernel * 2)[:2] if len(kernel) == 1 else kernel
    stride = stride or (kh, kw)
    sh, sw = (stride * 2)[:2] if len(stride) == 1 else stride
    padding = padding if isinstance(padding, (list, tuple)) else [padding]
    ph, pw = (padding * 2)[:2] if len(padding) == 1 else padding
    dilation = dilation if isinstance(dilation, (list, tuple)) else [dilation]
    if ceil_mode or any(d != 1 for d in dilation):
        raise Unsupported("aten.max_pool2d_with_indices.default", "ceil_mode or dilation")
    n, c, h, w = cx.out_shape(0)
    if ph or pw:  # padded positions read -inf (the lowest integer), which a max never picks
        low = -math.inf if x.dtype.is_float else -(2**31)
        inside = _to(cx.g.constant(1, DType.I32).broadcast_to(x.shape).pad(2, ph, ph).pad(3, pw, pw), DType.BOOL)
        x = ops.where(inside, x.pad(2, ph, ph).pad(3, pw, pw), low)
    out = None
    for i in range(kh):
        for j in range(kw):
            win = x.slice(2, i, i + (h - 1) * sh + 1, sh).slice(3, j, j + (w - 1) * sw + 1, sw)
            out = win if out is None else ops.maximum(out, win)
    return out, None


@op(aten.avg_pool2d.default)
def avg_pool2d(cx, x, kernel, stride=(), padding=0, ceil_mode=False, count_include_pad=True, divisor=None):
    kh, kw = (kernel * 2)[:2] if len(kernel) == 1 else kernel
    stride = stride or (kh, kw)
    sh, sw = (stride * 2)[:2] if len(stride) == 1 else stride
    padding = padding if isinstance(padding, (list, tuple)) else [padding]
    ph, pw = (list(padding) * 2)[:2] if len(padding) == 1 else padding
    if (ph or pw) and not count_include_pad or ceil_mode or divisor is not None:
        raise Unsupported("aten.avg_pool2d.default", "count_include_pad=False, ceil_mode or divisor_override")
    if ph or pw:  # padded zeros count in the mean (materialised: strided windows cannot read a padded view)
        x = x.pad(2, ph, ph).pad(3, pw, pw).contiguous()
    n, c, h, w = cx.out_shape()
    out = None
    for i in range(kh):
        for j in range(kw):
            win = x.slice(2, i, i + (h - 1) * sh + 1, sh).slice(3, j, j + (w - 1) * sw + 1, sw)
            out = win if out is None else out + win
    return out * (1.0 / (kh * kw))


@op(aten.upsample_nearest2d.default, aten.upsample_nearest2d.vec)
def upsample_nearest2d(cx, x, *args, **kw):
    n, c, h, w = x.shape
    oh, ow = cx.out_shape()[2:]
    if not (isinstance(h, int) and isinstance(oh, int) and oh % h == 0 and ow % w == 0):
        raise Unsupported(str(cx.node.target), "non-integer or symbolic scale")
    fh, fw = oh // h, ow // w
    return x.expand(3, fh).expand(5, fw).reshape(n, c, oh, ow)


@op(aten.embedding.default)
def embedding(cx, table, ids, padding_idx=-1, scale_grad=False, sparse=False):
    return ops.embedding(ids, table)


@op(aten.index_select.default)
def index_select(cx, x, dim, index):
    dim = dim % x.ndim
    perm = [dim] + [i for i in range(x.ndim) if i != dim]
    rows = gather(x.permute(perm), _to(index, DType.I32))
    back = list(range(1, dim + 1)) + [0] + list(range(dim + 1, x.ndim))
    return rows.permute(back)


@op(aten.index.Tensor)
def index(cx, x, indices):
    """``x[i0, i1, ...]`` with integer index tensors (``None`` for an axis taken whole): the indexed axes are
    flattened into one and read by one Gather at the broadcast indices (negative ones wrapped), as numpy's
    advanced indexing places them (where the indexed axes were when they are adjacent, else first)."""
    given = [i for i, t in enumerate(indices) if t is not None]
    if any(indices[i].dtype == DType.BOOL for i in given):
        raise Unsupported("aten.index.Tensor", "a boolean mask (its result's shape depends on the values)")
    sizes = [x.shape[i] for i in given]
    if not all(isinstance(n, int) for n in sizes):
        # index values made from one symbol (an ``arange`` over the KV length) may read an axis sized by another
        # that equals it only at run time (the mask's length): the plan's timing runs bind each symbol to its own
        # size bucket, and the Gather would read past the table there
        raise Unsupported("aten.index.Tensor", "indexing a symbolic axis")
    out_shape = cx.out_shape()
    adjacent = given == list(range(given[0], given[-1] + 1))
    rest = [i for i in range(x.ndim) if i not in given]
    nb = len(out_shape) - len(rest)  # the broadcast index shape's rank
    bshape = out_shape[given[0]:given[0] + nb] if adjacent else out_shape[:nb]
    flat = None
    for axis, n in zip(given, sizes):
        idx = _to(indices[axis], DType.I32)
        idx = idx + _to(idx < 0, DType.I32) * _dim_value(cx, n, idx.shape)  # negative indices count from the end
        idx = idx.broadcast_to(bshape)
        flat = idx if flat is None else flat * _dim_value(cx, n, bshape) + idx
    table = x.permute(given + rest)
    total = 1
    for n in sizes:
        total *= n
    table = table.reshape((total,) + tuple(table.shape[len(given):]))
    rows = gather(table, flat)  # [*bshape, *rest axes]
    if adjacent and given[0] > 0:  # the indexed block goes back where its axes were
        k = given[0]
        perm = list(range(nb, nb + k)) + list(range(nb)) + list(range(nb + k, rows.ndim))
        rows = rows.permute(perm)
    return rows


@op(aten.gather.default)
def gather_(cx, x, dim, index, sparse_grad=False):
    """``torch.gather``: ``out[..., j, ...] = x[..., index[..., j, ...], ...]`` along ``dim``, every other axis at
    the output's own position. One Gather over ``x`` flattened, at the flat offsets of those coordinates."""
    if x.ndim == 0:
        return x
    dim = dim % x.ndim
    shape = cx.out_shape()
    n = x.shape[dim]
    idx = _to(index, DType.I32)
    if not all(isinstance(d, int) for d in x.shape):  # as for aten.index.Tensor
        raise Unsupported("aten.gather.default", "gathering from a tensor of a symbolic shape")
    flat, stride = None, 1
    for axis in range(x.ndim - 1, -1, -1):
        if axis == dim:
            coord = idx + _to(idx < 0, DType.I32) * _dim_value(cx, n, shape)  # negative ones count from the end
        else:
            ones = [1] * x.ndim
            ones[axis] = shape[axis]
            coord = cx.g.iota(shape[axis]).reshape(ones).broadcast_to(shape)
        term = coord if isinstance(stride, int) and stride == 1 else coord * _dim_value(cx, stride, shape)
        flat = term if flat is None else flat + term
        stride = sym.mul(stride, x.shape[axis])
    return gather(x.reshape((stride,)), flat)


@op(aten.index_put.default, aten._unsafe_index_put.default)
def index_put(cx, x, indices, values, accumulate=False):
    """``x`` with ``x[i0, i1, ...] = values`` (the functional form AOTAutograd makes of ``index_put_`` and
    ``x[..., idx, :] = v``). Negative indices count from the end, as torch's."""
    return _put_rows(cx, x, indices, values, accumulate, wrap=True)


@op(aten.index_copy.default)
def index_copy(cx, x, dim, index, source):
    """``x.index_copy(dim, index, source)`` (transformers' StaticCache update, ``keys.index_copy_(2, positions,
    k)``), kept whole (``KEEP``): torch refuses a negative index here, where ``index_put`` wraps it (the core
    decomposition would turn it into one), so a negative index raises as an out of range one."""
    if index.ndim != 1:
        raise Unsupported(str(cx.node.target), "a 0-dim index")
    dim = dim % max(x.ndim, 1)
    return _put_rows(cx, x, [None] * dim + [index], source, False, wrap=False)


def _put_rows(cx, x, indices, values, accumulate, wrap: bool):
    """The AOTAutograd functional form of an in-place row write: a static KV cache's update. The axes before the
    indexed block and the indexed block are flattened into rows, ``x`` as ``[rows, after...]`` (a view where
    ``x`` is contiguous), and one Scatter writes the broadcast ``values``' rows at the indices' flat row numbers.
    An index out of range (or negative, unless ``wrap``) makes the flat row -1, which the Scatter kernels refuse
    (torch raises too), so it never writes a row of another axis. Repeated indices: torch leaves which value
    lands undefined; here one of them does (the last, on the CPU runtimes)."""
    name = str(cx.node.target)
    if accumulate:
        raise Unsupported(name, "accumulate=True (a scatter-add: the HLIR's Scatter replaces rows)")
    given = [i for i, t in enumerate(indices) if t is not None]
    if not given:
        raise Unsupported(name, "no index tensor")
    if any(indices[i].dtype == DType.BOOL for i in given):
        raise Unsupported(name, "a boolean mask")
    if given != list(range(given[0], given[-1] + 1)):
        raise Unsupported(name, "index tensors on axes that are not adjacent")
    if x.ndim == 0 or not all(isinstance(d, int) for d in x.shape[:given[-1] + 1]):
        # the flat row numbers are computed with the axes' sizes as constants
        raise Unsupported(name, "a symbolic axis before or among the indexed ones")
    first, last = given[0], given[-1] + 1
    before, sizes, after = x.shape[:first], x.shape[first:last], x.shape[last:]
    # the broadcast index shape: torch's indexed block is before + bshape + after
    bshape = _broadcast_shapes([indices[i].shape for i in given])
    block = tuple(before) + tuple(bshape) + tuple(after)
    lead = tuple(before) + tuple(bshape)
    flat, ok = None, None
    for axis in given:
        n = x.shape[axis]
        idx = _to(indices[axis], DType.I32).broadcast_to(bshape)
        if wrap:
            idx = idx + _to(idx < 0, DType.I32) * _dim_value(cx, n, bshape)  # negative ones count from the end
        inside = ops.logical_and(ops.greater_equal(idx, 0), ops.less(idx, n))
        ok = inside if ok is None else ops.logical_and(ok, inside)
        flat = idx if flat is None else flat * _dim_value(cx, n, bshape) + idx
    count = math.prod(sizes)
    if before:  # each row of the axes before the block is its own run of ``count`` rows
        ones = (1,) * len(bshape)
        flat = flat.broadcast_to(lead)
        for axis, n in enumerate(before):
            shape = [1] * len(before)
            shape[axis] = n
            stride = math.prod(before[axis + 1:]) * count
            if n > 1:
                flat = flat + (cx.g.iota(n).reshape(tuple(shape) + ones) * stride).broadcast_to(lead)
        ok = ok.broadcast_to(lead)
    flat = ops.where(ok, flat, -1).reshape(-1)  # out of range: a row the Scatter refuses
    rows = _to(values, x.dtype).broadcast_to(block)
    rows = rows.reshape((flat.shape[0],) + tuple(after))
    dest = x.reshape((math.prod(before) * count,) + tuple(after))
    return scatter(dest, flat, rows).reshape(x.shape)


def _broadcast_shapes(shapes) -> tuple:
    """numpy's broadcast of index shapes (sizes of 1 stretch; equal sizes otherwise)."""
    rank = max(len(s) for s in shapes)
    out = []
    for axis in range(rank):
        size = 1
        for s in shapes:
            d = s[axis - rank + len(s)] if axis - rank + len(s) >= 0 else 1
            if not dims_equal(d, 1):
                size = d
        out.append(size)
    return tuple(out)


def _dim_value(cx, d: int, shape) -> Tensor:
    return cx.g.constant(d, DType.I32).broadcast_to(shape)


def _same_length(x: Tensor, t) -> Tensor:
    """``x`` with its key axis named ``t``: Dynamo gives a KV cache's k and v lengths separate symbols, which
    eager SDPA requires to be equal at run time (the executable binds both from their own inputs)."""
    if dims_equal(x.shape[2], t) or isinstance(x.shape[2], int) and isinstance(t, int):
        return x
    from ..graph import View

    view = x.view
    if view.mask is not None:
        raise Unsupported("attention", f"k/v lengths {x.shape[2]} and {t} of a padded view")
    shape = view.shape[:2] + (t,) + view.shape[3:]
    return x._with_view(View(shape, view.strides, view.offset, view.mask))


def _sdpa(cx, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    if dropout_p:
        raise Unsupported(str(cx.node.target), "dropout")
    if q.ndim != 4:
        raise Unsupported(str(cx.node.target), f"rank {q.ndim} (4-D q, k, v are translated)")
    s, t = q.shape[2], k.shape[2]
    k, v = _same_length(k, t), _same_length(v, t)
    mask = attn_mask
    if is_causal:  # torch's causal mask is top-left aligned (query i sees keys 0..i), whatever S and T
        qpos = cx.g.iota(s).expand(1, t)
        kpos = cx.g.iota(t).expand(0, s)
        allowed = ops.logical_not(qpos < kpos).unsqueeze(0).unsqueeze(0)
        if mask is None:
            mask = allowed
        elif mask.dtype == DType.BOOL:
            shape = tuple(mask.shape[:2]) + (s, t)
            mask = ops.logical_and(mask.broadcast_to(shape), allowed.broadcast_to(shape))
        else:
            mask = ops.where(allowed.broadcast_to(mask.shape[:2] + (s, t)), _to(mask, q.dtype).broadcast_to(
                mask.shape[:2] + (s, t)), -math.inf)
    seen = None
    if mask is not None:
        while mask.ndim < 4:
            mask = mask.unsqueeze(0)
        if mask.dtype != DType.BOOL:
            mask = _to(mask, q.dtype)
        if attn_mask is not None:  # does each query see any key (torch's causal mask always shows key 0)
            allowed = mask if mask.dtype == DType.BOOL else -math.inf < mask
            seen = _to(ops.max(_to(allowed, DType.I32), [3], True), DType.BOOL)
    out = ops.scaled_dot_product_attention(q, k, v, mask=mask, scale=scale)
    if seen is not None:
        # a query whose keys are all masked (left padding in a batch) gets zeros, as torch's SDPA gives it; the
        # composition's softmax over no key is NaN there, which later layers would read through masked keys
        # (0 * NaN) into every row of that sequence
        out = ops.where(seen.broadcast_to(out.shape[:3] + (1,)).broadcast_to(out.shape), out, 0.0)
    return _to(out, cx.out_dtype(0) if isinstance(cx.val(), (tuple, list)) else cx.out_dtype())


@op(aten.scaled_dot_product_attention.default)
def sdpa(cx, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return _sdpa(cx, q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)


@op(aten._scaled_dot_product_flash_attention_for_cpu.default)
def sdpa_flash_cpu(cx, q, k, v, dropout_p=0.0, is_causal=False, attn_mask=None, scale=None):
    return _sdpa(cx, q, k, v, attn_mask, dropout_p, is_causal, scale), None


@op(aten._scaled_dot_product_attention_math.default)
def sdpa_math(cx, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, dropout_mask=None, scale=None,
              enable_gqa=False):
    if dropout_mask is not None:
        raise Unsupported("aten._scaled_dot_product_attention_math.default", "dropout mask")
    return _sdpa(cx, q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa), None


# ops the decompositions must leave whole, so the table above translates them with the op library's compositions
KEEP = (aten.scaled_dot_product_attention.default, aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten._scaled_dot_product_attention_math.default, aten.rms_norm.default, aten._fused_rms_norm.default,
        aten.silu.default, aten.gelu.default, aten.upsample_nearest2d.default, aten.upsample_nearest2d.vec,
        aten.index_copy.default)
