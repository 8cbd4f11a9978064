"""CUDA kernels of GGUF block-quantized weights (``graph.gguf_blocks``): the ``Dequant`` primitive,
``GatherDequant`` (only the picked rows decoded) and ``DequantMatMulGGUF`` (bands of weight rows decoded into
scratch, each band one cuBLAS GEMM, as the fp8/nvfp4 ``DequantMatMul``). Every value comes from
``kernels/gguf.cuh``'s ``lr_gguf_value``, which decodes as gguf-py does, bit for bit.

The packed operand is read as rows of bytes: its view must reshape to ``[rows, row_bytes]`` with the bytes of a
row contiguous (any row stride: sliced or broadcast rows are fine).
"""

from __future__ import annotations

import math

import numpy as np

from luminal_recipes.graph import gguf_blocks

from .codegen import CodegenError, ctype
from .gemm import Matrix, matmul_desc
from .plan import IN, OUT, SCRATCH, Gemm, IndexCheck, Launch, NodePlan, grid_1d

KINDS = {"Q4_0": 0, "Q4_1": 1, "Q5_0": 2, "Q5_1": 3, "Q8_0": 4, "Q2_K": 5, "Q3_K": 6, "Q4_K": 7, "Q5_K": 8,
         "Q6_K": 9, "F16": 10, "BF16": 11, "F32": 12, "IQ4_NL": 13, "IQ4_XS": 14}


def _nodes():
    from . import nodes

    return nodes


def _qtype(ctx) -> str:
    qtype = ctx.node.attr("qtype")
    if qtype not in KINDS:
        raise CodegenError(f"unknown GGUF quantization type {qtype!r}")
    return qtype


def _rows_of_bytes(op, rows: int, rb: int):
    """(offset, row stride) of the packed operand read as [rows, row_bytes] with contiguous bytes per row."""
    r = _nodes()._reshaped(op, (rows, rb))
    if r is None or r.view.mask is not None or (rb > 1 and r.view.strides[1] != 1):
        raise CodegenError(f"packed GGUF bytes {tuple(op.view.shape)} are not rows of contiguous bytes")
    return r.view.offset, r.view.strides[0]


def _value(qtype: str, row: str, k: str) -> str:
    """C expression: element ``k`` of the packed row starting at pointer ``row``."""
    _, bs, ts = gguf_blocks.QTYPES[qtype]
    if bs == 1:
        return f"lr_gguf_value({KINDS[qtype]}, {row} + ({k}) * {ts}LL, 0)"
    return f"lr_gguf_value({KINDS[qtype]}, {row} + (({k}) / {bs}) * {ts}LL, (int)(({k}) % {bs}))"


def prepare_dequant(ctx, options) -> NodePlan:
    nd = _nodes()
    qtype = _qtype(ctx)
    (p,) = nd._operands(ctx)
    in_shape, shape = tuple(p.view.shape), tuple(ctx.shape)
    k = shape[-1]
    rb = in_shape[-1]
    if gguf_blocks.row_bytes(qtype, k) != rb or in_shape[:-1] != shape[:-1]:
        raise CodegenError(f"packed {in_shape} does not decode to {shape} as {qtype}")
    rows = math.prod(shape[:-1])
    plan = NodePlan()
    total = rows * k
    if total == 0:
        return plan
    off, rs = _rows_of_bytes(p, rows, rb)
    out_t = ctype(ctx.dtype)
    text = f"""extern "C" __global__ void __launch_bounds__({nd.BLOCK}) KNAME({out_t}* __restrict__ out,
    const unsigned char* __restrict__ packed, int n0, int nr) {{
  const long long total = (long long)nr * {k}LL;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
       i += (long long)gridDim.x * blockDim.x) {{
    const long long r = n0 + i / {k}LL, k = i % {k}LL;
    const unsigned char* row = packed + {off}LL + r * {rs}LL;
    out[i] = from_f32<{out_t}>({_value(qtype, "row", "k")});
  }}
}}"""
    name = plan.kernel(nd._source("gguf_dequant", text, [f"{out_t}*", "const unsigned char*", "int", "int"],
                                  sync=False))
    plan.steps.append(Launch(name, grid_1d(total, nd.BLOCK, options.max_blocks), (nd.BLOCK, 1, 1),
                             (OUT, IN(0), 0, rows)))
    return plan


