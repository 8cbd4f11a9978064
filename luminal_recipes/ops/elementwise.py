"""Elementwise math composed from the primitives (Exp2, Log2, Sin, Sqrt, Recip, Add, Mul, Mod, LessThan, Cast).

Scalars are lifted to explicit broadcast constants; tensor operands must already have equal shapes.
"""

from __future__ import annotations

import math

from ..errors import DTypeError, GraphError
from ..graph import DType, Tensor, cast, unary
from ..graph.symbolic import shape_str
from .shape import stack

LOG2_E = 1.0 / math.log(2.0)
LN_2 = math.log(2.0)


def _f(x: Tensor, value: float) -> Tensor:
    return x.graph.constant(value, x.dtype).broadcast_to(x.shape)


def exp(x: Tensor) -> Tensor:
    return unary("Exp2", x * LOG2_E)


def exp2(x: Tensor) -> Tensor:
    return unary("Exp2", x)


def log(x: Tensor) -> Tensor:
    return unary("Log2", x) * LN_2


def log2(x: Tensor) -> Tensor:
    return unary("Log2", x)


def sqrt(x: Tensor) -> Tensor:
    return unary("Sqrt", x)


def recip(x: Tensor) -> Tensor:
    return unary("Recip", x)


def rsqrt(x: Tensor) -> Tensor:
    return unary("Recip", unary("Sqrt", x))


def sin(x: Tensor) -> Tensor:
    return unary("Sin", x)


def cos(x: Tensor) -> Tensor:
    """cos(x) = 1 - 2 sin(x/2)^2: exact halving, so no rounding of a shifted argument (sin(x + pi/2) loses
    ~ulp(x) of phase for large x, e.g. 3e-5 at x = 1000 in f32)."""
    h = unary("Sin", x * 0.5)
    return 1.0 - h * h * 2.0


def square(x: Tensor) -> Tensor:
    return x * x


def pow(x: Tensor, p: float) -> Tensor:  # noqa: A001 - the op's conventional name
    """``x ** p``; small integer powers are exact repeated products, others use exp2(p*log2(x)) (x > 0)."""
    if float(p).is_integer() and 0 <= p <= 8:
        if p == 0:
            return _f(x, 1.0)
        out = x
        for _ in range(int(p) - 1):
            out = out * x
        return out
    return unary("Exp2", unary("Log2", x) * float(p))


def sigmoid(x: Tensor) -> Tensor:
    return unary("Recip", exp(-x) + 1.0)


def tanh(x: Tensor) -> Tensor:
    return sigmoid(x * 2.0) * 2.0 - 1.0


def silu(x: Tensor) -> Tensor:
    return x * sigmoid(x)


def relu(x: Tensor) -> Tensor:
    return maximum(x, _f(x, 0.0))


def erf(x: Tensor) -> Tensor:
    """Abramowitz & Stegun 7.1.26 (|error| <= 1.5e-7), built from primitives."""
    a1, a2, a3, a4, a5, p = 0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429, 0.3275911
    s = sign(x)
    ax = x * s
    t = unary("Recip", ax * p + 1.0)
    poly = ((((t * a5 + a4) * t + a3) * t + a2) * t + a1) * t
    return s * (1.0 - poly * exp(-(ax * ax)))


def gelu(x: Tensor, approximate: str = "none") -> Tensor:
    """GELU: ``approximate="none"`` is the exact erf form, ``"tanh"`` the tanh approximation (as torch)."""
    if approximate == "tanh":
        inner = (x + x * x * x * 0.044715) * math.sqrt(2.0 / math.pi)
        return x * 0.5 * (tanh(inner) + 1.0)
    if approximate != "none":
        raise GraphError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    return x * 0.5 * (erf(x * (1.0 / math.sqrt(2.0))) + 1.0)


# ---- comparisons and selection ----------------------------------------------------------------------------------
def _lift(x: Tensor, y) -> Tensor:
    return y if isinstance(y, Tensor) else _f(x, float(y)) if x.dtype.is_float else \
        x.graph.constant(int(y), x.dtype).broadcast_to(x.shape)


