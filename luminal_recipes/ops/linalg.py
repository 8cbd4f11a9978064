"""Matrix products as broadcast Mul + SumReduce (the pattern compiler rules turn into BLAS matmuls)."""

from __future__ import annotations

from ..errors import DTypeError, ShapeError
from ..graph import Tensor, cast, reduce
from ..graph.symbolic import dims_equal, shape_str


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` for ``a [..., M, K]`` and ``b [..., K, N]``; batch axes broadcast explicitly as in torch.

    Transposed operands are just permuted views (``x.T``), so all four layouts share this one pattern.
    """
    if a.ndim < 1 or b.ndim < 1:
        raise ShapeError("matmul: operands need at least one axis")
    squeeze_a = a.ndim == 1
    squeeze_b = b.ndim == 1
    if squeeze_a:
        a = a.unsqueeze(0)
    if squeeze_b:
        b = b.unsqueeze(1)
    if not dims_equal(a.shape[-1], b.shape[-2]):
        raise ShapeError(
            f"matmul: inner dimensions differ: {shape_str(a.shape)} @ {shape_str(b.shape)} "
            f"({a.shape[-1]} != {b.shape[-2]}); transpose an operand (x.T) if it is stored [N, K]"
        )
    if a.dtype != b.dtype:
        raise DTypeError(f"matmul: operand dtypes differ ({shape_str(a.shape)} {a.dtype} @ "
                         f"{shape_str(b.shape)} {b.dtype}); HLIR never promotes implicitly: cast one operand, "
                         f"e.g. b.cast('{a.dtype}')")
    batch = _broadcast_batch(a.shape[:-2], b.shape[:-2], a, b)
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    a = a.broadcast_to(batch + (m, k)).expand(len(batch) + 2, n)      # [..., M, K, N]
    b = b.broadcast_to(batch + (k, n)).expand(len(batch), m)          # [..., M, K, N]
    out = reduce("SumReduce", a * b, len(batch) + 1)                  # [..., M, N]
    if squeeze_a:
        out = out.squeeze(-2)
    if squeeze_b:
        out = out.squeeze(-1)
    return out


def _broadcast_batch(sa, sb, a, b):
    n = max(len(sa), len(sb))
    sa = (1,) * (n - len(sa)) + tuple(sa)
    sb = (1,) * (n - len(sb)) + tuple(sb)
    out = []
    for x, y in zip(sa, sb):
        if dims_equal(x, y) or dims_equal(y, 1):
            out.append(x)
        elif dims_equal(x, 1):
            out.append(y)
        else:
            raise ShapeError(f"matmul: batch shapes of {shape_str(a.shape)} and {shape_str(b.shape)} do not "
                             f"broadcast; batch axes must be equal or 1")
    return tuple(out)


def bmm(a: Tensor, b: Tensor) -> Tensor:
    return matmul(a, b)


class LoraWeight(Tensor):
    """A linear weight ``[out, in]`` with low-rank updates (LoRA) that ``linear`` adds beside its matmul:
    ``updates`` are ``(down [r, in], up [out, r], scale)``; ``applied`` records the node ids each ``linear`` made
    with it, so the builder can check that nothing else used the weight (which would drop the updates)."""

    __slots__ = ("updates", "applied")

    def __init__(self, base: Tensor, updates: list[tuple[Tensor, Tensor, float]]):
        super().__init__(base.graph, base.node, base.view, base.dtype)
        self.updates = updates
        self.applied: list[range] = []


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x @ weight.T + bias`` with ``weight [out, in]`` as stored by torch; for a ``LoraWeight``, plus
    ``(x @ down.T) @ up.T * scale`` per update, as PEFT's LoRA layer computes it beside the base layer.

    The weight (and bias) are cast to ``x``'s dtype with explicit Cast nodes: this is the op family's compute-dtype
    policy (bf16/fp8 checkpoints compute in the activation dtype), visible in the graph, never implicit.
    """
    first = len(x.graph.nodes)
    lora = weight if isinstance(weight, LoraWeight) else None
    if weight.dtype != x.dtype:
        weight = cast(weight, x.dtype)
    out = matmul(x, weight.T)
    if bias is not None:
        if bias.dtype != x.dtype:
            bias = cast(bias, x.dtype)
        out = out + bias.broadcast_to(out.shape)
    if lora is not None:
        for down, up, scale in lora.updates:
            down = down if down.dtype == x.dtype else cast(down, x.dtype)
            up = up if up.dtype == x.dtype else cast(up, x.dtype)
            out = out + matmul(matmul(x, down.T), up.T) * float(scale)
        lora.applied.append(range(first, len(x.graph.nodes)))
    return out
