"""Program node -> ``NodePlan``: the CUDA kernels and cuBLAS calls that compute one kernel node.

``prepare(ctx, options)`` dispatches on ``ctx.node.op``. ``ctx`` is the kernel context of the backend contract
(node, output shape and storage dtype, each input's bound view, storage dtype and element count, a ``scratch``
to request typed scratch arrays). Semantics follow ``graph.reference`` (primitives) and ``runtimes/program.py``
(fused kernels), with the numpy runtime's arithmetic: f32 compute, one rounding at the store.

Generated kernels bake every fixed shape, stride and offset in as constants (``codegen.index_code``); what
depends on a symbolic dim is read from the kernel's arguments (``symdims``: ``prepare`` appends them); hand-written
templates live in ``kernels/*.cuh``. GEMMs go through ``gemm.matmul_desc`` (cuBLAS reads the views in place when
it can; otherwise the operand is copied into scratch by a generated copy kernel).
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from luminal_recipes.errors import InputError
from luminal_recipes.graph.dtypes import DType, to_dtype
from luminal_recipes.graph.view import BoundView, View
from luminal_recipes.runtimes.kernels.fused import conv_windows

from . import codegen as cg
from . import symdims
from .codegen import CodegenError, Operand, ctype
from .cublaslt import E4M3, LtDesc, arch_number, fp8_unsupported, workspace_bytes
from .gemm import GemmLayoutError, Matrix, matmul_desc, split_batch
from .plan import IN, OUT, SCRATCH, Gemm, IndexCheck, KernelSource, Launch, LtGemm, NodePlan, Ref, grid_1d

F32, F16, BF16 = np.dtype(np.float32), np.dtype(np.float16), DType.BF16.np
GEMM_TYPES = {F32, F16, BF16}
# (A/B type, C type) pairs cuBLAS gemmEx computes with CUBLAS_COMPUTE_32F
GEMM_OUT = {(F32, F32), (F16, F16), (F16, F32), (BF16, BF16), (BF16, F32)}
BLOCK = 256


@dataclass
class CudaOptions:
    """Launch shapes and algorithm choices (the same for the GPU and cuda-emu, so both run the same code)."""

    max_blocks: int = 132 * 16  # grid-stride loops: a few waves on an H200's 132 SMs
    # "auto" (the cheaper by ``attention_seconds``), "flash" (tiled SIMT kernel, online softmax, never S x T) or
    # "chunked" (cuBLAS GEMM + softmax rows + GEMM per chunk of heads, scores within ``score_budget``)
    attention: str = "auto"
    # device figures the attention choice is made with (an H200's, sustained): SIMT f32 FMA, tensor-core GEMMs
    # for f16/bf16 and f32 operands, memory bandwidth
    simt_flops: float = 30e12
    tensor_flops: float = 600e12
    f32_gemm_flops: float = 50e12
    bytes_per_s: float = 3.5e12
    launch_s: float = 5e-6
    score_budget: int = 1 << 26  # f32 score elements per attention chunk (256 MiB)
    dequant_band: int = 1 << 24  # decoded weight elements per DequantMatMul band
    conv_cols: int = 1 << 24  # im2col elements per Conv2d tile
    graphs: bool = True  # the cuda backend replays a program as one CUDA graph from its second run
    # fp8 DequantMatMul: "dequant" (weights decoded to bf16/f16 bands feeding cuBLAS: the reference's weight-only
    # semantics) or "cublaslt" (FP8 x FP8 on the tensor cores where the device has them, sm_89+: activations
    # quantized to e4m3 with a per-tensor scale, which changes results: opt-in). Default: $LUMINAL_FP8_GEMM.
    fp8_gemm: str = field(default_factory=lambda: os.environ.get("LUMINAL_FP8_GEMM", "dequant"))
    arch: str = "sm_90"  # the device's architecture (what FP8 and bf16 tensor cores it has)
    # () -> why cuBLASLt cannot run on this device (its library missing), or None; asked once an FP8 GEMM is wanted
    fp8_check: Callable[[], str | None] | None = None
    notes: list[str] = field(default_factory=list)  # one-line notices already printed

    def __post_init__(self):
        if self.fp8_gemm not in FP8_GEMM_MODES:
            raise InputError(f"LUMINAL_FP8_GEMM={self.fp8_gemm!r}: expected one of {', '.join(FP8_GEMM_MODES)}")

    def notice(self, text: str) -> None:
        """Print ``text`` as a one-line notice, once per backend."""
        if text not in self.notes:
            self.notes.append(text)
            print(f"note: cuda: {text}", file=sys.stderr)


FP8_GEMM_MODES = ("dequant", "cublaslt")


class CudaPrepareError(ValueError):
    """A node the CUDA runtime cannot run as given (names the node)."""


def _where(ctx) -> str:
    n = ctx.node
    return f"{n.op} #{n.id}" + (f" ('{n.name}')" if n.name else "")


def prepare(ctx, options: CudaOptions | None = None) -> NodePlan:
    options = options or CudaOptions()
    fn = PREPARE.get(ctx.node.op)
    if fn is None:
        raise CudaPrepareError(f"{_where(ctx)}: the CUDA runtime has no kernel for {ctx.node.op}")
    try:
        plan = fn(ctx, options)
    except (CodegenError, GemmLayoutError) as e:
        raise CudaPrepareError(symdims.plain(f"{_where(ctx)}: {e}")) from e
    plan = _dims_as_arguments(plan, ctx)
    if arch_number(options.arch) < 80 and any(isinstance(s, Gemm) and BF16 in (s.desc.a_type, s.desc.b_type)
                                              for s in plan.steps):
        options.notice(f"{options.arch} has no bf16 tensor cores: bf16 GEMMs run on cuBLAS's bf16 kernels without "
                       "them (CUBLAS_COMPUTE_32F, correct but several times slower than on sm_80+)")
    return plan


def _dims_as_arguments(plan: NodePlan, ctx) -> NodePlan:
    """Kernels whose text reads symbolic dims (``symdims``) take them as trailing ``long long`` arguments; their
    launches pass the values being bound."""
    if not any(symdims.OPEN in s.code for s in plan.sources):
        return plan
    values = symdims.values_in(ctx.shape, ctx.inputs)
    sources, extra = [], {}
    for s in plan.sources:
        if symdims.OPEN not in s.code:
            sources.append(s)
            continue
        code, tokens = symdims.lower(s.code, s.name)
        extra[s.name] = tuple(symdims.dim_of(t, values) for t in tokens)
        sources.append(KernelSource(s.name, s.params + ("long long",) * len(tokens), code, s.sync))

    def launch(step):
        if isinstance(step, Launch) and extra.get(step.kernel):
            return Launch(step.kernel, step.grid, step.block, (*step.args, *extra[step.kernel]))
        if isinstance(step, SkipIfSame):
            return SkipIfSame(launch(step.launch), step.a, step.b)
        if isinstance(step, IndexCheck):
            return IndexCheck(step.flag, symdims.plain(step.message))
        return step

    return NodePlan(sources, [launch(step) for step in plan.steps])


def _operands(ctx) -> list[Operand]:
    return [Operand(k.view, k.size, np.dtype(k.dtype)) for k in ctx.inputs]


def _contiguous(shape: tuple[int, ...], size: int | None = None, dtype=F32, offset: int = 0) -> Operand:
    n = math.prod(shape)
    return Operand(View.contiguous(shape).bind({}) if offset == 0 else
                   BoundView(tuple(shape), View.contiguous(shape).bind({}).strides, offset, None),
                   size if size is not None else n + offset, np.dtype(dtype))


# ---- Elementwise (and every unary/binary primitive, Cast, copies) ---------------------------------------------
def elementwise(plan: NodePlan, options: CudaOptions, expr: str, operands: list[Operand], refs: list[Ref],
                shape: tuple[int, ...], out_dtype, out_ref: Ref = OUT) -> None:
    """Append the launch of a generated kernel ``out[i] = expr(in0[i], in1[i]...)`` over ``shape`` (output
    contiguous at ``out_ref``)."""
    out_dtype = np.dtype(out_dtype)
    n = math.prod(shape)
    if n == 0:
        return
    ec = cg.ExprCompiler(expr, [op.dtype for op in operands], out_dtype)
    used = ec.used
    itype = cg.index_type(n, *(op.size for op in operands), *(abs(op.view.offset) + sum(
        abs(s) * d for s, d in zip(op.view.strides, op.view.shape)) for op in operands))
    idx = cg.index_code(tuple(shape), [(0, len(shape))], [operands[i] for i in used], ["i"], itype)
    out_t = ctype(out_dtype)
    params = [f"{out_t}*"] + [f"const {ctype(op.dtype)}*" for op in operands]
    sig = ", ".join([f"{out_t}* __restrict__ out"] + [f"const {ctype(op.dtype)}* __restrict__ in{i}"
                                                      for i, op in enumerate(operands)])
    loads = []
    for j, i in enumerate(used):
        loads.append(f"const {cg.compute_type(operands[i].dtype)} v{i} = "
                     f"{cg.load_expr(f'in{i}', idx.flats[j], idx.valids[j], operands[i].dtype)};")
    body = "\n      ".join(idx.stmts + loads + ec.lines + [f"out[i] = {ec.result};"])
    vector = _vector_loop(ec, operands, used, out_dtype, n, itype)
    text = f"""extern "C" __global__ void __launch_bounds__({BLOCK}) KNAME({sig}) {{
  const {itype} n = {n};
  const {itype} start = ({itype})blockIdx.x * blockDim.x + threadIdx.x;
  const {itype} stride = ({itype})gridDim.x * blockDim.x;
  {{
    {vector}
  }}
  for ({itype} i = start; i < n; i += stride) {{
      {body}
  }}
}}"""
    name = plan.kernel(_source("ew", text, params, sync=False))
    plan.steps.append(Launch(name, grid_1d(n, BLOCK, options.max_blocks), (BLOCK, 1, 1),
                             (out_ref, *refs)))


def _vector_loop(ec: cg.ExprCompiler, operands: list[Operand], used: list[int], out_dtype: np.dtype, n: int,
                 itype: str) -> str:
    """A loop of 16-byte vector loads and stores when every input read is contiguous or uniform (taken at run
    time only if the pointers are aligned); it ends by moving ``start`` past the elements it covered."""
    kinds = {}
    for i in used:
        off = cg.is_contiguous_from(operands[i], n)
        if off is not None:
            kinds[i] = ("contiguous", off)
        elif cg.is_uniform(operands[i]):
            kinds[i] = ("uniform", operands[i].view.offset)
        else:
            return ""
    widest = max([out_dtype.itemsize] + [operands[i].dtype.itemsize for i, (k, _) in kinds.items()
                                         if k == "contiguous"])
    vec = min(8, 16 // widest)
    if vec < 2 or (n < vec * 2 and not symdims.is_sym(n)):  # (a length that varies: the loop serves any n)
        return ""
    out_t = ctype(out_dtype)
    checks = [f"lr_aligned(out, {vec * out_dtype.itemsize})"]
    pre, inner = [], []
    for i, (kind, off) in kinds.items():
        t = ctype(operands[i].dtype)
        ct = cg.compute_type(operands[i].dtype)
        val = "to_f32({})" if ct == "float" else "{}"
        if kind == "contiguous":
            if off % vec:
                return ""
            checks.append(f"lr_aligned(in{i} + {off}, {vec * operands[i].dtype.itemsize})")
            pre.append(f"const Vec<{t}, {vec}>* __restrict__ p{i} = "
                       f"reinterpret_cast<const Vec<{t}, {vec}>*>(in{i} + {off});")
            inner.append(f"const {ct} v{i} = {val.format(f'a{i}.v[e]')};")
        else:
            pre.append(f"const {ct} u{i} = {val.format(f'in{i}[{off}]')};")
            inner.append(f"const {ct} v{i} = u{i};")
    loads = "\n        ".join(f"const Vec<{ctype(operands[i].dtype)}, {vec}> a{i} = p{i}[j];"
                              for i, (k, _) in kinds.items() if k == "contiguous")
    lines = "\n          ".join(inner + ec.lines + [f"o.v[e] = {ec.result};"])
    return f"""if ({" && ".join(checks)}) {{
      {" ".join(pre)}
      Vec<{out_t}, {vec}>* __restrict__ po = reinterpret_cast<Vec<{out_t}, {vec}>*>(out);
      const {itype} nv = n / {vec};
      for ({itype} j = start; j < nv; j += stride) {{
        {loads}
        Vec<{out_t}, {vec}> o;
#pragma unroll
        for (int e = 0; e < {vec}; ++e) {{
          {lines}
        }}
        po[j] = o;
      }}
      for ({itype} i = nv * {vec} + start; i < n; i += stride) {{
        {_scalar_contiguous(ec, kinds, operands)}
      }}
      return;
    }}"""


def _scalar_contiguous(ec, kinds, operands) -> str:
    lines = []
    for i, (kind, off) in kinds.items():
        ct = cg.compute_type(operands[i].dtype)
        ref = f"in{i}[i + {off}]" if kind == "contiguous" else f"in{i}[{off}]"
        lines.append(f"const {ct} v{i} = {'to_f32(' + ref + ')' if ct == 'float' else ref};")
    return "\n        ".join(lines + ec.lines + [f"out[i] = {ec.result};"])


def _source(prefix: str, text: str, params: list[str], sync: bool) -> KernelSource:
    name = cg.kernel_name(prefix, text)
    return KernelSource(name, tuple(params), text.replace("KNAME", name), sync)


def copy_into(plan: NodePlan, options: CudaOptions, op: Operand, ref: Ref, dtype, dst: Ref) -> None:
    """Materialise ``op`` contiguously (converted to ``dtype``) at ``dst`` (zeros where the view is padding)."""
    elementwise(plan, options, "in0", [op], [ref], tuple(op.view.shape), dtype, dst)


_PRIMITIVE_EXPR = {**{u: f"({u} in0)" for u in ("Log2", "Exp2", "Sin", "Sqrt", "Recip")},
                   **{b: f"({b} in0 in1)" for b in ("Add", "Mul", "Mod", "LessThan")},
                   # issue 9's kernels: a concatenation is pad(a) + pad(b) (-0.0 comes out +0.0, as in the sum),
                   # a copy materialises a view (zeros where masked)
                   "Concat": "(Add in0 in1)", "Copy": "in0"}


def prepare_elementwise(ctx, options: CudaOptions) -> NodePlan:
    op = ctx.node.op
    if op == "Elementwise":
        expr = ctx.node.attr("expr")
        if not isinstance(expr, str):
            raise CodegenError("needs a string attribute 'expr'")
    elif op == "Cast":
        expr = f"(Cast {to_dtype(np.dtype(ctx.dtype))} in0)"
    else:
        expr = _PRIMITIVE_EXPR[op]
    for i, k in enumerate(ctx.inputs):
        if tuple(k.view.shape) != tuple(ctx.shape):
            raise CodegenError(f"input {i} is viewed at {k.view.shape}, not at the output shape {ctx.shape}")
    plan = NodePlan()
    elementwise(plan, options, expr, _operands(ctx), [IN(i) for i in range(len(ctx.inputs))], tuple(ctx.shape),
                ctx.dtype)
    return plan


def prepare_iota(ctx, options: CudaOptions) -> NodePlan:
    n = int(ctx.shape[0])
    plan = NodePlan()
    if n == 0:
        return plan
    text = f"""extern "C" __global__ void __launch_bounds__({BLOCK}) KNAME(int* __restrict__ out) {{
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < {n}; i += gridDim.x * blockDim.x) out[i] = i;
}}"""
    name = plan.kernel(_source("iota", text, ["int*"], sync=False))
    plan.steps.append(Launch(name, grid_1d(n, BLOCK, options.max_blocks), (BLOCK, 1, 1), (OUT,)))
    return plan


# ---- loads through a view with axis groups (row kernels, reductions, gathers) -------------------------------
def view_loader(name: str, op: Operand, groups: list[tuple[int, int]], itype: str = "long long") -> str:
    """A functor ``name{p}(g0, g1...)`` reading ``op`` at one linear index per axis group (0 where masked)."""
    args = [f"g{j}" for j in range(len(groups))]
    idx = cg.index_code(tuple(op.view.shape), groups, [op], args, itype, tag="x")
    ret = cg.compute_type(op.dtype)
    body = "\n    ".join(idx.stmts)
    load = cg.load_expr("p", idx.flats[0], idx.valids[0], op.dtype)
    params = ", ".join(f"{itype} {a}" for a in args)
    return f"""struct {name} {{
  const {ctype(op.dtype)}* __restrict__ p;
  LR_DEV {ret} operator()({params}) const {{
    {body}
    return {load};
  }}
}};"""


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def prepare_rows(ctx, options: CudaOptions) -> NodePlan:
    most = 1 if ctx.node.op == "Softmax" else 3  # a norm's affine operands: scale, shift
    if not 1 <= len(ctx.inputs) <= most or not ctx.shape or \
            any(tuple(k.view.shape) != tuple(ctx.shape) for k in ctx.inputs):
        raise CodegenError("expects x [..., N] (and a norm's scale and shift) viewed at the output shape")
    kind = {"Softmax": "ROW_SOFTMAX", "LayerNorm": "ROW_LAYERNORM", "RMSNorm": "ROW_RMSNORM"}[ctx.node.op]
    eps = float(ctx.node.attr("eps", 1e-5 if ctx.node.op == "LayerNorm" else 1e-6))
    shape = tuple(ctx.shape)
    n, rows = shape[-1], math.prod(shape[:-1])
    plan = NodePlan()
    if n == 0 or rows == 0:
        return plan
    ops = _operands(ctx)
    rows_kernel(plan, options, kind, ops[0], IN(0), rows, n, eps, ctx.dtype, OUT,
                affine=[(op, IN(i + 1)) for i, op in enumerate(ops[1:])])
    return plan


def prepare_groupnorm(ctx, options: CudaOptions) -> NodePlan:
    """GroupNorm (+ affine, + SiLU): the LayerNorm row kernel over x's [N*G, n] rows, the scale and shift read
    through their [N, C, *spatial] views split to [N, G, C/G, *spatial] (rows: the first two axes)."""
    if len(ctx.inputs) != 3 or len(ctx.inputs[0].view.shape) != 3 or len(ctx.shape) < 2 or \
            any(tuple(k.view.shape) != tuple(ctx.shape) for k in ctx.inputs[1:]):
        raise CodegenError("expects x [N, G, n], scale and shift viewed at the output shape [N, C, *spatial]")
    nb, groups, n = ctx.inputs[0].view.shape
    shape = tuple(ctx.shape)
    c, hw = shape[1], math.prod(shape[2:])
    if nb != shape[0] or groups == 0 or c % groups or n != (c // groups) * hw:
        raise CodegenError(f"x {tuple(ctx.inputs[0].view.shape)} is not the {groups} groups of an output {shape}")
    plan = NodePlan()
    if n == 0 or nb == 0:
        return plan
    ops = _operands(ctx)
    grouped = (nb, groups, c // groups, *shape[2:])
    affine = []
    for i, op in enumerate(ops[1:]):
        bv = op.view
        split_view = View(tuple(bv.shape), tuple(bv.strides), bv.offset, bv.mask).reshape(grouped)
        if split_view is None:
            raise CodegenError(f"operand {i + 1} cannot be read per group of channels")
        affine.append((Operand(split_view.bind({}), op.size, op.dtype), IN(i + 1)))
    rows_kernel(plan, options, "ROW_LAYERNORM", ops[0], IN(0), nb * groups, n, float(ctx.node.attr("eps", 1e-5)),
                ctx.dtype, OUT, affine=affine, affine_rows=2, act=str(ctx.node.attr("act", "")),
                max_block=256)  # the per-group scale and shift loaders' index arithmetic spilled at 1024 threads
    return plan


def prepare_rmsnorm_rope(ctx, options: CudaOptions) -> NodePlan:
    """RMSNorm times its weight, then the rotary embedding of adjacent pairs: the RMSNorm row kernel over x's
    [..., S, D] rows, the weight and the cos/sin tables (viewed at [..., S, D/2, 2], the last two axes one index
    of the row) read in the epilogue, each value rotated with its pair partner's."""
    xs = tuple(ctx.inputs[0].view.shape) if ctx.inputs else ()
    shape = tuple(ctx.shape)
    if (len(ctx.inputs) != 4 or len(shape) < 3 or shape[-1] != 2 or xs[:-1] != shape[:-2]
            or xs[-1] != 2 * shape[-2] or tuple(ctx.inputs[1].view.shape) != xs
            or any(tuple(k.view.shape) != shape for k in ctx.inputs[2:])):
        raise CodegenError("expects x [..., S, D], scale at x's shape, cos and sin at the output shape "
                           "[..., S, D/2, 2]")
    n, rows = xs[-1], math.prod(xs[:-1])
    plan = NodePlan()
    if n == 0 or rows == 0:
        return plan
    ops = _operands(ctx)
    rows_kernel(plan, options, "ROW_RMSNORM_ROPE", ops[0], IN(0), rows, n, float(ctx.node.attr("eps", 1e-6)),
                ctx.dtype, OUT, affine=[(ops[1], IN(1))], rope=[(ops[2], IN(2)), (ops[3], IN(3))])
    return plan


