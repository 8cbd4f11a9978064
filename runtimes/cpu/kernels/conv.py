"""``Conv2d``: Winograd F(2x2, 3x3), a compiled direct convolution, or im2col + BLAS, by shape."""

from __future__ import annotations

import contextlib
import functools
import math

import numpy as np

from ...kernels.context import Bind, KernelContext
from ...kernels.fused import conv_windows
from ...views import alias, strided, zero_padded
from .. import cblas, jit
from .. import threads as cpu_threads
from . import matmul
from .common import F32, bind_all, view_reshape, with_refresh
from .operands import operand

CONV_TILE = 1 << 20  # elements of the im2col scratch per tile
# the compiled direct convolution (numba_kernels.conv_kw3_rows) where it beats im2col + BLAS on this project's CPU:
# long rows, few output channels (measured: 16 -> 16 channels at 256x256 2.6 ms vs 12 ms; 128 -> 128 at 32x32
# 6.8 ms vs 2.8 ms)
DIRECT_CONV_MIN_WIDTH = 96
DIRECT_CONV_MAX_OUT = 64
# Winograd F(2x2, 3x3) (numba_kernels.winograd_*) for stride-1 3x3 convolutions with an even output size: 2.25x fewer
# multiplications than either path above, as 16 BLAS products per band of tiles. Measured on one core (the medium
# VAE's layers): 128 -> 128 channels at 32x32 1.7 ms (im2col + BLAS 11 ms, torch 2.0-3.0 ms), 16 -> 16 at 256x256
# 3.1 ms (direct 9.7 ms, torch 2.9-4.6 ms); with fewer than 4 input or output channels the products are too thin
# for BLAS (3 -> 16 at 256x256: 1.7 ms, direct 1.4 ms; 4 -> 8 at 128x128 0.31 ms, direct 0.35 ms). That was with
# the bands run from Python; with one compiled call per core (``numba_kernels.winograd_bands``, numpy's BLAS being
# OpenBLAS) any channel count gains (two cores, fastest of 150: 16 -> 3 at 256x256 0.86 ms, direct 1.26 ms; at
# 48x80 0.083 ms, direct 0.126, im2col 0.35; 3 -> 16 at 48x80 0.068, direct 0.084; 2 -> 8 at 64x64 0.041, direct
# 0.049).
WINOGRAD_MIN_CHANNELS = 4
WINOGRAD_MIN_CHANNELS_COMPILED = 1
# elements of one band's transformed tiles (16 x channels x tiles), so that they stay in L2 between the transform
# and the product (measured: 64 K elements 5.6-6.9 ms, 1 M elements 6.0-8.1 ms at 128 x 128 x 64 x 64)
WINOGRAD_BAND = 1 << 16
# rows of tiles left unused between the 16 planes of a band's transformed input: a full band's plane is 16 KiB,
# so without a gap the planes the input transform writes in turn fall on the same L1 sets and 4 KiB-alias its
# loads (measured on one core: the transform's time varied up to 1.5x with the buffers' addresses, 10-40% slower)
WINOGRAD_PLANE_GAP = 1
OPENBLAS_THREADED_PRODUCT = 1 << 18  # m * n * k above which OpenBLAS runs a product on its threads


def prepare_conv2d(ctx: KernelContext) -> Bind:
    """The convolution by the fastest path for its shape: Winograd F(2x2, 3x3) (stride-1 3x3 kernels, even output
    sizes, input and output channels >= ``WINOGRAD_MIN_CHANNELS_COMPILED``, or ``WINOGRAD_MIN_CHANNELS`` where its
    bands run from Python), the direct convolution (3 wide, wide rows, few output channels), else im2col + BLAS;
    the first two are compiled (numba), im2col is their numpy fallback."""
    if len(ctx.inputs) not in (2, 3):
        ctx.fail("expects inputs (x [N, C, H, W], w [O, C, kh, kw][, bias viewed at [N, O, Ho, Wo]])")
    (nb, c, h, w_), (o, c2, kh, kw) = ctx.inputs[0].view.shape, ctx.inputs[1].view.shape
    try:
        sh, sw = conv_windows((nb, c, h, w_), (o, c2, kh, kw), ctx.node.attr("stride", 1), ctx.shape)
    except ValueError as exc:
        ctx.fail(str(exc))
    ho, wo = ctx.shape[2], ctx.shape[3]
    if (jit.AVAILABLE and sh == sw == 1 and kh == kw == 3 and ho % 2 == 0 and wo % 2 == 0
            and min(c, o) >= (WINOGRAD_MIN_CHANNELS if cblas.sgemm() is None else WINOGRAD_MIN_CHANNELS_COMPILED)
            and math.prod(ctx.shape) > 0):
        return _prepare_winograd_conv(ctx)
    if (jit.AVAILABLE and sh == sw == 1 and kw == 3 and wo >= DIRECT_CONV_MIN_WIDTH and o <= DIRECT_CONV_MAX_OUT
            and math.prod(ctx.shape) > 0):
        return _prepare_direct_conv(ctx)
    return _prepare_im2col_conv(ctx)


