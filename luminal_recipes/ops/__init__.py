"""The op library: every high-level op composed only of HLIR primitives.

``REGISTRY`` maps the names recipes may call to these functions.
"""

from __future__ import annotations

from ..graph import cast
from . import reduce as _reduce
from .attention import (
    apply_rope,
    attention_mask,
    merge_heads,
    rope_tables,
    rotate_half,
    rotate_pairs,
    scaled_dot_product_attention,
    split_heads,
    timestep_embedding,
)
from .conv import conv2d, unfold, upsample_nearest2x
from .elementwise import (
    abs,
    clamp,
    cos,
    equal,
    erf,
    exp,
    exp2,
    gelu,
    greater,
    greater_equal,
    less,
    less_equal,
    log,
    log2,
    logical_and,
    logical_not,
    logical_or,
    maximum,
    minimum,
    modulate,
    not_equal,
    pow,
    recip,
    relu,
    rsqrt,
    sigmoid,
    sign,
    silu,
    sin,
    sqrt,
    square,
    swiglu,
    tanh,
    where,
)
from .indexing import argmax, embedding, topk, update_cache, write_rows
from .linalg import bmm, linear, matmul
from .norm import group_norm, layer_norm, log_softmax, rms_norm, softmax
from .quant import dequant_fp8, dequant_nvfp4, unpack_fp4_codes, unswizzle_scales
from .shape import chunk, concat, split, stack

sum = _reduce.sum  # noqa: A001
mean = _reduce.mean
max = _reduce.max  # noqa: A001
min = _reduce.min  # noqa: A001
var = _reduce.var

# Helpers that are not graph ops a recipe may call (host-side tables, pieces of larger ops).
_NOT_OPS = {"attention_mask", "rope_tables", "rotate_half", "rotate_pairs", "unfold", "unpack_fp4_codes",
            "unswizzle_scales"}

# Every public function imported above (plus cast), by name; `attention` is the short name recipes use for SDPA.
REGISTRY = {
    name: fn
    for name, fn in sorted(globals().items())
    if callable(fn) and not name.startswith("_") and name not in _NOT_OPS
    and getattr(fn, "__module__", "").startswith(__name__ + ".")
}
REGISTRY.update({"cast": cast, "attention": scaled_dot_product_attention})

__all__ = sorted(REGISTRY) + ["REGISTRY", *sorted(_NOT_OPS)]
