"""2-D convolution as unfold + matmul, and nearest-neighbour upsampling, both from views and primitives."""

from __future__ import annotations

from ..errors import ShapeError
from ..graph import Tensor, View
from ..graph.symbolic import dims_equal, shape_str
from .linalg import matmul


def _pair(v) -> tuple[int, int]:
    return (v, v) if isinstance(v, int) else (int(v[0]), int(v[1]))


def unfold(x: Tensor, kernel, stride=1) -> Tensor:
    """Sliding windows of a contiguous ``[N, C, H, W]`` as a zero-copy view ``[N, C, kh, kw, Ho, Wo]``."""
    kh, kw = _pair(kernel)
    sh, sw = _pair(stride)
    x = x.contiguous()
    n, c, h, w = x.shape
    ho, wo = (h - kh) // sh + 1, (w - kw) // sw + 1
    st = x.view.strides
    view = View((n, c, kh, kw, ho, wo), (st[0], st[1], st[2], st[3], st[2] * sh, st[3] * sw), x.view.offset)
    return x._with_view(view)


def conv2d(x: Tensor, weight: Tensor, bias: Tensor | None = None, stride=1, padding=0) -> Tensor:
    """``torch.nn.functional.conv2d`` for ``x [N, C, H, W]``, ``weight [O, C, kh, kw]`` (groups=1, dilation=1)."""
    if x.ndim != 4 or weight.ndim != 4:
        raise ShapeError(f"conv2d: expects x [N, C, H, W] and weight [O, C, kh, kw], got {shape_str(x.shape)} and "
                         f"{shape_str(weight.shape)}")
    if not dims_equal(x.shape[1], weight.shape[1]):
        raise ShapeError(f"conv2d: input has {x.shape[1]} channels, weight expects {weight.shape[1]}")
    if weight.dtype != x.dtype:
        weight = weight.cast(x.dtype)
    ph, pw = _pair(padding)
    o, c, kh, kw = weight.shape
    if ph or pw:
        x = x.pad(2, ph, ph).pad(3, pw, pw)
    cols = unfold(x, (kh, kw), stride).contiguous()                  # [N, C, kh, kw, Ho, Wo]
    n, _, _, _, ho, wo = cols.shape
    cols = cols.reshape(n, c * kh * kw, ho * wo)
    w2 = weight.reshape(o, c * kh * kw)
    out = matmul(w2.unsqueeze(0).broadcast_to((n, o, c * kh * kw)), cols)  # [N, O, Ho*Wo]
    out = out.reshape(n, o, ho, wo)
    if bias is not None:
        b = bias if bias.dtype == x.dtype else bias.cast(x.dtype)
        out = out + b.reshape(1, o, 1, 1).broadcast_to(out.shape)
    return out


def upsample_nearest2x(x: Tensor) -> Tensor:
    """Nearest-neighbour 2x upsampling of ``[N, C, H, W]`` (each pixel repeated in a 2x2 block)."""
    n, c, h, w = x.shape
    return x.expand(3, 2).expand(5, 2).reshape(n, c, h * 2, w * 2)