def _prepare_im2col_conv(ctx: KernelContext) -> Bind:
    """im2col of a tile of output rows into scratch, its channels split over the cores, then one BLAS product per
    tile into the output, the bias added to the tile while it is in cache (1x1 kernels: no copy)."""
    (nb, c, h, w_), (o, _, kh, kw) = ctx.inputs[0].view.shape, ctx.inputs[1].view.shape
    sh, sw = conv_windows((nb, c, h, w_), (o, c, kh, kw), ctx.node.attr("stride", 1), ctx.shape)
    ho, wo = ctx.shape[2], ctx.shape[3]
    x_op = operand(ctx, 0, dtype=F32)
    w_op = operand(ctx, 1, dtype=F32, shape=(o, c * kh * kw), blas=True)
    bias_op = operand(ctx, 2) if len(ctx.inputs) == 3 else None
    ckk = c * kh * kw
    pointwise = kh == kw == 1 and sh == sw == 1
    tile_rows = max(1, min(ho, CONV_TILE // max(ckk * wo, 1)))
    cols = None if pointwise else ctx.scratch.add((ckk, tile_rows * wo), F32)
    acc = None if ctx.dtype == F32 else ctx.scratch.add(ctx.shape, F32)
    ops = [x_op, w_op, bias_op]
    # products too small to cut in chunks run on one BLAS thread, as MatMul's do (``_blas_product``): a two-threaded
    # call waits for its helper thread whenever the OS has descheduled it (the tiny VAE's last layer, 3 x 144 x
    # 3840: 0.3-0.4 ms on one thread; on two, median 8 ms with other jobs running)
    macs = o * ckk * (h * w_ if pointwise else tile_rows * wo)
    one_thread = cpu_threads.THREADS > 1 and macs < 2 * matmul.BLAS_PART_MACS

    def bind(out, flats, scratch):
        x, w2, bias = bind_all(ops, flats, scratch)
        target = out if acc is None else scratch[acc]
        calls = []
        for i in range(nb):
            o2 = target[i].reshape(o, ho * wo)
            b2 = None if bias is None else view_reshape(bias[i], (o, ho * wo))
            xi = x[i]
            flat_x = view_reshape(xi, (c, h * w_)) if pointwise else None
            if flat_x is not None:
                calls.append(((), w2, flat_x, o2, b2, None))
            sc, sy, sx = xi.strides
            for r0 in range(0, ho, tile_rows) if flat_x is None else ():
                r = min(tile_rows, ho - r0)
                window = alias(
                    xi[:, r0 * sh :, :], (c, kh, kw, r, wo), (sc, sy, sx, sy * sh, sx * sw), writeable=False)
                buf = scratch[cols][:, : r * wo]
                dst5 = buf.reshape(window.shape)
                copies = cpu_threads.parallel([
                    (lambda d=dst5[part], s=window[part]: np.copyto(d, s))
                    for part in cpu_threads.split(c, kh * kw * r * wo)])
                cols_slice = slice(r0 * wo, (r0 + r) * wo)
                tile_bias = None if b2 is None else b2[:, cols_slice]
                calls.append(((copies,), w2, buf, o2[:, cols_slice], tile_bias, None))
            if bias is not None and b2 is None:  # a bias view that is not a per-tile slice: added at the end
                calls.append(((), None, None, target[i], None, bias[i]))

        def body():
            for copies, wm, buf, dst, tile_bias, whole_bias in calls:
                for copy in copies:
                    copy()
                if wm is not None:
                    np.matmul(wm, buf, out=dst)
                if tile_bias is not None:
                    np.add(dst, tile_bias, out=dst, dtype=F32)
                if whole_bias is not None:
                    np.add(dst, whole_bias, out=dst, dtype=F32)
            if acc is not None:
                np.copyto(out, target, casting="unsafe")

        def single_threaded():
            with cpu_threads.blas_single_threaded():
                body()

        return with_refresh(ops, single_threaded if one_thread else body)

    return bind


def _prepare_direct_conv(ctx: KernelContext) -> Bind:
    """numba_kernels.conv_kw3_rows on each image, its output rows split over the cores; the weight reordered to
    [C, kh, 3, O4] and a per-channel bias gathered into scratch at every run (a few kB: weights may stream),
    zero-padded to O4, the output channels rounded up to a multiple of 4 (the kernel's block)."""
    (nb, c, _, _), (o, _, kh, kw) = ctx.inputs[0].view.shape, ctx.inputs[1].view.shape
    ho, wo = ctx.shape[2], ctx.shape[3]
    x_op = operand(ctx, 0, dtype=F32)
    w_op = operand(ctx, 1, dtype=F32)
    bias_op = operand(ctx, 2) if len(ctx.inputs) == 3 else None  # read in place, any float type
    o4 = -(-o // 4) * 4
    wr = ctx.scratch.add((c, kh, kw, o4), F32)
    bias_vec = ctx.scratch.add((o4,), F32)
    acc_out = None if ctx.dtype == F32 else ctx.scratch.add(ctx.shape, F32)
    ops = [x_op, w_op, bias_op]

    def bind(out, flats, scratch):
        x, w, bias = bind_all(ops, flats, scratch)
        target = out if acc_out is None else scratch[acc_out]
        w_r, b_v = scratch[wr], scratch[bias_vec]
        kernel = jit.kernels("image").conv_kw3_rows
        per_channel = _per_channel_bias(bias)  # one value per output channel: it goes into the sums' start
        steps = []
        for i in range(nb):
            parts = [lambda i=i, rows=rows: kernel(x[i], w_r, b_v, target[i], rows.start, rows.stop)
                     for rows in cpu_threads.split(ho, o * wo * c * kh * kw)]
            steps.append(cpu_threads.parallel(parts))

        def body():
            np.copyto(w_r[..., :o], w.transpose(1, 2, 3, 0))
            w_r[..., o:] = 0
            _bias_vector(b_v, bias, per_channel)
            for step in steps:
                step()
            _conv_epilogue(out, target, bias, per_channel)

        return with_refresh(ops, body)

    return bind


def _per_channel_bias(bias: np.ndarray | None) -> bool:
    """A bias viewed at [N, O, Ho, Wo] that is one value per output channel (the usual [O] broadcast)."""
    return bias is not None and all(bias.strides[axis] == 0 or bias.shape[axis] == 1 for axis in (0, 2, 3))


def _bias_vector(b_v: np.ndarray, bias: np.ndarray | None, per_channel: bool) -> None:
    """The compiled paths' per-channel start values (zero past the bias's channels, or everywhere without one)."""
    b_v.fill(0)
    if per_channel:
        np.copyto(b_v[: bias.shape[1]], bias[0, :, 0, 0], casting="unsafe")


def _conv_epilogue(out: np.ndarray, target: np.ndarray, bias: np.ndarray | None, per_channel: bool) -> None:
    """A bias that varies over the image added whole; the f32 result cast into a lower-precision output."""
    if bias is not None and not per_channel:
        np.add(target, bias, out=target, dtype=F32)
    if target is not out:
        np.copyto(out, target, casting="unsafe")


def _prepare_winograd_conv(ctx: KernelContext) -> Bind:
    """Winograd F(2x2, 3x3) (numba_kernels.winograd_*): the images' 2x2 output tiles cut into bands of tile rows
    (``WINOGRAD_BAND``), which the cores take in turn (a core the OS gives less time simply does fewer bands;
    fixed halves left the other core waiting), each core with its own scratch: the input transform into ``v [16,
    C, tiles]`` (planes ``WINOGRAD_PLANE_GAP`` rows apart), 16 BLAS products ``[O, C] @ [C, tiles]``
    (single-threaded inside) into ``m [16, O, tiles]``, the output transform into the output rows, a per-channel
    bias added there. Where numpy's BLAS is OpenBLAS (``cblas.sgemm``) each core's share is one compiled call
    (``numba_kernels.winograd_bands``: tasks from an atomic counter, the weight transform in chunks among them, the
    products as direct ``cblas_sgemm`` calls); else the bands run from Python (``cpu_threads.claimed``). An f32
    input zero-padded on its rows and columns is read in place, the padding made by the input transform; any other
    input view is first gathered into scratch. The weight transform ``u [16, O, C]`` and the bias vector are made
    in scratch at every run (weights may stream)."""
    (nb, c, _, _), (o, _, _, _) = ctx.inputs[0].view.shape, ctx.inputs[1].view.shape
    th, tw = ctx.shape[2] // 2, ctx.shape[3] // 2
    x_in = ctx.inputs[0]
    padded = zero_padded(x_in.view, x_in.size, (2, 3)) if np.dtype(x_in.dtype) == F32 else None
    if padded is not None and padded[0].strides[3] != 1:
        padded = None  # the input transform reads rows with unit stride in place; others are gathered first
    x_op = operand(ctx, 0, dtype=F32) if padded is None else None
    (top, left) = (0, 0) if padded is None else padded[1]
    w_op = operand(ctx, 1, dtype=F32)
    bias_op = operand(ctx, 2) if len(ctx.inputs) == 3 else None  # read in place, any float type
    band = max(1, min(th, WINOGRAD_BAND // (16 * max(c, o) * tw)))
    bands = [(i, t0, min(t0 + band, th)) for i in range(nb) for t0 in range(0, th, band)]
    slots = min(len(bands), len(cpu_threads.split(nb * th, 16 * (c + o) * tw)))
    u_slot, bias_vec = ctx.scratch.add((16, o, c), F32), ctx.scratch.add((o,), F32)
    tiles = [(ctx.scratch.add((16, c + WINOGRAD_PLANE_GAP, band * tw), F32), ctx.scratch.add((16, o, band * tw), F32))
             for _ in range(slots)]
    acc_out = None if ctx.dtype == F32 else ctx.scratch.add(ctx.shape, F32)
    ops = [x_op, w_op, bias_op]
    # BLAS on one thread inside the parts, and for one part whose products OpenBLAS would thread (above its
    # m * n * k threshold, 2^18 by default): a two-threaded call waits for its descheduled helper thread
    one_blas_thread = slots > 1 or o * c * band * tw > OPENBLAS_THREADED_PRODUCT

    def bind(out, flats, scratch):
        x, w, bias = bind_all(ops, flats, scratch)
        if padded is not None:
            x = strided(flats[0], padded[0])
        target = out if acc_out is None else scratch[acc_out]
        u, b_v = scratch[u_slot], scratch[bias_vec]
        k = jit.kernels("image")
        per_channel = _per_channel_bias(bias)
        images, outputs = [x[i] for i in range(nb)], [target[i] for i in range(nb)]
        # per slot: its transform buffers, and the products' operands for each band height (made here, once)
        work = [(scratch[vs], scratch[ms], {r: (scratch[vs][:, :c, : r * tw], scratch[ms][:, :, : r * tw])
                                            for r in {t1 - t0 for _, t0, t1 in bands}}) for vs, ms in tiles]

        blas = cblas.sgemm()
        if blas is not None:  # one compiled call per core takes the weight chunks and bands in turn
            table = np.array(bands, np.int64).reshape(-1, 3)
            counter = np.zeros(1 + -(-o // k.WEIGHT_CHUNK), np.int64)  # next task, then a flag per chunk
            w_strides = np.array([stride // 4 for stride in w.strides], np.int64)
            parts = [functools.partial(k.winograd_bands, x, w.ctypes.data, w_strides, u, b_v, target, v, m, table,
                                       counter, tw, top, left, *blas) for v, m, _ in work]

            def step():
                counter[:] = 0
                cpu_threads.run_parts(parts)
        else:
            def task(slot: int, j: int) -> None:
                i, t0, t1 = bands[j]
                v, m, products = work[slot]
                v_band, m_band = products[t1 - t0]  # the band's first tiles
                k.winograd_input(images[i], v, t0, t1, tw, top, left)
                np.matmul(u, v_band, out=m_band)
                k.winograd_output(m, b_v, outputs[i], t0, t1, tw)

            step = cpu_threads.claimed(len(bands), slots, task)

        def body():
            if blas is None:
                k.winograd_weights(w, u)
            _bias_vector(b_v, bias, per_channel)
            with cpu_threads.blas_single_threaded() if one_blas_thread else contextlib.nullcontext():
                step()
            _conv_epilogue(out, target, bias, per_channel)

        return with_refresh(ops, body)

    return bind

