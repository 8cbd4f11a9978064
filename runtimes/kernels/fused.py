"""The fused kernels egglog rules discover (``compiler/rules/*.egg``): one ``KernelSpec`` each.

Adding a kernel: its spec here (constructors, operands, attributes, cost, aliasing, semantics), the rule that
finds it (a ``compiler/rules/*.egg`` file), and its implementation in every backend (``runtimes/cpu/kernels/``
for numpy). Float kernels other than the primitives compute in f32 unless their doc says otherwise.
"""

from __future__ import annotations

import numpy as np

from .spec import Ctor, KernelCall, KernelSpec, Work, data_elements, expression_ops, touched


def _matmul(k: KernelCall) -> Work:
    return k.base(mm_flops=2.0 * k.out_numel * k.dim(k.inputs[0][0].shape[-1]))


def _elementwise(k: KernelCall) -> Work:
    # during extraction the expression is costed node by node (its loads and operations), not here
    ops = expression_ops(k.attrs.get("expr", ""))
    return k.base(ew_ops={op: n * k.out_numel for op, n in ops.items()})


def _per_element(flops: float):
    def cost(k: KernelCall) -> Work:
        return k.base(ew_flops=flops * k.out_numel)

    return cost


def _group_norm(k: KernelCall) -> Work:
    # LayerNorm's statistics and normalising pass with the affine transform (and the activation's exp and
    # division) in the same pass: the normalised tensor is never written out and read back
    return k.base(ew_flops=(8.0 + (6.0 if k.attrs.get("act") else 2.0)) * k.out_numel)


