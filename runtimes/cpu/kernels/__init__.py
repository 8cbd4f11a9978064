"""The CPU backend's kernels, one module per kernel family, and ``PREPARE``: the kernel name -> its prepare.

A kernel is prepared once per program node (``prepare(ctx) -> bind``): it decides how to read each operand
(``operands.Operand``) and which scratch arrays it needs (``ctx.scratch``, placed in the arena by the memory
planner). ``bind(out, flats, scratch)`` then receives the node's output array, every input's flat buffer and
the scratch arrays, precomputes every view it will touch, and returns the step the hot loop calls: ufuncs with
``out=`` into preallocated memory, nothing allocated beyond numpy's small internal buffers.

Semantics are graph.reference's (the oracle); float kernels other than the primitives compute in f32. Where a
compiled (numba, ``..jit``) or AMX (``..amx``) path exists, the numpy passes remain the fallback and the oracle
the tests compare it with.

Families: ``elementwise`` (primitives, Cast, fused Elementwise), ``reduce``, ``indexing`` (Gather, Scatter),
``layout`` (Copy, Concat), ``matmul``, ``norms`` (Softmax and the norms), ``conv`` (Conv2d), ``attention``,
``dequant`` (DequantMatMul); ``common`` and ``operands`` are what they share.
"""

from __future__ import annotations

from .attention import prepare_attention, prepare_attention_blocked
from .conv import prepare_conv2d
from .dequant import prepare_dequant_matmul
from .elementwise import _BINARY, prepare_binary, prepare_cast, prepare_elementwise, prepare_unary
from .indexing import prepare_gather, prepare_scatter
from .layout import prepare_concat, prepare_copy
from .matmul import prepare_matmul
from .norms import prepare_groupnorm, prepare_layernorm, prepare_rmsnorm, prepare_rmsnorm_rope, prepare_softmax
from .reduce import prepare_reduce

PREPARE = {
    **{op: prepare_unary for op in ("Log2", "Exp2", "Sin", "Sqrt", "Recip")},
    **{op: prepare_binary for op in _BINARY},
    "SumReduce": prepare_reduce,
    "MaxReduce": prepare_reduce,
    "Cast": prepare_cast,
    "Gather": prepare_gather,
    "Scatter": prepare_scatter,
    "ScatterInPlace": prepare_scatter,
    "Elementwise": prepare_elementwise,
    "Concat": prepare_concat,
    "Copy": prepare_copy,
    "MatMul": prepare_matmul,
    "Softmax": prepare_softmax,
    "LayerNorm": prepare_layernorm,
    "RMSNorm": prepare_rmsnorm,
    "GroupNorm": prepare_groupnorm,
    "RMSNormRoPE": prepare_rmsnorm_rope,
    "Conv2d": prepare_conv2d,
    "Attention": prepare_attention,
    "AttentionBlocked": prepare_attention_blocked,
    "DequantMatMul": prepare_dequant_matmul,
}