def less(x: Tensor, y) -> Tensor:
    return x < _lift(x, y)


def greater(x: Tensor, y) -> Tensor:
    return _lift(x, y) < x


def logical_not(b: Tensor) -> Tensor:
    return cast(b, DType.I32) < 1


def logical_and(a: Tensor, b: Tensor) -> Tensor:
    return cast(cast(a, DType.I32) * cast(b, DType.I32), DType.BOOL)


def logical_or(a: Tensor, b: Tensor) -> Tensor:
    return cast(cast(a, DType.I32) + cast(b, DType.I32), DType.BOOL)


def less_equal(x: Tensor, y) -> Tensor:
    return logical_not(greater(x, y))


def greater_equal(x: Tensor, y) -> Tensor:
    return logical_not(less(x, y))


def equal(x: Tensor, y) -> Tensor:
    return logical_and(logical_not(less(x, y)), logical_not(greater(x, y)))


def not_equal(x: Tensor, y) -> Tensor:
    return logical_not(equal(x, y))


def sign(x: Tensor) -> Tensor:
    """-1, 0 or +1 (in x's dtype)."""
    zero = _f(x, 0.0) if x.dtype.is_float else x.graph.constant(0, x.dtype).broadcast_to(x.shape)
    return cast(zero < x, x.dtype) - cast(x < zero, x.dtype)


def abs(x: Tensor) -> Tensor:  # noqa: A001
    return x * sign(x)


def maximum(a: Tensor, b: Tensor) -> Tensor:
    """Exact elementwise max (also with infinities): stack the operands on a new axis and MaxReduce it."""
    from ..graph import reduce

    return reduce("MaxReduce", stack([a, _lift(a, b)], axis=-1), -1)


def minimum(a: Tensor, b: Tensor) -> Tensor:
    return -maximum(-a, -_lift(a, b))


def clamp(x: Tensor, lo: float | None = None, hi: float | None = None) -> Tensor:
    if lo is not None:
        x = maximum(x, _f(x, lo))
    if hi is not None:
        x = minimum(x, _f(x, hi))
    return x


def where(cond: Tensor, a, b) -> Tensor:
    """``a`` where ``cond`` else ``b``, exactly (infinities in the other branch are harmless).

    Built as a Gather: both branches are stacked on a trailing axis and each element picks its branch by index.
    """
    from ..graph import gather

    ref = a if isinstance(a, Tensor) else b
    if not isinstance(ref, Tensor):
        raise GraphError("where: at least one branch must be a Tensor (the other may be a Python number)")
    a, b = _lift(ref, a), _lift(ref, b)
    if cond.dtype != DType.BOOL:
        raise DTypeError(f"where: condition {shape_str(cond.shape)} must be bool, got {cond.dtype}; compare "
                         f"first, e.g. greater(x, 0), or cast with .cast('bool')")
    if len(cond.shape) != len(a.shape) or any(str(x) != str(y) for x, y in zip(cond.shape, a.shape)):
        cond = cond.broadcast_to(a.shape)
    pair = stack([b, a], axis=-1).reshape(-1)  # element 2i is b_i, 2i+1 is a_i
    index = a.graph.iota(a.numel) * 2 + cast(cond, DType.I32).reshape(-1)
    return gather(pair, index).reshape(a.shape)


def swiglu(x: Tensor) -> Tensor:
    """SwiGLU with the gate fused into the projection: ``silu(first half) * second half`` of the last axis."""
    d = x.shape[-1]
    return silu(x.slice(-1, 0, d // 2)) * x.slice(-1, d // 2, d)


def modulate(x: Tensor, scale: Tensor, shift: Tensor) -> Tensor:
    """adaLN modulation ``x * (1 + scale) + shift``, the vectors broadcast explicitly to x's shape (DiT, FLUX)."""
    return x * (scale + 1.0).broadcast_to(x.shape) + shift.broadcast_to(x.shape)