def _attention(k: KernelCall) -> Work:
    q, kk = k.inputs[0][0], k.inputs[1][0]
    s, t, d = k.dim(q.shape[-2]), k.dim(kk.shape[-2]), k.dim(q.shape[-1])
    batch = k.numel(q.shape[:-2])
    dv = k.dim(k.out_shape[-1])
    scores = batch * s * t
    # the two products, and one pass per score (max, exp and row sum: compiled on CPU, in registers on a GPU)
    # over scores that never leave a cache-sized block per core (or the GPU's shared memory): no memory traffic
    # for them, unlike an unfused MatMul -> Softmax -> MatMul that writes and reads them back
    work = k.base(mm_flops=2.0 * scores * (d + dv), ew_flops=2.0 * scores)
    if "block" in k.attrs:  # online softmax: per key block two more products, the accumulator and sums rescaled
        blocks = max(1, -(-t // int(k.attrs["block"])))
        work.ew_flops += 2.0 * batch * s * (dv + 1) * blocks
        work.launches += 4 * batch * (blocks - 1)  # the calls of each extra key block, per head
    return work


def _conv2d(k: KernelCall) -> Work:
    return k.base(mm_flops=2.0 * k.out_numel * k.numel(k.inputs[1][0].shape[1:]))


def conv_windows(x_shape, w_shape, stride, out_shape) -> tuple[int, int]:
    """(sh, sw) after checking that ``out_shape`` [N, O, Ho, Wo] are windows of ``w_shape`` [O, C, kh, kw] inside
    ``x_shape`` [N, C, H, W] at ``stride``: Ho x Wo windows starting at 0, every one inside the input (the rule
    may give fewer than fit; ops.conv2d gives all of them)."""
    (nb, c, h, w), (o, c2, kh, kw) = x_shape, w_shape
    sh, sw = (int(stride), int(stride)) if np.ndim(stride) == 0 else (int(stride[0]), int(stride[1]))
    ok = (c2 == c and len(out_shape) == 4 and tuple(out_shape[:2]) == (nb, o)
          and (out_shape[2] - 1) * sh + kh <= h and (out_shape[3] - 1) * sw + kw <= w)
    if not ok:
        raise ValueError(f"x {tuple(x_shape)}, w {tuple(w_shape)}, stride {(sh, sw)} do not give {tuple(out_shape)}")
    return sh, sw


def _dequant_matmul(k: KernelCall) -> Work:
    work = _matmul(k)
    work.ew_flops = 2.0 * k.attrs.get("out_features", 1) * k.attrs.get("in_features", 1)
    return work


def _scatter_in_place(k: KernelCall) -> Work:
    # only the rows written move (read from the source, written into the destination), not the destination
    work = k.base()
    work.bytes += 2 * touched(k.inputs[2][0], k.dims) * k.out_dtype.bits / 8 - k.written \
        - touched(k.inputs[0][0], k.dims) * k.out_dtype.bits / 8
    return work


def _moved(k: KernelCall) -> Work:
    # each operand's data (its mask's box, broadcast axes once) is read once; the output is written once
    read = sum(data_elements(view, k.dims) * dtype.bits / 8 for view, dtype in k.inputs)
    return Work(bytes=read + k.written)


FUSED: list[KernelSpec] = [
    KernelSpec(
        "MatMul", "out [..., M, N] = a @ b (+ bias), accumulated in f32.",
        {"MatMul": Ctor("a:Ld b:Ld"), "MatMulBias": Ctor("a:Ld b:Ld bias:Ld")},
        "a [..., M, K], b [..., K, N][, bias [..., M, N]]; any strides (transposes and broadcast batch axes "
        "are views)", cost=_matmul),
    KernelSpec(
        "Elementwise", "the expression evaluated per element into one output buffer.",
        # the output's shape and dtype are part of the term: an expression of constants alone has neither, and two
        # such kernels of different shapes or dtypes must not be one e-class
        {"Elementwise": Ctor("expr:EX shape:Dims dtype:String", attrs=lambda literals, views: {})},
        "in0..inN, each viewed at the output shape",
        {"expr": "an s-expression over the inputs (in0, in1...), constants (Const <float>), the primitive "
                 "unary/binary ops, Exp (e^x) and (Cast <dtype> x), e.g. '(Mul in0 (Recip (Add (Exp in1) "
                 "(Const 1.0))))'; floats compute in f32, integers in their dtype, LessThan gives bool, a "
                 "constant takes its partner operand's type, the result converts to the node's dtype "
                 "(runtimes/kernels/expression.py is the grammar)"},
        cost=_elementwise, elementwise_inplace=True),
    KernelSpec("Softmax", "out = softmax over the last axis (max-subtracted).",
               {"Softmax": Ctor("x:Ld")}, "x [..., N]", cost=_per_element(5.0)),
    KernelSpec("LayerNorm", "out = (x - mean) / sqrt(var + eps) over the last axis (a GroupNorm without an affine "
               "transform is this kernel on the [N, groups, C/groups*HW] view; with one, the GroupNorm kernel), then "
               "times scale and plus shift when given (the adaptive "
               "norm's modulation, in f32: ((x - mean) * inv) * scale + shift).",
               {"LayerNorm": Ctor("x:Ld eps:f64"), "LayerNormAffine": Ctor("x:Ld scale:Ld shift:Ld eps:f64")},
               "x [..., N][, scale, shift viewed at the output shape]", {"eps": "added to the variance"},
               cost=_per_element(8.0), version="2"),
    KernelSpec("GroupNorm", "out [N, C, H, W] = GroupNorm with its affine transform, then SiLU when act is "
               "'silu': x [N, G, n] (n = C/G*H*W, G dividing C) normalised over its last axis as LayerNorm does "
               "(two-pass mean and variance, in f32), its rows written in order as out's [N, C, H, W] (a reshape), "
               "then times scale plus shift: t = ((x - mean) * (inv * scale)) + shift; SiLU: t * sigmoid(t).",
               {"GroupNormAffine": Ctor("x:Ld scale:Ld shift:Ld eps:f64", fixed={"act": ""}),
                "GroupNormSiLU": Ctor("x:Ld scale:Ld shift:Ld eps:f64", fixed={"act": "silu"})},
               "x [N, G, n], scale and shift viewed at the output shape [N, C, H, W]",
               {"eps": "added to the variance", "act": "'' (none) or 'silu'"}, cost=_group_norm),
    KernelSpec("RMSNorm", "out = x / sqrt(mean(x^2) + eps) over the last axis, then times scale when given (the "
               "norm's weight, in f32: (x * inv) * scale).",
               {"RMSNorm": Ctor("x:Ld eps:f64"), "RMSNormScale": Ctor("x:Ld scale:Ld eps:f64")},
               "x [..., N][, scale viewed at the output shape]", {"eps": "added to the mean square"},
               cost=_per_element(5.0), version="2"),
    KernelSpec(
        "RMSNormRoPE", "out [..., S, D/2, 2] = the rotary embedding (adjacent pairs, FLUX.2's convention) of y = "
        "RMSNorm(x) * scale, in one pass: per pair (y0, y1) = (y[2i], y[2i+1]) of a row, out[i, 0] = y0 * cos[i, 0] "
        "+ y1 * (sin[i, 0] * -1), out[i, 1] = y1 * cos[i, 1] + y0 * sin[i, 1]; y = (x * inv) * scale as RMSNormScale "
        "computes it (inv = 1 / sqrt(mean(x^2) + eps)), all in f32, y not rounded to the output dtype before the "
        "rotation.",
        {"RMSNormRoPE": Ctor("x:Ld scale:Ld cos:Ld sin:Ld eps:f64")},
        "x [..., S, D] (D even) and scale viewed at x's shape; cos and sin (the tables, broadcast over the leading "
        "axes) viewed at the output shape [..., S, D/2, 2]", {"eps": "added to the mean square"},
        cost=_per_element(9.0)),
    KernelSpec(
        "Attention", "out [..., S, Dv] = softmax(q k^T * scale + bias) v, never materialising (S, T, D).",
        {"Attention": Ctor("q:Ld k:Ld v:Ld scale:f64"), "AttentionBias": Ctor("q:Ld k:Ld v:Ld bias:Ld scale:f64")},
        "q [..., S, D], k [..., T, D], v [..., T, Dv][, bias [..., S, T]]", {"scale": "the scores' factor"},
        cost=_attention),
    KernelSpec(
        "AttentionBlocked", "as Attention, with keys processed block by block with an online softmax, never "
        "materialising (S, T).",
        {"AttentionBlocked": Ctor("q:Ld k:Ld v:Ld scale:f64 block:i64"),
         "AttentionBlockedBias": Ctor("q:Ld k:Ld v:Ld bias:Ld scale:f64 block:i64")},
        "as Attention", {"scale": "the scores' factor", "block": "keys per block"}, cost=_attention),
    KernelSpec(
        "Conv2d", "out [N, O, Ho, Wo] = the 2-D convolution of x (read through its view: zero padding is a masked "
        "view) with w (+ bias): out[n, o, y, x] = sum w[o, c, i, j] x[n, c, y*sh + i, x*sw + j], for the Ho x Wo "
        "windows of the output shape (each inside x).",
        {"Conv2d": Ctor("x:Ld w:Ld stride:i64"), "Conv2dBias": Ctor("x:Ld w:Ld bias:Ld stride:i64")},
        "x [N, C, H, W], w [O, C, kh, kw][, bias viewed at [N, O, Ho, Wo]]",
        {"stride": "an int, or an (sh, sw) pair"}, cost=_conv2d),
    KernelSpec(
        "DequantMatMul", "out [..., M, out_features] = x @ dequant(W).T, W stays packed (ops.quant's decoding).",
        {"DequantFP8": Ctor("x:Ld weight:Ld scale:Ld out_features:i64 in_features:i64",
                            fixed={"format": "fp8", "layout": ""}),
         "DequantNVFP4": Ctor("layout:String x:Ld packed:Ld scales:Ld scale_2:Ld out_features:i64 in_features:i64",
                              fixed={"format": "nvfp4"})},
        "x [..., M, K], then as ops.quant takes them - fp8: (weight f8 [N, K], weight_scale f32 [] | [1] | [N] | "
        "[N, 1]); nvfp4: (weight u8, weight_scale f8e4m3, weight_scale_2 f32 [] | [1]) with "
        "ops.quant.dequant_nvfp4's shapes for each layout (comfy: padded rows, 128x4-swizzled scales) - then an "
        "optional bias viewed at the output shape",
        {"format": "'fp8' | 'nvfp4'", "layout": "nvfp4: 'modelopt' | 'comfy' (fp8: ignored)",
         "out_features": "N", "in_features": "K"}, cost=_dequant_matmul),
    KernelSpec(
        "ScatterInPlace", "as Scatter, but writes into the destination's buffer (legal only when nothing else "
        "reads the destination afterwards; the memory planner aliases the two, else it copies first).",
        {"ScatterInPlace": Ctor("dest:Ld index:Ld src:Ld")}, "as Scatter", cost=_scatter_in_place,
        writes_into=0),
    KernelSpec(
        "Concat", "out = a + b, each read through its zero-padded view (concat and stack are pad(a) + pad(b)): "
        "each operand's data is added into place and zeros written only where neither has data (-0.0 comes out "
        "+0.0, as in the sum).",
        {"Concat": Ctor("a:Ld b:Ld")}, "a, b of the output's dtype, viewed at the output shape, at least one "
        "masked", cost=_moved, elementwise_inplace=True),
    KernelSpec(
        "Copy", "out = x read through its view (zero where masked): a materialised view (contiguous(), padding, "
        "im2col, a layout change).",
        {"Copy": Ctor("x:Ld")}, "x of the output's dtype, viewed at the output shape", cost=_moved,
        elementwise_inplace=True),
]