def prepare_gather_dequant(ctx, options) -> NodePlan:
    nd = _nodes()
    qtype = _qtype(ctx)
    table, idx = nd._operands(ctx)
    t_shape, shape = tuple(table.view.shape), tuple(ctx.shape)
    k = shape[-1]
    if len(t_shape) != 2 or gguf_blocks.row_bytes(qtype, k) != t_shape[1]:
        raise CodegenError(f"table {t_shape} does not decode to rows of {k} as {qtype}")
    vocab, rb = t_shape
    count = math.prod(idx.view.shape)
    plan = NodePlan()
    flag = ctx.scratch.add((1,), np.int32)
    total = count * k
    if total == 0:
        return plan
    off, rs = _rows_of_bytes(table, vocab, rb)
    il = nd.view_loader("LoadI", idx, [(0, len(idx.view.shape))])
    out_t = ctype(ctx.dtype)
    text = f"""{il}
extern "C" __global__ void __launch_bounds__({nd.BLOCK}) KNAME({out_t}* __restrict__ out,
    const unsigned char* __restrict__ table, const {ctype(idx.dtype)}* __restrict__ index, int* flag) {{
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < {total}LL;
       i += (long long)gridDim.x * blockDim.x) {{
    const long long j = i / {k}LL, k = i % {k}LL;
    const long long r = (long long)LoadI{{index}}(j);
    if (!lr_index_ok(r, {vocab}LL, flag)) {{ out[i] = from_f32<{out_t}>(0.0f); continue; }}
    const unsigned char* row = table + {off}LL + r * {rs}LL;
    out[i] = from_f32<{out_t}>({_value(qtype, "row", "k")});
  }}
}}"""
    params = [f"{out_t}*", "const unsigned char*", f"const {ctype(idx.dtype)}*", "int*"]
    source = nd._source("gguf_gather", text, params, sync=False)
    code = source.code.replace("LoadI", f"LI_{source.name}")
    from .plan import KernelSource

    name = plan.kernel(KernelSource(source.name, source.params, code, False))
    plan.steps.append(nd._zero_flag(plan, options, SCRATCH(flag)))
    plan.steps.append(Launch(name, grid_1d(total, nd.BLOCK, options.max_blocks), (nd.BLOCK, 1, 1),
                             (OUT, IN(0), IN(1), SCRATCH(flag))))
    plan.steps.append(IndexCheck(SCRATCH(flag), f"GatherDequant #{ctx.node.id}: index out of range [0, {int(vocab)}); "
                                               f"check token ids against the vocabulary size"))
    return plan


def prepare_dequant_matmul_gguf(ctx, options) -> NodePlan:
    nd = _nodes()
    qtype = _qtype(ctx)
    n_out, k_in = int(ctx.node.attr("out_features")), int(ctx.node.attr("in_features"))
    x, w = nd._operands(ctx)
    shape = tuple(ctx.shape)
    rb = gguf_blocks.row_bytes(qtype, k_in)
    if x.view.shape[-1] != k_in or shape != tuple(x.view.shape[:-1]) + (n_out,) or \
            math.prod(w.view.shape) != n_out * rb:
        raise CodegenError(f"x {x.view.shape}, packed weight {w.view.shape} and out {shape} do not match {qtype} "
                           f"with in_features={k_in}, out_features={n_out}")
    plan = NodePlan()
    rows = math.prod(shape[:-1])
    if rows * n_out == 0:
        return plan
    off, rs = _rows_of_bytes(w, n_out, rb)
    gemm_t = nd._gemm_type(x.dtype)
    band = max(1, min(n_out, options.dequant_band // max(k_in, 1)))
    dense = ctx.scratch.add((band, k_in), gemm_t)
    dt = ctype(gemm_t)
    text = f"""extern "C" __global__ void __launch_bounds__({nd.BLOCK}) KNAME({dt}* __restrict__ band,
    const unsigned char* __restrict__ packed, int n0, int nb) {{
  const long long total = (long long)nb * {k_in}LL;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
       i += (long long)gridDim.x * blockDim.x) {{
    const long long r = n0 + i / {k_in}LL, k = i % {k_in}LL;
    const unsigned char* row = packed + {off}LL + r * {rs}LL;
    band[i] = from_f32<{dt}>({_value(qtype, "row", "k")});
  }}
}}"""
    name = plan.kernel(nd._source("gguf_band", text, [f"{dt}*", "const unsigned char*", "int", "int"], sync=False))
    acc_ref, acc_t, _ = nd._accumulator(ctx, options, plan, gemm_t, False)
    xr_op = nd._reshaped(x, (rows, k_in)) or nd.Operand(x.view, x.size, x.dtype)
    if len(xr_op.view.shape) != 2:
        raise CodegenError(f"x {x.view.shape} cannot be read as ({rows}, {k_in})")
    xv, xr = nd.gemm_operand(plan, options, ctx.scratch, xr_op, IN(0), gemm_t)
    for n0 in range(0, n_out, band):
        nb = min(band, n_out - n0)
        plan.steps.append(Launch(name, grid_1d(nb * k_in, nd.BLOCK, options.max_blocks), (nd.BLOCK, 1, 1),
                                 (SCRATCH(dense), IN(1), n0, nb)))
        xm = Matrix(rows, k_in, xv.strides[0], xv.strides[1], xv.offset)
        ym = Matrix(k_in, nb, 1, k_in, 0)  # the band [nb, K] read transposed
        desc = matmul_desc(xm, ym, n_out, 1, 0, 0, 0, gemm_t, gemm_t, acc_t)
        plan.steps.append(Gemm(desc, SCRATCH(dense), xr.at(xv.offset, gemm_t.itemsize),
                               acc_ref.at(n0, acc_t.itemsize)))
    nd._epilogue(plan, options, ctx, acc_ref, acc_t, None)
    return plan


PREPARE = {
    "Dequant": prepare_dequant,
    "GatherDequant": prepare_gather_dequant,
    "DequantMatMulGGUF": prepare_dequant_matmul_gguf,
}