def rows_kernel(plan: NodePlan, options: CudaOptions, kind: str, op: Operand, ref: Ref, rows: int, n: int,
                eps: float, out_dtype, out_ref: Ref, bias: tuple[Operand, Ref] | None = None,
                row_base: int = 0, affine: list[tuple[Operand, Ref]] = (), affine_rows: int | None = None,
                act: str = "", max_block: int = 1024, rope: list[tuple[Operand, Ref]] = ()) -> None:
    """A row kernel over ``op`` viewed as [rows, n] (its leading axes merged); ``bias`` (viewed the same way,
    rows counted from ``row_base``) is added before a softmax; ``affine`` (a norm's scale [and shift], viewed the
    same way, or with their first ``affine_rows`` axes merged into the rows and the others into the row)
    multiplies [and shifts] each normalised value before it is stored, then ``act`` ('silu': t * sigmoid(t));
    ``max_block``: threads per block at most (fewer leave each thread more registers); ``rope`` (kind
    ROW_RMSNORM_ROPE: the cos and sin tables, viewed at [rows..., n/2, 2]) rotates each weighted value with its
    pair partner's."""
    nd = len(op.view.shape)
    if symdims.is_sym(n):
        # a row length that changes with the dims: one kernel for every length, choosing at run time between
        # keeping a row in registers (up to 10 values a thread: FLUX.2-dev's 4608 keys) and re-reading it per pass
        # (longer rows); at 1024 threads ptxas spilled these, at 512 it does not (test_cuda_nvrtc.py)
        block, items, cached = min(max_block, 512), None, (10 if kind == "ROW_SOFTMAX" else 8)
        inv_n = f"(float)(1.0 / (double){n})"
    else:
        block = min(max_block, max(32, _pow2(-(-n // 8))))
        items = -(-n // block) if -(-n // block) <= 8 else 0
        inv_n = cg.float_literal(1.0 / n)
    loader = view_loader("LoadX", op, [(0, nd - 1), (nd - 1, nd)])
    out_t = ctype(out_dtype)
    params = [f"{out_t}*", f"const {ctype(op.dtype)}*"]
    sig = [f"{out_t}* __restrict__ out", f"const {ctype(op.dtype)}* __restrict__ x"]
    extra, load = "", "LoadX{x}"
    if bias is not None:
        bop, bref = bias
        bnd = len(bop.view.shape)
        extra = view_loader("LoadB", bop, [(0, bnd - 1), (bnd - 1, bnd)])
        params += [f"const {ctype(bop.dtype)}*", "long long"]
        sig += [f"const {ctype(bop.dtype)}* __restrict__ bias", "long long row_base"]
        extra += """
struct LoadXB {
  LoadX x; LoadB b; long long base;
  LR_DEV float operator()(long long r, long long c) const { return x(r, c) + b(base + r, c); }
};"""
        load = "LoadXB{LoadX{x}, LoadB{bias}, row_base}"
    epilogue = ""
    if affine:
        names = ("LoadS", "LoadT")[: len(affine)]
        for name, (aop, _) in zip(names, affine):
            nd_a = len(aop.view.shape)
            split_at = nd_a - 1 if affine_rows is None else affine_rows
            extra += "\n" + view_loader(name, aop, [(0, split_at), (split_at, nd_a)])
        args_text = ["scale", "shift"][: len(affine)]
        params += [f"const {ctype(aop.dtype)}*" for aop, _ in affine]
        sig += [f"const {ctype(aop.dtype)}* __restrict__ {a}" for (aop, _), a in zip(affine, args_text)]
        value = "v * s(r, c)" + (" + t(r, c)" if len(affine) > 1 else "")
        if act == "silu":
            value = f"silu_f32({value})"
        elif act:
            raise CodegenError(f"unknown activation {act!r}")
        members = " ".join(f"{name} {m};" for name, m in zip(names, "st"))
        inits = [f"{name}{{{a}}}" for name, a in zip(names, args_text)]
        pair = ""
        if rope:  # the tables, their last two axes ([n/2, 2]) one index of the row
            for name, (top, _), a in zip(("LoadC", "LoadN"), rope, ("cos", "sin")):
                nd_t = len(top.view.shape)
                extra += "\n" + view_loader(name, top, [(0, nd_t - 2), (nd_t - 2, nd_t)])
                params.append(f"const {ctype(top.dtype)}*")
                sig.append(f"const {ctype(top.dtype)}* __restrict__ {a}")
                inits.append(f"{name}{{{a}}}")
            members += " LoadC cs; LoadN sn;"
            pair = """
  LR_DEV float pair(long long r, int c, float v, float p) const {
    const float y = v * s(r, c), yp = p * s(r, c ^ 1);
    return (c & 1) ? y * cs(r, c) + yp * sn(r, c) : y * cs(r, c) + yp * (sn(r, c) * -1.0f);
  }"""
        extra += f"""
struct NormEpi {{
  {members}
  LR_DEV float operator()(long long r, int c, float v) const {{ return {value}; }}{pair}
}};"""
        epilogue = ", NormEpi{" + ", ".join(inits) + "}"
    def call(items: int) -> str:
        return (f"rows_kernel<{block}, {items}, {kind}>(out, {rows}LL, {n}, {cg.float_literal(eps)}, {inv_n},\n"
                f"                                       {load}{epilogue});")

    if items is not None:
        call = call(items)
    else:
        call = f"if ({n} <= {block * cached}) {{\n    {call(cached)}\n  }} else {{\n    {call(0)}\n  }}"
    text = f"""{loader}
{extra}
extern "C" __global__ void __launch_bounds__({block}) KNAME({", ".join(sig)}) {{
  {call}
}}""".replace("LoadX", "LX_KNAME").replace("LoadB", "LB_KNAME").replace("LX_KNAMEB", "LXB_KNAME") \
        .replace("LoadS", "LS_KNAME").replace("LoadT", "LT_KNAME").replace("LoadC", "LC_KNAME") \
        .replace("LoadN", "LN_KNAME").replace("NormEpi", "NE_KNAME")
    source = _source("rows", text, params, sync=True)
    source = KernelSource(source.name, source.params, source.code.replace("_KNAME", "_" + source.name), True)
    name = plan.kernel(source)
    args = (out_ref, ref) if bias is None else (out_ref, ref, bias[1], row_base)
    args = (*args, *(r for _, r in affine), *(r for _, r in rope))
    plan.steps.append(Launch(name, (max(1, min(rows, options.max_blocks * 4)), 1, 1), (block, 1, 1), args))


# ---- SumReduce / MaxReduce -------------------------------------------------------------------------------------
def prepare_reduce(ctx, options: CudaOptions) -> NodePlan:
    axis = int(ctx.node.attr("axis"))
    op = _operands(ctx)[0]
    shape = tuple(op.view.shape)
    nd = len(shape)
    axis %= max(nd, 1)
    r = shape[axis]
    outer, inner = math.prod(shape[:axis]), math.prod(shape[axis + 1:])
    outputs = outer * inner
    plan = NodePlan()
    if outputs == 0:
        return plan
    is_max = ctx.node.op == "MaxReduce"
    ct = cg.compute_type(op.dtype)
    acc = {"float": "float", "int": "int", "u8": "unsigned", "bool": "int"}[ct]
    if is_max:
        identity = {"float": "-f32_bits(0x7f800000u)", "int": "(int)0x80000000u", "unsigned": "0u"}[acc]
    else:
        identity = {"float": "0.0f", "int": "0", "unsigned": "0u"}[acc]
    # the view as [outer, r, inner]: three axis groups
    loader = view_loader("LoadR", op, [(0, axis), (axis, axis + 1), (axis + 1, nd)])
    out_t = ctype(ctx.dtype)
    store_val = cg.convert("v", acc if acc != "unsigned" else "int", np.dtype(ctx.dtype)) if acc != "float" \
        else cg.convert("v", "float", np.dtype(ctx.dtype))
    lanes = inner == 1 and r >= 32
    text = f"""{loader}
struct LoadW {{
  LoadR x;
  LR_DEV {acc} operator()(long long w, int k) const {{ return ({acc})x(w / {inner}, k, w % {inner}); }}
}};
struct StoreW {{
  {out_t}* __restrict__ out;
  LR_DEV void operator()(long long w, {acc} v) const {{ out[w] = {store_val}; }}
}};
extern "C" __global__ void __launch_bounds__({BLOCK}) KNAME({out_t}* __restrict__ out,
                                                       const {ctype(op.dtype)}* __restrict__ x) {{
  reduce_{"lanes" if lanes else "serial"}<{acc}, {1 if is_max else 0}>({outputs}LL, {r}, ({acc})({identity}),
      StoreW{{out}}, LoadW{{LoadR{{x}}}});
}}"""
    source = _source("reduce", text, [f"{out_t}*", f"const {ctype(op.dtype)}*"], sync=lanes)
    code = source.code.replace("LoadR", f"LR_{source.name}").replace("LoadW", f"LW_{source.name}").replace(
        "StoreW", f"SW_{source.name}")
    name = plan.kernel(KernelSource(source.name, source.params, code, lanes))
    work = outputs * 32 if lanes else outputs
    plan.steps.append(Launch(name, grid_1d(work, BLOCK, options.max_blocks), (BLOCK, 1, 1), (OUT, IN(0))))
    return plan


# ---- Gather / Scatter -------------------------------------------------------------------------------------------
def prepare_gather(ctx, options: CudaOptions) -> NodePlan:
    table, idx = _operands(ctx)
    rows = table.view.shape[0]
    row_elems = math.prod(table.view.shape[1:])
    count = math.prod(idx.view.shape)
    plan = NodePlan()
    flag = ctx.scratch.add((1,), np.int32)
    total = count * row_elems
    if total == 0:
        return plan
    tl = view_loader("LoadT", table, [(0, 1), (1, len(table.view.shape))])
    il = view_loader("LoadI", idx, [(0, len(idx.view.shape))])
    out_t = ctype(ctx.dtype)
    value = cg.convert("v", cg.compute_type(table.dtype), np.dtype(ctx.dtype))
    text = f"""{tl}
{il}
extern "C" __global__ void __launch_bounds__({BLOCK}) KNAME({out_t}* __restrict__ out,
    const {ctype(table.dtype)}* __restrict__ table, const {ctype(idx.dtype)}* __restrict__ index, int* flag) {{
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < {total}LL;
       i += (long long)gridDim.x * blockDim.x) {{
    const long long j = i / {row_elems}, e = i % {row_elems};
    const long long row = (long long)LoadI{{index}}(j);
    const {cg.compute_type(table.dtype)} v = lr_index_ok(row, {rows}LL, flag) ? LoadT{{table}}(row, e)
                                                                         : ({cg.compute_type(table.dtype)})0;
    out[i] = {value};
  }}
}}"""
    params = [f"{out_t}*", f"const {ctype(table.dtype)}*", f"const {ctype(idx.dtype)}*", "int*"]
    source = _source("gather", text, params, sync=False)
    code = source.code.replace("LoadT", f"LT_{source.name}").replace("LoadI", f"LI_{source.name}")
    name = plan.kernel(KernelSource(source.name, source.params, code, False))
    plan.steps.append(_zero_flag(plan, options, SCRATCH(flag)))
    plan.steps.append(Launch(name, grid_1d(total, BLOCK, options.max_blocks), (BLOCK, 1, 1),
                             (OUT, IN(0), IN(1), SCRATCH(flag))))
    plan.steps.append(IndexCheck(SCRATCH(flag), f"Gather #{ctx.node.id}: index out of range [0, {int(rows)}); check "
                                               f"token ids against the vocabulary size"))
    return plan


def _zero_flag(plan: NodePlan, options: CudaOptions, ref: Ref) -> Launch:
    text = """extern "C" __global__ void KNAME(int* flag) { if (threadIdx.x == 0 && blockIdx.x == 0) flag[0] = 0; }"""
    name = plan.kernel(_source("zero", text, ["int*"], sync=False))
    return Launch(name, (1, 1, 1), (1, 1, 1), (ref,))


def prepare_scatter(ctx, options: CudaOptions) -> NodePlan:
    dest, idx, src = _operands(ctx)
    rows = dest.view.shape[0] if dest.view.shape else 0
    row_elems = math.prod(dest.view.shape[1:])
    count = math.prod(idx.view.shape)
    plan = NodePlan()
    flag = ctx.scratch.add((1,), np.int32)
    total_out = math.prod(ctx.shape)
    # 1. out = dest (skipped when ScatterInPlace's destination already is the output buffer)
    in_place_ok = ctx.node.op == "ScatterInPlace" and cg.is_contiguous_from(dest, total_out) == 0 and \
        np.dtype(dest.dtype) == np.dtype(ctx.dtype)
    before = len(plan.steps)
    elementwise(plan, options, "in0", [dest], [IN(0)], tuple(ctx.shape), ctx.dtype, OUT)
    if in_place_ok and len(plan.steps) > before:
        plan.steps[-1] = SkipIfSame(plan.steps[-1], OUT, IN(0))
    total = count * row_elems
    if total == 0:
        return plan
    il = view_loader("LoadI", idx, [(0, len(idx.view.shape))])
    sl = view_loader("LoadS", src, [(0, len(idx.view.shape)), (len(idx.view.shape), len(src.view.shape))])
    out_t = ctype(ctx.dtype)
    value = cg.convert("v", cg.compute_type(src.dtype), np.dtype(ctx.dtype))
    text = f"""{il}
{sl}
extern "C" __global__ void __launch_bounds__({BLOCK}) KNAME({out_t}* __restrict__ out,
    const {ctype(idx.dtype)}* __restrict__ index, const {ctype(src.dtype)}* __restrict__ src, int* flag) {{
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < {total}LL;
       i += (long long)gridDim.x * blockDim.x) {{
    const long long j = i / {row_elems}, e = i % {row_elems};
    const long long row = (long long)LoadI{{index}}(j);
    if (!lr_index_ok(row, {rows}LL, flag)) continue;
    const {cg.compute_type(src.dtype)} v = LoadS{{src}}(j, e);
    out[row * {row_elems}LL + e] = {value};
  }}
}}"""
    params = [f"{out_t}*", f"const {ctype(idx.dtype)}*", f"const {ctype(src.dtype)}*", "int*"]
    source = _source("scatter", text, params, sync=False)
    code = source.code.replace("LoadI", f"LI_{source.name}").replace("LoadS", f"LS_{source.name}")
    name = plan.kernel(KernelSource(source.name, source.params, code, False))
    plan.steps.append(_zero_flag(plan, options, SCRATCH(flag)))
    plan.steps.append(Launch(name, grid_1d(total, BLOCK, options.max_blocks), (BLOCK, 1, 1),
                             (OUT, IN(1), IN(2), SCRATCH(flag))))
    plan.steps.append(IndexCheck(SCRATCH(flag),
                                 f"{ctx.node.op} #{ctx.node.id}: row index out of range [0, {int(rows)})"))
    return plan


@dataclass(frozen=True)
class SkipIfSame:
    """A launch that is skipped when refs ``a`` and ``b`` bind to the same address (an in-place node whose
    destination the memory planner placed in the output buffer)."""

    launch: Launch
    a: Ref
    b: Ref


PREPARE = {
    **{op: prepare_elementwise for op in ("Log2", "Exp2", "Sin", "Sqrt", "Recip", "Add", "Mul", "Mod", "LessThan",
                                          "Cast", "Elementwise", "Concat", "Copy")},
    "Iota": prepare_iota,
    "SumReduce": prepare_reduce,
    "MaxReduce": prepare_reduce,
    "Softmax": prepare_rows,
    "LayerNorm": prepare_rows,
    "RMSNorm": prepare_rows,
    "GroupNorm": prepare_groupnorm,
    "RMSNormRoPE": prepare_rmsnorm_rope,
    "Gather": prepare_gather,
    "Scatter": prepare_scatter,
    "ScatterInPlace": prepare_scatter,
}

__all__ = ["CudaOptions", "CudaPrepareError", "PREPARE", "prepare", "Gemm", "Matrix", "matmul_desc",
           "split_batch"]


# ---- MatMul ----------------------------------------------------------------------------------------------------
def _unmasked(bv: BoundView) -> bool:
    return bv.mask is None or all(lo <= 0 and hi >= d for (lo, hi), d in zip(bv.mask, bv.shape))


def _gemm_readable(op: Operand, dtype) -> bool:
    bv = op.view
    return (np.dtype(op.dtype) == np.dtype(dtype) and _unmasked(bv) and cg.statically_in_bounds(bv, op.size)
            and Matrix(bv.shape[-2], bv.shape[-1], bv.strides[-2], bv.strides[-1], 0).as_cublas() is not None)


def gemm_operand(plan: NodePlan, options: CudaOptions, scratch, op: Operand, ref: Ref, dtype) -> tuple[BoundView,
                                                                                                      Ref]:
    """``op`` as cuBLAS reads it: its own view and ref when it can, else a contiguous copy in ``dtype`` made
    in scratch (batch axes that broadcast stay stride 0 in the copy, so a shared weight is copied once)."""
    if _gemm_readable(op, dtype):
        return op.view, ref
    bv = op.view
    lead = len(bv.shape) - 2
    own = tuple(1 if (k < lead and bv.strides[k] == 0) else d for k, d in enumerate(bv.shape))
    shrunk = BoundView(own, bv.strides, bv.offset, None if bv.mask is None else tuple(
        (0, 1) if own[k] == 1 and bv.shape[k] != 1 and lo <= 0 < hi else (lo, hi)
        for k, (lo, hi) in enumerate(bv.mask)))
    slot = scratch.add(own, dtype)
    copy_into(plan, options, Operand(shrunk, op.size, op.dtype), ref, dtype, SCRATCH(slot))
    strides = list(View.contiguous(own).bind({}).strides)
    for k in range(lead):
        if own[k] == 1 and bv.shape[k] != 1:
            strides[k] = 0
    return BoundView(tuple(bv.shape), tuple(strides), 0, None), SCRATCH(slot)


def batched_gemms(plan: NodePlan, x: tuple[BoundView, Ref], y: tuple[BoundView, Ref], out: tuple[BoundView, Ref],
                  types: tuple, alpha: float = 1.0, beta: float = 0.0) -> None:
    """``out[b] = alpha * x[b] @ y[b] + beta * out[b]`` over the common batch axes (all views already readable
    in place): one strided-batched GEMM per outer batch index (usually one in all)."""
    (xv, xr), (yv, yr), (ov, orf) = x, y, out
    batch = tuple(ov.shape[:-2])
    strides = [tuple(v.strides[:-2]) for v in (xv, yv, ov)]
    outer, count, outer_strides, inner = split_batch(batch, strides)
    x_t, y_t, o_t = (np.dtype(t) for t in types)
    for idx in np.ndindex(*outer):
        offs = [v.offset + sum(i * s for i, s in zip(idx, st)) for v, st in zip((xv, yv, ov), outer_strides)]
        xm = Matrix(xv.shape[-2], xv.shape[-1], xv.strides[-2], xv.strides[-1], offs[0])
        ym = Matrix(yv.shape[-2], yv.shape[-1], yv.strides[-2], yv.strides[-1], offs[1])
        ld = ov.strides[-2] if ov.shape[-2] > 1 else max(ov.shape[-1], 1)
        desc = matmul_desc(xm, ym, ld, count, inner[0], inner[1], inner[2], x_t, y_t, o_t, alpha, beta)
        desc.check()
        # cuBLAS's A is y (column-major out^T = y^T x^T), its B is x
        plan.steps.append(Gemm(desc, yr.at(offs[1], y_t.itemsize), xr.at(offs[0], x_t.itemsize),
                               orf.at(offs[2], o_t.itemsize)))


def _gemm_type(*dtypes) -> np.dtype:
    ds = {np.dtype(d) for d in dtypes}
    return ds.pop() if len(ds) == 1 and next(iter(ds)) in GEMM_TYPES else F32


def _accumulator(ctx, options, plan, gemm_t, has_bias: bool) -> tuple[Ref, np.dtype, int | None]:
    """Where the GEMM writes: the output itself when cuBLAS can produce its dtype directly (and no bias is
    added in f32 afterwards, unless the output is f32), else an f32 scratch the epilogue converts from."""
    out_t = np.dtype(ctx.dtype)
    if (gemm_t, out_t) in GEMM_OUT and (not has_bias or out_t == F32):
        return OUT, out_t, None
    slot = ctx.scratch.add(tuple(ctx.shape), F32)
    return SCRATCH(slot), F32, slot


def _epilogue(plan, options, ctx, acc_ref: Ref, acc_t, bias: tuple[Operand, Ref] | None) -> None:
    shape = tuple(ctx.shape)
    acc_op = _contiguous(shape, dtype=acc_t)
    if bias is not None:
        elementwise(plan, options, "(Add in0 in1)", [acc_op, bias[0]], [acc_ref, bias[1]], shape, ctx.dtype, OUT)
    elif acc_ref != OUT:
        elementwise(plan, options, "in0", [acc_op], [acc_ref], shape, ctx.dtype, OUT)


def prepare_matmul(ctx, options: CudaOptions) -> NodePlan:
    if len(ctx.inputs) not in (2, 3) or len(ctx.shape) < 2:
        raise CodegenError("expects inputs (a [..., M, K], b [..., K, N][, bias [..., M, N]])")
    ops = _operands(ctx)
    a, b = ops[0], ops[1]
    shape = tuple(ctx.shape)
    m, n = shape[-2:]
    k = a.view.shape[-1]
    if b.view.shape[-2] != k or a.view.shape[-2] != m or b.view.shape[-1] != n:
        raise CodegenError(f"shapes {a.view.shape} @ {b.view.shape} do not give {shape}")
    plan = NodePlan()
    gemm_t = _gemm_type(a.dtype, b.dtype)
    bias = (ops[2], IN(2)) if len(ops) == 3 else None
    acc_ref, acc_t, _ = _accumulator(ctx, options, plan, gemm_t, bias is not None)
    batch = shape[:-2]
    rows = math.prod(batch) * m
    out_view = View.contiguous(shape).bind({})
    if math.prod(shape) == 0:
        return plan
    merged = None
    if batch and len(a.view.shape) == len(shape) and all(d == 1 or s == 0 for d, s in zip(b.view.shape[:-2],
                                                                                           b.view.strides[:-2])):
        flat_a = _reshaped(a, (rows, k))
        if flat_a is not None and _unmasked(b.view):
            merged = flat_a
    if merged is not None:  # a linear layer: (B*M, K) @ (K, N), one GEMM
        xv, xr = gemm_operand(plan, options, ctx.scratch, merged, IN(0), gemm_t)
        bm = Operand(BoundView(b.view.shape[-2:], b.view.strides[-2:], b.view.offset, None), b.size, b.dtype)
        yv, yr = gemm_operand(plan, options, ctx.scratch, bm, IN(1), gemm_t)
        ov = View.contiguous((rows, n)).bind({})
        batched_gemms(plan, (xv, xr), (yv, yr), (ov, acc_ref), (gemm_t, gemm_t, acc_t))
    else:
        av = _broadcast_to(a, shape[:-2])
        bv = _broadcast_to(b, shape[:-2])
        xv, xr = gemm_operand(plan, options, ctx.scratch, av, IN(0), gemm_t)
        yv, yr = gemm_operand(plan, options, ctx.scratch, bv, IN(1), gemm_t)
        batched_gemms(plan, (xv, xr), (yv, yr), (out_view, acc_ref), (gemm_t, gemm_t, acc_t))
    if bias is not None and acc_ref == OUT:  # f32 output: add the bias in place
        elementwise(plan, options, "(Add in0 in1)", [_contiguous(shape), bias[0]], [OUT, bias[1]], shape, F32, OUT)
    else:
        _epilogue(plan, options, ctx, acc_ref, acc_t, bias)
    return plan


def _reshaped(op: Operand, shape: tuple[int, ...]) -> Operand | None:
    from luminal_recipes.runtimes.views import reshape_view

    bv = reshape_view(op.view, shape)
    return None if bv is None else Operand(bv, op.size, op.dtype)


def _broadcast_to(op: Operand, batch: tuple[int, ...]) -> Operand:
    """The operand with its batch axes left-padded/broadcast to ``batch`` (stride 0), as numpy broadcasts."""
    bv = op.view
    lead = len(batch) - (len(bv.shape) - 2)
    shape = tuple(batch) + tuple(bv.shape[-2:])
    strides = (0,) * lead + tuple(s if d == bd else 0 for d, s, bd in zip(bv.shape[:-2], bv.strides[:-2],
                                                                           batch[lead:])) + tuple(bv.strides[-2:])
    mask = None if bv.mask is None else ((0, 1),) * 0 + tuple((0, d) for d in batch[:lead]) + tuple(
        (lo, hi) if d == bd else (0, bd) for (lo, hi), d, bd in zip(bv.mask[:-2], bv.shape[:-2], batch[lead:])) \
        + tuple(bv.mask[-2:])
    return Operand(BoundView(shape, strides, bv.offset, mask), op.size, op.dtype)


PREPARE["MatMul"] = prepare_matmul


# ---- Attention (chunked: GEMM, softmax rows, GEMM per chunk of heads) -----------------------------------------
def prepare_attention(ctx, options: CudaOptions) -> NodePlan:
    if len(ctx.inputs) not in (3, 4) or len(ctx.shape) < 2:
        raise CodegenError("expects inputs (q [..., S, D], k [..., T, D], v [..., T, Dv][, bias [..., S, T]])")
    ops = _operands(ctx)
    shape = tuple(ctx.shape)
    s, dv = shape[-2:]
    t, d = ops[1].view.shape[-2:]
    if ops[0].view.shape[-2:] != (s, d) or ops[2].view.shape[-2:] != (t, dv):
        raise CodegenError(f"q {ops[0].view.shape}, k {ops[1].view.shape}, v {ops[2].view.shape} do not give out "
                           f"{shape}")
    if attention_path(options, ops, shape) == "flash":
        return prepare_flash(ctx, options, ops)
    return prepare_attention_chunked(ctx, options, ops)


def attention_seconds(options: CudaOptions, ops: list[Operand], shape) -> dict[str, float]:
    """Estimated seconds of each attention path on the device ``options`` describes.

    flash: 2 S T (D + Dv) FMA-flops per head on SIMT cores; q/k/v read once per query block, out written.
    chunked: the same flops on tensor cores (f16/bf16 operands; f32 GEMMs otherwise), plus the scores' round
    trips through memory: the f32 scores written by the first GEMM, read and written (in the GEMM type) by the
    softmax, read by the second GEMM, and three launches per chunk of heads. At FLUX.2's sizes (48 heads x
    4608^2, head dim 128, bf16) flash is ~17 ms a layer and chunked ~4.7 ms; for short sequences flash wins (no
    S x T traffic, one launch)."""
    heads = math.prod(shape[:-2])
    s, dv = shape[-2:]
    t, d = ops[1].view.shape[-2:]
    flops = 2.0 * heads * s * t * (d + dv)
    qkv_bytes = heads * (s * d + t * d + t * dv + s * dv) * ops[0].dtype.itemsize
    flash = flops / options.simt_flops + qkv_bytes / options.bytes_per_s + options.launch_s
    gemm_t = _gemm_type(ops[0].dtype, ops[1].dtype)
    gemm_flops = options.tensor_flops if gemm_t != F32 else options.f32_gemm_flops
    score_bytes = heads * s * t * (4 + 4 + 2 * gemm_t.itemsize)
    chunks = -(-heads // max(1, min(heads, options.score_budget // max(s * t, 1))))
    chunked = flops / gemm_flops + (score_bytes + qkv_bytes) / options.bytes_per_s + 3 * chunks * options.launch_s
    return {"flash": flash, "chunked": chunked}


def attention_path(options: CudaOptions, ops: list[Operand], shape) -> str:
    """"flash" or "chunked": as ``options.attention`` says, or the cheaper estimate when it says "auto"
    (flash only for head dims it supports)."""
    if options.attention == "chunked" or not flash_supported(ops, shape):
        return "chunked"
    if options.attention == "flash":
        return "flash"
    est = attention_seconds(options, ops, shape)
    return "flash" if est["flash"] <= est["chunked"] else "chunked"


def prepare_attention_chunked(ctx, options: CudaOptions, ops: list[Operand]) -> NodePlan:
    shape = tuple(ctx.shape)
    batch = shape[:-2]
    s, dv = shape[-2:]
    t, d = ops[1].view.shape[-2:]
    scale = float(ctx.node.attr("scale", 1.0))
    plan = NodePlan()
    if math.prod(shape) == 0:
        return plan
    qk_t = _gemm_type(ops[0].dtype, ops[1].dtype)
    pv_t = _gemm_type(ops[2].dtype)
    q, k, v = (_broadcast_to(op, batch) for op in ops[:3])
    qv, qr = gemm_operand(plan, options, ctx.scratch, q, IN(0), qk_t)
    kv, kr = gemm_operand(plan, options, ctx.scratch, k, IN(1), qk_t)
    vv, vr = gemm_operand(plan, options, ctx.scratch, v, IN(2), pv_t)
    bias = (_broadcast_to(ops[3], batch), IN(3)) if len(ops) == 4 else None
    acc_ref, acc_t, _ = _accumulator(ctx, options, plan, pv_t, False)
    out_view = View.contiguous(shape).bind({})
    outer, inner, outer_strides, inner_strides = split_batch(
        batch, [tuple(x.strides[:-2]) for x in (qv, kv, vv, out_view)])
    chunk = max(1, min(inner, options.score_budget // max(s * t, 1)))
    scores = ctx.scratch.add((chunk, s, t), F32)
    probs = scores if pv_t == F32 else ctx.scratch.add((chunk, s, t), pv_t)
    for oi, idx in enumerate(np.ndindex(*outer)):
        base = [x.offset + sum(i * st for i, st in zip(idx, sts)) for x, sts in zip((qv, kv, vv, out_view),
                                                                                     outer_strides)]
        for c0 in range(0, inner, chunk):
            cb = min(chunk, inner - c0)
            qo, ko, vo, oo = (b + c0 * st for b, st in zip(base, inner_strides))
            xm = Matrix(s, d, qv.strides[-2], qv.strides[-1], qo)
            ym = Matrix(d, t, kv.strides[-1], kv.strides[-2], ko)  # k^T
            desc = matmul_desc(xm, ym, t, cb, inner_strides[0], inner_strides[1], s * t, qk_t, qk_t, F32, scale)
            plan.steps.append(Gemm(desc, kr.at(ko, qk_t.itemsize), qr.at(qo, qk_t.itemsize), SCRATCH(scores)))
            scores_op = _contiguous((cb * s, t))
            rows_kernel(plan, options, "ROW_SOFTMAX", scores_op, SCRATCH(scores), cb * s, t, 0.0, pv_t,
                        SCRATCH(probs), bias=bias, row_base=(oi * inner + c0) * s)
            xm = Matrix(s, t, t, 1, 0)
            ym = Matrix(t, dv, vv.strides[-2], vv.strides[-1], vo)
            desc = matmul_desc(xm, ym, dv, cb, s * t, inner_strides[2], inner_strides[3], pv_t, pv_t, acc_t)
            plan.steps.append(Gemm(desc, vr.at(vo, pv_t.itemsize), SCRATCH(probs), acc_ref.at(oo, acc_t.itemsize)))
    _epilogue(plan, options, ctx, acc_ref, acc_t, None)
    return plan


FLASH_MAX_HEAD_DIM = 128  # shared-memory tiles of 32 keys x (D + Dv) f32 stay under the 48 KiB static limit
FLASH_MIN_HEAD_DIM = 64
FLASH_WARPS, FLASH_ROWS = 4, 4


def flash_supported(ops: list[Operand], shape) -> bool:
    d, dv = ops[1].view.shape[-1], ops[2].view.shape[-1]
    # below 64 (tiny test models) ptxas on sm_100 spills 4-8 bytes in this kernel: those use the chunked path
    return FLASH_MIN_HEAD_DIM <= d <= FLASH_MAX_HEAD_DIM and FLASH_MIN_HEAD_DIM <= dv <= FLASH_MAX_HEAD_DIM


def prepare_flash(ctx, options: CudaOptions, ops: list[Operand]) -> NodePlan:
    """The tiled kernel of ``kernels/attention.cuh``: q, k, v (and the bias) read through their views."""
    shape = tuple(ctx.shape)
    batch = shape[:-2]
    nb = len(batch)
    s, dv = shape[-2:]
    t, d = ops[1].view.shape[-2:]
    plan = NodePlan()
    heads = math.prod(batch)
    if heads * s * dv == 0:
        return plan
    groups = [(0, nb), (nb, nb + 1), (nb + 1, nb + 2)]
    views = [_broadcast_to(op, batch) for op in ops]
    names = ["LoadQ", "LoadK", "LoadV", "LoadB"][: len(views)]
    loaders = "\n".join(view_loader(n, v, groups) for n, v in zip(names, views))
    has_bias = len(views) == 4
    out_t = ctype(ctx.dtype)
    params = [f"{out_t}*"] + [f"const {ctype(v.dtype)}*" for v in views]
    sig = ", ".join([f"{out_t}* __restrict__ out"] + [f"const {ctype(v.dtype)}* __restrict__ {n.lower()[4:]}"
                                                      for n, v in zip(names, views)])
    bias = "LoadB{b}" if has_bias else "NoBias{}"
    scale = cg.float_literal(float(ctx.node.attr("scale", 1.0)))
    block = 32 * FLASH_WARPS
    text = f"""{loaders}
extern "C" __global__ void __launch_bounds__({block}) KNAME({sig}) {{
  flash_attention<{d}, {dv}, {FLASH_WARPS}, {FLASH_ROWS}, {"true" if has_bias else "false"}, {out_t}>(
      out, {heads}LL, {s}, {t}, {scale}, LoadQ{{q}}, LoadK{{k}}, LoadV{{v}}, {bias});
}}"""
    source = _source("flash", text, params, sync=True)
    code = source.code
    for n in names:
        code = code.replace(n, f"{n}_{source.name}")
    name = plan.kernel(KernelSource(source.name, source.params, code, True))
    work = heads * -(-s // (FLASH_WARPS * FLASH_ROWS))
    plan.steps.append(Launch(name, (max(1, min(work, options.max_blocks * 8)), 1, 1), (block, 1, 1),
                             tuple([OUT] + [IN(i) for i in range(len(views))])))
    return plan


PREPARE["Attention"] = prepare_attention
PREPARE["AttentionBlocked"] = prepare_attention


# ---- DequantMatMul: weight bands decoded into scratch, one GEMM per band ---------------------------------------
def prepare_dequant_matmul(ctx, options: CudaOptions) -> NodePlan:
    fmt = ctx.node.attr("format")
    n_out, k_in = int(ctx.node.attr("out_features")), int(ctx.node.attr("in_features"))
    ops = _operands(ctx)
    x = ops[0]
    shape = tuple(ctx.shape)
    if x.view.shape[-1] != k_in or shape != tuple(x.view.shape[:-1]) + (n_out,):
        raise CodegenError(f"x {x.view.shape} and out {shape} do not match in_features={k_in}, "
                           f"out_features={n_out}")
    n_scales = {"fp8": 3, "nvfp4": 4}.get(fmt)
    if n_scales is None:
        raise CodegenError(f"format must be 'fp8' or 'nvfp4', got {fmt!r}")
    if len(ops) not in (n_scales, n_scales + 1):
        raise CodegenError(f"{fmt} expects {n_scales} inputs (x, packed weight, scales) and an optional bias")
    plan = NodePlan()
    rows = math.prod(shape[:-1])
    if rows * n_out == 0:
        return plan
    if fmt == "fp8" and options.fp8_gemm == "cublaslt":
        why = _fp8_lt_refusal(ctx, options, ops, n_out, k_in)
        if why is None:
            return _prepare_fp8_lt(ctx, options, ops, n_out, k_in, rows)
    gemm_t = _gemm_type(x.dtype)
    if fmt == "fp8" and options.fp8_gemm == "cublaslt":
        options.notice(f"fp8 DequantMatMul through cuBLASLt FP8 (LUMINAL_FP8_GEMM=cublaslt) is not possible: {why}; "
                       f"decoding the weights to {to_dtype(gemm_t)} for cuBLAS instead")
    band = max(1, min(n_out, options.dequant_band // max(k_in, 1)))
    dense = ctx.scratch.add((band, k_in), gemm_t)
    decode = _fp8_decoder(ctx, ops, n_out, k_in, gemm_t) if fmt == "fp8" else \
        _nvfp4_decoder(ctx, ops, n_out, k_in, gemm_t)
    name = plan.kernel(decode)
    bias = (ops[n_scales], IN(n_scales)) if len(ops) > n_scales else None
    acc_ref, acc_t, _ = _accumulator(ctx, options, plan, gemm_t, bias is not None)
    xr_op = _reshaped(x, (rows, k_in)) or Operand(x.view, x.size, x.dtype)
    if len(xr_op.view.shape) != 2:  # not expressible as (rows, K): gemm_operand copies it at that shape
        raise CodegenError(f"x {x.view.shape} cannot be read as ({rows}, {k_in})")
    xv, xr = gemm_operand(plan, options, ctx.scratch, xr_op, IN(0), gemm_t)
    scale_refs = tuple(IN(i) for i in range(1, n_scales))
    for n0 in range(0, n_out, band):
        nb = min(band, n_out - n0)
        plan.steps.append(Launch(name, grid_1d(nb * k_in, BLOCK, options.max_blocks), (BLOCK, 1, 1),
                                 (SCRATCH(dense), *scale_refs, n0, nb)))
        xm = Matrix(rows, k_in, xv.strides[0], xv.strides[1], xv.offset)
        ym = Matrix(k_in, nb, 1, k_in, 0)  # the band [nb, K] read transposed
        desc = matmul_desc(xm, ym, n_out, 1, 0, 0, 0, gemm_t, gemm_t, acc_t)
        plan.steps.append(Gemm(desc, SCRATCH(dense), xr.at(xv.offset, gemm_t.itemsize), acc_ref.at(n0, acc_t.itemsize)))
    if bias is not None and acc_ref == OUT:
        elementwise(plan, options, "(Add in0 in1)", [_contiguous(shape), bias[0]], [OUT, bias[1]], shape, F32, OUT)
    else:
        _epilogue(plan, options, ctx, acc_ref, acc_t, bias)
    return plan


# ---- fp8 DequantMatMul as one cuBLASLt FP8 GEMM ------------------------------------------------------------------
def _fp8_scale(ops, n_out: int) -> tuple[Operand, bool]:
    """The weight scale as a 1-D operand ([1] per tensor, [N] per channel) and whether it is per channel."""
    s = ops[2]
    count = math.prod(s.view.shape)
    per_channel = count == n_out and n_out != 1 and tuple(s.view.shape) in ((n_out,), (n_out, 1))
    if not per_channel and count != 1:
        raise CodegenError(f"fp8 scale {s.view.shape} is neither per tensor ([] / [1]) nor per channel "
                           f"([{n_out}] / [{n_out}, 1])")
    return _reshaped(s, (n_out,) if per_channel else (1,)), per_channel


def _fp8_lt_output(ctx, ops, n_out: int, per_channel: bool) -> tuple[np.dtype, bool]:
    """cuBLASLt's D type, and whether D is the output itself: the output's dtype when it is written directly
    (bf16/f16/f32 output, per-tensor scale, no bias, 16-byte aligned rows), else f32 scratch for the epilogue."""
    out_t = np.dtype(ctx.dtype)
    direct = (out_t in (BF16, F16, F32) and not per_channel and len(ops) == 3
              and n_out * out_t.itemsize % 16 == 0)
    return (out_t, True) if direct else (F32, False)


def _fp8_lt_refusal(ctx, options: CudaOptions, ops: list[Operand], n_out: int, k_in: int) -> str | None:
    """Why this fp8 DequantMatMul cannot be one cuBLASLt FP8 GEMM here (None: it can)."""
    why = fp8_unsupported(options.arch) or (options.fp8_check() if options.fp8_check is not None else None)
    if why:
        return why
    x, w = ops[0], ops[1]
    if np.dtype(w.dtype) != E4M3:
        return f"the weight is {to_dtype(np.dtype(w.dtype))}, not f8e4m3"
    if np.dtype(x.dtype) not in (BF16, F16):
        return f"the activations are {to_dtype(np.dtype(x.dtype))} (FP8 x FP8 is for bf16/f16 compute)"
    if k_in % 16:
        return f"in_features {k_in} is not a multiple of 16"
    _, per_channel = _fp8_scale(ops, n_out)
    if n_out * _fp8_lt_output(ctx, ops, n_out, per_channel)[0].itemsize % 16:
        return f"out_features {n_out} does not give 16-byte aligned output rows"
    return None


def _fp8_quantizers(x: Operand, k_in: int, total: int) -> tuple[KernelSource, KernelSource]:
    """Two kernels putting the activations x (read through its view as [rows, K]) in e4m3 with one per-tensor
    scale: ``amax`` (max |x| as f32 bits, one atomicMax per block; NaN wins, as numpy's max) and ``quantize``
    (``s = amax / 448``, e4m3's largest finite value, 1 for an all-zero x; ``xq = e4m3(x * (448 / amax))``,
    round to nearest even; ``scale[0] = s`` for cuBLASLt's B scale). A NaN or inf in x makes every output NaN."""
    nd = len(x.view.shape)
    loader = view_loader("LoadX", x, [(0, nd - 1), (nd - 1, nd)])
    xt = ctype(x.dtype)
    amax = f"""{loader}
extern "C" __global__ void __launch_bounds__({BLOCK}) KNAME(unsigned* __restrict__ amax,
                                                       const {xt}* __restrict__ x) {{
  __shared__ float red[32];
  float m = 0.0f;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < {total}LL;
       i += (long long)gridDim.x * blockDim.x) {{
    m = MaxOp()(m, fabsf(LoadX{{x}}(i / {k_in}, i % {k_in})));
  }}
  m = block_reduce<{BLOCK}>(m, MaxOp(), 0.0f, red);
  if (threadIdx.x == 0) atomicMax(amax, (unsigned)__float_as_int(m));  // |x| >= 0: bits order as values
}}"""
    quant = f"""{loader}
extern "C" __global__ void __launch_bounds__({BLOCK}) KNAME(f8e4m3* __restrict__ xq, float* __restrict__ scale,
                                                       const unsigned* __restrict__ amax_bits,
                                                       const {xt}* __restrict__ x) {{
  const float amax = __int_as_float((int)amax_bits[0]);
  const float s = amax == 0.0f ? 1.0f : amax / 448.0f;
  const float inv = amax == 0.0f ? 1.0f : 448.0f / amax;
  if (blockIdx.x == 0 && threadIdx.x == 0) scale[0] = s;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < {total}LL;
       i += (long long)gridDim.x * blockDim.x) {{
    xq[i] = from_f32<f8e4m3>(LoadX{{x}}(i / {k_in}, i % {k_in}) * inv);
  }}
}}"""
    out = []
    for prefix, text, params, sync in (("fp8amax", amax, ["unsigned*", f"const {xt}*"], True),
                                       ("fp8quant", quant, ["f8e4m3*", "float*", "const unsigned*",
                                                            f"const {xt}*"], False)):
        source = _source(prefix, text, params, sync)
        out.append(KernelSource(source.name, source.params, source.code.replace("LoadX", f"LX_{source.name}"),
                                sync))
    return out[0], out[1]


def _prepare_fp8_lt(ctx, options: CudaOptions, ops: list[Operand], n_out: int, k_in: int, rows: int) -> NodePlan:
    """``out = x @ (W * s_w).T`` as ``(e4m3(x / s_x) @ W^T) * s_x * s_w``: x quantized to e4m3 with a per-tensor
    scale s_x (two small kernels), one cuBLASLt FP8 GEMM in TN layout (W [N, K] row-major is A, read in place;
    the quantized x [rows, K] is B; A/B scale pointers s_w / s_x), then an epilogue for per-channel scales, a
    bias or another output dtype."""
    plan = NodePlan()
    shape = tuple(ctx.shape)
    x, w = ops[0], ops[1]
    s1, per_channel = _fp8_scale(ops, n_out)
    d_t, direct = _fp8_lt_output(ctx, ops, n_out, per_channel)
    # the activations, quantized
    total = rows * k_in
    amax = ctx.scratch.add((1,), np.uint32)
    xscale = ctx.scratch.add((1,), F32)
    xq = ctx.scratch.add((rows, k_in), E4M3)
    amax_k, quant_k = (plan.kernel(k) for k in _fp8_quantizers(x, k_in, total))
    plan.steps.append(_zero_flag(plan, options, SCRATCH(amax)))
    plan.steps.append(Launch(amax_k, grid_1d(total, BLOCK, options.max_blocks), (BLOCK, 1, 1),
                             (SCRATCH(amax), IN(0))))
    plan.steps.append(Launch(quant_k, grid_1d(total, BLOCK, options.max_blocks), (BLOCK, 1, 1),
                             (SCRATCH(xq), SCRATCH(xscale), SCRATCH(amax), IN(0))))
    # the weight, in place when it is [N, K] row-major with 16-byte aligned rows (else an e4m3 copy)
    wv = w.view
    if (tuple(wv.shape) == (n_out, k_in) and _unmasked(wv) and cg.statically_in_bounds(wv, w.size)
            and wv.strides[1] == 1 and wv.strides[0] >= k_in and wv.strides[0] % 16 == 0 and wv.offset % 16 == 0):
        wref, lda = IN(1).at(wv.offset, 1), wv.strides[0]
    else:
        slot = ctx.scratch.add((n_out, k_in), E4M3)
        copy_into(plan, options, Operand(wv, w.size, w.dtype), IN(1), E4M3, SCRATCH(slot))
        wref, lda = SCRATCH(slot), k_in
    # the weight's scale: cuBLASLt's A scale (an f32 scalar in device memory) or, per channel, the epilogue's
    a_scale = None
    if not per_channel:
        if np.dtype(s1.dtype) == F32 and _unmasked(s1.view) and cg.statically_in_bounds(s1.view, s1.size):
            a_scale = IN(2).at(s1.view.offset, 4)
        else:
            slot = ctx.scratch.add((1,), F32)
            copy_into(plan, options, s1, IN(2), F32, SCRATCH(slot))
            a_scale = SCRATCH(slot)
    ws = workspace_bytes(n_out, rows)
    workspace = ctx.scratch.add((ws,), np.uint8)
    d_ref = OUT if direct else SCRATCH(ctx.scratch.add(shape, F32))
    desc = LtDesc(trans_a=True, trans_b=False, m=n_out, n=rows, k=k_in, lda=lda, ldb=k_in, ldd=n_out,
                  a_type=E4M3, b_type=E4M3, d_type=d_t, a_scale=a_scale is not None, b_scale=True, workspace=ws)
    desc.check()
    plan.steps.append(LtGemm(desc, wref, SCRATCH(xq), d_ref, a_scale, SCRATCH(xscale), SCRATCH(workspace)))
    if d_ref == OUT:
        return plan
    # epilogue: out = D [* s_w per channel] [+ bias], in the output's dtype
    expr, operands, refs = "in0", [_contiguous(shape, dtype=F32)], [d_ref]
    if per_channel:
        sv = s1.view
        lead = shape[:-1]
        mask = None if sv.mask is None else tuple((0, d) for d in lead) + tuple(sv.mask)
        operands.append(Operand(BoundView(shape, (0,) * len(lead) + (sv.strides[0],), sv.offset, mask), s1.size,
                                s1.dtype))
        refs.append(IN(2))
        expr = f"(Mul {expr} in1)"
    if len(ops) > 3:
        operands.append(ops[3])
        refs.append(IN(3))
        expr = f"(Add {expr} in{len(operands) - 1})"
    elementwise(plan, options, expr, operands, refs, shape, ctx.dtype, OUT)
    return plan


def _decoder_source(prefix: str, loaders: str, params: list[str], sig: str, k_in: int, value: str,
                    out_t: str) -> KernelSource:
    text = f"""{loaders}
extern "C" __global__ void __launch_bounds__({BLOCK}) KNAME({out_t}* __restrict__ band, {sig}, int n0, int nb) {{
  const long long total = (long long)nb * {k_in};
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
       i += (long long)gridDim.x * blockDim.x) {{
    const long long row = n0 + i / {k_in};
    const long long k = i % {k_in};
    {value}
    band[i] = from_f32<{out_t}>(w);
  }}
}}"""
    source = _source(prefix, text, [f"{out_t}*", *params, "int", "int"], sync=False)
    code = source.code
    for tag in ("LoadW", "LoadS", "LoadS2"):
        code = code.replace(tag + "{", f"{tag}_{source.name}{{")
        code = code.replace(f"struct {tag} ", f"struct {tag}_{source.name} ")
    return KernelSource(source.name, source.params, code, False)


def _fp8_decoder(ctx, ops, n_out, k_in, gemm_t) -> KernelSource:
    w, s = ops[1], ops[2]
    if tuple(w.view.shape) != (n_out, k_in):
        raise CodegenError(f"fp8 weight is {w.view.shape}, expected {(n_out, k_in)}")
    count = math.prod(s.view.shape)
    per_channel = count == n_out and n_out != 1 and tuple(s.view.shape) in ((n_out,), (n_out, 1))
    if not per_channel and count != 1:
        raise CodegenError(f"fp8 scale {s.view.shape} is neither per tensor ([] / [1]) nor per channel "
                           f"([{n_out}] / [{n_out}, 1])")
    s1 = _reshaped(s, (n_out,) if per_channel else (1,))
    loaders = view_loader("LoadW", w, [(0, 1), (1, 2)]) + "\n" + view_loader("LoadS", s1, [(0, 1)])
    value = f"const float w = LoadW{{weight}}(row, k) * LoadS{{scale}}({'row' if per_channel else '0'});"
    sig = f"const {ctype(w.dtype)}* __restrict__ weight, const {ctype(s.dtype)}* __restrict__ scale"
    return _decoder_source("fp8", loaders, [f"const {ctype(w.dtype)}*", f"const {ctype(s.dtype)}*"], sig, k_in,
                           value, ctype(gemm_t))


def _nvfp4_decoder(ctx, ops, n_out, k_in, gemm_t) -> KernelSource:
    layout = ctx.node.attr("layout", "modelopt")
    if layout not in ("modelopt", "comfy"):
        raise CodegenError(f"nvfp4 layout must be 'modelopt' or 'comfy', got {layout!r}")
    if k_in % 16:
        raise CodegenError(f"nvfp4 needs in_features divisible by 16, got {k_in}")
    blocks = k_in // 16
    w, s, s2 = ops[1], ops[2], ops[3]
    if layout == "modelopt":
        want_w, want_s = (n_out, k_in // 2), (n_out, blocks)
    else:
        want_w = (-(-n_out // 16) * 16, -(-k_in // 16) * 16 // 2)
        want_s = (-(-n_out // 128) * 128, -(-blocks // 4) * 4)
    if tuple(w.view.shape) != want_w or tuple(s.view.shape) != want_s or math.prod(s2.view.shape) != 1:
        raise CodegenError(f"nvfp4 ({layout}) weight {w.view.shape}, weight_scale {s.view.shape}, weight_scale_2 "
                           f"{s2.view.shape}; expected {want_w}, {want_s} and one value for a [{n_out}, {k_in}] "
                           "weight")
    s2_1 = _reshaped(s2, (1,))
    loaders = "\n".join([view_loader("LoadW", w, [(0, 1), (1, 2)]),
                         view_loader("LoadS", s, [(0, 2)] if layout == "comfy" else [(0, 1), (1, 2)]),
                         view_loader("LoadS2", s2_1, [(0, 1)])])
    if layout == "modelopt":
        nibble = "(k & 1) ? (b >> 4) : (b & 15)"  # element 0 in the low nibble
        scale = "LoadS{scale}(row, k / 16)"
    else:
        nibble = "(k & 1) ? (b & 15) : (b >> 4)"  # element 0 in the high nibble
        ncb = want_s[1] // 4
        # logical (row, col) of the 128x4-tiled scales: tile (row/128, col/4), inside it (row%32, row%128/32, col%4)
        scale = (f"LoadS{{scale}}((((row / 128) * {ncb} + (k / 16) / 4) * 32 + row % 32) * 16 + "
                 f"((row % 128) / 32) * 4 + (k / 16) % 4)")
    value = f"""const int b = (int)LoadW{{weight}}(row, k / 2);
    const int code = {nibble};
    const int mag = code & 7;
    const float e2m1 = (mag < 2 ? 0.5f * mag : (float)(2 + (mag & 1)) * (float)(1 << ((mag >> 1) - 1)) * 0.5f)
                       * ((code & 8) ? -1.0f : 1.0f);
    const float w = (e2m1 * {scale}) * LoadS2{{scale2}}(0);"""
    sig = (f"const {ctype(w.dtype)}* __restrict__ weight, const {ctype(s.dtype)}* __restrict__ scale, "
           f"const {ctype(s2.dtype)}* __restrict__ scale2")
    return _decoder_source("nvfp4", loaders, [f"const {ctype(w.dtype)}*", f"const {ctype(s.dtype)}*",
                                              f"const {ctype(s2.dtype)}*"], sig, k_in, value, ctype(gemm_t))


PREPARE["DequantMatMul"] = prepare_dequant_matmul


# ---- Conv2d: im2col tiles in scratch + one batched GEMM per tile ---------------------------------------------
def prepare_conv2d(ctx, options: CudaOptions) -> NodePlan:
    if len(ctx.inputs) not in (2, 3):
        raise CodegenError("expects inputs (x [N, C, H, W], w [O, C, kh, kw][, bias viewed at [N, O, Ho, Wo]])")
    ops = _operands(ctx)
    x, w = ops[0], ops[1]
    (nb, c, h, wd), (o, c2, kh, kw) = x.view.shape, w.view.shape
    stride = ctx.node.attr("stride", 1)
    sh, sw = (int(stride), int(stride)) if np.ndim(stride) == 0 else (int(stride[0]), int(stride[1]))
    shape = tuple(ctx.shape)
    try:  # the Ho x Wo windows the rule gives, each inside the input (as the numpy kernel checks them)
        conv_windows((nb, c, h, wd), (o, c2, kh, kw), (sh, sw), shape)
    except ValueError as exc:
        raise CodegenError(str(exc)) from None
    ho, wo = shape[2], shape[3]
    plan = NodePlan()
    if math.prod(shape) == 0:
        return plan
    ckk, p = c * kh * kw, ho * wo
    gemm_t = _gemm_type(x.dtype, w.dtype)
    bias = (ops[2], IN(2)) if len(ops) == 3 else None
    acc_ref, acc_t, _ = _accumulator(ctx, options, plan, gemm_t, bias is not None)
    if kh == kw == 1 and sh == sw == 1 and _conv1x1(plan, options, ctx, x, w, (gemm_t, acc_t), acc_ref):
        _conv_epilogue(plan, options, ctx, shape, acc_ref, acc_t, bias)
        return plan
    w2 = _reshaped(w, (o, ckk))
    if w2 is None:
        w2 = Operand(BoundView((o, ckk), (ckk, 1), 0, None), o * ckk, w.dtype)
        slot = ctx.scratch.add((o, ckk), gemm_t)
        copy_into(plan, options, Operand(w.view, w.size, w.dtype), IN(1), gemm_t, SCRATCH(slot))
        wv, wr = w2.view, SCRATCH(slot)
    else:
        wv, wr = gemm_operand(plan, options, ctx.scratch, w2, IN(1), gemm_t)
    if ckk * p <= options.conv_cols:
        images, rows = max(1, min(nb, options.conv_cols // (ckk * p))), ho
    else:
        images, rows = 1, max(1, min(ho, options.conv_cols // max(ckk * wo, 1)))
    cols = ctx.scratch.add((images * ckk * rows * wo,), gemm_t)
    name = plan.kernel(_im2col_source(x, c, kh, kw, sh, sw, wo, gemm_t))
    for n0 in range(0, nb, images):
        ni = min(images, nb - n0)
        for r0 in range(0, ho, rows):
            nr = min(rows, ho - r0)
            plan.steps.append(Launch(name, grid_1d(ni * ckk * nr * wo, BLOCK, options.max_blocks), (BLOCK, 1, 1),
                                     (SCRATCH(cols), IN(0), n0, ni, r0, nr)))
            pt = nr * wo
            xm = Matrix(o, ckk, wv.strides[0], wv.strides[1], wv.offset)
            ym = Matrix(ckk, pt, pt, 1, 0)
            out_off = n0 * o * p + r0 * wo
            desc = matmul_desc(xm, ym, p, ni, 0, ckk * pt, o * p, gemm_t, gemm_t, acc_t)
            plan.steps.append(Gemm(desc, SCRATCH(cols), wr.at(wv.offset, gemm_t.itemsize),
                                   acc_ref.at(out_off, acc_t.itemsize)))
    _conv_epilogue(plan, options, ctx, shape, acc_ref, acc_t, bias)
    return plan


def _conv_epilogue(plan, options, ctx, shape, acc_ref, acc_t, bias) -> None:
    if bias is not None and acc_ref == OUT:
        elementwise(plan, options, "(Add in0 in1)", [_contiguous(shape), bias[0]], [OUT, bias[1]], shape, F32, OUT)
    else:
        _epilogue(plan, options, ctx, acc_ref, acc_t, bias)


def _conv1x1(plan, options, ctx, x: Operand, w: Operand, types, acc_ref: Ref) -> bool:
    """A 1x1, stride-1 convolution is a GEMM per image, out[n] [O, H*W] = w [O, C] @ x[n] [C, H*W], with x read
    in place (no im2col): one strided-batched GEMM over the images, the weight broadcast by stride 0. False
    when x or w cannot be viewed as those matrices (the im2col path handles them)."""
    (nb, c, h, wd), o = x.view.shape, w.view.shape[0]
    x3, w2 = _reshaped(x, (nb, c, h * wd)), _reshaped(w, (o, c))
    if x3 is None or w2 is None:
        return False
    gemm_t, acc_t = types
    xv, xr = gemm_operand(plan, options, ctx.scratch, x3, IN(0), gemm_t)
    wv, wr = gemm_operand(plan, options, ctx.scratch, w2, IN(1), gemm_t)
    wb = BoundView((nb, o, c), (0, *wv.strides), wv.offset, None)
    out = View.contiguous((nb, o, h * wd)).bind({})
    batched_gemms(plan, (wb, wr), (xv, xr), (out, acc_ref), (gemm_t, gemm_t, acc_t))
    return True


def _im2col_source(x: Operand, c: int, kh: int, kw: int, sh: int, sw: int, wo: int, gemm_t) -> KernelSource:
    """cols[img][c, ky, kx][oy - r0, ox] = x[n0 + img, c, oy * sh + ky, ox * sw + kx] (0 in the padding)."""
    loader = view_loader("LoadX", x, [(0, 1), (1, 2), (2, 3), (3, 4)])
    out_t = ctype(gemm_t)
    ckk = c * kh * kw
    text = f"""{loader}
extern "C" __global__ void __launch_bounds__({BLOCK}) KNAME({out_t}* __restrict__ cols,
    const {ctype(x.dtype)}* __restrict__ x, int n0, int ni, int r0, int nr) {{
  const long long total = (long long)ni * {ckk} * nr * {wo};
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
       i += (long long)gridDim.x * blockDim.x) {{
    const long long ox = i % {wo};
    long long t = i / {wo};
    const long long oy = r0 + t % nr;
    t /= nr;
    const long long ck = t % {ckk};
    const long long img = n0 + t / {ckk};
    const long long ch = ck / {kh * kw}, ky = (ck / {kw}) % {kh}, kx = ck % {kw};
    cols[i] = from_f32<{out_t}>(LoadX{{x}}(img, ch, oy * {sh} + ky, ox * {sw} + kx));
  }}
}}"""
    source = _source("im2col", text, [f"{out_t}*", f"const {ctype(x.dtype)}*", "int", "int", "int", "int"],
                     sync=False)
    code = source.code.replace("LoadX", f"LoadX_{source.name}")
    return KernelSource(source.name, source.params, code, False)


PREPARE["Conv2d"] = prepare_conv2d


# ---- GGUF block-quantized weights (gguf_nodes.py) ------------------------------------------------------------
from .gguf_nodes import PREPARE as _GGUF_PREPARE  # noqa: E402 - its kernels use this module's helpers

PREPARE.update(_GGUF_PREPARE)
